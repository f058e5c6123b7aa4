"""The Triton kernels of fp8_cast.py: an FP8 cast that also takes its input's amax, writes the transposed
copy and derives its scale, in one pass. Imported only where Triton is (fp8_cast.py falls back to torch's
ops elsewhere)."""

import triton
import triton.language as tl


@triton.jit
def scale_of(scale_ptr, src_ptr, inv_ptr, hist_ptr, big, shrink, first, DERIVE: tl.constexpr,
             HIST: tl.constexpr):
    """The scale to multiply by: loaded, or (DERIVE) fp8_max / amax / 2**margin from the amax at
    src_ptr, the previous scale where that is not finite and positive, in torch's arithmetic (a number
    over a tensor is the number times the tensor's reciprocal: fp8_max * (1 / amax) * 2**-margin). The first program stores it, its reciprocal and (HIST) the amax. Another program may
    read scale_ptr after that store: it then reads the scale it derives itself wherever the previous
    one was kept, so every program multiplies by the same value."""
    s = tl.load(scale_ptr)
    if DERIVE:
        a = tl.load(src_ptr)
        fresh = big * tl.math.div_rn(1.0, a) * shrink
        s = tl.where((a > 0) & (a < float("inf")) & (fresh < float("inf")), fresh, s)
        if first:
            tl.store(scale_ptr, s)
            tl.store(inv_ptr, tl.math.div_rn(1.0, s))
            if HIST:
                tl.store(hist_ptr, a)
    return s

@triton.jit
def cast_amax(x_ptr, y_ptr, amax_ptr, scale_ptr, src_ptr, inv_ptr, hist_ptr, n, big, shrink,
              HAS_SCALE: tl.constexpr, AMAX: tl.constexpr, DERIVE: tl.constexpr, HIST: tl.constexpr,
              BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    nan = x != x
    if AMAX:
        m = tl.max(tl.abs(x), axis=0)
        m = tl.where(tl.max(nan.to(tl.int32), axis=0) > 0, float("nan"), m)  # NaN propagates, as torch.amax
        tl.atomic_max(amax_ptr, m)  # non-negative floats (and NaN above inf) order as their bits
    if HAS_SCALE:
        x = x * scale_of(scale_ptr, src_ptr, inv_ptr, hist_ptr, big, shrink, pid == 0, DERIVE, HIST)
    x = tl.where(nan, x, tl.minimum(tl.maximum(x, -big), big))  # saturate; NaN stays NaN
    tl.store(y_ptr + offs, x.to(y_ptr.dtype.element_ty), mask=mask)

@triton.jit
def cast_transpose_amax(x_ptr, y_ptr, yt_ptr, amax_ptr, scale_ptr, src_ptr, inv_ptr, hist_ptr, rows, cols,
                        stride_x, big, shrink, HAS_SCALE: tl.constexpr, AMAX: tl.constexpr,
                        DERIVE: tl.constexpr, HIST: tl.constexpr, TILE: tl.constexpr):
    pr, pc = tl.program_id(0), tl.program_id(1)
    r = pr.to(tl.int64) * TILE + tl.arange(0, TILE)
    c = pc.to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    x = tl.load(x_ptr + r[:, None] * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
    nan = x != x
    if AMAX:
        m = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        m = tl.where(tl.max(tl.max(nan.to(tl.int32), axis=1), axis=0) > 0, float("nan"), m)
        tl.atomic_max(amax_ptr, m)
    if HAS_SCALE:
        x = x * scale_of(scale_ptr, src_ptr, inv_ptr, hist_ptr, big, shrink, (pr == 0) & (pc == 0), DERIVE,
                         HIST)
    y = tl.where(nan, x, tl.minimum(tl.maximum(x, -big), big)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + r[:, None] * cols + c[None, :], y, mask=mask)
    tl.store(yt_ptr + c[:, None] * rows + r[None, :], tl.trans(y),
             mask=(c[:, None] < cols) & (r[None, :] < rows))
