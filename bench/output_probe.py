"""Does a plan read its output buffer before it writes it? (diagnostic)

tests/test_gpu_fuzz.py saw a float32 conv (2x64x11x14, 8 3x3 filters, stride 2, bias, tanh, NCHW
inputs, TF32 off) give a finite answer on its first call and a non-finite one on its second (the
same signature, new values, a recycled output block). This runs that case and a few neighbours
through cf several times, then runs every heuristic candidate of each graph with its output
pre-filled with NaN, +1e30 and 0, and reports which engines' results depend on the old contents.

    python3 bench/output_probe.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from cudnn_fuse import plans  # noqa: E402
from cudnn_fuse.builders import build_graph, roles_of, uids_of  # noqa: E402

CASES = [  # (dtype, N, C, H, W, K, R, stride, bias, act, channels_last)
    (torch.float32, 2, 64, 11, 14, 8, 3, 2, True, "tanh", False),
    (torch.float32, 2, 64, 11, 14, 8, 3, 2, False, None, False),
    (torch.float32, 2, 64, 11, 14, 8, 3, 2, True, "tanh", True),
    (torch.float32, 2, 64, 11, 14, 8, 3, 1, True, "tanh", False),
    (torch.float32, 4, 32, 16, 16, 16, 3, 2, True, "relu", False),
    (torch.float16, 2, 64, 11, 14, 8, 3, 2, True, "tanh", False),
]


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm()).item()


def through_cf(dtype, N, C, H, W, K, R, stride, bias, act, cl, calls=6):
    errs, engine, spec = [], None, None
    for i in range(calls):
        g = torch.Generator(device="cpu").manual_seed(i)
        x = torch.randn(N, C, H, W, generator=g).to(dtype).cuda()
        w = (torch.randn(K, C, R, R, generator=g) / (C * R * R) ** 0.5).to(dtype).cuda()
        b = torch.randn(K, generator=g).to(dtype).cuda() if bias else None
        if cl:
            x, w = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
        junk = torch.full((N * K * H * W * 4,), float("nan"), dtype=dtype, device="cuda")  # poison the free blocks
        del junk
        n0 = len(plans.plans_in_memory())
        y = cf.conv2d(x, w, b, stride=stride, activation=act)
        torch.cuda.synchronize()
        new = plans.plans_in_memory()[n0:]
        if new:
            engine, spec = new[-1].engine, new[-1].spec
        z = F.conv2d(x.double(), w.double(), b.double() if b is not None else None, stride=stride)
        ref = {None: z, "tanh": torch.tanh(z), "relu": F.relu(z)}[act]
        errs.append(rel(y, ref))
    return errs, engine, spec


def candidates(spec) -> list:
    import cudnn

    from cudnn_fuse.autotune import random_buffers

    h = plans.handle_for(0).handle
    g = build_graph(spec, h)
    plans.prepare(g, spec)
    cudnn.set_stream(handle=h, stream=torch.cuda.current_stream().cuda_stream)
    roles, uids = roles_of(spec), uids_of(spec)
    bufs = random_buffers(spec, roles, 0, 1)[0]
    yi = roles.index("y")
    out = []
    for i in range(g.get_execution_plan_count()):
        eid, knobs = g.get_engine_and_knobs_at_index(i)
        name = f"eng{int(eid)} {dict((str(getattr(k, 'name', k)), int(v)) for k, v in knobs.items())}"
        try:
            g.build_plan_at_index(i)
            ws = torch.empty(int(g.get_workspace_size_plan_at_index(i)), dtype=torch.uint8, device="cuda")
            results = {}
            for fill in (0.0, float("nan"), 1e30):
                bufs[yi].fill_(fill)
                if ws.numel():
                    ws.fill_(255)
                g.execute_plan_at_index(bufs, ws, index=i, handle=h, tensor_uids=uids)
                torch.cuda.synchronize()
                results[str(fill)] = bufs[yi].clone()
            base = results["0.0"]
            out.append((name, int(ws.numel()), bool(torch.isfinite(base).all()),
                        {k: (bool(torch.isfinite(v).all()), bool(torch.equal(v, base))) for k, v in results.items()}))
        except Exception as exc:  # noqa: BLE001
            out.append((name, f"{type(exc).__name__}: {str(exc)[:80]}"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for c in CASES:
        errs, engine, spec = through_cf(*c)
        r = {"case": [str(c[0])[6:], *c[1:]], "errors": [round(e, 7) if e != float("inf") else "inf" for e in errs],
             "engine": engine}
        if spec is not None:
            r["candidates"] = candidates(spec)
        rows.append(r)
        print(r, flush=True)
    with open(os.path.join(args.out, "output_probe.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
