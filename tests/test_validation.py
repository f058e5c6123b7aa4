"""Invalid arguments raise ValueError (values, shapes) or TypeError (dtypes, types), naming the argument.

Each case is (op, arguments, expected exception, regex the message must match, whether torch's own
function also rejects the same arguments). The last column checks the contract's "exactly where torch
would": cudnn_fuse must not reject what torch accepts for these shapes.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import cudnn_fuse as cf

f32, f64 = torch.float32, torch.float64


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
    "channels": (conv(w=(6, 3, 3, 3)), ValueError, r"channel mismatch: x has C=4", True),
    "groups_not_dividing_C": (conv(x=(2, 6, 8, 8), w=(6, 3, 3, 3), groups=4), ValueError, r"C=6 .*C/groups\*groups=3\*4=12", True),
    "K_mod_groups": (conv(w=(5, 2, 3, 3), groups=2), ValueError, r"K=5 .*groups=2", True),
    "x_rank": (conv(x=(1, 2, 4, 8, 8)), ValueError, r"x\.shape=\(1, 2, 4, 8, 8\)", True),
    "weight_rank": (conv(w=(6, 4, 3)), ValueError, r"weight\.shape=\(6, 4, 3\)", True),
    "bias_len": (conv(bias=T(5)), ValueError, r"bias.*\(6,\).*bias\.shape=\(5,\)", True),
    "bias_rank": (conv(bias=T(6, 1)), ValueError, r"bias\.shape=\(6, 1\)", True),
    "residual_shape": (conv(residual=T(2, 6, 8, 8)), ValueError, r"residual.*\(2, 6, 6, 6\).*residual\.shape", None),
    "residual_unbatched": (conv(x=(4, 8, 8), residual=T(1, 6, 6, 6)), ValueError, r"residual\.shape=\(1, 6, 6, 6\)",
                           None),
    "output_too_small": (conv(x=(2, 4, 2, 8)), ValueError, r"output size.*x\.shape=\(2, 4, 2, 8\)", True),
    "output_too_small_dilation": (conv(x=(2, 4, 5, 5), dilation=3), ValueError, r"output size.*dilation", True),
    # dtypes and types
    "weight_dtype": (conv(w=T(*W, dtype=f64)), TypeError, r"weight has dtype torch\.float64", True),
    "bias_dtype": (conv(bias=T(6, dtype=f64)), TypeError, r"bias has dtype torch\.float64", True),
    "residual_dtype": (conv(residual=T(2, 6, 6, 6, dtype=f64)), TypeError, r"residual has dtype", None),
    "integer_x": (conv(x=T(*X, dtype=torch.int32), w=T(*W, dtype=torch.int32)), TypeError, r"\bx must have a floating",
                  False),  # torch convolves integers on the CPU; the contract takes floats only
    "bool_x": (conv(x=T(*X, dtype=torch.bool), w=T(*W, dtype=torch.bool)), TypeError, r"\bx must have a floating",
               True),
    "x_not_tensor": (conv(x=np.zeros(X, np.float32)), TypeError, r"\bx must be a torch\.Tensor", True),
    "x_list": (conv(x=[[1.0]]), TypeError, r"\bx must be a torch\.Tensor", True),
    "weight_not_tensor": (conv(w=3.0), TypeError, r"weight must be a torch\.Tensor", True),
    "bias_not_tensor": (conv(bias=[0.0] * 6), TypeError, r"bias must be a torch\.Tensor", True),
    "residual_not_tensor": (conv(residual=1.0), TypeError, r"residual must be a torch\.Tensor", None),
    "activation": (conv(activation="swish"), ValueError, r"activation.*'swish'", None),
    "activation_case": (conv(activation="ReLU"), ValueError, r"activation.*'ReLU'", None),
    # stride / padding / dilation / groups
    "stride_0": (conv(stride=0), ValueError, r"stride.*stride=\(0, 0\)", True),
    "stride_negative": (conv(stride=(1, -2)), ValueError, r"stride.*\(1, -2\)", True),
    "stride_float": (conv(stride=1.5), TypeError, r"stride must be an int or a pair", True),
    "stride_str": (conv(stride="1"), TypeError, r"stride must be", True),
    "stride_triple": (conv(stride=(1, 1, 1)), TypeError, r"stride must be", True),
    "stride_pair_of_floats": (conv(stride=(1.0, 1.0)), TypeError, r"stride must be", True),
    "padding_negative": (conv(padding=-1), ValueError, r"padding.*padding=\(-1, -1\)", True),
    "padding_pair_negative": (conv(padding=(0, -3)), ValueError, r"padding", True),
    "padding_float": (conv(padding=0.5), TypeError, r"padding must be an int or a pair", True),
    "padding_string": (conv(padding="full"), ValueError, r"padding.*'full'", True),
    "padding_same_strided": (conv(padding="same", stride=2), ValueError, r"padding='same'.*stride=\(2, 2\)", True),
    "padding_same_strided_w": (conv(padding="same", stride=(1, 2)), ValueError, r"padding='same'.*stride", True),
    "dilation_0": (conv(dilation=0), ValueError, r"dilation.*dilation=\(0, 0\)", True),
    "dilation_negative": (conv(dilation=(-1, 1)), ValueError, r"dilation", True),
    "dilation_str": (conv(dilation="2"), TypeError, r"dilation must be", True),
    "groups_0": (conv(groups=0), ValueError, r"groups.*groups=0", True),
    "groups_negative": (conv(groups=-2), ValueError, r"groups=-2", True),
}


# ------------------------------------------------------------------- linear

def lin(x=(3, 5), w=(4, 5), **kw):
    x = T(*x) if isinstance(x, tuple) else x
    w = T(*w) if isinstance(w, tuple) else w
    return (x, w), kw


LINEAR_CASES = {
    "in_features": (lin(w=(4, 6)), ValueError, r"in_features=5 .*weight\.shape=\(4, 6\)", True),
    "weight_3d": (lin(w=(1, 4, 5)), ValueError, r"weight must be 2-D.*\(1, 4, 5\)", True),
    "weight_1d": (lin(w=(5,)), ValueError, r"weight must be 2-D", False),  # torch's 1-D weight: see contract
    "x_0dim": (lin(x=()), ValueError, r"\bx needs at least 1 dimension", True),
    "bias_len": (lin(bias=T(5)), ValueError, r"bias.*\(4,\).*bias\.shape=\(5,\)", True),
    "bias_rank": (lin(bias=T(1, 4)), ValueError, r"bias\.shape=\(1, 4\)", False),  # torch broadcasts it
    "residual_shape": (lin(residual=T(3, 5)), ValueError, r"residual.*\(3, 4\).*residual\.shape=\(3, 5\)", None),
    "residual_broadcastable": (lin(residual=T(4)), ValueError, r"residual\.shape=\(4,\)", None),
    "weight_dtype": (lin(w=T(4, 5, dtype=f64)), TypeError, r"weight has dtype torch\.float64", True),
    "bias_dtype": (lin(bias=T(4, dtype=torch.float16)), TypeError, r"bias has dtype torch\.float16", True),
    "integer_x": (lin(x=T(3, 5, dtype=torch.int64), w=T(4, 5, dtype=torch.int64)), TypeError, r"\bx must have a floating",
                  False),  # torch computes integer linear on the CPU
    "x_not_tensor": (lin(x=np.zeros((3, 5), np.float32)), TypeError, r"\bx must be a torch\.Tensor", True),
    "weight_not_tensor": (lin(w=[[0.0] * 5] * 4), TypeError, r"weight must be a torch\.Tensor", True),
    "bias_not_tensor": (lin(bias=0.0), TypeError, r"bias must be a torch\.Tensor", True),
    "activation": (lin(activation="mish"), ValueError, r"activation.*'mish'", None),
}


# ------------------------------------------------------------------- matmul

def mm(a=(2, 3, 4), b=(2, 4, 5), **kw):
    a = T(*a) if isinstance(a, tuple) else a
    b = T(*b) if isinstance(b, tuple) else b
    return (a, b), kw


MATMUL_CASES = {
    "inner_dims": (mm(b=(2, 6, 5)), ValueError, r"inner dimensions.*a\.shape=\(2, 3, 4\).*b\.shape=\(2, 6, 5\)", True),
    "inner_dims_1d": (mm(a=(4,), b=(5,)), ValueError, r"inner dimensions.*K=4 vs 5", True),
    "inner_dims_1d_2d": (mm(a=(3,), b=(4, 5)), ValueError, r"inner dimensions", True),
    "batch_broadcast": (mm(a=(2, 3, 4), b=(3, 4, 5)), ValueError, r"batch dimensions.*a\.shape=\(2, 3, 4\)", True),
    "batch_broadcast_4d": (mm(a=(2, 2, 3, 4), b=(3, 1, 4, 5)), ValueError, r"batch dimensions", True),
    "a_0dim": (mm(a=()), ValueError, r"at least 1 dimension.*a\.shape=\(\)", True),
    "b_0dim": (mm(b=()), ValueError, r"at least 1 dimension.*b\.shape=\(\)", True),
    "bias_len": (mm(bias=T(4)), ValueError, r"bias.*\(5,\).*bias\.shape=\(4,\)", None),
    "bias_with_1d_b": (mm(b=(4,), bias=T(1)), ValueError, r"bias needs a 2-D or batched b", None),
    "residual_shape": (mm(residual=T(3, 5)), ValueError, r"residual.*\(2, 3, 5\).*residual\.shape=\(3, 5\)", None),
    "b_dtype": (mm(b=T(2, 4, 5, dtype=f64)), TypeError, r"\bb has dtype torch\.float64", True),
    "bias_dtype": (mm(bias=T(5, dtype=f64)), TypeError, r"bias has dtype", None),
    "integer_a": (mm(a=T(2, 3, 4, dtype=torch.int32), b=T(2, 4, 5, dtype=torch.int32)), TypeError,
                  r"\ba must have a floating", False),  # torch multiplies integers
    "a_not_tensor": (mm(a=np.zeros((2, 3, 4))), TypeError, r"\ba must be a torch\.Tensor", True),
    "b_not_tensor": (mm(b=2.0), TypeError, r"\bb must be a torch\.Tensor", True),
    "residual_not_tensor": (mm(residual="r"), TypeError, r"residual must be a torch\.Tensor", None),
    "activation": (mm(activation="elu"), ValueError, r"activation.*'elu'", None),
}


# ---------------------------------------------------------------------- sdpa

Q, KV = (2, 4, 6, 8), (2, 4, 10, 8)


def att(q=Q, k=KV, v=KV, **kw):
    q, k, v = (T(*t) if isinstance(t, tuple) else t for t in (q, k, v))
    return (q, k, v), kw


SDPA_CASES = {
    "head_dim": (att(k=(2, 4, 10, 7)), ValueError, r"query and key head dims differ.*key\.shape=\(2, 4, 10, 7\)", True),
    "kv_lengths": (att(v=(2, 4, 9, 8)), ValueError, r"key and value sequence lengths.*value\.shape=\(2, 4, 9, 8\)",
                   None),  # torch 2.13's CPU kernel does not check this one (it returns a result)
    "rank": (att(k=(4, 10, 8), v=(4, 10, 8)), ValueError, r"same rank.*key\.shape=\(4, 10, 8\)", None),
    "rank_1": (att(q=(8,), k=(8,), v=(8,)), ValueError, r"rank >= 2", True),
    "heads_without_gqa": (att(k=(2, 2, 10, 8), v=(2, 2, 10, 8)), ValueError, r"4 heads.*2.*enable_gqa=True", True),
    "heads_not_divisible": (att(k=(2, 3, 10, 8), v=(2, 3, 10, 8), enable_gqa=True), ValueError,
                            r"enable_gqa=True and 4 divisible by 3", True),
    "kv_heads_differ": (att(k=(2, 2, 10, 8), enable_gqa=True), ValueError, r"key has 2 heads but value has 4",
                        None),  # unchecked by torch's CPU kernel
    "batch": (att(k=(3, 4, 10, 8), v=(3, 4, 10, 8)), ValueError, r"batch dims differ.*key\.shape=\(3, 4, 10, 8\)",
              True),
    "dropout_negative": (att(dropout_p=-0.1), ValueError, r"dropout_p.*-0\.1", None),
    "dropout_one": (att(dropout_p=1.0), ValueError, r"dropout_p=1\.0", None),
    "dropout_big": (att(dropout_p=2.0), ValueError, r"dropout_p=2\.0", None),
    "mask_and_causal": (att(attn_mask=T(6, 10, dtype=torch.bool), is_causal=True), ValueError,
                        r"attn_mask and is_causal", None),  # torch documents the error, its CPU kernel skips it
    "mask_int": (att(attn_mask=T(6, 10, dtype=torch.int64)), TypeError, r"attn_mask must be bool.*torch\.int64", True),
    "mask_other_float": (att(attn_mask=T(6, 10, dtype=f64)), TypeError, r"attn_mask.*torch\.float64", True),
    "mask_shape": (att(attn_mask=T(6, 11, dtype=torch.bool)), ValueError, r"attn_mask\.shape=\(6, 11\)", True),
    "mask_too_big": (att(attn_mask=T(3, 4, 6, 10)), ValueError, r"attn_mask\.shape=\(3, 4, 6, 10\)", True),
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
    q, k, v = (T(*s, dtype=torch.bfloat16) for s in (Q, KV, KV))
    mask = torch.randn(6, 10)
    with caplog.at_level("DEBUG", logger="cudnn_fuse"):
        out = cf.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert any("float32 attn_mask" in r.getMessage() for r in caplog.records)
