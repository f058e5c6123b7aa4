"""Normalization through cuDNN's graph API against torch's kernels, at the zoo's shapes; writes norms.json.

Per shape (rows x hidden, 16-bit): torch's F.layer_norm / F.rms_norm against cudnn-frontend's own
``cudnn.ops.norm.layer_norm`` / ``rms_norm`` (training-phase graphs: y, mean and 1/std), and a residual add
+ LayerNorm in one inference graph (h = x + r and LayerNorm(h) both written, as a pre-norm block needs)
against torch's add then F.layer_norm. Device time per call (CUDA events around 100 back-to-back calls).

    python3 bench/norms.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.common import device_name, write_json  # noqa: E402

# (what, rows, hidden, dtype): the zoo's LayerNorms and RMSNorms at batch 32
SHAPES = [("vit_b_16", 6304, 768, torch.float16), ("bert/gpt2", 8192, 768, torch.bfloat16),
          ("convnext stage 1", 100352, 96, torch.float16), ("convnext stage 3", 6272, 384, torch.float16),
          ("llama_small", 8192, 1024, torch.bfloat16), ("large", 16384, 4096, torch.bfloat16)]


def device_us(fn, n=100) -> float:
    for _ in range(10):
        fn()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    e1.synchronize()
    return round(1e3 * e0.elapsed_time(e1) / n, 2)


def add_layernorm_graph(rows, hidden, dtype):
    """(run(x, r) -> (h, y), None) of one cuDNN graph h = x + r, y = LayerNorm(h), or (None, why)."""
    import cudnn

    io = {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16}[dtype]
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    g = cudnn.pygraph(handle=handle, io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT)
    dims, strides = [rows, hidden, 1, 1], [hidden, 1, hidden, hidden]
    X = g.tensor(name="x", dim=dims, stride=strides, data_type=io)
    R = g.tensor(name="r", dim=dims, stride=strides, data_type=io)
    S = g.tensor(name="scale", dim=[1, hidden, 1, 1], stride=[hidden, 1, hidden, hidden], data_type=cudnn.data_type.FLOAT)
    B = g.tensor(name="bias", dim=[1, hidden, 1, 1], stride=[hidden, 1, hidden, hidden], data_type=cudnn.data_type.FLOAT)
    E = g.tensor(name="eps", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT, is_pass_by_value=True)
    H = g.add(a=X, b=R, name="residual")
    H.set_output(True).set_data_type(io)
    Y, _, _ = g.layernorm(name="ln", norm_forward_phase=cudnn.norm_forward_phase.INFERENCE, input=H, scale=S, bias=B,
                          epsilon=E)
    Y.set_output(True).set_data_type(io)
    try:
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
    except Exception as exc:  # noqa: BLE001 - not supported is a result
        return None, f"{type(exc).__name__}: {exc}"[:300]
    ws = torch.empty(g.get_workspace_size(), device="cuda", dtype=torch.uint8)
    s = torch.ones(hidden, device="cuda", dtype=torch.float32)
    b = torch.zeros(hidden, device="cuda", dtype=torch.float32)
    eps = torch.full((1, 1, 1, 1), 1e-5, dtype=torch.float32)

    def run(x, r):
        h, y = torch.empty_like(x), torch.empty_like(x)
        g.execute({X: x, R: r, S: s, B: b, E: eps, H: h, Y: y}, ws, handle=handle)
        return h, y
    return run, None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = ap.parse_args(argv)
    from cudnn.ops.norm import layer_norm, rms_norm

    rows = []
    for what, n, h, dt in SHAPES:
        x = torch.randn(n, h, device="cuda", dtype=dt)
        r = torch.randn(n, h, device="cuda", dtype=dt)
        w = torch.rand(h, device="cuda", dtype=dt) + 0.5
        b = torch.randn(h, device="cuda", dtype=dt)
        wf, bf = w.float(), b.float()
        row = {"what": what, "rows": n, "hidden": h, "dtype": str(dt).split(".")[-1]}
        row["torch_layer_norm_us"] = device_us(lambda: F.layer_norm(x, (h,), w, b))
        try:
            got = layer_norm(x, (h,), wf, bf)
            row["layer_norm_err"] = float((got.float() - F.layer_norm(x.float(), (h,), wf, bf)).abs().max())
            row["cudnn_layer_norm_us"] = device_us(lambda: layer_norm(x, (h,), wf, bf))
        except Exception as exc:  # noqa: BLE001
            row["cudnn_layer_norm_error"] = f"{type(exc).__name__}: {exc}"[:300]
        row["torch_rms_norm_us"] = device_us(lambda: F.rms_norm(x, (h,), w))
        try:
            row["cudnn_rms_norm_us"] = device_us(lambda: rms_norm(x, (h,), wf))
        except Exception as exc:  # noqa: BLE001
            row["cudnn_rms_norm_error"] = f"{type(exc).__name__}: {exc}"[:300]
        row["torch_add_layer_norm_us"] = device_us(lambda: F.layer_norm(x + r, (h,), w, b))
        run, why = add_layernorm_graph(n, h, dt)
        if run is None:
            row["cudnn_add_layer_norm_error"] = why
        else:
            hh, y = run(x, r)
            ref = F.layer_norm((x + r).float(), (h,))
            row["add_layer_norm_err"] = float((y.float() - ref).abs().max())
            row["cudnn_add_layer_norm_us"] = device_us(lambda: run(x, r))
        print(json.dumps(row), flush=True)
        rows.append(row)
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "norms.json"), {"gpu": device_name(), "torch": torch.__version__, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
