"""Engines that compute a graph wrongly are barred (engines.barred_engines): cuDNN 9.19's GEMM
eng0 runs leaky_relu as a plain ReLU and GELU as its tanh approximation, its float32 conv eng0
returns NaN for tanh past z ~ 44 (bench/results/leaky_probe.json, act_range_probe.json). CPU: which
specs bar it, that prepare() deselects it before any candidate is built, and that a cache entry
or an engine record naming it is a miss, never a plan. GPU: tests/test_gpu_ops.py."""

from __future__ import annotations

import logging

import pytest

from cudnn_fuse import engines, loader
from cudnn_fuse.errors import UnsupportedError
from cudnn_fuse.spec import (ActGradSpec, ConvSpec, Epilogue, MatmulSpec, RecomputeGradSpec, SaveZSpec,
                             TensorSpec)
from tuning import DictCache, RecordingGraph, entry


def _mm(act="leaky_relu", bias=False):
    a = TensorSpec.contiguous((1, 64, 32), "float16")
    b = TensorSpec((1, 32, 48), (1536, 1, 32), "float16")
    y = TensorSpec.contiguous((1, 64, 48), "float16")
    epi = Epilogue(bias=TensorSpec((1, 1, 48), (48, 48, 1), "float16") if bias else None, activation=act,
                   negative_slope=0.2)
    return MatmulSpec(a, b, y, epi)


def _conv(act="leaky_relu"):
    x = TensorSpec((2, 8, 6, 6), (288, 1, 48, 8), "float16")
    w = TensorSpec((8, 8, 3, 3), (72, 1, 24, 8), "float16")
    y = TensorSpec((2, 8, 6, 6), (288, 1, 48, 8), "float16")
    return ConvSpec(x, w, y, (1, 1), (1, 1), (1, 1), (1, 1), 1, Epilogue(activation=act, negative_slope=0.2))


def test_eng0_is_barred_where_it_was_measured_wrong():
    # conv: tanh (NaN past z ~ 44 in float32), in every graph wrapping that forward
    assert engines.barred_engines(_conv("tanh")) == {0}
    assert engines.barred_engines(SaveZSpec(_conv("tanh"), _conv().y)) == {0}
    for act in (None, "relu", "sigmoid", "leaky_relu", "gelu"):
        assert engines.barred_engines(_conv(act)) == frozenset()
    # GEMM: GELU run as its tanh approximation
    assert engines.barred_engines(_mm(act="gelu")) == {0}
    assert engines.barred_engines(_mm(act="gelu_tanh")) == frozenset()


def test_eng0_is_barred_from_every_matmul_graph_with_a_leaky_relu():
    assert engines.barred_engines(_mm()) == {0}
    assert engines.barred_engines(_mm(bias=True)) == {0}
    z = TensorSpec.contiguous((1, 64, 48), "float16")
    assert engines.barred_engines(SaveZSpec(_mm(), z)) == {0}
    # not for other activations, and not for convs or the elementwise activation backward
    for act in (None, "relu", "tanh", "silu"):
        assert engines.barred_engines(_mm(act=act)) == frozenset()
    assert engines.barred_engines(_conv()) == frozenset()
    assert engines.barred_engines(ActGradSpec(z, z, z, "leaky_relu", 0.2)) == frozenset()


_FakeGraph = RecordingGraph


def test_prepare_deselects_the_barred_engine_after_the_heuristics_and_before_any_build():
    g = _FakeGraph()
    engines.prepare(g, _mm())
    names = [c[0] for c in g.calls]
    assert names[:3] == ["validate", "build_operation_graph", "create_execution_plans"]
    assert ("deselect_engines", (["eng0"],)) in g.calls
    assert not any(n.startswith("build_plan") for n in names)
    g2 = _FakeGraph()
    engines.prepare(g2, _mm(act="relu"))
    assert "deselect_engines" not in [c[0] for c in g2.calls]


def test_the_deselect_pattern_cannot_bar_another_engine():
    names = ["eng0", "eng0_k24=0", "eng4_k24=50", "eng10_k2=8_k13=1", "eng40", "eng7_k24=0", "eng20_k2=0",
             "eng8", "eng8_k24=0", "eng8_k24=29_k25=1", "eng80_k2=1", "eng18_k24=0", "eng28"]
    # cuDNN-frontend's substring match
    assert [n for n in names if engines._bar_name(0) in n] == ["eng0", "eng0_k24=0"]
    assert [n for n in names if engines._bar_name(8) in n] == ["eng8_k24=0", "eng8_k24=29_k25=1"]  # not eng80/eng18
    with pytest.raises(ValueError, match="-1"):
        engines._bar_name(-1)


class _BuiltGraph(_FakeGraph):
    """A graph whose heuristic build picked ``engine`` (get_engine_and_knobs_at_index)."""

    def __init__(self, engine):
        super().__init__()
        self._plan_index = 0
        self.get_engine_and_knobs_at_index = lambda i: (engine, {})


def test_finalize_refuses_a_knobless_plan_of_a_barred_engine():
    # the "eng8_" pattern cannot name a plan "eng8" without knobs: finalize checks the built plan's id
    with pytest.raises(UnsupportedError, match="engine 8"):
        engines.finalize(_BuiltGraph(8), _recompute())
    engines.finalize(_BuiltGraph(4), _recompute())  # another engine: fine
    engines.finalize(_BuiltGraph(8), _conv("silu"))  # eng8 runs the forward right: not barred there


def _recompute(act="silu", groups=2):
    fwd = _conv(act)
    fwd = ConvSpec(fwd.x, TensorSpec((8, 8 // groups, 3, 3), (72 // groups, 1, 24 // groups, 8 // groups), "float16"),
                   fwd.y, fwd.stride, fwd.pre_padding, fwd.post_padding, fwd.dilation, groups, fwd.epilogue)
    return RecomputeGradSpec(fwd, fwd.y, fwd.y)


def test_eng8_is_barred_from_conv_recompute_graphs():
    # a grouped fp16 conv's silu/sigmoid/GELU backward came out NaN or 60-330 (relative) off on eng8
    # (bench/results/grouped_grad_probe_before_fix.json); barred grouped or not, forward untouched
    for act in ("silu", "sigmoid", "gelu", "gelu_tanh"):
        assert engines.barred_engines(_recompute(act)) == {8}
        assert engines.barred_engines(_recompute(act, groups=1)) == {8}
        assert engines.barred_engines(_recompute(act).fwd) == frozenset()
    assert engines.barred_engines(_recompute("tanh")) == {0, 8}
    g = _FakeGraph()
    engines.prepare(g, _recompute())
    assert ("deselect_engines", (["eng8_"],)) in g.calls
    # the GEMM recompute graph is not implicated
    z = TensorSpec.contiguous((1, 64, 48), "float16")
    assert engines.barred_engines(RecomputeGradSpec(_mm(act="silu"), z, z)) == frozenset()


_Cache, _entry = DictCache, entry


def test_a_cache_entry_or_record_naming_a_barred_engine_is_a_miss(monkeypatch, caplog):
    spec = _mm()
    digest = spec.digest()
    monkeypatch.setattr(loader, "_deserialize", lambda *a: pytest.fail("a barred entry was deserialized"))
    monkeypatch.setattr(loader, "rebuild", lambda *a: pytest.fail("a barred record was rebuilt"))
    loader._warned.discard("barred")
    pc = _Cache({digest: _entry({"engine_id": 0, "engine_name": "eng0", "tuned": True}),
                 loader.engine_record_key(digest): _entry({"engine_id": 0, "kind": "engine-record"})})
    with caplog.at_level(logging.WARNING, logger="cudnn_fuse"):
        assert loader._from_cache(pc, spec, digest, 0, want_tuned=False) is None
    assert "computes it wrongly" in caplog.text
    # only the engine record left (a corrupt entry was dropped): still a miss
    pc = _Cache({loader.engine_record_key(digest): _entry({"engine_id": 0, "kind": "engine-record"})})
    assert loader._from_cache(pc, spec, digest, 0, want_tuned=False) is None


def test_an_entry_of_another_engine_still_loads(monkeypatch):
    spec = _mm()
    digest = spec.digest()
    got = object()
    monkeypatch.setattr(loader, "_deserialize", lambda s, e, d: got)
    pc = _Cache({digest: _entry({"engine_id": 4, "engine_name": "eng4_k24=50"})})
    assert loader._from_cache(pc, spec, digest, 0, want_tuned=False) is got
    # and the same engine 0 entry for a graph it computes right (no leaky_relu) loads too
    relu = _mm(act="relu")
    pc = _Cache({relu.digest(): _entry({"engine_id": 0, "engine_name": "eng0"})})
    assert loader._from_cache(pc, relu, relu.digest(), 0, want_tuned=False) is got


def test_rebuild_refuses_a_barred_engine_before_touching_cudnn(monkeypatch):
    monkeypatch.setattr(loader, "handle_for", lambda d: pytest.fail("reached cuDNN"))
    with pytest.raises(UnsupportedError, match="wrongly"):
        loader.rebuild(_mm(), 0, {}, 0)
