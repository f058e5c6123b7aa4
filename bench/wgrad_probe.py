"""Does a linear layer's weight gradient with its bias gradient in the epilogue (cuBLASLt BGRADB,
cudnn_fuse.cublaslt) make the kept-pre-activation MLP step faster than eager (issue 4)?

Pieces (device ms, median of 50 after warm-up, each piece timed in three alternating passes,
every pass after a 0.5 s heat so all run at a sustained run's clocks): memory.py's MLP shapes,
dW2/db2 from dY [8192, 2048] and y1 [8192, 8192], dW1/db1 from dz [8192, 8192] and x [8192, 2048]:
torch's GEMM + column sum (eager's kernels), the GEMM alone, and the one cuBLASLt GEMM; with the
largest error of each against float32 math.

Steps: memory.py's 8-block MLP (bf16), eager and nn.FusedMLP variants in alternating rounds:
  cf         nn.FusedMLP on cuDNN (CUDNN_FUSE_MLP_KERNELS=cudnn, the default before 2026-12-03: cuDNN's
             save-z forward, the fused dz graph with db1, torch sums for db2)
  cf_lt      the same with dW and db from one cuBLASLt GEMM each (CUDNN_FUSE_BWD_WGRAD=cublaslt)
  torch      the block's one autograd node with eager's kernels (forward addmm + GELU, dz product +
             gelu_backward, GEMMs and sums): the default since 2026-12-03
  torch_lt   that, with dW and db from one cuBLASLt GEMM each

    python3 bench/wgrad_probe.py --out bench/results
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from bench.common import device_name, heat, synced_ms, write_json  # noqa: E402
from bench.memory import mlp  # noqa: E402
from bench.mlp_variants_probe import grads_vs_eager, variant_steps  # noqa: E402
from cudnn_fuse import backward, cublaslt  # noqa: E402



def use(variant: str):
    backward.MLP = "torch" if variant.startswith("torch") else "cudnn"
    backward.WGRAD = "cublaslt" if variant.endswith("_lt") else "torch"


def pieces(rows=8192, d=2048, h=8192, passes=3) -> dict:
    bf = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = {"dw2_db2": (torch.randn(rows, d, device="cuda", dtype=bf, generator=g),
                         torch.randn(rows, h, device="cuda", dtype=bf, generator=g)),
             "dw1_db1": (torch.randn(rows, h, device="cuda", dtype=bf, generator=g),
                         torch.randn(rows, d, device="cuda", dtype=bf, generator=g))}
    out = {}
    for name, (dz, x) in cases.items():
        lt = cublaslt.wgrad_bgrad(dz, x)
        if lt is None:
            out[name] = "cuBLASLt declined"
            continue
        ref_w = dz.float().t() @ x.float()
        ref_b = dz.float().sum(0)
        tw, tb = dz.t() @ x, dz.sum(0)
        err = lambda a, r: float(((a.float() - r).abs().max() / r.abs().max()).item())  # noqa: E731
        fns = {"torch_gemm_sum": lambda: (dz.t() @ x, dz.sum(0)), "torch_gemm": lambda: dz.t() @ x,
               "cublaslt_bgrad": lambda: cublaslt.wgrad_bgrad(dz, x),
               "cublaslt_gemm": lambda: cublaslt.wgrad_bgrad(dz, x, with_bias=False)}
        times = {k: [] for k in fns}
        for _ in range(passes):
            heat()
            for k, fn in fns.items():
                for _ in range(10):
                    fn()
                times[k].append(synced_ms(fn, 50))
        out[name] = {k: round(sorted(v)[len(v) // 2], 4) for k, v in times.items()}
        out[name]["passes_ms"] = {k: [round(t, 4) for t in v] for k, v in times.items()}
        out[name]["max_rel_err"] = {"cublaslt_dw": err(lt[0], ref_w), "cublaslt_db": err(lt[1], ref_b),
                                    "torch_dw": err(tw, ref_w), "torch_db": err(tb, ref_b)}
        print(name, {k: v for k, v in out[name].items() if k != "passes_ms"}, flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    result = {"device": device_name(), "pieces_ms": pieces()}
    bf = torch.bfloat16
    base = mlp().cuda().to(bf)
    x = torch.randn(8192, 2048, device="cuda", dtype=bf, requires_grad=True)
    variants = ["cf", "cf_lt", "torch", "torch_lt"]
    models = [base] + [cf.optimize(copy.deepcopy(base)) for _ in variants]
    setups = [lambda: use("cf")] + [lambda v=v: use(v) for v in variants]
    result["grad_max_rel_err_vs_eager"] = grads_vs_eager(models, setups, variants, x)
    heat()
    result["steps"] = variant_steps(models, ["eager"] + variants, setups, x, args.rounds)
    use("cf")
    result["rounds"] = args.rounds
    result["fallbacks"] = cf.plan_stats().get("fallbacks")
    write_json(os.path.join(args.out, "wgrad_probe.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
