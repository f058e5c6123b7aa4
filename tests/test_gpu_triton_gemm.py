"""cudnn_fuse.triton_gemm on the GPU: the first layer's GEMM writing z and act(z), and dY @ W2 with
the activation's backward and the bias gradient's column sums in its epilogue, against float64
products and aten's elementwise kernels; odd shapes (ragged tiles, K not a multiple of the K
tile, 3-D inputs, strided weights); declines; a CUDA graph replay; nn.FusedMLP's training step
with CUDNN_FUSE_MLP_KERNELS=triton against eager's gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cudnn_fuse as cf
from cudnn_fuse import backward, triton_gemm
from tests.grad_check import mlp_operands as _operands, step_grads
from tests.test_gpu_triton_act import ATEN_BWD, ATEN_FWD, _close_to_aten

pytestmark = pytest.mark.gpu

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def triton_on(monkeypatch):
    monkeypatch.setattr(backward, "MLP", "triton")


def _gemm_bound(ours, a, b, bias, dtype):
    """ours (16-bit) against the float64 product: its rounding (half an ulp of the exact value)
    plus float32 accumulation over K, relative to the sum of |products| per element."""
    exact = a.double() @ b.double()
    if bias is not None:
        exact = exact + bias.double()
    mag = a.double().abs() @ b.double().abs() + (bias.double().abs() if bias is not None else 0)
    k = a.shape[-1]
    err = (ours.double() - exact).abs()
    bound = torch.finfo(dtype).eps * exact.abs() + 2 * k * torch.finfo(torch.float32).eps * mag + 1e-30
    assert (err <= bound).all(), f"{int((err > bound).sum())} elements off; worst {float((err - bound).max())}"


SHAPES = [(512, 256, 1024), (300, 200, 130), (1, 64, 1040), (4099, 136, 257)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", triton_gemm.ACTS)
@pytest.mark.parametrize("mkn", SHAPES)
def test_linear_act_and_matmul_act_grad(act, dtype, mkn):
    m, k, n = mkn
    x, w1, b1, w2, gy = _operands(m, k, n, dtype)
    y, z = triton_gemm.linear_act(x, w1, b1, act)
    assert y.shape == z.shape == (m, n) and y.dtype == z.dtype == dtype
    _gemm_bound(z, x, w1.t(), b1, dtype)
    _close_to_aten(y, ATEN_FWD[act](z), act, z)  # the activation of the rounded z, as eager's
    dz, db = triton_gemm.matmul_act_grad(gy, w2, z, act, True)
    prod = gy @ w2
    _gemm_bound(prod, gy, w2, None, dtype)  # cuBLAS's product: what the epilogue's must be near
    # the epilogue's product differs from cuBLAS's by accumulation order; judge dz against aten's
    # backward of the float64 product's rounding and of cuBLAS's, whichever is closer per element
    exact_prod = (gy.double() @ w2.double()).to(dtype)
    ref_a, ref_b = ATEN_BWD[act](prod, z), ATEN_BWD[act](exact_prod, z)
    err = torch.minimum((dz.float() - ref_a.float()).abs(), (dz.float() - ref_b.float()).abs())
    mag = (gy.double().abs() @ w2.double().abs()).float() * 1.2  # |act'| <= 1.13 (GELU), 1.1 (SiLU)
    bound = torch.finfo(dtype).eps * (ref_a.float().abs() + mag) + 2 * k * torch.finfo(torch.float32).eps * mag
    assert (err <= bound).all(), float((err - bound).max())
    exact = dz.double().sum(0)
    scale = dz.double().abs().sum(0)
    assert db.shape == (n,) and db.dtype == dtype
    assert ((db.double() - exact).abs() <= 2 * torch.finfo(dtype).eps * exact.abs() + 1e-5 * scale + 1e-30).all()
    dz2, none = triton_gemm.matmul_act_grad(gy, w2, z, act, False)
    assert none is None and torch.equal(dz2, dz)


def test_shapes_strides_and_no_bias():
    """A 3-D input, a weight read through a transposed view, no bias: the same as the plain call."""
    x, w1, b1, w2, gy = _operands(96, 64, 160, torch.bfloat16)
    y, z = triton_gemm.linear_act(x.view(2, 48, 64), w1, None, "gelu")
    assert y.shape == (2, 48, 160)
    y2, z2 = triton_gemm.linear_act(x, w1.t().contiguous().t(), None, "gelu")
    _gemm_bound(z2, x, w1.t(), None, torch.bfloat16)
    assert torch.equal(z.view(96, 160), z2) or (z.view(96, 160) - z2).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * z2.abs().max()
    dz, _ = triton_gemm.matmul_act_grad(gy.view(2, 48, 64), w2, z, "gelu", False)
    assert dz.shape == (2, 48, 160)
    dzt, _ = triton_gemm.matmul_act_grad(gy, w2.t().contiguous().t(), z.view(96, 160), "gelu", False)
    assert (dz.view(96, 160).float() - dzt.float()).abs().max() <= 4 * torch.finfo(torch.bfloat16).eps * dzt.float().abs().max()


def test_bias_sum_is_deterministic():
    x, w1, b1, w2, gy = _operands(2048, 256, 1024, torch.bfloat16)
    y, z = triton_gemm.linear_act(x, w1, b1, "gelu")
    sums = [triton_gemm.matmul_act_grad(gy, w2, z, "gelu", True)[1] for _ in range(3)]
    assert all(torch.equal(s, sums[0]) for s in sums)


def test_declines():
    x, w1, b1, w2, gy = _operands(64, 32, 48, torch.float32)
    assert triton_gemm.linear_act(x, w1, b1, "gelu") is None  # float32
    xb, w1b, b1b, w2b, gyb = _operands(64, 32, 48, torch.bfloat16)
    assert triton_gemm.linear_act(xb, w1b, b1b, "relu") is None  # no input-needing activation
    assert triton_gemm.linear_act(xb, w1b, b1b.float(), "gelu") is None  # mixed dtypes
    assert triton_gemm.linear_act(xb[:, ::2], w1b[:, ::2], b1b, "gelu") is None  # no unit stride
    z = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16)[:, ::2]
    assert triton_gemm.matmul_act_grad(gyb, w2b, z, "gelu", True) is None  # z not contiguous


def test_replays_in_a_cuda_graph():
    x, w1, b1, w2, gy = _operands(256, 128, 384, torch.bfloat16)
    triton_gemm.linear_act(x, w1, b1, "gelu")  # compiled before the capture
    y0, z0 = triton_gemm.linear_act(x, w1, b1, "gelu")
    triton_gemm.matmul_act_grad(gy, w2, z0, "gelu", True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        y, z = triton_gemm.linear_act(x, w1, b1, "gelu")
        dz, db = triton_gemm.matmul_act_grad(gy, w2, z, "gelu", True)
    torch.cuda.current_stream().wait_stream(s)
    x2, _, _, _, gy2 = _operands(256, 128, 384, torch.bfloat16, seed=7)
    x.copy_(x2)
    gy.copy_(gy2)
    g.replay()
    torch.cuda.synchronize()
    ry, rz = triton_gemm.linear_act(x2, w1, b1, "gelu")
    rdz, rdb = triton_gemm.matmul_act_grad(gy2, w2, rz, "gelu", True)
    assert torch.equal(y, ry) and torch.equal(z, rz) and torch.equal(dz, rdz) and torch.equal(db, rdb)


def test_capture_with_an_uncompiled_specialization_declines(monkeypatch):
    monkeypatch.setattr(triton_gemm, "_launched", set())
    x, w1, b1, w2, gy = _operands(128, 64, 96, torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        assert triton_gemm.linear_act(x, w1, b1, "gelu") is None
    torch.cuda.current_stream().wait_stream(s)
    assert triton_gemm.linear_act(x, w1, b1, "gelu") is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_mlp_step_matches_eager(dtype):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512),
                         nn.Linear(512, 1024), nn.SiLU(), nn.Linear(1024, 512)).cuda().to(dtype)
    opt = cf.optimize(copy.deepcopy(base))
    assert sum(isinstance(m, cf.nn.FusedMLP) for m in opt.modules()) == 2
    x = torch.randn(4, 300, 512, device="cuda", dtype=dtype, requires_grad=True)
    before = dict(triton_gemm.stats)
    grads = step_grads((base, opt), x)
    for ours, theirs in zip(grads[1], grads[0]):
        assert (ours.float() - theirs.float()).abs().max().item() <= 2e-2 * theirs.float().abs().max().item() + 1e-6
    assert triton_gemm.stats["forward"] - before["forward"] == 2
    assert triton_gemm.stats["backward"] - before["backward"] == 2


def test_fused_mlp_peak_is_not_above_eager():
    """The product dY @ W2 is never stored: the node's backward peak is at most eager's."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda().to(torch.bfloat16)
    opt = cf.optimize(copy.deepcopy(base))
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    peaks = []
    for m in (base, opt):
        for _ in range(2):
            m.zero_grad(set_to_none=True)
            x.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            m(x).float().square().mean().backward()
            torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
    assert peaks[1] <= peaks[0], peaks
