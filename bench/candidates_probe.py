"""Which engine configs the autotuner sees, and how fast each runs, per heuristic-mode set: the
workloads where cf trails its best peer (attention, large GEMMs), each tuned with cuDNN's
heuristic modes A + FALLBACK (the default) and A + B + FALLBACK (CUDNN_FUSE_HEUR_MODES).
Prints `cudnn-fuse autotune`'s candidate tables, one fresh plan cache per tuning.

    python3 bench/candidates_probe.py [--budget-s 6]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = [
    ["--op", "sdpa", "--input", "2x32x8192x64", "--weight", "2x32x8192x64", "--dtype", "bf16", "--causal"],
    ["--op", "sdpa", "--input", "8x16x2048x128", "--weight", "8x16x2048x128", "--dtype", "bf16"],
    ["--op", "matmul", "--input", "8192x8192", "--weight", "8192x8192", "--dtype", "bf16", "--amax"],
    ["--op", "linear", "--input", "16384x4096", "--weight", "16384x4096", "--dtype", "bf16", "--bias",
     "--activation", "gelu"],
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--budget-s", default="6")
    args = ap.parse_args(argv)
    from cudnn_fuse import cli, plans

    for modes in (("A", "FALLBACK"), ("A", "B", "FALLBACK")):
        plans.HEUR_MODES = modes
        for case in CASES:
            os.environ["CUDNN_FUSE_CACHE_DIR"] = tempfile.mkdtemp()
            plans.clear()
            print(f"\n### modes {','.join(modes)}: {' '.join(case)}", flush=True)
            try:
                rc = cli.main(["autotune", *case, "--budget-s", args.budget_s, "--force"])
            except Exception as exc:  # noqa: BLE001 - a probe reports and goes on
                print(f"failed: {type(exc).__name__}: {exc}")
                rc = -1
            print(f"rc={rc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
