"""Scaled dot-product attention forward (inference: no softmax stats)."""

from __future__ import annotations

import cudnn

from ..spec import SdpaSpec
from .common import declare, mark_output, new_graph


def build(spec: SdpaSpec, handle=None):
    g = new_graph(spec.q.dtype, handle)
    q = declare(g, "q", spec.q)
    k = declare(g, "k", spec.k)
    v = declare(g, "v", spec.v)
    kwargs = {}
    if spec.bias is not None:
        kwargs["bias"] = declare(g, "bias", spec.bias)
    o, _stats = g.sdpa(
        q=q,
        k=k,
        v=v,
        generate_stats=False,
        attn_scale=spec.scale,
        use_causal_mask=spec.is_causal,
        compute_data_type=cudnn.data_type.FLOAT,
        name="sdpa",
        **kwargs,
    )
    mark_output(o, "o", spec.o)
    return g
