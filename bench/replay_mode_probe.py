"""Why does the eager batch-2 conv cost more with kernel replays than with graph replays?

host_breakdown.json (this stop): ``cf.conv2d`` 2x128x8x8 3x3 no-grad read 17.91 us a call with
kernel replays (the default), 10.38 with graph replays only (CUDNN_FUSE_KERNEL_REPLAY=0), while
the fixed-pointer launch of its plan alone read 6.96 / 6.85. This probe times, in the launch
mode the environment selects (run it once per mode), for cf's conv and the issue-6 host row's
linear and for their plans' fixed-pointer launches:
  * ``wall_us``: back-to-back calls, synced at the end (what host_breakdown reads);
  * ``queued_us``: host time a call while the GPU is held busy by a spin (host cost alone);
  * ``device_us``: device time a call, events around 500 calls queued behind a spin;
and a cProfile of 3000 conv calls (top functions by own time).

    CUDNN_FUSE_KERNEL_REPLAY=0 python3 bench/replay_mode_probe.py --out bench/results/launch_graphs --tag graph

With ``--interleave`` it runs both replay kinds in one process instead, alternating by round (ABBA:
the driver's ``kernels`` switch flipped and every plan's captures dropped, so the next calls capture
again in the other kind), the comparison two separate processes could not settle (two runs read the
conv 14.55 / 17.32 us and 17.89 / 9.84 us, kernel / graph replays). Not run yet.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import cudnn_fuse as cf  # noqa: E402
from bench.common import profile_text, write_json  # noqa: E402
from cudnn_fuse import autotune, launch_graphs, plans  # noqa: E402
from cudnn_fuse.builders import roles_of  # noqa: E402


def spin(us):
    torch.cuda._sleep(int(2e3 * us))


def wall_us(f, calls=2000):
    for _ in range(50):
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        f()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t0) / calls


def queued_us(f, calls=500):
    torch.cuda.synchronize()
    spin(calls * 60 + 20000)
    t0 = time.perf_counter()
    for _ in range(calls):
        f()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * dt / calls


def device_us(f, calls=500):
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    spin(calls * 60 + 20000)
    s.record()
    for _ in range(calls):
        f()
    e.record()
    e.synchronize()
    return 1e3 * s.elapsed_time(e) / calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "launch_graphs"))
    ap.add_argument("--tag", default="default")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--interleave", action="store_true",
                    help="kernel and graph replays in this one process, alternating by round (tag 'interleaved')")
    args = ap.parse_args(argv)
    if args.interleave:
        args.tag = "interleaved"
    drv = launch_graphs.driver()
    if args.interleave and (drv is None or not hasattr(drv, "_launch_kernel")):
        ap.error("--interleave needs launch graphs on and a driver with kernel replays")
    torch.manual_seed(0)
    cl = torch.channels_last
    x = torch.randn(2, 128, 8, 8, device="cuda", dtype=torch.float16).to(memory_format=cl)
    w = (0.05 * torch.randn(128, 128, 3, 3, device="cuda", dtype=torch.float16)).to(memory_format=cl)
    b = torch.randn(128, device="cuda", dtype=torch.float16)
    lx = torch.randn(64, 256, device="cuda", dtype=torch.float16)
    lw = torch.randn(256, 256, device="cuda", dtype=torch.float16) * 0.06
    lb = torch.randn(256, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        cf.conv2d(x, w, b, padding=1, activation="relu")
        cf.linear(lx, lw, lb, activation="relu")
        torch.cuda.synchronize()
        by_op = {p.spec.op: p for p in plans.plans_in_memory()}

        def fixed(plan):
            bufs = autotune.random_buffers(plan.spec, roles_of(plan.spec), 0, 1)[0]
            ptrs = [t.data_ptr() for t in bufs]
            return (lambda: plan.launch(ptrs)), bufs

        conv_launch, keep1 = fixed(by_op["conv2d"])
        lin_op = next(k for k in by_op if k != "conv2d")
        lin_launch, keep2 = fixed(by_op[lin_op])
        rows = {
            "cf_conv": lambda: cf.conv2d(x, w, b, padding=1, activation="relu"),
            "launch_conv": conv_launch,
            "cf_linear": lambda: cf.linear(lx, lw, lb, activation="relu"),
            "launch_linear": lin_launch,
            "torch_conv": lambda: torch.relu_(torch.conv2d(x, w, b, padding=1)),
        }
        modes = (["kernel", "graph"] if args.interleave else [args.tag])
        res = {f"{k}:{m}" if args.interleave else k: {"wall_us": [], "queued_us": [], "device_us": []}
               for m in modes for k in rows}
        before = launch_graphs.STATS.snapshot()
        for r in range(args.rounds):
            for m in (modes if r % 2 == 0 else modes[::-1]):
                if args.interleave:  # the other replay kind from here: drop every capture, capture again
                    drv.kernels = m == "kernel"
                    for p in plans.plans_in_memory():
                        if p._graphs is not None:
                            p._graphs.release()
                for k, f in rows.items():
                    key = f"{k}:{m}" if args.interleave else k
                    res[key]["wall_us"].append(round(wall_us(f), 2))
                    res[key]["queued_us"].append(round(queued_us(f), 2))
                    res[key]["device_us"].append(round(device_us(f), 2))
        after = launch_graphs.STATS.snapshot()
        if args.interleave:
            drv.kernels = launch_graphs.KERNEL_REPLAY
        profile = profile_text(rows["cf_conv"], 3000, 15)
    doc = {"device": torch.cuda.get_device_name(), "tag": args.tag,
           "env": {k: v for k, v in os.environ.items() if k.startswith("CUDNN_FUSE_")},
           "engines": {k: p.engine for k, p in by_op.items()},
           "median": {k: {m: statistics.median(v) for m, v in r.items()} for k, r in res.items()},
           "rounds": res, "graph_counts": {k: after[k] - before[k] for k in after if isinstance(after[k], int)},
           "profile_cf_conv": profile}
    for k, r in doc["median"].items():
        print(f"{args.tag:8s} {k:14s} " + "  ".join(f"{m} {v:7.2f}" for m, v in r.items()), flush=True)
    write_json(os.path.join(args.out, f"replay_mode_probe_{args.tag}.json"), doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
