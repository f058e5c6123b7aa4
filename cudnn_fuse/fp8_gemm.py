"""FP8 GEMMs on the GPU: cuBLASLt through nvmath-python's stateful ``Matmul``, or torch._scaled_mm.

cuBLASLt runs an FP8 GEMM with both operands K-contiguous, dequantizes with per-tensor scales, adds the
bias and applies ReLU or GELU (tanh) in its epilogue, adds C (the residual) and, for an FP8 output,
multiplies by ``scale_d``, saturates and writes max |D| before ``scale_d`` (``amax_d``), all in one
kernel. Its bias runs along the rows of a column-major D, so the product is computed transposed:
D' [N, M] = bᵀ [N, K] · aᵀ [K, M], column-major, whose transpose is the row-major D [M, N] with the bias
along N. nvmath plans once per shape and epilogue (``_Plan``, kept in memory) and then only rebinds
operands and scales, on the caller's stream.

What the fused kernel cannot take (SiLU and the other activations, an exact-erf GELU, an amax of a
16-bit output, a combination cuBLASLt refuses) runs its GEMM with what it can take, to a bfloat16 D, and
the rest in torch. Rowwise scales, an M that is not a multiple of 16 (cuBLASLt's FP8 alignment, which
torch._scaled_mm does not need), or no nvmath run torch._scaled_mm and the epilogue in torch.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from typing import Optional, Tuple

import torch

from . import fp8_cast
from .reference import FP8_DTYPES, activation as torch_activation
from .spec import Epilogue, ScaledMMSpec, TensorSpec

log = logging.getLogger(__name__)
_NVMATH_LOG = logging.getLogger(__name__ + ".nvmath")  # nvmath logs to the root logger unless given one

# cuBLASLt's epilogues by (activation in the kernel, bias): GELU is its tanh approximation
_EPILOG = {None: "BIAS", "relu": "RELU_BIAS", "gelu_tanh": "GELU_BIAS"}
MAX_PLANS = 64  # nvmath plans kept (each holds descriptors and a workspace); least recently used go first
AUTOTUNE_ITERATIONS = 10  # timed runs per candidate algorithm when autotuning
STATS = {"from_cache": 0, "heuristics": 0, "tuned": 0}  # how this process's plans chose their algorithm
_zero_bias: dict = {}  # (N, dtype, device) -> zeros: a plan without a bias still wants column-major D
_constants: dict = {}  # (device, value) -> a float32 one-element tensor
_transposed: set = set()  # shapes of b already logged as not K-major
_capability: dict = {}  # device index -> compute capability, asked once
_nvmath_found: list = []  # [(module, why)] once imported (or not)


class Kept:
    """What an FP8 engine built, by key, the least recently used dropped past ``capacity``, and the keys
    whose build failed with the reason: a build is tried once per process, its refusal logged once."""

    def __init__(self, capacity: int, logger: logging.Logger, what: str):
        self.capacity, self.log, self.what = capacity, logger, what
        self.items: OrderedDict = OrderedDict()
        self.refused: dict = {}
        self.lock = threading.Lock()

    def get(self, key, build):
        """The item of ``key``, built by ``build()`` if new; None where a build failed (now or before)."""
        with self.lock:
            item = self.items.get(key)
            if item is not None:
                self.items.move_to_end(key)
                return item
            if key in self.refused:
                return None
        try:
            item = build()
        except Exception as e:  # noqa: BLE001 - the engine declined it: the caller's next form runs it
            self.refuse(key, f"{type(e).__name__}: {e}")
            return None
        with self.lock:
            self.items[key] = item
            while len(self.items) > self.capacity:
                self.items.popitem(last=False)
        return item

    def refuse(self, key, why: str) -> None:
        with self.lock:
            self.refused[key] = why
        self.log.info("%s declined %s (%s); the next form runs it", self.what, key, why)

    def refusals(self) -> dict:
        with self.lock:
            return dict(self.refused)


_kept = Kept(MAX_PLANS, log, "FP8 GEMM: cuBLASLt")


class Unsupported(RuntimeError):
    """No FP8 GEMM engine here (no GPU of compute capability 8.9 or newer)."""


def capability(device: torch.device) -> tuple:
    """``device``'s compute capability, asked of the driver once (the ops ask at every call)."""
    cap = _capability.get(device.index)
    if cap is None:
        cap = _capability[device.index] = torch.cuda.get_device_capability(device)
    return cap


def fp8_capable(device: torch.device) -> bool:
    return device.type == "cuda" and capability(device) >= (8, 9)


def _nvmath():
    """(nvmath's linalg.advanced module, None), or (None, why it is unavailable); imported once."""
    if not _nvmath_found:
        try:
            from nvmath.linalg import advanced
            _nvmath_found.append((advanced, None))
        except Exception as e:  # noqa: BLE001 - not installed, or its CUDA libraries not found
            _nvmath_found.append((None, f"nvmath-python unavailable ({type(e).__name__}: {e})"))
    return _nvmath_found[0]


def _cuda_type(dtype: torch.dtype):
    import nvmath
    from nvmath.internal import typemaps

    return nvmath.CudaDataType(typemaps.NAME_TO_DATA_TYPE[str(dtype).replace("torch.", "")])


_threads = threading.local()  # .ready: cuda.core knows this thread's current device


def _thread_ready() -> None:
    """Make cuda.core (nvmath's CUDA layer) take this thread's current device as set, once per thread: a
    plan made in one thread and run in another (the forward's plan of a shape that autograd's device
    thread meets in the backward) raised "Device 0 is not yet initialized" in nvmath's execute (H100,
    nvmath 1.0). The device is torch's current one: nothing changes for torch."""
    if not getattr(_threads, "ready", False):
        from cuda.core import Device

        Device(torch.cuda.current_device()).set_current()
        _threads.ready = True


class _Plan:
    """One planned nvmath Matmul: D' = act(bᵀ·aᵀ·sa·sb + bias + Cᵀ) [· scale_d], amax_d if asked."""

    def __init__(self, mm):
        self.mm, self.lock = mm, threading.Lock()

    def run(self, a2, b2, sa, sb, bias, residual, scale_d, stream):
        if a2.is_cuda:
            _thread_ready()
        scales = {"a": sb, "b": sa}
        if scale_d is not None:
            scales["d"] = scale_d
        with self.lock:
            self.mm.reset_operands_unchecked(a=b2.t(), b=a2.t(), c=None if residual is None else residual.t(),
                                             quantization_scales=scales, epilog_inputs={"bias": bias})
            out = self.mm.execute(stream=stream)
            self.mm.release_operands()  # the plan outlives the call: it must not keep the caller's tensors alive
        d, aux = out if isinstance(out, tuple) else (out, {})
        am = aux.get("result_amax")
        return d.t(), None if am is None else am.reshape(())


def cache_key(key, epilog: str, device: torch.device) -> str:
    """The plan cache's key of a cuBLASLt plan: the problem (``key`` without the device index), its
    epilogue, the card and cuBLASLt's version (an algorithm is only valid where it was chosen)."""
    try:
        from nvmath.bindings import cublasLt

        version = cublasLt.get_version()
    except Exception:  # noqa: BLE001 - no cuBLASLt: no plan will be built to store
        version = None
    text = repr(("fp8-gemm", tuple(str(k) for k in key[1:]), epilog, torch.cuda.get_device_name(device), version))
    return hashlib.sha256(text.encode()).hexdigest()


def _stored_algorithm(pc, ckey: str, tuning: bool):
    """The cuBLASLt algorithm the plan cache holds for ``ckey`` (a tuned one when tuning), else None."""
    entry = pc.get(ckey) if pc is not None else None
    if entry is None or (tuning and entry.meta.get("tuned") is not True):
        return None
    try:
        import numpy as np
        from nvmath.bindings.cublasLt import matmul_heuristic_result_dtype
        from nvmath.linalg.advanced import Algorithm

        return Algorithm.from_numpy(np.frombuffer(entry.blob, dtype=matmul_heuristic_result_dtype))
    except Exception as e:  # noqa: BLE001 - written by another nvmath: heuristics run, the entry is replaced
        log.info("FP8 GEMM: the cached algorithm of %s is unreadable (%s); heuristics choose", ckey[:12], e)
        return None


def _store_algorithm(pc, ckey: str, mm, key, epilog: str, tuned: bool) -> None:
    """The algorithm ``mm`` runs (its fastest measured when ``tuned``), into the plan cache."""
    if pc is None or getattr(pc, "read_only", False):
        return
    try:
        best = mm.algorithms[0]
        blob = best.as_numpy()
        meta = {"kind": "fp8-gemm", "op": "scaled_mm", "engine": f"cuBLASLt algorithm {best.algorithm_id}",
                "workspace_bytes": int(blob["workspace_size"][0]),
                "tuned": tuned, "mkn": [int(k) for k in key[1:4]], "epilog": epilog,
                "dtypes": [str(k) for k in key[4:7]]}
    except Exception as e:  # noqa: BLE001 - an algorithm not stored is chosen again by the next process
        log.debug("FP8 GEMM: the algorithm of %s not stored: %s: %s", key, type(e).__name__, e)
        return
    if tuned:
        meta["tuned_at"] = time.time()
    from .loader import pinning_now

    pinned = pinning_now()  # stored by a pre-warm: never evicted for space
    if pinned:
        meta["pinned"] = True
    pc.put(ckey, meta, blob.tobytes(), pinned=pinned)  # the cache logs and absorbs its own faults


def _plan(key, a2, b2, sa, sb, bias, residual, scale_d, epilog, d_dtype, want_amax, stream):
    """The kept plan of ``key``, made now if new; None where cuBLASLt refused it (remembered). A new plan
    takes its algorithm from the plan cache where it is there (no heuristic query); otherwise heuristics
    choose, or, with autotuning on, every candidate is timed; the choice is stored either way."""

    def build():
        advanced, why = _nvmath()
        if advanced is None:
            raise Unsupported(why)
        from . import autotune
        from .cache import open_default_cache

        scales = {"a": sb, "b": sa}
        if scale_d is not None:
            scales["d"] = scale_d
        options = {"logger": _NVMATH_LOG, "result_type": _cuda_type(d_dtype), "result_amax": want_amax}
        mm = advanced.Matmul(b2.t(), a2.t(), c=None if residual is None else residual.t(),
                             beta=None if residual is None else 1.0, quantization_scales=scales,
                             options=options, stream=stream)
        from .loader import _capturing

        # no timing while a CUDA graph capture is open: the timed runs would be captured, not run
        tuning = autotune.autotune_enabled() and not _capturing()
        pc = open_default_cache(a2.device.index)
        ckey = cache_key(key, epilog, a2.device)
        stored = _stored_algorithm(pc, ckey, tuning)
        plan = dict(epilog=getattr(advanced.MatmulEpilog, epilog), epilog_inputs={"bias": bias}, stream=stream)
        if stored is not None:
            try:
                mm.plan(algorithms=[stored], **plan)
            except Exception as e:  # noqa: BLE001 - another driver or library: heuristics choose again
                log.info("FP8 GEMM: cuBLASLt refused the cached algorithm of %s (%s); heuristics choose", key, e)
                stored = None
        if stored is None:
            mm.plan(**plan)
            if tuning:
                mm.autotune(iterations=AUTOTUNE_ITERATIONS, stream=stream)  # on this call's own operands
            _store_algorithm(pc, ckey, mm, key, epilog, tuning)
        STATS["from_cache" if stored is not None else ("tuned" if tuning else "heuristics")] += 1
        mm.release_operands()  # the sample operands: each run binds its own
        return _Plan(mm)

    return _kept.get(key, build)


def engine_of(a2, b2, scale_a, scale_b, out_dtype=torch.bfloat16) -> str:
    """Which engine runs this product: "cublaslt" or "torch" (torch._scaled_mm). A float32 output is
    torch's: cuBLASLt's FP8 GEMM with a float32 D (and C) gave results off by up to 2.8 where they were
    about 3 (H100, cuBLASLt of CUDA 13, nvmath 1.0)."""
    if (scale_a.numel() != 1 or scale_b.numel() != 1 or a2.shape[0] % 16 or out_dtype == torch.float32
            or _nvmath()[0] is None):
        return "torch"
    return "cublaslt"


def fast_amax(y: torch.Tensor) -> torch.Tensor:
    """max |y| as a float32 0-dim tensor in one reduction (no |y| copy); NaN propagates."""
    if y.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=y.device)
    return torch.linalg.vector_norm(y.detach(), float("inf"), dtype=torch.float32)


def _finish(r: torch.Tensor, out_dtype, scale_result, return_amax: bool):
    """(``r`` as ``out_dtype``: an FP8 output cast with its amax in one pass (fp8_cast.py), amax or None)."""
    if out_dtype in FP8_DTYPES:
        out, am = fp8_cast.cast_amax(r, out_dtype, scale_result)
        return out, am if return_amax else None
    return r.to(out_dtype), fast_amax(r) if return_amax else None


def _k_major(b2: torch.Tensor) -> torch.Tensor:
    """``b`` [K, N] with K contiguous, as FP8 GEMMs want (one logged transpose otherwise)."""
    if b2.stride(0) == 1 and b2.stride(1) >= b2.shape[0]:
        return b2
    shape = tuple(b2.shape)
    if shape not in _transposed:  # said once per shape: a loop would repeat it every call
        _transposed.add(shape)
        log.info("scaled_mm: b of shape %s is not K-major (b.t() contiguous): transposed at every call", shape)
    return b2.t().contiguous().t()


def _wide(out_dtype) -> torch.dtype:
    """The output a split epilogue's GEMM writes: bfloat16 for an FP8 output, else the output's own."""
    return torch.bfloat16 if out_dtype in FP8_DTYPES else out_dtype


def scaled_mm_2d(a2, b2, scale_a, scale_b, bias, activation, residual, out_dtype, scale_result, return_amax,
                 negative_slope):
    """(out [M, N], amax or None) of ``act(a2·sa @ b2·sb + bias + residual)`` for 2-D FP8 operands on a
    GPU of compute capability 8.9 or newer; residual already [M, N]."""
    if not fp8_capable(a2.device):
        raise Unsupported("FP8 GEMMs need a GPU of compute capability 8.9 or newer")
    a2 = a2 if a2.stride(1) == 1 else a2.contiguous()
    b2 = _k_major(b2)
    if engine_of(a2, b2, scale_a, scale_b, out_dtype) == "cublaslt":
        got = _cublaslt(a2, b2, scale_a, scale_b, bias, activation, residual, out_dtype, scale_result,
                        return_amax, negative_slope)
        if got is not None:
            return got
    return _torch_scaled_mm(a2, b2, scale_a, scale_b, bias, activation, residual, out_dtype, scale_result,
                            return_amax, negative_slope)


def _forms(index, M, K, N, a_dtype, b_dtype, a_ld, b_ld, activation, has_residual, out_dtype, return_amax):
    """The plans cuBLASLt is asked for, in order, as (form, D's dtype, amax in the kernel, the kernel's
    activation, plan key): "full" puts the whole epilogue in the kernel; "split" writes a 16-bit D with
    the bias (and the activation the kernel has), the rest in torch. The key holds the layouts too: a
    plan rebinds pointers unchecked, so another leading dimension is another plan."""
    in_kernel = activation in _EPILOG
    fp8_out = out_dtype in FP8_DTYPES
    forms = []
    if in_kernel:
        forms.append(("full", out_dtype, fp8_out and return_amax))
    if fp8_out or not in_kernel:
        forms.append(("split", _wide(out_dtype), False))
    act = activation if in_kernel else None
    return [(form, d_dtype, kernel_amax, act,
             (index, M, K, N, a_dtype, b_dtype, d_dtype, act, has_residual, kernel_amax, a_ld, b_ld,
              N if has_residual else None))  # C is row-major [M, N]
            for form, d_dtype, kernel_amax in forms]


def _cublaslt(a2, b2, sa, sb, bias, activation, residual, out_dtype, scale_result, return_amax, negative_slope):
    """The most of the epilogue cuBLASLt takes in its kernel, the rest in torch; None if it takes none."""
    M, N = a2.shape[0], b2.shape[1]
    dev, stream = a2.device, torch.cuda.current_stream(a2.device)
    sa, sb = sa.reshape(1), sb.reshape(1)
    in_kernel = activation in _EPILOG
    for form, d_dtype, kernel_amax, act, key in _forms(dev.index, M, a2.shape[1], N, a2.dtype, b2.dtype,
                                                       a2.stride(0), b2.stride(1), activation, residual is not None,
                                                       out_dtype, return_amax):
        c_dtype = _wide(d_dtype) if d_dtype in FP8_DTYPES else d_dtype
        bias_dtype = torch.float16 if d_dtype == torch.float16 else (torch.float32 if d_dtype == torch.float32
                                                                      else torch.bfloat16)
        c = None if residual is None else _rowmajor(residual.to(c_dtype))
        bb = _bias(bias, N, bias_dtype, dev)
        scale_d = (scale_result if scale_result is not None else constant(dev, 1.0)).reshape(1) \
            if d_dtype in FP8_DTYPES else None
        p = _plan(key, a2, b2, sa, sb, bb, c, scale_d, _EPILOG[act], d_dtype, kernel_amax, stream)
        if p is None:
            continue
        d, am = p.run(a2, b2, sa, sb, bb, c, scale_d, stream)
        if form == "full":
            return d, (am if am is not None else fast_amax(d)) if return_amax else None
        r = d if in_kernel else torch_activation(d, activation, negative_slope)
        return _finish(r, out_dtype, scale_result, return_amax)
    return None


def _rowmajor(t: torch.Tensor) -> torch.Tensor:
    """``t`` [M, N] with rows of exactly N elements: the leading dimension the plan keys assume."""
    return t if t.stride(1) == 1 and t.stride(0) == t.shape[1] else t.contiguous()


def _bias(bias, N, dtype, device):
    if bias is not None:
        return bias.to(dtype).contiguous()
    key = (N, dtype, device)
    z = _zero_bias.get(key)
    if z is None:
        z = _zero_bias[key] = torch.zeros(N, dtype=dtype, device=device)
    return z


def constant(device, value: float) -> torch.Tensor:
    """A float32 one-element tensor of ``value`` on ``device``, made once (a default scale: no fill kernel
    per call)."""
    key = (device, value)
    t = _constants.get(key)
    if t is None:
        t = _constants[key] = torch.full((), value, dtype=torch.float32, device=device)
    return t


def _torch_scaled_mm(a2, b2, sa, sb, bias, activation, residual, out_dtype, scale_result, return_amax,
                     negative_slope):
    """torch._scaled_mm (cuBLASLt, its bias fused) to a 16-bit output, the residual, activation, amax
    and cast in torch."""
    wide = _wide(out_dtype)
    rowwise = sa.numel() != 1 or sb.numel() != 1
    fused_bias = bias is not None and wide != torch.float32  # its bias is 16-bit only
    y = torch._scaled_mm(a2, b2, scale_a=sa if rowwise else sa.reshape(()), scale_b=sb if rowwise else sb.reshape(()),
                         bias=bias.to(wide) if fused_bias else None, out_dtype=wide)
    if bias is not None and not fused_bias:
        y = y + bias.float()
    if residual is not None:
        y = y + residual.to(wide)
    return _finish(torch_activation(y, activation, negative_slope), out_dtype, scale_result, return_amax)


# ------------------------------------------------------------------ specs: record, pre-warm, the plan cache


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def operand(t: TensorSpec, device: torch.device) -> torch.Tensor:
    """A tensor of spec ``t`` on ``device`` (its strides kept), filled with values a pre-warm can run on."""
    x = torch.empty_strided(t.shape, t.stride, dtype=_dtype(t.dtype), device=device)
    x.copy_(torch.randn(t.shape, device=device).clamp(-8, 8))
    return x


def pin_keys(pc, keys) -> int:
    """Pin the plan cache's entries of ``keys`` (a pre-warm found them cached); how many were newly pinned."""
    n = 0
    for k in keys:
        e = pc.get(k, count=False)
        if e is not None and not e.meta.get("pinned") and pc.put(k, dict(e.meta, pinned=True), e.blob, pinned=True):
            n += 1
    return n


def spec_of(a2, b2, bias, activation, residual, out_dtype, return_amax, negative_slope=0.01) -> ScaledMMSpec:
    """The spec of a 2-D product as the GPU path runs it: b K-major (the plan's operand: a b that is not
    is transposed first), the residual a row-major [M, N] of its own dtype."""
    M, K, N = a2.shape[0], a2.shape[1], b2.shape[1]
    b_stride = tuple(b2.stride()) if b2.stride(0) == 1 and b2.stride(1) >= K else (1, K)
    a_stride = tuple(a2.stride()) if a2.stride(1) == 1 else (K, 1)
    name = lambda t: str(t).replace("torch.", "")  # noqa: E731
    epi = Epilogue(bias=None if bias is None else TensorSpec((N,), (1,), name(bias.dtype)),
                   residual=None if residual is None else TensorSpec((M, N), (N, 1), name(residual.dtype)),
                   activation=activation, negative_slope=negative_slope, amax=bool(return_amax))
    return ScaledMMSpec(TensorSpec((M, K), a_stride, name(a2.dtype)), TensorSpec((K, N), b_stride, name(b2.dtype)),
                        TensorSpec((M, N), (N, 1), name(out_dtype)), epi)


def _spec_keys(spec, device: torch.device) -> list:
    """The plan cache keys of the cuBLASLt plans ``spec`` asks for, in the order they are asked."""
    (M, K), N = spec.a.shape, spec.b.shape[1]
    e = spec.epilogue
    return [cache_key(key, _EPILOG[act], device)
            for _, _, _, act, key in _forms(device.index, M, K, N, _dtype(spec.a.dtype), _dtype(spec.b.dtype),
                                            spec.a.stride[0], spec.b.stride[1], e.activation, e.residual is not None,
                                            _dtype(spec.y.dtype), e.amax)]


def spec_cached(pc, spec, device: int, want_tuned: bool) -> bool:
    """Whether the plan cache holds an algorithm for ``spec`` on ``device`` (a tuned one if ``want_tuned``)."""
    if pc is None or not torch.cuda.is_available():
        return False
    for k in _spec_keys(spec, torch.device("cuda", device)):
        entry = pc.get(k, count=False)  # a pre-warm's look: the hit rate leaves it out
        if entry is not None and (entry.meta.get("tuned") is True or not want_tuned):
            return True
    return False


def pin_spec(pc, spec, device: int) -> int:
    """Pin the cached algorithms of ``spec``; how many were newly pinned."""
    return pin_keys(pc, _spec_keys(spec, torch.device("cuda", device)))


def prewarm_spec(spec, device: int) -> None:
    """Plan ``spec`` on ``device`` as a call would (its algorithm stored in the plan cache, autotuned when
    autotuning is on), on operands made for it; UnsupportedError where no cuBLASLt plan would serve it."""
    from .errors import UnsupportedError

    dev = torch.device("cuda", device)
    if not fp8_capable(dev):
        raise UnsupportedError("FP8 GEMMs need a GPU of compute capability 8.9 or newer")
    a2, b2 = operand(spec.a, dev), operand(spec.b, dev)
    e, out_dtype = spec.epilogue, _dtype(spec.y.dtype)
    one = constant(dev, 1.0)
    if engine_of(a2, b2, one, one, out_dtype) != "cublaslt":
        raise UnsupportedError("this product runs torch._scaled_mm (M not a multiple of 16, a float32 output or "
                               "no nvmath): nothing to pre-warm")
    with torch.cuda.device(dev):
        scaled_mm_2d(a2, b2, one, one, None if e.bias is None else operand(e.bias, dev), e.activation,
                     None if e.residual is None else operand(e.residual, dev), out_dtype, None, e.amax,
                     e.negative_slope)
        torch.cuda.synchronize(dev)


def plan_count() -> int:
    return len(_kept.items)


def refused() -> dict:
    """{plan key: cuBLASLt's refusal} of this process (what runs split or through torch, and why)."""
    return _kept.refusals()


def _scaled_mm_op_impl(a2: torch.Tensor, b2: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                       bias: Optional[torch.Tensor], activation: Optional[str], residual: Optional[torch.Tensor],
                       out_dtype: torch.dtype, scale_result: Optional[torch.Tensor], return_amax: bool,
                       negative_slope: float) -> Tuple[torch.Tensor, torch.Tensor]:
    out, am = scaled_mm_2d(a2, b2, scale_a, scale_b, bias, activation, residual, out_dtype, scale_result,
                           return_amax, negative_slope)
    return out.contiguous(), (am if am is not None else torch.empty((0,), dtype=torch.float32, device=a2.device))


# torch.compile sees the GPU path as one op (nvmath is not traceable); no autograd: FP8 operands take none
scaled_mm_op = torch.library.custom_op("cudnn_fuse::scaled_mm_2d", mutates_args=())(_scaled_mm_op_impl)


@scaled_mm_op.register_fake
def _scaled_mm_fake(a2, b2, scale_a, scale_b, bias, activation, residual, out_dtype, scale_result, return_amax,
                    negative_slope):
    out = a2.new_empty((a2.shape[0], b2.shape[1]), dtype=out_dtype)
    return out, a2.new_empty(() if return_amax else (0,), dtype=torch.float32)
