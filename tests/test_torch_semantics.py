"""What torch accepts, cf accepts, with torch's result; what torch refuses, cf refuses where torch would.

- ``return_amax`` is a bool (a string such as "no" must not turn it on by being truthy), and a
  ``negative_slope`` goes with leaky_relu only (torch's F.relu takes none);
- an activation by any of its names ("ReLU"), "none"/"identity", or the torch function or module a user
  already has (F.gelu, nn.GELU(approximate="tanh"), nn.LeakyReLU(0.2), ...), one canonical name inside;
- residuals that broadcast to the output, as ``+`` does; attention's q, k, v of different ranks whose
  leading dims broadcast; ``is_causal=True`` with an ``attn_mask`` (combined, as torch 2.13 combines them);
- dtypes cuDNN does not take (integers, complex, a float64 residual beside float32) run torch's own
  expression, torch's type promotion and errors included;
- cf's argument errors are ``cf.ArgumentError``: a ValueError and a RuntimeError, as torch's are;
- ``optimize()`` of something that is no module instance is a TypeError naming ``model``.

Everything is compared against torch's own ops on the CPU (float32 or float64)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudnn_fuse as cf
from cudnn_fuse import manifest, ops
from cudnn_fuse.spec import ACTIVATIONS
from tests.memo_paths import PATHS, NoOpPlan, on_memo_path

f64 = torch.float64


def R(*shape, dtype=torch.float32, grad=False):
    return torch.randn(shape, dtype=dtype, requires_grad=grad)


# (name, cf call on (x, w, b), torch's expression on the same) for the three epilogue ops
def _conv(**kw):
    return cf.conv2d(R(2, 4, 7, 7), R(6, 4, 3, 3), R(6), padding=1, **kw)


def _linear(**kw):
    return cf.linear(R(3, 5), R(4, 5), R(4), **kw)


def _matmul(**kw):
    return cf.matmul(R(2, 3, 5), R(5, 4), R(4), **kw)


OPS = {"conv2d": _conv, "linear": _linear, "matmul": _matmul}
_TORCH_ACT = {None: lambda z: z, "relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
              "silu": F.silu, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "leaky_relu": F.leaky_relu}


# ------------------------------------------------------------------ 1. return_amax, negative_slope


@pytest.mark.parametrize("value", ["yes", "no", 1, 0, None, np.bool_(True), torch.tensor(True)],
                         ids=["yes", "no", "1", "0", "None", "np.bool_", "tensor"])
@pytest.mark.parametrize("op", OPS)
def test_return_amax_must_be_a_bool(op, value):
    with pytest.raises(TypeError, match=f"{op}: return_amax must be a bool, got return_amax="):
        OPS[op](return_amax=value)


@pytest.mark.parametrize("path", PATHS)
def test_a_remembered_call_does_not_serve_return_amax_1(path, monkeypatch):
    """The memo keys the attributes' exact types: return_amax=0 is refused after return_amax=False was
    remembered (a no-op plan makes a 16-bit CPU call fused, so remembered, as a GPU call is)."""

    with on_memo_path(path, monkeypatch, lambda spec, device: NoOpPlan(spec)) as o:
        x, w = R(4, 8).half(), R(16, 8).half()
        cf.linear(x, w, return_amax=False)
        cf.linear(x, w, return_amax=False)
        assert len(o.memo_keys()) == 1
        for bad in (0, "False"):
            with pytest.raises(TypeError, match="return_amax must be a bool"):
                cf.linear(x, w, return_amax=bad)


@pytest.mark.parametrize("act", [None] + [a for a in ACTIVATIONS if a != "leaky_relu"])
@pytest.mark.parametrize("op", OPS)
def test_a_slope_with_another_activation_than_leaky_relu_is_an_argument_error(op, act):
    with pytest.raises(cf.ArgumentError, match=rf"{op}: negative_slope=0\.2 is given with activation={act!r}"):
        OPS[op](activation=act, negative_slope=0.2)


@pytest.mark.parametrize("act", [None] + list(ACTIVATIONS))
def test_the_default_slope_passes_with_every_activation(act):
    x, w, b = R(3, 5), R(4, 5), R(4)
    want = _TORCH_ACT[act](F.linear(x, w, b))
    torch.testing.assert_close(cf.linear(x, w, b, activation=act, negative_slope=0.01), want)


@pytest.mark.parametrize("make", [lambda **kw: cf.nn.Conv2d(2, 3, 1, **kw), lambda **kw: cf.nn.Linear(2, 3, **kw)],
                         ids=["Conv2d", "Linear"])
def test_modules_check_the_slope_as_the_ops_do(make):
    with pytest.raises(cf.ArgumentError, match="negative_slope=0.3 is given with activation='relu'"):
        make(activation="relu", negative_slope=0.3)
    assert make(activation="gelu").negative_slope == 0.01  # the default passes with any activation
    m = make(activation="leaky_relu", negative_slope=torch.tensor(0.3))  # a 0-dim tensor, as F.leaky_relu takes
    assert m.negative_slope == pytest.approx(0.3)


def test_a_tensor_slope_is_read_as_torch_reads_it():
    x, w = R(3, 5), R(4, 5)
    want = F.leaky_relu(F.linear(x, w), torch.tensor(0.3).item())
    torch.testing.assert_close(cf.linear(x, w, activation="leaky_relu", negative_slope=torch.tensor(0.3)), want)
    with pytest.raises(TypeError, match="negative_slope must be a real number"):
        cf.linear(x, w, activation="leaky_relu", negative_slope="0.3")


# ------------------------------------------------------------------ 2. optimize(model)


@pytest.mark.parametrize("model, said", [
    (None, "got None of type NoneType"),
    ("resnet", "got 'resnet' of type str"),
    (nn.Linear, r"got the class torch\.nn\.Linear"),
    (nn.Sequential, r"got the class torch\.nn\.Sequential"),
    ([nn.Linear(2, 2)], r"got \[Linear.* of type list"),
])
def test_optimize_of_no_module_instance_is_a_type_error_naming_model(model, said):
    with pytest.raises(TypeError, match=rf"optimize: model must be a torch\.nn\.Module instance, {said}"):
        cf.optimize(model)


# ------------------------------------------------------------------ 3. activation names


SPELLINGS = [
    ("ReLU", "relu"), ("RELU", "relu"), ("GELU", "gelu"), ("Gelu_Tanh", "gelu_tanh"), ("SILU", "silu"),
    ("Tanh", "tanh"), ("Sigmoid", "sigmoid"), ("Leaky_ReLU", "leaky_relu"), ("none", None), ("NONE", None),
    ("identity", None), ("Identity", None),
    (F.relu, "relu"), (torch.relu, "relu"), (nn.ReLU(), "relu"), (nn.ReLU(inplace=True), "relu"),
    (F.gelu, "gelu"), (nn.GELU(), "gelu"), (nn.GELU(approximate="tanh"), "gelu_tanh"),
    (F.silu, "silu"), (nn.SiLU(), "silu"), (nn.SiLU(inplace=True), "silu"),
    (torch.tanh, "tanh"), (F.tanh, "tanh"), (nn.Tanh(), "tanh"),
    (torch.sigmoid, "sigmoid"), (F.sigmoid, "sigmoid"), (nn.Sigmoid(), "sigmoid"),
    (F.leaky_relu, "leaky_relu"), (nn.LeakyReLU(), "leaky_relu"), (nn.Identity(), None),
]
_IDS = [repr(s)[:40] for s, _ in SPELLINGS]


@pytest.mark.parametrize("spelling, name", SPELLINGS, ids=_IDS)
@pytest.mark.parametrize("op", OPS)
def test_every_spelling_of_an_activation_computes_torchs(op, spelling, name):
    torch.manual_seed(0)
    want = OPS[op](activation=name)
    torch.manual_seed(0)
    got = OPS[op](activation=spelling)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.manual_seed(0)
    z = OPS[op]()
    torch.testing.assert_close(got, _TORCH_ACT[name](z))


def test_an_inplace_module_leaves_the_input_alone():
    x, w = R(3, 5, grad=True), R(4, 5)
    x0 = x.detach().clone()
    y = cf.linear(x, w, activation=nn.ReLU(inplace=True))
    torch.testing.assert_close(y, F.relu(F.linear(x, w)))
    assert torch.equal(x.detach(), x0)
    (g,) = torch.autograd.grad(y.sum(), x)
    (want,) = torch.autograd.grad(F.relu(F.linear(x, w)).sum(), x)
    torch.testing.assert_close(g, want)


def test_nn_leaky_relu_brings_its_slope():
    x, w = R(3, 5), R(4, 5)
    want = F.leaky_relu(F.linear(x, w), 0.2)
    torch.testing.assert_close(cf.linear(x, w, activation=nn.LeakyReLU(0.2)), want)
    torch.testing.assert_close(cf.linear(x, w, activation=nn.LeakyReLU(0.2), negative_slope=0.2), want)
    torch.testing.assert_close(cf.linear(x, w, activation=nn.LeakyReLU(0.2), negative_slope=0.01), want)  # the default
    with pytest.raises(cf.ArgumentError, match=r"linear: negative_slope=0\.3 conflicts with activation=LeakyReLU"):
        cf.linear(x, w, activation=nn.LeakyReLU(0.2), negative_slope=0.3)
    torch.testing.assert_close(cf.linear(x, w, activation=F.leaky_relu, negative_slope=0.3),
                               F.leaky_relu(F.linear(x, w), 0.3))


@pytest.mark.parametrize("bad", ["swish", "leakyrelu", nn.Dropout(), nn.ReLU6(), lambda z: z, F.elu, 3, nn.ReLU])
@pytest.mark.parametrize("op", OPS)
def test_an_unknown_activation_names_the_accepted_ones(op, bad):
    with pytest.raises(cf.ArgumentError, match=rf"{op}: activation must be None or one of \('relu'.*nn\.GELU\(\).*"
                                              rf"got {re_escape(repr(bad))}"):
        OPS[op](activation=bad)


def re_escape(s: str) -> str:
    import re

    return re.escape(s)


@pytest.mark.parametrize("spelling, name", [("ReLU", "relu"), (nn.GELU(), "gelu"), (nn.GELU(approximate="tanh"),
                                            "gelu_tanh"), (torch.sigmoid, "sigmoid"), ("Identity", None)])
def test_modules_keep_the_canonical_name(spelling, name):
    lin = cf.nn.Linear(5, 4, activation=spelling)
    conv = cf.nn.Conv2d(4, 6, 3, activation=spelling)
    assert lin.activation == name and conv.activation == name
    x = R(3, 5)
    torch.testing.assert_close(lin(x), _TORCH_ACT[name](F.linear(x, lin.weight, lin.bias)))
    xc = R(2, 4, 7, 7)
    torch.testing.assert_close(conv(xc), _TORCH_ACT[name](F.conv2d(xc, conv.weight, conv.bias)))


def test_a_module_keeps_nn_leaky_relus_slope():
    m = cf.nn.Linear(5, 4, activation=nn.LeakyReLU(0.2))
    assert (m.activation, m.negative_slope) == ("leaky_relu", 0.2)
    with pytest.raises(cf.ArgumentError, match="conflicts"):
        cf.nn.Linear(5, 4, activation=nn.LeakyReLU(0.2), negative_slope=0.3)


def test_a_keep_z_linear_takes_a_torch_module_activation():
    m = cf.nn.Linear(5, 4, activation=nn.GELU(approximate="tanh"))
    assert m.activation == "gelu_tanh"
    x = R(3, 5, grad=True)
    y = m(x)
    want = F.gelu(F.linear(x, m.weight, m.bias), approximate="tanh")
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(torch.autograd.grad(y.sum(), x)[0], torch.autograd.grad(want.sum(), x)[0])


def test_the_spec_of_every_spelling_is_the_canonical_one():
    """A 16-bit call recorded as a GPU would make it (cf.record on CPU tensors): one spec for all spellings."""
    x, w = R(8, 16).half(), R(32, 16).half()
    spellings = ["gelu", "GELU", "Gelu", nn.GELU(), F.gelu]
    with manifest.record() as rec:
        for s in spellings:
            cf.linear(x, w, activation=s)
    (entry,) = rec.entries
    assert entry.count == len(spellings) and entry.spec.epilogue.activation == "gelu"


def test_a_module_activation_is_not_remembered(monkeypatch):
    """The memo's key would hold the module, whose slope can change in place: such a call is validated
    each time, and a changed slope is seen."""

    with on_memo_path("python", monkeypatch, lambda spec, device: NoOpPlan(spec)) as o:
        x, w = R(4, 8).half(), R(16, 8).half()
        act = nn.LeakyReLU(0.2)
        cf.linear(x, w, activation=act)
        cf.linear(x, w, activation=act)
        assert o.memo_keys() == []
        cf.linear(x, w, activation="leaky_relu", negative_slope=0.2)
        assert len(o.memo_keys()) == 1
    x, w = R(3, 5), R(4, 5)
    act = nn.LeakyReLU(0.2)
    cf.linear(x, w, activation=act)
    act.negative_slope = 0.5
    torch.testing.assert_close(cf.linear(x, w, activation=act), F.leaky_relu(F.linear(x, w), 0.5))


def test_optimize_fuses_the_activations_it_did():
    model = nn.Sequential(nn.Linear(4, 8), nn.LeakyReLU(0.2), nn.Linear(8, 8), nn.GELU(approximate="tanh"),
                          nn.Linear(8, 3), nn.Identity()).eval()
    opt = cf.optimize(model)
    fused = [m for m in opt.modules() if isinstance(m, cf.nn.Linear)]
    assert [(m.activation, m.negative_slope) for m in fused] == [("leaky_relu", 0.2), ("gelu_tanh", 0.01)]
    x = R(5, 4)
    torch.testing.assert_close(opt(x), model(x))
    lone = cf.optimize(nn.Sequential(nn.Linear(4, 3), nn.Identity()))  # nn.Identity: nothing to fuse, as before
    assert not any(isinstance(m, cf.nn.Linear) for m in lone.modules())
    assert any("no epilogue" in why for _, why in lone.cudnn_fuse_summary.left_alone)


# ------------------------------------------------------------------ 4. broadcast residuals


def _check_residual(cf_fn, torch_fn, operands, r_shape, act="relu"):
    """cf's op with a broadcast residual against torch's ``act(op(...) + residual)``: values, gradients
    (float64), and the residual's gradient in the residual's own shape."""
    ins = [t.detach().to(f64).requires_grad_() for t in operands]
    r = R(*r_shape, dtype=f64, grad=True)
    y = cf_fn(*ins, activation=act, residual=r)
    want = _TORCH_ACT[act](torch_fn(*ins) + r)
    assert y.shape == want.shape
    torch.testing.assert_close(y, want)
    gy = torch.randn_like(want)
    got = torch.autograd.grad(y, ins + [r], gy)
    exp = torch.autograd.grad(want, ins + [r], gy)
    for g, e in zip(got, exp):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e)
    assert got[-1].shape == tuple(r_shape)
    with torch.no_grad():  # inference: the plain path
        torch.testing.assert_close(cf_fn(*ins, activation=act, residual=r), want.detach())


@pytest.mark.parametrize("r_shape", [(1, 6, 1, 1), (6, 1, 1), (2, 6, 1, 1), (1, 1, 1, 1), (7, 7), (), (1, 6, 7, 7),
                                     (2, 1, 7, 1)])
def test_conv2d_takes_a_residual_that_broadcasts_to_its_output(r_shape):
    x, w, b = R(2, 4, 7, 7), R(6, 4, 3, 3), R(6)
    _check_residual(lambda x, w, b, **kw: cf.conv2d(x, w, b, padding=1, **kw),
                    lambda x, w, b: F.conv2d(x, w, b, padding=1), [x, w, b], r_shape)


def test_an_unbatched_conv2d_takes_a_broadcast_residual():
    _check_residual(lambda x, w, **kw: cf.conv2d(x, w, padding=1, **kw), lambda x, w: F.conv2d(x, w, padding=1),
                    [R(4, 7, 7), R(6, 4, 3, 3)], (6, 1, 1), act="gelu")


@pytest.mark.parametrize("r_shape", [(4,), (3, 1), (1, 4), (), (1, 1)])
def test_linear_takes_a_residual_that_broadcasts_to_its_output(r_shape):
    _check_residual(cf.linear, F.linear, [R(3, 5), R(4, 5), R(4)], r_shape, act="silu")


@pytest.mark.parametrize("r_shape", [(4,), (3, 1), (1, 3, 4), (2, 1, 4), (2, 3, 1)])
def test_matmul_takes_a_residual_that_broadcasts_to_its_output(r_shape):
    _check_residual(cf.matmul, lambda a, b, bias: torch.matmul(a, b) + bias, [R(2, 3, 5), R(5, 4), R(4)], r_shape,
                    act="tanh")


@pytest.mark.parametrize("path", PATHS)
def test_a_remembered_training_call_expands_its_residual_again(path):
    """A training call's validated call is remembered (ops._remember_call) and later calls of the signature
    bring the residual unexpanded: the entry expands it itself."""
    if path == "native" and ops._native is None:
        pytest.skip("cudnn_fuse._native is not built")
    was = ops.native_enabled()
    ops.set_native(path == "native")
    try:
        x, w = R(3, 5, dtype=f64, grad=True), R(4, 5, dtype=f64)
        for _ in range(3):
            r = R(4, dtype=f64, grad=True)
            y = cf.linear(x, w, activation="relu", residual=r)
            want = F.relu(F.linear(x, w) + r)
            torch.testing.assert_close(y, want)
            (gr,) = torch.autograd.grad(y.sum(), r)
            torch.testing.assert_close(gr, torch.autograd.grad(want.sum(), r)[0])
        assert any(k[0] == "linear:grad" for k in ops.memo_keys())
    finally:
        ops.set_native(was)


def test_the_nn_modules_broadcast_residuals_as_the_ops_do():
    conv = cf.nn.Conv2d(4, 6, 3, padding=1, activation="relu")
    x, r = R(2, 4, 7, 7), R(1, 6, 1, 1)
    torch.testing.assert_close(conv(x, r), cf.conv2d(x, conv.weight, conv.bias, padding=1, activation="relu",
                                                     residual=r))
    lin = cf.nn.Linear(5, 4, activation="gelu")
    x, r = R(3, 5), R(4)
    torch.testing.assert_close(lin(x, r), cf.linear(x, lin.weight, lin.bias, activation="gelu", residual=r))


# ------------------------------------------------------------------ 5. attention: ranks, is_causal with a mask


SDPA_SHAPES = [  # (q, k, v, enable_gqa)
    ((4, 3, 8), (4, 4, 6, 8), (4, 4, 6, 8), False),
    ((2, 1, 6, 8), (2, 4, 10, 8), (2, 4, 10, 8), False),
    ((2, 4, 6, 8), (2, 1, 10, 8), (2, 1, 10, 8), False),
    ((1, 4, 6, 8), (2, 4, 10, 8), (2, 4, 10, 8), False),
    ((2, 4, 6, 8), (4, 10, 8), (2, 4, 10, 8), False),
    ((6, 8), (2, 4, 10, 8), (2, 4, 10, 8), False),
    ((3, 1, 4, 6, 8), (1, 2, 4, 10, 8), (1, 2, 4, 10, 8), False),
    ((1, 4, 6, 8), (2, 2, 10, 8), (2, 2, 10, 8), True),
    ((4, 6, 8), (2, 2, 10, 8), (2, 2, 10, 8), True),
    ((3, 8, 6, 8), (1, 2, 10, 8), (1, 2, 10, 5), True),
]


@pytest.mark.parametrize("qs, ks, vs, gqa", SDPA_SHAPES, ids=[f"q{q}-k{k}" for q, k, _, _ in SDPA_SHAPES])
def test_sdpa_broadcasts_leading_dims_of_any_rank_as_torch_does(qs, ks, vs, gqa):
    q, k, v = (R(*s, dtype=f64, grad=True) for s in (qs, ks, vs))
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    got = cf.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)
    go = torch.randn_like(want)
    for g, e, t in zip(torch.autograd.grad(got, (q, k, v), go), torch.autograd.grad(want, (q, k, v), go), (q, k, v)):
        assert g.shape == t.shape
        torch.testing.assert_close(g, e)
    with torch.no_grad():
        torch.testing.assert_close(cf.scaled_dot_product_attention(q, k, v, enable_gqa=gqa), want.detach())


def test_sdpa_broadcasts_a_mask_with_the_leading_dims():
    q, k, v = R(4, 3, 8, dtype=f64), R(4, 4, 6, 8, dtype=f64), R(4, 4, 6, 8, dtype=f64)
    m = torch.rand(4, 1, 3, 6) > 0.3
    torch.testing.assert_close(cf.scaled_dot_product_attention(q, k, v, attn_mask=m),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=m))


@pytest.mark.parametrize("qs, ks", [((2, 4, 6, 8), (3, 4, 10, 8)), ((2, 4, 6, 8), (2, 3, 10, 8)),
                                    ((5, 6, 8), (2, 3, 10, 8))])
def test_sdpa_leading_dims_that_do_not_broadcast_are_refused_as_torch_refuses_them(qs, ks):
    q, k = R(*qs), R(*ks)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, k)
    with pytest.raises(cf.ArgumentError, match=r"scaled_dot_product_attention: .*(heads|batch dims)"):
        cf.scaled_dot_product_attention(q, k, k)


def _tril(Sq, Skv):
    return torch.ones(Sq, Skv, dtype=torch.bool).tril()


@pytest.mark.parametrize("Sq, Skv", [(5, 7), (9, 7), (6, 6)])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("mask_shape", ["full", "rows", "4d"])
def test_sdpa_is_causal_with_a_mask_is_torchs(Sq, Skv, kind, mask_shape):
    """torch 2.13's CPU kernel combines a mask with is_causal=True (a bool mask ANDed with the top-left
    causal triangle, a float mask with -inf above the diagonal); its math kernel, which a float mask that
    requires grad takes, refuses the pair, and a 1-D mask fails in its CPU kernel: cf combines them always."""
    q, k, v = R(2, 3, Sq, 8, dtype=f64, grad=True), R(2, 3, Skv, 8, dtype=f64, grad=True), R(2, 3, Skv, 8, dtype=f64)
    shape = {"full": (Sq, Skv), "rows": (Skv,), "4d": (2, 1, Sq, Skv)}[mask_shape]
    m = torch.rand(shape) > 0.3 if kind == "bool" else R(*shape, dtype=f64, grad=True)
    combined = m & _tril(Sq, Skv) if kind == "bool" else torch.where(_tril(Sq, Skv), m, float("-inf"))
    explicit = F.scaled_dot_product_attention(q, k, v, attn_mask=combined)
    if mask_shape != "rows":  # where torch's own kernel takes the pair: the same as the explicit mask
        torchs = F.scaled_dot_product_attention(q, k, v, attn_mask=m.detach(), is_causal=True)
        torch.testing.assert_close(torchs, explicit, equal_nan=True)
    got = cf.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=True)
    torch.testing.assert_close(got, explicit, equal_nan=True)
    ins = (q, k) + ((m,) if kind == "float" else ())
    go = torch.randn_like(explicit)
    for a, b in zip(torch.autograd.grad(got.nan_to_num(), ins, go), torch.autograd.grad(explicit.nan_to_num(), ins, go)):
        torch.testing.assert_close(a, b, equal_nan=True)


def test_sdpa_is_causal_with_a_mask_under_no_grad_and_a_float32_mask_beside_bf16():
    q, k, v = (R(2, 3, s, 8).bfloat16() for s in (5, 7, 7))
    m = R(5, 7)
    with torch.no_grad():
        got = cf.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=True)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(_tril(5, 7), m, float("-inf")))
    torch.testing.assert_close(got, want)


# ------------------------------------------------------------------ 6. dtypes cuDNN does not take


TORCH_COMPUTES = {  # (cf call, torch's expression)
    "int64_conv": (lambda x, w, r: cf.conv2d(x, w, padding=1, activation="relu", residual=r),
                   lambda x, w, r: F.relu(F.conv2d(x, w, padding=1) + r),
                   lambda: (torch.randint(-5, 5, (2, 3, 6, 6)), torch.randint(-3, 3, (4, 3, 3, 3)),
                            torch.randint(-9, 9, (1, 4, 1, 1)))),
    "int32_conv_channels_last": (lambda x, w, r: cf.conv2d(x, w, None, 2),
                                 lambda x, w, r: F.conv2d(x, w, None, 2),
                                 lambda: (torch.randint(-5, 5, (2, 3, 7, 7), dtype=torch.int32).contiguous(
                                     memory_format=torch.channels_last),
                                          torch.randint(-3, 3, (4, 3, 3, 3), dtype=torch.int32), None)),
    "complex64_linear": (lambda x, w, b: cf.linear(x, w, b, activation="tanh"),
                         lambda x, w, b: torch.tanh(F.linear(x, w, b)),
                         lambda: (R(3, 5).to(torch.complex64), R(4, 5).to(torch.complex64), R(4).to(torch.complex64))),
    "int64_linear": (lambda x, w, r: cf.linear(x, w, residual=r), lambda x, w, r: F.linear(x, w) + r,
                     lambda: (torch.randint(-5, 5, (3, 5)), torch.randint(-5, 5, (4, 5)), torch.randint(-5, 5, (4,)))),
    "float64_residual_on_float32_conv": (
        lambda x, w, r: cf.conv2d(x, w, padding=1, activation="gelu", residual=r),
        lambda x, w, r: F.gelu(F.conv2d(x, w, padding=1) + r),
        lambda: (R(2, 3, 6, 6), R(4, 3, 3, 3), R(2, 4, 6, 6, dtype=f64))),
    "float64_bias_on_float32_matmul": (lambda a, b, bias: cf.matmul(a, b, bias), lambda a, b, bias: torch.matmul(a, b) + bias,
                                       lambda: (R(2, 3, 5), R(5, 4), R(4, dtype=f64))),
    "float16_residual_on_float32_linear": (lambda x, w, r: cf.linear(x, w, residual=r), lambda x, w, r: F.linear(x, w) + r,
                                           lambda: (R(3, 5), R(4, 5), R(3, 4, dtype=torch.float16))),
    "int32_matmul_amax": (lambda a, b, _: cf.matmul(a, b, return_amax=True)[1],
                          lambda a, b, _: torch.matmul(a, b).abs().amax().float(),
                          lambda: (torch.randint(-5, 5, (2, 3, 4), dtype=torch.int32),
                                   torch.randint(-5, 5, (4, 2), dtype=torch.int32), None)),
}


@pytest.mark.parametrize("name", TORCH_COMPUTES)
def test_dtypes_cudnn_does_not_take_run_torchs_expression(name, caplog):
    ours, theirs, make = TORCH_COMPUTES[name]
    args = make()
    with caplog.at_level(logging.DEBUG, logger="cudnn_fuse"):
        got = ours(*args)
    want = theirs(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want)
    if got.dim() == 4:
        assert got.is_contiguous(memory_format=torch.channels_last) == want.is_contiguous(
            memory_format=torch.channels_last)


def test_a_dtype_fallback_is_logged_once_at_debug_with_its_reason(caplog):
    ops._said.discard(("linear", "operands of dtypes torch.float32 and torch.float64 (torch's own expression "
                                 "promotes them)"))
    with caplog.at_level(logging.DEBUG, logger="cudnn_fuse"):
        for _ in range(3):
            cf.linear(R(3, 5), R(4, 5), residual=R(3, 4, dtype=f64))
    said = [r for r in caplog.records if "float64" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.DEBUG
    assert "linear: running the PyTorch reference: operands of dtypes" in said[0].getMessage()


def test_a_float64_residual_gets_its_gradient_in_float64():
    x, w = R(3, 5, grad=True), R(4, 5, grad=True)
    r = R(3, 4, dtype=f64, grad=True)
    y = cf.linear(x, w, activation="silu", residual=r)
    want = F.silu(F.linear(x, w) + r)
    assert y.dtype == f64
    g = torch.autograd.grad(y.sum(), (x, w, r))
    e = torch.autograd.grad(want.sum(), (x, w, r))
    for a, b in zip(g, e):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b)


TORCH_REFUSES = {  # (cf call, torch's own call of the same operands)
    "float16_bias_on_float32_conv": (lambda: cf.conv2d(R(2, 3, 6, 6), R(4, 3, 3, 3), R(4).half()),
                                     lambda: F.conv2d(R(2, 3, 6, 6), R(4, 3, 3, 3), R(4).half())),
    "float64_weight_on_float32_conv": (lambda: cf.conv2d(R(2, 3, 6, 6), R(4, 3, 3, 3, dtype=f64)),
                                       lambda: F.conv2d(R(2, 3, 6, 6), R(4, 3, 3, 3, dtype=f64))),
    "bool_conv": (lambda: cf.conv2d(R(2, 3, 6, 6) > 0, R(4, 3, 3, 3) > 0),
                  lambda: F.conv2d(R(2, 3, 6, 6) > 0, R(4, 3, 3, 3) > 0)),
    "float64_weight_on_float32_linear": (lambda: cf.linear(R(3, 5), R(4, 5, dtype=f64)),
                                         lambda: F.linear(R(3, 5), R(4, 5, dtype=f64))),
    "float16_bias_on_float32_linear": (lambda: cf.linear(R(3, 5), R(4, 5), R(4).half()),
                                       lambda: F.linear(R(3, 5), R(4, 5), R(4).half())),
    "float64_b_on_float32_matmul": (lambda: cf.matmul(R(2, 3, 5), R(5, 4, dtype=f64)),
                                    lambda: torch.matmul(R(2, 3, 5), R(5, 4, dtype=f64))),
    "gelu_of_integers": (lambda: cf.linear(torch.ones(3, 5, dtype=torch.long), torch.ones(4, 5, dtype=torch.long),
                                           activation="gelu"),
                         lambda: F.gelu(F.linear(torch.ones(3, 5, dtype=torch.long), torch.ones(4, 5, dtype=torch.long)))),
}


@pytest.mark.parametrize("name", TORCH_REFUSES)
def test_dtypes_torch_refuses_raise_torchs_own_error(name):
    ours, theirs = TORCH_REFUSES[name]
    with pytest.raises(Exception) as t:
        theirs()
    with pytest.raises(Exception) as c:
        ours()
    assert type(c.value) is type(t.value) and str(c.value) == str(t.value)


def test_operands_on_two_devices_stay_an_argument_error():
    with pytest.raises(cf.ArgumentError, match=r"linear: weight is on meta but x is on cpu"):
        cf.linear(R(3, 5), torch.empty(4, 5, device="meta"))
    with pytest.raises(cf.ArgumentError, match=r"conv2d: residual is on meta but x is on cpu"):
        cf.conv2d(R(2, 3, 6, 6), R(4, 3, 3, 3), residual=torch.empty(2, 4, 4, 4, device="meta", dtype=f64))


@pytest.mark.parametrize("bad", [np.zeros((3, 5), np.float32), [[1.0] * 5] * 3, 2.0])
def test_a_non_tensor_operand_stays_a_type_error(bad):
    with pytest.raises(TypeError, match=r"linear: x must be a torch\.Tensor"):
        cf.linear(bad, R(4, 5))


# ------------------------------------------------------------------ 7. cf.ArgumentError


MISMATCHES = {  # a shape mismatch of each op, and torch's own call of it (which raises RuntimeError)
    "conv2d": (lambda: cf.conv2d(R(2, 4, 6, 6), R(3, 5, 3, 3)), lambda: F.conv2d(R(2, 4, 6, 6), R(3, 5, 3, 3))),
    "linear": (lambda: cf.linear(R(3, 5), R(4, 6)), lambda: F.linear(R(3, 5), R(4, 6))),
    "matmul": (lambda: cf.matmul(R(3, 5), R(6, 4)), lambda: torch.matmul(R(3, 5), R(6, 4))),
    "scaled_dot_product_attention": (lambda: cf.scaled_dot_product_attention(R(2, 6, 8), R(2, 7, 9), R(2, 7, 9)),
                                     lambda: F.scaled_dot_product_attention(R(2, 6, 8), R(2, 7, 9), R(2, 7, 9))),
    "nn.Conv2d": (lambda: cf.nn.Conv2d(4, 6, 3)(R(2, 5, 8, 8)), lambda: nn.Conv2d(4, 6, 3)(R(2, 5, 8, 8))),
    "nn.Linear": (lambda: cf.nn.Linear(5, 4, activation="gelu")(R(3, 6, grad=True)),
                  lambda: nn.Linear(5, 4)(R(3, 6))),
}


@pytest.mark.parametrize("name", MISMATCHES)
def test_an_argument_error_is_caught_as_torchs_runtime_error_and_as_a_value_error(name):
    ours, theirs = MISMATCHES[name]
    with pytest.raises(RuntimeError):
        theirs()
    try:
        ours()
    except RuntimeError as exc:  # what code written around torch's ops catches
        assert isinstance(exc, cf.ArgumentError)
    else:
        pytest.fail("no RuntimeError")
    try:
        ours()
    except ValueError as exc:  # what the contract says
        assert isinstance(exc, cf.ArgumentError)
    else:
        pytest.fail("no ValueError")


def test_argument_error_is_exported_and_subclasses_both():
    assert issubclass(cf.ArgumentError, ValueError) and issubclass(cf.ArgumentError, RuntimeError)
    assert "ArgumentError" in cf.__all__
    assert "RuntimeError" in cf.ArgumentError.__doc__


def test_module_argument_errors_are_argument_errors():
    with pytest.raises(cf.ArgumentError, match="activation"):
        cf.nn.Linear(2, 3, activation="swish")
    with pytest.raises(cf.ArgumentError, match="ConvChain"):
        cf.nn.ConvChain([nn.Linear(2, 2)])
    with pytest.raises(cf.ArgumentError, match="fc1"):
        cf.nn.FusedMLP(nn.Linear(4, 8), nn.Linear(8, 4))
    conv = cf.nn.Conv2d(4, 6, 3)
    with pytest.raises(cf.ArgumentError, match="residual"):
        conv(R(2, 4, 8, 8), R(2, 6, 5, 5))
