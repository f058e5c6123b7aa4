"""Hits' access times are written in batches (not one write transaction per hit), yet every
reader of access times (eviction, prune) and the process's exit see them."""

import hashlib
import sqlite3
import time

from cudnn_fuse import cache as cache_module
from cudnn_fuse.cache import PlanCache, encode_entry

NS = "testns"
META = {"spec": {"op": "matmul"}}
BLOB = b"plan" * 50


def key(i) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def _column(root, k, column):
    con = sqlite3.connect(root / NS / "cache.db")
    try:
        return con.execute(f"SELECT {column} FROM Cache WHERE key = ?", (k,)).fetchone()[0]
    finally:
        con.close()


def access_time(root, k) -> float:
    return _column(root, k, "access_time")


def test_a_hit_is_written_later_not_per_get(cache_dir, monkeypatch):
    monkeypatch.setattr(cache_module, "ACCESS_FLUSH_S", 3600.0)
    c = PlanCache(cache_dir, namespace=NS)
    assert c.put(key(0), META, BLOB)
    stored = access_time(cache_dir, key(0))
    time.sleep(0.01)
    writes = []
    c._store._sql("SELECT 1")  # open the connection before counting
    real = c._touch
    monkeypatch.setattr(c, "_touch", lambda rowid: (writes.append(rowid), real(rowid)))
    for _ in range(5):
        assert c.get(key(0)) is not None
    assert writes == [] and access_time(cache_dir, key(0)) == stored
    c.close()  # exit and close flush what is pending
    assert access_time(cache_dir, key(0)) > stored


def test_hits_flush_once_the_interval_has_passed(cache_dir, monkeypatch):
    monkeypatch.setattr(cache_module, "ACCESS_FLUSH_S", 0.0)
    c = PlanCache(cache_dir, namespace=NS)
    assert c.put(key(0), META, BLOB)
    stored = access_time(cache_dir, key(0))
    time.sleep(0.01)
    assert c.get(key(0)) is not None
    assert access_time(cache_dir, key(0)) > stored
    c.close()


def test_prune_and_eviction_see_deferred_hits(cache_dir, monkeypatch):
    monkeypatch.setattr(cache_module, "ACCESS_FLUSH_S", 3600.0)
    size = len(encode_entry(key(0), META, BLOB))
    c = PlanCache(cache_dir, namespace=NS, size_limit=2 * size + 10)
    assert c.put(key(0), META, BLOB) and c.put(key(1), META, BLOB)
    con = sqlite3.connect(cache_dir / NS / "cache.db", isolation_level=None)
    con.execute("UPDATE Cache SET access_time = ?", (time.time() - 3600,))
    con.close()
    assert c.get(key(0)) is not None  # deferred: not in cache.db yet
    assert c.prune(older_than_s=60) == 1  # key 1 only: the pending hit of key 0 counts
    assert [k for k, _, _ in c.entries()] == [key(0)]
    assert c.put(key(1), META, BLOB) and c.get(key(0)) is not None
    assert c.put(key(2), META, BLOB)  # over the limit: least recently used is key 1, not key 0
    assert sorted(k for k, _, _ in c.entries()) == sorted([key(0), key(2)])
    c.close()


def access_count(root, k) -> int:
    return _column(root, k, "access_count")


def test_two_threads_flushing_at_once_raise_nothing_and_count_each_hit_once(cache_dir, monkeypatch):
    """Two threads' flushes of the same pending hit: the second one's removal of the flushed access
    time raised KeyError out of PlanCache.get (into the op that hit the cache), and both added the hit
    to access_count. One flush runs at a time now; the other thread skips. A pause in the pending
    dict's lookup holds the first flush open while the second starts."""
    import threading

    monkeypatch.setattr(cache_module, "ACCESS_FLUSH_S", 3600.0)
    c = PlanCache(cache_dir, namespace=NS)
    assert c.put(key(0), META, BLOB)
    before = access_count(cache_dir, key(0))

    class SlowGet(dict):
        def get(self, k, d=None):
            time.sleep(0.05)
            return dict.get(self, k, d)

    c._accessed = SlowGet()
    assert c.get(key(0)) is not None  # one pending hit, not flushed yet
    errors = []

    def flush():
        try:
            c._touch(None)
        except Exception as exc:  # noqa: BLE001 - what the test looks for
            errors.append(repr(exc))

    threads = [threading.Thread(target=flush) for _ in range(2)]
    threads[0].start()
    time.sleep(0.01)
    threads[1].start()
    for t in threads:
        t.join()
    assert errors == []
    assert access_count(cache_dir, key(0)) == before + 1
    assert dict(c._accessed) == {}
    c.close()
