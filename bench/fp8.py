"""FP8 GEMMs and attention. cf.scaled_mm with a bias and GELU (tanh) against the chain a user writes with torch
(torch._scaled_mm with its bias, then GELU, amax and the cast to FP8) and against cf's bfloat16 linear,
from operands already in FP8, for a bfloat16 output and an E4M3 output with its amax. Per shape: device
times (ms), errors against a float64 reference (max |error| over max |reference|, in the output's own
format), the kernels each launches (torch.profiler), and which engine cf ran; which forms cuBLASLt plans
and whether they are right. cf's FP8 attention against its bfloat16 attention (``attention_rows``).
Writes fp8.json and fp8.png.

    python3 bench/fp8.py --out bench/results [--shapes 1024x4096x4096,4096x4096x4096]
    python3 bench/fp8.py --plot bench/results/fp8.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.common import checkout_commit, device_ms, device_name, time_ms, write_json  # noqa: E402

SHAPES = ((1024, 4096, 4096), (4096, 4096, 4096), (8192, 4096, 4096), (8192, 8192, 8192), (16384, 8192, 8192))
E4 = torch.float8_e4m3fn
ACT = "gelu_tanh"  # cuBLASLt's GELU; torch's chain runs the same approximation


def _operands(M, K, N, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(M, K, device="cuda", generator=g).to(E4)
    w = torch.randn(N, K, device="cuda", generator=g).to(E4)  # a weight [N, K]: b = w.t() is K-major
    bias = torch.randn(N, device="cuda", generator=g, dtype=torch.bfloat16)
    sa = torch.tensor(1.0 / math.sqrt(K), device="cuda")
    sb = torch.tensor(0.5, device="cuda")
    return a, w.t(), bias, sa, sb


def _torch_chain(a, b, bias, sa, sb, out, scale):
    """What a user writes: torch._scaled_mm with its bias, GELU, amax and (for FP8) the saturating cast."""
    import torch.nn.functional as F

    y = F.gelu(torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, bias=bias, out_dtype=torch.bfloat16), approximate="tanh")
    am = y.abs().amax().float()
    if out == E4:
        big = torch.finfo(E4).max
        y = (y.float() * scale).clamp(-big, big).to(E4)
    return y, am


def _kernels(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower())


def _err(y, want, out) -> float:
    """max |y - want| / max |want|, want rounded to ``out`` first (the format's own rounding is no error)."""
    want_r = want.clamp(-torch.finfo(out).max, torch.finfo(out).max).to(out).double() if out == E4 else want
    return float((y.double() - want_r).abs().max() / want.abs().max().clamp_min(1e-30))


def scaled_mm_rows(shapes) -> list:
    import cudnn_fuse as cf
    from cudnn_fuse import fp8_gemm

    rows = []
    for M, K, N in shapes:
        a, b, bias, sa, sb = _operands(M, K, N)
        ref = (a.double() * sa.double()) @ (b.double() * sb.double()) + bias.double()
        ref = torch.nn.functional.gelu(ref, approximate="tanh")
        x16, w16 = (a.to(torch.bfloat16) * sa.to(torch.bfloat16)), (b.t().to(torch.bfloat16) * sb.to(torch.bfloat16))
        for out in (torch.bfloat16, E4):
            scale = torch.tensor(448.0, device="cuda") / ref.abs().max().float() if out == E4 else None
            cf_fn = lambda: cf.scaled_mm(a, b, sa, sb, bias=bias, activation=ACT, out_dtype=out,  # noqa: E731
                                         scale_result=scale, return_amax=True)
            torch_fn = lambda: _torch_chain(a, b, bias, sa, sb, out, scale)  # noqa: E731
            only_fn = lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, bias=bias,  # noqa: E731
                                               out_dtype=torch.bfloat16)
            bf16_fn = lambda: cf.linear(x16, w16, bias, activation=ACT, return_amax=True)  # noqa: E731
            before = dict(fp8_gemm.refused())
            y, am = cf_fn()
            refused = {str(k): v for k, v in fp8_gemm.refused().items() if k not in before}
            ty, tam = torch_fn()
            want = ref * scale.double() if out == E4 else ref
            row = {"M": M, "K": K, "N": N, "out_dtype": str(out).replace("torch.", ""),
                   "engine": fp8_gemm.engine_of(a, b, sa, sb, out), "cublaslt_refused": refused,
                   "cf_ms": device_ms(cf_fn), "torch_ms": device_ms(torch_fn),
                   "torch_scaled_mm_only_ms": device_ms(only_fn), "cf_bf16_ms": device_ms(bf16_fn),
                   "cf_err": _err(y, want, out), "torch_err": _err(ty, want, out),
                   "cf_amax_rel_err": float(abs(am.double() - ref.abs().max()) / ref.abs().max()),
                   "torch_amax_rel_err": float(abs(tam.double() - ref.abs().max()) / ref.abs().max()),
                   "cf_kernels": _kernels(cf_fn), "torch_kernels": _kernels(torch_fn)}
            flops = 2.0 * M * K * N
            row["cf_tflops"] = flops / row["cf_ms"] / 1e9
            row["speedup_vs_torch"] = row["torch_ms"] / row["cf_ms"]
            row["speedup_vs_bf16"] = row["cf_bf16_ms"] / row["cf_ms"]
            rows.append(row)
            print(f"{M}x{K}x{N} {row['out_dtype']:>13}: cf {row['cf_ms']:.3f} ms ({row['engine']}, "
                  f"{row['cf_kernels']} kernels), torch chain {row['torch_ms']:.3f} ({row['torch_kernels']}), "
                  f"_scaled_mm only {row['torch_scaled_mm_only_ms']:.3f}, cf bf16 {row['cf_bf16_ms']:.3f}; "
                  f"err cf {row['cf_err']:.2e} torch {row['torch_err']:.2e}", flush=True)
        del a, b, ref, x16, w16
        torch.cuda.empty_cache()
    return rows


ATTN_SEQS = (2048, 4096, 8192)
ATTN_B, ATTN_H, ATTN_D = 4, 16, 128


def attention_rows(seqs) -> list:
    """cf's FP8 attention against cf's bfloat16 attention (B=4, H=16, D=128): from FP8 q, k, v
    (``fp8_only_ms``) and from bfloat16 q, k, v with their three casts (``cf.quantize_fp8``) counted (``fp8_ms``); errors of
    the dequantized output against a float32 attention of the bfloat16 operands."""
    import cudnn_fuse as cf
    from cudnn_fuse import fp8_attention

    rows = []
    for S in seqs:
        for causal in (False, True):
            g = torch.Generator(device="cuda").manual_seed(S)
            q, k, v = (torch.randn(ATTN_B, ATTN_H, S, ATTN_D, device="cuda", generator=g, dtype=torch.bfloat16)
                       for _ in range(3))
            (q8, dq), (k8, dk), (v8, dv) = (cf.quantize_fp8(t) for t in (q, k, v))
            scale_o = torch.tensor(1.0, device="cuda")
            bf16_fn = lambda: cf.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
            only_fn = lambda: cf.scaled_dot_product_attention_fp8(q8, k8, v8, dq, dk, dv, is_causal=causal,  # noqa: E731
                                                                 scale_o=scale_o)

            def full_fn():
                (a8, da), (b8, db), (c8, dc) = (cf.quantize_fp8(t) for t in (q, k, v))
                return cf.scaled_dot_product_attention_fp8(a8, b8, c8, da, db, dc, is_causal=causal, scale_o=scale_o)

            o8, _ = only_fn()
            ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
            top = ref.abs().max()
            row = {"seq": S, "causal": causal, "batch": ATTN_B, "heads": ATTN_H, "head_dim": ATTN_D,
                   "declined": bool(fp8_attention.refused()),
                   "bf16_ms": device_ms(bf16_fn), "fp8_ms": device_ms(full_fn), "fp8_only_ms": device_ms(only_fn),
                   "fp8_err": float((o8.float() - ref).abs().max() / top),
                   "bf16_err": float((bf16_fn().float() - ref).abs().max() / top)}
            row["speedup"] = row["bf16_ms"] / row["fp8_ms"]
            row["speedup_fp8_only"] = row["bf16_ms"] / row["fp8_only_ms"]
            rows.append(row)
            print(f"attention S={S} causal={causal}: bf16 {row['bf16_ms']:.3f} ms, fp8 {row['fp8_ms']:.3f} "
                  f"(casts counted), fp8 only {row['fp8_only_ms']:.3f}; err fp8 {row['fp8_err']:.2e} "
                  f"bf16 {row['bf16_err']:.2e}", flush=True)
            del q, k, v, q8, k8, v8, ref
            torch.cuda.empty_cache()
    return rows


def cublaslt_support(n: int = 256) -> list:
    """Which FP8 GEMM forms cuBLASLt plans here, and whether each gives the reference's result: per D
    format, epilogue, kernel amax, residual (C) and bias format, planned or refused (and why), and the
    largest error over the largest magnitude."""
    from cudnn_fuse import fp8_gemm, reference

    a, b, bias, sa, sb = _operands(n, n, n, seed=1)
    res = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.current_stream()
    rows = []
    for d in (torch.bfloat16, torch.float16, torch.float32, E4, torch.float8_e5m2):
        fp8_d = d in reference.FP8_DTYPES
        for epilog, act in (("BIAS", None), ("RELU_BIAS", "relu"), ("GELU_BIAS", "gelu_tanh")):
            for kernel_amax in ((False, True) if fp8_d else (False,)):
                for with_res in (False, True):
                    for bias_dtype in ((torch.bfloat16, torch.float16) if fp8_d else (None,)):
                        bd = bias_dtype or (d if d != torch.float32 else torch.float32)
                        c_dtype = torch.bfloat16 if fp8_d else d
                        c = res.to(c_dtype) if with_res else None
                        scale_d = torch.ones(1, device="cuda") if fp8_d else None
                        # the layout of fp8_gemm._forms' keys, the bias format last (the op's follows D's)
                        key = (a.device.index, n, n, n, a.dtype, b.dtype, d, act, with_res, kernel_amax,
                               a.stride(0), b.stride(1), n if with_res else None, bd)
                        row = {"d": str(d).replace("torch.", ""), "epilog": epilog, "amax": kernel_amax,
                               "residual": with_res, "bias": str(bd).replace("torch.", "")}
                        p = fp8_gemm._plan(key, a, b, sa.reshape(1), sb.reshape(1), bias.to(bd), c, scale_d, epilog,
                                           d, kernel_amax, stream)
                        if p is None:
                            row["planned"], row["why"] = False, fp8_gemm.refused().get(key, "")[:160]
                        else:
                            y, am = p.run(a, b, sa.reshape(1), sb.reshape(1), bias.to(bd), c, scale_d, stream)
                            want = reference.scaled_mm(a, b, sa, sb, bias.to(bd), act, c, torch.float32)
                            top = want.abs().max()
                            want_d = want.clamp(-torch.finfo(d).max, torch.finfo(d).max).to(d).float()
                            row["planned"] = True
                            row["err"] = float((y.float() - want_d).abs().max() / top)
                            if kernel_amax:
                                row["amax_err"] = float(abs(am.float() - top) / top)
                        rows.append(row)
    torch.cuda.synchronize()
    return rows


# training: name -> (tokens as batch x seq, hidden, ffn, heads; 0 heads: the MLP alone)
TRAINING = {"mlp": (1, 8192, 4096, 16384, 0), "gpt2_medium_block": (8, 1024, 1024, 4096, 16)}
TRAIN_STEPS = 300  # the loss curves' length
TRAIN_LR = 3e-4


class _Block(torch.nn.Module):
    """A pre-norm transformer block (causal attention, GELU-tanh MLP) or, with ``heads`` 0, the MLP alone;
    ``linear(i, o)`` and ``mlp(fc1, fc2)`` make its layers, so each variant runs its own."""

    def __init__(self, hidden, ffn, heads, linear, mlp):
        super().__init__()
        self.heads = heads
        if heads:
            self.ln1, self.qkv, self.proj = torch.nn.LayerNorm(hidden), linear(hidden, 3 * hidden), linear(hidden, hidden)
            self.ln2 = torch.nn.LayerNorm(hidden)
        self.mlp = mlp(hidden, ffn)

    def forward(self, x):
        if not self.heads:
            return self.mlp(x)
        B, S, H = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, S, 3, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, S, H))
        return x + self.mlp(self.ln2(x))


def _torch_mlp(hidden, ffn):
    return torch.nn.Sequential(torch.nn.Linear(hidden, ffn), torch.nn.GELU(approximate="tanh"),
                               torch.nn.Linear(ffn, hidden))


def _variant(name, hidden, ffn, heads, reference):
    """The block of variant ``name`` with ``reference``'s weights, in bfloat16 on the GPU."""
    import cudnn_fuse as cf

    if name in ("torch_compile", "torchao"):
        m = _Block(hidden, ffn, heads, torch.nn.Linear, _torch_mlp)
    else:
        recipe = {"cf_bf16": None, "cf_fp8_current": cf.Float8CurrentScaling(),
                  "cf_fp8_delayed": cf.DelayedScaling(amax_history_len=16)}[name]
        m = _Block(hidden, ffn, heads, lambda i, o: cf.nn.Linear(i, o, fp8=recipe),
                   lambda h, f: cf.nn.FusedMLP(cf.nn.Linear(h, f, activation="gelu_tanh"), torch.nn.Linear(f, h),
                                               fp8=recipe))
    m = m.to("cuda", torch.bfloat16)
    ref = reference.state_dict()
    if name not in ("torch_compile", "torchao"):  # FusedMLP names its layers fc1 and fc2, the Sequential 0 and 2
        ref = {k.replace("mlp.0.", "mlp.fc1.").replace("mlp.2.", "mlp.fc2."): v for k, v in ref.items()}
    m.load_state_dict(ref)
    if name == "torchao":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(m)
    if name in ("torch_compile", "torchao"):
        m = torch.compile(m)
    return m


TRAIN_VARIANTS = ("cf_bf16", "cf_fp8_current", "cf_fp8_delayed", "torchao", "torch_compile")


def _profile(step, n: int = 5) -> dict:
    """``n`` steps under torch.profiler: device time a step (its kernels' sum), host time a step (the steps'
    wall time with the GPU kept waiting on nothing but them), kernels a step and the heaviest host ops."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    cpu = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                 key=lambda e: e.self_cpu_time_total, reverse=True)
    return {"device_us": round(sum(e.self_device_time_total for e in kernels) / n, 1),
            "host_us": round(host * 1e6 / n, 1), "kernels": round(sum(e.count for e in kernels) / n, 1),
            "host_ops": [{"op": e.key[:80], "us": round(e.self_cpu_time_total / n, 1), "calls": e.count // n}
                         for e in cpu[:12]]}


def training_rows(names, steps: int = TRAIN_STEPS, profiled: bool = False) -> tuple:
    """(rows, loss curves): per block and variant the median step (forward, backward, fused AdamW) and
    ``steps`` steps' losses toward a fixed teacher, every variant from the same weights and batches."""
    rows, curves = [], {}
    for name in names:
        batch, seq, hidden, ffn, heads = TRAINING[name]
        torch.manual_seed(0)
        reference = _Block(hidden, ffn, heads, torch.nn.Linear, _torch_mlp).to("cuda", torch.bfloat16)
        teacher = _Block(hidden, ffn, heads, torch.nn.Linear, _torch_mlp).to("cuda", torch.bfloat16)
        shape = (batch, seq, hidden) if heads else (batch * seq, hidden)
        with torch.no_grad():
            data = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
            targets = [teacher(x) for x in data]
        times, curves[name], profiles = {}, {}, {}
        for v in TRAIN_VARIANTS:
            try:
                m = _variant(v, hidden, ffn, heads, reference)
            except ImportError as e:
                print(f"training {name} {v}: skipped ({e})", flush=True)
                continue
            opt = torch.optim.AdamW(m.parameters(), lr=TRAIN_LR, fused=True)
            it = [0]

            def step():
                i = it[0] % len(data)
                it[0] += 1
                loss = (m(data[i]).float() - targets[i].float()).square().mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                return loss

            losses = [step().item() for _ in range(steps)]
            times[v] = time_ms(step, warmup=5, iters=30)
            if profiled:
                profiles[v] = _profile(step)
                print(f"  profile {v}: device {profiles[v]['device_us']:.0f} us, host {profiles[v]['host_us']:.0f} us, "
                      f"{profiles[v]['kernels']:.0f} kernels a step", flush=True)
            curves[name][v] = losses
            print(f"training {name} {v}: {times[v]:.3f} ms/step, loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
            del m, opt
            torch.cuda.empty_cache()
        for recipe in ("current", "delayed"):
            fp8_ms = times.get(f"cf_fp8_{recipe}")
            row = {"name": name, "recipe": recipe, "tokens": batch * seq, "hidden": hidden, "ffn": ffn, "heads": heads,
                   "bf16_ms": times.get("cf_bf16"), "fp8_ms": fp8_ms, "torchao_ms": times.get("torchao"),
                   "torch_compile_bf16_ms": times.get("torch_compile")}
            if profiles:
                row["profile"] = {v: profiles[v] for v in ("cf_bf16", f"cf_fp8_{recipe}", "torchao") if v in profiles}
            from cudnn_fuse import fp8 as cf_fp8

            # the layer shapes measured slower in FP8 than in bfloat16, which ran in bfloat16 (fp8.pays)
            row["bf16_layers"] = [f"{k[0]}x{k[1]}->{k[2]}{' training' if k[6] else ''}" for k, ok in cf_fp8._paid.items()
                                  if not ok and k[7] == (recipe == "delayed")]
            if fp8_ms:
                row["speedup_vs_bf16"] = row["bf16_ms"] / fp8_ms if row["bf16_ms"] else None
                row["speedup_vs_torchao"] = row["torchao_ms"] / fp8_ms if row["torchao_ms"] else None
            rows.append(row)
    return rows, curves


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc.get("scaled_mm", [])
    attn = doc.get("attention") if isinstance(doc.get("attention"), list) else []
    training = doc.get("training") if isinstance(doc.get("training"), list) else []
    curves = doc.get("loss_curves") or {}
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    (ax, ax2), (ax3, ax4) = axes
    labels = [f"{r['M']}x{r['K']}x{r['N']}\n{r['out_dtype']}" for r in rows]
    xs = range(len(rows))
    for i, (key, name) in enumerate((("speedup_vs_torch", "torch chain / cf"), ("speedup_vs_bf16", "cf bf16 / cf"))):
        ax.bar([x + 0.4 * i for x in xs], [r[key] for r in rows], width=0.4, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([x + 0.2 for x in xs], labels, fontsize=7)
    ax.set_ylabel("speedup of cf.scaled_mm")
    ax.set_title(f"FP8 GEMM + bias + GELU ({doc.get('device', '?')}, {doc.get('commit', '?')})")
    ax.legend()
    for i, (key, name) in enumerate((("speedup", "bf16 / fp8 (casts counted)"), ("speedup_fp8_only", "bf16 / fp8"))):
        ax2.bar([x + 0.4 * i for x in range(len(attn))], [r[key] for r in attn], width=0.4, label=name)
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_xticks([x + 0.2 for x in range(len(attn))], [f"S={r['seq']}\n{'causal' if r['causal'] else 'full'}"
                                                         for r in attn], fontsize=7)
    ax2.set_title("FP8 attention against cf's bfloat16 attention")
    ax2.legend()
    for i, (key, name) in enumerate((("speedup_vs_bf16", "cf bf16 / cf fp8"), ("speedup_vs_torchao", "torchao / cf fp8"))):
        ax3.bar([x + 0.4 * i for x in range(len(training))], [r.get(key) or 0 for r in training], width=0.4, label=name)
    ax3.axhline(1.0, color="k", lw=0.8)
    ax3.set_xticks([x + 0.2 for x in range(len(training))], [f"{r['name']}\n{r['recipe']}" for r in training],
                   fontsize=7)
    ax3.set_title("training step speedup of cf's FP8")
    ax3.legend()
    for block, style in zip(curves, ("-", "--", ":")):
        for variant, losses in curves[block].items():
            ax4.plot(losses, style, lw=0.8, label=f"{block} {variant}")
    ax4.set_yscale("log")
    ax4.set_xlabel("step")
    ax4.set_title("training loss")
    ax4.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results", help="directory of fp8.json")
    p.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES), help="MxKxN, comma-separated")
    p.add_argument("--seqs", default=",".join(map(str, ATTN_SEQS)), help="attention sequence lengths ('' for none)")
    p.add_argument("--training", default=",".join(TRAINING), help=f"training blocks among {', '.join(TRAINING)} "
                   "('' for none)")
    p.add_argument("--steps", type=int, default=TRAIN_STEPS, help="training steps of the loss curves")
    p.add_argument("--profile", action="store_true", help="also profile each training variant's step (device and "
                                                           "host time, the heaviest host ops)")
    p.add_argument("--commit", default=None, help="the commit to record (default: git's HEAD)")
    p.add_argument("--plot", metavar="JSON", help="only plot an existing fp8.json")
    args = p.parse_args(argv)
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
        seqs = [int(x) for x in args.seqs.split(",") if x]
    except ValueError as exc:
        p.error(f"--shapes (MxKxN, comma-separated) and --seqs (integers) take numbers: {exc}")
    if any(len(s) != 3 or min(s) < 1 for s in shapes):
        p.error(f"--shapes: each shape is MxKxN of positive integers, got {args.shapes}")
    bad = [n for n in args.training.split(",") if n and n not in TRAINING]
    if bad:
        p.error(f"--training: unknown {', '.join(bad)} (known: {', '.join(TRAINING)})")
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f), os.path.splitext(args.plot)[0] + ".png")
        return 0
    if not torch.cuda.is_available():
        print("fp8.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import cudnn

    path = os.path.join(args.out, "fp8.json")
    # the sections this run does not measure stay as an earlier run wrote them; "runs" says which run
    # (commit, GPU) each section comes from
    doc = json.load(open(path)) if os.path.exists(path) else {}
    run_id = {"commit": args.commit or checkout_commit(), "device": device_name()}
    doc.update(run_id, torch=torch.__version__, cudnn=cudnn.backend_version())
    try:
        import nvmath

        doc["nvmath"] = nvmath.__version__
    except Exception as e:  # noqa: BLE001 - recorded, the torch engine ran
        doc["nvmath"] = f"unavailable: {e}"
    os.makedirs(args.out, exist_ok=True)
    sections = [("cublaslt_support", lambda: cublaslt_support())]
    sections += [("scaled_mm", lambda: scaled_mm_rows(shapes))] if shapes else []
    sections += [("attention", lambda: attention_rows(seqs))] if seqs else []
    sections += [("training", lambda n=n: training_rows([n], args.steps, args.profile)) for n in args.training.split(",") if n]
    for key, run in sections:  # written after each: a run cut short keeps what it measured
        got = run()
        if key == "training":  # one block at a time, its rows replacing an earlier run's
            names = {r["name"] for r in got[0]}
            doc["training"] = [r for r in doc.get("training", []) if r["name"] not in names] + got[0]
            doc.setdefault("loss_curves", {}).update(got[1])
            for name in names:
                doc.setdefault("runs", {})[f"training:{name}"] = run_id
        else:
            doc[key] = got
            doc.setdefault("runs", {})[key] = run_id
        if key == "cublaslt_support":
            for r in got:
                print("cuBLASLt", {k: v for k, v in r.items() if k != "why"}, r.get("why", ""), flush=True)
        write_json(path, doc)
    try:
        plot(doc, os.path.join(args.out, "fp8.png"))
    except ImportError:
        print("fp8.png not drawn: needs matplotlib", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
