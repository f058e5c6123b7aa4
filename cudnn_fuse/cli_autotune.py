"""``cudnn-fuse autotune``: tune one op at the given shapes and store the winner.

    cudnn-fuse autotune --op conv2d --input 64x128x56x56 --weight 128x128x3x3 \\
        --dtype fp16 --activation relu --bias --padding 1
"""

from __future__ import annotations

import argparse
import math
import sys

from .progress import Bar, format_table

DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def shape(text: str) -> tuple:
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is sizes joined by 'x' (e.g. 64x128x56x56), got {text!r}") from None
    if not dims or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    if math.prod(dims) >= 2**63:  # torch's sizes are int64
        raise argparse.ArgumentTypeError(f"{text!r} has 2**63 elements or more")
    return dims


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def add_command(commands) -> None:
    p = commands.add_parser("autotune", help="time every candidate engine of one op and store the winner",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", required=True, choices=["conv2d", "linear", "matmul", "sdpa"])
    p.add_argument("--input", type=shape, required=True, help="x (conv2d/linear), a (matmul) or q (sdpa)")
    p.add_argument("--weight", type=shape, help="conv weight KxCxRxS, linear weight OUTxIN, matmul b; sdpa: k and v")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    p.add_argument("--activation", default=None)
    p.add_argument("--bias", action="store_true", help="add a bias epilogue")
    p.add_argument("--residual", action="store_true", help="add a residual epilogue")
    p.add_argument("--amax", action="store_true", help="also compute amax = max|y|")
    p.add_argument("--stride", type=int, default=1)
    p.add_argument("--padding", type=int, default=0)
    p.add_argument("--dilation", type=int, default=1)
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--nchw", action="store_true", help="conv2d: NCHW tensors (default channels_last)")
    p.add_argument("--causal", action="store_true", help="sdpa: causal mask")
    p.add_argument("--budget-s", type=seconds, default=None,
                   help="tuning time budget (default $CUDNN_FUSE_TUNE_BUDGET_S or 10)")
    p.add_argument("--force", action="store_true", help="tune again even if the cache holds a tuned entry")
    p.set_defaults(run=run)


def _inputs(args, device="cuda"):
    """The op's call on random inputs of the given shapes: ``call(cf)``. On the "meta" device
    nothing is allocated or computed, and cf checks every argument as it would on the GPU."""
    import torch

    import cudnn_fuse

    dt = getattr(torch, DTYPES[args.dtype])

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, device=device) * scale).to(dt)

    if args.op == "sdpa":
        q = rnd(*args.input)
        kv = args.weight or args.input
        k, v = rnd(*kv), rnd(*kv)
        gqa = len(kv) == 4 and q.dim() == 4 and kv[1] != q.shape[1]  # fewer k/v heads than q heads
        return lambda cf: cf.scaled_dot_product_attention(q, k, v, is_causal=args.causal, enable_gqa=gqa)
    if args.weight is None:
        raise ValueError(f"--weight is required for --op {args.op}")
    r = None
    if args.residual:  # of the output's shape: cf's own call without it, on the meta device
        plain = argparse.Namespace(**{**vars(args), "residual": False, "amax": False})
        r = rnd(*_inputs(plain, "meta")(cudnn_fuse).shape)
    x, w = rnd(*args.input), rnd(*args.weight, scale=1 / math.sqrt(args.weight[-1]))
    if args.op == "conv2d":
        if not args.nchw:  # an unbatched (3-D) x has no channels_last
            x, w, r = (t if t is None or t.dim() != 4 else t.to(memory_format=torch.channels_last) for t in (x, w, r))
        b = rnd(args.weight[0]) if args.bias else None
        return lambda cf: cf.conv2d(x, w, b, args.stride, args.padding, args.dilation, args.groups,
                                    activation=args.activation, residual=r, return_amax=args.amax)
    n = args.weight[0] if args.op == "linear" else args.weight[-1]
    b = rnd(n) if args.bias else None
    op = "linear" if args.op == "linear" else "matmul"
    return lambda cf: getattr(cf, op)(x, w, b, activation=args.activation, residual=r, return_amax=args.amax)


def _inapplicable(args) -> list:
    """The options given that ``--op`` does not take: run, they would be dropped without a word
    and another graph than the one asked for tuned and stored."""
    given = []
    if args.op != "conv2d":
        given += [f"--{n}" for n, default in (("stride", 1), ("padding", 0), ("dilation", 1), ("groups", 1))
                  if getattr(args, n) != default] + (["--nchw"] if args.nchw else [])
    if args.op == "sdpa":
        given += [f"--{n}" for n in ("activation", "bias", "residual", "amax") if getattr(args, n)]
    elif args.causal:
        given.append("--causal")
    return given


def run(args) -> int:
    import torch

    import cudnn_fuse as cf
    from cudnn_fuse import autotune, loader
    from cudnn_fuse.cache import open_default_cache
    from cudnn_fuse.spec import flops

    inapplicable = _inapplicable(args)
    if inapplicable:
        print(f"cudnn-fuse autotune: {', '.join(inapplicable)} not taken by --op {args.op}", file=sys.stderr)
        return 2
    try:  # every argument checked first, on any machine: shapes, their fit, activation, geometry
        _inputs(args, "meta")(cf)
    except (ValueError, TypeError, RuntimeError) as exc:  # RuntimeError: torch's (a size past int64)
        print(f"cudnn-fuse autotune: {exc}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("cudnn-fuse autotune: needs a CUDA GPU (none found); nothing was tuned", file=sys.stderr)
        return 2
    try:
        call = _inputs(args)
        pc = open_default_cache()
        cf.set_autotune(False)
        call(cf)  # the heuristic plan tells us the spec (and runs the op once)
    except torch.OutOfMemoryError as exc:  # sizes that pass every check but fit no GPU
        print(f"cudnn-fuse autotune: the op does not fit in GPU memory ({exc})", file=sys.stderr)
        return 1
    except (ValueError, TypeError) as exc:
        print(f"cudnn-fuse autotune: {exc}", file=sys.stderr)
        return 2
    mem = loader.plans_in_memory()
    if not mem:
        print("cudnn-fuse autotune: cuDNN cannot run this op; it falls back to PyTorch (see logs)", file=sys.stderr)
        return 1
    spec = mem[-1].spec
    digest = loader.cache_digest(spec)
    entry = pc.get(digest) if pc is not None else None
    if entry is None or not loader.is_tuned(entry.meta) or args.force:
        if pc is not None:
            pc.delete(digest)
            pc.delete(loader.engine_record_key(digest))
        loader.clear()
        cfg = autotune.Config(progress=Bar(f"tuning {spec.op}"), per_family=False)  # this size itself
        if args.budget_s is not None:
            cfg.budget_s = args.budget_s
        autotune.DEFAULT_CONFIG = cfg
        cf.set_autotune(True)
        call(cf)
        entry = pc.get(digest) if pc is not None else None
    if entry is None:
        print("cudnn-fuse autotune: tuned, but the plan cache is unavailable; the result was not stored", file=sys.stderr)
        return 1
    print(candidate_report(entry.meta, flops(spec)))
    print(f"stored under {digest[:16]} in {pc.dir}")
    return 0


def candidate_report(meta: dict, f: float) -> str:
    """A tuned entry's candidates as a table (fastest first, the one chosen starred), the runoff
    against torch where one ran (autotune.settle_torch), and the winner; ``f``: the graph's FLOPs."""
    from cudnn_fuse import autotune

    rows = []
    for c in sorted(meta.get("candidates", []), key=lambda c: (c["median_ms"] is None, c["median_ms"] or 0)):
        ms = c["median_ms"]
        won = c["index"] == (autotune.TORCH_INDEX if meta.get("use_torch") else
                             autotune.GEMM_INDEX if meta.get("use_gemm") else meta.get("winner_index"))
        rows.append(["*" if won else "", c["index"], c["name"],
                     ",".join(f"{k}={v}" for k, v in sorted(c["knobs"].items())) or "-",
                     f"{ms:.4f}" if ms is not None else "-", f"{f / ms / 1e9:.1f}" if ms else "-",
                     c["workspace"], c["status"].split(":")[0]])
    out = [format_table(["", "#", "engine", "knobs", "median ms", "TFLOP/s", "workspace", "status"], rows)]
    runoff = {c["index"]: c["runoff_ms"] for c in meta.get("candidates", []) if c.get("runoff_ms") is not None}
    if autotune.TORCH_INDEX in runoff and len(runoff) == 2:  # the winner and torch, timed again alternately
        w = next(ms for i, ms in runoff.items() if i != autotune.TORCH_INDEX)
        out.append(f"\nrunoff (a close call, the two timed again alternately): cuDNN winner {w:.4f} ms, "
                   f"torch {runoff[autotune.TORCH_INDEX]:.4f} ms")
    if meta.get("use_torch"):
        winner = "torch (cuBLAS + epilogue), faster than every cuDNN candidate"
    elif meta.get("use_gemm"):
        winner = "the GEMM of the 1x1 conv's matrix views (its own matmul entry), faster than every conv candidate"
    else:
        winner = meta.get("engine_name")
    out.append(f"\nwinner {winner}")
    return "\n".join(out)
