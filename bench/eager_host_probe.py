"""Where an eager cf.linear call's host time goes, piece by piece (issue 6's host target).

`cf.linear(x, w, b, activation="relu")` at 64x256x256 fp16 with its signature memoized and its
pointer sets replayed as launch graphs; each piece of that call timed alone over back-to-back
calls, beside torch's F.linear and F.relu. Medians of interleaved rounds, one process. Also the
whole call's host time (and cuGraphLaunch's, and torch's) with the GPU kept busy by a sleep kernel,
so that no call waits for the GPU (``queued_host_us``).

    python3 bench/eager_host_probe.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import cudnn_fuse as cf  # noqa: E402
from bench.common import host_row_operands, host_us  # noqa: E402
from cudnn_fuse import launch_graphs, ops, plans  # noqa: E402


def host_and_device_us(fn, calls: int) -> tuple:
    """(host, device) microseconds per call over ``calls`` back-to-back calls: device time from
    CUDA events around the loop. Equal when the GPU is the bottleneck."""
    import time

    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    e0.record()
    for _ in range(calls):
        fn()
    e1.record()
    t1 = time.perf_counter()
    e1.synchronize()
    return 1e6 * (t1 - t0) / calls, 1e3 * e0.elapsed_time(e1) / calls


def queued_host_us(fn, calls: int = 400, rounds: int = 5) -> float:
    """Host microseconds per call with the GPU held busy by a sleep kernel for the whole loop, so
    that no call waits for the GPU (a back-to-back loop of calls shorter than their kernels times
    the GPU): the median over ``rounds`` loops of ``calls`` calls."""
    import time

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        torch.cuda._sleep(int(40e6))  # ~20 ms at the H200's clock: longer than any loop below
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append(1e6 * (time.perf_counter() - t0) / calls)
        torch.cuda.synchronize()
    return statistics.median(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    x, w, b = host_row_operands()
    attrs = ("relu", False, 0.01)
    with torch.no_grad():
        for _ in range(10):
            y = cf.linear(x, w, b, activation="relu")
        key, launch = ops._memo("linear", x, w, b, None, attrs)
        assert launch is not None, "the signature must be memoized"
        plan = launch.plan
        y = torch.empty_strided(launch.size, launch.stride, dtype=launch.dtype, device=launch.device)
        ptrs = [x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr()]
        for _ in range(3):
            plan.launch(ptrs)
        torch.cuda.synchronize()
        gs = plan._graphs
        drv = gs._drv if gs is not None else None
        stream = torch.cuda.current_stream().cuda_stream
        def held_capture(kernels: bool):
            """This launch captured afresh (as its kernel or as a graph executable) and taken out of
            the plan: the loops below release the plan's captures, which would free it."""
            drv.kernels = kernels
            gs.release()
            gs.seen.clear()
            for _ in range(launch_graphs.AFTER):
                plan.launch(ptrs)
            torch.cuda.synchronize()
            return gs.execs.pop((0, *ptrs), None) if plan.workspace_size == 0 else None

        ex = kr = None  # the same launch as a graph executable and as a KernelReplay, held outside the plan
        if drv is not None:
            ex = held_capture(False)
            got = held_capture(launch_graphs.KERNEL_REPLAY)
            drv.kernels = launch_graphs.KERNEL_REPLAY
            kr = got if isinstance(got, launch_graphs.KernelReplay) else None
            if got is not None and kr is None:
                drv.destroy(got)  # a graph again (kernel replay off): not the piece timed
        pieces = {
            "cf_linear": lambda: cf.linear(x, w, b, activation="relu"),
            "memo_lookup": lambda: ops._memo("linear", x, w, b, None, attrs),
            "launch_call": lambda: launch(x, w, b, None),
            "empty_strided": lambda: torch.empty_strided(launch.size, launch.stride, dtype=launch.dtype,
                                                         device=launch.device),
            "empty": lambda: torch.empty(launch.size, dtype=launch.dtype, device=launch.device),
            "new_empty": lambda: x.new_empty(launch.size),
            "new_empty_strided": lambda: x.new_empty_strided(launch.size, launch.stride),
            "plan_launch_replay": lambda: plan.launch(ptrs),
            "cuGraphLaunch": (lambda: drv.launch(ex, stream)) if ex is not None else None,
            "cuLaunchKernelEx": (lambda: kr.launch(stream)) if kr is not None else None,
            "current_stream": lambda: plans._current_stream(0),
            "is_capturing": plans._capturing,
            "workspace_ptr": lambda: plans._workspace_ptr(0, stream, plan.workspace_size or 1, False),
            "torch_linear": lambda: F.linear(x, w, b),
            "torch_relu": lambda: F.relu(y),
            "torch_linear_relu": lambda: F.relu(F.linear(x, w, b)),
        }
        pieces = {k: v for k, v in pieces.items() if v is not None}
        rows = {k: [] for k in pieces}
        for _ in range(args.rounds):
            for k, fn in pieces.items():
                rows[k].append(host_us(fn, args.calls))
        cf.set_launch_graphs(False)
        rows["plan_launch_raw"] = [host_us(lambda: plan.launch(ptrs), args.calls) for _ in range(args.rounds)]
        cf.set_launch_graphs(True)
        # is a loop of calls host-bound or GPU-bound? CUDA-event time of the same loops, beside their host time
        loops = {"cf_linear": pieces["cf_linear"], "torch_linear_relu": pieces["torch_linear_relu"]}
        modes = {"": (True, True), "_graph_replays": (True, False), "_no_graphs": (False, True)}
        both = {f"{k}{sfx}": {"host": [], "device": []} for k in loops for sfx in modes
                if not (k.startswith("torch") and sfx)}
        for _ in range(args.rounds):
            for name, fn in loops.items():
                for sfx, (graphs, kernels) in (modes.items() if name == "cf_linear" else [("", (True, True))]):
                    cf.set_launch_graphs(graphs)
                    if drv is not None and drv.kernels != (kernels and launch_graphs.KERNEL_REPLAY):
                        drv.kernels = kernels and launch_graphs.KERNEL_REPLAY
                        gs.release()  # captured again as the mode says, in the loop's warm-up
                        gs.seen.clear()
                    h, d = host_and_device_us(fn, args.calls)
                    row = both[name + sfx]
                    row["host"].append(h)
                    row["device"].append(d)
        cf.set_launch_graphs(True)
        if drv is not None:
            drv.kernels = launch_graphs.KERNEL_REPLAY
            gs.release()
            gs.seen.clear()
        # the same calls' host time with the GPU busy throughout (none of them waits for the GPU)
        queued = {"cf_linear": pieces["cf_linear"], "torch_linear_relu": pieces["torch_linear_relu"]}
        for k in ("cuGraphLaunch", "cuLaunchKernelEx"):
            if k in pieces:
                queued[k] = pieces[k]
        queued_rows = {k: [] for k in queued}
        for _ in range(args.rounds):
            for k, fn in queued.items():
                queued_rows[k].append(queued_host_us(fn))
        for held in (ex, kr):
            if held is not None:
                drv.destroy(held)
    med = {k: round(statistics.median(v), 3) for k, v in rows.items()}
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "op": "cf.linear(x[64,256], w[256,256], b, activation='relu') fp16, memoized, launch graphs on "
              "(one-kernel captures as their kernel unless the row says graph_replays)",
        "engine": plan.engine, "workspace": plan.workspace_size, "calls_per_round": args.calls,
        "host_us": med,
        "loop_host_vs_device_us": {k: {m: round(statistics.median(v[m]), 3) for m in v} for k, v in both.items()},
        "loop_all_rounds_us": {k: {m: [round(t, 3) for t in v[m]] for m in v} for k, v in both.items()},
        "all_rounds_us": {k: [round(t, 3) for t in v] for k, v in rows.items()},
        "queued_host_us": {k: round(statistics.median(v), 3) for k, v in queued_rows.items()},
        "queued_all_rounds_us": {k: [round(t, 3) for t in v] for k, v in queued_rows.items()},
        "plan_stats": {k: v for k, v in cf.plan_stats().items() if k.startswith("graph_")},
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "eager_host_probe.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({"host_us": med, "queued_host_us": result["queued_host_us"], "loops": result["loop_host_vs_device_us"], "plan_stats": result["plan_stats"]},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
