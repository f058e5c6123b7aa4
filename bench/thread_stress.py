"""Threads on their own streams launching one cf.linear while plans are dropped beside them.

Each trial: four threads, each on its own torch stream, call cf.linear 50 times and check every
output against torch's; every third trial first drops the in-memory plans (plans.clear()), so the
next calls reload and re-capture them while the dropped ones are freed. Counts every failure kind:
an exception in a thread (with its message), a wrong output, a launch-graph capture that failed.
While cf captured on a stream of torch's pool, one that some thread was handed too, the H200 showed
all three within seconds (docs/decisions.md, "The side stream is no pool stream"); --pool-side-stream
brings that back for an A/B. --memo-churn adds a thread that empties the call memo over and over, so
that threads' calls often find an entry another thread is dropping: the window of the C path's
borrowed-entry crash (docs/decisions.md, "The threaded C-path crash"; bench/crash_hunt.sh builds the
C path without its fix for the A/B).

    python3 bench/thread_stress.py --seconds 30 --native 1 --out bench/results/thread_stress.json
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Log(logging.Handler):
    def __init__(self):
        super().__init__()
        self.msgs = []

    def emit(self, record):
        self.msgs.append(record.getMessage())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--native", type=int, choices=(0, 1), default=1, help="the C call path (1) or Python's (0)")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--clear-every", type=int, default=3, help="drop the in-memory plans every Nth trial")
    ap.add_argument("--pool-side-stream", action="store_true",
                    help="capture on a stream of torch's pool, as cf did before it made its own (the fault's A/B)")
    ap.add_argument("--memo-churn", action="store_true",
                    help="a thread empties the call memo (plans.FAST) every 0.2 ms while the trials run")
    ap.add_argument("--out", default=None, help="JSON file to write (stdout always gets it)")
    args = ap.parse_args(argv)

    import torch

    import cudnn_fuse as cf
    from cudnn_fuse import launch_graphs, ops, plans

    handler = _Log()
    lg = logging.getLogger("cudnn_fuse")
    lg.setLevel(logging.INFO)
    lg.addHandler(handler)
    if ops.set_native(bool(args.native)) != bool(args.native):
        print("the C path was asked for, but cudnn_fuse._native is not built", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    x = torch.randn(64, 256, device="cuda").half()
    w = (torch.randn(256, 256, device="cuda") * 0.05).half()
    b = torch.randn(256, device="cuda").half()
    want = torch.relu(x.float() @ w.float().t() + b.float())
    if args.pool_side_stream:
        plans._side_streams[0] = torch.cuda.Stream(0).cuda_stream
    side = plans._side_stream(0)
    kinds, first = collections.Counter(), {}
    calls = trials = shared = 0
    churned, stop_churn = [0], threading.Event()

    def churn():
        while not stop_churn.is_set():
            plans.FAST.clear()
            churned[0] += 1
            time.sleep(0.0002)

    churner = threading.Thread(target=churn, daemon=True) if args.memo_churn else None
    if churner is not None:
        churner.start()
    t_end = time.time() + args.seconds
    while time.time() < t_end:
        trials += 1
        if trials % args.clear_every == 0:
            plans.clear()
        errors = []

        def work(stream):
            try:
                with torch.cuda.stream(stream), torch.no_grad():
                    for _ in range(50):
                        y = cf.linear(x, w, b, activation="relu")
                        stream.synchronize()
                        err = ((y.float() - want).norm() / want.norm()).item()
                        if not err < 1e-2:
                            raise AssertionError(f"wrong output: relative error {err:.3g}")
            except Exception as exc:  # noqa: BLE001 - every kind is counted
                errors.append(exc)

        torch.cuda.synchronize()
        f0, n0 = launch_graphs.STATS.failures, len(handler.msgs)
        streams = [torch.cuda.Stream() for _ in range(args.threads)]
        shared += sum(st.cuda_stream == side for st in streams)  # a thread handed the side stream itself
        threads = [threading.Thread(target=work, args=(st,)) for st in streams]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        calls += 50 * args.threads
        found = [f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" for e in errors]
        if launch_graphs.STATS.failures != f0:
            found += ["capture failed: " + m[:200] for m in handler.msgs[n0:] if "CUDA graphs" in m] or \
                ["capture failed (no message)"]
        for k in found:
            kinds[k] += 1
            first.setdefault(k, trials)
    stop_churn.set()
    if churner is not None:
        churner.join()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "native": bool(args.native),
           "threads": args.threads, "clear_every": args.clear_every, "pool_side_stream": args.pool_side_stream,
           "threads_given_the_side_stream": shared,
           "memo_churn": args.memo_churn, "memo_clears": churned[0], "seconds": args.seconds, "trials": trials,
           "calls": calls, "failed_trials_by_kind": dict(kinds), "first_trial_by_kind": first,
           "graph_stats": launch_graphs.STATS.snapshot(), "dropped_plans_waiting": plans.released()}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if not kinds else 1


if __name__ == "__main__":
    sys.exit(main())
