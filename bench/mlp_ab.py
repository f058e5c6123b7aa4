"""The memory bench's MLP training step (8 x Linear 2048->8192 + GELU + Linear, bf16, 8192 rows),
four ways in one process, timed in alternating rounds: eager; cf as two modules per block
(cf.nn.Linear with GELU keeping z, then the torch Linear: what optimize() built before
nn.FusedMLP); cf.nn.FusedMLP (what optimize() builds now); the same with the backward's dX / dW products on
torch (cuBLAS) instead of cuDNN matmul graphs. Peak memory of one step each.

    python3 bench/mlp_ab.py --out bench/results [--autotune] [--rounds 12]
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
from bench import memory  # noqa: E402
from bench.common import device_name, write_json  # noqa: E402


def two_modules(base: nn.Sequential) -> nn.Sequential:
    """Each block as cf.nn.Linear(activation='gelu', recompute=False) + the torch Linear, same Parameters."""
    mods = []
    for i in range(0, len(base), 3):
        l1, l2 = base[i], base[i + 2]
        m = cf.nn.Linear(l1.in_features, l1.out_features, device=l1.weight.device, dtype=l1.weight.dtype,
                         activation="gelu", recompute=False)
        m.weight, m.bias = l1.weight, l1.bias
        mods += [m, l2]
    return nn.Sequential(*mods)


class Engines(nn.Module):
    """``model`` with cudnn_fuse.backward's engine switches set on each forward (they stay set
    through that step's backward: the variants' steps never overlap)."""

    def __init__(self, model, **switches):
        super().__init__()
        self.model, self.switches = model, switches

    def forward(self, x):
        from cudnn_fuse import backward

        for k, v in self.switches.items():
            setattr(backward, k, v)
        return self.model(x)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--autotune", action="store_true")
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args(argv)
    if args.autotune:
        cf.set_autotune(True)
    torch.manual_seed(0)
    bf = torch.bfloat16
    base = memory.mlp().cuda().to(bf)
    x = torch.randn(8192, 2048, device="cuda", dtype=bf, requires_grad=True)
    fused = cf.optimize(copy.deepcopy(base))
    assert sum(isinstance(m, cf.nn.FusedMLP) for m in fused.modules()) == 8
    variants = {"eager": base, "cf two modules": Engines(two_modules(copy.deepcopy(base)), MM="cudnn"),
                "cf FusedMLP": Engines(fused, MM="cudnn"),
                "cf FusedMLP, bwd mm torch": Engines(fused, MM="torch")}
    peaks = {k: memory.peak_bytes(m, x) for k, m in variants.items()}
    timed = memory.interleaved_ms(list(variants.values()), x, rounds=args.rounds)
    rows = []
    for (k, _), (ms, rounds) in zip(variants.items(), timed):
        rows.append({"name": k, "peak_bytes": peaks[k], "step_ms": round(ms, 3), "round_ms": [round(v, 3) for v in rounds]})
        print(f"{k:26s} peak {peaks[k] / 2**20:8.1f} MiB   step {ms:7.3f} ms   rounds {min(rounds):.3f}-{max(rounds):.3f}",
              flush=True)
    write_json(os.path.join(args.out, "mlp_ab_autotuned.json" if args.autotune else "mlp_ab.json"),
               {"device": device_name(), "autotune": args.autotune, "rounds": args.rounds, "variants": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
