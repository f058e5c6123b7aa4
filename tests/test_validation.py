"""Invalid arguments raise cf.ArgumentError (values, shapes: a ValueError and a RuntimeError, as torch's
own errors for bad calls are) or TypeError (types), naming the argument. Dtypes the fused ops do not take
run torch's own expression: torch's result where torch computes one, torch's own error where it refuses.

Each case is (op, arguments, expected exception, regex the message must match, whether torch's own
function also rejects the same arguments). The last column checks the contract's "exactly where torch
would": cudnn_fuse must not reject what torch accepts for these shapes.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import cudnn_fuse as cf
from tests.memo_paths import PATHS, NoOpPlan, on_memo_path

f32, f64 = torch.float32, torch.float64
AE = cf.ArgumentError


def T(*shape, dtype=f32):
    return torch.zeros(shape, dtype=dtype)


# ------------------------------------------------------------------- conv2d

X, W = (2, 4, 8, 8), (6, 4, 3, 3)


def conv(x=X, w=W, **kw):
    """Arguments of a conv2d call; shapes are turned into float32 tensors."""
    x = T(*x) if isinstance(x, tuple) else x
    w = T(*w) if isinstance(w, tuple) else w
    return (x, w), kw


CONV_CASES = {
    # shapes
    "channels": (conv(w=(6, 3, 3, 3)), AE, r"channel mismatch: x has C=4", True),
    "groups_not_dividing_C": (conv(x=(2, 6, 8, 8), w=(6, 3, 3, 3), groups=4), AE, r"C=6 .*C/groups\*groups=3\*4=12", True),
    "K_mod_groups": (conv(w=(5, 2, 3, 3), groups=2), AE, r"K=5 .*groups=2", True),
    "x_rank": (conv(x=(1, 2, 4, 8, 8)), AE, r"x\.shape=\(1, 2, 4, 8, 8\)", True),
    "weight_rank": (conv(w=(6, 4, 3)), AE, r"weight\.shape=\(6, 4, 3\)", True),
    "kernel_zero": (conv(w=(6, 4, 0, 3)), AE, r"kernel of positive size.*weight\.shape=\(6, 4, 0, 3\)", True),
    "out_channels_zero": (conv(w=(0, 4, 3, 3)), AE, r"weight\.shape=\(0, 4, 3, 3\)", True),
    "bias_len": (conv(bias=T(5)), AE, r"bias.*\(6,\).*bias\.shape=\(5,\)", True),
    "bias_rank": (conv(bias=T(6, 1)), AE, r"bias\.shape=\(6, 1\)", True),
    "residual_shape": (conv(residual=T(2, 6, 8, 8)), AE, r"residual.*\(2, 6, 6, 6\).*residual\.shape", None),
    "residual_bigger": (conv(residual=T(2, 6, 6, 6, 1)), AE, r"residual.*\(2, 6, 6, 6\).*\(2, 6, 6, 6, 1\)", None),
    "residual_unbatched": (conv(x=(4, 8, 8), residual=T(1, 6, 6, 6)), AE, r"residual\.shape=\(1, 6, 6, 6\)",
                           None),
    "output_too_small": (conv(x=(2, 4, 2, 8)), AE, r"output size.*x\.shape=\(2, 4, 2, 8\)", True),
    "output_too_small_dilation": (conv(x=(2, 4, 5, 5), dilation=3), AE, r"output size.*dilation", True),
    # dtypes and types
    "x_not_tensor": (conv(x=np.zeros(X, np.float32)), TypeError, r"\bx must be a torch\.Tensor", True),
    "x_list": (conv(x=[[1.0]]), TypeError, r"\bx must be a torch\.Tensor", True),
    "weight_not_tensor": (conv(w=3.0), TypeError, r"weight must be a torch\.Tensor", True),
    "bias_not_tensor": (conv(bias=[0.0] * 6), TypeError, r"bias must be a torch\.Tensor", True),
    "residual_not_tensor": (conv(residual=1.0), TypeError, r"residual must be a torch\.Tensor", None),
    "activation": (conv(activation="swish"), AE, r"activation.*'swish'", None),
    # stride / padding / dilation / groups
    "stride_0": (conv(stride=0), AE, r"stride.*stride=\(0, 0\)", True),
    "stride_negative": (conv(stride=(1, -2)), AE, r"stride.*\(1, -2\)", True),
    "stride_float": (conv(stride=1.5), TypeError, r"stride must be an int or a pair", True),
    "stride_str": (conv(stride="1"), TypeError, r"stride must be", True),
    "stride_triple": (conv(stride=(1, 1, 1)), TypeError, r"stride must be", True),
    "stride_pair_of_floats": (conv(stride=(1.0, 1.0)), TypeError, r"stride must be", True),
    "padding_negative": (conv(padding=-1), AE, r"padding.*padding=\(-1, -1\)", True),
    "padding_pair_negative": (conv(padding=(0, -3)), AE, r"padding", True),
    "padding_float": (conv(padding=0.5), TypeError, r"padding must be an int or a pair", True),
    "padding_string": (conv(padding="full"), AE, r"padding.*'full'", True),
    "padding_same_strided": (conv(padding="same", stride=2), AE, r"padding='same'.*stride=\(2, 2\)", True),
    "padding_same_strided_w": (conv(padding="same", stride=(1, 2)), AE, r"padding='same'.*stride", True),
    "dilation_0": (conv(dilation=0), AE, r"dilation.*dilation=\(0, 0\)", True),
    "dilation_negative": (conv(dilation=(-1, 1)), AE, r"dilation", True),
    "dilation_str": (conv(dilation="2"), TypeError, r"dilation must be", True),
    "groups_0": (conv(groups=0), AE, r"groups.*groups=0", True),
    "groups_negative": (conv(groups=-2), AE, r"groups=-2", True),
}


# ------------------------------------------------------------------- linear

def lin(x=(3, 5), w=(4, 5), **kw):
    x = T(*x) if isinstance(x, tuple) else x
    w = T(*w) if isinstance(w, tuple) else w
    return (x, w), kw


LINEAR_CASES = {
    "in_features": (lin(w=(4, 6)), AE, r"in_features=5 .*weight\.shape=\(4, 6\)", True),
    "weight_3d": (lin(w=(1, 4, 5)), AE, r"weight must be 2-D.*\(1, 4, 5\)", True),
    "weight_1d": (lin(w=(5,)), AE, r"weight must be 2-D", False),  # torch's 1-D weight: see contract
    "x_0dim": (lin(x=()), AE, r"\bx needs at least 1 dimension", True),
    "bias_len": (lin(bias=T(5)), AE, r"bias.*\(4,\).*bias\.shape=\(5,\)", True),
    "bias_rank": (lin(bias=T(1, 4)), AE, r"bias\.shape=\(1, 4\)", False),  # torch broadcasts it
    "residual_bigger": (lin(residual=T(2, 3, 4)), AE, r"residual.*\(3, 4\).*residual\.shape=\(2, 3, 4\)", None),
    "residual_shape": (lin(residual=T(3, 5)), AE, r"residual.*\(3, 4\).*residual\.shape=\(3, 5\)", None),
    "x_not_tensor": (lin(x=np.zeros((3, 5), np.float32)), TypeError, r"\bx must be a torch\.Tensor", True),
    "weight_not_tensor": (lin(w=[[0.0] * 5] * 4), TypeError, r"weight must be a torch\.Tensor", True),
    "bias_not_tensor": (lin(bias=0.0), TypeError, r"bias must be a torch\.Tensor", True),
    "activation": (lin(activation="mish"), AE, r"activation.*'mish'", None),
}


# ------------------------------------------------------------------- matmul

def mm(a=(2, 3, 4), b=(2, 4, 5), **kw):
    a = T(*a) if isinstance(a, tuple) else a
    b = T(*b) if isinstance(b, tuple) else b
    return (a, b), kw


MATMUL_CASES = {
    "inner_dims": (mm(b=(2, 6, 5)), AE, r"inner dimensions.*a\.shape=\(2, 3, 4\).*b\.shape=\(2, 6, 5\)", True),
    "inner_dims_1d": (mm(a=(4,), b=(5,)), AE, r"inner dimensions.*K=4 vs 5", True),
    "inner_dims_1d_2d": (mm(a=(3,), b=(4, 5)), AE, r"inner dimensions", True),
    "batch_broadcast": (mm(a=(2, 3, 4), b=(3, 4, 5)), AE, r"batch dimensions.*a\.shape=\(2, 3, 4\)", True),
    "batch_broadcast_4d": (mm(a=(2, 2, 3, 4), b=(3, 1, 4, 5)), AE, r"batch dimensions", True),
    "a_0dim": (mm(a=()), AE, r"at least 1 dimension.*a\.shape=\(\)", True),
    "b_0dim": (mm(b=()), AE, r"at least 1 dimension.*b\.shape=\(\)", True),
    "bias_len": (mm(bias=T(4)), AE, r"bias.*\(5,\).*bias\.shape=\(4,\)", None),
    "bias_with_1d_b": (mm(b=(4,), bias=T(1)), AE, r"bias needs a 2-D or batched b", None),
    "residual_shape": (mm(residual=T(2, 3, 4)), AE, r"residual.*\(2, 3, 5\).*residual\.shape=\(2, 3, 4\)", None),
    "residual_bigger": (mm(residual=T(3, 2, 3, 5)), AE, r"residual.*\(2, 3, 5\).*residual\.shape=\(3, 2, 3, 5\)", None),
    "residual_bigger_rows": (mm(residual=T(2, 4, 5)), AE, r"residual\.shape=\(2, 4, 5\)", None),
    "a_not_tensor": (mm(a=np.zeros((2, 3, 4))), TypeError, r"\ba must be a torch\.Tensor", True),
    "b_not_tensor": (mm(b=2.0), TypeError, r"\bb must be a torch\.Tensor", True),
    "residual_not_tensor": (mm(residual="r"), TypeError, r"residual must be a torch\.Tensor", None),
    "activation": (mm(activation="elu"), AE, r"activation.*'elu'", None),
}


# ---------------------------------------------------------------------- sdpa

Q, KV = (2, 4, 6, 8), (2, 4, 10, 8)


def att(q=Q, k=KV, v=KV, **kw):
    q, k, v = (T(*t) if isinstance(t, tuple) else t for t in (q, k, v))
    return (q, k, v), kw


SDPA_CASES = {
    "head_dim": (att(k=(2, 4, 10, 7)), AE, r"query and key head dims differ.*key\.shape=\(2, 4, 10, 7\)", True),
    "kv_lengths": (att(v=(2, 4, 9, 8)), AE, r"key and value sequence lengths.*value\.shape=\(2, 4, 9, 8\)",
                   None),  # torch 2.13's CPU kernel does not check this one (it returns a result)
    "rank": (att(k=(3, 10, 8), v=(3, 10, 8)), AE, r"query has 4 heads and key/value 3", True),
    "rank_1": (att(q=(8,), k=(8,), v=(8,)), AE, r"rank >= 2", True),
    "heads_without_gqa": (att(k=(2, 2, 10, 8), v=(2, 2, 10, 8)), AE, r"4 heads.*2.*enable_gqa=True", True),
    "heads_not_divisible": (att(k=(2, 3, 10, 8), v=(2, 3, 10, 8), enable_gqa=True), AE,
                            r"enable_gqa=True and 4 divisible by 3", True),
    "kv_heads_differ": (att(k=(2, 2, 10, 8), enable_gqa=True), AE, r"key has 2 heads but value has 4",
                        None),  # unchecked by torch's CPU kernel
    "batch": (att(k=(3, 4, 10, 8), v=(3, 4, 10, 8)), AE, r"batch dims do not broadcast.*key\.shape=\(3, 4, 10, 8\)",
              True),
    "dropout_negative": (att(dropout_p=-0.1), AE, r"dropout_p.*-0\.1", None),
    "dropout_one": (att(dropout_p=1.0), AE, r"dropout_p=1\.0", None),
    "dropout_big": (att(dropout_p=2.0), AE, r"dropout_p=2\.0", None),
    "mask_int": (att(attn_mask=T(6, 10, dtype=torch.int64)), TypeError, r"attn_mask must be bool.*torch\.int64", True),
    "mask_other_float": (att(attn_mask=T(6, 10, dtype=f64)), TypeError, r"attn_mask.*torch\.float64", True),
    "mask_shape": (att(attn_mask=T(6, 11, dtype=torch.bool)), AE, r"attn_mask\.shape=\(6, 11\)", True),
    "mask_too_big": (att(attn_mask=T(3, 4, 6, 10)), AE, r"attn_mask\.shape=\(3, 4, 6, 10\)", True),
    "mask_not_tensor": (att(attn_mask=[[True] * 10] * 6), TypeError, r"attn_mask must be a torch\.Tensor", True),
    "integer_query": (att(q=T(*Q, dtype=torch.int32), k=T(*KV, dtype=torch.int32), v=T(*KV, dtype=torch.int32)),
                      TypeError, r"query must have a floating", True),
    "key_dtype": (att(k=T(*KV, dtype=f64)), TypeError, r"key has dtype torch\.float64", True),
    "value_dtype": (att(v=T(*KV, dtype=torch.float16)), TypeError, r"value has dtype torch\.float16", True),
    "query_not_tensor": (att(q=np.zeros(Q, np.float32)), TypeError, r"query must be a torch\.Tensor", True),
    "key_not_tensor": (att(k=None), TypeError, r"key must be a torch\.Tensor", True),
    "value_not_tensor": (att(v=1.0), TypeError, r"value must be a torch\.Tensor", True),
    "scale_str": (att(scale="0.5"), TypeError, r"scale must be a float", True),
}


OPS = {
    "conv2d": (cf.conv2d, CONV_CASES),
    "linear": (cf.linear, LINEAR_CASES),
    "matmul": (cf.matmul, MATMUL_CASES),
    "scaled_dot_product_attention": (cf.scaled_dot_product_attention, SDPA_CASES),
}

_TORCH = {
    "conv2d": lambda x, w, bias=None, stride=1, padding=0, dilation=1, groups=1, **_: F.conv2d(
        x, w, bias, stride, padding, dilation, groups),
    "linear": lambda x, w, bias=None, **_: F.linear(x, w, bias),
    "matmul": lambda a, b, **_: torch.matmul(a, b),
    "scaled_dot_product_attention": lambda q, k, v, **kw: F.scaled_dot_product_attention(q, k, v, **kw),
}

CASES = [pytest.param(op, *case, id=f"{op}-{name}") for op, (_, table) in OPS.items() for name, case in table.items()]


@pytest.mark.parametrize("op, call, exc, match, torch_rejects", CASES)
def test_invalid_arguments_raise_the_right_type_naming_the_argument(op, call, exc, match, torch_rejects):
    fn = OPS[op][0]
    args, kwargs = call
    with pytest.raises(exc, match=match) as info:
        fn(*args, **kwargs)
    assert type(info.value) is exc  # not a subclass someone catches differently
    assert str(info.value).startswith(f"{op}: "), "messages start with the op's name"


@pytest.mark.parametrize("op, call, exc, match, torch_rejects",
                         [c for c in CASES if c.values[4] is not None])
def test_cudnn_fuse_rejects_exactly_what_torch_rejects(op, call, exc, match, torch_rejects):
    args, kwargs = call
    if torch_rejects:
        with pytest.raises((RuntimeError, ValueError, TypeError, IndexError)):
            _TORCH[op](*args, **kwargs)
    else:
        _TORCH[op](*args, **kwargs)  # torch accepts it; cudnn_fuse rejects it on purpose (contract)


# The same geometries, made valid: the validation must let them through (no over-eager checks).
VALID = [
    ("conv2d", conv(groups=2, w=(6, 2, 3, 3), bias=T(6), residual=T(2, 6, 6, 6), stride=(1, 1), dilation=[1, 1])),
    ("conv2d", conv(x=(4, 8, 8), padding="same", dilation=(2, 1), residual=T(6, 8, 8))),
    ("conv2d", conv(x=(2, 4, 3, 3), padding="valid", stride=(2, 3))),
    ("conv2d", conv(x=(0, 4, 8, 8), padding=(1, 0))),
    ("linear", lin(x=(2, 0, 5), bias=T(4), residual=T(2, 0, 4))),
    ("linear", lin(x=(5,), w=(0, 5), bias=T(0))),
    ("matmul", mm(a=(4,), b=(4,), residual=T())),
    ("matmul", mm(a=(2, 1, 3, 4), b=(5, 4, 6), bias=T(6), residual=T(2, 5, 3, 6))),
    ("matmul", mm(a=(7, 3, 0), b=(0, 5))),
    ("scaled_dot_product_attention", att(k=(2, 2, 10, 8), v=(2, 2, 10, 5), enable_gqa=True)),
    ("scaled_dot_product_attention", att(attn_mask=T(1, 4, 1, 10), scale=1)),
    ("scaled_dot_product_attention", att(q=(6, 8), k=(10, 8), v=(10, 8), attn_mask=T(10, dtype=torch.bool))),
]


@pytest.mark.parametrize("op, call", VALID, ids=[f"{op}-{i}" for i, (op, _) in enumerate(VALID)])
def test_valid_arguments_pass_validation_with_torch_shapes(op, call):
    args, kwargs = call
    out = OPS[op][0](*args, **kwargs)
    ref_kwargs = {k: v for k, v in kwargs.items() if k not in ("residual",)}
    expected = _TORCH[op](*args, **ref_kwargs)
    assert out.shape == expected.shape


# ----------------------------------------------------------- library bugs


@pytest.mark.parametrize("mask", [torch.tensor([True, False, True, True]), torch.randn(4), torch.tensor(True)],
                         ids=["bool-S", "float-S", "one-value"])
@pytest.mark.parametrize("causal", [False, True])
def test_an_attn_mask_of_fewer_than_two_dims_broadcasts_over_every_query(mask, causal):
    """torch's CPU attention indexes a mask's last two dims (IndexError on a 4-D query); it broadcasts."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 3, 8, requires_grad=True), torch.randn(1, 2, 4, 8)
    out = cf.scaled_dot_product_attention(q, k, k, attn_mask=mask, is_causal=causal)
    want = F.scaled_dot_product_attention(q, k, k, attn_mask=mask.expand(3, 4), is_causal=causal)
    torch.testing.assert_close(out, want)
    g, = torch.autograd.grad(out.sum(), q)
    torch.testing.assert_close(g, torch.autograd.grad(want.sum(), q)[0])


@pytest.mark.parametrize("groups", ["2", 2.0])
def test_conv2d_groups_of_wrong_type_is_a_type_error(groups):
    with pytest.raises(TypeError, match="groups"):
        cf.conv2d(T(*X), T(6, 2, 3, 3), groups=groups)


@pytest.mark.parametrize("dropout_p", ["0.1", None])
def test_sdpa_dropout_p_of_wrong_type_names_the_argument(dropout_p):
    with pytest.raises(TypeError, match="dropout_p"):
        cf.scaled_dot_product_attention(T(*Q), T(*KV), T(*KV), dropout_p=dropout_p)


def test_a_float32_mask_beside_a_16_bit_query_runs_torchs_own_op(caplog):
    """torch's rule for attn_mask is bool, float32 or the query's dtype: a float32 additive mask with
    bf16 q, k, v is valid (and optimize() rewrites such call sites), so it runs torch's op, logged, where
    cf once raised TypeError."""
    from cudnn_fuse import ops

    q, k, v = (T(*s, dtype=torch.bfloat16) for s in (Q, KV, KV))
    mask = torch.randn(6, 10)
    ops._said.discard(("scaled_dot_product_attention", "a float32 attn_mask beside another query dtype"))  # once a process
    with caplog.at_level("DEBUG", logger="cudnn_fuse"):
        out = cf.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert any("float32 attn_mask" in r.getMessage() for r in caplog.records)


# ------------------------------------------- a remembered signature (ops._memo, the C memo)
#
# The memo keys a call on its arguments' values, and Python's True == 1 == 1.0 (with one hash): a key of
# values alone served groups=True once groups=1 had been seen, where the same call alone is refused. The
# key now holds the attributes' exact types too (ops._attr_sig; the C memo builds the same key).


@pytest.fixture(params=PATHS)
def memo_path(request, monkeypatch):
    """The memo on the Python path and on the C path (cudnn_fuse._native), with no-op plans."""
    with on_memo_path(request.param, monkeypatch, lambda spec, device: NoOpPlan(spec)) as ops:
        yield ops


def _cl16(*shape):
    return torch.randn(shape).half().contiguous(memory_format=torch.channels_last)


_CONV = lambda **kw: (cf.conv2d, (_cl16(2, 4, 6, 6), _cl16(4, 4, 3, 3)), kw)  # noqa: E731
_ATT = lambda **kw: (cf.scaled_dot_product_attention, tuple(torch.randn(2, 2, 4, 8).half() for _ in "qkv"), kw)  # noqa: E731

# (the call whose signature is remembered, the same call with a value equal to its good one, the argument named)
CONFLATED = {
    "groups_True": (_CONV(groups=1), {"groups": True}, "groups"),
    "groups_float": (_CONV(groups=1), {"groups": 1.0}, "groups"),
    "stride_bool_in_pair": (_CONV(stride=(1, 1)), {"stride": (True, 1)}, "stride"),
    "stride_float": (_CONV(stride=1), {"stride": 1.0}, "stride"),
    "padding_False": (_CONV(padding=0), {"padding": False}, "padding"),
    "dilation_float_in_pair": (_CONV(dilation=(1, 1)), {"dilation": (1.0, 1)}, "dilation"),
    "dropout_p_False": (_ATT(dropout_p=0), {"dropout_p": False}, "dropout_p"),
}


@pytest.mark.parametrize("good, bad, name", list(CONFLATED.values()), ids=list(CONFLATED))
def test_a_remembered_signature_does_not_serve_a_bad_value_equal_to_its_good_one(memo_path, good, bad, name):
    ops = memo_path
    fn, args, kw = good
    with pytest.raises(TypeError, match=name):  # refused alone
        fn(*args, **{**kw, **bad})
    fn(*args, **kw)
    assert len(ops.memo_keys()) == 1, "the good call's signature is remembered"
    fn(*args, **kw)  # served by the memo
    with pytest.raises(TypeError, match=name):  # and refused after it
        fn(*args, **{**kw, **bad})


@pytest.mark.parametrize("native", ["python", "native"])
def test_a_remembered_training_signature_does_not_serve_groups_true(native):
    """The training memo (the validated call of the autograd op, ops._remember_call) runs on the CPU
    as it is: groups=True passed once groups=1 had been seen."""
    from cudnn_fuse import ops

    if native == "native" and ops._native is None:
        pytest.skip("cudnn_fuse._native is not built")
    was = ops.native_enabled()
    ops.set_native(native == "native")
    try:
        x, w = torch.randn(2, 4, 6, 6, requires_grad=True), torch.randn(4, 4, 3, 3)
        cf.conv2d(x, w, groups=1)
        assert len(ops.memo_keys()) == 1
        for bad in (True, 1.0):
            with pytest.raises(TypeError, match=f"groups must be an int, got groups={bad}"):
                cf.conv2d(x, w, groups=bad)
    finally:
        ops.set_native(was)


SIG_PAIRS = [  # attributes that compare (and hash) equal, of other types
    ((1, 1), (True, 1)), (((1, 1), 0), ((1, True), 0)), ((1,), (1.0,)), ((0.0,), (False,)), ((None, 2), (None, 2.0)),
    (((1, 1), (0, 0), (1, 1), 1, "relu", False, 0.01), ((1, 1), (0, 0), (1, 1), 1, "relu", 0, 0.01)),
    ((np.int64(1),), (1.0,)), ((np.int64(1),), (np.int32(1),)), ((2,), (np.float64(2.0),)),
]


@pytest.mark.parametrize("a, b", SIG_PAIRS)
def test_memo_keys_of_equal_attributes_of_other_types_differ(a, b):
    from cudnn_fuse import ops

    assert a == b and hash(a) == hash(b)
    x = torch.randn(2, 3)
    ka, kb = ops._memo("op", x, None, None, None, a)[0], ops._memo("op", x, None, None, None, b)[0]
    assert ka is not None and kb is not None and ka != kb
    assert ops._memo("op", x, None, None, None, a)[0] == ka  # and a key is stable


def test_the_c_and_python_attribute_signatures_agree():
    from cudnn_fuse import ops

    if ops._native is None:
        pytest.skip("cudnn_fuse._native is not built")
    samples = [(), ("relu", False, 0.01), (None, True, 0.5, False), ((1, 1), (0, 0), (1, 1), 1, None, False, 0.01),
               ((1, 1), "same", (2, 1), 2, "gelu", True, 0.2), ((), (1,), ((1,),)), ([1], 2), (np.int64(1), 1),
               ((np.int64(1), 2),), tuple(range(30)), ((1,) * 25,), (1 << 70, "x"), "not a tuple",
               (1.5, None, "s", True, False, 3, (1.0, True, None, "t"))]
    for attrs in samples:
        assert ops._native.attr_sig(attrs) == ops._attr_sig_py(attrs), attrs
    for attrs in ((torch.tensor(1),), ((1, torch.tensor(1)),)):  # a tensor attribute: unkeyable on both (test_keys_audit)
        for sig in (ops._native.attr_sig, ops._attr_sig_py):
            with pytest.raises(TypeError, match="tensor attribute"):
                sig(attrs)


# ------------------------------------------------- numpy integers, __index__, a 0-dim tensor scale


class _Index:
    """An integer as numpy's scalars are one: through __index__ only."""

    def __init__(self, v):
        self.v = v

    def __index__(self):
        return self.v


@pytest.mark.parametrize("to", [pytest.param(np.int64, id="np.int64"), pytest.param(np.int32, id="np.int32"),
                                pytest.param(_Index, id="__index__")])
def test_conv2d_takes_integers_through_index_as_torch_does(to):
    """torch takes numpy's integers for stride, padding, dilation and groups (a class with only __index__
    meets an internal assert in torch 2.13's argument parser; cf reads both through operator.index)."""
    x, w, b = torch.randn(2, 4, 9, 9), torch.randn(6, 2, 3, 3), torch.randn(6)
    kw = dict(stride=to(2), padding=(to(1), to(2)), dilation=to(1), groups=to(2))
    want = F.conv2d(x, w, b, stride=2, padding=(1, 2), dilation=1, groups=2)
    if to is not _Index:
        torch.testing.assert_close(F.conv2d(x, w, b, **kw), want)
    torch.testing.assert_close(cf.conv2d(x, w, b, **kw), want)
    torch.testing.assert_close(cf.conv2d(x, w, b, **kw), want)  # a second call: the same (remembered) signature
    w1 = torch.randn(6, 4, 3, 3)
    got = cf.conv2d(x, w1, stride=(to(2), to(1)), dilation=(to(1), to(2)), groups=to(1))
    torch.testing.assert_close(got, F.conv2d(x, w1, stride=(2, 1), dilation=(1, 2), groups=1))


def test_a_torch_conv2d_module_with_numpy_geometry_runs_as_cf_nn_conv2d():
    m = torch.nn.Conv2d(4, 6, 3, stride=np.int64(2), padding=np.int64(1))
    c = cf.nn.Conv2d(4, 6, 3, stride=np.int64(2), padding=np.int64(1))
    c.load_state_dict(m.state_dict())
    x = torch.randn(2, 4, 9, 9)
    torch.testing.assert_close(c(x), m(x))


@pytest.mark.parametrize("kw, name", [({"groups": np.bool_(True)}, "groups"), ({"stride": np.float64(1.0)}, "stride"),
                                      ({"padding": (np.float32(1.0), 1)}, "padding"), ({"groups": True}, "groups")])
def test_conv2d_still_refuses_what_torch_refuses(kw, name):
    x, w = torch.randn(2, 4, 9, 9), torch.randn(6, 4, 3, 3)
    with pytest.raises(TypeError):
        F.conv2d(x, w, **kw)
    with pytest.raises(TypeError, match=f"conv2d: {name} must be"):
        cf.conv2d(x, w, **kw)


@pytest.mark.parametrize("scale", [pytest.param(torch.tensor(0.3), id="0-dim float32"),
                                   pytest.param(torch.tensor(0.3, dtype=torch.float64), id="0-dim float64"),
                                   pytest.param(torch.tensor(1), id="0-dim int"),
                                   pytest.param(np.float32(0.3), id="np.float32"),
                                   pytest.param(np.int64(1), id="np.int64")])
def test_sdpa_takes_a_scale_that_torch_takes(scale):
    """torch 2.13 takes a 0-dim tensor without grad as the float ``scale`` (it reads its value), and
    numpy scalars: so does cf, which reads them as float(scale)."""
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8)
    want = F.scaled_dot_product_attention(q, k, v, scale=scale)
    torch.testing.assert_close(cf.scaled_dot_product_attention(q, k, v, scale=scale), want)
    torch.testing.assert_close(cf.scaled_dot_product_attention(q, k, v, scale=float(scale)), want)


@pytest.mark.parametrize("scale", [pytest.param(torch.tensor([0.3]), id="1-dim"),
                                   pytest.param(torch.tensor(0.3, requires_grad=True), id="requires_grad"),
                                   pytest.param(torch.tensor(0.3j), id="complex")])
def test_sdpa_refuses_a_tensor_scale_torch_refuses_naming_it(scale):
    q = torch.randn(2, 3, 5, 8)
    with pytest.raises((TypeError, RuntimeError)):
        F.scaled_dot_product_attention(q, q, q, scale=scale)
    with pytest.raises(TypeError, match="scaled_dot_product_attention: scale must be"):
        cf.scaled_dot_product_attention(q, q, q, scale=scale)


# ------------------------------------------------------------------- a conv with 0 input channels
#
# The sum over no input channels is 0: y = act(bias + residual), of shape [N, K, P, Q]. torch 2.13's CPU
# conv returns [N, 0, P, Q] instead (its K taken from the empty input), and cf's epilogue then raised a
# RuntimeError naming no argument. cf returns the mathematically correct result (chosen over an error: it
# is cheap, and it is what the same conv with one channel of zeros gives).


def _zero_channel_want(N, K, P, Q, bias=None, residual=None, act=None, dtype=torch.float32):
    z = torch.zeros(N, K, P, Q, dtype=torch.float32)
    if bias is not None:
        z = z + bias.float().view(1, K, 1, 1)
    if residual is not None:
        z = z + residual.float()
    return cf.reference.activation(z, act).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", [None, "relu", "sigmoid"])
def test_a_conv_with_no_input_channels_is_its_bias_and_residual(dtype, act):
    x, w = torch.randn(2, 0, 7, 7, dtype=dtype), torch.randn(6, 0, 3, 3, dtype=dtype)
    b, r = torch.randn(6, dtype=dtype), torch.randn(2, 6, 4, 4, dtype=dtype)
    y = cf.conv2d(x, w, b, stride=2, padding=1, activation=act, residual=r)
    assert y.shape == (2, 6, 4, 4) and y.dtype == dtype
    torch.testing.assert_close(y, _zero_channel_want(2, 6, 4, 4, b, r, act, dtype))
    y, amax = cf.conv2d(x, w, b, padding="same", return_amax=True)
    torch.testing.assert_close(y, _zero_channel_want(2, 6, 7, 7, b, dtype=dtype))
    torch.testing.assert_close(amax, b.float().abs().max())
    assert cf.conv2d(x, w).shape == (2, 6, 5, 5) and not cf.conv2d(x, w).any()


def test_a_conv_with_no_input_channels_in_other_geometries():
    w = torch.randn(6, 0, 3, 3)
    b = torch.randn(6)
    assert cf.conv2d(torch.randn(0, 7, 7), w, b).shape == (6, 5, 5)  # unbatched
    torch.testing.assert_close(cf.conv2d(torch.randn(0, 7, 7), w, b), _zero_channel_want(1, 6, 5, 5, b)[0])
    y = cf.conv2d(torch.randn(2, 0, 7, 7), w, b, groups=3, dilation=2)  # 0 channels in each of 3 groups
    torch.testing.assert_close(y, _zero_channel_want(2, 6, 3, 3, b))
    x_cl = torch.randn(2, 0, 7, 7).contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(cf.conv2d(x_cl, w, b), _zero_channel_want(2, 6, 5, 5, b))
    assert cf.conv2d(torch.randn(0, 0, 7, 7), w, b).shape == (0, 6, 5, 5)
    with pytest.raises(ValueError, match="channel mismatch"):  # the weight's channels still have to match
        cf.conv2d(torch.randn(2, 0, 7, 7), torch.randn(6, 1, 3, 3))


def test_a_conv_with_no_input_channels_trains():
    x = torch.randn(2, 0, 7, 7, requires_grad=True)
    w = torch.randn(6, 0, 3, 3, requires_grad=True)
    b = torch.randn(6, requires_grad=True)
    y = cf.conv2d(x, w, b, padding=1, activation="relu")
    assert y.shape == (2, 6, 7, 7)
    gy = torch.randn(2, 6, 7, 7)
    gx, gw, gb = torch.autograd.grad(y, (x, w, b), gy)
    assert gx.shape == x.shape and gw.shape == w.shape
    torch.testing.assert_close(gb, (gy * (b.view(1, 6, 1, 1) > 0)).sum((0, 2, 3)))


def test_cf_nn_conv2d_with_no_input_channels():
    m = cf.nn.Conv2d(0, 6, 3, padding=1, activation="relu")
    y = m(torch.randn(2, 0, 5, 5))
    torch.testing.assert_close(y, _zero_channel_want(2, 6, 5, 5, m.bias.detach(), act="relu"))
