"""Pre-warm scaling: `python -m cudnn_fuse.prewarm --autotune` of the ResNet-50 manifests (fp16,
batch 32 and 1) on one GPU and on two, each into its own empty cache; then, on the two-GPU cache,
fresh processes running torchvision's resnet50 through cf.optimize(): they should build no plan.
Writes prewarm.json. Needs 2 GPUs and torchvision.

    python3 bench/prewarm_scaling.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFESTS = [os.path.join(ROOT, "plans", f) for f in ("resnet50_fp16_bs32.json", "resnet50_fp16_bs1.json")]


def _env(cache_dir: str, budget_s) -> dict:
    env = dict(os.environ, CUDNN_FUSE_CACHE_DIR=cache_dir, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if budget_s is not None:
        env["CUDNN_FUSE_TUNE_BUDGET_S"] = str(budget_s)
    return env


def prewarm(gpus: int, cache_dir: str, budget_s) -> tuple[float, str]:
    cmd = [sys.executable, "-m", "cudnn_fuse.prewarm", *MANIFESTS, "--autotune", "--gpus", str(gpus)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=_env(cache_dir, budget_s), capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"prewarm --gpus {gpus} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return wall, p.stdout


def _table_seconds(out: str):
    """The pre-warm's own elapsed seconds (its table's last column), which leave out the
    interpreter, torch and CUDA start-up that the process wall time includes."""
    for line in out.splitlines():
        cols = line.split()
        if len(cols) == 6 and cols[0].isdigit():
            return float(cols[5])
    return None


def resnet50_first_forward(batch: int) -> dict:
    """In this (fresh) process: torchvision's resnet50 (fp16, channels_last, eval) through cf.optimize(),
    one forward; the plans it built and loaded, and how long the first forward took."""
    import torch
    import torchvision

    import cudnn_fuse as cf

    t_start = time.perf_counter()
    model = torchvision.models.resnet50().cuda().half().eval().to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
    opt = cf.optimize(model)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        opt(x)
    torch.cuda.synchronize()
    first_ms = 1e3 * (time.perf_counter() - t0)
    stats = cf.plan_stats()
    return {"batch": batch, "first_forward_ms": round(first_ms, 1), "builds": stats["builds"], "loads": stats["loads"],
            "fallbacks": stats["fallbacks"], "process_to_first_result_s": round(time.perf_counter() - t_start, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--budget-s", type=float, default=None,
                    help="autotune budget per graph (default: the library's, as `cudnn-fuse prewarm` uses it)")
    ap.add_argument("--child-batch", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    if args.child_batch is not None:
        print(json.dumps(resnet50_first_forward(args.child_batch)))
        return 0
    import torch

    from bench.common import write_json
    from cudnn_fuse import manifest

    entries = {e.spec.digest() for m in MANIFESTS for e in manifest.load(m)}
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 GPUs")
    with tempfile.TemporaryDirectory() as one, tempfile.TemporaryDirectory() as two:
        one_s, one_out = prewarm(1, one, args.budget_s)
        two_s, two_out = prewarm(2, two, args.budget_s)
        warm = []
        for batch in (32, 1):
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child-batch", str(batch)],
                               env=_env(two, args.budget_s), capture_output=True, text=True, timeout=600)
            if p.returncode != 0:
                raise SystemExit(f"resnet50 after the pre-warm failed:\n{p.stderr[-3000:]}")
            warm.append(json.loads(p.stdout.strip().splitlines()[-1]))
    result = {
        "device": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}",
        "entries": len(entries),
        "one_gpu_s": round(one_s, 2),
        "two_gpu_s": round(two_s, 2),
        "autotune": True,
        "two_over_one": round(two_s / one_s, 3),
        "tune_budget_s_per_graph": args.budget_s,  # None: the library's default
        "prewarm_seconds": {"one_gpu": _table_seconds(one_out), "two_gpu": _table_seconds(two_out)},
        "seconds_are": "wall time of the whole `python -m cudnn_fuse.prewarm ... --autotune --gpus N` process",
        "after_prewarm_resnet50": warm,
        "tables": {"one_gpu": one_out.strip().splitlines()[-6:], "two_gpu": two_out.strip().splitlines()[-8:]},
    }
    write_json(os.path.join(args.out, "prewarm.json"), result)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
