"""Special values on the GPU: what the CPU audit (tests/test_values_audit.py) could not check.

cuDNN's epilogues compute max/relu with hardware min/max, which return the number when one operand
is NaN (fmaxf(NaN, 0) = 0), so a fused relu could turn NaN into 0 and the AMAX reduction could skip
a NaN: these tests hold the GPU ops to torch's expression (relu(NaN) is NaN; amax is
``y.abs().amax()``, NaN when y has one) and say whether amax is taken of the rounded 16-bit y."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cudnn_fuse as cf
from cudnn_fuse import reference

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]


def _operands(dt, op):
    torch.manual_seed(0)
    if op == "conv2d":
        x = torch.randn(2, 64, 16, 16, device="cuda", dtype=dt).to(memory_format=torch.channels_last)
        w = (torch.randn(64, 64, 3, 3, device="cuda") / 24).to(dt).to(memory_format=torch.channels_last)
        r = torch.randn(2, 64, 16, 16, device="cuda", dtype=dt).to(memory_format=torch.channels_last)
    else:
        x = torch.randn(128, 256, device="cuda", dtype=dt)
        w = (torch.randn(192, 256, device="cuda") / 16).to(dt)
        r = torch.randn(128, 192, device="cuda", dtype=dt)
    b = torch.randn(w.shape[0], device="cuda", dtype=dt)
    return x, w, b, r


def _call(op, x, w, b, r, act):
    if op == "conv2d":
        return cf.conv2d(x, w, b, padding=1, activation=act, residual=r, return_amax=True)
    if op == "matmul":
        return cf.matmul(x, w.t(), b, activation=act, residual=r, return_amax=True)
    return cf.linear(x, w, b, activation=act, residual=r, return_amax=True)


def _torch(op, x, w, b, r, act):
    """torch's expression in float32, rounded once (the epilogue's numerics)."""
    f = lambda t: t.float()  # noqa: E731
    z = F.conv2d(f(x), f(w), f(b), padding=1) if op == "conv2d" else F.linear(f(x), f(w), f(b))
    return reference.activation(z + f(r), act).to(x.dtype)


def _fused(fn):
    before = cf.plan_stats()["fallbacks"]
    out = fn()
    torch.cuda.synchronize()
    assert cf.plan_stats()["fallbacks"] == before, "the op fell back to PyTorch: nothing of cuDNN's was checked"
    return out


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("act", [None, "relu", "gelu", "leaky_relu"])
@pytest.mark.parametrize("op", ["linear", "matmul", "conv2d"])
def test_nan_propagates_into_y_and_amax_as_torch(op, act, dt):
    x, w, b, r = _operands(dt, op)
    if op == "conv2d":
        x[0, 5, 3, 3] = float("nan")  # one NaN in x: its output pixel's 3x3 neighbourhood of y is NaN
    else:
        x[0, 5] = float("nan")  # a row of y is NaN
    want = _torch(op, x, w, b, r, act)
    y, amax = _fused(lambda: _call(op, x, w, b, r, act))
    assert want.isnan().any()
    assert torch.equal(y.isnan(), want.isnan()), f"{int(y.isnan().sum())} NaN in y, torch has {int(want.isnan().sum())}"
    assert amax.dtype == torch.float32 and amax.shape == () and amax.isnan(), amax


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("op", ["linear", "matmul", "conv2d"])
def test_amax_is_the_max_of_y_as_returned(op, dt, record_property):
    """amax is max|y| of the y returned, to within y's rounding: cuDNN may reduce the float32 values
    before they are rounded to 16 bits. Whether it was exact is recorded in the junit XML
    (``amax_exact``)."""
    x, w, b, r = _operands(dt, op)
    y, amax = _fused(lambda: _call(op, x, w, b, r, "relu"))
    rounded = float(y.abs().amax())
    record_property("amax_exact", float(amax) == rounded)
    record_property("amax_minus_rounded", float(amax) - rounded)
    assert torch.isfinite(amax) and amax > 0
    assert abs(float(amax) - rounded) <= rounded * torch.finfo(dt).eps, (float(amax), rounded)


@pytest.mark.parametrize("dt", DTYPES)
def test_inf_in_the_residual_reaches_y_and_amax(dt):
    x, w, b, r = _operands(dt, "linear")
    r[3, 7] = float("inf")
    r[4, 9] = float("-inf")
    want = _torch("linear", x, w, b, r, None)
    y, amax = _fused(lambda: _call("linear", x, w, b, r, None))
    assert torch.equal(y.isinf(), want.isinf()) and y[3, 7] == float("inf") and y[4, 9] == float("-inf")
    assert amax == float("inf")
