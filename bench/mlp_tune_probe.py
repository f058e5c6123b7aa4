"""Every candidate engine of a training MLP block's graphs, timed (issue 4): one bf16
Linear(2048 -> 8192) + GELU + Linear(8192 -> 2048) block at 8192 rows through optimize()
(cf.nn.FusedMLP), one training step with autotuning on and a generous per-graph budget, then
each tuned cache entry's candidate table (cuDNN engines and torch's stand-in). Diagnostic.

    CUDNN_FUSE_TUNE_BUDGET_S=40 python3 bench/mlp_tune_probe.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from cudnn_fuse import cache  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    cf.set_autotune(True)
    torch.manual_seed(0)
    bf = torch.bfloat16
    model = cf.optimize(nn.Sequential(nn.Linear(2048, 8192), nn.GELU(), nn.Linear(8192, 2048)).cuda().to(bf))
    x = torch.randn(8192, 2048, device="cuda", dtype=bf, requires_grad=True)
    model(x).float().square().mean().backward()
    torch.cuda.synchronize()
    pc = cache.open_default_cache()
    rows = []
    for info in pc.entry_info():
        meta = info.meta
        if meta.get("kind") == "engine-record" or not meta.get("candidates"):
            continue
        cands = sorted(meta["candidates"], key=lambda c: (c.get("median_ms") is None, c.get("median_ms") or 0))
        rows.append({"op": meta.get("op"), "shape": meta["spec"].get("fwd", meta["spec"]).get("a", {}).get("shape"),
                     "winner": meta.get("engine_name"), "use_torch": meta.get("use_torch"),
                     "candidates": [(c.get("name"), c.get("median_ms"), c.get("status")) for c in cands]})
        print(f"\n{meta.get('op')} a={rows[-1]['shape']} winner={meta.get('engine_name')} "
              f"use_torch={meta.get('use_torch')}")
        for name, ms, status in rows[-1]["candidates"]:
            print(f"   {name:24s} {ms if ms is not None else '-':>10} {status}")
    with open(os.path.join(args.out, "mlp_tune_probe.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "budget_s": os.environ.get("CUDNN_FUSE_TUNE_BUDGET_S"),
                   "entries": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
