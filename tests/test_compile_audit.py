"""The custom-op surface under torch.compile on the CPU: faults the 2026-12-04 audit found
(docs/decisions.md, "An audit of the custom ops under torch.compile"), each test failing
without its fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.func import grad, vmap

import cudnn_fuse as cf
from cudnn_fuse import ops

F64 = torch.float64


@pytest.fixture
def fresh_log(monkeypatch):
    """No fallback reason logged yet in this process (each reason is logged once: the first call of
    a reason is the one that reached the logger)."""
    monkeypatch.setattr(ops, "_said", set())


@pytest.fixture(params=["default", "opaque"])
def inline(request):
    """CUDNN_FUSE_COMPILE_INLINE's default (linear, matmul, sdpa traced as torch), and none inlined."""
    prev = cf.set_compile_inline(ops.COMPILE_INLINE_OPS if request.param == "default" else ())
    yield request.param
    cf.set_compile_inline(prev)


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="eager", fullgraph=True)  # raises on any graph break


# A logged fallback inside traced code: dynamo cannot trace a logger call, so the first call of a
# fallback reason under torch.compile(fullgraph=True) raised Unsupported ("logging.Logger method not
# supported"), without fullgraph a graph break; after an eager call had logged that reason it traced.


def test_sdpa_with_dropout_compiles_fullgraph(fresh_log, inline):
    q = torch.randn(2, 2, 5, 4, requires_grad=True)
    o = _compiled(lambda q: cf.scaled_dot_product_attention(q, q, q, dropout_p=0.5))(q)
    o.sum().backward()
    assert o.shape == q.shape and q.grad is not None and q.grad.shape == q.shape


def test_sdpa_with_a_float32_mask_beside_bfloat16_compiles_fullgraph(fresh_log, inline):
    q, k = torch.randn(2, 2, 5, 4, dtype=torch.bfloat16), torch.randn(2, 2, 6, 4, dtype=torch.bfloat16)
    m = torch.randn(5, 6)
    got = _compiled(lambda q, k, m: cf.scaled_dot_product_attention(q, k, k, m))(q, k, m)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, k, m))


def test_torch_func_transforms_inside_compile(fresh_log, inline):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 5, generator=g, dtype=F64), torch.randn(4, 5, generator=g, dtype=F64)
    img, k = torch.randn(2, 3, 6, 6, generator=g, dtype=F64), torch.randn(4, 3, 3, 3, generator=g, dtype=F64)
    q = torch.randn(2, 2, 5, 4, generator=g, dtype=F64)

    got = _compiled(vmap(lambda x: cf.conv2d(x, k, padding=1, activation="relu")))(img)
    torch.testing.assert_close(got, F.relu(F.conv2d(img, k, padding=1)))
    got = _compiled(grad(lambda k: cf.conv2d(img, k, activation="silu").sum()))(k)
    torch.testing.assert_close(got, grad(lambda k: F.silu(F.conv2d(img, k)).sum())(k))
    got = _compiled(vmap(lambda x: cf.linear(x, w, activation="gelu")))(x)
    torch.testing.assert_close(got, F.gelu(F.linear(x, w)))
    got = _compiled(grad(lambda w: cf.matmul(x, w.t(), activation="tanh").sum()))(w)
    torch.testing.assert_close(got, grad(lambda w: torch.tanh(x @ w.t()).sum())(w))
    got = _compiled(grad(lambda q: cf.scaled_dot_product_attention(q, q, q, is_causal=True).sum()))(q)
    torch.testing.assert_close(got, grad(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True).sum())(q))


def test_fallbacks_are_still_logged_in_eager(fresh_log, caplog):
    q = torch.randn(2, 2, 5, 4)
    with caplog.at_level("DEBUG", logger="cudnn_fuse"):
        cf.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    assert "dropout_p > 0" in caplog.text


# The conv's CPU backward formula, traced by AOTAutograd on symbolic sizes, read each size with int()
# (reference.nchw's stride check), which specialized the batch and image sizes: a recompile for every
# new shape, and with mark_dynamic a ConstraintViolationError where torch's conv trains.


@pytest.mark.parametrize("unbatched", [False, True])
def test_conv_training_keeps_dynamic_sizes(unbatched):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(6, 4, 3, 3, generator=g, dtype=F64), torch.randn(6, generator=g, dtype=F64)
    torch._dynamo.reset()
    counters.clear()
    # aot_eager: AOTAutograd traces the backward formulas (the eager backend traces no backward)
    fn = torch.compile(lambda x, w, b: cf.conv2d(x, w, b, padding=1, activation="gelu"), backend="aot_eager",
                       fullgraph=True)
    for n, h in ((2, 9), (3, 11)):
        shape = (4, h, h + 1) if unbatched else (n, 4, h, h + 1)
        x = torch.randn(shape, generator=g, dtype=F64)
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
        for t in range(1 if unbatched else 0, x.dim()):
            if t != (0 if unbatched else 1):  # the channels stay static
                torch._dynamo.mark_dynamic(xs, t)
        y = fn(xs, ws, bs)
        want = F.gelu(F.conv2d(xr, wr, br, padding=1))
        torch.testing.assert_close(y, want)
        y.pow(2).sum().backward()
        want.pow(2).sum().backward()
        for got, ref in ((xs, xr), (ws, wr), (bs, br)):
            torch.testing.assert_close(got.grad, ref.grad)
    assert counters["stats"]["unique_graphs"] == 1  # the second shape reused the first's graph
