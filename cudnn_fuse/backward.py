"""The CUDA backward of the fused ops through cuDNN training graphs.

Each function here returns None (or leaves a product to torch) when cuDNN
declines a graph; the caller in torch_ops.py then runs the reference math, and
the decline is logged once like a forward fallback. Only float16 / bfloat16 on
CUDA take this path: float32 keeps torch's own backward (cuDNN matmul rounds
fp32 through TF32).

Gemm backward, as the graphs see it (3-D views, no copies):

    dz = act'(z) * dy     one graph: from z recomputed as matmul(a, b) + bias inside
                          the graph (recompute), or from a saved z (or y for ReLU);
                          dbias = ADD reduction of dz in the same graph
    da = dz @ b^T         cuDNN matmul on the transposed view of b
    db = a^T @ dz         (for linear: dW = dz^T @ x, written in W's [out, in] layout)

Conv backward: dz as above (ReLU from the saved output), then dgrad and wgrad
graphs (ReLU's backward fused into dgrad has no Hopper engine).
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import torch

from . import engines, loader, manifest, ops, plans
from .errors import UnsupportedError
from .spec import (
    ActGradSpec,
    ConvDgradSpec,
    ConvSpec,
    ConvWgradSpec,
    Epilogue,
    MatmulSpec,
    RecomputeGradSpec,
    SaveZSpec,
    SdpaBwdSpec,
    SdpaTrainSpec,
    TensorSpec,
)

_DT = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
# engines.deterministic()'s two getters, called here directly as ops' memo calls them: the keys below read
# the mode on every backward call, and pin what they read for the plans they look up (engines.pinned_mode)
_det_algorithms, _det_cudnn = engines._det_algorithms, engines._det_cudnn

log = logging.getLogger(__name__)

# The bias gradient of a gemm whose dz comes from a SAVED z/y is a torch sum after the act-grad
# graph, not a reduction fused into it: the fused reduction was the slower of the two
# (docs/decisions.md, "Backward pieces").
GEMM_FUSE_DBIAS = False


def usable(*tensors) -> bool:
    """Whether the cuDNN backward can take these operands (16-bit CUDA, non-empty, real).

    Under torch.compile, AOTAutograd traces the custom ops' backward formulas with fake
    tensors: there the formulas must take the torch math (which Inductor compiles), since a
    cuDNN graph launch reads data pointers that a fake tensor does not have. One pass of cheap
    checks: this runs in every backward node (the generator-based version and torch's is_fake
    took 13 us a call).

    Grad mode on in a backward means ``create_graph=True`` (a double backward to come, e.g. a
    gradient penalty): a cuDNN launch records no graph, so the formulas take the torch math,
    which does (torch_ops.py)."""
    if torch.compiler.is_compiling() or torch.is_grad_enabled():
        return False
    dt = None
    for t in tensors:
        if t is None:
            continue
        if dt is None:
            dt = t.dtype
            if dt not in _DT:
                return False
        if t.dtype != dt or not t.is_cuda or t.numel() == 0 or _traced(t):
            return False
    return dt is not None


def tracing(ts) -> bool:
    """Whether these tensors are being traced (fake or functional tensors, or torch.compile)."""
    if torch.compiler.is_compiling():
        return True
    return any(_traced(t) for t in ts)


_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
_functional = getattr(torch, "_is_functional_tensor", None)


def _traced(t) -> bool:
    """A fake tensor or tensor subclass (its type says so), or a plain-typed tensor that wraps
    one (functionalization, functorch transforms): the torch math is right for all of them."""
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        return True
    return bool((_wrapped is not None and _wrapped(t)) or (_functional is not None and _functional(t)))


def _spec(t: torch.Tensor) -> TensorSpec:
    return TensorSpec.of(t)


def _try(op: str, spec, buffers, quiet: bool = False) -> bool:
    """Run ``spec`` on ``buffers`` (roles order); False, logged once, when cuDNN declines.
    ``quiet``: a decline that the caller answers with another graph (DEBUG, not a fallback).
    An active ``cf.record`` notes each graph that runs, so a recorded training step pre-warms
    its backward too. A spec from ``_cached_spec`` keeps its plan beside it, so a repeat
    skips hashing the spec and the plan LRU. Operands off the graphs' alignment (a view at an odd
    offset) or negated views are a decline (ops._unlaunchable)."""
    why = ops._unlaunchable(buffers)
    if why is not None:
        if quiet:
            log.debug("%s: %s; trying another way", op, why)
        else:
            ops._fallback(op, why)
        return False
    slot = plans.FAST.get(("plan", id(spec)))
    if slot is not None and slot[0] is spec and slot[1] is not None:
        plan = slot[1]
    else:
        try:
            if slot is not None and slot[0] is spec:  # planned under the mode the spec was remembered under
                with engines.pinned_mode(slot[2]):
                    plan = loader.get_plan(spec, buffers[0].device.index)
            else:
                plan = loader.get_plan(spec, buffers[0].device.index)
        except UnsupportedError as exc:
            if quiet:
                log.debug("%s: cuDNN declined a variant, trying another: %s", op, exc)
            else:
                ops._fallback(op, str(exc))
            return False
        if slot is not None and slot[0] is spec:
            slot[1] = plan
    rec = manifest.active()
    if rec is not None:
        rec.add(spec)
    plan.run(buffers)
    return True


def _cached_spec(kind: str, attrs: tuple, buffers, make):
    """The spec ``make()`` builds for these buffers' geometry and ``attrs``, built once per
    signature (a training step rebuilt three or four frozen specs per layer: the host time of
    the step, not its kernels). Every spec here is a function of its buffers' shapes, strides
    and dtypes and of ``attrs``, which is what the key holds. Kept in the ops' memo (cleared
    with the plans), with a slot for its plan (``_try`` fills it; the slot holds the spec, so
    its id cannot be reused while the slot lives). The key holds the determinism mode too: the slot's
    plan is chosen under the key's mode (the slot keeps it for ``_try``), and must not serve the other. And the
    buffers' device: the slot's plan is bound to one (a spec holds none), and a key without it served one device's
    buffers (a replica of the layer on cuda:1) the plan of another (cuda:0's)."""
    det = _det_algorithms() or _det_cudnn()  # engines.deterministic(), read once: the key's and the slot's
    key = ("spec", kind, attrs, det, buffers[0].device, tuple([(t.shape, t.stride(), t.dtype) for t in buffers]))
    spec = plans.FAST.get(key)
    if spec is None:
        spec = make()
        if len(plans.FAST) >= plans.FAST_CAPACITY - 1:
            plans.FAST.clear()
        plans.FAST[key] = spec
        plans.FAST[("plan", id(spec))] = [spec, None, det]
    return spec


def _dense_like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` with ``like``'s strides (a copy only when they differ)."""
    if t.stride() == like.stride():
        return t
    return torch.empty_like(like).copy_(t)


# ------------------------------------------------------------------ dz (+ dbias)


def _sum_bias(dz: torch.Tensor, bias_shape) -> torch.Tensor:
    dims = tuple(i for i, n in enumerate(bias_shape) if n == 1)
    return dz.sum(dim=dims, keepdim=True, dtype=torch.float32)


def _with_dbias(op: str, make_spec, buffers, dz, bias_shape, attrs: tuple,
                fuse: Optional[bool] = None) -> Optional[torch.Tensor]:
    """Run the dz graph with the bias gradient fused as a reduction; when cuDNN
    declines that, without it (then the bias gradient is a torch sum).
    Returns the float32 dbias (or an empty tensor when none is wanted), None if
    cuDNN declined the graph altogether. ``attrs``: what ``make_spec`` reads besides the
    buffers' geometry."""
    if bias_shape is not None and (fuse is None or fuse):
        dbias = torch.empty_strided(bias_shape, _bias_strides(dz, bias_shape), dtype=torch.float32, device=dz.device)
        bufs = buffers + [dz, dbias]
        if _try(op, _cached_spec(op + "+dbias", attrs, bufs, lambda: make_spec(_spec(dbias))), bufs, quiet=True):
            return dbias
    bufs = buffers + [dz]
    if not _try(op, _cached_spec(op, attrs, bufs, lambda: make_spec(None)), bufs):
        return None
    return _sum_bias(dz, bias_shape) if bias_shape is not None else torch.empty(0, device=dz.device)


def _bias_strides(dz, bias_shape):
    """The reduction output in dz's layout (channels_last dz: NHWC-packed [1, K, 1, 1])."""
    if len(bias_shape) == 4 and dz.stride(1) == 1:
        return (bias_shape[1], 1, bias_shape[1], bias_shape[1])
    return TensorSpec.contiguous(bias_shape, "float32").stride


def _rows_as_nhwc(t: torch.Tensor) -> torch.Tensor:
    """A row-major [B, M, N] as [B*M, N, 1, 1] with NHWC strides: cuDNN fuses a
    pointwise op with a reduction only on NHWC tensors (a 3-D one was declined)."""
    B, M, N = t.shape
    return t.as_strided((B * M, N, 1, 1), (N, 1, N, N))


def act_grad(dy, src, act: str, slope: float, bias_shape=None, fuse_dbias: Optional[bool] = None):
    """(dz, dbias) with dz = act'(src) * dy from a saved src (z, or y for ReLU); None if declined.
    ``fuse_dbias``: whether to try the bias reduction inside the graph (default: yes)."""
    dz = torch.empty_like(dy)

    def make(db):
        return ActGradSpec(_spec(dy), _spec(src), _spec(dz), act, slope, db)

    dbias = _with_dbias("act_grad", make, [dy, src], dz, bias_shape, (act, slope), fuse_dbias)
    return None if dbias is None else (dz, dbias)


def recompute_grad(fwd, fwd_buffers, dy, bias_shape=None):
    """(dz, dbias), the pre-activation recomputed inside the graph from ``fwd``'s
    operands (``fwd.y`` is dz's geometry); None if declined."""
    dz = torch.empty_strided(fwd.y.shape, fwd.y.stride, dtype=dy.dtype, device=dy.device)

    def make(db):
        return RecomputeGradSpec(fwd, _spec(dy), _spec(dz), db)

    dbias = _with_dbias("recompute_grad", make, list(fwd_buffers) + [dy], dz, bias_shape, (fwd,))
    return None if dbias is None else (dz, dbias)


# ------------------------------------------------------------------ gemm


def mm(a3: torch.Tensor, b3: torch.Tensor) -> torch.Tensor:
    """[Ba, M, K] @ [Bb, K, N] -> [B, M, N] through a plain cuDNN matmul graph;
    torch.matmul when cuDNN declines it."""
    B = max(a3.shape[0], b3.shape[0])
    y = torch.empty((B, a3.shape[1], b3.shape[2]), dtype=a3.dtype, device=a3.device)
    spec = _cached_spec("mm", (), (a3, b3, y), lambda: MatmulSpec(_spec(a3), _spec(b3), _spec(y), Epilogue()))
    if not _try("matmul_backward", spec, [a3, b3, y]):
        return torch.matmul(a3, b3)
    return y


def _saved_dz(dy3, src3, act, slope, want_dbias):
    """(dz, dbias f32 [1,1,N] or None) = act'(src3) * dy3 from a saved src, or None if declined."""
    N = dy3.shape[-1]
    if dy3.is_contiguous() and src3.is_contiguous():
        out = act_grad(_rows_as_nhwc(dy3), _rows_as_nhwc(src3), act, slope, (1, N, 1, 1) if want_dbias else None,
                       fuse_dbias=GEMM_FUSE_DBIAS)
        return None if out is None else (out[0].as_strided(dy3.shape, dy3.stride()),
                                         out[1].view(1, 1, N) if want_dbias else None)
    return act_grad(dy3, src3, act, slope, (1, 1, N) if want_dbias else None)


def gemm_dz(a3, b3, bias, r3, dy3, act, slope, src=None, want_dbias=False):
    """(dz, dbias f32 [1,1,N] or None) for y = act(a3 @ b3 + bias + r3); None if declined.

    ``src``: the saved pre-activation z (or y for ReLU); None recomputes z."""
    N = b3.shape[-1]
    bias_shape = (1, 1, N) if want_dbias else None
    if act is None:
        return dy3, (_sum_bias(dy3, bias_shape) if want_dbias else None)
    if src is not None:
        out = _saved_dz(dy3, src.reshape(dy3.shape), act, slope, want_dbias)
    else:
        # the bias dense, as its spec declares it (ops._matmul_fused)
        buffers = [a3, b3] + ([bias.contiguous().view(1, 1, N)] if bias is not None else []) + \
            ([r3] if r3 is not None else [])

        def make_fwd():
            epi = Epilogue(bias=TensorSpec((1, 1, N), (N, N, 1), _DT[a3.dtype]) if bias is not None else None,
                           residual=_spec(r3) if r3 is not None else None, activation=act, negative_slope=slope)
            return MatmulSpec(_spec(a3), _spec(b3), _spec(dy3), epi)

        fwd = _cached_spec("gemm_fwd", (act, slope, bias is not None, r3 is not None), buffers + [dy3], make_fwd)
        out = recompute_grad(fwd, buffers, dy3, bias_shape)
    if out is None:
        return None
    return out[0], (out[1] if want_dbias else None)


def gemm_products(a3, b3, dz, need_a: bool, need_b: bool, weight_layout: bool = False):
    """(da [Ba, M, K], db) for y = a3 @ b3 with dz = dL/dy [B, M, N].

    ``weight_layout``: b3 is a linear weight's transposed view [1, K, N]; db is
    then returned as dW [1, N, K] = dz^T @ a (the weight's own layout)."""
    B, M, N = dz.shape
    K = a3.shape[-1]
    da = db = None
    if need_a:
        da = mm(dz, b3.transpose(1, 2))
        if a3.shape[0] == 1 and B > 1:
            da = da.sum(0, keepdim=True)
    if need_b:
        if b3.shape[0] == 1 and B > 1:  # b broadcast over the batch: one product over all rows
            a_rows, dz_rows = a3.expand(B, M, K).reshape(1, B * M, K), dz.reshape(1, B * M, N)
        else:
            a_rows, dz_rows = a3, dz
        db = mm(dz_rows.transpose(1, 2), a_rows) if weight_layout else mm(a_rows.transpose(1, 2), dz_rows)
    return da, db


def _linear_operands(x, w):
    """x @ w.T as one batch of the matmul graphs: (N, K, rows, a3 [1, rows, K], b3 [1, K, N])."""
    N, K = w.shape
    rows = math.prod(x.shape[:-1])
    a3 = x.reshape(1, rows, K)
    if a3.stride(-1) != 1 and a3.stride(-2) != 1:
        a3 = a3.contiguous()
    return N, K, rows, a3, w.t().unsqueeze(0)


def linear_grads(x, w, bias, residual, gy, act, slope, src, needs):
    """(dx, dw, dbias, dresidual) of y = act(x @ w.T + bias + residual) on the
    cuDNN graphs, or None when the dz graph was declined. ``needs``: 4 bools
    (x, w, bias, residual); the residual's gradient is dz itself. ``bias`` and
    ``residual`` are needed only when z is recomputed (the caller saves them then)."""
    N, K, rows, a3, b3 = _linear_operands(x, w)
    dy3 = gy.contiguous().reshape(1, rows, N)
    r3 = ops.dense_residual(residual.reshape(1, rows, N)) if residual is not None else None
    out = gemm_dz(a3, b3, bias, r3, dy3, act, slope, src, want_dbias=needs[2])
    if out is None:
        return None
    dz, dbias = out
    da, dw = gemm_products(a3, b3, dz, needs[0], needs[1], weight_layout=True)
    return (da.view(x.shape) if da is not None else None, dw.view(N, K) if dw is not None else None,
            dbias.view(N).to(gy.dtype) if dbias is not None else None,
            dz.view(gy.shape) if needs[3] else None)


def matmul_grads(a, b, bias, residual, gy, act, slope, src, needs):
    """(da, db, dbias, dresidual) of y = act(a @ b + bias + residual) with
    torch.matmul's broadcasting; None when the operands need torch's own
    backward (partial broadcasts) or the dz graph was declined."""
    a2, b2, batch, M, N, _ = ops.matmul_views(a, b)
    a3, b3 = ops._as_batched(a2, batch), ops._as_batched(b2, batch)
    if a3 is None or b3 is None:
        return None
    B = max(a3.shape[0], b3.shape[0])
    dy3 = gy.contiguous().reshape(B, M, N)
    r3 = ops.dense_residual(residual.reshape(B, M, N)) if residual is not None else None
    src3 = src.reshape(B, M, N) if src is not None else None
    out = gemm_dz(a3, b3, bias, r3, dy3, act, slope, src3, want_dbias=needs[2])
    if out is None:
        return None
    dz, dbias = out
    da, db = gemm_products(a3, b3, dz, needs[0], needs[1])
    if da is not None:
        da = da.reshape(a2.shape).reshape(a.shape)
    if db is not None:
        db = db.reshape(b2.shape).reshape(b.shape)
    return (da, db, dbias.view(N).to(gy.dtype) if dbias is not None else None,
            dz.view(gy.shape) if needs[3] else None)


def linear_save_z(x, w, bias, residual, act, slope):
    """(y, z) of y = act(z), z = x @ w.T + bias + residual, written by ONE graph;
    None when cuDNN declines it."""
    N, K, rows, a3, b3 = _linear_operands(x, w)
    y = torch.empty((1, rows, N), dtype=x.dtype, device=x.device)
    z = torch.empty_like(y)
    r3 = residual.reshape(1, rows, N).contiguous() if residual is not None else None
    buffers = [a3, b3] + ([bias.contiguous().view(1, 1, N)] if bias is not None else []) + \
        ([r3] if r3 is not None else []) + [y, z]  # the bias dense, as its spec declares it

    def make():
        epi = Epilogue(bias=TensorSpec((1, 1, N), (N, N, 1), _DT[x.dtype]) if bias is not None else None,
                       residual=_spec(r3) if r3 is not None else None, activation=act, negative_slope=slope)
        return SaveZSpec(MatmulSpec(_spec(a3), _spec(b3), _spec(y), epi), _spec(z))

    spec = _cached_spec("save_z", (act, slope, bias is not None, r3 is not None), buffers, make)
    if not _try("linear", spec, buffers):
        return None
    shape = tuple(x.shape[:-1]) + (N,)
    return y.view(shape), z.view(shape)


# ------------------------------------------------------------------ conv


def conv_dz(x, w, bias, residual, gy, y, geo, act, slope, want_dbias):
    """(dz, dbias f32 [1,K,1,1] or None, x4, w4) for a batched conv, in the layout
    the forward ran; None if declined. ``geo``: (stride, pre, post, dilation, groups), as tuples (ctx.geo)."""
    x4, w4 = ops._conv_layout(x, w)
    fmt = torch.channels_last
    dy = gy.contiguous(memory_format=fmt)
    K = w.shape[0]
    bias_shape = (1, K, 1, 1) if want_dbias else None
    if act is None:
        return dy, (_sum_bias(dy, bias_shape) if want_dbias else None), x4, w4
    if act == "relu":
        out = act_grad(dy, y.contiguous(memory_format=fmt), act, slope, bias_shape)
    else:
        r = residual.contiguous(memory_format=fmt) if residual is not None else None
        # the bias dense, as its spec declares it (ops._conv2d_fwd)
        buffers = [x4, w4] + ([bias.contiguous().view(1, K, 1, 1)] if bias is not None else []) + \
            ([r] if r is not None else [])

        def make_fwd():
            epi = Epilogue(bias=TensorSpec((1, K, 1, 1), (K, 1, K, K), _DT[x.dtype]) if bias is not None else None,
                           residual=_spec(r) if r is not None else None, activation=act, negative_slope=slope)
            return ConvSpec(_spec(x4), _spec(w4), _spec(dy), *geo, epi)

        fwd = _cached_spec("conv_fwd", (act, slope, bias is not None, r is not None) + geo, buffers + [dy], make_fwd)
        out = recompute_grad(fwd, buffers, dy, bias_shape)
    if out is None:
        return None
    return out[0], (out[1] if want_dbias else None), x4, w4


class _ConvProgram:
    """A conv layer's whole backward for one signature, replayed: the dz (+ dbias) graph, dgrad
    and wgrad, each output allocated from a remembered geometry and each plan launched with no
    spec, layout or cache work in between. The specs are the ones conv_dz / conv_dgrad /
    conv_wgrad make for these operands (the general path stays for every other case): the Python
    between the three launches of that path took as long as the launches, and a conv training step
    was host-bound (docs/training.md)."""

    __slots__ = ("dz_plan", "dz_geo", "dbias_geo", "dgrad", "dx_geo", "wgrad", "dw_geo", "dtype", "device",
                 "bias_dims", "gy_format", "x_format", "w_format")

    def __call__(self, x, w, y, gy):
        """(dx, dw, dbias [K] in gy's dtype, dz), None where not asked for (dz: always)."""
        dt, dev = self.dtype, self.device
        if self.gy_format is not None:  # a gradient in the other layout (a loss's): the graphs read the forward's
            gy = gy.contiguous(memory_format=self.gy_format)
        if self.x_format is not None:  # an NCHW input or weight the forward converted: converted again
            x = x.contiguous(memory_format=self.x_format)
        if self.w_format is not None:
            w = w.contiguous(memory_format=self.w_format)
        db = None
        if self.dz_plan is None:  # no activation: dz is the incoming gradient
            dz = gy
            if self.bias_dims is not None:
                db = dz.sum(dim=self.bias_dims, dtype=torch.float32)
        else:
            dz = torch.empty_strided(*self.dz_geo, dtype=dt, device=dev)
            if self.dbias_geo is not None:
                db = torch.empty_strided(*self.dbias_geo, dtype=torch.float32, device=dev)
                self.dz_plan.run((gy, y, dz, db))
            else:
                self.dz_plan.run((gy, y, dz))
                if self.bias_dims is not None:
                    db = dz.sum(dim=self.bias_dims, dtype=torch.float32)
        dx = dw = None
        if self.dgrad is not None:
            dx = torch.empty_strided(*self.dx_geo, dtype=dt, device=dev)
            self.dgrad.run((dz, w, dx))
        if self.wgrad is not None:
            dw = torch.empty_strided(*self.dw_geo, dtype=dt, device=dev)
            self.wgrad.run((x, dz, dw))
        return dx, dw, (db.view(-1).to(dt) if db is not None else None), dz


def conv_program(x, w, y, gy, geo, act, slope, need_x: bool, need_w: bool, need_b: bool):
    """(dx, dw, dbias [K] in gy's dtype or None, dz) of a batched conv with no activation or
    ReLU (read from the saved output y), from the signature's remembered program; None when this
    signature has none (a saved output not in the layout the graphs read, a piece cuDNN declines,
    a product on torch, an active recorder): the caller then takes the general path, which
    handles, logs and records every case. What the general path converts (a gradient in another
    layout than the forward's, as a loss hands the last layer; an NCHW input or weight under the
    "convert" policy) the program converts the same way on every call."""
    if manifest._active:
        return None
    det = _det_algorithms() or _det_cudnn()  # engines.deterministic(), read once: the key's and the plans'
    key = ("convprog", x.shape, x.stride(), w.shape, w.stride(), y.stride() if y is not None else None, gy.stride(),
           x.dtype, x.device,
           act, slope, geo, need_x, need_w, need_b, det)
    prog = plans.FAST.get(key)
    if prog is None:
        with engines.pinned_mode(det):  # its plans are chosen under the key's mode
            prog = _build_conv_program(x, w, y, gy, geo, act, slope, need_x, need_w, need_b)
        if len(plans.FAST) >= plans.FAST_CAPACITY - 1:
            plans.FAST.clear()
        plans.FAST[key] = prog
    return prog(x, w, y, gy) if prog is not False else None


def _build_conv_program(x, w, y, gy, geo, act, slope, need_x, need_w, need_b):
    """The program of this signature, or False (the general path's cases: see conv_program)."""
    if act not in (None, "relu") or x.dim() != 4:
        return False
    x4, w4 = ops._conv_layout(x, w)
    fmt = torch.channels_last
    if act == "relu" and not y.is_contiguous(memory_format=fmt):
        return False
    K = w.shape[0]
    device = x.device.index
    p = _ConvProgram()
    p.dtype, p.device = x.dtype, x.device
    p.dz_plan = p.dbias_geo = p.dgrad = p.wgrad = p.bias_dims = p.gy_format = p.x_format = p.w_format = None
    # what the general path converts (conv_dz's layouts), converted on every call the same way
    if not gy.is_contiguous(memory_format=fmt):
        p.gy_format = fmt
        gy = gy.contiguous(memory_format=fmt)
    if x4 is not x:
        p.x_format, x = fmt, x4
    if w4 is not w:
        p.w_format, w = fmt, w4
    p.dz_geo = (tuple(gy.shape), tuple(gy.stride()))
    p.dx_geo, p.dw_geo = (tuple(x.shape), tuple(x.stride())), (tuple(w.shape), tuple(w.stride()))
    try:
        dz_s = _spec(gy)  # dz has gy's geometry (and dtype: usable() checked)
        if act == "relu":
            if need_b:
                db_geo = ((1, K, 1, 1), _bias_strides(gy, (1, K, 1, 1)))
                try:
                    p.dz_plan = loader.get_plan(ActGradSpec(dz_s, _spec(y), dz_s, act, slope,
                                                           TensorSpec(*db_geo, "float32")), device)
                    p.dbias_geo = db_geo
                except UnsupportedError:
                    pass
            if p.dz_plan is None:
                p.dz_plan = loader.get_plan(ActGradSpec(dz_s, _spec(y), dz_s, act, slope, None), device)
        if need_b and p.dbias_geo is None:
            p.bias_dims = (0, 2, 3)
        g = geo[:4]
        if need_x:
            p.dgrad = loader.get_plan(ConvDgradSpec(dz_s, _spec(w), _spec(x), *g), device)
        if need_w:
            p.wgrad = loader.get_plan(ConvWgradSpec(_spec(x), dz_s, _spec(w), *g), device)
    except UnsupportedError:
        return False
    return p


def _conv_grad(op: str, kind: str, spec_type, a, b, like, geo) -> Optional[torch.Tensor]:
    """``spec_type(a, b) -> out`` (dgrad or wgrad), out in ``like``'s layout; None if declined.
    ``geo``'s stride, padding and dilation are tuples already (ctx.geo); the groups are in w's shape."""
    out = torch.empty_like(like)
    g = geo[:4]
    spec = _cached_spec(kind, g, (a, b, out), lambda: spec_type(_spec(a), _spec(b), _spec(out), *g))
    return out if _try(op, spec, [a, b, out]) else None


def conv_dgrad(dz, w4, x4, geo) -> Optional[torch.Tensor]:
    """dx in x4's layout, or None if declined."""
    return _conv_grad("conv2d_dgrad", "dgrad", ConvDgradSpec, dz, w4, x4, geo)


def conv_wgrad(x4, dz, w4, geo) -> Optional[torch.Tensor]:
    """dw in w4's layout, or None if declined."""
    return _conv_grad("conv2d_wgrad", "wgrad", ConvWgradSpec, x4, dz, w4, geo)


# ------------------------------------------------------------------ attention


def _sdpa_inputs(q, k, v, attn_mask):
    """The 4-D, last-dim-dense views the fused forward used, and the additive bias."""
    if q.dim() == 3:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    B, H, Sq, _ = q.shape
    bias = ops._sdpa_bias(attn_mask, B, H, Sq, k.shape[-2], q.dtype)
    return q, k, v, bias


def sdpa_train_usable(q, k, v, attn_mask) -> bool:
    return usable(q, k, v) and q.dim() in (3, 4) and (attn_mask is None or attn_mask.is_cuda)


def sdpa_train_forward(q, k, v, attn_mask, is_causal, scale):
    """(o, stats) of the training forward (stats float32 [B, H, Sq, 1]), or None if declined."""
    squeeze = q.dim() == 3
    q4, k4, v4, bias = _sdpa_inputs(q, k, v, attn_mask)
    B, H, Sq, D = q4.shape
    o = ops._sdpa_output(q4, v4.shape[-1])
    stats = torch.empty((B, H, Sq, 1), dtype=torch.float32, device=q.device)
    spec = SdpaTrainSpec(_spec(q4), _spec(k4), _spec(v4), _spec(o), _spec(stats),
                         _spec(bias) if bias is not None else None, bool(is_causal), _scale(scale, D))
    bufs = [q4, k4, v4] + ([bias] if bias is not None else []) + [o, stats]
    if not _try("scaled_dot_product_attention", spec, bufs):
        return None
    return (o.squeeze(0) if squeeze else o), stats


def _scale(scale, D) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(D)


def sdpa_grads(q, k, v, attn_mask, o, stats, go, is_causal, scale):
    """(dq, dk, dv) from the forward's output and stats, or None if declined."""
    squeeze = q.dim() == 3
    q4, k4, v4, bias = _sdpa_inputs(q, k, v, attn_mask)
    o4, go4 = (o.unsqueeze(0), go.unsqueeze(0)) if squeeze else (o, go)
    do = _dense_like(go4, o4)
    dq, dk, dv = torch.empty_like(q4), torch.empty_like(k4), torch.empty_like(v4)
    spec = SdpaBwdSpec(_spec(q4), _spec(k4), _spec(v4), _spec(o4), _spec(do), _spec(stats), _spec(dq), _spec(dk),
                       _spec(dv), _spec(bias) if bias is not None else None, bool(is_causal), _scale(scale, q4.shape[-1]))
    bufs = [q4, k4, v4, o4, do, stats] + ([bias] if bias is not None else []) + [dq, dk, dv]
    if not _try("scaled_dot_product_attention_backward", spec, bufs):
        return None
    if squeeze:
        dq, dk, dv = dq.squeeze(0), dk.squeeze(0), dv.squeeze(0)
    return dq, dk, dv
