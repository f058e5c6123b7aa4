"""Host time per forward of a traced model: as written, as torch.fx's GraphModule, and as optimize()'s
(the generated forward fetching shared submodule paths once, ``optimize._hoisted``); writes host_fx.json.

The model is torchvision's ViT-B/16 blocks' structure at tiny widths (12 blocks of LayerNorm, multi-head
attention, a Linear-GELU-Linear MLP, residual adds), run on the CPU with one thread, so that the host's
Python is what is timed. No cf op is in it: only the module around the ops differs.

    python3 bench/host_fx.py --out bench/results
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import statistics
import sys
import time

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.common import write_json  # noqa: E402

opt = importlib.import_module("cudnn_fuse.optimize")


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.self_attention = nn.MultiheadAttention(d, heads, batch_first=True)
        self.dropout = nn.Dropout(0.0)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Dropout(0.0), nn.Linear(2 * d, d), nn.Dropout(0.0))

    def forward(self, x):
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = x + self.dropout(y)
        return x + self.mlp(self.ln_2(x))


class Encoder(nn.Module):
    def __init__(self, blocks=12, d=32, heads=2):
        super().__init__()
        self.layers = nn.Sequential(*[Block(d, heads) for _ in range(blocks)])
        self.ln = nn.LayerNorm(d)

    def forward(self, x):
        return self.ln(self.layers(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.encoder(x)[:, 0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    m = Model().eval()
    x = torch.randn(1, 17, 32)
    traced = opt._trace(m)
    hoisted = opt._trace(m)
    opt._keep_model_surface(hoisted, m)
    hoisted.recompile()
    assert "_cf_m0" in hoisted.code
    variants = {"as_written": m, "fx": traced, "fx_hoisted": hoisted}
    times = {k: [] for k in variants}
    with torch.no_grad():
        for f in variants.values():
            torch.testing.assert_close(f(x), m(x))
            for _ in range(30):
                f(x)
        for _ in range(args.rounds):  # interleaved rounds; the minimum is the host's cost without noise
            for k, f in variants.items():
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    f(x)
                times[k].append(1e6 * (time.perf_counter() - t0) / args.calls)
    best = {k: round(min(v), 1) for k, v in times.items()}
    doc = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__, "threads": 1,
           "model": "12 ViT-style blocks, width 32, 17 tokens, batch 1", "us_per_forward_min": best,
           "us_per_forward_median": {k: round(statistics.median(v), 1) for k, v in times.items()},
           "ratio_to_as_written": {k: round(v / best["as_written"], 3) for k, v in best.items()}}
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "host_fx.json"), doc)
    print(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
