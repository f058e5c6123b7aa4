"""Batched matmul + epilogue on 3-D views."""

from __future__ import annotations

import cudnn

from ..spec import MatmulSpec
from . import epilogue
from .common import declare, new_graph


def build(spec: MatmulSpec, handle=None):
    g = new_graph(spec.a.dtype, handle)
    epilogue.apply(g, main(g, spec), spec.epilogue, spec.y)
    return g


def main(g, spec: MatmulSpec):
    """Declare a and b, add the matmul; returns its virtual output z."""
    a = declare(g, "a", spec.a)
    b = declare(g, "b", spec.b)
    z = g.matmul(A=a, B=b, compute_data_type=cudnn.data_type.FLOAT, name="matmul")
    z.set_dim(list(spec.y.shape)).set_stride(list(spec.y.stride))
    return z
