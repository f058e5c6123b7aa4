"""cudnn_fuse against its peers (torch eager, torch.compile, ...): writes bench/results/peers.json
(or one part of it).

A thin wrapper of `cudnn-fuse bench` (cudnn_fuse/benchsuite.py) for running from a checkout:

    python3 bench/peers.py --list
    python3 bench/peers.py --part core --out DIR/peers_core.json         # one part per run
    python3 bench/peers.py --merge bench/results/parts/peers_*.json      # -> bench/results/peers.json
    python3 bench/plot_results.py                                        # the PNGs and the table
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cudnn_fuse import benchsuite  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benchsuite.add_arguments(p)
    return benchsuite.main(p.parse_args(argv), emit=lambda s: print(s, flush=True),
                           err=lambda s: print(s, file=sys.stderr))


if __name__ == "__main__":
    sys.exit(main())
