"""The ``cudnn-fuse`` command line. The only module of the package that prints."""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from . import env
from ._version import __version__
from .progress import Bar, format_table

NO_GPU_DOCTOR = "no CUDA GPU: ops run their PyTorch reference"
NO_GPU_DEMO = ("no CUDA GPU: the ops ran their PyTorch reference; "
               "fused cuDNN graphs need an NVIDIA GPU")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit status instead of exiting."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits for --version, --help and usage errors
        return exc.code if isinstance(exc.code, int) else 1
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except KeyboardInterrupt:  # Ctrl-C: each command leaves no partial file behind; no traceback
        import sys

        print("\ncudnn-fuse: interrupted", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cudnn-fuse", description="cuDNN graph API as fused PyTorch ops.")
    parser.add_argument("--version", action="version", version=f"cudnn-fuse {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    doctor = commands.add_parser(
        "doctor", help="show versions, GPU and cache dir; exit 1 if something is broken",
        description="Print the versions of Python, torch, CUDA, the driver and cuDNN (frontend and "
                    "backend), the GPU and its environment namespace, the path the ops' memoized calls "
                    "take, and the plan cache (directory, mode, entries, hit rate); then the problems "
                    "found. Exit status 1 when something is broken: an unsupported cuDNN frontend, a GPU "
                    "whose cuDNN library cannot be loaded, a plan cache that cannot be used, one whose "
                    "database was corrupt, or a damaged fingerprint.json. No GPU is no problem: the ops "
                    "then run their PyTorch reference.")
    doctor.set_defaults(run=_doctor)
    demo = commands.add_parser(
        "demo", help="run each public op against its plain torch expression",
        description="Time each public op (conv2d, linear, matmul, scaled_dot_product_attention) against "
                    "its plain torch expression and print the relative error; then run a small "
                    "ResNet-style CNN and a transformer block through cf.optimize(): the op specs each "
                    "records in the dtype a GPU runs, the cold start (empty plan cache) against the warm "
                    "start (a cache pre-warmed from those specs), and the error against eager. Without a "
                    "CUDA GPU the ops run their PyTorch reference in fp32, nothing is built, and the demo "
                    "says so.")
    demo.set_defaults(run=_demo)
    from . import cache_cli, cli_autotune, prewarm

    cli_autotune.add_command(commands)
    cache_cli.add_cache_commands(commands)
    pw = commands.add_parser("prewarm", help="build every entry of a plan manifest into the cache",
                             description=prewarm.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    prewarm.add_arguments(pw)
    pw.set_defaults(run=prewarm.run)
    rec = commands.add_parser(
        "record", help="run a Python script and write the op specs it used as a manifest",
        description="Run a Python script in this process with cf.record active and write every op spec "
                    "it made (deduplicated, with call counts) as a plan manifest, the input of "
                    "`cudnn-fuse prewarm`. The manifest is written also when the script fails; the exit "
                    "status is the script's (1 when the manifest cannot be written).")
    rec.add_argument("-o", "--output", required=True, help="the manifest to write")
    rec.add_argument("--name", default="", help="a name stored in the manifest")
    rec.add_argument("command", nargs=argparse.REMAINDER, help="-- python SCRIPT [ARGS...] (or -- SCRIPT [ARGS...])")
    rec.set_defaults(run=_record)
    from . import benchsuite

    bench = commands.add_parser("bench", help="time cf against torch eager, torch.compile and SDPA backends (CUDA GPU)",
                                description=benchsuite.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benchsuite.add_arguments(bench)
    bench.set_defaults(run=_bench)
    return parser


def _bench(args: argparse.Namespace) -> int:
    """The benchmark suite; without a CUDA GPU it says so and exits 2 (--list and --merge still work)."""
    import sys

    from . import benchsuite

    return benchsuite.main(args, emit=lambda s: print(s, flush=True), err=lambda s: print(s, file=sys.stderr))


def _record(args: argparse.Namespace) -> int:
    """Run a script in this process with cf.record active (every op spec it makes is kept)."""
    import runpy
    import sys

    from . import manifest

    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if cmd and os.path.basename(cmd[0]).startswith("python"):
        cmd = cmd[1:]
    if not cmd or not cmd[0].endswith(".py"):
        print("cudnn-fuse record: give the script to run: cudnn-fuse record -o out.json -- python SCRIPT.py [ARGS]",
              file=sys.stderr)
        return 2
    # Checked before the script runs (it may train for hours), not when its manifest is written.
    problem = (f"no such script: {cmd[0]}" if not os.path.isfile(cmd[0]) else
               f"cannot write the manifest to {args.output}: it is a directory" if os.path.isdir(args.output) else
               f"cannot write the manifest to {args.output}: no directory {os.path.dirname(args.output)}"
               if not os.path.isdir(os.path.dirname(os.path.abspath(args.output))) else None)
    if problem is not None:
        print(f"cudnn-fuse record: {problem}", file=sys.stderr)
        return 2
    saved, status, name = sys.argv, 0, args.name or os.path.basename(cmd[0])
    sys.argv = cmd
    try:
        with manifest.record(name=name) as rec:
            runpy.run_path(cmd[0], run_name="__main__")
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:  # also when the script raised: the specs it made so far are written
        sys.argv = saved
        entries = manifest.collapse(rec.entries)
        try:
            manifest.dump(entries, args.output, name=name)
            written = True
        except OSError as exc:
            print(f"cudnn-fuse record: cannot write the manifest to {args.output}: {exc}", file=sys.stderr)
            written = False
    if not written:
        return 1
    print(f"recorded {len(entries)} distinct op specs ({sum(e.count for e in entries)} calls) into {args.output}")
    return status


class _Warnings(logging.Handler):
    """The messages of the warnings logged while it is attached."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _cache_rows() -> tuple[list, list]:
    """(rows, problems) about the plan cache: where, mode, permissions, entries, size. A fault the
    cache met and survived while opening (a corrupt cache.db moved aside, entries lost) is a problem."""
    from .cache import PlanCache

    seen, logger = _Warnings(), logging.getLogger("cudnn_fuse.cache")
    logger.addHandler(seen)
    try:
        pc = PlanCache()
        st = pc.stats()
    finally:
        logger.removeHandler(seen)
    rows = [("cache dir", str(pc.dir))]
    if pc.disabled:
        return rows, [f"plan cache unusable ({pc.disabled}): ops run without it"]
    try:
        mode = oct(os.stat(pc.dir).st_mode & 0o777)
    except OSError:
        mode = "?"
    rows += [("cache mode", ("read-only" if pc.read_only else "read-write") + f", permissions {mode}"),
             ("cache entries", f"{st.get('entries')} ({st.get('pinned', 0)} pinned), {st.get('bytes', 0)} bytes"),
             ("cache hit rate", "n/a" if st.get("hit_rate") is None else f"{100 * st['hit_rate']:.1f}%")]
    pc.close()
    problems = list(seen.messages)
    if st.get("error"):
        problems.append(f"plan cache database {pc.dir / 'cache.db'} cannot be read: {st['error']}")
    if pc.fingerprint_problem:  # an export of this namespace would carry no fingerprint, or a wrong one
        problems.append(f"plan cache {pc.fingerprint_problem}: `cudnn-fuse cache verify` repairs it")
    return rows, problems


def _native_row() -> str:
    """Which path the ops' memoized calls take in this process (ops.set_native)."""
    from . import launch_graphs, ops

    if ops.native_enabled():
        return "C (cudnn_fuse._native)"
    if launch_graphs._native is None:
        return "Python (cudnn_fuse._native is not built: reinstall with a C compiler for the C path)"
    return "Python (CUDNN_FUSE_NATIVE=0 or set_native(False))"


def _doctor(args: argparse.Namespace) -> int:
    fp = env.fingerprint()
    found = env.problems(fp)
    cache_rows, cache_problems = _cache_rows()
    found += cache_problems
    print(f"cudnn-fuse {__version__} doctor\n")
    # env's "cache dir" is the root; the cache's own row names this machine's directory under it
    env_rows = [row for row in env.describe(fp) if row[0] != "cache dir"]
    print(format_table(("item", "value"), env_rows + [("memoized calls", _native_row())] + cache_rows))
    print("\nproblems:")
    for problem in found or ["none"]:
        print(f"  {problem}")
    if fp["gpu_name"] is None:
        print(f"\n{NO_GPU_DOCTOR}")
    return 1 if found else 0


def _demo(args: argparse.Namespace) -> int:
    import cudnn_fuse as cf

    from . import demo

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    rows, steps = [], len(_DEMO_CASES) + len(demo.GPU_FORMS)
    bar = Bar("demo")
    with torch.no_grad():
        for i, (name, shape, gpu_dtype, make) in enumerate(_DEMO_CASES):
            bar(i, steps)
            dtype = gpu_dtype if on_gpu else torch.float32
            torch.manual_seed(0)
            fused, plain = make(cf, device, dtype)
            rows.append((name, shape, f"{device.type} {_DTYPE_NAMES[dtype]}",
                         f"{_median_ms(fused, on_gpu):.3f}", f"{_median_ms(plain, on_gpu):.3f}",
                         f"{_rel_err(fused(), plain()):.2e}"))
    model_rows, notes = demo.run(on_gpu, progress=lambda done, total: bar(len(_DEMO_CASES) + done, steps))
    print(format_table(("op", "shape", "device", "cf ms", "torch ms", "rel err"), rows))
    print("\nmodels through cf.optimize(): record -> pre-warm -> warm start\n")
    print(format_table(demo.HEADERS, model_rows))
    for note in notes:
        print(note)
    stats = cf.plan_stats()
    print("\nplan stats: " + ", ".join(f"{k}={stats[k]}" for k in ("builds", "hits", "fallbacks")))
    if not on_gpu:
        print(NO_GPU_DEMO)
    return 0


# Each demo case: make(cf, device, dtype) -> (fused call, plain torch call) on fresh inputs.
# Weights are scaled by 1/sqrt(fan_in) so outputs stay O(1), far from fp16 overflow.

def _randn(device, dtype, *shapes):
    return [torch.randn(s, device=device, dtype=dtype) for s in shapes]


def _demo_conv2d(cf, device, dtype):
    x, w, b = _randn(device, dtype, (8, 64, 32, 32), (64, 64, 3, 3), (64,))
    w = w / (64 * 9) ** 0.5
    if device.type == "cuda":  # cuDNN's fast conv layout; torch gets the same tensors
        x, w = (t.contiguous(memory_format=torch.channels_last) for t in (x, w))
    return (lambda: cf.conv2d(x, w, b, padding=1, activation="relu"),
            lambda: F.relu(F.conv2d(x, w, b, padding=1)))


def _demo_linear(cf, device, dtype):
    x, w, b = _randn(device, dtype, (256, 1024), (4096, 1024), (4096,))
    w = w / 1024 ** 0.5
    return (lambda: cf.linear(x, w, b, activation="gelu"),
            lambda: F.gelu(F.linear(x, w, b)))


def _demo_matmul(cf, device, dtype):
    a, b = _randn(device, dtype, (8, 256, 512), (512, 256))
    b = b / 512 ** 0.5

    def plain():
        y = torch.relu(torch.matmul(a, b))
        return y, y.abs().amax().float()

    return lambda: cf.matmul(a, b, activation="relu", return_amax=True), plain


def _demo_sdpa(cf, device, dtype):
    q, k, v = _randn(device, dtype, *[(2, 8, 256, 64)] * 3)
    return (lambda: cf.scaled_dot_product_attention(q, k, v, is_causal=True),
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))


_DEMO_CASES = (  # (op, shape text, dtype on the GPU, make); the CPU runs fp32
    ("conv2d", "x 8x64x32x32, w 64x64x3x3", torch.float16, _demo_conv2d),
    ("linear", "x 256x1024, w 4096x1024", torch.bfloat16, _demo_linear),
    ("matmul", "8x256x512 @ 512x256", torch.bfloat16, _demo_matmul),
    ("scaled_dot_product_attention", "q,k,v 2x8x256x64", torch.bfloat16, _demo_sdpa),
)
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _rel_err(got, want) -> float:
    """Max |got - want| over max |want|, in fp32; the worst over paired outputs (y, amax)."""
    if not isinstance(want, tuple):
        got, want = (got,), (want,)
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        g, w = g.float(), w.float()
        scale = w.abs().max().clamp_min(torch.finfo(torch.float32).tiny)
        worst = max(worst, ((g - w).abs().max() / scale).item())
    return worst


def _median_ms(fn: Callable[[], object], on_gpu: bool) -> float:
    """Median milliseconds per call: CUDA events (10 warm-up, 50 timed) or perf_counter (5)."""
    if not on_gpu:
        fn()  # the first call pays one-time costs (lazy imports, the fallback warning)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    for _ in range(10):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(50)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


if __name__ == "__main__":  # python -m cudnn_fuse.cli (python -m cudnn_fuse is __main__.py)
    raise SystemExit(main())
