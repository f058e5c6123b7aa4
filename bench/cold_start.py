"""Cold start: time to first result of 32 distinct graphs in fresh processes, with
an empty cache (heuristics), an empty cache (autotune), and the warm cache.

    python3 bench/cold_start.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child() -> None:
    """One fresh process: every graph once, timing each first call."""
    sys.path.insert(0, ROOT)
    import torch

    import cudnn_fuse as cf
    from bench.workloads import cold_start_graphs
    from cudnn_fuse import plans

    from cudnn_fuse.cache import open_default_cache

    eager = os.environ.get("COLD_START_EAGER") == "1"
    graphs = cold_start_graphs(eager=eager)  # inputs made before timing
    t0 = time.perf_counter()
    plans.handle_for(0)  # cuDNN library load + handle: process start-up, not per-graph cost
    open_default_cache()  # environment fingerprint + opening the cache: once per process
    if eager:  # torch's cuBLAS handle and workspace, its own process start-up (one tiny float32 product)
        torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
    torch.cuda.synchronize()
    setup_ms = 1e3 * (time.perf_counter() - t0)
    preload = _preload_cudnn_libraries() if os.environ.get("COLD_START_PRELOAD") == "1" else None
    per, parts, slow = {}, {}, {}
    profiling = os.environ.get("COLD_START_PROFILE") == "1"
    for name, fn in graphs:
        before = cf.plan_stats()
        if profiling:  # where a slow first call spends its time (a separate run: cProfile adds its own cost)
            import cProfile
            import io
            import pstats

            prof = cProfile.Profile()
            prof.enable()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        torch.cuda.synchronize()
        per[name] = 1e3 * (time.perf_counter() - t0)
        cpu_ms = 1e3 * (time.process_time() - c0)  # every thread's CPU time: work, not waiting
        if profiling:
            prof.disable()
            if per[name] > 20:
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(6)
                slow[name] = buf.getvalue()[-1500:]
        after = cf.plan_stats()
        t0 = time.perf_counter()
        fn()  # the same call again: plan in memory, kernels loaded
        torch.cuda.synchronize()
        again = 1e3 * (time.perf_counter() - t0)
        parts[name] = {k: round(1e3 * (after[k + "_seconds"] - before[k + "_seconds"]), 3)
                       for k in ("build", "load", "cache_get", "deserialize", "autotune")}
        parts[name]["second_call"] = round(again, 3)
        parts[name]["cpu"] = round(cpu_ms, 3)
    print(json.dumps({"per_graph_ms": per, "parts_ms": parts, "stats": cf.plan_stats(), "setup_ms": setup_ms,
                      "slow_first_calls": slow, "preload_ms": preload}))


def _preload_cudnn_libraries() -> dict:
    """dlopen every cuDNN sub-library beside the loaded libcudnn that is not mapped yet,
    timing each: is a warm process's slow first conv the loading of an engine library?"""
    import ctypes
    import glob

    mapped = {line.split()[-1] for line in open("/proc/self/maps") if "libcudnn" in line}
    dirs = {os.path.dirname(m) for m in mapped}
    out = {}
    for d in sorted(dirs):
        for lib in sorted(glob.glob(os.path.join(d, "libcudnn*.so*"))):
            real = os.path.realpath(lib)
            if real in mapped or lib in mapped or os.path.basename(real) in out:
                continue
            t0 = time.perf_counter()
            try:
                ctypes.CDLL(real, mode=ctypes.RTLD_GLOBAL)
                out[os.path.basename(real)] = round(1e3 * (time.perf_counter() - t0), 2)
            except OSError as exc:
                out[os.path.basename(real)] = str(exc)[:80]
            mapped.add(real)
    out["_already_mapped"] = sorted(os.path.basename(m) for m in mapped)
    return out


def _driver_cache() -> dict:
    """The CUDA driver's compiled-kernel cache (where PTX compiled at load time is kept): its
    directory, files and bytes; a kernel that ships as PTX only is compiled by the driver there."""
    d = os.environ.get("CUDA_CACHE_PATH") or os.path.join(os.path.expanduser("~"), ".nv", "ComputeCache")
    files, size = 0, 0
    for root, _, names in os.walk(d):
        for n in names:
            files += 1
            try:
                size += os.path.getsize(os.path.join(root, n))
            except OSError:
                pass
    return {"dir": d, "files": files, "bytes": size, "disabled": os.environ.get("CUDA_CACHE_DISABLE", "0")}


def run_child(cache_dir: str, autotune: bool, budget_s: float, profile: bool = False, preload: bool = False,
              extra_env: dict | None = None, eager: bool = False) -> dict:
    env = dict(os.environ, **(extra_env or {}), COLD_START_EAGER="1" if eager else "0", COLD_START_PROFILE="1" if profile else "0", COLD_START_PRELOAD="1" if preload else "0", CUDNN_FUSE_CACHE_DIR=cache_dir, CUDNN_FUSE_AUTOTUNE="1" if autotune else "0",
               CUDNN_FUSE_TUNE_BUDGET_S=str(budget_s), PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"], env=env, capture_output=True, text=True,
                       timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"child failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--budget-s", type=float, default=1.0, help="autotune budget per graph")
    ap.add_argument("--profile-slow", action="store_true",
                    help="one more warm process under cProfile: where each first call over 20 ms goes")
    ap.add_argument("--preload-probe", action="store_true",
                    help="one more warm process that first dlopens every cuDNN sub-library (timed)")
    ap.add_argument("--jit-probe", action="store_true",
                    help="one more warm process with the driver's kernel cache off (CUDA_CACHE_DISABLE=1): "
                         "do the slow first calls compile PTX?")
    ap.add_argument("--eager-probe", action="store_true",
                    help="one more fresh process running the same 32 computations as plain PyTorch ops: what torch's "
                         "own first calls cost a process (its cuDNN convs load the same engines)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child()
        return 0
    sys.path.insert(0, ROOT)
    from bench.common import device_name, write_json

    with tempfile.TemporaryDirectory() as heur_dir, tempfile.TemporaryDirectory() as tune_dir:
        heur = run_child(heur_dir, autotune=False, budget_s=args.budget_s)
        tuned = run_child(tune_dir, autotune=True, budget_s=args.budget_s)
        warm = run_child(tune_dir, autotune=True, budget_s=args.budget_s)
        profiled = run_child(tune_dir, autotune=True, budget_s=args.budget_s, profile=True) if args.profile_slow else None
        preloaded = run_child(tune_dir, autotune=True, budget_s=args.budget_s, preload=True) if args.preload_probe else None
        driver_cache = _driver_cache()
        nojit = run_child(tune_dir, autotune=True, budget_s=args.budget_s,
                          extra_env={"CUDA_CACHE_DISABLE": "1"}) if args.jit_probe else None
        eager = run_child(heur_dir, autotune=False, budget_s=args.budget_s, eager=True) if args.eager_probe else None
    n = len(heur["per_graph_ms"])

    def mean(r):
        return round(sum(r["per_graph_ms"].values()) / n, 3)

    def median(r):
        return round(statistics.median(r["per_graph_ms"].values()), 3)

    result = {
        "device": device_name(),
        "graphs": n,
        "cold_heuristic_ms_per_graph": mean(heur),
        "cold_autotune_ms_per_graph": mean(tuned),
        "warm_ms_per_graph": mean(warm),
        "warm_plans_built": warm["stats"]["builds"],
        "warm_plans_loaded": warm["stats"]["loads"],
        "median_ms_per_graph": {"cold_heuristic": median(heur), "cold_autotune": median(tuned), "warm": median(warm)},
        "process_setup_ms": {"cold_heuristic": round(heur["setup_ms"], 1), "cold_autotune": round(tuned["setup_ms"], 1),
                             "warm": round(warm["setup_ms"], 1)},
        "autotune_budget_s_per_graph": args.budget_s,
        "per_graph_ms": {k: {"cold_heuristic": round(heur["per_graph_ms"][k], 2),
                             "cold_autotune": round(tuned["per_graph_ms"][k], 2),
                             "warm": round(warm["per_graph_ms"][k], 3)} for k in heur["per_graph_ms"]},
        "warm_parts_ms": warm["parts_ms"],
        "stats": {"cold_heuristic": heur["stats"], "cold_autotune": tuned["stats"], "warm": warm["stats"]},
        "prefer_precompiled": float(os.environ.get("CUDNN_FUSE_PREFER_PRECOMPILED", "0")),
    }
    if profiled is not None:
        result["warm_profiled_slow_first_calls"] = profiled["slow_first_calls"]
    if preloaded is not None:
        result["warm_after_preload"] = {"preload_ms": preloaded["preload_ms"], "mean_ms_per_graph": mean(preloaded),
                                        "median_ms_per_graph": median(preloaded),
                                        "per_graph_ms": {k: round(v, 3) for k, v in preloaded["per_graph_ms"].items()}}
    result["driver_kernel_cache"] = driver_cache
    if nojit is not None:
        result["warm_driver_cache_off"] = {"mean_ms_per_graph": mean(nojit), "median_ms_per_graph": median(nojit),
                                           "per_graph_ms": {k: round(v, 3) for k, v in nojit["per_graph_ms"].items()},
                                           "cpu_ms": {k: v["cpu"] for k, v in nojit["parts_ms"].items()}}
    if eager is not None:  # torch eager's first calls in a fresh process, after the same process set-up
        result["eager_first_call"] = {"mean_ms_per_graph": mean(eager), "median_ms_per_graph": median(eager),
                                      "process_setup_ms": round(eager["setup_ms"], 1),
                                      "per_graph_ms": {k: round(v, 3) for k, v in eager["per_graph_ms"].items()},
                                      "second_call_ms": {k: v["second_call"] for k, v in eager["parts_ms"].items()},
                                      "cpu_ms": {k: v["cpu"] for k, v in eager["parts_ms"].items()}}
    write_json(os.path.join(args.out, "cold_start.json"), result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("per_graph_ms", "stats")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
