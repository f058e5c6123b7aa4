"""cf.scaled_dot_product_attention_fp8: FP8 q, k, v with dequantization factors, the probabilities
quantized with scale_s as cuDNN's FP8 graph does, an FP8 output saturated after scale_o and its amax
before it; validation names the argument. The CPU runs the float32 reference."""

from __future__ import annotations

import math

import pytest
import torch

import cudnn_fuse as cf
from cudnn_fuse.errors import ArgumentError

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
BIG = torch.finfo(E4).max


def _qkv(B=2, H=4, Hkv=4, S=16, Skv=None, D=32, fmt=E4, seed=0):
    g = torch.Generator().manual_seed(seed)
    Skv = S if Skv is None else Skv
    q = torch.randn(B, H, S, D, generator=g).to(fmt)
    k = torch.randn(B, Hkv, Skv, D, generator=g).to(fmt)
    v = torch.randn(B, Hkv, Skv, D, generator=g).to(fmt)
    return q, k, v, torch.tensor(0.5), torch.tensor(0.25), torch.tensor(2.0)


def _want(q, k, v, dq, dk, dv, causal=False, scale=None, scale_s=BIG, quantize_p=True):
    """The float64 hand computation."""
    qf, kf, vf = q.double() * dq.double(), k.double() * dk.double(), v.double() * dv.double()
    rep = q.shape[1] // k.shape[1]
    kf, vf = kf.repeat_interleave(rep, 1), vf.repeat_interleave(rep, 1)
    s = qf @ kf.transpose(-2, -1) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    p = torch.softmax(s, -1)
    if quantize_p:
        p = (p * scale_s).clamp(-BIG, BIG).to(E4).double() / scale_s
    return p @ vf


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [4, 2])  # 2: grouped-query attention
def test_the_output_and_amax_follow_the_fp8_graph(causal, heads):
    q, k, v, dq, dk, dv = _qkv(Hkv=heads)
    o, am = cf.scaled_dot_product_attention_fp8(q, k, v, dq, dk, dv, is_causal=causal)
    want = _want(q, k, v, dq, dk, dv, causal)
    assert o.dtype == E4 and o.shape == q.shape and am.dtype == torch.float32 and am.shape == ()
    assert am.item() == pytest.approx(want.abs().max().item(), rel=1e-4)
    # one rounding to e4m3: half its relative step (2^-3), or half its smallest subnormal step (2^-9)
    assert ((o.double() - want).abs() <= want.abs() * 2.0**-4 + 2.0**-10 + 1e-6).all()


def test_the_probabilities_are_quantized_with_scale_s_and_dequantized_with_descale_s():
    q, k, v, dq, dk, dv = _qkv(seed=1)
    default, _ = cf.scaled_dot_product_attention_fp8(q, k, v, dq, dk, dv)
    given, _ = cf.scaled_dot_product_attention_fp8(q, k, v, dq, dk, dv, scale_s=torch.tensor(BIG),
                                                   descale_s=torch.tensor(1 / BIG))
    assert torch.equal(default.view(torch.uint8), given.view(torch.uint8))  # the defaults are these
    coarse, am = cf.scaled_dot_product_attention_fp8(q, k, v, dq, dk, dv, scale_s=torch.tensor(4.0),
                                                     descale_s=torch.tensor(0.25))
    want = _want(q, k, v, dq, dk, dv, scale_s=4.0)
    assert am.item() == pytest.approx(want.abs().max().item(), rel=1e-4)
    exact = _want(q, k, v, dq, dk, dv, quantize_p=False)
    assert (want - exact).abs().max() > 1e-3  # P on a coarse scale changes the result, as it should


def test_scale_o_multiplies_before_the_saturating_cast_and_not_the_amax():
    q, k, v, dq, dk, dv = _qkv()
    o1, am1 = cf.scaled_dot_product_attention_fp8(q, k, v, dq, dk, dv)
    o2, am2 = cf.scaled_dot_product_attention_fp8(q, k, v, dq, dk, dv, scale_o=torch.tensor(1e6))
    assert am1.item() == am2.item()
    assert not torch.isnan(o2.float()).any() and o2.float().abs().max().item() == BIG


def test_scale_defaults_to_one_over_sqrt_d_and_a_given_one_is_used():
    q, k, v, dq, dk, dv = _qkv()
    o, _ = cf.scaled_dot_product_attention_fp8(q, k, v, dq, dk, dv, scale=0.05)
    want = _want(q, k, v, dq, dk, dv, scale=0.05)
    assert ((o.double() - want).abs() <= want.abs() * 2.0**-4 + 2.0**-10 + 1e-6).all()


def _call(**over):
    q, k, v, dq, dk, dv = _qkv()
    kw = dict(q=q, k=k, v=v, descale_q=dq, descale_k=dk, descale_v=dv)
    kw.update(over)
    return cf.scaled_dot_product_attention_fp8(**kw)


@pytest.mark.parametrize("over, exc, match", [
    (dict(q="q"), TypeError, "q must be a torch.Tensor of an FP8 dtype"),
    (dict(k=torch.randn(2, 4, 16, 32, dtype=torch.bfloat16)), ArgumentError, "k must be float8_e4m3fn or"),
    (dict(v=torch.randn(2, 4, 16, 32).to(E5)), ArgumentError, "share one FP8 format"),
    (dict(q=torch.randn(4, 16, 32).to(E4)), ArgumentError, r"q must be 4-D \[B, H, S, D\]"),
    (dict(k=torch.randn(2, 3, 16, 32).to(E4), v=torch.randn(2, 3, 16, 32).to(E4)), ArgumentError, "do not match"),
    (dict(v=torch.randn(2, 4, 8, 32).to(E4)), ArgumentError, "do not match"),
    (dict(descale_q=torch.ones(2)), ArgumentError, "descale_q must be a float32 tensor of one element"),
    (dict(descale_k=None), TypeError, "descale_k must be a torch.Tensor"),
    (dict(descale_v=0.5), TypeError, "descale_v must be a torch.Tensor"),
    (dict(scale_o=torch.tensor(1.0, dtype=torch.float16)), ArgumentError, "scale_o must be a float32 tensor"),
    (dict(is_causal=1), TypeError, "is_causal must be a bool"),
])
def test_bad_arguments_are_named(over, exc, match):
    with pytest.raises(exc, match=match):
        _call(**over)


# ---------------------------------------------------------------- the GPU path's parts, on the CPU


def test_the_fp8_graph_is_declared_whole_and_only_the_engine_search_needs_a_gpu():
    """The IR validates and lowers (dims, strides, uids, dtypes); here cuDNN's plan search is what fails."""
    import cudnn

    from cudnn_fuse import fp8_attention

    q, k, v, *_ = _qkv(S=64, D=64)
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match="no engine"):
        fp8_attention._build(q, k, v, torch.empty_like(q), True, 0.125, None)


def test_a_declined_graph_is_asked_once_and_runs_the_dequantized_fallback(monkeypatch, caplog):
    import logging

    from cudnn_fuse import fp8_attention, fp8_gemm

    builds = []

    def declined(*args):
        builds.append(args)
        raise RuntimeError("no engine for this graph")

    monkeypatch.setattr(fp8_attention, "_build", declined)
    monkeypatch.setattr(fp8_attention, "_kept", fp8_gemm.Kept(4, fp8_attention.log, "FP8 attention: cuDNN"))
    monkeypatch.setattr(fp8_attention.handles, "handle_for", lambda device: type("H", (), {"handle": None})())
    monkeypatch.setattr(fp8_attention.handles, "held", lambda h, d: __import__("contextlib").nullcontext(h))
    monkeypatch.setattr(fp8_attention.torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    q, k, v, dq, dk, dv = _qkv(H=4, Hkv=2, S=32, D=32, seed=3)
    args = (q, k, v, dq, dk, dv, torch.tensor(1 / BIG), torch.tensor(BIG), torch.tensor(0.5), True, 0.2)
    with caplog.at_level(logging.INFO, logger="cudnn_fuse.fp8_attention"):
        for _ in range(2):
            o, am = fp8_attention.attention(*args)
    assert len(builds) == 1 and "no engine for this graph" in caplog.text
    want = _want(q, k, v, dq, dk, dv, causal=True, scale=0.2, quantize_p=False)
    assert o.dtype == E4 and o.shape == q.shape
    torch.testing.assert_close(o.double(), (want * 0.5).clamp(-BIG, BIG).to(E4).double(), atol=0.05, rtol=0.13)
    assert am.item() == pytest.approx(want.abs().max().item(), rel=2e-2)


def test_the_fp8_attention_op_has_shapes_for_torch_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cudnn_fuse import fp8_attention

    q, k, v, dq, dk, dv = _qkv(S=16, D=32)
    with FakeTensorMode() as mode:
        f = [mode.from_tensor(t) for t in (q, k, v, dq, dk, dv, dq, dk, dv)]
        o, am = fp8_attention.attention_op(*f, False, 0.1)
    assert (o.shape, o.dtype, am.shape, am.dtype) == (q.shape, E4, (), torch.float32)


class _FakeGraph:
    def __init__(self, blob=b"graph-1", serializable=True):
        self.blob, self.serializable = blob, serializable

    def serialize(self, as_bytes=True):
        if not self.serializable:
            raise RuntimeError("not serializable")
        return self.blob

    def deserialize(self, handle, blob):
        if blob == b"junk":
            raise RuntimeError("CUDNN_STATUS_BAD_PARAM")
        self.blob = blob

    def get_workspace_size(self):
        return 0


def _fake_device(monkeypatch, serializable=True):
    """fp8_attention's graph source on the CPU: builds counted, handles and devices faked."""
    import contextlib

    import cudnn

    from cudnn_fuse import fp8_attention, fp8_gemm, handles

    built = []

    def build(q, k, v, o, is_causal, scale, handle):
        built.append(tuple(q.shape))
        return fp8_attention._Graph(_FakeGraph(serializable=serializable), 0)

    monkeypatch.setattr(fp8_attention, "_build", build)
    monkeypatch.setattr(handles, "handle_for", lambda device: type("H", (), {"handle": None})())
    monkeypatch.setattr(handles, "held", lambda h, device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(cudnn, "pygraph", lambda handle=None: _FakeGraph(blob=None))
    monkeypatch.setattr(fp8_attention, "_kept", fp8_gemm.Kept(8, fp8_attention.log, "x"))
    return built


def _graph_once(S=128):
    from cudnn_fuse import fp8_attention

    q = torch.zeros(1, 2, S, 64, dtype=torch.float8_e4m3fn)
    key = fp8_attention._key(q, q, q, True, 0.125)
    return fp8_attention._graph(key, q, q, q, q, True, 0.125)


def test_a_built_fp8_attention_graph_is_stored_and_a_new_process_deserializes_it(monkeypatch, caplog):
    import logging

    from cudnn_fuse import fp8_attention, fp8_gemm
    from cudnn_fuse.cache import open_default_cache

    built = _fake_device(monkeypatch)
    assert _graph_once() is not None and built == [(1, 2, 128, 64)]
    (key, meta, _), = open_default_cache().entries()
    assert meta["op"] == "sdpa_fp8" and meta["causal"] is True
    monkeypatch.setattr(fp8_attention, "_kept", fp8_gemm.Kept(8, fp8_attention.log, "x"))  # a new process
    got = _graph_once()
    assert got.graph.blob == b"graph-1" and len(built) == 1  # deserialized, not built
    _graph_once(256)
    assert len(built) == 2  # another shape: another graph
    pc = open_default_cache()
    pc.put(key, meta, b"junk")  # a blob this cuDNN cannot read: built again and replaced, never an error
    monkeypatch.setattr(fp8_attention, "_kept", fp8_gemm.Kept(8, fp8_attention.log, "x"))
    with caplog.at_level(logging.INFO, logger="cudnn_fuse.fp8_attention"):
        assert _graph_once() is not None
    assert len(built) == 3 and "did not deserialize" in caplog.text
    assert pc.get(key).blob == b"graph-1"


def test_a_graph_cudnn_cannot_serialize_still_runs(monkeypatch):
    from cudnn_fuse.cache import open_default_cache

    built = _fake_device(monkeypatch, serializable=False)
    assert _graph_once() is not None and len(built) == 1
    assert list(open_default_cache().entries()) == []


def test_record_writes_the_fp8_attention_graph_and_prewarm_builds_it_by_its_own_keys(tmp_path, monkeypatch):
    from cudnn_fuse import fp8_attention, loader, manifest, prewarm
    from cudnn_fuse.spec import SdpaFP8Spec

    q = torch.randn(1, 4, 64, 32).to(torch.float8_e4m3fn)
    k = torch.randn(1, 2, 64, 32).to(torch.float8_e4m3fn)
    d = torch.tensor(0.5)
    with cf.record(tmp_path / "m.json"):
        cf.scaled_dot_product_attention_fp8(q, k, k, d, d, d, is_causal=True)
    (entry,) = manifest.load(tmp_path / "m.json")
    assert isinstance(entry.spec, SdpaFP8Spec) and entry.spec.k.shape == (1, 2, 64, 32)
    assert entry.spec.scale == pytest.approx(1 / math.sqrt(32)) and entry.spec.is_causal
    built, asked = [], []
    monkeypatch.setattr(fp8_attention, "prewarm_spec", lambda s, device: built.append(s))
    monkeypatch.setattr(fp8_attention, "spec_cached", lambda pc, s, device, tuned: asked.append(s) or False)
    monkeypatch.setattr(loader, "load_or_build", lambda s, device: pytest.fail("a cuDNN plan build"))
    rows = prewarm.prewarm([entry], cache=object())
    assert [r.status for r in rows] == ["built"] and built == asked == [entry.spec]


def test_the_fp8_attention_cache_look_finds_what_a_build_stored(monkeypatch):
    from cudnn_fuse import fp8_attention
    from cudnn_fuse.cache import open_default_cache

    _fake_device(monkeypatch)
    q = torch.zeros(1, 2, 128, 64, dtype=torch.float8_e4m3fn)
    spec = fp8_attention.spec_of(q, q, q, True, 0.125)
    pc = open_default_cache()
    assert not fp8_attention.spec_cached(pc, spec, 0)
    _graph_once()  # the same shape, causality and scale
    assert fp8_attention.spec_cached(pc, spec, 0) and fp8_attention.pin_spec(pc, spec, 0) == 1
    assert not fp8_attention.spec_cached(pc, fp8_attention.spec_of(q, q, q, False, 0.125), 0)
