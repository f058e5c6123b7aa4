"""Training graphs of conv and matmul: the forward that keeps its pre-activation,
the activation's backward (from a saved tensor, or from the pre-activation
recomputed inside the graph), the bias gradient as an ADD reduction, and conv
dgrad / wgrad. Nodes only; engines.finalize builds them."""

from __future__ import annotations

import cudnn

from ..spec import (
    ActGradSpec,
    ConvDgradSpec,
    ConvSpec,
    ConvWgradSpec,
    RecomputeGradSpec,
    SaveZSpec,
)
from . import conv, epilogue, matmul
from .common import declare, mark_output, new_graph

_F32 = cudnn.data_type.FLOAT


def act_backward(g, dy, src, name: str, slope: float):
    """d act / d z * dy. ``src`` is z, or for ReLU either z or y (same mask)."""
    if name == "relu":
        return g.relu_backward(loss=dy, input=src, name="act_backward")
    if name == "gelu":
        return g.gelu_backward(loss=dy, input=src, name="act_backward")
    if name == "gelu_tanh":
        return g.gelu_approx_tanh_backward(loss=dy, input=src, name="act_backward")
    if name == "silu":
        return g.swish_backward(loss=dy, input=src, swish_beta=1.0, name="act_backward")
    if name == "tanh":
        return g.tanh_backward(loss=dy, input=src, name="act_backward")
    if name == "sigmoid":
        return g.sigmoid_backward(loss=dy, input=src, name="act_backward")
    if name == "leaky_relu":
        return g.leaky_relu_backward(loss=dy, input=src, negative_slope=slope, name="act_backward")
    raise ValueError(f"activation {name!r} has no cuDNN backward mode")


def _dz_and_dbias(g, dz, spec):
    mark_output(dz, "dz", spec.dz)
    if spec.dbias is not None:
        db = g.reduction(input=dz, mode=cudnn.reduction_mode.ADD, compute_data_type=_F32, name="dbias")
        mark_output(db, "dbias", spec.dbias)


def _main(g, fwd):
    return (conv.main if isinstance(fwd, ConvSpec) else matmul.main)(g, fwd)


def build_save_z(spec: SaveZSpec, handle=None):
    g = new_graph(spec.fwd.operands()[0].dtype, handle)
    epilogue.apply(g, _main(g, spec.fwd), spec.fwd.epilogue, spec.fwd.y, save_z=spec.z)
    return g


def build_recompute_grad(spec: RecomputeGradSpec, handle=None):
    fwd = spec.fwd
    g = new_graph(fwd.operands()[0].dtype, handle)
    z = epilogue.pre_activation(g, _main(g, fwd), fwd.epilogue)
    dy = declare(g, "dy", spec.dy)
    _dz_and_dbias(g, act_backward(g, dy, z, fwd.epilogue.activation, fwd.epilogue.negative_slope), spec)
    return g


def build_act_grad(spec: ActGradSpec, handle=None):
    g = new_graph(spec.dy.dtype, handle)
    dy = declare(g, "dy", spec.dy)
    src = declare(g, "src", spec.src)
    _dz_and_dbias(g, act_backward(g, dy, src, spec.activation, spec.negative_slope), spec)
    return g


def _geometry(spec) -> dict:
    return dict(pre_padding=list(spec.pre_padding), post_padding=list(spec.post_padding), stride=list(spec.stride),
                dilation=list(spec.dilation), compute_data_type=_F32)


def build_dgrad(spec: ConvDgradSpec, handle=None):
    g = new_graph(spec.dy.dtype, handle)
    dx = g.conv_dgrad(loss=declare(g, "dy", spec.dy), filter=declare(g, "w", spec.w), name="dgrad", **_geometry(spec))
    mark_output(dx, "dx", spec.dx)
    return g


def build_wgrad(spec: ConvWgradSpec, handle=None):
    g = new_graph(spec.x.dtype, handle)
    dw = g.conv_wgrad(image=declare(g, "x", spec.x), loss=declare(g, "dy", spec.dy), name="wgrad", **_geometry(spec))
    mark_output(dw, "dw", spec.dw)
    return g
