"""Timing helpers shared by the bench scripts (CUDA events, warm-up, medians).

The peers suite's harness lives in the package (cudnn_fuse/benchsuite.py, so that `cudnn-fuse bench`
works from an install); the helpers these scripts share with it are re-exported here.
"""

from __future__ import annotations

import os
import statistics
import subprocess

import torch

from cudnn_fuse.benchsuite import device_name, write_json  # noqa: F401 - re-exported for the bench scripts


def time_ms(fn, warmup: int = 10, iters: int = 50) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` back-to-back runs, each between CUDA events
    with no synchronisation in between: the host queues ahead as it would in a model, and a host
    slower than the kernel shows in the time (``device_ms`` leaves it out)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def synced_ms(fn, reps: int) -> float:
    """Median milliseconds of ``fn()`` between CUDA events, each run waited for before the next
    (a whole training step: what one step takes with nothing of the previous one in flight)."""
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def device_ms(fn, warmup: int = 10, iters: int = 50) -> float:
    """Median device milliseconds of ``fn()``: the calls are queued behind a GPU spin so that the
    events time the kernels, not the host's launch overhead (``host_us`` measures that)."""
    from cudnn_fuse.benchsuite import device_times

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(device_times(lambda: fn(), [()], iters, host_us=200.0))


def host_us(fn, calls: int = 2000) -> float:
    """Host microseconds per call of ``fn()`` (a tiny op: the host is the bottleneck)."""
    from cudnn_fuse.benchsuite import host_us as _host_us

    return _host_us(fn, calls)


def host_row_operands():
    """The operands of the host-overhead row, ``cf.linear(x, w, b, activation="relu")`` at 64x256x256
    fp16 on the current GPU: x [64, 256], w [256, 256] (scaled 0.06), b [256], drawn after
    ``torch.manual_seed(0)``."""
    torch.manual_seed(0)
    x = torch.randn(64, 256, device="cuda", dtype=torch.float16)
    w = torch.randn(256, 256, device="cuda", dtype=torch.float16) * 0.06
    b = torch.randn(256, device="cuda", dtype=torch.float16)
    return x, w, b


def host_row_calls(x, w, b, chain: int = 100):
    """The host row's calls on its operands: (cf's ``cf.linear(x, w, b, activation="relu")``, torch's
    ``F.relu(F.linear(x, w, b))``, a function applying cf's ``chain`` times, for ``cf.capture``)."""
    import torch.nn.functional as F

    import cudnn_fuse as cf

    def cf_op():
        return cf.linear(x, w, b, activation="relu")

    def torch_op():
        return F.relu(F.linear(x, w, b))

    def chain_fn(t):
        for _ in range(chain):
            t = cf.linear(t, w, b, activation="relu")
        return t
    return cf_op, torch_op, chain_fn


def checkout_commit() -> str:
    """git's HEAD, with "+dirty" where the tree differs from it (a copy of a checkout whose .git is
    older than its files says so rather than naming a commit that is not what ran): pass --commit."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=here).stdout.strip() or "?"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=here).stdout.strip()
    except OSError:
        return "?"
    return head + ("+dirty" if dirty else "")


def profiled_ops(prof, steps: int = 1, width: int = 120) -> tuple:
    """(kernels, host ops) of a torch.profiler session over ``steps`` calls, each list most time first: per
    kernel its device us per call, per host op its own CPU us per call, with their counts per call."""
    kernels, host = [], []
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if dev and e.device_type.name == "CUDA":
            kernels.append({"kernel": e.key[:width], "us": round(dev / steps, 2), "calls": e.count // steps})
        elif e.self_cpu_time_total:
            host.append({"op": e.key[:width], "us": round(e.self_cpu_time_total / steps, 2),
                         "calls": e.count // steps})
    kernels.sort(key=lambda r: -r["us"])
    host.sort(key=lambda r: -r["us"])
    return kernels, host
