"""The public functional ops: ``conv2d``, ``linear``, ``matmul``, ``scaled_dot_product_attention``.

Each entry point takes its remembered launch when the call's signature was seen before (the memo of
ops.py, in C where ``cudnn_fuse._native`` is built); else it validates its arguments like torch
(errors.ArgumentError, a ValueError and a RuntimeError, for bad values; TypeError for bad types; each
naming the argument and its values), and runs the fused cuDNN graph, its
autograd op (torch_ops.py) when a gradient or torch.compile needs one, or its PyTorch reference,
logged once with the reason.
"""

from __future__ import annotations

import math
import torch

from . import fp8_attention, fp8_gemm, manifest, ops, reference, torch_ops
from .errors import ArgumentError
from .ops import _any_autocast, _is_compiling  # read on every call: bound here, not looked up on ops
from .spec import canonical_activation

__all__ = ["conv2d", "linear", "matmul", "scaled_dot_product_attention"]

_GO = object()  # _front's answer when no shortcut served the call: the op validates and runs it


def _front(name: str, grad: str, again, a, b, c, d, attrs: tuple):
    """The prologue every public op shares, in order: under torch.autocast, ``again`` (the op called
    anew) on the operands cast as autocast casts them; the remembered launch of this signature (the C
    memo, then the Python one); a CuPy first operand through DLPack. Returns (output, None), or
    (_GO, the memo key) for the op's own validation and run. ``a``-``d``: the op's four operands (None
    where absent), ``attrs`` its other arguments as ``again`` takes them."""
    if _any_autocast() and (cast := ops.autocast_args(a, a, b, c, d)) is not None:
        dev, operands = cast
        with ops._autocast_off(dev):
            return again(*operands, attrs), None
    if (native := ops._native_call) is not None and not _is_compiling() and \
            (out := native(name, grad, a, b, c, d, attrs)) is not None:
        return out, None
    key, launch = ops._memo(name, a, b, c, d, attrs)
    if launch is not None:
        return launch(a, b, c, d), None
    if ops._is_cupy(a):
        return ops._cupy_call(again, (a, b, c, d, attrs), {}), None
    return _GO, key


def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, activation=None, residual=None,
           return_amax=False, *, negative_slope=0.01):
    """Fused ``act(conv2d(x, weight) + bias + residual)``, optionally with ``amax = max|y|``.

    x: [N, C, H, W] or unbatched [C, H, W], NCHW or channels_last memory;
    weight: [K, C/groups, R, S]; bias: [K]; residual: the output's shape
    [N, K, P, Q] or one that broadcasts to it ([1, K, 1, 1], [K, 1, 1], ...). Returns y (memory format
    of x), or (y, amax) with amax a float32 0-dim tensor. activation: a name (any case), None, or a
    torch activation (F.relu, nn.GELU(), nn.LeakyReLU(0.2), ...); negative_slope: leaky_relu's only.
    Operands of dtypes the fused op does not take (integers, complex, a float64 residual beside
    float32) run torch's own ``act(F.conv2d(x, weight, bias) + residual)``, its type promotion included.
    """
    attrs = (stride, padding, dilation, groups, activation, return_amax, negative_slope)
    out, key = _front("conv2d", "conv2d:grad", _conv2d_again, x, weight, bias, residual, attrs)
    if out is not _GO:
        return out
    op = "conv2d"
    ops._check_tensor("x", x, op)
    ops._check_tensor("weight", weight, op)
    ops._check_devices(op, "x", x, weight=weight, bias=bias, residual=residual)
    ops._check_flag(op, "return_amax", return_amax)
    key = ops._unkeyed(key, activation)
    activation, negative_slope = canonical_activation(activation, negative_slope, op)
    if x.dim() not in (3, 4):
        raise ArgumentError(f"{op}: expected 3-D (unbatched) or 4-D (batched) input x, got x.shape={tuple(x.shape)}")
    if weight.dim() != 4:
        raise ArgumentError(f"{op}: weight must be 4-D [K, C/groups, R, S], got weight.shape={tuple(weight.shape)}")
    g = ops._index(groups)
    if g is None:
        raise TypeError(f"{op}: groups must be an int, got groups={groups!r}")
    groups = g
    if groups < 1:
        raise ArgumentError(f"{op}: groups must be a positive int, got groups={groups!r}")
    stride = ops._pair("stride", stride, op, 1)
    dilation = ops._pair("dilation", dilation, op, 1)
    C = x.shape[-3]
    K, Cg, R, S = weight.shape
    if 0 in (K, R, S):
        raise ArgumentError(f"{op}: weight must have out channels and a kernel of positive size, got "
                            f"weight.shape={tuple(weight.shape)}")
    if C != Cg * groups:
        raise ArgumentError(f"{op}: channel mismatch: x has C={C} but weight expects C/groups*groups={Cg}*{groups}="
                            f"{Cg * groups}")
    if K % groups != 0:
        raise ArgumentError(f"{op}: out channels K={K} must be divisible by groups={groups}")
    pre, post = ops._conv_padding(padding, (R, S), dilation, stride)
    out_shape = ops.conv_out_shape(x.shape, weight.shape, stride, pre, post, dilation)
    if any(o <= 0 for o in out_shape[-2:]):
        raise ArgumentError(f"{op}: output size {out_shape[-2:]} is too small for x.shape={tuple(x.shape)}, "
                            f"weight.shape={tuple(weight.shape)}, padding={padding!r}, dilation={dilation}, "
                            f"stride={stride}")
    ops._check_epilogue(op, activation, residual, out_shape, bias, K)
    grow = ops._grown(residual, out_shape)
    if (why := ops._torch_dtypes(x, weight, bias, residual)) is not None:
        ops._fallback(op, why)
        return reference.conv2d_torch(x, weight, bias, stride, pre, post, dilation, groups, activation, residual,
                                      return_amax, negative_slope)

    if ops._inline_under_compile("conv2d") or ops._under_functorch(op):
        return reference.conv2d_plain(x, weight, bias, stride, pre, post, dilation, groups, activation, residual,
                                      return_amax, negative_slope)
    if Cg == 0:  # no input channels: y = act(bias + residual), torch's own ops (and autograd) compute it
        ops._fallback(op, "no input channels (the conv's sum is 0)")
        return reference.conv2d_padded(x, weight, bias, stride, pre, post, dilation, groups, activation, residual,
                                       return_amax, negative_slope)
    if ops._via_custom_op(x, weight, bias, residual):
        if return_amax:
            def call(x, weight, bias, residual):
                return torch_ops.conv2d(x, weight, bias, stride, pre, post, dilation, groups, activation, residual,
                                        return_amax, negative_slope)
        else:
            attrs_t = (tuple(stride), tuple(pre), tuple(post), tuple(dilation), groups, activation, float(negative_slope))
            slot = [None, key[-1] if key is not None else None]  # the launch, and the mode it must be of

            def call(x, weight, bias, residual):
                return torch_ops.conv2d_train(x, weight, bias, residual, attrs_t, slot)

        return _remembered(key, call, grow, x, weight, bias, residual)
    if grow is not None:  # not remembered: the memo's later calls would bring the residual unexpanded
        residual, key = residual.expand(grow), None
    return ops._conv2d_fwd(x, weight, bias, stride, pre, post, dilation, groups, activation, residual, return_amax,
                           negative_slope, memo=key)


def matmul(a, b, bias=None, activation=None, residual=None, return_amax=False, *, negative_slope=0.01):
    """Fused ``act(a @ b + bias + residual)`` with torch.matmul's batching and broadcasting.

    a: [..., M, K] (or [K]); b: [..., K, N] (or [K]); bias: [N];
    residual: the output's shape, or one that broadcasts to it ([N], [M, 1], ...). Returns y, or
    (y, amax). Operands of other dtypes than one floating-point one run torch's
    ``act(torch.matmul(a, b) + bias + residual)``.
    """
    attrs = (activation, return_amax, negative_slope)
    out, key = _front("matmul", "matmul:grad", _matmul_again, a, b, bias, residual, attrs)
    if out is not _GO:
        return out
    op = "matmul"
    ops._check_tensor("a", a, op)
    ops._check_tensor("b", b, op)
    ops._check_devices(op, "a", a, b=b, bias=bias, residual=residual)
    ops._check_flag(op, "return_amax", return_amax)
    key = ops._unkeyed(key, activation)
    activation, negative_slope = canonical_activation(activation, negative_slope, op)
    if a.dim() == 0 or b.dim() == 0:
        raise ArgumentError(f"{op}: both arguments need at least 1 dimension, got a.shape={tuple(a.shape)}, "
                            f"b.shape={tuple(b.shape)}")
    views = ops.matmul_views(a, b)
    out_shape, N = views[5], views[4]
    if bias is not None and b.dim() == 1:
        raise ArgumentError(f"{op}: bias needs a 2-D or batched b (an output with an N dimension), got "
                            f"b.shape={tuple(b.shape)}")
    ops._check_epilogue(op, activation, residual, out_shape, bias, N)
    grow = ops._grown(residual, out_shape)
    if (why := ops._torch_dtypes(a, b, bias, residual)) is not None:
        ops._fallback(op, why)
        return reference.matmul_torch(a, b, bias, activation, residual, return_amax, negative_slope)

    if ops._inline_under_compile("matmul") or ops._under_functorch(op):
        return reference.matmul(a, b, bias, activation, residual, return_amax, negative_slope)
    if ops._via_custom_op(a, b, bias, residual):
        def call(a, b, bias, residual):
            return torch_ops.matmul(a, b, bias, activation, residual, return_amax, negative_slope)

        return _remembered(key, call, grow, a, b, bias, residual)
    if grow is not None:
        residual, key = residual.expand(grow), None
    return ops._matmul_fwd(a, b, bias, activation, residual, return_amax, negative_slope, views, memo=key)


def linear(x, weight, bias=None, activation=None, residual=None, return_amax=False, *, negative_slope=0.01):
    """Fused ``act(x @ weight.T + bias + residual)``; the [out, in] weight is read
    through strides, never copied.

    x: [..., in]; weight: [out, in]; bias: [out]; residual: [..., out], or one that broadcasts to it
    ([out], [..., 1], ...). Operands of other dtypes than one floating-point one run torch's
    ``act(F.linear(x, weight, bias) + residual)``.
    """
    attrs = (activation, return_amax, negative_slope)
    out, key = _front("linear", "linear:grad", _linear_again, x, weight, bias, residual, attrs)
    if out is not _GO:
        return out
    op = "linear"
    ops._check_tensor("x", x, op)
    ops._check_tensor("weight", weight, op)
    ops._check_devices(op, "x", x, weight=weight, bias=bias, residual=residual)
    ops._check_flag(op, "return_amax", return_amax)
    key = ops._unkeyed(key, activation)
    activation, negative_slope = canonical_activation(activation, negative_slope, op)
    if weight.dim() != 2:
        raise ArgumentError(f"{op}: weight must be 2-D [out_features, in_features], got "
                            f"weight.shape={tuple(weight.shape)}")
    if x.dim() == 0:
        raise ArgumentError(f"{op}: x needs at least 1 dimension, got a 0-dim tensor")
    K = x.shape[-1]
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise ArgumentError(f"{op}: x has in_features={K} but weight.shape={tuple(weight.shape)} expects "
                            f"{weight.shape[1]}")
    out_shape = tuple(x.shape[:-1]) + (N,)
    ops._check_epilogue(op, activation, residual, out_shape, bias, N)
    grow = ops._grown(residual, out_shape)
    if (why := ops._torch_dtypes(x, weight, bias, residual)) is not None:
        ops._fallback(op, why)
        return reference.linear_torch(x, weight, bias, activation, residual, return_amax, negative_slope)

    if ops._inline_under_compile("linear") or ops._under_functorch(op):
        return reference.linear(x, weight, bias, activation, residual, return_amax, negative_slope)
    if ops._via_custom_op(x, weight, bias, residual):
        def call(x, weight, bias, residual):
            return torch_ops.linear(x, weight, bias, activation, residual, return_amax, negative_slope)

        return _remembered(key, call, grow, x, weight, bias, residual)
    if grow is not None:
        residual, key = residual.expand(grow), None
    return ops._linear_fwd(x, weight, bias, activation, residual, return_amax, negative_slope, memo=key)


def _remembered(key, call, grow, a, b, c, residual):
    """Remember a training call's validated call of the autograd op (under its ":grad" key) and make it.
    ``grow``: the output's shape a broadcast residual is expanded to (a view: autograd sums its gradient
    back to the residual's shape), inside the call, since the memo's later calls bring it unexpanded."""
    if grow is not None:
        inner = call

        def call(a, b, c, residual):
            return inner(a, b, c, residual.expand(grow))

    ops._remember_call(key, call)
    return call(a, b, c, residual)


def scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Fused attention forward, torch.nn.functional.scaled_dot_product_attention's semantics.

    q: [B, Hq, Sq, D]; k: [B, Hkv, Skv, D]; v: [B, Hkv, Skv, Dv] (BHSD or BSHD
    memory, e.g. ``x.view(B, S, H, D).transpose(1, 2)``); 3-D inputs [B, S, D]
    are one head; leading dims of any rank broadcast as torch's do (a q [4, 3, 8] with k, v
    [4, 4, 6, 8] gives [4, 4, 3, 8]). Hq != Hkv needs enable_gqa=True. attn_mask: bool (True takes
    part) or an additive float bias, broadcastable to [B, Hq, Sq, Skv]; with is_causal=True it is
    combined with the top-left causal triangle, as torch does. Returns o [B, Hq, Sq, Dv] in q's memory
    layout.
    """
    if scale is not None and type(scale) is not float:  # an int, numpy's, a 0-dim tensor: read as torch reads it
        scale = ops._float_arg("scaled_dot_product_attention", "scale", scale)
    attrs = (dropout_p, is_causal, scale, enable_gqa)
    out, key = _front("sdpa", "sdpa:grad", _sdpa_again, q, k, v, attn_mask, attrs)
    if out is not _GO:
        return out
    op = "scaled_dot_product_attention"
    lead = ops._check_sdpa(op, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    bq, bk, bv = ops._sdpa_broadcast(q, k, v, lead, enable_gqa)
    if bq is not q or bk is not k or bv is not v:  # views of the common shape: the memo's key holds the others
        q, k, v, key = bq, bk, bv, None
    if attn_mask is not None and attn_mask.dim() < 2:  # a mask of S or one value: torch's kernels index (L, S)
        attn_mask, key = attn_mask.expand(q.shape[-2], k.shape[-2]), None
    if is_causal and attn_mask is not None:  # one explicit mask, as torch combines them
        attn_mask, is_causal, key = ops._with_causal(attn_mask, q.shape[-2], k.shape[-2]), False, None
    if attn_mask is not None and attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
        # torch takes a float32 mask beside 16-bit q, k, v (its rule: bool, float32 or the query's dtype),
        # which the fused graph does not: torch's own op runs it
        ops._fallback(op, "a float32 attn_mask beside another query dtype")
        return reference.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if dropout_p > 0.0:  # torch's own autograd: a backward cannot replay the forward's random mask
        ops._fallback(op, "dropout_p > 0")
        return reference.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if ops._inline_under_compile("sdpa") and (attn_mask is None or ops._needs_grad(q, k, v, attn_mask)):
        # a masked attention's inference stays cuDNN's: Inductor lowered BERT-base's masked SDPA to an
        # fp32 math attention (docs/decisions.md, "torch.compile")
        return reference.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, scale, enable_gqa)
    if ops._under_functorch(op):
        return reference.scaled_dot_product_attention_math(q, k, v, attn_mask, is_causal, scale, enable_gqa)
    if ops._via_custom_op(q, k, v, attn_mask):
        return torch_ops.sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return ops._sdpa_fwd(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, memo=key)


_FP8 = reference.FP8_DTYPES
_SCALED_OUT = (torch.bfloat16, torch.float16, torch.float32) + _FP8


def scaled_mm(a, b, scale_a, scale_b, bias=None, activation=None, residual=None, out_dtype=torch.bfloat16,
              scale_result=None, return_amax=False, *, negative_slope=0.01):
    """FP8 ``act((a * scale_a) @ (b * scale_b) + bias + residual)``, cast to ``out_dtype``.

    As torch._scaled_mm: ``a`` [..., M, K] and ``b`` [..., K, N] (or [K, N]) are float8_e4m3fn or
    float8_e5m2 (not both e5m2), K and N multiples of 16; ``scale_a`` / ``scale_b`` dequantize (the real
    value of ``a`` is ``a.float() * scale_a``): float32, one element each, or rowwise ``(M, 1)`` /
    ``(1, N)`` for 2-D operands with a bfloat16 output. ``bias``: [N]; ``residual``: the output's shape
    or one that broadcasts to it. An FP8 ``out_dtype`` gives ``result * scale_result`` (float32, one
    element, default 1) saturated to the format's largest value, then rounded; ``return_amax`` also
    returns max |result| before ``scale_result`` (float32, 0-dim). On a GPU of compute capability 8.9 or
    newer it runs cuBLASLt's FP8 GEMM with as much of the epilogue as its kernel takes (fp8_gemm.py);
    on an older GPU, or with a batched ``b``, the dequantized operands through ``matmul`` in bfloat16
    (one logged reason); on the CPU the float32 reference.
    """
    op = "scaled_mm"
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor of an FP8 dtype (CuPy has none), got "
                            f"{type(t).__name__}")
        if t.dtype not in _FP8:
            raise ArgumentError(f"{op}: {name} must be float8_e4m3fn or float8_e5m2, got {name}.dtype={t.dtype}")
    if a.dtype == b.dtype == torch.float8_e5m2:
        raise ArgumentError(f"{op}: a and b cannot both be float8_e5m2 (one of them must be float8_e4m3fn)")
    for name, t in (("scale_a", scale_a), ("scale_b", scale_b)):  # required, unlike the operands after them
        ops._check_tensor(name, t, op)
    ops._check_devices(op, "a", a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias, residual=residual,
                       scale_result=scale_result)
    ops._check_flag(op, "return_amax", return_amax)
    if a.dim() < 2 or b.dim() < 2:
        raise ArgumentError(f"{op}: a and b must have at least 2 dimensions, got a.shape={tuple(a.shape)}, "
                            f"b.shape={tuple(b.shape)}")
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    if b.shape[-2] != K:
        raise ArgumentError(f"{op}: a.shape={tuple(a.shape)} and b.shape={tuple(b.shape)} do not multiply "
                            f"(K={K} against {b.shape[-2]})")
    if K % 16 or N % 16:
        raise ArgumentError(f"{op}: K and N must be multiples of 16 (FP8 GEMMs), got K={K}, N={N}")
    if not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"{op}: out_dtype must be a torch.dtype, got {type(out_dtype).__name__} ({out_dtype!r})")
    if out_dtype not in _SCALED_OUT:
        raise ArgumentError(f"{op}: out_dtype must be one of {', '.join(str(d) for d in _SCALED_OUT)}, "
                            f"got out_dtype={out_dtype!r}")
    _check_scales(op, a, b, scale_a, scale_b, scale_result, out_dtype)
    if bias is not None and tuple(bias.shape) != (N,):
        raise ArgumentError(f"{op}: bias must have shape ({N},), got bias.shape={tuple(bias.shape)}")
    try:
        out_shape = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])) + (M, N)
    except RuntimeError:
        raise ArgumentError(f"{op}: the batch dimensions of a.shape={tuple(a.shape)} and b.shape={tuple(b.shape)} "
                            "do not broadcast") from None
    if residual is not None:
        try:
            if torch.broadcast_shapes(residual.shape, out_shape) != out_shape:
                raise RuntimeError
        except RuntimeError:
            raise ArgumentError(f"{op}: residual.shape={tuple(residual.shape)} does not broadcast to the output "
                                f"{tuple(out_shape)}") from None
    activation, negative_slope = canonical_activation(activation, negative_slope, op)
    args = (bias, activation, residual, out_dtype, scale_result, return_amax, negative_slope)
    rec = None if _is_compiling() else manifest.active()  # a traced call records nothing (its sizes are symbols)
    if rec is not None and b.dim() == 2 and scale_a.numel() == scale_b.numel() == 1:  # what cuBLASLt would plan
        rec.add(fp8_gemm.spec_of(a.reshape(-1, K), b, bias, activation, residual, out_dtype, return_amax,
                                 negative_slope))
    if not a.is_cuda:
        return reference.scaled_mm(a, b, scale_a, scale_b, *args)
    if not fp8_gemm.fp8_capable(a.device):
        ops._fallback(op, "FP8 GEMMs need compute capability 8.9 or newer: the dequantized operands run the "
                          "bfloat16 matmul")
        return _scaled_mm_bf16(a, b, scale_a, scale_b, *args)
    if b.dim() > 2:
        ops._fallback(op, "a batched b: the dequantized operands run the bfloat16 matmul")
        return _scaled_mm_bf16(a, b, scale_a, scale_b, *args)
    M2 = a.numel() // K
    res2 = None if residual is None else residual.expand(out_shape).reshape(M2, N)
    gemm = fp8_gemm.scaled_mm_op if _is_compiling() else fp8_gemm.scaled_mm_2d
    out, am = gemm(a.reshape(M2, K), b, scale_a, scale_b, bias, activation, res2, out_dtype, scale_result,
                   return_amax, negative_slope)
    out = out.reshape(out_shape)
    return (out, am) if return_amax else out


def _check_scales(op, a, b, scale_a, scale_b, scale_result, out_dtype) -> None:
    """scale_a and scale_b: float32, one element or rowwise ((M, 1), (1, N)) with 2-D operands and a bfloat16
    output, as torch's; scale_result: one float32 element, for an FP8 output only."""
    rowwise = {"scale_a": (a.shape[-2], 1), "scale_b": (1, b.shape[-1])}
    for name, t in (("scale_a", scale_a), ("scale_b", scale_b)):
        if t.dtype != torch.float32:
            raise ArgumentError(f"{op}: {name} must be float32, got {name}.dtype={t.dtype}")
        if t.numel() != 1 and not (tuple(t.shape) == rowwise[name] and a.dim() == b.dim() == 2
                                   and out_dtype == torch.bfloat16):
            raise ArgumentError(f"{op}: {name} must have one element, or be rowwise {rowwise[name]} with 2-D "
                                f"operands and a bfloat16 output, got {name}.shape={tuple(t.shape)}")
    if scale_result is not None:
        if out_dtype not in _FP8:
            raise ArgumentError(f"{op}: scale_result applies to an FP8 output only, got out_dtype={out_dtype}")
        if scale_result.dtype != torch.float32 or scale_result.numel() != 1:
            raise ArgumentError(f"{op}: scale_result must be a float32 tensor of one element, got "
                                f"dtype={scale_result.dtype}, shape={tuple(scale_result.shape)}")


def _scaled_mm_bf16(a, b, scale_a, scale_b, bias, activation, residual, out_dtype, scale_result, return_amax,
                    negative_slope):
    """Dequantize (FP8 values are exact in bfloat16), run cf's bfloat16 matmul with the epilogue and its
    amax, then cast as the reference does."""
    bf = torch.bfloat16
    y, am = matmul((a.to(bf) * scale_a.to(bf)), (b.to(bf) * scale_b.to(bf)), None if bias is None else bias.to(bf),
                   activation, None if residual is None else residual.to(bf), True, negative_slope=negative_slope)
    out = reference.fp8_cast(y.float(), out_dtype, scale_result) if out_dtype in _FP8 else y.to(out_dtype)
    return (out, am) if return_amax else out


def scaled_dot_product_attention_fp8(q, k, v, descale_q, descale_k, descale_v, *, descale_s=None, scale_s=None,
                                     is_causal=False, scale=None, scale_o=None):
    """FP8 attention: (o, amax_o) from FP8 ``q``, ``k``, ``v`` [B, H, S, D] of one format (k and v may
    have fewer heads, dividing q's) and their float32 dequantization factors (one element each). The
    probabilities are quantized with ``scale_s`` (default: the format's largest value) and dequantized
    with ``descale_s`` (default its inverse); o is O · ``scale_o`` (default 1) in q's format, saturated;
    amax_o = max |O| before ``scale_o``. ``scale`` defaults to 1/sqrt(D); ``is_causal`` masks the top-left
    triangle. Runs cuDNN's FP8 attention graph on a GPU of compute capability 9.0 or newer
    (fp8_attention.py); where cuDNN declines the graph, or on an older GPU, the dequantized operands
    through cf's bfloat16 attention (logged once), whose probabilities are not quantized; the float32
    reference on the CPU.
    """
    op = "scaled_dot_product_attention_fp8"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor of an FP8 dtype, got {type(t).__name__}")
        if t.dtype not in _FP8:
            raise ArgumentError(f"{op}: {name} must be float8_e4m3fn or float8_e5m2, got {name}.dtype={t.dtype}")
        if t.dim() != 4:
            raise ArgumentError(f"{op}: {name} must be 4-D [B, H, S, D], got {name}.shape={tuple(t.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise ArgumentError(f"{op}: q, k and v must share one FP8 format, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, t in (("descale_q", descale_q), ("descale_k", descale_k), ("descale_v", descale_v)):
        ops._check_tensor(name, t, op)  # required, unlike the scales after them
    ops._check_devices(op, "q", q, k=k, v=v, descale_q=descale_q, descale_k=descale_k, descale_v=descale_v,
                       descale_s=descale_s, scale_s=scale_s, scale_o=scale_o)
    (B, H, _, D), (Bk, Hk, _, Dk) = q.shape, k.shape
    if Bk != B or v.shape[0] != B or Dk != D or k.shape[:3] != v.shape[:3] or Hk == 0 or H % Hk:
        raise ArgumentError(f"{op}: q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)} "
                            "do not match (one batch, k's head size q's, k and v one sequence, k's heads dividing q's)")
    for name, t in (("descale_q", descale_q), ("descale_k", descale_k), ("descale_v", descale_v),
                    ("descale_s", descale_s), ("scale_s", scale_s), ("scale_o", scale_o)):
        if t is not None and (t.dtype != torch.float32 or t.numel() != 1):
            raise ArgumentError(f"{op}: {name} must be a float32 tensor of one element, got "
                                f"dtype={t.dtype}, shape={tuple(t.shape)}")
    ops._check_flag(op, "is_causal", is_causal)
    if scale is not None:
        scale = ops._float_arg(op, "scale", scale)
    rec = None if _is_compiling() else manifest.active()
    if rec is not None:  # the graph a Hopper GPU would build
        rec.add(fp8_attention.spec_of(q, k, v, is_causal, float(scale) if scale is not None else 1.0 / math.sqrt(D)))
    if not q.is_cuda:
        return reference.scaled_dot_product_attention_fp8(q, k, v, descale_q, descale_k, descale_v, descale_s,
                                                          scale_s, is_causal, scale, scale_o)
    if fp8_attention.fp8_attention_capable(q.device):
        fmax = torch.finfo(q.dtype).max
        full = (lambda t, x: t if t is not None else fp8_gemm.constant(q.device, x))
        ss = full(scale_s, fmax)
        args = (q, k, v, descale_q, descale_k, descale_v, full(descale_s, 1.0 / fmax), ss, full(scale_o, 1.0),
                bool(is_causal), float(scale) if scale is not None else 1.0 / math.sqrt(D))
        return tuple(fp8_attention.attention_op(*args) if _is_compiling() else fp8_attention.attention(*args))
    ops._fallback(op, "FP8 attention needs compute capability 9.0: the dequantized operands run the bfloat16 "
                      "attention")
    bf = torch.bfloat16
    o = scaled_dot_product_attention(q.to(bf) * descale_q.to(bf), k.to(bf) * descale_k.to(bf),
                                     v.to(bf) * descale_v.to(bf), is_causal=is_causal, scale=scale,
                                     enable_gqa=Hk != H).float()
    return reference.fp8_cast(o, q.dtype, scale_o), reference.amax(o)


# Each op called anew with its four operands and its attributes as _front hands them back.

def _conv2d_again(x, weight, bias, residual, attrs):
    stride, padding, dilation, groups, activation, return_amax, negative_slope = attrs
    return conv2d(x, weight, bias, stride, padding, dilation, groups, activation, residual, return_amax,
                  negative_slope=negative_slope)


def _matmul_again(a, b, bias, residual, attrs):
    activation, return_amax, negative_slope = attrs
    return matmul(a, b, bias, activation, residual, return_amax, negative_slope=negative_slope)


def _linear_again(x, weight, bias, residual, attrs):
    activation, return_amax, negative_slope = attrs
    return linear(x, weight, bias, activation, residual, return_amax, negative_slope=negative_slope)


def _sdpa_again(q, k, v, attn_mask, attrs):
    dropout_p, is_causal, scale, enable_gqa = attrs
    return scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
