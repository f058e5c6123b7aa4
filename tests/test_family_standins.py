"""A new size of a known shape family runs torch's kernels at once (loader.StandIn) and gets its own plan
on a later call of its own (STANDIN_CALLS), swapped in; the family is known from a plan of another size
in this process or from its record in the plan cache (a fresh process). Sizes on disk, unknown families,
families-less specs, deterministic mode, autotuning and captures keep the old way; cache faults mean a
build, never a failed op. cuDNN, the torch check and the GPU are stood in for on the CPU."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from cudnn_fuse import families, loader, ops, torch_engine
from cudnn_fuse.cache import PlanCache
from cudnn_fuse.spec import ConvSpec, Epilogue, MatmulSpec, TensorSpec
from tuning import stand_in_device


def _spec(m, dtype="bfloat16"):
    a = TensorSpec.contiguous((1, m, 32), dtype)
    b = TensorSpec((1, 32, 48), (32, 1, 32), dtype)
    return MatmulSpec(a, b, TensorSpec.contiguous((1, m, 48), dtype), Epilogue(activation="gelu"))


class _Graph:
    _plan_index = 0

    def get_engine_and_knobs_at_index(self, i):
        return 39, {}

    def serialize(self, as_bytes=True):
        return b"plan"


class _Plan:
    raw = True

    def __init__(self, spec, graph, device, engine=None):
        self.spec, self.graph, self.device, self.workspace_size, self.engine = spec, graph, device, 0, "eng39"


@pytest.fixture
def env(tmp_path, monkeypatch):
    ns = types.SimpleNamespace(pc=PlanCache(tmp_path / "cache", namespace="standin_test"), built=[], decline=False)
    stand_in_device(monkeypatch, ns.pc)

    def build_graph(spec, h):
        if ns.decline:
            raise loader.UnsupportedError("no engine for this size")
        ns.built.append(spec)
        return _Graph()

    monkeypatch.setattr(loader, "build_graph", build_graph)
    monkeypatch.setattr(loader, "finalize", lambda g, spec: None)
    monkeypatch.setattr(loader, "torch_check", lambda plan, spec, device: None)
    monkeypatch.setattr(loader, "Plan", _Plan)
    monkeypatch.setattr(loader, "_deserialize", lambda spec, entry, device: _Plan(spec, _Graph(), device))
    monkeypatch.setattr(loader, "_capturing", lambda: ns.capturing)
    ns.capturing = False
    ns.lru = loader.PlanLRU(64)
    return ns


@contextlib.contextmanager
def _deterministic():
    old = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old[0], warn_only=old[1])


def _fresh_process(env):
    """What a new process has: the plan cache on disk, nothing in memory."""
    loader._KNOWN_FAMILIES.clear()
    env.lru = loader.PlanLRU(64)


def test_a_new_size_of_a_known_family_stands_in_then_swaps_in_its_plan(env):
    first = env.lru.get(_spec(512), 0)
    assert isinstance(first, _Plan) and env.built == [_spec(512)]  # no family known yet: built
    rec = env.pc.get(loader.family_record_key(families.family(_spec(512))), count=False)
    assert rec is not None and rec.meta["anchors"] == []  # the family is known to later processes
    stand = env.lru.get(_spec(300), 0)
    assert isinstance(stand, loader.StandIn) and isinstance(stand, torch_engine.TorchPlan) and stand.standin
    assert env.built == [_spec(512)] and loader.STATS.standins == 1
    assert "waits" in loader.describe(stand)
    for _ in range(loader.STANDIN_CALLS - 1):
        assert env.lru.get(_spec(300), 0) is stand  # its first calls: no build
    assert env.built == [_spec(512)] and loader.STATS.swaps == 0
    plan = env.lru.get(_spec(300), 0)  # the STANDIN_CALLS-th call after: built, swapped in
    assert isinstance(plan, _Plan) and env.built[-1] == _spec(300) and loader.STATS.swaps == 1
    assert env.lru.get(_spec(300), 0) is plan and env.pc.get(loader.cache_digest(_spec(300))) is not None


def test_a_fresh_process_knows_the_family_from_the_cache_and_loads_sizes_on_disk(env):
    env.lru.get(_spec(512), 0)
    _fresh_process(env)
    assert isinstance(env.lru.get(_spec(512), 0), _Plan)  # on disk: loaded, not stood in for
    _fresh_process(env)
    assert isinstance(env.lru.get(_spec(77), 0), loader.StandIn)  # known from the family record alone
    assert env.built == [_spec(512)]


def test_an_entry_written_without_its_family_record_makes_the_family_known_once_loaded(env):
    env.lru.get(_spec(512), 0)
    env.pc.delete(loader.family_record_key(families.family(_spec(512))))  # as an older cudnn_fuse wrote it
    _fresh_process(env)
    assert isinstance(env.lru.get(_spec(90), 0), _Plan) and env.built[-1] == _spec(90)  # nothing known: built
    _fresh_process(env)
    env.pc.delete(loader.family_record_key(families.family(_spec(512))))
    assert isinstance(env.lru.get(_spec(512), 0), _Plan) and env.built[-1] == _spec(90)  # loaded, not built
    assert isinstance(env.lru.get(_spec(60), 0), loader.StandIn)  # its family is known now


@pytest.mark.parametrize("case", ["unknown family", "no family", "deterministic", "autotune", "direct load"])
def test_what_keeps_building_at_once(env, monkeypatch, case):
    if case != "unknown family":
        env.lru.get(_spec(512), 0)
    if case == "no family":  # a conv: no dynamic dimension
        x = TensorSpec.contiguous((2, 8, 8, 8), "float16")
        w = TensorSpec.contiguous((8, 8, 3, 3), "float16")
        spec = ConvSpec(x, w, TensorSpec.contiguous((2, 8, 6, 6), "float16"), (1, 1), (0, 0), (0, 0), (1, 1), 1)
        assert families.family(spec) is None
    else:
        spec = _spec(300)
    if case == "autotune":
        from cudnn_fuse import autotune

        monkeypatch.setattr(autotune, "autotune_enabled", lambda: True)
        monkeypatch.setattr(loader, "_from_family", lambda *a: None)
        monkeypatch.setattr(loader, "prepare", lambda g, spec: None)
        monkeypatch.setattr(autotune, "tune", lambda *a, **k: (None, types.SimpleNamespace(index=0), []))
        monkeypatch.setattr(autotune, "torch_wins", lambda w, t: False)
        monkeypatch.setattr(autotune, "gemm_wins", lambda w, t: False)
    if case == "deterministic":
        with _deterministic():
            plan = env.lru.get(spec, 0)
    elif case == "direct load":  # prewarm and the autotune CLI build what they are given
        plan = loader.load_or_build(spec, 0)
    else:
        plan = env.lru.get(spec, 0)
    assert not getattr(plan, "standin", False) and env.built[-1] == spec and loader.STATS.standins == 0


def test_no_swap_inside_a_capture_and_a_declined_size_keeps_torchs_kernels(env):
    env.lru.get(_spec(512), 0)
    stand = env.lru.get(_spec(300), 0)
    env.capturing = True
    for _ in range(3 * loader.STANDIN_CALLS):
        assert env.lru.get(_spec(300), 0) is stand  # a build would not survive the capture
    env.capturing, env.decline = False, True
    plan = env.lru.get(_spec(300), 0)
    assert type(plan) is torch_engine.TorchPlan and not plan.standin and "declined" in plan.reason
    assert loader.STATS.swaps == 1 and env.lru.get(_spec(300), 0) is plan


def test_a_faulty_family_record_means_a_build(env, monkeypatch):
    env.lru.get(_spec(512), 0)
    _fresh_process(env)
    real_get = env.pc.get

    def get(key, *a, **k):
        if key.startswith("family") or key == loader.family_record_key(families.family(_spec(512))):
            raise OSError("disk I/O error")
        return real_get(key, *a, **k)

    monkeypatch.setattr(env.pc, "get", get)
    plan = env.lru.get(_spec(300), 0)
    assert isinstance(plan, _Plan) and env.built[-1] == _spec(300)


def test_the_ops_memo_never_remembers_a_stand_in(env, monkeypatch):
    monkeypatch.setattr(ops, "_FAST", {})
    spec = _spec(300)
    a = torch.zeros(1, 300, 32, dtype=torch.bfloat16)
    y = torch.zeros(1, 300, 48, dtype=torch.bfloat16)
    ops._remember(("linear", 1), [a], loader.StandIn(spec, 0), [a, y], y)
    assert ops._FAST == {}
    ops._remember(("linear", 1), [a], torch_engine.TorchPlan(spec, 0), [a, y], y)
    assert list(ops._FAST) == [("linear", 1)]  # a settled torch-kernel plan is remembered
