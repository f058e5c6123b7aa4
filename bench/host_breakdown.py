"""Host time per call of a conv layer's training pieces, cf vs torch (issue 4's conv step).

bench/step_profile.py showed the cf conv-bias-ReLU step host-bound (its kernels take 1.85 ms,
the step 3.9-5.5 ms). This splits the host time of one layer at a shape small enough that
the GPU never holds the host back (2x128x8x8 fp16, channels_last, 3x3): the cuDNN launch
alone of each graph (forward, activation-grad + dbias, dgrad, wgrad), the cf forward and
backward functions, and a whole forward + backward through autograd, against torch's.
Median of interleaved rounds, one process; per row, how much the launch-graph counters rose
(``graph_counts``: whether the row's launches replayed or launched raw).

    python3 bench/host_breakdown.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import types

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import cudnn_fuse as cf  # noqa: E402
from bench.common import host_us, profile_text  # noqa: E402
from cudnn_fuse import autotune, plans, torch_ops  # noqa: E402
from cudnn_fuse.builders import roles_of  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--hw", type=int, default=8)
    ap.add_argument("--profile", action="store_true", help="also cProfile 500 cf steps (host_breakdown_profile.txt)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cl = torch.channels_last
    C = 128
    x = torch.randn(args.batch, C, args.hw, args.hw, device="cuda", dtype=torch.float16).to(memory_format=cl)
    w = (0.05 * torch.randn(C, C, 3, 3, device="cuda", dtype=torch.float16)).to(memory_format=cl)
    b = torch.randn(C, device="cuda", dtype=torch.float16)
    xg, wg, bg = (t.detach().clone().requires_grad_() for t in (x, w, b))
    gy = torch.randn_like(x)

    def cf_step():
        cf.conv2d(xg, wg, bg, padding=1, activation="relu").backward(gy)

    def torch_step():
        F.relu(F.conv2d(xg, wg, bg, padding=1)).backward(gy)

    class _PyNode(torch.autograd.Function):  # the least a Python autograd node can be: one copy forward, none back
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            return g

    def py_node_step():  # a Python autograd node's hand-over to autograd's device thread, without cf
        _PyNode.apply(xg).backward(gy)

    def cpp_node_step():  # the same graph of one C++ node (CloneBackward)
        xg.clone().backward(gy)

    def on_calling_thread(step):  # the backward run on the calling thread, not autograd's device thread
        def run():
            with torch.autograd.set_multithreading_enabled(False):
                step()
        return run

    cf_step()  # builds every graph of the layer
    torch.cuda.synchronize()
    by_op = {}
    for p in plans.plans_in_memory():
        by_op.setdefault(p.spec.op, p)

    def raw(plan):
        bufs = autotune.random_buffers(plan.spec, roles_of(plan.spec), 0, 1)[0]
        ptrs = [t.data_ptr() for t in bufs]
        return (lambda: plan.launch(ptrs)) if plan.raw else (lambda: plan.run(bufs))

    y = cf.conv2d(x, w, b, padding=1, activation="relu")
    ctx = types.SimpleNamespace(geo=((1, 1), (1, 1), (1, 1), (1, 1), 1), act="relu", slope=0.01, has_bias=True,
                                has_residual=False, needs_input_grad=[True] * 12)
    fns = {
        "torch_fwd": lambda: F.relu(F.conv2d(x, w, b, padding=1)),
        "cf_fwd": lambda: cf.conv2d(x, w, b, padding=1, activation="relu"),
        "cf_bwd_fn": lambda: torch_ops._conv2d_backward_cudnn(ctx, x, w, y, b, None, gy),
        "torch_bwd_ops": lambda: (torch.ops.aten.threshold_backward(gy, y, 0).sum((0, 2, 3)),
                                  torch.ops.aten.convolution_backward(gy, x, w, None, [1, 1], [1, 1], [1, 1], False,
                                                                      [0, 0], 1, [True, True, False])),
        "cf_step": cf_step,
        "torch_step": torch_step,
        "cf_step_calling_thread": on_calling_thread(cf_step),
        "torch_step_calling_thread": on_calling_thread(torch_step),
        "py_node_step": py_node_step,
        "py_node_step_calling_thread": on_calling_thread(py_node_step),
        "cpp_node_step": cpp_node_step,
        "cpp_node_step_calling_thread": on_calling_thread(cpp_node_step),
    }
    for op, p in sorted(by_op.items()):
        fns[f"launch_{op}"] = raw(p)
    with torch.no_grad():
        for f in fns.values():
            with torch.enable_grad():
                f()
    rounds = {k: [] for k in fns}
    graph_counts = {k: {} for k in fns}  # per row, over all rounds: the launch-graph counters' increase
    from cudnn_fuse import launch_graphs

    for _ in range(args.rounds):
        for k, f in fns.items():
            before = launch_graphs.STATS.snapshot()
            if "_step" in k:
                rounds[k].append(host_us(f, args.calls))
            else:
                with torch.no_grad():
                    rounds[k].append(host_us(f, args.calls))
            after = launch_graphs.STATS.snapshot()
            for name in ("graph_captures", "graph_kernels", "graph_replays", "graph_failures"):
                graph_counts[k][name] = graph_counts[k].get(name, 0) + after[name] - before[name]
    med = {k: round(statistics.median(v), 2) for k, v in rounds.items()}
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "layer": f"conv2d {args.batch}x{C}x{args.hw}x{args.hw} 3x3 fp16 channels_last, bias, relu",
              "calls_per_round": args.calls, "rounds": args.rounds, "host_us_per_call": med,
              "engines": {op: p.engine for op, p in by_op.items()}, "raw_launch": {op: p.raw for op, p in by_op.items()},
              "all_rounds_us": {k: [round(v, 2) for v in r] for k, r in rounds.items()},
              "graph_counts": graph_counts}
    for k, v in med.items():
        print(f"{k:28s} {v:8.2f} us")
    os.makedirs(args.out, exist_ok=True)
    if args.profile:  # where the cf step's host time goes, by Python function (C calls inside them included)
        with open(os.path.join(args.out, "host_breakdown_profile.txt"), "w") as f:
            f.write(profile_text(cf_step, 500, 35))
    with open(os.path.join(args.out, "host_breakdown.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
