"""Re-run one tests/test_gpu_fuzz.py case with its outputs inspected (diagnostic).

    python3 bench/fuzz_repro.py case168 [--seed 7 --n 300]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import cudnn_fuse as cf  # noqa: E402
from cudnn_fuse import ops, plans  # noqa: E402
from fuzz import MAKERS, _rand, draw, rel_err  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--n", type=int, default=300)
    args = ap.parse_args(argv)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    cases = draw(seed=args.seed, n=args.n, dtypes=(torch.float16, torch.bfloat16, torch.float16, torch.bfloat16,
                                                   torch.float32))
    case = next(c for c in cases if c.name == args.name)
    print(case)
    gen = torch.Generator().manual_seed(int(case.name[4:]))
    ins, run, ref = MAKERS[case.op](case, "cuda", gen)
    for k, t in ins.items():
        if t is not None:
            print(k, tuple(t.shape), t.stride(), t.dtype, t.is_contiguous())
    for rep in range(4):
        if rep:
            for t in ins.values():
                if t is not None and t.dtype != torch.bool:
                    t.copy_(_rand(tuple(t.shape), t.dtype, "cpu", gen).to(t.device))
        n_fast = len(ops._FAST)
        st = cf.plan_stats()
        y = run(ins)
        torch.cuda.synchronize()
        r = ref({k: (t.detach().double().cpu() if t is not None and t.dtype != torch.bool else t) for k, t in ins.items()})
        bad = ~torch.isfinite(y.cpu())
        diff = (y.double().cpu() - r).abs()
        print(f"call {rep + 1}: err {rel_err(y, r):.3g} nonfinite {int(bad.sum())}/{y.numel()} "
              f"max|diff| {diff[~bad].max().item() if (~bad).any() else float('nan'):.3g} y {tuple(y.shape)} {y.stride()} "
              f"memo {len(ops._FAST) - n_fast:+d} builds {cf.plan_stats()['builds'] - st['builds']} "
              f"engines {[p.engine for p in plans.plans_in_memory()]}")
        if bad.any():
            idx = bad.nonzero()
            print("  nonfinite at", idx[:8].tolist(), "... per-channel counts", bad.sum(dim=(0, 2, 3)).tolist()
                  if y.dim() == 4 else "")
            y2 = run(ins)
            torch.cuda.synchronize()
            print("  same inputs again:", f"{rel_err(y2, r):.3g}")
            fresh = {k: (t.clone() if t is not None else None) for k, t in ins.items()}
            y3 = run(fresh)
            torch.cuda.synchronize()
            print("  cloned inputs:", f"{rel_err(y3, r):.3g}",
                  "x finite", {k: bool(torch.isfinite(t).all()) for k, t in ins.items() if t is not None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
