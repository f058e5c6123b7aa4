"""Where torch.compile over an optimize()d resnet50 spends its host time (fp16 channels_last,
batch 32, inference): cf eager vs cf under torch.compile per forward, a CPU profile of the
compiled forward, and the per-call host cost of one cuDNN conv custom op: cf eager, the custom
op called directly, and inside a compiled function.

    python3 bench/compile_probe.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from cudnn_fuse import torch_ops  # noqa: E402,F401 - registers the custom ops


def per_call_us(fn, n=1000):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return round(1e6 * (time.perf_counter() - t0) / n, 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    import torchvision

    res = {"device": torch.cuda.get_device_name()}
    path = os.path.join(args.out, "compile_probe.json")

    def save():
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    with torch.no_grad():
        x = torch.randn(1, 64, 56, 56, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
        w = (torch.randn(64, 64, 3, 3, device="cuda", dtype=torch.float16) / 24).to(memory_format=torch.channels_last)
        b = torch.randn(64, device="cuda", dtype=torch.float16)
        op = torch.ops.cudnn_fuse.conv2d.default
        f = lambda x: cf.conv2d(x, w, b, padding=1, activation="relu")  # noqa: E731
        cfn = torch.compile(f, dynamic=False)
        tf = torch.compile(lambda x: torch.relu(torch.nn.functional.conv2d(x, w, b, padding=1)), dynamic=False)
        res["conv_call_us"] = {
            "cf_eager": per_call_us(lambda: f(x)),
            "custom_op_direct": per_call_us(lambda: op(x, w, b, [1, 1], [1, 1], [1, 1], [1, 1], 1, "relu", None,
                                                       False, 0.01)),
            "cf_compiled": per_call_us(lambda: cfn(x)),
            "torch_compiled": per_call_us(lambda: tf(x)),
        }
        print(res, flush=True)
        save()
        from cudnn_fuse import ops

        slow, real = [], ops._conv2d_fwd

        def counted(x, weight, *a, memo=None, **k):  # the path a memo miss takes
            slow.append((tuple(x.stride()), tuple(weight.stride()), memo is not None))
            return real(x, weight, *a, memo=memo, **k)

        ops._conv2d_fwd = counted
        for _ in range(50):
            cfn(x)
        torch.cuda.synchronize()
        res["compiled_conv_slow_path_calls_per_50"] = len(slow)
        res["slow_path_samples"] = [list(map(str, t)) for t in slow[:3]]
        ops._conv2d_fwd = real
        print(res, flush=True)
        save()
        model = torchvision.models.resnet50().cuda().half().eval().to(memory_format=torch.channels_last)
        xb = torch.randn(32, 3, 224, 224, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
        opt = cf.optimize(model)
        res["resnet50_bs32_ms"] = {"cf": per_call_us(lambda: opt(xb), 30) / 1e3}
        cm = torch.compile(opt, dynamic=False)
        res["resnet50_bs32_ms"]["cf_compiled"] = per_call_us(lambda: cm(xb), 30) / 1e3
        print(res, flush=True)
        save()
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                cm(xb)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=90)
        with open(os.path.join(args.out, "compile_probe_profile.txt"), "w") as fh:
            fh.write(table)
        print(table[:6000], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
