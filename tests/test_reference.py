"""The CPU path of every public op (it runs ``reference``) equals plain torch, for every epilogue.

The expected values are written with torch.nn.functional directly, never with cudnn_fuse.reference:
  conv2d  act(F.conv2d(x, w, b, ...) + residual)
  linear  act(F.linear(x, w, b) + residual)
  matmul  act(torch.matmul(a, b) + bias + residual)
  sdpa    F.scaled_dot_product_attention (GQA: torch's enable_gqa without a mask, else k/v repeat_interleave'd), and a float64 softmax formula
"""

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import cudnn_fuse as cf
from cudnn_fuse import ops, reference

ACTS = ["relu", "gelu", "gelu_tanh", "silu", "tanh", "sigmoid", "leaky_relu"]


def act_fn(name, slope=0.01):
    """The torch function each activation name means (independent of cudnn_fuse)."""
    return {
        None: lambda z: z,
        "relu": torch.relu,
        "gelu": F.gelu,
        "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
        "silu": F.silu,
        "tanh": torch.tanh,
        "sigmoid": torch.sigmoid,
        "leaky_relu": lambda z: F.leaky_relu(z, slope),
    }[name]


def rand(gen, *shape, dtype=torch.float32):
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64).to(dtype)


def check_output(out, expected, return_amax, dtype):
    """``out`` is y, or (y, amax) when return_amax; compare with ``expected`` (torch's y)."""
    if return_amax:
        assert isinstance(out, tuple) and len(out) == 2
        y, amax = out
        assert amax.dtype == torch.float32 and amax.dim() == 0
        if y.numel() == 0:
            assert amax.item() == 0.0, "amax of an empty output is 0"
        elif torch.isnan(y).any():
            assert torch.isnan(amax)
        else:
            assert amax.item() == y.abs().max().float().item()
    else:
        assert isinstance(out, torch.Tensor)
        y = out
    assert y.shape == expected.shape
    assert y.dtype == dtype
    torch.testing.assert_close(y, expected, equal_nan=True)
    return y


epilogues = st.fixed_dictionaries({
    "activation": st.sampled_from([None] + ACTS),
    "negative_slope": st.sampled_from([0.01, 0.2, 0.0, 1.5]),
    "bias": st.booleans(),
    "residual": st.booleans(),
    "return_amax": st.booleans(),
})
float_dtypes = st.sampled_from([torch.float32, torch.float64])
seeds = st.integers(0, 2**31 - 1)


def _with_epilogue(expected_z, epi, residual):
    z = expected_z + residual if residual is not None else expected_z
    return act_fn(epi["activation"], epi["negative_slope"])(z)


def _epilogue_kwargs(epi, residual):
    kw = dict(activation=epi["activation"], residual=residual, return_amax=epi["return_amax"])
    if epi["activation"] == "leaky_relu":
        kw["negative_slope"] = epi["negative_slope"]
    return kw


# ------------------------------------------------------------------- conv2d

pairs = lambda lo, hi: st.one_of(st.integers(lo, hi), st.tuples(st.integers(lo, hi), st.integers(lo, hi)))


@st.composite
def conv_cases(draw):
    groups = draw(st.integers(1, 3))
    C, K = groups * draw(st.integers(1, 3)), groups * draw(st.integers(1, 2))
    R, S = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    dilation = draw(pairs(1, 2))
    padding = draw(st.one_of(pairs(0, 2), st.sampled_from(["same", "valid"])))
    stride = 1 if padding == "same" else draw(pairs(1, 3))
    dh, dw = (dilation, dilation) if isinstance(dilation, int) else dilation
    # at least one output position for any padding >= 0
    H = draw(st.integers(dh * (R - 1) + 1, dh * (R - 1) + 6))
    W = draw(st.integers(dw * (S - 1) + 1, dw * (S - 1) + 6))
    batch = draw(st.sampled_from([None, 0, 1, 2, 3]))  # None: unbatched 3-D input
    channels_last = batch is not None and draw(st.booleans())
    return dict(groups=groups, C=C, K=K, R=R, S=S, H=H, W=W, stride=stride, padding=padding, dilation=dilation,
                batch=batch, channels_last=channels_last)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
@settings(max_examples=50, deadline=None)
@given(case=conv_cases(), epi=epilogues, dtype=float_dtypes, seed=seeds)
def test_conv2d_cpu_equals_torch(case, epi, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    lead = () if case["batch"] is None else (case["batch"],)
    x = rand(g, *lead, case["C"], case["H"], case["W"], dtype=dtype)
    if case["channels_last"]:
        x = x.contiguous(memory_format=torch.channels_last)
    w = rand(g, case["K"], case["C"] // case["groups"], case["R"], case["S"], dtype=dtype)
    b = rand(g, case["K"], dtype=dtype) if epi["bias"] else None
    geo = dict(stride=case["stride"], padding=case["padding"], dilation=case["dilation"], groups=case["groups"])
    # torch 2.13's CPU conv with a bias segfaults on some channels_last inputs (e.g. x [2,3,3,1],
    # w [2,3,2,1], stride 3, padding 2, dilation 2); the values do not depend on the layout.
    z = F.conv2d(x.contiguous(), w, b, **geo)
    residual = rand(g, *z.shape, dtype=dtype) if epi["residual"] else None
    expected = _with_epilogue(z, epi, residual)
    out = cf.conv2d(x, w, b, **geo, **_epilogue_kwargs(epi, residual))
    check_output(out, expected, epi["return_amax"], dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_conv2d_cpu_16bit_rounds_once_after_the_bias(dtype):
    """The 16-bit CPU conv adds the bias in float32 before its one rounding, as the fused graph
    does: where z + bias cancels to near 0, rounding z first to 16 bits (then adding the bias)
    flipped ReLU masks against float32. Here a bias that cancels z exactly, up to a tiny offset."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 7, 7).to(dtype).to(memory_format=torch.channels_last)
    w = (torch.randn(6, 8, 3, 3) / 4).to(dtype)
    z32 = F.conv2d(x.float(), w.float(), None, padding=1)
    at = z32[0, :, 3, 3]  # the bias makes z + bias tiny at one position per channel
    b = (-at + 1e-3 * torch.sign(at + 1e-9)).to(dtype)
    y = cf.conv2d(x, w, b, padding=1, activation="relu")
    want = (z32 + b.float().view(1, -1, 1, 1)).relu()
    assert y.dtype == dtype
    assert torch.equal(y, want.to(dtype))  # one rounding of the float32 result, bit for bit
    assert torch.equal(y.float() > 0, want > 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", ["linear", "matmul"])
def test_gemm_cpu_16bit_rounds_once_after_the_bias_and_residual(op, dtype):
    """The 16-bit CPU linear/matmul adds bias and residual in float32 before its one rounding.
    torch rounds a batched product to 16 bits before it adds the bias (and cf's epilogue added
    the residual after that rounding): where z + bias cancels, ReLU masks flipped against
    float64 and moved gradients by up to 4% (tests/test_fuzz.py found it)."""
    torch.manual_seed(0)
    a = torch.randn(2, 9, 16).to(dtype)
    w = (torch.randn(16, 12) / 4).to(dtype)  # [K, N]; linear takes its transpose
    z32 = torch.matmul(a.float(), w.float())
    at = z32[1, 4]  # bias and residual cancel z to a tiny value in one row
    b = (-at / 2).to(dtype)
    r = (-(z32 + b.float()) + 1e-3 * torch.sign(at + 1e-9)).to(dtype)
    if op == "linear":
        y = cf.linear(a, w.t(), b, activation="relu", residual=r)
    else:
        y = cf.matmul(a, w, b, activation="relu", residual=r)
    want = (z32 + b.float() + r.float()).relu()
    assert y.dtype == dtype
    assert torch.equal(y, want.to(dtype))  # one rounding of the float32 result, bit for bit
    assert torch.equal(y.float() > 0, want > 0)


# ------------------------------------------------------------------- linear


@settings(max_examples=40, deadline=None)
@given(lead=st.lists(st.integers(0, 3), max_size=3), K=st.integers(0, 5), N=st.integers(0, 5), epi=epilogues,
       dtype=float_dtypes, transposed_weight=st.booleans(), seed=seeds)
def test_linear_cpu_equals_torch(lead, K, N, epi, dtype, transposed_weight, seed):
    g = torch.Generator().manual_seed(seed)
    x = rand(g, *lead, K, dtype=dtype)
    w = rand(g, K, N, dtype=dtype).t() if transposed_weight else rand(g, N, K, dtype=dtype)
    b = rand(g, N, dtype=dtype) if epi["bias"] else None
    z = F.linear(x, w, b)
    residual = rand(g, *z.shape, dtype=dtype) if epi["residual"] else None
    expected = _with_epilogue(z, epi, residual)
    out = cf.linear(x, w, b, **_epilogue_kwargs(epi, residual))
    y = check_output(out, expected, epi["return_amax"], dtype)
    assert y.shape == tuple(lead) + (N,)


# ------------------------------------------------------------------- matmul


@st.composite
def matmul_shapes(draw):
    batch = draw(st.lists(st.integers(0, 3), max_size=2))

    def operand_batch():
        n = draw(st.integers(0, len(batch)))
        dims = batch[len(batch) - n:]
        return [1 if draw(st.booleans()) else d for d in dims]  # 1s broadcast

    M, K, N = draw(st.integers(0, 4)), draw(st.integers(0, 4)), draw(st.integers(0, 4))
    a_vec, b_vec = draw(st.booleans()), draw(st.booleans())
    a = [K] if a_vec else operand_batch() + [M, K]
    b = [K] if b_vec else operand_batch() + [K, N]
    return a, b, draw(st.booleans())  # last: b is a transposed (column-major) view


@settings(max_examples=50, deadline=None)
@given(shapes=matmul_shapes(), epi=epilogues, dtype=float_dtypes, seed=seeds)
def test_matmul_cpu_equals_torch(shapes, epi, dtype, seed):
    a_shape, b_shape, b_transposed = shapes
    g = torch.Generator().manual_seed(seed)
    a = rand(g, *a_shape, dtype=dtype)
    if b_transposed and len(b_shape) >= 2:
        b = rand(g, *b_shape[:-2], b_shape[-1], b_shape[-2], dtype=dtype).transpose(-1, -2)
    else:
        b = rand(g, *b_shape, dtype=dtype)
    use_bias = epi["bias"] and b.dim() >= 2
    N = b.shape[-1]
    bias = rand(g, N, dtype=dtype) if use_bias else None
    z = torch.matmul(a, b)
    if bias is not None:
        z = z + bias
    residual = rand(g, *z.shape, dtype=dtype) if epi["residual"] else None
    expected = _with_epilogue(z, epi, residual)
    out = cf.matmul(a, b, bias, **_epilogue_kwargs(epi, residual))
    check_output(out, expected, epi["return_amax"], dtype)


# ---------------------------------------------------------------------- sdpa


@st.composite
def sdpa_cases(draw):
    four_d = draw(st.booleans())
    B = draw(st.integers(0, 2))
    Hkv = draw(st.integers(1, 2)) if four_d else None
    rep = draw(st.integers(1, 3)) if four_d else 1
    Sq, Skv, D, Dv = (draw(st.integers(1, n)) for n in (5, 6, 8, 8))
    mask = draw(st.sampled_from([None, "causal", "bool", "additive"]))
    mask_lead = []
    if mask in ("bool", "additive"):
        n_lead = draw(st.integers(0, 2 if four_d else 1))
        full = ([B, Hkv * rep] if four_d else [B])[-n_lead:] if n_lead else []  # right-aligned, like broadcasting
        mask_lead = [1 if draw(st.booleans()) else d for d in full]
    scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0)))
    bshd = four_d and draw(st.booleans())
    return dict(four_d=four_d, B=B, Hkv=Hkv, rep=rep, Sq=Sq, Skv=Skv, D=D, Dv=Dv, mask=mask, mask_lead=mask_lead,
                scale=scale, bshd=bshd)


def _sdpa_operand(g, c, H, S, D, dtype):
    if not c["four_d"]:
        return rand(g, c["B"], S, D, dtype=dtype)
    if c["bshd"]:  # [B, S, H, D] memory seen as [B, H, S, D]
        return rand(g, c["B"], S, H, D, dtype=dtype).transpose(1, 2)
    return rand(g, c["B"], H, S, D, dtype=dtype)


def _sdpa_math(q, k, v, mask, causal, scale):
    """softmax(q k^T * scale + mask) v in float64 (fully visible rows only)."""
    q, k, v = q.double(), k.double(), v.double()
    s = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    return torch.softmax(s, -1) @ v


@settings(max_examples=50, deadline=None)
@given(c=sdpa_cases(), dtype=float_dtypes, seed=seeds)
def test_sdpa_cpu_equals_torch(c, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    Hq = c["Hkv"] * c["rep"] if c["four_d"] else None
    q = _sdpa_operand(g, c, Hq, c["Sq"], c["D"], dtype)
    k = _sdpa_operand(g, c, c["Hkv"], c["Skv"], c["D"], dtype)
    v = _sdpa_operand(g, c, c["Hkv"], c["Skv"], c["Dv"], dtype)
    mask = None
    if c["mask"] == "bool":
        mask = torch.rand(*c["mask_lead"], c["Sq"], c["Skv"], generator=g) > 0.3
    elif c["mask"] == "additive":
        mask = rand(g, *c["mask_lead"], c["Sq"], c["Skv"], dtype=dtype)
    causal = c["mask"] == "causal"
    kw = dict(attn_mask=mask, is_causal=causal, scale=c["scale"])

    out = cf.scaled_dot_product_attention(q, k, v, **kw, enable_gqa=c["rep"] > 1 or (c["four_d"] and seed % 2 == 0))
    kr, vr = (k.repeat_interleave(c["rep"], dim=-3), v.repeat_interleave(c["rep"], dim=-3)) if c["rep"] > 1 else (k, v)
    expected = F.scaled_dot_product_attention(q, kr, vr, **kw)
    assert out.shape == expected.shape == (*q.shape[:-1], c["Dv"])
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, equal_nan=True)

    visible = _sdpa_math(q, kr, vr, mask, causal, c["scale"]) if dtype == torch.float64 else None
    if visible is not None and torch.isfinite(visible).all():  # no fully masked row
        torch.testing.assert_close(out, visible)


# ------------------------------------------------------------- explicit cases


def test_non_default_negative_slope_reaches_every_op():
    g = torch.Generator().manual_seed(1)
    x, w = rand(g, 2, 3, 6, 6), rand(g, 4, 3, 3, 3)
    a, b = rand(g, 5, 7), rand(g, 7, 6)
    for fn, args, z in [(cf.conv2d, (x, w), F.conv2d(x, w)), (cf.linear, (a, b.t()), a @ b),
                        (cf.matmul, (a, b), a @ b)]:
        y = fn(*args, activation="leaky_relu", negative_slope=0.3)
        torch.testing.assert_close(y, F.leaky_relu(z, 0.3))
        assert (z < 0).any() and not torch.allclose(y, F.leaky_relu(z, 0.01))


def test_empty_outputs_match_torch_and_amax_is_zero():
    cases = [
        (cf.linear, (torch.randn(0, 4), torch.randn(3, 4)), (0, 3)),
        (cf.linear, (torch.randn(2, 0, 4), torch.randn(3, 4)), (2, 0, 3)),
        (cf.matmul, (torch.randn(0, 4), torch.randn(4, 5)), (0, 5)),
        (cf.matmul, (torch.randn(3, 0, 4), torch.randn(4, 5)), (3, 0, 5)),
        (cf.matmul, (torch.randn(2, 3, 4), torch.randn(4, 0)), (2, 3, 0)),
        (cf.conv2d, (torch.randn(0, 3, 5, 5), torch.randn(4, 3, 3, 3)), (0, 4, 3, 3)),
    ]
    for fn, args, shape in cases:
        y, amax = fn(*args, activation="relu", return_amax=True)
        assert tuple(y.shape) == shape
        assert amax.dtype == torch.float32 and amax.dim() == 0 and amax.item() == 0.0


def test_matmul_k_zero_is_bias_plus_residual():
    a, b, bias, r = torch.randn(3, 0), torch.randn(0, 4), torch.randn(4), torch.randn(3, 4)
    y, amax = cf.matmul(a, b, bias, residual=r, activation="tanh", return_amax=True)
    torch.testing.assert_close(y, torch.tanh(bias + r))
    assert amax.item() == y.abs().max().item()


# -------------------------------------------------------------- NaN and Inf


def _poisoned_case(op, where, value, act, gen):
    """(cf call, torch expected) with ``value`` written into one element of ``where``."""
    t = {}
    if op == "conv2d":
        t["x"], t["w"], t["bias"] = rand(gen, 2, 3, 6, 6), rand(gen, 4, 3, 3, 3), rand(gen, 4)
        t["residual"] = rand(gen, 2, 4, 4, 4)
        idx = {"x": (0, 1, 2, 3), "w": (1, 0, 0, 2), "bias": (2,), "residual": (1, 3, 0, 1)}[where]
        t[where][idx] = value
        ref = act_fn(act)(F.conv2d(t["x"], t["w"], t["bias"]) + t["residual"])
        call = lambda **kw: cf.conv2d(t["x"], t["w"], t["bias"], residual=t["residual"], activation=act, **kw)
    elif op in ("linear", "matmul"):
        t["x"], t["w"], t["bias"], t["residual"] = rand(gen, 3, 5, 6), rand(gen, 4, 6), rand(gen, 4), rand(gen, 3, 5, 4)
        idx = {"x": (1, 2, 3), "w": (2, 5), "bias": (0,), "residual": (2, 4, 1)}[where]
        t[where][idx] = value
        ref = act_fn(act)(F.linear(t["x"], t["w"], t["bias"]) + t["residual"])
        if op == "linear":
            call = lambda **kw: cf.linear(t["x"], t["w"], t["bias"], residual=t["residual"], activation=act, **kw)
        else:
            call = lambda **kw: cf.matmul(t["x"], t["w"].t(), t["bias"], residual=t["residual"], activation=act, **kw)
    else:
        q, k, v = rand(gen, 1, 2, 4, 8), rand(gen, 1, 2, 5, 8), rand(gen, 1, 2, 5, 8)
        {"x": q, "w": k, "bias": v, "residual": q}[where][0, 1, 2, 3] = value
        ref = F.scaled_dot_product_attention(q, k, v)
        call = lambda **kw: cf.scaled_dot_product_attention(q, k, v)
    return call, ref


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", ["x", "w", "bias", "residual"])
@pytest.mark.parametrize("op", ["conv2d", "linear", "matmul", "sdpa"])
def test_nan_and_inf_land_where_torch_puts_them(op, where, value):
    gen = torch.Generator().manual_seed(7)
    for act in (None, "relu", "sigmoid", "leaky_relu", "gelu"):
        call, ref = _poisoned_case(op, where, value, act, gen)
        if act is None and op != "sdpa":  # torch's CPU SDPA kernel does not always propagate a NaN query
            assert not torch.isfinite(ref).all(), "the case must poison torch's result"
        if op == "sdpa":
            torch.testing.assert_close(call(), ref, equal_nan=True)
            continue
        y, amax = call(return_amax=True)
        torch.testing.assert_close(y, ref, equal_nan=True)
        assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.equal(torch.isinf(y), torch.isinf(ref))
        if torch.isnan(ref).any():
            assert torch.isnan(amax), "amax is NaN when y has a NaN"
        else:
            assert amax.item() == ref.abs().max().item()


# --------------------------------------------------------------------- bf16


def _rel_err(y, ref):
    return ((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("act", [None, "relu", "gelu", "silu", "sigmoid", "leaky_relu"])
def test_bf16_within_contract_tolerance_of_fp32(act):
    g = torch.Generator().manual_seed(3)
    bf = torch.bfloat16
    x, w, b, r = rand(g, 2, 8, 10, 10, dtype=bf), rand(g, 16, 8, 3, 3, dtype=bf), rand(g, 16, dtype=bf), None
    r = rand(g, 2, 16, 10, 10, dtype=bf)
    y, amax = cf.conv2d(x, w, b, padding=1, residual=r, activation=act, return_amax=True)
    ref = act_fn(act)(F.conv2d(x.float(), w.float(), b.float(), padding=1) + r.float())
    assert y.dtype == bf and _rel_err(y, ref) <= 1e-2
    assert amax.dtype == torch.float32 and amax.item() == y.abs().max().float().item()
    assert abs(amax.item() - ref.abs().max().item()) <= 1e-2 * ref.abs().max().item()

    a, wl, bl, rl = (rand(g, 4, 9, 32, dtype=bf), rand(g, 24, 32, dtype=bf), rand(g, 24, dtype=bf),
                     rand(g, 4, 9, 24, dtype=bf))
    y = cf.linear(a, wl, bl, residual=rl, activation=act)
    ref = act_fn(act)(F.linear(a.float(), wl.float(), bl.float()) + rl.float())
    assert y.dtype == bf and _rel_err(y, ref) <= 1e-2
    y = cf.matmul(a, wl.t(), bl, residual=rl, activation=act)
    assert y.dtype == bf and _rel_err(y, ref) <= 1e-2

    q, k, v = rand(g, 2, 4, 16, 32, dtype=bf), rand(g, 2, 2, 24, 32, dtype=bf), rand(g, 2, 2, 24, 32, dtype=bf)
    o = cf.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(2, 1), v.float().repeat_interleave(2, 1),
                                         is_causal=True)
    assert o.dtype == bf and _rel_err(o, ref) <= 1e-2


# ------------------------------------------------------------ fallback path


def _every_op_once():
    x, w = torch.randn(1, 2, 4, 4), torch.randn(3, 2, 3, 3)
    a = torch.randn(2, 3)
    q = torch.randn(1, 2, 3, 4)
    return [
        lambda: cf.conv2d(x, w),
        lambda: cf.linear(a, a),
        lambda: cf.matmul(a, a.t()),
        lambda: cf.scaled_dot_product_attention(q, q, q),
    ]


def test_every_cpu_call_counts_a_fallback():
    calls = _every_op_once() * 3
    before = cf.plan_stats()["fallbacks"]
    for i, call in enumerate(calls, 1):
        call()
        assert cf.plan_stats()["fallbacks"] == before + i


def test_no_gpu_warning_is_logged_exactly_once(monkeypatch, caplog, capsys):
    monkeypatch.setattr(ops, "_said", set())
    caplog.set_level(logging.DEBUG, logger="cudnn_fuse")
    for _ in range(5):
        for call in _every_op_once():
            call()
    said = [r for r in caplog.records if "CUDA" in r.getMessage()]
    assert len(said) == 1
    assert said[0].levelno == logging.WARNING and said[0].name.startswith("cudnn_fuse")
    assert capsys.readouterr() == ("", ""), "the library logs, it never prints"
    # a fresh process (an emptied record) says it again, once
    monkeypatch.setattr(ops, "_said", set())
    caplog.clear()
    cf.linear(torch.randn(2, 3), torch.randn(4, 3))
    cf.linear(torch.randn(2, 3), torch.randn(4, 3))
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "mask"])
def test_sdpa_reference_gqa_uses_torchs_enable_gqa_without_a_mask(monkeypatch, masked):
    """GQA without a mask goes to torch's enable_gqa (no k/v copy; what torch.compile traces for
    cf's SDPA); with a mask k/v are expanded by hand. Both equal the float64 formula."""
    if not reference._TORCH_GQA:
        pytest.skip("this torch has no enable_gqa")
    seen, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((k.size(-3), kw.get("enable_gqa", False)))
        return real(q, k, v, **kw)

    monkeypatch.setattr(reference.F, "scaled_dot_product_attention", spy)
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 8, 12, 16), torch.randn(2, 2, 12, 16), torch.randn(2, 2, 12, 16)
    mask = (torch.rand(2, 1, 12, 12) > 0.3) | torch.eye(12, dtype=torch.bool) if masked else None  # no empty row
    out = reference.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not masked, enable_gqa=True)
    assert seen == ([(8, False)] if masked else [(2, True)])
    kk, vv = (t.double().repeat_interleave(4, dim=-3) for t in (k, v))
    s = q.double() @ kk.transpose(-1, -2) / 4.0
    allowed = mask if masked else torch.ones(12, 12, dtype=torch.bool).tril()
    ref = s.masked_fill(~allowed, float("-inf")).softmax(-1) @ vv
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


# torch 2.13's CPU conv backward corrupts the heap for a float32 1x1 stride-2 conv of a [3, 8, 16, 16]
# input when an operand has channels_last strides (a segfault or "malloc(): unaligned tcache chunk");
# optimize() makes a conv's weight channels_last, so a plain NCHW model's CPU training step reached it.
_CRASH = """
import sys, torch, torch.nn.functional as F
import cudnn_fuse as cf
torch.manual_seed(0)
case = sys.argv[1]
x = torch.randn(3, 8, 16, 16, dtype=torch.float64)
w = torch.randn(8, 8, 1, 1, dtype=torch.float64)
b = torch.randn(8, dtype=torch.float64)
x64, w64, b64 = (t.clone().requires_grad_(True) for t in (x, w, b))
F.relu(F.conv2d(x64, w64, b64, 2)).sum().backward()
if case == "plain_torch":  # the torch bug itself, outside cf (expected to crash on torch 2.13)
    xt = x.float().contiguous(memory_format=torch.channels_last).requires_grad_(True)
    F.conv2d(xt, w.float().requires_grad_(True), None, 2).sum().backward()
    print("torch survived")
    sys.exit(0)
if case == "op":
    xs = x.float().contiguous(memory_format=torch.channels_last).requires_grad_(True)
    ws, bs = w.float().requires_grad_(True), b.float().requires_grad_(True)
    y = cf.conv2d(xs, ws, bs, 2, activation="relu")
    assert y.is_contiguous(memory_format=torch.channels_last), y.stride()
    y.sum().backward()
    grads = [(xs.grad, x64.grad), (ws.grad, w64.grad), (bs.grad, b64.grad)]
    assert xs.grad.is_contiguous(memory_format=torch.channels_last), xs.grad.stride()
else:  # a plain NCHW model through optimize(), trained on the CPU
    m = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 1, 2), torch.nn.ReLU())
    with torch.no_grad():
        m[0].weight.copy_(w)
        m[0].bias.copy_(b)
    m = cf.optimize(m)
    xs = x.float().requires_grad_(True)
    m(xs).sum().backward()
    conv = [mod for mod in m.modules() if hasattr(mod, "weight")][0]
    grads = [(xs.grad, x64.grad), (conv.weight.grad, w64.grad), (conv.bias.grad, b64.grad)]
for got, want in grads:
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
print("ok")
"""


@pytest.mark.parametrize("case", ["op", "optimized_model"])
def test_cpu_conv_training_survives_torchs_channels_last_backward_crash(case, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "crash.py"
    script.write_text(_CRASH)
    res = subprocess.run([sys.executable, str(script), case], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, (res.returncode, res.stdout[-500:], res.stderr[-2000:])


def test_cpu_conv_output_and_gradient_layouts_follow_torch():
    """The CPU conv runs on NCHW operands (reference._cpu_conv) but hands back torch's layouts."""
    torch.manual_seed(0)
    import itertools

    for x_cl, w_cl, r, hw in itertools.product([True, False], [True, False], [1, 3], [9, 1]):
        x = torch.randn(2, 8, hw, hw, requires_grad=True)
        w = torch.randn(8, 8, r, r, requires_grad=True)
        xs = x.contiguous(memory_format=torch.channels_last) if x_cl else x
        ws = w.contiguous(memory_format=torch.channels_last) if w_cl else w
        want = F.conv2d(xs, ws, None, 1, r // 2)
        got = reference.conv2d(xs, ws, None, 1, r // 2)
        what = (x_cl, w_cl, r, hw, got.stride(), want.stride())
        assert got.stride() == want.stride() or (got.is_contiguous() and want.is_contiguous()), what
        torch.testing.assert_close(got, want)
        # cf's CPU backward (torch_ops._conv2d_products_torch) the same way
        xc = xs.detach().clone(memory_format=torch.preserve_format).requires_grad_(True)
        wc = ws.detach().clone(memory_format=torch.preserve_format).requires_grad_(True)
        cf.conv2d(xc, wc, None, 1, r // 2, activation="silu").sum().backward()
        xt, wt = xs.detach().clone().requires_grad_(True), ws.detach().clone().requires_grad_(True)
        F.silu(F.conv2d(xt, wt, None, 1, r // 2)).sum().backward()
        torch.testing.assert_close(xc.grad, xt.grad)
        torch.testing.assert_close(wc.grad, wt.grad)


class _OpCounts:
    """A dispatch mode counting the aten ops (by overload packet name) a call runs."""

    def __enter__(self):
        from collections import Counter

        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = Counter()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counts[func.overloadpacket.__name__] += 1
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


@pytest.mark.parametrize("act, dtype, amax", [("relu", torch.float32, False), ("leaky_relu", torch.float32, True),
                                              ("gelu", torch.float32, False), ("relu", torch.bfloat16, False),
                                              (None, torch.float64, False)])
def test_the_cpu_conv_epilogue_runs_in_place_on_the_conv_output(act, dtype, amax):
    """Outside autograd the CPU conv adds the bias and residual and applies a ReLU / leaky ReLU in place on
    its own fresh output: the epilogue's arithmetic, with no new tensor a step (each step allocated one, 3 of
    a bottleneck's 4 full passes over the output beside the conv's). The inputs stay as they were."""
    torch.manual_seed(0)
    x, w = torch.randn(2, 8, 9, 9, dtype=dtype), torch.randn(16, 8, 3, 3, dtype=dtype)
    b, r = torch.randn(16, dtype=dtype), torch.randn(2, 16, 9, 9, dtype=dtype)
    b0, r0 = b.clone(), r.clone()
    with torch.no_grad(), _OpCounts() as ops_run:
        got = reference.conv2d(x, w, b, 1, 1, activation=act, residual=r, return_amax=amax, negative_slope=0.2)
    y = got[0] if amax else got
    assert ops_run.counts["add"] == 0 and ops_run.counts["add_"] == 2, dict(ops_run.counts)
    if act in ("relu", "leaky_relu"):
        assert ops_run.counts[act] == 0 and ops_run.counts[act + "_"] == 1, dict(ops_run.counts)
    assert torch.equal(b, b0) and torch.equal(r, r0)
    # the out-of-place epilogue on the same conv output: the same numbers, bit for bit
    z = F.conv2d(x.float() if dtype is torch.bfloat16 else x, w.float() if dtype is torch.bfloat16 else w, None, 1, 1)
    want = reference.epilogue(z, b, r, act, 0.2, amax, bias_shape=(1, -1, 1, 1), out_dtype=dtype)
    assert y.dtype == dtype and torch.equal(y, want[0] if amax else want)
    if amax:
        assert torch.equal(got[1], want[1])


def test_the_cpu_conv_epilogue_stays_out_of_place_where_it_must():
    """Under autograd (the reference's operands requiring grad) and for a residual that broadcasts the
    output to a larger shape, the epilogue makes new tensors, as before: gradients and shapes as torch's."""
    torch.manual_seed(0)
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 4, 3, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(8, dtype=torch.float64, requires_grad=True)
    y = reference.conv2d(x, w, b, 1, 1, activation="relu")
    want = F.relu(F.conv2d(x, w, b, 1, 1))
    g = torch.randn_like(want)
    got_grads = torch.autograd.grad(y, (x, w, b), g)
    want_grads = torch.autograd.grad(want, (x, w, b), g)
    for a, e in zip(got_grads, want_grads):
        torch.testing.assert_close(a, e)
    with torch.no_grad():  # a [1, K, 1, 1] output against a [2, K, 3, 3] residual: torch's add broadcasts
        x1, w1 = torch.randn(1, 4, 3, 3), torch.randn(8, 4, 3, 3)
        r = torch.randn(2, 8, 3, 3)
        got = reference.conv2d(x1, w1, None, 1, 0, activation="relu", residual=r)
        assert got.shape == (2, 8, 3, 3)
        torch.testing.assert_close(got, F.relu(F.conv2d(x1, w1) + r))
