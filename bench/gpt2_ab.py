"""GPT-2 small bf16 8x1024 (use_cache=False, as in the peers suite), its compiled variants side
by side: torch.compile alone against torch.compile over the optimize()d model (and, for inference,
cf.capture and torch.compile's reduce-overhead), timed in interleaved rounds in one process so
that clock and host drift hit every variant alike. Each round times ``--steps`` back-to-back
steps of each variant between CUDA events; the result is the median over rounds, with the
spread (max/min - 1) of each variant's rounds.

    python3 bench/gpt2_ab.py --out DIR [--train]     # -> DIR/gpt2_ab_{infer,train}.json
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from bench.common import device_name, write_json  # noqa: E402
from cudnn_fuse.benchsuite import gpt2_small  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reverse", action="store_true", help="build (compile) the variants in the reverse order")
    args = ap.parse_args(argv)
    import transformers

    torch.manual_seed(0)
    model, ids, run = gpt2_small(args.train)

    def step(m):
        return run(m, ids)

    variants, setup_s, makers = {}, {}, []

    def add(name, make):
        makers.append((name, make))

    def build(name, make):
        t0 = time.perf_counter()
        fn = make()
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        setup_s[name] = round(time.perf_counter() - t0, 2)
        variants[name] = fn

    torch._dynamo.reset()
    add("torch_compile", lambda: (lambda cm: lambda: step(cm))(torch.compile(copy.deepcopy(model), dynamic=False)))
    add("cf_compiled", lambda: (lambda cm: lambda: step(cm))(torch.compile(cf.optimize(model), dynamic=False)))
    if not args.train:
        opt = cf.optimize(model)
        add("cf_captured", lambda: (lambda g: lambda: g(ids))(cf.capture(lambda i: run(opt, i), ids)))
        add("torch_compile_reduce_overhead",
            lambda: (lambda cm: lambda: step(cm))(torch.compile(copy.deepcopy(model), mode="reduce-overhead",
                                                                dynamic=False)))
    for name, make in (makers[::-1] if args.reverse else makers):
        build(name, make)
    for fn in variants.values():  # one more untimed call each: a variant built before cf.optimize() ran
        fn()                      # recompiles once (its guards saw transformers' packed-sequence check change)
    rounds = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            s.record()
            for _ in range(args.steps):
                fn()
            e.record()
            e.synchronize()
            rounds[name].append(s.elapsed_time(e) / args.steps)
    med = {k: round(statistics.median(v), 3) for k, v in rounds.items()}
    res = {"device": device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
           "mode": "train" if args.train else "infer", "built_in_order": list(variants), "rounds": args.rounds, "steps_per_round": args.steps,
           "median_ms": med, "spread": {k: round(max(v) / min(v) - 1, 3) for k, v in rounds.items()},
           "ratio_torch_compile_over_cf_compiled": round(med["torch_compile"] / med["cf_compiled"], 3),
           "setup_s": setup_s, "all_rounds_ms": {k: [round(x, 3) for x in v] for k, v in rounds.items()}}
    write_json(os.path.join(args.out, f"gpt2_ab_{res['mode']}{'_reversed' if args.reverse else ''}.json"), res)
    print(res["mode"], med, "spread", res["spread"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
