"""Do launch graphs cost device time on batch-1 kernels? (the peers conv1 part, 2026-12-01)

With launch graphs on by default, the peers suite's batch-1 conv rows read 0.3-2 us slower in
device time than in the earlier run with them off (the residual rows most). This times the same
plans in one process, in alternating rounds, three ways: ``on`` (the default: a launch whose
stream still has work queued goes raw, launch_graphs.REPLAY_WHEN_BUSY False), ``always`` (every
captured pointer set replays, the behaviour before), ``off`` (no graphs). Device time per call
behind a checked spin with L2 flushed between calls (the suite's device mode,
``benchsuite.device_times``) and wall time per call back to back (``wall_block_ms``, the host's
cost included); and the host cost of one cuStreamQuery through ctypes.

    python3 bench/graph_device_probe.py --out bench/results
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

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
        modes = ("on", "always", "off")
        dev, wall = {m: [] for m in modes}, {m: [] for m in modes}
        counts = {m: {"replays": 0, "busy_raw": 0} for m in modes}
        for rnd in range(args.rounds):
            for mode in (modes if rnd % 2 == 0 else modes[::-1]):
                cf.set_launch_graphs(mode != "off")
                launch_graphs.REPLAY_WHEN_BUSY = mode == "always"
                before = launch_graphs.STATS.replays, launch_graphs.STATS.busy
                host = host_enqueue_us(fn, sets)
                dev[mode].append(statistics.median(device_times(fn, sets, 100, host, flush)))
                wall[mode].append(statistics.median(wall_block_ms(fn, sets, 200, 10)))
                counts[mode]["replays"] += launch_graphs.STATS.replays - before[0]
                counts[mode]["busy_raw"] += launch_graphs.STATS.busy - before[1]
        cf.set_launch_graphs(True)
        launch_graphs.REPLAY_WHEN_BUSY = False
        row = {"name": name, "device_ms": {m: round(statistics.median(v), 5) for m, v in dev.items()},
               "wall_ms": {m: round(statistics.median(v), 5) for m, v in wall.items()},
               "device_rounds_ms": {m: [round(x, 5) for x in v] for m, v in dev.items()},
               "wall_rounds_ms": {m: [round(x, 5) for x in v] for m, v in wall.items()},
               "counts": counts}
        rows.append(row)
        print(f"{name:32s} device " + " ".join(f"{m} {row['device_ms'][m]:.5f}" for m in modes)
              + "  wall " + " ".join(f"{m} {row['wall_ms'][m]:.5f}" for m in modes) + f"  {counts}", flush=True)
    drv, stream = launch_graphs.driver(), torch.cuda.current_stream().cuda_stream
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20000):
        drv.query(stream)
    query_us = 1e6 * (time.perf_counter() - t0) / 20000
    print(f"cuStreamQuery through ctypes: {query_us:.3f} us a call")
    write_json(os.path.join(args.out, "graph_device_probe.json"),
               {"device": device_name(), "torch": torch.__version__, "rounds": args.rounds,
                "stream_query_us": round(query_us, 3), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
