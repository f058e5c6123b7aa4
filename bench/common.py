"""Timing helpers shared by the benchmarks (CUDA events, warm-up, medians).

The suite's harness lives in the package (cudnn_fuse/benchsuite.py, so that `cudnn-fuse bench`
works from an install); the helpers it shares with these scripts are re-exported here.
"""

from __future__ import annotations

import statistics
import time

import torch

from cudnn_fuse.benchsuite import (  # noqa: F401 - re-exported for the bench scripts
    device_name, device_times, l2_bytes, measure_ceilings, rel_err, rotation_sets, wall_block_ms, write_json)


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
    """Median device milliseconds of ``fn()``: calls queued behind a GPU spin so the
    events time the kernels, not the host's launch overhead (``host_us`` measures that)."""
    from cudnn_fuse.autotune import device_ms as _device_ms

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(_device_ms(fn, iters, host_us_per_call=200.0))


def host_us(fn, calls: int = 2000) -> float:
    """Host microseconds per call of ``fn()`` (a tiny op: the host is the bottleneck)."""
    from cudnn_fuse.benchsuite import host_us as _host_us

    return _host_us(fn, calls)


def host_row_operands():
    """The operands of issue 6's host row, ``cf.linear(x, w, b, activation="relu")`` at 64x256x256
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


def replay_us(graph, calls_per_graph: int, reps: int = 20) -> float:
    """Device microseconds per call of a captured graph (``cf.capture``) holding ``calls_per_graph``
    calls: three warm replays, then the median of ``reps`` replays, each between CUDA events."""
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        out.append(1e3 * e0.elapsed_time(e1) / calls_per_graph)
    return statistics.median(out)


def large_gemm_cases(linear_ms=(16384,), amax_of=None):
    """The large bf16 GEMMs where autotuned cf trailed torch in the suite's core part, as
    (name, cf's op, torch's eager op) with fresh normal operands (seeded): linear + GELU
    M x 4096 -> 16384 for each M in ``linear_ms``, then 8192^3 matmul + AMAX (torch: the product,
    then ``amax_of(y)``, by default max |y| as one reduction)."""
    import torch.nn.functional as F

    import cudnn_fuse as cf

    bf = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*s, scale=1.0):
        return (torch.randn(*s, device="cuda", generator=g) * scale).to(bf)

    for m in linear_ms:
        x, w, b = r(m, 4096), r(16384, 4096, scale=0.02), r(16384)
        yield (f"linear_gelu_{m}x4096x16384", lambda x=x, w=w, b=b: cf.linear(x, w, b, activation="gelu"),
               lambda x=x, w=w, b=b: F.gelu(F.linear(x, w, b)))
    amax_of = amax_of or (lambda y: torch.linalg.vector_norm(y, float("inf")))
    a, m2 = r(8192, 8192), r(8192, 8192, scale=0.02)
    yield ("matmul_amax_8192cubed", lambda: cf.matmul(a, m2, return_amax=True),
           lambda: (lambda y: (y, amax_of(y)))(a @ m2))


def tuned(op, cfg):
    """Run ``op()`` once with autotuning on under ``cfg`` (autotune.Config) in place of the default
    config, then restore both; the plan it built (the newest in memory)."""
    import cudnn_fuse as cf
    from cudnn_fuse import autotune, plans

    saved = autotune.DEFAULT_CONFIG
    autotune.DEFAULT_CONFIG = cfg
    cf.set_autotune(True)
    try:
        op()
        torch.cuda.synchronize()
    finally:
        cf.set_autotune(False)
        autotune.DEFAULT_CONFIG = saved
    return plans.plans_in_memory()[-1]


def profile_text(fn, calls: int, top: int) -> str:
    """cProfile of ``calls`` calls of ``fn()`` (synced at the end): the ``top`` functions by own time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def heat(seconds: float = 0.5) -> None:
    """Bring the GPU from its idle boost clock to what a sustained run holds: bf16 8192^3 GEMMs back
    to back for ``seconds``."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(4):
            a @ a
        torch.cuda.synchronize()
