"""Plots and a results table from bench/results/peers.json (made on any machine; needs matplotlib:
`pip install ".[bench]"`).

    python3 bench/plot_peers.py [--json bench/results/peers.json] [--out-dir bench/results]

writes peers_speedup.png (autotuned cf's speedup over the best peer, per workload),
peers_roofline.png (achieved TFLOP/s against arithmetic intensity under the measured roofline,
and each workload's fraction of its roofline floor) and peers_table.md (the table for the README).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

KIND_COLORS = {"conv": "tab:blue", "matmul": "tab:orange", "attention": "tab:green", "small": "tab:purple",
               "model": "tab:red"}


def _ok(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def cf_ms(rec: dict):
    """Autotuned cf where measured, else the best cf variant."""
    return rec["cf_autotuned_ms"] if _ok(rec.get("cf_autotuned_ms")) else rec.get("cf_best_ms")


def speedup_rows(doc: dict) -> list:
    """(name, kind, speedup over the best peer, best peer) for workloads with both timed."""
    rows = []
    for r in doc["workloads"]:
        ms, peer = cf_ms(r), r.get("best_peer_ms")
        if _ok(ms) and _ok(peer):
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
        if not (r.get("bytes") and _ok(ms) and r.get("floor_ms")):
            continue
        peer = r.get("best_peer_ms")
        rows.append((r["name"], r["kind"], r["flops"] / r["bytes"], r["flops"] / ms / 1e9,
                     r["flops"] / peer / 1e9 if _ok(peer) else None, r["floor_ms"] / ms))
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
    if rows and _ok(ceiling) and _ok(bw):
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
    return fmt.format(x) if _ok(x) else "–"


def _ff(ttr: dict, key: str):
    return (ttr.get(key + "_detail") or {}).get("first_forward_s", "–")


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
             "| workload | kind | cf ms | cf autotuned ms | best peer | peer ms | speedup | % of roofline |",
             "|---|---|---|---|---|---|---|---|"]
    for r in doc["workloads"]:
        frac = r.get("roofline_fraction")
        lines.append(f"| {r['name']} | {r['kind']} | {_f(r.get('cf_ms'))} | {_f(r.get('cf_autotuned_ms'))} | "
                     f"{r.get('best_peer') or '–'} | {_f(r.get('best_peer_ms'))} | "
                     f"{_f(r.get('speedup_vs_best_peer'), '{:.2f}×')} | {_f(frac and 100 * frac, '{:.0f}')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=os.path.join("bench", "results", "peers.json"))
    p.add_argument("--out-dir", default=None, help="default: the JSON's folder")
    p.add_argument("--prefix", default="peers", help="file name prefix of the outputs")
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_peers: needs matplotlib (pip install '.[bench]')", file=sys.stderr)
        return 2
    with open(args.json) as f:
        doc = json.load(f)
    out = args.out_dir or os.path.dirname(os.path.abspath(args.json))
    os.makedirs(out, exist_ok=True)
    n = plot_speedup(doc, os.path.join(out, f"{args.prefix}_speedup.png"))
    m = plot_roofline(doc, os.path.join(out, f"{args.prefix}_roofline.png"))
    with open(os.path.join(out, f"{args.prefix}_table.md"), "w") as f:
        f.write(table(doc))
    print(f"{n} speedup bars, {m} roofline points -> {out}/{args.prefix}_{{speedup,roofline}}.png, "
          f"{args.prefix}_table.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
