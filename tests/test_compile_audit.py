"""The custom-op surface under torch.compile on the CPU: faults the 2026-12-04 audit found
(docs/decisions.md, "An audit of the custom ops under torch.compile"), each test failing
without its fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
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
