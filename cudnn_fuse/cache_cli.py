"""``cudnn-fuse cache {ls,stats,verify,prune,clear,export,import}``: the plan cache from a shell.

cli.py wires it in::

    add_cache_commands(subparsers)   # adds "cache" with run=run_cache_command
    ...
    return args.run(args)

Exit status: 0 on success; 1 when the cache cannot be used or read, an action fails, ``verify`` leaves
bad entries behind (read-only cache) or ``import`` rejects or fails entries.
"""

from __future__ import annotations

import argparse
import datetime
import decimal
import logging
import os
import re
import sys

from .cache import CacheError, PlanCache, default_cache_dir, list_namespaces
from .progress import format_table, human_bytes

_SIZE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def add_cache_commands(subparsers) -> argparse.ArgumentParser:
    """Add the ``cache`` command and its actions to an argparse subparsers object."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dir", help="cache root (default: $CUDNN_FUSE_CACHE_DIR or the user "
                                      "cache dir)")
    common.add_argument("--namespace", help="environment namespace (default: this machine's, "
                                            "see `cudnn-fuse doctor`)")
    cache = subparsers.add_parser("cache", help="inspect and maintain the on-disk plan cache")
    actions = cache.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    actions.add_parser("ls", parents=[common], help="list the cached plans")
    actions.add_parser("stats", parents=[common], help="entries, bytes, hit rate")
    actions.add_parser("verify", parents=[common],
                       help="re-check every checksum; remove bad entries and orphan files")
    prune = actions.add_parser("prune", parents=[common],
                               help="remove old or least recently used entries")
    prune.add_argument("--max-bytes", type=parse_size, metavar="SIZE",
                       help="keep at most SIZE bytes (e.g. 512M; default: the size limit)")
    prune.add_argument("--older-than", type=parse_duration, metavar="AGE",
                       help="remove entries unused for AGE (e.g. 30d, 12h, 3600)")
    prune.add_argument("--include-pinned", action="store_true",
                       help="pre-warmed (pinned) entries may go too")
    actions.add_parser("clear", parents=[common], help="remove every entry, pinned ones too")
    export = actions.add_parser("export", parents=[common],
                                help="write every valid entry to one portable file")
    export.add_argument("file", help="output file (JSON lines)")
    imp = actions.add_parser("import", parents=[common],
                             help="add the entries of an exported file, verifying each")
    imp.add_argument("file", help="a file written by `cache export`")
    imp.add_argument("--force", action="store_true",
                     help="import even if the file comes from another environment namespace")
    cache.set_defaults(run=run_cache_command)
    return cache


def run_cache_command(args: argparse.Namespace) -> int:
    """Run one ``cache`` action; returns the exit status."""
    handler = _show_warnings()
    cache = None
    try:
        if args.dir is not None and not args.dir.strip():
            print("error: --dir is empty (give a directory, or leave --dir out for the default)", file=sys.stderr)
            return 2
        if args.namespace is not None and args.cache_command in ("verify", "prune", "clear"):
            # these open the cache for writing, so a typo created (and stats then listed) that namespace;
            # ls, stats and export read an absent one as empty, and import may fill a new one
            there = list_namespaces(args.dir)
            if args.namespace not in there:
                print(f"error: no namespace {args.namespace!r} under {args.dir or default_cache_dir()} "
                      f"(namespaces there: {', '.join(there) or 'none'})", file=sys.stderr)
                return 1
        read_only = True if args.cache_command in ("ls", "stats", "export") else None
        cache = PlanCache(args.dir, namespace=args.namespace, read_only=read_only)
        if cache.disabled is not None:
            said = handler is not None and any(cache.disabled in m for m in handler.said)
            print("error: the plan cache is disabled" + (" (the warning above says why)" if said
                                                         else f": {cache.disabled}"), file=sys.stderr)
            return 1
        return _ACTIONS[args.cache_command](cache, args)
    except (CacheError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if cache is not None:
            cache.close()
        if handler is not None:
            logging.getLogger("cudnn_fuse").removeHandler(handler)


class _SayingHandler(logging.StreamHandler):
    """A stderr handler that remembers what it printed (an error need not repeat a warning's reason)."""

    def __init__(self, stream):
        super().__init__(stream)
        self.said: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        self.said.append(record.getMessage())


def _show_warnings() -> "_SayingHandler | None":
    """Print the cache's warnings to stderr unless the application configured logging."""
    logger = logging.getLogger("cudnn_fuse")
    configured = logging.getLogger().handlers or [
        h for h in logger.handlers if not isinstance(h, logging.NullHandler)]
    if configured:
        return None
    handler = _SayingHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("warning: %(message)s"))
    logger.addHandler(handler)
    return handler


def _ls(cache: PlanCache, args) -> int:
    infos = list(cache.entry_info())
    if not infos:
        print(f"no plans cached in {cache.dir}")
        return 0
    rows = [(info.key[:12], _op(info.meta), _engine(info.meta),
             _maybe_bytes(_first(info.meta, "workspace_bytes", "workspace")),
             human_bytes(info.size), "yes" if info.pinned else "", _when(info.meta, info))
            for info in infos]
    print(format_table(("key", "op", "engine", "workspace", "size", "pinned", "tuned_at"), rows))
    total = sum(info.size for info in infos)
    print(f"\n{_count(len(infos), 'plan')}, {human_bytes(total)} in {cache.dir}")
    return 0


def _stats(cache: PlanCache, args) -> int:
    s = cache.stats()
    rate = "-" if s["hit_rate"] is None else f"{100 * s['hit_rate']:.1f}%"
    rows = [
        ("directory", s["dir"]),
        ("namespace", s["namespace"]),
        ("entries", f"{s['entries']} ({s['pinned']} pinned)"),
        ("bytes", f"{human_bytes(s['bytes'])} of {human_bytes(s['size_limit'])}"),
        ("hits", s["hits"]),
        ("misses", s["misses"]),
        ("hit rate", rate),
    ]
    others = [ns for ns in list_namespaces(cache.path) if ns != cache.namespace]
    if others:
        rows.append(("other namespaces", ", ".join(others)))
    if s.get("error"):
        rows.append(("error", s["error"]))
    print(format_table(("item", "value"), rows))
    return 1 if s.get("error") else 0  # cache.db could not be read: the counts above are not its own


def _verify(cache: PlanCache, args) -> int:
    c = cache.verify()
    print(f"checked {_count(c['checked'], 'entry')}: {c['ok']} ok, {c['bad']} bad, "
          f"{c['removed']} removed")
    print(f"orphan value files: {c['orphans']}, {c['orphans_removed']} removed "
          "(younger ones may belong to a running writer)")
    barred, pinned = _barred_keys(cache)
    dropped = 0 if cache.read_only else sum(bool(cache.delete(k)) for k in barred)
    if barred or pinned:
        n = len(barred) + len(pinned)
        print(f"{_count(n, 'entry')} {'names' if n == 1 else 'name'} an engine that computes "
              f"{'its' if n == 1 else 'their'} graph wrongly "
              f"(plans.barred_engines): {dropped} removed, {len(pinned)} pinned left for a process to rebuild in place")
    if c["bad"] > c["removed"] or len(barred) > dropped:
        print("the cache is read-only: bad entries were left in place", file=sys.stderr)
        return 1
    return 0


def _barred_keys(cache: PlanCache) -> tuple:
    """(unpinned keys, pinned keys) of the entries whose recorded engine is barred for their
    spec, with their engine records (which hold no spec of their own). A pinned (pre-warmed)
    entry is not removed: the loader refuses it and rebuilds it in place, still pinned."""
    from .loader import engine_record_key
    from .plans import barred_engines
    from .spec import spec_from_dict

    out, pinned = [], []
    infos = list(cache.entry_info())
    keys = {info.key for info in infos}
    for info in infos:
        eid, spec = info.meta.get("engine_id"), info.meta.get("spec")
        if eid is None or not isinstance(spec, dict):
            continue
        try:
            if int(eid) not in barred_engines(spec_from_dict(dict(spec))):
                continue
        except (TypeError, ValueError, KeyError, OverflowError):  # OverflowError: an engine id of Infinity
            continue  # a spec or engine id this version cannot read: not ours to judge
        into = pinned if info.pinned else out
        into.append(info.key)
        if engine_record_key(info.key) in keys:
            into.append(engine_record_key(info.key))
    return out, pinned


def _prune(cache: PlanCache, args) -> int:
    removed = cache.prune(max_bytes=args.max_bytes, older_than_s=args.older_than,
                          include_pinned=args.include_pinned)
    print(f"removed {_count(removed, 'entry')}; {human_bytes(cache.stats()['bytes'])} left")
    return 0


def _clear(cache: PlanCache, args) -> int:
    print(f"removed {_count(cache.clear(), 'entry')} from {cache.dir}")
    return 0


def _export(cache: PlanCache, args) -> int:
    n = cache.export(args.file)
    # into a pipe (/dev/stdout | ssh host cudnn-fuse cache import /dev/stdin) the export goes alone
    out = sys.stdout if os.path.isfile(args.file) else sys.stderr
    print(f"exported {_count(n, 'entry')} of namespace {cache.namespace} to {args.file}", file=out)
    return 0


def _import(cache: PlanCache, args) -> int:
    c = cache.import_(args.file, force=args.force)
    print(f"imported {c['imported']}, skipped {c['skipped']} (already cached), rejected "
          f"{c['rejected']} (failed verification), failed {c['failed']} (not written)")
    return 1 if c["rejected"] or c["failed"] else 0


_ACTIONS = {"ls": _ls, "stats": _stats, "verify": _verify, "prune": _prune, "clear": _clear,
            "export": _export, "import": _import}


# ---------------------------------------------------------------- formatting


def parse_size(text: str) -> int:
    """ "512M" -> 536870912; plain numbers are bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1048576, 512M, 2G)")
    return int(decimal.Decimal(m.group(1)) * _SIZE_UNITS[m.group(2)])  # a float would overflow past 1e308


def parse_duration(text: str) -> float:
    """ "30d" -> 2592000.0; plain numbers are seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 3600, 12h, 30d)")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def _count(n: int, noun: str) -> str:
    plural = noun[:-1] + "ies" if noun.endswith("y") else noun + "s"
    return f"{n} {noun if n == 1 else plural}"


def _first(meta: dict, *names):
    for name in names:
        if meta.get(name) is not None:
            return meta[name]
    return None


def _op(meta: dict) -> str:
    spec = meta.get("spec")
    op = _first(meta, "op") or (spec.get("op") if isinstance(spec, dict) else None)
    return str(op) if op is not None else "?"


def _engine(meta: dict) -> str:
    """The engine an entry names; a tuned entry that runs torch's implementation or a 1x1 conv's
    GEMM instead says so, with the cuDNN plan it keeps as its blob in brackets."""
    engine = _first(meta, "engine", "engine_id", "engine_name")
    if isinstance(engine, dict):
        engine = _first(engine, "name", "id", "engine_id")
    name = str(engine) if engine is not None else "?"
    if meta.get("use_gemm"):
        return f"gemm (conv {name})"
    if meta.get("use_torch"):
        return f"torch (cuDNN {name})"
    return name


def _maybe_bytes(value) -> str:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 2**63  # NaN fails too
    return human_bytes(value) if ok else "?"


def _when(meta: dict, info) -> str:
    tuned = meta.get("tuned_at")
    stamp = tuned if isinstance(tuned, (int, float)) else (None if tuned else info.stored_at)
    if stamp is None:
        return str(tuned)
    try:
        return datetime.datetime.fromtimestamp(stamp).strftime("%Y-%m-%d %H:%M:%S")
    except (ValueError, OverflowError, OSError):  # NaN, or past the platform's dates: one row says so
        return str(stamp)
