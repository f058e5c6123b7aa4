"""Where one training step of bench/memory.py's conv-bias-ReLU stack spends its time, eager vs cf:
torch.profiler's top operators by host time and by device time, and the step's wall time against
the device's busy time (a step far longer than its kernels is host-bound or waits on syncs).

    python3 bench/step_profile.py --out bench/results
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from bench.memory import convs, train_step as step  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    base = convs().cuda().half().to(memory_format=torch.channels_last)
    x = torch.randn(32, 128, 56, 56, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
    x.requires_grad_()
    out = {}
    for name, model in (("eager", base), ("cf", cf.optimize(copy.deepcopy(base)))):
        for _ in range(3):
            step(model, x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            step(model, x)
        torch.cuda.synchronize()
        wall = 1e3 * (time.perf_counter() - t0) / 5
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step(model, x)
            torch.cuda.synchronize()
        ka = prof.key_averages()
        dev = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in ka) / 3e3
        out[name] = {"step_wall_ms": round(wall, 3), "device_busy_ms_per_step": round(dev, 3),
                     "top_host": ka.table(sort_by="self_cpu_time_total", row_limit=15),
                     "top_device": ka.table(sort_by="self_cuda_time_total", row_limit=12)}
        print(f"== {name}: step {wall:.3f} ms wall, device busy {dev:.3f} ms")
        print(out[name]["top_host"])
        print(out[name]["top_device"])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "step_profile.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
