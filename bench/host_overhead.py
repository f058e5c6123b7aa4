"""Host time per call of a tiny fused op, by path (issue 6's host-overhead gap).

`cf.linear(x, w, b, activation="relu")` at 64x256x256 fp16, where the host is the
bottleneck: the memoized fast path (what users get by default: a repeated pointer set replays
as its captured kernel, the call in C where cudnn_fuse._native is built), the same on the Python
path (``eager_python``, ``cf.ops.set_native(False)``), the same replayed as a one-kernel graph (``eager_graph_replays``) and as
its kernel with every attribute the captured node had (``eager_node_attrs``, before
launch_graphs.Driver.trim_attrs), the same with launch graphs off (each call a raw cuDNN execute), the
first-call path with the memo off, the same with the public cuDNN execute instead of raw
pointers, the op replayed under `cf.capture` (per op, 100 ops a graph, and one op a graph:
torch's CUDAGraph replay), and torch's `F.relu(F.linear(x, w, b))`. All in one process,
interleaved rounds, median of rounds.

Also the device side: CUDA-event time per call of a GPU-bound 2048^3 cf.linear, launch
graphs on and off (does a one-kernel graph cost the GPU anything?).

    python3 bench/host_overhead.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import cudnn_fuse as cf  # noqa: E402
from bench.common import host_row_calls, host_row_operands, host_us  # noqa: E402
from cudnn_fuse import launch_graphs, ops, plans  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--calls", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    x, w, b = host_row_operands()
    chain = 100
    memo = ops._memo

    def no_memo(*_):
        return None, None

    cf_op, torch_op, chain_fn = host_row_calls(x, w, b, chain)

    X = torch.randn(2048, 2048, device="cuda", dtype=torch.float16)
    W = torch.randn(2048, 2048, device="cuda", dtype=torch.float16) * 0.02
    B = torch.randn(2048, device="cuda", dtype=torch.float16)

    def device_us(n=200):
        for _ in range(10):
            cf.linear(X, W, B, activation="relu")
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(n):
            cf.linear(X, W, B, activation="relu")
        e1.record()
        e1.synchronize()
        return 1e3 * e0.elapsed_time(e1) / n

    with torch.no_grad():
        captured = cf.capture(chain_fn, x)
        single = cf.capture(cf_op)
        native = ops.native_enabled()
        rows = {k: [] for k in ("eager", "eager_python", "eager_graph_replays", "eager_node_attrs", "eager_no_launch_graphs", "eager_no_memo", "eager_public_execute", "captured",
                                "captured_single_op", "torch_eager")}
        dev = {"graphs": [], "no_graphs": []}
        graphs_default = launch_graphs.ENABLED
        for _ in range(args.rounds):
            rows["torch_eager"].append(host_us(torch_op, args.calls))
            cf.set_launch_graphs(True)
            plans.clear()  # plans built from now on get launch graphs (the default)
            rows["eager"].append(host_us(cf_op, args.calls))
            if native:  # the same calls on the Python path (set_native clears the memo)
                ops.set_native(False)
                plans.clear()
                rows["eager_python"].append(host_us(cf_op, args.calls))
                ops.set_native(True)
                plans.clear()
            drv = launch_graphs.driver()
            if drv is not None:  # the same with one-kernel captures replayed as graphs (before KernelReplay)
                drv.kernels = False
                plans.clear()
                rows["eager_graph_replays"].append(host_us(cf_op, args.calls))
                drv.kernels = launch_graphs.KERNEL_REPLAY
                if drv.kernels:  # kernel replays with every attribute the captured node had (before trim_attrs)
                    drv.trim = False
                    plans.clear()
                    rows["eager_node_attrs"].append(host_us(cf_op, args.calls))
                    drv.trim = launch_graphs.TRIM_ATTRS
                plans.clear()
            dev["graphs"].append(device_us())
            cf.set_launch_graphs(False)
            rows["eager_no_launch_graphs"].append(host_us(cf_op, args.calls))
            dev["no_graphs"].append(device_us())
            plans.clear()  # the memo-off and public-execute rows: raw launches, as before graphs
            ops.set_native(False)  # the C memo would serve them otherwise
            ops._memo = no_memo
            rows["eager_no_memo"].append(host_us(cf_op, args.calls))
            plans.RAW_EXECUTE = False
            plans.clear()
            rows["eager_public_execute"].append(host_us(cf_op, args.calls))
            plans.RAW_EXECUTE = True
            plans.clear()
            ops._memo = memo
            ops.set_native(native)
            cf.set_launch_graphs(graphs_default)
            cf_op()
            rows["captured"].append(host_us(captured.replay, max(1, args.calls // chain)) / chain)
            rows["captured_single_op"].append(host_us(single.replay, args.calls))
    rows = {k: v for k, v in rows.items() if v}
    med = {k: round(statistics.median(v), 2) for k, v in rows.items()}
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "op": "cf.linear(x[64,256], w[256,256], b, activation='relu') fp16",
        "native": native,
        "native_stats": ops._native.stats() if ops._native is not None else None,
        "native_torch_helpers": {"tensor_guards": ops._tensor_guards is not None, "alloc_cuda": ops._alloc_cuda is not None,
                                 "data_ptr_fn": bool(ops._data_ptr_fn)},
        "calls_per_round": args.calls,
        "rounds": args.rounds,
        "host_us_per_call": med,
        "ratio_to_torch_eager": {k: round(v / med["torch_eager"], 3) for k, v in med.items()},
        "all_rounds_us": {k: [round(t, 2) for t in v] for k, v in rows.items()},
        "device_us_per_call_2048cubed": {k: round(statistics.median(v), 3) for k, v in dev.items()},
        "device_all_rounds_us": {k: [round(t, 3) for t in v] for k, v in dev.items()},
        "plan_stats": {k: v for k, v in cf.plan_stats().items() if k.startswith("graph_")},
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host_overhead.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("host_us_per_call", "ratio_to_torch_eager", "device_us_per_call_2048cubed",
                                             "plan_stats")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
