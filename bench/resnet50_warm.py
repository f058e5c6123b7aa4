"""After `cudnn-fuse prewarm plans/resnet50_fp16_bs32.json`, a fresh process runs
torchvision's resnet50 through optimize(): how many plans does it build, how long
does the first forward take?

    python3 bench/resnet50_warm.py [--batch 32]
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    import argparse

    import torchvision

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args(argv)

    import cudnn_fuse as cf

    t_start = time.perf_counter()
    model = torchvision.models.resnet50().cuda().half().eval().to(memory_format=torch.channels_last)
    x = torch.randn(args.batch, 3, 224, 224, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
    opt = cf.optimize(model)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        opt(x)
    torch.cuda.synchronize()
    first_ms = 1e3 * (time.perf_counter() - t0)
    stats = cf.plan_stats()
    print(json.dumps({"batch": args.batch, "first_forward_ms": round(first_ms, 1), "builds": stats["builds"], "loads": stats["loads"],
                      "fallbacks": stats["fallbacks"], "process_to_first_result_s":
                      round(time.perf_counter() - t_start, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
