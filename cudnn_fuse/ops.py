"""What the functional ops stand on: validation, the memoized launch, and the fused forward.

The public entry points (functional.py) and the autograd ops (torch_ops.py) call into this:
  1. argument checks (errors.ArgumentError, a ValueError and a RuntimeError, for bad values; TypeError
     for bad types; each naming the argument and its values, where torch would raise);
  2. whether a fused cuDNN graph can run the call (CUDA tensors, a supported dtype, no zero-size
     dimension, ...); if not, ``reference`` runs and the reason is logged once;
  3. the forward on validated arguments (``_conv2d_fwd``, ``_matmul_fwd``, ``_linear_fwd``,
     ``_sdpa_fwd``): layouts canonicalized, the spec made, its plan found and run;
  4. the per-signature memo, whose remembered launch a repeated call takes (in C where
     ``cudnn_fuse._native`` is built).
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import operator
from typing import Optional, Sequence, Tuple

import torch

from . import engines, envvars, launch_graphs, loader, manifest, plans, reference, torch_engine
from .errors import ArgumentError, UnsupportedError
from .spec import (
    ACTIVATIONS,
    ConvSpec,
    Epilogue,
    MatmulSpec,
    SdpaSpec,
    TensorSpec,
    canonical_activation,
    channels_last_strides,
)

log = logging.getLogger(__name__)

_FUSED_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


# ------------------------------------------------------------------------- CuPy


def _is_cupy(x) -> bool:
    return type(x).__module__.split(".", 1)[0] == "cupy"


def _cupy_call(fn, args, kwargs):
    """``fn(*args, **kwargs)`` with CuPy arrays in and out (zero-copy through DLPack): the public ops
    call it after a memo miss when their first argument is a CuPy array (CuPy stays optional: it is
    imported only then). No wrapper: that would add a Python call to every call of the hot path."""
    import cupy

    conv = [torch.from_dlpack(a) if _is_cupy(a) else a for a in args]
    kw = {k: torch.from_dlpack(v) if _is_cupy(v) else v for k, v in kwargs.items()}
    out = fn(*conv, **kw)
    if isinstance(out, tuple):
        return tuple(cupy.from_dlpack(t) for t in out)
    return cupy.from_dlpack(out)


# --------------------------------------------------------------------- logging

_said: set = set()


def _fallback(op: str, reason: str) -> None:
    """Log a fallback reason once per (op, reason); count every fallback. Not while torch.compile
    traces: dynamo cannot trace a logger call (a graph break, an error under fullgraph=True, the
    first time a reason came up), and what it traces is torch's expression, run by no fallback."""
    if torch.compiler.is_compiling():
        return
    plans.STATS.fallbacks += 1
    key = ("*", reason) if reason == "no CUDA GPU" else (op, reason)
    if key in _said:
        return
    _said.add(key)
    if reason == "no CUDA GPU":
        log.warning("no CUDA GPU is available: cudnn_fuse ops run their PyTorch reference")
    else:
        log.debug("%s: running the PyTorch reference: %s", op, reason)


def _why_not_fused(op: str, tensors: Sequence[Optional[torch.Tensor]]) -> Optional[str]:
    """The reason the fused path cannot run these operands, or None."""
    ts = [t for t in tensors if t is not None]
    if not all(t.is_cuda or t.is_meta for t in ts):  # meta: record the spec, run nothing
        return "no CUDA GPU" if not torch.cuda.is_available() else "tensors are not on a CUDA device"
    if ts[0].dtype not in _FUSED_DTYPES:
        return f"dtype {ts[0].dtype} has no cuDNN fused path"
    if any(t.numel() == 0 for t in ts):
        return "zero-size dimension"
    return None


# Ops that torch.compile traces as their PyTorch expression instead of the opaque cuDNN custom
# op, so that Inductor compiles them with their neighbours: a GEMM epilogue or an attention call
# is one Inductor kernel choice among others (cuBLAS + a fused pointwise, torch's SDPA), and a
# custom op inside the graph costs its backward (the SDPA forward recomputed, a pre-activation
# recomputed by a GEMM) and blocks fusion across it. A conv custom op costs tens of microseconds of
# host time inside a compiled function, which left compiled CNNs host-bound and slower than
# torch.compile alone (docs/decisions.md, "torch.compile"), so convs trace as torch's too.
# CUDNN_FUSE_COMPILE_INLINE: comma-separated among conv2d, linear, matmul, sdpa; "" keeps every op
# a custom op under torch.compile.
COMPILE_INLINE_OPS = ("conv2d", "linear", "matmul", "sdpa")


def _parse_inline(raw: Optional[str]) -> frozenset:
    if raw is None:
        return frozenset(COMPILE_INLINE_OPS)
    ops_ = frozenset(p.strip() for p in raw.split(",") if p.strip())
    unknown = ops_ - set(COMPILE_INLINE_OPS)
    if unknown:
        log.warning("CUDNN_FUSE_COMPILE_INLINE: ignoring %s (known: %s)", sorted(unknown), ", ".join(COMPILE_INLINE_OPS))
    return ops_ & frozenset(COMPILE_INLINE_OPS)


compile_inline = _parse_inline(envvars.text(envvars.COMPILE_INLINE))


def set_compile_inline(names) -> frozenset:
    """Which ops torch.compile traces as their PyTorch expression (see ``COMPILE_INLINE_OPS``):
    an iterable of names or one comma-separated string (``()`` or ``""``: none). Returns the
    previous set. Takes effect at the next compilation (``torch._dynamo.reset()``)."""
    global compile_inline
    if isinstance(names, str):
        names = [p.strip() for p in names.split(",") if p.strip()]
    else:
        try:
            names = list(names)
        except TypeError:
            raise TypeError(f"set_compile_inline: names must be a str or an iterable of str, got "
                            f"{type(names).__name__}") from None
        bad = [n for n in names if not isinstance(n, str)]
        if bad:
            raise TypeError(f"set_compile_inline: names must be str, got {bad!r}")
        names = [n.strip() for n in names]
    unknown = sorted(set(names) - set(COMPILE_INLINE_OPS))
    if unknown:
        raise ArgumentError(f"set_compile_inline: unknown op names {unknown} (known: {', '.join(COMPILE_INLINE_OPS)})")
    prev, compile_inline = compile_inline, frozenset(names)
    return prev


def _inline_under_compile(op: str) -> bool:
    return op in compile_inline and torch.compiler.is_compiling()


# --------------------------------------------------------------- torch.autocast
# cf's ops are in autocast's lower-precision list, as F.conv2d, F.linear, torch.matmul and
# F.scaled_dot_product_attention are: under torch.autocast for the first operand's device type,
# every floating-point tensor argument on that device type (float64 excepted, as autocast
# excepts it) is cast to autocast's dtype, and the op runs on the cast tensors with autocast off
# for that device type (its plans, references and backward then see one dtype). Gradients reach
# the original tensors through the casts, in their own dtype, as with torch's ops.

_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (lambda: True)


def autocast_dtype(t) -> Optional[torch.dtype]:
    """torch.autocast's dtype for an op whose first operand is ``t``, or None where autocast is
    off for t's device type (or t is no tensor). One C call when no autocast is on anywhere."""
    if not _any_autocast() or not isinstance(t, torch.Tensor):
        return None
    dev = t.device.type
    try:
        if not torch.is_autocast_enabled(dev):
            return None
        return torch.get_autocast_dtype(dev)
    except (TypeError, AttributeError, RuntimeError):  # a torch without the device-type forms
        if dev == "cuda" and torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
        if dev == "cpu" and torch.is_autocast_cpu_enabled():
            return torch.get_autocast_cpu_dtype()
        return None


def autocast_cast(dtype: torch.dtype, dev: str, *tensors) -> tuple:
    """``tensors`` as autocast casts an op's arguments: floating-point tensors on device type
    ``dev``, other than float64 and ``dtype`` itself, cast to ``dtype``; anything else as it is."""
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type == dev
                 and t.dtype is not dtype and t.dtype is not torch.float64 else t for t in tensors)


def _autocast_off(dev: str):
    return torch.autocast(dev, enabled=False)


def autocast_args(first, *tensors):
    """Under torch.autocast for ``first``'s device type: (that device type, ``tensors`` cast as
    autocast casts them); else None. Callers run their op on the cast tensors under
    ``_autocast_off(device type)``."""
    amp = autocast_dtype(first)
    if amp is None:
        return None
    dev = first.device.type
    return dev, autocast_cast(amp, dev, *tensors)


# torch.func transforms (vmap, grad, jacrev, jvp, ...) wrap tensors whose data a cuDNN launch cannot
# read, and need autograd.Functions with a setup_context (cf's eager ones take ctx in forward, for
# speed): under them an op runs its PyTorch reference, which every transform supports.
_functorch_on = getattr(torch._C, "_are_functorch_transforms_active", None) or (lambda: False)


def _under_functorch(op: str) -> bool:
    if _functorch_on():
        _fallback(op, "a torch.func transform is active")
        return True
    return False


def _via_custom_op(*tensors) -> bool:
    """Autograd and torch.compile go through the registered torch.library op
    (torch_ops.py); plain inference calls the implementation directly."""
    if torch.compiler.is_compiling():
        return True
    return _needs_grad(*tensors)


def _needs_grad(*tensors) -> bool:
    """Whether autograd records a call on ``tensors`` (None where absent)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ------------------------------------------------------------------ validation


def _check_tensor(name: str, t, op: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")


def _check_devices(op: str, ref_name: str, ref: torch.Tensor, **others) -> None:
    """Each of ``others`` None or a tensor on ``ref``'s device (torch refuses operands on two devices too)."""
    for name, t in others.items():
        if t is None:
            continue
        _check_tensor(name, t, op)
        if t.device != ref.device:
            raise ArgumentError(f"{op}: {name} is on {t.device} but {ref_name} is on {ref.device}; they must be on "
                                "one device")


def _check_same(op: str, ref_name: str, ref: torch.Tensor, **others) -> None:
    """``_check_devices``, and one dtype (attention's rule, and torch's: q, k and v of one dtype)."""
    _check_devices(op, ref_name, ref, **others)
    for name, t in others.items():
        if t is not None and t.dtype != ref.dtype:
            raise TypeError(f"{op}: {name} has dtype {t.dtype} but {ref_name} has dtype {ref.dtype}; they must match")


def _check_floating(op: str, name: str, t: torch.Tensor) -> None:
    if not t.is_floating_point():
        raise TypeError(f"{op}: {name} must have a floating-point dtype, got {t.dtype}")


def _torch_dtypes(ref: torch.Tensor, *others) -> Optional[str]:
    """Why operands of these dtypes run torch's own expression (its type promotion, its errors) rather
    than the op's, or None: the fused op (and its reference) takes operands of one floating-point dtype;
    torch also convolves and multiplies integers and complex numbers, and promotes a residual of another
    dtype (``act(F.conv2d(x, w) + residual)`` of a float32 conv and a float64 residual is float64).
    ``others``: the other operands, None where absent."""
    if not ref.is_floating_point():
        return f"dtype {ref.dtype}: no floating-point op (torch's own expression computes it)"
    for t in others:
        if t is not None and t.dtype != ref.dtype:
            return f"operands of dtypes {ref.dtype} and {t.dtype} (torch's own expression promotes them)"
    return None


def _check_flag(op: str, name: str, v) -> None:
    """A bool argument: a string such as "no" or an int must not turn it on by being truthy."""
    if not isinstance(v, bool):
        raise TypeError(f"{op}: {name} must be a bool, got {name}={v!r}")


def _unkeyed(key, activation):
    """The memo key, or None for an activation given as a torch module: the key holds the module itself,
    whose attributes (nn.LeakyReLU's slope, nn.GELU's approximate) can change in place after a call was
    remembered; such a call is validated every time."""
    return key if activation is None or type(activation) is str or not isinstance(activation, torch.nn.Module) else None


def _broadcasts(shape, out_shape) -> bool:
    """Whether ``shape`` broadcasts to exactly ``out_shape`` (as ``t + out`` would, with no bigger result)."""
    try:
        return broadcast_shapes(tuple(shape), tuple(out_shape)) == tuple(out_shape)
    except RuntimeError:
        return False


def _grown(residual, out_shape) -> Optional[tuple]:
    """The output's shape when ``residual`` has another one it broadcasts to (validated), else None."""
    if residual is None or tuple(residual.shape) == tuple(out_shape):
        return None
    return tuple(out_shape)


def _check_epilogue(op: str, activation, residual, out_shape, bias=None, bias_len=None) -> None:
    """The epilogue's operands: an activation by any of its names, a [bias_len] bias, and a residual
    of the output's shape or one that broadcasts to it as torch's ``+`` does, without making the
    result bigger than the output."""
    if activation is not None and activation not in ACTIVATIONS:  # another spelling, or an unknown one: named
        canonical_activation(activation, op=op, strict=False)
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != bias_len):
        raise ArgumentError(f"{op}: bias must have shape ({bias_len},), got bias.shape={tuple(bias.shape)}")
    if residual is not None and tuple(residual.shape) != tuple(out_shape) and not _broadcasts(residual.shape, out_shape):
        raise ArgumentError(f"{op}: residual must have the output's shape {tuple(out_shape)} or broadcast to it "
                            f"(as + does, with no bigger result), got residual.shape={tuple(residual.shape)}")


def _index(v) -> Optional[int]:
    """``v`` as torch reads an int argument, or None: an int, or what ``operator.index`` takes (numpy's
    integers, an integer tensor of one element), never a bool (torch refuses True, a float, numpy's bool)."""
    if type(v) is int:
        return v
    if isinstance(v, bool):
        return None
    try:
        return operator.index(v)
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a meta tensor has no value
        return None


def _pair(name: str, v, op: str, minimum: int) -> Tuple[int, int]:
    """An int or a pair of them (``_index``'s ints: numpy's too), as a tuple of two Python ints."""
    i = None if isinstance(v, (tuple, list)) else _index(v)
    if i is not None:
        p = (i, i)
    elif isinstance(v, (tuple, list)) and len(v) == 2:
        p = (_index(v[0]), _index(v[1]))
    else:
        p = (None,)
    if None in p:
        raise TypeError(f"{op}: {name} must be an int or a pair of ints, got {v!r}")
    if any(i < minimum for i in p):
        raise ArgumentError(f"{op}: {name} must be >= {minimum}, got {name}={p}")
    return p


def _float_arg(op: str, name: str, v) -> float:
    """A float argument as torch reads one: a real number (Python's or numpy's), or a tensor of 0
    dimensions that is real and does not require grad (its value: torch 2.13's
    scaled_dot_product_attention takes ``scale=torch.tensor(0.5)``, and refuses the others)."""
    if isinstance(v, torch.Tensor):
        if v.dim() == 0 and not v.requires_grad and not v.is_complex() and not v.is_meta:
            return float(v)
        raise TypeError(f"{op}: {name} must be a float or None (a tensor only with 0 dimensions, real and not "
                        f"requiring grad, as torch takes one), got a tensor of shape {tuple(v.shape)}, dtype {v.dtype}"
                        + (", requires_grad=True" if v.requires_grad else ""))
    if isinstance(v, numbers.Real):
        return float(v)
    raise TypeError(f"{op}: {name} must be a float or None, got {type(v).__name__}")


def _spec(t: torch.Tensor) -> TensorSpec:
    return TensorSpec.of(t)


def _amax_buffer(ref: torch.Tensor, rank: int) -> torch.Tensor:
    return torch.empty((1,) * rank, dtype=torch.float32, device=ref.device)


ALIGNMENT = 16  # bytes: the operand alignment the graphs declare (the frontend's default)
MISALIGNED = f"an operand's data is not {ALIGNMENT}-byte aligned (a view at an odd offset)"


NEGATED = "an operand is a negated view (its neg bit set: the .imag of a .conj(), torch._neg_view), " \
          "whose memory holds the values unnegated"


def _unlaunchable(buffers) -> Optional[str]:
    """Why cuDNN cannot be given these buffers' memory as they are, or None:

    - a data pointer off the graphs' declared alignment: cuDNN refuses such a launch
      (CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER);
    - a negated view: torch negates its values lazily, on read, and a raw pointer hands cuDNN the
      memory unnegated (a wrong answer, not an error).

    The op runs torch's implementation instead, which honours both."""
    for t in buffers:
        if t is not None:
            if t.data_ptr() % ALIGNMENT:
                return MISALIGNED
            if t.is_neg():
                return NEGATED
    return None


def _run(op: str, spec, buffers, ref_fn, memo=None):
    """Run ``spec``'s plan on ``buffers``; on UnsupportedError, or operands cuDNN cannot take at
    their addresses, run ``ref_fn``. ``memo``: the call's memo key, whose last item is the
    determinism mode the call was keyed under: the plan is looked up (and loaded or built) under
    that mode, not under one read again later (``_remember`` files it under that key).

    An active ``cf.record`` notes the spec; meta tensors stop here (shapes only)."""
    rec = manifest.active()
    if rec is not None:
        rec.add(spec)
    if buffers[0].is_meta:
        return None, None
    why = _unlaunchable(buffers)
    if why is not None:
        _fallback(op, why)
        return None, ref_fn()
    mode = _mode  # engines.pinned_mode(memo[-1]) spelled out (a third of its cost: fp32 calls come here every time)
    old = mode.det
    if memo is not None:
        mode.det = memo[-1]
    try:
        plan = loader.get_plan(spec, buffers[0].device.index)
    except UnsupportedError as exc:
        plan, why = None, str(exc)
    finally:
        mode.det = old
    if plan is None:
        _fallback(op, why)
        return None, ref_fn()
    plan.run(buffers)
    return plan, None


# ------------------------------------------------------------ per-signature memo
#
# The first call of a signature (operand shapes, strides, dtypes, devices and the
# op's attributes, with their exact types) validates, canonicalizes, makes the spec
# and finds the plan; when the plan runs the caller's own tensors (no copy, no
# reshape that moved data), it is remembered with its output geometry. A later call
# of the same signature skips all of that: it allocates the outputs and launches the
# plan with raw pointers. Only plain inference of 16-bit dtypes takes it (fp32's TF32
# flags are global state that can change between calls). A training call remembers
# only its validated call of the autograd op; torch.compile and cf.record never take
# the memo.

_FAST = plans.FAST
# engines.deterministic()'s two getters, inlined into the key: a launch remembered in one mode never serves the other
_det_algorithms, _det_cudnn = engines._det_algorithms, engines._det_cudnn
_mode = engines._mode  # the mode a plan lookup of this thread is pinned to (_run pins the memo key's)
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_FAST_DTYPES = (torch.float16, torch.bfloat16)


def broadcast_shapes(s1, s2) -> tuple:
    """torch.broadcast_shapes of two shapes, in plain Python for int shapes: torch's imports
    torch.fx's symbolic shapes (and sympy) on its first call, seconds of a process's first
    matmul (docs/decisions.md). Symbolic shapes (tracing) go
    to torch's. Raises RuntimeError when they do not broadcast, as torch's does."""
    if not all(type(n) is int for n in (*s1, *s2)):
        return tuple(torch.broadcast_shapes(s1, s2))
    n = max(len(s1), len(s2))
    s1, s2 = (1,) * (n - len(s1)) + tuple(s1), (1,) * (n - len(s2)) + tuple(s2)
    out = []
    for a, b in zip(s1, s2):
        if a != b and a != 1 and b != 1:
            raise RuntimeError(f"shapes {s1} and {s2} do not broadcast")
        out.append(b if a == 1 else a)
    return tuple(out)


# The attributes' exact types, in the key beside their values: True == 1 == 1.0 (one hash), so a key of
# values alone served a bad value from a good one's entry (groups=True once groups=1 was remembered, where
# validation refuses it). _native.attr_sig computes it in C (the C memo's key holds the same); this is its twin,
# used where the module is not built. Attributes of None, bool, int, float, str and flat tuples of those (every
# op's) give an int, 3 bits an item after a leading 1; anything else (a numpy integer, a nested or long tuple)
# gives the nested tuple of exact types, _exact_types(attrs). A tensor attribute (torch takes stride=torch.tensor(2),
# negative_slope=torch.tensor(0.2)) makes the call unkeyable (TypeError: no memo): the key would hold the tensor,
# equal to itself by identity after an in-place change of its value, and served the old value's plan.
_SIG_LEAF = {type(None): 1, bool: 2, int: 3, float: 4, str: 5}  # 6 opens a tuple
_SIG_FULL = 1 << 58  # a code this large takes no further item


def _exact_types(v):
    if type(v) is tuple:
        return tuple([_exact_types(e) for e in v])
    if isinstance(v, torch.Tensor):
        raise TypeError("a tensor attribute cannot key the memo (its value may change in place)")
    return type(v)


def _attr_sig_py(attrs):
    """The memo key's signature of ``attrs`` (``_native.attr_sig``'s twin: they must agree)."""
    if type(attrs) is not tuple:
        return _exact_types(attrs)
    code = 1
    for v in attrs:
        if type(v) is tuple:
            if code >= _SIG_FULL:
                return _exact_types(attrs)
            code = code << 3 | 6
            for e in v:
                c = _SIG_LEAF.get(type(e))
                if c is None or code >= _SIG_FULL:
                    return _exact_types(attrs)
                code = code << 3 | c
        else:
            c = _SIG_LEAF.get(type(v))
            if c is None or code >= _SIG_FULL:
                return _exact_types(attrs)
            code = code << 3 | c
    return code


def _memo(name: str, a, b, c, d, attrs: tuple):
    """(key, remembered call or None) of a call with operands a, b, c, d; (None, None) when the
    memo may not serve it (tracing, recording, a first operand that is not a plain tensor) or the
    arguments cannot be keyed (non-tensors, unhashable values: validation then names them).

    A plain call's entry is its launch (``_Launch``, raw pointers). A training call (autograd
    on, an operand requiring grad; its key's name ends in ":grad") must go through autograd,
    but its validation depends only on the operands' metadata and ``attrs``: its entry is the
    validated call of the autograd op (``_remember_call``), attributes only, never tensors."""
    if type(a) is not torch.Tensor or _active_recorders or _is_compiling() or _functorch_on():
        return None, None
    if _grad_enabled() and (a.requires_grad or getattr(b, "requires_grad", False)
                            or getattr(c, "requires_grad", False) or getattr(d, "requires_grad", False)):
        name += ":grad"
    try:  # four operands, spelled out (each as _meta would), no call per operand: this runs on every call
        key = (name, (a.shape, a.stride(), a.dtype, a.device),
               None if b is None else (b.shape, b.stride(), b.dtype, b.device),
               None if c is None else (c.shape, c.stride(), c.dtype, c.device),
               None if d is None else (d.shape, d.stride(), d.dtype, d.device),
               attrs, _attr_sig(attrs), _det_algorithms() or _det_cudnn())
        entry = _FAST.get(key)
        if entry is not None and ((a.data_ptr() | (0 if b is None else b.data_ptr()) | (0 if c is None else c.data_ptr())
                                   | (0 if d is None else d.data_ptr())) % ALIGNMENT
                                  or a.is_neg() or (b is not None and b.is_neg()) or (c is not None and c.is_neg())
                                  or (d is not None and d.is_neg())):
            # the key holds neither addresses nor neg bits: a misaligned or negated view of a remembered
            # signature goes to the slow path, whose _run falls back (_unlaunchable)
            return key, None
        return key, entry
    except (AttributeError, TypeError, RuntimeError):
        return None, None


def _remember_call(key, call) -> None:
    """Remember a training call's validated call of the autograd op under its ":grad" key."""
    if key is not None and key[0].endswith(":grad"):
        if len(_FAST) >= plans.FAST_CAPACITY:
            _FAST.clear()
        _FAST[key] = call


_active_recorders = manifest._active  # the live list: non-empty while cf.record runs


class _PyLaunch:
    """A remembered signature: the plan and the outputs' geometry. Called with the op's four
    operands (None where absent: which ones are is part of the memo key, so fixed per entry).
    The Python twin of ``_native.Launch`` (``_Launch`` makes whichever the process uses)."""

    __slots__ = ("plan", "size", "stride", "dtype", "device", "amax", "_like_a")

    def __init__(self, plan, y: torch.Tensor, amax: bool, a: Optional[torch.Tensor] = None):
        self.plan, self.size, self.stride = plan, tuple(y.shape), tuple(y.stride())
        self.dtype, self.device, self.amax = y.dtype, y.device, amax
        # the output has the first operand's dtype and device (the key holds them): allocate it
        # through a.new_empty_strided, torch's cheapest allocation call (no keyword parsing)
        self._like_a = a is not None and a.dtype == y.dtype and a.device == y.device

    def __call__(self, a, b, c, d):
        y = a.new_empty_strided(self.size, self.stride) if self._like_a else \
            torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=self.device)
        ptrs = [a.data_ptr()]
        if b is not None:
            ptrs.append(b.data_ptr())
        if c is not None:
            ptrs.append(c.data_ptr())
        if d is not None:
            ptrs.append(d.data_ptr())
        ptrs.append(y.data_ptr())
        if not self.amax:
            self.plan.launch(ptrs)
            return y
        am = torch.empty((), dtype=torch.float32, device=self.device)
        ptrs.append(am.data_ptr())
        self.plan.launch(ptrs)
        return y, am


def _native_launch(plan, y: torch.Tensor, amax: bool, a: Optional[torch.Tensor] = None):
    """``_PyLaunch``'s arguments, made a ``_native.Launch``: the same steps in C, which also replays the
    plan's kernel captures itself (it is given the plan's launch graphs only for a ``plans.Plan``;
    any other plan, and anything the C path does not handle, goes through ``plan.launch``)."""
    graphs = plan._graphs if type(plan) is plans.Plan else None
    return _native.Launch(plan, tuple(y.shape), tuple(y.stride()), y.dtype, y.device, amax,
                          a is not None and a.dtype == y.dtype and a.device == y.device, graphs,
                          plan.device if graphs is not None else -1, plan.workspace_size if graphs is not None else 0)


# The memoized call in C (cudnn_fuse/_native.c): ops._memo's checks and key, and _PyLaunch's allocation and
# launch, for every op. The ops test torch.compiler.is_compiling first, in Python, so that dynamo never meets
# the C call: it traces the Python path, which declines the memo while compiling. The Python path stays for
# misses, for processes without the module, and with CUDNN_FUSE_NATIVE=0; bench/host_overhead.py compares the
# two on the GPU machine (docs/decisions.md, "The memoized call in C").
_native = launch_graphs._native
if _native is not None and not hasattr(_native, "attr_sig"):  # a build older than its source: its keys differ
    log.warning("cudnn_fuse._native is older than cudnn_fuse/_native.c (no attr_sig): rebuild it "
                "(bash bench/build_native.sh, or pip install -e .); memoized calls run in Python until then")
    _native = None
_attr_sig = _native.attr_sig if _native is not None else _attr_sig_py


def _torch_helpers():
    """torch's compiled helpers the C path uses where this torch has them (torch._C._dynamo.guards, what
    Inductor's generated code calls; private, so each is optional and the C path has a fallback): the
    tensor-metadata guard, the output allocations without the Python argument parser (on this host
    1.1 against 2.3 us for new_empty_strided), and a tensor's data pointer as a C function."""
    try:
        from torch._C._dynamo import guards
    except ImportError:
        return None, None, None, 0
    ptr = getattr(guards, "_torchinductor_pyobject_tensor_data_ptr", 0)
    return (getattr(guards, "TensorGuards", None), getattr(guards, "_empty_strided_cuda", None),
            getattr(guards, "_empty_strided_cpu", None), ptr if isinstance(ptr, int) else 0)


_tensor_guards, _alloc_cuda, _alloc_cpu, _data_ptr_fn = _torch_helpers()
if _native is not None:
    _native.configure(ops=globals(), plans=vars(plans), launch_graphs=vars(launch_graphs), tensor=torch.Tensor,
                      parameter=torch.nn.Parameter, empty_strided=torch.empty_strided, empty=torch.empty,
                      float32=torch.float32, tensor_guards=_tensor_guards, data_ptr=_data_ptr_fn)
_native_call = None
_Launch = _PyLaunch


def set_native(enabled: bool) -> bool:
    """Whether memoized calls run in C (``cudnn_fuse._native``; default on where it is built, off with
    ``CUDNN_FUSE_NATIVE=0``). Returns whether they do now: False when asked for C without the module.
    Clears the memo, so remembered calls are made again by the chosen path."""
    global _native_call, _Launch
    if not isinstance(enabled, bool):
        raise TypeError(f"set_native: enabled must be a bool, got {enabled!r}")
    on = enabled and _native is not None
    _native_call, _Launch = (_native.call, _native_launch) if on else (None, _PyLaunch)
    _FAST.clear()
    return on


def memo_keys() -> list:
    """The memo's own keys (ops._FAST; plans.FAST): its entries without the C path's guarded index, which
    shares the dict (so that whatever clears the memo clears the index too)."""
    mark = getattr(_native, "INDEX_MARK", None)
    return [k for k in _FAST if not (type(k) is tuple and k and k[0] is mark and mark is not None)]


def native_enabled() -> bool:
    """Whether memoized calls run in C now (``set_native``)."""
    return _native_call is not None


set_native(launch_graphs.NATIVE)


def _remember(key, originals, plan, buffers, out) -> None:
    """Memoize ``key`` when ``plan`` ran on the caller's tensors themselves: a raw launch, or for
    torch's own kernels standing in for the graph (torch_engine.TorchPlan) a ``_TorchLaunch``; a new
    size's stand-in (loader.StandIn) only while the build process builds its plan (``_StandInLaunch``)."""
    if key is None or key[0].endswith(":grad") or plan is None or originals[0].dtype not in _FAST_DTYPES:
        return  # a training call must reach autograd: never a raw launch
    torch_plan = isinstance(plan, torch_engine.TorchPlan)
    standin = getattr(plan, "standin", False)
    if not plan.raw and not torch_plan or standin and not _building(plan):
        return
    if torch_plan and type(plan.spec) is SdpaSpec:
        return  # a _TorchLaunch takes the matmul and conv operands: attention keeps the slow path
    ins = [t for t in originals if t is not None]
    y, amax = out if isinstance(out, tuple) else (out, None)
    if any(a.data_ptr() != b.data_ptr() for a, b in zip(ins, buffers)) or y.data_ptr() != buffers[len(ins)].data_ptr():
        return  # a copy or a moved view fed the plan: the slow path must keep making it
    if len(_FAST) >= plans.FAST_CAPACITY:
        _FAST.clear()
    if standin:
        _FAST[key] = _StandInLaunch(plan, ins, buffers, y, amax, key[0], key)
    else:
        _FAST[key] = _TorchLaunch(plan, ins, buffers, y, amax, key[0]) if torch_plan else \
            _Launch(plan, y, amax is not None, originals[0])


def _building(stand) -> bool:
    """Whether the build process is building ``stand``'s plan: asked, not answered yet."""
    req = stand.request
    return bool(req) and req.status is None


def _forget(key, entry) -> None:
    """Drop ``entry`` from the memo: its exact key and the guarded index's lists (the C memo's second
    index, kept in the same dict), so that the next call of its signature takes the slow path."""
    fast = _FAST
    if fast.get(key) is entry:
        fast.pop(key, None)
    for v in list(fast.values()):
        if type(v) is list and any(type(p) is tuple and p[-1] is entry for p in v):
            v[:] = [p for p in v if not (type(p) is tuple and p[-1] is entry)]


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()


class _TorchLaunch:
    """A remembered signature whose plan is torch's own kernels (torch_engine.TorchPlan, which takes
    tensors, not raw pointers). Where it applies, the call is eager's own expression on the caller's
    operands (``torch_engine.eager_call``), checked once to give the output the slow path gave (shape,
    strides, dtype); otherwise, or after a mismatch, the operands viewed as the plan's buffers were
    (views of the caller's own memory: the data pointers matched when it was remembered, and the key
    fixes their shapes and strides), the outputs allocated with their remembered geometry, the plan
    run. The C memo calls it as any Python entry."""

    __slots__ = ("plan", "views", "y_buf", "y_out", "amax_shape", "dtype", "device", "direct", "checked")

    def __init__(self, plan, ins, buffers, y_out, amax, op: str = ""):
        self.plan = plan
        self.views = tuple(None if _same_view(a, b) else (tuple(b.shape), tuple(b.stride())) for a, b in zip(ins, buffers))
        yb = buffers[len(ins)]
        self.y_buf = (tuple(yb.shape), tuple(yb.stride()))
        self.y_out = None if _same_view(y_out, yb) else (tuple(y_out.shape), tuple(y_out.stride()))
        self.amax_shape = tuple(buffers[len(ins) + 1].shape) if amax is not None else None
        self.dtype, self.device = yb.dtype, yb.device
        self.direct = torch_engine.eager_call(plan.spec, op) if amax is None else None
        self.checked = False

    def __call__(self, a, b, c, d):
        if self.direct is not None:
            if self.checked:
                return self.direct(a, b, c, d)
            y = self._first_direct(a, b, c, d)
            if y is not None:
                return y
        bufs = []
        for t, v in zip([t for t in (a, b, c, d) if t is not None], self.views):
            bufs.append(t if v is None else t.as_strided(v[0], v[1], t.storage_offset()))
        y = torch.empty_strided(*self.y_buf, dtype=self.dtype, device=self.device)
        bufs.append(y)
        am = None
        if self.amax_shape is not None:
            am = torch.empty(self.amax_shape, dtype=torch.float32, device=self.device)
            bufs.append(am)
        self.plan.run(bufs)
        out = y if self.y_out is None else y.as_strided(self.y_out[0], self.y_out[1], 0)
        return out if am is None else (out, am.view(()))

    def _first_direct(self, a, b, c, d):
        """eager's expression once: its output, or None (and the plan's run from now on) where it
        failed or its output's geometry is not the slow path's."""
        try:
            y = self.direct(a, b, c, d)
        except Exception as exc:  # noqa: BLE001 - the plan's run serves this signature
            log.debug("torch-kernel call: eager's expression failed (%s); the plan's run serves", exc)
            self.direct = None
            return None
        want = self.y_out or self.y_buf
        if (tuple(y.shape), tuple(y.stride()), y.dtype) != (want[0], want[1], self.dtype):
            self.direct = None
            return None
        self.checked = True
        return y


class _StandInLaunch(_TorchLaunch):
    """A new size's stand-in, remembered while the build process builds its plan: torch's kernels at
    eager's host cost, not the slow path's (validation, a spec, the plan lookup: several eager calls'
    worth, docs/dynamic_shapes.md), on every layer of a model that meets the size. Each call counts on
    the stand-in, as the plan lookup would; once the build process has answered, the entry forgets
    itself and the slow path swaps the plan in (``loader.PlanLRU``)."""

    __slots__ = ("key",)

    def __init__(self, plan, ins, buffers, y_out, amax, op: str, key):
        super().__init__(plan, ins, buffers, y_out, amax, op)
        self.key = key

    def __call__(self, a, b, c, d):
        stand = self.plan
        stand.calls += 1
        if not _building(stand):
            _forget(self.key, self)
        return _TorchLaunch.__call__(self, a, b, c, d)


# ----------------------------------------------------------------------- conv2d


def _conv_padding(padding, ksize, dilation, stride, op="conv2d"):
    """(pre, post) padding per spatial dim, torch's rules for 'same' / 'valid'."""
    if isinstance(padding, str):
        if padding == "valid":
            return (0, 0), (0, 0)
        if padding != "same":
            raise ArgumentError(f"{op}: padding must be 'same', 'valid', an int or a pair of ints, got {padding!r}")
        if stride != (1, 1):
            raise ArgumentError(f"{op}: padding='same' is not supported for strided convolutions, got stride={stride}")
        total = [d * (k - 1) for d, k in zip(dilation, ksize)]
        pre = tuple(t // 2 for t in total)
        # torch puts the odd element of the padding after the data
        return pre, tuple(t - p for t, p in zip(total, pre))
    p = _pair("padding", padding, op, 0)
    return p, p


def _as_meta(v):
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device="meta")
    return v


def _record_as_gpu(fwd, *args) -> None:
    """Under ``cf.record`` with CPU tensors: make the spec this call would make on a
    GPU, by running ``fwd`` on meta copies (shapes and strides only, nothing computed)."""
    if manifest.active() is not None and not any(isinstance(a, torch.Tensor) and (a.is_cuda or a.is_meta)
                                                 for a in args):
        fwd(*[_as_meta(a) for a in args])


def _conv2d_fwd(x, weight, bias, stride, pre, post, dilation, groups, activation, residual, return_amax, negative_slope,
                memo=None):
    """conv2d on validated arguments: the fused graph, or the reference.
    ``memo``: the plain call's signature key, remembered when the plan ran on its tensors."""
    _record_as_gpu(_conv2d_fwd, x, weight, bias, stride, pre, post, dilation, groups, activation, residual, return_amax,
                   negative_slope)
    op = "conv2d"
    K = weight.shape[0]
    ref = functools.partial(reference.conv2d_padded, x, weight, bias, stride, pre, post, dilation, groups, activation,
                            residual, return_amax, negative_slope)

    why = _why_not_fused(op, (x, weight, bias, residual))
    if why is not None:
        _fallback(op, why)
        return ref()

    originals = (x, weight, bias, residual)
    out_shape = conv_out_shape(x.shape, weight.shape, stride, pre, post, dilation)
    unbatched = x.dim() == 3
    if unbatched:
        x = x.unsqueeze(0)
        residual = residual.unsqueeze(0) if residual is not None else None
        out_shape = (1,) + out_shape
    x, weight = _conv_layout(x, weight)
    y_stride = channels_last_strides(out_shape)
    y = torch.empty_strided(out_shape, y_stride, dtype=x.dtype, device=x.device)
    # the graph declares the bias dense (epi.bias's strides): a strided or expanded [K] view is read as it is
    # declared, not as it is laid out, so it goes in as a dense copy (then the call is not remembered)
    b4 = bias.contiguous().view(1, K, 1, 1) if bias is not None else None
    if residual is not None:
        # the epilogue reads residual in y's layout (cuDNN rejects NCHW epilogue operands on Hopper)
        residual = residual.contiguous(memory_format=torch.channels_last)
    amax = _amax_buffer(x, 4) if return_amax else None
    epi = Epilogue(
        bias=TensorSpec((1, K, 1, 1), (K, 1, K, K), _FUSED_DTYPES[x.dtype]) if bias is not None else None,
        residual=_spec(residual) if residual is not None else None,
        activation=activation, negative_slope=negative_slope, amax=return_amax)
    spec = ConvSpec(_spec(x), _spec(weight), TensorSpec(out_shape, y_stride, _FUSED_DTYPES[x.dtype]), stride, pre,
                    post, dilation, groups, epi, allow_tf32=_conv_tf32(x))
    buffers = [t for t in (x, weight, b4, residual, y, amax) if t is not None]
    plan, fallback_out = _run(op, spec, buffers, ref, memo)
    if fallback_out is not None:
        return fallback_out
    if unbatched:
        y = y.squeeze(0)
    out = (y, amax.view(())) if return_amax else y
    _remember(memo, originals, plan, buffers, out)
    return out


def conv_out_shape(x_shape, w_shape, stride, pre, post, dilation) -> tuple:
    """The conv output's shape ([N,] K, P, Q) from the input geometry."""
    K, _, R, S = w_shape
    out_hw = tuple((n + a + b - d * (k - 1) - 1) // s + 1
                   for n, a, b, d, k, s in zip(tuple(x_shape[-2:]), pre, post, dilation, (R, S), stride))
    return tuple(x_shape[:-3]) + (K,) + out_hw


def conv_out_channels_last(x: torch.Tensor) -> bool:
    """Whether conv2d's output on ``x`` is channels_last (the layout rule the fake kernel shares)."""
    if x.dim() != 4:
        return False
    if _is_channels_last(x):
        return True
    return (x.is_cuda or x.is_meta) and x.dtype in _FUSED_DTYPES


_is_channels_last = reference.is_channels_last


def _conv_layout(x, weight):
    """x and weight as the fused conv reads them: channels_last (an NCHW input is converted, and its
    output is channels_last: docs/decisions.md, "Conv input layout")."""
    return x.contiguous(memory_format=torch.channels_last), weight.contiguous(memory_format=torch.channels_last)


def _conv_tf32(x) -> bool:
    return x.dtype == torch.float32 and tf32_enabled("conv")


def tf32_enabled(op: str) -> bool:
    """Whether torch runs a float32 ``op`` ("conv": cuDNN, "matmul": cuBLAS) through TF32. The legacy
    flags (``torch.backends.cudnn.allow_tf32``, ``torch.backends.cuda.matmul.allow_tf32``) answer
    unless torch refuses to: with the ``fp32_precision`` API (seen on torch 2.13), reading them raises
    RuntimeError once that API set the matmul's precision, or set cuDNN's conv and RNN apart, and
    every float32 call of cf's raised with it. Then the new API answers, resolved as torch resolves
    it: the op's own setting, else its backend's "all", else "generic"."""
    try:
        return bool(torch.backends.cudnn.allow_tf32 if op == "conv" else torch.backends.cuda.matmul.allow_tf32)
    except RuntimeError:
        pass
    get = torch._C._get_fp32_precision_getter
    for backend, name in (("cuda", op), ("cuda", "all"), ("generic", "all")):
        precision = get(backend, name)
        if precision != "none":
            return precision == "tf32"
    return False


# ----------------------------------------------------------------------- matmul


def _as_batched(t: torch.Tensor, batch: Tuple[int, ...]) -> Optional[torch.Tensor]:
    """View ``t`` ([..., R, C]) as [B|1, R, C] for the output batch ``batch``, or
    None when its batch dims broadcast only partially (torch would copy)."""
    tb = tuple(t.shape[:-2])
    R, C = t.shape[-2:]
    if math.prod(tb) == 1:
        t = t.reshape(1, R, C)
    elif (1,) * (len(batch) - len(tb)) + tb == batch:
        t = t.reshape(-1, R, C)
    else:
        return None
    if t.stride(-1) != 1 and t.stride(-2) != 1:
        t = t.contiguous()  # cuDNN needs row- or column-major matrices
    return t


def matmul_views(a, b, op: str = "matmul"):
    """torch.matmul's geometry: (a2, b2, batch, M, N, out_shape), with 1-D operands
    lifted to matrices. Raises ArgumentError for mismatched inner or batch dims. The
    fake kernel of the custom op uses it too, so shapes cannot drift apart."""
    a2 = a.unsqueeze(0) if a.dim() == 1 else a
    b2 = b.unsqueeze(-1) if b.dim() == 1 else b
    if a2.shape[-1] != b2.shape[-2]:
        raise ArgumentError(f"{op}: inner dimensions differ: a.shape={tuple(a.shape)} and b.shape={tuple(b.shape)} "
                         f"(K={a2.shape[-1]} vs {b2.shape[-2]})")
    try:
        batch = broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
    except RuntimeError:
        raise ArgumentError(f"{op}: batch dimensions do not broadcast: a.shape={tuple(a.shape)}, b.shape={tuple(b.shape)}") from None
    M, N = a2.shape[-2], b2.shape[-1]
    out_shape = batch + ((M,) if a.dim() > 1 else ()) + ((N,) if b.dim() > 1 else ())
    return a2, b2, batch, M, N, out_shape


def _matmul_fwd(a, b, bias, activation, residual, return_amax, negative_slope, views=None, memo=None):
    """matmul on validated arguments: the fused graph, or the reference. ``views``:
    matmul_views(a, b) when the caller computed it already (the plain call does)."""
    _record_as_gpu(_matmul_fwd, a, b, bias, activation, residual, return_amax, negative_slope)
    a2, b2, batch, M, N, out_shape = views if views is not None else matmul_views(a, b)
    ref = functools.partial(reference.matmul, a, b, bias, activation, residual, return_amax, negative_slope)
    return _matmul_fused("matmul", a2, b2, batch, M, N, out_shape, bias, residual, activation, return_amax,
                         negative_slope, ref, memo=memo and (memo, (a, b, bias, residual)))


def _matmul_fused(op, a2, b2, batch, M, N, out_shape, bias, residual, activation, return_amax, negative_slope, ref,
                  memo=None):
    why = _why_not_fused(op, (a2, b2, bias, residual))
    if why is None and a2.dtype == torch.float32 and not tf32_enabled("matmul"):
        # cuDNN matmul rounds fp32 through TF32 even with tensor cores deselected
        why = "float32 matmul with TF32 disabled (cuDNN would round through TF32)"
    a3 = b3 = None
    if why is None:
        a3, b3 = _as_batched(a2, batch), _as_batched(b2, batch)
        if a3 is None or b3 is None:
            why = "batch dims broadcast only partially (would need a copy)"
    if why is not None:
        _fallback(op, why)
        return ref()
    B = max(a3.shape[0], b3.shape[0])
    y = torch.empty((B, M, N), dtype=a2.dtype, device=a2.device)
    r3 = dense_residual(residual.reshape(B, M, N)) if residual is not None else None
    amax = _amax_buffer(y, 3) if return_amax else None
    dt = _FUSED_DTYPES[a2.dtype]
    epi = Epilogue(
        bias=TensorSpec((1, 1, N), (N, N, 1), dt) if bias is not None else None,
        residual=_spec(r3) if r3 is not None else None,
        activation=activation, negative_slope=negative_slope, amax=return_amax)
    spec = MatmulSpec(_spec(a3), _spec(b3), _spec(y), epi, allow_tf32=a2.dtype == torch.float32)
    b1 = bias.contiguous().view(1, 1, N) if bias is not None else None  # declared dense (epi.bias), as in conv2d
    buffers = [t for t in (a3, b3, b1, r3, y, amax) if t is not None]
    plan, fallback_out = _run(op, spec, buffers, ref, memo[0] if memo else None)
    if fallback_out is not None:
        return fallback_out
    y = y.view(out_shape)
    out = (y, amax.view(())) if return_amax else y
    if memo:
        _remember(memo[0], memo[1], plan, buffers, out)
    return out


def dense_residual(r: torch.Tensor) -> torch.Tensor:
    """A matmul residual as the graphs read it: a broadcast (stride-0) dim of more than one element is
    copied out: a [64, 1] residual expanded to [64, 96] (strides (1, 0)) was read wrong by the fused GEMM
    (relative error 60), and other stride-0 residuals were refused, a fallback each call
    (docs/decisions.md)."""
    if any(s == 0 and n > 1 for n, s in zip(r.shape, r.stride())):
        return r.contiguous()
    return r


def _linear_fwd(x, weight, bias, activation, residual, return_amax, negative_slope, memo=None):
    """linear on validated arguments: the fused graph, or the reference."""
    _record_as_gpu(_linear_fwd, x, weight, bias, activation, residual, return_amax, negative_slope)
    op = "linear"
    K, N = x.shape[-1], weight.shape[0]
    out_shape = tuple(x.shape[:-1]) + (N,)
    ref = functools.partial(reference.linear, x, weight, bias, activation, residual, return_amax, negative_slope)
    rows = math.prod(x.shape[:-1])
    a2 = x.reshape(1, rows, K)
    b2 = weight.t().unsqueeze(0)
    r = residual.reshape(1, rows, N) if residual is not None else None
    return _matmul_fused(op, a2, b2, (1,), rows, N, out_shape, bias, r, activation, return_amax, negative_slope, ref,
                         memo=memo and (memo, (x, weight, bias, residual)))


# -------------------------------------------------------------------- attention


def _check_sdpa(op, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> tuple:
    """attention's argument checks; returns the output's leading shape (all but its last 2 dims:
    ``_sdpa_lead``)."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        _check_tensor(name, t, op)
    _check_floating(op, "query", q)
    _check_same(op, "query", q, key=k, value=v)
    if min(q.dim(), k.dim(), v.dim()) < 2:
        raise ArgumentError(f"{op}: query, key and value must have rank >= 2, got "
                            f"query.shape={tuple(q.shape)}, key.shape={tuple(k.shape)}, value.shape={tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ArgumentError(f"{op}: query and key head dims differ: query.shape={tuple(q.shape)}, "
                            f"key.shape={tuple(k.shape)}")
    if k.shape[-2] != v.shape[-2]:
        raise ArgumentError(f"{op}: key and value sequence lengths differ: key.shape={tuple(k.shape)}, "
                            f"value.shape={tuple(v.shape)}")
    lead = _sdpa_lead(op, q, k, v, enable_gqa)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"{op}: dropout_p must be a float, got dropout_p={dropout_p!r}")
    if not (0.0 <= dropout_p < 1.0):
        raise ArgumentError(f"{op}: dropout_p must be in [0, 1), got dropout_p={dropout_p}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"{op}: scale must be a float or None, got {type(scale).__name__}")
    if attn_mask is not None:
        _check_tensor("attn_mask", attn_mask, op)
        if attn_mask.dtype not in (torch.bool, torch.float32, q.dtype):  # torch's rule
            raise TypeError(f"{op}: attn_mask must be bool, float32 or query's dtype {q.dtype}, got {attn_mask.dtype}")
        target = lead + (q.shape[-2], k.shape[-2])
        if not _broadcasts(attn_mask.shape, target):
            raise ArgumentError(f"{op}: attn_mask.shape={tuple(attn_mask.shape)} does not broadcast to {target}")
    return lead


def _sdpa_gqa(q, k, v, enable_gqa) -> bool:
    """Whether k and v keep heads of their own that divide q's (torch's enable_gqa: it repeats them)."""
    return bool(enable_gqa) and min(q.dim(), k.dim(), v.dim()) >= 3 and not (q.shape[-3] == k.shape[-3] == v.shape[-3])


def _sdpa_lead(op, q, k, v, enable_gqa) -> tuple:
    """The output's leading shape: torch's broadcast of q, k and v's leading dims (all but the last 2),
    of any ranks (torch's math: a q [4, 3, 8] with k, v [4, 4, 6, 8] gives [4, 4, 3, 8]). Under
    ``enable_gqa``, k and v's heads (dim -3) count as q's where they divide them, as torch repeats them."""
    ql, kl, vl = tuple(q.shape[:-2]), tuple(k.shape[:-2]), tuple(v.shape[:-2])
    if ql == kl == vl:
        return ql
    if _sdpa_gqa(q, k, v, enable_gqa):
        hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
        if hk != hv:
            raise ArgumentError(f"{op}: key has {hk} heads but value has {hv}")
        if hk == 0 or hq % hk != 0:
            raise ArgumentError(f"{op}: query has {hq} heads and key/value {hk}: that needs enable_gqa=True and "
                                f"{hq} divisible by {hk}")
        kl, vl = kl[:-1] + (hq,), vl[:-1] + (hq,)
    try:
        return broadcast_shapes(broadcast_shapes(ql, kl), vl)
    except RuntimeError:
        pass
    if min(q.dim(), k.dim(), v.dim()) >= 3:
        hq, hk = q.shape[-3], k.shape[-3]
        if hq != hk and 1 not in (hq, hk) and not _sdpa_gqa(q, k, v, enable_gqa):
            raise ArgumentError(f"{op}: query has {hq} heads and key/value {hk}: that needs enable_gqa=True and "
                                f"{hq} divisible by {hk}")
    raise ArgumentError(f"{op}: batch dims do not broadcast: query.shape={tuple(q.shape)}, key.shape={tuple(k.shape)}, "
                        f"value.shape={tuple(v.shape)}")


def _sdpa_broadcast(q, k, v, lead, enable_gqa):
    """q, k and v expanded to the output's leading shape ``lead`` (views: no copy), k and v with their
    own heads under enable_gqa; the tensors themselves where they have it already."""
    own = _sdpa_gqa(q, k, v, enable_gqa)

    def grown(t, heads):
        want = (lead[:-1] + (t.shape[-3],) if heads else lead) + tuple(t.shape[-2:])
        if tuple(t.shape) == want:
            return t
        while t.dim() < len(want):
            t = t.unsqueeze(0)
        return t.expand(want)

    return grown(q, False), grown(k, own), grown(v, own)


def _with_causal(mask, Sq: int, Skv: int):
    """attn_mask with is_causal=True as one mask, as torch 2.13 combines them: a bool mask ANDed with
    the top-left causal lower triangle, a float mask with -inf above its diagonal."""
    tril = torch.ones(Sq, Skv, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        return mask & tril
    return torch.where(tril, mask, torch.tensor(float("-inf"), dtype=mask.dtype, device=mask.device))


def _sdpa_fwd(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, memo=None):
    """attention on validated arguments: the fused graph, or the reference."""
    _record_as_gpu(_sdpa_fwd, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    op = "scaled_dot_product_attention"
    ref = functools.partial(reference.scaled_dot_product_attention, q, k, v, attn_mask, dropout_p, is_causal, scale,
                            enable_gqa)
    why = _why_not_fused(op, (q, k, v, attn_mask))
    if why is None and q.dtype == torch.float32:
        why = "float32 attention has no cuDNN engine"
    if why is None and q.dim() not in (3, 4):
        why = f"{q.dim()}-D inputs (the fused path takes 3-D or 4-D)"
    if why is not None:
        _fallback(op, why)
        return ref()

    originals = (q, k, v, attn_mask)
    squeeze = q.dim() == 3
    if squeeze:  # [H, S, D]: dim -3 is the heads, as for torch's enable_gqa
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    B, H, Sq, D = q.shape
    Skv, Dv = k.shape[-2], v.shape[-1]
    o = _sdpa_output(q, Dv)
    bias = _sdpa_bias(attn_mask, B, H, Sq, Skv, q.dtype)
    spec = SdpaSpec(_spec(q), _spec(k), _spec(v), _spec(o), _spec(bias) if bias is not None else None,
                    bool(is_causal), float(scale) if scale is not None else 1.0 / math.sqrt(D))
    buffers = [t for t in (q, k, v, bias, o) if t is not None]
    plan, fallback_out = _run(op, spec, buffers, ref, memo)
    if fallback_out is not None:
        return fallback_out
    out = o.squeeze(0) if squeeze else o
    _remember(memo, originals, plan, buffers, out)  # not when a mask became a new bias tensor (a copy)
    return out


def _sdpa_output(q: torch.Tensor, Dv: int) -> torch.Tensor:
    """o with q's layout: BSHD memory when q is a BSHD view, else BHSD contiguous."""
    B, H, S, _ = q.shape
    if q.stride(1) < q.stride(2) and H > 1:  # heads inside sequence: BSHD
        return torch.empty((B, S, H, Dv), dtype=q.dtype, device=q.device).transpose(1, 2)
    return torch.empty((B, H, S, Dv), dtype=q.dtype, device=q.device)


def _sdpa_bias(mask, B, H, Sq, Skv, dtype):
    """The additive [B|1, H|1, Sq, Skv] bias cuDNN reads, or None."""
    if mask is None:
        return None
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    if mask.dtype == torch.bool:
        # True takes part: 0; False is masked out: -inf
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    mb = mask.shape[0] if mask.shape[0] == B else 1
    mh = mask.shape[1] if mask.shape[1] == H else 1
    mask = mask.expand(mb, mh, Sq, Skv)
    if mask.stride(-1) != 1 or mask.stride(-2) != Skv or (mb > 1 and mask.stride(0) == 0) or (mh > 1 and mask.stride(1) == 0):
        mask = mask.contiguous()
    return mask
