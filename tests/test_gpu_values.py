"""Special values on the GPU: what the CPU audit (tests/test_values_audit.py) could not check.

cuDNN's epilogues compute max/relu with hardware min/max, which return the number when one operand
is NaN (fmaxf(NaN, 0) = 0). Measured on the H200 (2026-12-04): y's NaN are torch's (relu(NaN) is
NaN), but the AMAX reduction skips NaN, unlike torch's ``y.abs().amax()`` and cf's CPU op; amax
is the max of the returned (16-bit) y."""

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


def _with_nan(op, dt):
    x, w, b, r = _operands(dt, op)
    if op == "conv2d":
        x[0, 5, 3, 3] = float("nan")  # one NaN in x: its output pixel's 3x3 neighbourhood of y is NaN
    else:
        x[0, 5] = float("nan")  # a row of y is NaN
    return x, w, b, r


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("act", [None, "relu", "gelu", "leaky_relu"])
@pytest.mark.parametrize("op", ["linear", "matmul", "conv2d"])
def test_nan_propagates_into_y_as_torch(op, act, dt):
    """relu(NaN) is NaN in cuDNN's epilogue too (no fmaxf(NaN, 0) = 0): y's NaN are torch's."""
    x, w, b, r = _with_nan(op, dt)
    want = _torch(op, x, w, b, r, act)
    y, _ = _fused(lambda: _call(op, x, w, b, r, act))
    assert want.isnan().any()
    assert torch.equal(y.isnan(), want.isnan()), f"{int(y.isnan().sum())} NaN in y, torch has {int(want.isnan().sum())}"
    ok = ~want.isnan()
    torch.testing.assert_close(y[ok], want[ok], rtol=2e-2, atol=2e-2)  # the other values unharmed


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("act", [None, "relu", "gelu"])
@pytest.mark.parametrize("op", ["linear", "matmul", "conv2d"])
def test_the_fused_amax_skips_nan(op, act, dt):
    """cuDNN's AMAX reduction skips NaN: amax is max |y| over y's numbers (as Transformer Engine's
    amax), where torch's y.abs().amax() and cf's CPU op give NaN (H200, 2026-12-04: every one of
    these cases gave a finite amax, gpu_session_values_log.txt). Documented in README and
    docs/decisions.md ("Epilogue numerics"); this test fails if cuDNN starts to propagate NaN."""
    x, w, b, r = _with_nan(op, dt)
    y, amax = _fused(lambda: _call(op, x, w, b, r, act))
    assert y.isnan().any()
    numbers = y.abs().float().nan_to_num(nan=0.0).amax()
    assert amax.dtype == torch.float32 and amax.shape == () and torch.isfinite(amax), amax
    assert abs(float(amax) - float(numbers)) <= float(numbers) * torch.finfo(dt).eps, (float(amax), float(numbers))


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
