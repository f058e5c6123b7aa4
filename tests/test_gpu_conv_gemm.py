"""GPU: a 1x1 stride-1 channels_last conv run as the GEMM of its matrix views (conv_gemm.py): the
GEMM plan on the conv's own pointers against float64, the autotuner's GEMM row and the decision it
stores, a fresh process's load of that decision, the memo'd launch, capture and a training step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cudnn_fuse as cf
from cudnn_fuse import autotune, conv_gemm, loader, reference
from tuning import autotuning

pytestmark = pytest.mark.gpu


def _cl(t):
    return t.contiguous(memory_format=torch.channels_last)


def _operands(N, C, H, K, dtype, residual=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = _cl(torch.randn(N, C, H, H, device="cuda", generator=g).to(dtype))
    w = _cl((torch.randn(K, C, 1, 1, device="cuda", generator=g) / C ** 0.5).to(dtype))
    b = torch.randn(K, device="cuda", generator=g).to(dtype)
    r = _cl(torch.randn(N, K, H, H, device="cuda", generator=g).to(dtype)) if residual else None
    return x, w, b, r


def _want(x, w, b, r, act, slope=0.01):
    z = F.conv2d(x.double(), w.double(), b.double())
    if r is not None:
        z = z + r.double()
    return reference.activation(z, act, slope)


def _rel(got, want):
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


@pytest.fixture
def tuned(cache_dir):
    with autotuning(budget_s=2, gemm_candidate=True):
        yield cache_dir


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("act,residual,amax", [(None, False, False), ("relu", True, False), ("gelu", False, True),
                                               ("silu", True, True), ("leaky_relu", False, False)])
def test_the_gemm_plan_on_the_convs_pointers_matches_float64(dtype, act, residual, amax):
    x, w, b, r = _operands(2, 64, 14, 96, dtype, residual)
    with cf.record() as rec:
        cf.conv2d(x.to("meta"), w.to("meta"), b.to("meta"), activation=act, residual=None if r is None else r.to("meta"),
                  return_amax=amax, negative_slope=0.2 if act == "leaky_relu" else 0.01)
    spec = rec.entries[0].spec
    mspec = conv_gemm.gemm_spec(spec)
    assert mspec is not None
    plan = conv_gemm.GemmConvPlan(spec, loader.get_plan(mspec, 0))
    assert plan.raw  # a cuDNN GEMM plan: the conv's pointers go straight in
    y = _cl(torch.full((2, 96, 14, 14), float("nan"), device="cuda", dtype=dtype))
    am = torch.full((1, 1, 1, 1), -1.0, device="cuda")
    bufs = [t for t in (x, w, b.view(1, -1, 1, 1), r, y, am if amax else None) if t is not None]
    plan.run(bufs)
    torch.cuda.synchronize()
    want = _want(x, w, b, r, act, 0.2)
    assert _rel(y, want) < (1e-2 if dtype == torch.float16 else 3e-2)
    if amax:
        assert am.item() == pytest.approx(y.float().abs().max().item(), rel=1e-3)


@pytest.mark.parametrize("N,C,H,K,act,residual", [
    (1, 64, 56, 256, None, False),   # peers' conv_rn50_bs1_c64_k256_56_r1_s1_bias (max-autotune's GEMM won it)
    (1, 256, 56, 64, "relu", False),
    (32, 64, 56, 256, "relu", True),
    (32, 1024, 14, 256, "relu", False),
])
def test_the_tuned_entry_times_the_gemm_and_a_fresh_load_follows_it(tuned, N, C, H, K, act, residual):
    x, w, b, r = _operands(N, C, H, K, torch.float16, residual, seed=1)
    y = cf.conv2d(x, w, b, activation=act, residual=r)
    want = _want(x, w, b, r, act)
    assert _rel(y, want) < 1e-2
    plan = loader.plans_in_memory()[-1]
    assert plan.spec.op == "conv2d"
    from cudnn_fuse.cache import open_default_cache

    pc = open_default_cache()
    entry = pc.get(plan.spec.digest())
    assert entry is not None and entry.meta["tuned"]
    rows = [c for c in entry.meta["candidates"] if c["index"] == autotune.GEMM_INDEX]
    assert len(rows) == 1 and rows[0]["status"] == "timed" and rows[0]["median_ms"] > 0, rows
    assert rows[0]["runtime_compiled"] in (True, False), rows  # cuDNN's note of the tuned GEMM plan was read
    # the conv winner's time (its median, or its first run when the budget ended the timing first)
    conv_best = next(c["median_ms"] for c in entry.meta["candidates"] if c["index"] == entry.meta["winner_index"])
    assert entry.meta["use_gemm"] == (rows[0]["median_ms"] < conv_best)
    assert isinstance(plan, conv_gemm.GemmConvPlan) == entry.meta["use_gemm"]
    mentry = pc.get(conv_gemm.gemm_spec(plan.spec).digest())
    assert mentry is not None and mentry.meta["tuned"]  # the GEMM is its own tuned matmul entry
    # a fresh load (no tuning) makes the same choice and the same bits
    loader.clear()
    cf.set_autotune(False)
    before = loader.plan_stats()
    y2 = cf.conv2d(x, w, b, activation=act, residual=r)
    after = loader.plan_stats()
    assert after["builds"] == before["builds"]  # loaded, nothing built
    assert isinstance(loader.plans_in_memory()[-1], conv_gemm.GemmConvPlan) == entry.meta["use_gemm"]
    assert torch.equal(y2, y)
    print(f"[conv-gemm] N{N} C{C} H{H} K{K}: conv {conv_best:.5f} ms, gemm {rows[0]['median_ms']:.5f} ms, "
          f"use_gemm={entry.meta['use_gemm']}, gemm runtime-compiled={rows[0]['runtime_compiled']}")


def test_a_gemm_entry_serves_the_memo_capture_and_training(tuned, monkeypatch):
    """With the decision forced to the GEMM: the plain call's memo launches it, cf.capture replays
    it, and a training step's forward runs it with gradients equal to float64 autograd's."""
    monkeypatch.setattr(autotune, "gemm_wins", _gemm_timed)
    x, w, b, r = _operands(4, 128, 28, 64, torch.bfloat16, residual=True, seed=2)
    want = _want(x, w, b, r, "relu")
    y = cf.conv2d(x, w, b, activation="relu", residual=r)
    assert isinstance(loader.plans_in_memory()[-1], conv_gemm.GemmConvPlan)
    assert _rel(y, want) < 3e-2
    key = ("conv2d",) + tuple(ops_meta(t) for t in (x, w, b, r))
    y_memo = cf.conv2d(x, w, b, activation="relu", residual=r)
    from cudnn_fuse import ops

    hits = [k for k, v in ops._FAST.items() if k[:5] == key and isinstance(getattr(v, "plan", None), conv_gemm.GemmConvPlan)]
    assert hits, "the plain call was not memoized with the GEMM plan"
    assert torch.equal(y_memo, y)
    fn = cf.capture(lambda x: cf.conv2d(x, w, b, activation="relu", residual=r), x)
    x2 = _cl(torch.randn_like(x))
    out = fn(x2)
    torch.cuda.synchronize()
    assert torch.equal(out, cf.conv2d(x2, w, b, activation="relu", residual=r))
    # training: the forward through the GEMM, the gradients through the conv's backward graphs
    xg, wg, bg = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
    yt = cf.conv2d(xg, wg, bg, activation="relu")
    gy = torch.randn_like(yt)
    yt.backward(gy)
    x64, w64, b64 = (t.detach().double().requires_grad_(True) for t in (x, w, b))
    y64 = F.relu(F.conv2d(x64, w64, b64))
    y64.backward(gy.double())
    assert _rel(yt, y64.detach()) < 3e-2
    for got, ref in ((xg.grad, x64.grad), (wg.grad, w64.grad), (bg.grad, b64.grad)):
        assert _rel(got, ref) < 3e-2


def ops_meta(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _gemm_timed(winner, timings, *_preference) -> bool:
    """The decision forced to the GEMM wherever it has a timed row (only 1x1 convs do)."""
    return any(t.index == autotune.GEMM_INDEX and t.status == "timed" for t in timings)


def test_a_fresh_process_loads_a_gemm_entry_without_the_conv_blob(tuned, monkeypatch):
    monkeypatch.setattr(autotune, "gemm_wins", _gemm_timed)
    x, w, b, _ = _operands(1, 64, 56, 256, torch.float16)
    y = cf.conv2d(x, w, b)
    loader.clear()
    cf.set_autotune(False)
    seen = []
    real = loader._deserialize
    monkeypatch.setattr(loader, "_deserialize", lambda s, e, d: seen.append(s.op) or real(s, e, d))
    y2 = cf.conv2d(x, w, b)
    assert seen == ["matmul"]  # the GEMM's entry only
    assert isinstance(loader.plans_in_memory()[-1], conv_gemm.GemmConvPlan)
    assert torch.equal(y2, y)
