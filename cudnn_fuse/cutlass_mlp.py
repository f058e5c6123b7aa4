"""nn.FusedMLP's exact-GELU epilogues as CUTLASS 3 Hopper GEMMs (CUDNN_FUSE_MLP_KERNELS=cutlass).

cuBLASLt's GELU epilogues compute the tanh approximation only, so a block with ``nn.GELU()``
(approximate="none") had no fused GEMM on this stack. ``cudnn_fuse/csrc/cutlass_mlp.cu`` is two
CUTLASS 3 warp-specialized GEMMs with their epilogues built from CUTLASS's own fusion operations
(LinCombPerRowBiasEltActAux, LinCombDeEltAct) and aten's GELU formulas:

- ``linear_gelu_aux``: z = x @ w1.T + b1 and y = gelu(z) from ONE GEMM (z its aux output);
- ``dgelu``: dz = (dY @ W2) * gelu'(z) from ONE GEMM (z read in its epilogue).

Each element is computed as eager computes it from the rounded bf16 values (GELU of the bf16 z,
gelu_backward of the bf16 product), so outputs differ from eager's only where the GEMMs' own fp32
sums round differently. bf16 on sm_90 only, every dimension a multiple of 8, contiguous operands.

The kernels are an optional, separately built shared library (``bench/build_cutlass.sh``: nvcc and
CUTLASS's headers), loaded through ctypes from ``cudnn_fuse/_cutlass_mlp.so`` or
``$CUDNN_FUSE_CUTLASS_LIB``. Anything they cannot take, or a missing library, answers None and the
caller runs torch's kernels; a failure is logged once.

``CUDNN_FUSE_CUTLASS_FWD_CONFIG`` / ``CUDNN_FUSE_CUTLASS_BWD_CONFIG`` pick each kernel's launch:
tile + 16 * log2(swizzle) + 64 * raster order, the tiles as cutlass_mlp.cu lists them
(``bench/cutlass_mlp_probe.py`` times them); a forward config of -1 leaves the forward to torch's kernels.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Optional, Tuple

import torch

from . import envvars

log = logging.getLogger(__name__)

TILES = 6  # cutlass_mlp.cu's kConfigs
MAX_CONFIG = 64 * 3 - 1
FWD_CONFIG = envvars.number("CUDNN_FUSE_CUTLASS_FWD_CONFIG", 0, integer=True, minimum=-1, maximum=MAX_CONFIG)
BWD_CONFIG = envvars.number("CUDNN_FUSE_CUTLASS_BWD_CONFIG", 0, integer=True, minimum=0, maximum=MAX_CONFIG)
_lib = None
_lib_tried = False
_lock = threading.Lock()
_warned: set = set()
_ws: dict = {}  # (device index, stream) -> a uint8 workspace tensor
stats = {"forward": 0, "backward": 0, "declined": 0}


def library_path() -> str:
    return os.environ.get("CUDNN_FUSE_CUTLASS_LIB") or os.path.join(os.path.dirname(__file__), "_cutlass_mlp.so")


def _load():
    global _lib, _lib_tried
    if _lib_tried:
        return _lib
    with _lock:
        if _lib_tried:
            return _lib
        path = library_path()
        try:
            lib = ctypes.CDLL(path)
            vp, i32, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
            lib.cf_cutlass_linear_gelu_aux.argtypes = [i32, i32, i32, i32, vp, vp, vp, vp, vp, vp, sz, i32, vp,
                                                       ctypes.POINTER(sz)]
            lib.cf_cutlass_dgelu.argtypes = [i32, i32, i32, i32, vp, vp, vp, vp, vp, sz, i32, vp, ctypes.POINTER(sz)]
            lib.cf_cutlass_linear_gelu_aux.restype = lib.cf_cutlass_dgelu.restype = i32
            _lib = lib
        except (OSError, AttributeError) as exc:
            log.warning("CUTLASS MLP kernels unavailable (%s: %s); torch's kernels run", path, exc)
        _lib_tried = True
    return _lib


def available() -> bool:
    return _load() is not None


def usable(*ts: Optional[torch.Tensor]) -> bool:
    """bf16 CUDA tensors, contiguous, 16-byte aligned, on an sm_90 device."""
    first = ts[0]
    if first is None or not first.is_cuda or torch.cuda.get_device_capability(first.device) != (9, 0):
        return False
    return all(t is None or (t.dtype == torch.bfloat16 and t.is_cuda and t.device == first.device
                             and t.is_contiguous() and t.data_ptr() % 16 == 0) for t in ts)


def _warn_once(what: str, rc: int) -> None:
    stats["declined"] += 1
    if what not in _warned:
        _warned.add(what)
        log.warning("CUTLASS %s declined (status %d); torch's kernels run", what, rc)


def _call(fn, what: str, dev: torch.device, args_before_ws: tuple) -> bool:
    """Query the workspace, then launch on the current stream. True where the kernel ran."""
    stream = torch.cuda.current_stream(dev)
    need = ctypes.c_size_t(0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    # a workspace query: the same arguments with the first operand null
    q = (args_before_ws[0], args_before_ws[1], args_before_ws[2], args_before_ws[3], None) + args_before_ws[5:]
    rc = fn(*q, None, 0, sms, ctypes.c_void_p(stream.cuda_stream), ctypes.byref(need))
    if rc != 0:
        _warn_once(what, rc)
        return False
    ws = None
    if need.value:
        ws = torch.empty(need.value, dtype=torch.uint8, device=dev)
    rc = fn(*args_before_ws, ws.data_ptr() if ws is not None else None, need.value, sms,
            ctypes.c_void_p(stream.cuda_stream), ctypes.byref(need))
    if rc != 0:
        _warn_once(what, rc)
        return False
    return True


def linear_gelu_aux(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]
                    ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """``(y, z)``: z = x @ w.T + bias and y = gelu(z) (exact) from ONE GEMM. x [..., K], w [N, K],
    bias [N] (required). None where the kernels cannot take it."""
    if FWD_CONFIG < 0 or FWD_CONFIG % 16 >= TILES:
        return None
    if bias is None or w.dim() != 2 or x.dim() < 1 or x.shape[-1] != w.shape[1] or bias.shape != (w.shape[0],):
        return None
    lib = _load()
    if lib is None:
        return None
    n, k = w.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0 or m % 8 or n % 8 or k % 8 or max(m, n, k) >= 2 ** 31 or not usable(x2, w, bias):
        return None
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    z = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if not _call(lib.cf_cutlass_linear_gelu_aux, "linear + GELU forward", x.device,
                 (FWD_CONFIG, m, n, k, x2.data_ptr(), w.data_ptr(), bias.data_ptr(), y.data_ptr(), z.data_ptr())):
        return None
    stats["forward"] += 1
    shape = tuple(x.shape[:-1]) + (n,)
    return y.view(shape), z.view(shape)


def dgelu(gy: torch.Tensor, w2: torch.Tensor, z: torch.Tensor) -> Optional[torch.Tensor]:
    """dz = (gy @ w2) * gelu'(z) (exact GELU) from ONE GEMM. gy [..., K], w2 [K, N] (the next layer's
    weight), z [..., N]. None where the kernels cannot take it."""
    if BWD_CONFIG % 16 >= TILES or w2.dim() != 2 or gy.shape[-1] != w2.shape[0] or z.shape[-1] != w2.shape[1]:
        return None
    lib = _load()
    if lib is None:
        return None
    k, n = w2.shape
    gy2 = gy.reshape(-1, k)
    z2 = z.reshape(-1, n)
    m = gy2.shape[0]
    if z2.shape[0] != m or m == 0 or m % 8 or n % 8 or k % 8 or max(m, n, k) >= 2 ** 31 or not usable(gy2, w2, z2):
        return None
    dz = torch.empty((m, n), dtype=z.dtype, device=z.device)
    if not _call(lib.cf_cutlass_dgelu, "GELU backward", z.device,
                 (BWD_CONFIG, m, n, k, gy2.data_ptr(), w2.data_ptr(), z2.data_ptr(), dz.data_ptr())):
        return None
    stats["backward"] += 1
    return dz.view(z.shape)
