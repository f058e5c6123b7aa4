"""Plots of bench/results/memory.json and cold_start.json (made on any machine; needs matplotlib:
`pip install ".[bench]"`).

    python3 bench/plot_results.py [--memory bench/results/memory.json]
                                  [--cold bench/results/cold_start.json] [--out-dir bench/results]

writes memory.png (each case's peak memory and step time as a ratio to eager's, against the
targets: recompute cases at most 0.70x the peak and 1.35x the step, the others at most 1.0x the
peak and under 1.0x the step) and cold_start.png (each graph's time to first result in a fresh
process: empty cache with heuristic plans, empty cache autotuned, warm cache, and torch eager;
log scale, with the 2 ms warm target and each mode's mean and median).
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--memory", default=os.path.join("bench", "results", "memory.json"))
    p.add_argument("--cold", default=os.path.join("bench", "results", "cold_start.json"))
    p.add_argument("--out-dir", default=None, help="default: each JSON's folder")
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_results: needs matplotlib (pip install '.[bench]')", file=sys.stderr)
        return 2
    made = []
    for src, name, plot in ((args.memory, "memory.png", plot_memory), (args.cold, "cold_start.png", plot_cold)):
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
