"""Where the cuDNN backward's time goes (issue 4): each piece of one layer's
backward, cuDNN graph vs torch, and the memory bench's step under each engine
choice of cudnn_fuse.backward (MM, DBIAS, CONV). Diagnostic, not a result.

    python3 bench/backward_probe.py --out bench/results
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from cudnn_fuse import backward  # noqa: E402
from bench import memory  # noqa: E402
from bench.common import synced_ms  # noqa: E402


def timed(fn, reps=20) -> float:
    for _ in range(3):
        fn()
    return round(synced_ms(fn, reps), 4)


def gemm_pieces():
    bf = torch.bfloat16
    x = torch.randn(8192, 2048, device="cuda", dtype=bf)
    w = torch.randn(8192, 2048, device="cuda", dtype=bf) / 45
    b = torch.randn(8192, device="cuda", dtype=bf)
    z = F.linear(x, w, b)
    dy = torch.randn_like(z)
    a3, b3, dy3, z3 = x.unsqueeze(0), w.t().unsqueeze(0), dy.unsqueeze(0), z.unsqueeze(0)
    r = {}
    r["fwd eager addmm+gelu"] = timed(lambda: F.gelu(F.linear(x, w, b)))
    r["fwd cf save_z"] = timed(lambda: backward.linear_save_z(x, w, b, None, "gelu", 0.01))
    with torch.no_grad():
        r["fwd cf linear+gelu"] = timed(lambda: cf.linear(x, w, b, activation="gelu"))
    r["dz eager gelu_backward+sum"] = timed(lambda: torch.ops.aten.gelu_backward(dy, z).sum(0))
    for mode in ("fused", "torch"):
        backward.DBIAS = mode
        r[f"dz cf act_grad dbias={mode}"] = timed(lambda: backward.gemm_dz(a3, b3, b, None, dy3, "gelu", 0.01, z3, True))
        r[f"dz cf recompute dbias={mode}"] = timed(lambda: backward.gemm_dz(a3, b3, b, None, dy3, "gelu", 0.01, None, True))
    backward.DBIAS = "fused"
    r["dX+dW torch"] = timed(lambda: (dy @ w, dy.t() @ x))
    backward.MM = "cudnn"
    r["dX+dW cf cudnn"] = timed(lambda: backward.gemm_products(a3, b3, dy3, True, True, weight_layout=True))
    r["dX cf cudnn"] = timed(lambda: backward.gemm_products(a3, b3, dy3, True, False, weight_layout=True))
    return r


def mlp_pieces():
    """The first layer's dz in a Linear -> GELU -> Linear block (MLP 8192 x 2048 -> 8192 -> 2048):
    eager's dY @ W2 then gelu_backward, against cf's split graphs and the one matmul_act_grad graph."""
    bf = torch.bfloat16
    dy = torch.randn(8192, 2048, device="cuda", dtype=bf)
    w2 = torch.randn(2048, 8192, device="cuda", dtype=bf) / 45
    z1 = torch.randn(8192, 8192, device="cuda", dtype=bf)
    dy3, w23, z3 = dy.unsqueeze(0), w2.unsqueeze(0), z1.unsqueeze(0)
    f32 = torch.float32
    r = {}
    r["eager dY@W2 alone"] = timed(lambda: dy @ w2)
    r["cf mm dY@W2 alone"] = timed(lambda: backward.mm(dy3, w23))
    r["eager dY@W2 + gelu_backward + sum"] = timed(lambda: torch.ops.aten.gelu_backward(dy @ w2, z1).sum(0))
    r["cf split mm + act_grad + sum"] = timed(
        lambda: backward._saved_dz(backward.mm(dy3, w23), z3, "gelu", 0.01, False)[0].sum((0, 1), dtype=f32))
    fused = backward.matmul_act_grad(dy3, w23, z3, "gelu", 0.01)
    if fused is None:
        r["cf fused matmul_act_grad"] = "declined"
        return r
    r["cf fused matmul_act_grad"] = timed(lambda: backward.matmul_act_grad(dy3, w23, z3, "gelu", 0.01))
    r["cf fused matmul_act_grad + sum"] = timed(
        lambda: backward.matmul_act_grad(dy3, w23, z3, "gelu", 0.01).sum((0, 1), dtype=f32))
    ref = torch.ops.aten.gelu_backward((dy.float() @ w2.float()), z1.float())
    r["fused rel err vs fp32"] = float((fused[0].float() - ref).norm() / ref.norm())
    r["eager rel err vs fp32"] = float((torch.ops.aten.gelu_backward(dy @ w2, z1).float() - ref).norm() / ref.norm())
    r["engines"] = {p.spec.op: p.engine for p in cf.plans.plans_in_memory() if p.spec.op == "matmul_act_grad"}
    return r


def conv_pieces():
    h, cl = torch.float16, torch.channels_last
    x = torch.randn(32, 128, 56, 56, device="cuda", dtype=h).to(memory_format=cl)
    w = (torch.randn(128, 128, 3, 3, device="cuda", dtype=h) / 34).to(memory_format=cl)
    b = torch.randn(128, device="cuda", dtype=h)
    y = F.relu(F.conv2d(x, w, b, padding=1))
    dy = torch.randn_like(y)
    geo = ((1, 1), (1, 1), (1, 1), (1, 1), 1)
    r = {}
    r["fwd eager conv+relu"] = timed(lambda: F.relu(F.conv2d(x, w, b, padding=1)))
    with torch.no_grad():
        r["fwd cf conv+bias+relu"] = timed(lambda: cf.conv2d(x, w, b, padding=1, activation="relu"))
    r["dz eager threshold_backward+sum"] = timed(lambda: torch.ops.aten.threshold_backward(dy, y, 0).sum((0, 2, 3)))
    for mode in ("fused", "torch"):
        backward.DBIAS = mode
        r[f"dz cf relu dbias={mode}"] = timed(lambda: backward.conv_dz(x, w, b, None, dy, y, geo, "relu", 0.01, True))
    backward.DBIAS = "fused"
    r["dgrad torch"] = timed(lambda: torch.ops.aten.convolution_backward(dy, x, w, None, [1, 1], [1, 1], [1, 1], False,
                                                                          [0, 0], 1, [True, False, False]))
    r["wgrad torch"] = timed(lambda: torch.ops.aten.convolution_backward(dy, x, w, None, [1, 1], [1, 1], [1, 1], False,
                                                                          [0, 0], 1, [False, True, False]))
    r["dgrad cf"] = timed(lambda: backward.conv_dgrad(dy, w, x, geo))
    r["wgrad cf"] = timed(lambda: backward.conv_wgrad(x, dy, w, geo))
    pl = [p for p in cf.plans.plans_in_memory() if p.spec.op in ("conv_dgrad", "conv_wgrad", "act_grad")]
    r["engines"] = {p.spec.op: p.engine for p in pl}
    return r


def steps():
    torch.manual_seed(0)
    rows = []
    cbase = memory.convs().cuda().half().to(memory_format=torch.channels_last)
    xc = torch.randn(32, 128, 56, 56, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
    xc.requires_grad_()
    fused = cf.optimize(copy.deepcopy(cbase))
    ep, et = memory.step_stats(cbase, xc)
    for conv, dbias in (("cudnn", "fused"), ("cudnn", "torch"), ("torch", "fused"), ("torch", "torch")):
        backward.CONV, backward.DBIAS = conv, dbias
        cp, ct = memory.step_stats(fused, xc)
        rows.append({"case": f"conv CONV={conv} DBIAS={dbias}", "eager_ms": round(et, 3), "cf_ms": round(ct, 3),
                     "eager_peak": ep, "cf_peak": cp})
    backward.CONV, backward.DBIAS = "cudnn", "fused"
    bf = torch.bfloat16
    base = memory.mlp().cuda().to(bf)
    x = torch.randn(8192, 2048, device="cuda", dtype=bf, requires_grad=True)
    ep, et = memory.step_stats(base, x)
    for rec in (False, True):
        m = cf.optimize(copy.deepcopy(base), recompute=rec)
        for mm in ("cudnn", "torch"):
            backward.MM = mm
            cp, ct = memory.step_stats(m, x)
            rows.append({"case": f"mlp recompute={rec} MM={mm}", "eager_ms": round(et, 3), "cf_ms": round(ct, 3),
                         "eager_peak": ep, "cf_peak": cp})
    backward.MM = "cudnn"
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--steps", action="store_true", help="also the memory bench's steps under each engine choice")
    args = ap.parse_args(argv)
    out = {}
    for name, fn in (("gemm", gemm_pieces), ("mlp", mlp_pieces), ("conv", conv_pieces)) + ((("steps", steps),) if args.steps else ()):
        try:
            out[name] = fn()
        except Exception as exc:  # noqa: BLE001 - a diagnostic reports what broke and goes on
            out[name] = f"{type(exc).__name__}: {exc}"[:2000]
        print(name, json.dumps(out[name], indent=1), flush=True)
    with open(os.path.join(args.out, "backward_probe.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
