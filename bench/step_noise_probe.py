"""Why does cf's conv training step vary between rounds when eager's does not (memory.py)?
Per-step times of the memory bench's conv-bias-ReLU stack and MLP stack, eager and cf, each step
synchronized: the device time (CUDA events), the host time to enqueue it, and the same with
Python's garbage collector off, and with autograd's backward on the calling thread
(torch.autograd.set_multithreading_enabled(False)). Diagnostic, not a result.

    python3 bench/step_noise_probe.py --out bench/results
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from bench import memory  # noqa: E402


def steps(model, x, n=40):
    """[(device ms, host ms to enqueue)] of n synchronized steps."""
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        s.record()
        memory.train_step(model, x)
        e.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        out.append((s.elapsed_time(e), 1e3 * (t1 - t0)))
    return out


def summary(rows):
    dev, host = [r[0] for r in rows], [r[1] for r in rows]
    q = statistics.quantiles(dev, n=10)
    return {"device_median": round(statistics.median(dev), 3), "device_p10": round(q[0], 3),
            "device_p90": round(q[-1], 3), "device_max": round(max(dev), 3),
            "host_median": round(statistics.median(host), 3), "host_max": round(max(host), 3),
            "device_ms": [round(v, 3) for v in dev]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    res = {"device": torch.cuda.get_device_name()}
    cbase = memory.convs().cuda().half().to(memory_format=torch.channels_last)
    xc = torch.randn(32, 128, 56, 56, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
    xc.requires_grad_()
    bf = torch.bfloat16
    mbase = memory.mlp().cuda().to(bf)
    xm = torch.randn(8192, 2048, device="cuda", dtype=bf, requires_grad=True)
    for case, base, x in (("conv", cbase, xc), ("mlp", mbase, xm)):
        fused = cf.optimize(copy.deepcopy(base))
        for m in (base, fused):
            steps(m, x, 5)
        for label, m in (("eager", base), ("cf", fused)):
            res[f"{case} {label}"] = summary(steps(m, x))
            gc.disable()
            try:
                res[f"{case} {label} gc off"] = summary(steps(m, x))
            finally:
                gc.enable()
            # the backward on the calling thread, not autograd's per-device worker (no thread hand-off)
            with torch.autograd.set_multithreading_enabled(False):
                res[f"{case} {label} 1 thread"] = summary(steps(m, x))
        for k in [k for k in res if k.startswith(case)]:
            v = res[k]
            print(f"{k:24s} device median {v['device_median']:8.3f} p10 {v['device_p10']:8.3f} p90 {v['device_p90']:8.3f} "
                  f"max {v['device_max']:8.3f}   host median {v['host_median']:7.3f} max {v['host_max']:7.3f}", flush=True)
    with open(os.path.join(args.out, "step_noise_probe.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
