"""Plans built in a process of their own, off the caller's hot path.

cudnn-frontend 1.32 holds the GIL through its heuristics query and ``build_plans``, so a thread building a
plan would stall the caller's Python thread for as long as the build takes (0.2-1.9 s for a block's plans,
docs/dynamic_shapes.md). A build process does not: it builds from the spec with its own CUDA context and
handle and stores the plan in the plan cache on disk, where the caller loads it (a deserialization) once the
process has answered that it is there.

One build process per process, started at the first request (``python -m cudnn_fuse.build_child``). Requests
go to its stdin as JSON lines, written by a thread of their own so that a full pipe never blocks the caller;
it answers one JSON line per request on its stdout, read by another thread. A process that cannot start,
dies, or stores its plans where this process does not look turns the build process off for this process
(logged once): its requests answer "failed", and the caller builds as it would without one.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time

from . import envvars

log = logging.getLogger(__name__)

CHILD_MODULE = "cudnn_fuse.build_child"
STDERR_LINES = 20  # the build process's last stderr lines, logged when it dies


class Request:
    """One plan asked of the build process. ``status`` is None while it builds, then "ok" (the plan is in
    the plan cache), "declined" (cuDNN has no engine for it; ``reason`` says why) or "failed"."""

    __slots__ = ("status", "reason")

    def __init__(self):
        self.status = None
        self.reason = ""

    def _answer(self, status: str, reason: str = "") -> None:
        self.reason = reason
        self.status = status  # last: a reader seeing the status sees its reason


class BuildProcess:
    """The build process of this process, started at the first ``submit``. ``argv`` replaces the command
    that starts it (tests)."""

    def __init__(self, argv=None):
        self._argv = list(argv) if argv is not None else [sys.executable, "-m", CHILD_MODULE]
        self._lock = threading.Lock()
        self._proc = None
        self._outbox: queue.Queue = queue.Queue()
        self._pending: dict = {}  # request id -> (Request, namespace the caller reads)
        self._by_key: dict = {}  # (digest, device, cache dir) -> Request: each plan asked once
        self._ids = itertools.count()
        self._stderr = collections.deque(maxlen=STDERR_LINES)
        self.off = None  # why it serves no more requests, once it does not

    def submit(self, spec_dict: dict, digest: str, device: int, cache_path: str, namespace: str):
        """A Request for the plan of ``spec_dict`` on ``device``, stored in the plan cache at ``cache_path``
        (the caller's, whose namespace is ``namespace``); the same Request for a plan asked before; None
        when the build process is off. Never blocks on the process."""
        key = (digest, device, cache_path)
        with self._lock:
            req = self._by_key.get(key)
            if req is not None and req.status != "failed":
                return req
            if self.off is not None or (self._proc is None and not self._start()):
                return None
            rid = next(self._ids)
            req = self._by_key[key] = Request()
            self._pending[rid] = (req, namespace)
        self._outbox.put(json.dumps({"id": rid, "spec": spec_dict, "device": device, "cache_dir": cache_path}))
        return req

    def pending(self) -> int:
        """Requests not answered yet."""
        with self._lock:
            return len(self._pending)

    def wait(self, timeout: float) -> bool:
        """Block until every request is answered, at most ``timeout`` s; whether they all were."""
        deadline = time.monotonic() + timeout
        while self.pending():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        """Stop the process: its stdin closes, it exits after the build in hand."""
        with self._lock:
            proc, self._proc = self._proc, None
            if self.off is None:
                self.off = "closed"
        if proc is not None:
            self._outbox.put(None)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
            except Exception:  # noqa: BLE001 - at exit, whatever is left of it goes
                pass
        self._fail_pending("the build process was closed")

    # ------------------------------------------------------------------ internals (under self._lock)

    def _start(self) -> bool:
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        env[envvars.BUILD_PROCESS] = "0"  # its own new sizes are built where they are met
        env[envvars.AUTOTUNE] = "0"  # it builds what a stand-in waits for: heuristic plans
        try:
            self._proc = subprocess.Popen(self._argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, env=env, text=True, bufsize=1,
                                          close_fds=True, start_new_session=True)
        except OSError as exc:
            self._turn_off(f"it could not start ({exc})")
            return False
        proc = self._proc
        for target in (self._write, self._read, self._drain_stderr):
            threading.Thread(target=target, args=(proc,), name=f"cudnn_fuse-build-{target.__name__[1:]}",
                             daemon=True).start()
        log.debug("cudnn_fuse: build process %d started", proc.pid)
        return True

    def _turn_off(self, why: str) -> None:
        if self.off is None:
            self.off = why
            log.warning("cudnn_fuse: plans of new sizes are built in the calling process from now on: the build "
                        "process %s", why)

    def _fail_pending(self, why: str) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for req, _ns in pending.values():
            req._answer("failed", why)

    # ------------------------------------------------------------------ threads

    def _write(self, proc) -> None:
        while True:
            line = self._outbox.get()
            if line is None or proc.poll() is not None:
                break
            try:
                proc.stdin.write(line + "\n")
                proc.stdin.flush()
            except (OSError, ValueError):
                break  # it died: the reader says so
        try:
            proc.stdin.close()
        except (OSError, ValueError):
            pass

    def _read(self, proc) -> None:
        for line in proc.stdout:
            try:
                reply = json.loads(line)
                rid = reply["id"]
            except (ValueError, KeyError, TypeError):
                log.debug("cudnn_fuse: build process said %r", line[:200])
                continue
            with self._lock:
                req, namespace = self._pending.pop(rid, (None, None))
            if req is None:
                continue
            status = reply.get("status")
            if status == "ok" and reply.get("namespace") != namespace:
                with self._lock:
                    self._turn_off(f"stores its plans in namespace {reply.get('namespace')!r}, not this "
                                   f"process's {namespace!r}")
                status, reply["reason"] = "failed", "stored in another namespace"
            req._answer(status if status in ("ok", "declined") else "failed", str(reply.get("reason", ""))[:300])
        code = proc.wait()
        with self._lock:
            if self._proc is proc:
                self._proc = None
                tail = " | ".join(self._stderr)
                self._turn_off(f"exited with code {code}" + (f": {tail[-600:]}" if tail else ""))
        self._fail_pending(f"the build process exited with code {code}")

    def _drain_stderr(self, proc) -> None:
        for line in proc.stderr:
            line = line.rstrip()
            if line:
                self._stderr.append(line)
                log.debug("cudnn_fuse build process: %s", line)


_default = None
_default_lock = threading.Lock()


def default():
    """This process's BuildProcess, or None where $CUDNN_FUSE_BUILD_PROCESS=0."""
    global _default
    if not envvars.flag(envvars.BUILD_PROCESS, True):
        return None
    with _default_lock:
        if _default is None:
            _default = BuildProcess()
        return _default


def _close_at_exit() -> None:
    if _default is not None:
        _default.close()


def _after_fork_in_child() -> None:
    global _default, _default_lock
    _default, _default_lock = None, threading.Lock()  # the parent's process and threads are not this one's


atexit.register(_close_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
