"""Is a 1x1 stride-1 conv faster as a GEMM? torch.compile max-autotune lowers ResNet-50's
``c64_k256_56_r1_s1_bias`` conv at batch 1 to ``addmm(3136x64, 64x256)`` and a Triton GEMM of
5.9 us, 0.87x of cf's conv (peers_conv1.json). A channels_last [N, C, H, W] input is the row-major
matrix [N*H*W, C] and a [K, C, 1, 1] weight is [K, C], so the same conv is ``cf.linear`` on views
(no copies), output [N*H*W, K] = channels_last [N, K, H, W]. This times, for every distinct 1x1
stride-1 conv of ResNet-50 at batch 1 and 32 (fp16, bias, the layer's activation and residual):
cf.conv2d and cf.linear on the views, each with heuristic and autotuned plans, torch eager's conv
and torch's addmm on the views. Same timer as the peers suite (device ms, L2 rotation).

Since the autotuner times that GEMM beside a 1x1 conv's own candidates (cudnn_fuse/conv_gemm.py),
``cf_conv_autotuned`` is the op as users get it (the faster of the two, ``chose_gemm`` in the row
says which), and ``cf_conv_autotuned_conv_only`` the conv's candidates alone (no plan cache, the
GEMM candidate off), so the row shows what the GEMM candidate buys.

    python3 bench/conv1x1_gemm_probe.py --out DIR      # -> DIR/conv1x1_gemm_probe.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import device_name, write_json  # noqa: E402
from cudnn_fuse import benchsuite as bs  # noqa: E402


def as_matrix(t):
    """[N, C, H, W] channels_last -> the [N*H*W, C] view of the same memory."""
    n, c, h, w = t.shape
    return t.permute(0, 2, 3, 1).reshape(n * h * w, c)


def as_image(m, n, h, w):
    return m.view(n, h, w, m.shape[1]).permute(0, 3, 1, 2)


def build(layer: bs.ConvLayer):
    import cudnn_fuse as cf

    def make(opts) -> bs.Case:
        h = torch.float16
        act, n, hw = layer.activation, layer.n, layer.hw

        def make_set():
            x = bs._rand(n, layer.c, hw, hw, dtype=h, cl=True)
            w = bs._rand(layer.k, layer.c, 1, 1, dtype=h, scale=layer.c ** -0.5, cl=True)
            b = bs._rand(layer.k, dtype=h)
            r = bs._rand(n, layer.k, hw, hw, dtype=h, cl=True) if layer.residual else None
            return (x, w, b, r)

        def cf_conv(x, w, b, r):
            return cf.conv2d(x, w, b, 1, 0, activation=act, residual=r)

        def cf_gemm(x, w, b, r):
            y = cf.linear(as_matrix(x), w.view(layer.k, layer.c), b, activation=act,
                          residual=None if r is None else as_matrix(r))
            return as_image(y, n, hw, hw)

        def torch_conv(x, w, b, r):
            y = F.conv2d(x, w, b)
            if r is not None:
                y = y + r
            return F.relu(y) if act == "relu" else y

        def torch_addmm(x, w, b, r):
            y = torch.addmm(b, as_matrix(x), w.view(layer.k, layer.c).t())
            if r is not None:
                y = y + as_matrix(r)
            return as_image(F.relu(y) if act == "relu" else y, n, hw, hw)

        def conv_only():
            from cudnn_fuse import autotune

            saved = autotune.DEFAULT_CONFIG.gemm_candidate, os.environ.get("CUDNN_FUSE_CACHE")
            autotune.DEFAULT_CONFIG.gemm_candidate = False
            os.environ["CUDNN_FUSE_CACHE"] = "0"  # tuned in memory: the cached entry (with the GEMM row) stays

            def restore():
                autotune.DEFAULT_CONFIG.gemm_candidate = saved[0]
                if saved[1] is None:
                    os.environ.pop("CUDNN_FUSE_CACHE", None)
                else:
                    os.environ["CUDNN_FUSE_CACHE"] = saved[1]
                bs._autotune_off()
            CONV_ONLY_RESTORE.append(restore)
            return bs._cf_setup(cf_conv, autotune=True)()

        def restore_conv_only():
            while CONV_ONLY_RESTORE:
                CONV_ONLY_RESTORE.pop()()
            from cudnn_fuse import plans

            plans.clear()  # the next variant must not find the conv-only plan in memory

        sets, flush = bs._rotated(make_set, opts)
        tuned = dict(expensive=True, est_s=5.0, cleanup=bs._autotune_off)
        return bs.Case(sets, [
            bs.Variant("torch_eager", lambda: torch_conv),
            bs.Variant("torch_addmm", lambda: torch_addmm),
            bs.Variant("cf_conv", bs._cf_setup(cf_conv, autotune=False)),
            bs.Variant("cf_gemm", bs._cf_setup(cf_gemm, autotune=False)),
            bs.Variant("cf_conv_autotuned_conv_only", conv_only, expensive=True, est_s=5.0, cleanup=restore_conv_only),
            bs.Variant("cf_conv_autotuned", bs._cf_setup(cf_conv, autotune=True), **tuned),
            bs.Variant("cf_gemm_autotuned", bs._cf_setup(cf_gemm, autotune=True), **tuned),
            bs.Variant("cf_conv_repeat", bs._cf_setup(cf_conv, autotune=False)),
        ], flush_l2=flush)
    return make


CONV_ONLY_RESTORE: list = []


def _chose_gemm(layer) -> bool | None:
    """Whether the tuned entry of this layer's conv (cf_conv_autotuned's) runs the GEMM."""
    from cudnn_fuse import conv_gemm, plans

    for p in reversed(plans.plans_in_memory()):
        spec = getattr(p, "spec", None)
        if getattr(spec, "op", None) == "conv2d" and spec.x.shape[1] == layer.c and spec.w.shape[0] == layer.k \
                and spec.x.shape[0] == layer.n and spec.x.shape[2] == layer.hw:
            return isinstance(p, conv_gemm.GemmConvPlan)
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--name", default="conv1x1_gemm_probe", help="the JSON's name under --out")
    args = ap.parse_args(argv)
    opts = bs.Options(max_autotune=False, budget_s=args.budget_s, deadline_s=args.budget_s + 30, target_ms=150.0)
    layers = [layer for b in (int(v) for v in args.batches.split(","))
              for layer, _ in bs.distinct_resnet50_convs(b) if layer.r == 1 and layer.stride == 1]
    started = time.perf_counter()
    rows = []
    import cudnn_fuse as cf

    for layer in layers:
        w = bs.Workload(layer.name, "conv", "probe", layer.flops, layer.bytes, build(layer))
        before = cf.plan_stats()["fallbacks"]
        rec = bs.run_workload(w, opts, started)
        row = {"name": layer.name, "ms": rec["peers"], "rel_err_vs_torch_eager": rec["rel_err"],
               "errors": rec["errors"], "skipped": rec["skipped"],
               "fallbacks": cf.plan_stats()["fallbacks"] - before, "chose_gemm": _chose_gemm(layer)}
        rows.append(row)
        print(layer.name, row["ms"], row["errors"] or "", f"fallbacks {row['fallbacks']}",
              f"chose_gemm {row['chose_gemm']}", flush=True)
    write_json(os.path.join(args.out, args.name + ".json"),
               {"device": device_name(), "torch": torch.__version__, "rows": rows,
                "wall_s": round(time.perf_counter() - started, 1)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
