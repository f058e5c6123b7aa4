"""Pre-warmed entries are pinned (docs/cache.md's fault case 15): what a pre-warm stores,
through the loader's own store, is never evicted for space, nor are the entries it finds
already cached (with the GEMM entry a 1x1 conv entry runs as); plain runs store unpinned
entries. A real PlanCache in a temporary directory and the loader's real write path; the plan
is a stand-in."""

from __future__ import annotations

import types

import pytest
import torch

import cudnn_fuse as cf
from cudnn_fuse import conv_gemm, loader, prewarm
from cudnn_fuse.cache import PlanCache
from cudnn_fuse.manifest import Entry

NS = "0" * 16


class _Graph:
    _plan_index = 0

    def __init__(self, blob=b"plan " * 400):
        self.blob = blob

    def get_engine_and_knobs_at_index(self, i):
        return 39, {}

    def serialize(self, as_bytes=True):
        return self.blob


def _plan(spec):
    return types.SimpleNamespace(spec=spec, device=0, graph=_Graph(), engine="eng39", workspace_size=0)


def _conv_spec(k=24):
    x = torch.randn(2, 16, 5, 3).half().contiguous(memory_format=torch.channels_last)
    w = torch.randn(k, 16, 1, 1).half().contiguous(memory_format=torch.channels_last)
    with cf.record() as rec:
        cf.conv2d(x, w, torch.randn(k).half(), activation="relu")
    return rec.entries[0].spec


@pytest.fixture
def store(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "stand-in GPU")

    def put(pc, spec, **kw):
        loader._store(pc, spec, spec.digest(), _plan(spec), kw.pop("tuned", True), [], 0.01, **kw)
    return put


def _pinned(pc) -> dict:
    return {info.key: info.pinned for info in pc.entry_info()}


def test_a_prewarm_build_pins_the_entry_and_its_record(tmp_path, store):
    pc = PlanCache(tmp_path / "c", namespace=NS)
    plain, warm = _conv_spec(24), _conv_spec(32)
    store(pc, plain)
    with loader.pinning():
        store(pc, warm)
    assert loader.pinning_now() is False  # the block ends the pinning
    pins = _pinned(pc)
    assert pins[plain.digest()] is False and pins[loader.engine_record_key(plain.digest())] is False
    assert pins[warm.digest()] is True and pins[loader.engine_record_key(warm.digest())] is True
    assert pc.get(warm.digest()).meta["pinned"] is True  # a rebuild from the record re-pins it
    assert "pinned" not in pc.get(plain.digest()).meta


def test_prewarmed_entries_survive_a_cache_over_its_size_limit(tmp_path, store):
    probe = PlanCache(tmp_path / "probe", namespace=NS)
    store(probe, _conv_spec(8))
    one = probe.stats()["bytes"]  # an entry and its record
    pc = PlanCache(tmp_path / "c", namespace=NS, size_limit=3 * one)
    warm = [_conv_spec(k) for k in (8, 16)]

    def builder(spec):
        store(pc, spec)

    rows = prewarm.prewarm([Entry(s) for s in warm], builder=builder, cache=pc)
    assert [r.status for r in rows] == ["built", "built"]
    for k in (24, 40, 48, 56):  # a later run's lazily built plans push the cache over its limit
        store(pc, _conv_spec(k))
    keys = set(_pinned(pc))
    for s in warm:
        assert s.digest() in keys and loader.engine_record_key(s.digest()) in keys
    assert _conv_spec(24).digest() not in keys  # the oldest plain entry went


def test_a_prewarm_pins_what_it_finds_cached_with_the_gemm_entry(tmp_path, store):
    pc = PlanCache(tmp_path / "c", namespace=NS)
    conv = _conv_spec(24)
    mspec = conv_gemm.gemm_spec(conv)
    store(pc, conv, use_gemm=True)
    store(pc, mspec)
    other = _conv_spec(32)
    store(pc, other)
    assert not any(_pinned(pc).values())
    rows = prewarm.prewarm([Entry(conv)], builder=lambda s: pytest.fail("built a cached entry"), cache=pc)
    assert [r.status for r in rows] == ["cached"]
    pins = _pinned(pc)
    for d in (conv.digest(), mspec.digest()):
        assert pins[d] is True and pins[loader.engine_record_key(d)] is True
    assert pins[other.digest()] is False
    assert pc.get(conv.digest()).meta["use_gemm"] is True  # the meta is kept, pinned added
    assert loader.pin_cached(pc, conv) == 0  # already pinned: nothing rewritten
    # a dry run writes nothing
    pc2 = PlanCache(tmp_path / "d", namespace=NS)
    store(pc2, other)
    prewarm.prewarm([Entry(other)], dry_run=True, builder=lambda s: None, cache=pc2)
    assert not any(_pinned(pc2).values())


def test_a_prewarm_leaves_the_caches_hit_and_miss_counts_alone(tmp_path, store):
    """A pre-warm's own looks (is it cached? pin what is) counted as plan lookups: a dry run of a
    manifest changed `cudnn-fuse cache stats`' hits and misses, and a pre-warm counted each built
    entry's miss twice (its look, then the loader's)."""
    pc = PlanCache(tmp_path / "c", namespace=NS)
    cached, missing = _conv_spec(24), _conv_spec(32)
    store(pc, cached)

    def counts():
        s = pc.stats()
        return s["hits"], s["misses"]

    before = counts()
    rows = prewarm.prewarm([Entry(cached), Entry(missing)], dry_run=True, builder=lambda s: None, cache=pc)
    assert [r.status for r in rows] == ["cached", "would build"] and counts() == before
    rows = prewarm.prewarm([Entry(cached), Entry(missing)], builder=lambda s: None, cache=pc)
    assert [r.status for r in rows] == ["cached", "built"] and counts() == before
    assert _pinned(pc)[cached.digest()] is True  # the cached entry was still found, and pinned
