"""GPU tests of cuBLASLt's GELU epilogues (the tanh form; cudnn_fuse.cublaslt.linear_gelu_aux and
dgelu_bgrad) and nn.FusedMLP's node with CUDNN_FUSE_MLP_KERNELS=cublaslt: the pre-activation
against a float64 GEMM, GELU and its backward against aten's tanh GELU, the bias gradient against
a float64 sum, declines, a CUDA graph replay, the training step against eager's gradients."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudnn_fuse as cf
from cudnn_fuse import backward, cublaslt
from tests.grad_check import mlp_operands as _operands

pytestmark = pytest.mark.gpu


def _within(ours, ref, bound, what):
    err = (ours.double() - ref.double()).abs()
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} elements off; worst excess "
                           f"{float((err - bound).max()):.3g}")


SHAPES = [(512, 256, 1024), (1000, 64, 136), (8, 512, 2048), (4096, 1024, 4096)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mkn", SHAPES, ids=str)
def test_linear_gelu_aux_and_dgelu_bgrad(dtype, mkn):
    m, k, n = mkn
    x, w1, b1, w2, gy = _operands(m, k, n, dtype)
    eps = torch.finfo(dtype).eps
    out = cublaslt.linear_gelu_aux(x, w1, b1)
    assert out is not None, "cuBLASLt declined GELU_AUX_BIAS on a plain aligned problem"
    y, z = out
    assert y.shape == z.shape == (m, n) and y.dtype == z.dtype == dtype
    exact = x.double() @ w1.double().t() + b1.double()
    mag = x.double().abs() @ w1.double().abs().t() + b1.double().abs()
    _within(z, exact, eps * exact.abs() + 2 * k * torch.finfo(torch.float32).eps * mag + 1e-30, "z")
    # y = gelu_tanh of the float pre-activation, rounded once: within two ulps of aten's GELU of
    # the rounded z, plus z's own rounding carried through gelu' (|gelu'| < 1.13)
    ref_y = F.gelu(z.float(), approximate="tanh")
    sub = torch.finfo(dtype).smallest_normal * eps  # the subnormals' spacing (fp16: 6e-8)
    _within(y, ref_y, 2 * eps * ref_y.abs() + eps * z.double().abs() + sub, "y")
    for need_db, in_epilogue in ((True, False), (False, False), (True, True)):
        out = cublaslt.dgelu_bgrad(gy, w2, z, need_db, in_epilogue)
        assert out is not None, "cuBLASLt declined DGELU_BGRAD"
        dz, db = out
        assert dz.shape == (m, n) and dz.dtype == dtype and (db is None) == (not need_db)
        prod = gy.float() @ w2.float()
        ref = torch.ops.aten.gelu_backward(prod, z.float(), approximate="tanh")
        pmag = (gy.double().abs() @ w2.double().abs())
        _within(dz, ref, 2 * eps * ref.abs() + 1.2 * (2 * eps * prod.double().abs() + 2 * k * 1.2e-7 * pmag) + 1e-30,
                "dz" + (" (DGELU_BGRAD)" if in_epilogue else ""))
        if need_db:
            ref_db = dz.double().sum(0)  # of the dz it wrote: the sum's own accuracy
            _within(db, ref_db, eps * ref_db.abs() + 4 * eps * dz.double().abs().sum(0) + 1e-30, "db")


def test_no_bias_and_3d_inputs():
    x, w1, _, w2, gy = _operands(4 * 64, 128, 256, torch.bfloat16)
    y, z = cublaslt.linear_gelu_aux(x.view(4, 64, 128), w1, None)
    assert y.shape == z.shape == (4, 64, 256)
    ref_z = F.linear(x, w1).view(4, 64, 256)
    assert (z.float() - ref_z.float()).abs().max() <= 2e-2 * ref_z.float().abs().max()
    dz, db = cublaslt.dgelu_bgrad(gy.view(4, 64, 128), w2, z, True)
    assert dz.shape == (4, 64, 256) and db.shape == (256,)


def test_declines():
    x, w1, b1, w2, gy = _operands(64, 128, 256, torch.bfloat16)
    assert cublaslt.linear_gelu_aux(x.cpu(), w1.cpu(), b1.cpu()) is None
    assert cublaslt.linear_gelu_aux(x.float(), w1.float(), b1.float()) is None
    assert cublaslt.linear_gelu_aux(x[:, :124], w1[:, :124], b1) is None  # K not a multiple of 8 (and a view)
    assert cublaslt.linear_gelu_aux(x, w1[:, :64], b1) is None  # shapes that do not chain
    assert cublaslt.linear_gelu_aux(x, w1.t().contiguous().t(), b1) is None  # not contiguous
    assert cublaslt.linear_gelu_aux(x, w1, b1[:8]) is None
    z = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    assert cublaslt.dgelu_bgrad(gy, w2, z[:32], True) is None
    torch.use_deterministic_algorithms(True)
    try:
        assert cublaslt.linear_gelu_aux(x, w1, b1) is None
        assert cublaslt.dgelu_bgrad(gy, w2, z, True) is None
    finally:
        torch.use_deterministic_algorithms(False)


def test_replays_in_a_cuda_graph_and_on_a_side_stream():
    x, w1, b1, w2, gy = _operands(256, 128, 384, torch.bfloat16)
    cublaslt.linear_gelu_aux(x, w1, b1)  # plans built before the capture
    y0, z0 = cublaslt.linear_gelu_aux(x, w1, b1)
    cublaslt.dgelu_bgrad(gy, w2, z0, True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # on a caller's own stream: the same numbers
        ys, zs = cublaslt.linear_gelu_aux(x, w1, b1)
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(ys, y0) and torch.equal(zs, z0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        y, z = cublaslt.linear_gelu_aux(x, w1, b1)
        dz, db = cublaslt.dgelu_bgrad(gy, w2, z, True)
    torch.cuda.current_stream().wait_stream(s)
    x2, _, _, _, gy2 = _operands(256, 128, 384, torch.bfloat16, seed=7)
    x.copy_(x2)
    gy.copy_(gy2)
    g.replay()
    torch.cuda.synchronize()
    ry, rz = cublaslt.linear_gelu_aux(x2, w1, b1)
    rdz, rdb = cublaslt.dgelu_bgrad(gy2, w2, rz, True)
    assert torch.equal(y, ry) and torch.equal(z, rz) and torch.equal(dz, rdz) and torch.equal(db, rdb)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fused_mlp_step_matches_eager(monkeypatch, dtype):
    """GELU(tanh) blocks run the epilogues; an exact-GELU block beside them runs torch's kernels."""
    monkeypatch.setattr(backward, "MLP", "cublaslt")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(512, 2048), nn.GELU(approximate="tanh"), nn.Linear(2048, 512),
                         nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512)).cuda().to(dtype)
    opt = cf.optimize(copy.deepcopy(base))
    assert sum(isinstance(m, cf.nn.FusedMLP) for m in opt.modules()) == 2
    x = torch.randn(4, 304, 512, device="cuda", dtype=dtype, requires_grad=True)
    before = dict(cublaslt.gelu_stats)
    grads = []
    for model in (base, opt):  # a summed loss: fp16 gradients of a mean sit in the subnormals
        x.grad = None
        model.zero_grad()
        model(x).float().square().sum().backward()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in model.parameters()])
    for ours, theirs in zip(grads[1], grads[0]):
        assert (ours.float() - theirs.float()).abs().max().item() <= 2e-2 * theirs.float().abs().max().item() + 1e-6
    assert cublaslt.gelu_stats["forward"] - before["forward"] == 1  # the tanh block only
    assert cublaslt.gelu_stats["backward"] - before["backward"] == 1


def test_fused_mlp_peak_is_not_above_eager(monkeypatch):
    """The node's step peak above the step's starting allocation is at most eager's (each model's
    gradients dropped after its steps, so that neither starts with the other's)."""
    monkeypatch.setattr(backward, "MLP", "cublaslt")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(approximate="tanh"), nn.Linear(4096, 1024)).cuda().to(torch.bfloat16)
    opt = cf.optimize(copy.deepcopy(base))
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    before = dict(cublaslt.gelu_stats)
    peaks = []
    for m in (base, opt):
        for _ in range(2):
            m.zero_grad(set_to_none=True)
            x.grad = None
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            m(x).float().square().mean().backward()
            torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - start)
        m.zero_grad(set_to_none=True)
        x.grad = None
    assert cublaslt.gelu_stats["backward"] - before["backward"] == 2  # the epilogues ran
    assert peaks[1] <= peaks[0], peaks
