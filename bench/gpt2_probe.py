"""GPT-2 small bf16 8x1024, one process: cf eager, cf captured (inference), torch eager, then
torch.compile over the optimize()d model with each compile-inline setting (which cf ops
torch.compile traces as torch ops: cf.set_compile_inline), and torch.compile alone; wall ms per
step (events around 20 steps after 3 warm-up steps), written after each variant.

    python3 bench/gpt2_probe.py --out DIR [--train]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from cudnn_fuse.benchsuite import gpt2_small  # noqa: E402

INLINE = {"cf_compiled": ("linear", "matmul", "sdpa"), "cf_compiled_sdpa_op": ("linear", "matmul"),
          "cf_compiled_all_ops": ()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--train", action="store_true", help="a training step (forward, loss, backward)")
    args = ap.parse_args(argv)
    import transformers

    model, ids, run = gpt2_small(args.train)
    mode = "train" if args.train else "infer"
    res = {"device": torch.cuda.get_device_name(), "transformers": transformers.__version__, "mode": mode,
           "inline": {k: list(v) for k, v in INLINE.items()}}
    path = os.path.join(args.out, f"gpt2_probe_{mode}.json")

    def step(m):
        return run(m, ids)

    ref = step(model).float()

    def timed(name, fn):
        t0 = time.perf_counter()
        out = None
        for _ in range(3):
            out = fn()
        torch.cuda.synchronize()
        setup = time.perf_counter() - t0
        err = ((out.float() - ref).norm() / ref.norm()).item()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20):
            fn()
        e.record()
        torch.cuda.synchronize()
        res[name] = {"ms": round(s.elapsed_time(e) / 20, 4), "setup_s": round(setup, 2), "rel_err": float(f"{err:.3g}")}
        print(name, res[name], flush=True)
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    opt = cf.optimize(model)
    timed("cf", lambda: step(opt))
    if not args.train:
        def fwd(i):
            with torch.no_grad():
                return opt(i).logits
        g = cf.capture(fwd, ids)
        timed("cf_captured", lambda: g(ids))
    timed("torch_eager", lambda: step(model))
    for name, inline in INLINE.items():
        prev = cf.set_compile_inline(inline)
        torch._dynamo.reset()
        cm = torch.compile(cf.optimize(model), dynamic=False)
        timed(name, lambda: step(cm))
        cf.set_compile_inline(prev)
        del cm
    torch._dynamo.reset()
    tm = torch.compile(copy.deepcopy(model), dynamic=False)
    timed("torch_compile", lambda: step(tm))
    return 0


if __name__ == "__main__":
    sys.exit(main())
