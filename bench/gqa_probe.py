"""GQA attention as a torch expression (what torch.compile traces for cf's SDPA): k/v expanded
by hand (repeat_interleave, what reference.py did) against torch's own enable_gqa, eager and
under torch.compile, with the attention kernel each one runs. Device ms, median of repeats.

    python3 bench/gqa_probe.py --out DIR      # -> DIR/gqa_probe.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import device_name, time_ms, write_json  # noqa: E402


def expanded(q, k, v, causal, mask):
    rep = q.size(-3) // k.size(-3)
    k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


def native(q, k, v, causal, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)


def kernels(fn) -> list:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.key[:90] for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    bf = torch.bfloat16
    for B, H, HKV, S, D, causal, masked in [(4, 32, 8, 2048, 128, True, False), (8, 32, 8, 1024, 64, True, False),
                                            (2, 32, 4, 4096, 128, False, False), (4, 32, 8, 1024, 128, False, True)]:
        q = torch.randn(B, H, S, D, device="cuda", dtype=bf)
        k, v = (torch.randn(B, HKV, S, D, device="cuda", dtype=bf) for _ in range(2))
        mask = torch.rand(B, 1, S, S, device="cuda") > 0.2 if masked else None
        ref = expanded(q.float(), k.float(), v.float(), causal, mask)
        row = {"shape": f"b{B}_h{H}_hkv{HKV}_s{S}_d{D}_{'causal' if causal else 'full'}{'_mask' if masked else ''}"}
        for name, fn in (("expanded", expanded), ("native", native)):
            for mode in ("eager", "compiled"):
                f = torch.compile(fn, fullgraph=True, dynamic=False) if mode == "compiled" else fn
                try:
                    out = f(q, k, v, causal, mask)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    row[f"{name}_{mode}"] = {"ms": round(time_ms(lambda: f(q, k, v, causal, mask)), 4),
                                             "rel_err": float(f"{err:.3g}"),
                                             "kernels": kernels(lambda: f(q, k, v, causal, mask))}
                except Exception as exc:  # noqa: BLE001 - a backend that refuses is a result here
                    row[f"{name}_{mode}"] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        rows.append(row)
        print(row["shape"], {k: v.get("ms", v.get("error")) for k, v in row.items() if isinstance(v, dict)}, flush=True)
    write_json(os.path.join(args.out, "gqa_probe.json"), {"device": device_name(), "torch": torch.__version__, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
