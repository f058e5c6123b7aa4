"""Custom ops on the CPU: opcheck, torch.compile(fullgraph=True), gradients vs torch autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import cudnn_fuse as cf
from cudnn_fuse import ops, reference, torch_ops
from cudnn_fuse.errors import ArgumentError
from cudnn_fuse.spec import ACTIVATIONS

ACTS = [None, *ACTIVATIONS]  # every activation cf fuses, and none


def rg(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype).requires_grad_()


@pytest.mark.parametrize("args", [
    (rg(2, 3, 6, 6), rg(4, 3, 3, 3), rg(4), [1, 1], [1, 1], [1, 1], [1, 1], 1, "relu", rg(2, 4, 6, 6), True, 0.01),
    (rg(2, 4, 7, 7), rg(4, 2, 2, 2), None, [2, 2], [0, 0], [1, 1], [1, 1], 2, "silu", None, False, 0.01),
    (rg(3, 5, 5), rg(2, 3, 3, 3), rg(2), [1, 1], [1, 1], [1, 1], [1, 1], 1, None, None, False, 0.01),
])
def test_opcheck_conv2d(args):
    opcheck(torch_ops.conv2d_op, args)


@pytest.mark.parametrize("args", [
    (rg(3, 5), rg(4, 5), rg(4), "gelu", None, True, 0.01),
    (rg(2, 3, 5), rg(4, 5), None, "leaky_relu", rg(2, 3, 4), False, 0.2),
    (rg(5), rg(4, 5), rg(4), None, None, False, 0.01),
])
def test_opcheck_linear(args):
    opcheck(torch_ops.linear_op, args)


@pytest.mark.parametrize("args", [
    (rg(2, 3, 5), rg(5, 4), rg(4), "tanh", None, True, 0.01),
    (rg(2, 1, 3, 5), rg(3, 5, 4), None, "relu", rg(2, 3, 3, 4), False, 0.01),
    (rg(5), rg(2, 5, 4), None, None, None, False, 0.01),
])
def test_opcheck_matmul(args):
    opcheck(torch_ops.matmul_op, args)


@pytest.mark.parametrize("args", [
    (rg(2, 4, 5, 8), rg(2, 2, 6, 8), rg(2, 2, 6, 8), None, False, None, True),
    (rg(2, 4, 5, 8), rg(2, 4, 5, 8), rg(2, 4, 5, 8), None, True, 0.3, False),
    (rg(2, 4, 5, 8), rg(2, 4, 6, 8), rg(2, 4, 6, 8), torch.randn(2, 1, 5, 6, dtype=torch.float64), False, None, False),
    (rg(3, 5, 8), rg(3, 6, 8), rg(3, 6, 8), torch.rand(5, 6) > 0.2, False, None, False),
])
def test_opcheck_sdpa(args):
    opcheck(torch_ops.sdpa_op, args)


@pytest.mark.parametrize("args", [
    (rg(2, 4, 5, 8), rg(2, 2, 6, 8), rg(2, 2, 6, 8), None, False, None, True),
    (rg(2, 4, 5, 8), rg(2, 4, 5, 8), rg(2, 4, 5, 8), None, True, 0.3, False),
    (rg(2, 4, 5, 8), rg(2, 4, 6, 8), rg(2, 4, 6, 8), torch.randn(2, 1, 5, 6, dtype=torch.float64), False, None, False),
    (rg(3, 5, 8), rg(3, 6, 8), rg(3, 6, 8), torch.rand(5, 6) > 0.2, False, None, False),
    (rg(2, 5, 4, 8).transpose(1, 2), rg(2, 6, 4, 8).transpose(1, 2), rg(2, 6, 4, 8).transpose(1, 2), None, False,
     None, False),  # BSHD views
])
def test_opcheck_sdpa_train(args):
    """The training op's fake gives the stats as float32 [B, H, Sq, 1]; where torch's forward runs (the
    CPU, or cuDNN declining) the real op's stats have that shape, dtype and strides too (they were an
    empty (0,) tensor, which opcheck's fake-tensor check failed on)."""
    opcheck(torch_ops.sdpa_train_op, args)
    o, stats = torch_ops.sdpa_train_op(*args)
    q = args[0]
    B = q.shape[0] if q.dim() == 4 else 1
    assert stats.shape == (B, q.shape[-3], q.shape[-2], 1) and stats.dtype == torch.float32 and stats.is_contiguous()
    torch.testing.assert_close(o, torch_ops.sdpa_op(*args))


def test_torch_compile_fullgraph_has_no_graph_break():
    torch._dynamo.reset()

    def block(x, w, b, q, k):
        h = cf.linear(x, w, b, activation="gelu")
        c = cf.conv2d(h.view(2, 4, 4, 4), w[:4].reshape(4, 4, 2, 2), padding="same", activation="relu")
        o = cf.scaled_dot_product_attention(q, k, k, enable_gqa=True)
        m, amax = cf.matmul(h, w, return_amax=True)
        return c.sum() + o.sum() + m.sum() + amax

    args = (torch.randn(8, 16), torch.randn(16, 16), torch.randn(16), torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8))
    compiled = torch.compile(block, fullgraph=True)  # raises on any graph break
    torch.testing.assert_close(compiled(*args), block(*args))


def _grads(fn, inputs):
    out = fn(*inputs)
    loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)).sum() + (out ** 2).sum()
    return torch.autograd.grad(loss, [t for t in inputs if t is not None and t.requires_grad])


@pytest.mark.parametrize("act", ACTS)
def test_conv2d_gradients_equal_torch_autograd(act):
    x, w, b, r = rg(2, 4, 7, 7), rg(6, 2, 3, 3), rg(6), rg(2, 6, 4, 4)
    slope = 0.1 if act == "leaky_relu" else 0.01  # a slope only with leaky_relu (any other one is an ArgumentError)
    ours = _grads(lambda x, w, b, r: cf.conv2d(x, w, b, 2, 1, 1, 2, activation=act, residual=r, negative_slope=slope),
                  (x, w, b, r))
    theirs = _grads(lambda x, w, b, r: reference.activation(F.conv2d(x, w, b, 2, 1, 1, 2) + r, act, slope), (x, w, b, r))
    for a, t in zip(ours, theirs):
        torch.testing.assert_close(a, t, rtol=1e-10, atol=1e-10)


def test_conv2d_gradients_with_asymmetric_same_padding_and_unbatched():
    x, w = rg(3, 9, 8), rg(5, 3, 4, 2)
    ours = _grads(lambda x, w: cf.conv2d(x, w, padding="same", activation="gelu"), (x, w))
    theirs = _grads(lambda x, w: F.gelu(F.conv2d(x, w, padding="same")), (x, w))
    for a, t in zip(ours, theirs):
        torch.testing.assert_close(a, t)


@pytest.mark.parametrize("act", ACTS)
def test_linear_gradients_equal_torch_autograd(act):
    x, w, b, r = rg(2, 3, 5), rg(4, 5), rg(4), rg(2, 3, 4)
    ours = _grads(lambda x, w, b, r: cf.linear(x, w, b, activation=act, residual=r), (x, w, b, r))
    theirs = _grads(lambda x, w, b, r: reference.activation(F.linear(x, w, b) + r, act), (x, w, b, r))
    for a, t in zip(ours, theirs):
        torch.testing.assert_close(a, t, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("act", ACTS)
def test_matmul_gradients_equal_torch_autograd_with_broadcasting(act):
    a, b, bias = rg(2, 1, 3, 5), rg(3, 5, 4), rg(4)
    ours = _grads(lambda a, b, bias: cf.matmul(a, b, bias, activation=act), (a, b, bias))
    theirs = _grads(lambda a, b, bias: reference.activation(torch.matmul(a, b) + bias, act), (a, b, bias))
    for x, t in zip(ours, theirs):
        torch.testing.assert_close(x, t, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_sdpa_gradients_equal_torch_autograd(mask):
    q, k, v = rg(2, 4, 5, 8), rg(2, 2, 6, 8), rg(2, 2, 6, 8)
    m = None
    if mask == "bool":
        m = torch.rand(2, 1, 5, 6) > 0.3
        m[..., 0] = True
    elif mask == "float":
        m = torch.randn(2, 4, 5, 6, dtype=torch.float64, requires_grad=True)
    args = (q, k, v, m) if mask == "float" else (q, k, v)

    def ours_fn(q, k, v, mm=m):
        return cf.scaled_dot_product_attention(q, k, v, attn_mask=mm, enable_gqa=True)

    def theirs_fn(q, k, v, mm=m):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mm)

    ours, theirs = _grads(ours_fn, args), _grads(theirs_fn, args)
    assert len(ours) == len(args)
    for a, t in zip(ours, theirs):
        torch.testing.assert_close(a, t)


def test_gradcheck_every_op():
    assert torch.autograd.gradcheck(lambda x, w: cf.conv2d(x, w, padding=1, activation="tanh"), (rg(1, 2, 4, 4), rg(3, 2, 3, 3)))
    assert torch.autograd.gradcheck(lambda a, b: cf.matmul(a, b, activation="sigmoid"), (rg(3, 4), rg(4, 2)))
    assert torch.autograd.gradcheck(lambda x, w: cf.linear(x, w, activation="silu"), (rg(3, 4), rg(2, 4)))
    assert torch.autograd.gradcheck(lambda q, k, v: cf.scaled_dot_product_attention(q, k, v, is_causal=True),
                                    (rg(1, 2, 3, 4), rg(1, 2, 3, 4), rg(1, 2, 3, 4)))


def test_amax_has_no_gradient_and_y_still_does():
    x = rg(3, 5)
    y, amax = cf.linear(x, rg(4, 5), return_amax=True)
    assert y.requires_grad and not amax.requires_grad
    y.sum().backward()
    assert x.grad is not None


def _saved(fn):
    """The tensors autograd saves while running fn."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


def test_relu_saves_the_output_not_the_pre_activation():
    x, w, b = rg(6, 8), rg(5, 8), rg(5)
    y, saved = _saved(lambda: cf.linear(x, w, b, activation="relu"))
    ptrs = {t.data_ptr() for t in saved if t is not None}
    assert ptrs == {x.data_ptr(), w.data_ptr(), y.data_ptr()}


def test_gelu_saves_no_intermediate_it_recomputes():
    x, w, b = rg(6, 8), rg(5, 8), rg(5)
    y, saved = _saved(lambda: cf.linear(x, w, b, activation="gelu"))
    ptrs = {t.data_ptr() for t in saved if t is not None}
    assert ptrs == {x.data_ptr(), w.data_ptr(), b.data_ptr()}  # no M x N tensor saved


def test_dropout_sdpa_keeps_torch_autograd():
    q = rg(1, 2, 4, 8, dtype=torch.float32)
    o = cf.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    o.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_inference_without_grad_does_not_touch_the_dispatcher(monkeypatch):
    calls = []
    monkeypatch.setattr(torch_ops, "linear", lambda *a: calls.append(a))
    x, w = torch.randn(3, 4), torch.randn(2, 4)
    y = cf.linear(x, w)
    assert not calls and y.shape == (3, 2)
    with torch.no_grad():
        cf.linear(x.requires_grad_(), w)
    assert not calls
    cf.linear(x, w)  # grad enabled and x requires grad: the custom op
    assert len(calls) == 1


def test_cupy_arrays_in_and_out_through_dlpack(monkeypatch):
    """With a stand-in 'cupy' module (numpy underneath; the real one is GPU-tested): arrays
    go in zero-copy through DLPack and the result comes back through cupy.from_dlpack."""
    import sys
    import types

    import numpy as np

    fake = types.ModuleType("cupy")
    fake.from_dlpack = np.from_dlpack

    class Array:
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, *args, **kwargs):
            return self.a.__dlpack__(*args, **kwargs)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    Array.__module__ = "cupy._core.core"
    monkeypatch.setitem(sys.modules, "cupy", fake)
    x, w = np.random.randn(3, 4).astype(np.float32), np.random.randn(5, 4).astype(np.float32)
    y = cf.linear(Array(x), Array(w), activation="relu")
    assert isinstance(y, np.ndarray) and y.shape == (3, 5)
    np.testing.assert_allclose(y, np.maximum(x @ w.T, 0), rtol=1e-5, atol=1e-6)
    y2, amax = cf.matmul(Array(x), Array(w.T.copy()), return_amax=True)
    assert isinstance(amax, np.ndarray) and np.isclose(amax, np.abs(y2).max())


@pytest.mark.parametrize("needs", ["x", "w", "b", "r", "xr", "wb"])
def test_lean_conv_function_maps_every_gradient_slot(needs):
    """Eager training convs without amax take the 5-input Function; each subset of operands
    that requires grad gets exactly torch's gradients, and the others none."""
    torch.manual_seed(0)
    base = {"x": torch.randn(2, 4, 7, 7, dtype=torch.float64), "w": torch.randn(6, 4, 3, 3, dtype=torch.float64),
            "b": torch.randn(6, dtype=torch.float64), "r": torch.randn(2, 6, 7, 7, dtype=torch.float64)}
    ours = {k: v.clone().requires_grad_(k in needs) for k, v in base.items()}
    theirs = {k: v.clone().requires_grad_(k in needs) for k, v in base.items()}
    y = cf.conv2d(ours["x"], ours["w"], ours["b"], padding=1, activation="gelu", residual=ours["r"])
    assert type(y.grad_fn).__name__.startswith("_Conv2dTrain")
    (y * y).sum().backward()
    ref = F.gelu(F.conv2d(theirs["x"], theirs["w"], theirs["b"], padding=1) + theirs["r"])
    (ref * ref).sum().backward()
    for k in base:
        if k in needs:
            torch.testing.assert_close(ours[k].grad, theirs[k].grad)
        else:
            assert ours[k].grad is None


def test_conv_with_amax_keeps_the_custom_op_layout():
    x, w = rg(1, 2, 5, 5), rg(3, 2, 3, 3)
    y, amax = cf.conv2d(x, w, padding=1, activation="relu", return_amax=True)
    assert not type(y.grad_fn).__name__.startswith("_Conv2dTrain") and not amax.requires_grad
    y.sum().backward()
    assert x.grad is not None and w.grad is not None


class _Ctx:
    """What a custom op's backward formula reads from its ctx."""

    def __init__(self, saved, act, needs, has_bias=True, has_residual=False, geo=None):
        self.saved_tensors, self.act, self.slope, self.needs_input_grad = saved, act, 0.01, needs
        self.has_bias, self.has_residual, self.geo = has_bias, has_residual, geo


def test_backward_formulas_trace_torch_math_on_fake_cuda_tensors():
    """torch.compile's AOTAutograd runs the backward formulas on fake tensors: on 16-bit CUDA
    they must not take the cuDNN path, whose launch reads data pointers (it failed so on the
    H200: "Cannot access data pointer of Tensor (e.g. FakeTensor ...)")."""
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    from cudnn_fuse import backward

    bf = dict(device="cuda", dtype=torch.bfloat16)
    with FakeTensorMode():
        x, w, b = torch.empty(64, 128, **bf), torch.empty(256, 128, **bf), torch.empty(256, **bf)
        y, gy = torch.empty(64, 256, **bf), torch.empty(64, 256, **bf)
        assert not backward.usable(x, w, b, gy)
        dx, dw, db, *rest = torch_ops._linear_backward(
            _Ctx((x, w, y, b, None), "relu", (True, True, True) + (False,) * 4), gy, None)
        assert [t.shape for t in (dx, dw, db)] == [x.shape, w.shape, b.shape] and all(map(is_fake, (dx, dw, db)))
        # (matmul's and the other activations' torch math runs autograd.grad, which a CPU-only
        # torch cannot trace on fake CUDA tensors: the GPU suite compiles those)
        xc, wc, bc = torch.empty(2, 16, 8, 8, **bf), torch.empty(32, 16, 3, 3, **bf), torch.empty(32, **bf)
        yc = torch.empty(2, 32, 8, 8, **bf)
        geo = ((1, 1), (1, 1), (1, 1), (1, 1), 1)
        dxc, dwc, dbc, *_ = torch_ops._conv2d_backward(
            _Ctx((xc, wc, yc, bc, None), "relu", (True, True, True) + (False,) * 9, geo=geo), yc.clone(), None)
        assert [t.shape for t in (dxc, dwc, dbc)] == [xc.shape, wc.shape, bc.shape]


def _compiled_graph_text(fn, *args) -> str:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return "\n".join(graphs)


def test_torch_compile_inlines_every_op_by_default_and_keeps_custom_ops_when_asked():
    x, w, b = torch.randn(4, 8, 16), torch.randn(32, 16), torch.randn(32)
    xc, wc = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    q = torch.randn(1, 2, 8, 16)

    def f(x, w, b, xc, wc, q):
        return (cf.linear(x, w, b, activation="gelu"), cf.matmul(x, w.t(), activation="relu"),
                cf.scaled_dot_product_attention(q, q, q, is_causal=True), cf.conv2d(xc, wc, padding=1, activation="relu"))

    args = (x, w, b, xc, wc, q)
    default = _compiled_graph_text(f, *args)
    assert "cudnn_fuse.conv2d" not in default and "target=torch.conv2d" in default
    assert "cudnn_fuse.linear" not in default and "cudnn_fuse.matmul" not in default
    assert "cudnn_fuse.scaled_dot_product_attention" not in default and "scaled_dot_product_attention" in default
    prev = cf.set_compile_inline(())
    try:
        opaque = _compiled_graph_text(f, *args)
    finally:
        cf.set_compile_inline(prev)
    for op in ("linear", "matmul", "scaled_dot_product_attention", "conv2d"):
        assert f"cudnn_fuse.{op}" in opaque
    torch._dynamo.reset()
    for got, want in zip(torch.compile(f)(*args), f(*args)):
        torch.testing.assert_close(got, want)


def test_compile_inline_names_are_checked(caplog):
    from cudnn_fuse import ops

    assert ops._parse_inline(None) == frozenset(ops.COMPILE_INLINE_OPS)
    assert ops._parse_inline("") == frozenset()
    with caplog.at_level("WARNING"):
        assert ops._parse_inline("linear, conv3d") == frozenset({"linear"})
    assert "conv3d" in caplog.text
    assert ops._parse_inline("conv2d") == frozenset({"conv2d"})


def test_tracing_is_false_for_the_tensors_an_eager_backward_sees():
    """The eager backward must keep the cuDNN path: plain tensors, Parameters and their views
    are not "traced"; fake tensors and tensor subclasses are."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cudnn_fuse import backward

    p = torch.nn.Parameter(torch.randn(4, 3))
    x = torch.randn(2, 3, requires_grad=True)
    assert not backward.tracing([x, p, p.t(), x.detach(), (x * 2).view(3, 2)])

    class Sub(torch.Tensor):
        pass

    assert backward.tracing([x, torch.randn(2).as_subclass(Sub)])
    with FakeTensorMode():
        assert backward.tracing([torch.empty(2)])


def test_set_compile_inline_takes_names_or_a_comma_separated_string():
    from cudnn_fuse import ops

    prev = cf.set_compile_inline("linear, sdpa")
    try:
        assert ops.compile_inline == frozenset({"linear", "sdpa"})
        assert cf.set_compile_inline(["matmul"]) == frozenset({"linear", "sdpa"})
        assert ops.compile_inline == frozenset({"matmul"})
        cf.set_compile_inline("")
        assert ops.compile_inline == frozenset()
    finally:
        cf.set_compile_inline(prev)
    assert ops.compile_inline == prev


@pytest.mark.parametrize("names,exc,match", [(None, TypeError, "names must be a str or an iterable"),
                                             (3, TypeError, "names must be a str or an iterable"),
                                             (["conv2d", 3], TypeError, "names must be str"),
                                             ("Conv2d", ArgumentError, r"unknown op names \['Conv2d'\]"),
                                             (["linear", "mlp"], ArgumentError, "known: conv2d, linear")])
def test_set_compile_inline_refuses_what_names_no_op_and_keeps_the_set(names, exc, match):
    from cudnn_fuse import ops

    before = ops.compile_inline
    with pytest.raises(exc, match=match):
        cf.set_compile_inline(names)
    assert ops.compile_inline == before


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu", "leaky_relu"])
def test_act_grad_takes_atens_backward_kernel_without_create_graph(monkeypatch, act):
    """GELU, SiLU and leaky ReLU's backward (a FusedMLP or linear whose cuDNN graphs were
    declined, every float32 model) is aten's kernel, what eager autograd runs, and not a float32
    autograd replay of the forward: same gradient, no autograd.grad call."""
    z, gy = torch.randn(64, 48), torch.randn(64, 48)
    zz = z.clone().requires_grad_()
    (want,) = torch.autograd.grad(reference.activation(zz, act, 0.2), zz, gy)

    def refuse(*a, **k):
        raise AssertionError("autograd.grad called")

    monkeypatch.setattr(torch.autograd, "grad", refuse)
    with torch.no_grad():
        got = torch_ops._act_grad(z, gy, act, 0.2)
    assert torch.equal(got, want)


def test_act_grad_under_create_graph_stays_differentiable():
    z = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    gy = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    with torch.enable_grad():
        g = torch_ops._act_grad(z, gy, "gelu", 0.01)
    assert g.requires_grad  # the double backward (a gradient penalty) needs its graph
    torch.testing.assert_close(g, torch.ops.aten.gelu_backward(gy, z))


def test_act_grad_keeps_float32_math_for_16_bit_cpu_tensors(monkeypatch):
    """On the CPU (the tests' oracle), 16-bit operands still go through float32 autograd."""
    calls = []
    real = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: calls.append(1) or real(*a, **k))
    z, gy = torch.randn(16, 8, dtype=torch.bfloat16), torch.randn(16, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        got = torch_ops._act_grad(z, gy, "gelu", 0.01)
    assert calls == [1] and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), torch.ops.aten.gelu_backward(gy.float(), z.float()), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("shapes", [((3, 0), (4, 0)), ((3, 5), (0, 5)), ((0,), (4, 0)), ((2, 3, 5), (0, 5))],
                         ids=["K0", "N0", "1d-K0", "3d-N0"])
def test_linear_with_zero_features_has_torchs_gradients(shapes):
    """A linear of 0 in or out features: its backward folded dz and x with reshape(-1, n), which cannot
    infer the -1 of an empty tensor whose n is 0, and raised where F.linear's backward gives zeros."""
    xs, ws = shapes
    x0, w0, b0 = torch.randn(xs), torch.randn(ws), torch.randn(ws[0])
    grads = []
    for fn in (cf.linear, torch.nn.functional.linear):
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        y = fn(x, w, b)
        y.sum().backward()
        grads.append((y.detach(), x.grad, w.grad, b.grad))
    for a, t in zip(*grads):
        assert a.shape == t.shape and torch.equal(a, t)


def test_matmul_with_zero_columns_and_a_bias_has_torchs_gradients():
    a0, b0, c0 = torch.randn(3, 5), torch.randn(5, 0), torch.randn(0)
    a, b, c = (t.clone().requires_grad_() for t in (a0, b0, c0))
    cf.matmul(a, b, c).sum().backward()
    assert a.grad.shape == (3, 5) and not a.grad.any() and b.grad.shape == (5, 0) and c.grad.shape == (0,)


def test_a_masked_attentions_inference_stays_a_custom_op_under_torch_compile():
    """Inlined by default, except a masked attention that needs no gradient: Inductor lowers masked SDPA
    to a math attention, cuDNN runs the mask in its fused kernel. One that trains inlines (a custom op's
    backward would recompute the forward)."""
    q = torch.randn(1, 2, 8, 16)
    mask = torch.rand(1, 1, 8, 8) > 0.3
    mask[..., 0] = True

    def f(q, mask):
        return cf.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    def plain(q, mask):
        return cf.scaled_dot_product_attention(q, q, q, is_causal=True)

    with torch.no_grad():
        assert "cudnn_fuse.scaled_dot_product_attention" in _compiled_graph_text(f, q, mask)
        assert "cudnn_fuse.scaled_dot_product_attention" not in _compiled_graph_text(plain, q, mask)
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(f)(q, mask), f(q, mask))
    qg = q.clone().requires_grad_()
    assert "cudnn_fuse.scaled_dot_product_attention" not in _compiled_graph_text(f, qg, mask)
    prev = cf.set_compile_inline("linear")
    try:  # sdpa not inlined at all: every call a custom op
        assert "cudnn_fuse.scaled_dot_product_attention" in _compiled_graph_text(plain, q, mask)
    finally:
        cf.set_compile_inline(prev)


@pytest.mark.parametrize("inline", ["default", "custom ops"])
def test_torch_compile_dynamic_compiles_once_for_a_range_of_sizes(inline):
    """torch.compile(dynamic=True) over cf ops: the fake kernels take symbolic sizes, so five sequence
    lengths compile one graph, inlined or kept custom ops; a conv over five batch sizes compiles no more
    graphs than torch's own F.conv2d does (torch's CPU conv specializes batches past 15; cf's custom op
    does not)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    w, b = torch.randn(32, 16), torch.randn(32)
    wc = torch.randn(4, 3, 3, 3)

    def f(x, q):
        return cf.linear(x, w, b, activation="gelu"), cf.scaled_dot_product_attention(q, q, q, is_causal=True)

    def conv(xc):
        return cf.conv2d(xc, wc, padding=1, activation="relu")

    def torch_conv(xc):
        return F.relu(F.conv2d(xc, wc, padding=1))

    def graphs(fn, make):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(fn, dynamic=True)
        for s in (10, 17, 33, 64, 100):  # sizes that never equal another dimension (duck sizing would tie them)
            args = make(s)
            got, want = compiled(*args), fn(*args)
            for g, w_ in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                torch.testing.assert_close(g, w_, atol=1e-4, rtol=1e-4)
        return counters["stats"]["unique_graphs"]

    prev = cf.set_compile_inline(ops.COMPILE_INLINE_OPS if inline == "default" else ())
    try:
        assert graphs(f, lambda s: (torch.randn(2, s, 16), torch.randn(1, 2, s, 16))) == 1
        image = lambda s: (torch.randn(s + 1, 3, 7, 7),)  # noqa: E731
        assert graphs(conv, image) <= graphs(torch_conv, image)
    finally:
        cf.set_compile_inline(prev)
        torch._dynamo.reset()
