"""The FP8 GEMM's dispatch (fp8_gemm.py), on the CPU: cuBLASLt's plan replaced by a fake that computes
what its kernel computes (and refuses what the H100 refused), torch._scaled_mm run for real. Which form
runs (the whole epilogue in the kernel, or the GEMM to bfloat16 and the rest in torch), which engine,
and that every path gives the reference's result."""

from __future__ import annotations

import logging

import pytest
import torch

from cudnn_fuse import fp8_gemm, reference

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
_ACT = {"BIAS": None, "RELU_BIAS": "relu", "GELU_BIAS": "gelu_tanh"}


class _FakePlan:
    """cuBLASLt's FP8 kernel: D' = act(bᵀ·aᵀ·sa·sb + bias + Cᵀ), times scale_d and saturated for an FP8
    D, amax_d before scale_d; the product is handed over transposed, as the real plan gets it."""

    def __init__(self, epilog, d_dtype, want_amax):
        self.act, self.d_dtype, self.want_amax = _ACT[epilog], d_dtype, want_amax

    def run(self, a2, b2, sa, sb, bias, residual, scale_d, stream):
        a_t, b_t = b2.t(), a2.t()  # what the real plan's nvmath operands are
        r = (a_t.float() * sb.float()) @ (b_t.float() * sa.float()) + bias.float()[:, None]
        if residual is not None:
            r = r + residual.t().float()
        r = reference.activation(r, self.act)
        am = reference.amax(r) if self.want_amax else None
        d = reference.fp8_cast(r, self.d_dtype, scale_d) if self.d_dtype in (E4, E5) else r.to(self.d_dtype)
        return d.t(), am


@pytest.fixture
def fake_cublaslt(monkeypatch):
    calls = []

    def plan(key, a2, b2, sa, sb, bias, residual, scale_d, epilog, d_dtype, want_amax, stream):
        calls.append(dict(key=key, epilog=epilog, d_dtype=d_dtype, amax=want_amax))
        if d_dtype in (E4, E5) and epilog == "GELU_BIAS" and want_amax:  # NOT_SUPPORTED on the H100's cuBLASLt
            fp8_gemm._kept.refuse(key, "CUBLAS_STATUS_NOT_SUPPORTED")
            return None
        return _FakePlan(epilog, d_dtype, want_amax)

    monkeypatch.setattr(fp8_gemm, "_plan", plan)
    monkeypatch.setattr(fp8_gemm, "fp8_capable", lambda device: True)
    monkeypatch.setattr(fp8_gemm, "_nvmath", lambda: (object(), None))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(fp8_gemm, "_kept", fp8_gemm.Kept(fp8_gemm.MAX_PLANS, fp8_gemm.log, "FP8 GEMM: cuBLASLt"))
    return calls


def _ops(M=32, K=64, N=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g).to(E4)
    w = torch.randn(N, K, generator=g).to(E4)
    return a, w.t(), torch.tensor(0.5), torch.tensor(0.25)


def _close(y, want, out):
    rtol = {E4: 0.13, E5: 0.26, torch.float32: 1e-4, torch.float16: 2e-3}.get(out, 1e-2)
    torch.testing.assert_close(y.float(), want.float(), atol=rtol * 0.5, rtol=rtol)


@pytest.mark.parametrize("act", [None, "relu", "gelu_tanh", "gelu", "silu"])
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32, E4, E5])
def test_every_form_gives_the_reference(fake_cublaslt, act, out):
    a, b, sa, sb = _ops()
    bias, res = torch.randn(48).bfloat16(), torch.randn(32, 48).bfloat16()
    scale = torch.tensor(0.5) if out in (E4, E5) else None
    y, am = fp8_gemm.scaled_mm_2d(a, b, sa, sb, bias, act, res, out, scale, True, 0.01)
    want, want_am = reference.scaled_mm(a, b, sa, sb, bias, act, res, out, scale, True)
    assert y.dtype == out and y.shape == (32, 48)
    _close(y, want, out)
    assert am.item() == pytest.approx(want_am.item(), rel=1e-2)
    epilogs = [c["epilog"] for c in fake_cublaslt]
    if out == torch.float32:  # torch._scaled_mm's (cuBLASLt's float32 D gave wrong results)
        assert epilogs == []
    elif act in (None, "relu", "gelu_tanh"):  # cuBLASLt's own activations run in its kernel
        assert epilogs[0] == {None: "BIAS", "relu": "RELU_BIAS", "gelu_tanh": "GELU_BIAS"}[act]
    else:  # the GEMM with bias and residual in the kernel, the activation in torch
        assert epilogs == ["BIAS"] and fake_cublaslt[0]["d_dtype"] == fp8_gemm._wide(out)


def test_an_fp8_output_with_its_amax_comes_from_the_kernel_where_it_can(fake_cublaslt):
    a, b, sa, sb = _ops(seed=1)
    fp8_gemm.scaled_mm_2d(a, b, sa, sb, None, "relu", None, E4, None, True, 0.01)
    assert [(c["d_dtype"], c["amax"]) for c in fake_cublaslt] == [(E4, True)]


def test_a_refused_combination_runs_split_to_bfloat16_and_is_asked_once(fake_cublaslt, caplog):
    a, b, sa, sb = _ops(seed=2)
    with caplog.at_level(logging.INFO, logger="cudnn_fuse.fp8_gemm"):
        y, am = fp8_gemm.scaled_mm_2d(a, b, sa, sb, None, "gelu_tanh", None, E4, None, True, 0.01)
    assert [(c["d_dtype"], c["amax"]) for c in fake_cublaslt] == [(E4, True), (torch.bfloat16, False)]
    assert "CUBLAS_STATUS_NOT_SUPPORTED" in caplog.text and len(fp8_gemm.refused()) == 1
    want, want_am = reference.scaled_mm(a, b, sa, sb, None, "gelu_tanh", None, E4, None, True)
    _close(y, want, E4)
    assert am.item() == pytest.approx(want_am.item(), rel=1e-2)


def test_a_sixteen_bit_output_takes_its_amax_from_torch(fake_cublaslt):
    a, b, sa, sb = _ops(seed=3)
    y, am = fp8_gemm.scaled_mm_2d(a, b, sa, sb, None, "relu", None, torch.bfloat16, None, True, 0.01)
    assert [c["amax"] for c in fake_cublaslt] == [False]  # cuBLASLt's amax_d is for FP8 outputs only
    assert am.item() == pytest.approx(reference.amax(y.float()).item(), rel=1e-2)


@pytest.mark.parametrize("case", ["unaligned_m", "rowwise", "no_nvmath"])
def test_what_cublaslt_cannot_plan_runs_torch_scaled_mm(fake_cublaslt, monkeypatch, case):
    a, b, sa, sb = _ops(M=40 if case == "unaligned_m" else 32, seed=4)
    if case == "rowwise":
        sa, sb = torch.rand(32, 1) + 0.5, torch.rand(1, 48) + 0.5
    if case == "no_nvmath":
        monkeypatch.setattr(fp8_gemm, "_nvmath", lambda: (None, "nvmath-python unavailable"))
    bias = torch.randn(48).bfloat16()
    assert fp8_gemm.engine_of(a, b, sa, sb) == "torch"
    y, am = fp8_gemm.scaled_mm_2d(a, b, sa, sb, bias, "silu", None, torch.bfloat16, None, True, 0.01)
    assert fake_cublaslt == []
    want, want_am = reference.scaled_mm(a, b, sa, sb, bias, "silu", None, torch.bfloat16, None, True)
    _close(y, want, torch.bfloat16)
    assert am.item() == pytest.approx(want_am.item(), rel=1e-2)


def test_a_row_major_b_is_transposed_and_logged_once_per_shape(fake_cublaslt, caplog, monkeypatch):
    monkeypatch.setattr(fp8_gemm, "_transposed", set())
    a, b, sa, sb = _ops(seed=5)
    with caplog.at_level(logging.INFO, logger="cudnn_fuse.fp8_gemm"):
        for _ in range(3):
            y, _ = fp8_gemm.scaled_mm_2d(a, b.contiguous(), sa, sb, None, None, None, torch.bfloat16, None, False,
                                         0.01)
    assert caplog.text.count("not K-major") == 1
    _close(y, reference.scaled_mm(a, b, sa, sb), torch.bfloat16)


def test_no_fp8_gpu_is_a_clear_error():
    a, b, sa, sb = _ops()
    with pytest.raises(fp8_gemm.Unsupported, match="compute capability 8.9"):
        fp8_gemm.scaled_mm_2d(a, b, sa, sb, None, None, None, torch.bfloat16, None, False, 0.01)


def test_the_custom_op_has_shapes_for_torch_compile():
    a, b, sa, sb = _ops()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fa, fb = mode.from_tensor(a), mode.from_tensor(b)
        fs = mode.from_tensor(sa)
        y, am = fp8_gemm.scaled_mm_op(fa, fb, fs, fs, None, "relu", None, E4, None, True, 0.01)
        y2, am2 = fp8_gemm.scaled_mm_op(fa, fb, fs, fs, None, None, None, torch.bfloat16, None, False, 0.01)
    assert (y.shape, y.dtype, am.shape) == ((32, 48), E4, ())
    assert (y2.dtype, am2.shape) == (torch.bfloat16, (0,))


@pytest.mark.parametrize("fmt", [E4, E5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_cast_with_its_amax_saturates_keeps_nan_and_leaves_its_input(fmt, dtype):
    from cudnn_fuse import fp8_cast

    x = (torch.randn(1000) * 300).to(dtype)
    x[7] = float("nan")
    keep = x.clone()
    scale = torch.tensor(2.0)
    y, am = fp8_cast.cast_amax(x, fmt, scale)
    assert torch.equal(x.nan_to_num(), keep.nan_to_num())  # the input is not scaled in place
    want = reference.fp8_cast(x.float(), fmt, scale)
    assert y.dtype == fmt and torch.equal(y.float().nan_to_num(), want.float().nan_to_num())
    assert torch.isnan(y.float()[7]) and torch.isnan(am)
    x[7] = 1.0
    y, am = fp8_cast.cast_amax(x, fmt, torch.tensor(100.0))  # |x| * 100 passes both formats' largest
    assert am.item() == x.float().abs().max().item() and y.float().abs().max() == torch.finfo(fmt).max


def test_a_view_with_another_leading_dimension_gets_its_own_plan(fake_cublaslt):
    """A plan rebinds pointers without checking layouts: a sliced a (rows K+32 apart) must not reuse the
    plan of a contiguous one."""
    a, b, sa, sb = _ops(seed=6)
    wide = torch.cat([a.float(), torch.zeros(32, 32)], dim=1).to(E4)  # [32, 96]
    view = wide[:, :64]
    assert view.stride(0) == 96
    fp8_gemm.scaled_mm_2d(a, b, sa, sb, None, "relu", None, torch.bfloat16, None, False, 0.01)
    y, _ = fp8_gemm.scaled_mm_2d(view, b, sa, sb, None, "relu", None, torch.bfloat16, None, False, 0.01)
    assert len({c["key"] for c in fake_cublaslt}) == 2
    _close(y, reference.scaled_mm(a, b, sa, sb, None, "relu"), torch.bfloat16)


def test_a_plan_lets_go_of_the_callers_tensors_after_each_run():
    """A plan lives across calls (64 kept): holding the last call's operands would keep them alive."""
    events = []

    class FakeMatmul:
        def reset_operands_unchecked(self, **kw):
            events.append("bind")

        def execute(self, stream=None):
            events.append("execute")
            return torch.zeros(48, 32), {"result_amax": torch.ones(1)}

        def release_operands(self):
            events.append("release")

    a, b, sa, sb = _ops()
    d, am = fp8_gemm._Plan(FakeMatmul()).run(a, b, sa, sb, torch.zeros(48), None, None, None)
    assert events == ["bind", "execute", "release"]
    assert d.shape == (32, 48) and am.shape == ()


def test_kept_builds_once_drops_the_least_recently_used_and_remembers_a_refusal(caplog):
    import logging

    builds = []
    kept = fp8_gemm.Kept(2, logging.getLogger("cudnn_fuse.fp8_gemm"), "an engine")

    def build(key):
        def make():
            builds.append(key)
            if key == "bad":
                raise RuntimeError("no algorithm")
            return f"plan {key}"
        return make

    assert kept.get("a", build("a")) == "plan a" and kept.get("a", build("a")) == "plan a"
    kept.get("b", build("b"))
    kept.get("a", build("a"))  # a is now the most recent: b goes when c comes
    kept.get("c", build("c"))
    assert list(kept.items) == ["a", "c"]
    with caplog.at_level(logging.INFO, logger="cudnn_fuse.fp8_gemm"):
        assert kept.get("bad", build("bad")) is None and kept.get("bad", build("bad")) is None
    assert builds == ["a", "b", "c", "bad"] and kept.refusals() == {"bad": "RuntimeError: no algorithm"}
    assert caplog.text.count("an engine declined bad (RuntimeError: no algorithm)") == 1


class _FakeAlgorithm:
    def __init__(self, ident: int):
        import numpy as np
        from nvmath.bindings.cublasLt import matmul_heuristic_result_dtype

        self.algorithm_id = ident
        self.array = np.zeros(1, dtype=matmul_heuristic_result_dtype)
        self.array["workspace_size"] = ident

    def as_numpy(self):
        return self.array


def _fake_nvmath(monkeypatch, refuse_stored=False):
    """An nvmath whose Matmul records how it was planned: heuristics (algorithms 7 then 3), a stored
    algorithm, or autotuning (which puts 3 first)."""
    pytest.importorskip("nvmath")
    seen = []

    class Matmul:
        def __init__(self, *args, **kwargs):
            self.algorithms = ()

        def plan(self, algorithms=None, epilog=None, epilog_inputs=None, stream=None):
            if algorithms is not None:
                ident = int(algorithms[0].as_numpy()["workspace_size"][0])
                seen.append(("stored", ident))
                if refuse_stored:
                    raise RuntimeError("CUBLAS_STATUS_INVALID_VALUE")
                self.algorithms = (_FakeAlgorithm(ident),)
            else:
                seen.append(("heuristics", None))
                self.algorithms = (_FakeAlgorithm(7), _FakeAlgorithm(3))

        def autotune(self, iterations=10, stream=None):
            seen.append(("autotune", iterations))
            self.algorithms = self.algorithms[::-1]

        def release_operands(self):
            pass

    class Epilog:
        BIAS, RELU_BIAS, GELU_BIAS = "BIAS", "RELU_BIAS", "GELU_BIAS"

    fake = type("advanced", (), {"Matmul": Matmul, "MatmulEpilog": Epilog})
    monkeypatch.setattr(fp8_gemm, "_nvmath", lambda: (fake, None))
    monkeypatch.setattr(fp8_gemm, "_cuda_type", lambda dtype: dtype)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(fp8_gemm, "_kept", fp8_gemm.Kept(fp8_gemm.MAX_PLANS, fp8_gemm.log, "FP8 GEMM: cuBLASLt"))
    return seen


def _plan_once(key=(0, 32, 64, 48)):
    a, b, sa, sb = _ops()
    return fp8_gemm._plan(key + (E4, E4, torch.bfloat16), a, b, sa, sb, torch.zeros(48), None, None, "BIAS",
                          torch.bfloat16, False, None)


def test_a_new_process_plans_with_the_algorithm_the_plan_cache_holds(monkeypatch):
    from cudnn_fuse import autotune
    from cudnn_fuse.cache import open_default_cache

    seen = _fake_nvmath(monkeypatch)
    monkeypatch.setattr(autotune, "autotune_enabled", lambda: False)
    assert _plan_once() is not None and seen == [("heuristics", None)]
    entries = [(meta["op"], meta["tuned"], meta["engine"]) for _, meta, _ in open_default_cache().entries()]
    assert entries == [("scaled_mm", False, "cuBLASLt algorithm 7")]  # heuristics' first choice, stored
    monkeypatch.setattr(fp8_gemm, "_kept", fp8_gemm.Kept(fp8_gemm.MAX_PLANS, fp8_gemm.log, "x"))  # a new process
    assert _plan_once() is not None and seen[-1] == ("stored", 7)  # no heuristic query
    _plan_once((0, 32, 64, 64))  # another shape is another entry
    assert seen[-1] == ("heuristics", None) and len(list(open_default_cache().entries())) == 2


def test_autotuning_times_the_candidates_stores_the_fastest_and_outranks_a_heuristic_entry(monkeypatch):
    from cudnn_fuse import autotune
    from cudnn_fuse.cache import open_default_cache

    seen = _fake_nvmath(monkeypatch)
    monkeypatch.setattr(autotune, "autotune_enabled", lambda: False)
    _plan_once()
    monkeypatch.setattr(autotune, "autotune_enabled", lambda: True)
    monkeypatch.setattr(fp8_gemm, "_kept", fp8_gemm.Kept(fp8_gemm.MAX_PLANS, fp8_gemm.log, "x"))
    _plan_once()  # the stored heuristic choice is no tuning: the candidates are timed
    assert seen[1:] == [("heuristics", None), ("autotune", fp8_gemm.AUTOTUNE_ITERATIONS)]
    (_, meta, _), = open_default_cache().entries()
    assert meta["tuned"] is True and meta["engine"] == "cuBLASLt algorithm 3" and "tuned_at" in meta
    monkeypatch.setattr(fp8_gemm, "_kept", fp8_gemm.Kept(fp8_gemm.MAX_PLANS, fp8_gemm.log, "x"))
    _plan_once()
    assert seen[-1] == ("stored", 3)  # the tuned entry serves a tuning process without timing again


def test_a_cached_algorithm_cuBLASLt_refuses_falls_back_to_heuristics_and_is_replaced(monkeypatch, caplog):
    from cudnn_fuse import autotune

    monkeypatch.setattr(autotune, "autotune_enabled", lambda: False)
    _fake_nvmath(monkeypatch)
    _plan_once()
    seen = _fake_nvmath(monkeypatch, refuse_stored=True)
    with caplog.at_level(logging.INFO, logger="cudnn_fuse.fp8_gemm"):
        assert _plan_once() is not None
    assert seen == [("stored", 7), ("heuristics", None)] and "refused the cached algorithm" in caplog.text


def test_the_cache_key_names_the_problem_the_card_and_not_the_device_index(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Card A")
    k = (0, 32, 64, 48, E4, E4, torch.bfloat16)
    same = fp8_gemm.cache_key((1,) + k[1:], "BIAS", None)
    assert fp8_gemm.cache_key(k, "BIAS", None) == same and len(same) == 64 and int(same, 16) >= 0
    assert fp8_gemm.cache_key(k, "GELU_BIAS", None) != same
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Card B")
    assert fp8_gemm.cache_key(k, "BIAS", None) != same


def test_record_writes_the_fp8_gemm_as_the_gpu_would_plan_it_and_the_manifest_loads(tmp_path):
    import cudnn_fuse as cf
    from cudnn_fuse import manifest
    from cudnn_fuse.spec import ScaledMMSpec

    a, _, sa, sb = _ops(M=32, K=64, N=48)
    b_row_major = _ops(M=32, K=64, N=48)[1].contiguous()  # [K, N] row-major: the GPU path transposes it
    path = tmp_path / "fp8.json"
    with cf.record(path):
        for _ in range(2):
            cf.scaled_mm(a.reshape(2, 16, 64), b_row_major, sa, sb, bias=torch.zeros(48, dtype=torch.bfloat16),
                         activation="gelu_tanh", out_dtype=E4, return_amax=True)
        cf.scaled_mm(a, b_row_major, sa.expand(32, 1).contiguous(), sb)  # rowwise: torch._scaled_mm, no plan
    (entry,) = manifest.load(path)
    spec = entry.spec
    assert isinstance(spec, ScaledMMSpec) and entry.count == 2
    assert spec.a.shape == (32, 64) and spec.b.stride == (1, 64) and spec.y.dtype == "float8_e4m3fn"
    assert spec.epilogue.activation == "gelu_tanh" and spec.epilogue.amax and spec.epilogue.bias.dtype == "bfloat16"


def test_a_spec_names_the_keys_its_call_stores(monkeypatch):
    """The pre-warm's look (spec_cached) finds what a call through the fake cuBLASLt stored."""
    from cudnn_fuse import autotune
    from cudnn_fuse.cache import open_default_cache

    seen = _fake_nvmath(monkeypatch)
    monkeypatch.setattr(autotune, "autotune_enabled", lambda: False)
    monkeypatch.setattr(fp8_gemm, "fp8_capable", lambda device: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fp8_gemm._Plan, "run", lambda self, a2, b2, *rest: (torch.zeros(a2.shape[0], b2.shape[1],
                                                                                      dtype=torch.bfloat16), None))
    a, b, sa, sb = _ops(M=32, K=64, N=48)
    spec = fp8_gemm.spec_of(a, b, None, "relu", None, torch.bfloat16, False)
    pc = open_default_cache()
    assert not fp8_gemm.spec_cached(pc, spec, 0, False)
    fp8_gemm.scaled_mm_2d(a, b, sa, sb, None, "relu", None, torch.bfloat16, None, False, 0.01)
    assert seen == [("heuristics", None)]
    assert fp8_gemm.spec_cached(pc, spec, 0, False) and not fp8_gemm.spec_cached(pc, spec, 0, True)
    other = fp8_gemm.spec_of(a, b, None, "gelu_tanh", None, torch.bfloat16, False)
    assert not fp8_gemm.spec_cached(pc, other, 0, False)
    assert fp8_gemm.pin_spec(pc, spec, 0) == 1 and fp8_gemm.pin_spec(pc, spec, 0) == 0


def test_prewarm_sends_an_fp8_gemm_to_cublaslt_and_asks_its_own_keys(monkeypatch):
    from cudnn_fuse import loader, manifest, prewarm

    a, b, _, _ = _ops()
    spec = fp8_gemm.spec_of(a, b, None, None, None, torch.bfloat16, False)
    built, asked = [], []
    monkeypatch.setattr(fp8_gemm, "prewarm_spec", lambda s, device: built.append((s, device)))
    monkeypatch.setattr(loader, "load_or_build", lambda s, device: pytest.fail("a cuDNN build"))
    monkeypatch.setattr(fp8_gemm, "spec_cached", lambda pc, s, device, tuned: asked.append((s, device)) or False)
    rows = prewarm.prewarm([manifest.Entry(spec)], cache=object(), device=1)
    assert [r.status for r in rows] == ["built"] and built == [(spec, 1)] and asked == [(spec, 1)]


def test_prewarm_spec_refuses_what_torch_scaled_mm_would_run(monkeypatch):
    from cudnn_fuse.errors import UnsupportedError

    a, b, _, _ = _ops(M=40)
    spec = fp8_gemm.spec_of(a, b, None, None, None, torch.bfloat16, False)  # M=40: no cuBLASLt plan
    monkeypatch.setattr(fp8_gemm, "fp8_capable", lambda device: True)
    monkeypatch.setattr(fp8_gemm, "_nvmath", lambda: (object(), None))
    monkeypatch.setattr(torch, "randn", lambda shape, device=None: torch.ones(shape))
    monkeypatch.setattr(torch, "empty_strided", lambda shape, stride, dtype, device: torch.zeros(shape, dtype=dtype))
    monkeypatch.setattr(fp8_gemm, "constant", lambda device, value: torch.tensor(value))
    with pytest.raises(UnsupportedError, match="torch._scaled_mm"):
        fp8_gemm.prewarm_spec(spec, 0)


def test_a_traced_call_records_nothing_and_traces_in_one_graph(tmp_path):
    import cudnn_fuse as cf
    from cudnn_fuse import manifest

    a, b, sa, sb = _ops()
    fn = torch.compile(lambda a, b: cf.scaled_mm(a, b, sa, sb, activation="relu"), backend="eager", fullgraph=True)
    torch._dynamo.reset()
    with cf.record(tmp_path / "m.json"):
        got = fn(a, b)
    torch._dynamo.reset()
    torch.testing.assert_close(got, cf.scaled_mm(a, b, sa, sb, activation="relu"))
    assert manifest.load(tmp_path / "m.json") == []  # a traced call's sizes are symbols: record eager calls
