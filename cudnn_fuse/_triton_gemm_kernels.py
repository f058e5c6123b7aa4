"""Triton GEMM kernels of cudnn_fuse.triton_gemm (imported only when Triton is asked for and
importable): a tiled GEMM (fp32 accumulation, grouped tile order for L2 reuse) whose epilogue is
one of the MLP's elementwise passes, so that the pass's tensor is never written and read back.

- ``linear_act_kernel``: z = A @ B + bias, stored in 16 bits, and y = act(z) from that rounded z
  (what eager's addmm then F.gelu compute), both written by the GEMM.
- ``matmul_act_grad_kernel``: dz = act'(z) * (A @ B), the product rounded to 16 bits first (as
  eager's mm writes it), and optionally each tile's column sums of dz (float32 partials, one row
  per tile row, summed by the caller in a fixed order: deterministic).

Its own module, without ``from __future__ import annotations``: Triton reads the ``tl.constexpr``
annotations, which must resolve in this module's globals."""

import triton
import triton.language as tl

from ._triton_kernels import _act, _act_grad


@triton.jit
def _tile(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's (tile row, tile column), GROUP_M tile rows at a time (L2 reuse of B)."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    width = GROUP_M * grid_n
    group_id = pid // width
    first_m = group_id * GROUP_M
    group_m = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % width) % group_m)
    pid_n = (pid % width) // group_m
    return pid_m, pid_n


@triton.jit
def _mainloop(a_ptr, b_ptr, M, N, K, s_am, s_ak, s_bk, s_bn, pid_m, pid_n,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr):
    """acc[BM, BN] = A[rows, :] @ B[:, cols] in float32. Rows and columns past M and N wrap
    around (read valid memory; the epilogue masks them out)."""
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    ram = rm % M
    rbn = rn % N
    rk = tl.arange(0, BK)
    a_ptrs = a_ptr + (ram[:, None] * s_am + rk[None, :] * s_ak)
    b_ptrs = b_ptr + (rk[:, None] * s_bk + rbn[None, :] * s_bn)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            kk = k * BK + rk
            a = tl.load(a_ptrs, mask=kk[None, :] < K, other=0.0)
            b = tl.load(b_ptrs, mask=kk[:, None] < K, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BK * s_ak
        b_ptrs += BK * s_bk
    return acc, rm, rn


@triton.jit
def linear_act_kernel(a_ptr, b_ptr, bias_ptr, z_ptr, y_ptr, M, N, K, s_am, s_ak, s_bk, s_bn, s_cm,
                      HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BETA: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                      EVEN_K: tl.constexpr):
    pid_m, pid_n = _tile(M, N, BM, BN, GROUP_M)
    acc, rm, rn = _mainloop(a_ptr, b_ptr, M, N, K, s_am, s_ak, s_bk, s_bn, pid_m, pid_n, BM, BN, BK, EVEN_K)
    nmask = rn < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    mask = (rm < M)[:, None] & nmask[None, :]
    offs = rm.to(tl.int64)[:, None] * s_cm + rn[None, :]
    z = acc.to(z_ptr.dtype.element_ty)
    tl.store(z_ptr + offs, z, mask=mask)
    y = _act(z.to(tl.float32), ACT, BETA).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs, y, mask=mask)


@triton.jit
def matmul_act_grad_kernel(a_ptr, b_ptr, z_ptr, dz_ptr, part_ptr, M, N, K, s_am, s_ak, s_bk, s_bn, s_cm,
                           SUM: tl.constexpr, ACT: tl.constexpr, BETA: tl.constexpr,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                           EVEN_K: tl.constexpr):
    pid_m, pid_n = _tile(M, N, BM, BN, GROUP_M)
    acc, rm, rn = _mainloop(a_ptr, b_ptr, M, N, K, s_am, s_ak, s_bk, s_bn, pid_m, pid_n, BM, BN, BK, EVEN_K)
    nmask = rn < N
    mask = (rm < M)[:, None] & nmask[None, :]
    offs = rm.to(tl.int64)[:, None] * s_cm + rn[None, :]
    dy = acc.to(dz_ptr.dtype.element_ty).to(tl.float32)  # eager's mm writes the product in 16 bits
    z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dz = _act_grad(dy, z, ACT, BETA).to(dz_ptr.dtype.element_ty)
    tl.store(dz_ptr + offs, dz, mask=mask)
    if SUM:
        s = tl.sum(tl.where(mask, dz.to(tl.float32), 0.0), axis=0)
        tl.store(part_ptr + pid_m.to(tl.int64) * N + rn, s, mask=nmask)
