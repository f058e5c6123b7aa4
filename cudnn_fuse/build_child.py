"""The build process (build_process.py): builds the plans its parent asks for into the plan cache.

Reads one JSON request a line on stdin ({"id", "spec", "device", "cache_dir"}), builds or loads the spec's
plan through the loader, as the parent would (heuristics, the check against torch's kernels, the stored
entry), and answers one JSON line per request: {"id", "status": "ok" | "declined" | "failed", "reason",
"namespace"}. Its answers go to the stdout it was started with; anything else written to stdout (a library's
own output) goes to stderr, so it cannot break a reply. Exits when stdin closes.
"""

from __future__ import annotations

import json
import logging
import os
import sys

log = logging.getLogger(__name__)


def serve(requests, reply) -> None:
    """Answer every request read from ``requests`` (lines) on ``reply`` (a text stream)."""
    from . import envvars, loader
    from .errors import UnsupportedError
    from .spec import spec_from_dict

    for line in requests:
        try:
            req = json.loads(line)
            rid = req["id"]
        except (ValueError, KeyError, TypeError):
            continue
        out = {"id": rid, "status": "failed", "reason": "", "namespace": None}
        try:
            os.environ[envvars.CACHE_DIR] = req["cache_dir"]  # the parent's cache, wherever it moved since
            spec, device = spec_from_dict(req["spec"]), int(req["device"])
            pc = loader._cache(device)
            out["namespace"] = getattr(pc, "namespace", None)
            if pc is None or pc.read_only:
                out["reason"] = "no writable plan cache here"
            else:
                loader.load_or_build(spec, device)
                out["status"] = "ok"
        except UnsupportedError as exc:
            out.update(status="declined", reason=str(exc)[:300])
        except Exception as exc:  # noqa: BLE001 - one bad request fails alone, the process serves the next
            out["reason"] = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            loader.clear()  # the plan is on disk: nothing here runs it
        reply.write(json.dumps(out) + "\n")
        reply.flush()


def main() -> int:
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stdout is the replies' alone
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    serve(sys.stdin, reply)
    return 0


if __name__ == "__main__":
    sys.exit(main())
