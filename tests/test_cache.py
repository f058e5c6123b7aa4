"""The plan cache in one process: entry format, verification, faults injected into files and
rows, namespaces, permissions, size limit and pinning, maintenance, export/import.

The fault cases of docs/cache.md 1, 2, 3 (the cache's part), 4, 5, 10, 12 (forced), 13 and 15 are here;
the multi-process cases are in test_cache_faults.py. Every test gets its own cache directory.
"""

import hashlib
import io
import json
import logging
import os
import pickle
import sqlite3
import stat
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cudnn_fuse import cache as cache_module
from cudnn_fuse import env
from cudnn_fuse.cache import (
    CacheEntry, CacheError, CorruptEntry, PlanCache, decode_entry, encode_entry,
    open_default_cache,
)

NS = "testns"
SMALL = b"plan-bytes " * 20  # inline in cache.db
LARGE = bytes(range(256)) * 200  # 51 KiB: a value file
META = {"spec": {"op": "conv2d", "dtype": "float16"}, "engine": {"id": 7, "knobs": {"split": 2}},
        "timings_ms": {"7": 0.09, "3": float("inf")}, "workspace_bytes": 1 << 20,
        "tuned_at": "2026-05-09T07:35:25", "host": "h200-1"}


def key(name) -> str:
    return hashlib.sha256(str(name).encode()).hexdigest()


K = key("k")


@pytest.fixture
def cache(cache_dir):
    c = PlanCache(cache_dir, namespace=NS)
    yield c
    c.close()


def db(root: Path, namespace=NS) -> sqlite3.Connection:
    return sqlite3.connect(root / namespace / "cache.db", isolation_level=None)


def row_of(root: Path, k: str):
    con = db(root)
    try:
        return con.execute("SELECT rowid, mode, filename, value FROM Cache WHERE key = ?",
                           (k,)).fetchone()
    finally:
        con.close()


def rewrite_value(root: Path, k: str, change) -> None:
    """Apply ``change(bytes) -> bytes`` to ``k``'s stored value, in cache.db or its file."""
    rowid, _, filename, value = row_of(root, k)
    if filename is None:
        con = db(root)
        con.execute("UPDATE Cache SET value = ? WHERE rowid = ?", (change(value), rowid))
        con.close()
    else:
        path = root / NS / filename
        path.write_bytes(change(path.read_bytes()))


def flip(offset: int):
    def change(data: bytes) -> bytes:
        i = offset % len(data)
        return data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1:]
    return change


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def modes(root: Path) -> dict:
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode)
            for p in [root, *root.rglob("*")]}


def snapshot(root: Path) -> dict:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")}


# ---------------------------------------------------------------- entry format


def test_entry_layout_is_header_key_meta_blob():
    data = encode_entry(K, META, LARGE)
    magic, version, key_len, meta_len, blob_len, digest = cache_module._HEADER.unpack_from(data)
    assert (magic, version, key_len, blob_len) == (b"CFPLAN", 1, 64, len(LARGE))
    body = data[cache_module._HEADER.size:]
    assert body[:64] == K.encode() and body[64 + meta_len:] == LARGE
    assert json.loads(body[64:64 + meta_len]) == META
    assert digest == hashlib.sha256(body).digest()
    assert decode_entry(K, data) == CacheEntry(K, META, LARGE)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(meta=st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8), max_size=4),
       blob=st.binary(max_size=300), where=st.integers(min_value=0), bit=st.integers(0, 7),
       cut=st.integers(min_value=1))
def test_any_flipped_bit_or_truncation_is_rejected(meta, blob, where, bit, cut):
    data = encode_entry(K, meta, blob)
    assert decode_entry(K, data) == CacheEntry(K, meta, blob)
    i = where % len(data)
    flipped = data[:i] + bytes([data[i] ^ (1 << bit)]) + data[i + 1:]
    with pytest.raises(CorruptEntry):
        decode_entry(K, flipped)
    with pytest.raises(CorruptEntry, match="truncated"):
        decode_entry(K, data[:len(data) - 1 - cut % len(data)])
    with pytest.raises(CorruptEntry, match="oversized"):
        decode_entry(K, data + b"\0")


def test_entry_for_another_key_is_rejected():
    with pytest.raises(CorruptEntry, match="key-mismatch"):
        decode_entry(key("other"), encode_entry(K, META, SMALL))


@pytest.mark.parametrize("bad_key, error", [(("conv", 1), TypeError), ("ABC", ValueError),
                                            ("", ValueError), ("0x12", ValueError)])
def test_keys_must_be_hex_strings(cache, bad_key, error):
    with pytest.raises(error, match="key"):
        cache.get(bad_key)
    with pytest.raises(error, match="key"):
        cache.put(bad_key, META, SMALL)


def test_blob_must_be_bytes_and_meta_json(cache):
    with pytest.raises(TypeError, match="blob"):
        cache.put(K, META, "not bytes")
    with pytest.raises(TypeError):
        cache.put(K, {"engine": object()}, SMALL)
    assert cache.put(K, META, bytearray(SMALL)) and cache.get(K).blob == SMALL


# ---------------------------------------------------------------- get / put


@pytest.mark.parametrize("blob, in_file", [(SMALL, False), (LARGE, True)], ids=["inline", "file"])
def test_put_then_get_returns_the_entry(cache, cache_dir, caplog, blob, in_file):
    assert cache.get(K) is None
    assert cache.put(K, META, blob)
    assert cache.get(K) == CacheEntry(K, META, blob)
    _, _, filename, value = row_of(cache_dir, K)
    assert (filename is not None) == in_file and (value is None) == in_file
    assert warnings(caplog) == []


def test_valid_checksum_nonsense_blob_is_returned_as_is(cache):
    """The cache cannot tell a nonsense plan from a real one: deserialize must (GPU test)."""
    nonsense = b"\xde\xad\xbe\xef" * 100
    assert cache.put(K, META, nonsense)
    assert cache.get(K).blob == nonsense


def test_put_replaces_an_entry_and_keeps_one_row(cache, cache_dir):
    assert cache.put(K, META, LARGE) and cache.put(K, {"v": 2}, SMALL)
    assert cache.get(K) == CacheEntry(K, {"v": 2}, SMALL)
    assert db(cache_dir).execute("SELECT count(*) FROM Cache").fetchone() == (1,)
    assert list(cache_dir.rglob("*.val")) == []  # the replaced value file went


def test_entries_read_meta_without_the_blob(cache, cache_dir):
    assert cache.put(K, META, LARGE) and cache.put(key(2), {"op": "matmul"}, SMALL)
    rewrite_value(cache_dir, K, lambda d: d[:-1000])  # a broken blob: entries() never reads it
    listed = {k: (meta, size) for k, meta, size in cache.entries()}
    assert listed[K][0] == META and listed[key(2)] == ({"op": "matmul"}, len(
        encode_entry(key(2), {"op": "matmul"}, SMALL)))
    assert cache.get(K) is None  # get() does verify


# ---------------------------------------------------------------- cases 1, 2: truncation, bit flips


@pytest.mark.parametrize("blob", [SMALL, LARGE], ids=["inline", "file"])
def test_truncated_value_is_dropped_with_one_warning(cache, cache_dir, caplog, blob):
    assert cache.put(K, META, blob) and cache.put(key(2), META, blob)
    rewrite_value(cache_dir, K, lambda d: d[: len(d) // 2])
    rewrite_value(cache_dir, key(2), lambda d: d[:40])
    assert cache.get(K) is None and cache.get(key(2)) is None
    warned = warnings(caplog)
    assert len(warned) == 1 and "[truncated]" in warned[0] and "dropped" in warned[0]
    assert row_of(cache_dir, K) is None and list(cache_dir.rglob("*.val")) == []
    assert cache.get(K) is None and len(warnings(caplog)) == 1  # gone: a plain miss now
    assert cache.put(K, META, blob) and cache.get(K).blob == blob  # rebuilt and stored again
    assert cache.stats()["faults"] == 2


@pytest.mark.parametrize("blob", [SMALL, LARGE], ids=["inline", "file"])
@pytest.mark.parametrize("offset, kind", [(0, "header"), (30, "checksum"), (200, "checksum"),
                                          (-1, "checksum")],
                         ids=["magic", "digest", "meta", "last-blob-byte"])
def test_flipped_bit_is_dropped_with_one_warning(cache, cache_dir, caplog, blob, offset, kind):
    assert cache.put(K, META, blob)
    rewrite_value(cache_dir, K, flip(offset))
    assert cache.get(K) is None
    warned = warnings(caplog)
    assert len(warned) == 1 and f"[{kind}]" in warned[0]
    assert row_of(cache_dir, K) is None


def test_missing_value_file_is_dropped(cache, cache_dir, caplog):
    assert cache.put(K, META, LARGE)
    next(cache_dir.rglob("*.val")).unlink()
    assert cache.get(K) is None
    assert "[missing-file]" in warnings(caplog)[0] and row_of(cache_dir, K) is None


# ---------------------------------------------------------------- case 4: pickle payloads


class _Touch:
    """Unpickling this creates ``path``: what a malicious row would do."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _live_payload(tmp_path, sentinel) -> bytes:
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_Touch(probe))).close()  # the payload really runs code
    assert probe.exists()
    return pickle.dumps(_Touch(sentinel))


@pytest.mark.parametrize("where", ["inline-value", "file-value", "key"])
def test_pickle_rows_run_no_code(cache, cache_dir, tmp_path, caplog, where):
    sentinel = tmp_path / "sentinel"
    payload = _live_payload(tmp_path, sentinel)
    assert cache.put(K, META, SMALL)
    con = db(cache_dir)
    if where == "inline-value":
        con.execute("UPDATE Cache SET mode = 4, value = ?, filename = NULL", (payload,))
    elif where == "file-value":
        (cache_dir / NS / "ab" / "cd").mkdir(parents=True)
        (cache_dir / NS / "ab" / "cd" / ("0" * 28 + ".val")).write_bytes(payload)
        con.execute("UPDATE Cache SET mode = 4, value = NULL, filename = ?",
                    ("ab/cd/" + "0" * 28 + ".val",))
    else:
        con.execute("INSERT INTO Cache (key, raw, store_time, access_time, mode, value)"
                    " VALUES (?, 0, 0, 0, 1, ?)", (payload, SMALL))
    con.close()
    got = cache.get(K)
    listed = list(cache.entries())
    stats = cache.stats()
    exported = cache.export(io.BytesIO())
    counts = cache.verify(orphan_grace_s=0)
    assert not sentinel.exists()
    if where == "key":
        assert got is not None and [k for k, _, _ in listed] == [K] and stats["entries"] == 2
        assert exported == 1 and (counts["bad"], counts["removed"]) == (1, 1)
    else:
        assert got is None and listed == [] and "[unsafe-row]" in warnings(caplog)[0]
        assert row_of(cache_dir, K) is None
    assert cache.stats()["entries"] == 1 - (where != "key")


def test_a_row_naming_a_foreign_file_is_refused_and_the_file_kept(cache, cache_dir, tmp_path,
                                                                    caplog):
    victim = tmp_path / "victim"
    victim.write_bytes(encode_entry(K, META, SMALL))
    assert cache.put(K, META, LARGE)
    con = db(cache_dir)
    con.execute("UPDATE Cache SET filename = ?", (os.path.relpath(victim, cache_dir / NS),))
    con.close()
    assert cache.get(K) is None
    assert "[unsafe-row]" in warnings(caplog)[0]
    assert victim.exists() and row_of(cache_dir, K) is None


# ---------------------------------------------------------------- case 5: environment drift


def test_another_namespace_is_a_clean_miss(cache_dir, caplog):
    ours, theirs = PlanCache(cache_dir, namespace="aaaa"), PlanCache(cache_dir, namespace="bbbb")
    assert ours.put(K, META, SMALL)
    assert theirs.get(K) is None and theirs.stats()["entries"] == 0
    assert theirs.put(K, {"theirs": True}, LARGE)
    assert ours.get(K).blob == SMALL and theirs.get(K).blob == LARGE
    assert sorted(p.name for p in cache_dir.iterdir()) == ["aaaa", "bbbb"]
    assert cache_module.list_namespaces(cache_dir) == ["aaaa", "bbbb"]
    assert warnings(caplog) == []


@pytest.mark.parametrize("field", env.FIELDS)
def test_fingerprint_drift_opens_a_new_namespace(cache_dir, monkeypatch, caplog, field):
    fp = {f: f"value-{f}" for f in env.FIELDS}
    monkeypatch.setattr(env, "fingerprint", lambda device=None: dict(fp))
    before = PlanCache(cache_dir)
    assert before.put(K, META, SMALL)
    fp[field] = "drifted"
    after = PlanCache(cache_dir)
    assert after.namespace != before.namespace and after.get(K) is None
    assert json.loads((after.dir / "fingerprint.json").read_text()) == fp
    assert warnings(caplog) == []


# ---------------------------------------------------------------- case 10: garbage cache.db


@pytest.mark.parametrize("garbage", [os.urandom(8192), b"SQLite format 3\0" + os.urandom(8176)],
                         ids=["random", "sqlite-header"])
def test_garbage_database_is_quarantined_and_recreated(cache_dir, caplog, garbage):
    first = PlanCache(cache_dir, namespace=NS)
    assert first.put(K, META, LARGE)
    first.close()
    (cache_dir / NS / "cache.db").write_bytes(garbage)
    cache = PlanCache(cache_dir, namespace=NS)
    assert cache.disabled is None and cache.get(K) is None
    warned = warnings(caplog)
    assert len(warned) == 1 and "[corrupt-database]" in warned[0] and "moved aside" in warned[0]
    aside = list((cache_dir / NS).glob("cache.db.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == garbage
    assert cache.put(K, META, SMALL) and cache.get(K).blob == SMALL
    assert cache.verify(orphan_grace_s=0)["orphans_removed"] == 1  # the old db's value file


def test_garbage_database_read_only_runs_uncached(cache_dir, caplog):
    (cache_dir / NS).mkdir(mode=0o700)
    (cache_dir / NS / "cache.db").write_bytes(os.urandom(4096))
    cache = PlanCache(cache_dir, namespace=NS, read_only=True)
    assert cache.get(K) is None and cache.put(K, META, SMALL) is False
    assert cache.disabled is not None and "[corrupt-database]" in warnings(caplog)[0]
    assert cache.get(K) is None and len(warnings(caplog)) == 1


# ---------------------------------------------------------------- case 12: read-only (forced)


def test_forced_read_only_serves_hits_and_writes_nothing(cache_dir, caplog):
    """The read-only mode itself, run as any user (root ignores chmod: test_cache_faults.py
    also runs it on a read-only mount or as a non-root user)."""
    warm = PlanCache(cache_dir, namespace=NS)
    assert warm.put(K, META, LARGE, pinned=True) and warm.put(key(2), META, SMALL)
    warm.close()
    before = snapshot(cache_dir)
    for p in [cache_dir, *cache_dir.rglob("*")]:
        os.chmod(p, 0o500 if p.is_dir() else 0o400)
    try:
        with caplog.at_level(logging.INFO, logger="cudnn_fuse"):
            cache = PlanCache(cache_dir, namespace=NS, read_only=True)
            assert cache.read_only and cache.get(K).blob == LARGE and cache.get(key(2)) is not None
            assert cache.get(key(3)) is None
            assert cache.put(key(3), META, SMALL) is False and cache.put(key(4), {}, b"") is False
            assert cache.delete(K) is False and cache.stats()["entries"] == 2
            with pytest.raises(CacheError, match="read-only"):
                cache.clear()
            assert cache.verify()["ok"] == 2
            cache.close()
    finally:
        for p in [cache_dir, *cache_dir.rglob("*")]:
            os.chmod(p, 0o700 if p.is_dir() else 0o600)
    assert snapshot(cache_dir) == before
    assert warnings(caplog) == []
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and "read-only" in infos[0]


def test_read_only_cache_of_a_missing_directory_misses_and_creates_nothing(tmp_path, caplog):
    cache = PlanCache(tmp_path / "absent", namespace=NS, read_only=True)
    assert cache.get(K) is None and cache.put(K, META, SMALL) is False
    assert cache.stats()["entries"] == 0 and list(cache.entries()) == []
    assert not (tmp_path / "absent").exists() and warnings(caplog) == []


# ---------------------------------------------------------------- case 13: unsafe directories


def _another_users_dir(tmp_path) -> Path:
    if os.geteuid() != 0:
        return Path("/")  # root's, not ours
    path = tmp_path / "theirs"
    path.mkdir(mode=0o700)
    os.chown(path, 65534, 65534)
    return path


@pytest.mark.parametrize("make, reason", [
    (lambda tmp: (tmp / "ww").mkdir() or os.chmod(tmp / "ww", 0o777) or tmp / "ww",
     "world-writable"),
    (lambda tmp: (tmp / "real").mkdir() or os.symlink(tmp / "real", tmp / "link") or tmp / "link",
     "symlink"),
    (_another_users_dir, "owned by uid"),
], ids=["world-writable", "symlink", "other-owner"])
def test_unsafe_cache_directory_is_refused(tmp_path, caplog, monkeypatch, make, reason):
    monkeypatch.setattr(cache_module, "_defaults", {})
    path = make(tmp_path)
    before = sorted(os.listdir(path))
    cache = PlanCache(path, namespace=NS)
    assert cache.disabled is not None and reason in cache.disabled
    assert cache.get(K) is None and cache.put(K, META, SMALL) is False
    warned = warnings(caplog)
    assert len(warned) == 1 and "[unsafe-dir]" in warned[0] and reason in warned[0]
    assert sorted(os.listdir(path)) == before  # nothing created in it
    monkeypatch.setenv("CUDNN_FUSE_CACHE_DIR", str(path))
    assert open_default_cache() is None


def test_unsafe_namespace_directory_is_refused(cache_dir):
    (cache_dir / NS).mkdir()
    os.chmod(cache_dir / NS, 0o777)
    assert "world-writable" in PlanCache(cache_dir, namespace=NS).disabled


def test_created_directories_are_0700_and_files_0600_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        root = tmp_path / "new" / "cache"
        cache = PlanCache(root, namespace=NS)
        assert cache.put(K, META, LARGE) and cache.put(key(2), META, SMALL)
        assert cache.get(K) is not None
        open_modes = modes(root)
        assert cache.export(tmp_path / "new" / "export.jsonl") == 2
        cache.close()
    finally:
        os.umask(old)
    assert {"testns/cache.db-wal", "testns/cache.db-shm"} <= set(open_modes)
    for name, mode in open_modes.items():
        assert mode == (0o700 if (root / name).is_dir() else 0o600), (name, oct(mode))
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "new" / "export.jsonl").stat().st_mode) == 0o600


# ---------------------------------------------------------------- case 15: size limit and pins


def test_least_recently_used_unpinned_entry_is_evicted_first(cache_dir):
    size = len(encode_entry(key(0), META, SMALL))
    cache = PlanCache(cache_dir, namespace=NS, size_limit=3 * size + 10)
    for i in range(3):
        assert cache.put(key(i), META, SMALL)
    assert cache.get(key(0)) is not None  # 0 is now more recent than 1
    assert cache.put(key(3), META, SMALL)
    assert sorted(k for k, _, _ in cache.entries()) == sorted([key(0), key(2), key(3)])
    assert cache.stats()["bytes"] == 3 * size


def test_pinned_entries_are_never_evicted(cache_dir, caplog):
    size = len(encode_entry(key(0), META, SMALL))
    cache = PlanCache(cache_dir, namespace=NS, size_limit=2 * size)
    for i in range(4):
        assert cache.put(key(i), META, SMALL, pinned=True)
    warned = warnings(caplog)
    assert len(warned) == 1 and "over its size limit" in warned[0]
    assert cache.put(key("u1"), META, SMALL) and cache.put(key("u2"), META, SMALL)
    assert {k for k, _, _ in cache.entries()} == {key(0), key(1), key(2), key(3), key("u2")}
    assert cache.put(key(0), {"replaced": True}, SMALL)  # an unpinned put keeps the pin
    assert {k for k, _, _ in cache.entries()} == {key(0), key(1), key(2), key(3)}
    assert cache.get(key(0)).meta == {"replaced": True}
    assert cache.stats()["pinned"] == 4 and len(warnings(caplog)) == 1
    assert cache.put(key("u3"), META, SMALL)
    assert cache.prune() == 1  # to size_limit: only the unpinned one can go
    assert cache.prune(max_bytes=0, include_pinned=True) == 4


def test_stats_report_the_hit_rate_across_processes(cache_dir):
    cache = PlanCache(cache_dir, namespace=NS)
    assert cache.get(K) is None and cache.put(K, META, SMALL)
    for _ in range(3):
        assert cache.get(K) is not None
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["hit_rate"]) == (3, 1, 0.75)
    assert (stats["entries"], stats["writes"], stats["faults"]) == (1, 1, 0)
    cache.close()
    later = PlanCache(cache_dir, namespace=NS)  # e.g. `cudnn-fuse cache stats`
    assert later.stats()["hit_rate"] == 0.75 and later.stats()["session_hits"] == 0


# ---------------------------------------------------------------- maintenance


def test_delete_and_clear(cache):
    assert cache.put(K, META, SMALL) and cache.put(key(2), META, LARGE, pinned=True)
    assert cache.delete(K) is True and cache.delete(K) is False and cache.get(K) is None
    assert cache.clear() == 1 and cache.stats()["entries"] == 0


def test_prune_older_than(cache, cache_dir):
    for i in range(3):
        assert cache.put(key(i), META, SMALL, pinned=i == 2)
    con = db(cache_dir)
    con.execute("UPDATE Cache SET access_time = ? WHERE key != ?", (time.time() - 3600, key(1)))
    con.close()
    assert cache.prune(older_than_s=60) == 1  # key 0: old and unpinned
    assert cache.prune(older_than_s=60, include_pinned=True) == 1  # key 2
    assert [k for k, _, _ in cache.entries()] == [key(1)]


def test_verify_removes_bad_entries_and_old_orphans(cache, cache_dir):
    for i in range(3):
        assert cache.put(key(i), META, LARGE if i else SMALL)
    rewrite_value(cache_dir, key(1), flip(-7))
    orphan = cache_dir / NS / "ee" / "ff" / ("1" * 28 + ".val")
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"half a plan")
    counts = cache.verify()
    faults = counts.pop("faults")
    assert counts == dict(checked=3, ok=2, bad=1, removed=1, orphans=1, orphans_removed=0, young_orphans=1)
    assert faults == [dict(key=key(1), op="conv2d", kind="checksum", detail="checksum: sha256 mismatch",
                           pinned=False, removed=True)]  # the young orphan may be a live writer's: no fault
    os.utime(orphan, (time.time() - 3600,) * 2)
    counts = cache.verify()
    faults = counts.pop("faults")
    assert counts == dict(checked=2, ok=2, bad=0, removed=0, orphans=1, orphans_removed=1, young_orphans=0)
    assert [(f["kind"], f["removed"], "ee/ff/" in f["detail"]) for f in faults] == [("orphan", True, True)]
    assert not orphan.parent.exists() and len(list(cache_dir.rglob("*.val"))) == 1


def test_maintenance_on_a_disabled_cache_raises(tmp_path):
    os.chmod(tmp_path, 0o777)
    cache = PlanCache(tmp_path, namespace=NS)
    for op in (cache.verify, cache.clear, cache.prune, lambda: cache.export(io.BytesIO())):
        with pytest.raises(CacheError, match="disabled"):
            op()


# ---------------------------------------------------------------- export / import


def test_export_import_round_trip(cache_dir, tmp_path):
    source = PlanCache(cache_dir, namespace=NS)
    source.fingerprint = {"gpu_name": "H200"}
    assert source.put(K, META, LARGE, pinned=True) and source.put(key(2), {}, SMALL)
    out = tmp_path / "plans.jsonl"
    assert source.export(out) == 2
    header = json.loads(out.read_text().splitlines()[0])
    assert header["namespace"] == NS and header["fingerprint"] == {"gpu_name": "H200"}
    target = PlanCache(tmp_path / "elsewhere", namespace=NS)
    assert target.import_(out) == dict(imported=2, skipped=0, rejected=0, failed=0)
    assert target.get(K) == CacheEntry(K, META, LARGE) and target.stats()["pinned"] == 1
    with open(out, "rb") as f:  # a binary file object works too; present entries are skipped
        assert target.import_(f) == dict(imported=0, skipped=2, rejected=0, failed=0)


def test_import_refuses_a_foreign_namespace_unless_forced(cache, tmp_path):
    assert cache.put(K, META, SMALL)
    text = io.StringIO()
    assert cache.export(text) == 1
    other = PlanCache(tmp_path / "other", namespace="elsewhere")
    with pytest.raises(ValueError, match=f"'{NS}'.*'elsewhere'"):
        other.import_(io.StringIO(text.getvalue()))
    assert other.get(K) is None
    assert other.import_(io.StringIO(text.getvalue()), force=True)["imported"] == 1


def test_import_rejects_tampered_entries(cache, tmp_path):
    for i in range(3):
        assert cache.put(key(i), META, SMALL)
    lines = io.StringIO()
    cache.export(lines)
    header, *records = lines.getvalue().splitlines()
    bad = json.loads(records[0])
    bad["entry"] = bad["entry"][:-8] + "AAAAAAA="  # bits changed, length kept
    records[0] = json.dumps(bad)
    records[1] = json.dumps({**json.loads(records[1]), "key": key("moved")})
    records.append("{not json")
    target = PlanCache(tmp_path / "t", namespace=NS)
    counts = target.import_(io.StringIO("\n".join([header, *records])))
    assert counts == dict(imported=1, skipped=0, rejected=3, failed=0)
    assert [k for k, _, _ in target.entries()] == [key(2)]


def test_import_takes_pinned_only_as_a_json_bool(cache, tmp_path):
    """A line whose "pinned" is not true/false is rejected: "false" (a string) used to pin its entry,
    and lines that are no JSON object are rejected too."""
    for i in range(4):
        assert cache.put(key(i), META, SMALL, pinned=i == 0)
    lines = io.StringIO()
    cache.export(lines)
    header, *records = lines.getvalue().splitlines()
    records[1] = json.dumps({**json.loads(records[1]), "pinned": "false"})
    records[2] = json.dumps({**json.loads(records[2]), "pinned": 1})
    records += ["[1, 2]", "7"]
    target = PlanCache(tmp_path / "t", namespace=NS)
    counts = target.import_(io.StringIO("\n".join([header, *records])))
    assert counts == dict(imported=2, skipped=0, rejected=4, failed=0)
    assert target.stats()["pinned"] == 1


def test_import_of_a_non_export_file_raises(cache, tmp_path):
    (tmp_path / "x").write_text('{"hello": 1}\n')
    with pytest.raises(ValueError, match="not a cudnn_fuse plan cache export"):
        cache.import_(tmp_path / "x")


# ---------------------------------------------------------------- the default cache


def test_default_cache_is_one_per_directory_and_can_be_disabled(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_module, "_defaults", {})  # restored after the test
    monkeypatch.setenv("CUDNN_FUSE_CACHE_DIR", str(tmp_path / "one"))
    first = open_default_cache()
    assert first is not None and first is open_default_cache()
    assert first.path == tmp_path / "one" and first.namespace == env.namespace()
    assert cache_module.default_cache_dir() == tmp_path / "one"
    monkeypatch.setenv("CUDNN_FUSE_CACHE_DIR", str(tmp_path / "two"))
    assert open_default_cache().path == tmp_path / "two"
    monkeypatch.setenv("CUDNN_FUSE_CACHE", "0")
    assert open_default_cache() is None


def test_default_cache_is_one_per_device_environment(tmp_path, monkeypatch):
    """A process with two GPU models keeps each model's plans under its own namespace: the default
    cache is opened for the device asked about (the loader's), not for the one
    current when the first cache was opened; devices with equal fingerprints share one."""
    from cudnn_fuse import loader

    monkeypatch.setattr(cache_module, "_defaults", {})
    monkeypatch.setenv("CUDNN_FUSE_CACHE_DIR", str(tmp_path))
    names = {0: "NVIDIA H200", 1: "NVIDIA A100-SXM4-80GB", 2: "NVIDIA H200"}
    real = env.fingerprint
    monkeypatch.setattr(env, "fingerprint", lambda device=None: dict(real(-1), gpu_name=names.get(device)))
    c0, c1, c2 = (open_default_cache(d) for d in (0, 1, 2))
    assert c0 is not None and c0 is c2 and c1 is not c0
    assert c1.namespace != c0.namespace and c1.fingerprint["gpu_name"] == "NVIDIA A100-SXM4-80GB"
    assert c0.namespace == env.namespace(env.fingerprint(0))
    assert c0.put(K, META, SMALL)
    assert c1.get(K) is None and c2.get(K).blob == SMALL  # the A100 never reads the H200's plan
    assert loader._cache(1) is c1 and loader._cache(0) is c0
    monkeypatch.setattr(env, "_current_device", lambda: 1)
    assert open_default_cache() is c1  # no device: the current one's
    with pytest.raises(ValueError, match="device"):
        PlanCache(tmp_path, device="cuda:1")


def test_threads_share_one_cache(cache):
    keys = [key(i) for i in range(6)]
    bad = []

    def worker():
        for k in keys:
            entry = cache.get(k)
            if entry is None:
                if not cache.put(k, META, LARGE if k[0] < "8" else SMALL):
                    bad.append(("put", k))
                entry = cache.get(k)
            if entry is None or entry.blob != (LARGE if k[0] < "8" else SMALL):
                bad.append(k)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert bad == []
    assert cache.stats()["faults"] == 0
    assert sorted(k for k, _, _ in cache.entries()) == sorted(keys)


@pytest.mark.parametrize("prune_at", ["mkdir", "chmod"])
def test_a_value_file_is_written_when_another_process_prunes_its_new_directory(tmp_path, monkeypatch, prune_at):
    """Another process's remove() deletes an empty value directory, even one this process has just made
    (between its mkdir and chmod, or before its mkdir of the subdirectory): the write tries again."""
    pruned = []
    real = {"mkdir": os.mkdir, "chmod": os.chmod}

    def racing(path, mode, *args, **kwargs):
        p = Path(path)
        if not pruned and p.name == "cd":
            pruned.append(p)
            if prune_at == "chmod":  # made, then pruned by the other process before the chmod
                os.rmdir(p)
            else:  # its parent pruned before this mkdir
                os.rmdir(p.parent)
        return real[prune_at](path, mode, *args, **kwargs)

    monkeypatch.setattr(cache_module.os, prune_at, racing)
    target = tmp_path / "ns" / "ab" / "cd" / ("0" * 28 + ".val")
    cache_module._write_private_file(str(target), LARGE)
    assert pruned and target.read_bytes() == LARGE
    assert stat.S_IMODE(target.parent.stat().st_mode) == 0o700 and stat.S_IMODE(target.stat().st_mode) == 0o600


@pytest.mark.parametrize("call,exc,match", [
    (lambda c: c.prune(older_than_s=-3600), ValueError, "older_than_s must be finite and at least 0"),
    (lambda c: c.prune(older_than_s=float("nan")), ValueError, "older_than_s"),
    (lambda c: c.prune(older_than_s="1d"), TypeError, "older_than_s must be seconds"),
    (lambda c: c.prune(max_bytes="1"), TypeError, "max_bytes must be an int"),
    (lambda c: c.prune(max_bytes=-5), ValueError, "max_bytes must be at least 0"),
    (lambda c: c.prune(max_bytes=True), TypeError, "max_bytes"),
    (lambda c: c.prune(include_pinned="no"), TypeError, "include_pinned must be a bool"),
    (lambda c: c.put(key("p"), {}, b"x", pinned="no"), TypeError, "pinned must be a bool"),
], ids=["negative-age", "nan-age", "age-string", "bytes-string", "negative-bytes", "bytes-bool", "pinned-string",
        "put-pinned-string"])
def test_a_bad_argument_is_refused_naming_it_and_nothing_is_removed(cache, call, exc, match):
    """A negative age would remove every entry; a string flag such as "no" is true."""
    cache.put(key("kept"), META, SMALL)
    with pytest.raises(exc, match=match):
        call(cache)
    assert cache.get(key("kept")) is not None and cache.get(key("p")) is None


def test_read_only_must_be_a_bool_or_none(cache_dir):
    with pytest.raises(TypeError, match="read_only must be a bool"):
        PlanCache(cache_dir, namespace=NS, read_only="no")
    assert PlanCache(cache_dir, namespace=NS, read_only=None).read_only is False
