"""Does the autotuner time kernels or the host? A batch-1 linear tuned on a busy host.

The suite's autotuned batch-1 stack (`small_mlp_stack8_linear_gelu_bf16_m1_1024`) ran 0.87-1.65 ms
a call in some runs against ~0.1 ms in others, and in exactly those runs its output equalled
torch's bit for bit: the op ran torch's candidate (torch_engine.TorchPlan) through the validated
path. torch's candidate may win only where the cuDNN winner timed >= autotune.TORCH_MIN_MS
(0.1 ms), far above this GEMV's ~4 us. The autotuner's device_ms queued its timed calls behind a
GPU spin sized for 100 us of host time a call; cuDNN's public execute, which the tuner times,
costs ~85 us on the H200 host, so a host slowed by anything else (torch.compile's workers in the
suite) outran the spin and the events timed its launch cost.

This probe tunes cf.linear(x[1,1024], w[1024,1024], b, activation="gelu") bf16 (gelu1024), each
trial in a fresh plan cache, with 0 or 2 Python threads spinning beside it (they take the GIL from the
tuner), under the spin of commit a8acb28 (fixed: 100 us a call) and under autotune.device_ms now
(measured: the spin checked against the host's enqueue time and lengthened). For each trial: the
engine chosen, the winner's and torch's timed medians (from the autotuner's log) and the call's
device time in a captured graph with no threads running; and the heuristic plan's. relu768:
cf.linear(x[1,768], w[768,768], b, activation="relu") (the suite's small_linear row), measured
spin, no threads.

    python3 bench/tune_timing_probe.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import tempfile
import threading

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import cudnn_fuse as cf  # noqa: E402
from bench.common import replay_us, write_json  # noqa: E402
from cudnn_fuse import autotune, plans  # noqa: E402


def fixed_spin_device_ms(fn, iters: int, host_us_per_call: float = 100.0) -> list:
    """autotune.device_ms as of a8acb28: a spin sized for ``host_us_per_call``, never checked."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    torch.cuda._sleep(int(2e3 * (200 + host_us_per_call * iters)))
    for s, e in events:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


class Hogs:
    """``n`` Python threads spinning until the block ends (they hold the GIL in turns with the tuner)."""

    def __init__(self, n: int):
        self.n, self.stop, self.threads = n, threading.Event(), []

    def __enter__(self):
        def spin():
            while not self.stop.is_set():
                pass
        self.threads = [threading.Thread(target=spin, daemon=True) for _ in range(self.n)]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join()


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def graph_us(fn, reps: int = 20) -> float:
    """Device microseconds of one call: 96 calls captured in one cf.capture graph, replayed."""
    def many():
        for _ in range(96):
            fn()
    return replay_us(cf.capture(many), 96, reps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=3.0)
    ap.add_argument("--ops", default="gelu1024,relu768",
                    help="gelu1024 (every setting), relu768 (measured spin, no threads)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    bf = torch.bfloat16
    lines = Lines()
    logging.getLogger("cudnn_fuse").addHandler(lines)
    logging.getLogger("cudnn_fuse").setLevel(logging.DEBUG)
    measured = autotune.device_ms
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "trials": [], "heuristic": {}}
    old_cfg = autotune.DEFAULT_CONFIG
    autotune.DEFAULT_CONFIG = autotune.Config(budget_s=args.budget_s)
    try:
        for op in args.ops.split(","):
            n, act = (1024, "gelu") if op == "gelu1024" else (768, "relu")
            w = torch.randn(n, n, device="cuda", dtype=bf) / n ** 0.5
            b = torch.randn(n, device="cuda", dtype=bf)
            x = torch.randn(1, n, device="cuda", dtype=bf)
            with cf.record() as rec:
                cf.linear(x.to("meta"), w.to("meta"), b.to("meta"), activation=act)
            spec = rec.entries[0].spec

            def call():
                return cf.linear(x, w, b, activation=act)

            settings = [(h, i) for h in (0, 2) for i in ("fixed_spin", "measured_spin")] if op == "gelu1024" \
                else [(0, "measured_spin")]
            with torch.no_grad():
                os.environ["CUDNN_FUSE_CACHE_DIR"] = tempfile.mkdtemp()
                plans.clear()
                call()
                heur = plans.get_plan(spec, 0)
                res["heuristic"][op] = {"engine": heur.engine, "device_us_per_call": round(graph_us(call), 3)}
                print(op, "heuristic", res["heuristic"][op], flush=True)
                for hogs, impl in settings:
                    for trial in range(args.trials):
                        os.environ["CUDNN_FUSE_CACHE_DIR"] = tempfile.mkdtemp()
                        plans.clear()
                        autotune._host_us_seen = 0.0
                        autotune.device_ms = fixed_spin_device_ms if impl == "fixed_spin" else measured
                        del lines.lines[:]
                        cf.set_autotune(True)
                        try:
                            with Hogs(hogs):
                                call()
                                torch.cuda.synchronize()
                        finally:
                            cf.set_autotune(False)
                            autotune.device_ms = measured
                        plan = plans.get_plan(spec, 0)
                        won = [ln for ln in lines.lines if "winner" in ln or "beats the cuDNN" in ln]
                        nums = [float(m) for ln in won for m in re.findall(r"(\d+\.\d+) ms", ln)]
                        row = {"op": op, "hogs": hogs, "impl": impl, "trial": trial,
                               "engine": getattr(plan, "engine", type(plan).__name__),
                               "cudnn_winner_ms": nums[0] if nums else None,
                               "torch_ms_if_it_won": nums[1] if len(nums) > 1 else None,
                               "respins": sum("measuring again" in ln for ln in lines.lines),
                               "device_us_per_call": round(graph_us(call), 3), "log": won}
                        res["trials"].append(row)
                        print(json.dumps({k: v for k, v in row.items() if k != "log"}), flush=True)
                        # written after every trial, atomically: a run cut short keeps its trials
                        write_json(os.path.join(args.out, "tune_timing_probe.json"), res)
    finally:
        autotune.DEFAULT_CONFIG = old_cfg
    summary = {}
    for r in res["trials"]:
        s = summary.setdefault(f"{r['op']}_{r['impl']}_hogs{r['hogs']}",
                               {"torch_chosen": 0, "trials": 0, "cudnn_winner_ms": [], "device_us_per_call": []})
        s["torch_chosen"] += r["engine"] == "torch"
        s["trials"] += 1
        s["cudnn_winner_ms"].append(r["cudnn_winner_ms"])
        s["device_us_per_call"].append(r["device_us_per_call"])
    res["summary"] = summary
    print(json.dumps(summary, indent=1))
    write_json(os.path.join(args.out, "tune_timing_probe.json"), res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
