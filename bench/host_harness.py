"""The host (Python + torch) cost of cudnn_fuse's training path with cuDNN replaced by
no-op launches, on any machine: a CPU stand-in for bench/host_breakdown.py when no GPU
is at hand. Every plan is a fake whose launch does nothing, so what is timed is exactly
what the library adds around the kernels: validation, memo lookups, autograd.Function
plumbing, spec caches, output allocation. The baseline is a bare autograd.Function that
allocates the same outputs and nothing else (the floor of any Python-level op).

Numbers from a CPU host are not H200 host numbers; use it to compare changes, and
bench/host_breakdown.py on the GPU to quote.

    python3 bench/host_harness.py [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from unittest import mock

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import cudnn_fuse as cf  # noqa: E402
from cudnn_fuse import backward, ops, plans  # noqa: E402


class FakePlan:
    raw = True
    engine = "fake"

    def __init__(self, spec):
        self.spec = spec

    def launch(self, ptrs):
        pass

    def run(self, buffers):
        pass


def _fake_get_plan(spec, device):
    return FakePlan(spec)


class Bare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        y = torch.empty_like(x)
        ctx.save_for_backward(x, w, y, b)
        return y

    @staticmethod
    def backward(ctx, gy):
        x, w, y, b = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(w), torch.empty_like(b)


def per_call_us(fn, calls):
    for _ in range(50):
        fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e6 * (time.perf_counter() - t) / calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", choices=("conv2d", "linear"), help="cProfile 1000 steps of this op")
    args = ap.parse_args(argv)
    cl = torch.channels_last
    dt = torch.float16
    x = torch.randn(2, 16, 8, 8).to(dt).to(memory_format=cl).requires_grad_()
    w = torch.randn(16, 16, 3, 3).to(dt).to(memory_format=cl).requires_grad_()
    b = torch.randn(16).to(dt).requires_grad_()
    gy = torch.randn(2, 16, 8, 8).to(dt).to(memory_format=cl)
    xl = torch.randn(64, 32).to(dt).requires_grad_()
    wl = torch.randn(48, 32).to(dt).requires_grad_()
    bl = torch.randn(48).to(dt).requires_grad_()
    gl = torch.randn(64, 48).to(dt)

    def conv_step():
        cf.conv2d(x, w, b, padding=1, activation="relu").backward(gy)

    def linear_step():
        cf.linear(xl, wl, bl, activation="relu").backward(gl)

    def bare_step():
        Bare.apply(x, w, b).backward(gy)

    patches = [mock.patch.object(plans, "get_plan", _fake_get_plan),
               mock.patch.object(ops, "_why_not_fused", lambda op, ts: None),
               mock.patch.object(backward, "usable", lambda *ts: True)]
    for p in patches:
        p.start()
    try:
        plans.clear()
        res = {name: per_call_us(fn, args.calls) for name, fn in
               (("bare_function_step", bare_step), ("cf_conv2d_step", conv_step), ("cf_linear_step", linear_step))}
        for k, v in res.items():
            print(f"{k:24s} {v:8.1f} us")
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            step = conv_step if args.profile == "conv2d" else linear_step
            for _ in range(1000):
                step()
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
            print(buf.getvalue())
    finally:
        for p in patches:
            p.stop()
        plans.clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
