"""The GPU bench scripts' CPU parts: sampling, summaries and plots from made-up results."""

from __future__ import annotations

import json
import os
import statistics
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import dynamic_shapes, models  # noqa: E402


def test_dynamic_shapes_draws_distinct_new_sizes_reproducibly():
    sizes = dynamic_shapes.draw_sizes(200)
    assert len(sizes) == len(set(sizes)) == 200
    assert all(1 <= s <= dynamic_shapes.MAX_SEQ for s in sizes)
    assert not set(sizes) & {128, 512, 1024, 2048}  # the manifests' own sizes are not new
    assert sizes == dynamic_shapes.draw_sizes(200) and sizes != dynamic_shapes.draw_sizes(200, seed=1)


def test_dynamic_shapes_sweep_takes_first_and_later_calls_minus_steady(monkeypatch):
    calls = []
    later = [3.0, 2.5, 40.0, 2.0, 2.0, 2.0]  # a stand-in's calls, the swap's build, the plan's
    times = iter(([10.0] + later + [2.0]) * 2)  # per size: the first call, each later call, the steady median
    assert len(later) == dynamic_shapes.LATER_CALLS

    def synced_ms(fn, reps):
        for _ in range(reps):
            fn()
        return next(times)

    monkeypatch.setattr(dynamic_shapes, "synced_ms", synced_ms)
    monkeypatch.setattr(dynamic_shapes.torch.cuda, "synchronize", lambda: None)
    res = dynamic_shapes.sweep(calls.append, lambda s: s, [7, 9])
    n = 1 + dynamic_shapes.LATER_CALLS + dynamic_shapes.STEADY_REPS
    assert calls == [7] * n + [9] * n
    assert [r["extra_ms"] for r in res["per_size"]] == [8.0, 8.0]
    assert res["per_size"][0]["later_ms"] == later
    assert res["first_call_extra_ms_median"] == res["first_call_extra_ms_p95"] == 8.0
    assert res["later_call_extra_ms_median"] == res["later_call_extra_ms_p95"] == 38.0


@pytest.mark.parametrize("script", ["dynamic", "models"])
def test_bench_plots_from_a_results_file(tmp_path, script):
    pytest.importorskip("matplotlib")
    if script == "dynamic":
        rows = [{"seq": s, "first_ms": 5.0, "steady_ms": 1.0, "extra_ms": 4.0} for s in (3, 40)]
        doc = {"gpu": "X", "commit": "c", "models": [{"name": "gpt2", "batch": 8, "cf": {"per_size": rows},
                                                      "eager": {"per_size": rows},
                                                      "static": {"per_size": [{"seq": 3, "steady_ms": 1.0}]}}]}
        path = tmp_path / "dynamic_shapes.json"
        path.write_text(json.dumps(doc))
        out = dynamic_shapes.plot(str(path))
    else:
        doc = {"gpu": "X", "commit": "c", "rows": [{"model": "m", "mode": "infer_bs1", "eager_ms": 2.0, "cf_ms": 1.0,
                                                   "compile_ms": 1.5, "cf_compile_ms": 1.2}]}
        path = tmp_path / "models.json"
        path.write_text(json.dumps(doc))
        out = models.plot(str(path))
    assert os.path.getsize(out) > 1000


def test_dynamic_shapes_times_every_call_of_the_paced_swaps_then_sweeps_up_the_stand_ins_left(monkeypatch):
    from cudnn_fuse import build_process, loader

    monkeypatch.setattr(build_process, "default", lambda: None)
    monkeypatch.setattr(dynamic_shapes.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(loader.STATS, "swaps", 0)  # restored after
    monkeypatch.setattr(loader.STATS, "standins", 3)  # three stand-ins serving: two swap in the timed calls
    n = dynamic_shapes.SWAP_CALLS
    times = iter([5.0, 1.5, 6.0] + [1.0] * (n - 3) + [1.0] * dynamic_shapes.STEADY_REPS)

    def synced_ms(fn, reps):
        out = []
        for _ in range(reps):
            fn()
            out.append(next(times))
        return statistics.median(out)

    calls = []

    def fn(x):  # the first and third calls swap a plan in each; the third stand-in swaps in the sweep-up
        calls.append(x)
        if len(calls) in (1, 3, n + 2):
            loader.STATS.swaps += 1

    monkeypatch.setattr(dynamic_shapes, "synced_ms", synced_ms)
    got = dynamic_shapes.settled(fn, lambda s: s, [64])
    row = got["per_size"][0]
    assert row["swaps"] == 2 and len(row["swap_calls_ms"]) == n and row["swap_ms"] == 6.0
    assert row["steady_ms"] == 1.0 and row["swap_extra_ms"] == 5.0 and got["swap_call_extra_ms_median"] == 5.0
    assert got["standins_after_swap_calls"] == 1 and got["sweep_up_passes"] == 1 and got["standins_left"] == 0
    assert len(calls) == n + 4 + 1 + dynamic_shapes.STEADY_REPS  # swap calls, one pass, a warm call, steady


def test_dynamic_shapes_sweep_up_is_bounded_and_says_what_is_left(monkeypatch):
    from cudnn_fuse import build_process, loader

    monkeypatch.setattr(build_process, "default", lambda: None)
    monkeypatch.setattr(dynamic_shapes.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(loader.STATS, "swaps", 0)
    monkeypatch.setattr(loader.STATS, "standins", 2)  # never swapped
    monkeypatch.setattr(dynamic_shapes, "synced_ms", lambda fn, reps: [fn() for _ in range(reps)] and 1.0)
    got = dynamic_shapes.settled(lambda x: None, lambda s: s, [8, 16])
    assert got["sweep_up_passes"] == dynamic_shapes.STALLED_PASSES and got["standins_left"] == 2
    monkeypatch.setattr(dynamic_shapes, "SWEEP_UP_S", 0.0)  # and in time
    got = dynamic_shapes.settled(lambda x: None, lambda s: s, [8, 16])
    assert got["sweep_up_passes"] == 0 and got["standins_left"] == 2


def test_dynamic_shapes_sweep_up_goes_on_while_its_passes_swap(monkeypatch):
    """Paced loads swap about one plan of a size a pass (its calls follow one another within a load's time): a
    block whose size kept six stand-ins needs six passes, some of them swapping nothing between."""
    from cudnn_fuse import build_process, loader

    monkeypatch.setattr(build_process, "default", lambda: None)
    monkeypatch.setattr(dynamic_shapes.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(loader.STATS, "swaps", 0)
    monkeypatch.setattr(loader.STATS, "standins", 6)
    monkeypatch.setattr(dynamic_shapes, "synced_ms", lambda fn, reps: [fn() for _ in range(reps)] and 1.0)
    n = dynamic_shapes.SWAP_CALLS
    calls = []

    def fn(x):  # the first call of every pass but the third swaps one
        calls.append(x)
        k = len(calls) - n - 1
        if k >= 0 and k % 4 == 0 and k // 4 != 2:
            loader.STATS.swaps += 1

    got = dynamic_shapes.settled(fn, lambda s: s, [64])
    assert got["standins_after_swap_calls"] == 6 and got["sweep_up_passes"] == 7 and got["standins_left"] == 0


def test_dynamic_shapes_sweeps_up_the_sizes_met_outside_the_sweep_too(monkeypatch):
    """A size the process called only for a profile leaves stand-ins that the sweep's sizes never swap."""
    from cudnn_fuse import build_process, loader

    monkeypatch.setattr(build_process, "default", lambda: None)
    monkeypatch.setattr(dynamic_shapes.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(loader.STATS, "swaps", 0)
    monkeypatch.setattr(loader.STATS, "standins", 1)
    monkeypatch.setattr(dynamic_shapes, "synced_ms", lambda fn, reps: [fn() for _ in range(reps)] and 1.0)

    def fn(x):
        if x == 99:  # the profiled size's stand-in swaps on its next call
            loader.STATS.swaps = 1

    assert dynamic_shapes.settled(fn, lambda s: s, [8])["standins_left"] == 1
    got = dynamic_shapes.settled(fn, lambda s: s, [8], also=[99])
    assert got["standins_left"] == 0 and got["sweep_up_passes"] == 1 and [r["seq"] for r in got["per_size"]] == [8]


def test_dynamic_shapes_pins_to_the_cores_named_or_the_default_where_the_machine_has_them():
    pin = dynamic_shapes.pinned_cpus
    assert pin("auto", range(16)) == dynamic_shapes.DEFAULT_CPUS and pin("auto", range(2)) == ()
    assert pin("none", range(16)) == () and pin("4-7", range(8)) == (4, 5, 6, 7) and pin("0,2-3", range(4)) == (0, 2, 3)
    for bad in ("4-9", "x", "", "3-"):
        with pytest.raises(ValueError, match="--cpus"):
            pin(bad, range(8))


def test_dynamic_shapes_steady_vs_static_is_the_median_ratio_over_the_sizes_both_timed():
    settled_ = {"per_size": [{"seq": 1, "steady_ms": 1.0}, {"seq": 2, "steady_ms": 2.0}, {"seq": 3, "steady_ms": 4.0},
                             {"seq": 4, "steady_ms": None}]}
    static = {"per_size": [{"seq": 1, "steady_ms": 0.9}, {"seq": 2, "steady_ms": 2.0}, {"seq": 3, "steady_ms": 4.4},
                           {"seq": 4, "steady_ms": 1.0}, {"seq": 5, "steady_ms": 1.0}]}
    assert dynamic_shapes.steady_vs_static(settled_, static) == 1.0  # median of 0.9, 1.0, 1.1
    assert dynamic_shapes.steady_vs_static(settled_, {}) is None
    assert dynamic_shapes.steady_vs_static({}, static) is None


def test_dynamic_shapes_static_variant_calls_each_size_as_the_cf_variant_does_before_timing_it(monkeypatch):
    from cudnn_fuse import loader

    monkeypatch.setattr(loader.STATS, "standins", 0)
    monkeypatch.setattr(dynamic_shapes.torch.cuda, "synchronize", lambda: None)
    seen = []
    monkeypatch.setattr(dynamic_shapes, "synced_ms", lambda fn, reps: [fn() for _ in range(reps)] and 2.5)
    got = dynamic_shapes.static_steady(seen.append, lambda s: s * 10, [1, 2], 3)
    assert [(r["seq"], r["steady_ms"]) for r in got["per_size"]] == [(1, 2.5), (2, 2.5)] and got["standins"] == 0
    d = dynamic_shapes
    # the cf variant: the sweep (first, later, steady), the swap calls, every sweep-up pass, then its timing
    passes = [1 + d.LATER_CALLS + d.STEADY_REPS, d.SWAP_CALLS] + [4] * 3 + [1 + d.STEADY_REPS]
    assert seen == [x for n in passes for x in [10] * n + [20] * n]
    assert got["calls_before_steady"] == sum(passes[:-1])


def test_dynamic_shapes_steady_paths_count_the_lookups_replays_and_captures_of_a_steady_call(monkeypatch):
    """Which way the steady calls went: a call that misses the ops' memo looks its plans up (``hits``), one
    on a captured launch replays it."""
    from cudnn_fuse import launch_graphs, loader

    monkeypatch.setattr(loader.STATS, "hits", 0)
    monkeypatch.setattr(launch_graphs.STATS, "replays", 0)
    monkeypatch.setattr(launch_graphs.STATS, "captures", 0)

    def fn(x):  # two lookups and three replays a call; one capture in all
        loader.STATS.hits += 2
        launch_graphs.STATS.replays += 3
        if launch_graphs.STATS.captures == 0:
            launch_graphs.STATS.captures = 1

    monkeypatch.setattr(dynamic_shapes, "synced_ms", lambda f, reps: [f() for _ in range(reps)] and 0.5)
    got = dynamic_shapes.steady_paths(fn, 7)
    native = {k: got.pop(k) for k in ("native_replays_per_call", "native_plan_launches_per_call",
                                      "guarded_hits_per_call", "keyed_hits_per_call") if k in got}
    assert got == {"steady_ms": 0.5, "hits_per_call": 2.0, "graph_replays_per_call": 3.0,
                   "graph_captures_per_call": round(1 / dynamic_shapes.STEADY_REPS, 2)}
    assert all(v == 0 for v in native.values())  # fn made no call through the C memo


def test_dynamic_shapes_probes_retake_the_steady_time_after_each_change(monkeypatch):
    """The probes time the same sizes as the process is and after each change, in order, closing the build
    process only where asked."""
    import gc

    from cudnn_fuse import build_process

    closed, calls = [], []

    class BP:
        def close(self):
            closed.append(True)

    monkeypatch.setattr(build_process, "default", lambda: BP())
    monkeypatch.setattr(dynamic_shapes.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(dynamic_shapes.torch.cuda, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    times = iter([1.0, 3.0, 2.0, 2.0, 2.0, 1.0, 0.5, 0.5])
    monkeypatch.setattr(dynamic_shapes, "synced_ms", lambda f, reps: next(times))
    got = dynamic_shapes.steady_probes(lambda x: None, lambda s: s, [5, 6], build_process=True)
    assert (got["as_is"], got["build_process_closed"], got["allocator_emptied"], got["gc_frozen"]) == (2.0, 2.0, 1.5, 0.5)
    assert closed == [True] and calls == ["empty", "freeze"]
    gc.unfreeze()
    times = iter([1.0] * 6)
    got = dynamic_shapes.steady_probes(lambda x: None, lambda s: s, [5, 6], build_process=False)
    assert "build_process_closed" not in got and closed == [True]


def test_dynamic_shapes_profiles_first_calls_at_sizes_the_sweep_did_not_meet(monkeypatch):
    sweep = dynamic_shapes.draw_sizes(10)
    new = dynamic_shapes.draw_sizes(dynamic_shapes.PROFILED_SIZES, 1, sweep)
    assert len(new) == dynamic_shapes.PROFILED_SIZES and not set(new) & set(sweep)
    assert not set(new) & {128, 512, 1024, 2048} and new == dynamic_shapes.draw_sizes(dynamic_shapes.PROFILED_SIZES, 1, sweep)
    monkeypatch.setattr(dynamic_shapes.torch.cuda, "synchronize", lambda: None)
    lin = torch.nn.Linear(8, 16)
    seen = []

    def make(s):
        seen.append(s)
        return torch.randn(1, s, 8)

    got = dynamic_shapes.profile_first(lin, make, new, sweep[0])
    assert seen == [sweep[0]] + new  # the profiler's first start on a size met before, then each new one
    assert [r["seq"] for r in got] == new and all(r["wall_ms"] > 0 for r in got)
    assert any("linear" in op["op"] or "addmm" in op["op"] for op in got[0]["host_ops"])


@pytest.mark.parametrize("option,value", [("--models", "resnet18"), ("--modes", "infer_bs8"),
                                          ("--variants", "cf,cf_tuned"), ("--compile-modes", "reduce-overhead")])
def test_models_names_an_unknown_option_value(option, value, capsys):
    with pytest.raises(SystemExit) as exc:
        models.main([option, value, "--table", "nothing.json"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert option in err and value.split(",")[-1] in err


@pytest.mark.parametrize("script,args,named", [
    ("dynamic_shapes", ["--models", "gpt3"], "--models"), ("dynamic_shapes", ["--sizes", "0"], "--sizes"),
    ("dynamic_shapes", ["--static-runs", "0"], "--static-runs"),
    ("fp8", ["--shapes", "4096x4096"], "--shapes"), ("fp8", ["--seqs", "1,x"], "--seqs"),
    ("fp8", ["--training", "nope"], "--training")])
def test_bench_scripts_name_a_bad_option(script, args, named, capsys):
    import importlib

    mod = importlib.import_module(f"bench.{script}")
    with pytest.raises(SystemExit) as exc:
        mod.main(args + ["--plot", "nothing.json"])
    assert exc.value.code == 2 and named in capsys.readouterr().err


def test_models_summary_holds_the_goals_ratios():
    rows = [{"model": "a", "mode": "infer_bs1", "eager_ms": 2.0, "cf_ms": 1.0, "compile_ms": 1.0, "cf_compile_ms": 0.5},
            {"model": "b", "mode": "infer_bs32", "eager_ms": 1.0, "cf_ms": 1.2, "compile_ms": 1.0, "cf_compile_ms": 2.0}]
    s = models.summarize(rows)
    assert s["cf_over_eager_worst"] == pytest.approx(1.2)
    assert s["compile_over_cf_compile_geomean_infer"] == pytest.approx(1.0)


def test_models_repeats_a_timing_and_keeps_its_median_and_spread(monkeypatch):
    import torch

    times = iter([2.0, 1.0, 1.5, 1.25, 1.75])
    monkeypatch.setattr(models, "time_ms", lambda step, warmup, iters: (step(), next(times))[1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    model = torch.nn.Linear(4, 3)
    step, first_s, err = models.prepare_variant(model, lambda bs: (torch.randn(bs, 4),), lambda m: m,
                                                "infer_bs1", 1, None)
    ms, spread = models.time_rounds({"eager": step}, 5, train=False)["eager"]
    assert ms == 1.5 and spread == pytest.approx(0.5 / 1.5) and err == 0.0 and first_s >= 0  # quartiles 1.25, 1.75


def test_models_times_compiled_variants_in_turn_so_none_always_comes_last(monkeypatch):
    order = []
    figures = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 5.0, 6.0])}
    monkeypatch.setattr(models, "time_ms", lambda step, warmup, iters: next(figures[step()]))
    steps = {"a": lambda: order.append("a") or "a", "b": lambda: order.append("b") or "b"}
    runs = {}
    got = models.time_rounds(steps, 3, train=False, runs=runs)
    assert order == ["a", "b", "b", "a", "a", "b"]  # forward, backward, forward
    assert got["a"] == (2.0, pytest.approx(0.5)) and got["b"] == (5.0, pytest.approx(0.1))
    assert runs == {"a": [3.0, 1.0, 2.0], "b": [5.0, 5.0, 6.0]}


def test_models_settles_a_cf_variant_before_timing_it(monkeypatch):
    import torch

    from cudnn_fuse import build_process, loader

    calls, waited = [], []

    class Process:
        def wait(self, timeout):
            waited.append((len(calls), timeout))
            loader.STATS.swaps += 2  # what swapping in two stored plans counts
            return False

        def pending(self):
            return 1

    monkeypatch.setattr(build_process, "default", lambda: Process())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(loader.STATS, "swaps", loader.STATS.swaps)  # restored after
    got = models.settle(lambda: calls.append(1), timeout_s=7.0)
    assert len(calls) == 5 and waited == [(3, 7.0)]  # asked on the 2nd call, waited for, then swapped in
    assert got == {"standins": 0, "swaps": 2, "process_builds": 0}


def test_models_speedups_are_ratios_of_the_fastest_rounds(monkeypatch):
    # eager is host-bound and its rounds fall into a slow state the device-bound cf does not share: the
    # medians' ratio (6 / 2) and the rounds' own ratios (median 3.5) would both read the slow state in
    figures = {"eager": iter([4.0, 8.0, 8.0, 3.0, 8.0]), "cf": iter([2.0, 2.0, 2.5, 2.0, 2.0])}
    monkeypatch.setattr(models, "time_ms", lambda step, warmup, iters: next(figures[step()]))
    runs = {}
    got = models._paired({"cf": lambda: "cf"}, lambda: "eager", 5, train=False, runs=runs)
    assert got["cf"][0] == 2.0 and runs["eager"] == [4.0, 8.0, 8.0, 3.0, 8.0] and "eager" not in got
    row = {}
    models._best_ratios(row, runs)
    assert row["vs_eager"] == {"cf": 1.5}
    row = {"eager_ms": 6.0, "cf_ms": 3.0, "compile_ms": 2.0, "vs_eager": {"cf": 2.0, "compile": 2.5}}
    assert models.speedup(row, "cf") == 2.0 and models.speedup(row, "compile") == 2.5
    assert models.speedup({"eager_ms": 6.0, "cf_ms": 3.0}, "cf") == 2.0  # an older row: the medians' ratio
    assert models.speedup(row, "cf_compile") is None
    s = models.summarize([{**row, "mode": "infer_bs32", "cf_compile_ms": 2.0,
                           "vs_eager": {"cf": 0.8, "compile": 2.5, "cf_compile": 2.0}}])
    assert s["cf_over_eager_worst"] == pytest.approx(1.25) and s["cf_compile_over_compile_worst"] == pytest.approx(1.25)
    assert s["compile_over_cf_compile_geomean_infer"] == pytest.approx(0.8)


def test_fp8_bench_errors_count_only_what_the_format_does_not_round_away(tmp_path):
    from bench import fp8

    want = torch.tensor([100.0, -3.3, 0.5], dtype=torch.float64)
    exact = want.to(fp8.E4)  # the format's own rounding of the reference: no error
    assert fp8._err(exact, want, fp8.E4) == 0.0
    off = exact.float().clone()
    off[0] = 104.0  # one E4M3 step above 100's rounding (96, then 104)
    assert fp8._err(off.to(fp8.E4), want, fp8.E4) == pytest.approx(8 / 100)
    assert fp8._err(want.bfloat16(), want, torch.bfloat16) == pytest.approx(
        float((want.bfloat16().double() - want).abs().max() / 100))
    pytest.importorskip("matplotlib")
    row = {"M": 8, "K": 16, "N": 16, "out_dtype": "bfloat16", "speedup_vs_torch": 1.2, "speedup_vs_bf16": 1.6}
    attn = {"seq": 2048, "causal": True, "speedup": 1.3, "speedup_fp8_only": 1.5}
    (tmp_path / "fp8.json").write_text(json.dumps({"device": "X", "commit": "c", "scaled_mm": [row, row],
                                                   "attention": [attn]}))
    assert fp8.main(["--plot", str(tmp_path / "fp8.json")]) == 0
    assert (tmp_path / "fp8.png").read_bytes()[:4] == b"\x89PNG"


def test_fp8_bench_keeps_the_sections_it_does_not_run_and_names_each_sections_run(tmp_path, monkeypatch):
    import cudnn

    from bench import fp8

    (tmp_path / "fp8.json").write_text(json.dumps({
        "commit": "old", "scaled_mm": [{"M": 1}], "runs": {"scaled_mm": {"commit": "old", "device": "A"}},
        "training": [{"name": "mlp", "recipe": "current", "fp8_ms": 9.0}, {"name": "blk", "recipe": "current"}]}))
    monkeypatch.setattr(fp8.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cudnn, "backend_version", lambda: 91900)
    monkeypatch.setattr(fp8, "device_name", lambda: "B")
    monkeypatch.setattr(fp8, "cublaslt_support", lambda: [{"d": "bfloat16"}])
    monkeypatch.setattr(fp8, "training_rows", lambda names, steps, profiled=False: ([{"name": names[0], "recipe": "current",
                                                                       "fp8_ms": 1.0}], {names[0]: {"cf_bf16": [1.0]}}))
    monkeypatch.setattr(fp8, "plot", lambda doc, path: None)
    assert fp8.main(["--out", str(tmp_path), "--commit", "new", "--shapes", "", "--seqs", "", "--training", "mlp"]) == 0
    doc = json.loads((tmp_path / "fp8.json").read_text())
    assert doc["scaled_mm"] == [{"M": 1}] and doc["runs"]["scaled_mm"] == {"commit": "old", "device": "A"}
    assert doc["runs"]["training:mlp"] == {"commit": "new", "device": "B"} and doc["commit"] == "new"
    assert sorted((r["name"], r.get("fp8_ms")) for r in doc["training"]) == [("blk", None), ("mlp", 1.0)]


def test_dynamic_shapes_pyprofiles_a_first_call_at_a_size_no_other_pass_met(monkeypatch):
    sweep = dynamic_shapes.draw_sizes(10)
    s = dynamic_shapes._pyprofiled_size(sweep)
    assert s not in sweep and s not in dynamic_shapes.draw_sizes(dynamic_shapes.PROFILED_SIZES, 1, sweep)
    assert s == dynamic_shapes._pyprofiled_size(sweep)  # every variant profiles the same size
    monkeypatch.setattr(dynamic_shapes.torch.cuda, "synchronize", lambda: None)
    lin = torch.nn.Linear(8, 16)
    got = dynamic_shapes.pyprofile_first(lin, lambda n: torch.randn(1, n, 8), s, limit=5)
    assert got["seq"] == s and got["wall_ms"] > 0 and len(got["by_self"]) == len(got["by_cum"]) == 5
    assert any("forward" in r["function"] for r in got["by_cum"])  # the module's own frames are named
    assert got["by_cum"][0]["cum_ms"] >= got["by_cum"][-1]["cum_ms"] and all(r["calls"] >= 1 for r in got["by_self"])


def test_profiled_ops_splits_kernels_from_host_ops_per_call_most_first():
    from types import SimpleNamespace as NS

    from bench.common import profiled_ops

    def ev(key, dev, cpu, count, kind):
        return NS(key=key, self_device_time_total=dev, self_cpu_time_total=cpu, count=count,
                  device_type=NS(name=kind))
    prof = NS(key_averages=lambda: [ev("gemm", 40.0, 0, 4, "CUDA"), ev("aten::mm", 0, 8.0, 4, "CPU"),
                                    ev("gelu", 80.0, 0, 2, "CUDA"), ev("aten::empty", 0, 0, 2, "CPU"),
                                    ev("aten::gelu", 0, 12.0, 2, "CPU")])
    kernels, host = profiled_ops(prof, steps=2, width=3)
    assert kernels == [{"kernel": "gel", "us": 40.0, "calls": 1}, {"kernel": "gem", "us": 20.0, "calls": 2}]
    assert host == [{"op": "ate", "us": 6.0, "calls": 1}, {"op": "ate", "us": 4.0, "calls": 2}]  # no time: left out


def test_dynamic_shapes_pyprofiles_a_stand_ins_later_call_with_its_plan_lookups(monkeypatch):
    import cudnn_fuse as cf

    sweep = dynamic_shapes.draw_sizes(10)
    s = dynamic_shapes._pyprofiled_size(sweep, 3)
    assert s not in sweep and s != dynamic_shapes._pyprofiled_size(sweep)
    assert s not in dynamic_shapes.draw_sizes(dynamic_shapes.PROFILED_SIZES, 1, sweep)
    monkeypatch.setattr(dynamic_shapes.torch.cuda, "synchronize", lambda: None)
    calls = []
    lookups = iter(range(100))

    def fn(x):
        calls.append(x.shape[1])
        return x

    monkeypatch.setattr(cf, "plan_stats", lambda: {"hits": 3 * next(lookups), "misses": 0, "swaps": 0})
    got = dynamic_shapes.pyprofile_standin(fn, lambda n: torch.zeros(1, n, 2), s)
    assert calls == [s] * dynamic_shapes.STANDIN_PROFILED_CALL  # the profiled call is the last of them
    assert got["call"] == dynamic_shapes.STANDIN_PROFILED_CALL and got["seq"] == s
    assert (got["hits"], got["misses"], got["swaps"]) == (3, 0, 0) and got["by_self"]
    assert got["steady_ms_build_process"] == {}  # no build process here to stop


def test_dynamic_shapes_times_beside_a_running_and_a_stopped_build_process(monkeypatch):
    import signal
    import subprocess
    import sys
    import types

    from cudnn_fuse import build_process

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        monkeypatch.setattr(build_process, "default", lambda: types.SimpleNamespace(_proc=proc))
        states = []

        def timed():  # what the process is doing while each timing runs
            with open(f"/proc/{proc.pid}/stat") as f:
                states.append(f.read().split(")")[-1].split()[0])
            return float(len(states))
        got = dynamic_shapes._beside_build_process(timed)
        assert got == {"running": 1.0, "stopped": 2.0, "running_again": 3.0}
        assert states[0] in "RS" and states[1] == "T" and states[2] in "RS"
        assert proc.poll() is None  # continued, not left stopped or killed
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_dynamic_shapes_merges_the_rows_of_the_same_run_and_replaces_another_runs(tmp_path):
    run = {"gpu": "G", "commit": "abc", "torch": "2", "cudnn": 91900, "cpus": [4, 5, 6, 7]}
    path = tmp_path / "dynamic_shapes.json"
    assert dynamic_shapes.merged_with(str(path), {**run, "models": []})["models"] == []  # no file yet
    path.write_text(json.dumps({**run, "models": [{"name": "gpt2", "x": 1}, {"bad": 1}]}))
    assert dynamic_shapes.merged_with(str(path), {**run, "models": []})["models"] == [{"name": "gpt2", "x": 1}]
    for key, other in (("commit", "def"), ("gpu", "H"), ("cpus", None)):
        assert dynamic_shapes.merged_with(str(path), {**run, key: other, "models": []})["models"] == []
    path.write_text("{not json")
    assert dynamic_shapes.merged_with(str(path), {**run, "models": []})["models"] == []


def test_dynamic_shapes_static_process_calls_as_many_sweep_up_passes_as_the_cf_one_made(monkeypatch):
    import types

    cmds = []
    static_ms = iter([0.8, 1.4, 1.0])  # three static processes, each its own steady time

    def run(cmd, **kwargs):
        cmds.append(cmd)
        if "--child" in cmd:
            variant, out = cmd[cmd.index("--child") + 2], cmd[cmd.index("--child") + 4]
            steady = [{"seq": 8, "steady_ms": 1.0, "hits_per_call": 0.0}]
            res = {"per_size": [{**steady[0], "steady_ms": next(static_ms)}]} if variant == "static" else {
                "first_call_extra_ms_median": 1.0, "first_call_extra_ms_p95": 2.0,
                "per_size": [{"seq": 8, "steady_ms": 2.0}], "reloaded": {"per_size": [{"seq": 8, "steady_ms": 0.9}]},
                "settled": {"sweep_up_passes": 5, "standins_left": 0, "per_size": steady}}
            with open(out, "w") as f:
                json.dump(res, f)
        return types.SimpleNamespace(returncode=0, stderr="")

    monkeypatch.setattr(dynamic_shapes.subprocess, "run", run)
    row = dynamic_shapes.run_model("gpt2", [8], 10.0, variants=("cf", "static"), static_runs=3)
    children = [c for c in cmds if "--child" in c]
    assert [c[c.index("--child") + 2] for c in children] == ["cf", "static", "static", "static"]
    assert children[0][-1] == "0" and all(c[-1] == "5" for c in children[1:])  # static: the passes cf made
    assert row["swapped_all"] is True and row["steady_vs_static"] == 1.0  # the median of the three processes
    assert row["static"]["process_steady_median_ms"] == [0.8, 1.4, 1.0] and row["static_process_spread"] == 1.75
    assert row["steady_vs_reloaded"] == 0.9


def test_dynamic_shapes_reloads_every_plan_in_cfs_own_process_and_calls_it_as_the_static_one(monkeypatch):
    from cudnn_fuse import loader

    order = []
    monkeypatch.setattr(loader, "clear", lambda: order.append("clear"))
    monkeypatch.setattr(loader.STATS, "standins", 7)  # cf's own, before the reload
    monkeypatch.setattr(dynamic_shapes.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(dynamic_shapes, "synced_ms", lambda fn, reps: [fn() for _ in range(reps)] and 0.5)
    got = dynamic_shapes.reloaded_steady(order.append, lambda s: s, [3], 2)
    assert order[0] == "clear" and order.count(3) == got["calls_before_steady"] + 1 + dynamic_shapes.STEADY_REPS
    assert got["calls_before_steady"] == 1 + dynamic_shapes.LATER_CALLS + dynamic_shapes.STEADY_REPS + \
        dynamic_shapes.SWAP_CALLS + 4 * 2
    assert got["standins"] == 0 and got["per_size"][0]["steady_ms"] == 0.5


def test_dynamic_shapes_static_processes_combine_per_size_and_a_failed_one_is_counted():
    runs = [{"per_size": [{"seq": 1, "steady_ms": 1.0}, {"seq": 2, "steady_ms": 4.0}], "standins": 0},
            {"error": "timed out after 600 s"},
            {"per_size": [{"seq": 1, "steady_ms": 3.0}, {"seq": 2, "steady_ms": 2.0}], "standins": 0}]
    got = dynamic_shapes.combined_static(runs)
    assert [(r["seq"], r["steady_ms"]) for r in got["per_size"]] == [(1, 2.0), (2, 3.0)]
    assert got["process_steady_median_ms"] == [2.5, 2.5] and got["processes"] == 2 and got["failed_processes"] == 1
    assert dynamic_shapes.combined_static([{"error": "x"}, {"error": "y"}]) == {"error": "x"}
