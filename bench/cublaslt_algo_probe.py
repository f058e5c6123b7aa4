"""Is there a cuBLASLt algorithm faster than torch's pick for the kept-z MLP step's GEMMs (issue 4)?

The kept-pre-activation MLP step ties eager at best because its time is GEMMs, and every GEMM is
cuBLAS's (or a cuDNN engine no faster). torch asks cuBLASLt's heuristic for ONE algorithm (addmm
with a bias) or lets cuBLAS choose (mm). This probe asks cuBLASLt's heuristic for up to 32
algorithms for each GEMM of memory.py's MLP block (bf16, 8192 rows, 2048 -> 8192 -> 2048) with the
operands laid out exactly as autograd hands them over, checks each algorithm's result against
torch's, and times torch and every algorithm in alternating rounds (CUDA events, 20 launches a
sample, rounds after a heat) so drift weighs on all alike.

    python3 bench/cublaslt_algo_probe.py --out bench/results
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import device_name, heat, write_json  # noqa: E402
from cudnn_fuse import cublaslt as lt  # noqa: E402
from cudnn_fuse import tuned_gemm as tg  # noqa: E402
from cudnn_fuse.tuned_gemm import _sample_ms as sample_ms  # noqa: E402

class Gemm:
    """C [M, N] = A [M, K] @ B [K, N] (+ bias [N]) on each of the heuristic's algorithms, through
    tuned_gemm's own descriptors (the layouts the library runs)."""

    def __init__(self, lib, handle, a, b, bias=None, count=32):
        self.lib, self.handle, self.a, self.b, self.bias = lib, handle, a, b, bias
        sig = tg.signature(a, b, bias)
        assert sig is not None, "tuned_gemm declines these operands"
        self.plan = tg._Plan(lib, sig)
        self.algos = self.plan.heuristic(lib, handle, count)
        self.c = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)

    def run(self, i: int) -> None:
        self.plan.run(self.lib, self.handle, self.algos[i], self.a, self.b, self.bias, self.c,
                      torch.cuda.current_stream().cuda_stream)


def cases(rows=8192, d=2048, h=8192):
    bf = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, device="cuda", dtype=bf, generator=g) / 8

    x, w1, b1, y1, w2, b2, dy, dz = r(rows, d), r(h, d), r(h), r(rows, h), r(d, h), r(d), r(rows, d), r(rows, h)
    # name: (A, B, bias, torch's own call) as autograd lays them out
    return {
        "fwd1_addmm x@W1^T+b1": (x, w1.t(), b1, lambda: F.linear(x, w1, b1)),
        "fwd2_addmm y1@W2^T+b2": (y1, w2.t(), b2, lambda: F.linear(y1, w2, b2)),
        "dgrad2 dY@W2": (dy, w2, None, lambda: dy @ w2),
        "wgrad2 dY^T@y1": (dy.t(), y1, None, lambda: dy.t() @ y1),
        "dgrad1 dz@W1": (dz, w1, None, lambda: dz @ w1),
        "wgrad1 dz^T@x": (dz.t(), x, None, lambda: dz.t() @ x),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--count", type=int, default=32)
    args = ap.parse_args(argv)
    lib = lt._load()
    handle = lt.thread_handle(lib, torch.device("cuda", torch.cuda.current_device()))
    heat(1.0)
    out = {"device": device_name(), "dtype": "bf16", "rounds": args.rounds, "launches_per_sample": 20, "gemms": []}
    for name, (a, b, bias, torch_fn) in cases().items():
        gm = Gemm(lib, handle, a, b, bias, args.count)
        ref = torch_fn().float()
        scale = ref.abs().max().item()
        errs, usable = [], []
        for i in range(len(gm.algos)):
            gm.c.zero_()
            try:
                gm.run(i)
                torch.cuda.synchronize()
            except lt.CublasLtError as e:
                errs.append(str(e))
                continue
            err = (gm.c.float() - ref).abs().max().item() / scale
            errs.append(err)
            if err < 2e-2:
                usable.append(i)
        samples = {"torch": []} | {i: [] for i in usable}
        for _ in range(args.rounds):
            heat(0.3)
            order = ["torch"] + usable
            for k in order:
                fn = torch_fn if k == "torch" else (lambda i=k: gm.run(i))
                fn()
                samples[k].append(sample_ms(fn, 20))
        med = {k: statistics.median(v) for k, v in samples.items()}
        best = min(usable, key=lambda i: med[i]) if usable else None
        row = {"gemm": name, "a": list(a.shape), "b": list(b.shape), "bias": bias is not None,
               "torch_ms": round(med["torch"], 4), "heuristic_first_ms": round(med[0], 4) if 0 in med else None,
               "best_algo": best, "best_ms": round(med[best], 4) if best is not None else None,
               "best_vs_torch": round(med[best] / med["torch"], 4) if best is not None else None,
               "algos": [{"index": i, "ms": round(med[i], 4) if i in med else None,
                          "workspace": gm.algos[i].workspace, "waves": round(gm.algos[i].waves, 3),
                          "max_rel_err": errs[i] if isinstance(errs[i], str) else round(errs[i], 6),
                          "samples": [round(s, 4) for s in samples.get(i, [])]} for i in range(len(gm.algos))],
               "torch_samples": [round(s, 4) for s in samples["torch"]]}
        out["gemms"].append(row)
        print(f"{name:24s} torch {row['torch_ms']:.4f}  lt[0] {row['heuristic_first_ms']}  best #{best} "
              f"{row['best_ms']} ({row['best_vs_torch']}x)  of {len(gm.algos)} algos, {len(usable)} correct", flush=True)
    tot_t = sum(r["torch_ms"] for r in out["gemms"])
    tot_b = sum(r["best_ms"] or r["torch_ms"] for r in out["gemms"])
    out["block_gemms_torch_ms"], out["block_gemms_best_ms"] = round(tot_t, 4), round(tot_b, 4)
    print(f"one block's six GEMMs: torch {tot_t:.3f} ms, best cuBLASLt algorithms {tot_b:.3f} ms ({tot_b / tot_t:.3f}x)")
    write_json(os.path.join(args.out, "cublaslt_algo_probe.json"), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
