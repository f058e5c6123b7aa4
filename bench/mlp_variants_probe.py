"""Can the kept-pre-activation MLP step beat eager (issue 4)? Pieces and whole steps of two
variants of nn.FusedMLP that the in-step profile (step_profile_mlp_20261201/) points at:

  fwd_torch   the first layer's forward on torch (cuBLAS addmm + GELU, keeping z), where the
              fused cuDNN graph ran 0.493 ms a layer against 0.334 + 0.090 in the same profile
  dz_dbias    fwd_torch, and the bias gradient db1 as a reduction inside the dz graph
              (dz = gelu'(z1) * (dY @ W2)), so torch's separate sum over dz (16 sums, 0.56 ms a
              step) loses one of its two per block

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
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from bench.common import device_name, write_json  # noqa: E402
from bench.memory import interleaved_ms, mlp, peak_bytes  # noqa: E402
from cudnn_fuse import backward, reference, torch_ops  # noqa: E402
from cudnn_fuse.spec import Epilogue, MatmulActGradSpec, MatmulSpec  # noqa: E402

ORIGINAL = {"save_z": torch_ops._linear_save_z_op_impl, "mlp_grads": backward.mlp_grads}


def save_z_torch(x, weight, bias, activation, residual, negative_slope):
    z = F.linear(x, weight, bias)
    if residual is not None:
        z = z + residual
    return reference.activation(z, activation, negative_slope), z


def dz_dbias(dy3, w2_3, z3, act, slope):
    """(dz, db f32 [1, 1, H]) from one graph, or None when cuDNN declines it."""
    dz = torch.empty_like(z3)
    db = torch.empty((1, 1, z3.shape[-1]), dtype=torch.float32, device=z3.device)
    bufs = [dy3, w2_3, z3, dz, db]

    def make():
        prod = MatmulSpec(backward._spec(dy3), backward._spec(w2_3), backward._spec(dz), Epilogue())
        return MatmulActGradSpec(prod, backward._spec(z3), backward._spec(dz), act, slope, dbias=backward._spec(db))

    spec = backward._cached_spec("matmul_act_grad+dbias", (act, slope), bufs, make)
    return (dz, db) if backward._try("mlp_backward", spec, bufs, quiet=True) else None


def mlp_grads_dbias(x, w1, inter, w2, gy, act, slope, needs):
    """backward.mlp_grads with db1 from the dz graph (falls back to the library's when declined)."""
    z1, y1 = inter
    N2, H = w2.shape
    rows = z1.numel() // H
    dy3 = gy.contiguous().reshape(1, rows, N2)
    z3 = z1.reshape(1, rows, H)
    if not (needs[0] or needs[1] or needs[2]) or not z3.is_contiguous():
        return ORIGINAL["mlp_grads"](x, w1, inter, w2, gy, act, slope, needs)
    inter.clear()
    dw2 = backward.mm(dy3.transpose(1, 2), y1.reshape(1, rows, H)).view(N2, H) if needs[3] else None
    db2 = dy3.view(rows, N2).sum(0) if needs[4] else None
    out = dz_dbias(dy3, w2.unsqueeze(0), z3, act, slope)
    if out is None:
        inter += [z1, y1]
        return ORIGINAL["mlp_grads"](x, w1, inter, w2, gy, act, slope, needs)
    dz, db = out
    del y1, z1, z3
    db1 = db.view(H).to(gy.dtype) if needs[2] else None
    dx = dw1 = None
    if needs[0] or needs[1]:
        _, K, _, a3, b3 = backward._linear_operands(x, w1)
        dx, dw1 = backward.gemm_products(a3, b3, dz, needs[0], needs[1], weight_layout=True)
        dx = dx.view(x.shape) if dx is not None else None
        dw1 = dw1.view(H, K) if dw1 is not None else None
    return dx, dw1, db1, dw2, db2, (gy if needs[5] else None)


def use(variant: str):
    torch_ops._linear_save_z_op_impl = ORIGINAL["save_z"] if variant == "cf" else save_z_torch
    backward.mlp_grads = mlp_grads_dbias if variant == "dz_dbias" else ORIGINAL["mlp_grads"]


def device_ms(fn, warmup=10, iters=50) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return round(statistics.median(times), 4)


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
    variants = ["cf", "fwd_torch", "dz_dbias"]
    models = [base] + [cf.optimize(copy.deepcopy(base)) for _ in variants]
    setups = [lambda: use("cf")] + [lambda v=v: use(v) for v in variants]
    peaks = []
    for m, s in zip(models, setups):
        s()
        peaks.append(peak_bytes(m, x))
    res = interleaved_ms(models, x, rounds=args.rounds, steps=4, setups=setups)
    use("cf")
    names = ["eager"] + variants
    result["steps"] = [{"name": n, "step_ms": round(med, 3), "round_ms": [round(r, 3) for r in per], "peak_bytes": p,
                        "vs_eager": round(med / res[0][0], 4)} for n, (med, per), p in zip(names, res, peaks)]
    result["rounds"] = args.rounds
    for r in result["steps"]:
        print(f"{r['name']:10s} {r['step_ms']:8.3f} ms  {r['vs_eager']:.4f}x  peak {r['peak_bytes'] / 2**20:.0f} MiB  "
              f"rounds {min(r['round_ms']):.3f}-{max(r['round_ms']):.3f}", flush=True)
    result["fallbacks"] = cf.plan_stats().get("fallbacks")
    write_json(os.path.join(args.out, "mlp_variants_probe.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
