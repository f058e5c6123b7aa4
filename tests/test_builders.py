"""Builders, checked on the pygraph IR (``g.inspect()`` needs no GPU).

Specs are made with spec.py's public helpers (TensorSpec.of / .contiguous, the stride helpers),
the way ops.py makes them.
"""

import itertools
import json

import cudnn
import pytest
import torch

from cudnn_fuse.builders import UIDS, build_graph, roles_of, uids_of
from cudnn_fuse.spec import (
    ConvSpec,
    Epilogue,
    MatmulSpec,
    SaveZSpec,
    SdpaSpec,
    TensorSpec,
    channels_last_strides,
    contiguous_strides,
)

DT = {"float16": cudnn.data_type.HALF, "bfloat16": cudnn.data_type.BFLOAT16, "float32": cudnn.data_type.FLOAT}
ACTS = ["relu", "gelu", "gelu_tanh", "silu", "tanh", "sigmoid", "leaky_relu"]

# The cuDNN pointwise mode each activation must become, with its extra params.
MODES = {
    "relu": ("relu", {}),
    "gelu": ("gelu", {}),
    "gelu_tanh": ("gelu_approx_tanh", {}),
    "silu": ("swish", {"swish_beta": 1.0}),
    "tanh": ("tanh", {}),
    "sigmoid": ("sigmoid", {}),
    "leaky_relu": ("leaky_relu", {"negative_slope": 0.25}),
}


def ir(spec):
    d = build_graph(spec).inspect()
    assert set(d) >= {"nodes", "tensors", "context"}
    return d


def dt(name):
    return str(DT[name])


def _epilogue(out_shape, bias_spec, dtype, bias, residual, act, amax, residual_spec=None):
    return Epilogue(
        bias=bias_spec if bias else None,
        residual=(residual_spec or TensorSpec.contiguous(out_shape, dtype)) if residual else None,
        activation=act, negative_slope=0.25, amax=amax)


def conv_spec(dtype="float16", layout="nchw", bias=False, residual=False, act=None, amax=False,
              stride=(1, 1), pre=(1, 1), post=(1, 1), dilation=(1, 1), groups=1):
    N, C, H, W, K = 2, 4, 10, 12, 8
    x = torch.empty(N, C, H, W, device="meta")
    w = torch.empty(K, C // groups, 3, 3, device="meta")
    if layout == "nhwc":
        x, w = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
    P = (H + pre[0] + post[0] - dilation[0] * 2 - 1) // stride[0] + 1
    Q = (W + pre[1] + post[1] - dilation[1] * 2 - 1) // stride[1] + 1
    out = (N, K, P, Q)
    ystride = channels_last_strides(out) if layout == "nhwc" else contiguous_strides(out)
    xs, ws = TensorSpec.of(x), TensorSpec.of(w)
    xs, ws = TensorSpec(xs.shape, xs.stride, dtype), TensorSpec(ws.shape, ws.stride, dtype)
    epi = _epilogue(out, TensorSpec((1, K, 1, 1), (K, 1, K, K), dtype), dtype, bias, residual, act, amax,
                    TensorSpec(out, ystride, dtype))
    return ConvSpec(xs, ws, TensorSpec(out, ystride, dtype), stride, pre, post, dilation, groups, epi)


def check_operands(d, spec, operands):
    """Every (role, TensorSpec) is a non-virtual graph tensor with its dims, strides, dtype and fixed uid."""
    tensors = d["tensors"]
    for role, t in operands.items():
        assert role in tensors, role
        got = tensors[role]
        assert got["dim"] == list(t.shape), role
        assert got["stride"] == list(t.stride), role
        assert got["uid"] == UIDS[role], role
        assert got["dtype"] == dt(t.dtype), role
        assert got["is_virtual"] is False, role


def check_plumbing(d, spec):
    """The graph's real tensors are exactly the buffers Plan.run feeds (roles_of), with those uids."""
    tensors = d["tensors"]
    real = {name for name, t in tensors.items() if not t["is_virtual"]}
    roles = roles_of(spec)
    assert real == set(roles)
    assert len(roles) == len(set(roles))
    assert uids_of(spec) == tuple(tensors[r]["uid"] for r in roles)
    uids = [t["uid"] for t in tensors.values()]
    assert len(uids) == len(set(uids)), f"two graph tensors share a uid: {uids}"


# --------------------------------------------------------------------- conv


EPILOGUES = [dict(bias=b, residual=r, act=a, amax=m)
             for b, r, a, m in itertools.product([False, True], [False, True], [None] + ACTS, [False, True])]


@pytest.mark.parametrize("epi", EPILOGUES, ids=lambda e: "-".join(f"{k}={v}" for k, v in e.items()))
def test_conv_nodes_in_order_with_their_modes(epi):
    spec = conv_spec(**epi)
    d = ir(spec)
    nodes = d["nodes"]
    expected = ["CONV_FPROP"] + ["POINTWISE"] * (epi["bias"] + epi["residual"] + (epi["act"] is not None)) \
        + ["REDUCTION"] * epi["amax"]
    assert [n["type"] for n in nodes] == expected

    conv, rest = nodes[0], nodes[1:]
    assert set(conv["inputs"].values()) == {"x", "w"}
    prev = next(iter(conv["outputs"].values()))
    if epi["bias"]:
        node, rest = rest[0], rest[1:]
        assert node["params"]["mode"] == "add" and set(node["inputs"].values()) == {prev, "bias"}
        prev = next(iter(node["outputs"].values()))
    if epi["residual"]:
        node, rest = rest[0], rest[1:]
        assert node["params"]["mode"] == "add" and set(node["inputs"].values()) == {prev, "residual"}
        prev = next(iter(node["outputs"].values()))
    if epi["act"] is not None:
        node, rest = rest[0], rest[1:]
        mode, extra = MODES[epi["act"]]
        assert node["params"] == {"mode": mode, **extra}
        assert list(node["inputs"].values()) == [prev]
        prev = next(iter(node["outputs"].values()))
    assert prev == "y", "the last pointwise node (or the conv) writes y"
    if epi["amax"]:
        (node,) = rest
        assert node["params"]["mode"] == cudnn.reduction_mode.AMAX
        assert list(node["inputs"].values()) == ["y"] and list(node["outputs"].values()) == ["amax"]
    check_plumbing(d, spec)


@pytest.mark.parametrize("geo", [
    dict(stride=(1, 1), pre=(1, 1), post=(1, 1), dilation=(1, 1)),
    dict(stride=(2, 3), pre=(0, 2), post=(1, 0), dilation=(1, 2)),
    dict(stride=(1, 2), pre=(2, 1), post=(2, 1), dilation=(3, 1), groups=2),
])
def test_conv_params(geo):
    spec = conv_spec(**geo)
    conv = ir(spec)["nodes"][0]
    assert conv["params"]["stride"] == list(geo["stride"])
    assert conv["params"]["pre_padding"] == list(geo["pre"])
    assert conv["params"]["post_padding"] == list(geo["post"])
    assert conv["params"]["dilation"] == list(geo["dilation"])


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_conv_tensors_dims_strides_uids(layout, dtype):
    spec = conv_spec(dtype, layout, bias=True, residual=True, act="relu", amax=True)
    d = ir(spec)
    assert d["context"]["io_data_type"] == dt(dtype)
    assert d["context"]["compute_data_type"] == str(cudnn.data_type.FLOAT)
    epi = spec.epilogue
    check_operands(d, spec, {"x": spec.x, "w": spec.w, "bias": epi.bias, "residual": epi.residual, "y": spec.y})
    y = d["tensors"]["y"]
    expect = channels_last_strides(spec.y.shape) if layout == "nhwc" else contiguous_strides(spec.y.shape)
    assert y["stride"] == list(expect), "the output keeps the spec's layout"
    amax = d["tensors"]["amax"]
    assert amax["dim"] == [1, 1, 1, 1] and all(s == 1 for s in amax["stride"])
    assert amax["dtype"] == dt("float32") and amax["uid"] == UIDS["amax"] and amax["is_virtual"] is False
    check_plumbing(d, spec)
    assert roles_of(spec) == ("x", "w", "bias", "residual", "y", "amax")


@pytest.mark.parametrize("bias, residual, amax", list(itertools.product([False, True], repeat=3)))
def test_uids_of_follows_roles_order(bias, residual, amax):
    for spec in (conv_spec(bias=bias, residual=residual, amax=amax), matmul_spec(bias=bias, residual=residual,
                                                                                 amax=amax)):
        roles = roles_of(spec)
        main = ("x", "w") if isinstance(spec, ConvSpec) else ("a", "b")
        assert roles == main + ("bias",) * bias + ("residual",) * residual + ("y",) + ("amax",) * amax
        assert uids_of(spec) == tuple(UIDS[r] for r in roles)
        check_plumbing(ir(spec), spec)


def test_fixed_uids_do_not_collide_within_a_family():
    for family in (("x", "w", "bias", "residual", "y", "amax"), ("a", "b", "bias", "residual", "y", "amax"),
                   ("q", "k", "v", "bias", "o")):
        uids = [UIDS[r] for r in family]
        assert len(set(uids)) == len(uids), family


# ------------------------------------------------------------------- matmul


def matmul_spec(dtype="bfloat16", bias=False, residual=False, act=None, amax=False, a=None, b=None):
    B, M, K, N = 3, 16, 32, 24
    a = a if a is not None else TensorSpec.contiguous((B, M, K), dtype)
    b = b if b is not None else TensorSpec.contiguous((1, K, N), dtype)
    y = (max(a.shape[0], b.shape[0]), a.shape[1], b.shape[2])
    N = y[2]
    epi = _epilogue(y, TensorSpec((1, 1, N), (N, N, 1), dtype), dtype, bias, residual, act, amax)
    return MatmulSpec(a, b, TensorSpec.contiguous(y, dtype), epi)


@pytest.mark.parametrize("act", [None] + ACTS)
def test_matmul_nodes_and_activation_modes(act):
    spec = matmul_spec(bias=True, act=act, amax=True)
    d = ir(spec)
    types = [n["type"] for n in d["nodes"]]
    assert types == ["MATMUL", "POINTWISE"] + ["POINTWISE"] * (act is not None) + ["REDUCTION"]
    assert set(d["nodes"][0]["inputs"].values()) == {"a", "b"}
    if act is not None:
        mode, extra = MODES[act]
        assert d["nodes"][2]["params"] == {"mode": mode, **extra}
    check_plumbing(d, spec)


def test_matmul_linear_weight_view_strides():
    N, K, rows = 24, 32, 10
    w = torch.empty(N, K, dtype=torch.float16, device="meta")
    x = torch.empty(rows, K, dtype=torch.float16, device="meta")
    b_view = w.t().unsqueeze(0)  # how linear hands its [out, in] weight to matmul: no copy
    assert b_view.stride() == (K, 1, K)
    spec = matmul_spec("float16", bias=True, residual=True, a=TensorSpec.of(x.reshape(1, rows, K)),
                       b=TensorSpec.of(b_view))
    d = ir(spec)
    assert d["tensors"]["b"]["dim"] == [1, K, N]
    assert d["tensors"]["b"]["stride"] == [K, 1, K]
    assert d["tensors"]["a"]["dim"] == [1, rows, K] and d["tensors"]["a"]["stride"] == [rows * K, K, 1]
    assert d["tensors"]["bias"]["dim"] == [1, 1, N]
    check_operands(d, spec, {"a": spec.a, "b": spec.b, "bias": spec.epilogue.bias,
                             "residual": spec.epilogue.residual, "y": spec.y})
    assert d["tensors"]["y"]["dim"] == [1, rows, N]
    check_plumbing(d, spec)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_matmul_batched_broadcast_operands(dtype):
    a = TensorSpec.contiguous((1, 5, 7), dtype)  # broadcast A
    b = TensorSpec.of(torch.empty(4, 6, 7, device="meta").transpose(1, 2))  # column-major B
    b = TensorSpec(b.shape, b.stride, dtype)
    spec = matmul_spec(dtype, residual=True, amax=True, a=a, b=b)
    d = ir(spec)
    assert d["context"]["io_data_type"] == dt(dtype)
    check_operands(d, spec, {"a": a, "b": b, "residual": spec.epilogue.residual, "y": spec.y})
    assert d["tensors"]["y"]["dim"] == [4, 5, 6]
    assert d["tensors"]["amax"]["dim"] == [1, 1, 1] and d["tensors"]["amax"]["dtype"] == dt("float32")
    check_plumbing(d, spec)


# --------------------------------------------------------------------- sdpa


def _bhsd(B, H, S, D, layout, dtype):
    """A [B, H, S, D] view: BHSD-contiguous memory, or BSHD memory transposed."""
    t = torch.empty(B, S, H, D, device="meta").transpose(1, 2) if layout == "bshd" else \
        torch.empty(B, H, S, D, device="meta")
    s = TensorSpec.of(t)
    return TensorSpec(s.shape, s.stride, dtype)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("causal, bias", [(False, False), (True, False), (False, True)])
def test_sdpa_node_params_and_tensors(layout, dtype, causal, bias):
    B, Hq, Hkv, Sq, Skv, D = 2, 8, 2, 16, 40, 64
    q = _bhsd(B, Hq, Sq, D, layout, dtype)
    k = _bhsd(B, Hkv, Skv, D, layout, dtype)
    v = _bhsd(B, Hkv, Skv, D, layout, dtype)
    o = _bhsd(B, Hq, Sq, D, layout, dtype)
    bias_spec = TensorSpec.contiguous((1, Hq, Sq, Skv), dtype) if bias else None
    spec = SdpaSpec(q, k, v, o, bias_spec, causal, 0.0625)
    d = ir(spec)
    assert d["context"]["io_data_type"] == dt(dtype)
    (node,) = d["nodes"]
    assert node["type"] == "SDPA"
    assert node["params"]["attn_scale"] == 0.0625
    assert node["params"]["use_causal_mask"] is causal
    assert node["params"]["generate_stats"] is False
    assert ("bias" in node["inputs"].values()) is bias
    assert list(node["outputs"].values()) == ["o"]
    operands = {"q": q, "k": k, "v": v, "o": o}
    if bias:
        operands["bias"] = bias_spec
    check_operands(d, spec, operands)
    expect_o = [Sq * Hq * D, D, Hq * D, 1] if layout == "bshd" else [Hq * Sq * D, Sq * D, D, 1]
    assert d["tensors"]["o"]["stride"] == expect_o
    assert roles_of(spec) == ("q", "k", "v") + ("bias",) * bias + ("o",)
    check_plumbing(d, spec)


def test_sdpa_scale_is_passed_through_not_recomputed():
    q = TensorSpec.contiguous((1, 2, 8, 32), "float16")
    for scale in (1.0, 0.3, 2.5):
        node = ir(SdpaSpec(q, q, q, q, None, False, scale))["nodes"][0]
        assert node["params"]["attn_scale"] == pytest.approx(scale)


# ------------------------------------------------------------------- keep-z forward


@pytest.mark.parametrize("amax", [False, True])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("fwd_kind", ["matmul", "conv"])
def test_save_z_graph_writes_z_and_y_as_two_tensors_with_their_uids(fwd_kind, act, amax):
    """The keep-z graph's real tensors are exactly roles_of's (z with its own uid, beside y)."""
    make = matmul_spec if fwd_kind == "matmul" else conv_spec
    fwd = make(bias=True, residual=True, act=act, amax=amax)
    spec = SaveZSpec(fwd, fwd.y)
    d = ir(spec)
    assert roles_of(spec)[-1] == "z"
    check_plumbing(d, spec)
    assert d["tensors"]["z"]["uid"] == UIDS["z"] != d["tensors"]["y"]["uid"]


@pytest.mark.parametrize("fwd_kind", ["matmul", "conv"])
def test_save_z_without_an_activation_is_refused_when_the_spec_is_made(fwd_kind):
    """With no activation z is y: the graph would mark its one tensor as both and have no tensor with
    z's uid (its buffers would not match uids_of). The spec refuses it, naming the field."""
    make = matmul_spec if fwd_kind == "matmul" else conv_spec
    for amax in (False, True):
        fwd = make(bias=True, act=None, amax=amax)
        with pytest.raises(ValueError, match=r"save_z: fwd\.epilogue\.activation must be one of .*got None"):
            SaveZSpec(fwd, fwd.y)


def test_save_z_of_an_attention_forward_is_refused_when_the_spec_is_made():
    q = TensorSpec.contiguous((1, 2, 8, 32), "float16")
    with pytest.raises(ValueError, match="save_z: fwd must be a ConvSpec or MatmulSpec, got SdpaSpec"):
        SaveZSpec(SdpaSpec(q, q, q, q, None, False, 0.5), q)


def test_a_manifest_save_z_entry_without_an_activation_names_the_entry():
    from cudnn_fuse import manifest

    doc = {"schema": manifest.SCHEMA, "version": manifest.VERSION}
    fwd = matmul_spec(bias=True, act="gelu")
    d = json.loads(SaveZSpec(fwd, fwd.y).canonical_json())
    assert manifest.parse({**doc, "entries": [{"spec": d}]})[0].spec.op == "save_z"
    d["fwd"]["epilogue"]["activation"] = None
    with pytest.raises(manifest.ManifestError, match=r"entries\[0\]\.spec is not a valid op spec: save_z: "
                                                      r"fwd\.epilogue\.activation"):
        manifest.parse({**doc, "entries": [{"spec": d}]})
