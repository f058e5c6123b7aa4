"""GPU tests of cudnn_fuse.cublaslt: a linear layer's weight and bias gradients from one
cuBLASLt GEMM (BGRADB epilogue), and the backward paths that use it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cudnn_fuse as cf
from cudnn_fuse import backward, cublaslt

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return float(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,n,k", [(64, 80, 96), (1000, 256, 72), (4096, 1024, 512)])
def test_wgrad_bgrad_matches_float32(dtype, rows, n, k):
    dz = torch.randn(rows, n, device="cuda", dtype=dtype)
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    out = cublaslt.wgrad_bgrad(dz, x)
    assert out is not None, "cuBLASLt declined a plain aligned fp16/bf16 problem"
    dw, db = out
    assert dw.shape == (n, k) and db.shape == (n,) and dw.dtype == dtype and db.dtype == dtype
    ref_w, ref_b = dz.float().t() @ x.float(), dz.float().sum(0)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert _rel(dw, ref_w) < tol
    assert _rel(db, ref_b) < tol
    dw2, none = cublaslt.wgrad_bgrad(dz, x, with_bias=False)  # another algorithm: equal within rounding
    assert none is None and dw2.shape == dw.shape and _rel(dw2, ref_w) < tol


def test_wgrad_bgrad_declines_what_it_cannot_take():
    dz = torch.randn(64, 80, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16)
    assert cublaslt.wgrad_bgrad(dz.float(), x.float()) is None  # float32
    assert cublaslt.wgrad_bgrad(dz[1:], x[1:]) is None  # rows start 160 bytes in: not 256-aligned
    assert cublaslt.wgrad_bgrad(dz[:, :72], x) is None  # not contiguous
    assert cublaslt.wgrad_bgrad(torch._neg_view(dz), x) is None  # a negated view's memory holds -values


def test_wgrad_bgrad_on_a_side_stream_and_in_a_cuda_graph():
    dz = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(512, 128, device="cuda", dtype=torch.bfloat16)
    ref = cublaslt.wgrad_bgrad(dz, x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        on_side = cublaslt.wgrad_bgrad(dz, x)
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(on_side[0], ref[0]) and torch.equal(on_side[1], ref[1])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = cublaslt.wgrad_bgrad(dz, x)
    dz.copy_(torch.randn_like(dz))
    g.replay()
    fresh = cublaslt.wgrad_bgrad(dz, x)
    assert torch.equal(captured[0], fresh[0]) and torch.equal(captured[1], fresh[1])


@pytest.mark.parametrize("path", ["cudnn", "torch"])
def test_fused_mlp_gradients_with_cublaslt_wgrad(monkeypatch, path):
    """nn.FusedMLP's backward with WGRAD=cublaslt: the same gradients as eager autograd, on the
    cuDNN graphs' path and on its torch path (a declined dz graph)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).cuda().to(torch.bfloat16)
    model = cf.optimize(copy.deepcopy(base))
    assert any(isinstance(m, cf.nn.FusedMLP) for m in model.modules())
    x = torch.randn(4, 512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    base(x).float().square().mean().backward()
    ref = [p.grad for p in base.parameters()] + [x.grad]
    x.grad = None
    monkeypatch.setattr(backward, "WGRAD", "cublaslt")
    if path == "torch":
        monkeypatch.setattr(backward, "mlp_grads", lambda *a, **k: None)
    calls = []
    real = cublaslt.wgrad_bgrad
    monkeypatch.setattr(cublaslt, "wgrad_bgrad", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    model(x).float().square().mean().backward()
    got = [p.grad for p in model.parameters()] + [x.grad]
    assert len(calls) == 2, calls  # dW2 + db2 and dW1 + db1, one GEMM each
    for g, r in zip(got, ref):
        assert g.shape == r.shape and _rel(g, r) < 2e-2
