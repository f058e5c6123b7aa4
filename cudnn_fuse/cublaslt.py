"""A linear layer's weight and bias gradients in ONE cuBLASLt GEMM (the BGRADB epilogue).

Eager PyTorch computes ``dW = dz^T @ x`` with a GEMM and ``db = dz.sum(0)`` with a separate
reduction that reads dz again (a bf16 [8192, 2048] dz: 32 MiB read, about 35 us on the H200).
cuDNN's graphs cannot fuse that reduction: it runs over the GEMM's K dimension (the rows), and
cuDNN's epilogues only see the output tile. cuBLASLt's BGRADB epilogue sums the B operand over
K while the GEMM streams it, which is what Megatron's and TransformerEngine's fused wgrad do.

The library is loaded from the process (torch's CUDA build links it), through ctypes: no
header, no build step, no new dependency. Anything it cannot take (CPU, float32, views not
256-byte aligned, a missing library, no algorithm, an error status) answers None and the caller
runs torch's GEMM and sum; a failure is logged once.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Optional, Tuple

import torch

log = logging.getLogger(__name__)

# cublasLt.h / library_types.h (CUDA 12 and 13)
_COMPUTE_32F = 68
_R_32F, _R_16F, _R_16BF = 0, 2, 14
_DTYPES = {torch.float16: _R_16F, torch.bfloat16: _R_16BF}
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_OP_N, _OP_T = 0, 1
_EPILOGUE_DEFAULT, _EPILOGUE_BGRADB = 1, 512
_PREF_MAX_WORKSPACE_BYTES = 1
WORKSPACE_BYTES = 32 << 20
ALIGN = 256  # what cuBLASLt's heuristic assumes of every pointer unless told otherwise
_SONAMES = ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so")


class _HeuristicResult(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class CublasLtError(RuntimeError):
    pass


_lib = None
_lib_state = "unloaded"  # "unloaded" | "ok" | "missing"
_lib_lock = threading.Lock()
_local = threading.local()  # per thread: a handle and its plans (a plan's bias pointer is set per call)
_failed: set = set()  # plan keys cuBLASLt refused, logged once each


def _load():
    global _lib, _lib_state
    with _lib_lock:
        if _lib_state != "unloaded":
            return _lib
        for name in _SONAMES:
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        else:
            _lib_state = "missing"
            log.info("cuBLASLt not found (%s): weight and bias gradients run as torch's GEMM and sum", ", ".join(_SONAMES))
            return None
        vp, sz, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        for fn, args in (("cublasLtCreate", [ctypes.POINTER(vp)]),
                         ("cublasLtMatmulDescCreate", [ctypes.POINTER(vp), i32, i32]),
                         ("cublasLtMatmulDescSetAttribute", [vp, i32, vp, sz]),
                         ("cublasLtMatrixLayoutCreate", [ctypes.POINTER(vp), i32, ctypes.c_uint64, ctypes.c_uint64,
                                                         ctypes.c_int64]),
                         ("cublasLtMatmulPreferenceCreate", [ctypes.POINTER(vp)]),
                         ("cublasLtMatmulPreferenceSetAttribute", [vp, i32, vp, sz]),
                         ("cublasLtMatmulAlgoGetHeuristic", [vp, vp, vp, vp, vp, vp, vp, i32, vp, ctypes.POINTER(i32)]),
                         ("cublasLtMatmulAlgoCheck", [vp, vp, vp, vp, vp, vp, vp, vp]),
                         ("cublasLtMatmul", [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp])):
            f = getattr(lib, fn)
            f.argtypes, f.restype = args, i32
        _lib, _lib_state = lib, "ok"
        return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"{what} returned cuBLAS status {status}")


class _Plan:
    """One shape's descriptors and algorithm: dW^T (K x N, column-major) = x^T (K x rows) @ dz (rows x N),
    which is row-major dW [N, K] = dz^T @ x; BGRADB sums B (dz) over the rows into db [N]."""

    __slots__ = ("desc", "a", "b", "d", "algo", "workspace", "alpha", "beta", "bias_ptr")

    def __init__(self, lib, handle, dtype: int, rows: int, n: int, k: int, with_bias: bool):
        vp = ctypes.c_void_p
        self.desc, self.a, self.b, self.d = vp(), vp(), vp(), vp()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "cublasLtMatmulDescCreate")
        for attr, value in ((_DESC_TRANSA, _OP_N), (_DESC_TRANSB, _OP_T),
                            (_DESC_EPILOGUE, _EPILOGUE_BGRADB if with_bias else _EPILOGUE_DEFAULT)):
            v = ctypes.c_int32(value)
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), 4), "cublasLtMatmulDescSetAttribute")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.a), dtype, k, rows, k), "cublasLtMatrixLayoutCreate")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.b), dtype, n, rows, n), "cublasLtMatrixLayoutCreate")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.d), dtype, k, n, k), "cublasLtMatrixLayoutCreate")
        self.bias_ptr = ctypes.c_void_p()
        if with_bias:  # the heuristic must see the epilogue's pointer set (any aligned value)
            self.bias_ptr.value = ALIGN
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, _DESC_BIAS_POINTER, ctypes.byref(self.bias_ptr), 8),
                   "cublasLtMatmulDescSetAttribute")
        pref = vp()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        ws = ctypes.c_size_t(WORKSPACE_BYTES)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
               "cublasLtMatmulPreferenceSetAttribute")
        result, count = _HeuristicResult(), ctypes.c_int(0)
        _check(lib.cublasLtMatmulAlgoGetHeuristic(handle, self.desc, self.a, self.b, self.d, self.d, pref, 1,
                                                  ctypes.byref(result), ctypes.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
        if count.value < 1 or result.state != 0:
            raise CublasLtError("cublasLtMatmulAlgoGetHeuristic found no algorithm")
        self.algo = result  # the struct's first 64 bytes are the cublasLtMatmulAlgo_t
        self.workspace = int(result.workspaceSize)
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        # descriptors live as long as the thread's plan table (never destroyed: a handful per shape)


def thread_handle(lib, dev: torch.device):
    """This thread's cuBLASLt handle for ``dev`` (created on first use; handles are not shared
    between threads)."""
    handles = getattr(_local, "handles", None)
    if handles is None:
        handles = _local.handles = {}
    handle = handles.get(dev.index)
    if handle is None:
        handle = ctypes.c_void_p()
        with torch.cuda.device(dev):
            _check(lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
        handles[dev.index] = handle
    return handle


def _aligned(*ts: torch.Tensor) -> bool:
    return all(t.data_ptr() % ALIGN == 0 for t in ts)


def usable(dz2: torch.Tensor, x2: torch.Tensor) -> bool:
    """Whether ``wgrad_bgrad(dz2, x2)`` can run here (it may still answer None on a cuBLAS refusal)."""
    return (dz2.is_cuda and x2.device == dz2.device and dz2.dtype in _DTYPES and x2.dtype == dz2.dtype
            and dz2.dim() == 2 and x2.dim() == 2 and dz2.shape[0] == x2.shape[0] and dz2.shape[0] > 0
            and dz2.is_contiguous() and x2.is_contiguous() and dz2.shape[1] % 8 == 0 and x2.shape[1] % 8 == 0
            and _aligned(dz2, x2) and not _negated(dz2, x2) and _lib_state != "missing")


def _negated(*ts) -> bool:
    return any(t.is_neg() or t.is_conj() for t in ts)


def wgrad_bgrad(dz2: torch.Tensor, x2: torch.Tensor, with_bias: bool = True
                ) -> Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """``(dz2.T @ x2, dz2.sum(0) if with_bias else None)`` from one cuBLASLt GEMM, in dz2's dtype
    (as torch's linear backward returns them), on the current stream. ``dz2`` [rows, N] and ``x2``
    [rows, K] contiguous fp16/bf16 CUDA tensors. None where cuBLASLt cannot take it."""
    if not usable(dz2, x2):
        return None
    if torch.are_deterministic_algorithms_enabled() or torch.backends.cudnn.deterministic:
        return None  # cuBLASLt's algorithm pick is not checked for run-to-run determinism: torch's GEMM and sum
    lib = _load()
    if lib is None:
        return None
    rows, n = dz2.shape
    k = x2.shape[1]
    dev = dz2.device
    key = (dev.index, dz2.dtype, rows, n, k, with_bias)
    if key in _failed:
        return None
    plans = getattr(_local, "plans", None)
    if plans is None:
        plans = _local.plans = {}
    try:
        handle = thread_handle(lib, dev)
        plan = plans.get(key)
        if plan is None:
            with torch.cuda.device(dev):
                plan = plans[key] = _Plan(lib, handle, _DTYPES[dz2.dtype], rows, n, k, with_bias)
        dw = torch.empty((n, k), dtype=dz2.dtype, device=dev)
        db = torch.empty((n,), dtype=dz2.dtype, device=dev) if with_bias else None
        if with_bias:
            plan.bias_ptr.value = db.data_ptr()
            _check(lib.cublasLtMatmulDescSetAttribute(plan.desc, _DESC_BIAS_POINTER, ctypes.byref(plan.bias_ptr), 8),
                   "cublasLtMatmulDescSetAttribute")
        ws = torch.empty((plan.workspace,), dtype=torch.uint8, device=dev) if plan.workspace else None
        stream = torch.cuda.current_stream(dev).cuda_stream
        with torch.cuda.device(dev):  # the launch goes to the current device's context: the operands' own
            _launch(lib, handle, plan, x2, dz2, dw, ws, stream)
        return dw, db
    except CublasLtError as e:
        plans.pop(key, None)
        _failed.add(key)
        log.warning("cuBLASLt weight gradient declined for dz %s, x %s (%s): torch's GEMM and sum run instead",
                    tuple(dz2.shape), tuple(x2.shape), e)
        return None


def _launch(lib, handle, plan: _Plan, x2, dz2, dw, ws, stream) -> None:
    _check(lib.cublasLtMatmul(handle, plan.desc, ctypes.byref(plan.alpha), x2.data_ptr(), plan.a, dz2.data_ptr(),
                              plan.b, ctypes.byref(plan.beta), dw.data_ptr(), plan.d, dw.data_ptr(), plan.d,
                              ctypes.byref(plan.algo), ws.data_ptr() if ws is not None else None, plan.workspace,
                              stream), "cublasLtMatmul")
