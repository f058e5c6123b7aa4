"""GPT-2 small bf16 8x1024 inference, one process: cf eager, cf captured, cf under torch.compile,
torch.compile alone; wall ms per step (events around 20 steps), written after each variant.

    python3 bench/gpt2_probe.py --out DIR
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    import transformers

    cfg = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg).cuda().to(torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (8, 1024), device="cuda")
    res, path = {"device": torch.cuda.get_device_name(), "transformers": transformers.__version__}, \
        os.path.join(args.out, "gpt2_probe.json")

    def step(m):
        with torch.no_grad():
            return m(ids).logits

    def timed(name, fn):
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        setup = time.perf_counter() - t0
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20):
            fn()
        e.record()
        torch.cuda.synchronize()
        res[name] = {"ms": round(s.elapsed_time(e) / 20, 4), "setup_s": round(setup, 2)}
        print(name, res[name], flush=True)
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    opt = cf.optimize(model)
    timed("cf", lambda: step(opt))
    def fwd(i):
        with torch.no_grad():
            return opt(i).logits

    g = cf.capture(fwd, ids)
    timed("cf_captured", lambda: g(ids))
    timed("torch_eager", lambda: step(model))
    cm = torch.compile(opt, dynamic=False)
    timed("cf_compiled", lambda: step(cm))
    torch._dynamo.reset()
    tm = torch.compile(copy.deepcopy(model), dynamic=False)
    timed("torch_compile", lambda: step(tm))
    timed("cf_again", lambda: step(opt))
    return 0


if __name__ == "__main__":
    sys.exit(main())
