"""Why host_overhead.py's eager row reads ~2 us more than eager_host_probe.py's whole-call piece.

In one device call (bench/results/host_fastpath_ab/) the probe timed the memoized
``cf.linear(x, w, b, activation="relu")`` at 9.72 us and host_overhead.py at 12.01 us, with torch's
``F.relu(F.linear(x, w, b))`` at 25.4 and 24.8 in both. The two scripts differ in what happens
before the timed loop: host_overhead.py clears the in-memory plans before its eager row (the plan
then comes back from the disk cache, deserialized), holds two ``cf.capture`` graphs, and runs a
GPU-bound 2048^3 linear between rounds. This probe times the same two calls, interleaved, after
each of those steps in turn, in one process, with the plan counters and the plan's engine and
workspace at each stage.

    python3 bench/host_gap_probe.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import cudnn_fuse as cf  # noqa: E402
from bench.common import host_row_calls, host_row_operands, host_us, write_json  # noqa: E402
from cudnn_fuse import ops, plans  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--calls", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    x, w, b = host_row_operands()
    attrs = ("relu", False, 0.01)

    cf_op, torch_op, chain_fn = host_row_calls(x, w, b)

    stages = {}

    def stage(name):
        rows = {"cf": [], "torch": []}
        for _ in range(args.rounds):
            rows["torch"].append(host_us(torch_op, args.calls))
            rows["cf"].append(host_us(cf_op, args.calls))
        _, launch = ops._memo("linear", x, w, b, None, attrs)
        plan = getattr(launch, "plan", None)
        gs = getattr(plan, "_graphs", None)
        med = {k: round(statistics.median(v), 3) for k, v in rows.items()}
        stages[name] = {
            "host_us": med, "ratio": round(med["cf"] / med["torch"], 3),
            "all_rounds_us": {k: [round(t, 3) for t in v] for k, v in rows.items()},
            "memoized": launch is not None, "plan": type(plan).__name__, "engine": getattr(plan, "engine", None),
            "workspace": getattr(plan, "workspace_size", None),
            "entries": sorted({type(e).__name__ for e in gs.execs.values()}) if gs is not None else None,
            "plan_stats": cf.plan_stats(),
        }
        print(name, json.dumps({k: stages[name][k] for k in ("host_us", "ratio", "plan", "engine", "workspace", "entries")}),
              flush=True)

    X = torch.randn(2048, 2048, device="cuda", dtype=torch.float16)
    W = torch.randn(2048, 2048, device="cuda", dtype=torch.float16) * 0.02
    B = torch.randn(2048, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        for _ in range(10):
            cf_op()
        stage("built")  # the plan built in this process, as eager_host_probe.py times it
        plans.clear()
        stage("after_clear")  # the plan back from the disk cache, as host_overhead.py's rows time it
        captured = cf.capture(chain_fn, x)
        single = cf.capture(cf_op)
        stage("with_captures")  # host_overhead.py holds these two for its whole run
        for _ in range(210):
            cf.linear(X, W, B, activation="relu")
        torch.cuda.synchronize()
        stage("after_2048")  # host_overhead.py's device rows run between its host rows
        plans.clear()
        stage("after_second_clear")
        del captured, single
        stage("captures_dropped")
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "calls": args.calls,
           "rounds": args.rounds, "stages": stages}
    write_json(os.path.join(args.out, "host_gap_probe.json"), doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
