"""New sizes of known shape families: what a block pays the first time it meets a sequence length.

A GPT-2-style and a Llama-style decoder block (plans/make_manifests.py's, bf16 inference) are called at
``--sizes`` sequence lengths drawn from 1-2048, each new to the process. For cf the plan cache first
holds the block's shipped manifest (its families, pre-warmed at 128, 512, 1024 and 2048) and none of
the drawn sizes, and the sweep runs in a fresh process. Per size: the first call's time minus the
steady-state time at that size (``extra``), for cf, torch eager and ``torch.compile(dynamic=True)``
(whose compile and recompiles are counted). For cf, once the build process has stored every plan asked of
it: per size the calls that swap them in (the slowest counts) and the steady time on them, against fresh
processes running those stored plans from their first call (``steady_vs_static``; ``--static-runs`` of them,
each size's median, with their spread ``static_process_spread``) and against the same plans dropped and
reloaded in cf's own process (``steady_vs_reloaded``), with the way their steady
calls went (``steady_paths``: plan lookups, launch-graph replays and captures a call) and a cProfile of one
(``steady_pyprofile``). For cf and for
eager with torch's SDPA off its cuDNN backend, a torch.profiler record of the first call at two more new
sizes (``first_call_profile``) and a cProfile of it at one more (``first_call_pyprofile``: Python's share).
Every process of a run is pinned to the same cores (``--cpus``). Writes dynamic_shapes.json (commit, GPU,
cuDNN, cores) and a plot:

    python3 bench/dynamic_shapes.py --out bench/results --sizes 200
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.common import checkout_commit, device_name, profiled_ops, synced_ms, write_json  # noqa: E402

MODELS = {  # name: (block class in plans/make_manifests.py, shipped manifest, batch, width)
    "gpt2": ("GPT2Block", "gpt2_block_bf16.json", 8, 768),
    "llama": ("LlamaBlock", "llama_block_bf16.json", 1, 2048),
}
MAX_SEQ = 2048
STEADY_REPS = 5
LATER_CALLS = 6  # calls after the first, timed one by one: cf's stand-ins swap their plans in among them
SWAP_CALLS = 16  # calls timed one by one once the build process has answered: the paced swaps fall in them
SWEEP_UP_S = 60.0  # passes over every size after those while stand-ins are left, for at most this long,
STALLED_PASSES = 3  # or until this many passes in a row swapped nothing
PROFILED_SIZES = 2  # new sizes whose first call is profiled after the sweep (cf, and eager's floor)
# eager_no_cudnn_sdpa: eager with torch's SDPA off its cuDNN backend (which builds a graph per shape), the
# kernels cf's stand-ins run: what a new size costs torch itself (allocator, cuBLAS), cf's floor.
# static: cf in a fresh process on the plans the cf variant's build process stored, every size's own
# (so it runs after cf, on its plan cache): what the swapped-in steady state is measured against
VARIANTS = ("cf", "static", "eager", "eager_no_cudnn_sdpa", "compile_dynamic")
# The cores every process of a run is pinned to by default: a host-bound block's steady time varied by about
# +-30% from one unpinned process to the next (docs/dynamic_shapes.md), so the processes compared share cores.
DEFAULT_CPUS = (4, 5, 6, 7)


def draw_sizes(n: int, seed: int = 0, exclude=()) -> list:
    """``n`` distinct sequence lengths in 1..MAX_SEQ, none a manifest's own (128, 512, 1024, 2048) nor one
    of ``exclude``."""
    rng = random.Random(seed)
    skip = {128, 512, 1024, 2048, *exclude}
    pool = [s for s in range(1, MAX_SEQ + 1) if s not in skip]
    return rng.sample(pool, min(n, len(pool)))


def sweep(fn, make, sizes) -> dict:
    """Per size: the first call's ms, the next LATER_CALLS calls' (where cf swaps a stand-in for its plan),
    the steady ms after them (median of STEADY_REPS synced calls), and the first's and the worst later
    call's excess over steady."""
    rows = []
    for s in sizes:
        x = make(s)
        torch.cuda.synchronize()  # nothing of the size before in flight
        with torch.no_grad():
            first = synced_ms(lambda: fn(x), 1)
            later = [synced_ms(lambda: fn(x), 1) for _ in range(LATER_CALLS)]
            steady = synced_ms(lambda: fn(x), STEADY_REPS)
        rows.append({"seq": s, "first_ms": round(first, 3), "later_ms": [round(t, 3) for t in later],
                     "steady_ms": round(steady, 4), "extra_ms": round(first - steady, 3),
                     "later_extra_ms": round(max(later) - steady, 3)})
    out = {"per_size": rows}
    for key, stem in (("extra_ms", "first_call_extra_ms"), ("later_extra_ms", "later_call_extra_ms")):
        vals = sorted(r[key] for r in rows)
        out[f"{stem}_median"] = round(statistics.median(vals), 3)
        out[f"{stem}_p95"] = round(vals[min(len(vals) - 1, int(0.95 * len(vals)))], 3)
    return out


def _path_counters() -> dict:
    """plan_stats() with the C memo's counters (launches it replayed itself or handed to the plan, hits
    through a guard or the exact key) where the C path is built."""
    import cudnn_fuse as cf

    out = dict(cf.plan_stats())
    try:
        from cudnn_fuse import _native

        out.update(_native.stats())
    except ImportError:
        pass
    return out


PATH_COUNTERS = ("hits", "graph_replays", "graph_captures", "native_replays", "native_plan_launches",
                 "guarded_hits", "keyed_hits")


def steady_paths(fn, x) -> dict:
    """The steady ms of ``fn(x)`` (median of STEADY_REPS synced calls) and, per call, the plan lookups it
    made (the ops' memo and C path make none), the launch-graph replays and captures it ran and the C
    memo's launches and hits: which way the steady calls went, where two processes running the same plans
    differ in time."""
    before = _path_counters()
    ms = synced_ms(lambda: fn(x), STEADY_REPS)
    after = _path_counters()
    return {"steady_ms": round(ms, 4), **{f"{k}_per_call": round((after[k] - before[k]) / STEADY_REPS, 2)
                                           for k in PATH_COUNTERS if k in after}}


PROBED_SIZES = 24  # sizes whose steady ms the probes below take again, each after one change to the process


def steady_probes(fn, make, sizes, build_process: bool) -> dict:
    """The median steady ms over ``sizes`` as the process is, then again after each change, one after the
    other: the build process closed (its threads and its CUDA context gone), the caching allocator emptied,
    the Python heap collected and frozen. Which state of the process its steady calls pay for."""
    import gc

    from cudnn_fuse import build_process as bpm

    def median_ms():
        out = []
        with torch.no_grad():
            for s in sizes:
                x = make(s)
                for _ in range(3):  # new pointer sets seen enough times to be captured
                    fn(x)
                out.append(synced_ms(lambda: fn(x), STEADY_REPS))
        return round(statistics.median(out), 4)

    res = {"as_is": median_ms(), "python_objects": len(gc.get_objects())}
    if build_process and bpm.default() is not None:
        bpm.default().close()
        res["build_process_closed"] = median_ms()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    res["allocator_emptied"] = median_ms()
    gc.collect()
    gc.freeze()
    res["gc_frozen"] = median_ms()
    return res


def _standins_left() -> int:
    import cudnn_fuse as cf

    stats = cf.plan_stats()
    return stats["standins"] - stats["swaps"]


def settled(fn, make, sizes, wait_s: float = 300.0, also=()) -> dict:
    """cf after the sweep: once the build process has answered every request (waited for, up to ``wait_s``),
    per size the calls that swap its plans in (paced: one load a call at most, ``SWAP_CALLS`` calls timed
    one by one), the slowest of them and the swaps they made. A load that takes long paces the next ones
    out past later sizes' calls, and a pass over every size swaps at most about one plan of each size (its
    calls follow one another within a load's time), so every size is then called again, pass after pass,
    until no stand-in is left (``standins_left``: those still serving; at most SWEEP_UP_S, and no longer
    than STALLED_PASSES passes that swap nothing); then each size's steady ms. ``also``: sizes
    the process met outside the sweep (a profiled call), swept up with the others so that their stand-ins
    are not counted as left."""
    from cudnn_fuse import build_process

    bp = build_process.default()
    t0 = time.perf_counter()
    answered = bp.wait(wait_s) if bp is not None else True
    out = {"build_process": bp is not None and bp.off is None, "all_answered": answered,
           "wait_s": round(time.perf_counter() - t0, 2), "per_size": []}
    import cudnn_fuse as cf

    with torch.no_grad():
        for s in sizes:
            x = make(s)
            torch.cuda.synchronize()
            swaps = cf.plan_stats()["swaps"]
            calls = [synced_ms(lambda: fn(x), 1) for _ in range(SWAP_CALLS)]
            out["per_size"].append({"seq": s, "swap_calls_ms": [round(c, 3) for c in calls],
                                    "swaps": cf.plan_stats()["swaps"] - swaps, "swap_ms": round(max(calls), 3)})
        out["standins_after_swap_calls"] = _standins_left()
        passes = stalled = 0
        deadline = time.perf_counter() + SWEEP_UP_S
        while _standins_left() > 0 and stalled < STALLED_PASSES and time.perf_counter() < deadline:
            passes += 1
            swaps = cf.plan_stats()["swaps"]
            for s in [*sizes, *also]:
                x = make(s)
                for _ in range(4):
                    fn(x)
            torch.cuda.synchronize()
            stalled = 0 if cf.plan_stats()["swaps"] > swaps else stalled + 1
        out["sweep_up_passes"], out["standins_left"] = passes, _standins_left()
        for row in out["per_size"]:
            x = make(row["seq"])
            fn(x)
            row.update(steady_paths(fn, x))
            row["swap_extra_ms"] = round(row["swap_ms"] - row["steady_ms"], 3)
    vals = sorted(r["swap_extra_ms"] for r in out["per_size"])
    out["swap_call_extra_ms_median"] = round(statistics.median(vals), 3)
    out["swap_call_extra_ms_p95"] = round(vals[min(len(vals) - 1, int(0.95 * len(vals)))], 3)
    return out


def static_steady(fn, make, sizes, sweep_up_passes: int) -> dict:
    """cf in a fresh process whose plan cache holds every size's own plan (stored by the cf variant's
    build process): per size the steady ms of those static plans, loaded on the first calls, with no
    stand-in between (``standins``: any that served all the same). Each size is called as often and in the
    same order as the cf variant calls it before its settled steady time (the sweep, the swap calls, its
    ``sweep_up_passes``), so that both compare one state of the launch graphs and the allocator."""
    import cudnn_fuse as cf

    passes = [1 + LATER_CALLS + STEADY_REPS, SWAP_CALLS] + [4] * sweep_up_passes
    with torch.no_grad():
        for calls in passes:
            for s in sizes:
                x = make(s)
                for _ in range(calls):
                    fn(x)
            torch.cuda.synchronize()
        rows = []
        for s in sizes:
            x = make(s)
            fn(x)
            rows.append({"seq": s, **steady_paths(fn, x)})
    return {"per_size": rows, "standins": cf.plan_stats()["standins"],
            "calls_before_steady": sum(passes), "plan_stats": cf.plan_stats()}


def reloaded_steady(fn, make, sizes, sweep_up_passes: int) -> dict:
    """cf's own process once its steady times are taken: every plan dropped (the ops' memo, the plan LRU and
    their launch graphs) and loaded again from the plan cache, each size called as the static process calls
    it (``static_steady``): the static plans' steady ms in the process cf was timed in, free of the spread
    between fresh processes (``standins``: any that served all the same, none expected)."""
    import cudnn_fuse as cf
    from cudnn_fuse import loader

    torch.cuda.synchronize()
    loader.clear()
    before = cf.plan_stats()["standins"]
    out = static_steady(fn, make, sizes, sweep_up_passes)
    out["standins"] = out["standins"] - before
    return out


def profile_first(fn, make, sizes: list, seen: int, limit: int = 12) -> list:
    """torch.profiler over the first call at each of ``sizes`` (new to the process): per size its wall ms
    (the profiler's overhead included), the host ops taking most self time and the kernels taking most
    device time. Where a new size's first call goes, which the sweep's times do not say. ``seen``: a size
    called before, for the profiler's own first start."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts), torch.no_grad():  # the profiler's own first start, off the record
        fn(make(seen))
    out = []
    for s in sizes:
        x = make(s)
        torch.cuda.synchronize()
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            with torch.no_grad():
                fn(x)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
        dev, host = profiled_ops(prof, width=100)
        out.append({"seq": s, "wall_ms": round(wall, 3), "host_ops": host[:limit], "kernels": dev[:limit]})
    return out


def _pyprofiled_size(sizes: list, seed: int = 2) -> int:
    """One more new size, met by neither the sweep nor ``profile_first`` (nor, for another ``seed``, by the
    first call ``pyprofile_first`` profiles): the same for every variant."""
    met = sizes + draw_sizes(PROFILED_SIZES, 1, sizes)
    return draw_sizes(1, seed, met if seed == 2 else met + [_pyprofiled_size(sizes)])[0]


STANDIN_PROFILED_CALL = 5  # a stand-in's call past the one that asks the build process for its plan


def pyprofile_standin(fn, make, size: int) -> dict:
    """``pyprofile_first`` over call STANDIN_PROFILED_CALL at a new ``size``, with the plan lookups that call
    made (``plan_stats`` deltas: a stand-in the ops' memo serves makes none). Taken while the build process is
    still answering the sweep's requests, in order, so that this size's plans are still being built."""
    import cudnn_fuse as cf

    x = make(size)
    with torch.no_grad():
        for _ in range(STANDIN_PROFILED_CALL - 1):
            fn(x)
    before = cf.plan_stats()
    out = pyprofile_first(fn, lambda _s: x, size)
    after = cf.plan_stats()
    out.update({"call": STANDIN_PROFILED_CALL, **{k: after[k] - before[k] for k in ("hits", "misses", "swaps")}})
    out["steady_ms_build_process"] = _beside_build_process(lambda: synced_ms(lambda: fn(x), STEADY_REPS))
    return out


def _beside_build_process(timed) -> dict:
    """``timed()`` while the build process runs and while it is stopped (SIGSTOP, then SIGCONT): whether a
    stand-in's calls wait for the GPU behind the plans the build process is building and timing, a second
    CUDA context the GPU time-slices with this one. Empty where there is no build process to stop."""
    import signal

    from cudnn_fuse import build_process

    proc = getattr(build_process.default(), "_proc", None)
    if proc is None or proc.poll() is not None or not hasattr(signal, "SIGSTOP"):
        return {}
    with torch.no_grad():
        running = timed()
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            _await_state(proc.pid, stopped=True)
            time.sleep(0.05)  # what it had queued on the GPU drains
            stopped = timed()
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        _await_state(proc.pid, stopped=False)
        time.sleep(0.05)  # the continued process is scheduled again before the timing
        again = timed()
    return {"running": round(running, 4), "stopped": round(stopped, 4), "running_again": round(again, 4)}


def _await_state(pid: int, stopped: bool, limit_s: float = 2.0) -> None:
    """Wait until the signal just sent has taken effect (Linux's /proc says the process is stopped, or no
    longer), at most ``limit_s``; where /proc cannot say, return at once."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            return
        if (state in "Tt") == stopped:
            return
        time.sleep(0.005)


def pyprofile_first(fn, make, size: int, limit: int = 15) -> dict:
    """cProfile over one call at ``size`` (its first, where the size is new to the process): its wall ms under
    the profiler and the Python functions taking most time, by their own time and with what they call. Where
    a call spends its host time in Python, which torch.profiler's host ops do not show."""
    import cProfile
    import io
    import pstats

    x = make(size)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    with torch.no_grad():
        prof.runcall(fn, x)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = [{"function": f"{os.path.basename(path)}:{line}({func})", "calls": nc, "self_ms": round(tt * 1e3, 3),
             "cum_ms": round(ct * 1e3, 3)} for (path, line, func), (_cc, nc, tt, ct, _) in stats.stats.items()]
    return {"seq": size, "wall_ms": round(wall, 3),
            "by_self": sorted(rows, key=lambda r: -r["self_ms"])[:limit],
            "by_cum": sorted(rows, key=lambda r: -r["cum_ms"])[:limit]}


def child(name: str, variant: str, sizes: list, out: str, sweep_up_passes: int = 0) -> None:
    """One variant's sweep in this (fresh) process; writes its result as JSON to ``out``. ``sweep_up_passes``:
    the cf variant's, which the static one calls as often."""
    sys.path.insert(0, os.path.join(ROOT, "plans"))
    import make_manifests

    import cudnn_fuse as cf

    cls, _manifest, batch, width = MODELS[name]
    torch.manual_seed(0)
    model = getattr(make_manifests, cls)().cuda().to(torch.bfloat16).eval()

    def make(s):
        return torch.randn(batch, s, width, device="cuda", dtype=torch.bfloat16)

    res = {}
    if variant == "cf":
        fn = cf.optimize(model)
        res.update(sweep(fn, make, sizes))
        # a stand-in's later call while the build process is still busy with the sweep's requests (it answers
        # them in order): what a call served by torch's kernels costs over eager's, where the steady times
        # say it does
        standin_size = _pyprofiled_size(sizes, 3)
        res["standin_call_pyprofile"] = pyprofile_standin(fn, make, standin_size)
        res["settled"] = settled(fn, make, sizes, also=[standin_size])
        res["steady_pyprofile"] = pyprofile_first(fn, make, sizes[1])  # one settled call, as the static one
        res["plan_stats"] = {k: v for k, v in cf.plan_stats().items() if isinstance(v, (int, float))}
        res["first_call_profile"] = profile_first(fn, make, draw_sizes(PROFILED_SIZES, 1, sizes), sizes[0])
        res["first_call_pyprofile"] = pyprofile_first(fn, make, _pyprofiled_size(sizes))
        res["reloaded"] = reloaded_steady(fn, make, sizes, res["settled"]["sweep_up_passes"])
        res["steady_probes"] = steady_probes(fn, make, sizes[:PROBED_SIZES], build_process=True)  # last: it changes the process
    elif variant == "static":
        fn = cf.optimize(model)
        res.update(static_steady(fn, make, sizes, sweep_up_passes))
        res["steady_pyprofile"] = pyprofile_first(fn, make, sizes[1])  # where its host time goes, against cf's
        res["steady_probes"] = steady_probes(fn, make, sizes[:PROBED_SIZES], build_process=False)
    elif variant == "eager":
        res.update(sweep(model, make, sizes))
    elif variant == "eager_no_cudnn_sdpa":  # torch's floor for a new size: its SDPA kept off the cuDNN backend
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            res.update(sweep(model, make, sizes))
            res["first_call_profile"] = profile_first(model, make, draw_sizes(PROFILED_SIZES, 1, sizes), sizes[0])
            res["first_call_pyprofile"] = pyprofile_first(model, make, _pyprofiled_size(sizes))
    else:
        from torch._dynamo.utils import counters

        fn = torch.compile(model, dynamic=True)
        res.update(sweep(fn, make, sizes))
        res["graphs_compiled"] = counters["stats"]["unique_graphs"]
        firsts = [r["first_ms"] for r in res["per_size"]]
        res["compile_s"] = round(firsts[0] / 1e3, 2)
    with open(out, "w") as f:
        json.dump(res, f)


def steady_vs_static(settled_: dict, static: dict):
    """Median over the sizes of the static plans' steady ms (a fresh process on every size's own plan) over
    cf's once its stand-ins have swapped; None where either is missing."""
    ours = {r["seq"]: r.get("steady_ms") for r in settled_.get("per_size", [])}
    ratios = [r["steady_ms"] / ours[r["seq"]] for r in static.get("per_size", [])
              if ours.get(r["seq"]) and r.get("steady_ms")]
    return round(statistics.median(ratios), 4) if ratios else None


def pinned_cpus(spec: str, allowed) -> tuple:
    """The cores ``--cpus`` names (``4-7``, ``0,2,4``, ``none``; ``auto``: DEFAULT_CPUS where all of them
    are ``allowed``, else none), checked against ``allowed``; ValueError naming the argument otherwise."""
    if spec == "none" or (spec == "auto" and not set(DEFAULT_CPUS) <= set(allowed)):
        return ()
    if spec == "auto":
        return DEFAULT_CPUS
    cpus = set()
    try:
        for part in spec.split(","):
            lo, dash, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi if dash else lo) + 1))
    except ValueError:
        raise ValueError(f"--cpus: expected a list such as 4-7 or 0,2, got {spec!r}") from None
    missing = sorted(cpus - set(allowed))
    if not cpus or missing:
        raise ValueError(f"--cpus: {spec!r} names cores this process may not run on ({missing or 'none named'}); "
                         f"allowed: {sorted(allowed)}")
    return tuple(sorted(cpus))


RUN_KEYS = ("gpu", "commit", "torch", "cudnn", "cpus")  # what must match for rows of two runs to share a file


def merged_with(path: str, doc: dict) -> dict:
    """``doc`` holding the model rows of the dynamic_shapes.json at ``path`` where that file is of the same
    run (RUN_KEYS: commit, GPU, versions, cores), so that the blocks can run in separate calls and share one
    file; ``doc`` as it is otherwise (an older run's file is replaced)."""
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return doc
    if not isinstance(old, dict) or any(old.get(k) != doc.get(k) for k in RUN_KEYS):
        return doc
    rows = [m for m in old.get("models", []) if isinstance(m, dict) and "name" in m]
    return {**doc, "models": rows}


def _child_run(name: str, variant: str, sizes: list, out: str, env: dict, timeout: float, passes: int) -> dict:
    """One variant's process (``child``): its result, or {"error": why}."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, variant, json.dumps(sizes), out, str(passes)]
    try:
        done = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    if done.returncode != 0:
        return {"error": done.stderr[-500:]}
    with open(out) as f:
        return json.load(f)


def combined_static(runs: list) -> dict:
    """Several static processes as one: the first's result with each size's steady ms the median over the
    processes, and each process's median over the sizes (``process_steady_median_ms``): how far a fresh
    process's steady time moves from one process to the next, which one cf process is compared within."""
    ok = [r for r in runs if "error" not in r and r.get("per_size")]
    if not ok:
        return runs[0]
    by_seq = {}
    for r in ok:
        for row in r["per_size"]:
            by_seq.setdefault(row["seq"], []).append(row["steady_ms"])
    out = dict(ok[0])
    out["per_size"] = [{**row, "steady_ms": round(statistics.median(by_seq[row["seq"]]), 4)}
                       for row in ok[0]["per_size"]]
    out["process_steady_median_ms"] = [round(statistics.median(x["steady_ms"] for x in r["per_size"]), 4) for r in ok]
    out["processes"], out["failed_processes"] = len(ok), len(runs) - len(ok)
    return out


def run_model(name: str, sizes: list, timeout: float, variants=VARIANTS, static_runs: int = 1) -> dict:
    from cudnn_fuse import loader

    row = {"name": name, "sizes": len(sizes), "batch": MODELS[name][2], "width": MODELS[name][3]}
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, CUDNN_FUSE_CACHE_DIR=os.path.join(tmp, "cache"))
        manifest = os.path.join(ROOT, "plans", MODELS[name][1])
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "cudnn_fuse", "prewarm", manifest], env=env, check=False,
                       stdout=subprocess.DEVNULL, timeout=timeout)
        row["prewarm_s"] = round(time.perf_counter() - t0, 2)
        for variant in variants:
            passes = (row.get("cf", {}).get("settled") or {}).get("sweep_up_passes", 0)
            runs = [_child_run(name, variant, sizes, os.path.join(tmp, f"{variant}.json"), env, timeout, passes)
                    for _ in range(static_runs if variant == "static" else 1)]
            v = row[variant] = runs[0] if len(runs) == 1 else combined_static(runs)
            if "error" in v:
                continue
            if variant == "static":
                print(f"  {name:6s} {variant:16s} steady median "
                      f"{statistics.median(r['steady_ms'] for r in v['per_size']):8.3f} ms  "
                      f"(per process: {v.get('process_steady_median_ms')})", flush=True)
            else:
                print(f"  {name:6s} {variant:16s} extra median {v['first_call_extra_ms_median']:8.2f} ms  "
                      f"p95 {v['first_call_extra_ms_p95']:8.2f} ms", flush=True)
    cf_row = row.get("cf", {})
    for key in ("first_call_extra_ms_median", "first_call_extra_ms_p95"):
        row[key] = cf_row.get(key)
    stats = cf_row.get("plan_stats", {})
    after = cf_row.get("settled") or {}
    row["swapped_all"] = after.get("standins_left") == 0 if "standins_left" in after else None
    row["steady_vs_static"] = steady_vs_static(after, row.get("static", {}))
    # the same plans reloaded in cf's own process: the steady state against static plans with no process between
    row["steady_vs_reloaded"] = steady_vs_static(after, cf_row.get("reloaded", {}))
    procs = row.get("static", {}).get("process_steady_median_ms")
    if procs and min(procs) > 0:  # the static processes' own spread: how far apart two fresh processes read
        row["static_process_spread"] = round(max(procs) / min(procs), 4)
    row["steady_paths"] = {variant: {k: statistics.median(r[k] for r in rows) for k in rows[0] if k.endswith("_per_call")}
                           for variant, rows in (("cf", after.get("per_size")), ("static", row.get("static", {}).get(
                               "per_size"))) if rows and "hits_per_call" in rows[0]}
    row["steady_probes"] = {v: row[v]["steady_probes"] for v in ("cf", "static") if "steady_probes" in row.get(v, {})}
    for key in ("steady_paths", "steady_probes"):
        print(f"  {name:6s} {key}: {json.dumps(row[key])}", flush=True)
    row["later_call_extra_ms_p95"] = cf_row.get("later_call_extra_ms_p95")
    row["swap_call_extra_ms_p95"] = after.get("swap_call_extra_ms_p95")
    row["process_builds"] = stats.get("process_builds")
    if after.get("per_size"):  # torch's kernels standing in, against the size's own plan once swapped in
        during = {r["seq"]: r["steady_ms"] for r in cf_row["per_size"]}
        row["standin_over_static_median"] = round(statistics.median(
            during[r["seq"]] / r["steady_ms"] for r in after["per_size"]), 4)
    row["tiers"] = (f"torch's kernels from a new size's first call; its static plan from the build process, asked "
                    f"on call {loader.BUILD_REQUEST_CALLS + 1} and swapped in once stored (built in the call after "
                    f"the first {loader.STANDIN_CALLS} where there is no build process)")
    return row


def plot(path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.load(open(path))
    fig, axes = plt.subplots(1, len(doc["models"]), figsize=(6 * len(doc["models"]), 4), squeeze=False)
    for ax, row in zip(axes[0], doc["models"]):
        for variant in VARIANTS:
            rows = row.get(variant, {}).get("per_size")
            if rows and "extra_ms" in rows[0]:  # the static variant times steady calls only
                rows = sorted(rows, key=lambda r: r["seq"])
                ax.plot([r["seq"] for r in rows], [max(r["extra_ms"], 1e-3) for r in rows], ".", label=variant)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (new to the process)")
        ax.set_ylabel("first call minus steady (ms)")
        ax.set_title(f"{row['name']} block, batch {row['batch']}")
        ax.legend(fontsize=8)
    fig.suptitle(f"{doc.get('gpu')} ({doc.get('commit')})")
    fig.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=120)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        child(argv[1], argv[2], json.loads(argv[3]), argv[4], int(argv[5]) if len(argv) > 5 else 0)
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results", help="directory of dynamic_shapes.json (model rows of the "
                   "same commit, GPU, versions and cores merged by name)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated among {', '.join(MODELS)}")
    p.add_argument("--sizes", type=int, default=200, help="sequence lengths drawn per model")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated among {', '.join(VARIANTS)} (static runs on the plans cf stored)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per variant's process")
    p.add_argument("--static-runs", type=int, default=3, help="fresh static processes, each size's steady ms the "
                   "median over them (a process's steady time moves from one process to the next)")
    p.add_argument("--cpus", default="auto", help="cores every process of the run is pinned to (4-7, 0,2,4 or "
                   f"none; auto: {DEFAULT_CPUS[0]}-{DEFAULT_CPUS[-1]} where the machine has them)")
    p.add_argument("--commit", default=None, help="the commit to record (default: git's HEAD)")
    p.add_argument("--plot", metavar="JSON", help="only plot an existing dynamic_shapes.json")
    args = p.parse_args(argv)
    bad = [n for n in args.models.split(",") if n not in MODELS]
    if bad:
        p.error(f"--models: unknown {', '.join(bad)} (known: {', '.join(MODELS)})")
    variants = args.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"--variants: unknown {', '.join(bad)} (known: {', '.join(VARIANTS)})")
    if "static" in variants and "cf" not in variants:
        p.error("--variants: static runs on the plans the cf variant stored; name cf too")
    if args.sizes < 1:
        p.error(f"--sizes must be at least 1, got {args.sizes}")
    if args.static_runs < 1:
        p.error(f"--static-runs must be at least 1, got {args.static_runs}")
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    try:
        cpus = pinned_cpus(args.cpus, allowed)
    except ValueError as exc:
        p.error(str(exc))
    if args.plot:
        print(plot(args.plot))
        return 0
    if not torch.cuda.is_available():
        print("dynamic_shapes.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import cudnn

    if cpus:
        os.sched_setaffinity(0, cpus)  # the processes started below inherit it
    doc = {"gpu": device_name(), "commit": args.commit or checkout_commit(), "torch": torch.__version__,
           "cudnn": cudnn.backend_version() if hasattr(cudnn, "backend_version") else None,
           "cpus": list(cpus) or None, "models": []}
    path = os.path.join(args.out, "dynamic_shapes.json")
    doc = merged_with(path, doc)
    sizes = draw_sizes(args.sizes)
    for name in args.models.split(","):
        row = run_model(name, sizes, args.timeout, variants, args.static_runs)
        doc["models"] = [m for m in doc["models"] if m.get("name") != name] + [row]
        os.makedirs(args.out, exist_ok=True)
        write_json(path, doc)
    print(plot(os.path.join(args.out, "dynamic_shapes.json")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
