"""Where a warm start's time goes (issue 3 diagnosis).

Fills a plan cache with the 32 cold-start graphs (heuristics) in one fresh process, then,
in fresh processes, for every cached plan: the cache read, cuDNN deserialize twice (the
second one, of the same blob, shows what is one-time kernel loading and what is per-graph
work), the Plan set-up, and the first and second execute. Last, all 32 blobs deserialized
sequentially and on 4 threads in two more fresh processes (does deserialize release the GIL?).

    python3 bench/deserialize_probe.py --out bench/results
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


def _fill(specs_path: str) -> None:
    import torch

    from bench.workloads import cold_start_graphs
    from cudnn_fuse import plans

    out = {}
    for name, fn in cold_start_graphs():
        fn()
        torch.cuda.synchronize()
        out[name] = plans.plans_in_memory()[-1].spec.to_dict()
    with open(specs_path, "w") as f:
        json.dump(out, f)


def _probe(specs_path: str) -> dict:
    import cudnn
    import torch

    from bench.workloads import cold_start_graphs
    from cudnn_fuse import plans
    from cudnn_fuse.cache import open_default_cache
    from cudnn_fuse.spec import spec_from_dict

    specs = json.load(open(specs_path))
    graphs = dict(cold_start_graphs())
    h = plans.handle_for(0)
    pc = open_default_cache()
    torch.cuda.synchronize()
    rows = {}
    for name, d in specs.items():
        spec = spec_from_dict(d)
        r = {}
        t = time.perf_counter()
        entry = pc.get(spec.digest())
        r["cache_get"] = time.perf_counter() - t
        r["engine"] = entry.meta.get("engine_name")
        r["blob_bytes"] = len(entry.blob)
        t = time.perf_counter()
        g = cudnn.pygraph(handle=h.handle)
        g.deserialize(h.handle, entry.blob)
        r["deserialize_1"] = time.perf_counter() - t
        t = time.perf_counter()
        g2 = cudnn.pygraph(handle=h.handle)
        g2.deserialize(h.handle, entry.blob)
        r["deserialize_2"] = time.perf_counter() - t
        t = time.perf_counter()
        plan = plans.Plan(spec, g, 0, engine=r["engine"])
        r["plan_init"] = time.perf_counter() - t
        plans._LRU._store((spec, 0), plan)
        for k in ("execute_1", "execute_2"):
            t = time.perf_counter()
            graphs[name]()
            torch.cuda.synchronize()
            r[k] = time.perf_counter() - t
        rows[name] = {k: (round(1e3 * v, 3) if isinstance(v, float) else v) for k, v in r.items()}
        del g2
    return rows


def _bulk(specs_path: str, threads: int) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    import cudnn
    import torch

    from cudnn_fuse import plans
    from cudnn_fuse.cache import open_default_cache
    from cudnn_fuse.spec import spec_from_dict

    specs = json.load(open(specs_path))
    h = plans.handle_for(0)
    pc = open_default_cache()
    blobs = [pc.get(spec_from_dict(d).digest()).blob for d in specs.values()]
    torch.cuda.synchronize()

    def one(blob):
        g = cudnn.pygraph(handle=h.handle)
        g.deserialize(h.handle, blob)
        return g

    t = time.perf_counter()
    if threads == 1:
        gs = [one(b) for b in blobs]
    else:
        with ThreadPoolExecutor(threads) as ex:
            gs = list(ex.map(one, blobs))
    total = time.perf_counter() - t
    return {"threads": threads, "graphs": len(gs), "total_ms": round(1e3 * total, 2)}


def _child(mode: str, specs_path: str, cache_dir: str, extra: dict | None = None) -> dict:
    env = dict(os.environ, CUDNN_FUSE_CACHE_DIR=cache_dir, CUDNN_FUSE_AUTOTUNE="0",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(extra or {}))
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode, "--specs", specs_path],
                       env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise SystemExit(f"{mode} child failed ({p.returncode}):\n{p.stderr[-3000:]}")
    lines = p.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--specs", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    if args.child == "fill":
        _fill(args.specs)
        return 0
    if args.child == "probe":
        print(json.dumps(_probe(args.specs)))
        return 0
    if args.child and args.child.startswith("bulk"):
        print(json.dumps(_bulk(args.specs, int(args.child[4:]))))
        return 0
    from bench.common import device_name, write_json

    with tempfile.TemporaryDirectory() as cache_dir:
        specs = os.path.join(cache_dir, "specs.json")
        _child("fill", specs, cache_dir)
        rows = _child("probe", specs, cache_dir)
        seq = _child("bulk1", specs, cache_dir)
        par = _child("bulk4", specs, cache_dir)
    keys = ("cache_get", "deserialize_1", "deserialize_2", "plan_init", "execute_1", "execute_2")
    n = len(rows)
    result = {
        "device": device_name(),
        "graphs": n,
        "mean_ms": {k: round(sum(r[k] for r in rows.values()) / n, 3) for k in keys},
        "bulk_deserialize": [seq, par],
        "per_graph": rows,
    }
    write_json(os.path.join(args.out, "deserialize_probe.json"), result)
    print(json.dumps({k: v for k, v in result.items() if k != "per_graph"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
