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


def access_time(root, k) -> float:
    con = sqlite3.connect(root / NS / "cache.db")
    try:
        return con.execute("SELECT access_time FROM Cache WHERE key = ?", (k,)).fetchone()[0]
    finally:
        con.close()


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
