"""Which fused leaky_relu graphs give a wrong answer, and on which cuDNN engine (diagnostic).

tests/test_gpu_fuzz.py found cf.linear(x, w, activation="leaky_relu", negative_slope=0.2) in fp16
at 128x128x128 (no bias, strided views) 20% off a float64 reference: what plain ReLU (slope 0)
would give. This sweeps op x dtype x bias x slope x shape x layout through cf's fused path,
reports each error with the engine cf ran, then runs every heuristic candidate of each failing
graph on the same buffers to name the engines that ignore the slope.

    python3 bench/leaky_probe.py --out bench/results
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
from cudnn_fuse import plans  # noqa: E402
from cudnn_fuse.builders import build_graph, roles_of, uids_of  # noqa: E402


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def sliced(t):
    big = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    v = big[..., 1::2]
    v.copy_(t)
    return v


def run_linear(dtype, bias, slope, n, layout, op):
    torch.manual_seed(0)
    x = torch.randn(n, n, device="cuda").to(dtype)
    w = (torch.randn(n, n, device="cuda") / n ** 0.5).to(dtype)
    b = torch.randn(n, device="cuda").to(dtype) if bias else None
    if layout == "sliced":
        x, w = sliced(x), sliced(w)
    ref = F.leaky_relu(F.linear(x.double(), w.double(), b.double() if b is not None else None), slope)
    n0 = len(plans.plans_in_memory())
    y = (cf.linear(x, w, b, activation="leaky_relu", negative_slope=slope) if op == "linear"
         else cf.matmul(x, w.t(), b, activation="leaky_relu", negative_slope=slope))
    torch.cuda.synchronize()
    new = plans.plans_in_memory()[n0:]
    plan = new[-1] if new else None
    return rel(y, ref), plan, (x, w, b)


def run_conv(dtype, bias, slope, n, layout):
    torch.manual_seed(0)
    x = torch.randn(4, n, 14, 14, device="cuda").to(dtype)
    w = (torch.randn(n, n, 3, 3, device="cuda") / (9 * n) ** 0.5).to(dtype)
    b = torch.randn(n, device="cuda").to(dtype) if bias else None
    if layout != "sliced":
        x, w = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
    ref = F.leaky_relu(F.conv2d(x.double(), w.double(), b.double() if b is not None else None, padding=1), slope)
    n0 = len(plans.plans_in_memory())
    y = cf.conv2d(x, w, b, padding=1, activation="leaky_relu", negative_slope=slope)
    torch.cuda.synchronize()
    new = plans.plans_in_memory()[n0:]
    return rel(y, ref), (new[-1] if new else None), None


_OUT = ("y", "z", "dz", "dbias", "amax")


def candidates(spec) -> list:
    """Every heuristic candidate of ``spec``'s graph on one set of random buffers, each output
    compared with torch's implementation of the same spec (torch_engine.TorchPlan):
    (engine, worst relative error over the outputs)."""
    import cudnn

    from cudnn_fuse.autotune import random_buffers
    from cudnn_fuse.torch_engine import TorchPlan

    h = plans.handle_for(0).handle
    g = build_graph(spec, h)
    g.validate()  # plans.prepare without its engine bar: every candidate cuDNN offers
    g.build_operation_graph()
    g.create_execution_plans([getattr(cudnn.heur_mode, m) for m in plans.HEUR_MODES])
    cudnn.set_stream(handle=h, stream=torch.cuda.current_stream().cuda_stream)
    roles, uids = roles_of(spec), uids_of(spec)
    bufs = random_buffers(spec, roles, 0, 1)[0]
    ref = [b.clone() for b in bufs]
    TorchPlan(spec, 0).run(ref)
    torch.cuda.synchronize()
    outs = [i for i, r in enumerate(roles) if r in _OUT]
    res = []
    for i in range(g.get_execution_plan_count()):
        eid, knobs = g.get_engine_and_knobs_at_index(i)
        name = f"eng{int(eid)} {dict((str(getattr(k, 'name', k)), int(v)) for k, v in knobs.items())}"
        try:
            g.build_plan_at_index(i)
            ws = torch.empty(int(g.get_workspace_size_plan_at_index(i)), dtype=torch.uint8, device="cuda")
            for j in outs:
                bufs[j].zero_()
            g.execute_plan_at_index(bufs, ws, index=i, handle=h, tensor_uids=uids)
            torch.cuda.synchronize()
            res.append((name, round(max(rel(bufs[j], ref[j]) for j in outs), 4)))
        except Exception as exc:  # noqa: BLE001
            res.append((name, f"{type(exc).__name__}: {str(exc)[:80]}"))
    return res


def training_specs(dtype, slope):
    """The matmul-class graphs a leaky_relu Linear's training step (no bias) and a
    Linear -> LeakyReLU -> Linear block through optimize() make."""
    from torch import nn

    from cudnn_fuse import manifest

    x = torch.randn(256, 128, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.randn(192, 128, device="cuda") / 12).to(dtype).requires_grad_(True)
    mlp = cf.optimize(nn.Sequential(nn.Linear(128, 256, bias=False), nn.LeakyReLU(slope),
                                    nn.Linear(256, 128, bias=False)).cuda().to(dtype))
    with manifest.record() as rec:
        cf.linear(x, w, None, activation="leaky_relu", negative_slope=slope).float().square().mean().backward()
        mlp(x).float().square().mean().backward()
    torch.cuda.synchronize()
    from cudnn_fuse import torch_engine

    seen, out = set(), []
    for e in rec.entries:
        if e.spec not in seen and torch_engine.supports(e.spec):
            seen.add(e.spec)
            out.append(e.spec)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    rows, bad = [], []
    for op, dtype, bias, slope, n, layout in itertools.product(
            ["linear", "matmul"], [torch.float16, torch.bfloat16], [False, True], [0.01, 0.2, 0.5],
            [64, 128, 256, 1024], ["contiguous", "sliced"]):
        err, plan, _ = run_linear(dtype, bias, slope, n, layout, op)
        r = dict(op=op, dtype=str(dtype)[6:], bias=bias, slope=slope, n=n, layout=layout, err=round(err, 4),
                 engine=plan.engine if plan else None)
        rows.append(r)
        if err > 1e-2 and plan is not None:
            bad.append((r, plan))
    for dtype, bias, slope, n, layout in itertools.product([torch.float16, torch.bfloat16], [False, True], [0.2],
                                                          [16, 64, 128], ["channels_last", "sliced"]):
        err, plan, _ = run_conv(dtype, bias, slope, n, layout)
        rows.append(dict(op="conv2d", dtype=str(dtype)[6:], bias=bias, slope=slope, n=n, layout=layout,
                         err=round(err, 4), engine=plan.engine if plan else None))
    wrong = [r for r in rows if r["err"] > 1e-2]
    for r in wrong:
        print("WRONG", r, flush=True)
    seen, cands = set(), []
    for r, plan in bad:
        if plan.spec.op != "matmul" or plan.spec in seen or len(cands) >= 4:
            continue
        seen.add(plan.spec)
        c = candidates(plan.spec)
        cands.append({"case": r, "candidates": c})
        print("CANDIDATES", r, c, flush=True)
    for dtype in (torch.float16, torch.bfloat16):
        for spec in training_specs(dtype, 0.2):
            c = candidates(spec)
            cands.append({"case": {"training": spec.op, "dtype": str(dtype)[6:]}, "candidates": c})
            print("TRAINING", spec.op, str(dtype)[6:], c, flush=True)
    out = {"device": torch.cuda.get_device_name(), "rows": rows, "wrong": wrong, "candidates": cands}
    with open(os.path.join(args.out, "leaky_probe.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"{len(wrong)} wrong of {len(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
