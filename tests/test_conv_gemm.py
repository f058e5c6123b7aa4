"""A 1x1 stride-1 channels_last conv as the GEMM of its matrix views (conv_gemm.py): which convs
qualify, that the GEMM spec is the one cf.linear makes of the same views (one cache entry), that
the views compute the conv (through torch's stand-in GEMM plan, on the CPU), the autotuner's
GEMM candidate with injected timings, and the loader's use of a tuned entry that chose it."""

from __future__ import annotations

import dataclasses
import logging
import types

import pytest
import torch
import torch.nn.functional as F

import cudnn_fuse as cf
from cudnn_fuse import autotune, conv_gemm, loader, reference, torch_engine
from cudnn_fuse.builders import roles_of
from cudnn_fuse.spec import ConvSpec, Epilogue, MatmulSpec, TensorSpec, channels_last_strides
from recorded import recorded_spec
from tuning import DictCache, entry

ACTS = [None, "relu", "gelu", "silu", "leaky_relu"]


def _cl(t):
    return t.contiguous(memory_format=torch.channels_last)


def _operands(N=2, C=16, H=5, W=3, K=24, dtype=torch.float16, bias=True, residual=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = _cl(torch.randn(N, C, H, W, generator=g).to(dtype))
    w = _cl((torch.randn(K, C, 1, 1, generator=g) * 0.2).to(dtype))
    b = torch.randn(K, generator=g).to(dtype) if bias else None
    r = _cl(torch.randn(N, K, H, W, generator=g).to(dtype)) if residual else None
    return x, w, b, r




def _conv_spec(**kw):
    act, amax, slope = kw.pop("act", "relu"), kw.pop("amax", False), kw.pop("slope", 0.01)
    stride, padding = kw.pop("stride", 1), kw.pop("padding", 0)
    x, w, b, r = _operands(**kw)
    slope = slope if act == "leaky_relu" else 0.01  # a slope goes with leaky_relu only (else an ArgumentError)
    return recorded_spec(lambda: cf.conv2d(x, w, b, stride=stride, padding=padding, activation=act, residual=r,
                                       return_amax=amax, negative_slope=slope))


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias,residual,amax", [(True, False, False), (False, False, False), (True, True, False),
                                                (True, False, True), (False, True, True)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_gemm_spec_is_the_one_linear_makes_of_the_views(act, bias, residual, amax, dtype):
    x, w, b, r = _operands(dtype=dtype, bias=bias, residual=residual)
    N, C, H, W = x.shape
    K = w.shape[0]
    kw = dict(activation=act, return_amax=amax, negative_slope=0.2 if act == "leaky_relu" else 0.01)  # a slope: leaky_relu's
    conv = recorded_spec(lambda: cf.conv2d(x, w, b, residual=r, **kw))
    rows = x.permute(0, 2, 3, 1).reshape(N * H * W, C)
    r2 = r.permute(0, 2, 3, 1).reshape(N * H * W, K) if r is not None else None
    lin = recorded_spec(lambda: cf.linear(rows, w.reshape(K, C), b, residual=r2, **kw))
    assert isinstance(conv, ConvSpec) and isinstance(lin, MatmulSpec)
    assert conv_gemm.gemm_spec(conv) == lin
    assert conv_gemm.gemm_spec(conv).digest() == lin.digest()  # the same cache entry


@pytest.mark.parametrize("why,kw", [
    ("3x3 kernel", None),
    ("stride 2", dict(stride=2)),
    ("padded", dict(padding=1)),
    ("float32", dict(dtype=torch.float32)),
])
def test_convs_that_are_not_a_plain_gemm_do_not_qualify(why, kw):
    if kw is None:
        x, w, b, _ = _operands()
        w3 = _cl(torch.randn(24, 16, 3, 3).half())
        spec = recorded_spec(lambda: cf.conv2d(x, w3, b, padding=1))
    else:
        spec = _conv_spec(**kw)
    assert isinstance(spec, ConvSpec)
    assert conv_gemm.gemm_spec(spec) is None, why


def test_grouped_strided_layouts_and_other_specs_do_not_qualify():
    spec = _conv_spec()
    assert conv_gemm.gemm_spec(spec) is not None
    assert conv_gemm.gemm_spec(dataclasses.replace(spec, groups=2)) is None
    assert conv_gemm.gemm_spec(dataclasses.replace(spec, dilation=(2, 2))) is None
    nchw = dataclasses.replace(spec.x, stride=(16 * 15, 15, 3, 1))  # NCHW memory: rows are not the channels
    assert conv_gemm.gemm_spec(dataclasses.replace(spec, x=nchw)) is None
    y_nchw = dataclasses.replace(spec.y, stride=(24 * 15, 15, 3, 1))
    assert conv_gemm.gemm_spec(dataclasses.replace(spec, y=y_nchw)) is None
    w_t = dataclasses.replace(spec.w, stride=(1, 24, 24, 24))  # [K, C] column-major
    assert conv_gemm.gemm_spec(dataclasses.replace(spec, w=w_t)) is None
    res = _conv_spec(residual=True)
    r_nchw = dataclasses.replace(res.epilogue.residual, stride=(24 * 15, 15, 3, 1))
    assert conv_gemm.gemm_spec(dataclasses.replace(res, epilogue=dataclasses.replace(res.epilogue, residual=r_nchw))) is None
    assert conv_gemm.gemm_spec(dataclasses.replace(spec, allow_tf32=True)) is None
    assert conv_gemm.gemm_spec(conv_gemm.gemm_spec(spec)) is None  # a MatmulSpec is not a conv


def _hand_conv(K=24, dtype="float16", bias=None, w_dtype=None, y_dtype=None):
    """A 1x1 channels_last ConvSpec written by hand, as a plan manifest may give one."""
    x = TensorSpec((2, 16, 5, 3), channels_last_strides((2, 16, 5, 3)), dtype)
    w = TensorSpec((K, 16, 1, 1), (16, 1, 16, 16), w_dtype or dtype)
    y = TensorSpec((2, K, 5, 3), channels_last_strides((2, K, 5, 3)), y_dtype or dtype)
    return ConvSpec(x, w, y, (1, 1), (0, 0), (0, 0), (1, 1), 1, Epilogue(bias=bias, activation="relu"))


@pytest.mark.parametrize("why,bias", [
    ("a float32 bias beside float16 operands", TensorSpec((1, 24, 1, 1), (24, 1, 24, 24), "float32")),
    ("a bfloat16 bias beside float16 operands", TensorSpec((1, 24, 1, 1), (24, 1, 24, 24), "bfloat16")),
    ("every other element", TensorSpec((1, 24, 1, 1), (48, 2, 48, 48), "float16")),
    ("a broadcast (stride 0) bias", TensorSpec((1, 24, 1, 1), (0, 0, 0, 0), "float16")),
    ("a bias read backwards", TensorSpec((1, 24, 1, 1), (24, -1, 24, 24), "float16")),
])
def test_a_bias_the_gemm_cannot_declare_exactly_keeps_the_convs_plan(why, bias):
    """The GEMM declares its bias as K dense elements of x's dtype ([1, 1, K], strides (K, K, 1)) and
    reads the conv's bias memory through that: another layout or dtype (only a hand-written
    manifest gives one) would be misread, so gemm_spec declines."""
    assert conv_gemm.gemm_spec(_hand_conv()) is not None
    assert conv_gemm.gemm_spec(_hand_conv(bias=dataclasses.replace(bias, stride=(24, 1, 24, 24), dtype="float16"))) \
        is not None
    assert conv_gemm.gemm_spec(_hand_conv(bias=bias)) is None, why


def test_a_dense_bias_qualifies_whatever_its_size_one_strides_and_a_single_channel_any_stride():
    for stride in ((24, 1, 24, 24), (1, 1, 1, 1), (999, 1, 7, 0)):  # size-1 dims' strides address nothing
        m = conv_gemm.gemm_spec(_hand_conv(bias=TensorSpec((1, 24, 1, 1), stride, "float16")))
        assert m is not None and m.epilogue.bias == TensorSpec((1, 1, 24), (24, 24, 1), "float16")
    m = conv_gemm.gemm_spec(_hand_conv(K=1, bias=TensorSpec((1, 1, 1, 1), (5, 5, 5, 5), "float16")))
    assert m is not None and m.epilogue.bias == TensorSpec((1, 1, 1), (1, 1, 1), "float16")
    assert conv_gemm.gemm_spec(_hand_conv(K=1, bias=TensorSpec((1, 1, 1, 1), (1, 1, 1, 1), "float32"))) is None


@pytest.mark.parametrize("w_dtype,y_dtype", [("bfloat16", None), (None, "float32"), (None, "bfloat16")])
def test_a_weight_or_output_in_another_dtype_than_x_keeps_the_convs_plan(w_dtype, y_dtype):
    """The GEMM declares a, b and y in x's dtype: a weight or an output of another dtype would be misread."""
    assert conv_gemm.gemm_spec(_hand_conv(w_dtype=w_dtype, y_dtype=y_dtype)) is None


def _conv_buffers(spec, x, w, b, r):
    """The conv op's buffers in roles order (bias as [1, K, 1, 1], outputs poisoned)."""
    K = w.shape[0]
    y = torch.full(spec.y.shape, 7.0, dtype=x.dtype).contiguous(memory_format=torch.channels_last)
    bufs = {"x": x, "w": w, "bias": b.view(1, K, 1, 1) if b is not None else None, "residual": r, "y": y,
            "amax": torch.full((1, 1, 1, 1), -1.0)}
    return [bufs[role] for role in roles_of(spec)]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("residual,amax", [(False, False), (True, False), (True, True)])
def test_the_views_compute_the_conv(act, residual, amax):
    """The GEMM of the views (torch's stand-in GEMM plan, which runs on the CPU) writes the conv's
    output in its channels_last buffer, and the conv's amax."""
    x, w, b, r = _operands(dtype=torch.bfloat16, residual=residual, seed=3)
    spec = _conv_spec(dtype=torch.bfloat16, residual=residual, act=act, amax=amax, slope=0.1, seed=3)
    mspec = conv_gemm.gemm_spec(spec)
    plan = conv_gemm.GemmConvPlan(spec, torch_engine.TorchPlan(mspec, 0))
    assert plan.raw is False and plan.engine == "gemm:torch" and plan.workspace_size == 0
    bufs = _conv_buffers(spec, x, w, b, r)
    views = conv_gemm.matrix_views(spec, bufs)
    assert [v.data_ptr() for v in views] == [t.data_ptr() for t in bufs]  # views: no copy
    plan.run(bufs)
    y = bufs[roles_of(spec).index("y")]
    want = F.conv2d(x.double(), w.double(), b.double())
    if r is not None:
        want = want + r.double()
    want = reference.activation(want, act, 0.1)
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(y.double(), want, rtol=2e-2, atol=3e-2)
    if amax:
        got = bufs[roles_of(spec).index("amax")].item()
        assert got == pytest.approx(y.double().abs().max().item(), rel=1e-6)


def test_a_raw_gemm_gets_the_convs_own_pointers_in_role_order():
    spec = _conv_spec(residual=True, amax=True)
    x, w, b, r = _operands(residual=True)
    seen = []
    gemm = types.SimpleNamespace(raw=True, device=0, engine="eng4_k24=7", workspace_size=128,
                                 launch=lambda ptrs: seen.append(list(ptrs)), graph="g")
    plan = conv_gemm.GemmConvPlan(spec, gemm)
    assert plan.raw and plan.engine == "gemm:eng4_k24=7" and plan.workspace_size == 128 and plan.graph == "g"
    bufs = _conv_buffers(spec, x, w, b, r)
    plan.run(bufs)
    plan.launch([1, 2, 3])
    assert seen == [[t.data_ptr() for t in bufs], [1, 2, 3]]
    # the ops' memo takes it like any raw plan
    from cudnn_fuse import ops

    ops._FAST.clear()
    y = bufs[roles_of(spec).index("y")]
    ops._remember(("k",), (x, w, b, r), plan, bufs, y)
    assert ops._FAST[("k",)].plan is plan
    ops._FAST.clear()


def _winner(ms):
    return autotune.Timing(0, "eng39", 39, {}, 0, first_ms=ms, median_ms=ms, status="timed")


def test_gemm_timing_and_decision():
    cfg = autotune.Config(warmup=2, repeats=5)
    assert autotune.Config().gemm_candidate is True
    ran = []
    plan = types.SimpleNamespace(engine="gemm:eng4", workspace_size=64, run=lambda bufs: ran.append(bufs))
    sets = [["set0"], ["set1"], ["set2"]]
    fast = autotune.gemm_timing(lambda: plan, sets, cfg, median_of=lambda run: [run() for _ in range(4)] and 0.8)
    assert fast.index == autotune.GEMM_INDEX and fast.status == "timed" and fast.median_ms == 0.8
    assert fast.name == "gemm:eng4" and fast.workspace == 64
    assert ran == [["set0"], ["set1"], ["set2"], ["set0"], ["set1"], ["set2"]]  # warm-up, then rotated sets
    assert autotune.gemm_wins(_winner(1.0), [_winner(1.0), fast])
    assert not autotune.gemm_wins(_winner(0.5), [_winner(0.5), fast])
    assert not autotune.gemm_wins(_winner(0.8), [_winner(0.8), fast])  # a tie keeps the conv
    assert not autotune.gemm_wins(_winner(1.0), [_winner(1.0)])  # no GEMM candidate: the conv

    def declined():
        raise cf.UnsupportedError("cuDNN declined matmul")

    failed = autotune.gemm_timing(declined, sets, cfg, median_of=lambda run: 0.1)
    assert failed.status.startswith("failed:UnsupportedError") and not autotune.gemm_wins(_winner(1.0), [failed])
    assert failed.to_dict()["median_ms"] is None
    # the torch candidate's decision does not read the GEMM row, nor the GEMM's the torch row
    torch_row = autotune.torch_timing(lambda: None, lambda: 0.2, cfg)
    assert not autotune.gemm_wins(_winner(1.0), [torch_row]) and not autotune.torch_wins(_winner(1.0), [fast])


def test_the_gemm_wins_where_its_device_time_is_shorter():
    conv = autotune.Timing(0, "eng39", 39, {}, 0, runtime_compiled=False, first_ms=1.0, median_ms=1.0, status="timed")

    def gemm(ms, rtc, status="timed"):
        return autotune.Timing(autotune.GEMM_INDEX, "gemm:eng4", None, {}, 0, runtime_compiled=rtc, first_ms=ms,
                               median_ms=ms, status=status)

    assert autotune.gemm_wins(conv, [gemm(0.97, True)])  # runtime-compiled or not: the faster wins
    assert autotune.gemm_wins(conv, [gemm(0.97, False)])
    assert not autotune.gemm_wins(conv, [gemm(1.01, False)])
    assert not autotune.gemm_wins(conv, [gemm(0.5, None, status="failed")])
    assert not autotune.gemm_wins(conv, [])  # no GEMM row
    # the GEMM row learns its plan's note; torch's stand-in counts as precompiled
    assert autotune._runtime_compiled(types.SimpleNamespace(engine="torch")) is False
    assert autotune._runtime_compiled(types.SimpleNamespace(engine="eng4")) is None  # no graph: unknown
    plan = types.SimpleNamespace(engine="gemm:torch", workspace_size=0, gemm=types.SimpleNamespace(engine="torch"),
                                 run=lambda bufs: None)
    t = autotune.gemm_timing(lambda: plan, [[]], autotune.Config(warmup=1), median_of=lambda run: 0.5)
    assert t.runtime_compiled is False and t.status == "timed"


def test_the_gemm_candidate_is_on_by_default_and_a_config_field():
    assert autotune.Config().gemm_candidate is True
    assert autotune.Config(gemm_candidate=False).gemm_candidate is False


_Cache, _entry = DictCache, entry


def test_the_loader_runs_the_gemm_a_tuned_entry_chose_without_deserializing_the_conv(monkeypatch, caplog):
    spec = _conv_spec()
    mspec = conv_gemm.gemm_spec(spec)
    gemm = types.SimpleNamespace(spec=mspec, device=0, raw=True, engine="eng4", workspace_size=0)
    conv_plan = types.SimpleNamespace(spec=spec, device=0, raw=True, engine="eng39")
    loaded = []

    def deserialize(s, e, d):
        loaded.append(s)
        return gemm if s == mspec else conv_plan

    monkeypatch.setattr(loader, "_deserialize", deserialize)
    conv_meta = {"engine_id": 39, "engine_name": "eng39", "tuned": True, "use_gemm": True}
    tuned = {"engine_id": 4, "engine_name": "eng4", "tuned": True}
    pc = _Cache({spec.digest(): _entry(conv_meta), mspec.digest(): _entry(tuned)})
    got = loader._from_cache(pc, spec, spec.digest(), 0, want_tuned=False)
    assert isinstance(got, conv_gemm.GemmConvPlan) and got.gemm is gemm and got.spec == spec
    assert loaded == [mspec]  # the conv's own blob was never deserialized
    # the GEMM's entry untuned or gone: the conv's own plan, one warning
    loader._warned.discard("gemm")
    for entries in ({mspec.digest(): _entry(dict(tuned, tuned=False))}, {}):
        loaded.clear()
        pc = _Cache({spec.digest(): _entry(conv_meta), **entries})
        with caplog.at_level(logging.WARNING, logger="cudnn_fuse"):
            assert loader._from_cache(pc, spec, spec.digest(), 0, want_tuned=False) is conv_plan
        assert loaded == [spec]
    assert "runs as a GEMM" in caplog.text
    # an entry that did not choose the GEMM never looks for it
    loaded.clear()
    pc = _Cache({spec.digest(): _entry(dict(conv_meta, use_gemm=False)), mspec.digest(): _entry(tuned)})
    assert loader._from_cache(pc, spec, spec.digest(), 0, want_tuned=False) is conv_plan and loaded == [spec]


def test_a_rebuilt_conv_record_that_chose_the_gemm_runs_the_gemm(monkeypatch):
    spec = _conv_spec()
    mspec = conv_gemm.gemm_spec(spec)
    gemm = types.SimpleNamespace(spec=mspec, device=0, raw=True, engine="eng4", workspace_size=0)
    rebuilt = types.SimpleNamespace(spec=spec, device=0, graph=types.SimpleNamespace(serialize=lambda as_bytes: b"b"))
    monkeypatch.setattr(loader, "rebuild", lambda s, e, k, d: rebuilt)
    monkeypatch.setattr(loader, "_deserialize", lambda s, e, d: gemm if s == mspec else pytest.fail("conv blob"))
    record = {"kind": "engine-record", "engine_id": 39, "tuned": True, "use_gemm": True}
    pc = _Cache({loader.engine_record_key(spec.digest()): _entry(record, b""),
                 mspec.digest(): _entry({"engine_id": 4, "tuned": True})})
    got = loader._from_cache(pc, spec, spec.digest(), 0, want_tuned=True)
    assert isinstance(got, conv_gemm.GemmConvPlan) and got.gemm is gemm
    assert pc.puts and pc.puts[0][0] == spec.digest()  # the conv's entry is restored all the same


def test_the_loader_never_looks_for_a_gemm_of_a_spec_that_has_none(monkeypatch):
    from cudnn_fuse import loader

    monkeypatch.setattr(loader, "get_plan", lambda *a: pytest.fail("looked up a GEMM"))
    mm = conv_gemm.gemm_spec(_conv_spec())
    w3 = _cl(torch.randn(24, 16, 3, 3).half())
    x, _, b, _ = _operands()
    conv3 = recorded_spec(lambda: cf.conv2d(x, w3, b, padding=1))
    for spec in (mm, conv3):
        assert loader._gemm_in_memory(spec, 0) is None
        assert loader._gemm_plan(_Cache({}), spec, 0) is None


def test_the_gemms_own_tuning_reports_to_a_bar_of_its_own():
    import io

    from cudnn_fuse.progress import Bar

    stream = io.StringIO()
    bar = Bar("tuning conv2d", stream)
    saved = autotune.DEFAULT_CONFIG
    cfg = autotune.Config(progress=bar)
    with autotune._sub_progress(cfg, "as a GEMM"):
        inner = autotune.current_config().progress
        assert isinstance(inner, Bar) and inner.label == "tuning conv2d (as a GEMM)" and inner is not bar
        assert autotune.current_config().budget_s == saved.budget_s  # only the progress differs
        inner(1, 2)
    assert autotune.DEFAULT_CONFIG is saved
    assert "tuning conv2d (as a GEMM): 1/2" in stream.getvalue()
    with pytest.raises(RuntimeError):  # restored when the nested tuning raises
        with autotune._sub_progress(autotune.Config(progress=lambda d, t: None), "as a GEMM"):
            assert autotune.current_config().progress is None  # a progress without sub(): left out
            raise RuntimeError("declined")
    assert autotune.DEFAULT_CONFIG is saved
    with autotune._sub_progress(autotune.Config(progress=None), "as a GEMM"):
        assert autotune.current_config() is saved
    assert autotune.current_config() is saved


def test_overlapping_tunings_in_two_threads_keep_their_own_nested_configs():
    """Thread A enters its GEMM's tuning, B enters its own, A leaves, B leaves: each saw its own
    nested config throughout, the other thread's never, and nothing stays replaced afterwards (the
    module-global swap left A's in place for good)."""
    import threading

    class Prog:
        def __init__(self, name):
            self.name = name

        def __call__(self, done, total):
            pass

        def sub(self, what):
            return Prog(self.name + " " + what)

    saved = autotune.DEFAULT_CONFIG
    steps = [threading.Event() for _ in range(3)]
    seen = {}

    def a():
        with autotune._sub_progress(autotune.Config(progress=Prog("A")), "gemm"):
            seen["a_in"] = autotune.current_config().progress.name
            steps[0].set()
            steps[1].wait(10)
            seen["a_later"] = autotune.current_config().progress.name
        steps[2].set()

    def b():
        steps[0].wait(10)
        with autotune._sub_progress(autotune.Config(progress=Prog("B")), "gemm"):
            seen["b_in"] = autotune.current_config().progress.name
            steps[1].set()
            steps[2].wait(10)
            seen["b_after_a_left"] = autotune.current_config().progress.name

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert seen == {"a_in": "A gemm", "b_in": "B gemm", "a_later": "A gemm", "b_after_a_left": "B gemm"}
    assert autotune.DEFAULT_CONFIG is saved and autotune.current_config() is saved


@pytest.mark.parametrize("seed", range(24))
def test_random_geometries_including_size_one_dims(seed):
    """Random 1x1 convs, size-1 batch, spatial, channel and output dims among them: where the op's
    spec qualifies, the GEMM of the views computes the conv; where it does not, it says None."""
    g = torch.Generator().manual_seed(seed)

    def pick(*vals):
        return vals[int(torch.randint(len(vals), (1,), generator=g))]

    N, C, H, W, K = pick(1, 2, 3), pick(1, 3, 8), pick(1, 2, 5), pick(1, 4), pick(1, 2, 7)
    residual, act = bool(seed % 2), pick(None, "relu", "silu")
    x = _cl(torch.randn(N, C, H, W, generator=g).to(torch.bfloat16))
    w = _cl(torch.randn(K, C, 1, 1, generator=g).to(torch.bfloat16))
    b = torch.randn(K, generator=g).to(torch.bfloat16)
    r = _cl(torch.randn(N, K, H, W, generator=g).to(torch.bfloat16)) if residual else None
    spec = recorded_spec(lambda: cf.conv2d(x, w, b, activation=act, residual=r))
    mspec = conv_gemm.gemm_spec(spec)
    assert mspec is not None, (N, C, H, W, K)  # the op makes every such call channels_last and dense
    bufs = _conv_buffers(spec, x, w, b, r)
    conv_gemm.GemmConvPlan(spec, torch_engine.TorchPlan(mspec, 0)).run(bufs)
    want = F.conv2d(x.double(), w.double(), b.double()) + (r.double() if r is not None else 0)
    want = reference.activation(want, act, 0.01)
    y = bufs[roles_of(spec).index("y")]
    assert torch.allclose(y.double(), want, rtol=2e-2, atol=3e-2), (N, C, H, W, K)


def test_views_of_ambiguous_layouts_write_the_callers_output():
    """A [N, C, 1, 1] input in NCHW memory (a squeeze-excitation conv's) qualifies, and the GEMM
    writes the caller's own output buffer, never a copy of it."""
    x = torch.randn(3, 8, 1, 1).to(torch.bfloat16)  # NCHW-contiguous: strides (8, 1, 1, 1)
    w = torch.randn(5, 8, 1, 1).to(torch.bfloat16)
    b = torch.randn(5).to(torch.bfloat16)
    spec = recorded_spec(lambda: cf.conv2d(x, w, b, activation="relu"))
    mspec = conv_gemm.gemm_spec(spec)
    assert mspec is not None and mspec.a.shape == (1, 3, 8) and mspec.y.shape == (1, 3, 5)
    y = torch.full((3, 5, 1, 1), 7.0, dtype=torch.bfloat16)  # NCHW strides too: the same memory
    bufs = [x, w, b.view(1, 5, 1, 1), y]
    conv_gemm.GemmConvPlan(spec, torch_engine.TorchPlan(mspec, 0)).run(bufs)
    want = F.relu(F.conv2d(x.double(), w.double(), b.double()))
    assert torch.allclose(y.double(), want, rtol=2e-2, atol=3e-2)
    assert conv_gemm._channels_last(spec.x) and not conv_gemm._channels_last(
        dataclasses.replace(spec.x, shape=(3, 8, 2, 1), stride=(16, 2, 1, 1)))  # NCHW with H = 2: not
