"""PyTorch implementations of every op: the fallback path and the tests' oracle.

The epilogue is computed in float32 (at least) and rounded once to the output
dtype, as the fused cuDNN graph does; for float32/float64 that is torch's own
arithmetic.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .spec import canonical_activation, contiguous_strides

_ACT = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "silu": F.silu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
}


def activation(z: torch.Tensor, name: Optional[str], negative_slope: float = 0.01) -> torch.Tensor:
    if name is None:
        return z
    if name == "leaky_relu":
        return F.leaky_relu(z, negative_slope)
    fn = _ACT.get(name) if isinstance(name, str) else None
    if fn is None:  # another spelling ("ReLU", nn.GELU(), set on a module after its construction), or an
        name, negative_slope = canonical_activation(name, negative_slope, strict=False)  # unknown one: named
        return activation(z, name, negative_slope)
    return fn(z)


def amax(y: torch.Tensor) -> torch.Tensor:
    """max |y| as a float32 0-dim tensor; 0 for an empty y (nothing to scale);
    NaN propagates like torch.amax."""
    if y.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=y.device)
    return y.detach().abs().amax().to(torch.float32)


def epilogue(z, bias=None, residual=None, act=None, negative_slope=0.01, return_amax=False, bias_shape=None,
             out_dtype=None, owned=False):
    """y = act(z + bias + residual) rounded once to ``out_dtype`` (default: z's dtype); optionally (y, amax).

    ``bias_shape`` reshapes a 1-D bias to broadcast against z (e.g. [1, C, 1, 1]).
    ``owned``: z is a fresh tensor no one else holds (the CPU conv's output): the adds and a ReLU or
    leaky ReLU then run in place on it, the same arithmetic with no new tensor a step, unless autograd
    records these operations or the residual would broadcast z to a larger shape.
    """
    out_dtype = out_dtype or z.dtype
    acc = torch.promote_types(out_dtype, torch.float32)
    t = z.to(acc)
    inplace = owned and (residual is None or isinstance(residual, torch.Tensor) and residual.shape == t.shape) \
        and not (torch.is_grad_enabled() and any(v is not None and v.requires_grad for v in (z, bias, residual)))
    if bias is not None:
        b = (bias.reshape(bias_shape) if bias_shape is not None else bias).to(acc)
        t = t.add_(b) if inplace else t + b
    if residual is not None:
        t = t.add_(residual.to(acc)) if inplace else t + residual.to(acc)
    if inplace and act == "relu":
        t = t.relu_()
    elif inplace and act == "leaky_relu":
        t = F.leaky_relu(t, negative_slope, inplace=True)
    else:
        t = activation(t, act, negative_slope)
    y = t.to(out_dtype)
    return (y, amax(y)) if return_amax else y


def _cpu_16bit(t) -> bool:
    """16-bit on the CPU: torch rounds the product to 16 bits before it adds a bias (a batched
    linear; the CPU conv, whose bias crashes on some channels_last inputs, adds it after) or cf's
    epilogue adds the residual, which cancels digits where z + bias is near 0 (ReLU masks
    flipped against float64 in tests), so the CPU computes in float32 and rounds once, as the
    fused graph does. CUDA keeps its 16-bit kernels (a fallback there must stay fast)."""
    return not t.is_cuda and t.dtype in (torch.float16, torch.bfloat16)


def _one_zero_channel(x, weight, groups):
    """x and weight of a conv with no input channels, given one channel of zeros a group: the same sum (0),
    which torch's conv then computes with the output's K channels. On no input channels torch 2.13's CPU
    conv returns [N, 0, P, Q] (its K from the empty input). The pads keep autograd's path to x and weight
    (their gradients: empty)."""
    return F.pad(x, (0, 0, 0, 0, 0, groups)), F.pad(weight, (0, 0, 0, 0, 0, 1))


def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, activation=None, residual=None,
           return_amax=False, negative_slope=0.01):
    if weight.dim() == 4 and weight.shape[1] == 0:
        x, weight = _one_zero_channel(x, weight, groups)
    if x.is_cuda:
        # the bias inside the conv is added before the 16-bit rounding (where z + bias cancels,
        # rounding z first would cost all its digits); torch 2.13's CPU conv with a bias crashes
        # on some channels_last inputs, so the CPU adds it after, in float32 (below)
        z = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
        shape = (-1, 1, 1) if z.dim() == 3 else (1, -1, 1, 1)
        return epilogue(z, None, residual, activation, negative_slope, return_amax, bias_shape=shape)
    shape = (-1, 1, 1) if x.dim() == 3 else (1, -1, 1, 1)
    if _cpu_16bit(x):  # convolve in float32, round once after bias and residual
        z = _cpu_conv(x.float(), weight.float(), stride, padding, dilation, groups)
        return epilogue(z, bias, residual, activation, negative_slope, return_amax, bias_shape=shape,
                        out_dtype=x.dtype, owned=True)
    z = _cpu_conv(x, weight, stride, padding, dilation, groups)  # a fresh tensor: the epilogue runs in place on it
    return epilogue(z, bias, residual, activation, negative_slope, return_amax, bias_shape=shape, owned=True)


def _cpu_conv(x, weight, stride, padding, dilation, groups):
    """The CPU convolution, on NCHW operands, its output in the layout torch's conv gives these
    operands. torch 2.13's CPU (oneDNN) conv crashes on some channels_last operands: with a bias,
    and the weight gradient of a float32 1x1 stride-2 conv of a [3, 8, 16, 16] input corrupts the
    heap ("malloc(): unaligned tcache chunk", a segfault; tests/test_reference.py runs it in a
    subprocess) when either operand has channels_last strides, including a 1x1 weight whose
    strides say channels_last while is_contiguous() is true. optimize() made a conv's weight
    channels_last, so a float32 CPU training step of a plain NCHW model reached it; it no longer does
    on the CPU (cudnn_fuse.nn.weight_format), so NCHW operands reach torch here with no copy."""
    fmt = conv_format(x, weight)
    z = F.conv2d(nchw(x), nchw(weight), None, stride, padding, dilation, groups)
    return z if fmt is None else z.contiguous(memory_format=fmt)


def nchw(t):
    """``t`` with the standard (row-major) strides, copied only when it has other ones."""
    return t if t.stride() == _row_major_strides(t.shape) else t.clone(memory_format=torch.contiguous_format)


def _row_major_strides(shape) -> tuple:
    """spec.contiguous_strides without its ``int()``: under torch.compile the CPU backward formulas
    (torch_ops._conv2d_products_torch) are traced on symbolic sizes, and ``int()`` of one
    specialized it to its value (a recompile for every new batch or image size; with
    ``mark_dynamic`` or ``torch.export``'s dynamic dims, a ConstraintViolationError)."""
    if all(type(n) is int for n in shape):
        return contiguous_strides(shape)
    if torch.jit.is_tracing():  # sizes are 0-dim tensors there, and a jit trace keeps the values it saw
        return contiguous_strides(tuple(int(n) for n in shape))
    strides, acc = [], 1
    for n in reversed(tuple(shape)):
        strides.append(acc)
        acc *= torch.sym_max(n, 1)
    return tuple(reversed(strides))


def is_channels_last(t) -> bool:
    """A 4-D tensor strided channels_last and not also contiguous."""
    return t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


def conv_format(x, weight):
    """torch.channels_last where torch's CPU conv returns a channels_last output for these operands
    (either batched 4-D operand channels_last, ``is_channels_last``), else None;
    tests/test_reference.py checks it against torch's own choice."""
    return torch.channels_last if x.dim() == 4 and (is_channels_last(x) or is_channels_last(weight)) else None


def conv2d_padded(x, weight, bias, stride, pre, post, dilation, groups, activation=None, residual=None,
                  return_amax=False, negative_slope=0.01):
    """conv2d with (pre, post) padding per spatial dim (asymmetric for 'same' with even kernels)."""
    if tuple(pre) == tuple(post):
        return conv2d(x, weight, bias, stride, tuple(pre), dilation, groups, activation, residual, return_amax,
                      negative_slope)
    xp = F.pad(x, (pre[1], post[1], pre[0], post[0]))
    return conv2d(xp, weight, bias, stride, 0, dilation, groups, activation, residual, return_amax, negative_slope)


def linear(x, weight, bias=None, activation=None, residual=None, return_amax=False, negative_slope=0.01):
    if _cpu_16bit(x):
        z = F.linear(x.float(), weight.float(), bias.float() if bias is not None else None)
        return epilogue(z, None, residual, activation, negative_slope, return_amax, out_dtype=x.dtype)
    z = F.linear(x, weight, bias)  # the GEMM adds the bias before rounding
    if activation is None and residual is None and not return_amax:
        return z  # nothing to add: no float32 round trip (two passes over z)
    return epilogue(z, None, residual, activation, negative_slope, return_amax)


def linear_save_z(x, weight, bias=None, act=None, residual=None, negative_slope=0.01):
    """(y, z): z = x @ weight.T + bias + residual rounded to x's dtype, and y = act of that rounded z
    (in float32 for 16 bits, then rounded): what the GPU's keep-z graph computes (cuDNN's graph reads
    the 16-bit z it writes: tests/test_gpu_backward.py
    test_the_kept_z_forward_rounds_z_before_the_activation) and what eager ``nn.Linear`` -> activation
    computes. The inference call (``linear``, no z kept) rounds once instead, so the two differ by the
    rounding of z, and where z overflows to -inf, GELU and SiLU give NaN here and -0.0 there."""
    z = linear(x, weight, bias, None, residual).contiguous()
    if _cpu_16bit(x):
        return activation(z.float(), act, negative_slope).to(x.dtype), z
    return activation(z, act, negative_slope), z


def matmul(a, b, bias=None, activation=None, residual=None, return_amax=False, negative_slope=0.01):
    if _cpu_16bit(a):
        z = torch.matmul(a.float(), b.float())
        return epilogue(z, bias, residual, activation, negative_slope, return_amax, out_dtype=a.dtype)
    if bias is not None and b.dim() == 2 and a.dim() >= 2:
        z = F.linear(a, b.t(), bias)  # bias added inside the GEMM, before rounding
        bias = None
    else:
        z = torch.matmul(a, b)
    return epilogue(z, bias, residual, activation, negative_slope, return_amax)


# torch >= 2.5 takes enable_gqa (a builtin has no signature to inspect; its docstring names it)
_TORCH_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if enable_gqa and q.dim() >= 3 and k.size(-3) != q.size(-3):
        if _TORCH_GQA and attn_mask is None and k.size(-1) == v.size(-1) <= 256:
            # torch's own GQA reads k/v once per group, with no copy: it ran the same cuDNN kernel as the
            # expanded form in about 0.6x the time (docs/decisions.md), also under torch.compile, which
            # traces this function for cf's
            # SDPA. With a mask, or head dims flash cannot take, some torch versions send enable_gqa to the
            # math kernel (transformers' sdpa integration draws the same line), so those expand by hand.
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                                  enable_gqa=True)
        rep = q.size(-3) // k.size(-3)
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale)


def scaled_dot_product_attention_math(q, k, v, attn_mask, is_causal, scale, enable_gqa):
    """scaled_dot_product_attention (no dropout) on torch's math kernel: torch's fused kernels have
    neither forward AD (jvp) nor a derivative of their backward (double backward)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, scale, enable_gqa)


# torch's own expressions, for operands of dtypes the fused ops do not take (integers, complex numbers,
# mixed dtypes): torch's type promotion gives the result's dtype, and whatever torch refuses (a float16
# bias in a float32 conv, GELU of integers) raises torch's own error.

def _torch_epilogue(z, residual, act, negative_slope, return_amax):
    y = activation(z if residual is None else z + residual, act, negative_slope)
    return (y, amax(y)) if return_amax else y


def conv2d_torch(x, weight, bias, stride, pre, post, dilation, groups, act=None, residual=None, return_amax=False,
                 negative_slope=0.01):
    """``act(F.conv2d(x, weight, bias) + residual)`` as torch computes it (on the CPU, on NCHW operands:
    torch 2.13's CPU conv crashes on some channels_last ones, _cpu_conv; the output takes the layout
    torch gives the operands)."""
    if tuple(pre) != tuple(post):
        x = F.pad(x, (pre[1], post[1], pre[0], post[0]))
        pre = (0, 0)
    if weight.dim() == 4 and weight.shape[1] == 0:
        x, weight = _one_zero_channel(x, weight, groups)
    fmt = None
    if not x.is_cuda:
        fmt = conv_format(x, weight)
        x, weight = nchw(x), nchw(weight)
    z = F.conv2d(x, weight, bias, stride, tuple(pre), dilation, groups)
    if fmt is not None:
        z = z.contiguous(memory_format=fmt)
    return _torch_epilogue(z, residual, act, negative_slope, return_amax)


def linear_torch(x, weight, bias=None, act=None, residual=None, return_amax=False, negative_slope=0.01):
    """``act(F.linear(x, weight, bias) + residual)`` as torch computes it."""
    return _torch_epilogue(F.linear(x, weight, bias), residual, act, negative_slope, return_amax)


def matmul_torch(a, b, bias=None, act=None, residual=None, return_amax=False, negative_slope=0.01):
    """``act(torch.matmul(a, b) + bias + residual)`` as torch computes it."""
    z = torch.matmul(a, b)
    return _torch_epilogue(z if bias is None else z + bias, residual, act, negative_slope, return_amax)


def conv2d_plain(x, weight, bias, stride, pre, post, dilation, groups, act=None, residual=None,
                 return_amax=False, negative_slope=0.01):
    """conv2d_padded as torch's own ops write it, with no layout handling: what runs under a
    torch.func transform (vmap can neither query nor make a channels_last layout)."""
    if tuple(pre) != tuple(post):
        x = F.pad(x, (pre[1], post[1], pre[0], post[0]))
        pre = (0, 0)
    if weight.shape[-3] == 0:
        x, weight = _one_zero_channel(x, weight, groups)
    z = F.conv2d(x, weight, bias, stride, tuple(pre), dilation, groups)
    y = activation(z if residual is None else z + residual, act, negative_slope)
    return (y, amax(y)) if return_amax else y


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_activation = activation  # scaled_mm's argument of that name hides the function there


def fp8_cast(r: torch.Tensor, dtype, scale=None) -> torch.Tensor:
    """``r * scale`` saturated to ±dtype's largest finite value, then rounded to ``dtype`` (torch's own
    cast turns out-of-range values into NaN for e4m3fn); NaN stays NaN."""
    if scale is not None:
        r = r * scale
    big = torch.finfo(dtype).max
    return r.clamp(-big, big).to(dtype)


def scaled_mm(a, b, scale_a, scale_b, bias=None, activation=None, residual=None, out_dtype=torch.bfloat16,
              scale_result=None, return_amax=False, negative_slope=0.01):
    """``act((a * scale_a) @ (b * scale_b) + bias + residual)`` in float32 from FP8 ``a`` and ``b`` (the
    scales dequantize, as torch._scaled_mm's do), then cast to ``out_dtype``: an FP8 output is the result
    times ``scale_result``, saturated and rounded (``fp8_cast``). With ``return_amax`` also max |result|,
    taken before ``scale_result`` (float32, 0-dim)."""
    r = torch.matmul(a.float() * scale_a.float(), b.float() * scale_b.float())
    if bias is not None:
        r = r + bias.float()
    if residual is not None:
        r = r + residual.float()
    r = _activation(r, activation, negative_slope)
    y = fp8_cast(r, out_dtype, None if scale_result is None else scale_result.float()) \
        if out_dtype in FP8_DTYPES else r.to(out_dtype)
    return (y, amax(r)) if return_amax else y


def scaled_dot_product_attention_fp8(q, k, v, descale_q, descale_k, descale_v, descale_s=None, scale_s=None,
                                     is_causal=False, scale=None, scale_o=None):
    """FP8 attention as cuDNN's FP8 graph computes it, in float32: q, k, v dequantized, softmax(q kᵀ ·
    scale) quantized to ``q``'s FP8 format with ``scale_s`` (default: the format's largest value, P
    lying in [0, 1]) and dequantized with ``descale_s`` (default its inverse), times v. Returns
    (o, amax_o): o = O · ``scale_o`` (default 1) cast to ``q``'s format (``fp8_cast``), amax_o = max |O|
    before ``scale_o`` (float32, 0-dim). Heads of k and v may divide q's (grouped-query attention)."""
    fmt = q.dtype
    qf, kf, vf = (t.float() * d.float() for t, d in ((q, descale_q), (k, descale_k), (v, descale_v)))
    if kf.shape[-3] != qf.shape[-3]:
        rep = qf.shape[-3] // kf.shape[-3]
        kf, vf = kf.repeat_interleave(rep, dim=-3), vf.repeat_interleave(rep, dim=-3)
    s = (qf @ kf.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if is_causal:
        keep = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=-1)
    big = torch.finfo(fmt).max
    scale_s = torch.tensor(big, device=q.device) if scale_s is None else scale_s.float()
    descale_s = 1.0 / scale_s if descale_s is None else descale_s.float()
    p = fp8_cast(p, fmt, scale_s).float() * descale_s
    o = p @ vf
    return fp8_cast(o, fmt, None if scale_o is None else scale_o.float()), amax(o)
