"""Peak memory and step time of one training step, eager PyTorch against cudnn_fuse; writes memory.json.

(a) a transformer-MLP stack of Linear+GELU layers: eager, cf (pre-activation kept), and cf with
    recompute=True (the backward recomputes the pre-activation; the forward saves none);
(b) a conv-bias-ReLU stack: eager against cf (ReLU's backward needs only the output).

Eager and cf steps are timed in alternating rounds in one process (the order flips every
round), so neither is measured on a GPU the other has just heated.

    python3 bench/memory.py --out bench/results
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from bench.common import device_name, synced_ms, write_json  # noqa: E402


def mlp(d=2048, layers=8):
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)]
    return nn.Sequential(*mods)


def convs(c=128, layers=8):
    mods = []
    for _ in range(layers):
        mods += [nn.Conv2d(c, c, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*mods)


def train_step(model, x):
    """One training step: forward, a scalar loss, backward, and the gradients dropped."""
    model(x).float().square().mean().backward()
    for p in model.parameters():
        p.grad = None


def peak_bytes(model, x) -> int:
    """Peak bytes one warm step allocates above what was allocated before it."""
    for _ in range(3):
        train_step(model, x)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    train_step(model, x)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def interleaved_ms(models, x, rounds=6, steps=4) -> list:
    """Per model: (median step ms, the rounds' medians, each round's [launch-graph captures, replays]),
    timed in alternating rounds (A B, B A, A B, ...) so that neither runs on a GPU the other has
    warmed (clocks, temperature)."""
    per = [[] for _ in models]
    graphs = [[] for _ in models]
    for r in range(rounds):
        order = range(len(models)) if r % 2 == 0 else reversed(range(len(models)))
        for i in order:
            before = cf.plan_stats()
            per[i].append(synced_ms(lambda: train_step(models[i], x), steps))
            after = cf.plan_stats()
            graphs[i].append([after.get(k, 0) - before.get(k, 0) for k in ("graph_captures", "graph_replays")])
    return [(statistics.median(p), p, g) for p, g in zip(per, graphs)]


def case(name, eager, fused, x, rounds):
    """One row: both models' peak bytes of a warm step, then their step times in alternating rounds.
    ``cf_fallbacks`` counts the op calls that ran torch instead of a cuDNN graph (forward or backward)."""
    ep = peak_bytes(eager, x)
    f0 = cf.plan_stats()["fallbacks"]
    cp = peak_bytes(fused, x)
    (et, er, _), (ct, cr, graphs) = interleaved_ms([eager, fused], x, rounds=rounds)
    print(f"{name:40s} peak {ep / 2**20:8.1f} -> {cp / 2**20:8.1f} MiB ({cp / ep:5.2f}x)   "
          f"step {et:7.3f} -> {ct:7.3f} ms ({ct / et:5.2f}x)   rounds eager {min(er):.3f}-{max(er):.3f}, "
          f"cf {min(cr):.3f}-{max(cr):.3f}", flush=True)
    return {"name": name, "eager_peak_bytes": ep, "cf_peak_bytes": cp, "eager_step_ms": round(et, 3),
            "cf_step_ms": round(ct, 3), "cf_fallbacks": cf.plan_stats()["fallbacks"] - f0,
            "eager_round_ms": [round(v, 3) for v in er], "cf_round_ms": [round(v, 3) for v in cr],
            "cf_round_graph_captures_replays": graphs}


def _fused_training(model):
    """``model`` with its layers' fused training path on: optimize() builds them to train on torch's
    expression, and this case measures the FusedMLP node."""
    for m in model.modules():
        if hasattr(m, "fuse_training"):
            m.fuse_training = True
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--autotune", action="store_true",
                    help="cf autotunes every graph on its first call (budget: $CUDNN_FUSE_TUNE_BUDGET_S); "
                         "written to memory_autotuned.json")
    ap.add_argument("--rounds", type=int, default=6, help="alternating timing rounds per case (4 steps each)")
    ap.add_argument("--only", choices=("mlp", "conv"), help="run only these cases (written to memory_<only>.json)")
    args = ap.parse_args(argv)
    rounds = max(1, args.rounds)
    if args.autotune:
        cf.set_autotune(True)
    torch.manual_seed(0)
    bf = torch.bfloat16
    rows = []
    if args.only != "conv":
        base = mlp().cuda().to(bf)
        x = torch.randn(8192, 2048, device="cuda", dtype=bf, requires_grad=True)
        rows += [case("mlp_linear_gelu", base, _fused_training(cf.optimize(copy.deepcopy(base))), x, rounds),
                 case("mlp_linear_gelu_recompute", base, cf.optimize(copy.deepcopy(base), recompute=True), x, rounds)]
    if args.only != "mlp":
        cbase = convs().cuda().half().to(memory_format=torch.channels_last)
        xc = torch.randn(32, 128, 56, 56, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
        rows.append(case("conv_bias_relu", cbase, cf.optimize(copy.deepcopy(cbase)), xc.requires_grad_(), rounds))
    name = ("memory_autotuned" if args.autotune else "memory") + (f"_{args.only}" if args.only else "")
    write_json(os.path.join(args.out, name + ".json"),
               {"device": device_name(), "autotune": args.autotune, "rounds": rounds,
                "graph_stats": {k: v for k, v in cf.plan_stats().items() if k.startswith("graph_")},
                "cases": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
