"""How many launches queue behind a busy GPU before the host blocks, by kind of launch.

A loop of host-bound calls that runs while the GPU is busy (a sleep kernel queued first) should
take its host time only: the launches queue. eager_host_probe.py found 400 replays of one
launch graph behind a 20 ms sleep took ~55 us each, the sleep's length spread over them: the host
waited for the GPU. This probe finds where that starts: for n launches of each kind behind a 50 ms
sleep, the host time of the loop (ms) and per call (us). Kinds: one launch graph replayed
(cuGraphLaunch of one executable), 8 executables in turn, the same captures launched as their
kernel (KernelReplay: one, 8 in turn), cf.linear (memoized) by default (one-kernel captures as
their kernel), with graph replays, and raw (launch graphs off), the raw plan launch alone, and
torch's F.relu (a kernel launch).
cf.linear 64x256x256 fp16, one process.

    python3 bench/graph_queue_probe.py --out bench/results/launch_graphs
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import cudnn_fuse as cf  # noqa: E402
from bench.common import host_row_operands, write_json  # noqa: E402
from cudnn_fuse import launch_graphs, ops  # noqa: E402

SLEEP_CYCLES = int(1e8)  # ~50 ms at the H200's 1.98 GHz


def queued_loop_ms(fn, n: int) -> float:
    """Host milliseconds of ``n`` calls of ``fn`` queued behind a ~50 ms sleep kernel."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e3 * t


def idle_sleep_ms() -> float:
    """Device milliseconds of the sleep kernel alone."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "launch_graphs"))
    ap.add_argument("--counts", default="8,32,64,128,256,512,1024,2048")
    args = ap.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    x, w, b = host_row_operands()
    attrs = ("relu", False, 0.01)
    rows = {}
    with torch.no_grad():
        cf.set_launch_graphs(True)
        for _ in range(10):
            cf.linear(x, w, b, activation="relu")
        _, launch = ops._memo("linear", x, w, b, None, attrs)
        assert launch is not None, "the signature must be memoized"
        plan = launch.plan
        assert plan._graphs is not None, "this plan must get launch graphs"
        ys = [torch.empty(64, 256, device="cuda", dtype=torch.float16) for _ in range(8)]
        sets = [[x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr()] for y in ys]
        gs = plan._graphs
        drv = gs._drv
        stream = torch.cuda.current_stream().cuda_stream

        def capture_all(kernels: bool) -> list:
            """The 8 pointer sets' captures, as kernels (KernelReplay) or as graph executables, taken
            out of the plan so that its next captures do not free them."""
            drv.kernels = kernels
            gs.release()
            gs.seen.clear()
            for ptrs in sets:
                for _ in range(launch_graphs.AFTER):
                    plan.launch(ptrs)
            torch.cuda.synchronize()
            return [gs.execs.pop((0, *ptrs)) for ptrs in sets]

        graph_execs = capture_all(False)
        kernels = capture_all(True) if launch_graphs.KERNEL_REPLAY else []
        kernels = [k for k in kernels if isinstance(k, launch_graphs.KernelReplay)]
        drv.kernels = launch_graphs.KERNEL_REPLAY
        turn = [0]

        def rr8(entries, launch):
            def call():
                turn[0] = (turn[0] + 1) % 8
                launch(entries[turn[0]])
            return call

        def mode(kernel_replay: bool):
            def setup():
                drv.kernels = kernel_replay and launch_graphs.KERNEL_REPLAY
                gs.release()
                gs.seen.clear()
            return setup

        graph_launch = lambda ex: drv.launch(ex, stream)  # noqa: E731
        kernel_launch = lambda k: k.launch(stream)  # noqa: E731
        kinds = {
            "graph_one_exec": (None, lambda: graph_launch(graph_execs[0])),
            "graph_8_execs": (None, rr8(graph_execs, graph_launch)),
            "cf_linear_graph_replays": (mode(False), lambda: cf.linear(x, w, b, activation="relu")),
            "cf_linear_raw": (None, lambda: cf.linear(x, w, b, activation="relu")),
            "plan_launch_raw": (None, lambda: plan.launch(sets[0])),
            "torch_relu": (None, lambda: F.relu(x)),
        }
        if kernels:
            kinds.update({
                "kernel_one": (None, lambda: kernel_launch(kernels[0])),
                "kernel_8": (None, rr8(kernels, kernel_launch)) if len(kernels) == 8 else (None, None),
                "cf_linear_default": (mode(True), lambda: cf.linear(x, w, b, activation="relu")),
            })
        kinds = {k: v for k, v in kinds.items() if v[1] is not None}
        raw_kinds = ("cf_linear_raw", "plan_launch_raw")
        for name, (setup, fn) in kinds.items():
            cf.set_launch_graphs(name not in raw_kinds)
            if setup is not None:
                setup()
            for _ in range(20):
                fn()
            rows[name] = {}
            for n in counts:
                ms = queued_loop_ms(fn, n)
                rows[name][n] = {"host_ms": round(ms, 3), "us_per_call": round(1e3 * ms / n, 3)}
        cf.set_launch_graphs(True)
        drv.kernels = launch_graphs.KERNEL_REPLAY
        for e in graph_execs + kernels:
            drv.destroy(e)
        sleep_ms = idle_sleep_ms()
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "op": "cf.linear(x[64,256], w[256,256], b, activation='relu') fp16", "engine": plan.engine,
        "sleep_ms": round(sleep_ms, 3),
        "queued_behind_sleep": rows,
        "plan_stats": {k: v for k, v in cf.plan_stats().items() if k.startswith("graph_")},
    }
    write_json(os.path.join(args.out, "graph_queue_probe.json"), result)
    print(f"sleep kernel: {sleep_ms:.1f} ms")
    print(f"{'kind':18s}" + "".join(f"{n:>10d}" for n in counts) + "   (us per call, n calls behind the sleep)")
    for name, r in rows.items():
        print(f"{name:18s}" + "".join(f"{r[n]['us_per_call']:10.2f}" for n in counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
