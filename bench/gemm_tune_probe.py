"""Does the kept-z MLP step beat eager with cuBLASLt's tuned GEMM algorithms (cudnn_fuse.tuned_gemm)?

memory.py's 8-block MLP (bf16, 8192 x 2048 -> 8192 -> 2048), eager and nn.FusedMLP variants in
alternating rounds in one process (bench.mlp_variants_probe.variant_steps):
  torch   the FusedMLP node on eager's kernels (the default, CUDNN_FUSE_MLP_KERNELS=torch), torch's GEMMs
  tuned   the same node with each GEMM signature tuned once (autotuning on for its first step, then
          off: the picks come from the process's table, as a later process finds them in the cache)
  side    the torch node with the bias gradients' column sums on a side stream, beside the layer's
          GEMMs (CUDNN_FUSE_BWD_BIAS_SUM=side)
  tuned_side  both
  cudnn   the node on cuDNN's save-z and fused dz graphs (CUDNN_FUSE_MLP_KERNELS=cudnn)
with every variant's gradients against eager's, and each signature's tuning record.

    python3 bench/gemm_tune_probe.py --out bench/results
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from bench.common import device_name, write_json  # noqa: E402
from bench.memory import mlp  # noqa: E402
from bench.mlp_variants_probe import grads_vs_eager, variant_steps  # noqa: E402
from cudnn_fuse import backward, tuned_gemm  # noqa: E402
from cudnn_fuse.cache import open_default_cache  # noqa: E402


def use(variant: str):
    backward.MLP = "cudnn" if variant == "cudnn" else "torch"
    tuned_gemm.ENABLED = variant.startswith("tuned")
    backward.BIAS_SUM = "side" if variant.endswith("side") else "inline"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    bf = torch.bfloat16
    base = mlp().cuda().to(bf)
    x = torch.randn(8192, 2048, device="cuda", dtype=bf, requires_grad=True)
    variants = ["torch", "tuned", "side", "tuned_side", "cudnn"]
    models = [base] + [cf.optimize(copy.deepcopy(base)) for _ in variants]
    setups = [lambda: use("torch")] + [lambda v=v: use(v) for v in variants]
    result = {"device": device_name(), "rounds": args.rounds}
    use("tuned")  # one step of the tuned model with autotuning on tunes its GEMM signatures
    cf.set_autotune(True)
    t0 = time.perf_counter()
    models[2](x).float().square().mean().backward()
    torch.cuda.synchronize()
    cf.set_autotune(False)
    result["tuning_step_s"] = round(time.perf_counter() - t0, 3)
    x.grad = None
    models[2].zero_grad(set_to_none=True)
    result["grad_max_rel_err_vs_eager"] = grads_vs_eager(models, setups, variants, x)
    pc = open_default_cache()
    records = []
    for sig in list(tuned_gemm._choice):
        entry = pc.get(tuned_gemm.cache_key(sig)) if pc is not None else None
        if entry is not None:
            records.append({"gemm": tuned_gemm._describe(sig), **{k: entry.meta.get(k) for k in
                                                                   ("engine", "candidates", "tune_s", "rounds")}})
            best = min((c for c in entry.meta["candidates"] if c.get("median_ms")), key=lambda c: c["median_ms"])
            print(f"{records[-1]['gemm']:40s} -> {entry.meta['engine']:18s} torch "
                  f"{entry.meta['candidates'][0]['median_ms']:.4f} best {best['median_ms']:.4f} ms", flush=True)
    result["tuned"] = records
    result["steps"] = variant_steps(models, ["eager"] + variants, setups, x, args.rounds)
    result["gemm_runs"] = tuned_gemm.stats["runs"]
    use("torch")
    tuned_gemm.ENABLED = True
    result["fallbacks"] = cf.plan_stats().get("fallbacks")
    write_json(os.path.join(args.out, "gemm_tune_probe.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
