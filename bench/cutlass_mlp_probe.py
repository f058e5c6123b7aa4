"""The CUTLASS exact-GELU epilogues (cudnn_fuse.cutlass_mlp) against eager, piece by piece and in
memory.py's kept-z MLP step (issue 4's last target).

1. exactness: y against F.gelu of the kernel's own z (bit for bit expected), z and dz against eager's;
2. pieces (device ms, medians, interleaved with eager): linear + GELU forward, dY @ W2 + gelu_backward,
   each tile configuration;
3. the step: eager, the FusedMLP node on torch's kernels, and the node on CUTLASS (the fastest
   configuration of 2.), in alternating rounds in one process, and one step's gradients against eager's.

    python3 bench/cutlass_mlp_probe.py --out bench/results [--rounds 16]
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
from bench import memory  # noqa: E402
from cudnn_fuse import backward, cutlass_mlp  # noqa: E402


def _events_ms(fn, reps=30):
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def exactness(rows, n, k, cfg):
    cutlass_mlp.CONFIG = cfg
    g = torch.Generator(device="cuda").manual_seed(cfg + 7)
    bf = torch.bfloat16
    x = torch.randn(rows, k, device="cuda", generator=g).to(bf)
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(bf)
    b = torch.randn(n, device="cuda", generator=g).to(bf)
    out = cutlass_mlp.linear_gelu_aux(x, w, b)
    if out is None:
        return {"declined": True}
    y, z = out
    ze = F.linear(x, w, b)
    ye_own = F.gelu(z)
    ref64 = F.linear(x.double(), w.double(), b.double())
    gy = torch.randn(rows, 64 if k == 64 else 2048, device="cuda", generator=g).to(bf)
    w2 = (torch.randn(gy.shape[1], n, device="cuda", generator=g) * n ** -0.5).to(bf)
    dz = cutlass_mlp.dgelu(gy, w2, z)
    dze = torch.ops.aten.gelu_backward(gy @ w2, z)
    d64 = torch.ops.aten.gelu_backward((gy.double() @ w2.double()), z.double())
    torch.cuda.synchronize()
    return {
        "y_equals_gelu_of_own_z": bool(torch.equal(y, ye_own)),
        "y_differ_frac_vs_gelu_of_own_z": float((y != ye_own).float().mean()),
        "z_differ_frac_vs_eager": float((z != ze).float().mean()),
        "z_max_err_vs_float64_rel": float((z.double() - ref64).abs().max() / ref64.abs().max()),
        "eager_z_max_err_vs_float64_rel": float((ze.double() - ref64).abs().max() / ref64.abs().max()),
        "dz_differ_frac_vs_eager": float((dz != dze).float().mean()),
        "dz_max_err_vs_float64_rel": float((dz.double() - d64).abs().max() / d64.abs().max()),
        "eager_dz_max_err_vs_float64_rel": float((dze.double() - d64).abs().max() / d64.abs().max()),
    }


def pieces(cfg, rows=8192, d=2048, h=8192, rounds=6):
    cutlass_mlp.CONFIG = cfg
    bf = torch.bfloat16
    x = torch.randn(rows, d, device="cuda").to(bf)
    w1 = (torch.randn(h, d, device="cuda") * d ** -0.5).to(bf)
    b1 = torch.randn(h, device="cuda").to(bf)
    gy = torch.randn(rows, d, device="cuda").to(bf)
    w2 = (torch.randn(d, h, device="cuda") * h ** -0.5).to(bf)
    z = F.linear(x, w1, b1)
    fw = {"eager": lambda: F.gelu(F.linear(x, w1, b1)), "cutlass": lambda: cutlass_mlp.linear_gelu_aux(x, w1, b1)}
    bw = {"eager": lambda: torch.ops.aten.gelu_backward(gy @ w2, z), "cutlass": lambda: cutlass_mlp.dgelu(gy, w2, z)}
    for f in list(fw.values()) + list(bw.values()):
        f()
    t_end = torch.cuda.Event(enable_timing=True)
    for _ in range(200):  # heat: the sustained clocks
        fw["eager"]()
    t_end.record()
    t_end.synchronize()
    res = {}
    for name, group in (("forward", fw), ("backward", bw)):
        per = {k: [] for k in group}
        for r in range(rounds):
            for k in (list(group) if r % 2 == 0 else list(group)[::-1]):
                per[k].append(_events_ms(group[k]))
        res[name] = {k: round(statistics.median(v), 4) for k, v in per.items()}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--rounds", type=int, default=16)
    args = ap.parse_args(argv)
    if not cutlass_mlp.available():
        print("no CUTLASS library at", cutlass_mlp.library_path())
        return 1
    doc = {"device": device_name(), "torch": torch.__version__, "exactness": {}, "pieces_ms": {}}
    for cfg in range(3):
        doc["exactness"][cfg] = {"small": exactness(136, 200, 64, cfg), "large": exactness(8192, 8192, 2048, cfg)}
        doc["pieces_ms"][cfg] = pieces(cfg)
        print("config", cfg, doc["exactness"][cfg], doc["pieces_ms"][cfg], flush=True)
    best = min(range(3), key=lambda c: doc["pieces_ms"][c]["forward"]["cutlass"] + doc["pieces_ms"][c]["backward"]["cutlass"])
    doc["picked_config"] = best
    cutlass_mlp.CONFIG = best
    torch.manual_seed(0)
    bf = torch.bfloat16
    base = memory.mlp().cuda().to(bf)
    x = torch.randn(8192, 2048, device="cuda", dtype=bf, requires_grad=True)
    node = cf.optimize(copy.deepcopy(base))
    # gradients of one step, CUTLASS node against eager
    backward.MLP = "cutlass"
    s0 = dict(cutlass_mlp.stats)
    node(x).float().square().mean().backward()
    gn = [p.grad.clone() for p in node.parameters()]
    gxn = x.grad.clone()
    x.grad = None
    for p in node.parameters():
        p.grad = None
    base(x).float().square().mean().backward()
    ge = [p.grad.clone() for p in base.parameters()]
    gxe = x.grad.clone()
    x.grad = None
    for p in base.parameters():
        p.grad = None
    doc["step_kernel_calls"] = {k: cutlass_mlp.stats[k] - s0[k] for k in s0}
    doc["grad_max_rel_diff_vs_eager"] = max(float((a.float() - b.float()).abs().max() / b.float().abs().max())
                                           for a, b in zip(gn + [gxn], ge + [gxe]))
    peak = {"eager": memory.peak_bytes(base, x)}
    backward.MLP = "torch"
    peak["node_torch"] = memory.peak_bytes(node, x)
    backward.MLP = "cutlass"
    peak["node_cutlass"] = memory.peak_bytes(node, x)
    doc["peak_bytes"] = peak

    def use(mode):
        return lambda: setattr(backward, "MLP", mode)

    (et, er), (tt, tr), (ct, cr) = memory.interleaved_ms([base, node, node], x, rounds=args.rounds,
                                                         setups=[use("torch"), use("torch"), use("cutlass")])
    doc["step_ms"] = {"eager": round(et, 3), "node_torch": round(tt, 3), "node_cutlass": round(ct, 3),
                      "rounds": args.rounds, "eager_rounds": [round(v, 3) for v in er],
                      "node_torch_rounds": [round(v, 3) for v in tr], "node_cutlass_rounds": [round(v, 3) for v in cr]}
    print("step ms", doc["step_ms"], "ratio cutlass/eager", round(ct / et, 4), "torch node/eager", round(tt / et, 4))
    print("grads", doc["grad_max_rel_diff_vs_eager"], "peak", peak, "calls", doc["step_kernel_calls"])
    write_json(os.path.join(args.out, "cutlass_mlp_probe.json"), doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
