"""Can the kept-pre-activation MLP step beat eager (issue 4)? Pieces and whole steps of nn.FusedMLP
variants that the in-step profile (step_profile_mlp_20261201/) points at:

  cf          the library's default: db1 (the first layer's bias gradient) a reduction inside the
              dz graph (dz = gelu'(z1) * (dY @ W2)), CUDNN_FUSE_BWD_MLP_DBIAS=fused
  cf_sum      db1 a torch sum over dz (the default before; CUDNN_FUSE_BWD_MLP_DBIAS=torch)
  fwd_torch   cf with the first layer's forward on torch (cuBLAS addmm + GELU, keeping z), where
              the fused cuDNN graph ran 0.493 ms a layer against 0.334 + 0.090 in that profile

Pieces (device ms, CUDA events, median of 50 after warm-up): the dz graph with and without the
dbias output, torch's product + gelu_backward + sum, the forward on cuDNN and on torch. Steps:
memory.py's 8-block MLP (bf16, 8192 rows, 2048 -> 8192 -> 2048), eager and each variant in
alternating rounds in one process.

    python3 bench/mlp_variants_probe.py --out bench/results
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
from bench.common import device_name, synced_ms, write_json  # noqa: E402
from bench.memory import interleaved_ms, mlp, peak_bytes  # noqa: E402
from cudnn_fuse import backward, reference, torch_ops  # noqa: E402

ORIGINAL = {"save_z": torch_ops._linear_save_z_op_impl}


def save_z_torch(x, weight, bias, activation, residual, negative_slope):
    z = F.linear(x, weight, bias)
    if residual is not None:
        z = z + residual
    return reference.activation(z, activation, negative_slope), z


def dz_dbias(dy3, w2_3, z3, act, slope):
    """(dz, db f32 [1, 1, H]) from one graph, or None when cuDNN declines the reduction."""
    out = backward.matmul_act_grad(dy3, w2_3, z3, act, slope, dbias=True)
    return out if out is not None and out[1] is not None else None


def use(variant: str):
    backward.MLP = "cudnn"  # every variant here is a cuDNN FusedMLP (fwd_torch swaps its forward below)
    torch_ops._linear_save_z_op_impl = save_z_torch if variant == "fwd_torch" else ORIGINAL["save_z"]
    backward.MLP_DBIAS = "torch" if variant == "cf_sum" else "fused"


def device_ms(fn, warmup=10, iters=50) -> float:
    for _ in range(warmup):
        fn()
    return round(synced_ms(fn, iters), 4)


def pieces(rows=8192, d=2048, h=8192) -> dict:
    bf = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    dy = torch.randn(1, rows, d, device="cuda", dtype=bf, generator=g)
    w2 = (torch.randn(d, h, device="cuda", dtype=bf, generator=g) * h ** -0.5).unsqueeze(0)
    z = torch.randn(1, rows, h, device="cuda", dtype=bf, generator=g)
    x = torch.randn(rows, d, device="cuda", dtype=bf, generator=g)
    w1 = torch.randn(h, d, device="cuda", dtype=bf, generator=g) * d ** -0.5
    b1 = torch.randn(h, device="cuda", dtype=bf, generator=g)
    out = {}
    plain = backward.matmul_act_grad(dy, w2, z, "gelu", 0.01)
    out["dz_graph"] = device_ms(lambda: backward.matmul_act_grad(dy, w2, z, "gelu", 0.01)) if plain is not None else None
    out["dz_graph_then_torch_sum"] = device_ms(lambda: backward.matmul_act_grad(dy, w2, z, "gelu", 0.01).view(rows, h)
                                              .sum(0)) if plain is not None else None
    fused = dz_dbias(dy, w2, z, "gelu", 0.01)
    out["dz_dbias_graph"] = device_ms(lambda: dz_dbias(dy, w2, z, "gelu", 0.01)) if fused is not None else "declined"
    if fused is not None and plain is not None:
        ref = plain.view(rows, h).float().sum(0)
        out["dz_dbias_max_rel_err"] = float(((fused[1].view(h) - ref).abs().max() / ref.abs().max()).item())
        out["dz_equal"] = bool(torch.equal(fused[0], plain))
    out["torch_mm_gelu_backward_sum"] = device_ms(
        lambda: torch.ops.aten.gelu_backward(torch.matmul(dy, w2), z).view(rows, h).sum(0))
    out["torch_sum_only"] = device_ms(lambda: z.view(rows, h).sum(0))
    out["fwd_cudnn_save_z"] = device_ms(lambda: backward.linear_save_z(x, w1, b1, None, "gelu", 0.01))
    out["fwd_torch_addmm_gelu"] = device_ms(lambda: F.gelu(F.linear(x, w1, b1)))
    return out


def grads_vs_eager(models, setups, variants, x) -> dict:
    """Each variant's largest relative gradient difference from eager's (models[0]), one step from
    the same weights; printed and returned by variant name."""
    grads = []
    for m, s in zip(models, setups):
        s()
        x.grad = None
        m(x).float().square().mean().backward()
        grads.append([p.grad.float().clone() for p in m.parameters()] + [x.grad.float().clone()])
        for p in m.parameters():
            p.grad = None
    out = {v: max(float(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()) for a, b in zip(g, grads[0]))
           for v, g in zip(variants, grads[1:])}
    print("grads vs eager", out, flush=True)
    return out


def variant_steps(models, names, setups, x, rounds) -> list:
    """Each model's peak bytes and median step ms (alternating rounds, memory.interleaved_ms; the
    first model is the baseline of ``vs_eager``), printed and returned as rows. ``setups[i]()``
    selects model i's variant before each of its steps."""
    peaks = []
    for m, s in zip(models, setups):
        s()
        peaks.append(peak_bytes(m, x))
    res = interleaved_ms(models, x, rounds=rounds, steps=4, setups=setups)
    rows = [{"name": n, "step_ms": round(med, 3), "round_ms": [round(r, 3) for r in per], "peak_bytes": p,
             "vs_eager": round(med / res[0][0], 4)} for n, (med, per), p in zip(names, res, peaks)]
    for r in rows:
        print(f"{r['name']:10s} {r['step_ms']:8.3f} ms  {r['vs_eager']:.4f}x  peak {r['peak_bytes'] / 2**20:.0f} MiB  "
              f"rounds {min(r['round_ms']):.3f}-{max(r['round_ms']):.3f}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    result = {"device": device_name(), "pieces_ms": pieces()}
    print("pieces", result["pieces_ms"], flush=True)
    bf = torch.bfloat16
    base = mlp().cuda().to(bf)
    x = torch.randn(8192, 2048, device="cuda", dtype=bf, requires_grad=True)
    variants = ["cf", "cf_sum", "fwd_torch"]
    models = [base] + [cf.optimize(copy.deepcopy(base)) for _ in variants]
    setups = [lambda: use("cf")] + [lambda v=v: use(v) for v in variants]
    result["steps"] = variant_steps(models, ["eager"] + variants, setups, x, args.rounds)
    use("cf")
    result["rounds"] = args.rounds
    result["fallbacks"] = cf.plan_stats().get("fallbacks")
    write_json(os.path.join(args.out, "mlp_variants_probe.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
