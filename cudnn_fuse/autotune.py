"""Autotuning: time every candidate engine of a graph and keep the fastest.

The selection logic (``select``) is pure Python over injected timing functions,
so it is tested on the CPU with fake timings (the Triton autotuner's habit).
``tune`` wires it to a real cuDNN graph on the GPU: build all candidates, one
run each with pruning, CUDA-event medians for the survivors, a time budget, a
workspace cap and a determinism filter.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

from . import conv_gemm, engines, envvars, torch_engine
from .errors import UnsupportedError
from .handles import held

log = logging.getLogger(__name__)

INF = float("inf")

_enabled: Optional[bool] = None


def set_autotune(enabled) -> None:
    """Turn autotuning of new plans on or off for this process (default: $CUDNN_FUSE_AUTOTUNE).

    ``enabled``: a bool, or one of the words the variable takes ("1"/"true"/"yes"/"on",
    "0"/"false"/"no"/"off", any case); None follows the variable again. Anything else raises
    TypeError (a string such as "no" must not turn tuning on by being truthy)."""
    global _enabled
    if enabled is None or isinstance(enabled, bool):
        _enabled = enabled
        return
    value = envvars.parse_flag(enabled) if isinstance(enabled, str) else None
    if value is None:
        raise TypeError(f"set_autotune: enabled must be a bool or one of {envvars.ON_WORDS + envvars.OFF_WORDS}, "
                        f"got {enabled!r}")
    _enabled = value


def autotune_enabled() -> bool:
    if _enabled is not None:
        return _enabled
    return envvars.flag(envvars.AUTOTUNE, False)


@dataclass
class Config:
    """Autotune limits (env overrides: CUDNN_FUSE_TUNE_BUDGET_S, CUDNN_FUSE_WORKSPACE_CAP)."""

    budget_s: float = envvars.number(envvars.TUNE_BUDGET_S, 10.0)
    prune_factor: float = 2.0
    workspace_cap: int = envvars.number(envvars.WORKSPACE_CAP, 1 << 30, integer=True)
    warmup: int = 3
    repeats: int = 30
    deterministic: Optional[bool] = None  # None: torch's flags (engines.deterministic)
    progress: Optional[Callable[[int, int], None]] = None  # (candidates done, total), e.g. a CLI bar
    # Also time torch's own implementation (cuBLAS + the epilogue, torch_engine.py) of matmul-class
    # graphs; the op runs it where it beats every cuDNN candidate.
    torch_candidate: bool = True
    # Also time a 1x1 stride-1 channels_last conv as the GEMM of its matrix views (conv_gemm.py),
    # itself tuned and cached as a matmul entry; the op runs it where it beats every conv candidate.
    gemm_candidate: bool = True
    # Where torch's time is within this fraction of the cuDNN winner's, the two are timed again
    # alternately, ``runoff_rounds`` rounds, and that decides (settle_torch).
    runoff_margin: float = 0.15
    runoff_rounds: int = 4  # even: ABBA rounds then balance a steady drift exactly
    # A graph whose best first run takes at least ``heat_min_ms`` is run back to back for ``heat_s``
    # (at most a quarter of the budget) before its candidates are timed, so that all of them are
    # timed at the clocks a sustained run settles to, not the first ones at an idle GPU's boost
    # clock (docs/autotune.md, "Timing at a sustained run's clocks"). 0 turns it off.
    heat_s: float = 0.5
    heat_min_ms: float = 0.25
    # A size of a shape family (families.py) near a size the family was tuned at takes that tuning's
    # engine instead of a tuning of its own (loader._from_family); off: every size is tuned.
    per_family: bool = True


DEFAULT_CONFIG = Config()
# A tuning nested in another (a conv's GEMM candidate) runs under this thread's replacement of DEFAULT_CONFIG
# (_sub_progress): a context variable, so that concurrent tunings in other threads neither see nor undo it.
_NESTED: contextvars.ContextVar = contextvars.ContextVar("cudnn_fuse_autotune_nested", default=None)


def current_config() -> "Config":
    """The config a tuning given none runs under: this thread's nested one, else DEFAULT_CONFIG."""
    return _NESTED.get() or DEFAULT_CONFIG


@dataclass
class Candidate:
    index: int
    engine_id: Optional[int] = None
    knobs: dict = field(default_factory=dict)  # knob name -> int
    name: str = ""
    workspace: int = 0
    deterministic: bool = True
    runtime_compiled: Optional[bool] = None  # cuDNN's RUNTIME_COMPILATION behavior note (None: unknown)


@dataclass
class Timing:
    index: int
    name: str
    engine_id: Optional[int]
    knobs: dict
    workspace: int
    runtime_compiled: Optional[bool] = None
    first_ms: float = INF
    median_ms: float = INF
    status: str = "pending"  # timed | pruned | failed | skipped:<why> | budget
    runoff_ms: float = INF  # the cuDNN winner's and torch's timings taken alternately (``settle_torch``)

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("first_ms", "median_ms", "runoff_ms"):
            d[k] = None if not math.isfinite(d[k]) else round(d[k], 6)
        return d


class SkipCandidate(Exception):
    """Raised by a timing function for a candidate that must not run (e.g. its
    workspace, known only once built, is over the cap)."""


def _safe(fn, c) -> tuple[float, Optional[str]]:
    """Run a timing function; a failure scores inf instead of raising."""
    try:
        t = float(fn(c))
        return (t if t >= 0 else INF), None  # NaN or a negative time counts as failure (one pruned every other)
    except SkipCandidate:
        raise
    except Exception as exc:  # noqa: BLE001 - any candidate failure is a score, not an error
        return INF, f"{type(exc).__name__}: {exc}"


def select(
    candidates: Sequence[Candidate],
    run_once: Callable[[Candidate], float],
    time_candidate: Callable[[Candidate], float],
    cfg: Config,
    deterministic: bool = False,
    clock: Callable[[], float] = time.perf_counter,
    heat: Optional[Callable[[Candidate, float], None]] = None,
) -> tuple[Timing, list[Timing]]:
    """Pick the fastest candidate.

    1. skip candidates over the workspace cap, and non-deterministic ones when
       ``deterministic``;
    2. run each once (``run_once`` -> ms); drop those over ``prune_factor`` x
       the best first run so far;
    3. when the best first run is at least ``cfg.heat_min_ms`` and the budget has room,
       ``heat(best, seconds)`` runs it back to back (``heat_gpu``) so the timings that follow all
       see a sustained run's clocks;
    4. time the survivors (``time_candidate`` -> median ms);
    5. stop starting new candidates once ``cfg.budget_s`` is spent (the heat counts) and one has
       run; a budget spent before that leaves the first candidate that runs as the winner.

    Returns (winner, every candidate's Timing). Raises UnsupportedError when no
    candidate produced a finite time.
    """
    t0 = clock()
    timings = [Timing(c.index, c.name, c.engine_id, c.knobs, c.workspace, c.runtime_compiled) for c in candidates]
    live: list[tuple[Candidate, Timing]] = []
    best_first = INF
    total = len(candidates)

    def report(done: int) -> None:
        if cfg.progress is not None:
            cfg.progress(done, total)

    for n, (c, t) in enumerate(zip(candidates, timings)):
        report(n)
        if c.workspace > cfg.workspace_cap:
            t.status = f"skipped:workspace {c.workspace} > cap {cfg.workspace_cap}"
            continue
        if deterministic and not c.deterministic:
            t.status = "skipped:nondeterministic"
            continue
        # the budget stops new candidates once one has run: a budget spent before (0, or a first candidate
        # that failed slowly) had the tuning raise, and the op fall back to PyTorch for the process
        if math.isfinite(best_first) and clock() - t0 > cfg.budget_s:
            t.status = "budget"
            continue
        try:
            t.first_ms, err = _safe(run_once, c)
        except SkipCandidate as why:
            t.status = f"skipped:{why}"
            continue
        t.workspace = c.workspace  # known once built
        if err is not None or not math.isfinite(t.first_ms):
            t.status = "failed" + (f":{err}" if err else "")
            continue
        if t.first_ms > cfg.prune_factor * best_first:
            t.status = "pruned"
            continue
        best_first = min(best_first, t.first_ms)
        live.append((c, t))
    seconds = min(cfg.heat_s, cfg.budget_s / 4)
    if heat is not None and seconds > 0 and live and best_first >= cfg.heat_min_ms \
            and clock() - t0 + seconds < cfg.budget_s:  # never a heat that leaves no time to time
        hottest = min(live, key=lambda ct: ct[1].first_ms)[0]
        try:
            heat(hottest, seconds)
        except Exception as exc:  # noqa: BLE001 - timing without the heat is still timing
            log.debug("autotune: heating the GPU failed (%s); timing without it", exc)
    for c, t in live:
        # a candidate that lost by > prune_factor to a LATER first run is pruned too
        if t.first_ms > cfg.prune_factor * best_first:
            t.status = "pruned"
            continue
        if clock() - t0 > cfg.budget_s:
            t.status = "budget"
            continue
        t.median_ms, err = _safe(time_candidate, c)
        t.status = "timed" if err is None and math.isfinite(t.median_ms) else "failed" + (f":{err}" if err else "")
    report(total)
    timed = [t for t in timings if t.status == "timed"]
    if not timed:
        # budget ran out before any full timing: fall back to the best single run
        firsts = [t for t in timings if math.isfinite(t.first_ms) and t.status in ("budget", "pruned", "timed")]
        if not firsts:
            raise UnsupportedError("autotune: no candidate ran (" + ", ".join(sorted({t.status for t in timings})) + ")")
        winner = min(firsts, key=lambda t: t.first_ms)
        winner.median_ms = winner.first_ms
        return winner, timings
    return min(timed, key=lambda t: t.median_ms), timings


# ----------------------------------------------------------------------------- GPU side


def knobs_to_json(knobs: dict) -> dict:
    return {getattr(k, "name", str(k)): int(v) for k, v in (knobs or {}).items()}


def knobs_from_json(knobs: dict) -> dict:
    import cudnn

    return {getattr(cudnn.knob_type, k): int(v) for k, v in (knobs or {}).items()}


# The host's enqueue rate seen by the last device_ms of this process that queued at least
# SEED_MIN_CALLS calls (us per call: the median interval between its calls, with a margin): the next
# measurement's spin starts from it. A slow or contended host (torch.compile's worker processes,
# data-loader threads) can issue a call slower than the caller's guess. The median and the latest,
# not the mean and the highest: one slow moment (a collection, a first call loading its kernel)
# made the mean of a short timing read up to the cap, and the highest rate seen then set every
# later spin of the process to 1 ms a call (30 ms idle GPU a candidate; the cold start's convs'
# tunings ran to their budget).
_host_us_seen = 0.0
SEED_MIN_CALLS = 4
SPIN_ATTEMPTS = 4
SPIN_MARGIN_MS = 0.05  # a call counts as queued in time if queued this long before the GPU reached it
HOST_US_CAP = 1000.0  # the remembered rate's cap: one slow callable must not lengthen every later spin
# This process's checked-spin measurements (spin_stats): how many, how many measured again behind a
# longer spin, and the device time spent spinning (the GPU idle while the host queues).
_SPIN = {"timings": 0, "respins": 0, "spin_ms": 0.0}


def spin_stats() -> dict:
    """Counters of the checked spin in this process (``tune_*`` keys of ``cf.plan_stats()``): timings
    taken, re-measurements behind a longer spin, device ms spent spinning, and the host rate (us a
    call) that seeds the next spin."""
    return {"tune_timings": _SPIN["timings"], "tune_respins": _SPIN["respins"],
            "tune_spin_ms": round(_SPIN["spin_ms"], 3), "tune_host_us_seen": round(_host_us_seen, 2)}


def device_ms(fn, iters: int, host_us_per_call: float = 100.0) -> list[float]:
    """Device milliseconds of calls of ``fn`` (``iters`` of them, or fewer, see below).

    The GPU is first held busy by a spin kernel long enough for the host to queue
    the calls behind it, so the events time the kernels back to back and not the
    host's launch overhead (which exceeds a small kernel's run time). Whether it was
    long enough is measured, not assumed: a call the host had not finished queueing
    before the GPU reached it (the spin's end, then the calls ahead of it) may have
    waited on the host, and its events timed its launch cost (a 4 us GEMV timed at
    0.25 ms once let torch's candidate "win" a batch-1 linear: docs/autotune.md). Those calls are
    dropped; when more than half
    were, it measures again behind a spin sized from the host's measured rate, up to
    SPIN_ATTEMPTS times (``spin_timed``).
    """
    return spin_timed(lambda i: fn(), iters, host_us_per_call)


def heat_gpu(run: Callable[[], None], seconds: float, clock: Callable[[], float] = time.perf_counter,
             sync: Optional[Callable[[], None]] = None) -> int:
    """Call ``run()`` back to back for about ``seconds`` of wall time, the host never more than 4
    calls ahead of the GPU (synchronized every 4), so the GPU is busy that long; the number of
    calls. Brings a GPU from its idle boost clock to what a sustained run holds (power cap)."""
    if sync is None:
        import torch

        sync = torch.cuda.current_stream().synchronize  # not the device's: see _behind_spin
    end = clock() + seconds
    n = 0
    while True:
        run()
        n += 1
        if n % 4 == 0:
            sync()
            if clock() >= end:
                return n


def spin_timed(call, iters: int, host_us_per_call: float, before=None, base_us: float = 200.0,
               remember: bool = True) -> list[float]:
    """Device ms of ``call(i)`` for i in range(iters), each between CUDA events, queued behind a spin
    of ``base_us`` + ``host_us_per_call`` per call; ``before(i)`` runs ahead of call i, outside its
    events (an L2 flush). The calls the host queued only after the GPU reached them are dropped,
    and the whole is measured again behind a longer spin when over half were (see device_ms).
    ``remember``: seed later spins with the host rate seen here (the tuner's calls; a benchmark's
    callables differ too much)."""
    global _host_us_seen
    if iters < 1:
        return []
    per_call = max(float(host_us_per_call), _host_us_seen if remember else 0.0)
    times: list = []
    clean: list = []
    measured = 0.0
    _SPIN["timings"] += 1
    for attempt in range(SPIN_ATTEMPTS):
        if attempt:
            _SPIN["respins"] += 1
        times, queued, starts, spin_ms = _behind_spin(call, iters, base_us + per_call * iters, before)
        _SPIN["spin_ms"] += spin_ms
        # call i is clean when the host had queued it whole before the GPU reached its start event:
        # the spin's end (no earlier than spin_ms after the host's clock started) plus the calls ahead
        clean = [t for t, q, st in zip(times, queued, starts) if q + SPIN_MARGIN_MS < spin_ms + st]
        measured = 1e3 * queued[-1] / len(queued) if queued else 0.0
        if clean and 2 * len(clean) >= len(times):
            if remember and len(queued) >= SEED_MIN_CALLS:
                _host_us_seen = min(1.5 * _median_interval_us(queued), HOST_US_CAP)
            return clean
        per_call = max(4.0 * measured, 2.0 * per_call)
        log.debug("device_ms: %d of %d calls queued before the GPU reached them (spin %.3f ms); measuring again "
                  "behind a longer spin (%.0f us a call)", len(clean), len(times), spin_ms, per_call)
    log.info("device_ms: the host stayed slower than the GPU's spin over %d attempts (%.1f us a call): these "
             "timings include launch overhead", SPIN_ATTEMPTS, measured)
    return clean or times


def _median_interval_us(queued: Sequence[float]) -> float:
    """The median host time between consecutive calls (us), from their queued times (ms since the
    clock started; the first interval is the first call's, spin launch included)."""
    steps = [b - a for a, b in zip([0.0, *queued[:-1]], queued)]
    return 1e3 * statistics.median(steps)


def _behind_spin(call, iters: int, spin_us: float, before=None) -> tuple[list, list, list, float]:
    """(device ms of each of ``call(0)`` .. ``call(iters - 1)``; host ms from just before the spin's
    launch until each call was queued whole; device ms from the spin's end to each call's start
    event; device ms the spin ran): the calls queued behind a spin of about ``spin_us`` (~2 GHz
    clock; at most 1 s). The clock starts before the launch, so a host held up between launching
    the spin and queueing the calls (another thread holding the GIL) cannot make a late call look
    early."""
    import torch

    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    # this stream's work only: a device-wide synchronize would also touch a stream another thread is
    # capturing into a CUDA graph, and break that capture
    stream = torch.cuda.current_stream()
    stream.synchronize()
    t0 = time.perf_counter()  # before the spin's launch: the spin cannot end before t0 + its run time
    a.record()
    torch.cuda._sleep(int(2e3 * min(spin_us, 1e6)))
    b.record()
    queued = []
    for i, (s, e) in enumerate(events):
        if before is not None:
            before(i)
        s.record()
        call(i)
        e.record()
        queued.append(1e3 * (time.perf_counter() - t0))
    stream.synchronize()
    return [s.elapsed_time(e) for s, e in events], queued, [b.elapsed_time(s) for s, _ in events], a.elapsed_time(b)


def random_buffers(spec, roles, device, sets: int = 1):
    """Fresh random operands for ``spec`` (never zeros), ``sets`` copies for L2 rotation, on CUDA
    device ``device`` (an index) or on ``device`` (a torch.device).

    Drawn from the tuner's own generator (``_generator``), never torch's default one: a tuning runs
    inside the user's first call, so drawing from torch's generator would shift every random number
    the program draws after it (dropout masks, initialisations) by whether the cache was warm; and a
    CUDA graph capture under way in another thread marks torch's default CUDA generator, which then
    refuses draws outside that capture ("Offset increment outside graph capture")."""
    import torch

    dev = device if isinstance(device, torch.device) else torch.device("cuda", device)
    gen = _generator(dev)
    dt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    geo = _geometry(spec)
    out = []
    for _ in range(sets):
        bufs = []
        for r in roles:
            shape, stride, dtype = geo[r]
            t = torch.empty_strided(shape, stride, dtype=dt[dtype], device=dev)
            if r not in _OUTPUT_ROLES:
                t.normal_(0, 0.5 if r != "bias" else 1.0, generator=gen)
            bufs.append(t)
        out.append(bufs)
    return out


_generators: dict = {}  # torch.device -> the tuner's generator there


def _generator(device):
    """The tuner's own generator on ``device``, seeded once per process (so the operands a tuning
    times are the same from run to run). Two threads racing to make it each get a working one."""
    import torch

    g = _generators.get(device)
    if g is None:
        g = torch.Generator(device=device)
        g.manual_seed(0x5EED)
        _generators[device] = g
    return g


_OUTPUT_ROLES = ("y", "o", "amax", "z", "dz", "dbias", "dx", "dw", "dq", "dk", "dv")


def _geometry(spec) -> dict:
    """role -> (shape, strides, dtype) of every operand ``spec``'s graph can take."""
    import dataclasses

    from .spec import ConvSpec, MatmulSpec, SdpaSpec, TensorSpec

    g = {}
    fwd = getattr(spec, "fwd", None)
    if fwd is not None:  # training graphs around a forward (save_z, recompute_grad)
        g = _geometry(fwd)
        for r in ("z", "dy", "src", "dz", "dbias"):
            t = getattr(spec, r, None)
            if t is not None:
                g[r] = (t.shape, t.stride, t.dtype)
        return g
    if not isinstance(spec, (ConvSpec, MatmulSpec, SdpaSpec)):  # the other training specs name operands by role
        for f in dataclasses.fields(spec):
            t = getattr(spec, f.name)
            if isinstance(t, TensorSpec):
                g[f.name] = (t.shape, t.stride, t.dtype)
        return g
    if isinstance(spec, SdpaSpec):
        for r in ("q", "k", "v", "o", "bias"):
            t = getattr(spec, r)
            if t is not None:
                g[r] = (t.shape, t.stride, t.dtype)
        return g
    main = ("x", "w") if isinstance(spec, ConvSpec) else ("a", "b")
    for r in main + ("y",):
        t = getattr(spec, r)
        g[r] = (t.shape, t.stride, t.dtype)
    e = spec.epilogue
    for r in ("bias", "residual"):
        t = getattr(e, r)
        if t is not None:
            g[r] = (t.shape, t.stride, t.dtype)
    ones = (1,) * len(spec.y.shape)
    g["amax"] = (ones, ones, "float32")
    return g


def _working_set_bytes(bufs) -> int:
    return sum(t.untyped_storage().nbytes() for t in bufs)


def tune(g, spec, handle, device: int, uids, roles, cfg: Optional[Config] = None,
         get_plan: Optional[Callable] = None) -> tuple[int, Timing, list[Timing]]:
    """Build and time the candidate plans of the operation graph ``g``.

    ``g`` must have run ``engines.prepare`` (validate, operation graph, candidates). ``handle``: the
    device's shared handle (``handles.handle_for``) or a raw handle of the caller's own. Besides
    cuDNN's candidates, torch's implementation of a matmul-class graph is timed (``torch_candidate``)
    and, given ``get_plan`` (the plan lookup, which tunes and stores the GEMM as a matmul entry of
    its own), a 1x1 conv as the GEMM of its matrix views (``gemm_candidate``).
    Returns (winner index, winner timing, all timings); the winner is built and selected on ``g``
    (``g.serialize()`` then stores it).
    """
    cfg = cfg or current_config()
    deterministic = cfg.deterministic if cfg.deterministic is not None else engines.deterministic()
    timer = _GraphTimer(g, spec, handle, device, uids, roles, cfg)
    candidates = timer.candidates(deterministic)
    try:
        winner, timings = select(candidates, timer.run_once, timer.time_candidate, cfg, deterministic, heat=timer.heat)
    finally:
        timer.workspaces.clear()
    with timer.holding():
        g.build_plan_at_index(winner.index)
    log.info("autotune %s: %d candidates, winner %s %.4f ms", spec.op, len(candidates), winner.name, winner.median_ms)
    if cfg.torch_candidate and not deterministic and torch_engine.supports(spec):
        _time_torch(timer, winner, next(c for c in candidates if c.index == winner.index), timings)
    mspec = conv_gemm.gemm_spec(spec) if cfg.gemm_candidate and get_plan is not None else None
    if mspec is not None:
        def gemm_plan():
            with _sub_progress(cfg, "as a GEMM"):
                return conv_gemm.GemmConvPlan(spec, get_plan(mspec, device))  # tuned (and stored) as a matmul

        timings.append(gemm_timing(gemm_plan, timer.sets, cfg))
        if gemm_wins(winner, timings):
            log.info("autotune %s: as a GEMM %.4f ms beats the conv winner %.4f ms", spec.op,
                     timings[-1].median_ms, winner.median_ms)
    return winner.index, winner, timings


class _GraphTimer:
    """The candidates of one operation graph, built lazily inside the budget (building all of them
    up front took 11 s for one matmul), launched on rotated random operand sets and timed.

    ``handle``: the device's shared handle (its lock and the stream it is bound to), or a raw handle
    of the caller's own. The shared one serves every thread's launches: each timed launch binds it to
    this stream under its lock, as Plan.launch does, so that neither a launch of another thread nor
    this tuning runs on the other's stream; each build (and the candidates' notes, which may place a
    plan in the backend) holds it as handles.held does, on the side stream."""

    def __init__(self, g, spec, handle, device: int, uids, roles, cfg: Config):
        import torch

        self.g, self.spec, self.device, self.uids, self.cfg = g, spec, device, uids, cfg
        self.state = handle if hasattr(handle, "lock") else None
        self.h = self.state.handle if self.state is not None else handle
        self.lock = self.state.lock if self.state is not None else contextlib.nullcontext()
        self.built: set = set()
        self.barred = engines.barred_engines(spec)  # prepare() deselected them; a skip names the reason
        self.workspaces: dict = {}
        self.sets = random_buffers(spec, roles, device, 1)
        ws_bytes = _working_set_bytes(self.sets[0])
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
        if ws_bytes < 2 * l2:  # small working set: rotate input sets so timings don't measure L2
            self.sets += random_buffers(spec, roles, device, min(7, (2 * l2) // max(ws_bytes, 1)))
        self.stream = torch.cuda.current_stream(device).cuda_stream

    def holding(self):
        return held(self.state, self.device) if self.state is not None else contextlib.nullcontext()

    def candidates(self, deterministic: bool) -> list:
        """Every execution plan of the graph as a Candidate, with its engine record and notes."""
        import cudnn

        g, out = self.g, []
        with self.holding():
            if deterministic:
                g.deselect_numeric_notes([cudnn.numerical_note.NONDETERMINISTIC])
            for i in range(g.get_execution_plan_count()):
                c = Candidate(index=i, deterministic=not _has_note(g, i, "NONDETERMINISTIC"),
                              runtime_compiled=_has_note(g, i, "RUNTIME_COMPILATION", kind="behavior", unknown=None))
                try:
                    c.name = str(g.get_plan_name_at_index(i))
                    eid, knobs = g.get_engine_and_knobs_at_index(i)
                    c.engine_id, c.knobs = int(eid), knobs_to_json(knobs)
                except Exception as exc:  # noqa: BLE001 - a candidate we cannot describe is still timed
                    c.name = c.name or f"plan{i}"
                    log.debug("autotune: candidate %d has no engine record: %s", i, exc)
                out.append(c)
        return out

    def build(self, c: Candidate) -> None:
        if c.index in self.built:
            return
        if c.engine_id in self.barred:
            raise SkipCandidate(f"engine {c.engine_id} computes this graph wrongly (engines.barred_engines)")
        with self.holding():
            self.g.build_plan_at_index(c.index)
            c.workspace = int(self.g.get_workspace_size_plan_at_index(c.index))
        self.built.add(c.index)
        if c.workspace > self.cfg.workspace_cap:
            raise SkipCandidate(f"workspace {c.workspace} > cap {self.cfg.workspace_cap}")

    def launch(self, c: Candidate, k: int) -> None:
        import cudnn
        import torch

        ws = self.workspaces.get(c.index)
        if ws is None and c.workspace:
            ws = self.workspaces[c.index] = torch.empty(c.workspace, dtype=torch.uint8,
                                                        device=torch.device("cuda", self.device))
        with self.lock:
            state = self.state
            if state is None or state.stream != self.stream:
                cudnn.set_stream(handle=self.h, stream=self.stream)
                if state is not None:
                    state.stream = self.stream
            self.g.execute_plan_at_index(self.sets[k % len(self.sets)], ws, index=c.index, handle=self.h,
                                         tensor_uids=self.uids)

    def run_once(self, c: Candidate) -> float:
        import torch

        self.build(c)
        self.launch(c, 0)
        torch.cuda.synchronize()
        return device_ms(lambda: self.launch(c, 1), 1)[0]

    def time_candidate(self, c: Candidate) -> float:
        counter = iter(range(10**9))
        for _ in range(self.cfg.warmup):
            self.launch(c, next(counter))
        return statistics.median(device_ms(lambda: self.launch(c, next(counter)), self.cfg.repeats))

    def heat(self, c: Candidate, seconds: float) -> None:
        counter = iter(range(10**9))
        heat_gpu(lambda: self.launch(c, next(counter)), seconds)


def _time_torch(timer: _GraphTimer, winner: Timing, won: Candidate, timings: list) -> None:
    """Time torch's implementation of the graph (torch_engine) and append its Timing; where it is
    close to the cuDNN winner, the two are timed again alternately (settle_torch)."""
    cfg, sets = timer.cfg, timer.sets
    tp = torch_engine.TorchPlan(timer.spec, timer.device)
    counter = iter(range(10**9))

    def run_torch():
        tp.run(sets[next(counter) % len(sets)])

    def torch_median():
        return statistics.median(device_ms(run_torch, cfg.repeats))

    timings.append(torch_timing(run_torch, torch_median, cfg))
    try:
        settle_torch(winner, timings[-1], lambda: timer.time_candidate(won), torch_median, cfg)
    finally:
        timer.workspaces.clear()
    if torch_wins(winner, timings):
        log.info("autotune %s: torch (cuBLAS) %.4f ms beats the cuDNN winner", timer.spec.op, timings[-1].median_ms)


GEMM_INDEX = -2  # the GEMM candidate's index in a tuned conv entry's timings


@contextlib.contextmanager
def _sub_progress(cfg: Config, what: str):
    """While the GEMM's own tuning runs (it reads current_config()), its candidates are reported to
    ``cfg.progress.sub(what)`` (a CLI bar of its own, label and ETA) instead of restarting the
    conv's bar; a progress without ``sub`` is left out of the nested tuning. The replacement is this
    thread's only: it once rebound the module's DEFAULT_CONFIG, and two threads' overlapping tunings
    then left one's nested config in place for every later tuning."""
    prog = cfg.progress
    if prog is None:
        yield
        return
    sub = getattr(prog, "sub", None)
    token = _NESTED.set(dataclasses.replace(current_config(), progress=sub(what) if callable(sub) else None))
    try:
        yield
    finally:
        _NESTED.reset(token)


def gemm_timing(make_plan: Callable[[], object], sets, cfg: Config,
                median_of: Optional[Callable[[Callable[[], None]], float]] = None) -> Timing:
    """The GEMM candidate's Timing: its plan (``make_plan()``, a conv_gemm.GemmConvPlan) run on the
    conv's own operand sets (rotated), warm-up then the median of repeats (``median_of(run)``,
    CUDA events by default) as the conv's candidates get; a GEMM cuDNN declines, or one that
    fails, scores inf."""
    t = Timing(GEMM_INDEX, "gemm", None, {}, 0, runtime_compiled=None)
    if median_of is None:
        def median_of(fn):
            return statistics.median(device_ms(fn, cfg.repeats))
    try:
        plan = make_plan()
        t.name, t.workspace = str(plan.engine), int(plan.workspace_size)
        t.runtime_compiled = _runtime_compiled(getattr(plan, "gemm", plan))
        counter = iter(range(10**9))

        def run():
            plan.run(sets[next(counter) % len(sets)])

        for _ in range(max(1, cfg.warmup)):
            run()
        t.median_ms = t.first_ms = float(median_of(run))
        t.status = "timed" if 0 <= t.median_ms < INF else "failed"
    except Exception as exc:  # noqa: BLE001 - a failing candidate is a score, not an error
        t.status = f"failed:{type(exc).__name__}: {exc}"[:200]
    return t


def _runtime_compiled(plan) -> Optional[bool]:
    """cuDNN's RUNTIME_COMPILATION note of a built plan (None: unknown, e.g. deserialized)."""
    if getattr(plan, "engine", None) == "torch":
        return False
    g = getattr(plan, "graph", None)
    if g is None:
        return None
    try:
        return _has_note(g, g._plan_index, "RUNTIME_COMPILATION", kind="behavior", unknown=None)
    except Exception:  # noqa: BLE001 - a note is a preference, never an error
        return None


def gemm_wins(winner: Timing, timings: Sequence[Timing]) -> bool:
    """Whether the GEMM candidate timed faster than the conv winner (both launch through raw
    pointers, so device time decides at every size)."""
    for t in timings:
        if t.index == GEMM_INDEX:
            return t.status == "timed" and t.median_ms < winner.median_ms
    return False


TORCH_INDEX = -1  # the torch candidate's index in a tuned entry's timings


def torch_timing(run_once: Callable[[], None], median: Callable[[], float], cfg: Config) -> Timing:
    """The torch candidate's Timing: warm-up, then the median of repeats, as the cuDNN
    candidates get; a failure scores inf."""
    t = Timing(TORCH_INDEX, "torch", None, {}, 0, runtime_compiled=False)
    try:
        for _ in range(max(1, cfg.warmup)):
            run_once()
        t.median_ms = t.first_ms = float(median())
        t.status = "timed" if 0 <= t.median_ms < INF else "failed"
    except Exception as exc:  # noqa: BLE001 - a failing candidate is a score, not an error
        t.status = f"failed:{type(exc).__name__}: {exc}"[:200]
    return t


# Host time per call of each path (host_overhead.py on one H100 host): a memoized cuDNN launch 14 us,
# torch's kernels run as eager's expression 38 us. A layer costs whichever of its host and device time is
# longer (the host issues the next launch while the GPU runs this one), so torch's faster kernel pays only
# where it runs longer than its host path; for launch-bound graphs cuDNN's shorter launch wins
# (docs/autotune.md, "Host time and device time").
CUDNN_HOST_MS = 0.014
TORCH_HOST_MS = 0.038
TORCH_TIE = 0.02  # torch's cost must be this fraction lower: a tie keeps the fused cuDNN plan


def torch_cheaper(cudnn_ms: float, torch_ms: float) -> bool:
    """Whether a layer costs less through torch's kernels than through the cuDNN plan, each path's
    cost being the longer of its device time and its host time per call."""
    return max(torch_ms, TORCH_HOST_MS) < max(cudnn_ms, CUDNN_HOST_MS) * (1.0 - TORCH_TIE)


def torch_wins(winner: Timing, timings: Sequence[Timing]) -> bool:
    """Whether the torch candidate costs less than the cuDNN winner (``torch_cheaper``): by the runoff
    where both have one (``settle_torch``), else by their medians."""
    for t in timings:
        if t.index == TORCH_INDEX:
            if t.status != "timed":
                return False
            if math.isfinite(t.runoff_ms) and math.isfinite(winner.runoff_ms):
                return torch_cheaper(winner.runoff_ms, t.runoff_ms)
            return torch_cheaper(winner.median_ms, t.median_ms)
    return False


CHECK_ROUNDS = 4  # a heuristic plan against torch: rounds timed alternately (ABBA), of CHECK_REPEATS runs each
CHECK_REPEATS = 5


def check_against_torch(plan, spec, device: int, roles) -> dict:
    """A heuristic plan timed against torch's own kernels for the same computation (torch_engine),
    alternately on rotated random operands, after a warm-up of both: {"cudnn_ms", "torch_ms",
    "use_torch"}, ``use_torch`` by the rule the autotuner's torch candidate follows (``torch_wins``).
    The price of one new shape's first call: a few milliseconds, paid once per cache."""
    tp = torch_engine.TorchPlan(spec, device)
    sets = random_buffers(spec, roles, device, 2)
    counter = iter(range(10**9))

    def cudnn_once():
        plan.run(sets[next(counter) % 2])

    def torch_once():
        tp.run(sets[next(counter) % 2])

    for _ in range(2):
        cudnn_once()
        torch_once()
    c_ms, t_ms = runoff(lambda: statistics.median(device_ms(cudnn_once, CHECK_REPEATS)),
                        lambda: statistics.median(device_ms(torch_once, CHECK_REPEATS)), CHECK_ROUNDS)
    heur = Timing(0, str(getattr(plan, "engine", "?")), None, {}, 0, median_ms=c_ms, runoff_ms=c_ms, status="timed")
    torch_t = Timing(TORCH_INDEX, "torch", None, {}, 0, median_ms=t_ms, runoff_ms=t_ms, status="timed")
    return {"cudnn_ms": round(c_ms, 6), "torch_ms": round(t_ms, 6), "use_torch": torch_wins(heur, [heur, torch_t])}


def runoff(a: Callable[[], float], b: Callable[[], float], rounds: int) -> tuple:
    """(median of a's, median of b's) over ``rounds`` rounds timed alternately, ABBA: a then b,
    b then a, ... so that a drift across the timings (clocks, temperature) weighs on both alike
    (exactly, for a steady drift and an even number of rounds)."""
    ra, rb = [], []
    for r in range(rounds):
        order = ((a, ra), (b, rb)) if r % 2 == 0 else ((b, rb), (a, ra))
        for fn, out in order:
            out.append(float(fn()))
    return statistics.median(ra), statistics.median(rb)


def settle_torch(winner: Timing, torch_t: Timing, time_winner: Callable[[], float], time_torch: Callable[[], float],
                 cfg: Config) -> bool:
    """Time the cuDNN winner and torch's candidate again, alternately (``runoff``), when their
    medians are within ``cfg.runoff_margin`` of each other on a graph torch may win
    (past TORCH_HOST_MS); the results go to their ``runoff_ms``, which ``torch_wins`` then reads. Whether
    a runoff ran.

    Why: torch's candidate is timed after every cuDNN candidate, which for a long compute-bound
    GEMM run for seconds: two medians taken that far apart carry whatever drifted in between
    (clocks, temperature, other work on the GPU). Seen in the suite (peers core part): an
    autotuned 16384x4096x16384 linear + GELU kept a cuDNN engine of 3.86 ms where torch's eager
    path ran 3.63 ms in the same process."""
    if cfg.runoff_rounds < 1 or torch_t.status != "timed" or not winner.median_ms > TORCH_HOST_MS:
        return False
    if not abs(torch_t.median_ms - winner.median_ms) <= cfg.runoff_margin * winner.median_ms:
        return False
    try:
        w, t = runoff(time_winner, time_torch, cfg.runoff_rounds)
    except Exception as exc:  # noqa: BLE001 - the medians stand
        log.debug("autotune: the runoff against torch failed (%s); the medians decide", exc)
        return False
    if math.isfinite(w) and math.isfinite(t):
        winner.runoff_ms, torch_t.runoff_ms = w, t
        return True
    return False


def _has_note(g, index: int, note: str, kind: str = "numerical", unknown=False):
    import cudnn

    try:  # private in cudnn-frontend 1.32 (pinned); the public deselect filter backs it up
        notes = g._notes_of(g._plans[index], kind)
    except Exception:  # noqa: BLE001
        return unknown
    want = getattr(cudnn.numerical_note if kind == "numerical" else cudnn.behavior_note, note)
    return any(n == want for n in notes)
