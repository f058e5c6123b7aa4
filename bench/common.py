"""Timing helpers shared by the benchmarks (CUDA events, warm-up, medians)."""

from __future__ import annotations

import json
import os
import statistics

import torch


def time_ms(fn, warmup: int = 10, iters: int = 50) -> float:
    """Median device milliseconds of ``fn()`` over ``iters`` back-to-back runs.

    Each run is bracketed by CUDA events, with no synchronisation in between, so
    the host queues ahead as it would in a model and the events time the device
    work, not the host's launch overhead (measured separately: ``host_us``).
    """
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


def device_ms(fn, warmup: int = 10, iters: int = 50) -> float:
    """Median device milliseconds of ``fn()``: calls queued behind a GPU spin so the
    events time the kernels, not the host's launch overhead (``host_us`` measures that)."""
    from cudnn_fuse.autotune import device_ms as _device_ms

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(_device_ms(fn, iters, host_us_per_call=200.0))


def host_us(fn, calls: int = 2000) -> float:
    """Host microseconds per call of ``fn()`` (a tiny op: the host is the bottleneck)."""
    import time

    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t0) / calls


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
