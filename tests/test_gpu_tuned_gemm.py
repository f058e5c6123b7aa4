"""cudnn_fuse.tuned_gemm on the GPU: every layout autograd hands over, tuned and stored, loaded
back by a fresh process state, declined where it must be; a stored garbage algorithm survived in a
subprocess; FusedMLP's step with tuned GEMMs matches eager."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import cudnn_fuse as cf
from cudnn_fuse import tuned_gemm as tg
from cudnn_fuse.cache import PlanCache
from tests.grad_check import step_grads

pytestmark = pytest.mark.gpu

BF = torch.bfloat16


@pytest.fixture
def tuning(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDNN_FUSE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tg, "BUDGET_S", 0.3)
    tg.clear()
    cf.set_autotune(True)
    yield tmp_path / "cache"
    cf.set_autotune(False)
    tg.clear()


def _operands(layout, m=512, n=768, k=256, bias=False):
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=BF, generator=g)
    b = torch.randn(k, n, device="cuda", dtype=BF, generator=g)
    if layout[0] == "t":
        a = a.t().contiguous().t()
    if layout[1] == "t":
        b = b.t().contiguous().t()
    return a, b, (torch.randn(n, device="cuda", dtype=BF, generator=g) if bias else None)


@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "tt"])
@pytest.mark.parametrize("bias", [False, True])
def test_tuned_product_matches_torch_and_is_stored(tuning, layout, bias):
    a, b, c = _operands(layout, bias=bias)
    sig = tg.signature(a, b, c)
    assert sig is not None
    before = dict(tg.stats)
    out = tg.mm(a, b, c)
    ref = tg.torch_call(a, b, c)
    assert tg.stats["tuned"] == before["tuned"] + 1
    pick = tg._choice[sig]
    if pick is tg.TORCH:
        assert out is None  # torch's call won: the caller runs it
    else:
        assert out.shape == ref.shape and out.is_contiguous()
        assert (out.float() - ref.float()).abs().max().item() <= 1e-2 * ref.abs().max().item()
    entry = PlanCache().get(tg.cache_key(sig))
    assert entry is not None and entry.meta["op"] == "cublaslt_gemm" and entry.meta["candidates"][0]["name"] == "torch"
    assert all(c["median_ms"] is None or c["median_ms"] > 0 for c in entry.meta["candidates"])
    # a fresh process state, not tuning: the record comes back from the cache and gives the same result
    tg.clear()
    cf.set_autotune(False)
    loaded = tg.stats["loaded"]
    again = tg.mm(a, b, c)
    assert tg.stats["loaded"] == loaded + 1
    if pick is tg.TORCH:
        assert again is None
    else:
        assert torch.equal(again, out)


def test_not_tuning_and_nothing_stored_is_torchs_call(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDNN_FUSE_CACHE_DIR", str(tmp_path / "cache"))
    tg.clear()
    a, b, _ = _operands("nn")
    tuned = tg.stats["tuned"]
    assert tg.mm(a, b) is None and tg.stats["tuned"] == tuned


def test_declines(tuning):
    a, b, c = _operands("nn", bias=True)
    assert tg.mm(a.float(), b.float()) is None  # float32
    assert tg.mm(a[:32], b) is None  # under MIN_DIM
    buf = torch.empty(a.numel() + 8, device="cuda", dtype=BF)
    assert tg.mm(buf[1:1 + a.numel()].view(a.shape), b) is None  # not 256-byte aligned
    torch.use_deterministic_algorithms(True)
    try:
        assert tg.mm(a, b, c) is None
    finally:
        torch.use_deterministic_algorithms(False)
    with torch.enable_grad():  # a create_graph backward: torch's differentiable call
        assert tg.mm(a.requires_grad_(), b) is None


def test_graph_capture_replays_a_resolved_pick(tuning):
    a, b, c = _operands("nt", bias=True)
    first = tg.mm(a, b, c)
    if first is None:
        pytest.skip("torch's call won this signature")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        tg.mm(a, b, c)
        with torch.cuda.graph(g, stream=s):
            out = tg.mm(a, b, c)
    torch.cuda.current_stream().wait_stream(s)
    a.copy_(a * 2)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, tg.torch_call(a, b, c)) or \
        (out.float() - tg.torch_call(a, b, c).float()).abs().max().item() <= 1e-2 * out.abs().max().item()


_GARBAGE = r"""
import sys, torch
from cudnn_fuse import tuned_gemm as tg
from cudnn_fuse.cache import PlanCache
a = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
b = torch.randn(256, 768, device="cuda", dtype=torch.bfloat16)
sig = tg.signature(a, b, None)
pc = PlanCache()
meta = {"format": tg.FORMAT, "op": "cublaslt_gemm", "spec": tg._spec(sig), "engine": "cublaslt algo 0"}
pc.put(tg.cache_key(sig), meta, bytes([0xA5]) * 64)  # valid checksum, garbage algorithm
out = tg.mm(a, b)
ref = a @ b
assert out is None or torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-2), "wrong answer"
print("survived", out is None)
"""


def test_garbage_algorithm_with_a_valid_checksum_is_survived(tmp_path):
    env = {**os.environ, "CUDNN_FUSE_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-c", _GARBAGE], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "survived True" in r.stdout, r.stdout + r.stderr


def test_fused_mlp_step_with_tuned_gemms_matches_eager(tuning):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)).cuda().to(BF)
    opt = cf.optimize(copy.deepcopy(base))
    assert any(isinstance(m, cf.nn.FusedMLP) for m in opt.modules())
    x = torch.randn(1024, 512, device="cuda", dtype=BF, requires_grad=True)
    tuned = tg.stats["tuned"]
    grads = step_grads((base, opt), x)
    for ours, theirs in zip(grads[1], grads[0]):
        assert (ours.float() - theirs.float()).abs().max().item() <= 2e-2 * theirs.float().abs().max().item() + 1e-6
    assert tg.stats["tuned"] - tuned == 6  # the block's six GEMM signatures (forward two, backward four)
