"""The fused activations over large pre-activations, on every candidate engine (diagnostic).

tests/test_gpu_fuzz.py saw a float32 conv + tanh on eng0 return NaN where |z| is large (tanh
written as (e^2z - 1) / (e^2z + 1) overflows to inf / inf past |z| ~ 44). This feeds every
activation pre-activations spread over [-R, R] (an identity 1x1 conv or an identity GEMM, so
y = act(x) exactly) for conv and matmul in fp16, bf16 and fp32, through cf and through every
heuristic candidate of each graph, and reports non-finite outputs and the worst error against
torch's activation in float64.

    python3 bench/act_range_probe.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from cudnn_fuse import plans, reference  # noqa: E402
from cudnn_fuse.builders import build_graph, roles_of, uids_of  # noqa: E402

ACTS = ["tanh", "gelu_tanh", "sigmoid", "silu", "gelu", "relu", "leaky_relu"]
RANGES = {torch.float16: 2000.0, torch.bfloat16: 1e4, torch.float32: 1e4}


def _z(dtype, n):
    R = RANGES[dtype]
    v = torch.linspace(-1, 1, n, dtype=torch.float64)
    z = torch.sign(v) * (R ** v.abs()) - torch.sign(v)  # log-spread over [-R, R], dense near 0
    return z.to(dtype)


def _score(y, x, act):
    want = reference.activation(x.double().cpu(), act, 0.2)
    got = y.double().cpu()
    fin = torch.isfinite(got)
    err = ((got - want).abs() / want.abs().clamp_min(1e-3))[fin]
    worst = int(err.argmax()) if err.numel() else None
    return {"nonfinite": int((~fin).sum()), "max_rel": float(err.max()) if err.numel() else None,
            "at_z": float(x.double().cpu()[fin].reshape(-1)[worst]) if worst is not None else None}


def case(op, dtype, act):
    C = 16
    x = _z(dtype, 256 * C).reshape(1, 256, C)  # 256 rows x C
    if op == "conv":
        xc = x.reshape(1, 16, 16, C).permute(0, 3, 1, 2).cuda()  # channels_last memory, [1, C, 16, 16]
        w = torch.eye(C, dtype=dtype).reshape(C, C, 1, 1).cuda().contiguous(memory_format=torch.channels_last)
        n0 = len(plans.plans_in_memory())
        y = cf.conv2d(xc, w, activation=act, negative_slope=0.2)
        ref_in = xc
    else:
        a = x.reshape(256, C).cuda()
        n0 = len(plans.plans_in_memory())
        y = cf.matmul(a, torch.eye(C, dtype=dtype).cuda(), activation=act, negative_slope=0.2)
        ref_in = a
    torch.cuda.synchronize()
    new = plans.plans_in_memory()[n0:]
    plan = new[-1] if new else None
    return {"op": op, "dtype": str(dtype)[6:], "act": act, "engine": plan.engine if plan else None,
            **_score(y, ref_in, act)}, plan, ref_in


def conv3_case(dtype, act, bias=False):
    """The fuzz's shape (2x64x11x14 NCHW, 8 3x3 filters, stride 2, valid): a centre-tap delta
    filter copies channel k's pre-activations into output channel k."""
    N, C, H, W, K = 2, 64, 11, 14, 8
    x = _z(dtype, N * C * H * W).reshape(N, C, H, W)[:, torch.randperm(C)].contiguous().cuda()
    w = torch.zeros(K, C, 3, 3, dtype=dtype)
    for k in range(K):
        w[k, k, 1, 1] = 1
    w = w.cuda()
    b = torch.zeros(K, dtype=dtype, device="cuda") if bias else None
    n0 = len(plans.plans_in_memory())
    y = cf.conv2d(x, w, b, stride=2, activation=act, negative_slope=0.2)
    torch.cuda.synchronize()
    z = torch.nn.functional.conv2d(x.double().cpu(), w.double().cpu(), stride=2)
    new = plans.plans_in_memory()[n0:]
    plan = new[-1] if new else None
    return {"op": "conv3x3_s2_nchw" + ("_bias" if bias else ""), "dtype": str(dtype)[6:], "act": act, "engine": plan.engine if plan else None,
            **_score(y, z, act)}, plan, (x, w, z)


def candidates_conv3(plan, xwz, act) -> list:
    import cudnn

    spec = plan.spec
    x, w, z = xwz
    h = plans.handle_for(0).handle
    g = build_graph(spec, h)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([getattr(cudnn.heur_mode, m) for m in plans.HEUR_MODES])
    if spec.dtype == "float32" and not getattr(spec, "allow_tf32", False):
        g.deselect_numeric_notes([cudnn.numerical_note.TENSOR_CORE])
    cudnn.set_stream(handle=h, stream=torch.cuda.current_stream().cuda_stream)
    roles, uids = roles_of(spec), uids_of(spec)
    from cudnn_fuse.autotune import _geometry

    geo = _geometry(spec)
    bufs = []
    for r in roles:
        shape, stride, d = geo[r]
        t = torch.empty_strided(shape, stride, dtype=x.dtype, device="cuda")
        if r == "x":
            t.copy_(x)
        elif r == "w":
            t.copy_(w)
        elif r == "bias":
            t.zero_()
        bufs.append(t)
    yi = roles.index("y")
    out = []
    for i in range(g.get_execution_plan_count()):
        eid, knobs = g.get_engine_and_knobs_at_index(i)
        name = f"eng{int(eid)} {dict((str(getattr(k, 'name', k)), int(v)) for k, v in knobs.items())}"
        try:
            g.build_plan_at_index(i)
            ws = torch.empty(int(g.get_workspace_size_plan_at_index(i)), dtype=torch.uint8, device="cuda")
            bufs[yi].zero_()
            g.execute_plan_at_index(bufs, ws, index=i, handle=h, tensor_uids=uids)
            torch.cuda.synchronize()
            out.append((name, _score(bufs[yi], z, act)))
        except Exception as exc:  # noqa: BLE001
            out.append((name, f"{type(exc).__name__}: {str(exc)[:60]}"))
    return out


def candidates(plan, ref_in, act) -> list:
    import cudnn

    spec = plan.spec
    h = plans.handle_for(0).handle
    g = build_graph(spec, h)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([getattr(cudnn.heur_mode, m) for m in plans.HEUR_MODES])
    if spec.dtype == "float32" and not getattr(spec, "allow_tf32", False):
        g.deselect_numeric_notes([cudnn.numerical_note.TENSOR_CORE])
    cudnn.set_stream(handle=h, stream=torch.cuda.current_stream().cuda_stream)
    roles, uids = roles_of(spec), uids_of(spec)
    from cudnn_fuse.autotune import _geometry

    geo = _geometry(spec)
    dt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    bufs = []
    C = 16
    for r in roles:
        shape, stride, d = geo[r]
        t = torch.empty_strided(shape, stride, dtype=dt[d], device="cuda")
        if r in ("x", "a"):
            t.copy_(ref_in.reshape(shape))
        elif r in ("w", "b"):
            t.copy_(torch.eye(C, dtype=dt[d]).reshape(shape))
        bufs.append(t)
    yi = roles.index("y")
    out = []
    for i in range(g.get_execution_plan_count()):
        eid, knobs = g.get_engine_and_knobs_at_index(i)
        name = f"eng{int(eid)} {dict((str(getattr(k, 'name', k)), int(v)) for k, v in knobs.items())}"
        try:
            g.build_plan_at_index(i)
            ws = torch.empty(int(g.get_workspace_size_plan_at_index(i)), dtype=torch.uint8, device="cuda")
            bufs[yi].zero_()
            g.execute_plan_at_index(bufs, ws, index=i, handle=h, tensor_uids=uids)
            torch.cuda.synchronize()
            out.append((name, _score(bufs[yi].reshape(ref_in.shape), ref_in, act)))
        except Exception as exc:  # noqa: BLE001
            out.append((name, f"{type(exc).__name__}: {str(exc)[:60]}"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--only-conv3-bias", action="store_true", help="only the fuzz's fp32 conv shape with a bias")
    args = ap.parse_args(argv)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for op in (() if args.only_conv3_bias else ("conv", "matmul")):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for act in ACTS:
                r, plan, ref_in = case(op, dtype, act)
                if plan is not None and (r["nonfinite"] or (r["max_rel"] or 0) > 1e-2):
                    r["candidates"] = candidates(plan, ref_in, act)
                rows.append(r)
                print(r, flush=True)
    for dtype, bias in ((torch.float32, True), (torch.float32, False), (torch.float16, False)):
        if args.only_conv3_bias and not bias:
            continue
        for act in ACTS:
            r, plan, xwz = conv3_case(dtype, act, bias)
            if plan is not None:
                r["candidates"] = candidates_conv3(plan, xwz, act)
            rows.append(r)
            print(r, flush=True)
    bad = [r for r in rows if r["nonfinite"] or (r["max_rel"] or 0) > 1e-2]
    with open(os.path.join(args.out, "act_range_probe.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "ranges": {str(k)[6:]: v for k, v in RANGES.items()},
                   "rows": rows, "bad": len(bad)}, f, indent=1, default=str)
    print(f"{len(bad)} of {len(rows)} wrong somewhere in the range")
    return 0


if __name__ == "__main__":
    sys.exit(main())
