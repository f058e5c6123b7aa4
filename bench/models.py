"""The model zoo: whole models as a user runs them, cf against torch eager and torch.compile.

torchvision's CNNs (fp16, channels_last) and vision transformers, and transformers' GPT-2, BERT-base and a
small Llama (bf16), all with random weights (no downloads), in inference at batch 1 and 32 and, for a few,
a training step. Per model and mode: eager, cf (``cf.optimize``), cf autotuned, torch.compile (default
mode; max-autotune where asked), torch.compile over cf in the same mode; each variant's first call (its
compile or plan builds included) and its output's error against eager. Rows are merged into the output
file by (model, mode), so the zoo can be run in parts:

    python3 bench/models.py --out bench/results --models convnext_tiny,resnet50 --modes infer_bs32
    python3 bench/models.py --plot bench/results/models.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from bench.common import checkout_commit, device_name, profiled_ops, time_ms, write_json  # noqa: E402

CNNS = ("resnet50", "resnext50_32x4d", "mobilenet_v3_large", "efficientnet_b0", "convnext_tiny", "regnet_y_1_6gf")
VITS = ("vit_b_16", "swin_t")
LMS = ("gpt2", "bert_base", "llama_small")
MODELS = CNNS + VITS + LMS
MODES = ("infer_bs1", "infer_bs32", "train")
TRAINED = ("resnet50", "gpt2", "llama_small")  # the models with a training row
MAX_AUTOTUNE = ("resnet50", "vit_b_16", "gpt2")  # max-autotune compiles take minutes: these only
SEQ = 256  # the language models' sequence length
ROUND_ITERS = {False: 10, True: 4}  # calls per timing in a round: inference, a training step
ROUND_WARMUP = 2
SETTLE_S = 120.0  # the longest a cf variant waits for the plans the build process builds for it


def build(name: str):
    """(model on the GPU in its dtype, a function making its input for a batch size)."""
    if name in CNNS + VITS:
        import torchvision

        model = getattr(torchvision.models, name)(weights=None).cuda().to(torch.float16)
        _random_zero_layers(model)
        if name in CNNS:
            model = model.to(memory_format=torch.channels_last)

        def make(bs):
            x = torch.randn(bs, 3, 224, 224, device="cuda", dtype=torch.float16)
            return (x.contiguous(memory_format=torch.channels_last) if name in CNNS else x,)
        return model, make
    import transformers as tf

    if name == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(attn_implementation="sdpa"))
    elif name == "bert_base":
        model = tf.BertModel(tf.BertConfig(attn_implementation="sdpa"))
    else:
        model = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                                   num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                                                   attn_implementation="sdpa"))
    model = model.cuda().to(torch.bfloat16)
    _random_zero_layers(model)
    vocab = model.config.vocab_size

    def make(bs):
        return (torch.randint(0, vocab, (bs, SEQ), device="cuda"),)
    return model, make


def _random_zero_layers(model) -> None:
    """Random weights for Linear layers initialized to zero (ViT's and Swin's heads): a zero output
    would make every variant's error against eager read 0."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and not m.weight.any():
                torch.nn.init.normal_(m.weight, std=0.02)


def _logits(out):
    if isinstance(out, torch.Tensor):
        return out
    for key in ("logits", "last_hidden_state"):
        v = getattr(out, key, None)
        if v is not None:
            return v
    return out[0]


def rel_err(got, want) -> float:
    got, want = _logits(got).float(), _logits(want).float()
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def variants(name: str, mode: str, autotune_budget: float, compile_modes) -> list:
    """(variant name, model wrapper from the eager model) pairs for one row."""
    out = [("eager", lambda m: m), ("cf", lambda m: cf.optimize(m)),
           ("cf_autotuned", lambda m: cf.optimize(m, autotune=True))]
    for cmode in compile_modes:
        if cmode == "max-autotune" and name not in MAX_AUTOTUNE:
            continue
        suffix = "" if cmode == "default" else "_max"
        out.append((f"compile{suffix}", lambda m, c=cmode: torch.compile(m, mode=c)))
        out.append((f"cf_compile{suffix}", lambda m, c=cmode: torch.compile(cf.optimize(m), mode=c)))
    return out


def decisions(limit: int = 40) -> list:
    """The plan decisions of the current plan cache (the cf variant just run): per graph its op, sizes,
    engine and, for a heuristic plan, its timing against torch's kernels; slowest first."""
    from cudnn_fuse.cache import open_default_cache

    pc = open_default_cache()
    if pc is None:
        return []
    out = []
    for _key, meta, _size in pc.entries():
        spec = meta.get("spec", {})
        check = meta.get("torch_check") or {}
        shapes = {k: v["shape"] for k, v in spec.items() if isinstance(v, dict) and "shape" in v}
        if spec.get("groups", 1) != 1:
            shapes["groups"] = spec["groups"]
        out.append({"op": meta.get("op"), "shapes": shapes,
                    "engine": meta.get("engine_name"), "tuned": meta.get("tuned"), "use_torch": meta.get("use_torch"),
                    "use_gemm": meta.get("use_gemm"), "cudnn_ms": check.get("cudnn_ms"), "torch_ms": check.get("torch_ms")})
    out.sort(key=lambda d: -(d["cudnn_ms"] or 0))
    return out[:limit]


def top_kernels(fn, steps: int = 5, limit: int = 15) -> dict:
    """torch.profiler over ``steps`` calls of ``fn``: the kernels taking most device time (us per call),
    and host and device time per call. Before it, unprofiled: the host's time to issue two calls and their
    time to finish (``issue_ms``, ``wall_ms`` per call: equal when the host bounds them), and the threads
    alive in the process (one polling beside the caller takes its share of the GIL)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(2):  # a forward launches a few hundred kernels: two fit in the launch queue
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    timing = {"issue_ms": round((t1 - t0) * 500, 3), "wall_ms": round((t2 - t0) * 500, 3),
              "threads": sorted(t.name for t in threading.enumerate())}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows, host = profiled_ops(prof, steps)
    return {**timing, "device_us": round(sum(r["us"] for r in rows), 1), "kernels": rows[:limit],
            "kernel_launches": sum(r["calls"] for r in rows), "host_us": round(sum(r["us"] for r in host), 1),
            "host_ops": host[:limit]}


def prepare_variant(model, make, wrap, mode: str, bs: int, want):
    """(the step, its first call in s, its error against ``want``) of one variant, its model wrapped."""
    inputs = make(bs)
    train = mode == "train"
    model.train(train)  # before the wrap: optimize() folds BatchNorm only in eval mode
    m = wrap(model)
    m.train(train)

    def step():
        if train:
            out = _logits(m(*inputs))
            out.float().square().mean().backward()
            return out
        with torch.no_grad():
            return m(*inputs)

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    first = step()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    err = rel_err(first, want) if want is not None else 0.0
    return step, first_s, err


def settle(step, timeout_s: float = SETTLE_S) -> dict:
    """Run a cf variant until no plan it waits for is still building: a new size of a known shape family
    runs torch's kernels while the build process builds its plan on the same GPU, and is swapped in the call
    after. Its timings, and the compiles built after it, then see neither. Returns the stand-ins, swaps and
    plans the build process built meanwhile."""
    from cudnn_fuse import build_process

    before = cf.plan_stats()
    for _ in range(3):  # the second call asks for the plans, the third may already swap
        step()
    bp = build_process.default()
    if bp is not None and not bp.wait(timeout_s):
        print(f"  the build process still had {bp.pending()} plans to build after {timeout_s:.0f} s", flush=True)
    for _ in range(2):  # the plans stored meanwhile swap in
        step()
    torch.cuda.synchronize()
    after = cf.plan_stats()
    return {k: after[k] - before[k] for k in ("standins", "swaps", "process_builds")}


def time_rounds(steps: dict, rounds: int, train: bool, runs: dict | None = None) -> dict:
    """{variant: (median ms, the interquartile range of its timings over that median)} of ``rounds`` short
    timings of each step, taken in turn (forward, then backward order, ...). The host of a GPU machine runs
    at speeds that drift over seconds: Swin-T's compiled forward read 3.1 ms in one round and 4.9 ms in the
    next, every compiled variant alike (docs/decisions.md), so many short rounds, none always last, keep
    the variants of a row under the same conditions. Each timing is also appended to ``runs[variant]``."""
    mine = {v: [] for v in steps}
    names = list(steps)
    for r in range(rounds):
        for v in (names if r % 2 == 0 else names[::-1]):
            mine[v].append(time_ms(steps[v], warmup=ROUND_WARMUP, iters=ROUND_ITERS[train]))
    if runs is not None:
        for v, t in mine.items():
            runs.setdefault(v, []).extend(t)
    return {v: (statistics.median(t), _iqr(t) / statistics.median(t)) for v, t in mine.items()}


def _iqr(values) -> float:
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[2] - q[0]


def _paired(steps: dict, eager, rounds: int, train: bool, runs: dict) -> dict:
    """``time_rounds`` of ``steps`` with eager's step among them (appended to ``runs``): {variant: (median
    ms, spread)}. The same model read 7.0 and 11.7 ms in two runs of one card (Swin-T eager, H100, f6f2ea2
    and 947cb89): a speed-up is only a ratio of timings taken in turn."""
    return {v: got for v, got in time_rounds(({"eager": eager} if eager is not None else {}) | steps, rounds,
                                             train, runs).items() if v != "eager"}


def _best_ratios(row: dict, runs: dict) -> None:
    """Each variant's speed-up over eager, the ratio of their fastest rounds (``vs_eager``): a host-bound
    model's rounds fall into a fast and a slow state (ResNet-50 eager read 3.1–3.9 ms and 5.7–6.5 ms in
    one row, H100, 4a39fe5) that the device-bound variants beside it do not share, so neither the medians
    nor the rounds' own ratios compare the variants under one state; the fastest rounds do."""
    base = min(runs.get("eager") or [0.0])
    for v, ts in runs.items():
        if v != "eager" and base and ts:
            row.setdefault("vs_eager", {})[v] = round(base / min(ts), 4)


def run_row(name: str, mode: str, args) -> dict:
    from torch._dynamo.utils import counters

    from cudnn_fuse import loader

    torch.manual_seed(0)
    model, make = build(name)
    bs = 32 if mode in ("infer_bs32", "train") else 1
    if mode == "train" and name in LMS:
        bs = 8
    row = {"model": name, "mode": mode, "batch": bs, "first_call_s": {}, "err": {}}
    torch.manual_seed(1)
    with torch.no_grad():
        model.eval()
        want = model(*make(bs))  # the reference output: eager, same inputs (seeded)
    compiled, caches, eager, runs = {}, contextlib.ExitStack(), None, {}
    rounds = max(4, args.repeat)
    with caches:  # every variant's plan cache lives until its timings are done
        torch._dynamo.reset()  # once a row: a reset between variants would drop the compiled ones
        for vname, wrap in variants(name, mode, args.autotune_budget, args.compile_modes):
            if args.variants and vname not in args.variants:
                continue
            torch.manual_seed(1)
            os.environ["CUDNN_FUSE_CACHE_DIR"] = caches.enter_context(tempfile.TemporaryDirectory())  # empty
            if vname.startswith("cf"):  # plans in memory would serve it: cf_autotuned would tune nothing
                loader.clear()
            counters.clear()
            try:
                step, first_s, err = prepare_variant(model, make, wrap, mode, bs, want if mode != "train" else None)
                if vname.startswith("cf") and "compile" not in vname:  # compiled, cf's ops trace as torch's
                    row.setdefault("settled", {})[vname] = settle(step)
                if args.profiling:
                    row.setdefault("profile", {})[vname] = top_kernels(step)
                    if vname == "cf":
                        row["decisions"] = decisions()
                    continue
            except Exception as exc:  # noqa: BLE001 - a variant that fails is recorded, the row goes on
                row[f"{vname}_error"] = f"{type(exc).__name__}: {exc}"[:300]
                print(f"  {name} {mode} {vname}: {row[f'{vname}_error']}", flush=True)
                continue
            finally:
                cf.set_autotune(None)
            row["first_call_s"][vname] = round(first_s, 3)
            row["err"][vname] = float(f"{err:.3g}")
            if "compile" in vname:  # what Dynamo made of it: graphs compiled, graph breaks; timed with the others
                row.setdefault("dynamo", {})[vname] = {"graphs": counters["stats"]["unique_graphs"],
                                                       "breaks": sum(counters["graph_break"].values())}
                compiled[vname] = step
            elif vname == "eager":
                eager = step
            else:  # timed now, in turn with eager, with its own plan cache and nothing built after it in memory
                _timed(row, name, mode, _paired({vname: step}, eager, rounds, mode == "train", runs))
        if compiled and not args.profiling:
            _timed(row, name, mode, _paired(compiled, eager, rounds, mode == "train", runs))
        row["round_ms"] = {v: [round(t, 3) for t in ts] for v, ts in runs.items()}  # the host's drift shows here
        _best_ratios(row, runs)
        if row.get("vs_eager"):
            print(f"  {name:18s} {mode:10s} over eager (fastest rounds): "
                  + ", ".join(f"{v} {x:.2f}x" for v, x in row["vs_eager"].items()), flush=True)
        if runs.get("eager"):
            row["eager_ms"] = round(statistics.median(runs["eager"]), 4)
        elif eager is not None and not args.profiling:  # eager alone was asked for
            row["eager_ms"] = round(time_rounds({"eager": eager}, rounds, mode == "train")["eager"][0], 4)
        compiled.clear()
    gc.collect()
    torch.cuda.empty_cache()
    return row


def _timed(row: dict, name: str, mode: str, timings: dict) -> None:
    for vname, (ms, spread) in timings.items():
        row[f"{vname}_ms"] = round(ms, 4)
        row.setdefault("spread", {})[vname] = round(spread, 4)
        print(f"  {name:18s} {mode:10s} {vname:14s} {ms:9.3f} ms  first {row['first_call_s'][vname]:7.2f} s  "
              f"err {row['err'][vname]:.2e}", flush=True)


def speedup(row: dict, variant: str):
    """Eager's time over ``variant``'s in ``row``: the ratio the row keeps (``vs_eager``: of the fastest
    rounds, or for rows before 4a39fe5 of rounds taken in turn) where it has one, else of the two medians;
    None where the row lacks either."""
    paired = (row.get("vs_eager") or {}).get(variant)
    if paired is not None:
        return paired
    ms, base = row.get(f"{variant}_ms"), row.get("eager_ms")
    return base / ms if ms and base else None


def summarize(rows) -> dict:
    """The goals' ratios over the rows that have them."""
    def geo(vals):
        vals = [v for v in vals if v and math.isfinite(v)]
        return round(math.exp(sum(math.log(v) for v in vals) / len(vals)), 4) if vals else None

    infer = [r for r in rows if r["mode"].startswith("infer")]

    def cf_eager(r):  # cf's time over eager's
        x = speedup(r, "cf")
        return 1 / x if x else None

    def cfc_compile(r):  # torch.compile(cf)'s time over torch.compile's, both against the same eager rounds
        a, b = speedup(r, "cf_compile"), speedup(r, "compile")
        return b / a if a and b else None

    return {
        "cf_over_eager_worst": max((v for v in map(cf_eager, rows) if v), default=None),
        "eager_over_cf_geomean_infer": geo([speedup(r, "cf") for r in infer]),
        "cf_compile_over_compile_worst": max((v for v in map(cfc_compile, rows) if v), default=None),
        "compile_over_cf_compile_geomean_infer": geo([1 / v for v in map(cfc_compile, infer) if v]),
    }


def plot(path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.load(open(path))
    rows = [r for r in doc["rows"] if "eager_ms" in r]
    labels = [f"{r['model']}\n{r['mode']}" for r in rows]
    series = [("cf", "cf_ms"), ("cf autotuned", "cf_autotuned_ms"), ("torch.compile", "compile_ms"),
              ("torch.compile(cf)", "cf_compile_ms")]
    fig, ax = plt.subplots(figsize=(max(8, 0.7 * len(rows)), 5))
    width = 0.8 / len(series)
    for i, (label, key) in enumerate(series):
        ax.bar([j + i * width for j in range(len(rows))],
               [speedup(r, key[:-3]) or 0 for r in rows], width, label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels(labels, rotation=90, fontsize=7)
    ax.set_ylabel("speed-up over torch eager")
    ax.set_title(f"model zoo on {doc.get('gpu')} ({doc.get('commit')})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=120)
    return out


def table(path: str) -> str:
    """The README's markdown table of a models.json: per model and mode, eager's time (its fastest round
    where the row keeps them) and each variant's speed-up over it, and the commit and GPU of the row."""
    doc = json.load(open(path))
    lines = ["| model | mode | eager ms | `cf.optimize` | `torch.compile` | `torch.compile(cf.optimize)` | run |",
             "|---|---|---|---|---|---|---|"]

    def x(r, key):
        v = speedup(r, key[:-3])
        return f"{v:.2f}×" if v else "—"
    order = {m: i for i, m in enumerate(MODELS)}
    for r in sorted((r for r in doc["rows"] if "eager_ms" in r), key=lambda r: (order.get(r["model"], 99), r["mode"])):
        gpu = str(r.get("gpu", "")).replace("NVIDIA ", "").split(" ")[0]
        eager = min(r["round_ms"]["eager"]) if r.get("round_ms", {}).get("eager") else r["eager_ms"]
        lines.append(f"| {r['model']} | {r['mode'].replace('infer_', 'inference ')} | {eager:.2f} | "
                     f"{x(r, 'cf_ms')} | {x(r, 'compile_ms')} | {x(r, 'cf_compile_ms')} | {r.get('commit')}, {gpu} |")
    return "\n".join(lines)


COMPILE_MODES = ("default", "max-autotune")


def _check_names(p, args) -> None:
    """An unknown model, mode, variant or compile mode is an error naming its option: a model name
    build() did not know ran the Llama config under that name."""
    every_variant = tuple(v for v, _ in variants(MAX_AUTOTUNE[0], "train", 0.0, COMPILE_MODES))
    for option, given, known in (("--models", args.models, MODELS), ("--modes", args.modes, MODES),
                                 ("--variants", args.variants, every_variant),
                                 ("--compile-modes", args.compile_modes, COMPILE_MODES)):
        bad = [n for n in given.split(",") if n and n not in known]
        if bad:
            p.error(f"{option}: unknown {', '.join(bad)} (known: {', '.join(known)})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results", help="directory of models.json (rows merged by model, mode)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated among {', '.join(MODELS)}")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated among {', '.join(MODES)}")
    p.add_argument("--variants", default="", help="comma-separated variant names to run (default: all)")
    p.add_argument("--compile-modes", default="default", help="torch.compile modes: default and/or max-autotune")
    p.add_argument("--autotune-budget", type=float, default=2.0, help="cf autotuned's budget per graph, seconds")
    p.add_argument("--compile-inline", default=None, metavar="OPS",
                   help="the ops torch.compile traces as torch (cf.set_compile_inline; default: the library's)")
    p.add_argument("--explain", action="store_true",
                   help="also record each row's top kernels and host ops (torch.profiler, after all timings) and "
                        "cf's plan decisions")
    p.add_argument("--plot", metavar="JSON", help="only plot an existing models.json")
    p.add_argument("--table", metavar="JSON", help="only print an existing models.json as the README's table")
    p.add_argument("--commit", default=None, help="the commit to record (default: git's HEAD)")
    p.add_argument("--repeat", type=int, default=16,
                   help="short timings per variant, at least 4, each taken in turn with eager's (the compiled ones "
                        "with each other's too): the row keeps them (round_ms), their median, their interquartile "
                        "range over it (spread) and eager's fastest over the variant's fastest (vs_eager)")
    args = p.parse_args(argv)
    _check_names(p, args)
    if args.plot:
        print(plot(args.plot))
        return 0
    if args.table:
        print(table(args.table))
        return 0
    if not torch.cuda.is_available():
        print("models.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.compile_inline is not None:
        cf.set_compile_inline(args.compile_inline)
    args.variants = [v for v in args.variants.split(",") if v]
    args.compile_modes = [c for c in args.compile_modes.split(",") if c]
    os.environ["CUDNN_FUSE_TUNE_BUDGET_S"] = str(args.autotune_budget)
    from cudnn_fuse import autotune

    autotune.DEFAULT_CONFIG.budget_s = args.autotune_budget
    path = os.path.join(args.out, "models.json")
    doc = json.load(open(path)) if os.path.exists(path) else {"rows": []}
    doc.update(gpu=device_name(), commit=args.commit or checkout_commit(), torch=torch.__version__)
    from cudnn_fuse import ops

    doc["compile_inline"] = sorted(ops.compile_inline)
    todo = [(n, m) for n in args.models.split(",") for m in args.modes.split(",") if m != "train" or n in TRAINED]
    args.profiling = False
    for name, mode in todo:
        row = run_row(name, mode, args)
        row.update(gpu=doc["gpu"], commit=doc["commit"])
        doc["rows"] = [r for r in doc["rows"] if (r["model"], r["mode"]) != (name, mode)] + [row]
        doc["summary"] = summarize(doc["rows"])
        os.makedirs(args.out, exist_ok=True)
        write_json(path, doc)
    if args.explain:  # after every timing: a profiler session slows the launches that follow it in the process
        args.profiling = True
        args.variants = args.variants or ["eager", "cf", "compile", "cf_compile"]
        for name, mode in todo:
            prof = run_row(name, mode, args)
            row = next(r for r in doc["rows"] if (r["model"], r["mode"]) == (name, mode))
            row.update(profile=prof.get("profile", {}), decisions=prof.get("decisions", []))
            write_json(path, doc)
    print(json.dumps(doc["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
