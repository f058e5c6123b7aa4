"""GEMMs on the cuBLASLt algorithm tuned for their signature.

torch runs a 16-bit GEMM on the one algorithm cuBLAS's heuristic ranks first (addmm with a bias
asks cuBLASLt for exactly one). That pick is not always the fastest: on the H200, for the six
GEMMs of a transformer MLP block's training step (bf16, 8192 x 2048 -> 8192), another of the
heuristic's own algorithms was up to 10% faster and 3% over the six, with bit-identical results
(bench/cublaslt_algo_probe.py, bench/results/cublaslt_algo_probe.json).

``mm(a, b, bias)`` computes ``a @ b (+ bias)`` with the algorithm recorded for the operands'
signature (device, dtype, M, N, K, each operand's layout, a bias or not), or answers None and the
caller runs torch's own call. A signature is tuned when autotuning is on (``cf.set_autotune`` /
CUDNN_FUSE_AUTOTUNE=1): torch's call and every algorithm cuBLASLt's heuristic offers (up to 16,
workspace up to 32 MiB) whose result matches torch's are timed in alternating rounds (CUDA events;
a steady drift weighs on all alike), after a heat for a GEMM of 0.25 ms or more (the clocks of a
sustained run), within CUDNN_FUSE_GEMM_TUNE_BUDGET_S (1 s); an algorithm
replaces torch's call only when it is faster by more than MARGIN (1%). The pick, torch included,
is stored in the plan cache (one entry, op ``cublaslt_gemm``: the 64-byte cublasLtMatmulAlgo_t,
every candidate's time in its metadata), so later processes, tuning or not, find it there; a
stored algorithm is checked with cublasLtMatmulAlgoCheck before its first use, and anything wrong
with an entry is a miss and one warning. Declined (None): CPU or float32 operands, a dimension
under MIN_DIM (launch-bound: torch's call), layouts cuBLASLt cannot read as they are, pointers not
256-byte aligned, deterministic algorithms (the pick is not checked for run-to-run determinism),
CUDA graph capture of a signature not yet resolved, an operand requiring grad in grad mode (a
create_graph backward needs torch's differentiable call), traced tensors (torch.compile,
torch.func), CUDNN_FUSE_GEMM_TUNE=0.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import socket
import statistics
import time
from typing import Callable, Optional

import torch

from . import autotune, backward, envvars
from . import cublaslt as lt

log = logging.getLogger(__name__)

_EPILOGUE_BIAS = 4
MIN_DIM = 64
MAX_ALGOS = 16
MARGIN = envvars.number("CUDNN_FUSE_GEMM_TUNE_MARGIN", 0.01)
BUDGET_S = envvars.number("CUDNN_FUSE_GEMM_TUNE_BUDGET_S", 1.0)
ENABLED = os.environ.get("CUDNN_FUSE_GEMM_TUNE", "1").strip().lower() not in ("0", "false", "no", "off")
# a GEMM whose first run takes at least HEAT_MIN_MS runs back to back HEAT_S (at most a quarter of
# the budget) before the candidates are timed, as autotune.py heats a graph (CUDNN_FUSE_TUNE_HEAT_S)
HEAT_S = envvars.number("CUDNN_FUSE_TUNE_HEAT_S", 0.5)
HEAT_MIN_MS = 0.25
TOLERANCE = 1e-2  # an algorithm's result against torch's, relative to max |torch's|
FORMAT = "cublaslt_gemm/1"

TORCH = "torch"      # the pick when torch's call won (or cuBLASLt failed)
_UNTUNED = "untuned"  # looked up, nothing stored, not tuning: torch's call until autotuning is on
_choice: dict = {}   # signature -> _Pick | TORCH | _UNTUNED
_warned: set = set()
stats = {"tuned": 0, "loaded": 0, "runs": 0}


class _Pick:
    __slots__ = ("algo", "workspace", "waves")

    def __init__(self, algo, workspace: int, waves: Optional[float] = None):
        self.algo, self.workspace = algo, workspace  # algo: ctypes c_uint64 * 8
        self.waves = waves  # the heuristic's wave count (None for a stored pick)


def _operand(t: torch.Tensor):
    """(op, leading dimension) presenting row-major-indexed 2-D ``t`` to cuBLASLt as its column-major
    transpose, or None when neither stride is 1 or the rows are not 16-byte aligned."""
    r, c = t.shape
    if t.stride(1) == 1 and t.stride(0) >= c and t.stride(0) % 8 == 0:
        return lt._OP_N, t.stride(0)
    if t.stride(0) == 1 and t.stride(1) >= r and t.stride(1) % 8 == 0:
        return lt._OP_T, t.stride(1)
    return None


def signature(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor]):
    """The tuning key of ``a [M, K] @ b [K, N] (+ bias [N])``, or None where this module declines."""
    if not (a.is_cuda and a.dim() == 2 and b.dim() == 2 and a.dtype in lt._DTYPES and b.dtype == a.dtype
            and b.device == a.device):
        return None
    m, k = a.shape
    k2, n = b.shape
    if k2 != k or min(m, n, k) < MIN_DIM or a.is_neg() or b.is_neg() or a.is_conj() or b.is_conj():
        return None
    if bias is not None and not (bias.dtype == a.dtype and bias.device == a.device and bias.dim() == 1
                                 and bias.shape[0] == n and bias.is_contiguous() and not bias.is_neg()
                                 and bias.data_ptr() % 16 == 0):
        return None
    if a.data_ptr() % lt.ALIGN or b.data_ptr() % lt.ALIGN:
        return None
    oa, ob = _operand(a), _operand(b)
    if oa is None or ob is None:
        return None
    return (a.device.index, lt._DTYPES[a.dtype], m, n, k, oa[0], oa[1], ob[0], ob[1], bias is not None)


def _takes(a, b, bias) -> bool:
    """Not traced (torch.compile, torch.func), not a product autograd must record (grad mode with an
    operand that requires grad: a create_graph backward needs torch's differentiable call)."""
    if torch.compiler.is_compiling() or backward.tracing((a, b) if bias is None else (a, b, bias)):
        return False
    return not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad
                                             or (bias is not None and bias.requires_grad)))


def _deterministic() -> bool:
    return torch.are_deterministic_algorithms_enabled() or torch.backends.cudnn.deterministic


class _Plan:
    """One signature's descriptors: row-major C [M, N] = A @ B as cuBLASLt's column-major
    C^T (N x M) = B^T @ A^T (its A is our B, its B our A). Per thread (the bias pointer is set
    per call)."""

    __slots__ = ("desc", "la", "lb", "ld", "bias_ptr", "alpha", "beta")

    def __init__(self, lib, sig):
        _dev, dtype, m, n, k, opa, lda, opb, ldb, has_bias = sig
        vp = ctypes.c_void_p
        self.desc, self.la, self.lb, self.ld = vp(), vp(), vp(), vp()
        lt._check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), lt._COMPUTE_32F, lt._R_32F),
                  "cublasLtMatmulDescCreate")
        # cuBLASLt's A = B^T (N x K): our row-major B [K, N] read as is (op N, N x K), or B stored
        # transposed (op T of its K x N memory); likewise its B = A^T (K x M)
        if opb == lt._OP_N:
            lt._check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.la), dtype, n, k, ldb), "layout B")
        else:
            lt._check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.la), dtype, k, n, ldb), "layout B")
        if opa == lt._OP_N:
            lt._check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.lb), dtype, k, m, lda), "layout A")
        else:
            lt._check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.lb), dtype, m, k, lda), "layout A")
        lt._check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.ld), dtype, n, m, n), "layout C")
        for attr, value in ((lt._DESC_TRANSA, opb), (lt._DESC_TRANSB, opa),
                            (lt._DESC_EPILOGUE, _EPILOGUE_BIAS if has_bias else lt._EPILOGUE_DEFAULT)):
            v = ctypes.c_int32(value)
            lt._check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), 4),
                      "cublasLtMatmulDescSetAttribute")
        self.bias_ptr = ctypes.c_void_p(lt.ALIGN if has_bias else None)
        if has_bias:  # the heuristic must see the epilogue's pointer set (any aligned value)
            lt._check(lib.cublasLtMatmulDescSetAttribute(self.desc, lt._DESC_BIAS_POINTER,
                                                         ctypes.byref(self.bias_ptr), 8), "bias pointer")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def heuristic(self, lib, handle, count: int) -> list:
        pref = ctypes.c_void_p()
        lt._check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        ws = ctypes.c_size_t(lt.WORKSPACE_BYTES)
        lt._check(lib.cublasLtMatmulPreferenceSetAttribute(pref, lt._PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
                  "cublasLtMatmulPreferenceSetAttribute")
        results, got = (lt._HeuristicResult * count)(), ctypes.c_int(0)
        lt._check(lib.cublasLtMatmulAlgoGetHeuristic(handle, self.desc, self.la, self.lb, self.ld, self.ld, pref,
                                                     count, results, ctypes.byref(got)),
                  "cublasLtMatmulAlgoGetHeuristic")
        return [_Pick((ctypes.c_uint64 * 8)(*results[i].algo), int(results[i].workspaceSize), float(results[i].wavesCount))
                for i in range(got.value) if results[i].state == 0 and results[i].workspaceSize <= lt.WORKSPACE_BYTES]

    def check(self, lib, handle, algo) -> int:
        """The workspace ``algo`` needs for this signature (raises CublasLtError if it cannot run it)."""
        result = lt._HeuristicResult()
        lt._check(lib.cublasLtMatmulAlgoCheck(handle, self.desc, self.la, self.lb, self.ld, self.ld, ctypes.byref(algo),
                                              ctypes.byref(result)), "cublasLtMatmulAlgoCheck")
        if result.state != 0 or result.workspaceSize > lt.WORKSPACE_BYTES:
            raise lt.CublasLtError(f"cublasLtMatmulAlgoCheck: state {result.state}, "
                                   f"workspace {result.workspaceSize}")
        return int(result.workspaceSize)

    def run(self, lib, handle, pick: _Pick, a, b, bias, out, stream: int) -> None:
        if bias is not None:
            self.bias_ptr.value = bias.data_ptr()
            lt._check(lib.cublasLtMatmulDescSetAttribute(self.desc, lt._DESC_BIAS_POINTER,
                                                         ctypes.byref(self.bias_ptr), 8), "bias pointer")
        ws = torch.empty((pick.workspace,), dtype=torch.uint8, device=out.device) if pick.workspace else None
        lt._check(lib.cublasLtMatmul(handle, self.desc, ctypes.byref(self.alpha), b.data_ptr(), self.la, a.data_ptr(),
                                     self.lb, ctypes.byref(self.beta), out.data_ptr(), self.ld, out.data_ptr(),
                                     self.ld, ctypes.byref(pick.algo), ws.data_ptr() if ws is not None else None,
                                     pick.workspace, stream), "cublasLtMatmul")


def _thread_plan(lib, sig) -> _Plan:
    plans = getattr(lt._local, "gemm_plans", None)
    if plans is None:
        plans = lt._local.gemm_plans = {}
    plan = plans.get(sig)
    if plan is None:
        plan = plans[sig] = _Plan(lib, sig)
    return plan


def torch_call(a, b, bias):
    """What torch runs for the same product (what F.linear and autograd's backward call)."""
    return torch.addmm(bias, a, b) if bias is not None else torch.mm(a, b)


def mm(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """``a @ b (+ bias)`` [M, N] (contiguous, a's dtype) on the current stream with the algorithm
    recorded or tuned for this signature; None where torch's own call should run (see the module)."""
    if not ENABLED or not _takes(a, b, bias):
        return None
    sig = signature(a, b, bias)
    if sig is None:
        return None
    pick = _choice.get(sig)
    if pick is TORCH or (pick is _UNTUNED and not autotune.autotune_enabled()) or _deterministic():
        return None
    if pick is None or pick is _UNTUNED:
        pick = _resolve(sig, a, b, bias)
        if not isinstance(pick, _Pick):
            return None
    lib = lt._lib
    try:
        handle = lt.thread_handle(lib, a.device)
        out = torch.empty((sig[2], sig[3]), dtype=a.dtype, device=a.device)
        with torch.cuda.device(a.device):
            _thread_plan(lib, sig).run(lib, handle, pick, a, b, bias, out, torch.cuda.current_stream(a.device).cuda_stream)
        stats["runs"] += 1
        return out
    except lt.CublasLtError as exc:
        _choice[sig] = TORCH
        _warn(sig, f"cuBLASLt GEMM failed ({exc}): torch's GEMM runs for this signature")
        return None


def _warn(sig, msg: str) -> None:
    if sig not in _warned:
        _warned.add(sig)
        log.warning("GEMM %s: %s", _describe(sig), msg)


def _describe(sig) -> str:
    _dev, _dt, m, n, k, opa, _lda, opb, _ldb, has_bias = sig
    return f"{m}x{k}{'^T' if opa == lt._OP_T else ''} @ {k}x{n}{'^T' if opb == lt._OP_T else ''}" \
           f"{' + bias' if has_bias else ''}"


def _capturing() -> bool:
    try:
        return torch.cuda.is_current_stream_capturing()
    except Exception:  # noqa: BLE001 - no CUDA: nothing captures
        return False


def _resolve(sig, a, b, bias):
    """The pick for ``sig``: the plan cache's record, else a tuning when autotuning is on."""
    if _capturing():
        return None  # no lookup or timing inside a capture; the next eager call resolves it
    lib = lt._load()
    if lib is None:
        _choice[sig] = TORCH
        return TORCH
    pick = _choice.get(sig)
    if pick is None:
        pick = _from_cache(sig, lib, a.device)
        _choice[sig] = pick if pick is not None else _UNTUNED
        if pick is not None:
            return pick
    if not autotune.autotune_enabled():
        return None
    try:
        with torch.cuda.device(a.device):
            pick, meta = tune(sig, a, b, bias)
    except lt.CublasLtError as exc:
        _choice[sig] = TORCH
        _warn(sig, f"cuBLASLt tuning failed ({exc}): torch's GEMM runs for this signature")
        return TORCH
    _choice[sig] = pick
    _store(sig, pick, meta)
    return pick


def cache_key(sig) -> str:
    return hashlib.sha256(json.dumps([FORMAT, list(sig)]).encode()).hexdigest()


def _spec(sig) -> dict:
    dev, dtype, m, n, k, opa, lda, opb, ldb, has_bias = sig
    return {"op": "cublaslt_gemm", "dtype": {lt._R_16F: "float16", lt._R_16BF: "bfloat16"}[dtype], "m": m, "n": n,
            "k": k, "a": {"transposed": opa == lt._OP_T, "ld": lda}, "b": {"transposed": opb == lt._OP_T, "ld": ldb},
            "bias": has_bias}


def _cache(sig):
    from .cache import open_default_cache

    return open_default_cache(sig[0])  # the namespace of the GEMM's device


def _store(sig, pick, meta: dict) -> None:
    pc = _cache(sig)
    if pc is None:
        return
    blob = bytes(pick.algo) if isinstance(pick, _Pick) else TORCH.encode()
    try:
        pc.put(cache_key(sig), meta, blob)
    except Exception as exc:  # noqa: BLE001 - the cache never fails an op
        _warn(sig, f"could not store the tuned GEMM ({exc!r})")


def _from_cache(sig, lib, device):
    """The stored pick of ``sig`` (verified by cuBLASLt), or None: a miss, or an entry that is
    not a GEMM record or that cuBLASLt refuses (one warning)."""
    pc = _cache(sig)
    if pc is None:
        return None
    try:
        entry = pc.get(cache_key(sig))
    except Exception as exc:  # noqa: BLE001 - the cache never fails an op
        _warn(sig, f"plan cache read failed ({exc!r}); treated as a miss")
        return None
    if entry is None:
        return None
    if entry.meta.get("format") != FORMAT or entry.meta.get("spec") != _spec(sig):
        _warn(sig, "the plan cache's entry is not this GEMM's record; treated as a miss")
        return None
    if entry.blob == TORCH.encode():
        stats["loaded"] += 1
        return TORCH
    if len(entry.blob) != 64:
        _warn(sig, f"the stored algorithm is {len(entry.blob)} bytes, not 64; treated as a miss")
        return None
    algo = (ctypes.c_uint64 * 8).from_buffer_copy(entry.blob)
    try:
        with torch.cuda.device(device):
            workspace = _thread_plan(lib, sig).check(lib, lt.thread_handle(lib, device), algo)
    except lt.CublasLtError as exc:
        _warn(sig, f"cuBLASLt refused the stored algorithm ({exc}); treated as a miss")
        return None
    stats["loaded"] += 1
    return _Pick(algo, workspace)


def _sample_ms(fn: Callable[[], object], launches: int) -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(launches):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / launches


def choose(medians: dict, margin: float = None):
    """The winner of timed candidates {name: median ms} ("torch" and algorithm indices): the fastest
    algorithm if it beats torch's median by more than ``margin`` (a fraction), else "torch"."""
    margin = MARGIN if margin is None else margin
    algos = {k: v for k, v in medians.items() if k != TORCH}
    if not algos:
        return TORCH
    best = min(algos, key=algos.get)
    return best if algos[best] < medians[TORCH] * (1.0 - margin) else TORCH


def plan_rounds(n_candidates: int, est_ms: float, budget_s: float) -> tuple:
    """(rounds, launches a sample, candidates kept) so that timing fits ``budget_s``: samples of
    about 2 ms (3 to 20 launches), 7 rounds, fewer (3 at least) and then fewer candidates (torch and
    the heuristic's first ones) when a GEMM is long."""
    est_ms = max(est_ms, 1e-3)
    launches = int(min(20, max(3, 2.0 / est_ms)))
    rounds = 7

    def cost(r, n):
        return r * n * (launches + 1) * est_ms / 1000.0

    while rounds > 3 and cost(rounds, n_candidates) > budget_s:
        rounds -= 1
    keep = n_candidates
    while keep > 2 and cost(rounds, keep) > budget_s:
        keep -= 1
    return rounds, launches, keep


def tune(sig, a, b, bias, budget_s: float = None):
    """(pick, metadata): torch's call and cuBLASLt's heuristic algorithms for ``sig`` timed in
    alternating rounds on the current stream; results checked against torch's first."""
    budget_s = BUDGET_S if budget_s is None else budget_s
    lib = lt._load()
    handle = lt.thread_handle(lib, a.device)
    plan = _thread_plan(lib, sig)
    algos = plan.heuristic(lib, handle, MAX_ALGOS)
    stream = torch.cuda.current_stream(a.device).cuda_stream
    t0 = time.perf_counter()
    ref = torch_call(a, b, bias)
    scale = max(ref.abs().max().float().item(), 1e-30)
    out = torch.empty_like(ref)
    errors, fns = {}, {TORCH: lambda: torch_call(a, b, bias)}
    for i, pick in enumerate(algos):
        try:
            plan.run(lib, handle, pick, a, b, bias, out, stream)
            torch.cuda.current_stream(a.device).synchronize()
        except lt.CublasLtError as exc:
            errors[i] = str(exc)
            continue
        err = (out.float() - ref.float()).abs().max().item() / scale
        errors[i] = err
        if err <= TOLERANCE:
            fns[i] = (lambda p=pick: plan.run(lib, handle, p, a, b, bias, out, stream))
    est = _sample_ms(fns[TORCH], 1)
    heat_s = min(HEAT_S, budget_s / 4)
    if est >= HEAT_MIN_MS and heat_s > 0:  # time at the clocks a sustained run holds, not the idle boost
        autotune.heat_gpu(fns[TORCH], heat_s, sync=torch.cuda.current_stream(a.device).synchronize)
        est = _sample_ms(fns[TORCH], 3)
    rounds, launches, keep = plan_rounds(len(fns), est, budget_s)
    names = list(fns)[:keep]
    samples = {k: [] for k in names}
    for r in range(rounds):
        for k in (names if r % 2 == 0 else names[::-1]):
            fns[k]()
            samples[k].append(_sample_ms(fns[k], launches))
    medians = {k: statistics.median(v) for k, v in samples.items()}
    winner = choose(medians)
    pick = algos[winner] if winner != TORCH else TORCH
    stats["tuned"] += 1
    meta = {"format": FORMAT, "op": "cublaslt_gemm", "spec": _spec(sig),
            "engine": f"cublaslt algo {winner}" if winner != TORCH else "torch",
            "workspace_bytes": pick.workspace if isinstance(pick, _Pick) else 0,
            "candidates": [{"name": "torch" if k == TORCH else f"cublaslt algo {k}", "median_ms": round(medians[k], 5),
                            "max_rel_err": None if k == TORCH else errors.get(k)} for k in names]
                          + [{"name": f"cublaslt algo {i}", "median_ms": None, "error": e}
                             for i, e in errors.items() if i not in medians],
            "rounds": rounds, "launches_per_sample": launches, "tune_s": round(time.perf_counter() - t0, 3),
            "tuned_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname(),
            "device": torch.cuda.get_device_name(a.device)}
    log.info("GEMM %s tuned: %s (torch %.4f ms, best %.4f ms, %d candidates, %.2f s)", _describe(sig), meta["engine"],
             medians[TORCH], min(medians.values()), len(names), meta["tune_s"])
    return pick, meta


def clear() -> None:
    """Forget this process's picks (tests; a changed cache directory)."""
    _choice.clear()
    _warned.clear()


# ------------------------------------------------------------------ the products autograd needs


def linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` through ``mm`` where it takes the operands (x's leading dims folded)."""
    if x.is_cuda and x.dim() >= 2 and w.dim() == 2 and x.shape[-1] == w.shape[1] and x.numel() and w.numel():
        x2 = x.reshape(-1, x.shape[-1])
        out = mm(x2, w.t(), bias)
        if out is not None:
            return out.view(*x.shape[:-1], w.shape[0])
    return torch.nn.functional.linear(x, w, bias)


def matmul(a2: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a2 @ b`` of 2-D operands (torch's call when ``mm`` declines); a 3-D+ ``a2`` folds its
    leading dims like torch.matmul."""
    if a2.is_cuda and a2.dim() >= 2 and b.dim() == 2 and a2.numel() and b.numel():  # empty: torch's own call
        out = mm(a2.reshape(-1, a2.shape[-1]), b)  # a 2-D a2 reshapes to itself (a view, strides kept)
        if out is not None:
            return out.view(*a2.shape[:-1], b.shape[1])
    return a2 @ b
