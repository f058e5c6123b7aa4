"""The FP8 cast that also yields the amax (and, for a GEMM operand, the transposed copy), in one pass over
the tensor (Triton kernels).

``cast_amax(x, fmt, scale)`` returns (``x * scale`` saturated to ±fmt's largest value and rounded to
``fmt``, max |x| as float32): what the FP8 recipes and the split FP8 GEMM need before every cast. In torch
it is four passes over the tensor (|x|, its max, the scaled copy, the clamp and cast); the kernel reads
``x`` once and writes one byte per element, its blocks' maxima combined by an atomic max. Where Triton
is missing (a CPU build of torch) or the tensor is not on a GPU, torch's ops run it.

``cast_scaled`` is a recipe's cast: the kernel also derives the scale from an amax (``fp8_max / amax /
2**margin``, or the previous scale where that amax is 0, inf or NaN), stores it in the module's state,
records the amax and writes the dequantization factor ``1 / scale``, the work of a dozen small torch ops
a cast, each a launch, done by the cast's own first program.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

log = logging.getLogger(__name__)

BLOCK = 4096  # elements per program: each reads 8-16 KB and keeps one running max
TILE = 64  # the cast-and-transpose kernel's square tiles: 64x64 elements per program
_kernel = None  # compiled on first use; False: Triton is not there


def _triton_kernel():
    global _kernel
    if _kernel is None:
        try:
            from . import fp8_kernels
        except Exception as e:  # noqa: BLE001 - no Triton (a CPU build of torch): torch's ops run the cast
            log.info("FP8 cast: Triton unavailable (%s): the cast and its amax run as torch ops", e)
            _kernel = False
            return _kernel
        _kernel = (fp8_kernels.cast_amax, fp8_kernels.cast_transpose_amax)
    return _kernel


def scale_from_amax(amax: torch.Tensor, fmt, margin: int, previous: torch.Tensor) -> torch.Tensor:
    """``fp8_max(fmt) / amax / 2**margin``, or ``previous`` where amax is 0, inf or NaN (float32)."""
    amax, previous = amax.float(), previous.float()
    fresh = torch.finfo(fmt).max / amax / (2.0 ** margin)
    ok = torch.isfinite(amax) & (amax > 0) & torch.isfinite(fresh)
    return torch.where(ok, fresh, previous)


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
    q, _, am, _ = _cast(x, fmt, scale, None, 0, None, False, True)
    return q, am


def cast_transpose_amax(x: torch.Tensor, fmt, scale=None):
    """(the cast of 2-D ``x`` as ``cast_amax`` makes it, its transpose as a contiguous [N, M] tensor, the
    amax), from one read of ``x``: an FP8 GEMM on Hopper wants both operands K-major, so a tensor that is
    the reduction's left operand in one GEMM and its right in another (X, W and dY of a linear) needs
    both layouts."""
    q, qt, am, _ = _cast(x, fmt, scale, None, 0, None, True, True)
    return q, qt, am


def cast_scaled(x: torch.Tensor, fmt, src_amax: torch.Tensor, scale: torch.Tensor, margin: int = 0,
                history: Optional[torch.Tensor] = None, transpose: bool = False, own_amax: bool = True) -> tuple:
    """A recipe's cast: ``x`` cast to ``fmt`` with the scale derived from ``src_amax`` (``scale_from_amax``,
    ``scale``'s value the previous one). ``scale`` (a float32 element of the caller's state) is set to the
    scale used and ``history`` (another, if given) to ``src_amax``. Returns (the cast, its transpose as
    ``cast_transpose_amax`` makes it when ``transpose`` else None, max |x| as float32 when ``own_amax``
    else None, the dequantization factor ``1 / scale`` as a fresh [1] tensor); one kernel on a GPU."""
    return _cast(x, fmt, scale, src_amax, margin, history, transpose, own_amax)


def _torch_cast(x, fmt, scale, src, margin, history, transpose):
    inv = None
    if src is not None:
        s = scale_from_amax(src, fmt, margin, scale)
        scale.copy_(s)
        if history is not None:
            history.copy_(src)
        inv = s.reciprocal().reshape(1)
    q, am = torch_cast_amax(x, fmt, scale)
    return q, q.t().contiguous() if transpose else None, am, inv


def _cast(x, fmt, scale, src, margin, history, transpose, own_amax):
    """(cast, transpose or None, amax or None, dequantization factor or None) of every form above."""
    kernels = _triton_kernel() if x.is_cuda and x.numel() and (x.dim() == 2 or not transpose) else False
    if kernels:
        try:
            return _launch(kernels, x, fmt, scale, src, margin, history, transpose, own_amax)
        except Exception as e:  # noqa: BLE001 - a Triton that cannot compile it: torch's ops, from now on
            _give_up(e)
    q, qt, am, inv = _torch_cast(x, fmt, scale, src, margin, history, transpose)
    return q, qt, am if own_amax else None, inv


def _give_up(e: Exception) -> None:
    global _kernel
    log.warning("FP8 cast: the Triton kernel failed (%s: %s); the casts run as torch ops", type(e).__name__, e)
    _kernel = False


def _launch(kernels, x, fmt, scale, src, margin, history, transpose, own_amax):
    x = x.detach()
    dev = x.device
    if src is None and scale is not None:  # only read: any float dtype or shape of one element
        scale = scale.reshape(()).float()
    am = torch.zeros((), dtype=torch.float32, device=dev) if own_amax else None
    inv = torch.empty(1, dtype=torch.float32, device=dev) if src is not None else None
    # pointers a flag leaves unread still need a tensor: the amax buffer, else the scale
    spare = am if am is not None else scale
    args = (spare if am is None else am, spare if scale is None else scale, spare if src is None else src,
            spare if inv is None else inv, spare if history is None else history)
    flags = dict(HAS_SCALE=scale is not None, AMAX=own_amax, DERIVE=src is not None, HIST=history is not None)
    big, shrink = torch.finfo(fmt).max, 2.0 ** -margin
    if transpose:
        xc = x if x.stride(1) == 1 else x.contiguous()
        rows, cols = xc.shape
        y = torch.empty((rows, cols), dtype=fmt, device=dev)
        yt = torch.empty((cols, rows), dtype=fmt, device=dev)
        grid = (-(-rows // TILE), -(-cols // TILE))
        kernels[1][grid](xc, y, yt, *args, rows, cols, xc.stride(0), big, shrink, **flags, TILE=TILE)
        return y, yt, am, inv
    xc = x if x.is_contiguous() else x.contiguous()
    y = torch.empty(x.shape, dtype=fmt, device=dev)
    n = xc.numel()
    kernels[0][(-(-n // BLOCK),)](xc, y, *args, n, big, shrink, **flags, BLOCK=BLOCK)
    return y, None, am, inv
