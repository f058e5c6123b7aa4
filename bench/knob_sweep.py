"""Beyond cuDNN's heuristic candidates: every engine's knob space, swept (issues 4 and 6).

The autotuner times the candidates cuDNN's heuristics propose (modes A + FALLBACK). For the
fused GEMM graphs those differ only in the STREAM_K knob (k24) of one engine (eng4), and the
fused ones ran ~0.1 ms slower than a plain GEMM (bench/results/mlp_tune_probe.json). This asks
cuDNN for every engine of each graph and its knobs (get_engine_count / get_knobs_for_engine),
builds (engine, knob) combinations through create_execution_plan, and times each with CUDA events
against the heuristic candidates, within a per-graph budget. Diagnostic.

The graphs: those a bf16 MLP block's training step makes (Linear 2048 -> 8192, GELU, Linear
8192 -> 2048 at 8192 rows, through optimize(): linear_save_z, matmul_act_grad, the products),
recorded with cf.record.

    python3 bench/knob_sweep.py --out bench/results --budget-s 60
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from cudnn_fuse import autotune, manifest, plans  # noqa: E402
from cudnn_fuse.builders import build_graph, roles_of, uids_of  # noqa: E402


def _time(g, index, bufs, ws, h, uids, reps=15) -> float:
    def launch():
        g.execute_plan_at_index(bufs, ws, index=index, handle=h, tensor_uids=uids)

    for _ in range(3):
        launch()
    torch.cuda.synchronize()
    return statistics.median(autotune.device_ms(launch, reps, host_us_per_call=60.0))


def _knob_space(lg, eid):
    out = []
    for k in lg.get_knobs_for_engine(eid):
        t = getattr(k, "type", None)
        lo, hi, st = int(k.min_value), int(k.max_value), max(int(k.stride), 1)
        vals = list(range(lo, hi + 1, st))
        out.append((t, vals))
    return out


def sweep(spec, device, budget_s, max_per_engine, rng, engines=None, sweep_knobs=None) -> dict:
    import cudnn

    h = plans.handle_for(device).handle
    g = build_graph(spec, h)
    plans.prepare(g, spec)
    uids, roles = uids_of(spec), roles_of(spec)
    bufs = autotune.random_buffers(spec, roles, device, 1)[0]
    cudnn.set_stream(handle=h, stream=torch.cuda.current_stream(device).cuda_stream)
    lg = getattr(g, "_lowered_graph", None)
    if lg is None:
        g._lower_backend_graph()
        lg = g._lowered_graph
    res = {"op": spec.op, "heuristic": [], "swept": [], "engines": {}}
    n0 = g.get_execution_plan_count()
    t_end = time.monotonic() + budget_s
    ws_cache = {}

    def run(index, label, into):
        try:
            g.build_plan_at_index(index)
            w = int(g.get_workspace_size_plan_at_index(index))
            if w not in ws_cache:
                ws_cache[w] = torch.empty(w, dtype=torch.uint8, device="cuda") if w else None
            ms = _time(g, index, bufs, ws_cache[w], h, uids)
            into.append((label, round(ms, 4), w))
        except Exception as exc:  # noqa: BLE001 - a combination cuDNN refuses
            into.append((label, None, f"{type(exc).__name__}: {str(exc)[:80]}"))

    for i in range(n0):
        eid, knobs = g.get_engine_and_knobs_at_index(i)
        run(i, f"heur eng{int(eid)} {autotune.knobs_to_json(knobs)}", res["heuristic"])
    try:
        n_eng = int(lg.get_engine_count())
    except Exception as exc:  # noqa: BLE001
        res["engines"] = f"get_engine_count: {type(exc).__name__}: {exc}"
        return res
    for eid in range(n_eng):
        if engines is not None and eid not in engines:
            continue
        try:
            space = _knob_space(lg, eid)
            if sweep_knobs is not None:  # the other knobs at their first value (SPLIT_K_SLC=1: no split)
                space = [(t, v if str(getattr(t, "name", t)) in sweep_knobs else v[:1]) for t, v in space]
        except Exception as exc:  # noqa: BLE001 - an engine that does not support this graph
            res["engines"][eid] = f"{type(exc).__name__}: {str(exc)[:80]}"
            continue
        res["engines"][eid] = {str(getattr(t, "name", t)): (v[0], v[-1], len(v)) for t, v in space}
        combos = list(itertools.product(*[v for _, v in space])) if space else [()]
        if len(combos) > max_per_engine:
            combos = rng.sample(combos, max_per_engine)
        for combo in combos:
            if time.monotonic() > t_end:
                res["budget_exhausted"] = True
                break
            knobs = {t: v for (t, _), v in zip(space, combo)}
            try:
                g.create_execution_plan(eid, knobs)
            except Exception as exc:  # noqa: BLE001
                res["swept"].append((f"eng{eid} {autotune.knobs_to_json(knobs)}", None,
                                     f"create: {type(exc).__name__}: {str(exc)[:60]}"))
                continue
            run(g.get_execution_plan_count() - 1, f"eng{eid} {autotune.knobs_to_json(knobs)}", res["swept"])
    for k in ("heuristic", "swept"):
        ok = sorted([r for r in res[k] if r[1] is not None], key=lambda r: r[1])
        res[f"best_{k}"] = ok[0] if ok else None
        res[f"{k}_ok"] = len(ok)
    failed = [r for r in res["swept"] if r[1] is None]
    res["swept_failed"] = len(failed)
    res["swept_failures_sample"] = failed[:5]
    res["swept"] = sorted([r for r in res["swept"] if r[1] is not None], key=lambda r: r[1])[:40]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--budget-s", type=float, default=60.0, help="per graph")
    ap.add_argument("--max-per-engine", type=int, default=60)
    ap.add_argument("--ops", default="save_z,matmul_act_grad,matmul")
    ap.add_argument("--engines", default="", help="engine ids to sweep (default: all)")
    ap.add_argument("--knobs", default="", help="knob names to sweep, the others at their first value (default: all)")
    ap.add_argument("--attention", default="",
                    help="sweep SDPA forward graphs instead: ';'-separated B,H,S,D,causal (e.g. 2,32,8192,64,1)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    bf = torch.bfloat16
    if args.attention:
        return _attention(args)
    model = cf.optimize(nn.Sequential(nn.Linear(2048, 8192), nn.GELU(), nn.Linear(8192, 2048)).cuda().to(bf))
    x = torch.randn(8192, 2048, device="cuda", dtype=bf, requires_grad=True)
    with manifest.record() as rec:
        model(x).float().square().mean().backward()
    torch.cuda.synchronize()
    want = args.ops.split(",")
    seen, out = set(), {"device": torch.cuda.get_device_name(), "budget_s_per_graph": args.budget_s, "graphs": []}
    rng = random.Random(0)
    for e in rec.entries:
        s = e.spec
        if s.op not in want or s.op in seen:  # the first graph of each op
            continue
        seen.add(s.op)
        r = sweep(s, 0, args.budget_s, args.max_per_engine, rng,
                  {int(e) for e in args.engines.split(",")} if args.engines else None,
                  set(args.knobs.split(",")) if args.knobs else None)
        out["graphs"].append(r)
        print(s.op, "best heuristic", r.get("best_heuristic"), "best swept", r.get("best_swept"),
              "ok", r.get("swept_ok"), "failed", r.get("swept_failed"), r.get("swept_failures_sample"), flush=True)
    with open(os.path.join(args.out, f"knob_sweep_{'_'.join(want)}.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    return 0


def _attention(args) -> int:
    """Every engine and knob of cf's SDPA forward graph at the given shapes, beside torch's
    flash and cuDNN SDPA backends timed the same way (issue 6: attention ran 0.95-1.01x the
    best peer with cuDNN's heuristic candidates)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    out = {"device": torch.cuda.get_device_name(), "budget_s_per_graph": args.budget_s, "graphs": []}
    rng = random.Random(0)
    for item in args.attention.split(";"):
        B, H, S, D, causal = (int(v) for v in item.split(","))
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        with manifest.record() as rec:
            cf.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
        torch.cuda.synchronize()
        spec = next(e.spec for e in rec.entries if e.spec.op == "sdpa")
        r = sweep(spec, 0, args.budget_s, args.max_per_engine, rng,
                  {int(e) for e in args.engines.split(",")} if args.engines else None,
                  set(args.knobs.split(",")) if args.knobs else None)
        r["shape"] = {"B": B, "H": H, "S": S, "D": D, "causal": bool(causal)}
        r["torch_ms"] = {}
        for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel([be]):
                    def launch():
                        F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
                    for _ in range(3):
                        launch()
                    torch.cuda.synchronize()
                    r["torch_ms"][name] = round(statistics.median(autotune.device_ms(launch, 15, host_us_per_call=60.0)), 4)
            except Exception as exc:  # noqa: BLE001 - a backend this build lacks
                r["torch_ms"][name] = f"{type(exc).__name__}: {str(exc)[:80]}"
        out["graphs"].append(r)
        print(item, "best heuristic", r.get("best_heuristic"), "best swept", r.get("best_swept"), "torch", r["torch_ms"],
              "ok", r.get("swept_ok"), "failed", r.get("swept_failed"), r.get("engines"), flush=True)
    tag = args.attention.replace(",", "x").replace(";", "_")
    with open(os.path.join(args.out, f"knob_sweep_sdpa_{tag}.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
