"""Scaled dot-product attention: forward (inference, or training with softmax
stats) and backward from the stats."""

from __future__ import annotations

import cudnn

from ..spec import SdpaBwdSpec, SdpaSpec, SdpaTrainSpec
from .common import declare, mark_output, new_graph


def _inputs(g, spec):
    q, k, v = (declare(g, r, getattr(spec, r)) for r in ("q", "k", "v"))
    extra = {"bias": declare(g, "bias", spec.bias)} if spec.bias is not None else {}
    return q, k, v, extra


def _forward(spec, handle, training: bool):
    g = new_graph(spec.q.dtype, handle)
    q, k, v, extra = _inputs(g, spec)
    o, stats = g.sdpa(
        q=q,
        k=k,
        v=v,
        generate_stats=training,
        attn_scale=spec.scale,
        use_causal_mask=spec.is_causal,
        compute_data_type=cudnn.data_type.FLOAT,
        name="sdpa",
        **extra,
    )
    mark_output(o, "o", spec.o)
    if training:
        mark_output(stats, "stats", spec.stats)
    return g


def build(spec: SdpaSpec, handle=None):
    return _forward(spec, handle, training=False)


def build_train(spec: SdpaTrainSpec, handle=None):
    return _forward(spec, handle, training=True)


def build_backward(spec: SdpaBwdSpec, handle=None):
    g = new_graph(spec.q.dtype, handle)
    q, k, v, extra = _inputs(g, spec)
    o, do, stats = (declare(g, r, getattr(spec, r)) for r in ("o", "do", "stats"))
    dq, dk, dv = g.sdpa_backward(
        q=q,
        k=k,
        v=v,
        o=o,
        dO=do,
        stats=stats,
        attn_scale=spec.scale,
        use_causal_mask=spec.is_causal,
        compute_data_type=cudnn.data_type.FLOAT,
        name="sdpa_backward",
        **extra,
    )
    for t, r in ((dq, "dq"), (dk, "dk"), (dv, "dv")):
        mark_output(t, r, getattr(spec, r))
    return g
