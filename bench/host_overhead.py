"""Host time per call of a tiny fused op, by call path; writes host_overhead.json.

`cf.linear(x, w, b, activation="relu")` at 64x256x256 fp16, where the host is the bottleneck:

- ``eager``: what users get by default (the memoized call, in C where cudnn_fuse._native is built,
  its launches replayed from launch graphs);
- ``eager_python``: the same on the Python call path (``cudnn_fuse.ops.set_native(False)``);
- ``eager_no_launch_graphs``: the same with launch graphs off (``cf.set_launch_graphs(False)``);
- ``eager_torch_kernels``: the same call where the plan runs torch's kernels (a shape where torch's
  timed faster: ``torch_engine.TorchPlan`` behind the same memo), the host cost the torch candidate's
  rule (``autotune.TORCH_HOST_MS``) weighs;
- ``captured``: the op replayed under ``cf.capture``, per op of a 100-op graph;
- ``captured_single_op``: one op a graph (torch's CUDAGraph replay cost);
- ``torch_eager``: torch's ``F.relu(F.linear(x, w, b))``.

All in one process, in interleaved rounds; each row is the median of its rounds. Also the device
side: CUDA-event time per call of a GPU-bound 2048^3 cf.linear with launch graphs on and off.

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
from bench.common import host_row_calls, host_row_operands, host_us, write_json  # noqa: E402
from cudnn_fuse import loader, ops  # noqa: E402

ROWS = ("eager", "eager_python", "eager_no_launch_graphs", "eager_torch_kernels", "captured", "captured_single_op", "torch_eager")


class _torch_kernels:
    """Within: plans loaded or built run torch's kernels (as where torch's timed faster)."""

    def __enter__(self):
        self.orig = loader._maybe_torch
        loader._maybe_torch = lambda plan, meta: self.orig(plan, {**meta, "use_torch": True})
        loader.torch_check = lambda plan, spec, device: {"use_torch": True}

    def __exit__(self, *exc):
        loader._maybe_torch = self.orig
        loader.torch_check = _CHECK


_CHECK = loader.torch_check


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--calls", type=int, default=10000, help="calls per row and round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    x, w, b = host_row_operands()
    chain = 100
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
        rows = {k: [] for k in ROWS}
        dev = {"graphs": [], "no_graphs": []}
        for _ in range(args.rounds):
            rows["torch_eager"].append(host_us(torch_op, args.calls))
            cf.set_launch_graphs(True)
            loader.clear()  # plans are reloaded, so that launch graphs serve them
            rows["eager"].append(host_us(cf_op, args.calls))
            if native:  # the same calls on the Python path (set_native clears the memo)
                ops.set_native(False)
                loader.clear()
                rows["eager_python"].append(host_us(cf_op, args.calls))
                ops.set_native(True)
                loader.clear()
            dev["graphs"].append(device_us())
            cf.set_launch_graphs(False)
            rows["eager_no_launch_graphs"].append(host_us(cf_op, args.calls))
            dev["no_graphs"].append(device_us())
            cf.set_launch_graphs(True)
            loader.clear()
            with _torch_kernels():
                rows["eager_torch_kernels"].append(host_us(cf_op, args.calls))
            loader.clear()
            loader.clear()
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
        "calls_per_round": args.calls,
        "rounds": args.rounds,
        "host_us_per_call": med,
        "ratio_to_torch_eager": {k: round(v / med["torch_eager"], 3) for k, v in med.items()},
        "all_rounds_us": {k: [round(t, 2) for t in v] for k, v in rows.items()},
        "device_us_per_call_2048cubed": {k: round(statistics.median(v), 3) for k, v in dev.items()},
        "device_all_rounds_us": {k: [round(t, 3) for t in v] for k, v in dev.items()},
        "plan_stats": {k: v for k, v in cf.plan_stats().items() if k.startswith("graph_")},
    }
    write_json(os.path.join(args.out, "host_overhead.json"), result)
    print(json.dumps({k: result[k] for k in ("host_us_per_call", "ratio_to_torch_eager", "device_us_per_call_2048cubed",
                                             "plan_stats")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
