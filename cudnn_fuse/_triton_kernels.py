"""Triton kernels of cudnn_fuse.triton_act (imported only when Triton is asked for and importable).

Its own module, without ``from __future__ import annotations``: Triton reads the ``tl.constexpr``
annotations, which must resolve in this module's globals."""

import triton
import triton.language as tl

try:
    from triton.language.extra import libdevice
except ImportError:  # older layouts
    from triton.language.extra.cuda import libdevice


@triton.jit
def _act(z, ACT: tl.constexpr, BETA: tl.constexpr):
    if ACT == 0:  # gelu: x * 0.5 * (1 + erf(x * M_SQRT1_2))
        return z * 0.5 * (1.0 + libdevice.erf(z * 0.7071067811865476))
    elif ACT == 1:  # gelu_tanh: 0.5 * x * (1 + tanh(kBeta * (x + kKappa * x^3)))
        inner = BETA * (z + 0.044715 * (z * z * z))
        return 0.5 * z * (1.0 + libdevice.tanh(inner))
    else:  # silu: x / (1 + exp(-x)), IEEE division as nvcc's
        return libdevice.div_rn(z, 1.0 + libdevice.exp(-z))


@triton.jit
def _act_grad(dy, z, ACT: tl.constexpr, BETA: tl.constexpr):
    if ACT == 0:
        cdf = 0.5 * (1.0 + libdevice.erf(z * 0.7071067811865476))
        pdf = libdevice.exp(-0.5 * z * z) * BETA
        return dy * (cdf + z * pdf)
    elif ACT == 1:
        x_sq = z * z
        x_cube = x_sq * z
        inner = BETA * (z + 0.044715 * x_cube)
        tanh_inner = libdevice.tanh(inner)
        left = 0.5 * z
        right = 1.0 + tanh_inner
        left_derivative = 0.5 * right
        right_derivative = left * (1.0 - tanh_inner * tanh_inner) * (BETA * (1.0 + 3.0 * 0.044715 * x_sq))
        return dy * (left_derivative + right_derivative)
    else:
        sig = libdevice.div_rn(1.0, 1.0 + libdevice.exp(-z))
        return dy * sig * (1.0 + z * (1.0 - sig))


@triton.jit
def forward_kernel(z_ptr, y_ptr, n, ACT: tl.constexpr, BETA: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    z = tl.load(z_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, _act(z, ACT, BETA).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def backward_kernel(dy_ptr, z_ptr, dz_ptr, part_ptr, M, N, rows_per_prog,
                    ACT: tl.constexpr, BETA: tl.constexpr, SUM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    STAGES: tl.constexpr):
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    cmask = cols < N
    row0 = tl.program_id(1).to(tl.int64) * rows_per_prog
    acc = tl.zeros([BM, BN], dtype=tl.float32)  # summed over its rows once, after the loop
    for r in tl.range(0, rows_per_prog, BM, num_stages=STAGES):
        rows = row0 + r + tl.arange(0, BM)
        m = (rows < M)[:, None] & cmask[None, :]
        offs = rows[:, None] * N + cols[None, :]
        dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + offs, mask=m, other=0.0).to(tl.float32)
        dz = _act_grad(dy, z, ACT, BETA).to(dz_ptr.dtype.element_ty)
        tl.store(dz_ptr + offs, dz, mask=m)
        if SUM:
            acc += dz.to(tl.float32)
    if SUM:
        tl.store(part_ptr + tl.program_id(1).to(tl.int64) * N + cols, tl.sum(acc, axis=0), mask=cmask)
