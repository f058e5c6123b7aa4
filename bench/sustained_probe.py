"""Do the large GEMMs where autotuned cf trailed torch (peers core part) rank the same in a short
burst, the way the autotuner times them, as in a sustained run, the way the suite and a
training loop run them?

Per case: cf tuned with cuDNN's candidates only (``torch_candidate=False``, a fresh plan cache),
then cf's op and torch's eager op, each timed in this process
  * as a burst: 3 warm-up calls then the median of 30, behind a spin (what autotune.py does);
  * sustained: 4 blocks each, alternating (ABBA), of back-to-back calls for ``--block-s``
    seconds, every call between CUDA events; per block the median of its first 30 calls and of
    the calls after its first half.
``nvidia-smi`` samples SM clock, power and temperature every 100 ms throughout
(``sustained_probe_smi.csv``), so a ranking that flips can be put next to the clocks.

    python3 bench/sustained_probe.py --out bench/results

bench/results/sustained_probe.json was taken at 3a4ee00, before the autotuner heated the GPU ahead
of its timings (its tuning was then a burst too).
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

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.common import large_gemm_cases, tuned, write_json  # noqa: E402
from cudnn_fuse import autotune, plans  # noqa: E402


def burst_ms(fn) -> float:
    for _ in range(3):
        fn()
    return statistics.median(autotune.device_ms(fn, 30))


def block(fn, seconds: float) -> dict:
    """Back-to-back calls for about ``seconds``, each between events; medians of the first 30
    and of the second half."""
    torch.cuda.synchronize()
    evs = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds or len(evs) < 60:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        evs.append((s, e))
        if len(evs) % 8 == 0:  # keep the queue short, so the host clock tracks the device
            evs[-4][1].synchronize()
    torch.cuda.synchronize()
    ms = [s.elapsed_time(e) for s, e in evs]
    return {"calls": len(ms), "first30_ms": round(statistics.median(ms[:30]), 4),
            "second_half_ms": round(statistics.median(ms[len(ms) // 2:]), 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--budget-s", type=float, default=4.0)
    ap.add_argument("--block-s", type=float, default=1.0)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    smi = None
    try:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,"
                                "clocks_throttle_reasons.active", "--format=csv", "-lms", "100"],
                               stdout=open(os.path.join(args.out, "sustained_probe_smi.csv"), "w"),
                               stderr=subprocess.DEVNULL)
    except OSError as exc:
        print("no nvidia-smi:", exc)
    results = {}
    t_start = time.time()
    try:
        with torch.no_grad():
            for name, op, ref in large_gemm_cases((16384, 4096)):
                os.environ["CUDNN_FUSE_CACHE_DIR"] = tempfile.mkdtemp()
                plans.clear()
                t_tune = time.time()
                plan = tuned(op, autotune.Config(budget_s=args.budget_s, torch_candidate=False))
                rec = {"engine": plan.engine, "tuned_s": [round(t_tune - t_start, 1), round(time.time() - t_start, 1)],
                       "burst_ms": {"cf": round(burst_ms(op), 4), "torch": round(burst_ms(ref), 4)}}
                blocks = {"cf": [], "torch": []}
                rec["sustained_s"] = [round(time.time() - t_start, 1)]
                for r in range(4):
                    order = ("cf", "torch") if r % 2 == 0 else ("torch", "cf")
                    for who in order:
                        blocks[who].append(block(op if who == "cf" else ref, args.block_s))
                rec["sustained_s"].append(round(time.time() - t_start, 1))
                rec["blocks"] = blocks
                rec["sustained_ms"] = {k: round(statistics.median(b["second_half_ms"] for b in v), 4) for k, v in blocks.items()}
                rec["first30_ms"] = {k: round(statistics.median(b["first30_ms"] for b in v), 4) for k, v in blocks.items()}
                rec["burst_ms_after"] = {"cf": round(burst_ms(op), 4), "torch": round(burst_ms(ref), 4)}
                results[name] = rec
                print(name, json.dumps({k: rec[k] for k in ("engine", "burst_ms", "first30_ms", "sustained_ms",
                                                            "burst_ms_after")}), flush=True)
    finally:
        if smi is not None:
            smi.terminate()
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "block_s": args.block_s,
           "cases": results}
    write_json(os.path.join(args.out, "sustained_probe.json"), doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
