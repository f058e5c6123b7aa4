"""Why does cf's GPT-2 step measure slower after torch.compile ran in the same process
(peers models part: cf 4.94 ms, its repeat 6.36 ms)? Times cf's step, runs torch.compile on a
copy, times cf again, and prints both profiles' top kernels side by side.

    python3 bench/repeat_probe.py --case gpt2_infer --out DIR
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from bench.step_profile import _case, profile_variant  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="gpt2_infer", choices=("conv", "mlp", "gpt2_infer", "gpt2_train"))
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    base, inputs, step = _case(args.case)
    opt = cf.optimize(copy.deepcopy(base))
    out = {"case": args.case, "before": profile_variant(opt, inputs, step)}
    torch._dynamo.reset()
    cm = torch.compile(copy.deepcopy(base), dynamic=False)
    out["torch_compile"] = profile_variant(cm, inputs, step)
    out["after"] = profile_variant(opt, inputs, step)
    del cm
    torch._dynamo.reset()
    out["after_reset"] = profile_variant(opt, inputs, step)
    out["memory"] = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}
    for k in ("before", "torch_compile", "after", "after_reset"):
        r = out[k]
        print(f"== {k}: {r['step_wall_ms']} ms wall")
        for name, ms, n in r["top_device_ms_per_step"][:12]:
            print(f"  {ms:9.4f} ms  x{n:<4d} {name[:100]}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"repeat_probe_{args.case}.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
