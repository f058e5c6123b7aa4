"""Peak memory and step time of one training step, eager vs cudnn_fuse (issue 4).

(a) a transformer-MLP stack of Linear+GELU layers: eager, cf (pre-activation kept), and cf with
    recompute=True (the backward recomputes the pre-activation; the forward saves none);
(b) a conv-bias-ReLU stack: eager vs cf (ReLU's backward needs only the output).

Eager and cf steps are timed in alternating rounds in one process (the order flips every
round), so neither is measured on a GPU the other has just heated.

    python3 bench/memory.py --out bench/results
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from bench.common import device_name, synced_ms, write_json  # noqa: E402


def mlp(d=2048, layers=8, approximate="none"):
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(d, 4 * d), nn.GELU(approximate=approximate), nn.Linear(4 * d, d)]
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


def step_stats(model, x, steps=10):
    """(peak bytes of one step, median step ms), one model alone (backward_probe's engine sweeps)."""
    return peak_bytes(model, x), synced_ms(lambda: train_step(model, x), steps)


def interleaved_ms(models, x, rounds=6, steps=4, setups=None) -> list:
    """Median step ms of each model, timed in alternating rounds (A B, B A, A B, ...) so that
    neither runs on a GPU the other has warmed (clocks, temperature); each model's round
    medians come back too, for the spread. ``setups[i]()``, where given, runs before model i's rounds."""
    per = [[] for _ in models]
    graphs = [[] for _ in models]  # per round: the launch-graph captures and replays it made
    for r in range(rounds):
        order = range(len(models)) if r % 2 == 0 else reversed(range(len(models)))
        for i in order:
            if setups is not None and setups[i] is not None:
                setups[i]()
            before = cf.plan_stats()
            per[i].append(synced_ms(lambda: train_step(models[i], x), steps))
            after = cf.plan_stats()
            graphs[i].append([after[k] - before[k] for k in ("graph_captures", "graph_replays")])
    LAST_GRAPHS[:] = graphs
    return [(statistics.median(p), p) for p in per]


LAST_GRAPHS: list = []  # interleaved_ms's last per-round [captures, replays], per model


ROUNDS = 6


def _row(name, ep, cp, et, er, ct, cr, fallbacks, graphs):
    # fallbacks counts every op call that ran torch instead of a cuDNN graph (forward or backward)
    row = {"name": name, "eager_peak_bytes": ep, "cf_peak_bytes": cp, "eager_step_ms": round(et, 3),
           "cf_step_ms": round(ct, 3), "cf_fallbacks": fallbacks,
           "eager_round_ms": [round(v, 3) for v in er], "cf_round_ms": [round(v, 3) for v in cr],
           "cf_round_graph_captures_replays": graphs}
    print(f"{name:40s} peak {ep / 2**20:8.1f} -> {cp / 2**20:8.1f} MiB ({cp / ep:5.2f}x)   "
          f"step {et:7.3f} -> {ct:7.3f} ms ({ct / et:5.2f}x)   rounds eager {min(er):.3f}-{max(er):.3f}, "
          f"cf {min(cr):.3f}-{max(cr):.3f}", flush=True)
    return row


def case(name, eager, fused, x):
    ep = peak_bytes(eager, x)
    f0 = cf.plan_stats()["fallbacks"]
    cp = peak_bytes(fused, x)
    (et, er), (ct, cr) = interleaved_ms([eager, fused], x, rounds=ROUNDS)
    return _row(name, ep, cp, et, er, ct, cr, cf.plan_stats()["fallbacks"] - f0,
                LAST_GRAPHS[1] if len(LAST_GRAPHS) > 1 else None)


def variant_case(name, eager, fused, x, other, suffix, setups=None) -> list:
    """``case`` with a third model in the same rounds (``other``, or ``fused`` itself behind ``setups``:
    see interleaved_ms). Two rows: cf as it is, and the variant (name + ``suffix``)."""
    ep = peak_bytes(eager, x)
    f0 = cf.plan_stats()["fallbacks"]
    cp = peak_bytes(fused, x)
    op = peak_bytes(other, x) if other is not fused else cp
    (et, er), (ct, cr), (ot, orr) = interleaved_ms([eager, fused, other], x, rounds=ROUNDS, setups=setups)
    fb = cf.plan_stats()["fallbacks"] - f0
    g = LAST_GRAPHS
    return [_row(name, ep, cp, et, er, ct, cr, fb, g[1]), _row(name + suffix, ep, op, et, er, ot, orr, fb, g[2])]


def chain_case(name, eager, fused, chained, x) -> list:
    """The conv row also with its runs chained (one autograd node, cf.optimize(chain_convs=True))."""
    return variant_case(name, eager, fused, x, chained, " [conv chain]")


def _programmatic(gs) -> bool:
    """Whether a launch set replays a chain with a programmatic dependent launch (the split-K wgrad)."""
    from cudnn_fuse import launch_graphs

    pdl = launch_graphs.ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
    return any(isinstance(e, launch_graphs.SequenceReplay) and
               any(isinstance(st, launch_graphs.KernelReplay) and pdl in st.attribute_ids for st in e.steps)
               for e in gs.execs.values())


def _long_kernel_sets(off: bool, only=None):
    """Switch the kernel-replay-only launch sets of every plan held (launch_graphs: kernels too long for
    graph replays), or those of them ``only(set)`` picks, off (launched raw, as before they existed) or
    back on."""
    n = 0
    for gs in _held_sets():
        if gs.kernel_only and (only is None or only(gs)):
            n += 1
            if off and not gs.off:
                gs.off = True
                _SWITCHED_OFF.add(id(gs))
            elif not off and id(gs) in _SWITCHED_OFF:  # never one that declined (off on its own)
                gs.off = False
                _SWITCHED_OFF.discard(id(gs))
    return n


_SWITCHED_OFF: set = set()


def kernel_replay_case(name, eager, fused, x) -> list:
    """The row also with the cf model's long kernels' kernel replays switched off (every launch of
    theirs raw), the same plans otherwise (name + " [long kernels raw]")."""
    try:
        rows = variant_case(name, eager, fused, x, fused, " [long kernels raw]",
                            setups=[None, lambda: _long_kernel_sets(False), lambda: _long_kernel_sets(True)])
    finally:
        sets = _long_kernel_sets(False)
    rows[0]["long_kernel_sets"] = sets
    return rows


def programmatic_case(name, eager, fused, x) -> list:
    """The row also with the launch sets that replay programmatic chains (cuDNN's split-K wgrad:
    three kernels, each later one a programmatic dependent) switched off, launched raw (name +
    " [programmatic chains raw]")."""
    try:  # variant_case's peak_bytes steps capture the sets before the first round's setup
        rows = variant_case(name, eager, fused, x, fused, " [programmatic chains raw]",
                            setups=[None, lambda: _long_kernel_sets(False), lambda: _long_kernel_sets(True, _programmatic)])
    finally:
        sets = _long_kernel_sets(False)
    rows[1]["programmatic_sets"] = sum(1 for p in _held_sets() if _programmatic(p))
    rows[0]["long_kernel_sets"] = sets
    return rows


def _held_sets():
    """The launch sets of every plan held in memory (a conv run as its GEMM: the GEMM's)."""
    from cudnn_fuse import launch_graphs, plans

    for p in plans.plans_in_memory():
        gs = getattr(getattr(p, "gemm", p), "_graphs", None)
        if isinstance(gs, launch_graphs.GraphSet):
            yield gs


@contextlib.contextmanager
def _engines(**kw):
    """Switch cudnn_fuse.backward's engine choices (MM, DBIAS, CONV, MLP, MLP_DZ) inside the block."""
    from cudnn_fuse import backward

    old = {k: getattr(backward, k) for k in kw}
    for k, v in kw.items():
        setattr(backward, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(backward, k, v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--variants", action="store_true", help="also time the backward with torch for some pieces")
    ap.add_argument("--autotune", action="store_true",
                    help="cf autotunes every graph on its first call (budget: $CUDNN_FUSE_TUNE_BUDGET_S); "
                         "written to memory_autotuned.json")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="alternating timing rounds per case (4 steps each)")
    ap.add_argument("--kernel-replay-ab", action="store_true",
                    help="every main row also with long kernels' kernel replays off (rows named ' [long kernels raw]'), "
                         "interleaved in the same rounds")
    ap.add_argument("--programmatic-ab", action="store_true",
                    help="the conv row also with the launch sets of programmatic chains (split-K wgrad) raw, same rounds")
    ap.add_argument("--conv-chain-ab", action="store_true",
                    help="the conv row also with its layers chained (one autograd node), interleaved in the same rounds")
    ap.add_argument("--only", choices=("mlp", "conv"), help="run only these cases")
    ap.add_argument("--ceiling", action="store_true",
                    help="only the kept-z MLP row, with a third model in the same rounds: eager with its GELUs "
                         "replaced by nn.Identity (no activation kernel forward or backward), the most any fusion "
                         "of the activation could save; written to memory_ceiling.json")
    ap.add_argument("--calling-thread", action="store_true",
                    help="run every backward on the calling thread (torch.autograd.set_multithreading_enabled(False)), "
                         "eager's and cf's alike; written to memory_calling_thread.json")
    args = ap.parse_args(argv)
    globals()["ROUNDS"] = max(1, args.rounds)
    if args.calling_thread:
        torch.autograd.set_multithreading_enabled(False)
    if args.autotune:
        cf.set_autotune(True)
    torch.manual_seed(0)
    bf = torch.bfloat16
    rows = []
    if args.ceiling:
        base = mlp().cuda().to(bf)
        x = torch.randn(8192, 2048, device="cuda", dtype=bf, requires_grad=True)
        bare = copy.deepcopy(base)
        for i, m in enumerate(bare):
            if isinstance(m, nn.GELU):
                bare[i] = nn.Identity()
        rows += variant_case("mlp_linear_gelu", base, cf.optimize(copy.deepcopy(base)), x, bare,
                             " [eager without the activation]")
        write_json(os.path.join(args.out, "memory_ceiling.json"), {"device": device_name(), "rounds": ROUNDS, "cases": rows})
        return 0
    if args.only != "conv":
        base = mlp().cuda().to(bf)
        x = torch.randn(8192, 2048, device="cuda", dtype=bf, requires_grad=True)
        if args.kernel_replay_ab:
            rows += kernel_replay_case("mlp_linear_gelu", base, cf.optimize(copy.deepcopy(base)), x)
            rows += kernel_replay_case("mlp_linear_gelu_recompute", base, cf.optimize(copy.deepcopy(base), recompute=True), x)
        else:
            rows += [case("mlp_linear_gelu", base, cf.optimize(copy.deepcopy(base)), x),
                     case("mlp_linear_gelu_recompute", base, cf.optimize(copy.deepcopy(base), recompute=True), x)]
    if args.variants and args.only != "conv":  # the same cases with torch (cuBLAS) for the backward's dX / dW products
        with _engines(MLP="cudnn"):  # FusedMLP on cuDNN's save-z and fused dz graphs (the default before 2026-12-03)
            rows.append(case("mlp_linear_gelu [mlp kernels: cudnn]", base, cf.optimize(copy.deepcopy(base)), x))
        with _engines(MLP="cudnn", MLP_DZ="split"):  # the MLP's dz as a product then an act-grad graph, not one graph
            rows.append(case("mlp_linear_gelu [mlp dz: split]", base, cf.optimize(copy.deepcopy(base)), x))
        with _engines(MM="torch"):
            rows += [case("mlp_linear_gelu [bwd mm: torch]", base, cf.optimize(copy.deepcopy(base)), x),
                     case("mlp_linear_gelu_recompute [bwd mm: torch]", base,
                          cf.optimize(copy.deepcopy(base), recompute=True), x)]
    if args.only == "mlp":
        return _write(args, rows)
    cbase = convs().cuda().half().to(memory_format=torch.channels_last)
    xc = torch.randn(32, 128, 56, 56, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
    if args.conv_chain_ab:
        rows += chain_case("conv_bias_relu", cbase, cf.optimize(copy.deepcopy(cbase), chain_convs=False),
                           cf.optimize(copy.deepcopy(cbase), chain_convs=True), xc.requires_grad_())
    elif args.kernel_replay_ab:
        rows += kernel_replay_case("conv_bias_relu", cbase, cf.optimize(copy.deepcopy(cbase)), xc.requires_grad_())
    elif args.programmatic_ab:
        rows += programmatic_case("conv_bias_relu", cbase, cf.optimize(copy.deepcopy(cbase)), xc.requires_grad_())
    else:
        rows.append(case("conv_bias_relu", cbase, cf.optimize(copy.deepcopy(cbase)), xc.requires_grad_()))
    if args.variants:  # dgrad / wgrad through torch's convolution_backward instead of cuDNN graphs
        with _engines(CONV="torch"):
            rows.append(case("conv_bias_relu [bwd dgrad/wgrad: torch]", cbase, cf.optimize(copy.deepcopy(cbase)), xc))
    return _write(args, rows)


def _write(args, rows) -> int:
    name = "memory_autotuned" if args.autotune else "memory"
    suffix = ("_calling_thread" if args.calling_thread else "") + (f"_{args.only}" if args.only else "")
    write_json(os.path.join(args.out, name + suffix + ".json"),
               {"device": device_name(), "autotune": args.autotune, "calling_thread": args.calling_thread,
                "kernel_replay_ab": args.kernel_replay_ab, "conv_chain_ab": args.conv_chain_ab,
                "programmatic_ab": args.programmatic_ab, "graph_stats": {k: v for k, v in cf.plan_stats().items()
                                                                           if k.startswith("graph_")},
                "cases": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
