"""optimize(model, example_inputs=...): the model is called once, its plans are built then, and the summary
says per replaced layer what its plans run (cuDNN's engine, or torch's kernels and why). Stand-in plans on
16-bit CPU tensors, as the memo tests drive the fused path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cudnn_fuse as cf
from cudnn_fuse import loader, manifest, torch_engine
from cudnn_fuse.spec import ConvSpec
from memo_paths import NoOpPlan, on_memo_path

WHY = "torch's kernels 0.096 ms against cuDNN's 1.199 ms"


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.act = nn.ReLU()
        self.fc = nn.Linear(8, 16)
        self.gelu = nn.GELU()

    def forward(self, x, scale=1.0):
        y = self.act(self.conv(x))
        return self.gelu(self.fc(y.mean((2, 3)) * scale))


@pytest.fixture
def stand_ins(monkeypatch):
    made, lru = [], {}

    def make(spec, device):  # one plan a spec and device, as loader's LRU keeps them
        if (spec, device) not in lru:
            plan = torch_engine.TorchPlan(spec, device, reason=WHY) if type(spec) is ConvSpec else NoOpPlan(spec)
            plan.device = device
            made.append(plan)
            lru[spec, device] = plan
        return lru[spec, device]

    with on_memo_path("python", monkeypatch, make):
        monkeypatch.setattr(loader, "plans_in_memory", lambda: list(made))
        yield made
    loader.clear()


def _model():
    torch.manual_seed(0)
    return _Model().half().eval()


@pytest.mark.parametrize("how", ["tensor", "tuple", "dict"])
def test_example_inputs_build_the_plans_and_the_summary_says_what_each_layer_runs(stand_ins, how):
    x = torch.randn(2, 8, 6, 6).half()
    example = {"tensor": x, "tuple": (x, 0.5), "dict": {"x": x, "scale": 0.5}}[how]
    out = cf.optimize(_model(), example_inputs=example)
    assert len(stand_ins) == 2  # both plans made during optimize, before the first call of the user's
    s = out.cudnn_fuse_summary
    runs = dict(s.runs)
    assert runs["conv"] == WHY and runs["fc"] == "cuDNN no-op"
    assert s.torch_kernels == [("conv", WHY)]
    assert f"runs conv: {WHY}" in str(s)
    assert manifest._active == []  # the per-layer recorders are closed
    out(x)
    assert len(stand_ins) == 2  # the call meets the plans built during optimize


def test_without_example_inputs_nothing_runs_and_the_summary_has_no_runs(stand_ins):
    out = cf.optimize(_model())
    assert stand_ins == [] and out.cudnn_fuse_summary.runs == [] and out.cudnn_fuse_summary.torch_kernels == []


def test_a_layer_whose_call_fell_back_says_so(monkeypatch):
    """No stand-ins: on the CPU the fused call runs PyTorch's reference, and the summary says torch's ops ran."""
    out = cf.optimize(_model().float(), example_inputs=torch.randn(2, 8, 6, 6))
    runs = dict(out.cudnn_fuse_summary.runs)
    assert set(runs) == {"conv", "fc"} and all(v.startswith("PyTorch's ops") for v in runs.values())
    assert out.cudnn_fuse_summary.torch_kernels == []


@pytest.mark.parametrize("bad", ["x", 3, None.__class__])
def test_example_inputs_of_another_type_are_refused_naming_the_argument(bad):
    m = _model()
    with pytest.raises(TypeError, match="example_inputs"):
        cf.optimize(m, example_inputs=bad)


def test_a_forward_that_raises_on_the_example_propagates_and_leaves_no_recorder_open(stand_ins):
    with pytest.raises(RuntimeError):
        cf.optimize(_model(), example_inputs=torch.randn(2, 3, 6, 6).half())  # 3 channels for an 8-channel conv
    assert manifest._active == []


def test_a_torch_kernel_plan_says_which_timings_chose_it():
    from cudnn_fuse import autotune

    assert loader._torch_reason({"torch_check": {"torch_ms": 0.0962, "cudnn_ms": 1.1994}}) == WHY
    tuned = {"winner_index": 3, "candidates": [{"index": 3, "median_ms": 0.2}, {"index": autotune.TORCH_INDEX,
                                                                              "median_ms": 0.15}]}
    assert loader._torch_reason(tuned) == "torch's kernels 0.150 ms against cuDNN's best 0.200 ms (autotuned)"
    assert loader._torch_reason({"use_torch": True}) == "torch's kernels timed faster"
    assert loader._torch_reason({"torch_check": None, "candidates": None}) == "torch's kernels timed faster"


def test_describe_names_the_engine_the_gemm_or_torchs_kernels():
    from cudnn_fuse import conv_gemm

    plan = NoOpPlan(None)
    assert loader.describe(plan) == "cuDNN no-op"
    tp = torch_engine.TorchPlan.__new__(torch_engine.TorchPlan)
    tp.reason = WHY
    assert loader.describe(tp) == WHY
    gemm = conv_gemm.GemmConvPlan.__new__(conv_gemm.GemmConvPlan)
    gemm.gemm = plan
    assert loader.describe(gemm) == "cuDNN no-op, a 1x1 conv as the GEMM of its matrix views"
