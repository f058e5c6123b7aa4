"""A spec's plan: from memory (a bounded LRU), else through the load order

    disk cache (verified blob -> deserialize)
      -> rebuild the recorded engine + knobs (create_execution_plan), no re-tuning
      -> full build: heuristics, or autotune when enabled (then stored on disk)

Any cache fault is a miss plus one warning (the cache logs it); a blob that
deserializes badly is dropped and rebuilt from its engine record. Across
processes, one process tunes a key while the others wait (bounded) for its
result or go on with the heuristic plan. ``get_plan(spec, device)`` returns a ``plans.Plan`` (or
torch's stand-in) or raises ``UnsupportedError``, remembered too, so an unsupported spec costs one
build attempt, not one per call.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import fcntl
import gc
import hashlib
import logging
import os
import socket
import threading
import time
from collections import OrderedDict

import torch

from . import autotune, build_process, conv_gemm, envvars, families, handles, launch_graphs, torch_engine
from .builders import build_graph, roles_of, uids_of
from .engines import barred_engines, deterministic, finalize, pinned_mode, prepare
from .errors import UnsupportedError
from .handles import bury, handle_for, held
from .plans import FAST, STATS, Plan

log = logging.getLogger(__name__)


def is_tuned(meta: dict) -> bool:
    """Whether an entry's metadata says its engine was autotuned: only the JSON ``true`` this package
    writes counts. An imported or hand-made entry's ``"false"``, ``"no"`` or ``1`` is not a tuning
    (truthiness would read the string ``"false"`` as tuned and never tune the key)."""
    return meta.get("tuned") is True


def cache_digest(spec) -> str:
    """The disk-cache key of ``spec``'s plan: its digest, or, while torch requires deterministic
    algorithms, a key of its own (the plan was chosen among deterministic engines only, and a plan
    tuned without that filter, or torch's cuBLAS stand-in, must not serve such a process)."""
    digest = spec.digest()
    if deterministic():
        return hashlib.sha256((digest + ":deterministic").encode()).hexdigest()
    return digest


def engine_record_key(digest: str) -> str:
    """Key of the second, tiny entry (engine id + knobs) that survives a corrupt blob entry."""
    return hashlib.sha256((digest + ":engine-record").encode()).hexdigest()


def is_engine_record(meta: dict) -> bool:
    return meta.get("kind") == "engine-record"


def is_record(meta: dict) -> bool:
    """Whether an entry is a record beside the plans (a plan's engine record, a shape family's record)."""
    return meta.get("kind") in ("engine-record", "family-record")


# A family's tuned engine serves a size within this factor of a size it was tuned at, on every dynamic
# dimension; a size further out is tuned itself and becomes one more of the family's anchors (the newest
# FAMILY_ANCHORS kept): an engine fast at one size may be slow far from it (docs/dynamic_shapes.md).
FAMILY_REACH = 4.0
FAMILY_ANCHORS = 8


def family_record_key(family: str) -> str:
    """Key of a shape family's record: the engines its sizes were tuned to (deterministic processes apart,
    as cache_digest keeps them)."""
    mode = ":deterministic" if deterministic() else ""
    return hashlib.sha256((family + mode + ":family-record").encode()).hexdigest()


def _well_formed(anchor) -> bool:
    s = anchor.get("sizes") if isinstance(anchor, dict) else None
    return isinstance(s, dict) and all(type(v) is int and v > 0 for v in s.values()) and \
        type(anchor.get("engine_id")) is int


def nearest_anchor(anchors, sizes: dict):
    """The anchor (a tuning of the family at ``anchor["sizes"]``) nearest ``sizes`` within FAMILY_REACH on
    every dimension, or None. Anchors that are not well-formed are passed over."""
    best = None
    for a in anchors if isinstance(anchors, list) else ():
        s = a.get("sizes") if isinstance(a, dict) else None
        if not isinstance(s, dict) or set(s) != set(sizes):
            continue
        try:
            far = max(max(sizes[k], s[k]) / min(sizes[k], s[k]) for k in sizes)
        except (TypeError, ValueError, ZeroDivisionError):
            continue
        if far <= FAMILY_REACH and (best is None or far < best[0]):
            best = (far, a)
    return None if best is None else best[1]


# how long _tune_lock waits for another process tuning the same key. Bounded: the library never hangs on
# another process (inf, or a wait past an hour, is a logged warning and the default)
TUNE_WAIT_MAX_S = 3600.0
TUNE_WAIT_S = envvars.number(envvars.TUNE_WAIT_S, 60.0, maximum=TUNE_WAIT_MAX_S)

_pin = threading.local()


@contextlib.contextmanager
def pinning():
    """Entries this thread stores inside the block are pinned: the cache never evicts them to
    stay under its size limit (pre-warm, RELIABILITY case 15). That includes the GEMM entry a
    1x1 conv's tuning stores beside its own."""
    old = getattr(_pin, "on", False)
    _pin.on = True
    try:
        yield
    finally:
        _pin.on = old


def pinning_now() -> bool:
    return bool(getattr(_pin, "on", False))


def pin_cached(pc, spec) -> int:
    """Pin the cached entries that serve ``spec`` (its entry, its engine record and, for a conv
    entry that runs as a GEMM, the GEMM's): a pre-warm that finds them already cached keeps
    them from eviction too. Returns how many were newly pinned; a fault pins nothing."""
    with pinned_mode():  # the conv's key and its GEMM's under one mode
        return _pin_cached(pc, spec)


def _pin_cached(pc, spec) -> int:
    digest = cache_digest(spec)
    digests = [digest]
    entry = pc.get(digest, count=False)  # a pre-warm's look, as in prewarm._cached: no plan lookup
    mspec = conv_gemm.gemm_spec(spec) if entry is not None and entry.meta.get("use_gemm") else None
    if mspec is not None:  # the conv runs as this GEMM: its entry serves the conv too
        digests.append(cache_digest(mspec))
    n = 0
    for d in digests:
        for key in (d, engine_record_key(d)):
            e = entry if key == digest else pc.get(key, count=False)
            if e is not None and not e.meta.get("pinned") and \
                    pc.put(key, dict(e.meta, pinned=True), e.blob, pinned=True):
                n += 1
    return n


_warned: set = set()


def _warn_once(kind: str, msg: str, *args) -> None:
    if kind not in _warned:
        _warned.add(kind)
        log.warning(msg, *args)


def _cache(device: int | None = None):
    from .cache import open_default_cache  # at the first load: diskcache (sqlite) stays out of the import

    return open_default_cache(device)  # the namespace of the device's own environment


def load_or_build(spec, device: int, standin: bool = False) -> Plan:
    """The plan of ``spec`` on ``device`` from the disk cache, else built (and stored); with ``standin``,
    a new size of a known shape family not on disk is a ``StandIn`` instead of a build. The determinism
    mode is read once (or taken from the plan LRU's lookup, which pinned it) and pinned for the whole
    load or build: the entry's key, the engine filter, the autotuner and the stored record agree."""
    with pinned_mode():
        return _load_or_build(spec, device, standin)


def _load_or_build(spec, device: int, standin: bool = False) -> Plan:
    t0 = time.perf_counter()
    tuning = autotune.autotune_enabled()
    pc = _cache(device)
    digest = cache_digest(spec)
    with torch.cuda.device(device):
        if pc is not None:
            plan = _from_cache(pc, spec, digest, device, want_tuned=tuning)
            if plan is not None:
                # the time is taken before the +=: `STATS.x += time.perf_counter() - t0` reads STATS.x, then
                # calls perf_counter, where CPython may switch threads, and another thread's += made then was lost
                dt = time.perf_counter() - t0
                STATS.loads += 1
                STATS.load_seconds += dt
                _mark_family(pc, spec)  # a plan of this size in the process: its family's other sizes may stand in
                return plan
        if tuning and pc is not None and autotune.current_config().per_family:
            plan = _from_family(pc, spec, digest, device, t0)
            if plan is not None:
                return plan
        if standin and not tuning:
            plan = _standin(pc, spec, device)
            if plan is not None:
                return plan
        # no tune lock on a read-only cache: no tuning can be stored there, so a process waiting for
        # another's would only wait (up to TUNE_WAIT_S) and then tune the key again itself
        if tuning and pc is not None and not getattr(pc, "read_only", False):
            with _tune_lock(pc, digest) as got_lock:
                if not got_lock:  # another process tuned it meanwhile, or is still tuning
                    plan = _from_cache(pc, spec, digest, device, want_tuned=False)
                    if plan is not None:
                        dt = time.perf_counter() - t0  # the wait included: the time this load took
                        STATS.loads += 1
                        STATS.load_seconds += dt
                        return plan
                    # the holder is still tuning: run heuristics now, leave the entry to it
                    return _build_and_store(None, spec, digest, device, False, t0)
                return _build_and_store(pc, spec, digest, device, tuning, t0)
        return _build_and_store(pc, spec, digest, device, tuning, t0)


# ------------------------------------------------------------------ from the cache


def _from_cache(pc, spec, digest, device, want_tuned: bool):
    t0 = time.perf_counter()
    entry = pc.get(digest)
    dt = time.perf_counter() - t0  # taken before the += (as in _load_or_build)
    STATS.cache_get_seconds += dt
    if entry is not None and want_tuned and not is_tuned(entry.meta):
        return None  # a heuristic entry is upgraded once tuned
    if entry is not None and _barred(spec, entry.meta):
        return None  # written before its engine was barred: built anew, the entry overwritten
    if entry is not None:
        if entry.meta.get("use_gemm"):  # the conv runs as its GEMM: its own blob is not needed
            gemm = _gemm_plan(pc, spec, device)
            if gemm is not None:
                return gemm
        plan = _deserialize(spec, entry, device)
        if plan is not None:
            return _maybe_torch(plan, entry.meta)
        pc.delete(digest)
    # the entry's lookup counted this plan's hit or miss: the record's is not a second one
    record = pc.get(engine_record_key(digest), count=False)
    meta = entry.meta if entry is not None else (record.meta if record is not None else None)
    if meta is None or meta.get("engine_id") is None or (want_tuned and not is_tuned(meta)) or _barred(spec, meta):
        return None
    try:
        plan = rebuild(spec, meta["engine_id"], meta.get("knobs", {}), device)
    except Exception as exc:  # noqa: BLE001 - a stale record is a miss
        _warn_once("rebuild", "cudnn_fuse cache: could not rebuild engine %s for %s (%s); building anew",
                   meta.get("engine_id"), spec.op, exc)
        return None
    blob = plan.graph.serialize(as_bytes=True)
    # the plan entry again, not a second record (the record's own meta said kind "engine-record", no spec)
    restored = {k: v for k, v in meta.items() if k != "kind"}
    restored.setdefault("spec", spec.to_dict())
    pc.put(digest, restored, blob, pinned=bool(meta.get("pinned")))
    if meta.get("use_gemm"):
        gemm = _gemm_plan(pc, spec, device)
        if gemm is not None:
            return gemm
    return _maybe_torch(plan, meta)


def _from_family(pc, spec, digest, device, t0):
    """A tuned plan for a new size from the engine its family was tuned to at a size near it, stored as
    this size's tuned entry (``family_anchor`` names that size); None where the spec has no family, the
    family no anchor in reach, or the anchor's engine does not build at this size."""
    fam = families.family(spec)
    if fam is None:
        return None
    try:
        rec = pc.get(family_record_key(fam), count=False)
    except Exception as exc:  # noqa: BLE001 - a cache fault is a miss
        log.debug("cudnn_fuse cache: family record unreadable: %s", exc)
        return None
    anchor = nearest_anchor(rec.meta.get("anchors") if rec is not None else None, families.sizes(spec))
    if anchor is None or type(anchor.get("engine_id")) is not int or _barred(spec, anchor):
        return None
    try:
        plan = rebuild(spec, anchor["engine_id"], anchor.get("knobs") or {}, device)
    except Exception as exc:  # noqa: BLE001 - the engine does not take this size: tuned as usual
        log.debug("cudnn_fuse: family engine %s does not build %s at %s (%s)", anchor["engine_id"], spec.op,
                  families.sizes(spec), exc)
        return None
    STATS.family_hits += 1
    use_torch = anchor.get("use_torch") is True
    _store(pc, spec, digest, plan, True, [], time.perf_counter() - t0, None, use_torch, False,
           family_anchor=anchor["sizes"])
    return _maybe_torch(plan, {"use_torch": use_torch, "candidates": [], "winner_index": None})


def _note_family(pc, spec, meta: dict) -> None:
    """Add a tuned entry's engine to its family's record, as the anchor at its sizes."""
    fam = families.family(spec)
    if fam is None or meta.get("family_anchor") is not None:
        return
    key = family_record_key(fam)
    try:
        old = pc.get(key, count=False)
        anchors = old.meta.get("anchors") if old is not None else None
        sizes = families.sizes(spec)
        anchors = [a for a in (anchors if isinstance(anchors, list) else []) if _well_formed(a)
                   and a["sizes"] != sizes]
        anchors.append({"sizes": sizes, **{k: meta[k] for k in ("engine_id", "knobs", "engine_name", "use_torch")}})
        record = {"kind": "family-record", "op": spec.op, "anchors": anchors[-FAMILY_ANCHORS:]}
        if meta.get("pinned") or (old is not None and old.meta.get("pinned") is True):
            record["pinned"] = True  # a family a pre-warm tuned stays pinned through later tunings of it
        pc.put(key, record, b"", pinned=bool(record.get("pinned")))
    except Exception as exc:  # noqa: BLE001 - a family record that cannot be written leaves sizes to be tuned
        log.debug("cudnn_fuse cache: family record not written: %s", exc)


# ------------------------------------------------------------------ new sizes of known families

# Calls a new size of a known family runs on torch's kernels (a StandIn) before its plan is built on the
# call after, where no build process builds it: a size met once never pays a plan build, one met again pays
# it once, on a call of its own.
STANDIN_CALLS = 4
_now = time.monotonic  # the clock that paces the loads of stored plans (PlanLRU._paced)
# A stand-in asks the build process for its plan on the call after its first BUILD_REQUEST_CALLS: a size
# met once is built nowhere.
BUILD_REQUEST_CALLS = 1
_KNOWN_FAMILIES: set = set()  # families this process has a stored plan or record of


def _mark_family(pc, spec) -> None:
    """Make a stored plan's shape family known to later processes: its family record, written once
    (with no anchors when no size of it was tuned)."""
    fam = families.family(spec)
    if fam is None or fam in _KNOWN_FAMILIES:
        return
    try:
        key = family_record_key(fam)
        if getattr(pc, "_peek", pc.get)(key) is None:
            pc.put(key, {"kind": "family-record", "op": spec.op, "anchors": []}, b"", pinned=pinning_now())
        _KNOWN_FAMILIES.add(fam)
    except Exception as exc:  # noqa: BLE001 - an unknown family only means a build instead of a stand-in
        log.debug("cudnn_fuse cache: family record not written: %s", exc)


class StandIn(torch_engine.TorchPlan):
    """torch's kernels for a new size of a known shape family while its plan waits: no build on the call
    that meets the size. PlanLRU asks the build process for the plan on the call after its first
    BUILD_REQUEST_CALLS and swaps it in on the first call after it is stored; with no build process it
    builds the plan itself on the call after the first STANDIN_CALLS. The ops' memo holds it only while the
    build process builds its plan (ops._StandInLaunch, which counts its calls here); every other call looks
    it up and counts."""

    __slots__ = ("calls", "request")
    standin = True

    def __init__(self, spec, device: int):
        super().__init__(spec, device, None, "torch's kernels while the plan of this new size of a known shape "
                                             "family waits")
        self.calls = 0
        self.request = None  # the build process's Request; False: none to be had


def _standin(pc, spec, device: int):
    """A StandIn for ``spec`` when torch's kernels can take it and another size of its family has a plan
    (in this process, or a family record in the cache); None otherwise (then it is built as ever)."""
    if deterministic() or not torch_engine.stands_in(spec):
        return None  # torch's kernels are no deterministic engine
    fam = families.family(spec)
    if fam is None:
        return None
    if fam not in _KNOWN_FAMILIES:
        try:
            if pc is None or pc.get(family_record_key(fam), count=False) is None:
                return None
        except Exception as exc:  # noqa: BLE001 - a cache fault is a miss: built as ever
            log.debug("cudnn_fuse cache: family record unreadable: %s", exc)
            return None
        _KNOWN_FAMILIES.add(fam)
    STATS.standins += 1
    return StandIn(spec, device)


def _capturing() -> bool:
    """Whether work that allocates and synchronizes (a build, a timing) must wait: this thread's stream is
    capturing, or a launch of ours found a caller's capture open (``handles.capture_noted``), which a
    capture in torch's default (global) mode would not survive."""
    return torch.cuda.is_available() and (torch.cuda.is_current_stream_capturing() or handles.capture_noted())


def _barred(spec, meta: dict) -> bool:
    """Whether a cache entry's engine is one ``engines.barred_engines`` bars for ``spec``, or is no
    engine id at all (valid JSON of another type: int() raised out of the loader, failing the op)."""
    eid = meta.get("engine_id")
    if eid is None:
        return False
    if type(eid) is not int:
        _warn_once("engine-id", "cudnn_fuse cache: entry for %s names engine %r, not an engine id; building anew",
                   spec.op, eid)
        return True
    if eid not in barred_engines(spec):
        return False
    _warn_once("barred", "cudnn_fuse cache: entry for %s names engine %s, which computes it wrongly; building anew",
               spec.op, eid)
    return True


def _maybe_torch(plan, meta: dict):
    """The cuDNN plan, or torch's implementation standing in for it when the tuned entry
    found torch faster (``use_torch``; the cuDNN plan stays the entry's blob)."""
    if not meta.get("use_torch"):
        return plan
    if not torch_engine.supports(plan.spec):  # an entry written by a newer cudnn_fuse: trust cuDNN
        return plan
    return torch_engine.TorchPlan(plan.spec, plan.device, plan, _torch_reason(meta))


def _torch_reason(meta: dict) -> str:
    """Why an entry runs torch's kernels, with the timings that decided."""
    check = meta.get("torch_check") or {}
    if check.get("torch_ms") is not None and check.get("cudnn_ms") is not None:
        return f"torch's kernels {check['torch_ms']:.3f} ms against cuDNN's {check['cudnn_ms']:.3f} ms"
    by_index = {c.get("index"): c.get("median_ms") for c in meta.get("candidates") or () if isinstance(c, dict)}
    t, w = by_index.get(autotune.TORCH_INDEX), by_index.get(meta.get("winner_index"))
    if t is not None and w is not None:
        return f"torch's kernels {t:.3f} ms against cuDNN's best {w:.3f} ms (autotuned)"
    return "torch's kernels timed faster"


def _gemm_plan(pc, spec, device):
    """The GEMM plan a tuned conv entry chose (``use_gemm``, conv_gemm.py), from the GEMM's own
    tuned entry, wrapped to take the conv's operands; None (one warning) when that entry is
    gone or untuned, and the conv's own plan serves."""
    mspec = conv_gemm.gemm_spec(spec)
    if mspec is None:  # an entry written by a newer cudnn_fuse: the conv's plan
        return None
    try:
        gemm = _from_cache(pc, mspec, cache_digest(mspec), device, want_tuned=True)
    except Exception as exc:  # noqa: BLE001 - a cache fault is a miss
        log.debug("cudnn_fuse cache: GEMM entry of %s unreadable: %s", spec.op, exc)
        gemm = None
    if gemm is None:
        _warn_once("gemm", "cudnn_fuse cache: a tuned conv entry runs as a GEMM whose tuned entry is missing; "
                   "running the conv's own plan")
        return None
    return conv_gemm.GemmConvPlan(spec, gemm)


def _deserialize(spec, entry, device):
    import cudnn

    h = handle_for(device)
    t0 = time.perf_counter()
    g = None
    try:
        # The frontend's deserialize "warms up" the plan: a throwaway CUDA graph capture of one execute
        # on the handle's stream. The handle is shared by every thread's launches and stays bound to
        # the last one's stream, where another thread may be launching: work of that thread would be
        # captured into the throwaway graph and never run. So it runs under the handle's lock, bound
        # to the device's side stream (launch graphs capture there, under the same lock; nothing is
        # ever launched there).
        with held(h, device):
            g = cudnn.pygraph(handle=h.handle)
            g.deserialize(h.handle, entry.blob)
        plan = Plan(spec, g, device, engine=entry.meta.get("engine_name", "?"))
        dt = time.perf_counter() - t0
        STATS.deserialize_seconds += dt
    except Exception as exc:  # noqa: BLE001 - a verified blob can still be nonsense to cuDNN
        _warn_once("deserialize", "cudnn_fuse cache: entry %s did not deserialize (%s: %s); rebuilding it",
                   entry.key[:12], type(exc).__name__, exc)
        bury(device, g)  # released under the handle's lock, outside captures
        return None
    return plan


def rebuild(spec, engine_id: int, knobs: dict, device: int) -> Plan:
    """Build exactly the recorded engine + knobs (no heuristics, no tuning)."""
    if int(engine_id) in barred_engines(spec):
        raise UnsupportedError(f"engine {engine_id} computes {spec.op} wrongly (engines.barred_engines)")
    h = handle_for(device)
    g = None
    try:
        with held(h, device):  # builds use the shared handle: one thread at a time, off callers' streams
            g = build_graph(spec, h.handle)
            g.validate()
            g.build_operation_graph()
            g.create_execution_plan(int(engine_id), autotune.knobs_from_json(knobs))
            g.build_plan_at_index(g.get_execution_plan_count() - 1)
    except BaseException:
        bury(device, g)  # released under the handle's lock, outside captures
        raise
    STATS.rebuilds += 1
    return Plan(spec, g, device)


# ------------------------------------------------------------------ building


def _build_and_store(pc, spec, digest, device, tuning: bool, t0: float) -> Plan:
    h = handle_for(device)
    candidates, winner_index, use_torch, use_gemm, check = [], None, False, False, None
    g = None
    try:
        with held(h, device):  # builds use the shared handle: one thread at a time, off callers' streams
            g = build_graph(spec, h.handle)
            if tuning:
                prepare(g, spec)  # the tuner builds its candidates, each under held() itself
            else:
                finalize(g, spec)
        if tuning:
            tt = time.perf_counter()
            try:
                _, winner, timings = autotune.tune(g, spec, h, device, uids_of(spec), roles_of(spec),
                                                   get_plan=get_plan)
            except UnsupportedError:
                raise
            except Exception as exc:  # noqa: BLE001
                raise UnsupportedError(f"autotune of {spec.op} failed: {type(exc).__name__}: {exc}") from exc
            dt = time.perf_counter() - tt
            STATS.autotune_seconds += dt
            candidates = [t.to_dict() for t in timings]
            winner_index = winner.index
            use_torch, use_gemm = _faster_of(winner, timings)
        plan = Plan(spec, g, device)
        if not tuning:
            check = torch_check(plan, spec, device)
            use_torch = bool(check and check["use_torch"])
    except UnsupportedError:
        STATS.build_failures += 1
        bury(device, g)  # the graph given up on is released under the handle's lock, outside captures
        raise
    STATS.builds += 1
    build_s = time.perf_counter() - t0
    STATS.build_seconds += build_s
    log.debug("built %s plan %s (%s, %s) on cuda:%d in %.1f ms", spec.op, digest[:12], plan.engine,
              "tuned" if tuning else "heuristic", device, 1e3 * build_s)
    if pc is not None:
        _store(pc, spec, digest, plan, tuning, candidates, build_s, winner_index, use_torch, use_gemm, check)
    if use_gemm:  # the tuned GEMM plan is in memory (the autotuner timed it through get_plan)
        gemm = _gemm_in_memory(spec, device)
        if gemm is not None:
            return gemm
    return _maybe_torch(plan, {"use_torch": use_torch, "torch_check": check, "candidates": candidates,
                               "winner_index": winner_index})


def _faster_of(winner, timings) -> tuple:
    """(use_torch, use_gemm) of a tuning: each where it beat the cuDNN winner, and where both did, only
    the faster of the two."""
    use_torch, use_gemm = autotune.torch_wins(winner, timings), autotune.gemm_wins(winner, timings)
    if use_torch and use_gemm:
        t = {x.index: x.median_ms for x in timings}
        use_torch = t[autotune.TORCH_INDEX] < t[autotune.GEMM_INDEX]
        use_gemm = not use_torch
    return use_torch, use_gemm


def torch_check(plan, spec, device: int):
    """A heuristic plan checked once against torch's own kernels for its computation
    (autotune.check_against_torch): the record to store, or None where no check applies (torch
    cannot stand in for the graph, deterministic algorithms are asked for, no GPU, the calling
    stream is capturing, or a launch of ours found another stream capturing: timing allocates and
    synchronizes, which a capture in torch's default mode does not survive). A check that fails or
    does not apply keeps cuDNN's plan."""
    if not torch_engine.supports(spec) or deterministic() or not torch.cuda.is_available() or _capturing():
        return None
    try:
        return autotune.check_against_torch(plan, spec, device, roles_of(spec))
    except Exception as exc:  # noqa: BLE001 - a check that cannot run leaves the cuDNN plan
        log.debug("cudnn_fuse: %s plan not checked against torch: %s: %s", spec.op, type(exc).__name__, exc)
        return None


def _gemm_in_memory(spec, device):
    mspec = conv_gemm.gemm_spec(spec)
    if mspec is None:
        return None
    try:
        return conv_gemm.GemmConvPlan(spec, get_plan(mspec, device))
    except UnsupportedError:
        return None


def _store(pc, spec, digest, plan, tuned: bool, candidates, build_s: float, winner_index=None,
           use_torch: bool = False, use_gemm: bool = False, torch_check: dict | None = None,
           family_anchor: dict | None = None) -> None:
    try:
        engine_id, knobs = plan.graph.get_engine_and_knobs_at_index(plan.graph._plan_index)
        blob = plan.graph.serialize(as_bytes=True)
    except Exception as exc:  # noqa: BLE001 - not serializable: memory only
        _warn_once("serialize", "cudnn_fuse cache: %s plan not serializable (%s); kept in memory only", spec.op, exc)
        return
    pinned = pinning_now()
    old = getattr(pc, "_peek", pc.get)(digest)  # a check, not a lookup: the cache's hit rate does not count it
    if old is not None:
        if not tuned and is_tuned(old.meta) and not _barred(spec, old.meta):
            # another process stored its tuned plan while this one built: a heuristic plan never replaces it
            log.debug("cudnn_fuse cache: %s entry %s was tuned meanwhile; kept", spec.op, digest[:12])
            return
        # an entry pre-warmed (pinned) stays so through its tuned upgrade, in its meta and its record's, which
        # is what a rebuild from the record pins by
        pinned = pinned or bool(old.meta.get("pinned"))
    meta = {
        "spec": spec.to_dict(),
        "op": spec.op,
        "engine_id": int(engine_id),
        "knobs": autotune.knobs_to_json(knobs),
        "engine_name": plan.engine,
        "workspace": plan.workspace_size,
        "tuned": tuned,
        "candidates": candidates,
        "winner_index": winner_index,
        "use_torch": bool(use_torch),  # torch's own kernels timed faster than the cuDNN winner: the op runs them
        "use_gemm": bool(use_gemm),  # a 1x1 conv's GEMM (conv_gemm.py) timed faster than the conv winner
        "deterministic": bool(deterministic()),  # chosen among deterministic engines only (cache_digest)
        "build_ms": round(1e3 * build_s, 3),
        "tuned_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "device_name": torch.cuda.get_device_name(plan.device),
    }
    if torch_check is not None:
        meta["torch_check"] = torch_check  # a heuristic plan's timing against torch's kernels
    if family_anchor is not None:
        meta["family_anchor"] = family_anchor  # tuned as its shape family was at these sizes (_from_family)
    if pinned:
        meta["pinned"] = True  # a rebuild of this entry's engine record keeps it pinned
    pc.put(digest, meta, blob, pinned=pinned)
    record = {k: meta[k] for k in ("op", "engine_id", "knobs", "engine_name", "workspace", "tuned", "tuned_at",
                                   "use_torch", "use_gemm")}
    record["kind"] = "engine-record"
    if pinned:
        record["pinned"] = True
    pc.put(engine_record_key(digest), record, b"", pinned=pinned)
    if tuned:
        _note_family(pc, spec, meta)
    else:
        _mark_family(pc, spec)


@contextlib.contextmanager
def _tune_lock(pc, digest: str):
    """Yield True when this process should tune ``digest``: it holds the tune lock
    (or no lock file can be made: tuning unlocked beats not tuning). Yield False
    when another process held the lock past TUNE_WAIT_S, or tuned the key while
    this one waited (the caller then loads that result)."""
    path = None
    try:
        lock_dir = os.path.join(str(pc.dir), "locks")
        os.makedirs(lock_dir, mode=0o700, exist_ok=True)
        path = os.path.join(lock_dir, digest + ".lock")
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    except OSError as exc:
        _warn_once("lock", "cudnn_fuse cache: no tune lock (%s); tuning without one", exc)
        yield True
        return
    try:
        deadline = time.monotonic() + TUNE_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    yield False
                    return
                time.sleep(0.05)
        waited = pc.get(digest)  # tuned by the holder we waited for?
        if waited is not None and is_tuned(waited.meta):
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the flock; a killed holder's lock dies with it


# ------------------------------------------------------------------ plans in memory

DEFAULT_CAPACITY = envvars.number(envvars.MAX_PLANS, 1024, minimum=1, integer=True)


def describe(plan) -> str:
    """What a plan runs, in a few words (optimize's summary): cuDNN's engine, the 1x1 conv's GEMM, or
    torch's kernels and why."""
    if isinstance(plan, torch_engine.TorchPlan):
        return plan.reason or "torch's kernels"
    if isinstance(plan, conv_gemm.GemmConvPlan):
        return f"{describe(plan.gemm)}, a 1x1 conv as the GEMM of its matrix views"
    return f"cuDNN {getattr(plan, 'engine', '?')}"


def plan_stats() -> dict:
    """Counters of this process: builds, hits, misses, evictions, fallbacks, build_seconds, the
    launch graphs' captures, replays and failures (launch_graphs.py), the autotuner's checked
    spin (``tune_*``: autotune.spin_stats)."""
    return {**STATS.snapshot(), **launch_graphs.STATS.snapshot(), **autotune.spin_stats()}


class PlanLRU:
    """Bounded, thread-safe map (spec, device) -> Plan | remembered decline.

    Keyed by the frozen spec itself: hashing its fields is far cheaper per call
    than its sha256 digest, which is computed only where it is stored.

    Each key is built once even when threads race for it (a per-key lock).
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY, builder=None):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._builder = builder
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self._building: dict = {}
        self._swap_next = 0.0  # no stand-in loads its stored plan before this time (_now())

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._swap_next = 0.0

    def plans(self) -> list:
        """The built plans held now, least recently used first."""
        with self._lock:
            return [p for p in self._items.values() if not isinstance(p, _Declined)]  # Plan or TorchPlan

    def _lookup(self, key):
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
            return item

    def _store(self, key, item) -> None:
        with self._lock:
            self._items[key] = item
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
                STATS.evictions += 1

    def get(self, spec, device: int):
        det = deterministic()  # read once (or this thread's pin): the key's mode is the mode the plan is built under
        key = (spec, device, det)  # a plan built deterministic-only serves only that mode, and back
        item = self._lookup(key)
        if item is None:
            item = self._once(key, None, det, lambda: self._builder(spec, device) if self._builder is not None
                              else load_or_build(spec, device, standin=True))
        else:
            STATS.hits += 1
            if type(item) is StandIn:
                item.calls += 1
                if item.calls >= BUILD_REQUEST_CALLS and not _capturing():  # never a build inside a capture
                    item = self._next_of(key, item, det)
        if isinstance(item, _Declined):
            raise UnsupportedError(item.reason)
        return item

    def _once(self, key, expected, det, make):
        """Under the key's lock (one build at a time per key, even across a clear()): the item now held
        for ``key`` unless it is still ``expected`` (None: absent), else ``make()``'s, stored."""
        with self._lock:
            building = self._building.get(key)
            if building is None:
                building = self._building[key] = [threading.Lock(), 0]
            building[1] += 1
        try:
            with building[0]:
                item = self._lookup(key)  # another thread may have built it meanwhile
                if item is not None and item is not expected:
                    if expected is None:
                        STATS.hits += 1
                    return item
                if expected is None:
                    STATS.misses += 1
                try:
                    with pinned_mode(det):  # every read of the mode in the load or build is the key's
                        item = make()
                except UnsupportedError as exc:
                    item = _declined(key, exc)
                self._store(key, item)
                return item
        finally:
            with self._lock:
                building[1] -= 1
                if building[1] == 0 and self._building.get(key) is building:
                    del self._building[key]

    def _next_of(self, key, stand: StandIn, det):
        """What serves a stand-in's calls after its first BUILD_REQUEST_CALLS: the stand-in while the build
        process builds its plan, the plan it stored (loaded) once it has, torch's kernels for good where cuDNN
        declined the size; with no build process, or one that failed, the stand-in until the call after the
        first STANDIN_CALLS, which builds the plan."""
        spec, device, _ = key
        if stand.request is None:
            stand.request = _request_build(spec, device) or False
        status = stand.request.status if stand.request else "failed"
        if status is None:
            return stand
        if status == "declined":
            reason = stand.request.reason
            return self._once(key, stand, det, lambda: _swap(torch_engine.TorchPlan(
                spec, device, None, f"torch's kernels: cuDNN declined this size ({reason})"[:200])))
        if status == "ok":
            return self._paced(key, stand, det, lambda: self._swapped(spec, device, built_elsewhere=True))
        if stand.calls >= STANDIN_CALLS:
            return self._once(key, stand, det, lambda: self._swapped(spec, device))
        return stand

    def _paced(self, key, stand: StandIn, det, swap):
        """The stand-in's plan, loaded by ``swap()`` from where the build process stored it, unless the last
        such load ended less than its own duration ago: then the stand-in serves this call. A block that meets
        a new size swaps several plans in at once, and one call loading them all paid their sum (four loads,
        13-18 ms over steady; docs/dynamic_shapes.md); paced, a call loads one and loading takes at most half
        of the caller's time. (A build in the caller, with no build process, keeps its fixed call.)"""
        start = _now()
        if start < self._swap_next:
            return stand
        item = self._once(key, stand, det, swap)
        end = _now()
        self._swap_next = end + (end - start)
        return item

    @staticmethod
    def _swapped(spec, device: int, built_elsewhere: bool = False):
        """A stand-in's own plan, loaded where the build process stored it, else built now; torch's kernels
        for good where cuDNN declines the spec."""
        builds = STATS.builds
        try:
            plan = load_or_build(spec, device)
        except UnsupportedError as exc:
            plan = torch_engine.TorchPlan(spec, device, None, f"torch's kernels: cuDNN declined this size ({exc})"[:200])
        if built_elsewhere and STATS.builds == builds:
            STATS.process_builds += 1
        return _swap(plan)


def _swap(plan):
    STATS.swaps += 1
    return plan


def _request_build(spec, device: int):
    """The build process's Request for ``spec``'s plan, stored in this process's plan cache; None where there
    is no build process, or no plan cache it could store the plan in for this process to load."""
    bp = build_process.default()
    if bp is None:
        return None
    try:
        pc = _cache(device)
        if pc is None or getattr(pc, "read_only", False):
            return None
        return bp.submit(spec.to_dict(), cache_digest(spec), device, str(pc.path), pc.namespace)
    except Exception as exc:  # noqa: BLE001 - no build process means building here, as without one
        log.debug("cudnn_fuse: no build process for %s: %s", spec.op, exc)
        return None


def _declined(key, exc: UnsupportedError):
    """What serves a spec cuDNN declines: torch's kernels for the same computation where they take it (a
    plan the ops remember, at eager's host cost), else the remembered decline, on which the op runs its
    reference. Keeps the message only: the exception's traceback would pin the caller's frames (and its
    tensors) for the entry's life."""
    spec, device, det = key
    if not det and torch_engine.supports(spec):
        return torch_engine.TorchPlan(spec, device, None, f"torch's kernels: cuDNN has no engine for it ({exc})"[:200])
    return _Declined(str(exc))


class _Declined:
    """A remembered 'cuDNN cannot run this spec'."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


_LRU = PlanLRU()


def get_plan(spec, device: int) -> Plan:
    """The plan of ``spec`` on ``device``: from memory, else loaded or built. Raises UnsupportedError."""
    return _LRU.get(spec, device)


def plans_in_memory() -> list:
    """The built plans this process holds, least recently used first."""
    return _LRU.plans()


def clear() -> None:
    """Forget every in-memory plan (tests; a later cache layer refills it). Their cuDNN objects are
    released here, under each device's handle lock, unless this thread's stream is capturing."""
    FAST.clear()
    _LRU.clear()
    _KNOWN_FAMILIES.clear()
    handles.drain_all()


def _release_at_exit() -> None:
    """Drop the process's plans while the interpreter, CUDA and cuDNN are all still up.

    cudnn-frontend's objects (graphs, tensors, plans) still alive when its extension module
    is torn down are reported on stderr by nanobind as leaked instances, dozens of lines
    after a run that built plans; freed here, they are destroyed normally instead. Plans the
    collection finds are released in it, not buried: a graveyard left to the interpreter's teardown
    would be destroyed after CUDA and cuDNN are gone (the likely reading of a segmentation fault in
    the final collection of a GPU pytest run)."""
    try:
        handles.exiting()
        clear()
        gc.collect()
    except Exception as exc:  # noqa: BLE001 - exit must go on whatever a destructor raised
        log.debug("releasing plans at exit: %s: %s", type(exc).__name__, exc)


atexit.register(_release_at_exit)
