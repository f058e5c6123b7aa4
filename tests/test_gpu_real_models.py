"""GPU: the pieces that keep a model from running slower through cf, with real plans. A depthwise conv
runs torch's kernels (the graph API has none as fast) and says so in optimize()'s summary; a remembered
torch-kernel call runs eager's expression; a size near a tuned one of its family takes that tuning's
engine without tuning."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudnn_fuse as cf
from cudnn_fuse import families, loader, ops, torch_engine
from tuning import autotuning

pytestmark = pytest.mark.gpu


class _DwBlock(nn.Module):
    """ConvNeXt's depthwise 7x7 (torch's kernel measured 12x faster) beside a dense 3x3 (cuDNN's)."""

    def __init__(self):
        super().__init__()
        self.dw = nn.Conv2d(96, 96, 7, padding=3, groups=96)
        self.dense = nn.Conv2d(96, 96, 3, padding=1)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.dense(self.dw(x)))


def test_example_inputs_build_the_plans_and_name_the_layers_on_torchs_kernels(cache_dir):
    torch.manual_seed(0)
    m = _DwBlock().cuda().half().eval()
    x = torch.randn(32, 96, 56, 56, device="cuda", dtype=torch.half).contiguous(memory_format=torch.channels_last)
    loader.clear()
    o = cf.optimize(m, example_inputs=x)
    built = cf.plan_stats()["builds"]
    runs = dict(o.cudnn_fuse_summary.runs)
    assert runs["dw"].startswith("torch's kernels") and "against cuDNN's" in runs["dw"]
    assert runs["dense"].startswith("cuDNN") or runs["dense"].startswith("torch's kernels")
    assert ("dw", runs["dw"]) in o.cudnn_fuse_summary.torch_kernels
    with torch.no_grad():
        y = o(x)
        want = m(x)
    assert cf.plan_stats()["builds"] == built  # the call met the plans optimize() built
    assert (y.float() - want.float()).abs().max() / want.float().abs().max() < 1e-2


def test_a_remembered_depthwise_conv_runs_eagers_expression(cache_dir):
    torch.manual_seed(0)
    cl = torch.channels_last
    x = torch.randn(8, 96, 28, 28, device="cuda", dtype=torch.half).contiguous(memory_format=cl)
    w = (torch.randn(96, 1, 7, 7, device="cuda", dtype=torch.half) / 7).contiguous(memory_format=cl)
    b = torch.randn(96, device="cuda", dtype=torch.half)
    loader.clear()
    outs = [cf.conv2d(x, w, b, padding=3, groups=96, activation="gelu") for _ in range(4)]
    remembered = [e.plan for e in ops._FAST.values() if hasattr(e, "plan")]
    held = loader.plans_in_memory() or remembered
    assert held, f"no plan held or remembered: {cf.plan_stats()}"
    plan = held[-1]
    want = F.gelu(F.conv2d(x.float(), w.float(), b.float(), padding=3, groups=96))
    for y in outs:
        assert y.is_contiguous(memory_format=cl)
        assert (y.float() - want).abs().max() / want.abs().max() < 1e-2
    if isinstance(plan, torch_engine.TorchPlan):  # torch's kernels won the check, as measured at this shape
        launches = [e for e in ops._FAST.values() if isinstance(e, ops._TorchLaunch)]
        assert launches and all(e.direct is not None and e.checked for e in launches)


def test_a_near_size_of_a_tuned_linear_takes_its_engine_untuned(cache_dir):
    torch.manual_seed(0)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) / 32
    b = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    with autotuning(budget_s=2, torch_candidate=True):
        cf.linear(torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16), w, b, activation="gelu")
        tuned = cf.plan_stats()["autotune_seconds"]
        hits = cf.plan_stats()["family_hits"]
        x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
        for _ in range(loader.STANDIN_CALLS):  # torch's kernels stand in, then the plan is built and swapped in
            y = cf.linear(x, w, b, activation="gelu")
        assert cf.plan_stats()["family_hits"] == hits + 1
        assert cf.plan_stats()["autotune_seconds"] == tuned  # no tuning of its own
        plans = [p for p in loader.plans_in_memory() if not getattr(p, "standin", False)]  # autotuning's exit clears them
    assert plans, f"no plan swapped in: {cf.plan_stats()}"
    spec = plans[-1].spec
    assert families.sizes(spec)["m"] == 4096
    want = F.gelu(F.linear(x.float(), w.float(), b.float()))
    assert (y.float() - want).abs().max() / want.abs().max() < 2e-2


def test_a_written_out_rms_norm_runs_as_one_kernel_and_trains():
    from test_rms_norm import LlamaStyle

    torch.manual_seed(0)
    m = LlamaStyle(1024).cuda().to(torch.bfloat16)
    with torch.no_grad():
        m.weight.copy_(torch.rand(1024) + 0.5)
    o = cf.optimize(m)
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16) * 2
    o(x)  # warm
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        y = o(x)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, kernels
    want = F.rms_norm(x.float(), (1024,), m.weight.float(), 1e-6)
    assert (y.float() - want).abs().max() <= (m(x).float() - want).abs().max() + 1e-3
    xg, xg2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    g = torch.randn_like(x)
    (m(xg).float() * g).sum().backward()
    (o(xg2).float() * g).sum().backward()
    assert (xg2.grad.float() - xg.grad.float()).norm() / xg.grad.float().norm() < 2e-2
    assert (o.weight.grad.float() - m.weight.grad.float()).norm() / m.weight.grad.float().norm() < 2e-2
