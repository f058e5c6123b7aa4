"""Does cuBLASLt's GELU epilogue pair (GELU_AUX_BIAS forward, DGELU backward: the tanh GELU
only) make a kept-pre-activation GELU(tanh) MLP step beat eager? (nn.FusedMLP with
CUDNN_FUSE_MLP_KERNELS=cublaslt)

Pieces at memory.py's MLP block (8192 rows, 2048 -> 8192 -> 2048, bf16), device ms (CUDA events
behind a spin, median): eager's addmm then GELU(tanh) against one GELU_AUX_BIAS GEMM; eager's
dY @ W2, gelu_backward(tanh) and the bias sum against one DGELU GEMM and torch's sum (and DGELU_BGRAD, the sum in the epilogue). Exactness against
eager's kernels. Steps: memory.py's 8-block MLP with GELU(approximate="tanh"), eager and
nn.FusedMLP's node on torch's kernels and on the epilogues, in alternating rounds in one process,
with each variant's gradients against eager's and each one's peak.

    python3 bench/cublaslt_gelu_probe.py --out bench/results [--rounds 8]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from bench.common import device_ms, device_name, heat, write_json  # noqa: E402
from bench.memory import mlp  # noqa: E402
from bench.mlp_variants_probe import grads_vs_eager, variant_steps  # noqa: E402
from bench.triton_gemm_probe import operands, use  # noqa: E402 - memory.py's block; sets backward.MLP
from cudnn_fuse import cublaslt  # noqa: E402

TANH = "tanh"


def pieces() -> dict:
    x, w1, b1, w2, gy = operands()
    z = F.linear(x, w1, b1)
    heat(1.0)
    gb = torch.ops.aten.gelu_backward
    out = {"eager_linear": device_ms(lambda: F.linear(x, w1, b1)),
           "eager_linear_gelu_tanh": device_ms(lambda: F.gelu(F.linear(x, w1, b1), approximate=TANH)),
           "cublaslt_gelu_aux_bias": device_ms(lambda: cublaslt.linear_gelu_aux(x, w1, b1)),
           "eager_mm": device_ms(lambda: gy @ w2),
           "eager_mm_gelu_backward_tanh": device_ms(lambda: gb(gy @ w2, z, approximate=TANH)),
           "eager_mm_gelu_backward_tanh_sum": device_ms(lambda: gb(gy @ w2, z, approximate=TANH).sum(0)),
           "cublaslt_dgelu_bgrad_epilogue": device_ms(lambda: cublaslt.dgelu_bgrad(gy, w2, z, True, True)),
           "cublaslt_dgelu_then_sum": device_ms(lambda: cublaslt.dgelu_bgrad(gy, w2, z, True)),
           "cublaslt_dgelu": device_ms(lambda: cublaslt.dgelu_bgrad(gy, w2, z, False)),
           "eager_linear_gelu_exact": device_ms(lambda: F.gelu(F.linear(x, w1, b1))),
           "eager_mm_gelu_backward_exact_sum": device_ms(lambda: gb(gy @ w2, z).sum(0))}
    out["saved_fwd_ms"] = round(out["eager_linear_gelu_tanh"] - out["cublaslt_gelu_aux_bias"], 4)
    out["saved_bwd_ms"] = round(out["eager_mm_gelu_backward_tanh_sum"] - out["cublaslt_dgelu_then_sum"], 4)
    return out


def workspace_caps() -> dict:
    """The two epilogue GEMMs' device ms and the workspace their algorithm asked for, with the
    plans' workspace cap at 0, 1, 4 and 32 MiB (a workspace adds to the step's peak)."""
    x, w1, b1, w2, gy = operands()
    z = F.linear(x, w1, b1)
    out = {}
    for cap in (0, 1 << 20, 4 << 20, 32 << 20):
        cublaslt.EPILOGUE_WORKSPACE_BYTES = cap
        cublaslt.reset_epilogue_plans()
        row = {"gelu_aux_bias": device_ms(lambda: cublaslt.linear_gelu_aux(x, w1, b1)),
               "dgelu_then_sum": device_ms(lambda: cublaslt.dgelu_bgrad(gy, w2, z, True))}
        row["workspace_bytes"] = {str(k[0]): v for k, v in cublaslt.epilogue_workspaces().items()}
        out[str(cap)] = row
        print("workspace cap", cap, row, flush=True)
    cublaslt.reset_epilogue_plans()
    return out


def exactness() -> dict:
    out = {}
    for dt in (torch.bfloat16, torch.float16):
        x, w1, b1, w2, gy = operands(4096, 2048, 4096, dt, seed=1)
        y, z = cublaslt.linear_gelu_aux(x, w1, b1)
        z_ref = F.linear(x, w1, b1)
        y_ref = F.gelu(z_ref, approximate=TANH)
        dz, db = cublaslt.dgelu_bgrad(gy, w2, z_ref, True)
        dz_ref = torch.ops.aten.gelu_backward(gy @ w2, z_ref, approximate=TANH)
        d64 = dz_ref.double().sum(0)
        y64 = F.gelu(z_ref.double(), approximate=TANH)
        out[str(dt)[6:]] = {
            "z_differ_from_cublas_addmm_frac": float((z != z_ref).float().mean()),
            "y_differ_from_eager_frac": float((y != y_ref).float().mean()),
            "y_max_abs_diff_from_eager": float((y.float() - y_ref.float()).abs().max()),
            "y_max_abs_err_vs_fp64_of_z": float((y.double() - y64).abs().max()),
            "eager_y_max_abs_err_vs_fp64_of_z": float((y_ref.double() - y64).abs().max()),
            "dz_differ_from_eager_frac": float((dz != dz_ref).float().mean()),
            "dz_max_rel_vs_eager": float((dz.float() - dz_ref.float()).abs().max() / dz_ref.float().abs().max()),
            "db_max_rel_vs_fp64_of_eager_dz": float((db.double() - d64).abs().max() / d64.abs().max()),
            "torch_sum_db_max_rel_vs_fp64": float((dz_ref.sum(0).double() - d64).abs().max() / d64.abs().max()),
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--workspace-bytes", type=int, default=None,
                    help="the epilogue plans' workspace cap for the exactness and steps (default: the module's)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "cublaslt_gelu_probe.json")
    result = {"device": device_name(), "torch": torch.__version__}
    result["pieces_ms"] = pieces()
    print("pieces", result["pieces_ms"], flush=True)
    default_cap = cublaslt.EPILOGUE_WORKSPACE_BYTES
    result["workspace_caps"] = workspace_caps()
    cublaslt.EPILOGUE_WORKSPACE_BYTES = default_cap if args.workspace_bytes is None else args.workspace_bytes
    result["workspace_cap_used"] = cublaslt.EPILOGUE_WORKSPACE_BYTES
    result["exactness"] = exactness()
    print("exactness", result["exactness"], flush=True)
    write_json(path, result)
    bf = torch.bfloat16
    base = mlp(approximate=TANH).cuda().to(bf)
    x = torch.randn(8192, 2048, device="cuda", dtype=bf, requires_grad=True)
    variants = ["torch", "cublaslt"]
    models = [base] + [cf.optimize(copy.deepcopy(base)) for _ in variants]
    setups = [lambda: use("torch")] + [lambda v=v: use(v) for v in variants]
    before = dict(cublaslt.gelu_stats)
    result["grads_max_rel_vs_eager"] = grads_vs_eager(models, setups, variants, x)
    result["steps"] = variant_steps(models, ["eager"] + variants, setups, x, args.rounds)
    result["gelu_epilogue_gemms"] = {k: cublaslt.gelu_stats[k] - before[k] for k in before}
    use("torch")
    write_json(path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
