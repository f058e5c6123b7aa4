"""Where a conv's time goes, engine by engine: for each shape, cuDNN's heuristic pick through the
graph API, every candidate engine the autotuner times, cf's call as it runs now (its plan checked
against torch's kernels), and torch's own F.conv2d with the kernels it launches (torch.profiler) and
with cuDNN switched off. Writes conv_engines.json.

    python3 bench/conv_engines.py --out bench/results [--budget-s 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from cudnn_fuse import loader  # noqa: E402
from cudnn_fuse.cache import PlanCache  # noqa: E402
from bench.common import device_ms, device_name, write_json  # noqa: E402

# (name, N, C, H, K, R, groups, stride, activation): depthwise 7x7 and 3x3 as ConvNeXt and MobileNet
# run them, a grouped 3x3 as ResNeXt does, and a dense 3x3 for reference
SHAPES = [
    ("dw7x7 c96 56", 32, 96, 56, 96, 7, 96, 1, None),
    ("dw7x7 c192 28", 32, 192, 28, 192, 7, 192, 1, None),
    ("dw7x7 c384 14", 32, 384, 14, 384, 7, 384, 1, None),
    ("dw7x7 c96 56 bs1", 1, 96, 56, 96, 7, 96, 1, None),
    ("dw3x3 c240 28 relu", 32, 240, 28, 240, 3, 240, 1, "relu"),
    ("dw3x3 c96 112 s2", 32, 96, 112, 96, 3, 96, 2, "relu"),
    ("group3x3 g32 c256 28", 32, 256, 28, 256, 3, 32, 1, "relu"),
    ("dense3x3 c128 56 relu", 32, 128, 56, 128, 3, 1, 1, "relu"),
]


def operands(N, C, H, K, R, groups, dtype=torch.float16):
    cl = torch.channels_last
    x = torch.randn(N, C, H, H, device="cuda", dtype=dtype).contiguous(memory_format=cl)
    w = (torch.randn(K, C // groups, R, R, device="cuda", dtype=dtype) / (C // groups * R * R) ** 0.5)
    return x, w.contiguous(memory_format=cl), torch.randn(K, device="cuda", dtype=dtype)


def torch_kernels(fn) -> list:
    """The names of the CUDA kernels one call of ``fn`` launches."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def entry_of(cache_dir, spec) -> dict:
    pc = PlanCache(cache_dir)
    e = pc.get(loader.cache_digest(spec))
    return e.meta if e is not None else {}


def measure(shape, budget_s: float) -> dict:
    name, N, C, H, K, R, groups, stride, act = shape
    x, w, b = operands(N, C, H, K, R, groups)
    pad = R // 2
    rec = {"name": name, "shape": dict(N=N, C=C, H=H, K=K, R=R, groups=groups, stride=stride, activation=act)}

    def eager():
        y = F.conv2d(x, w, b, stride, pad, 1, groups)
        return F.relu(y) if act == "relu" else y

    rec["torch_ms"] = device_ms(eager)
    rec["torch_kernels"] = torch_kernels(eager)
    torch.backends.cudnn.enabled = False
    try:
        rec["torch_no_cudnn_ms"] = device_ms(eager)
        rec["torch_no_cudnn_kernels"] = torch_kernels(eager)
    finally:
        torch.backends.cudnn.enabled = True

    def cf_call():
        return cf.conv2d(x, w, b, stride, pad, 1, groups, activation=act)

    def cf_conv_only():  # the graph with no epilogue: which engines the graph API offers for the conv alone
        return cf.conv2d(x, w, None, stride, pad, 1, groups)

    for mode, call in (("heuristic", cf_call), ("autotuned", cf_call), ("conv_only_autotuned", cf_conv_only)):
        with tempfile.TemporaryDirectory() as d:
            os.environ["CUDNN_FUSE_CACHE_DIR"] = d
            loader.clear()
            cf.set_autotune(mode != "heuristic")
            call()
            spec = loader.plans_in_memory()[-1].spec
            plan = loader.plans_in_memory()[-1]
            meta = entry_of(d, spec)
            rec[mode] = {
                "engine": meta.get("engine_name"), "use_torch": meta.get("use_torch"),
                "torch_check": meta.get("torch_check"), "runs": type(plan).__name__,
                "ms": device_ms(call),
                "candidates": [{k: c.get(k) for k in ("name", "median_ms", "first_ms", "status")}
                               for c in meta.get("candidates", [])],
            }
            if mode == "heuristic":
                rec[mode]["kernels"] = torch_kernels(cf_call)
    cf.set_autotune(False)
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results", help="directory for conv_engines.json")
    p.add_argument("--budget-s", type=float, default=20.0, help="the autotuner's budget per shape, seconds")
    p.add_argument("--only", default=None, help="a substring of the shape names to run")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("conv_engines.py needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ["CUDNN_FUSE_TUNE_BUDGET_S"] = str(args.budget_s)
    from cudnn_fuse import autotune

    autotune.DEFAULT_CONFIG.budget_s = args.budget_s
    rows = []
    for shape in SHAPES:
        if args.only and args.only not in shape[0]:
            continue
        rec = measure(shape, args.budget_s)
        rows.append(rec)
        h, a, c = rec["heuristic"], rec["autotuned"], rec["conv_only_autotuned"]
        best = min((x for x in c["candidates"] if x["name"] != "torch" and x["median_ms"]), default=None,
                   key=lambda x: x["median_ms"])
        print(f"{rec['name']:24s} torch {rec['torch_ms']:.3f} (no cuDNN {rec['torch_no_cudnn_ms']:.3f})  "
              f"cf heuristic {h['ms']:.3f} [{h['engine']}, {h['runs']}, check {h['torch_check']}]  "
              f"autotuned {a['ms']:.3f} [{a['engine']}, {a['runs']}]  conv alone: best cuDNN engine "
              f"{best and best['name']} {best and best['median_ms']}", flush=True)
        print(f"    torch kernels: {rec['torch_kernels']}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "conv_engines.json"),
               {"gpu": device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
