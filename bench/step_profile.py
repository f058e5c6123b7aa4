"""Where one step of a model spends its time, eager vs cf (and optionally torch.compile):
torch.profiler's top operators by host time and by device time, the step's wall time against
the device's busy time (a step far longer than its kernels is host-bound or waits on syncs), and
for cf the summary of what `optimize()` replaced and what it left alone.

    python3 bench/step_profile.py --case conv --out bench/results          # -> step_profile.json
    python3 bench/step_profile.py --case gpt2_infer --compile --out DIR     # -> step_profile_gpt2_infer.json

Cases: conv (bench/memory.py's conv-bias-ReLU stack, one training step), mlp (its Linear+GELU
stack, pre-activation kept), gpt2_infer / gpt2_train (transformers GPT-2 small, bf16, 8×1024, as
in the peers suite's model part).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import types

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from bench.memory import convs, mlp, train_step  # noqa: E402
from cudnn_fuse.benchsuite import gpt2_small  # noqa: E402


def _case(name: str):
    """(model, inputs, step(model, *inputs))"""
    torch.manual_seed(0)
    if name == "conv":
        base = convs().cuda().half().to(memory_format=torch.channels_last)
        x = torch.randn(32, 128, 56, 56, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
        return base, (x.requires_grad_(),), train_step
    if name == "mlp":
        base = mlp().cuda().to(torch.bfloat16)
        x = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
        return base, (x.requires_grad_(),), train_step
    if name in ("gpt2_infer", "gpt2_train"):
        base, ids, step = gpt2_small(training=name == "gpt2_train")
        return base, (ids,), step
    raise SystemExit(f"--case: unknown case {name!r}")


def _device_us(e) -> float:
    return getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))


def profile_variant(model, inputs, step, reps: int = 3) -> dict:
    for _ in range(3):
        step(model, *inputs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        step(model, *inputs)
    torch.cuda.synchronize()
    wall = 1e3 * (time.perf_counter() - t0) / 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step(model, *inputs)
        torch.cuda.synchronize()
    ka = prof.key_averages()
    dev = sum(_device_us(e) for e in ka) / (1e3 * reps)
    kernels = sorted(((e.key, _device_us(e) / (1e3 * reps), e.count // reps) for e in ka if _device_us(e) > 0),
                     key=lambda k: -k[1])
    return {"step_wall_ms": round(wall, 3), "device_busy_ms_per_step": round(dev, 3),
            "top_device_ms_per_step": [[k[:120], round(ms, 4), n] for k, ms, n in kernels[:25]],
            "top_host": ka.table(sort_by="self_cpu_time_total", row_limit=15)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="conv", choices=("conv", "mlp", "gpt2_infer", "gpt2_train"))
    ap.add_argument("--compile", action="store_true",
                    help="also profile torch.compile (default mode), alone and over the optimize()d model")
    ap.add_argument("--autotune", action="store_true", help="cf.optimize(autotune=True)")
    ap.add_argument("--mlp-kernels", nargs="*", default=[],
                    help="also profile the optimize()d model with nn.FusedMLP on these kernels "
                         "(CUDNN_FUSE_MLP_KERNELS values: cutlass, cublaslt, triton, cudnn), as variants cf_<kernels>")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    base, inputs, step = _case(args.case)
    opt = cf.optimize(copy.deepcopy(base), autotune=args.autotune)
    variants = [("eager", base), ("cf", opt)] + [(f"cf_{k}", opt) for k in args.mlp_kernels]
    if args.case == "gpt2_infer":
        # cf.capture of the optimize()d model: which kernels a replay runs that the eager cf step does not
        # (its device time was 0.7 ms longer than eager cf's in the peers suite)
        with torch.no_grad():
            graph = cf.capture(lambda ids: opt(ids).logits, *inputs)

        variants.append(("cf_captured", lambda ids: types.SimpleNamespace(logits=graph(ids))))  # step's m(ids).logits
    if args.compile:
        torch._dynamo.reset()
        variants.append(("torch_compile", torch.compile(copy.deepcopy(base), dynamic=False)))
        # torch.compile over the optimize()d model: which attention kernel it runs (cf's mask
        # function hands it is_causal) and what else differs from torch.compile alone
        variants.append(("cf_compiled", torch.compile(cf.optimize(copy.deepcopy(base)), dynamic=False)))
    out = {"case": args.case, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "optimize_summary": str(getattr(opt, "cudnn_fuse_summary", ""))}
    print(out["optimize_summary"])
    from cudnn_fuse import backward

    default_mlp = backward.MLP
    for name, model in variants:
        backward.MLP = name[3:] if name[3:] in args.mlp_kernels else default_mlp
        r = out[name] = profile_variant(model, inputs, step)
        print(f"== {name}: step {r['step_wall_ms']:.3f} ms wall, device busy {r['device_busy_ms_per_step']:.3f} ms")
        for k, ms, n in r["top_device_ms_per_step"][:18]:
            print(f"  {ms:9.4f} ms  x{n:<4d} {k[:100]}")
    os.makedirs(args.out, exist_ok=True)
    fname = "step_profile.json" if args.case == "conv" else f"step_profile_{args.case}.json"
    with open(os.path.join(args.out, fname), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
