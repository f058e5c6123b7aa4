"""CPU tests of cuBLASLt's GELU epilogue path (cudnn_fuse.cublaslt.linear_gelu_aux / dgelu_bgrad,
CUDNN_FUSE_MLP_KERNELS=cublaslt): the column-major layouts against torch's products, the plan's
descriptor attributes with cuBLASLt stood in by a recorder, the declines, the FusedMLP node's
fallback on the CPU, and the linear backward's bias sum taken before its GEMMs. The GEMMs
themselves run in tests/test_gpu_cublaslt_gelu.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import cudnn_fuse as cf
from cudnn_fuse import backward, cublaslt, torch_ops
from tests.grad_check import env_setting


def _colmajor(flat: torch.Tensor, rows: int, cols: int, ld: int) -> torch.Tensor:
    """The rows x cols column-major matrix with leading dimension ld that cuBLASLt reads at flat."""
    return flat.as_strided((rows, cols), (1, ld))


def _gemm(trans, a_lay, b_lay, d_lay, a_buf, b_buf):
    """Emulate cuBLASLt's D = op(A) @ op(B) on the CPU; return D's buffer read back row-major."""
    a = _colmajor(a_buf.reshape(-1), *a_lay)
    b = _colmajor(b_buf.reshape(-1), *b_lay)
    a = a.t() if trans[0] == cublaslt._OP_T else a
    b = b.t() if trans[1] == cublaslt._OP_T else b
    d = a @ b
    rows, cols, ld = d_lay
    assert d.shape == (rows, cols) and ld >= rows
    out = torch.zeros(cols * ld, dtype=d.dtype)
    _colmajor(out, rows, cols, ld).copy_(d)
    return out


@pytest.mark.parametrize("m,n,k", [(16, 24, 8), (40, 8, 32)])
def test_the_layouts_compute_the_row_major_products(m, n, k):
    torch.manual_seed(0)
    x, w = torch.randn(m, k, dtype=torch.float64), torch.randn(n, k, dtype=torch.float64)
    trans, a, b, d, epi = cublaslt.gelu_fwd_layout(m, n, k, True)
    assert epi == cublaslt._EPILOGUE_GELU_AUX_BIAS
    assert cublaslt.gelu_fwd_layout(m, n, k, False)[4] == cublaslt._EPILOGUE_GELU_AUX
    z = _gemm(trans, a, b, d, w, x).view(m, n)  # A is the weight, B the input
    torch.testing.assert_close(z, x @ w.t())
    assert d[0] == n  # the bias vector runs along D's rows: one per output feature
    gy, w2 = torch.randn(m, k, dtype=torch.float64), torch.randn(k, n, dtype=torch.float64)
    trans, a, b, d, epi = cublaslt.dgelu_layout(m, n, k, False)
    assert epi == cublaslt._EPILOGUE_DGELU and cublaslt.dgelu_layout(m, n, k, True)[4] == cublaslt._EPILOGUE_DGELU_BGRAD
    prod = _gemm(trans, a, b, d, w2, gy).view(m, n)
    torch.testing.assert_close(prod, gy @ w2)
    assert d[0] == n  # DGELU_BGRAD's bias gradient: one per feature, summed over the m rows


class _Recorder:
    """cuBLASLt stood in: records descriptor attributes and layouts, answers one algorithm."""

    def __init__(self, found=1, workspace=131):
        self.attrs, self.layouts, self.found, self.workspace = {}, [], found, workspace

    def cublasLtMatmulDescCreate(self, desc, compute, scale):
        desc._obj.value = 1
        return 0

    def cublasLtMatmulDescSetAttribute(self, desc, attr, value, size):
        self.attrs[attr] = value._obj.value
        return 0

    def cublasLtMatrixLayoutCreate(self, lay, dtype, rows, cols, ld):
        self.layouts.append((dtype, rows, cols, ld))
        return 0

    def cublasLtMatmulPreferenceCreate(self, pref):
        return 0

    def cublasLtMatmulPreferenceSetAttribute(self, pref, attr, value, size):
        self.attrs[("pref", attr)] = value._obj.value
        return 0

    def cublasLtMatmulAlgoGetHeuristic(self, handle, desc, a, b, c, d, pref, n, result, count):
        count._obj.value = self.found
        result._obj.workspaceSize = self.workspace
        return 0


def test_the_plan_sets_what_the_epilogue_needs():
    lib = _Recorder()
    plan = cublaslt._EpiPlan(lib, None, cublaslt._R_16BF, *cublaslt.gelu_fwd_layout(64, 256, 128, True), True)
    assert lib.attrs[cublaslt._DESC_EPILOGUE] == cublaslt._EPILOGUE_GELU_AUX_BIAS
    assert (lib.attrs[cublaslt._DESC_TRANSA], lib.attrs[cublaslt._DESC_TRANSB]) == (cublaslt._OP_T, cublaslt._OP_N)
    assert lib.attrs[cublaslt._DESC_AUX_LD] == 256  # the pre-activation matrix's leading dimension: D's
    assert lib.attrs[cublaslt._DESC_AUX_POINTER] % cublaslt.ALIGN == 0  # set before the heuristic
    assert lib.attrs[cublaslt._DESC_BIAS_POINTER] % cublaslt.ALIGN == 0
    assert lib.layouts == [(cublaslt._R_16BF, 128, 256, 128), (cublaslt._R_16BF, 128, 64, 128),
                           (cublaslt._R_16BF, 256, 64, 256)]
    assert lib.attrs[("pref", cublaslt._PREF_MAX_WORKSPACE_BYTES)] == cublaslt.EPILOGUE_WORKSPACE_BYTES > 0
    assert plan.workspace == 131
    lib = _Recorder()
    cublaslt._EpiPlan(lib, None, cublaslt._R_16F, *cublaslt.dgelu_layout(64, 256, 128, False), False)
    assert lib.attrs[cublaslt._DESC_EPILOGUE] == cublaslt._EPILOGUE_DGELU
    assert cublaslt._DESC_BIAS_POINTER not in lib.attrs  # DGELU alone writes no bias gradient
    with pytest.raises(cublaslt.CublasLtError, match="no algorithm"):
        cublaslt._EpiPlan(_Recorder(found=0), None, cublaslt._R_16F, *cublaslt.dgelu_layout(64, 256, 128, True), True)


def test_declines_without_cuda_or_on_bad_operands():
    x, w, b = torch.randn(16, 32, dtype=torch.bfloat16), torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    assert not cublaslt.gelu_usable(x, w, b)
    assert cublaslt.linear_gelu_aux(x, w, b) is None
    assert cublaslt.linear_gelu_aux(x, w[:, :16], b) is None  # shapes that do not chain
    assert cublaslt.linear_gelu_aux(x, w, b[:8]) is None
    gy, w2, z = torch.randn(16, 32, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16), torch.randn(16, 64, dtype=torch.bfloat16)
    assert cublaslt.dgelu_bgrad(gy, w2, z, True) is None
    assert cublaslt.dgelu_bgrad(gy, w2, z[:8], True) is None
    assert cublaslt.dgelu_bgrad(gy, w2.t(), z, True) is None


@pytest.mark.parametrize("mode", ["cublaslt", "triton"])
def test_fused_mlp_on_the_cpu_gives_autograd_gradients(monkeypatch, mode):
    """With either opt-in kernel set the CPU node declines to the reference and matches autograd."""
    monkeypatch.setattr(backward, "MLP", mode)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 64), nn.GELU(approximate="tanh"), nn.Linear(64, 16))
    opt = cf.optimize(copy.deepcopy(base))
    assert sum(isinstance(m, cf.nn.FusedMLP) for m in opt.modules()) == 1
    before = dict(cublaslt.gelu_stats)
    x = torch.randn(8, 16, requires_grad=True)
    grads = []
    for m in (base, opt):
        x.grad = None
        m.zero_grad()
        m(x).square().sum().backward()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in m.parameters()])
    for ours, theirs in zip(*grads[::-1]):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert cublaslt.gelu_stats == before


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_the_linear_backward_sums_the_bias_before_its_gemms(monkeypatch):
    """The column sum's scratch (128 MiB for a 4096 x 4096 bf16 dz on the H200) meets fewer live
    tensors before dx and dw exist: the node's backward peak fell from 8 MiB above eager's to 8 below."""
    monkeypatch.setattr(backward, "BIAS_SUM", "inline")
    monkeypatch.setattr(backward, "wgrad", lambda *a: None)
    dz, x, w = torch.randn(2, 5, 4), torch.randn(2, 5, 3), torch.randn(4, 3)
    with _Ops() as mode:
        dx, dw, db = torch_ops._linear_products(dz, x, w, True, True, True)
    first_sum = mode.ops.index("sum")
    gemms = [i for i, op in enumerate(mode.ops) if op in ("mm", "matmul", "bmm", "addmm")]
    assert gemms and first_sum < min(gemms), mode.ops
    torch.testing.assert_close(db, dz.reshape(10, 4).sum(0))
    torch.testing.assert_close(dx, dz @ w)


def test_the_mode_is_read_from_the_environment():
    code = "from cudnn_fuse import backward; print(backward.MLP)"
    assert env_setting(code, "CUDNN_FUSE_MLP_KERNELS", "cublaslt") == "cublaslt"
    assert env_setting(code, "CUDNN_FUSE_MLP_KERNELS", "triton") == "triton"
