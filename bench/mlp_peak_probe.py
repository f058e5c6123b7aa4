"""Where a FusedMLP step's peak falls against eager's: one Linear -> GELU -> Linear block (4096 x
1024 -> 4096 bf16), eager and the node on each kernel set, the peak above the step's starting
allocation after the forward and after the backward, for the exact and the tanh GELU.

    python3 bench/mlp_peak_probe.py --out DIR
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from bench.common import write_json  # noqa: E402
from cudnn_fuse import backward, cublaslt  # noqa: E402


def phases(model, x) -> dict:
    out = {}
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        x.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = model(x).float().square().mean()
        torch.cuda.synchronize()
        out["forward_peak_MiB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        out["after_forward_MiB"] = (torch.cuda.memory_allocated() - base) / 2**20
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        torch.cuda.synchronize()
        out["backward_peak_MiB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        out["start_MiB"] = base / 2**20
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    res = {}
    for approx in ("none", "tanh"):
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(approximate=approx), nn.Linear(4096, 1024)).cuda().to(torch.bfloat16)
        opt = cf.optimize(copy.deepcopy(base))
        x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        res[approx] = {"eager": phases(base, x)}
        for mode in ("torch", "cublaslt"):
            backward.MLP = mode
            res[approx][mode] = phases(opt, x)
        backward.MLP = "torch"
        for k, v in res[approx].items():
            print(approx, k, {a: round(b, 1) for a, b in v.items()}, flush=True)
        if os.environ.get("PEAK_SNAPSHOT"):  # allocation histories of one step each, for reading
            for mode, m in (("eager", base), ("torch", opt), ("cublaslt", opt)):
                backward.MLP = "torch" if mode == "eager" else mode
                phases(m, x)
                torch.cuda.memory._record_memory_history(max_entries=100000)
                phases(m, x)
                torch.cuda.memory._dump_snapshot(os.path.join(args.out, f"snapshot_{approx}_{mode}.pickle"))
                torch.cuda.memory._record_memory_history(enabled=None)
            backward.MLP = "torch"
    res["workspaces"] = {str(k): v for k, v in cublaslt.epilogue_workspaces().items()}
    print(res["workspaces"])
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "mlp_peak_probe.json"), res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
