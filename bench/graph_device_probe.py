"""Do launch graphs cost device time on batch-1 kernels? (the peers conv1 part, 2026-12-01)

With launch graphs on by default, the peers suite's four batch-1 residual conv rows read 1.7-2.3 us
slower in device time than in the run before, with graphs off. This times the same plans with
graphs on and off in one process, in alternating rounds: device time per call behind a checked
spin with L2 flushed between calls (the suite's device mode, ``benchsuite.device_times``) and wall
time per call back to back (``wall_block_ms``, the host's cost included).

Results (bench/results/launch_graphs/graph_device_probe.json, one H200): behind queued work the
residual convs' replays took 1.8-2.2 us longer than their stream launches (same kernel, same
kernel time in torch.profiler), the others 0.1-0.5 us; back to back the replays took 4.6-15 us
less a call. Commit 15a5880 tried launching raw whenever the stream still had work queued (one
cuStreamQuery a launch, 0.99 us through ctypes; graph_device_probe_busy_check.json, with a third
mode "always"): the residual rows' device time came back to graphs-off's (0.85-0.98 us less than
replaying every time, on that machine), but the others lost 0.36-0.50 us, every call paid 2.3-3.0
us more wall time, and host_overhead's eager call read 19.25 us (16.93 that day without it).
Reverted: the graphs replay whenever they exist.

    python3 bench/graph_device_probe.py --out bench/results
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from bench.common import device_name, device_times, l2_bytes, wall_block_ms, write_json  # noqa: E402
from cudnn_fuse import launch_graphs  # noqa: E402
from cudnn_fuse.benchsuite import host_enqueue_us  # noqa: E402

# (name, c, k, hw, r, stride, residual, activation): rows of the conv1 part
CONVS = [
    ("c64_k256_56_r1_bias", 64, 256, 56, 1, 1, False, None),
    ("c64_k256_56_r1_bias_res_relu", 64, 256, 56, 1, 1, True, "relu"),
    ("c256_k1024_14_r1_bias_res_relu", 256, 1024, 14, 1, 1, True, "relu"),
    ("c512_k2048_7_r1_bias_res_relu", 512, 2048, 7, 1, 1, True, "relu"),
    ("c64_k64_56_r3_bias_relu", 64, 64, 56, 3, 1, False, "relu"),
    ("c2048_k512_7_r1_bias_relu", 2048, 512, 7, 1, 1, False, "relu"),
]


def _sets(c, k, hw, r, stride, residual, n=16):
    h = torch.float16
    out_hw = (hw + 2 * (r // 2) - r) // stride + 1
    cl = torch.channels_last
    return [(torch.randn(1, c, hw, hw, device="cuda", dtype=h).to(memory_format=cl),
             (torch.randn(k, c, r, r, device="cuda", dtype=h) * (c * r * r) ** -0.5).to(memory_format=cl),
             torch.randn(k, device="cuda", dtype=h),
             torch.randn(1, k, out_hw, out_hw, device="cuda", dtype=h).to(memory_format=cl) if residual else None)
            for _ in range(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    flush = torch.empty(3 * l2_bytes() // 4, dtype=torch.int32, device="cuda")
    rows = []
    for name, c, k, hw, r, s, res, act in CONVS:
        sets = _sets(c, k, hw, r, s, res)

        def fn(x, w, b, rr, s=s, r=r, act=act):
            return cf.conv2d(x, w, b, s, r // 2, activation=act, residual=rr)

        for i in range(64):  # build the plan and capture every set's graph (3 sightings each)
            fn(*sets[i % len(sets)])
        torch.cuda.synchronize()
        dev = {"on": [], "off": []}
        wall = {"on": [], "off": []}
        replays = {"on": 0, "off": 0}
        for rnd in range(args.rounds):
            for mode in (("on", "off") if rnd % 2 == 0 else ("off", "on")):
                cf.set_launch_graphs(mode == "on")
                before = launch_graphs.STATS.replays
                host = host_enqueue_us(fn, sets)
                dev[mode].append(statistics.median(device_times(fn, sets, 100, host, flush)))
                wall[mode].append(statistics.median(wall_block_ms(fn, sets, 200, 10)))
                replays[mode] += launch_graphs.STATS.replays - before
        cf.set_launch_graphs(True)
        row = {"name": name, "device_ms": {m: round(statistics.median(v), 5) for m, v in dev.items()},
               "wall_ms": {m: round(statistics.median(v), 5) for m, v in wall.items()},
               "device_rounds_ms": {m: [round(x, 5) for x in v] for m, v in dev.items()},
               "wall_rounds_ms": {m: [round(x, 5) for x in v] for m, v in wall.items()},
               "replays": replays}
        rows.append(row)
        print(f"{name:34s} device on {row['device_ms']['on']:.5f} off {row['device_ms']['off']:.5f}   "
              f"wall on {row['wall_ms']['on']:.5f} off {row['wall_ms']['off']:.5f}   replays {replays}", flush=True)
    write_json(os.path.join(args.out, "graph_device_probe.json"),
               {"device": device_name(), "torch": torch.__version__, "rounds": args.rounds, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
