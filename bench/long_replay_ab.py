"""In one process, the optimize()d demo models (inference) with long kernels' replays on and off in
interleaved rounds (10 rounds of 30 synchronized calls, median per round). Prints its result.

    python3 bench/long_replay_ab.py
"""
import statistics, sys

import torch
sys.path.insert(0, ".")
import cudnn_fuse as cf
from cudnn_fuse.demo import _models, _first_call_ms
from bench.memory import _long_kernel_sets
res = {}
for name, model, x in _models("cuda", True):
    m = cf.optimize(model)
    with torch.no_grad():
        for _ in range(10):
            m(x)
        per = {"on": [], "off": []}
        for r in range(10):
            for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
                _long_kernel_sets(mode == "off")
                with torch.no_grad():
                    for _ in range(3):
                        m(x)
                    per[mode].append(statistics.median(_first_call_ms(lambda: m(x), True) for _ in range(30)))
        _long_kernel_sets(False)
    print(name, {k: round(statistics.median(v), 4) for k, v in per.items()}, {k: [round(a, 3) for a in v] for k, v in per.items()})
print({k: v for k, v in cf.plan_stats().items() if k.startswith("graph_")})
