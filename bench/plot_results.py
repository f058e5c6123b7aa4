"""Plots of the benchmark results (made on any machine; needs matplotlib: `pip install ".[bench]"`).

    python3 bench/plot_results.py [--memory bench/results/memory.json] [--cold bench/results/cold_start.json]
                                  [--peers bench/results/peers.json] [--out-dir bench/results]

writes, next to each JSON that exists:
- memory.png: each case's peak memory and step time as a ratio to eager's, against the targets:
  recompute cases at most 0.70x the peak and 1.35x the step, the others at most 1.0x the peak and under
  1.0x the step;
- cold_start.png: each graph's time to first result in a fresh process: empty cache with heuristic
  plans, empty cache autotuned, warm cache, and torch eager; log scale, with the 2 ms warm target and
  each mode's mean and median;
- peers_speedup.png (autotuned cf's speedup over the best peer, per workload), peers_roofline.png
  (achieved TFLOP/s against arithmetic intensity under the measured roofline, and each workload's
  fraction of its roofline floor) and peers_table.md (the table for the README).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

# the memory targets, as (peak ratio at most, step ratio at most, step ratio strictly under?)
RECOMPUTE_TARGET = (0.70, 1.35, False)
PLAIN_TARGET = (1.00, 1.00, True)
WARM_TARGET_MS = 2.0  # the warm cache's target, ms to first result per graph
COLD_MODES = ("cold_heuristic", "cold_autotune", "warm", "torch_eager_first_call")


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _target(name: str) -> tuple:
    return RECOMPUTE_TARGET if "recompute" in name else PLAIN_TARGET


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def memory_rows(doc: dict) -> list:
    """(name, peak ratio, step ratio, peak met, step met) per case of memory.json with every
    measurement; each judged against the case's target (recompute cases: "recompute" in the name)."""
    rows = []
    for c in doc.get("cases", []):
        keys = ("eager_peak_bytes", "cf_peak_bytes", "eager_step_ms", "cf_step_ms")
        if not all(_num(c.get(k)) for k in keys):
            continue
        peak = c["cf_peak_bytes"] / c["eager_peak_bytes"]
        step = c["cf_step_ms"] / c["eager_step_ms"]
        max_peak, max_step, strict = _target(c["name"])
        rows.append((c["name"], peak, step, peak <= max_peak, step < max_step if strict else step <= max_step))
    return rows


def cold_rows(doc: dict) -> list:
    """(graph, {mode: ms}) per graph of cold_start.json, in the file's order; modes not measured
    for a graph are left out of its dict."""
    eager = (doc.get("eager_first_call") or {}).get("per_graph_ms") or {}  # torch eager's first calls (cold_start.py's eager process)
    rows = []
    for name, per in (doc.get("per_graph_ms") or {}).items():
        per = dict(per, torch_eager_first_call=eager.get(name))
        rows.append((name, {m: per[m] for m in COLD_MODES if _num(per.get(m))}))
    return rows


def cold_summary(rows: list) -> dict:
    """{mode: (mean, median)} over the graphs that measured it."""
    out = {}
    for m in COLD_MODES:
        vals = [per[m] for _, per in rows if m in per]
        if vals:
            out[m] = (statistics.fmean(vals), statistics.median(vals))
    return out


def plot_memory(doc: dict, path: str) -> int:
    plt = _pyplot()
    rows = memory_rows(doc)
    if not rows:
        raise ValueError("memory.json has no case with every measurement")
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.9 * len(rows) + 2.2), sharey=True)
    names = [r[0] for r in rows]
    for ax, idx, title in ((axes[0], 1, "peak memory / eager's"), (axes[1], 2, "step time / eager's")):
        vals = [r[idx] for r in rows]
        colors = ["tab:green" if r[idx + 2] else "tab:red" for r in rows]
        bars = ax.barh(range(len(rows)), vals, color=colors)
        for b, v in zip(bars, vals):
            ax.text(v, b.get_y() + b.get_height() / 2, f" {v:.2f}×", va="center", fontsize=9)
        for i, r in enumerate(rows):
            target = _target(r[0])[idx - 1]
            ax.plot([target, target], [i - 0.45, i + 0.45], color="black", linestyle="--", linewidth=1)
        ax.axvline(1.0, color="grey", linewidth=0.6)
        ax.set_title(title)
        ax.set_xlim(0, max(1.5, max(vals) * 1.2))
    axes[0].set_yticks(range(len(rows)))
    axes[0].set_yticklabels(names, fontsize=9)
    axes[0].invert_yaxis()
    fig.suptitle(f"One training step, cf against eager ({doc.get('device', '?')}); dashed: the target, "
                 "green: met", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return len(rows)


def plot_cold(doc: dict, path: str) -> int:
    plt = _pyplot()
    rows = cold_rows(doc)
    if not rows:
        raise ValueError("cold_start.json has no per_graph_ms")
    colors = {"cold_heuristic": "tab:orange", "cold_autotune": "tab:red", "warm": "tab:blue",
              "torch_eager_first_call": "tab:grey"}
    summary = cold_summary(rows)
    modes = [m for m in COLD_MODES if m in summary]
    fig, ax = plt.subplots(figsize=(max(8, 0.32 * len(rows) + 6), 5.5))
    width = 0.8 / max(1, len(modes))
    for k, m in enumerate(modes):
        xs = [i + (k - (len(modes) - 1) / 2) * width for i, (_, per) in enumerate(rows) if m in per]
        ys = [per[m] for _, per in rows if m in per]
        mean, median = summary.get(m, (float("nan"), float("nan")))
        ax.bar(xs, ys, width=width, color=colors[m], label=f"{m}: mean {mean:.1f}, median {median:.1f} ms")
    ax.axhline(WARM_TARGET_MS, color="black", linestyle="--", linewidth=1, label=f"warm target {WARM_TARGET_MS:g} ms")
    ax.set_yscale("log")
    ax.set_ylabel("time to first result, ms per graph (log)")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r[0] for r in rows], rotation=75, ha="right", fontsize=7)
    built = doc.get("warm_plans_built")
    ax.set_title(f"Cold start, {doc.get('graphs', len(rows))} graphs in fresh processes ({doc.get('device', '?')}); "
                 f"warm plans built: {built}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return len(rows)


KIND_COLORS = {"conv": "tab:blue", "matmul": "tab:orange", "attention": "tab:green", "small": "tab:purple",
               "model": "tab:red"}


def cf_ms(rec: dict):
    """Autotuned cf where measured, else the best cf variant."""
    return rec["cf_autotuned_ms"] if _num(rec.get("cf_autotuned_ms")) else rec.get("cf_best_ms")


def speedup_rows(doc: dict) -> list:
    """(name, kind, speedup over the best peer, best peer) for workloads with both timed."""
    rows = []
    for r in doc["workloads"]:
        ms, peer = cf_ms(r), r.get("best_peer_ms")
        if _num(ms) and _num(peer):
            rows.append((r["name"], r["kind"], peer / ms, r.get("best_peer")))
    return rows


def plot_speedup(doc: dict, path: str) -> int:
    """Horizontal bars, one per workload, log scale, 1.0 marked; returns the number of bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = speedup_rows(doc)
    fig, ax = plt.subplots(figsize=(9, 1.5 + 0.2 * max(len(rows), 1)))
    if rows:
        y = range(len(rows))
        ax.barh(list(y), [r[2] for r in rows], color=[KIND_COLORS.get(r[1], "gray") for r in rows])
        ax.set_yticks(list(y), [f"{r[0]}  (vs {r[3]})" for r in rows], fontsize=6)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.axvline(1.0, color="black", linewidth=0.8)
        for kind, color in KIND_COLORS.items():
            ax.barh([0], [0], color=color, label=kind)
        ax.legend(loc="lower right", fontsize=7)
    ax.set_xlabel("speedup of autotuned cf over the best peer (best peer ms / cf ms; > 1: cf faster)")
    s = doc.get("summary", {})
    ax.set_title(f"{doc.get('device')}: geomean {s.get('geomean_speedup_vs_best_peer')} vs best peer, "
                 f"{s.get('geomean_autotuned_vs_max_autotune')} vs torch.compile max-autotune", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return len(rows)


def roofline_rows(doc: dict) -> list:
    """(name, kind, intensity, cf TFLOP/s, best peer TFLOP/s or None, cf fraction of the floor)."""
    rows = []
    for r in doc["workloads"]:
        ms = cf_ms(r)
        if not (r.get("bytes") and _num(ms) and r.get("floor_ms")):
            continue
        peer = r.get("best_peer_ms")
        rows.append((r["name"], r["kind"], r["flops"] / r["bytes"], r["flops"] / ms / 1e9,
                     r["flops"] / peer / 1e9 if _num(peer) else None, r["floor_ms"] / ms))
    return rows


def plot_roofline(doc: dict, path: str) -> int:
    """Left: TFLOP/s vs FLOP/byte under min(ceiling, bandwidth x intensity), cf filled, best peer
    hollow. Right: cf's fraction of each workload's roofline floor. Returns the points drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = roofline_rows(doc)
    ceiling, bw = doc.get("ceiling_tflops"), doc.get("hbm_tbps")
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, max(5, 1.5 + 0.16 * len(rows))),
                                 gridspec_kw={"width_ratios": [1, 1.2]})
    if rows and _num(ceiling) and _num(bw):
        lo = min(r[2] for r in rows) / 2
        hi = max(r[2] for r in rows) * 2
        xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
        ax.plot(xs, [min(ceiling, bw * x) for x in xs], color="black", linewidth=1,
                label=f"roof: {ceiling} TFLOP/s, {bw} TB/s (the highest part's)")
        for kind, color in KIND_COLORS.items():
            pts = [r for r in rows if r[1] == kind]
            if pts:
                ax.scatter([r[2] for r in pts], [r[3] for r in pts], color=color, s=14, label=f"cf {kind}")
                peers = [r for r in pts if r[4]]
                ax.scatter([r[2] for r in peers], [r[4] for r in peers], facecolors="none", edgecolors=color, s=14)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.legend(fontsize=7, loc="lower right")
        order = sorted(rows, key=lambda r: r[5])
        bx.barh(range(len(order)), [r[5] for r in order], color=[KIND_COLORS.get(r[1], "gray") for r in order])
        bx.set_yticks(range(len(order)), [r[0] for r in order], fontsize=5)
        bx.axvline(0.85, color="black", linestyle="--", linewidth=0.8)
        bx.set_xlim(0, 1.05)
    ax.set_xlabel("arithmetic intensity (FLOP / byte, fewest bytes)")
    ax.set_ylabel("TFLOP/s (filled: cf autotuned; hollow: best peer)")
    ax.set_title(f"{doc.get('device')}: roofline from the ceilings measured in the run", fontsize=9)
    bx.set_xlabel("cf's fraction of the roofline floor of its own run's ceilings (floor ms / cf ms); dashed: 0.85")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return len(rows)


def _f(x, fmt="{:.4g}") -> str:
    return fmt.format(x) if _num(x) else "–"


def _ff(ttr: dict, key: str):
    return (ttr.get(key + "_detail") or {}).get("first_forward_s", "–")


def _peak_line(peak) -> str:
    if not peak:
        return "Card peak: not listed for this card (no % of peak)."
    return (f"Card peak ({peak['card']} datasheet): dense bf16 {peak['bf16_tflops']} TFLOP/s, HBM {peak['hbm_tbps']} "
            "TB/s; achieved is TFLOP/s for a compute-bound row, GB/s for a memory-bound one.")


def table(doc: dict) -> str:
    """The README's results table (markdown), with the run's context above it."""
    s = doc.get("summary", {})
    ho = doc.get("host_overhead_us") or {}
    ttr = doc.get("time_to_ready_s") or {}
    lines = [f"Device {doc.get('device')}, torch {doc.get('torch')}, cudnn_fuse {doc.get('cudnn_fuse')}; "
             f"measured bf16 matmul ceiling {doc.get('ceiling_tflops')} TFLOP/s, HBM copy {doc.get('hbm_tbps')} TB/s "
             "(the highest of the parts; each row is judged against the ceilings of the run that measured it).",
             "",
             f"Geomean speedup of cf over the best peer: {s.get('geomean_speedup_vs_best_peer')}; autotuned cf over "
             f"torch.compile max-autotune: {s.get('geomean_autotuned_vs_max_autotune')}.",
             f"Host µs per call (cf.linear 64×256×256 + ReLU): eager {ho.get('eager')}, captured {ho.get('captured')} "
             f"per op, torch eager {ho.get('torch_eager')}.",
             (f"Time to ready (fresh process → first resnet50 forward, s; in brackets the first forward alone, "
              f"after the imports): cf warm plan cache {ttr.get('cf')} ({_ff(ttr, 'cf')}), "
              f"torch.compile {ttr.get('torch_compile')} ({_ff(ttr, 'torch_compile')}), with a warm Inductor cache "
              f"{ttr.get('torch_compile_warm_inductor_cache')} ({_ff(ttr, 'torch_compile_warm_inductor_cache')})."
              if ttr else
              "Time to ready: not measured in the parts merged here (the `attention` part measures it)."),
             "",
             _peak_line(doc.get("card_peak")),
             "",
             "| workload | kind | cf ms | cf autotuned ms | best peer | peer ms | speedup | % of roofline | "
             "achieved | % of peak |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["workloads"]:
        frac, peak = r.get("roofline_fraction"), r.get("peak_fraction")
        achieved = (f"{_f(r.get('cf_tflops'))} TFLOP/s" if r.get("compute_bound")
                    else f"{_f(r.get('cf_gbps'))} GB/s" if r.get("compute_bound") is False else "–")
        lines.append(f"| {r['name']} | {r['kind']} | {_f(r.get('cf_ms'))} | {_f(r.get('cf_autotuned_ms'))} | "
                     f"{r.get('best_peer') or '–'} | {_f(r.get('best_peer_ms'))} | "
                     f"{_f(r.get('speedup_vs_best_peer'), '{:.2f}×')} | {_f(frac and 100 * frac, '{:.0f}')} | "
                     f"{achieved} | {_f(peak and 100 * peak, '{:.0f}')} |")
    return "\n".join(lines) + "\n"


def plot_peers(doc: dict, path: str) -> int:
    """peers_speedup.png, peers_roofline.png and peers_table.md in ``path``'s folder; the workloads."""
    out = os.path.dirname(path)
    n = plot_speedup(doc, os.path.join(out, "peers_speedup.png"))
    plot_roofline(doc, os.path.join(out, "peers_roofline.png"))
    with open(os.path.join(out, "peers_table.md"), "w") as f:
        f.write(table(doc))
    return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--memory", default=os.path.join("bench", "results", "memory.json"))
    p.add_argument("--cold", default=os.path.join("bench", "results", "cold_start.json"))
    p.add_argument("--peers", default=os.path.join("bench", "results", "peers.json"))
    p.add_argument("--out-dir", default=None, help="default: each JSON's folder")
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_results: needs matplotlib (pip install '.[bench]')", file=sys.stderr)
        return 2
    made = []
    for src, name, plot in ((args.memory, "memory.png", plot_memory), (args.cold, "cold_start.png", plot_cold),
                            (args.peers, "peers_*.png", plot_peers)):
        try:
            with open(src) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            print(f"plot_results: skipped {src}: {e}", file=sys.stderr)
            continue
        out = args.out_dir or os.path.dirname(os.path.abspath(src))
        os.makedirs(out, exist_ok=True)
        n = plot(doc, os.path.join(out, name))
        made.append(f"{os.path.join(out, name)} ({n} rows)")
    print("\n".join(made) if made else "plot_results: nothing plotted")
    return 0 if made else 1


if __name__ == "__main__":
    sys.exit(main())
