"""The functional ops as PyTorch custom ops (``torch.ops.cudnn_fuse.*``).

Each op is registered with ``torch.library.custom_op``: its kernel is the op's
implementation in ops.py (the fused cuDNN graph on CUDA, the reference on the
CPU), a fake kernel gives torch.compile shapes and strides without running it,
and ``register_autograd`` gives it a backward. The public functions in ops.py
call these only when autograd or torch.compile needs them; plain inference
calls the implementation directly (no dispatcher on the hot path).

Backward: on CUDA in float16/bfloat16 it runs cuDNN training graphs
(backward.py): the activation's backward with the bias gradient fused as a
reduction, then dgrad/wgrad (conv) or two matmuls (linear, matmul), and SDPA's
backward from the softmax stats of a training forward. ReLU's backward reads
the saved OUTPUT (y > 0), so the forward saves y, never the pre-activation;
other activations recompute the pre-activation inside the backward graph (the
forward saves no M x N intermediate), except ``linear_save_z`` (cf.nn.Linear
with recompute=False), whose one forward graph writes z too and keeps it.
Anything cuDNN declines, float32, and the CPU run the same math on torch
kernels. The amax output has no gradient.

Under ``create_graph=True`` (grad mode on inside a backward) every formula takes the torch
math, written so that the gradients it returns are differentiable in the saved operands and
the incoming gradient: intermediates saved without a graph (a kept pre-activation, FusedMLP's
z1 and y1, a conv chain's activations) are recomputed from the saved inputs, and SDPA runs
torch's math kernel. A kept pre-activation with a residual (the residual is not saved) raises.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import backward, ops, reference

# ------------------------------------------------------------------------ helpers


def _no_amax(like: Tensor) -> Tensor:
    return torch.empty((0,), dtype=torch.float32, device=like.device)


def _amax_out(like: Tensor, return_amax: bool) -> Tensor:
    return torch.empty((), dtype=torch.float32, device=like.device) if return_amax else _no_amax(like)


def _memoized(name: str, a, b, bias, residual, attrs: tuple, fwd):
    """The ops' remembered launch of this signature, else ``fwd(memo_key)``, which remembers it.
    Inside autograd's forward grad is off, so the per-signature memo serves training too."""
    key, launch = ops._memo(name, a, b, bias, residual, attrs)
    return launch(a, b, bias, residual) if launch is not None else fwd(key)


def _split(out, like: Tensor, return_amax: bool):
    return out if return_amax else (out, _no_amax(like))


def _create_graph() -> bool:
    """Inside a backward formula: whether it runs under ``create_graph=True`` (grad mode is on
    there only then), so that its gradients must be differentiable themselves."""
    return torch.is_grad_enabled()


def _check_unchanged(t: Optional[Tensor], version: Optional[int], what: str) -> None:
    """Autograd's in-place error for ``t``, held by reference (not saved) for a recompute inside a
    backward, when it changed in place since the forward read it at ``version``: the recompute
    would read the new values and return wrong gradients without a word. torch checks the saved
    tensors itself."""
    if t is not None and t._version != version:
        raise RuntimeError(f"one of the variables needed for gradient computation has been modified by an inplace "
                           f"operation: {what} [{t.type()} {list(t.shape)}] is at version {t._version}; expected "
                           f"version {version} instead (cudnn_fuse's backward recomputes from it)")


# The activations whose backward aten computes from z alone, in one kernel (in float32 at least:
# half and bfloat16 go through float opmath and are rounded once), as eager autograd runs it.
_NATIVE_ACT_GRAD = {
    "gelu": lambda gy, z, slope: torch.ops.aten.gelu_backward(gy, z),
    "gelu_tanh": lambda gy, z, slope: torch.ops.aten.gelu_backward(gy, z, approximate="tanh"),
    "silu": lambda gy, z, slope: torch.ops.aten.silu_backward(gy, z),
    "leaky_relu": lambda gy, z, slope: torch.ops.aten.leaky_relu_backward(gy, z, slope, False),
}


def _act_grad(z: Tensor, gy: Tensor, act: str, slope: float) -> Tensor:
    """d act(z) / dz * gy, computed in float32 at least (differentiable in z and gy under
    create_graph=True).

    Without create_graph, on CUDA (any dtype) or in float32/float64 on the CPU, GELU, SiLU and
    leaky ReLU take aten's backward kernel, eager's own: the float32 autograd below cost an fp32
    copy of z and of gy, a recomputed forward and a cast back, and made a FusedMLP whose cuDNN
    graphs were declined (every float32 model) 15% slower than eager (docs/training.md)."""
    native = _NATIVE_ACT_GRAD.get(act)
    if (native is not None and gy.dtype == z.dtype and gy.shape == z.shape and not _create_graph()
            and (z.is_cuda or z.dtype in (torch.float32, torch.float64))):
        return native(gy, z, slope)
    acc = torch.promote_types(z.dtype, torch.float32)
    if _create_graph():
        zz = z.to(acc)
        if not zz.requires_grad:
            zz = zz.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(reference.activation(zz, act, slope), zz, gy.to(acc), create_graph=True)
        return g.to(gy.dtype)
    with torch.enable_grad():
        zz = z.detach().to(acc).requires_grad_(True)
        (g,) = torch.autograd.grad(reference.activation(zz, act, slope), zz, gy.to(acc))
    return g.to(gy.dtype)


def _pre_activation_grad(ctx, gy: Tensor, y: Optional[Tensor], recompute_z) -> Tensor:
    act = ctx.act
    if act is None:
        return gy
    if act == "relu":
        return torch.where(y > 0, gy, torch.zeros((), dtype=gy.dtype, device=gy.device))
    return _act_grad(recompute_z(), gy, act, ctx.slope)


def _rows(t: Tensor) -> Tensor:
    """``t`` as a matrix of its last dim (the leading dims folded): ``reshape(-1, n)``, which cannot
    infer the -1 of an empty tensor whose last dim is 0 (a linear of 0 in or out features)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _linear_products(dz: Tensor, x: Tensor, w: Tensor, need_x: bool, need_w: bool, need_b: bool):
    """(dx, dw, db) of z = x @ w.T + b from dz on torch kernels, None where not needed."""
    dz2, x2 = _rows(dz), _rows(x)
    # the column sum first: its scratch then meets fewer live tensors than after dx and dw exist
    db = dz2.sum(0) if need_b else None
    dx = torch.matmul(dz, w) if need_x else None
    dw = torch.matmul(dz2.t(), x2) if need_w else None
    return dx, dw, db


def _save(ctx, main: tuple, y: Tensor, bias, residual) -> None:
    """Save the main operands, plus only what the activation's backward needs."""
    recompute = ctx.act not in (None, "relu")
    ctx.save_for_backward(*main, y if ctx.act == "relu" else None, bias if recompute else None,
                          residual if recompute else None)


def _eager_autograd(impl, setup, backward_fn):
    """An autograd.Function around a custom op's implementation with the op's own formulas
    (setup_context + backward): what eager autograd runs. torch.library's autograd wrapper
    re-parses the arguments and redispatches on every call (its argument handling alone took
    ~90 us a call on a CI host, against ~30 us for a whole eager conv2d + relu); torch.compile
    keeps the custom op, which it traces without running. The forward takes ``ctx`` itself (no
    separate setup_context, for which Function.apply binds the arguments through inspect on
    every call)."""

    def forward(ctx, *args):
        out = impl(*args)
        setup(ctx, args, out)
        return out

    return type(f"{impl.__name__.strip('_')}_function", (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(backward_fn)})


def _pick(op, eager):
    """The custom op under torch.compile, else the plain autograd.Function."""
    return op if torch.compiler.is_compiling() else eager.apply


# ------------------------------------------------------------------------ conv2d


def _conv2d_op_impl(x: Tensor, weight: Tensor, bias: Optional[Tensor], stride: List[int], pre: List[int],
                    post: List[int], dilation: List[int], groups: int, activation: Optional[str],
                    residual: Optional[Tensor], return_amax: bool, negative_slope: float) -> Tuple[Tensor, Tensor]:
    geo = (tuple(stride), tuple(pre), tuple(post), tuple(dilation), groups)
    out = _memoized("conv2d:train", x, weight, bias, residual, geo + (activation, return_amax, negative_slope),
                    lambda key: ops._conv2d_fwd(x, weight, bias, *geo, activation, residual, return_amax,
                                                negative_slope, memo=key))
    y, amax = _split(out, x, return_amax)
    return _conv_out_layout(y, x), amax


def _conv_out_layout(y: Tensor, x: Tensor) -> Tensor:
    return y.contiguous(memory_format=torch.channels_last if ops.conv_out_channels_last(x) else torch.contiguous_format)


conv2d_op = torch.library.custom_op("cudnn_fuse::conv2d", mutates_args=())(_conv2d_op_impl)


class _Conv2dTrain(torch.autograd.Function):
    """Eager training conv without amax: 5 inputs and 1 output instead of the custom op's 12
    and 2. autograd's cost grows with both (each input is inspected by apply, each output
    wrapped and every gradient slot validated); on the CI host with cuDNN mocked
    (bench/host_harness.py) this Function's step cost ~30 us less. Same forward
    implementation and backward formula as the custom op."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, attrs, slot):
        stride, pre, post, dilation, groups, act, slope = attrs
        geo = (stride, pre, post, dilation, groups)
        launch = slot[0] if slot is not None else None
        # a native launch answers None for operands it may not take (misaligned: a guard does not read
        # addresses): the memo and the op's own path decide then, and fall back
        y = launch(x, weight, bias, residual) if launch is not None else None
        if y is None:
            # _conv2d_op_impl without its amax placeholder (one CUDA allocation a layer); attrs'
            # values are tuples already (conv2d_train below), so the memo key is the custom op's own
            key, launch = ops._memo("conv2d:train", x, weight, bias, residual, geo + (act, False, slope))
            if launch is not None:
                y = launch(x, weight, bias, residual)
            if y is None:
                y = ops._conv2d_fwd(x, weight, bias, *geo, act, residual, False, slope, memo=key)
                launch = ops._FAST.get(key) if key is not None else None
            if slot is not None and launch is not None and key[-1] == slot[1]:
                slot[0] = launch  # only a launch of the mode the slot's signature was keyed under
        y = _conv_out_layout(y, x)
        ctx.act, ctx.slope, ctx.geo = act, slope, geo
        ctx.has_bias, ctx.has_residual = bias is not None, residual is not None
        _save(ctx, (x, weight), y, bias, residual)
        return y

    @staticmethod
    def backward(ctx, gy):
        n = ctx.needs_input_grad
        if ctx.act is None or ctx.act == "relu":  # the signature's replayed program, straight from here
            x, w, y, b, _ = ctx.saved_tensors
            if backward.usable(x, w, b, gy):
                out = _conv2d_program_grads(ctx, x, w, y, gy, n[0], n[1], n[2], n[3])
                if out is not None:
                    return out + (None, None)
        g = _conv2d_backward(_OpCtx(ctx.saved_tensors, (n[0], n[1], n[2], False, False, False, False, False, False, n[3],
                                                        False, False), ctx.act, ctx.slope, ctx.geo, ctx.has_bias,
                                    ctx.has_residual), gy, None)
        return g[0], g[1], g[2], g[9], None, None


def _conv2d_program_grads(ctx, x, w, y, gy, need_x, need_w, need_b, need_r):
    """(dx, dw, dbias, dresidual) from backward.conv_program (no activation or ReLU), or None
    when the signature has no program."""
    out = backward.conv_program(x, w, y, gy, ctx.geo, ctx.act, ctx.slope, need_x, need_w, ctx.has_bias and need_b)
    if out is None:
        return None
    dx, dw, dbias, dz = out
    return dx, dw, dbias, (dz if ctx.has_residual and need_r else None)


class _OpCtx:
    """A ctx as the custom op's backward reads it (a lean Function's, or one chained layer's): the
    saved tensors (x, w, y, bias, residual) as _save keeps them, needs_input_grad in the custom op's
    argument layout, and the attributes."""

    __slots__ = ("saved_tensors", "needs_input_grad", "act", "slope", "geo", "has_bias", "has_residual")

    def __init__(self, saved, needs, act, slope, geo, has_bias, has_residual):
        self.saved_tensors, self.needs_input_grad = saved, needs
        self.act, self.slope, self.geo = act, slope, geo
        self.has_bias, self.has_residual = has_bias, has_residual


@conv2d_op.register_fake
def _conv2d_fake(x, weight, bias, stride, pre, post, dilation, groups, activation, residual, return_amax,
                 negative_slope):
    shape = ops.conv_out_shape(x.shape, weight.shape, stride, pre, post, dilation)
    fmt = torch.channels_last if ops.conv_out_channels_last(x) else torch.contiguous_format
    y = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=fmt)
    return y, _amax_out(x, return_amax)


def _conv2d_setup(ctx, inputs, output):
    x, w, b, stride, pre, post, dilation, groups, act, r, _, slope = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.act, ctx.slope = act, slope
    ctx.geo = (tuple(stride), tuple(pre), tuple(post), tuple(dilation), groups)
    ctx.has_bias, ctx.has_residual = b is not None, r is not None
    _save(ctx, (x, w), output[0], b, r)


def _conv2d_backward(ctx, gy, _gamax):
    x, w, y, b, r = ctx.saved_tensors
    if backward.usable(x, w, b, r, gy):  # grouped too: dgrad / wgrad read the groups from w's shape
        out = _conv2d_backward_cudnn(ctx, x, w, y, b, r, gy)
        if out is not None:
            return out
    stride, pre, post, dilation, groups = ctx.geo
    dz = _pre_activation_grad(ctx, gy, y, lambda: reference.conv2d_padded(x, w, b, stride, pre, post, dilation, groups,
                                                                            None, r))
    return _conv2d_products_torch(ctx, x, w, dz)


def _conv2d_backward_cudnn(ctx, x, w, y, b, r, gy):
    """Graph 1: dz (+ dbias), graph 2: dgrad, graph 3: wgrad; torch for a product cuDNN declines."""
    n = ctx.needs_input_grad
    need_b = ctx.has_bias and n[2]
    if ctx.act is None or ctx.act == "relu":  # the signature's replayed program
        out = _conv2d_program_grads(ctx, x, w, y, gy, n[0], n[1], n[2], n[9])
        if out is not None:
            dx, dw, db, dr = out
            return dx, dw, db, None, None, None, None, None, None, dr, None, None
    unbatched = x.dim() == 3
    sq = (lambda t: t.unsqueeze(0) if t is not None else None) if unbatched else (lambda t: t)
    out = backward.conv_dz(sq(x), w, b, sq(r), sq(gy), sq(y), ctx.geo, ctx.act, ctx.slope, need_b)
    if out is None:
        return None
    dz, dbias, x4, w4 = out
    dx = backward.conv_dgrad(dz, w4, x4, ctx.geo) if ctx.needs_input_grad[0] else None
    dw = backward.conv_wgrad(x4, dz, w4, ctx.geo) if ctx.needs_input_grad[1] else None
    if (dx is None and ctx.needs_input_grad[0]) or (dw is None and ctx.needs_input_grad[1]):
        tdx, tdw = _conv2d_products_torch(ctx, sq(x), w, dz)[:2]
        dx, dw = dx if dx is not None else tdx, dw if dw is not None else tdw
    unsq = (lambda t: t.squeeze(0) if t is not None else None) if unbatched else (lambda t: t)
    db = dbias.view(-1).to(gy.dtype) if dbias is not None else None
    dr = unsq(dz) if ctx.has_residual and ctx.needs_input_grad[9] else None
    return unsq(dx), dw, db, None, None, None, None, None, None, dr, None, None


def _conv2d_products_torch(ctx, x, w, dz):
    stride, pre, post, dilation, groups = ctx.geo
    unbatched = x.dim() == 3
    xb, dzb = (x.unsqueeze(0), dz.unsqueeze(0)) if unbatched else (x, dz)
    symmetric = tuple(pre) == tuple(post)
    xp = xb if symmetric else F.pad(xb, (pre[1], post[1], pre[0], post[0]))
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    fmt = None
    if not dzb.is_cuda:  # torch 2.13's CPU conv backward corrupts the heap on some channels_last operands
        # (reference._cpu_conv): NCHW operands, the gradients in the layout torch's backward gives
        fmt = reference.conv_format(xp, w)
        dzb, xp, w = reference.nchw(dzb), reference.nchw(xp), reference.nchw(w)
    dx, dw, _ = torch.ops.aten.convolution_backward(
        dzb, xp, w, None, list(stride), list(pre) if symmetric else [0, 0], list(dilation), False, [0, 0], groups,
        [need_x, need_w, False])
    if fmt is not None:
        dx = dx.contiguous(memory_format=fmt) if dx is not None else None
        dw = dw.contiguous(memory_format=fmt) if dw is not None else None
    if dx is not None:
        if not symmetric:
            H, W = xb.shape[-2:]
            dx = dx[..., pre[0]:pre[0] + H, pre[1]:pre[1] + W]
        dx = dx.squeeze(0) if unbatched else dx
    db = dz.sum(dim=(0, 2, 3) if not unbatched else (1, 2)) if ctx.has_bias and ctx.needs_input_grad[2] else None
    dr = dz if ctx.has_residual and ctx.needs_input_grad[9] else None
    return dx, dw, db, None, None, None, None, None, None, dr, None, None


conv2d_op.register_autograd(_conv2d_backward, setup_context=_conv2d_setup)
_Conv2dFn = _eager_autograd(_conv2d_op_impl, _conv2d_setup, _conv2d_backward)


def conv2d_train(x, weight, bias, residual, attrs, slot):
    """An eager training conv2d without amax. ``attrs``: (stride, pre, post, dilation, groups,
    activation, negative_slope) with tuples and a float, as conv2d below makes them; ``slot``: a
    list [launch, mode] the caller keeps per validated signature (ops.conv2d's remembered call, whose
    memo key holds the determinism mode ``mode``), which the first call of that mode fills with the
    forward's launch, so later calls skip the second memo lookup."""
    if torch.compiler.is_compiling():
        stride, pre, post, dilation, groups, act, slope = attrs
        return conv2d(x, weight, bias, stride, pre, post, dilation, groups, act, residual, False, slope)
    return _Conv2dTrain.apply(x, weight, bias, residual, attrs, slot)


def conv2d(x, weight, bias, stride, pre, post, dilation, groups, activation, residual, return_amax, negative_slope):
    if not return_amax and not torch.compiler.is_compiling():
        return _Conv2dTrain.apply(x, weight, bias, residual, (tuple(stride), tuple(pre), tuple(post), tuple(dilation),
                                                              groups, activation, float(negative_slope)), None)
    y, amax = _pick(conv2d_op, _Conv2dFn)(x, weight, bias, list(stride), list(pre), list(post), list(dilation), groups,
                                         activation, residual, return_amax, float(negative_slope))
    return (y, amax) if return_amax else y


# ------------------------------------------------------------------------ a chain of convs, one node


class _ConvChain(torch.autograd.Function):
    """A chain of convs (each with no activation or ReLU, no residual) as ONE autograd node
    (cudnn_fuse.nn.ConvChain). The forward runs each layer's own forward, with grad off (its
    validated inference call); the backward runs each layer's replayed backward program in turn
    (backward.conv_program: dz + dbias, dgrad, wgrad), the general path where a layer has none.
    What it saves is what the layers' own nodes save (each input, each ReLU output, each weight),
    through save_for_backward; what it removes is one Python autograd node a layer (the node's
    apply, its saved-tensor unpacking and the engine's call into Python)."""

    @staticmethod
    def forward(ctx, x, layers, geos, *params):
        hs = [x]
        for m in layers:
            h = hs[-1]
            hs.append(_conv_out_layout(m.forward(h, epilogue=True), h))  # the layout the layer's own training call returns
        ctx.layers, ctx.geos = layers, geos
        weights = params[0::2]
        # the biases only for create_graph's recompute: held by reference with the versions read here
        # (_check_unchanged), not saved (torch's conv saves none; an in-place bias change is no error then)
        ctx.biases = params[1::2]
        ctx.bias_versions = [b._version if b is not None else None for b in ctx.biases]
        ctx.save_for_backward(*hs, *weights)
        return hs[-1]

    @staticmethod
    def backward(ctx, gy):
        layers, geos = ctx.layers, ctx.geos
        n = len(layers)
        saved = ctx.saved_tensors
        hs, weights = saved[:n + 1], saved[n + 1:]
        need = ctx.needs_input_grad
        if _create_graph():
            for i, (b, version) in enumerate(zip(ctx.biases, ctx.bias_versions)):
                _check_unchanged(b, version, f"the bias of ConvChain's layer {i}")
            return _conv_chain_differentiable(layers, hs[0], weights, ctx.biases, gy, need)
        pneed = need[3:]
        # whether layer i's input needs a gradient: the chain's input does, or a parameter before it
        up = [need[0]]
        for i in range(n - 1):
            up.append(up[-1] or pneed[2 * i] or pneed[2 * i + 1])
        grads = [None] * (2 * n)
        for i in reversed(range(n)):
            m, geo = layers[i], geos[i]
            x, w, b = hs[i], weights[i], m._parameters.get("bias")
            act, slope = m.activation, m.negative_slope
            y = hs[i + 1] if act == "relu" else None
            need_x, need_w, need_b = up[i], pneed[2 * i], b is not None and pneed[2 * i + 1]
            out = None
            if backward.usable(x, w, b, gy):
                out = backward.conv_program(x, w, y, gy, geo, act, slope, need_x, need_w, need_b)
            if out is None:
                needs = (need_x, need_w, need_b, False, False, False, False, False, False, False, False, False)
                g = _conv2d_backward(_OpCtx((x, w, y, None, None), needs, act, slope, geo, b is not None, False), gy, None)
                dx, dw, db = g[0], g[1], g[2]
            else:
                dx, dw, db = out[0], out[1], out[2]
            grads[2 * i], grads[2 * i + 1] = (dw if need_w else None), (db if need_b else None)
            if not need_x:
                break  # nothing before this layer wants a gradient
            gy = dx
        return (gy if need[0] else None, None, None, *grads)


def _conv_chain_differentiable(layers, x, weights, biases, gy, need):
    """The chain's gradients under create_graph=True: its layers run again on torch's ops from
    the saved input (the saved activations have no graph), differentiated with create_graph.
    ``biases``: the forward's own (a layer's bias attribute may have been replaced since)."""
    h = x
    for m, w, b in zip(layers, weights, biases):
        h = torch.nn.Conv2d._conv_forward(m, h, w, b)
        h = F.relu(h) if m.activation == "relu" else h
    ins = [x] + [p for w, b in zip(weights, biases) for p in (w, b)]
    needs = (need[0],) + tuple(need[3:])  # x, then the parameters (the Function's layers/geos need none)
    wanted = [t for t, nd in zip(ins, needs) if nd and t is not None]
    grads = iter(torch.autograd.grad(h, wanted, gy, create_graph=True, allow_unused=True))
    out = [next(grads) if nd and t is not None else None for t, nd in zip(ins, needs)]
    return (out[0], None, None, *out[1:])


def conv_chain(x, layers, geos, params):
    """``layers`` (cudnn_fuse.nn.Conv2d, each with no activation or ReLU and no residual) applied in
    turn to ``x`` as one autograd node; ``geos``: each layer's (stride, pre, post, dilation, groups)
    tuples; ``params``: [w0, b0, w1, b1, ...] (the layers' own, b None where a layer has none).
    For eager training calls (cudnn_fuse.nn.ConvChain decides)."""
    return _ConvChain.apply(x, layers, geos, *params)


# ------------------------------------------------------------------------ linear


def _linear_op_impl(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: Optional[str],
                    residual: Optional[Tensor], return_amax: bool, negative_slope: float) -> Tuple[Tensor, Tensor]:
    out = _memoized("linear:train", x, weight, bias, residual, (activation, return_amax, negative_slope),
                    lambda key: ops._linear_fwd(x, weight, bias, activation, residual, return_amax, negative_slope,
                                                memo=key))
    y, amax = _split(out, x, return_amax)
    return y.contiguous(), amax


linear_op = torch.library.custom_op("cudnn_fuse::linear", mutates_args=())(_linear_op_impl)


@linear_op.register_fake
def _linear_fake(x, weight, bias, activation, residual, return_amax, negative_slope):
    y = torch.empty(tuple(x.shape[:-1]) + (weight.shape[0],), dtype=x.dtype, device=x.device)
    return y, _amax_out(x, return_amax)


def _gemm_setup(ctx, inputs, output):
    """linear and matmul share one argument layout: (x|a, w|b, bias, act, residual, amax, slope)."""
    x, w, b, act, r, _, slope = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.act, ctx.slope = act, slope
    ctx.has_bias, ctx.has_residual = b is not None, r is not None
    _save(ctx, (x, w), output[0], b, r)


def _gemm_needs(ctx) -> tuple:
    n = ctx.needs_input_grad
    return (n[0], n[1], ctx.has_bias and n[2], ctx.has_residual and n[4])


def _gemm_result(grads) -> tuple:
    dx, dw, db, dr = grads
    return dx, dw, db, None, dr, None, None


def _linear_backward(ctx, gy, _gamax):
    x, w, y, b, r = ctx.saved_tensors
    if backward.usable(x, w, b, r, gy):
        out = backward.linear_grads(x, w, b, r, gy, ctx.act, ctx.slope, y if ctx.act == "relu" else None,
                                    _gemm_needs(ctx))
        if out is not None:
            return _gemm_result(out)
    dz = _pre_activation_grad(ctx, gy, y, lambda: reference.linear(x, w, b, None, r))
    dx, dw, db = _linear_products(dz, x, w, ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                                  ctx.has_bias and ctx.needs_input_grad[2])
    dr = dz if ctx.has_residual and ctx.needs_input_grad[4] else None
    return dx, dw, db, None, dr, None, None


linear_op.register_autograd(_linear_backward, setup_context=_gemm_setup)
_LinearFn = _eager_autograd(_linear_op_impl, _gemm_setup, _linear_backward)


def linear(x, weight, bias, activation, residual, return_amax, negative_slope):
    y, amax = _pick(linear_op, _LinearFn)(x, weight, bias, activation, residual, return_amax, float(negative_slope))
    return (y, amax) if return_amax else y


# ------------------------------------------------------------------------ linear, pre-activation kept


def _linear_save_z_op_impl(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str,
                           residual: Optional[Tensor], negative_slope: float) -> Tuple[Tensor, Tensor]:
    """(y, z): y = act(z), z = x @ weight.T + bias + residual; one cuDNN graph writes both."""
    if backward.usable(x, weight, bias, residual):
        out = backward.linear_save_z(x, weight, bias, residual, activation, negative_slope)
        if out is not None:
            return out
    elif not x.is_cuda:
        ops._fallback("linear", "no CUDA GPU" if not torch.cuda.is_available() else "tensors are not on a CUDA device")
    return reference.linear_save_z(x, weight, bias, activation, residual, negative_slope)


linear_save_z_op = torch.library.custom_op("cudnn_fuse::linear_save_z", mutates_args=())(_linear_save_z_op_impl)


@linear_save_z_op.register_fake
def _linear_save_z_fake(x, weight, bias, activation, residual, negative_slope):
    shape = tuple(x.shape[:-1]) + (weight.shape[0],)
    return (torch.empty(shape, dtype=x.dtype, device=x.device), torch.empty(shape, dtype=x.dtype, device=x.device))


def _linear_save_z_setup(ctx, inputs, output):
    x, w, b, act, r, slope = inputs
    ctx.set_materialize_grads(False)  # z's gradient is never used: no M x N zeros for it
    ctx.mark_non_differentiable(output[1])
    ctx.act, ctx.slope = act, slope
    ctx.has_bias, ctx.has_residual = b is not None, r is not None
    ctx.save_for_backward(x, w, output[1], b)


def _linear_save_z_backward(ctx, gy, _gz):
    x, w, z, b = ctx.saved_tensors
    n = ctx.needs_input_grad
    needs = (n[0], n[1], ctx.has_bias and n[2], ctx.has_residual and n[4])
    if gy is None:
        return None, None, None, None, None, None
    if backward.usable(x, w, b, gy):
        out = backward.linear_grads(x, w, b, None, gy, ctx.act, ctx.slope, z, needs)
        if out is not None:
            dx, dw, db, dr = out
            return dx, dw, db, None, dr, None
    if _create_graph():  # the kept z has no graph: recompute it from the saved operands
        if ctx.has_residual:
            raise RuntimeError("cudnn_fuse: create_graph=True (a double backward) through a Linear that keeps its "
                               "pre-activation (recompute=False) with a residual is not supported (the residual is "
                               "not saved): build the layer with cf.nn.Linear(..., recompute=True)")
        z = reference.linear(x, w, b, None, None)
    dz = _act_grad(z, gy, ctx.act, ctx.slope)
    dx, dw, db = _linear_products(dz, x, w, *needs[:3])
    return dx, dw, db, None, (dz if needs[3] else None), None


linear_save_z_op.register_autograd(_linear_save_z_backward, setup_context=_linear_save_z_setup)
_LinearSaveZFn = _eager_autograd(_linear_save_z_op_impl, _linear_save_z_setup, _linear_save_z_backward)


def linear_save_z(x, weight, bias, activation, residual, negative_slope):
    """act(x @ weight.T + bias + residual) whose backward reads the kept pre-activation."""
    return _pick(linear_save_z_op, _LinearSaveZFn)(x, weight, bias, activation, residual, float(negative_slope))[0]


# ------------------------------------------------------------------------ Linear -> act -> Linear


def _saved_tensor_hooks_active() -> bool:
    """Whether torch.autograd.graph.saved_tensors_hooks (save_on_cpu, offloading...) are set;
    True when this torch cannot say."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return True
    try:
        return top(False) is not None
    except Exception:  # noqa: BLE001 - another signature: assume hooks
        return True


def _mlp_save_z(x, w1, b1, act, slope):
    """(y1, z1) of a FusedMLP block's first layer on eager's kernels: the GEMM with its bias, then
    the activation."""
    if not x.is_cuda:
        return reference.linear_save_z(x, w1, b1, act, None, slope)
    z = F.linear(x, w1, b1).contiguous()
    return reference.activation(z, act, slope), z


class _MlpTrain(torch.autograd.Function):
    """out = y1 @ w2.T + b2 [+ residual], y1 = act(z1), z1 = x @ w1.T + b1, for training
    (cf.nn.FusedMLP), on eager's kernels in one autograd node: it saves the hand-overs between the
    five nodes eager autograd would make. The second layer runs torch's addmm (cuDNN's matmul +
    residual epilogue when there is a residual); it keeps what eager torch keeps (x, z1, y1).

    Memory: eager autograd frees y1 after the second layer's backward and z1 after the
    activation's, before the first layer's gradients exist; one node would hold both to its
    end. So z1 and y1 ride on ctx (not save_for_backward) and the backward drops each as soon
    as it has been read. A second backward through the same graph (retain_graph=True) finds
    them gone and recomputes them from x. Under saved_tensors_hooks (save_on_cpu, offloading)
    everything is saved the standard way, so the hooks see it."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, residual, attrs):
        act, slope = attrs
        y1, z1 = _mlp_save_z(x, w1, b1, act, slope)
        if residual is None:
            out = F.linear(y1, w2, b2)
        else:
            out = _linear_op_impl(y1, w2, b2, None, residual, False, slope)[0]
        ctx.act, ctx.slope = act, slope
        ctx.has = (b1 is not None, b2 is not None, residual is not None)
        # b1 only for a recompute (a second backward, or create_graph): held by reference, not saved,
        # so that the saved tensors are exactly eager's (x, w1, w2, z1, y1) and hooks never pack it
        ctx.b1, ctx.b1_version = b1, (b1._version if b1 is not None else None)  # _check_unchanged at a recompute
        if _saved_tensor_hooks_active():
            ctx.inter = None
            ctx.save_for_backward(x, w1, w2, z1, y1)
        else:
            ctx.inter = [z1, y1]
            ctx.save_for_backward(x, w1, w2)
        return out

    @staticmethod
    def backward(ctx, gy):
        saved = ctx.saved_tensors
        x, w1, w2 = saved[:3]
        b1 = ctx.b1
        if ctx.inter is None:
            inter = list(saved[3:])
        else:
            inter, ctx.inter = ctx.inter, [None, None]
            if inter[0] is None:  # a second backward (retain_graph=True): recompute what the first one dropped
                _check_unchanged(b1, ctx.b1_version, "FusedMLP's first bias")
                inter = list(_mlp_save_z(x, w1, b1, ctx.act, ctx.slope))[::-1]
        if _create_graph():  # z1 and y1 have no graph: recompute them from the saved operands
            _check_unchanged(b1, ctx.b1_version, "FusedMLP's first bias")
            z1 = reference.linear(x, w1, b1, None, None)
            inter = [z1, reference.activation(z1, ctx.act, ctx.slope)]
        del saved
        n = ctx.needs_input_grad
        has_b1, has_b2, has_r = ctx.has
        needs = (n[0], n[1], has_b1 and n[2], n[3], has_b2 and n[4], has_r and n[5])
        return _mlp_grads_torch(x, w1, inter, w2, gy, ctx.act, ctx.slope, needs) + (None,)


def _mlp_grads_torch(x, w1, inter, w2, gy, act, slope, needs):
    """The block's six gradients (dx, dw1, db1, dw2, db2, dresidual) on torch kernels, None where
    ``needs`` asks for none. ``inter``: [z1, y1], emptied and each dropped once read (y1 after dW2,
    z1 after dz), as eager autograd frees them between its nodes."""
    z1, y1 = inter
    inter.clear()
    _, dw2, db2 = _linear_products(gy, y1, w2, False, needs[3], needs[4])
    del y1
    dx = dw1 = db1 = None
    if needs[0] or needs[1] or needs[2]:
        dy1 = torch.matmul(gy, w2)
        dz = _act_grad(z1, dy1, act, slope)
        del z1, dy1
        dx, dw1, db1 = _linear_products(dz, x, w1, *needs[:3])
    return dx, dw1, db1, dw2, db2, (gy if needs[5] else None)


def mlp(x, w1, b1, w2, b2, activation, residual, negative_slope):
    """linear(act(linear(x, w1, b1)), w2, b2) [+ residual] with the cross-layer backward
    (eager autograd; torch.compile traces the two layers' own ops instead, nn.FusedMLP)."""
    return _MlpTrain.apply(x, w1, b1, w2, b2, residual, (activation, float(negative_slope)))


# ------------------------------------------------------------------------ matmul


def _matmul_op_impl(a: Tensor, b: Tensor, bias: Optional[Tensor], activation: Optional[str], residual: Optional[Tensor],
                    return_amax: bool, negative_slope: float) -> Tuple[Tensor, Tensor]:
    out = _memoized("matmul:train", a, b, bias, residual, (activation, return_amax, negative_slope),
                    lambda key: ops._matmul_fwd(a, b, bias, activation, residual, return_amax, negative_slope,
                                                memo=key))
    y, amax = _split(out, a, return_amax)
    return y.contiguous(), amax


matmul_op = torch.library.custom_op("cudnn_fuse::matmul", mutates_args=())(_matmul_op_impl)


@matmul_op.register_fake
def _matmul_fake(a, b, bias, activation, residual, return_amax, negative_slope):
    y = torch.empty(ops.matmul_views(a, b)[5], dtype=a.dtype, device=a.device)
    return y, _amax_out(a, return_amax)


def _matmul_backward(ctx, gy, _gamax):
    a, b, y, bias, r = ctx.saved_tensors
    if backward.usable(a, b, bias, r, gy):
        out = backward.matmul_grads(a, b, bias, r, gy, ctx.act, ctx.slope, y if ctx.act == "relu" else None,
                                    _gemm_needs(ctx))
        if out is not None:
            return _gemm_result(out)
    dz = _pre_activation_grad(ctx, gy, y, lambda: reference.matmul(a, b, bias, None, r))
    need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    da = db_ = None
    if (need_a or need_b) and _create_graph():  # differentiable in a, b and dz
        wanted = [t for t, n in ((a, need_a), (b, need_b)) if n]
        grads = iter(torch.autograd.grad(torch.matmul(a, b), wanted, dz, create_graph=True))
        da = next(grads) if need_a else None
        db_ = next(grads) if need_b else None
    elif need_a or need_b:  # torch.matmul's own backward handles every broadcast and 1-D case
        with torch.enable_grad():
            a_ = a.detach().requires_grad_(need_a)
            b_ = b.detach().requires_grad_(need_b)
            wanted = [t for t, n in ((a_, need_a), (b_, need_b)) if n]
            grads = iter(torch.autograd.grad(torch.matmul(a_, b_), wanted, dz))
        da = next(grads) if need_a else None
        db_ = next(grads) if need_b else None
    dbias = _rows(dz).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    dr = dz if ctx.has_residual and ctx.needs_input_grad[4] else None
    return da, db_, dbias, None, dr, None, None


matmul_op.register_autograd(_matmul_backward, setup_context=_gemm_setup)
_MatmulFn = _eager_autograd(_matmul_op_impl, _gemm_setup, _matmul_backward)


def matmul(a, b, bias, activation, residual, return_amax, negative_slope):
    y, amax = _pick(matmul_op, _MatmulFn)(a, b, bias, activation, residual, return_amax, float(negative_slope))
    return (y, amax) if return_amax else y


# ------------------------------------------------------------------------ attention


def _sdpa_bshd(q: Tensor) -> bool:
    return q.dim() == 4 and q.shape[1] > 1 and q.stride(1) < q.stride(2)


def _sdpa_op_impl(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool, scale: Optional[float],
                  enable_gqa: bool) -> Tensor:
    o = ops._sdpa_fwd(q, k, v, attn_mask, 0.0, is_causal, scale, enable_gqa)
    if _sdpa_bshd(q):
        return o.transpose(1, 2).contiguous().transpose(1, 2)
    return o.contiguous()


sdpa_op = torch.library.custom_op("cudnn_fuse::scaled_dot_product_attention", mutates_args=())(_sdpa_op_impl)


@sdpa_op.register_fake
def _sdpa_fake(q, k, v, attn_mask, is_causal, scale, enable_gqa):
    shape = tuple(q.shape[:-1]) + (v.shape[-1],)
    if _sdpa_bshd(q):
        B, H, S, D = shape
        return torch.empty((B, S, H, D), dtype=q.dtype, device=q.device).transpose(1, 2)
    return torch.empty(shape, dtype=q.dtype, device=q.device)


def _sdpa_setup(ctx, inputs, output):
    q, k, v, mask, is_causal, scale, gqa = inputs
    ctx.conf = (is_causal, scale, gqa)
    ctx.save_for_backward(q, k, v, mask)


def _sdpa_backward(ctx, go):
    q, k, v, mask = ctx.saved_tensors
    is_causal, scale, gqa = ctx.conf
    needs = ctx.needs_input_grad
    if _create_graph():  # differentiable in q, k, v, the mask and go: torch's math kernel (its fused
        ins = (q, k, v, mask)  # kernels' backwards have no derivative of their own)
        out = reference.scaled_dot_product_attention_math(q, k, v, mask, is_causal, scale, gqa)
        wanted = [t for t, n in zip(ins, needs[:4]) if n and t is not None]
        grads = iter(torch.autograd.grad(out, wanted, go, create_graph=True)) if wanted else iter(())
        return tuple(next(grads) if n and t is not None else None for t, n in zip(ins, needs[:4])) + (None, None, None)
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(bool(n)) if t is not None else None for t, n in zip((q, k, v, mask), needs)]
        if leaves[3] is not None and leaves[3].dtype == torch.bool:
            leaves[3] = mask
        out = reference.scaled_dot_product_attention(*leaves[:3], leaves[3], 0.0, is_causal, scale, gqa)
        wanted = [t for t, n in zip(leaves, needs[:4]) if n and t is not None]
        grads = iter(torch.autograd.grad(out, wanted, go)) if wanted else iter(())
    return tuple(next(grads) if n and t is not None else None for t, n in zip(leaves, needs[:4])) + (None, None, None)


sdpa_op.register_autograd(_sdpa_backward, setup_context=_sdpa_setup)
_SdpaFn = _eager_autograd(_sdpa_op_impl, _sdpa_setup, _sdpa_backward)


def _sdpa_stats_shape(q) -> tuple:
    """The softmax stats' shape: float32 [B, H, Sq, 1] (B = 1 for a 3-D query)."""
    return (tuple(q.shape[:-3]) if q.dim() == 4 else (1,)) + tuple(q.shape[-3:-1]) + (1,)


# Set on the stats tensor the cuDNN training forward wrote (a Python attribute: the tensor object reaches
# setup_context unchanged, through the eager Function and the custom op's dispatch alike). Stats without it
# (torch's forward ran, or a fake under tracing) never reach cuDNN's backward, whose graph would read them.
_CUDNN_STATS = "_cudnn_fuse_sdpa_stats"


def _sdpa_train_op_impl(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
                        scale: Optional[float], enable_gqa: bool) -> Tuple[Tensor, Tensor]:
    """(o, stats): the training forward; stats float32 [B, H, Sq, 1] (the fake's), the row logsumexp
    of the scaled scores for the cuDNN backward when cuDNN ran; -inf where cuDNN declined (torch's
    forward ran, and the backward is then torch's)."""
    if backward.sdpa_train_usable(q, k, v, attn_mask):
        out = backward.sdpa_train_forward(q, k, v, attn_mask, is_causal, scale)
        if out is not None:
            setattr(out[1], _CUDNN_STATS, True)
            return out
    o = sdpa_op(q, k, v, attn_mask, is_causal, scale, enable_gqa)
    # not the stats (none were computed): a fixed value, so that equal calls give equal outputs, and -inf
    # rather than a plausible logsumexp, so that a graph reading them by mistake gives no finite gradient
    return o, torch.full(_sdpa_stats_shape(q), -math.inf, dtype=torch.float32, device=q.device)


sdpa_train_op = torch.library.custom_op("cudnn_fuse::scaled_dot_product_attention_train",
                                        mutates_args=())(_sdpa_train_op_impl)


@sdpa_train_op.register_fake
def _sdpa_train_fake(q, k, v, attn_mask, is_causal, scale, enable_gqa):
    # used only in eager autograd (sdpa() below keeps torch.compile on sdpa_op); the real op's stats
    # have this shape on either path
    o = _sdpa_fake(q, k, v, attn_mask, is_causal, scale, enable_gqa)
    return o, torch.empty(_sdpa_stats_shape(q), dtype=torch.float32, device=q.device)


def _sdpa_train_setup(ctx, inputs, output):
    q, k, v, mask, is_causal, scale, gqa = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.conf = (is_causal, scale, gqa)
    ctx.cudnn_stats = getattr(output[1], _CUDNN_STATS, False)  # which forward wrote them (not their shape)
    ctx.save_for_backward(q, k, v, mask, output[0], output[1])


def _sdpa_train_backward(ctx, go, _gstats):
    q, k, v, mask, o, stats = ctx.saved_tensors
    is_causal, scale, _ = ctx.conf
    if ctx.cudnn_stats and not (mask is not None and ctx.needs_input_grad[3]) and not _create_graph():
        grads = backward.sdpa_grads(q, k, v, mask, o, stats, go, is_causal, scale)
        if grads is not None:
            return tuple(g if n else None for g, n in zip(grads, ctx.needs_input_grad[:3])) + (None,) * 4
    return _sdpa_backward(_SavedView(ctx, (q, k, v, mask)), go)


class _SavedView:
    """ctx as _sdpa_backward reads it, over a subset of the saved tensors."""

    def __init__(self, ctx, saved):
        self.saved_tensors, self.conf, self.needs_input_grad = saved, ctx.conf, ctx.needs_input_grad


sdpa_train_op.register_autograd(_sdpa_train_backward, setup_context=_sdpa_train_setup)
_SdpaTrainFn = _eager_autograd(_sdpa_train_op_impl, _sdpa_train_setup, _sdpa_train_backward)


def sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    # dropout_p > 0 never reaches here (ops runs the autograd-capable reference: the
    # backward could not replay the forward's random mask)
    if (q.is_cuda and torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and any(t is not None and t.requires_grad for t in (q, k, v, attn_mask))):
        return _SdpaTrainFn.apply(q, k, v, attn_mask, bool(is_causal), None if scale is None else float(scale),
                                  bool(enable_gqa))[0]
    return _pick(sdpa_op, _SdpaFn)(q, k, v, attn_mask, bool(is_causal), None if scale is None else float(scale),
                                   bool(enable_gqa))
