"""The kept-pre-activation MLP's elementwise kernels in Triton: the activation's backward fused
with the bias gradient's column sum, which nn.FusedMLP's node on eager's kernels uses when asked
for; and the activation's forward, which it does not (no faster than aten's on the H200:
bench/elementwise_probe.py times it against aten's, docs/decisions.md).

Eager runs three memory-bound passes per block around its GEMMs: GELU's forward (read z, write
y), gelu_backward (read dy and z, write dz) and the bias gradient's column sum (read dz again).
``act_grad_dbias`` computes dz and its column sums in one pass: it never re-reads dz.

Each element is computed as aten's CUDA kernel computes it (float32 opmath, libdevice's erff and
expf, the same order of operations), so dz and y match eager's bit for bit except where the
compiler contracts a multiply-add differently (last-bit float32 differences that the 16-bit
rounding almost always absorbs). The bias sum accumulates the 16-bit dz in float32, as torch's
sum does, in a fixed order (partial sums per row chunk, then one sum over the chunks), so it is
deterministic.

Switch: ``CUDNN_FUSE_MLP_ELEMENTWISE`` = "torch" (the default: aten's kernels) or "triton". Triton
ships with torch's CUDA wheels on Linux and is imported only when asked for; when it is missing
or a kernel fails, the torch kernels run and one warning is logged. Declined (torch runs): the
CPU, dtypes other than fp16/bf16, mismatched or non-contiguous operands, activations other than
those in ``ACTS``, torch.compile tracing.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Optional, Tuple

import torch
from torch import Tensor

log = logging.getLogger(__name__)

MODE = os.environ.get("CUDNN_FUSE_MLP_ELEMENTWISE", "torch").strip().lower() or "torch"
ACTS = ("gelu", "gelu_tanh", "silu")
_DTYPES = (torch.float16, torch.bfloat16)

_SQRT1_2 = 0.7071067811865476  # M_SQRT1_2
_GELU_BETA = float(torch.tensor(2.0 / math.sqrt(math.pi) * _SQRT1_2 * 0.5, dtype=torch.float32))  # aten's kBeta
_TANH_BETA = float(torch.tensor(math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5, dtype=torch.float32))  # aten's kBeta (tanh)

FWD_CONFIG = (2048, 8)  # elements per program, warps
BWD_CONFIG = (16, 256, 8, 8, 1)  # rows per tile, columns per program, warps, programs per SM, pipeline stages


def _env_config(var: str, default: tuple) -> tuple:
    """A launch configuration from ``var`` ("16,256,8,8,1": powers of two where Triton needs them),
    else ``default``; a malformed value is logged and ignored."""
    raw = os.environ.get(var, "").strip()
    if not raw:
        return default
    try:
        cfg = tuple(int(v) for v in raw.split(","))
        pow2 = cfg[:3] if len(cfg) == 5 else ()
        if len(cfg) != len(default) or min(cfg) < 1 or any(v & (v - 1) for v in pow2):
            raise ValueError("want 5 positive integers, the first three powers of two")
        return cfg
    except ValueError as e:
        log.warning("%s=%r ignored (%s); using %s", var, raw, e, default)
        return default


BWD_CONFIG = _env_config("CUDNN_FUSE_MLP_ELEMENTWISE_CONFIG", BWD_CONFIG)
_kernels = None  # (forward, backward) once built; False once Triton proved unusable
_launched = set()  # specializations already compiled and launched (see _specialization)
stats = {"forward": 0, "backward": 0, "declined": 0}


def _build():
    """Compile-on-first-use Triton kernels (the import is here: Triton is optional)."""
    from . import _triton_kernels as k
    return k.forward_kernel, k.backward_kernel


def _get():
    global _kernels
    if _kernels is None:
        try:
            _kernels = _build()
        except Exception as e:  # noqa: BLE001 - no Triton, or one that cannot build these: torch's kernels
            log.warning("CUDNN_FUSE_MLP_ELEMENTWISE=triton: Triton unusable (%s: %s); aten's kernels run",
                        type(e).__name__, e)
            _kernels = False
    return _kernels or None


def _act_id(act: str) -> Tuple[int, float]:
    return {"gelu": (0, _GELU_BETA), "gelu_tanh": (1, _TANH_BETA), "silu": (2, 0.0)}[act]


def usable(act: Optional[str], *tensors: Tensor) -> bool:
    """Whether the Triton kernels take this call (MODE "triton", CUDA fp16/bf16 contiguous operands
    of one shape and dtype, an activation in ACTS, not traced)."""
    if MODE != "triton" or act not in ACTS:
        return False
    t0 = tensors[0]
    ok = (t0.is_cuda and t0.dtype in _DTYPES and t0.numel() > 0
          and all(t.dtype == t0.dtype and t.shape == t0.shape and t.device == t0.device and t.is_contiguous()
                  for t in tensors)
          and not torch.compiler.is_compiling())
    if not ok:
        stats["declined"] += 1
        return False
    return _get() is not None


def _specialization(kind: str, act: str, tensors: Tuple[Tensor, ...], ints: Tuple[int, ...], flag=None) -> tuple:
    """What Triton compiles a kernel for: its constexprs, the dtype, and each integer argument's
    and input pointer's divisibility by 16 (and ints equal to 1)."""
    return (kind, act, tensors[0].dtype, flag, tuple(t.data_ptr() % 16 == 0 for t in tensors),
            tuple((v % 16 == 0, v == 1) for v in ints))


def _may_launch(key: tuple) -> bool:
    """False under CUDA graph capture for a specialization not compiled yet: Triton would
    compile and load a module inside the capture (torch's kernels run instead)."""
    if key in _launched or not torch.cuda.is_current_stream_capturing():
        return True
    stats["declined"] += 1
    return False


def _failed(e: Exception) -> None:
    global _kernels
    log.warning("Triton elementwise kernel failed (%s: %s); aten's kernels run from now on", type(e).__name__, e)
    _kernels = False


def act_forward(z: Tensor, act: str) -> Optional[Tensor]:
    """act(z) in one pass, or None when not ``usable`` (the caller runs torch's)."""
    if not usable(act, z):
        return None
    fwd, _ = _kernels
    code, beta = _act_id(act)
    y = torch.empty_like(z)
    n = z.numel()
    block, warps = FWD_CONFIG
    key = _specialization("forward", act, (z,), (n,), FWD_CONFIG)
    if not _may_launch(key):
        return None
    try:
        with torch.cuda.device(z.device):
            fwd[((n + block - 1) // block,)](z, y, n, ACT=code, BETA=beta, BLOCK=block, num_warps=warps)
    except Exception as e:  # noqa: BLE001
        _failed(e)
        return None
    _launched.add(key)
    stats["forward"] += 1
    return y


def _rows_per_prog(m: int, n_col_blocks: int, bm: int, sms: int, per_sm: int = 4) -> int:
    """Rows per program: about ``per_sm`` programs per SM over the whole grid, a multiple of ``bm``."""
    chunks = max(1, min(-(-m // bm), (per_sm * sms) // max(1, n_col_blocks)))
    rows = -(-m // chunks)
    return -(-rows // bm) * bm


_sms: dict = {}  # device -> SM count


def _sm_count(device) -> int:
    sms = _sms.get(device)
    if sms is None:
        sms = _sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return sms


def act_grad_dbias(dy: Tensor, z: Tensor, act: str, need_db: bool) -> Optional[Tuple[Tensor, Optional[Tensor]]]:
    """(dz, db): dz = act'(z) * dy, and db = dz summed over every row (dz's dtype, float32
    accumulation) when ``need_db``; one pass over dy and z. None when not ``usable``."""
    if not usable(act, dy, z):
        return None
    _, bwd = _kernels
    code, beta = _act_id(act)
    n = z.shape[-1]
    m = z.numel() // n
    bm, bn, warps, per_sm, stages = BWD_CONFIG
    n_col_blocks = -(-n // bn)
    sms = _sm_count(z.device)
    rows = _rows_per_prog(m, n_col_blocks, bm, sms, per_sm)
    chunks = -(-m // rows)
    key = _specialization("backward", act, (dy, z), (m, n, rows), (bool(need_db), BWD_CONFIG))
    if not _may_launch(key):
        return None
    dz = torch.empty_like(z)
    part = torch.empty((chunks, n), device=z.device, dtype=torch.float32) if need_db else dz
    try:
        with torch.cuda.device(z.device):
            bwd[(n_col_blocks, chunks)](dy, z, dz, part, m, n, rows, ACT=code, BETA=beta, SUM=bool(need_db),
                                       BM=bm, BN=bn, STAGES=stages, num_warps=warps)
    except Exception as e:  # noqa: BLE001
        _failed(e)
        return None
    _launched.add(key)
    stats["backward"] += 1
    db = part.sum(0).to(z.dtype) if need_db else None
    return dz, db
