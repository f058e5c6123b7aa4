"""FP8 attention forward through cuDNN's ``sdpa_fp8`` graph (inference: no softmax stats).

One graph per shape, strides, format, causality and scale, built on the device's shared handle (under
its lock, bound to cf's side stream, as every build is: ``handles.held``), kept in memory and stored
serialized in the plan cache, where a new process finds it; a launch binds the handle to the caller's
stream. The probabilities are quantized with ``scale_s`` and
dequantized with ``descale_s`` inside the kernel; O is written in q's FP8 format (Hopper has no 16-bit
O for this graph) times ``scale_o``, and the kernel writes max |O| before ``scale_o`` (``amax_o``).
A graph cuDNN declines is remembered with its reason; the caller then runs its fallback.
"""

from __future__ import annotations

import hashlib
import logging
from typing import List

import torch
from torch import Tensor

from . import handles
from .fp8_gemm import Kept, capability, operand, pin_keys
from .spec import SdpaFP8Spec, TensorSpec
from .reference import amax as torch_amax, fp8_cast

log = logging.getLogger(__name__)

MAX_GRAPHS = 64  # built graphs kept; least recently used go first
STATS = {"from_cache": 0, "built": 0}  # where this process's graphs came from
_kept = Kept(MAX_GRAPHS, log, "FP8 attention: cuDNN")
_ROLES = ("q", "k", "v", "descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o", "o", "amax_s",
          "amax_o")
UIDS = {role: i + 1 for i, role in enumerate(_ROLES)}


def fp8_attention_capable(device: torch.device) -> bool:
    """cuDNN's FP8 attention runs on Hopper and newer (compute capability 9.0)."""
    return device.type == "cuda" and capability(device) >= (9, 0)


class _Graph:
    __slots__ = ("graph", "workspace_size")

    def __init__(self, graph, workspace_size: int):
        self.graph, self.workspace_size = graph, workspace_size


def _fp8_type(dtype):
    import cudnn

    return cudnn.data_type.FP8_E4M3 if dtype == torch.float8_e4m3fn else cudnn.data_type.FP8_E5M2


def _build(q, k, v, o, is_causal: bool, scale: float, handle):
    import cudnn

    fmt, f32 = _fp8_type(q.dtype), cudnn.data_type.FLOAT
    g = cudnn.pygraph(io_data_type=fmt, intermediate_data_type=f32, compute_data_type=f32, handle=handle)

    def tensor(role, t, dtype):
        return g.tensor(name=role, dim=list(t.shape), stride=list(t.stride()), data_type=dtype).set_uid(UIDS[role])

    one = torch.empty((1, 1, 1, 1))
    tq, tk, tv = tensor("q", q, fmt), tensor("k", k, fmt), tensor("v", v, fmt)
    scales = [tensor(r, one, f32) for r in _ROLES[3:9]]
    out, _, amax_s, amax_o = g.sdpa_fp8(q=tq, k=tk, v=tv, descale_q=scales[0], descale_k=scales[1],
                                        descale_v=scales[2], descale_s=scales[3], scale_s=scales[4],
                                        scale_o=scales[5], generate_stats=False, attn_scale=scale,
                                        use_causal_mask=is_causal, name="sdpa_fp8")
    out.set_output(True).set_dim(list(o.shape)).set_stride(list(o.stride())).set_data_type(fmt).set_uid(UIDS["o"])
    for role, t in (("amax_s", amax_s), ("amax_o", amax_o)):
        t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32).set_uid(UIDS[role])
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return _Graph(g, int(g.get_workspace_size()))


def _key(q, k, v, is_causal, scale):
    return (q.device.index, q.dtype, tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), tuple(v.shape), v.stride(),
            bool(is_causal), float(scale))


def cache_key(key) -> str:
    """The plan cache's key of the graph of ``key`` (without the device index: the cache's namespace is
    the device's environment)."""
    return hashlib.sha256(repr(("fp8-attention", tuple(str(k) for k in key[1:]))).encode()).hexdigest()


def _from_cache(pc, ckey: str, h, device: int):
    """The graph the plan cache holds for ``ckey``, deserialized; None where there is none or it does not
    deserialize (logged: the graph is built again and replaces it)."""
    entry = pc.get(ckey) if pc is not None else None
    if entry is None:
        return None
    try:
        import cudnn

        with handles.held(h, device):  # deserialize warms the plan up on the handle's stream (loader.py)
            g = cudnn.pygraph(handle=h.handle)
            g.deserialize(h.handle, entry.blob)
        return _Graph(g, int(g.get_workspace_size()))
    except Exception as e:  # noqa: BLE001 - a verified blob can still be nonsense to this cuDNN
        log.info("FP8 attention: cached graph %s did not deserialize (%s: %s); building it", ckey[:12],
                 type(e).__name__, e)
        return None


def _graph(key, q, k, v, o, is_causal, scale):
    """The kept graph of ``key``: from memory, else from the plan cache, else built now (and stored);
    None where cuDNN declined it (remembered)."""

    def build():
        from .cache import open_default_cache

        device = q.device.index
        h = handles.handle_for(device)
        pc = open_default_cache(device)
        ckey = cache_key(key)
        with torch.cuda.device(device):
            got = _from_cache(pc, ckey, h, device)
            if got is not None:
                STATS["from_cache"] += 1
                return got
            with handles.held(h, device):
                got = _build(q, k, v, o, is_causal, scale, h.handle)
            STATS["built"] += 1
        if pc is not None and not getattr(pc, "read_only", False):
            try:
                blob = got.graph.serialize(as_bytes=True)
            except Exception as e:  # noqa: BLE001 - an engine cuDNN cannot serialize: built per process
                log.info("FP8 attention: graph %s not serializable (%s: %s)", ckey[:12], type(e).__name__, e)
                return got
            meta = {"kind": "fp8-attention", "op": "sdpa_fp8", "engine": "cuDNN sdpa_fp8",
                    "workspace_bytes": got.workspace_size,
                    "q": list(q.shape), "kv": list(k.shape), "causal": bool(is_causal)}
            pc.put(ckey, meta, blob)  # the cache absorbs its own faults
        return got

    return _kept.get(key, build)


def _scalar(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, 1, 1, 1).contiguous()


def sdpa_fp8(q, k, v, descale_q, descale_k, descale_v, descale_s, scale_s, scale_o, is_causal: bool, scale: float):
    """(o, amax_o) from cuDNN's FP8 attention graph, or None where cuDNN declines it (remembered);
    the arguments already validated, the defaults of ``descale_s``, ``scale_s`` and ``scale_o`` filled."""
    key = _key(q, k, v, is_causal, scale)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    built = _graph(key, q, k, v, o, is_causal, scale)
    if built is None:
        return None
    amax_s = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=q.device)
    amax_o = torch.empty_like(amax_s)
    pack = {UIDS["q"]: q, UIDS["k"]: k, UIDS["v"]: v, UIDS["o"]: o, UIDS["amax_s"]: amax_s, UIDS["amax_o"]: amax_o}
    for role, t in zip(_ROLES[3:9], (descale_q, descale_k, descale_v, descale_s, scale_s, scale_o)):
        pack[UIDS[role]] = _scalar(t)
    device = q.device.index
    ws = torch.empty(built.workspace_size, dtype=torch.uint8, device=q.device) if built.workspace_size else None
    stream = torch.cuda.current_stream(q.device).cuda_stream
    h = handles.handle_for(device)
    with h.lock:  # one handle per device: the stream switch and the launch must not interleave
        if h.stream != stream:
            import cudnn

            cudnn.set_stream(handle=h.handle, stream=stream)
            h.stream = stream
        built.graph.execute(pack, ws, handle=h.handle)
    return o, amax_o.reshape(())


# ------------------------------------------------------------------ specs: record, pre-warm


def spec_of(q, k, v, is_causal: bool, scale: float) -> SdpaFP8Spec:
    return SdpaFP8Spec(TensorSpec.of(q), TensorSpec.of(k), TensorSpec.of(v), bool(is_causal), float(scale))


def _spec_key(spec, index):
    dt = getattr(torch, spec.q.dtype)
    return (index, dt, tuple(spec.q.shape), tuple(spec.q.stride), tuple(spec.k.shape), tuple(spec.k.stride),
            tuple(spec.v.shape), tuple(spec.v.stride), bool(spec.is_causal), float(spec.scale))


def spec_cached(pc, spec, device: int, want_tuned: bool = False) -> bool:
    """Whether the plan cache holds the graph of ``spec`` (a pre-warm's look: not counted as a hit); its
    graph is cuDNN's heuristic plan, so a tuned pre-warm finds it cached too."""
    return pc is not None and pc.get(cache_key(_spec_key(spec, device)), count=False) is not None


def pin_spec(pc, spec, device: int) -> int:
    return pin_keys(pc, [cache_key(_spec_key(spec, device))])


def prewarm_spec(spec, device: int) -> None:
    """Build the graph of ``spec`` on ``device`` into the plan cache, as a call would; UnsupportedError
    where cuDNN declines it or the GPU has no FP8 attention."""
    from .errors import UnsupportedError

    dev = torch.device("cuda", device)
    if not fp8_attention_capable(dev):
        raise UnsupportedError("cuDNN's FP8 attention needs compute capability 9.0")
    q, k, v = (operand(t, dev) for t in (spec.q, spec.k, spec.v))
    key = _spec_key(spec, device)
    if _graph(key, q, k, v, torch.empty(q.shape, dtype=q.dtype, device=dev), spec.is_causal, spec.scale) is None:
        raise UnsupportedError(f"cuDNN declined it: {refused().get(key, '?')}")


def refused() -> dict:
    return _kept.refusals()


def attention(q: Tensor, k: Tensor, v: Tensor, descale_q: Tensor, descale_k: Tensor, descale_v: Tensor,
              descale_s: Tensor, scale_s: Tensor, scale_o: Tensor, is_causal: bool, scale: float) -> List[Tensor]:
    """[o, amax_o]: cuDNN's FP8 graph, or where cuDNN declines it torch's bfloat16 attention of the
    dequantized operands (its probabilities not quantized), cast back as the graph would."""
    got = sdpa_fp8(q, k, v, descale_q, descale_k, descale_v, descale_s, scale_s, scale_o, is_causal, scale)
    if got is not None:
        return list(got)
    bf = torch.bfloat16
    o = torch.nn.functional.scaled_dot_product_attention(
        q.to(bf) * descale_q.to(bf), k.to(bf) * descale_k.to(bf), v.to(bf) * descale_v.to(bf), is_causal=is_causal,
        scale=scale, enable_gqa=k.shape[1] != q.shape[1]).float()
    return [fp8_cast(o, q.dtype, scale_o), torch_amax(o)]


# torch.compile sees the GPU path as one op; no autograd (FP8 operands take none)
attention_op = torch.library.custom_op("cudnn_fuse::attention_fp8", mutates_args=())(attention)


@attention_op.register_fake
def _attention_fake(q, k, v, descale_q, descale_k, descale_v, descale_s, scale_s, scale_o, is_causal, scale):
    return [q.new_empty(q.shape), q.new_empty((), dtype=torch.float32)]
