"""A heuristic plan is checked once against torch's own kernels for its computation (loader.torch_check,
autotune.check_against_torch): the op runs torch's where it timed faster on a graph long enough to be
GPU-bound, the cache entry keeps the decision and its figures, and a later load follows it without
timing again. cuDNN and the GPU timing are stood in for on the CPU."""

from __future__ import annotations

import types

import pytest
import torch

from cudnn_fuse import autotune, handles, loader, torch_engine
from cudnn_fuse.builders import roles_of
from cudnn_fuse.cache import PlanCache
from cudnn_fuse.spec import Epilogue, MatmulSpec, SdpaSpec, TensorSpec
from tuning import stand_in_device

NS = "torch_check_test"


def _spec(dtype="bfloat16"):
    a = TensorSpec.contiguous((1, 64, 32), dtype)
    b = TensorSpec((1, 32, 48), (32 * 48, 1, 32), dtype)
    return MatmulSpec(a, b, TensorSpec.contiguous((1, 64, 48), dtype), Epilogue(activation="relu"))


class _Graph:
    _plan_index = 0
    engine_id = 39

    def get_engine_and_knobs_at_index(self, i):
        return self.engine_id, {}

    def serialize(self, as_bytes=True):
        return b"heuristic plan"


class _Plan:
    def __init__(self, spec, graph, device, engine=None):
        self.spec, self.graph, self.device, self.engine, self.workspace_size = spec, graph, device, "eng39", 0


@pytest.fixture
def env(tmp_path, monkeypatch):
    """The loader on a real PlanCache with the build stood in for; ``env.check`` is what the timing
    against torch answers (None: it does not apply), ``env.checked`` counts the checks."""
    ns = types.SimpleNamespace(pc=PlanCache(tmp_path / "cache", namespace=NS), checked=[], check=None)
    stand_in_device(monkeypatch, ns.pc)
    monkeypatch.setattr(loader, "build_graph", lambda spec, h: _Graph())
    monkeypatch.setattr(loader, "finalize", lambda g, spec: None)
    monkeypatch.setattr(loader, "Plan", _Plan)
    monkeypatch.setattr(loader, "_deserialize", lambda spec, entry, device: _Plan(spec, _Graph(), device))
    monkeypatch.setattr(autotune, "_enabled", False)

    def check(plan, spec, device):
        ns.checked.append(spec.op)
        return ns.check

    monkeypatch.setattr(loader, "torch_check", check)
    return ns


@pytest.mark.parametrize("use_torch", [True, False])
def test_a_heuristic_build_follows_and_stores_the_check(env, use_torch):
    env.check = {"cudnn_ms": 1.2, "torch_ms": 0.1 if use_torch else 2.0, "use_torch": use_torch}
    spec = _spec()
    plan = loader.load_or_build(spec, 0)
    assert isinstance(plan, torch_engine.TorchPlan) is use_torch and env.checked == ["matmul"]
    meta = env.pc.get(loader.cache_digest(spec)).meta
    assert meta["use_torch"] is use_torch and meta["torch_check"] == env.check and meta["tuned"] is False
    again = loader.load_or_build(spec, 0)  # from the cache: the decision is kept, nothing timed again
    assert isinstance(again, torch_engine.TorchPlan) is use_torch and env.checked == ["matmul"]


def test_no_check_keeps_cudnn_and_stores_no_figures(env):
    env.check = None
    plan = loader.load_or_build(_spec(), 0)
    assert isinstance(plan, _Plan)
    meta = env.pc.get(loader.cache_digest(_spec())).meta
    assert meta["use_torch"] is False and "torch_check" not in meta


def test_the_check_applies_only_where_torch_can_stand_in(monkeypatch):
    """No check without a GPU, for what torch cannot stand in for, under deterministic algorithms, or
    inside a capture; a check that raises keeps cuDNN."""
    ran = []
    monkeypatch.setattr(autotune, "check_against_torch", lambda *a: ran.append(a) or {"use_torch": True})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(handles, "_caller_captures", {})
    assert loader.torch_check(object(), _spec(), 0) == {"use_torch": True} and len(ran) == 1
    monkeypatch.setattr(handles, "_caller_captures", {0: {0x77: 1}})  # another thread's capture, still open
    monkeypatch.setattr(handles, "_stream_capturing", lambda stream: True)
    assert loader.torch_check(object(), _spec(), 0) is None
    monkeypatch.setattr(handles, "_stream_capturing", lambda stream: False)  # it ended: checks resume
    assert loader.torch_check(object(), _spec(), 0) == {"use_torch": True} and len(ran) == 2
    assert loader.torch_check(object(), _spec("float32"), 0) is None  # fp32 follows torch's TF32 flags
    q = TensorSpec.contiguous((1, 2, 8, 16), "bfloat16")
    assert loader.torch_check(object(), SdpaSpec(q, q, q, q, None, False, 0.25), 0) is None
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert loader.torch_check(object(), _spec(), 0) is None
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(loader, "deterministic", lambda: True)
    assert loader.torch_check(object(), _spec(), 0) is None
    monkeypatch.setattr(loader, "deterministic", lambda: False)

    def boom(*a):
        raise RuntimeError("a launch failed")

    monkeypatch.setattr(autotune, "check_against_torch", boom)
    assert loader.torch_check(object(), _spec(), 0) is None
    assert len(ran) == 2


@pytest.mark.parametrize("cudnn_ms, torch_ms, want", [(1.2, 0.1, True), (1.2, 1.3, False), (0.05, 0.01, True),
                                                        (0.015, 0.008, False), (0.1, 0.099, False),
                                                        (0.1, 0.09, True), (0.03, 0.02, False)])
def test_check_against_torch_times_both_alternately_and_applies_the_candidates_rule(monkeypatch, cudnn_ms, torch_ms,
                                                                                   want):
    """Both are run (warmed up, then alternately timed); torch wins only where its path costs less, each
    path's cost being the longer of its device time and its host time per call (autotune.torch_cheaper)."""
    spec = _spec()
    ran = []

    class Plan:
        engine = "eng39"

        def run(self, bufs):
            ran.append("cudnn")

    class Torch(torch_engine.TorchPlan):
        def run(self, bufs):
            ran.append("torch")

    monkeypatch.setattr(torch_engine, "TorchPlan", Torch)
    monkeypatch.setattr(autotune, "random_buffers", lambda spec, roles, device, n: [[None]] * n)

    def device_ms(fn, n, *a, **k):
        fn()
        return [cudnn_ms if ran[-1] == "cudnn" else torch_ms] * n

    monkeypatch.setattr(autotune, "device_ms", device_ms)
    out = autotune.check_against_torch(Plan(), spec, 0, roles_of(spec))
    assert out == {"cudnn_ms": cudnn_ms, "torch_ms": torch_ms, "use_torch": want}
    assert ran[:4] == ["cudnn", "torch", "cudnn", "torch"]  # the warm-up of both
    assert ran.count("cudnn") == ran.count("torch") >= 2 + autotune.CHECK_ROUNDS // 2


def test_a_tuning_keeps_only_the_faster_of_torch_and_the_gemm():
    def row(index, ms):
        return autotune.Timing(index, "x", None, {}, 0, median_ms=ms, status="timed")

    winner = row(3, 1.0)
    both = [winner, row(autotune.TORCH_INDEX, 0.8), row(autotune.GEMM_INDEX, 0.7)]
    assert loader._faster_of(winner, both) == (False, True)
    both[1].median_ms = 0.6
    assert loader._faster_of(winner, both) == (True, False)
    assert loader._faster_of(winner, both[:2]) == (True, False)
    assert loader._faster_of(winner, [winner]) == (False, False)
