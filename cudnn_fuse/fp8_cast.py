"""The FP8 cast that also yields the amax (and, for a GEMM operand, the transposed copy), in one pass over
the tensor (Triton kernels).

``cast_amax(x, fmt, scale)`` returns (``x * scale`` saturated to ±fmt's largest value and rounded to
``fmt``, max |x| as float32): what the FP8 recipes and the split FP8 GEMM need before every cast. In torch
it is four passes over the tensor (|x|, its max, the scaled copy, the clamp and cast); the kernel reads
``x`` once and writes one byte per element, its blocks' maxima combined by an atomic max. Where Triton
is missing (a CPU build of torch) or the tensor is not on a GPU, torch's ops run it.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

BLOCK = 4096  # elements per program: each reads 8-16 KB and keeps one running max
TILE = 64  # the cast-and-transpose kernel's square tiles: 64x64 elements per program
_kernel = None  # compiled on first use; False: Triton is not there


def _triton_kernel():
    global _kernel
    if _kernel is None:
        try:
            import triton
            import triton.language as tl
        except Exception as e:  # noqa: BLE001 - no Triton (a CPU build of torch): torch's ops run the cast
            log.info("FP8 cast: Triton unavailable (%s): the cast and its amax run as torch ops", e)
            _kernel = False
            return _kernel

        @triton.jit
        def cast_amax(x_ptr, y_ptr, amax_ptr, scale_ptr, n, big, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            nan = x != x
            m = tl.max(tl.abs(x), axis=0)
            m = tl.where(tl.max(nan.to(tl.int32), axis=0) > 0, float("nan"), m)  # NaN propagates, as torch.amax
            tl.atomic_max(amax_ptr, m)  # non-negative floats (and NaN above inf) order as their bits
            if HAS_SCALE:
                x = x * tl.load(scale_ptr)
            x = tl.where(nan, x, tl.minimum(tl.maximum(x, -big), big))  # saturate; NaN stays NaN
            tl.store(y_ptr + offs, x.to(y_ptr.dtype.element_ty), mask=mask)

        @triton.jit
        def cast_transpose_amax(x_ptr, y_ptr, yt_ptr, amax_ptr, scale_ptr, rows, cols, stride_x, big,
                                HAS_SCALE: tl.constexpr, TILE: tl.constexpr):
            r = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
            c = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)
            mask = (r[:, None] < rows) & (c[None, :] < cols)
            x = tl.load(x_ptr + r[:, None] * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
            nan = x != x
            m = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
            m = tl.where(tl.max(tl.max(nan.to(tl.int32), axis=1), axis=0) > 0, float("nan"), m)
            tl.atomic_max(amax_ptr, m)
            if HAS_SCALE:
                x = x * tl.load(scale_ptr)
            y = tl.where(nan, x, tl.minimum(tl.maximum(x, -big), big)).to(y_ptr.dtype.element_ty)
            tl.store(y_ptr + r[:, None] * cols + c[None, :], y, mask=mask)
            tl.store(yt_ptr + c[:, None] * rows + r[None, :], tl.trans(y),
                     mask=(c[:, None] < cols) & (r[None, :] < rows))

        _kernel = (cast_amax, cast_transpose_amax)
    return _kernel


def torch_cast_amax(x: torch.Tensor, fmt, scale=None):
    """The same cast and amax in torch's ops (the reference and the fallback)."""
    big = torch.finfo(fmt).max
    am = torch.linalg.vector_norm(x.detach(), float("inf"), dtype=torch.float32) if x.numel() else \
        torch.zeros((), dtype=torch.float32, device=x.device)
    r = x.detach().to(torch.float32, copy=True)  # one float32 copy, scaled and clamped in place
    if scale is not None:
        r.mul_(scale)
    return r.clamp_(-big, big).to(fmt), am


def cast_amax(x: torch.Tensor, fmt, scale=None):
    """(``x * scale`` saturated and cast to ``fmt``, max |x| before the scale as a float32 0-dim tensor)."""
    kernels = _triton_kernel() if x.is_cuda and x.numel() else False
    if not kernels:
        return torch_cast_amax(x, fmt, scale)
    try:
        return _launch(kernels[0], x, fmt, scale)
    except Exception as e:  # noqa: BLE001 - a Triton that cannot compile it: torch's ops, from now on
        _give_up(e)
        return torch_cast_amax(x, fmt, scale)


def cast_transpose_amax(x: torch.Tensor, fmt, scale=None):
    """(the cast of 2-D ``x`` as ``cast_amax`` makes it, its transpose as a contiguous [N, M] tensor, the
    amax), from one read of ``x``: an FP8 GEMM on Hopper wants both operands K-major, so a tensor that is
    the reduction's left operand in one GEMM and its right in another (X, W and dY of a linear) needs
    both layouts."""
    kernels = _triton_kernel() if x.is_cuda and x.numel() and x.dim() == 2 else False
    if not kernels:
        y, am = torch_cast_amax(x, fmt, scale)
        return y, y.t().contiguous(), am
    x = x.detach()
    xc = x if x.stride(1) == 1 else x.contiguous()
    rows, cols = xc.shape
    y = torch.empty((rows, cols), dtype=fmt, device=x.device)
    yt = torch.empty((cols, rows), dtype=fmt, device=x.device)
    am = torch.zeros((), dtype=torch.float32, device=x.device)
    s = scale.reshape(()).float() if scale is not None else am
    grid = (-(-rows // TILE), -(-cols // TILE))
    try:
        kernels[1][grid](xc, y, yt, am, s, rows, cols, xc.stride(0), torch.finfo(fmt).max,
                         HAS_SCALE=scale is not None, TILE=TILE)
    except Exception as e:  # noqa: BLE001 - a Triton that cannot compile it: torch's ops, from now on
        _give_up(e)
        y, am = torch_cast_amax(x, fmt, scale)
        return y, y.t().contiguous(), am
    return y, yt, am


def _give_up(e: Exception) -> None:
    global _kernel
    log.warning("FP8 cast: the Triton kernel failed (%s: %s); the casts run as torch ops", type(e).__name__, e)
    _kernel = False


def _launch(kernel, x, fmt, scale):
    x = x.detach()
    xc = x if x.is_contiguous() else x.contiguous()
    y = torch.empty(x.shape, dtype=fmt, device=x.device)
    am = torch.zeros((), dtype=torch.float32, device=x.device)
    s = scale.reshape(()).float() if scale is not None else am
    n = xc.numel()
    kernel[(-(-n // BLOCK),)](xc, y, am, s, n, torch.finfo(fmt).max, HAS_SCALE=scale is not None, BLOCK=BLOCK)
    return y, am
