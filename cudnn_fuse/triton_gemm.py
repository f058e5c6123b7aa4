"""The kept-pre-activation MLP's two GEMMs with their elementwise pass in the epilogue, in Triton
(nn.FusedMLP's node with ``CUDNN_FUSE_MLP_KERNELS=triton``).

Eager runs, per Linear -> GELU -> Linear block, the first layer's GEMM then GELU's forward (read z,
write y), and in the backward the second layer's data-gradient GEMM dY @ W2 then gelu_backward
(read the product and z, write dz) then the first layer's bias-gradient column sum (read dz). Here:

- ``linear_act``: z = x @ W1^T + b1 and y = act(z) written by one GEMM (z is never re-read);
- ``matmul_act_grad``: dz = act'(z) * (dY @ W2) and dz's column sums (the first layer's bias
  gradient) from one GEMM: the product is never stored, dz never re-read.

cuDNN's fused engines do the same but lose to cuBLAS's GEMMs at the MLP's shapes on the H200
(docs/decisions.md); cuBLASLt's GELU epilogues compute the tanh form only. The elementwise math is
aten's (cudnn_fuse._triton_kernels: float32, libdevice), applied to the 16-bit rounded z or
product exactly as eager applies it to the tensor it wrote, so the results differ from eager's only
by the GEMM's accumulation order. The column sums are float32 partials per tile row, summed in a
fixed order (deterministic).

Declined (the caller runs torch's kernels): the CPU, dtypes other than fp16/bf16, activations
other than ``ACTS``, operands without a unit stride or of 2**31 elements or more, torch.compile
tracing, and a specialization not compiled yet during CUDA graph capture. A missing Triton or a
failing kernel logs one warning and torch's kernels run from then on.
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import triton_act

log = logging.getLogger(__name__)

ACTS = triton_act.ACTS
_DTYPES = (torch.float16, torch.bfloat16)
_MAX = 2 ** 31  # elements per operand: the kernels' row offsets into A and B are 32-bit

# (BM, BN, BK, GROUP_M, stages, warps)
FWD_CONFIG = (128, 256, 64, 8, 3, 8)
BWD_CONFIG = (128, 256, 64, 8, 3, 8)


def _parse_config(var: str, default: tuple) -> tuple:
    """A launch configuration from ``var`` ("128,256,64,8,3,8": tile M, N, K, group, stages,
    warps; the tiles and warps powers of two), else ``default``; a malformed one is logged and
    ignored."""
    raw = os.environ.get(var, "").strip()
    if not raw:
        return default
    try:
        cfg = tuple(int(v) for v in raw.split(","))
        if len(cfg) != 6 or min(cfg) < 1 or any(v & (v - 1) for v in cfg[:3] + cfg[5:]) or min(cfg[:3]) < 16:
            raise ValueError("want 6 positive integers: tiles (>= 16) and warps powers of two")
        return cfg
    except ValueError as e:
        log.warning("%s=%r ignored (%s); using %s", var, raw, e, default)
        return default


FWD_CONFIG = _parse_config("CUDNN_FUSE_TRITON_GEMM_FWD", FWD_CONFIG)
BWD_CONFIG = _parse_config("CUDNN_FUSE_TRITON_GEMM_BWD", BWD_CONFIG)
_kernels = None  # (linear_act, matmul_act_grad) once built; False once Triton proved unusable
_launched = set()
stats = {"forward": 0, "backward": 0, "declined": 0}


def _build():
    from . import _triton_gemm_kernels as k
    return k.linear_act_kernel, k.matmul_act_grad_kernel


def _get():
    global _kernels
    if _kernels is None:
        try:
            _kernels = _build()
        except Exception as e:  # noqa: BLE001 - no Triton, or one that cannot build these: torch's kernels
            log.warning("CUDNN_FUSE_MLP_KERNELS=triton: Triton unusable (%s: %s); torch's kernels run",
                        type(e).__name__, e)
            _kernels = False
    return _kernels or None


def _failed(e: Exception) -> None:
    global _kernels
    log.warning("Triton GEMM kernel failed (%s: %s); torch's kernels run from now on", type(e).__name__, e)
    _kernels = False


def _unit_stride(t: Tensor) -> bool:
    return t.dim() == 2 and 1 in t.stride() and t.numel() < _MAX


def usable(act: Optional[str], *tensors: Optional[Tensor]) -> bool:
    """Whether the kernels take these operands (CUDA, one fp16/bf16 dtype and device, 2-D with a
    unit stride, an activation in ACTS, not traced)."""
    if act not in ACTS:
        return False
    ts = [t for t in tensors if t is not None]
    t0 = ts[0]
    ok = (t0.is_cuda and t0.dtype in _DTYPES and all(t.numel() > 0 for t in ts)
          and all(t.dtype == t0.dtype and t.device == t0.device for t in ts)
          and not torch.compiler.is_compiling())
    if not ok:
        stats["declined"] += 1
        return False
    return _get() is not None


def _may_launch(key: tuple) -> bool:
    """False under CUDA graph capture for a specialization not compiled yet (Triton would compile
    and load a module inside the capture)."""
    if key in _launched or not torch.cuda.is_current_stream_capturing():
        return True
    stats["declined"] += 1
    return False


def _key(kind, act, cfg, flags, tensors, ints) -> tuple:
    """What Triton compiles a kernel for: constexprs, dtype, each pointer's and integer's
    divisibility by 16 (and integers equal to 1)."""
    return (kind, act, cfg, flags, tensors[0].dtype, tuple(t.data_ptr() % 16 == 0 for t in tensors),
            tuple((v % 16 == 0, v == 1) for v in ints))


def _grid(m: int, n: int, cfg: tuple) -> tuple:
    return (-(-m // cfg[0]) * -(-n // cfg[1]),)


def linear_act(x: Tensor, w: Tensor, bias: Optional[Tensor], act: str) -> Optional[Tuple[Tensor, Tensor]]:
    """(y, z) with z = x @ w.T + bias in x's dtype and y = act(z), from one Triton GEMM; x is
    [..., K] (its rows contiguous), w [N, K]. None when declined (the caller runs torch's)."""
    if not usable(act, x, w, bias) or x.dim() < 1 or w.dim() != 2 or x.shape[-1] != w.shape[1]:
        return None
    K = w.shape[1]
    x2 = x.reshape(-1, K)
    N, M = w.shape[0], x2.shape[0]
    if not (_unit_stride(x2) and _unit_stride(w)) or (bias is not None and (bias.shape != (N,) or bias.stride(0) != 1)):
        stats["declined"] += 1
        return None
    cfg = FWD_CONFIG
    code, beta = triton_act._act_id(act)
    ints = (M, N, K, x2.stride(0), x2.stride(1), w.stride(1), w.stride(0), N)
    key = _key("linear_act", act, cfg, bias is not None, (x2, w) + ((bias,) if bias is not None else ()), ints)
    if not _may_launch(key):
        return None
    z = torch.empty((M, N), dtype=x.dtype, device=x.device)
    y = torch.empty_like(z)
    fwd, _ = _kernels
    bm, bn, bk, group, stages, warps = cfg
    try:
        with torch.cuda.device(x.device):
            fwd[_grid(M, N, cfg)](x2, w, bias if bias is not None else z, z, y, *ints,
                                  HAS_BIAS=bias is not None, ACT=code, BETA=beta, BM=bm, BN=bn, BK=bk,
                                  GROUP_M=group, EVEN_K=K % bk == 0, num_stages=stages, num_warps=warps)
    except Exception as e:  # noqa: BLE001
        _failed(e)
        return None
    _launched.add(key)
    stats["forward"] += 1
    shape = tuple(x.shape[:-1]) + (N,)
    return y.view(shape), z.view(shape)


def matmul_act_grad(dy: Tensor, w: Tensor, z: Tensor, act: str, need_db: bool
                    ) -> Optional[Tuple[Tensor, Optional[Tensor]]]:
    """(dz, db) with dz = act'(z) * (dy @ w) (the product rounded to z's dtype first, as eager's mm
    writes it) and db = dz summed over its rows (float32 accumulation, z's dtype) when
    ``need_db``; dy is [..., K], w [K, N] (the next layer's weight in its own layout), z [..., N].
    None when declined."""
    if not usable(act, dy, w, z) or w.dim() != 2 or dy.shape[-1] != w.shape[0] or z.shape[-1] != w.shape[1]:
        return None
    K, N = w.shape
    dy2 = dy.reshape(-1, K)
    z2 = z.reshape(-1, N)
    M = dy2.shape[0]
    if z2.shape[0] != M or not (_unit_stride(dy2) and _unit_stride(w) and z2.is_contiguous() and z2.numel() < _MAX):
        stats["declined"] += 1
        return None
    cfg = BWD_CONFIG
    code, beta = triton_act._act_id(act)
    ints = (M, N, K, dy2.stride(0), dy2.stride(1), w.stride(0), w.stride(1), N)
    key = _key("matmul_act_grad", act, cfg, bool(need_db), (dy2, w, z2), ints)
    if not _may_launch(key):
        return None
    dz = torch.empty((M, N), dtype=z.dtype, device=z.device)
    part = torch.empty((-(-M // cfg[0]), N), dtype=torch.float32, device=z.device) if need_db else dz
    _, bwd = _kernels
    bm, bn, bk, group, stages, warps = cfg
    try:
        with torch.cuda.device(z.device):
            bwd[_grid(M, N, cfg)](dy2, w, z2, dz, part, *ints, SUM=bool(need_db), ACT=code, BETA=beta,
                                  BM=bm, BN=bn, BK=bk, GROUP_M=group, EVEN_K=K % bk == 0,
                                  num_stages=stages, num_warps=warps)
    except Exception as e:  # noqa: BLE001
        _failed(e)
        return None
    _launched.add(key)
    stats["backward"] += 1
    db = part.sum(0).to(z.dtype) if need_db else None
    return dz.view(z.shape), db
