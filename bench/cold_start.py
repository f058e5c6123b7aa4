"""Cold start: time to the first result of 32 distinct graphs (bench/workloads.py), each process
fresh: with an empty plan cache (heuristic plans), with an empty cache and autotuning, with the
cache the autotuned process filled (warm), and torch eager running the same computations.
Writes cold_start.json.

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
    """One fresh process: every graph once, timing each first call, then the same call again."""
    sys.path.insert(0, ROOT)
    import torch

    import cudnn_fuse as cf
    from bench.workloads import cold_start_graphs
    from cudnn_fuse import handles
    from cudnn_fuse.cache import open_default_cache

    eager = os.environ.get("COLD_START_EAGER") == "1"
    graphs = cold_start_graphs(eager=eager)  # inputs made before timing
    t0 = time.perf_counter()
    handles.handle_for(0)  # cuDNN library load + handle: process start-up, not per-graph cost
    open_default_cache()  # environment fingerprint + opening the cache: once per process
    if eager:  # torch's cuBLAS handle and workspace, its own process start-up (one tiny float32 product)
        torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
    torch.cuda.synchronize()
    setup_ms = 1e3 * (time.perf_counter() - t0)
    per, parts = {}, {}
    for name, fn in graphs:
        before = cf.plan_stats()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        torch.cuda.synchronize()
        per[name] = 1e3 * (time.perf_counter() - t0)
        cpu_ms = 1e3 * (time.process_time() - c0)  # every thread's CPU time: work, not waiting
        after = cf.plan_stats()
        t0 = time.perf_counter()
        fn()  # the same call again: plan in memory, kernels loaded
        torch.cuda.synchronize()
        again = 1e3 * (time.perf_counter() - t0)
        parts[name] = {k: round(1e3 * (after.get(k + "_seconds", 0.0) - before.get(k + "_seconds", 0.0)), 3)
                       for k in ("build", "load", "cache_get", "deserialize", "autotune")}
        parts[name]["second_call"] = round(again, 3)
        parts[name]["cpu"] = round(cpu_ms, 3)
    print(json.dumps({"per_graph_ms": per, "parts_ms": parts, "stats": cf.plan_stats(), "setup_ms": setup_ms}))


def run_child(cache_dir: str, autotune: bool, budget_s: float, eager: bool = False) -> dict:
    env = dict(os.environ, COLD_START_EAGER="1" if eager else "0", CUDNN_FUSE_CACHE_DIR=cache_dir,
               CUDNN_FUSE_AUTOTUNE="1" if autotune else "0", CUDNN_FUSE_TUNE_BUDGET_S=str(budget_s),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"], env=env, capture_output=True, text=True,
                       timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"child failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--budget-s", type=float, default=1.0, help="autotune budget per graph")
    ap.add_argument("--no-eager", action="store_true", help="leave out the torch eager process")
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
        eager = None if args.no_eager else run_child(heur_dir, autotune=False, budget_s=args.budget_s, eager=True)
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
    }
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
