"""Which grouped-conv training graphs give wrong gradients, and on which cuDNN engine (diagnostic).

tests/test_gpu_optimize_fuzz.py found the input and weight gradients of a grouped conv (groups=2)
with a fused silu / sigmoid / GELU 100-8000x off float64 in fp16 (bf16 and groups=1 fine), the
forward right. Those activations' backward recomputes the pre-activation inside one graph (conv
fprop + bias + act backward, backward.recompute_grad). This sweeps dtype x groups x activation x
bias x kernel through cf.conv2d's training path against float64 autograd and records the graph
each piece ran on with its engine. (The first run also tried leaky_probe.candidates on the failing
graphs; it has no torch implementation of conv graphs, so grouped_grad_probe_before_fix.json holds
only its errors, and that step is gone. Its "wrong" list also missed the NaN rows, which
compare false; counted from its "rows", 12 of 64 are wrong.)

    python3 bench/grouped_grad_probe.py --out bench/results
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from bench.leaky_probe import rel  # noqa: E402
from cudnn_fuse import manifest, plans  # noqa: E402

ACTS = {"silu": F.silu, "sigmoid": torch.sigmoid, "gelu": F.gelu, "tanh": torch.tanh, "relu": F.relu,
        "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}


def run(dtype, groups, act, bias, r, c=16, k=16, cl=False):
    torch.manual_seed(0)
    x = torch.randn(8, c, 16, 15, device="cuda").to(dtype)
    if cl:
        x = x.contiguous(memory_format=torch.channels_last)
    w = (torch.randn(k, c // groups, r, r, device="cuda") / (c // groups * r * r) ** 0.5).to(dtype)
    b = torch.randn(k, device="cuda").to(dtype) if bias else None
    gy = torch.randn(8, k, 16, 15, device="cuda").to(dtype)
    x64, w64 = x.double().cpu().requires_grad_(True), w.double().cpu().requires_grad_(True)
    b64 = b.double().cpu().requires_grad_(True) if bias else None
    ACTS[act](F.conv2d(x64, w64, b64, 1, r // 2, 1, groups)).backward(gy.double().cpu())
    xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    bs = b.clone().requires_grad_(True) if bias else None
    with manifest.record() as rec:
        y = cf.conv2d(xs, ws, bs, 1, r // 2, 1, groups, activation=act)
        y.backward(gy)
        torch.cuda.synchronize()
    errs = {"dx": rel(xs.grad.cpu(), x64.grad), "dw": rel(ws.grad.cpu(), w64.grad)}
    if bias:
        errs["db"] = rel(bs.grad.cpu(), b64.grad)
    specs = [e.spec for e in rec.entries]
    return errs, specs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    rows = []
    engines = {p.spec: p.engine for p in plans.plans_in_memory()}
    for dtype, groups, act, bias, r, cl in itertools.product(
            [torch.float16, torch.bfloat16], [1, 2], ["silu", "sigmoid", "gelu", "relu"], [False, True], [1, 3],
            [False]):
        errs, specs = run(dtype, groups, act, bias, r, cl=cl)
        engines.update({p.spec: p.engine for p in plans.plans_in_memory()})
        row = dict(dtype=str(dtype)[6:], groups=groups, act=act, bias=bias, r=r, channels_last=cl,
                   err={k: round(v, 5) for k, v in errs.items()},
                   graphs=[f"{s.op}: {engines.get(s)}" for s in specs])
        rows.append(row)
        if any(not v <= 0.05 for v in errs.values()):  # NaN is wrong too
            print("WRONG", row, flush=True)
    wrong = [r for r in rows if any(not v <= 0.05 for v in r["err"].values())]
    out = {"device": torch.cuda.get_device_name(), "rows": rows, "wrong": wrong}
    with open(os.path.join(args.out, "grouped_grad_probe.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"{len(wrong)} wrong of {len(rows)}")
    for r in rows:
        print(r["dtype"], "g", r["groups"], r["act"], "b" if r["bias"] else "-", "r", r["r"], "cl" if r["channels_last"] else "nchw",
              r["err"], r["graphs"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
