"""Which engines cost a fresh process seconds on their first execute (issue 3 diagnosis).

A warm start of the 32 cold-start graphs spent 2.1 s in the first execute of the first
matmul+AMAX graph (its deserialize took 2.5 ms), and 77-126 ms in the first two convs.
For each named graph, every candidate engine is built and executed, alone, in a fresh
process: build, first execute, second execute, and cuDNN's behaviour note
(RUNTIME_COMPILATION). An engine whose first execute is seconds pays per-process work that
no plan cache can hold.

    python3 bench/first_execute_probe.py --out bench/results [--graphs NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = ("matmul_1024x1024x1024_relu_amax", "conv_c64_k64_56_r1_relu", "linear_1x768x3072_gelu")


def _spec_of(name: str):
    import torch

    from bench.workloads import cold_start_graphs
    from cudnn_fuse import plans

    fn = dict(cold_start_graphs())[name]
    os.environ["CUDNN_FUSE_CACHE"] = "off"
    fn()
    torch.cuda.synchronize()
    return plans.plans_in_memory()[-1].spec


def child(index: int) -> dict:
    import torch

    from cudnn_fuse import autotune, plans
    from cudnn_fuse.builders import build_graph, roles_of, uids_of
    from cudnn_fuse.spec import spec_from_dict

    h = plans.handle_for(0)
    torch.cuda.synchronize()
    spec = spec_from_dict(json.loads(os.environ["PROBE_SPEC"]))  # the parent's --spec-of run made it
    g = build_graph(spec, h.handle)
    plans.prepare(g, spec)
    n = g.get_execution_plan_count()
    if index < 0:
        return {"count": n}
    row = {"index": index, "name": str(g.get_plan_name_at_index(index)),
           "runtime_compiled": autotune._has_note(g, index, "RUNTIME_COMPILATION", kind="behavior", unknown=None)}
    try:
        t = time.perf_counter()
        g.build_plan_at_index(index)
        row["build_ms"] = 1e3 * (time.perf_counter() - t)
    except Exception as exc:  # noqa: BLE001
        row["error"] = f"{type(exc).__name__}: {exc}"[:200]
        return row
    ws = int(g.get_workspace_size_plan_at_index(index))
    sets = autotune.random_buffers(spec, roles_of(spec), 0, 1)
    wsb = torch.empty(max(ws, 1), dtype=torch.uint8, device="cuda")
    for k in ("first_execute_ms", "second_execute_ms"):
        t = time.perf_counter()
        g.execute_plan_at_index(sets[0], wsb, index=index, handle=h.handle, tensor_uids=uids_of(spec))
        torch.cuda.synchronize()
        row[k] = 1e3 * (time.perf_counter() - t)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--graphs", nargs="*", default=list(DEFAULT))
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--spec-of", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    if args.spec_of:
        print(json.dumps(_spec_of(args.spec_of).to_dict()))
        return 0
    if args.child is not None:
        print(json.dumps(child(args.child)))
        return 0
    from bench.common import device_name, write_json

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def sub(*extra, spec=None):
        e = dict(env, PROBE_SPEC=spec) if spec else env
        p = subprocess.run([sys.executable, os.path.abspath(__file__), *extra], env=e, capture_output=True, text=True,
                           timeout=300)
        if p.returncode != 0:
            return {"error": p.stderr[-600:]}
        return json.loads(p.stdout.strip().splitlines()[-1])

    result = {"device": device_name(), "graphs": {}}
    for name in args.graphs:
        spec = json.dumps(sub("--spec-of", name))
        count = sub("--child", "-1", spec=spec).get("count", 0)
        rows = [sub("--child", str(i), spec=spec) for i in range(count)]
        result["graphs"][name] = rows
        for r in rows:
            print(name, json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    write_json(os.path.join(args.out, "first_execute_probe.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
