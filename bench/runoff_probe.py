"""Does the runoff against torch (autotune.settle_torch) pick the faster of cuDNN's winner and
torch's path for the large GEMMs where the suite's autotuned cf trailed torch (peers core part)?

Each case is tuned in a fresh plan cache with the runoff (twice) and without it (medians only,
``runoff_rounds=0``), then the tuned op and torch's eager op are timed in this process,
interleaved (CUDA events, fresh inputs). Per tuning: whether torch was chosen, the medians and
runoff times of the cuDNN winner and torch, and the tuned op's time against torch's.

    python3 bench/runoff_probe.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.common import large_gemm_cases, tuned, write_json  # noqa: E402
from cudnn_fuse import autotune, plans  # noqa: E402


def event_ms(fn, n=20) -> float:
    for _ in range(3):
        fn()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) / n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--budget-s", type=float, default=4.0)
    args = ap.parse_args(argv)
    from cudnn_fuse.cache import open_default_cache

    results = {}
    with torch.no_grad():
        for name, op, ref in large_gemm_cases(amax_of=lambda y: y.abs().amax().float()):
            runs = results[name] = []
            for label, rounds in (("runoff", 4), ("medians", 0), ("runoff", 4)):
                os.environ["CUDNN_FUSE_CACHE_DIR"] = tempfile.mkdtemp()
                plans.clear()
                plan = tuned(op, autotune.Config(budget_s=args.budget_s, runoff_rounds=rounds))
                meta = open_default_cache().get(plan.spec.digest()).meta
                cands = meta["candidates"]
                tor = next(c for c in cands if c["index"] == autotune.TORCH_INDEX)
                won = next(c for c in cands if c["index"] == meta["winner_index"])
                cf_ms, torch_ms = [], []
                for _ in range(5):
                    cf_ms.append(event_ms(op))
                    torch_ms.append(event_ms(ref))
                rec = {"mode": label, "use_torch": meta["use_torch"], "plan": type(plan).__name__,
                       "cudnn_winner": won["name"], "winner_median_ms": won["median_ms"], "torch_median_ms": tor["median_ms"],
                       "winner_runoff_ms": won.get("runoff_ms"), "torch_runoff_ms": tor.get("runoff_ms"),
                       "tuned_op_ms": round(statistics.median(cf_ms), 4), "torch_eager_ms": round(statistics.median(torch_ms), 4)}
                runs.append(rec)
                print(name, json.dumps(rec), flush=True)
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": results}
    write_json(os.path.join(args.out, "runoff_probe.json"), doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
