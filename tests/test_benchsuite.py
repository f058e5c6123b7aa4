"""The benchmark suite's logic on the CPU: registry, records and JSON schema from injected
timings, budgets, merge of parts, the plots, and `cudnn-fuse bench` without a GPU."""

import json
import os
import re
import sys
import types

import pytest
import torch

from cudnn_fuse import benchsuite as bs, loader
from cudnn_fuse import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the no-GPU behaviour")


# ---------------------------------------------------------------- registry


def _manifest_layers(batch):
    """(ConvLayer, count) from the shipped manifest's specs, independent of the suite's generator."""
    with open(os.path.join(ROOT, "plans", f"resnet50_fp16_bs{batch}.json")) as f:
        entries = json.load(f)["entries"]
    out = []
    for e in entries:
        s = e["spec"]
        n, c, hw, _ = s["x"]["shape"]
        k, _, r, _ = s["w"]["shape"]
        epi = s["epilogue"]
        out.append((bs.ConvLayer(n, c, hw, k, r, s["stride"][0], epi["activation"], epi["residual"] is not None),
                    e["count"]))
    return out


@pytest.mark.parametrize("batch", [32, 1])
def test_every_distinct_resnet50_conv_is_a_workload(batch):
    by_name = {w.name: w for w in bs.registry()}
    layers = _manifest_layers(batch)
    assert len(layers) == 24
    for layer, count in layers:
        w = by_name.get(layer.name)
        assert w is not None, f"{layer.name} (from the manifest) is not in the registry"
        assert (w.kind, w.flops, w.info["count_in_resnet50"]) == ("conv", layer.flops, count)
    suite_convs = [w for w in bs.registry() if w.name.startswith(f"conv_rn50_bs{batch}_")]
    assert len(suite_convs) == 24
    assert sum(count for _, count in layers) == 53 == len(bs.resnet50_convs(batch))


def test_workload_names_are_unique_and_kinds_known():
    ws = bs.registry()
    names = [w.name for w in ws]
    assert len(names) == len(set(names))
    assert {w.kind for w in ws} == set(bs.KINDS)
    assert all(w.flops > 0 for w in ws)
    grouped = {g for groups in bs.PARTS.values() for g in groups}
    assert {w.group for w in ws} <= grouped, "a workload whose group no part runs"


def test_flops_hand_computed():
    by_name = {w.name: w for w in bs.registry()}
    stem = by_name["conv_rn50_bs32_c3_k64_224_r7_s2_bias_relu"]
    assert stem.flops == 2 * 32 * 64 * 112 * 112 * 3 * 7 * 7 == 7_552_892_928
    # anchor SDPA, causal: half of 4*B*H*S*S*D
    assert by_name["sdpa_causal_bf16_b4_h16_s4096_d128"].flops == 274_877_906_944
    assert by_name["sdpa_causal_bf16_b4_h16_s4096_d128"].anchor
    assert by_name["sdpa_full_bf16_b4_h16_s4096_d128"].flops == 2 * 274_877_906_944
    assert by_name["anchor_matmul_8192x4096x4096_bias_gelu_bf16"].flops == 2 * 8192 * 4096 * 4096
    mlp = by_name["mlp_linear_gelu_bf16_m16_k4096_n16384"]
    assert (mlp.flops, mlp.bytes) == (2 * 16 * 4096 * 16384, 2 * (16 * 4096 + 16384 * 4096 + 16384 + 16 * 16384))
    # resnet50: about 4.1 GMAC per 224x224 image
    assert 8.0e9 < by_name["model_resnet50_fp16_cl_bs1"].flops < 8.4e9
    assert by_name["model_resnet50_fp16_cl_bs32"].flops == 32 * by_name["model_resnet50_fp16_cl_bs1"].flops


def test_attention_sweep_covers_lengths_heads_and_gqa():
    att = [w for w in bs.registry() if w.kind == "attention"]
    lengths = {int(re.search(r"_s(\d+)_", w.name).group(1)) for w in att}
    assert lengths == {512, 1024, 2048, 4096, 8192}
    assert {w.name.rsplit("_d", 1)[1] for w in att} == {"64", "128"}
    assert any("gqa" in w.name for w in att) and any("causal" in w.name for w in att)
    assert any("full" in w.name for w in att)


def test_select_filters():
    ws = bs.registry()
    assert [w.kind for w in bs.select(ws, kinds=["attention"])] == ["attention"] * 25
    only = bs.select(ws, only=r"^mlp_.*_m(1|16)_")
    assert [w.name for w in only] == ["mlp_linear_gelu_bf16_m1_k4096_n16384", "mlp_linear_gelu_bf16_m16_k4096_n16384"]
    core = bs.select(ws, part="core")
    assert {w.group for w in core} == set(bs.PARTS["core"])
    assert len(bs.select(ws, part="all")) == len(ws)
    # every workload is in exactly one part ("models" is a union of the four model parts)
    singles = [p for p in bs.PARTS if p != "models"]
    assert sorted(w.name for p in singles for w in bs.select(ws, part=p)) == sorted(w.name for w in ws)
    assert [w.name for w in bs.select(ws, part="models")] == [w.name for w in ws if w.kind == "model"]
    with pytest.raises(ValueError, match="part"):
        bs.select(ws, part="nope")
    with pytest.raises(ValueError, match="kinds"):
        bs.select(ws, kinds=["convs"])


def test_rotation_sets():
    l2 = 60 << 20
    assert bs.rotation_sets(500 << 20, l2) == (1, False)  # big: no rotation
    assert bs.rotation_sets(30 << 20, l2) == (6, False)  # 6 x 30 MB = 3 x L2
    assert bs.rotation_sets(1 << 20, l2) == (16, True)  # even 16 sets fit: flush too


def test_rel_err():
    a = torch.tensor([3.0, 4.0])
    assert bs.rel_err(a, a) == 0.0
    assert bs.rel_err(a * 1.01, a) == pytest.approx(0.01, rel=1e-5)
    assert bs.rel_err((a, a[0]), (a, a[0] * 2)) == pytest.approx(0.5)
    assert bs.rel_err(a, torch.zeros(3)) is None  # shapes differ: not comparable


# ---------------------------------------------------------------- records from fake timings


class Clock:
    def __init__(self, step=1.0):
        self.t, self.step = 0.0, step

    def __call__(self):
        self.t += self.step
        return self.t


def _fake_case(fail=(), est=None):
    def make(name):
        def setup():
            if name in fail:
                raise RuntimeError(f"{name} is broken")
            return lambda x: x * 2
        return setup
    names = ["torch_eager", "cf", "torch_compile", bs.MAX_AUTOTUNE, "cf_repeat", "cf_autotuned"]
    return bs.Case([(torch.ones(3),)], [bs.Variant(n, make(n), expensive="compile" in n or "tuned" in n,
                                                   est_s=(est or {}).get(n, 1.0)) for n in names])


FAKE_MS = {"torch_eager": 2.0, "cf": 1.0, "torch_compile": 1.5, bs.MAX_AUTOTUNE: 1.25, "cf_repeat": 1.1,
           "cf_autotuned": 0.8}


def _fake_workload(name, kind="matmul", flops=10**12, nbytes=10**9, **case_kw):
    return bs.Workload(name, kind, "mlp", flops, nbytes, lambda opts: _fake_case(**case_kw))


def _timer(name, fn, case):
    assert torch.equal(fn(*case.inputs[0]), torch.full((3,), 2.0))  # the runner hands over the set-up callable
    return FAKE_MS[name]


def test_run_suite_schema_from_injected_timings(tmp_path):
    ws = [_fake_workload("mm_a"), _fake_workload("mm_b", fail={"torch_compile"})]
    out = tmp_path / "part.json"
    doc = bs.run_suite(ws, bs.Options(), part="core", out_path=str(out), timer=_timer, clock=Clock(), extras=False)
    on_disk = json.loads(out.read_text())
    assert on_disk["workloads"] == doc["workloads"]
    for key in ("device", "ceiling_tflops", "host_overhead_us", "workloads", "time_to_ready_s", "summary"):
        assert key in on_disk
    a, b = on_disk["workloads"]
    for key in ("name", "kind", "flops", "cf_ms", "cf_autotuned_ms", "peers"):
        assert key in a
    assert (a["name"], a["kind"], a["flops"]) == ("mm_a", "matmul", 10**12)
    assert (a["cf_ms"], a["cf_autotuned_ms"], a["cf_ms_repeat"]) == (1.0, 0.8, 1.1)
    assert a["peers"] == {"torch_eager": 2.0, "torch_compile": 1.5, bs.MAX_AUTOTUNE: 1.25}
    assert (a["best_peer"], a["best_peer_ms"]) == (bs.MAX_AUTOTUNE, 1.25)
    assert a["speedup_autotuned_vs_best_peer"] == pytest.approx(1.25 / 0.8, abs=1e-4)
    assert a["cf_repeat_spread"] == pytest.approx(0.1)
    assert a["rel_err"]["cf"] == 0.0  # each variant's output checked against torch eager's
    # a failing variant: null and its reason, the rest still timed
    assert b["peers"]["torch_compile"] is None
    assert b["errors"] == {"torch_compile": "RuntimeError: torch_compile is broken"}
    assert b["cf_autotuned_ms"] == 0.8
    assert on_disk["parts"][0]["part"] == "core"


def test_each_variant_is_saved_as_it_ends(tmp_path):
    out = tmp_path / "part.json"
    seen = []

    def timer(name, fn, case):
        on_disk = json.loads(out.read_text())["workloads"] if out.exists() else []
        seen.append((name, [r["peers"] for r in on_disk]))
        return FAKE_MS[name]

    bs.run_suite([_fake_workload("mm")], bs.Options(), out_path=str(out), timer=timer, clock=Clock(), extras=False)
    # when max-autotune is timed, the file already holds the record with torch_eager and torch.compile
    at_max = dict(seen)[bs.MAX_AUTOTUNE]
    assert at_max == [{"torch_eager": 2.0, "torch_compile": 1.5}]


def test_model_variants_time_eager_python_before_any_torch_compile():
    """A model's step is timed on the wall clock, and torch.compile slows an eager model's host
    path once it has run in the process: cf and eager come first, compile's modes last."""
    model = torch.nn.Linear(4, 4)
    for captured in (True, False):
        names = [v.name for v in bs._model_variants(model, (torch.randn(2, 4),), lambda m, x: m(x),
                                                     tuned_est_s=1.0, max_autotune_est_s=1.0, captured=captured)]
        compiles = [n for n in names if n.startswith("torch_compile") or n == "cf_compiled"]
        assert names[-len(compiles):] == compiles and "cf_compiled" in compiles
        assert names[:2] == ["torch_eager", "cf"] and names.index("cf_repeat") < names.index("cf_autotuned")
        assert ("cf_captured" in names) == captured == ("torch_compile_reduce_overhead" in names)
        assert names[-1] == bs.MAX_AUTOTUNE


def test_small_ops_time_every_eager_variant_before_any_torch_compile(monkeypatch):
    """The batch-1 rows are timed on the wall clock too: cf's autotuned variant (and its repeat,
    the noise gauge) must not be the one timed after torch.compile has slowed the host."""
    def cpu_rand(*shape, dtype, scale=1.0, cl=False):
        t = (torch.randn(*shape) * scale).to(dtype)
        return t.contiguous(memory_format=torch.channels_last) if cl else t

    monkeypatch.setattr(bs, "_rand", cpu_rand)
    small = [w for w in bs.registry() if w.kind == "small"]
    assert len(small) == 4
    for w in small:
        case = w.build(bs.Options())
        names = [v.name for v in case.variants]
        compiles = [n for n in names if n in bs.COMPILED_VARIANTS]
        assert case.mode == "wall" and set(compiles) >= {"torch_compile", bs.MAX_AUTOTUNE,
                                                          "torch_compile_reduce_overhead"}
        assert names[-len(compiles):] == compiles, names
        assert names[:2] == ["torch_eager", "cf"]
        assert names.index("cf") < names.index("cf_repeat") < names.index("cf_autotuned") < names.index("cf_captured")
    # the other kernel rows keep their order: cf's repeat and autotuned variants after the compiles
    order = [v.name for v in bs.kernel_variants(lambda: None, lambda: None)]
    assert order.index(bs.MAX_AUTOTUNE) < order.index("cf_repeat") < order.index("cf_autotuned")


def test_the_record_names_the_engines_cf_and_its_autotuned_variant_built(monkeypatch):

    held = [types.SimpleNamespace(engine="eng9_old")]  # a plan of an earlier workload
    monkeypatch.setattr(loader, "plans_in_memory", lambda: list(held))

    def variant(name, action):
        def setup():
            action()
            return lambda x: x * 2
        return bs.Variant(name, setup)

    def heuristic():
        held.append(types.SimpleNamespace(engine="eng4_k24=23"))

    def tuned():  # the autotuned variant's setup clears the in-memory plans, then builds tuned ones
        held[:] = [types.SimpleNamespace(engine=e) for e in ("eng4_k24=40", "eng4_k24=40", "gemm:torch")]

    case = bs.Case([(torch.ones(3),)], [variant("torch_eager", lambda: None), variant("cf", heuristic),
                                        variant("cf_repeat", lambda: None), variant("cf_autotuned", tuned)])
    w = bs.Workload("mm", "matmul", "mlp", 1, 1, lambda opts: case)
    rec = bs.run_workload(w, bs.Options(), started=0.0, timer=_timer, clock=Clock())
    assert rec["engines"] == {"cf": {"plans": 1, "engines": ["eng4_k24=23"]},
                              "cf_autotuned": {"plans": 3, "engines": ["eng4_k24=40", "gemm:torch"]}}
    monkeypatch.setattr(bs, "ENGINES_LISTED", 1)  # a model's dozens of plans: the count, a few names
    held[:] = [types.SimpleNamespace(engine="b"), types.SimpleNamespace(engine="a")]
    assert bs._new_engines(set()) == {"plans": 2, "engines": ["a"]}
    assert bs._new_engines({id(held[1])}) == {"plans": 1, "engines": ["b"]}
    assert bs._new_engines({id(p) for p in held}) == {}


def test_build_failure_is_recorded_not_raised():
    def broken(opts):
        raise ImportError("No module named 'torchvision'")
    w = bs.Workload("model_x", "model", "model_gpt2_infer", 1, None, broken)
    rec = bs.run_workload(w, bs.Options(), started=0.0, timer=_timer, clock=Clock())
    assert rec["errors"] == {"build": "ImportError: No module named 'torchvision'"}
    assert rec["cf_ms"] is None and rec["best_peer"] is None and rec["speedup_vs_best_peer"] is None


def test_budget_skips_expensive_variants_with_a_reason():
    # every clock read advances 10 s; budget 45 s: the cheap variants run, the expensive ones
    # (compile, max-autotune, autotune) are skipped once they would end past it
    w = _fake_workload("mm", est={bs.MAX_AUTOTUNE: 300.0})
    opts = bs.Options(budget_s=45.0, deadline_s=1000.0)
    rec = bs.run_workload(w, opts, started=0.0, timer=_timer, clock=Clock(step=10.0))
    assert rec["cf_ms"] == 1.0 and rec["peers"]["torch_eager"] == 2.0 and rec["cf_ms_repeat"] == 1.1
    assert rec["peers"][bs.MAX_AUTOTUNE] is None and "time budget" in rec["skipped"][bs.MAX_AUTOTUNE]
    assert rec["cf_autotuned_ms"] is None and "time budget" in rec["skipped"]["cf_autotuned"]


def test_deadline_and_max_autotune_switch():
    v = bs.Variant(bs.MAX_AUTOTUNE, lambda: None, expensive=True)
    assert bs.skip_reason(v, bs.Options(max_autotune=False), 0.0) == "disabled (--no-max-autotune)"
    assert bs.skip_reason(v, bs.Options(), 0.0) is None
    cheap = bs.Variant("cf", lambda: None)
    assert bs.skip_reason(cheap, bs.Options(budget_s=10, deadline_s=20), 15.0) is None
    assert "deadline" in bs.skip_reason(cheap, bs.Options(budget_s=10, deadline_s=20), 25.0)


def _doc(part, workloads, **top):
    doc = {"schema": bs.SCHEMA, "version": bs.VERSION, "device": "NVIDIA H200", "ceiling_tflops": None,
           "hbm_tbps": None, "host_overhead_us": None, "time_to_ready_s": None, "workloads": workloads,
           "parts": [{"part": part}]}
    doc.update(top)
    return doc


def _rec(name, kind="matmul", cf=1.0, tuned=0.9, peers=None, flops=10**12, nbytes=10**9):
    rec = {"name": name, "kind": kind, "flops": flops, "bytes": nbytes, "cf_ms": cf, "cf_autotuned_ms": tuned,
           "cf_ms_repeat": cf, "cf_variants": {}, "peers": peers or {"torch_eager": 2.0, bs.MAX_AUTOTUNE: 1.8},
           "errors": {}, "skipped": {}}
    return bs.finish_record(rec)


def test_merge_of_parts():
    names = [w.name for w in bs.registry()]
    first, second = names[0], names[20]
    p1 = _doc("core", [_rec(first), _rec(second, tuned=None, peers={"torch_eager": 2.0})], ceiling_tflops=780.0,
              hbm_tbps=4.3, host_overhead_us={"eager": 30.0, "captured": 2.5, "torch_eager": 20.0})
    better = _rec(second, tuned=0.5)
    p2 = _doc("conv32", [better], ceiling_tflops=790.0, hbm_tbps=4.2,
              time_to_ready_s={"cf": 3.0, "torch_compile": 40.0})
    merged = bs.merge([p2, p1])
    assert [r["name"] for r in merged["workloads"]] == [first, second]  # registry order
    assert merged["workloads"][1]["cf_autotuned_ms"] == 0.5  # the record with more measured variants
    assert (merged["ceiling_tflops"], merged["hbm_tbps"]) == (790.0, 4.3)
    assert merged["host_overhead_us"]["eager"] == 30.0
    assert merged["time_to_ready_s"]["torch_compile"] == 40.0
    assert [p["part"] for p in merged["parts"]] == ["conv32", "core"]
    assert merged["summary"]["workloads"] == 2
    # each record keeps the ceilings of the run that measured it; the parts' own records are untouched
    assert [(r["run_ceiling_tflops"], r["run_hbm_tbps"]) for r in merged["workloads"]] == [(780.0, 4.3), (790.0, 4.2)]
    assert "run_ceiling_tflops" not in better
    with pytest.raises(ValueError, match="schema"):
        bs.merge([{"schema": "other", "workloads": []}])


def test_summary_roofline_and_targets():
    # ceiling 800 TFLOP/s, 4 TB/s: ridge 200 FLOP/B. 1 TFLOP over 1 GB (1000 FLOP/B) is compute-bound,
    # floor 1.25 ms; autotuned cf at 1.6 ms reaches 500 TFLOP/s = 62.5% of the ceiling: under 85%.
    slow = _rec("a", cf=2.0, tuned=1.6, peers={"torch_eager": 1.5, bs.MAX_AUTOTUNE: 2.0})
    fast = _rec("b", cf=2.0, tuned=1.3, peers={"torch_eager": 3.0, bs.MAX_AUTOTUNE: 2.6})
    doc = bs.summarize(_doc("all", [slow, fast], ceiling_tflops=800.0, hbm_tbps=4.0))
    assert slow["compute_bound"] is True and slow["floor_ms"] == pytest.approx(1.25)
    assert slow["roofline_fraction"] == pytest.approx(1.25 / 1.6, abs=1e-4)
    s = doc["summary"]
    assert s["kernels_autotuned_below_best_peer"] == ["a"]  # 1.6 ms vs torch eager's 1.5
    assert s["compute_bound_under_85pct_of_ceiling"] == ["a"]  # b: 769 TFLOP/s = 96%
    assert s["geomean_autotuned_vs_max_autotune"] == pytest.approx(((2.0 / 1.6) * (2.6 / 1.3)) ** 0.5, abs=1e-3)
    assert s["targets"] == {"autotuned_ge_best_peer": False, "geomean_vs_max_autotune_ge_1_25": True,
                            "compute_bound_ge_85pct": False}


def test_a_merged_record_is_judged_against_its_own_runs_ceiling():
    """1 TFLOP in 1.3 ms is 769 TFLOP/s: 96% of its own run's 800, but under 85% of another part's 1000."""
    names = [w.name for w in bs.registry()]
    fast = _rec(names[0], cf=2.0, tuned=1.3)
    other = _rec(names[1], cf=2.0, tuned=1.0)  # 1000 TFLOP/s: 100% of its run's 1000
    merged = bs.merge([_doc("core", [fast], ceiling_tflops=800.0, hbm_tbps=4.0),
                       _doc("conv32", [other], ceiling_tflops=1000.0, hbm_tbps=4.0)])
    assert merged["ceiling_tflops"] == 1000.0
    assert merged["summary"]["compute_bound_under_85pct_of_ceiling"] == []
    got = {r["name"]: r for r in merged["workloads"]}
    assert got[names[0]]["floor_ms"] == pytest.approx(1.25) and got[names[1]]["floor_ms"] == pytest.approx(1.0)
    # the same record judged against the other part's ceiling (no run ceiling of its own) is under
    lone = _rec(names[0], cf=2.0, tuned=1.3)
    doc = bs.summarize(_doc("all", [lone], ceiling_tflops=1000.0, hbm_tbps=4.0))
    assert doc["summary"]["compute_bound_under_85pct_of_ceiling"] == [names[0]]


def test_rows_carry_their_throughput_and_fraction_of_the_cards_peak():
    # 1 TFLOP over 1 GB in 2 ms: compute-bound, 500 TFLOP/s; 1 GFLOP over 4 GB in 2 ms: memory-bound, 2000 GB/s
    big, stream = _rec("big", cf=2.0, tuned=None), _rec("stream", cf=2.0, tuned=None, flops=10**9, nbytes=4 * 10**9)
    doc = bs.summarize(_doc("all", [big, stream], ceiling_tflops=800.0, hbm_tbps=4.0))
    assert doc["card_peak"] == {"card": "H200", "bf16_tflops": 989.4, "hbm_tbps": 4.8}
    assert big["compute_bound"] and big["cf_tflops"] == 500.0 and big["peak_fraction"] == pytest.approx(500 / 989.4, abs=1e-4)
    assert stream["compute_bound"] is False and stream["cf_gbps"] == 2000.0
    assert stream["peak_fraction"] == pytest.approx(2000 / 4800, abs=1e-4)
    assert bs.card_peak("NVIDIA H100 PCIe")["bf16_tflops"] == 756.0  # the most specific name wins
    assert bs.card_peak("NVIDIA H100 80GB HBM3")["hbm_tbps"] == 3.35
    unknown = bs.summarize(_doc("all", [_rec("u")], device="Some GPU", ceiling_tflops=800.0, hbm_tbps=4.0))
    assert unknown["card_peak"] is None and unknown["workloads"][0]["peak_fraction"] is None


def test_a_tiny_kernel_is_not_compute_bound_whatever_its_intensity():
    # 1 GFLOP over 1 MB is 1000 FLOP/B, far over the ridge, but its floor is 1.25 us: latency-bound
    tiny = _rec("t", cf=0.01, tuned=0.008, flops=10**9, nbytes=10**6)
    doc = bs.summarize(_doc("all", [tiny], ceiling_tflops=800.0, hbm_tbps=4.0))
    assert tiny["compute_bound"] is False
    assert doc["summary"]["compute_bound_under_85pct_of_ceiling"] == []


# ---------------------------------------------------------------- plots


def test_plot_script_on_a_fake_peers_json(tmp_path):
    pytest.importorskip("matplotlib")
    plot_peers = _plot_results()
    recs = [_rec("conv_x", kind="conv"), _rec("sdpa_y", kind="attention", tuned=None, cf=3.0),
            _rec("model_z", kind="model", nbytes=None)]
    doc = bs.summarize(_doc("all", recs, ceiling_tflops=790.0, hbm_tbps=4.3,
                            host_overhead_us={"eager": 31.0, "captured": 2.4, "torch_eager": 22.0}))
    path = tmp_path / "peers.json"
    path.write_text(json.dumps(doc))
    assert plot_peers.main(["--peers", str(path), "--memory", str(tmp_path / "no.json"), "--cold",
                            str(tmp_path / "no.json"), "--out-dir", str(tmp_path / "out")]) == 0
    for png in ("peers_speedup.png", "peers_roofline.png"):
        data = (tmp_path / "out" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    # sdpa_y has no autotuned time: its bar uses the best cf (3.0 ms vs the peer's 1.8)
    rows = {r[0]: r[2] for r in plot_peers.speedup_rows(doc)}
    assert rows == pytest.approx({"conv_x": 1.8 / 0.9, "sdpa_y": 1.8 / 3.0, "model_z": 1.8 / 0.9})
    assert [r[0] for r in plot_peers.roofline_rows(doc)] == ["conv_x", "sdpa_y"]  # a model has no byte count
    table = (tmp_path / "out" / "peers_table.md").read_text()
    assert "| conv_x | conv | 1 | 0.9 | torch_compile_max_autotune | 1.8 | 2.00× |" in table
    assert "eager 31.0, captured 2.4" in table
    assert "Time to ready: not measured" in table  # no part of this run measured it
    doc["time_to_ready_s"] = {"cf": 7.8, "cf_detail": {"first_forward_s": 0.6}, "torch_compile": 41.0,
                              "torch_compile_detail": {"first_forward_s": 33.2}, "torch_compile_warm_inductor_cache": 9.5}
    assert ("cf warm plan cache 7.8 (0.6), torch.compile 41.0 (33.2), with a warm Inductor cache 9.5 (–)"
            in plot_peers.table(doc))


def _plot_results():
    sys.path.insert(0, ROOT)
    from bench import plot_results
    return plot_results


def _mem_case(name, peak, step):
    return {"name": name, "eager_peak_bytes": 1000, "cf_peak_bytes": peak * 1000,
            "eager_step_ms": 10.0, "cf_step_ms": step * 10.0}


def test_memory_rows_judge_each_case_against_its_own_target():
    pr = _plot_results()
    doc = {"cases": [_mem_case("mlp", 1.0, 1.0), _mem_case("mlp_recompute", 0.70, 1.35),
                     _mem_case("conv", 1.0, 0.99), _mem_case("conv_more_memory", 1.01, 0.5),
                     _mem_case("x_recompute", 0.71, 1.0), _mem_case("y_recompute", 0.5, 1.36),
                     {"name": "unmeasured", "eager_peak_bytes": 1, "cf_peak_bytes": None,
                      "eager_step_ms": 1.0, "cf_step_ms": 1.0}]}
    rows = {r[0]: r[1:] for r in pr.memory_rows(doc)}
    assert "unmeasured" not in rows
    assert rows["mlp"][:2] == pytest.approx((1.0, 1.0)) and rows["mlp"][2:] == (True, False)  # a tie is not faster
    assert rows["mlp_recompute"][2:] == (True, True)  # recompute targets are inclusive: 0.70, 1.35
    assert rows["conv"][2:] == (True, True)
    assert rows["conv_more_memory"][2:] == (False, True)
    assert rows["x_recompute"][2:] == (False, True)
    assert rows["y_recompute"][2:] == (True, False)


def test_cold_rows_and_summary_over_the_graphs_measured():
    pr = _plot_results()
    doc = {"per_graph_ms": {"a": {"cold_heuristic": 300.0, "cold_autotune": 900.0, "warm": 2.0},
                            "b": {"cold_heuristic": 100.0, "warm": 6.0},
                            "c": {"cold_heuristic": 200.0, "cold_autotune": float("nan"), "warm": 1.0}}}
    rows = pr.cold_rows(doc)
    assert [r[0] for r in rows] == ["a", "b", "c"] and "cold_autotune" not in rows[2][1]
    summary = pr.cold_summary(rows)
    assert summary["cold_heuristic"] == pytest.approx((200.0, 200.0))
    assert summary["cold_autotune"] == pytest.approx((900.0, 900.0))
    assert summary["warm"] == pytest.approx((3.0, 2.0))
    assert "torch_eager_first_call" not in summary  # no --eager-probe in this file
    assert pr.cold_rows({}) == [] and pr.cold_summary([]) == {}
    doc["eager_first_call"] = {"per_graph_ms": {"a": 40.0, "c": 10.0, "gone": 99.0}}  # --eager-probe's own per-graph times
    rows = pr.cold_rows(doc)
    assert [r[1].get("torch_eager_first_call") for r in rows] == [40.0, None, 10.0]
    assert pr.cold_summary(rows)["torch_eager_first_call"] == pytest.approx((25.0, 25.0))


def test_plot_results_writes_both_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    pr = _plot_results()
    mem, cold = tmp_path / "memory.json", tmp_path / "cold.json"
    mem.write_text(json.dumps({"device": "X", "cases": [_mem_case("mlp", 1.0, 0.9), _mem_case("m_recompute", 0.6, 1.2)]}))
    cold.write_text(json.dumps({"graphs": 2, "warm_plans_built": 0,
                                "per_graph_ms": {"a": {"cold_heuristic": 30.0, "warm": 2.0}, "b": {"warm": 1.5}},
                                "eager_first_call": {"per_graph_ms": {"a": 9.0, "b": 4.0}}}))
    assert pr.main(["--memory", str(mem), "--cold", str(cold), "--peers", str(tmp_path / "none.json"), "--out-dir", str(tmp_path / "out")]) == 0
    for png in ("memory.png", "cold_start.png"):
        data = (tmp_path / "out" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert pr.main(["--memory", str(tmp_path / "none.json"), "--cold", str(tmp_path / "none2.json"),
                    "--peers", str(tmp_path / "none3.json"), "--out-dir", str(tmp_path / "out2")]) == 1  # nothing to plot is a failure


def test_plot_results_without_matplotlib_exits_2(monkeypatch, capsys):
    pr = _plot_results()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert pr.main(["--memory", "nope.json"]) == 2
    assert "needs matplotlib" in capsys.readouterr().err


# ---------------------------------------------------------------- the command line


@no_gpu
def test_bench_without_gpu_exits_2_with_a_clear_message(capsys):
    assert cli.main(["bench", "--only", "anchor"]) == 2
    err = capsys.readouterr().err
    assert "benchmarks need a CUDA GPU" in err


def test_bench_list_and_merge_need_no_gpu(tmp_path, capsys):
    assert cli.main(["bench", "--list", "--kinds", "attention"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == "25 workloads" and all("attention" in line for line in lines[:-1])
    part = tmp_path / "p.json"
    part.write_text(json.dumps(_doc("core", [_rec(bs.registry()[0].name)], ceiling_tflops=790.0, hbm_tbps=4.3)))
    out = tmp_path / "merged.json"
    assert cli.main(["bench", "--merge", str(part), "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert merged["summary"]["workloads"] == 1 and merged["ceiling_tflops"] == 790.0
    assert cli.main(["bench", "--merge", str(tmp_path / "missing.json")]) == 2


@pytest.mark.parametrize("content", ["[1, 2]", '"x"', "[" * 100_000 + "]" * 100_000,
                                     json.dumps({"schema": bs.SCHEMA, "workloads": [1]}),
                                     json.dumps({"schema": bs.SCHEMA, "workloads": {"a": 1}})])
def test_bench_merge_of_a_malformed_part_is_one_message(tmp_path, capsys, content):
    """A JSON list, a string, JSON nested past the recursion limit, or workloads that are no records
    raised AttributeError, RecursionError or TypeError tracebacks."""
    part = tmp_path / "p.json"
    part.write_text(content)
    assert cli.main(["bench", "--merge", str(part), "--out", str(tmp_path / "m.json")]) == 2
    assert "cudnn-fuse bench --merge: " in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()


def test_bench_rejects_a_bad_regex(capsys):
    assert cli.main(["bench", "--list", "--only", "("]) == 2
    assert "cudnn-fuse bench: --only: '(' is no regular expression" in capsys.readouterr().err


def test_bench_merge_names_the_part_that_is_not_json(tmp_path, capsys):
    part = tmp_path / "g.bin"
    part.write_bytes(b"\x00garbage")
    assert cli.main(["bench", "--merge", str(part)]) == 2
    assert f"cudnn-fuse bench --merge: {part}: not JSON" in capsys.readouterr().err


def test_a_variant_that_captures_or_replays_launch_graphs_records_how_many(monkeypatch):
    from cudnn_fuse import launch_graphs

    monkeypatch.setattr(launch_graphs, "STATS", launch_graphs.Stats())

    def timer(name, fn, case):
        if name == "cf_autotuned":  # as if its launches captured 3 graphs and replayed 40 times
            launch_graphs.STATS.captures += 3
            launch_graphs.STATS.replays += 40
            launch_graphs.STATS.live += 3
        return _timer(name, fn, case)

    rec = bs.run_workload(_fake_workload("mm"), bs.Options(), started=0.0, timer=timer, clock=Clock())
    assert rec["launch_graphs"] == {"cf_autotuned": {"graph_captures": 3, "graph_replays": 40}}
    quiet = bs.run_workload(_fake_workload("mm"), bs.Options(), started=0.0, timer=_timer, clock=Clock())
    assert "launch_graphs" not in quiet  # graphs off (the default): the record is as before


@pytest.mark.parametrize("est_ms, heated", [(1.0, True), (0.1, False)])
def test_timer_heats_the_gpu_before_timing_a_long_variant(monkeypatch, est_ms, heated):
    """A variant whose calls take at least autotune's heat_min_ms is first run back to back for
    heat_s (every variant then timed at a sustained run's clocks); a short one is not."""
    from cudnn_fuse import autotune

    seen, ran = [], []
    monkeypatch.setattr(bs, "_warm", lambda fn, inputs, **kw: est_ms)
    monkeypatch.setattr(bs, "host_enqueue_us", lambda fn, inputs: 5.0)
    monkeypatch.setattr(bs, "device_times", lambda fn, inputs, iters, host, flush: [2.0, 1.0, 3.0])

    def fake_heat(run, seconds):
        seen.append(seconds)
        run()
        run()

    monkeypatch.setattr(autotune, "heat_gpu", fake_heat)
    monkeypatch.setattr(autotune, "DEFAULT_CONFIG", autotune.Config(heat_s=0.4, heat_min_ms=0.5))
    case = bs.Case(inputs=[(1,), (2,)], variants=[])
    assert bs.Timer(100.0)("v", lambda i: ran.append(i), case) == 2.0
    assert seen == ([0.4] if heated else [])
    assert ran == ([1, 2] if heated else [])  # the heat rotates through the input sets
