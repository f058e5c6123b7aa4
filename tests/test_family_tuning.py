"""Autotuning per shape family (loader._from_family): a size near one its family was tuned at takes that
tuning's engine without a tuning of its own; a size far from every tuned one is tuned and becomes another
anchor; explicit tuning (per_family=False), an engine that does not build, a barred engine and a damaged
family record all fall back to tuning. cuDNN, the tuner and the GPU are stood in for on the CPU."""

from __future__ import annotations

import types

import pytest

from cudnn_fuse import autotune, families, loader, plans, torch_engine
from cudnn_fuse.cache import PlanCache
from tuning import StoredGraph, StoredPlan, family_spec, stand_in_device


@pytest.fixture
def env(tmp_path, monkeypatch):
    ns = types.SimpleNamespace(pc=PlanCache(tmp_path / "cache", namespace="family_test"), tuned=[], rebuilt=[],
                               winner_engine=39, use_torch=False, rebuild_fails=False)
    stand_in_device(monkeypatch, ns.pc)
    monkeypatch.setattr(loader, "build_graph", lambda spec, h: StoredGraph(ns.winner_engine))
    monkeypatch.setattr(loader, "prepare", lambda g, spec: None)
    monkeypatch.setattr(loader, "Plan", StoredPlan)
    monkeypatch.setattr(loader, "_deserialize", lambda spec, entry, device: StoredPlan(
        spec, StoredGraph(entry.meta["engine_id"]), device))
    monkeypatch.setattr(autotune, "autotune_enabled", lambda: True)
    monkeypatch.setattr(autotune, "torch_wins", lambda w, t: ns.use_torch)
    monkeypatch.setattr(autotune, "gemm_wins", lambda w, t: False)

    def tune(g, spec, h, device, uids, roles, get_plan=None):
        ns.tuned.append(families.sizes(spec)["m"])
        return None, types.SimpleNamespace(index=0), []

    def rebuild(spec, engine_id, knobs, device):
        if ns.rebuild_fails:
            raise loader.UnsupportedError("no such engine at this size")
        ns.rebuilt.append((families.sizes(spec)["m"], engine_id, knobs))
        return StoredPlan(spec, StoredGraph(engine_id), device)

    monkeypatch.setattr(autotune, "tune", tune)
    monkeypatch.setattr(loader, "rebuild", rebuild)
    return ns


def _anchors(env, spec):
    rec = env.pc.get(loader.family_record_key(families.family(spec)), count=False)
    return [a["sizes"]["m"] for a in rec.meta["anchors"]] if rec is not None else []


def test_a_size_near_a_tuned_one_takes_its_engine_and_a_far_one_is_tuned(env):
    first = loader.load_or_build(family_spec(1024), 0)
    assert env.tuned == [1024] and first.engine == "eng39" and _anchors(env, family_spec(1024)) == [1024]
    near = loader.load_or_build(family_spec(3000), 0)  # within 4x of 1024
    assert env.tuned == [1024] and env.rebuilt == [(3000, 39, {"k24": 7})] and near.engine == "eng39"
    assert loader.STATS.family_hits == 1
    meta = env.pc.get(loader.cache_digest(family_spec(3000))).meta
    assert meta["tuned"] is True and meta["family_anchor"] == {"batch": 1, "m": 1024}
    assert loader.load_or_build(family_spec(3000), 0).engine == "eng39" and env.rebuilt == [(3000, 39, {"k24": 7})]
    env.winner_engine = 41
    far = loader.load_or_build(family_spec(8192), 0)  # 8x from 1024, 2.7x from 3000, which is no anchor
    assert env.tuned == [1024, 8192] and far.engine == "eng41" and _anchors(env, family_spec(1)) == [1024, 8192]
    loader.load_or_build(family_spec(6000), 0)  # nearest anchor: 8192
    assert env.rebuilt[-1] == (6000, 41, {"k24": 7})


def test_explicit_tuning_tunes_the_size_itself(env, monkeypatch):
    loader.load_or_build(family_spec(1024), 0)
    monkeypatch.setattr(autotune, "DEFAULT_CONFIG", autotune.Config(per_family=False))
    loader.load_or_build(family_spec(2048), 0)
    assert env.tuned == [1024, 2048] and env.rebuilt == []


def test_an_anchor_engine_that_does_not_build_at_the_size_means_a_tuning(env):
    loader.load_or_build(family_spec(1024), 0)
    env.rebuild_fails = True
    loader.load_or_build(family_spec(2048), 0)
    assert env.tuned == [1024, 2048] and loader.STATS.family_hits == 0


def test_a_family_tuned_to_torchs_kernels_runs_them_at_a_near_size(env):
    env.use_torch = True
    assert isinstance(loader.load_or_build(family_spec(1024), 0), torch_engine.TorchPlan)
    near = loader.load_or_build(family_spec(512), 0)
    assert isinstance(near, torch_engine.TorchPlan) and env.tuned == [1024]


def test_a_barred_anchor_engine_is_not_taken(env, monkeypatch):
    loader.load_or_build(family_spec(1024), 0)
    monkeypatch.setattr(loader, "barred_engines", lambda spec: {39})
    loader.load_or_build(family_spec(2048), 0)
    assert env.rebuilt == [] and env.tuned == [1024, 2048]


@pytest.mark.parametrize("anchors", ["not a list", [1, None, {"sizes": "m=1024"}, {"sizes": {"m": 0, "batch": 1}},
                                                    {"sizes": {"batch": 1, "m": 1024}, "engine_id": "39"}]])
def test_a_damaged_family_record_means_a_tuning(env, anchors):
    env.pc.put(loader.family_record_key(families.family(family_spec(1024))), {"kind": "family-record", "anchors": anchors},
               b"")
    loader.load_or_build(family_spec(1024), 0)
    assert env.tuned == [1024] and env.rebuilt == []
    assert _anchors(env, family_spec(1024)) == [1024]  # the damaged anchors are dropped from the record


def test_heuristic_plans_and_specs_of_no_family_leave_family_records_alone(env, monkeypatch):
    monkeypatch.setattr(autotune, "autotune_enabled", lambda: False)
    monkeypatch.setattr(loader, "finalize", lambda g, spec: None)
    monkeypatch.setattr(loader, "torch_check", lambda plan, spec, device: None)
    loader.load_or_build(family_spec(1024), 0)
    assert _anchors(env, family_spec(1024)) == []


def test_nearest_anchor_takes_the_closest_within_reach():
    a = [{"sizes": {"m": 100}}, {"sizes": {"m": 1000}}, {"sizes": {"m": 10}, "x": 1}]
    assert loader.nearest_anchor(a, {"m": 300})["sizes"] == {"m": 100}
    assert loader.nearest_anchor(a, {"m": 700})["sizes"] == {"m": 1000}
    assert loader.nearest_anchor(a, {"m": 5000}) is None  # 5x from 1000
    assert loader.nearest_anchor(a, {"m": 300, "batch": 1}) is None  # other dimensions
    assert loader.nearest_anchor(None, {"m": 3}) is None


def test_a_family_record_a_prewarm_pinned_stays_pinned_when_a_later_size_is_tuned(env):
    with loader.pinning():
        loader.load_or_build(family_spec(1024), 0)
    loader.load_or_build(family_spec(16384), 0)  # far: tuned outside the pre-warm, added to the record
    key = loader.family_record_key(families.family(family_spec(1024)))
    assert {i.key: i.pinned for i in env.pc.entry_info()}[key] is True
    assert _anchors(env, family_spec(1024)) == [1024, 16384]


def test_a_fresh_process_takes_the_familys_engine_from_the_plan_cache(env, tmp_path, monkeypatch):
    """The family record is an entry of the plan cache: another process (a new PlanCache on the same
    directory, nothing in memory) meets a new size of the family without tuning it."""
    loader.load_or_build(family_spec(1024), 0)
    fresh = PlanCache(env.pc.path, namespace="family_test")
    monkeypatch.setattr(loader, "_cache", lambda device=None: fresh)
    monkeypatch.setattr(loader, "STATS", plans._Stats())
    loader.clear()
    plan = loader.load_or_build(family_spec(2000), 0)
    assert env.tuned == [1024] and loader.STATS.family_hits == 1 and plan.engine == "eng39"
