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
import ctypes
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import device_name, heat, write_json  # noqa: E402
from cudnn_fuse import cublaslt as lt  # noqa: E402
from cudnn_fuse.tuned_gemm import _sample_ms as sample_ms  # noqa: E402

_EPILOGUE_BIAS = 4


def _layout(lib, t: torch.Tensor, dtype: int):
    """(layout, op) presenting row-major-indexed 2-D ``t`` [r, c] to cuBLASLt as the column-major t^T (c x r)."""
    lay = ctypes.c_void_p()
    r, c = t.shape
    if t.stride(1) == 1:  # row-major: its memory read column-major is t^T, op N
        lt._check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), dtype, c, r, t.stride(0)), "layout")
        return lay, lt._OP_N
    assert t.stride(0) == 1, "a 2-D view with one unit stride"
    lt._check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), dtype, r, c, t.stride(1)), "layout")
    return lay, lt._OP_T  # column-major memory is t itself (r x c): op T presents t^T


class Gemm:
    """C [M, N] = A [M, K] @ B [K, N] (+ bias [N]) row-major, as cuBLASLt's C^T = B^T A^T."""

    def __init__(self, lib, handle, a, b, bias=None, count=32):
        dtype = lt._DTYPES[a.dtype]
        self.lib, self.handle, self.a, self.b, self.bias = lib, handle, a, b, bias
        m, n = a.shape[0], b.shape[1]
        self.c = torch.empty((m, n), dtype=a.dtype, device=a.device)
        self.desc = ctypes.c_void_p()
        lt._check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), lt._COMPUTE_32F, lt._R_32F), "desc")
        self.la, opa = _layout(lib, b, dtype)  # cuBLASLt's A is B^T
        self.lb, opb = _layout(lib, a, dtype)  # its B is A^T
        self.ld = ctypes.c_void_p()
        lt._check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.ld), dtype, n, m, n), "layout")
        attrs = [(lt._DESC_TRANSA, opa), (lt._DESC_TRANSB, opb),
                 (lt._DESC_EPILOGUE, _EPILOGUE_BIAS if bias is not None else lt._EPILOGUE_DEFAULT)]
        for attr, value in attrs:
            v = ctypes.c_int32(value)
            lt._check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), 4), "attr")
        if bias is not None:
            self.bias_ptr = ctypes.c_void_p(bias.data_ptr())
            lt._check(lib.cublasLtMatmulDescSetAttribute(self.desc, lt._DESC_BIAS_POINTER, ctypes.byref(self.bias_ptr), 8),
                      "bias")
        pref = ctypes.c_void_p()
        lt._check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        ws = ctypes.c_size_t(lt.WORKSPACE_BYTES)
        lt._check(lib.cublasLtMatmulPreferenceSetAttribute(pref, lt._PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8), "pref")
        results = (lt._HeuristicResult * count)()
        got = ctypes.c_int(0)
        lt._check(lib.cublasLtMatmulAlgoGetHeuristic(handle, self.desc, self.la, self.lb, self.ld, self.ld, pref, count,
                                                     results, ctypes.byref(got)), "heuristic")
        self.algos = [results[i] for i in range(got.value) if results[i].state == 0]
        self.ws = torch.empty(lt.WORKSPACE_BYTES, dtype=torch.uint8, device=a.device)
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def run(self, i: int) -> None:
        r = self.algos[i]
        lt._check(self.lib.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self.alpha), self.b.data_ptr(), self.la,
                                          self.a.data_ptr(), self.lb, ctypes.byref(self.beta), self.c.data_ptr(), self.ld,
                                          self.c.data_ptr(), self.ld, ctypes.byref(r), self.ws.data_ptr(),
                                          r.workspaceSize, torch.cuda.current_stream().cuda_stream), "matmul")


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
    handle = ctypes.c_void_p()
    lt._check(lib.cublasLtCreate(ctypes.byref(handle)), "create")
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
                          "workspace": int(gm.algos[i].workspaceSize), "waves": round(gm.algos[i].wavesCount, 3),
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
