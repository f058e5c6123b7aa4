"""conv2d forward + epilogue."""

from __future__ import annotations

import cudnn

from ..spec import ConvSpec
from . import epilogue
from .common import declare, new_graph


def build(spec: ConvSpec, handle=None):
    g = new_graph(spec.x.dtype, handle)
    epilogue.apply(g, main(g, spec), spec.epilogue, spec.y)
    return g


def main(g, spec: ConvSpec):
    """Declare x and w, add the convolution; returns its virtual output z."""
    x = declare(g, "x", spec.x)
    w = declare(g, "w", spec.w)
    z = g.conv_fprop(
        image=x,
        weight=w,
        pre_padding=list(spec.pre_padding),
        post_padding=list(spec.post_padding),
        stride=list(spec.stride),
        dilation=list(spec.dilation),
        compute_data_type=cudnn.data_type.FLOAT,
        name="conv",
    )
    # cuDNN infers conv outputs as NHWC-packed; pin the virtual tensor to the
    # real output's geometry so the epilogue operands broadcast against it.
    z.set_dim(list(spec.y.shape)).set_stride(list(spec.y.stride))
    return z
