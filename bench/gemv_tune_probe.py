"""Why the autotuned batch-1 MLP stack ran slower than its heuristic plans (peers small part).

One layer of `small_mlp_stack8_linear_gelu_bf16_m1_1024`: cf.linear(x[1,1024], w[1024,1024], b,
activation="gelu") bf16. The heuristic plan and the autotuned plan, each timed as the suite's
captured variant does (100 calls of the 8 layers' weights in one cf.capture graph, replayed: the
weights stay in L2, as in the stack), beside what the autotuner recorded for every candidate
(inputs rotated through L2-sized sets, so its times are cold-L2 times).

    python3 bench/gemv_tune_probe.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import cudnn_fuse as cf  # noqa: E402
from bench.common import replay_us, write_json  # noqa: E402
from cudnn_fuse import autotune, loader, plans  # noqa: E402


def graph_us(fn, reps=20) -> float:
    """Device microseconds per layer call: 8 layers x 12 passes captured, replayed ``reps`` times."""
    return replay_us(cf.capture(fn), 96, reps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--budget-s", type=float, default=3.0)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    bf = torch.bfloat16
    ws = [torch.randn(1024, 1024, device="cuda", dtype=bf) / 32 for _ in range(8)]
    bs = [torch.randn(1024, device="cuda", dtype=bf) for _ in range(8)]
    x = torch.randn(1, 1024, device="cuda", dtype=bf)

    def stack():
        t = x
        for _ in range(12):
            for w, b in zip(ws, bs):
                t = cf.linear(t, w, b, activation="gelu")
        return t

    with cf.record() as rec:
        cf.linear(x.to("meta"), ws[0].to("meta"), bs[0].to("meta"), activation="gelu")
    spec = rec.entries[0].spec
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with torch.no_grad():
        plans.clear()
        stack()
        res["heuristic_engine"] = plans.get_plan(spec, 0).engine
        res["heuristic_us_per_layer"] = round(graph_us(stack), 3)
        plans.clear()
        cf.set_autotune(True)
        old = autotune.DEFAULT_CONFIG
        autotune.DEFAULT_CONFIG = autotune.Config(budget_s=args.budget_s)
        try:
            stack()
            tuned = plans.get_plan(spec, 0)
            res["tuned_engine"] = getattr(tuned, "engine", type(tuned).__name__)
            res["tuned_us_per_layer"] = round(graph_us(stack), 3)
        finally:
            autotune.DEFAULT_CONFIG = old
            cf.set_autotune(False)
        entry = loader._cache().get(loader.cache_digest(spec))
        meta = entry.meta if entry is not None else {}
        res["tuned_candidates"] = [{k: c.get(k) for k in ("index", "name", "median_ms", "status")}
                                   for c in meta.get("candidates", [])]
        res["winner_index"] = meta.get("winner_index")
        res["use_torch"] = meta.get("use_torch")
    write_json(os.path.join(args.out, "gemv_tune_probe.json"), res)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
