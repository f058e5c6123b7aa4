"""A linear layer's weight and bias gradients in ONE cuBLASLt GEMM (the BGRADB epilogue).

Eager PyTorch computes ``dW = dz^T @ x`` with a GEMM and ``db = dz.sum(0)`` with a separate
reduction that reads dz again (a bf16 [8192, 2048] dz: 32 MiB read, about 35 us on the H200).
cuDNN's graphs cannot fuse that reduction: it runs over the GEMM's K dimension (the rows), and
cuDNN's epilogues only see the output tile. cuBLASLt's BGRADB epilogue sums the B operand over
K while the GEMM streams it, which is what Megatron's and TransformerEngine's fused wgrad do.

The same module runs the tanh GELU's epilogues for nn.FusedMLP with CUDNN_FUSE_MLP_KERNELS=cublaslt:
GELU_AUX_BIAS (y and the pre-activation from one forward GEMM) and DGELU (dY @ W2 times gelu'(z)
in the backward GEMM's epilogue): ``linear_gelu_aux`` and ``dgelu_bgrad``.

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
_DESC_AUX_POINTER, _DESC_AUX_LD = 11, 12
_OP_N, _OP_T = 0, 1
_EPILOGUE_DEFAULT, _EPILOGUE_BGRADB = 1, 512
# GELU (the tanh form) with its pre-activation written to / read from the aux matrix
_EPILOGUE_GELU_AUX, _EPILOGUE_GELU_AUX_BIAS, _EPILOGUE_DGELU, _EPILOGUE_DGELU_BGRAD = 160, 164, 192, 208
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


def _best_algo(lib, handle, desc, a, b, d, workspace_cap: int, what: str) -> _HeuristicResult:
    """cuBLASLt heuristic's first algorithm for D = op(A) @ op(B) (C = D) within ``workspace_cap``."""
    pref = ctypes.c_void_p()
    _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
    ws = ctypes.c_size_t(workspace_cap)
    _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
           "cublasLtMatmulPreferenceSetAttribute")
    result, count = _HeuristicResult(), ctypes.c_int(0)
    _check(lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, d, d, pref, 1, ctypes.byref(result),
                                              ctypes.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
    if count.value < 1 or result.state != 0:
        raise CublasLtError("cublasLtMatmulAlgoGetHeuristic found no algorithm" + what)
    return result


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
        result = _best_algo(lib, handle, self.desc, self.a, self.b, self.d, WORKSPACE_BYTES, "")
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


# ------------------------------------------------------------------ GELU (tanh) epilogues

gelu_stats = {"forward": 0, "backward": 0}  # GEMMs run with a GELU epilogue
# The workspace the GELU epilogue plans may ask for (allocated per call from torch's caching
# allocator). With none, cuBLASLt's heuristic found no DGELU_BGRAD algorithm and a DGELU one at
# 0.93 ms against 0.40 with 1 MiB allowed, of which the picks asked for 4 and 131 bytes
# (8192 x 2048 -> 8192 bf16, H200: bench/results/cublaslt_gelu_runs).
EPILOGUE_WORKSPACE_BYTES = 1 << 20


class _EpiPlan:
    """One column-major GEMM D = op(A) @ op(B) with an epilogue that has a bias vector and an aux
    matrix (GELU_AUX[_BIAS] forward, DGELU[_BGRAD] backward), its algorithm from cuBLASLt's
    heuristic; the bias and aux pointers are set per call."""

    __slots__ = ("desc", "a", "b", "d", "algo", "workspace", "alpha", "beta", "bias_ptr", "aux_ptr", "has_bias")

    def __init__(self, lib, handle, dtype: int, trans: Tuple[int, int], a: Tuple[int, int, int],
                 b: Tuple[int, int, int], d: Tuple[int, int, int], epilogue: int, has_bias: bool):
        vp = ctypes.c_void_p
        self.desc, self.a, self.b, self.d = vp(), vp(), vp(), vp()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "cublasLtMatmulDescCreate")
        for attr, value in ((_DESC_TRANSA, trans[0]), (_DESC_TRANSB, trans[1]), (_DESC_EPILOGUE, epilogue)):
            v = ctypes.c_int32(value)
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), 4), "cublasLtMatmulDescSetAttribute")
        for lay, (rows, cols, ld) in ((self.a, a), (self.b, b), (self.d, d)):
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), dtype, rows, cols, ld), "cublasLtMatrixLayoutCreate")
        ld = ctypes.c_int64(d[2])
        _check(lib.cublasLtMatmulDescSetAttribute(self.desc, _DESC_AUX_LD, ctypes.byref(ld), 8), "cublasLtMatmulDescSetAttribute")
        self.has_bias = has_bias
        self.bias_ptr, self.aux_ptr = ctypes.c_void_p(ALIGN), ctypes.c_void_p(ALIGN)
        self._set_pointers(lib)  # the heuristic must see them set (any aligned value)
        result = _best_algo(lib, handle, self.desc, self.a, self.b, self.d, EPILOGUE_WORKSPACE_BYTES,
                            " for the GELU epilogue")
        self.algo = result
        self.workspace = int(result.workspaceSize)
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def _set_pointers(self, lib) -> None:
        _check(lib.cublasLtMatmulDescSetAttribute(self.desc, _DESC_AUX_POINTER, ctypes.byref(self.aux_ptr), 8),
               "cublasLtMatmulDescSetAttribute")
        if self.has_bias:
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, _DESC_BIAS_POINTER, ctypes.byref(self.bias_ptr), 8),
                   "cublasLtMatmulDescSetAttribute")

    def run(self, lib, handle, a_ptr: int, b_ptr: int, d: torch.Tensor, aux: torch.Tensor,
            bias: Optional[torch.Tensor]) -> None:
        self.aux_ptr.value = aux.data_ptr()
        if self.has_bias:
            self.bias_ptr.value = bias.data_ptr()
        self._set_pointers(lib)
        dev = d.device
        ws = torch.empty((self.workspace,), dtype=torch.uint8, device=dev) if self.workspace else None
        stream = torch.cuda.current_stream(dev).cuda_stream
        with torch.cuda.device(dev):
            _check(lib.cublasLtMatmul(handle, self.desc, ctypes.byref(self.alpha), a_ptr, self.a, b_ptr, self.b,
                                      ctypes.byref(self.beta), d.data_ptr(), self.d, d.data_ptr(), self.d,
                                      ctypes.byref(self.algo), ws.data_ptr() if ws is not None else None,
                                      self.workspace, stream), "cublasLtMatmul")


def gelu_fwd_layout(m: int, n: int, k: int, has_bias: bool) -> tuple:
    """(transposes, A, B, D layouts as (rows, cols, ld), epilogue) of the forward GEMM: column-major
    D [n, m] = W [k, n]^T @ X [k, m], i.e. row-major z [m, n] = x [m, k] @ w [n, k]^T; the bias runs
    along D's rows (z's columns)."""
    return ((_OP_T, _OP_N), (k, n, k), (k, m, k), (n, m, n),
            _EPILOGUE_GELU_AUX_BIAS if has_bias else _EPILOGUE_GELU_AUX)


def dgelu_layout(m: int, n: int, k: int, bgrad: bool) -> tuple:
    """The backward GEMM's: column-major D [n, m] = W2 [n, k] @ GY [k, m], i.e. row-major
    [m, n] = gy [m, k] @ w2 [k, n]; DGELU_BGRAD's bias gradient sums D over its columns (dz's rows)."""
    return ((_OP_N, _OP_N), (n, k, n), (k, m, k), (n, m, n), _EPILOGUE_DGELU_BGRAD if bgrad else _EPILOGUE_DGELU)


def gelu_usable(*ts: Optional[torch.Tensor]) -> bool:
    """Whether the GELU epilogues can take these operands: CUDA, one fp16/bf16 dtype and device,
    contiguous, 256-byte aligned, every dimension a multiple of 8, no lazy negation, not in
    deterministic mode (cuBLASLt's pick is not checked for run-to-run determinism)."""
    ts = [t for t in ts if t is not None]
    t0 = ts[0]
    return (_lib_state != "missing" and t0.is_cuda and t0.dtype in _DTYPES
            and all(t.device == t0.device and t.dtype == t0.dtype and t.is_contiguous() and t.numel() > 0
                    and all(n % 8 == 0 for n in t.shape) for t in ts)
            and _aligned(*ts) and not _negated(*ts)
            and not (torch.are_deterministic_algorithms_enabled() or torch.backends.cudnn.deterministic)
            and not torch.compiler.is_compiling())


def epilogue_workspaces() -> dict:
    """This thread's GELU epilogue plans: key -> the workspace bytes its algorithm asked for."""
    return {k: p.workspace for k, p in getattr(_local, "epi_plans", {}).items()}


def reset_epilogue_plans() -> None:
    """Drop this thread's GELU epilogue plans (the next call asks cuBLASLt's heuristic again)."""
    _local.epi_plans = {}


def _epi_call(key, build, run, what: str):
    lib = _load()
    if lib is None or key in _failed:
        return None
    plans = getattr(_local, "epi_plans", None)
    if plans is None:
        plans = _local.epi_plans = {}
    dev = torch.device("cuda", key[1])
    try:
        handle = thread_handle(lib, dev)
        plan = plans.get(key)
        if plan is None:
            with torch.cuda.device(dev):
                plan = plans[key] = build(lib, handle)
        return run(lib, handle, plan)
    except CublasLtError as e:
        plans.pop(key, None)
        _failed.add(key)
        log.warning("cuBLASLt %s declined (%s): torch's kernels run instead", what, e)
        return None


def linear_gelu_aux(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]
                    ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """``(y, z)``: z = x @ w.T + bias and y = gelu(z, approximate="tanh") from ONE cuBLASLt GEMM
    (epilogue GELU_AUX_BIAS: z is the aux output), in x's dtype. x [..., K], w [N, K]. None where
    cuBLASLt cannot take it (the caller runs torch's addmm and GELU)."""
    if x.dim() < 1 or w.dim() != 2 or x.shape[-1] != w.shape[1] or (bias is not None and bias.shape != (w.shape[0],)):
        return None
    k = w.shape[1]
    x2 = x.reshape(-1, k)
    if not gelu_usable(x2, w, bias):
        return None
    m, n = x2.shape[0], w.shape[0]
    dev = x.device
    y = torch.empty((m, n), dtype=x.dtype, device=dev)
    z = torch.empty((m, n), dtype=x.dtype, device=dev)
    if not _aligned(y, z):
        return None
    key = ("gelu_aux", dev.index, x.dtype, m, n, k, bias is not None)
    layout = gelu_fwd_layout(m, n, k, bias is not None)
    out = _epi_call(key, lambda lib, h: _EpiPlan(lib, h, _DTYPES[x.dtype], *layout, bias is not None),
                    lambda lib, h, plan: plan.run(lib, h, w.data_ptr(), x2.data_ptr(), y, z, bias) or True,
                    "GELU_AUX_BIAS forward")
    if out is None:
        return None
    gelu_stats["forward"] += 1
    shape = tuple(x.shape[:-1]) + (n,)
    return y.view(shape), z.view(shape)


def dgelu_bgrad(gy: torch.Tensor, w2: torch.Tensor, z: torch.Tensor, need_db: bool, bgrad_epilogue: bool = False
                ) -> Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """``(dz, db)``: dz = (gy @ w2) * gelu'(z) (the tanh form) from ONE cuBLASLt GEMM (epilogue
    DGELU, z its aux input), in z's dtype, and db = dz summed over its rows when ``need_db``: by
    torch's sum, or with ``bgrad_epilogue`` by the GEMM itself (DGELU_BGRAD, which took 0.94 ms
    against DGELU's 0.40 at 8192 x 2048 -> 8192 bf16 on the H200: bench/results/cublaslt_gelu_probe*).
    gy [..., K], w2 [K, N] (the next layer's weight), z [..., N]. None where cuBLASLt cannot take it."""
    if w2.dim() != 2 or gy.shape[-1] != w2.shape[0] or z.shape[-1] != w2.shape[1]:
        return None
    k, n = w2.shape
    gy2 = gy.reshape(-1, k)
    z2 = z.reshape(-1, n)
    if z2.shape[0] != gy2.shape[0] or not gelu_usable(gy2, w2, z2):
        return None
    m = gy2.shape[0]
    dev = z.device
    in_epilogue = bool(need_db and bgrad_epilogue)
    dz = torch.empty((m, n), dtype=z.dtype, device=dev)
    db = torch.empty((n,), dtype=z.dtype, device=dev) if in_epilogue else None
    if not _aligned(dz, *([db] if in_epilogue else [])):
        return None
    key = ("dgelu", dev.index, z.dtype, m, n, k, in_epilogue)
    layout = dgelu_layout(m, n, k, in_epilogue)
    out = _epi_call(key, lambda lib, h: _EpiPlan(lib, h, _DTYPES[z.dtype], *layout, in_epilogue),
                    lambda lib, h, plan: plan.run(lib, h, w2.data_ptr(), gy2.data_ptr(), dz, z2, db) or True,
                    "DGELU backward")
    if out is None:
        return None
    gelu_stats["backward"] += 1
    if need_db and not in_epilogue:
        db = dz.sum(0)
    return dz.view(z.shape), db
