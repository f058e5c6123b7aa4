"""The builders' graphs run through a torch interpreter of the cuDNN graph IR, against reference.py.

tests/test_builders.py and tests/test_backward.py check the IR's shape (nodes, modes, params,
operand geometry, uids). This file checks what the IR *computes*: ``run_ir`` evaluates the nodes
of ``build_graph(spec).inspect()`` in order with cuDNN's documented semantics (virtual tensors kept
unrounded, as the graph's float32 intermediates; every non-virtual output rounded to its declared
dtype, and a later node reading that output reads the rounded value, as measured on the H200 for
the keep-z graph; SDPA's causal mask top-left aligned, its stats the row logsumexp, GQA heads in
groups) and compares the result with the PyTorch reference (the CPU fallback). A builder that
dropped the leaky slope, swapped GELU's form, added the bias after the activation, lost a padding,
read amax from the wrong tensor or passed the wrong attention scale computes another function
here. The interpreter knows nothing of cudnn_fuse; the reference side uses only reference.py and
torch's autograd.
"""

from __future__ import annotations

import itertools
import math

import cudnn
import pytest
import torch
import torch.nn.functional as F

from cudnn_fuse import reference
from cudnn_fuse.builders import build_graph, roles_of
from cudnn_fuse.spec import (
    ActGradSpec,
    ConvDgradSpec,
    ConvSpec,
    ConvWgradSpec,
    Epilogue,
    MatmulSpec,
    RecomputeGradSpec,
    SaveZSpec,
    SdpaBwdSpec,
    SdpaSpec,
    SdpaTrainSpec,
    TensorSpec,
    channels_last_strides,
)

ACTS = ["relu", "gelu", "gelu_tanh", "silu", "tanh", "sigmoid", "leaky_relu"]
TORCH_DT = {"data_type.HALF": torch.float16, "data_type.BFLOAT16": torch.bfloat16, "data_type.FLOAT": torch.float32}
W = torch.float64  # the interpreter's arithmetic: no rounding of its own
SLOPE = 0.2


# ------------------------------------------------------------------ the IR interpreter

def _pointwise_fwd(mode, x, p):
    if mode == "relu":  # its backward (RELU_BWD): the loss where the input is > 0
        return torch.relu(x)
    if mode == "leaky_relu":
        return torch.where(x > 0, x, p["negative_slope"] * x)
    if mode == "gelu":
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if mode == "gelu_approx_tanh":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    if mode == "swish":
        return x * torch.sigmoid(p["swish_beta"] * x)
    if mode == "tanh":
        return torch.tanh(x)
    if mode == "sigmoid":
        return torch.sigmoid(x)
    raise NotImplementedError(mode)


def _pointwise(mode, ins, p):
    if mode == "add":
        return ins[0] + ins[1]
    if mode.endswith("_backward"):  # (loss, input): d fwd(input) / d input * loss
        loss, x = ins
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            (g,) = torch.autograd.grad(_pointwise_fwd(mode[: -len("_backward")], x, p), x, loss)
        return g
    (x,) = ins
    return _pointwise_fwd(mode, x, p)


def _conv_pad(x, p):
    (t, l), (b, r) = p["pre_padding"], p["post_padding"]
    return F.pad(x, (l, r, t, b))


def _conv(x, w, p):
    return F.conv2d(_conv_pad(x, p), w, None, p["stride"], 0, p["dilation"], x.shape[1] // w.shape[1])


def _sdpa_scores(v, p):
    q, k = v["q"], v["k"]
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    s = q @ k.transpose(-1, -2) * p["attn_scale"]
    if "bias" in v:
        s = s + v["bias"]
    if p.get("use_causal_mask"):
        sq, skv = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, skv, dtype=torch.bool).triu(1), float("-inf"))
    return s, rep


def _sdpa(v, p):
    s, rep = _sdpa_scores(v, p)
    o = torch.softmax(s, -1) @ v["v"].repeat_interleave(rep, dim=1)
    return o, torch.logsumexp(s, -1, keepdim=True)


def _sdpa_backward(v, p):
    """FlashAttention's backward from o and the stats, as cuDNN's reads them."""
    s, rep = _sdpa_scores(v, p)
    P = torch.exp(s - v["stats"])
    vv = v["v"].repeat_interleave(rep, dim=1)
    dP = v["dO"] @ vv.transpose(-1, -2)
    D = (v["dO"] * v["o"]).sum(-1, keepdim=True)
    dS = P * (dP - D) * p["attn_scale"]
    dq = dS @ v["k"].repeat_interleave(rep, dim=1)
    dk = dS.transpose(-1, -2) @ v["q"]
    dv = P.transpose(-1, -2) @ v["dO"]
    fold = lambda t: t.unflatten(1, (t.shape[1] // rep, rep)).sum(2)  # noqa: E731 — the heads of a group
    return dq, fold(dk), fold(dv)


def run_ir(g, feeds):
    """Evaluate the graph ``g`` on ``feeds`` ({input name: tensor}); {output name: tensor}, each
    non-virtual output rounded to its declared dtype (and read back rounded by later nodes)."""
    d = g.inspect()
    assert g.context.intermediate_data_type == cudnn.data_type.FLOAT
    assert d["context"]["compute_data_type"] == str(cudnn.data_type.FLOAT)
    tensors = d["tensors"]
    val = {n: t.to(W) for n, t in feeds.items()}
    outs = {}
    for node in d["nodes"]:
        ty, p = node["type"], node["params"]
        ins = {port: val[name] for port, name in node["inputs"].items()}
        if ty == "MATMUL":
            res = {"C": ins["A"] @ ins["B"]}
        elif ty == "CONV_FPROP":
            res = {"Y": _conv(ins["image"], ins["weight"], p)}
        elif ty in ("CONV_DGRAD", "CONV_WGRAD"):
            name = next(iter(node["outputs"].values()))
            dims = tensors[name]["dim"]
            if ty == "CONV_DGRAD":
                x, w = torch.zeros(dims, dtype=W, requires_grad=True), ins["filter"].detach().requires_grad_()
                loss, leaf, port = ins["loss"], x, "DX"
            else:
                x, w = ins["image"].detach().requires_grad_(), torch.zeros(dims, dtype=W, requires_grad=True)
                loss, leaf, port = ins["loss"], w, "DW"
            with torch.enable_grad():
                (grad,) = torch.autograd.grad(_conv(x, w, p), leaf, loss)
            res = {port: grad}
        elif ty == "POINTWISE":
            res = {"OUT_0": _pointwise(p["mode"], [ins[f"IN_{i}"] for i in range(len(ins))], p)}
        elif ty == "REDUCTION":
            name = node["outputs"]["OUT_0"]
            dims = tensors[name]["dim"]
            x = ins["input"]
            axes = tuple(i for i, (a, b) in enumerate(zip(x.shape, dims)) if b == 1 and a != 1)
            if p["mode"] == cudnn.reduction_mode.AMAX:
                r = x.abs().amax(dim=axes, keepdim=True) if axes else x.abs()
            elif p["mode"] == cudnn.reduction_mode.ADD:
                r = x.sum(dim=axes, keepdim=True) if axes else x
            else:
                raise NotImplementedError(p["mode"])
            res = {"OUT_0": r.reshape(dims)}
        elif ty == "SDPA":
            o, stats = _sdpa(ins, p)
            res = {"O": o, "Stats": stats} if p.get("generate_stats") else {"O": o}
        elif ty == "SDPA_BWD":
            dq, dk, dv = _sdpa_backward(ins, p)
            res = {"dQ": dq, "dK": dk, "dV": dv}
        else:
            raise NotImplementedError(ty)
        assert set(res) == set(node["outputs"]), (ty, set(node["outputs"]))
        for port, t in res.items():
            name = node["outputs"][port]
            meta = tensors[name]
            if not meta["is_virtual"]:
                assert list(t.shape) == list(meta["dim"]), name
                t = t.to(TORCH_DT[meta["dtype"]]).to(W)  # written to memory in its dtype
                outs[name] = t
            val[name] = t
    return outs


def strided(spec: TensorSpec, gen, scale=1.0) -> torch.Tensor:
    """Random values in ``spec``'s dtype laid out with ``spec``'s strides."""
    dt = getattr(torch, spec.dtype)
    span = 1 + sum((n - 1) * s for n, s in zip(spec.shape, spec.stride))
    base = (torch.randn(span, generator=gen, dtype=torch.float64) * scale).to(dt)
    return base.as_strided(spec.shape, spec.stride)


def inputs_of(spec, gen, **scales):
    """The graph's inputs by role (roles_of's order), from the specs' geometry."""
    g = build_graph(spec)
    real = {n for n, t in g.inspect()["tensors"].items() if not t["is_virtual"]}
    produced = {name for node in g.inspect()["nodes"] for name in node["outputs"].values()}
    out = {}
    for role in roles_of(spec):
        if role in real and role not in produced:
            out[role] = strided(_geometry(spec, role), gen, scales.get(role, 1.0))
    return g, out


def _geometry(spec, role) -> TensorSpec:
    for holder in (spec, getattr(spec, "fwd", None)):
        if holder is None:
            continue
        if isinstance(getattr(holder, role, None), TensorSpec):
            return getattr(holder, role)
        epi = getattr(holder, "epilogue", None)
        if epi is not None and isinstance(getattr(epi, role, None), TensorSpec):
            return getattr(epi, role)
    raise KeyError(role)


def close(got, want, dtype, what=""):
    """Equal up to the output dtype's rounding (the reference's float32 and the interpreter's
    float64 can land one 16-bit ulp apart); float32 outputs to float32 accuracy."""
    want = want.to(W)
    tol = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
    assert got.shape == want.shape, what
    err = (got - want).abs().max().item() if got.numel() else 0.0
    scale = max(want.abs().max().item(), 1.0) if want.numel() else 1.0
    assert err <= tol * scale, f"{what}: max error {err:.3g} (scale {scale:.3g}, tol {tol})"


# ------------------------------------------------------------------ conv


def conv_spec(dtype, layout, bias, residual, act, amax, stride=(1, 1), pre=(1, 1), post=(1, 1), dilation=(1, 1),
              groups=1, N=2, C=4, H=9, Wd=7, K=6, R=3, S=3):
    P = (H + pre[0] + post[0] - dilation[0] * (R - 1) - 1) // stride[0] + 1
    Q = (Wd + pre[1] + post[1] - dilation[1] * (S - 1) - 1) // stride[1] + 1
    strides = channels_last_strides if layout == "nhwc" else (lambda s: TensorSpec.contiguous(s, dtype).stride)
    ts = lambda s: TensorSpec(s, tuple(strides(s)), dtype)  # noqa: E731
    x, w, y = ts((N, C, H, Wd)), ts((K, C // groups, R, S)), ts((N, K, P, Q))
    epi = Epilogue(bias=TensorSpec((1, K, 1, 1), (K, 1, K, K), dtype) if bias else None,
                   residual=y if residual else None, activation=act, negative_slope=SLOPE, amax=amax)
    return ConvSpec(x, w, y, stride, pre, post, dilation, groups, epi)


def _check_conv_forward(spec, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g, t = inputs_of(spec, gen, w=0.3)
    got = run_ir(g, t)
    e = spec.epilogue
    want = reference.conv2d_padded(t["x"], t["w"], t["bias"].reshape(-1) if e.bias else None, spec.stride,
                                   spec.pre_padding, spec.post_padding, spec.dilation, spec.groups, e.activation,
                                   t.get("residual"), e.amax, e.negative_slope)
    y, amax = want if e.amax else (want, None)
    close(got["y"], y, spec.y.dtype, "y")
    if e.amax:
        assert got["amax"].shape == (1,) * 4
        close(got["amax"].reshape(()), amax, "float32", "amax")


@pytest.mark.parametrize("bias, residual, act, amax",
                         [c for c in itertools.product([False, True], [False, True], [None] + ACTS, [False, True])])
def test_conv_forward_computes_the_reference(bias, residual, act, amax):
    _check_conv_forward(conv_spec("float32", "nchw", bias, residual, act, amax))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("act", ["gelu", "leaky_relu"])
def test_conv_forward_16bit_rounds_once_like_the_reference(dtype, layout, act):
    _check_conv_forward(conv_spec(dtype, layout, True, True, act, True))


@pytest.mark.parametrize("geo", [
    dict(stride=(2, 1), pre=(0, 2), post=(1, 0), dilation=(1, 2)),
    dict(stride=(1, 3), pre=(2, 1), post=(2, 1), dilation=(2, 1), groups=2),
    dict(stride=(2, 2), pre=(1, 1), post=(0, 0), groups=4, C=4, K=8),  # depthwise, multiplier 2
    dict(stride=(1, 1), pre=(0, 0), post=(0, 0), R=1, S=1),
])
def test_conv_geometry_computes_the_reference(geo):
    _check_conv_forward(conv_spec("float32", "nhwc", True, True, "silu", False, **geo))


def _conv_grads(spec, x, w, dy):
    """(dx, dw) by autograd through the reference conv (no epilogue)."""
    x, w = x.to(W).requires_grad_(), w.to(W).requires_grad_()
    y = reference.conv2d_padded(x, w, None, spec.stride, spec.pre_padding, spec.post_padding, spec.dilation,
                                x.shape[1] // w.shape[1])
    return torch.autograd.grad(y, (x, w), dy.to(W))


@pytest.mark.parametrize("geo", [
    dict(stride=(1, 1), pre=(1, 1), post=(1, 1)),
    dict(stride=(2, 2), pre=(1, 0), post=(0, 1), dilation=(1, 2)),
    dict(stride=(2, 1), pre=(1, 1), post=(1, 1), groups=2),
])
def test_conv_dgrad_and_wgrad_compute_the_reference_gradients(geo):
    fwd = conv_spec("float32", "nchw", False, False, None, False, **geo)
    args = (fwd.stride, fwd.pre_padding, fwd.post_padding, fwd.dilation)
    gen = torch.Generator().manual_seed(1)
    x, w, dy = strided(fwd.x, gen), strided(fwd.w, gen), strided(fwd.y, gen)
    dx, dw = _conv_grads(fwd, x, w, dy)
    got = run_ir(build_graph(ConvDgradSpec(fwd.y, fwd.w, fwd.x, *args)), {"dy": dy, "w": w})
    close(got["dx"], dx, "float32", "dx")
    got = run_ir(build_graph(ConvWgradSpec(fwd.x, fwd.y, fwd.w, *args)), {"x": x, "dy": dy})
    close(got["dw"], dw, "float32", "dw")


# ------------------------------------------------------------------ matmul


def matmul_spec(dtype, bias, residual, act, amax, Ba=3, Bb=1, M=5, K=16, N=12, b_transposed=False):
    B = max(Ba, Bb)
    a = TensorSpec.contiguous((Ba, M, K), dtype)
    b = TensorSpec((Bb, K, N), (K * N, 1, K), dtype) if b_transposed else TensorSpec.contiguous((Bb, K, N), dtype)
    y = TensorSpec.contiguous((B, M, N), dtype)
    epi = Epilogue(bias=TensorSpec((1, 1, N), (N, N, 1), dtype) if bias else None, residual=y if residual else None,
                   activation=act, negative_slope=SLOPE, amax=amax)
    return MatmulSpec(a, b, y, epi)


def _check_matmul_forward(spec, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g, t = inputs_of(spec, gen, b=0.3)
    got = run_ir(g, t)
    e = spec.epilogue
    want = reference.matmul(t["a"], t["b"], t["bias"].reshape(-1) if e.bias else None, e.activation,
                            t.get("residual"), e.amax, e.negative_slope)
    y, amax = want if e.amax else (want, None)
    close(got["y"], y, spec.y.dtype, "y")
    if e.amax:
        assert got["amax"].shape == (1, 1, 1)
        close(got["amax"].reshape(()), amax, "float32", "amax")


@pytest.mark.parametrize("bias, residual, act, amax",
                         [c for c in itertools.product([False, True], [False, True], [None] + ACTS, [False, True])])
def test_matmul_forward_computes_the_reference(bias, residual, act, amax):
    _check_matmul_forward(matmul_spec("float32", bias, residual, act, amax))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("batches", [(3, 1), (1, 4), (2, 2)])
def test_matmul_forward_batches_and_16bit(dtype, batches):
    _check_matmul_forward(matmul_spec(dtype, True, True, "gelu_tanh", True, *batches, b_transposed=True))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("act", ["gelu", "silu", "leaky_relu", "tanh"])
@pytest.mark.parametrize("residual", [False, True])
def test_save_z_computes_reference_linear_save_z(dtype, act, residual):
    """The keep-z graph: z = x @ W.T + b (+ r) in 16 bits, y = act of that rounded z (documented,
    measured on the H200): reference.linear_save_z."""
    rows, K, N = 7, 16, 12
    fwd = matmul_spec(dtype, True, residual, act, False, Ba=1, Bb=1, M=rows, K=K, N=N, b_transposed=True)
    spec = SaveZSpec(fwd, fwd.y)
    gen = torch.Generator().manual_seed(2)
    g, t = inputs_of(spec, gen, b=0.3)
    got = run_ir(g, t)
    w = t["b"][0].t()  # the [N, K] weight whose transposed view b is
    y, z = reference.linear_save_z(t["a"][0], w, t["bias"].reshape(-1), act, t["residual"][0] if residual else None,
                                   SLOPE)
    close(got["z"][0], z, dtype, "z")
    close(got["y"][0], y, dtype, "y")


def _act_grad(z, dy, act, slope):
    """dz = act'(z) * dy by autograd through reference.activation (float64)."""
    z = z.to(W).requires_grad_()
    with torch.enable_grad():
        (g,) = torch.autograd.grad(reference.activation(z, act, slope), z, dy.to(W))
    return g


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias, residual, dbias", [(True, True, True), (True, False, False), (False, True, False)])
def test_recompute_grad_matmul_computes_the_reference(act, bias, residual, dbias):
    fwd = matmul_spec("float32", bias, residual, act, False, Ba=2, Bb=1)
    spec = RecomputeGradSpec(fwd, fwd.y, fwd.y, TensorSpec.contiguous((1, 1, fwd.y.shape[-1]), "float32")
                             if dbias else None)
    gen = torch.Generator().manual_seed(3)
    g, t = inputs_of(spec, gen, b=0.3)
    got = run_ir(g, t)
    z = t["a"].to(W) @ t["b"].to(W)
    if bias:
        z = z + t["bias"].to(W)
    if residual:
        z = z + t["residual"].to(W)
    dz = _act_grad(z, t["dy"], act, SLOPE)
    close(got["dz"], dz, "float32", "dz")
    if dbias:
        close(got["dbias"], dz.to(torch.float32).to(W).sum((0, 1), keepdim=True), "float32", "dbias")


@pytest.mark.parametrize("act", ["gelu", "leaky_relu", "sigmoid"])
def test_recompute_grad_conv_computes_the_reference(act):
    fwd = conv_spec("float32", "nhwc", True, True, act, False, stride=(2, 1), pre=(1, 0), post=(0, 1))
    K = fwd.w.shape[0]
    spec = RecomputeGradSpec(fwd, fwd.y, fwd.y, TensorSpec((1, K, 1, 1), (K, 1, K, K), "float32"))
    gen = torch.Generator().manual_seed(4)
    g, t = inputs_of(spec, gen, w=0.3)
    got = run_ir(g, t)
    z = reference.conv2d_padded(t["x"].to(W), t["w"].to(W), t["bias"].reshape(-1).to(W), fwd.stride,
                                fwd.pre_padding, fwd.post_padding, fwd.dilation, fwd.groups, None,
                                t["residual"].to(W))
    dz = _act_grad(z, t["dy"], act, SLOPE)
    close(got["dz"], dz, "float32", "dz")
    close(got["dbias"], dz.to(torch.float32).to(W).sum((0, 2, 3), keepdim=True), "float32", "dbias")


@pytest.mark.parametrize("act", ACTS)
def test_act_grad_computes_the_reference(act):
    gen = torch.Generator().manual_seed(5)
    rows, N = 6, 10
    z = TensorSpec((rows, N, 1, 1), (N, 1, N, N), "float32")  # the NHWC rows backward.py hands it
    spec = ActGradSpec(z, z, z, act, SLOPE, TensorSpec((1, N, 1, 1), (N, 1, N, N), "float32"))
    dy, src = strided(z, gen), strided(z, gen)
    got = run_ir(build_graph(spec), {"dy": dy, "src": src})
    dz = _act_grad(src, dy, act, SLOPE)
    close(got["dz"], dz, "float32", "dz")
    close(got["dbias"], dz.sum((0, 2, 3), keepdim=True), "float32", "dbias")


def test_relu_grad_from_the_saved_output_is_the_grad_from_z():
    """ReLU's backward reads y (the forward's output) in place of z: the same mask."""
    gen = torch.Generator().manual_seed(6)
    z = TensorSpec.contiguous((1, 8, 16), "float32")
    zt, dy = strided(z, gen), strided(z, gen)
    got = run_ir(build_graph(ActGradSpec(z, z, z, "relu")), {"dy": dy, "src": F.relu(zt)})
    close(got["dz"], _act_grad(zt, dy, "relu", 0.01), "float32", "dz")


# ------------------------------------------------------------------ attention


def _bhsd(B, H, S, D, layout, dtype):
    if layout == "bshd":
        return TensorSpec((B, H, S, D), (S * H * D, D, H * D, 1), dtype)
    return TensorSpec.contiguous((B, H, S, D), dtype)


SDPA_CASES = [
    # (Hq, Hkv, Sq, Skv, causal, bias shape or None, scale)
    (4, 4, 6, 6, False, None, 0.125),
    (4, 2, 5, 9, True, None, 0.3),  # GQA, causal with Sq < Skv (top-left, as torch)
    (4, 1, 9, 5, True, None, 1.0),  # MQA, causal with Sq > Skv
    (4, 2, 6, 7, False, (2, 4), 0.25),  # a [B, H] bias
    (2, 2, 6, 7, False, (1, 1), 0.5),  # a bias broadcast over batch and heads
]


def _sdpa_inputs(Hq, Hkv, Sq, Skv, bias_bh, layout, dtype, B=2, D=8):
    q, o = _bhsd(B, Hq, Sq, D, layout, dtype), _bhsd(B, Hq, Sq, D, layout, dtype)
    k, v = _bhsd(B, Hkv, Skv, D, layout, dtype), _bhsd(B, Hkv, Skv, D, layout, dtype)
    bias = TensorSpec.contiguous(bias_bh + (Sq, Skv), dtype) if bias_bh else None
    return q, k, v, o, bias


def _torch_sdpa(t, causal, scale):
    """reference.scaled_dot_product_attention in float64 (its own GQA handling)."""
    mask = t["bias"].to(W) if "bias" in t else None
    return reference.scaled_dot_product_attention(t["q"].to(W), t["k"].to(W), t["v"].to(W), mask, 0.0, causal, scale,
                                                  enable_gqa=True)


@pytest.mark.parametrize("case", SDPA_CASES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("train", [False, True])
def test_sdpa_forward_computes_the_reference(case, layout, train):
    Hq, Hkv, Sq, Skv, causal, bias_bh, scale = case
    q, k, v, o, bias = _sdpa_inputs(Hq, Hkv, Sq, Skv, bias_bh, layout, "float32")
    if train:
        spec = SdpaTrainSpec(q, k, v, o, TensorSpec.contiguous(q.shape[:3] + (1,), "float32"), bias, causal, scale)
    else:
        spec = SdpaSpec(q, k, v, o, bias, causal, scale)
    gen = torch.Generator().manual_seed(7)
    g, t = inputs_of(spec, gen)
    got = run_ir(g, t)
    close(got["o"], _torch_sdpa(t, causal, scale), "float32", "o")
    assert ("stats" in got) is train


@pytest.mark.parametrize("case", SDPA_CASES)
def test_sdpa_backward_computes_the_reference_gradients(case):
    Hq, Hkv, Sq, Skv, causal, bias_bh, scale = case
    q, k, v, o, bias = _sdpa_inputs(Hq, Hkv, Sq, Skv, bias_bh, "bshd", "float32")
    stats = TensorSpec.contiguous(q.shape[:3] + (1,), "float32")
    gen = torch.Generator().manual_seed(8)
    fwd = SdpaTrainSpec(q, k, v, o, stats, bias, causal, scale)
    g, t = inputs_of(fwd, gen)
    out = run_ir(g, t)  # o and stats from the training forward's own graph
    do = strided(o, gen)
    spec = SdpaBwdSpec(q, k, v, o, o, stats, q, k, v, bias, causal, scale)
    feeds = dict(t, o=out["o"].to(torch.float32), do=do, stats=out["stats"].to(torch.float32))
    got = run_ir(build_graph(spec), feeds)
    leaves = {r: t[r].to(W).requires_grad_() for r in ("q", "k", "v")}
    with torch.enable_grad():
        ref_o = _torch_sdpa(dict(t, **leaves), causal, scale)
        grads = torch.autograd.grad(ref_o, tuple(leaves.values()), do.to(W))
    for r, want in zip(("dq", "dk", "dv"), grads):
        close(got[r], want, "float32", r)
