"""Where does cf's conv training step spend its host time (issue 4's conv row)?

bench/step_noise_probe.py measured the cf step of bench/memory.py's conv-bias-ReLU stack
(8 layers, 32x128x56x56 fp16 channels_last) enqueueing in 3.6 ms of host time against eager's
2.3 ms, while bench/host_harness.py (CPU, cuDNN mocked) puts cf's Python cost at ~50 us a layer.
This times, in the real step on the GPU machine, with each step's phases synchronized apart:

- the forward's and the backward's host time, for eager, cf, and a third model whose layers are
  a Python autograd.Function running torch's own conv kernels ("pyfn"): pyfn - eager is what a
  Python node costs here, cf - pyfn what cf's own code and cuDNN's execute cost;
- inside cf: the host time of every cuDNN launch, of the replayed backward (conv_program), of the
  general path's pieces where it runs, and of the forward body;
- the threads alive in the process (a Python thread holding the GIL would stall the backward).

Diagnostic, not a result. python3 bench/conv_host_probe.py --out bench/results
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import statistics
import sys
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from bench import memory  # noqa: E402
from cudnn_fuse import backward, plans, torch_ops  # noqa: E402

_T: dict = collections.defaultdict(list)  # label -> [ns of each call]
_ON = [False]


def _wrap(owner, name, label):
    orig = getattr(owner, name)

    def timed(*a, **k):
        if not _ON[0]:
            return orig(*a, **k)
        t = time.perf_counter_ns()
        try:
            return orig(*a, **k)
        finally:
            _T[label].append(time.perf_counter_ns() - t)

    setattr(owner, name, timed)


class _PyConvReLU(torch.autograd.Function):
    """torch's conv + relu kernels behind a Python autograd node (what a Python node costs)."""

    @staticmethod
    def forward(ctx, x, w, b):
        y = F.relu(F.conv2d(x, w, b, padding=1))
        ctx.save_for_backward(x, w, y)
        return y

    @staticmethod
    def backward(ctx, gy):
        x, w, y = ctx.saved_tensors
        gz = torch.ops.aten.threshold_backward(gy, y, 0)
        dx, dw, db = torch.ops.aten.convolution_backward(gz, x, w, [w.shape[0]], [1, 1], [1, 1], [1, 1], False,
                                                         [0, 0], 1, [True, True, True])
        return dx, dw, db


class _PyLayer(nn.Module):
    def __init__(self, conv):
        super().__init__()
        self.conv = conv

    def forward(self, x):
        return _PyConvReLU.apply(x, self.conv.weight, self.conv.bias)


def _phases(model, x, n):
    """[(forward host ms, backward host ms, step device ms)] of n steps, phases synchronized apart."""
    rows = []
    for _ in range(n):
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        t0 = time.perf_counter()
        loss = model(x).float().square().mean()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        e.record()
        for p in model.parameters():
            p.grad = None
        torch.cuda.synchronize()
        rows.append((1e3 * (t1 - t0), 1e3 * (t3 - t2), s.elapsed_time(e)))
    return rows


def _profile(model, x, n=30) -> str:
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        _phases(model, x, 3)
        prof.enable()
        _phases(model, x, n)
        prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(45)
    return buf.getvalue()


def _micro(x, w, b) -> dict:
    """Host us per call of the step's elementary pieces, each in a tight loop (warm caches)."""
    from bench.common import host_us
    from cudnn_fuse import autotune
    from cudnn_fuse.builders import roles_of

    xd, wd, bd = x.detach(), w.detach(), b.detach()
    db32 = torch.randn(1, 128, 1, 1, device="cuda")
    out = {
        "empty_strided 32x128x56x56": lambda: torch.empty_strided(xd.shape, xd.stride(), dtype=xd.dtype, device=xd.device),
        "empty_like channels_last": lambda: torch.empty_like(xd),
        "f32 -> f16 cast of 128": lambda: db32.view(-1).to(torch.float16),
        "backward.usable": lambda: backward.usable(xd, wd, bd, None, xd),
        "x.contiguous(channels_last)": lambda: xd.contiguous(memory_format=torch.channels_last),
        "raw stream": lambda: plans._current_stream(0),
    }
    for p in plans.plans_in_memory():
        bufs = autotune.random_buffers(p.spec, roles_of(p.spec), 0, 1)[0]
        ptrs = [t.data_ptr() for t in bufs]
        out[f"launch {p.spec.op} {p.engine}"] = (lambda p=p, ptrs=ptrs: p.launch(ptrs)) if p.raw else \
            (lambda p=p, bufs=bufs: p.run(bufs))
    res = {}
    for k, fn in out.items():
        res[k] = round(host_us(fn, 500), 2)
        torch.cuda.synchronize()
    return res


def _dbias16(x) -> dict:
    """Would the act-grad graph's bias reduction write float16 directly (no cast kernel after
    it)? Its result against the float32 reduction's, rounded, and each graph's device time."""
    from cudnn_fuse.errors import UnsupportedError
    from cudnn_fuse.spec import ActGradSpec, TensorSpec

    gy = torch.randn_like(x.detach())
    y = torch.relu(torch.randn_like(gy))
    K = gy.shape[1]
    out = {}
    res = {}
    for dt in ("float32", "float16"):
        db = torch.empty_strided((1, K, 1, 1), (K, 1, K, K), dtype=getattr(torch, dt), device="cuda")
        dz = torch.empty_like(gy)
        spec = ActGradSpec(TensorSpec.of(gy), TensorSpec.of(y), TensorSpec.of(dz), "relu", 0.01,
                           TensorSpec((1, K, 1, 1), (K, 1, K, K), dt))
        try:
            plan = plans.get_plan(spec, 0)
        except UnsupportedError as exc:
            res[dt] = f"declined: {exc}"[:200]
            continue
        plan.run([gy, y, dz, db])
        torch.cuda.synchronize()
        out[dt] = db.clone()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(50):
            plan.run([gy, y, dz, db])
        e.record()
        torch.cuda.synchronize()
        res[dt] = {"engine": plan.engine, "device_ms": round(s.elapsed_time(e) / 50, 4)}
    if len(out) == 2:
        ref = out["float32"].to(torch.float16)
        res["max_abs_diff_vs_rounded_f32"] = (out["float16"].float() - ref.float()).abs().max().item()
        res["max_abs_f32"] = out["float32"].abs().max().item()
        res["equal_to_rounded_f32"] = bool(torch.equal(out["float16"], ref))
    return res


def _med(v):
    return round(statistics.median(v), 4) if v else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--profile", action="store_true",
                    help="also cProfile 30 steps of cf and of eager, backward on the calling thread "
                         "(conv_host_profile.txt)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cl = torch.channels_last
    base = memory.convs().cuda().half().to(memory_format=cl)
    x = torch.randn(32, 128, 56, 56, device="cuda", dtype=torch.float16).to(memory_format=cl).requires_grad_()
    fused = cf.optimize(copy.deepcopy(base))
    pyfn = nn.Sequential(*[_PyLayer(m) for m in copy.deepcopy(base) if isinstance(m, nn.Conv2d)])
    models = {"eager": base, "pyfn": pyfn, "cf": fused}
    for m in models.values():
        _phases(m, x, 5)
    for owner, name, label in ((plans.Plan, "launch", "cudnn launch"),
                               (torch_ops, "_conv2d_backward", "cf backward body"),
                               (torch_ops, "_conv2d_op_impl", "cf forward body"),
                               (backward, "conv_program", "conv_program (replayed backward)"),
                               (backward, "conv_dz", "conv_dz"), (backward, "conv_dgrad", "conv_dgrad"),
                               (backward, "conv_wgrad", "conv_wgrad")):
        _wrap(owner, name, label)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "steps": args.steps,
           "python_threads": [t.name for t in threading.enumerate()],
           "native_threads": len(os.listdir("/proc/self/task")), "switch_interval_s": sys.getswitchinterval()}
    rounds = {k: [] for k in models}
    per_step = collections.defaultdict(list)
    for r in range(args.rounds):
        order = list(models) if r % 2 == 0 else list(models)[::-1]
        for k in order:
            _T.clear()
            _ON[0] = k == "cf"
            rows = _phases(models[k], x, args.steps)
            _ON[0] = False
            rounds[k].append({"fwd_host_ms": _med([a for a, _, _ in rows]), "bwd_host_ms": _med([b for _, b, _ in rows]),
                              "device_ms": _med([c for _, _, c in rows])})
            if k == "cf":
                for label, v in _T.items():
                    per_step[label].append({"calls_per_step": len(v) / args.steps,
                                            "us_per_step": sum(v) / 1e3 / args.steps,
                                            "median_us_per_call": statistics.median(v) / 1e3})
    res["rounds"] = rounds
    res["summary"] = {k: {f: _med([r[f] for r in v]) for f in ("fwd_host_ms", "bwd_host_ms", "device_ms")}
                      for k, v in rounds.items()}
    res["cf_inside"] = {label: {f: _med([r[f] for r in v]) for f in v[0]} for label, v in per_step.items()}
    res["micro_us_per_call"] = _micro(x, base[0].weight, base[0].bias)
    res["dbias_fp16"] = _dbias16(x)
    os.makedirs(args.out, exist_ok=True)
    if args.profile:
        with open(os.path.join(args.out, "conv_host_profile.txt"), "w") as f:
            for k in ("cf", "eager"):
                f.write(f"==== {k}: 30 steps, cProfile, autograd on the calling thread\n")
                f.write(_profile(models[k], x))
    with open(os.path.join(args.out, "conv_host_probe.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: res[k] for k in ("summary", "cf_inside", "python_threads", "native_threads")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
