"""Do the MLP's GEMMs with their elementwise pass in a Triton epilogue make the kept-z step beat
eager (issue 4)? (cudnn_fuse.triton_gemm, CUDNN_FUSE_MLP_KERNELS=triton)

Pieces at memory.py's MLP block (8192 rows, 2048 -> 8192 -> 2048, bf16, GELU), device ms (CUDA
events behind a spin, median): eager's first layer (addmm, then GELU) against Triton's one GEMM
writing z and y, and eager's dz (dY @ W2, gelu_backward, the bias sum) against Triton's one GEMM
with gelu_backward and the column sums in its epilogue, over launch configurations. Exactness:
Triton's z against cuBLAS's, y against aten's GELU of Triton's z, dz against aten's gelu_backward
of the rounded product, db against a float64 sum. Steps: memory.py's 8-block MLP, eager and
nn.FusedMLP's node on torch's kernels and on the Triton GEMMs (the fastest configurations), in
alternating rounds in one process, with each variant's gradients against eager's. With
``--max-autotune``: the same two pieces through torch.compile(mode="max-autotune-no-cudagraphs"),
the yardstick of what a fused Triton GEMM reaches here.

    python3 bench/triton_gemm_probe.py --out bench/results [--max-autotune]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from bench.common import device_ms, device_name, heat, write_json  # noqa: E402
from bench.memory import mlp  # noqa: E402
from bench.mlp_variants_probe import grads_vs_eager, variant_steps  # noqa: E402
from cudnn_fuse import backward, triton_gemm  # noqa: E402

CONFIGS = [(128, 256, 64, 8, 3, 8), (128, 256, 64, 8, 4, 8), (256, 128, 64, 8, 3, 8), (256, 128, 64, 8, 4, 8),
           (128, 128, 64, 8, 4, 4), (128, 128, 64, 8, 4, 8), (128, 128, 64, 8, 5, 4), (64, 256, 64, 8, 4, 4),
           (128, 256, 32, 8, 5, 8), (128, 128, 128, 8, 3, 8)]


def _run(kind: str, cfg: tuple, fn):
    """fn() under ``cfg`` for ``kind`` ("fwd"/"bwd"), with a failed configuration (too much shared
    memory, say) reported and the module re-armed, not left disabled."""
    setattr(triton_gemm, "FWD_CONFIG" if kind == "fwd" else "BWD_CONFIG", cfg)
    if triton_gemm._kernels is False:
        triton_gemm._kernels = None
    out = fn()
    if out is None:
        triton_gemm._kernels = None
    return out


def operands(rows=8192, k=2048, h=8192, dt=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, device="cuda", generator=g).to(dt)
    w1 = (torch.randn(h, k, device="cuda", generator=g) / k ** 0.5).to(dt)
    b1 = (torch.randn(h, device="cuda", generator=g) * 0.1).to(dt)
    w2 = (torch.randn(k, h, device="cuda", generator=g) / h ** 0.5).to(dt)
    gy = torch.randn(rows, k, device="cuda", generator=g).to(dt)
    return x, w1, b1, w2, gy


def exactness(cfg_f, cfg_b) -> dict:
    out = {}
    for dt in (torch.bfloat16, torch.float16):
        x, w1, b1, w2, gy = operands(4096, 2048, 4096, dt, seed=1)
        y, z = _run("fwd", cfg_f, lambda: triton_gemm.linear_act(x, w1, b1, "gelu"))
        z_ref = F.linear(x, w1, b1)
        z64 = x.double() @ w1.double().t() + b1.double()
        dz, db = _run("bwd", cfg_b, lambda: triton_gemm.matmul_act_grad(gy, w2, z, "gelu", True))
        prod = gy @ w2
        dz_ref = torch.ops.aten.gelu_backward(prod, z)
        d64 = dz_ref.double().sum(0)
        scale = z64.abs().max()
        out[str(dt)[6:]] = {
            "z_max_abs_err_vs_fp64_over_max": float((z.double() - z64).abs().max() / scale),
            "cublas_z_max_abs_err_vs_fp64_over_max": float((z_ref.double() - z64).abs().max() / scale),
            "z_differ_from_cublas_frac": float((z != z_ref).float().mean()),
            "y_differ_from_aten_gelu_of_z_frac": float((y != F.gelu(z)).float().mean()),
            "y_max_abs_diff_from_aten": float((y.float() - F.gelu(z).float()).abs().max()),
            "dz_differ_from_aten_frac": float((dz != dz_ref).float().mean()),
            "dz_max_rel_vs_aten": float((dz.float() - dz_ref.float()).abs().max() / dz_ref.float().abs().max()),
            "db_max_rel_vs_fp64": float((db.double() - d64).abs().max() / d64.abs().max()),
            "torch_sum_db_max_rel_vs_fp64": float((dz_ref.sum(0).double() - d64).abs().max() / d64.abs().max()),
        }
    return out


def pieces() -> dict:
    x, w1, b1, w2, gy = operands()
    z = F.linear(x, w1, b1)
    heat(1.0)
    out = {"eager_linear": device_ms(lambda: F.linear(x, w1, b1)),
           "eager_linear_gelu": device_ms(lambda: F.gelu(F.linear(x, w1, b1))),
           "eager_mm": device_ms(lambda: gy @ w2),
           "eager_mm_gelu_backward": device_ms(lambda: torch.ops.aten.gelu_backward(gy @ w2, z)),
           "eager_mm_gelu_backward_sum": device_ms(lambda: torch.ops.aten.gelu_backward(gy @ w2, z).sum(0))}
    fwd, bwd = {}, {}
    for cfg in CONFIGS:
        t0 = time.perf_counter()
        ok = _run("fwd", cfg, lambda: triton_gemm.linear_act(x, w1, b1, "gelu")) is not None
        fwd[str(cfg)] = device_ms(lambda: triton_gemm.linear_act(x, w1, b1, "gelu")) if ok else None
        ok = _run("bwd", cfg, lambda: triton_gemm.matmul_act_grad(gy, w2, z, "gelu", True)) is not None
        bwd[str(cfg)] = ({"with_sum": device_ms(lambda: triton_gemm.matmul_act_grad(gy, w2, z, "gelu", True)),
                          "no_sum": device_ms(lambda: triton_gemm.matmul_act_grad(gy, w2, z, "gelu", False))}
                         if ok else None)
        print(f"{cfg}: fwd {fwd[str(cfg)]} bwd {bwd[str(cfg)]} ({time.perf_counter() - t0:.1f} s)", flush=True)
    out["triton_linear_gelu"] = fwd
    out["triton_mm_gelu_backward"] = bwd
    best_f = min((k for k in fwd if fwd[k] is not None), key=fwd.get)
    best_b = min((k for k in bwd if bwd[k] is not None), key=lambda k: bwd[k]["with_sum"])
    out["picked"] = {"forward": best_f, "backward": best_b}
    flop = 2 * 8192 * 2048 * 8192
    out["TFLOPs"] = {"eager_linear": round(flop / out["eager_linear"] / 1e9, 1),
                     "eager_mm": round(flop / out["eager_mm"] / 1e9, 1),
                     "triton_linear_gelu": round(flop / fwd[best_f] / 1e9, 1),
                     "triton_mm_gelu_backward_sum": round(flop / bwd[best_b]["with_sum"] / 1e9, 1)}
    return out


def max_autotune() -> dict:
    """The two pieces through torch.compile's max-autotune (Inductor's Triton GEMM templates with
    the elementwise work fused where its tuning picks them), device ms and compile seconds."""
    x, w1, b1, w2, gy = operands()
    z = F.linear(x, w1, b1)
    mode = "max-autotune-no-cudagraphs"

    def fwd(x, w, b):
        t = F.linear(x, w, b)
        return t, F.gelu(t)

    def bwd(gy, w2, z):
        d = torch.ops.aten.gelu_backward(gy @ w2, z)
        return d, d.sum(0)

    out = {}
    for name, fn, args in (("linear_gelu", fwd, (x, w1, b1)), ("mm_gelu_backward_sum", bwd, (gy, w2, z))):
        c = torch.compile(fn, mode=mode, fullgraph=True)
        t0 = time.perf_counter()
        c(*args)
        torch.cuda.synchronize()
        out[name + "_compile_s"] = round(time.perf_counter() - t0, 1)
        out[name] = device_ms(lambda: c(*args))
        print(f"max-autotune {name}: {out[name]:.4f} ms (compiled in {out[name + '_compile_s']} s)", flush=True)
    return out


def use(variant: str):
    backward.MLP = variant


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--max-autotune", action="store_true")
    args = ap.parse_args(argv)
    import triton

    torch.manual_seed(0)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "triton_gemm_probe.json")
    result = {"device": device_name(), "triton": triton.__version__, "torch": torch.__version__}
    result["pieces_ms"] = pieces()
    print("pieces", result["pieces_ms"], flush=True)
    picked = result["pieces_ms"]["picked"]
    cfg_f = tuple(int(v) for v in picked["forward"].strip("()").split(","))
    cfg_b = tuple(int(v) for v in picked["backward"].strip("()").split(","))
    result["exactness"] = exactness(cfg_f, cfg_b)
    print("exactness", result["exactness"], flush=True)
    write_json(path, result)
    triton_gemm.FWD_CONFIG, triton_gemm.BWD_CONFIG = cfg_f, cfg_b
    bf = torch.bfloat16
    base = mlp().cuda().to(bf)
    x = torch.randn(8192, 2048, device="cuda", dtype=bf, requires_grad=True)
    variants = ["torch", "triton"]
    models = [base] + [cf.optimize(copy.deepcopy(base)) for _ in variants]
    setups = [lambda: use("torch")] + [lambda v=v: use(v) for v in variants]
    result["grads_max_rel_vs_eager"] = grads_vs_eager(models, setups, variants, x)
    result["steps"] = variant_steps(models, ["eager"] + variants, setups, x, args.rounds)
    result["triton_stats"] = dict(triton_gemm.stats)
    use("torch")
    write_json(path, result)
    if args.max_autotune:
        result["max_autotune_ms"] = max_autotune()
        write_json(path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
