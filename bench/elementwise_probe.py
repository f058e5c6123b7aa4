"""Do Triton elementwise kernels make the kept-z MLP step beat eager (issue 4)?
(cudnn_fuse.triton_act, CUDNN_FUSE_MLP_ELEMENTWISE=triton)

Pieces at the MLP's hidden activation (8192 x 8192, bf16), device ms (CUDA events, median):
aten's gelu, gelu_backward and column sum against the Triton forward and the fused
backward + column sum, for a few launch configurations; each activation's outputs compared with
aten's bit for bit, the bias sum against a float64 sum. Steps: memory.py's 8-block MLP, eager
and nn.FusedMLP's node on aten's and on Triton's elementwise kernels, in alternating rounds in one
process, with each variant's gradients against eager's.

    python3 bench/elementwise_probe.py --out bench/results
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
from bench.common import device_ms, device_name, write_json  # noqa: E402
from bench.memory import mlp  # noqa: E402
from bench.mlp_variants_probe import grads_vs_eager, variant_steps  # noqa: E402
from cudnn_fuse import backward, triton_act  # noqa: E402

ATEN_BWD = {"gelu": lambda dy, z: torch.ops.aten.gelu_backward(dy, z),
            "gelu_tanh": lambda dy, z: torch.ops.aten.gelu_backward(dy, z, approximate="tanh"),
            "silu": lambda dy, z: torch.ops.aten.silu_backward(dy, z)}
ATEN_FWD = {"gelu": F.gelu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"), "silu": F.silu}


def exactness(rows, h) -> dict:
    """Per activation and dtype: the fraction of y and dz elements that differ from aten's, and
    db's largest relative difference from a float64 sum of aten's dz."""
    out = {}
    g = torch.Generator(device="cuda").manual_seed(1)
    for dt in (torch.bfloat16, torch.float16):
        z = (torch.randn(rows, h, device="cuda", generator=g) * 3).to(dt)
        dy = torch.randn(rows, h, device="cuda", generator=g).to(dt)
        for act in triton_act.ACTS:
            y = triton_act.act_forward(z, act)
            dz, db = triton_act.act_grad_dbias(dy, z, act, True)
            ref_dz = ATEN_BWD[act](dy, z)
            ref_db = ref_dz.double().sum(0)
            out[f"{act}_{str(dt)[6:]}"] = {
                "y_differ_frac": float((y != ATEN_FWD[act](z)).float().mean()),
                "dz_differ_frac": float((dz != ref_dz).float().mean()),
                "db_max_rel": float(((db.double() - ref_db).abs().max() / ref_db.abs().max()).item()),
                "torch_sum_db_max_rel": float(((ref_dz.sum(0).double() - ref_db).abs().max() / ref_db.abs().max()).item()),
            }
    return out


def pieces(rows, h) -> dict:
    bf = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    z = torch.randn(rows, h, device="cuda", generator=g, dtype=bf)
    dy = torch.randn(rows, h, device="cuda", generator=g, dtype=bf)
    out = {"aten_gelu": device_ms(lambda: F.gelu(z)),
           "aten_gelu_backward": device_ms(lambda: torch.ops.aten.gelu_backward(dy, z)),
           "aten_sum": device_ms(lambda: dy.sum(0)),
           "aten_gelu_backward_then_sum": device_ms(lambda: torch.ops.aten.gelu_backward(dy, z).sum(0))}
    fwd = {}
    for cfg in [(1024, 4), (2048, 8), (4096, 8), (8192, 16)]:
        triton_act.FWD_CONFIG = cfg
        fwd[str(cfg)] = device_ms(lambda: triton_act.act_forward(z, "gelu"))
    bwd = {}
    one_tile = 10 ** 6  # programs per SM past any grid: every program one [BM, BN] tile, no loop
    for cfg in [(16, 512, 8, 4, 1), (16, 256, 8, 8, 3), (32, 256, 8, 16, 2),
                (32, 256, 8, one_tile, 1), (64, 256, 8, one_tile, 1), (64, 128, 4, one_tile, 1),
                (16, 512, 4, one_tile, 1), (128, 128, 8, one_tile, 1)]:
        triton_act.BWD_CONFIG = cfg
        bwd[str(cfg)] = {"with_sum": device_ms(lambda: triton_act.act_grad_dbias(dy, z, "gelu", True)),
                         "no_sum": device_ms(lambda: triton_act.act_grad_dbias(dy, z, "gelu", False))}
    out["triton_forward"] = fwd
    out["triton_backward"] = bwd
    best_f = min(fwd, key=fwd.get)
    best_b = min(bwd, key=lambda k: bwd[k]["with_sum"])
    triton_act.FWD_CONFIG = tuple(int(v) for v in best_f.strip("()").split(","))
    triton_act.BWD_CONFIG = tuple(int(v) for v in best_b.strip("()").split(","))
    out["picked"] = {"forward": best_f, "backward": best_b}
    moved = rows * h * 2
    out["GBps"] = {"aten_gelu": round(2 * moved / out["aten_gelu"] / 1e6, 1),
                   "aten_gelu_backward": round(3 * moved / out["aten_gelu_backward"] / 1e6, 1),
                   "triton_forward": round(2 * moved / fwd[best_f] / 1e6, 1),
                   "triton_backward_with_sum": round(3 * moved / bwd[best_b]["with_sum"] / 1e6, 1)}
    return out


def use(variant: str):
    backward.MLP = "torch"
    triton_act.MODE = "triton" if variant == "triton" else "torch"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    triton_act.MODE = "triton"
    result = {"device": device_name(), "exactness": exactness(4096, 8192)}
    print("exactness", result["exactness"], flush=True)
    result["pieces_ms"] = pieces(8192, 8192)
    print("pieces", result["pieces_ms"], flush=True)
    bf = torch.bfloat16
    base = mlp().cuda().to(bf)
    x = torch.randn(8192, 2048, device="cuda", dtype=bf, requires_grad=True)
    variants = ["torch", "triton"]
    models = [base] + [cf.optimize(copy.deepcopy(base)) for _ in variants]
    setups = [lambda: use("torch")] + [lambda v=v: use(v) for v in variants]
    result["grads_max_rel_vs_eager"] = grads_vs_eager(models, setups, variants, x)
    result["steps"] = variant_steps(models, ["eager"] + variants, setups, x, args.rounds)
    result["triton_stats"] = dict(triton_act.stats)
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "elementwise_probe.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
