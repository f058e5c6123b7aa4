"""Pre-warm: build (and optionally autotune) every entry of a manifest into the plan cache.

    cudnn-fuse prewarm plans/resnet50_fp16_bs32.json [more.json ...] [--autotune] [--dry-run] [--gpus N]
    torchrun --nproc-per-node N -m cudnn_fuse.prewarm plans/resnet50_fp16_bs32.json --autotune

The repository ships manifests for ResNet-50 (plans/resnet50_fp16_bs1.json,
plans/resnet50_fp16_bs32.json), a GPT-2 block (plans/gpt2_block_bf16.json) and a Llama
block (plans/llama_block_bf16.json); ``cudnn-fuse record`` writes one for any script.

With several ranks the manifest is sharded round-robin over them
(torch.distributed; NCCL on GPUs, gloo otherwise); every rank writes into the
shared cache and rank 0 prints the table. Across nodes: the same command under
torchrun's multi-node rendezvous, with the cache exported and imported between
nodes (``cudnn-fuse cache export|import``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

from . import manifest
from .errors import UnsupportedError
from .progress import Bar, format_table

log = logging.getLogger(__name__)


@dataclass
class Row:
    index: int
    name: str
    op: str
    digest: str
    status: str  # built | cached | would build | failed
    seconds: float = 0.0
    reason: str = ""
    rank: int = 0


def default_builder(autotune: bool, device: int) -> Callable:
    """Build through the normal load order (which stores into the cache), with autotuning on or
    off for that build only: the process's own setting is restored after each build."""
    from . import autotune as at
    from . import loader

    def build(spec):
        old = at._enabled  # None (the environment decides) is restored as None
        at.set_autotune(autotune)
        try:
            fp8 = _fp8_engine(spec)
            if fp8 is not None:  # an FP8 GEMM (cuBLASLt's algorithm) or FP8 attention graph
                fp8.prewarm_spec(spec, device)
            else:
                loader.load_or_build(spec, device)
        finally:
            at._enabled = old

    return build


def _fp8_engine(spec):
    """The module that plans an FP8 spec (fp8_gemm, fp8_attention), or None for a cuDNN graph's spec."""
    op = getattr(spec, "op", None)
    if op == "scaled_mm":
        from . import fp8_gemm

        return fp8_gemm
    if op == "sdpa_fp8":
        from . import fp8_attention

        return fp8_attention
    return None


def _cached(pc, digest: str, want_tuned: bool, spec=None, device: int = 0) -> bool:
    if pc is None:
        return False
    from . import loader

    fp8 = _fp8_engine(spec)
    if fp8 is not None:  # its entries have keys of their own
        return fp8.spec_cached(pc, spec, device, want_tuned)

    entry = pc.get(digest, count=False)  # a pre-warm's look, no plan lookup: the cache's hit rate leaves it out
    return entry is not None and (loader.is_tuned(entry.meta) or not want_tuned)


def work_order(entries) -> list:
    """Entry indices, most expensive first (by flops: a proxy for build and tuning time), so
    that static shards are balanced and a shared queue ends with short jobs."""
    from .spec import flops

    def cost(i):
        try:
            return flops(entries[i].spec)
        except Exception:  # noqa: BLE001 - an odd spec still gets built, last
            return 0

    return sorted(range(len(entries)), key=lambda i: (-cost(i), i))


def prewarm_one(i: int, e, *, autotune: bool, dry_run: bool, builder, cache, rank: int = 0, device: int = 0) -> Row:
    """Build entry ``i`` unless the cache has it; never raises for a bad entry."""
    from . import loader

    digest = loader.cache_digest(e.spec)
    row = Row(i, e.name or f"{e.spec.op}#{i}", e.spec.op, digest[:16], "cached", rank=rank)
    t0 = time.perf_counter()

    if not _cached(cache, digest, autotune, e.spec, device):
        if dry_run:
            row.status = "would build"
        else:
            try:
                with loader.pinning():  # pre-warmed entries are never evicted for space
                    builder(e.spec)
                row.status = "built"
            except UnsupportedError as exc:
                row.status, row.reason = "failed", str(exc).splitlines()[0][:200]
            except Exception as exc:  # noqa: BLE001 - one bad entry must not stop the pre-warm
                row.status, row.reason = "failed", f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    elif not dry_run:
        try:  # found cached (a lazy first run stored it): pinned now, as if pre-warmed
            fp8 = _fp8_engine(e.spec)
            if fp8 is not None:
                fp8.pin_spec(cache, e.spec, device)
            else:
                loader.pin_cached(cache, e.spec)
        except Exception as exc:  # noqa: BLE001 - a pin is an eviction policy, never a failed entry
            log.debug("pre-warm: could not pin %s: %s", digest[:16], exc)
    row.seconds = time.perf_counter() - t0
    return row


def prewarm(entries, *, autotune: bool = False, dry_run: bool = False, builder: Optional[Callable] = None,
            cache=None, rank: int = 0, world: int = 1, progress: Optional[Callable[[int, int], None]] = None,
            device: int = 0) -> list:
    """Build this rank's share of ``entries`` (every world-th of the cost-ordered list);
    returns one Row per entry of the share, in manifest order."""
    mine = [i for n, i in enumerate(work_order(entries)) if n % world == rank]
    if builder is None and not dry_run:
        builder = default_builder(autotune, device)
    rows = []
    for n, i in enumerate(mine):
        if progress is not None:
            progress(n, len(mine))
        rows.append(prewarm_one(i, entries[i], autotune=autotune, dry_run=dry_run, builder=builder, cache=cache,
                                rank=rank, device=device))
    if progress is not None:
        progress(len(mine), len(mine))
    return sorted(rows, key=lambda r: r.index)


# ----------------------------------------------------------------------------- local GPUs


def _local_worker(rank: int, entries, autotune: bool, work, results, builder_factory=None) -> None:
    """One process per GPU: take the next entry from the shared queue until it is empty."""
    try:
        from .cache import open_default_cache

        if builder_factory is None:
            import torch

            visible = torch.cuda.device_count()  # in the worker: the parent makes no CUDA call before forking
            if rank >= visible:  # one line, not torch's five-line "invalid device ordinal"
                raise RuntimeError(f"there is no GPU {rank} ({visible} visible); lower --gpus")
            torch.cuda.set_device(rank)
            builder = default_builder(autotune, rank)
        else:  # tests: a fake builder, no GPU
            builder = builder_factory(rank)
        cache = open_default_cache()
        while True:
            i = work.get()
            if i is None:
                break
            row = prewarm_one(i, entries[i], autotune=autotune, dry_run=False, builder=builder, cache=cache, rank=rank,
                              device=rank)
            results.put(asdict(row))
    except Exception as exc:  # noqa: BLE001 - the parent must hear of it, not wait forever
        # reported per entry by the parent; raised on, multiprocessing would print a traceback
        results.put({"worker_error": f"rank {rank}: {type(exc).__name__}: {exc}"})
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the parent says so
        pass
    finally:
        results.put({"worker_done": rank})


def run_local(entries, gpus: int, *, autotune: bool = False, progress=None, builder_factory=None) -> list:
    """Pre-warm on ``gpus`` local GPUs, one process each, pulling entries from one shared
    queue (most expensive first), so no GPU idles while another has a backlog. Forked when
    the platform allows (no re-import of torch; CUDA is not initialised in this parent)."""
    import multiprocessing as mp

    import torch

    fork = "fork" in mp.get_all_start_methods() and not torch.cuda.is_initialized()
    ctx = mp.get_context("fork" if fork else "spawn")
    work, results = ctx.Queue(), ctx.Queue()
    for i in work_order(entries):
        work.put(i)
    for _ in range(gpus):
        work.put(None)
    procs = [ctx.Process(target=_local_worker, args=(r, entries, autotune, work, results, builder_factory), daemon=True)
             for r in range(gpus)]
    for p in procs:
        p.start()
    rows, done, errors = [], 0, []
    if progress is not None:
        progress(0, len(entries))
    while done < gpus:
        try:
            msg = results.get(timeout=5.0)
        except Exception:  # noqa: BLE001 - queue.Empty: is anyone still alive?
            if not any(p.is_alive() for p in procs):
                break
            continue
        if "worker_done" in msg:
            done += 1
        elif "worker_error" in msg:
            errors.append(msg["worker_error"])
        else:
            rows.append(Row(**msg))
            if progress is not None:
                progress(len(rows), len(entries))
    for p in procs:
        p.join(timeout=30)
    for e in errors:  # a worker that never started: its GPU did no work, though the others took its entries
        log.warning("pre-warm worker failed, its GPU took no more entries: %s", e)
    seen, reported = {r.index for r in rows}, len(rows)
    for i, e in enumerate(entries):  # entries a dead worker never reported
        if i not in seen:
            rows.append(Row(i, e.name or f"{e.spec.op}#{i}", e.spec.op, e.spec.digest()[:16], "failed",
                            reason="; ".join(errors) or "worker process died"))
    if progress is not None and len(rows) > reported:
        progress(len(rows), len(entries))  # the bar ends its line also when workers died
    return sorted(rows, key=lambda r: r.index)


def summarize(rows: list, seconds: float) -> dict:
    return {
        "entries": len(rows),
        "built": sum(r.status == "built" for r in rows),
        "already cached": sum(r.status == "cached" for r in rows),
        "would build": sum(r.status == "would build" for r in rows),
        "failed": sum(r.status == "failed" for r in rows),
        "seconds": round(seconds, 2),
    }


def format_report(rows: list, seconds: float) -> str:

    s = summarize(rows, seconds)
    out = [format_table(list(s), [list(s.values())])]
    failed = [r for r in rows if r.status == "failed"]
    if failed:
        out.append("\nfailed:")
        out.append(format_table(["#", "name", "op", "reason"], [[r.index, r.name, r.op, r.reason] for r in failed]))
    return "\n".join(out)


# ----------------------------------------------------------------------------- distributed


def _dist_env() -> tuple[int, int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def run_distributed(entries, *, autotune=False, dry_run=False, builder=None, cache=None, progress=None):
    """Shard over torch.distributed's ranks (initialised here from torchrun's environment);
    returns every rank's rows on rank 0, and this rank's rows elsewhere."""
    import torch
    import torch.distributed as dist

    rank, world, local = _dist_env()
    if world == 1:
        return prewarm(entries, autotune=autotune, dry_run=dry_run, builder=builder, cache=cache, progress=progress,
                       device=local)
    use_cuda = torch.cuda.is_available() and not dry_run
    if use_cuda:
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        rows = prewarm(entries, autotune=autotune, dry_run=dry_run, builder=builder, cache=cache, rank=rank,
                       world=world, progress=progress if rank == 0 else None, device=local)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object([asdict(r) for r in rows], gathered, dst=0)
        if rank != 0:
            return rows
        return sorted((Row(**d) for part in gathered for d in part), key=lambda r: r.index)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    """``python -m cudnn_fuse.prewarm`` / ``cudnn-fuse prewarm``."""
    p = argparse.ArgumentParser(prog="cudnn-fuse prewarm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    return run(args)


def add_arguments(p) -> None:
    p.add_argument("manifest", nargs="+", help="plan manifests (plans/*.json); their entries are built together")
    p.add_argument("--autotune", action="store_true", help="autotune every entry (default: heuristics)")
    p.add_argument("--dry-run", action="store_true", help="only report what would be built")
    p.add_argument("--gpus", type=_positive_int, default=1, help="spread the entries over N local GPUs (processes)")


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}")
    return n


def run(args) -> int:
    from .cache import open_default_cache

    paths = args.manifest  # nargs="+": always a list
    entries, seen = [], set()
    for path in paths:
        try:
            loaded = manifest.load(path)
        except (OSError, manifest.ManifestError) as exc:
            print(f"cudnn-fuse prewarm: {exc}", file=sys.stderr)
            return 2
        for e in manifest.expand(loaded):  # a spec in two manifests is built once
            d = e.spec.digest()
            if d not in seen:
                seen.add(d)
                entries.append(e)
    import torch

    if args.gpus > 1 and not args.dry_run and "WORLD_SIZE" not in os.environ:
        # no CUDA call here: the workers are forked from this process (a missing GPU fails its worker);
        # a CPU build of torch is known without one
        if not torch.backends.cuda.is_built():
            print("cudnn-fuse prewarm: building plans needs a CUDA GPU (this torch has no CUDA); try --dry-run",
                  file=sys.stderr)
            return 2
        t0 = time.perf_counter()
        rows = run_local(entries, args.gpus, autotune=args.autotune,
                         progress=Bar(f"prewarm {', '.join(os.path.basename(p) for p in paths)} on {args.gpus} GPUs"))
        print(format_report(rows, time.perf_counter() - t0))
        per_gpu = [[r, sum(x.rank == r for x in rows), round(sum(x.seconds for x in rows if x.rank == r), 2)]
                   for r in range(args.gpus)]
    
        print("\n" + format_table(["gpu", "entries", "busy seconds"], per_gpu))
        return 1 if any(r.status == "failed" for r in rows) else 0

    if not args.dry_run and not torch.cuda.is_available():
        print("cudnn-fuse prewarm: building plans needs a CUDA GPU (none found); try --dry-run", file=sys.stderr)
        return 2
    rank, world, local = _dist_env()
    cache = open_default_cache(local if not args.dry_run else None)  # this rank's GPU's namespace
    t0 = time.perf_counter()
    rows = run_distributed(entries, autotune=args.autotune, dry_run=args.dry_run, cache=cache,
                           progress=Bar(f"prewarm {', '.join(os.path.basename(p) for p in paths)}"))
    if rank == 0:
        print(format_report(rows, time.perf_counter() - t0))
    return 1 if rank == 0 and any(r.status == "failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
