"""cf.scaled_mm: torch._scaled_mm's conventions (scales dequantize) with cf's epilogues, an FP8 output
saturated rather than NaN, and the amax before scale_result; its validation names the argument. The
CPU runs the float32 reference; the older GPUs' path (dequantized operands through the bfloat16 matmul)
is run here on CPU tensors (the FP8 GPUs' dispatch: test_fp8_gemm.py)."""

from __future__ import annotations

import pytest
import torch

import cudnn_fuse as cf
from cudnn_fuse import functional, reference
from cudnn_fuse.errors import ArgumentError

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def _ops(M=32, K=64, N=48, batch=(), seed=0, da=E4, db=E4):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(*batch, M, K, generator=g).to(da)
    b = torch.randn(K, N, generator=g).to(db)
    return a, b, torch.tensor(0.5), torch.tensor(0.25)


def _want(a, b, sa, sb, bias=None, residual=None, act=None):
    r = (a.double() * sa.double()) @ (b.double() * sb.double())
    if bias is not None:
        r = r + bias.double()
    if residual is not None:
        r = r + residual.double()
    return reference.activation(r, act)


@pytest.mark.parametrize("act", [None, "relu", "gelu", "silu"])
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float16, torch.float32])
def test_the_result_is_the_dequantized_product_with_its_epilogue(act, out):
    a, b, sa, sb = _ops()
    bias, res = torch.randn(48), torch.randn(32, 48)
    y, am = cf.scaled_mm(a, b, sa, sb, bias=bias, activation=act, residual=res, out_dtype=out, return_amax=True)
    want = _want(a, b, sa, sb, bias, res, act)
    assert y.dtype == out and y.shape == (32, 48)
    torch.testing.assert_close(y.double(), want, atol=2e-2, rtol=1e-2)
    assert am.dtype == torch.float32 and am.shape == () and am.item() == pytest.approx(want.abs().max().item(), rel=1e-5)


def test_it_agrees_with_torch_scaled_mm():
    a, b, sa, sb = _ops()
    y = cf.scaled_mm(a, b, sa, sb)
    t = torch._scaled_mm(a, b.t().contiguous().t(), sa, sb, out_dtype=torch.bfloat16)
    torch.testing.assert_close(y.float(), t.float(), atol=1e-2, rtol=1e-2)


def test_rowwise_scales_with_a_bfloat16_output():
    a, b, _, _ = _ops()
    sa, sb = torch.rand(32, 1) + 0.5, torch.rand(1, 48) + 0.5
    torch.testing.assert_close(cf.scaled_mm(a, b, sa, sb).double(), _want(a, b, sa, sb), atol=2e-2, rtol=1e-2)
    with pytest.raises(ArgumentError, match=r"scale_a must have one element, or be rowwise \(32, 1\)"):
        cf.scaled_mm(a, b, sa, sb, out_dtype=torch.float32)


@pytest.mark.parametrize("fmt", [E4, E5])
def test_an_fp8_output_is_scaled_saturated_and_its_amax_taken_before_the_scale(fmt):
    a, b, sa, sb = _ops()
    res = torch.zeros(32, 48)
    res[0, 0], res[1, 1] = 1e6, -1e6  # far past both formats' largest values
    scale = torch.tensor(4.0)
    y, am = cf.scaled_mm(a, b, sa, sb, residual=res, out_dtype=fmt, scale_result=scale, return_amax=True)
    big = torch.finfo(fmt).max
    assert y.dtype == fmt and not torch.isnan(y.float()).any()  # torch's own cast gives NaN for e4m3fn
    assert y[0, 0].float().item() == big and y[1, 1].float().item() == -big
    want = _want(a, b, sa, sb, residual=res)
    assert am.item() == pytest.approx(want.abs().max().item(), rel=1e-6)  # before scale_result
    inner = (want * 4.0).clamp(-big, big)[2:, 2:]
    # one rounding to the format: half its relative step, or half its smallest subnormal step
    step, tiny = (2.0**-3, 2.0**-9) if fmt == E4 else (2.0**-2, 2.0**-16)
    assert ((y.float()[2:, 2:].double() - inner).abs() <= inner.abs() * step / 2 + tiny / 2 + 1e-12).all()


def test_nan_stays_nan():
    a, b, sa, sb = _ops()
    res = torch.zeros(32, 48)
    res[3, 4] = float("nan")
    y, am = cf.scaled_mm(a, b, sa, sb, residual=res, out_dtype=E4, return_amax=True)
    assert torch.isnan(y[3, 4].float()) and torch.isnan(am)


def test_batched_operands_multiply_like_matmul():
    a, b, sa, sb = _ops(batch=(3,))
    y = cf.scaled_mm(a, b, sa, sb, activation="relu")
    assert y.shape == (3, 32, 48)
    torch.testing.assert_close(y.double(), _want(a, b, sa, sb, act="relu"), atol=2e-2, rtol=1e-2)


def test_the_gpu_path_dequantizes_through_the_bfloat16_matmul():
    a, b, sa, sb = _ops()
    bias = torch.randn(48)
    for out, scale in ((torch.bfloat16, None), (E4, torch.tensor(2.0))):
        y, am = functional._scaled_mm_bf16(a, b, sa, sb, bias, "gelu", None, out, scale, True, 0.01)
        want, want_am = reference.scaled_mm(a, b, sa, sb, bias, "gelu", None, out, scale, True)
        assert y.dtype == out and y.shape == want.shape
        # bfloat16 arithmetic, then (for FP8) a rounding that may land one FP8 step away from the reference's
        rtol = 7e-2 if out == torch.bfloat16 else 0.13
        torch.testing.assert_close(y.float(), want.float(), atol=6e-2, rtol=rtol)
        assert am.item() == pytest.approx(want_am.item(), rel=2e-2)


def test_it_compiles_in_one_graph():
    a, b, sa, sb = _ops()
    bias = torch.randn(48)
    torch._dynamo.reset()
    fn = torch.compile(lambda *t: cf.scaled_mm(*t, bias=bias, activation="gelu", return_amax=True), fullgraph=True)
    (y, am), (wy, wam) = fn(a, b, sa, sb), cf.scaled_mm(a, b, sa, sb, bias=bias, activation="gelu", return_amax=True)
    torch.testing.assert_close(y.float(), wy.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(am, wam, atol=1e-3, rtol=1e-3)


def _call(**over):
    a, b, sa, sb = _ops()
    kw = dict(a=a, b=b, scale_a=sa, scale_b=sb)
    kw.update(over)
    return cf.scaled_mm(**kw)


@pytest.mark.parametrize("over, exc, match", [
    (dict(a=[[1.0]]), TypeError, "a must be a torch.Tensor of an FP8 dtype"),
    (dict(a=torch.randn(32, 64, dtype=torch.bfloat16)), ArgumentError, "a must be float8_e4m3fn or float8_e5m2"),
    (dict(a=torch.randn(32, 64).to(E5), b=torch.randn(64, 48).to(E5)), ArgumentError, "cannot both be float8_e5m2"),
    (dict(a=torch.randn(32, 8).to(E4), b=torch.randn(8, 48).to(E4)), ArgumentError, r"multiples of 16 \(FP8 GEMMs\), got K=8"),
    (dict(b=torch.randn(48, 48).to(E4)), ArgumentError, "do not multiply"),
    (dict(b=torch.randn(64).to(E4)), ArgumentError, "at least 2 dimensions"),
    (dict(a=torch.randn(3, 32, 64).to(E4), b=torch.randn(2, 64, 48).to(E4)), ArgumentError, "do not broadcast"),
    (dict(out_dtype=torch.int8), ArgumentError, "out_dtype must be one of"),
    (dict(out_dtype="bf16"), TypeError, "out_dtype must be a torch.dtype"),
    (dict(scale_a=None), TypeError, "scale_a must be a torch.Tensor"),
    (dict(scale_b=None), TypeError, "scale_b must be a torch.Tensor"),
    (dict(scale_a=torch.tensor(0.5, dtype=torch.float16)), ArgumentError, "scale_a must be float32"),
    (dict(scale_b=torch.ones(2, 2)), ArgumentError, r"scale_b must have one element"),
    (dict(scale_result=torch.tensor(2.0)), ArgumentError, "scale_result applies to an FP8 output only"),
    (dict(out_dtype=E4, scale_result=torch.ones(2)), ArgumentError, "scale_result must be a float32 tensor of one"),
    (dict(bias=torch.randn(32)), ArgumentError, r"bias must have shape \(48,\)"),
    (dict(residual=torch.randn(5, 48)), ArgumentError, "residual.shape=.5, 48. does not broadcast"),
    (dict(return_amax="yes"), TypeError, "return_amax must be a bool"),
    (dict(activation="swish"), ArgumentError, "activation"),
])
def test_bad_arguments_are_named(over, exc, match):
    with pytest.raises(exc, match=match):
        _call(**over)


@pytest.mark.parametrize("fault", ["algorithm", "key"])
def test_an_algorithm_that_cannot_be_stored_leaves_the_plan_running(tmp_path, fault):
    """Storing a cuBLASLt algorithm is best effort: a fault there never refuses the plan."""
    import types

    from cudnn_fuse import fp8_gemm
    from cudnn_fuse.cache import PlanCache

    class Alg:
        algorithm_id = 3

        def as_numpy(self):
            raise RuntimeError("not a numpy view")

    pc = PlanCache(tmp_path / "c", namespace="t")
    alg = Alg() if fault == "algorithm" else types.SimpleNamespace(algorithm_id=3, as_numpy=lambda: {"workspace_size": [0]})
    key = (0, 8, 16, 32) if fault == "algorithm" else ("probe", torch.bfloat16, "BIAS")  # M, K, N not ints
    fp8_gemm._store_algorithm(pc, "ab" * 32, types.SimpleNamespace(algorithms=[alg]), key, "BIAS", False)
    assert pc.get("ab" * 32) is None


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_quantize_fp8_scales_by_the_amax_and_returns_the_dequantization_factor(dtype):
    torch.manual_seed(0)
    t = torch.randn(64, 32, dtype=torch.bfloat16) * 3
    q, descale = cf.quantize_fp8(t, dtype)
    assert q.dtype == dtype and descale.dtype == torch.float32 and descale.shape == (1,)
    assert q.float().abs().max() == torch.finfo(dtype).max  # the amax lands on the format's largest value
    step = 2.0 ** -3 if dtype == torch.float8_e4m3fn else 2.0 ** -2
    torch.testing.assert_close(q.float() * descale, t.float(), rtol=step, atol=step * 3 * 2 ** -6)
    q2, d2 = cf.quantize_fp8(t, dtype, margin=2)
    torch.testing.assert_close(d2, descale * 4)
    z, dz = cf.quantize_fp8(torch.zeros(4, 4))
    assert dz.item() == 1.0 and not z.float().any()


@pytest.mark.parametrize("bad,arg,exc", [(dict(t=torch.zeros(2, dtype=torch.int32)), "t", ArgumentError),
                                         (dict(t=torch.zeros(2).to(torch.float8_e4m3fn)), "t", ArgumentError),
                                         (dict(dtype=torch.bfloat16), "dtype", ArgumentError),
                                         (dict(margin=-1), "margin", ArgumentError),
                                         (dict(t=[1.0]), "t", TypeError), (dict(dtype="e4m3"), "dtype", TypeError),
                                         (dict(margin=True), "margin", TypeError), (dict(margin="a"), "margin", TypeError)])
def test_quantize_fp8_names_a_bad_argument(bad, arg, exc):
    """A value of the wrong type is a TypeError, one out of range an ArgumentError (a ValueError)."""
    kw = {"t": torch.zeros(2), **bad}
    with pytest.raises(exc, match=f"quantize_fp8: {arg}") as info:
        cf.quantize_fp8(**kw)
    assert type(info.value) is exc
