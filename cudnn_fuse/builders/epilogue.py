"""The shared epilogue: y = act(z + bias + residual), plus amax = max|y|."""

from __future__ import annotations

import cudnn

from ..spec import Epilogue, TensorSpec
from .common import declare, mark_output


def _activation(g, z, name: str, slope: float):
    if name == "relu":
        return g.relu(input=z)
    if name == "gelu":
        return g.gelu(input=z)
    if name == "gelu_tanh":
        return g.gelu_approx_tanh(input=z)
    if name == "silu":  # x * sigmoid(x) is swish with beta = 1
        return g.swish(input=z, swish_beta=1.0)
    if name == "tanh":
        return g.tanh(input=z)
    if name == "sigmoid":
        return g.sigmoid(input=z)
    if name == "leaky_relu":
        return g.leaky_relu(input=z, negative_slope=slope)
    raise ValueError(f"activation {name!r} has no cuDNN pointwise mode")


def pre_activation(g, z, epi: Epilogue):
    """z + bias + residual (the activation's input), still virtual."""
    if epi.bias is not None:
        z = g.add(a=z, b=declare(g, "bias", epi.bias), name="bias_add")
    if epi.residual is not None:
        z = g.add(a=z, b=declare(g, "residual", epi.residual), name="residual_add")
    return z


def apply(g, z, epi: Epilogue, y: TensorSpec, save_z: TensorSpec = None):
    """Append the epilogue to ``z`` (the main op's virtual output) and mark the
    outputs; ``save_z`` also writes the pre-activation (role "z"). Returns the
    output tensor ``y``."""
    z = pre_activation(g, z, epi)
    if save_z is not None:
        mark_output(z, "z", save_z)
    if epi.activation is not None:
        z = _activation(g, z, epi.activation, epi.negative_slope)
    out = mark_output(z, "y", y)
    if epi.amax:
        amax = g.reduction(input=out, mode=cudnn.reduction_mode.AMAX, compute_data_type=cudnn.data_type.FLOAT, name="amax")
        ones = [1] * len(y.shape)
        mark_output(amax, "amax", TensorSpec(tuple(ones), tuple(ones), "float32"))
    return out
