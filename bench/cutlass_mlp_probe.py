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
from bench.common import device_name, synced_ms, write_json  # noqa: E402
from bench import memory  # noqa: E402
from cudnn_fuse import backward, cutlass_mlp  # noqa: E402


def exactness(rows, n, k, cfg):
    cutlass_mlp.FWD_CONFIG = cutlass_mlp.BWD_CONFIG = cfg
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
    gy = torch.randn(rows, 64 if k == 64 else 2048, device="cuda", generator=g).to(bf)
    w2 = (torch.randn(gy.shape[1], n, device="cuda", generator=g) * n ** -0.5).to(bf)
    dz = cutlass_mlp.dgelu(gy, w2, z)
    dze = torch.ops.aten.gelu_backward(gy @ w2, z)
    torch.cuda.synchronize()
    return {"y_equals_gelu_of_own_z": bool(torch.equal(y, F.gelu(z))),
            "z_differ_frac_vs_eager": float((z != ze).float().mean()),
            "dz_differ_frac_vs_eager": float((dz != dze).float().mean())}


CANDIDATES = [t + 16 * sw for t in range(cutlass_mlp.TILES) for sw in (0, 3)]  # each tile, swizzle 1 and 8


def pieces(rows=8192, d=2048, h=8192, rounds=4, candidates=CANDIDATES):
    """Device ms (median of rounds' medians) of eager's and each CUTLASS launch, forward and backward."""
    bf = torch.bfloat16
    x = torch.randn(rows, d, device="cuda").to(bf)
    w1 = (torch.randn(h, d, device="cuda") * d ** -0.5).to(bf)
    b1 = torch.randn(h, device="cuda").to(bf)
    gy = torch.randn(rows, d, device="cuda").to(bf)
    w2 = (torch.randn(d, h, device="cuda") * h ** -0.5).to(bf)
    z = F.linear(x, w1, b1)

    def fwd(c):
        def run():
            cutlass_mlp.FWD_CONFIG = c
            return cutlass_mlp.linear_gelu_aux(x, w1, b1)
        return run

    def bwd(c):
        def run():
            cutlass_mlp.BWD_CONFIG = c
            return cutlass_mlp.dgelu(gy, w2, z)
        return run

    groups = {"forward": {"eager": lambda: F.gelu(F.linear(x, w1, b1)), **{c: fwd(c) for c in candidates}},
              "backward": {"eager": lambda: torch.ops.aten.gelu_backward(gy @ w2, z), **{c: bwd(c) for c in candidates}}}
    for group in groups.values():
        for f in group.values():
            assert f() is not None
    for _ in range(200):  # heat: the sustained clocks
        groups["forward"]["eager"]()
    torch.cuda.synchronize()
    res = {}
    for name, group in groups.items():
        per = {k: [] for k in group}
        for r in range(rounds):
            for k in (list(group) if r % 2 == 0 else list(group)[::-1]):
                per[k].append(synced_ms(group[k], 20))
        res[name] = {str(k): round(statistics.median(v), 4) for k, v in per.items()}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--rounds", type=int, default=16)
    args = ap.parse_args(argv)
    if not cutlass_mlp.available():
        print("no CUTLASS library at", cutlass_mlp.library_path())
        return 1
    doc = {"device": device_name(), "torch": torch.__version__, "exactness": {}, "candidates": CANDIDATES}
    for cfg in CANDIDATES:
        doc["exactness"][cfg] = {"small": exactness(136, 200, 64, cfg), "large": exactness(8192, 8192, 2048, cfg)}
    print("exactness", doc["exactness"], flush=True)
    doc["pieces_ms"] = pieces()
    print("pieces", doc["pieces_ms"], flush=True)
    fw, bw = doc["pieces_ms"]["forward"], doc["pieces_ms"]["backward"]
    best_f = min(CANDIDATES, key=lambda c: fw[str(c)])
    best_b = min(CANDIDATES, key=lambda c: bw[str(c)])
    # the forward on CUTLASS only where its fastest launch beat eager's addmm + GELU
    cutlass_mlp.FWD_CONFIG = best_f if fw[str(best_f)] < fw["eager"] else -1
    cutlass_mlp.BWD_CONFIG = best_b
    doc["picked"] = {"forward": cutlass_mlp.FWD_CONFIG, "backward": best_b}
    print("picked", doc["picked"], flush=True)
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
