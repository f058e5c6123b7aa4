"""Persistent plan cache: verified entries in a diskcache store, one directory per environment.

A cached plan is bytes that the caller hands to native code (``graph.deserialize``), kept on a
disk shared by several processes. So every entry carries a sha256 and is verified on every
read, nothing is ever unpickled, files are private to the user, and any fault (a truncated
file, a flipped bit, a locked or corrupt database, a full disk, a read-only directory) becomes a
miss or a refused write with one warning naming it, never an exception from ``get``/``put``.
docs/cache.md has the entry format, the directory layout and the fault table.

The cache never calls cuDNN: it stores opaque bytes plus JSON metadata, and ``plans.py``
deserializes them.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import dataclasses
import errno
import hashlib
import io
import json
import logging
import math
import os
import re
import socket
import sqlite3
import stat
import struct
import threading
import time
import weakref
from pathlib import Path
from typing import Iterator, NamedTuple

import diskcache
from diskcache.core import MODE_BINARY, MODE_RAW, UNKNOWN

from . import envvars

log = logging.getLogger(__name__)

__all__ = [
    "CacheEntry", "CacheError", "CorruptEntry", "EntryInfo", "PlanCache", "RawDisk",
    "decode_entry", "default_cache_dir", "encode_entry", "list_namespaces", "open_default_cache",
]

MAGIC = b"CFPLAN"
FORMAT_VERSION = 1
EXPORT_FORMAT = "cudnn_fuse-plan-cache-export"
EXPORT_VERSION = 1
DB_NAME = "cache.db"
FINGERPRINT_NAME = "fingerprint.json"
INLINE_MAX = 2**15          # entries smaller than this live inside cache.db (diskcache's default)
ACCESS_FLUSH_S = 1.0         # hits' access times reach cache.db at most this late (or at exit)
ORPHAN_GRACE_S = 60.0       # verify() leaves younger orphan files: a live writer may own them
LOCK_BACKOFF_TIMEOUTS = 10  # after a lock timeout, writes are skipped for this many timeouts

# magic, format version, key length, meta length, blob length, sha256(key + meta + blob)
_HEADER = struct.Struct(">6sHHIQ32s")
_KEY_RE = re.compile(r"[0-9a-f]{1,128}\Z")
_NAMESPACE_RE = re.compile(r"[0-9A-Za-z_][0-9A-Za-z_.-]{0,63}\Z")
_VALUE_FILE_RE = re.compile(r"[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{28}\.val\Z")
_HEX2_RE = re.compile(r"[0-9a-f]{2}\Z")
_PINNED = 1  # the diskcache `tag` column holds 1 for pinned entries, NULL otherwise
# An entry's size without reading it: inline values by SQL length(), files by diskcache's size.
_SIZE_SQL = "CASE WHEN filename IS NULL THEN length(value) ELSE size END"
_FULL_ERRNOS = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}


# ---------------------------------------------------------------- entries


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """A verified cache entry: the plan's key, its JSON metadata and the serialized plan."""

    key: str    # hex digest (spec.digest())
    meta: dict  # spec, engine id + knobs, candidates' timings, workspace bytes, tuned_at, host, ...
    blob: bytes  # serialized plan, returned exactly as stored


class EntryInfo(NamedTuple):
    """One row of ``PlanCache.entry_info()``: what ``cache ls`` shows, read without the blob."""

    key: str
    meta: dict
    size: int          # bytes of the whole entry (header + key + meta + blob)
    pinned: bool
    stored_at: float   # time.time() of the write
    accessed_at: float  # time.time() of the last hit (or the write)


class CorruptEntry(ValueError):
    """Entry bytes that fail verification; ``kind`` names the fault (``checksum``, ...)."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


class UnsafeRow(ValueError):
    """A cache.db row that is not a raw-bytes entry of ours (a pickle, text, a foreign path)."""


class CacheError(RuntimeError):
    """A maintenance operation (verify, prune, clear, export, import_) could not run."""


def encode_entry(key: str, meta: dict, blob) -> bytes:
    """Entry bytes: header + key + meta JSON + blob (layout in docs/cache.md).

    Raises TypeError/ValueError for a key, meta or blob that no cache could store.
    """
    _check_key(key)
    blob = _as_bytes(blob)
    if not isinstance(meta, dict):
        raise TypeError(f"meta must be a dict, got {type(meta).__name__}")
    meta_bytes = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    key_bytes = key.encode("ascii")
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, len(key_bytes), len(meta_bytes), len(blob),
                          _digest(key_bytes, meta_bytes, blob))
    return b"".join((header, key_bytes, meta_bytes, blob))


def decode_entry(key: str, data) -> CacheEntry:
    """Verify entry bytes against ``key`` and split them; raises CorruptEntry on any mismatch."""
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise CorruptEntry("key-mismatch", f"{key!r:.40} is not a plan key")
    view = memoryview(data)
    if len(view) < _HEADER.size:
        raise CorruptEntry("truncated", f"{len(view)} bytes, shorter than the header")
    magic, version, key_len, meta_len, blob_len, digest = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise CorruptEntry("header", f"bad magic {bytes(magic)!r}")
    if version != FORMAT_VERSION:
        raise CorruptEntry("header", f"format version {version}, expected {FORMAT_VERSION}")
    expected = _HEADER.size + key_len + meta_len + blob_len
    if len(view) != expected:
        kind = "truncated" if len(view) < expected else "oversized"
        raise CorruptEntry(kind, f"{len(view)} bytes, the header says {expected}")
    key_end = _HEADER.size + key_len
    meta_end = key_end + meta_len
    key_bytes, meta_bytes = view[_HEADER.size:key_end], view[key_end:meta_end]
    blob = view[meta_end:]
    if _digest(key_bytes, meta_bytes, blob) != digest:
        raise CorruptEntry("checksum", "sha256 mismatch")
    if bytes(key_bytes) != key.encode("ascii"):
        raise CorruptEntry("key-mismatch", f"entry is for key {bytes(key_bytes)[:16]!r}...")
    try:
        meta = json.loads(bytes(meta_bytes))
    except ValueError as exc:  # a checksummed entry with bad JSON was written by a buggy writer
        raise CorruptEntry("meta", f"metadata is not JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise CorruptEntry("meta", f"metadata is a {type(meta).__name__}, not an object")
    return CacheEntry(key, meta, bytes(blob))


def _parse_meta_prefix(prefix: bytes) -> dict | None:
    """The meta dict from the first bytes of an entry (header + key + meta), unverified."""
    if len(prefix) < _HEADER.size:
        return None
    magic, version, key_len, meta_len, _, _ = _HEADER.unpack_from(prefix)
    start = _HEADER.size + key_len
    if magic != MAGIC or version != FORMAT_VERSION or len(prefix) < start + meta_len:
        return None
    try:
        meta = json.loads(prefix[start:start + meta_len])
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


def _meta_prefix_len(header: bytes) -> int | None:
    if len(header) < _HEADER.size:
        return None
    magic, _, key_len, meta_len, _, _ = _HEADER.unpack_from(header)
    return _HEADER.size + key_len + meta_len if magic == MAGIC else None


def _digest(*parts) -> bytes:
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.digest()


def _check_key(key) -> None:
    if not isinstance(key, str):
        raise TypeError(f"plan cache keys are hex strings (spec.digest()), "
                        f"got {type(key).__name__}")
    if not _KEY_RE.match(key):
        raise ValueError(f"plan cache key must be 1-128 lowercase hex characters, got {key!r}")


def _as_bytes(blob) -> bytes:
    if isinstance(blob, bytes):
        return blob
    if isinstance(blob, (bytearray, memoryview)):
        return bytes(blob)
    raise TypeError(f"blob must be bytes, got {type(blob).__name__}")


def _check_flag(name: str, value) -> None:
    """A bool argument's value, refused otherwise (a string such as "no" would be true)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")


# ---------------------------------------------------------------- files and directories


def _make_private_dirs(path: Path) -> None:
    """mkdir -p with 0700 for every directory made here, whatever the umask."""
    missing = []
    p = path
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:  # another process made it; it chmods its own
            continue
        os.chmod(d, 0o700)  # mkdir's mode is masked by the umask


def _write_private_file(path: str, data: bytes) -> None:
    """Create ``path`` (0600, must not exist) holding ``data``; no partial file survives."""
    for attempt in range(10):
        try:
            _make_private_dirs(Path(path).parent)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                         | getattr(os, "O_NOFOLLOW", 0), 0o600)
            break
        except FileNotFoundError:  # a concurrent remove() pruned an empty directory, even one just made; again
            if attempt == 9:
                raise
    try:
        os.fchmod(fd, 0o600)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    os.close(fd)


def _atomic_private_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    _write_private_file(str(tmp), data)
    os.replace(tmp, path)


def _unsafe_reason(path: Path) -> str | None:
    """Why ``path`` must not hold a cache (a symlink, another user's, world-writable), or None."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    uid = os.geteuid() if hasattr(os, "geteuid") else st.st_uid
    if st.st_uid != uid:
        return f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & stat.S_IWOTH:
        return f"{path} is world-writable (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _unreachable_reason(path: Path) -> str | None:
    """Why this process cannot reach or read ``path`` (a cache directory or cache.db), or None;
    an absent path is none (an empty cache). Root passes every permission check."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        parent = next((p for p in path.parents if os.path.lexists(p)), path.parent)
        return f"{path} cannot exist: {parent} is not a directory"
    except OSError as exc:
        return f"{path} cannot be reached ({_describe(exc)})"
    need = os.R_OK | os.X_OK if stat.S_ISDIR(st.st_mode) else os.R_OK
    if not os.access(path, need):
        return f"{path} cannot be read by this user (permissions {stat.S_IMODE(st.st_mode):o})"
    return None


def _unsafe_file_reason(path: Path) -> str | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        return f"{path} is owned by uid {st.st_uid}, not by this user"
    return None


class RawDisk(diskcache.Disk):
    """A diskcache ``Disk`` for raw bytes only: keys are str, values bytes, nothing is pickled.

    diskcache's own Disk unpickles whatever a row's mode says; this one refuses any row that is
    not a raw-bytes value (``UnsafeRow``), so a row rewritten to a pickle payload runs no code.
    Value files are created 0600 in 0700 directories, and only names of the form
    ``ab/cd/<28 hex>.val`` are ever opened or removed, whatever a row says.
    """

    def put(self, key):
        if type(key) is not str:
            raise TypeError(f"RawDisk keys are str, got {type(key).__name__}")
        return key, True

    def get(self, key, raw):
        if raw and type(key) is str:
            return key
        raise UnsafeRow("a key stored as a pickle")

    def store(self, value, read, key=UNKNOWN):
        if read or type(value) is not bytes:
            raise TypeError(f"RawDisk stores bytes only, got {type(value).__name__}")
        if len(value) < self.min_file_size:
            return 0, MODE_RAW, None, sqlite3.Binary(value)
        filename, full_path = self.filename(key, value)
        _write_private_file(full_path, value)
        return len(value), MODE_BINARY, filename, None

    def fetch(self, mode, filename, value, read):
        if not read and mode == MODE_RAW and filename is None and type(value) is bytes:
            return value
        if not read and mode == MODE_BINARY and value is None and self._ours(filename):
            with open(os.path.join(self._directory, filename), "rb") as f:
                return f.read()
        raise UnsafeRow(f"row mode {mode!r} with filename {filename!r} and a "
                        f"{type(value).__name__} value is not a raw-bytes entry")

    def read_prefix(self, mode, filename, value) -> bytes:
        """The entry's header + key + meta, without reading a file's blob."""
        if mode == MODE_RAW and filename is None and type(value) is bytes:
            return value
        if mode != MODE_BINARY or not self._ours(filename):
            raise UnsafeRow(f"row mode {mode!r} is not a raw-bytes entry")
        with open(os.path.join(self._directory, filename), "rb") as f:
            head = f.read(_HEADER.size)
            need = _meta_prefix_len(head)
            return head + f.read(need - len(head)) if need else head

    def remove(self, file_path):
        if not self._ours(file_path):
            log.debug("not removing %r: not a plan cache value file", file_path)
            return
        full_path = os.path.join(self._directory, file_path)
        with contextlib.suppress(OSError):
            os.remove(full_path)
        parent = os.path.dirname(full_path)
        for directory in (parent, os.path.dirname(parent)):  # never above the namespace dir
            with contextlib.suppress(OSError):
                os.rmdir(directory)

    @staticmethod
    def _ours(filename) -> bool:
        return isinstance(filename, str) and _VALUE_FILE_RE.match(filename) is not None


class _Store(diskcache.Cache):
    """diskcache.Cache, no eviction, whose opening gives up after ``timeout`` (diskcache: 60 s)."""

    def __init__(self, directory: str, timeout: float, size_limit: int):
        self._open_deadline = time.monotonic() + timeout
        super().__init__(directory, timeout=timeout, disk=RawDisk, eviction_policy="none",
                         cull_limit=0, statistics=0, tag_index=0, size_limit=size_limit,
                         disk_min_file_size=INLINE_MAX)
        self._open_deadline = None

    @property
    def _sql_retry(self):
        # diskcache retries writes made outside a transaction (__init__, reset) for a fixed 60 s;
        # behind a stuck writer that is a 60 s hang at import, so we stop at our timeout.
        sql = self._sql
        deadline = self._open_deadline or time.monotonic() + self._timeout

        def execute(statement, *args, **kwargs):
            while True:
                try:
                    return sql(statement, *args, **kwargs)
                except sqlite3.OperationalError as exc:
                    if str(exc) != "database is locked" or time.monotonic() >= deadline:
                        raise
                    time.sleep(0.002)

        return execute


class _NoDatabase(Exception):
    """No cache.db to read (a read-only or not yet created cache): every lookup misses."""


class _Vanished(Exception):
    """The entry was deleted between reading its row and its file: a plain miss."""


# ---------------------------------------------------------------- the cache


_INSTANCES: weakref.WeakSet = weakref.WeakSet()
# Connections inherited across fork: never used and never closed in the child, since closing
# one there can checkpoint and unlink the parent's WAL. A few kilobytes per fork.
_ABANDONED: list = []


class PlanCache:
    """The persistent plan cache of one environment namespace.

    ``path``: the cache root ($CUDNN_FUSE_CACHE_DIR or the user cache dir); entries live in
    ``path/<namespace>/``, so an environment change (``env.namespace()``) is a clean miss.
    ``read_only``: None detects (a directory we cannot write is opened read-only).
    ``size_limit``: bytes of entries kept; least recently used unpinned entries go first,
    pinned ones never. ``timeout``: seconds to wait for another process's write lock before
    running without the cache.

    The constructor raises only for bad arguments; an unusable directory (refused as unsafe, or
    one this process cannot reach or read) gives a disabled cache (``disabled`` holds the
    reason, every get misses, every put returns False). ``fingerprint_problem`` says why the
    namespace's fingerprint.json is no fingerprint (not JSON, not an object, another
    namespace's), or is None; ``verify`` repairs it and ``export`` refuses while it is set.
    """

    def __init__(self, path=None, *, namespace=None, read_only=None, size_limit=2**30,
                 timeout=2.0, device=None):
        if isinstance(size_limit, bool) or not isinstance(size_limit, int) or size_limit < 1:
            raise ValueError(f"size_limit must be a positive int of bytes, got {size_limit!r}")
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        if read_only is not None:
            _check_flag("read_only", read_only)
        self.fingerprint: dict | None = None
        self.fingerprint_problem: str | None = None
        self._probed = namespace is None  # the fingerprint is this machine's, not read from a file
        if namespace is None:
            from . import env

            if device is not None and (isinstance(device, bool) or not isinstance(device, int)):
                raise ValueError(f"device must be a CUDA device index or None, got {device!r}")
            self.fingerprint = env.fingerprint(device)
            namespace = env.namespace(self.fingerprint)
        if not isinstance(namespace, str) or not _NAMESPACE_RE.match(namespace):
            raise ValueError(f"namespace must be 1-64 of [0-9A-Za-z_.-], got {namespace!r}")
        root = default_cache_dir() if path is None else path
        self.path = Path(os.path.abspath(os.path.expanduser(os.fspath(root))))
        self.namespace = namespace
        self.dir = self.path / namespace
        self.size_limit = size_limit
        self.timeout = float(timeout)
        self.read_only = bool(read_only)
        self.disabled: str | None = None
        self._disk = RawDisk(str(self.dir), min_file_size=INLINE_MAX)
        self._store: _Store | None = None
        self._local = threading.local()  # read-only connections, one per thread
        self._warned: set = set()
        self._session = dict(hits=0, misses=0, faults=0, writes=0, write_failures=0)
        self._pending = dict(hits=0, misses=0)  # counted here, not yet added to cache.db
        # Hits' access times, written in one transaction at most every ACCESS_FLUSH_S (a write
        # per hit cost a warm start ~0.2 ms a plan), and before anything that reads them.
        self._accessed: dict = {}
        self._flush_lock = threading.Lock()  # one flush at a time (threads skip, never wait)
        self._flushed_at = time.monotonic()
        self._backoff_until = 0.0
        _INSTANCES.add(self)
        try:
            self._open(read_only)
        except Exception as exc:  # noqa: BLE001 - an unusable cache must not fail the caller
            self._disable("open-error", f"cannot open the plan cache at {self.dir}: {exc!r}")

    def __repr__(self) -> str:
        mode = f"disabled: {self.disabled}" if self.disabled else (
            "read-only" if self.read_only else "read-write")
        return f"PlanCache({str(self.dir)!r}, {mode})"

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    # ------------------------------------------------------------ opening

    def _open(self, read_only) -> None:
        # A root below a file, or a directory this process may not read, left the cache silently
        # empty (a read-only open saw no database): every lookup missed and `cache ls` said "no
        # plans cached" for a cache it could not read.
        blocked = next(filter(None, map(_unreachable_reason, (self.path, self.dir, self.dir / DB_NAME))), None)
        if blocked is not None:
            self._disable("open-error", f"cannot open the plan cache: {blocked}; running without a plan cache")
            return
        if not os.path.lexists(self.path):
            if read_only:
                return  # nothing to read: every lookup misses
            _make_private_dirs(self.path)
        reason = _unsafe_reason(self.path)
        if reason is None and os.path.lexists(self.dir):
            reason = _unsafe_reason(self.dir) or _unsafe_file_reason(self.dir / DB_NAME)
        if reason is not None:
            self._disable("unsafe-dir", f"refusing the plan cache directory: {reason}; "
                                        "running without a plan cache")
            return
        if read_only is None:
            probe = self.dir if os.path.lexists(self.dir) else self.path
            read_only = not os.access(probe, os.W_OK)
        self.read_only = bool(read_only)
        if self.read_only:
            self._load_fingerprint()
            return
        if not os.path.lexists(self.dir):
            _make_private_dirs(self.dir)
            if self.fingerprint is not None:
                text = json.dumps(self.fingerprint, sort_keys=True, indent=1) + "\n"
                _atomic_private_write(self.dir / FINGERPRINT_NAME, text.encode())
        self._load_fingerprint()
        self._precreate_db()
        self._get_store()

    def _precreate_db(self) -> None:
        # SQLite creates cache.db with the umask's mode and gives -wal/-shm the db's mode, so an
        # empty 0600 file made first (a valid empty database) keeps all three private.
        with contextlib.suppress(FileExistsError):
            fd = os.open(self.dir / DB_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                         0o600)
            try:
                os.fchmod(fd, 0o600)
            finally:
                os.close(fd)

    def _load_fingerprint(self) -> None:
        fp, self.fingerprint_problem = self._read_fingerprint_file()
        if self.fingerprint is None:
            self.fingerprint = fp

    def _read_fingerprint_file(self) -> tuple[dict | None, str | None]:
        """(the fingerprint in fingerprint.json, None), or (None, why the file holds none). No file
        is no problem: a namespace named by hand (``namespace=``, an import) has none."""
        path = self.dir / FINGERPRINT_NAME
        try:
            text = path.read_bytes()
        except FileNotFoundError:
            return None, None
        except OSError as exc:
            return None, f"{path} cannot be read ({_describe(exc)})"
        if not text.strip():
            return None, f"{path} is empty"
        try:
            fp = json.loads(text)
        except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, nested past the recursion limit
            return None, f"{path} is not JSON ({type(exc).__name__}: {str(exc)[:80]})"
        if not isinstance(fp, dict):
            return None, f"{path} holds a JSON {type(fp).__name__}, not a fingerprint object"
        from . import env

        if env.namespace(fp) != self.namespace:  # copied from another namespace, or edited
            return None, f"{path} is the fingerprint of namespace {env.namespace(fp)}, not of {self.namespace}"
        return fp, None

    def _get_store(self) -> _Store | None:
        """The writable diskcache store, opened on first use; None while it cannot be."""
        if self._store is not None or self.read_only or self.disabled:
            return self._store
        if time.monotonic() < self._backoff_until:
            return None
        for attempt in (1, 2):
            try:
                self._store = _Store(str(self.dir), self.timeout, self.size_limit)
                return self._store
            except Exception as exc:  # noqa: BLE001 - classified below; never raised to callers
                if _is_corrupt(exc) and attempt == 1 and self._quarantine(exc):
                    continue
                self._store_unavailable(exc)
                return None
        return None

    def _store_unavailable(self, exc: Exception) -> None:
        if _is_locked(exc):
            self._lock_fault("opening")
        elif _is_read_only_error(exc):
            self._go_read_only(f"cannot write {self.dir / DB_NAME} ({exc})")
        elif _is_corrupt(exc):
            self._disable("corrupt-database", f"plan cache database {self.dir / DB_NAME} is "
                                              f"corrupt and could not be replaced ({exc})")
        else:
            self._backoff_until = time.monotonic() + LOCK_BACKOFF_TIMEOUTS * self.timeout
            self._fault("open-error", "cannot open the plan cache database %s (%r); running "
                        "without it for now", self.dir / DB_NAME, exc)

    def _go_read_only(self, why: str) -> None:
        self.read_only = True
        self._info_once("read-only", "plan cache %s is read-only (%s): hits are served, new "
                        "plans are kept in memory only", self.dir, why)

    def _ro_connection(self) -> sqlite3.Connection:
        """This thread's read-only connection to cache.db; raises _NoDatabase if there is none."""
        local = self._local
        if getattr(local, "pid", None) == os.getpid() and local.con is not None:
            return local.con
        db = self.dir / DB_NAME
        if not db.exists():
            raise _NoDatabase()
        uri = db.as_uri() + "?mode=ro"
        tries = (uri,)
        if self.read_only:
            # A WAL database read with locking needs its -shm file, and SQLite would create one
            # (it cannot in a read-only directory). With no -shm, no process has the database
            # open, so immutable=1 (no locks, no -shm) reads it and writes nothing.
            immutable = uri + "&immutable=1"
            live = os.path.exists(f"{db}-shm")
            tries = (uri, immutable) if live else (immutable, uri)
        for i, candidate in enumerate(tries):
            con = sqlite3.connect(candidate, uri=True, timeout=self.timeout,
                                  isolation_level=None, check_same_thread=True)
            try:
                con.execute("SELECT count(*) FROM sqlite_master").fetchone()
            except sqlite3.OperationalError:
                con.close()
                if i == len(tries) - 1:
                    raise
                continue
            local.pid, local.con = os.getpid(), con
            return con
        raise _NoDatabase()  # unreachable: the loop returns or raises

    def _read_sql(self):
        """execute() for reads: the store's connection when writable, else a read-only one."""
        store = self._get_store()
        if store is not None:
            return store._sql
        return self._ro_connection().execute

    def _drop_inherited_connections(self) -> None:
        """In a forked child: set the parent's connections aside; new ones open on demand."""
        _ABANDONED.append(self._local)
        self._local = threading.local()
        store = self._store
        if store is not None:
            _ABANDONED.append(store._local)
            store._local = threading.local()  # diskcache's pid check then finds no connection
            store._txn_id = None
        self._pending = dict(hits=0, misses=0)  # the parent flushes its own
        self._accessed = {}
        self._flush_lock = threading.Lock()  # a parent's thread may have held it at the fork

    def close(self) -> None:
        """Flush the hit/miss counters (best effort) and close this thread's connections."""
        self._touch(None)
        store, self._store = self._store, None
        if store is not None:
            with contextlib.suppress(Exception):
                store.close()
        con = getattr(self._local, "con", None)
        if con is not None and getattr(self._local, "pid", None) == os.getpid():
            with contextlib.suppress(Exception):
                con.close()
        self._local = threading.local()

    # ------------------------------------------------------------ logging

    def _fault(self, kind: str, msg: str, *args) -> None:
        """Count a fault; warn the first time per kind, DEBUG after that."""
        self._session["faults"] += 1
        self._log_once(kind, logging.WARNING, f"plan cache fault [{kind}]: {msg}", *args)

    def _info_once(self, kind: str, msg: str, *args) -> None:
        self._log_once(kind, logging.INFO, msg, *args)

    def _warn_once(self, kind: str, msg: str, *args) -> None:
        self._log_once(kind, logging.WARNING, msg, *args)

    def _log_once(self, kind: str, level: int, msg: str, *args) -> None:
        first = kind not in self._warned
        self._warned.add(kind)
        log.log(level if first else logging.DEBUG, msg, *args)

    def _disable(self, kind: str, msg: str) -> None:
        self.disabled = msg
        self._fault(kind, "%s", msg)

    # ------------------------------------------------------------ get

    def get(self, key: str, *, count: bool = True) -> CacheEntry | None:
        """The verified entry of ``key``, or None on a miss or any fault (one warning per kind).
        ``count=False``: a secondary lookup (a plan's engine record after its entry missed) that the
        hit and miss counts leave out, so that they count plan lookups.

        Raises TypeError/ValueError only for a key that is not a hex string.
        """
        _check_key(key)
        miss = self._miss if count else _uncounted
        if self.disabled is not None:
            return miss()
        for _ in range(3):  # a row rewritten between reading it and its file: read it again
            try:
                row = self._select(key)
            except _NoDatabase:
                return miss()
            except Exception as exc:  # noqa: BLE001 - sqlite errors of every kind: a miss
                self._read_fault(exc, f"looking up {key[:12]}")
                return miss()
            if row is None:
                return miss()
            rowid, mode, filename, value, store_time = row
            try:
                entry = decode_entry(key, self._fetch(rowid, mode, filename, value))
            except _Vanished:
                continue
            except (CorruptEntry, UnsafeRow, OSError) as exc:
                self._bad_entry(key, rowid, store_time, filename, exc)
                return miss()
            except Exception as exc:  # noqa: BLE001 - sqlite errors while re-checking a file
                self._read_fault(exc, f"reading {key[:12]}")
                return miss()
            if count:
                self._session["hits"] += 1
                self._pending["hits"] += 1
            self._accessed[rowid] = time.time()
            if len(self._accessed) >= 256 or time.monotonic() - self._flushed_at > ACCESS_FLUSH_S:
                self._touch(None)
            return entry
        return miss()

    def _select(self, key: str):
        sql = self._read_sql()
        try:
            rows = sql("SELECT rowid, mode, filename, value, store_time FROM Cache"
                       " WHERE key = ? AND raw = 1", (key,)).fetchall()
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):
                raise _NoDatabase() from None  # a database no writer has initialized yet
            raise
        return rows[0] if rows else None

    def _fetch(self, rowid, mode, filename, value) -> bytes:
        try:
            return self._disk.fetch(mode, filename, value, False)
        except FileNotFoundError:
            # Deleted by a concurrent delete/prune (a plain miss), unless the row still names it.
            still = self._read_sql()("SELECT 1 FROM Cache WHERE rowid = ? AND filename = ?",
                                     (rowid, filename)).fetchall()
            if not still:
                raise _Vanished() from None
            raise CorruptEntry("missing-file", f"value file {filename} is gone") from None

    def _miss(self) -> None:
        # Recorded in cache.db with the next hit, put or close: a miss is followed by a build
        # and a put, and a write transaction here would only add a second one.
        self._session["misses"] += 1
        self._pending["misses"] += 1
        return None

    def _bad_entry(self, key, rowid, store_time, filename, exc) -> None:
        kind = exc.kind if isinstance(exc, CorruptEntry) else (
            "unsafe-row" if isinstance(exc, UnsafeRow) else "read-error")
        dropped = self._drop_row(rowid, store_time, filename)
        self._fault(kind, "entry %s... failed verification (%s); %s", key[:12], exc,
                    "dropped, the plan will be rebuilt" if dropped
                    else "ignored, the plan will be rebuilt")

    def _drop_row(self, rowid, store_time, filename) -> bool:
        """Delete a bad row unless it was rewritten meanwhile; False when it cannot be."""
        if self.read_only or self.disabled or self._get_store() is None:
            return False
        try:
            with self._write() as (sql, doomed):
                deleted = sql("DELETE FROM Cache WHERE rowid = ? AND store_time IS ?",
                              (rowid, store_time)).rowcount
                if deleted:
                    doomed.append(filename)
            return True
        except Exception as exc:  # noqa: BLE001 - the next get() tries again
            log.debug("could not drop a bad plan cache row: %r", exc)
            return False

    def _touch(self, rowid) -> None:
        """Best effort, never waiting for the lock: the hits' access times, and the counters."""
        store = self._store
        if rowid is not None:
            self._accessed[rowid] = time.time()
        if store is None or self.read_only or not (self._accessed or any(self._pending.values())):
            return
        if not self._flush_lock.acquire(blocking=False):
            return  # another thread is flushing: the next hit's flush takes what this one would
        try:
            self._flush(store)
        finally:
            self._flush_lock.release()

    def _flush(self, store) -> None:
        """_touch's write, one thread at a time: two at once counted the same hits twice, and the second
        one's removal of a flushed access time raised KeyError into the op that hit the cache."""
        accessed = dict(self._accessed)
        pending = dict(self._pending)
        try:
            sql = store._sql
            sql("PRAGMA busy_timeout = 0")
            try:
                with store.transact():
                    for row, when in accessed.items():
                        sql("UPDATE Cache SET access_time = MAX(access_time, ?), access_count = access_count + 1"
                            " WHERE rowid = ?", (when, row))
                    _add_counters(sql, pending)
            finally:
                sql(f"PRAGMA busy_timeout = {int(self.timeout * 1000)}")
        except Exception as exc:  # noqa: BLE001 - LRU order and counters are best effort
            log.debug("plan cache access-time update skipped: %r", exc)
            return
        self._flushed_at = time.monotonic()
        for row, when in accessed.items():
            if self._accessed.get(row) == when:
                self._accessed.pop(row, None)
        for name, n in pending.items():
            self._pending[name] -= n

    def _read_fault(self, exc: Exception, what: str) -> None:
        if _is_corrupt(exc):
            self._quarantine(exc)
        else:
            self._fault("database-error", "%s failed (%r); treated as a miss", what, exc)

    # ------------------------------------------------------------ put

    def put(self, key: str, meta: dict, blob, *, pinned: bool = False) -> bool:
        """Store an entry; True if stored. Any fault gives False and one warning; never raises
        for a fault (TypeError/ValueError for a key, meta or blob no cache could store).

        ``pinned`` entries (pre-warmed) are never evicted; a pinned entry stays pinned when an
        unpinned put replaces it.
        """
        data = encode_entry(key, meta, blob)
        _check_flag("pinned", pinned)
        if self.disabled is not None:
            return False
        if self.read_only:
            self._go_read_only("opened read-only")
            return False
        try:
            store = self._get_store()
            if store is None:
                raise CacheError("the cache database is unavailable")
            was_pinned = store._sql("SELECT 1 FROM Cache WHERE key = ? AND raw = 1 AND tag IS ?",
                                    (key, _PINNED)).fetchall()
            # diskcache's own transaction: it removes a replaced value file only after the
            # commit, so a reader never finds the committed row's file gone.
            store.set(key, data, tag=_PINNED if pinned or was_pinned else None)
        except Exception as exc:  # noqa: BLE001 - the op never fails because of the cache
            self._session["write_failures"] += 1
            self._write_fault(exc, f"storing {key[:12]}...")
            return False
        self._session["writes"] += 1
        self._after_put(key)
        return True

    def _after_put(self, key: str) -> None:
        """Evict when over the size limit, record the counters; a failure leaves that to the
        next put (the entry is stored either way)."""
        try:
            if _total_bytes(self._store._sql) > self.size_limit:
                self._touch(None)  # eviction reads access times: the deferred ones first
                with self._write() as (sql, doomed):
                    self._evict(sql, doomed, key)
        except Exception as exc:  # noqa: BLE001
            log.debug("plan cache eviction after a put skipped: %r", exc)
        self._touch(None)

    @contextlib.contextmanager
    def _write(self):
        """A write transaction: yields (execute, doomed); files in doomed go after the commit."""
        store = self._get_store()
        if store is None:
            raise CacheError(self.disabled or ("the cache is read-only" if self.read_only
                                               else "the cache database is unavailable"))
        doomed: list = []
        with store.transact():  # BEGIN IMMEDIATE, diskcache.Timeout after `timeout`
            yield store._sql, doomed
        for filename in doomed:
            if filename is not None:
                store.disk.remove(filename)

    def _evict(self, sql, doomed, key: str) -> None:
        """Bring entry bytes under size_limit: least recently used unpinned entries first."""
        total = _total_bytes(sql)
        if total <= self.size_limit:
            return
        rows = sql(f"SELECT rowid, filename, {_SIZE_SQL} FROM Cache WHERE tag IS NOT ?"
                   " AND NOT (key = ? AND raw = 1) ORDER BY access_time",
                   (_PINNED, key)).fetchall()
        for rowid, filename, size in rows:
            if total <= self.size_limit:
                break
            sql("DELETE FROM Cache WHERE rowid = ?", (rowid,))
            doomed.append(filename)
            total -= size or 0
        if total > self.size_limit:
            self._warn_once("over-limit", "plan cache %s holds %d bytes, over its size limit of %d"
                            " bytes, in pinned entries and the newest one; keeping them (pinned"
                            " entries are never evicted)", self.dir, total, self.size_limit)

    def _write_fault(self, exc: Exception, what: str) -> None:
        if _is_locked(exc):
            self._lock_fault(what)
        elif _is_corrupt(exc):
            self._quarantine(exc)
        elif _is_read_only_error(exc):
            self._go_read_only(str(exc))
        elif isinstance(exc, CacheError):
            log.debug("plan cache write skipped: %s", exc)
        elif _is_full(exc):
            self._fault("disk-full", "%s failed: %s; the plan is kept in memory only", what,
                        _describe(exc))
        elif isinstance(exc, OSError):
            self._fault("write-error", "%s failed: %s", what, _describe(exc))
        else:
            self._fault("database-error", "%s failed: %r", what, exc)

    def _lock_fault(self, what: str) -> None:
        backoff = LOCK_BACKOFF_TIMEOUTS * self.timeout
        self._backoff_until = time.monotonic() + backoff
        self._fault("locked", "%s: the cache database %s stayed locked by another process for "
                    "%.1f s; running without the cache for %.0f s", what, self.dir / DB_NAME,
                    self.timeout, backoff)

    def _quarantine(self, exc: Exception) -> bool:
        """Move a corrupt cache.db aside so a fresh one can be made; True if moved or already
        replaced. A read-only cache is disabled instead."""
        db = self.dir / DB_NAME
        if self.read_only:
            self._disable("corrupt-database", f"plan cache database {db} is corrupt ({exc}); "
                                              "running without a plan cache")
            return False
        self.close()
        if _db_healthy(db):  # another process replaced it already
            return True
        stamp = time.strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"
        try:
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.rename(f"{db}{suffix}", f"{db}{suffix}.corrupt-{stamp}")
            self._precreate_db()
        except OSError as err:
            self._disable("corrupt-database", f"plan cache database {db} is corrupt ({exc}) and "
                                              f"cannot be moved aside ({err})")
            return False
        self._fault("corrupt-database", "plan cache database %s is corrupt (%s); moved aside to "
                    "%s and starting empty", db, exc, f"{db.name}.corrupt-{stamp}")
        return True

    # ------------------------------------------------------------ maintenance

    def delete(self, key: str) -> bool:
        """Remove ``key``'s entry; True if there was one. Never raises for a fault."""
        _check_key(key)
        try:
            with self._write() as (sql, doomed):
                rows = sql("SELECT rowid, filename FROM Cache WHERE key = ? AND raw = 1",
                           (key,)).fetchall()
                _delete_rows(sql, rows, doomed)
        except Exception as exc:  # noqa: BLE001
            self._write_fault(exc, f"deleting {key[:12]}...")
            return False
        return bool(rows)

    def entry_info(self) -> Iterator[EntryInfo]:
        """Every readable entry's key, meta, size, pinned flag and times; blobs are not read."""
        if self.disabled is not None:
            return
        try:
            rows = self._read_sql()(
                f"SELECT key, raw, mode, filename, CASE WHEN filename IS NULL THEN value END,"
                f" {_SIZE_SQL}, tag, store_time, access_time FROM Cache ORDER BY store_time"
            ).fetchall()
        except _NoDatabase:
            return
        except sqlite3.Error as exc:
            if "no such table" in str(exc):
                return
            raise CacheError(f"cannot list {self.dir / DB_NAME}: {exc}") from exc
        for key, raw, mode, filename, value, size, tag, stored, accessed in rows:
            if raw != 1 or type(key) is not str or not _KEY_RE.match(key):
                continue  # not ours; verify() removes it
            try:
                meta = _parse_meta_prefix(self._disk.read_prefix(mode, filename, value))
            except (OSError, UnsafeRow):
                meta = None
            if meta is not None:
                yield EntryInfo(key, meta, size or 0, tag == _PINNED, stored, accessed)

    def entries(self) -> Iterator[tuple[str, dict, int]]:
        """(key, meta, size in bytes) of every readable entry; blobs are not read."""
        for info in self.entry_info():
            yield info.key, info.meta, info.size

    def stats(self) -> dict:
        """Entries, pinned, bytes, limits, and hit/miss counts.

        ``hits``/``misses``/``hit_rate`` are lifetime totals of every process that used this
        namespace (recorded best effort, without waiting for the lock) plus this process's
        unrecorded ones; ``session_*``, ``faults``, ``writes`` and ``write_failures`` are this
        object's.
        """
        out = dict(path=str(self.path), dir=str(self.dir), namespace=self.namespace,
                   read_only=self.read_only, disabled=self.disabled, size_limit=self.size_limit,
                   entries=0, pinned=0, bytes=0, hits=0, misses=0)
        if self.disabled is None:
            with contextlib.suppress(_NoDatabase):
                try:
                    sql = self._read_sql()
                    count, pinned, total = sql(
                        f"SELECT count(*), count(CASE WHEN tag IS ? THEN 1 END),"
                        f" COALESCE(sum({_SIZE_SQL}), 0) FROM Cache", (_PINNED,)).fetchone()
                    out.update(entries=count, pinned=pinned, bytes=total)
                    out.update(sql("SELECT key, value FROM Settings WHERE key IN"
                                   " ('hits', 'misses')").fetchall())
                except sqlite3.Error as exc:
                    if "no such table" not in str(exc):
                        out["error"] = str(exc)
        out["hits"] += self._pending["hits"]
        out["misses"] += self._pending["misses"]
        lookups = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / lookups if lookups else None
        out.update({f"session_{k}": self._session[k] for k in ("hits", "misses")})
        out.update({k: self._session[k] for k in ("faults", "writes", "write_failures")})
        return out

    def verify(self, *, orphan_grace_s: float = ORPHAN_GRACE_S, progress=None) -> dict:
        """Re-check every entry, the namespace's fingerprint.json and the value files; remove the
        bad entries and orphan files and repair fingerprint.json (when writable).

        Orphans are value files no row names (left by a writer killed mid-write); those younger
        than ``orphan_grace_s`` may belong to a live writer: they stay, and are no fault. A
        damaged fingerprint.json is rewritten when the namespace is this machine's (the
        fingerprint is known), else removed (it names no environment). ``progress(done, total)``
        is called as entries are checked.

        Returns counts {checked, ok, bad, removed, orphans, orphans_removed, young_orphans} and
        ``faults``: one dict per fault found {key (None for a file), op (None if unknown), kind
        (``CorruptEntry.kind``, ``unsafe-row``, ``missing-file``, ``read-error``, ``orphan``,
        ``fingerprint``), detail, pinned, removed} (fingerprint.json's also has ``repair``: what
        was done to it). Pinned entries that fail verification are
        removed like any other (their bytes are useless); ``pinned`` says so. Raises CacheError if
        the cache cannot be read or its bad entries cannot be removed.
        """
        self._require_usable()
        counts = dict(checked=0, ok=0, bad=0, removed=0, orphans=0, orphans_removed=0, young_orphans=0)
        faults: list = []
        self._verify_fingerprint(faults)
        bad, referenced = self._verify_rows(counts, faults, progress)
        if bad and not self.read_only:
            with self._maintenance("removing bad entries") as (sql, doomed):
                for (rowid, store_time, filename), fault in bad:
                    if sql("DELETE FROM Cache WHERE rowid = ? AND store_time IS ?",
                           (rowid, store_time)).rowcount:
                        doomed.append(filename)
                        counts["removed"] += 1
                        fault["removed"] = True
        self._sweep_orphans(referenced, counts, orphan_grace_s, faults)
        counts["faults"] = faults
        return counts

    def _verify_fingerprint(self, faults: list) -> None:
        fp, problem = self._read_fingerprint_file()
        self.fingerprint_problem = problem
        if problem is None:
            return
        fault = dict(key=None, op=None, kind="fingerprint", detail=problem, pinned=False, removed=False)
        faults.append(fault)
        if self.read_only:
            return
        path = self.dir / FINGERPRINT_NAME
        try:
            if self._probed and self.fingerprint is not None:
                text = json.dumps(self.fingerprint, sort_keys=True, indent=1) + "\n"
                _atomic_private_write(path, text.encode())
                fault["repair"] = "rewritten with this machine's fingerprint"
            else:
                os.unlink(path)
                fault["repair"] = "removed (it named no environment)"
        except OSError as exc:
            fault["repair"] = f"left: {_describe(exc)}"
            return
        fault["removed"] = True
        self.fingerprint_problem = None

    def _verify_rows(self, counts: dict, faults: list, progress=None):
        try:
            sql = self._read_sql()
            rows = sql("SELECT rowid, key, raw, mode, filename, store_time, tag FROM Cache").fetchall()
        except _NoDatabase:
            rows = []
        except sqlite3.Error as exc:
            raise CacheError(f"cannot read {self.dir / DB_NAME}: {exc}") from exc
        bad, referenced = [], set()
        for n, (rowid, key, raw, mode, filename, store_time, tag) in enumerate(rows):
            if progress is not None:
                progress(n, len(rows))
            counts["checked"] += 1
            if isinstance(filename, str):
                referenced.add(filename)
            value = None
            try:
                if raw != 1 or type(key) is not str or not _KEY_RE.match(key):
                    raise UnsafeRow("a key that is not a raw hex string")
                found = sql("SELECT value FROM Cache WHERE rowid = ?", (rowid,)).fetchone()
                if found is None:  # deleted meanwhile by another process
                    counts["checked"] -= 1
                    continue
                value = found[0]
                decode_entry(key, self._disk.fetch(mode, filename, value, False))
                counts["ok"] += 1
            except (CorruptEntry, UnsafeRow, OSError) as exc:
                counts["bad"] += 1
                fault = dict(key=key if type(key) is str else None, op=self._op_of(mode, filename, value),
                             kind=_fault_kind(exc), detail=str(exc), pinned=tag == _PINNED, removed=False)
                faults.append(fault)
                bad.append(((rowid, store_time, filename), fault))
                log.info("plan cache entry %r is bad: %s", fault["key"] or "?", exc)
            except sqlite3.Error as exc:
                raise CacheError(f"cannot read {self.dir / DB_NAME}: {exc}") from exc
        if progress is not None:
            progress(len(rows), len(rows))
        return bad, referenced

    def _op_of(self, mode, filename, value) -> str | None:
        """The op a bad entry's unverified metadata names, if its first bytes still parse."""
        try:
            meta = _parse_meta_prefix(self._disk.read_prefix(mode, filename, value))
        except (OSError, UnsafeRow, ValueError, TypeError):
            return None
        if meta is None:
            return None
        spec = meta.get("spec")
        op = meta.get("op") or (spec.get("op") if isinstance(spec, dict) else None)
        return op if isinstance(op, str) else None

    def _sweep_orphans(self, referenced: set, counts: dict, grace_s: float, faults: list) -> None:
        now, writable = time.time(), not self.read_only
        for level1 in _hex_dirs(self.dir):
            for level2 in _hex_dirs(level1.path):
                for item in _scan(level2.path):
                    name = f"{level1.name}/{level2.name}/{item.name}"
                    if name in referenced or not _VALUE_FILE_RE.match(name):
                        continue
                    counts["orphans"] += 1
                    with contextlib.suppress(FileNotFoundError):
                        age = now - item.stat(follow_symlinks=False).st_mtime
                        if age < grace_s:
                            counts["young_orphans"] += 1
                            continue
                        fault = dict(key=None, op=None, kind="orphan", pinned=False, removed=False,
                                     detail=f"value file {name} that no entry names")
                        faults.append(fault)
                        if writable:
                            os.unlink(item.path)
                            counts["orphans_removed"] += 1
                            fault["removed"] = True
                if writable:
                    with contextlib.suppress(OSError):
                        os.rmdir(level2.path)  # only if empty
            if writable:
                with contextlib.suppress(OSError):
                    os.rmdir(level1.path)

    def prune(self, *, max_bytes=None, older_than_s=None, include_pinned=False) -> int:
        """Remove entries not used for ``older_than_s`` seconds, then least recently used ones
        until at most ``max_bytes`` remain (default, with neither given: ``size_limit``).
        Pinned entries stay unless ``include_pinned``. Returns how many went; raises CacheError
        if the cache cannot be written."""
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)):
            raise TypeError(f"prune: max_bytes must be an int or None, got {type(max_bytes).__name__}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"prune: max_bytes must be at least 0, got {max_bytes}")
        if older_than_s is not None and (isinstance(older_than_s, bool) or not isinstance(older_than_s, (int, float))):
            raise TypeError(f"prune: older_than_s must be seconds (a number) or None, got {type(older_than_s).__name__}")
        if older_than_s is not None and not 0 <= older_than_s < math.inf:
            raise ValueError(f"prune: older_than_s must be finite and at least 0, got {older_than_s}")
        _check_flag("include_pinned", include_pinned)
        if max_bytes is None and older_than_s is None:
            max_bytes = self.size_limit
        pin_filter = "" if include_pinned else f" AND tag IS NOT {_PINNED}"
        removed = 0
        self._touch(None)  # pruning reads access times: the deferred ones first
        with self._maintenance("pruning") as (sql, doomed):
            if older_than_s is not None:
                rows = sql(f"SELECT rowid, filename FROM Cache WHERE access_time < ?{pin_filter}",
                           (time.time() - older_than_s,)).fetchall()
                removed += _delete_rows(sql, rows, doomed)
            if max_bytes is not None:
                total = _total_bytes(sql)
                rows = sql(f"SELECT rowid, filename, {_SIZE_SQL} FROM Cache WHERE 1{pin_filter}"
                           " ORDER BY access_time").fetchall()
                for rowid, filename, size in rows:
                    if total <= max_bytes:
                        break
                    removed += _delete_rows(sql, [(rowid, filename)], doomed)
                    total -= size or 0
        return removed

    def clear(self) -> int:
        """Remove every entry, pinned ones too; returns how many. Raises CacheError if the
        cache cannot be written."""
        with self._maintenance("clearing") as (sql, doomed):
            return _delete_rows(sql, sql("SELECT rowid, filename FROM Cache").fetchall(), doomed)

    @contextlib.contextmanager
    def _maintenance(self, what: str):
        self._require_usable()
        if self.read_only:
            raise CacheError(f"plan cache {self.dir} is read-only; cannot finish {what}")
        try:
            with self._write() as txn:
                yield txn
        except CacheError:
            raise
        except Exception as exc:
            if _is_corrupt(exc):
                self._quarantine(exc)
            raise CacheError(f"{what} {self.dir} failed: {_describe(exc)}") from exc

    def _require_usable(self) -> None:
        if self.disabled is not None:
            raise CacheError(f"plan cache disabled: {self.disabled}")

    # ------------------------------------------------------------ export / import

    def export(self, file, *, progress=None) -> int:
        """Write every valid entry to one portable file; returns how many.

        Format (docs/cache.md): JSON lines, UTF-8. Line 1 is a header
        {"format": "cudnn_fuse-plan-cache-export", "version": 1, "namespace", "fingerprint",
        "exported_at", "host"}; each further line {"key", "pinned", "entry"} where "entry" is the
        base64 of the checksummed entry bytes. ``file``: a path or a file object open for writing
        (binary or text). A path to a regular file (or to none yet; through a symlink, its target)
        is written atomically, 0600: a temp file beside it renamed into place, so an interrupted
        export leaves the old file or none. A pipe or device (``/dev/stdout``) is written in
        place, never replaced. ``progress(done, total)`` is called as entries are written.

        Raises CacheError for a directory, and for a namespace whose fingerprint.json is damaged
        (``fingerprint_problem``: the header would carry no fingerprint, or a wrong one; ``verify``
        repairs it); OSError naming ``file`` when it cannot be written.
        """
        self._require_usable()
        if self.fingerprint_problem is not None:
            raise CacheError(f"not exporting namespace {self.namespace}: {self.fingerprint_problem} "
                             "(`cudnn-fuse cache verify` repairs it)")
        if hasattr(file, "write"):
            return self._write_export(file.write, text=isinstance(file, io.TextIOBase), progress=progress)
        try:
            mode = os.stat(file).st_mode
        except OSError:
            mode = None
        if mode is not None and stat.S_ISDIR(mode):
            raise CacheError(f"cannot export to {os.fspath(file)!r}: it is a directory")
        if mode is not None and not stat.S_ISREG(mode):
            with open(file, "wb") as f:  # not its realpath: /dev/stdout's is pipe:[...]
                return self._write_export(f.write, text=False, progress=progress)
        path = Path(os.path.realpath(file) if os.path.islink(file) else file)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
                         | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except OSError as exc:  # name the file asked for, not our temp file beside it
            raise OSError(exc.errno, exc.strerror, os.fspath(file)) from None
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "wb") as f:
                count = self._write_export(f.write, text=False, progress=progress)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return count

    def _write_export(self, write, text: bool, progress=None) -> int:
        header = dict(format=EXPORT_FORMAT, version=EXPORT_VERSION, namespace=self.namespace,
                      fingerprint=self.fingerprint, host=socket.gethostname(),
                      exported_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        count = 0
        for record in [header, *(dict(key=key, pinned=pinned,
                                      entry=base64.b64encode(data).decode("ascii"))
                                 for key, pinned, data in self._valid_entries(progress))]:
            line = json.dumps(record, sort_keys=True) + "\n"
            write(line if text else line.encode())
            count += 1
        return count - 1

    def _valid_entries(self, progress=None) -> Iterator[tuple[str, bool, bytes]]:
        try:
            sql = self._read_sql()
            rows = sql("SELECT rowid, key, mode, filename, tag FROM Cache WHERE raw = 1"
                       " ORDER BY store_time").fetchall()
        except _NoDatabase:
            rows = []
        except sqlite3.Error as exc:
            raise CacheError(f"cannot read {self.dir / DB_NAME}: {exc}") from exc
        for n, (rowid, key, mode, filename, tag) in enumerate(rows):
            if progress is not None:
                progress(n, len(rows))
            try:
                found = sql("SELECT value FROM Cache WHERE rowid = ?", (rowid,)).fetchone()
                if found is None:  # deleted meanwhile
                    continue
                data = self._disk.fetch(mode, filename, found[0], False)
                decode_entry(key, data)
            except (CorruptEntry, UnsafeRow, OSError) as exc:
                log.warning("export skips plan cache entry %r: %s", key, exc)
                continue
            except sqlite3.Error as exc:
                raise CacheError(f"cannot read {self.dir / DB_NAME}: {exc}") from exc
            yield key, tag == _PINNED, data
        if progress is not None:
            progress(len(rows), len(rows))

    def import_(self, file, *, force: bool = False, progress=None) -> dict:
        """Import an ``export()`` file, verifying every entry; returns counts
        {imported, skipped (already here), rejected (failed verification), failed (not written)}.

        ``progress(done, total)``: called as lines are read, ``total`` being the file's line
        count (only for a path to a regular file: a pipe's length is unknown).

        Raises ValueError for a file that is not an export, or whose namespace differs from
        this cache's unless ``force``; CacheError if this cache cannot be written.
        """
        total = _count_lines(file) if progress is not None else None
        if total is None:
            progress = None
        lines = _read_lines(file)
        header = _parse_export_header(next(lines, b""))
        theirs = header.get("namespace")
        if theirs != self.namespace and not force:
            raise ValueError(
                f"export file is from namespace {theirs!r} but this cache is namespace "
                f"{self.namespace!r} (another GPU, driver or library version); its plans may not "
                "load here. Pass force=True (cudnn-fuse cache import --force) to import anyway")
        self._require_usable()
        if self.read_only:
            raise CacheError(f"plan cache {self.dir} is read-only; cannot import")
        counts = dict(imported=0, skipped=0, rejected=0, failed=0)
        for n, line in enumerate(lines, start=1):
            if progress is not None:
                progress(min(n, total), total)
            if not line.strip():
                continue
            try:
                record = json.loads(_text(line))
                key = record["key"]
                entry = decode_entry(key, base64.b64decode(record["entry"], validate=True))
                pinned = record.get("pinned", False)
                if not isinstance(pinned, bool):  # export writes true or false: "false" would pin
                    raise ValueError(f"entry {key}: pinned must be true or false, got {pinned!r}")
            except (ValueError, KeyError, TypeError, RecursionError) as exc:
                # CorruptEntry and a byte that is not UTF-8 are ValueErrors; RecursionError: JSON
                # nested deeper than Python's recursion limit
                counts["rejected"] += 1
                log.info("import rejects an entry: %s", exc)
                continue
            if self._peek(key) is not None:
                counts["skipped"] += 1
            elif self.put(key, entry.meta, entry.blob, pinned=pinned):
                counts["imported"] += 1
            else:
                counts["failed"] += 1
        if progress is not None:
            progress(total, total)
        return counts

    def _peek(self, key: str) -> CacheEntry | None:
        """The valid entry of ``key`` without counting a hit or miss, or None."""
        try:
            row = self._select(key)
            if row is None:
                return None
            rowid, mode, filename, value, _ = row
            return decode_entry(key, self._fetch(rowid, mode, filename, value))
        except Exception:  # noqa: BLE001 - anything unreadable is replaced by the import
            return None


# ---------------------------------------------------------------- helpers


def _fault_kind(exc: Exception) -> str:
    """The fault table's name (docs/cache.md) of an entry's verification failure."""
    if isinstance(exc, CorruptEntry):
        return exc.kind
    if isinstance(exc, UnsafeRow):
        return "unsafe-row"
    return "missing-file" if isinstance(exc, FileNotFoundError) else "read-error"


def _uncounted() -> None:
    """A miss of a lookup made with ``count=False``."""
    return None


def _add_counters(sql, pending: dict) -> None:
    for name, n in pending.items():
        if n:
            sql("UPDATE Settings SET value = value + ? WHERE key = ?", (n, name))


def _total_bytes(sql) -> int:
    return sql(f"SELECT COALESCE(sum({_SIZE_SQL}), 0) FROM Cache").fetchone()[0]


def _delete_rows(sql, rows, doomed) -> int:
    for rowid, filename in rows:
        sql("DELETE FROM Cache WHERE rowid = ?", (rowid,))
        doomed.append(filename)
    return len(rows)


def _scan(path) -> list:
    try:
        return list(os.scandir(path))
    except OSError:  # removed meanwhile by a concurrent remove()
        return []


def _hex_dirs(path) -> list:
    return [e for e in _scan(path) if _HEX2_RE.match(e.name) and e.is_dir(follow_symlinks=False)]


def _read_lines(file) -> Iterator:
    """The lines of an export, as bytes (a path) or as the file object gives them; each is decoded
    by its reader, so a byte that is not UTF-8 rejects its own line, not the whole import."""
    if hasattr(file, "read"):
        yield from file
        return
    with open(file, "rb") as f:
        yield from f


def _count_lines(file) -> int | None:
    """The lines of an export file after its header; None for a file object, a pipe or a device."""
    try:
        if hasattr(file, "read") or not stat.S_ISREG(os.stat(file).st_mode):
            return None
        with open(file, "rb") as f:
            return max(0, sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b"")) - 1)
    except OSError:
        return None  # import_ names the file when it opens it


def _text(line) -> str:
    return line.decode("utf-8") if isinstance(line, bytes) else line


def _parse_export_header(line) -> dict:
    try:
        header = json.loads(_text(line))
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the recursion limit
        header = None
    if not isinstance(header, dict) or header.get("format") != EXPORT_FORMAT:
        raise ValueError("not a cudnn_fuse plan cache export (its first line is no export header)")
    if header.get("version") != EXPORT_VERSION:
        raise ValueError(f"plan cache export version {header.get('version')!r} is not "
                         f"{EXPORT_VERSION}; export it again with this cudnn_fuse version")
    return header


def _db_healthy(db: Path) -> bool:
    try:
        con = sqlite3.connect(db, timeout=0.1)
        try:
            return con.execute("PRAGMA quick_check(1)").fetchone()[0] == "ok"
        finally:
            con.close()
    except sqlite3.Error:
        return False


def _sqlite_code(exc) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)  # Python >= 3.11
    return code & 0xFF if isinstance(code, int) else None


def _is_corrupt(exc) -> bool:
    if not isinstance(exc, sqlite3.DatabaseError) or isinstance(exc, sqlite3.OperationalError):
        return False
    code = _sqlite_code(exc)
    if code is not None:
        return code in (11, 26)  # SQLITE_CORRUPT, SQLITE_NOTADB
    text = str(exc)
    return "not a database" in text or "malformed" in text


def _is_locked(exc) -> bool:
    return isinstance(exc, diskcache.Timeout) or (
        isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc))


def _is_read_only_error(exc) -> bool:
    if isinstance(exc, OSError):
        return exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
    return isinstance(exc, sqlite3.OperationalError) and "readonly" in str(exc)


def _is_full(exc) -> bool:
    if isinstance(exc, OSError):
        return exc.errno in _FULL_ERRNOS
    return isinstance(exc, sqlite3.OperationalError) and "full" in str(exc)


def _describe(exc) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{exc.strerror} ({errno.errorcode.get(exc.errno, exc.errno)})"
    return f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------- defaults


def default_cache_dir() -> Path:
    """$CUDNN_FUSE_CACHE_DIR, else the user cache dir (platformdirs) of cudnn_fuse."""
    from . import env

    return Path(env.cache_dir())


def list_namespaces(path=None) -> list[str]:
    """The namespace directories (with a cache.db) under a cache root, sorted."""
    root = Path(path) if path is not None else default_cache_dir()
    try:
        return sorted(e.name for e in os.scandir(root)
                      if e.is_dir(follow_symlinks=False) and _NAMESPACE_RE.match(e.name)
                      and os.path.exists(os.path.join(e.path, DB_NAME)))
    except OSError:
        return []


_default_lock = threading.Lock()
# (CUDNN_FUSE_CACHE_DIR it was opened for, namespace) -> PlanCache | None: one per directory and per
# device environment, so a process with two GPU models keeps each one's plans under its own namespace
_defaults: dict = {}


def open_default_cache(device: int | None = None) -> PlanCache | None:
    """The process-wide cache of ``device``'s environment (default: the current CUDA device): None
    when CUDNN_FUSE_CACHE=0, or when it cannot be opened (then one warning). Devices whose
    fingerprints are equal (the same GPU model, driver and libraries) share one; reopened when
    $CUDNN_FUSE_CACHE_DIR changes."""
    if not envvars.flag(envvars.CACHE, True):
        return None
    from . import env

    configured = envvars.text(envvars.CACHE_DIR, "")
    if device is None:
        device = env._current_device()  # once: the key and the cache name the same device
    key = (configured, env.namespace(env.fingerprint(device)))
    with _default_lock:
        if key in _defaults:
            return _defaults[key]
        try:
            cache = PlanCache(device=device)
        except Exception as exc:  # noqa: BLE001 - no cache is a slower run, not a failed one
            log.warning("cannot open the plan cache (%r); running without it", exc)
            cache = None
        if cache is not None and cache.disabled is not None:
            cache = None  # PlanCache warned with the reason
        _defaults[key] = cache
        return cache


def _after_fork_in_child() -> None:
    global _default_lock
    _default_lock = threading.Lock()  # a thread of the parent may have held it
    for cache in list(_INSTANCES):
        cache._drop_inherited_connections()


def _flush_counters_at_exit() -> None:
    for cache in list(_INSTANCES):
        cache._touch(None)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_flush_counters_at_exit)
