"""An audit of the autotuner's selection and the loader's order (memory -> disk -> engine record ->
build) on the CPU: timings, budgets and build results are injected, the plans are stand-ins, the
cache is a real PlanCache in a temporary directory. Each test here failed before its fix."""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import threading
import types

import pytest
import torch

from cudnn_fuse import autotune, loader, plans
from cudnn_fuse.autotune import Candidate, Config, select
from cudnn_fuse.cache import PlanCache
from cudnn_fuse.spec import Epilogue, MatmulSpec, TensorSpec, spec_from_dict

NS = "0" * 16
HEURISTIC, TUNED = 39, 7  # the engines the stand-in heuristics and tuner pick
_REBUILD = loader.rebuild  # the real one (the fixture stands one in)


def _mm(act=None):
    a = TensorSpec.contiguous((1, 64, 32), "float16")
    b = TensorSpec((1, 32, 48), (1536, 1, 32), "float16")
    y = TensorSpec.contiguous((1, 64, 48), "float16")
    return MatmulSpec(a, b, y, Epilogue(activation=act))


class _Graph:
    _plan_index = 0

    def __init__(self, engine_id):
        self.engine_id = engine_id

    def get_engine_and_knobs_at_index(self, i):
        return self.engine_id, {}

    def serialize(self, as_bytes=True):
        return b"plan of engine %d" % self.engine_id


class _Plan:
    def __init__(self, spec, graph, device, engine=None):
        self.spec, self.graph, self.device = spec, graph, device
        self.engine, self.workspace_size = engine or f"eng{graph.engine_id}", 0


@pytest.fixture
def env(tmp_path, monkeypatch):
    """The loader over a real PlanCache with cuDNN stood in for: heuristics pick engine 39, the tuner
    engine 7, a blob deserializes to its entry's engine, a record rebuilds its engine. ``env.calls``
    says which of them ran."""
    pc = PlanCache(tmp_path / "cache", namespace=NS)
    calls = []
    monkeypatch.setattr(loader, "_cache", lambda device=None: ns.pc)
    monkeypatch.setattr(loader, "STATS", plans._Stats())
    monkeypatch.setattr(loader, "_warned", set())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "stand-in GPU")
    monkeypatch.setattr(loader, "handle_for", lambda d: types.SimpleNamespace(handle=None))
    monkeypatch.setattr(loader, "held", lambda h, d: contextlib.nullcontext())
    monkeypatch.setattr(loader, "build_graph", lambda spec, h: _Graph(HEURISTIC))
    monkeypatch.setattr(loader, "finalize", lambda g, spec: calls.append("heuristic build"))
    monkeypatch.setattr(loader, "prepare", lambda g, spec: None)
    monkeypatch.setattr(loader, "Plan", _Plan)
    monkeypatch.setattr(autotune, "_enabled", False)

    def tune(g, spec, h, device, uids, roles, get_plan=None):
        calls.append("tune")
        g.engine_id = TUNED
        w = autotune.Timing(0, f"eng{TUNED}", TUNED, {}, 0, first_ms=1.0, median_ms=1.0, status="timed")
        return 0, w, [w]

    def deserialize(spec, entry, device):
        calls.append("deserialize")
        return _Plan(spec, _Graph(entry.meta["engine_id"]), device, engine=entry.meta.get("engine_name"))

    def rebuild(spec, engine_id, knobs, device):
        calls.append("rebuild")
        return _Plan(spec, _Graph(int(engine_id)), device)

    monkeypatch.setattr(autotune, "tune", tune)
    monkeypatch.setattr(loader, "_deserialize", deserialize)
    monkeypatch.setattr(loader, "rebuild", rebuild)
    ns = types.SimpleNamespace(pc=pc, calls=calls, dir=tmp_path / "cache")
    return ns


def _warnings(caplog) -> list:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _fake(first: dict, median: dict):
    def run_once(c):
        return first[c.index]

    def time_candidate(c):
        return median[c.index]

    return run_once, time_candidate


def _cands(n):
    return [Candidate(index=i, name=f"eng{i}") for i in range(n)]


# ---------------------------------------------------------------- select(): timings and the budget


def test_a_negative_timing_is_a_failure_not_the_fastest():
    """A negative first run was taken as the best one: it pruned every other candidate (each over
    2x a negative time) and won with its impossible time. Now it scores inf, like NaN."""
    winner, timings = select(_cands(3), *_fake({0: 1.0, 1: -1.0, 2: 1.1}, {0: 1.0, 1: 0.5, 2: 0.8}), Config())
    assert [t.status for t in timings] == ["timed", "failed", "timed"]
    assert winner.index == 2 and winner.median_ms == 0.8
    winner, timings = select(_cands(2), *_fake({0: 1.0, 1: 1.0}, {0: 1.0, 1: -5.0}), Config())
    assert timings[1].status == "failed" and winner.index == 0


def test_a_negative_torch_or_gemm_timing_does_not_win():
    cfg = Config(warmup=1)
    t = autotune.torch_timing(lambda: None, lambda: -1.0, cfg)
    assert t.status == "failed"
    winner = autotune.Timing(0, "eng0", 0, {}, 0, first_ms=1.0, median_ms=1.0, status="timed")
    assert not autotune.torch_wins(winner, [winner, t])
    plan = types.SimpleNamespace(engine="eng1", workspace_size=0, run=lambda bufs: None)
    g = autotune.gemm_timing(lambda: plan, [[]], cfg, median_of=lambda run: -1.0)
    assert g.status == "failed" and not autotune.gemm_wins(winner, [winner, g])


@pytest.mark.parametrize("budget", [0.0, 1e-9])
def test_a_spent_budget_still_gives_the_first_candidate_that_runs(budget):
    """With CUDNN_FUSE_TUNE_BUDGET_S=0 (or any budget spent before a candidate had run) every
    candidate was marked "budget" and select raised "no candidate ran": the tuned op then fell back
    to PyTorch for the process, where the heuristic plan would have run. The clock here advances a
    microsecond a reading, as a real one does."""
    ticks = itertools.count()
    clock = lambda: next(ticks) * 1e-6  # noqa: E731
    winner, timings = select(_cands(3), *_fake({0: 1.0, 1: 0.5, 2: 0.7}, {0: 1.0, 1: 0.5, 2: 0.7}),
                             Config(budget_s=budget), clock=clock)
    assert winner.index == 0 and winner.median_ms == 1.0  # the first (best ranked) candidate, run once
    assert [t.status for t in timings] == ["budget"] * 3


def test_a_failing_first_candidate_that_spends_the_budget_leaves_the_next_one_to_run():
    clock = types.SimpleNamespace(t=0.0)

    def run_once(c):
        clock.t += 5.0  # each run takes 5 s of a 2 s budget
        if c.index == 0:
            raise RuntimeError("launch failed")
        return 1.0

    winner, timings = select(_cands(3), run_once, lambda c: 1.0, Config(budget_s=2.0), clock=lambda: clock.t)
    assert winner.index == 1
    assert timings[0].status.startswith("failed:RuntimeError") and timings[2].status == "budget"


# ---------------------------------------------------------------- the loader: wrong-typed metadata


@pytest.mark.parametrize("engine_id", ["abc", [1], {"id": 1}])
@pytest.mark.parametrize("where", ["entry", "record"])
def test_an_engine_id_that_is_no_integer_is_a_miss_with_one_warning(env, caplog, engine_id, where):
    """An entry (or engine record) whose engine_id is valid JSON but no integer raised ValueError or
    TypeError out of the loader (engines.barred_engines' check ran int() on it), so the op failed."""
    spec = _mm()
    digest = loader.cache_digest(spec)
    meta = {"engine_id": engine_id, "knobs": {}, "tuned": False}
    if where == "entry":
        env.pc.put(digest, meta, b"blob")
    else:
        env.pc.put(loader.engine_record_key(digest), dict(meta, kind="engine-record"), b"")
    with caplog.at_level(logging.WARNING, logger="cudnn_fuse"):
        plan = loader.load_or_build(spec, 0)
        loader.load_or_build(spec, 0)  # the fresh entry now loads: no second warning
    assert plan.graph.engine_id == HEURISTIC and env.calls[0] == "heuristic build"
    assert "deserialize" in env.calls[1:]
    assert len(_warnings(caplog)) == 1 and repr(engine_id) in _warnings(caplog)[0]
    assert env.pc.get(digest).meta["engine_id"] == HEURISTIC  # the bad entry was replaced


def test_record_knobs_of_the_wrong_type_fall_back_to_a_build_with_one_warning(env, caplog, monkeypatch):
    """Probed, already right: a record whose knobs are a list fails its rebuild, which is a miss."""
    graph = types.SimpleNamespace(validate=lambda: None, build_operation_graph=lambda: None,
                                  create_execution_plan=lambda eid, knobs: pytest.fail("garbage knobs reached cuDNN"))
    monkeypatch.setattr(loader, "rebuild", _REBUILD)
    monkeypatch.setattr(loader, "build_graph", lambda spec, h: graph)
    monkeypatch.setattr(loader, "finalize", lambda g, spec: env.calls.append("heuristic build"))
    monkeypatch.setattr(loader, "Plan", lambda spec, g, device, engine=None: _Plan(spec, _Graph(HEURISTIC), device))
    spec = _mm()
    digest = loader.cache_digest(spec)
    env.pc.put(loader.engine_record_key(digest), {"kind": "engine-record", "engine_id": 5, "knobs": ["x", 1],
                                                   "tuned": False}, b"")
    with caplog.at_level(logging.WARNING, logger="cudnn_fuse"):
        plan = loader.load_or_build(spec, 0)
    assert plan.graph.engine_id == HEURISTIC and env.calls == ["heuristic build"]
    assert len(_warnings(caplog)) == 1 and "could not rebuild engine 5" in _warnings(caplog)[0]


# ---------------------------------------------------------------- the loader: entries restored and replaced


def test_an_entry_restored_from_its_engine_record_is_a_plan_entry(env):
    """A blob entry dropped as corrupt is rebuilt from its engine record and stored again; it was
    stored with the record's own metadata, so the plan entry said kind "engine-record" (is_engine_record
    true: listings and tests that skip records skipped it) and carried no spec (cache verify's barred
    check skips entries without one)."""
    spec = _mm()
    digest = loader.cache_digest(spec)
    loader.load_or_build(spec, 0)
    env.pc.delete(digest)  # what a checksum failure does to it
    plan = loader.load_or_build(spec, 0)
    assert env.calls == ["heuristic build", "rebuild"] and plan.graph.engine_id == HEURISTIC
    meta = env.pc.get(digest).meta
    assert not loader.is_engine_record(meta)
    assert spec_from_dict(meta["spec"]) == spec and meta["engine_id"] == HEURISTIC
    assert loader.is_engine_record(env.pc.get(loader.engine_record_key(digest)).meta)


def _tuned_elsewhere(env, spec, digest):
    """Another process's store of its tuned plan (its own PlanCache on the same directory)."""
    other = PlanCache(env.dir, namespace=NS)
    loader._store(other, spec, digest, _Plan(spec, _Graph(TUNED), 0), True, [], 1.0, 0)
    other.close()


def test_a_heuristic_store_never_replaces_a_tuned_entry(env, monkeypatch):
    """A process building heuristics (autotune off) that missed the key stored its plan over the
    tuned entry another process stored while it built: the tuning was lost, and every later tuning
    process tuned the key again."""
    spec = _mm()
    digest = loader.cache_digest(spec)

    def build_graph(spec_, h):
        _tuned_elsewhere(env, spec_, digest)  # stored while this process builds
        return _Graph(HEURISTIC)

    monkeypatch.setattr(loader, "build_graph", build_graph)
    plan = loader.load_or_build(spec, 0)
    assert plan.graph.engine_id == HEURISTIC  # this process runs what it built
    for key in (digest, loader.engine_record_key(digest)):
        meta = env.pc.get(key).meta
        assert meta["tuned"] is True and meta["engine_id"] == TUNED
    monkeypatch.setattr(autotune, "_enabled", True)
    assert loader.load_or_build(spec, 0).graph.engine_id == TUNED  # served, not tuned again
    assert env.calls == ["heuristic build", "deserialize"]


@pytest.mark.parametrize("flag", ["false", "no", 1, None])
def test_only_a_json_true_marks_an_entry_tuned(env, monkeypatch, flag):
    """An imported or hand-made entry whose "tuned" was the string "false" read as tuned (truthiness):
    a tuning process served its heuristic plan and never tuned the key. Only True counts."""
    spec = _mm()
    digest = loader.cache_digest(spec)
    meta = {"engine_id": HEURISTIC, "knobs": {}, "spec": spec.to_dict()}
    if flag is not None:
        meta["tuned"] = flag
    env.pc.put(digest, meta, b"plan of engine %d" % HEURISTIC)
    assert not loader.is_tuned(env.pc.get(digest).meta)
    monkeypatch.setattr(autotune, "_enabled", True)
    assert loader.load_or_build(spec, 0).graph.engine_id == TUNED
    assert env.calls == ["tune"]  # tuned at once: the heuristic entry is not served first
    assert env.pc.get(digest).meta["tuned"] is True


def test_a_heuristic_store_replaces_a_tuned_entry_of_a_barred_engine(env):
    spec = _mm("gelu")  # GEMM eng0 is barred for GELU
    digest = loader.cache_digest(spec)
    env.pc.put(digest, {"engine_id": 0, "knobs": {}, "tuned": True}, b"blob")
    loader.load_or_build(spec, 0)
    assert env.calls == ["heuristic build"]
    assert env.pc.get(digest).meta["engine_id"] == HEURISTIC and env.pc.get(digest).meta["tuned"] is False


def test_a_prewarmed_entry_stays_pinned_through_its_tuned_upgrade_and_a_restore(env, monkeypatch):
    """A pre-warmed (pinned) heuristic entry upgraded by a tuning in a plain run kept its pinned tag
    but lost "pinned" from its metadata and its record's; once its blob was dropped as corrupt, the
    entry restored from the record was stored unpinned, and could be evicted."""
    spec = _mm()
    digest = loader.cache_digest(spec)
    with loader.pinning():
        loader.load_or_build(spec, 0)
    monkeypatch.setattr(autotune, "_enabled", True)
    loader.load_or_build(spec, 0)  # the upgrade, outside any pre-warm
    assert env.calls == ["heuristic build", "tune"]
    assert env.pc.get(digest).meta["pinned"] is True
    env.pc.delete(digest)  # a checksum failure drops the entry
    assert loader.load_or_build(spec, 0).graph.engine_id == TUNED
    assert env.calls[-1] == "rebuild"
    pinned = {info.key: info.pinned for info in env.pc.entry_info()}
    from cudnn_fuse import families

    # the shape family's record of a pre-warmed size is pinned too
    assert pinned == {digest: True, loader.engine_record_key(digest): True,
                      loader.family_record_key(families.family(spec)): True}


# ---------------------------------------------------------------- the tune lock and the counters


def test_a_read_only_cache_takes_no_tune_lock(env, monkeypatch):
    """On a read-only cache nothing a tuner finds can be stored, yet processes took the tune lock:
    each waited (up to CUDNN_FUSE_TUNE_WAIT_S, 60 s) for another's whole tuning and then tuned again
    itself, or ran heuristics. Here another process holds the lock and the wait bound is 0."""
    env.pc = PlanCache(env.dir, namespace=NS, read_only=True)
    monkeypatch.setattr(loader, "TUNE_WAIT_S", 0.0)
    monkeypatch.setattr(autotune, "_enabled", True)
    spec = _mm()
    holder = PlanCache(env.dir, namespace=NS)
    with loader._tune_lock(holder, loader.cache_digest(spec)) as mine:
        assert mine is True
        plan = loader.load_or_build(spec, 0)
    assert env.calls == ["tune"] and plan.graph.engine_id == TUNED
    assert env.pc.get(loader.cache_digest(spec)) is None  # nothing stored


def test_a_load_after_waiting_for_the_tune_lock_counts_its_seconds(env, monkeypatch):
    """A process that waited for the tuner and loaded its result counted a load but none of its
    seconds (plan_stats' load_seconds / loads read low)."""
    monkeypatch.setattr(autotune, "_enabled", True)
    spec = _mm()
    digest = loader.cache_digest(spec)
    ticks = threading.local()

    def perf_counter():
        ticks.n = getattr(ticks, "n", 0) + 1
        return float(ticks.n)

    @contextlib.contextmanager
    def tuned_meanwhile(pc, d):
        _tuned_elsewhere(env, spec, d)
        yield False

    monkeypatch.setattr(loader, "_tune_lock", tuned_meanwhile)
    monkeypatch.setattr(loader, "time", types.SimpleNamespace(perf_counter=perf_counter))
    assert loader.load_or_build(spec, 0).graph.engine_id == TUNED
    assert env.calls == ["deserialize"] and env.pc.get(digest).meta["tuned"] is True
    assert loader.STATS.loads == 1 and loader.STATS.builds == 0
    assert loader.STATS.load_seconds > 0 and math.isfinite(loader.STATS.load_seconds)


def test_a_cold_plan_is_one_miss_and_a_record_rebuild_one_miss_no_hit(env):
    """A cold build counted two misses (the entry, then its engine record), so `cache stats` read a
    low hit rate; the record's lookup is not a plan lookup of its own."""
    spec = _mm()
    loader.load_or_build(spec, 0)
    s = env.pc.stats()
    assert (s["hits"], s["misses"]) == (0, 1)
    env.pc.delete(loader.cache_digest(spec))  # the entry gone, its record left: rebuilt from the record
    env.calls.clear()
    loader.load_or_build(spec, 0)
    assert env.calls == ["rebuild"]
    s = env.pc.stats()
    assert (s["hits"], s["misses"]) == (0, 2)
    loader.load_or_build(spec, 0)  # the restored entry
    s = env.pc.stats()
    assert (s["hits"], s["misses"]) == (1, 2)
