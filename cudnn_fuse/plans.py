"""Built cuDNN plans: one build per (spec, device), kept in a bounded LRU.

``get_plan(spec, device)`` returns a ``Plan`` or raises ``UnsupportedError``
(remembered too, so an unsupported spec costs one build attempt, not one per
call). ``Plan.run(buffers)`` executes through the ordered path on torch's
current stream with a workspace from torch's caching allocator.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from . import envvars, launch_graphs
from .builders import uids_of
from .errors import UnsupportedError
from .spec import ConvSpec, MatmulSpec, RecomputeGradSpec

log = logging.getLogger(__name__)

DEFAULT_CAPACITY = envvars.number(envvars.MAX_PLANS, 1024, minimum=1, integer=True)

# Launch through cudnn-frontend 1.32's raw-pointer entry point (private, pinned with the frontend
# version; several microseconds less host time than the public ordered execute, docs/launch.md).
# Any plan it cannot describe, or a frontend without it, keeps the public path.
RAW_EXECUTE = True

# The ops' per-signature memo (ops.py): (op, operand metadata, attributes) -> a
# launcher bound to a plan. Lives here so that ``clear()`` forgets both together.
FAST: dict = {}
FAST_CAPACITY = 4096
# cuDNN heuristic modes whose ranked engine configs become the candidates (the first that builds
# is the heuristic plan; the autotuner times them all). Mode B offered the same configs.
HEUR_MODES = ("A", "FALLBACK")

_det_algorithms = getattr(torch._C, "_get_deterministic_algorithms", None) or torch.are_deterministic_algorithms_enabled
_det_cudnn = getattr(torch._C, "_get_cudnn_deterministic", None) or (lambda: bool(torch.backends.cudnn.deterministic))


class _Mode(threading.local):
    det = None  # this thread's pinned mode (pinned_mode), or None: torch's flags


_mode = _Mode()


def deterministic() -> bool:
    """Whether torch asks for deterministic kernels: ``torch.use_deterministic_algorithms(True)``
    or ``torch.backends.cudnn.deterministic = True`` (which torch's own cuDNN convs honour), since a
    plan chosen under one setting must not serve the other.

    While this thread looks a plan up (``pinned_mode``), the answer is the mode pinned for that
    lookup: the plan LRU's key, the disk cache's key, the engine filter, the autotuner's and the
    entry's record then all take the one mode read once (or the one the caller's memo key holds),
    whatever another thread switches meanwhile. The memos read torch's C getters themselves
    (``_det_algorithms() or _det_cudnn()``) and pin what they read for the lookup they key."""
    det = _mode.det
    return (_det_algorithms() or _det_cudnn()) if det is None else det


class pinned_mode:
    """Within the block, ``deterministic()`` answers ``det`` in this thread (None: the mode now, read
    once; an outer pin stands). ``as`` gives the mode pinned."""

    __slots__ = ("det", "_old")

    def __init__(self, det=None):
        self.det = det

    def __enter__(self) -> bool:
        self._old = _mode.det
        _mode.det = det = bool(self.det) if self.det is not None else deterministic()
        return det

    def __exit__(self, *exc) -> None:
        _mode.det = self._old


@dataclass
class _Stats:
    builds: int = 0
    build_failures: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    fallbacks: int = 0
    loads: int = 0
    rebuilds: int = 0
    build_seconds: float = 0.0
    load_seconds: float = 0.0  # whole loads; of which:
    cache_get_seconds: float = 0.0  # reading + verifying entries
    deserialize_seconds: float = 0.0  # cuDNN deserialize + plan set-up
    autotune_seconds: float = 0.0

    def snapshot(self) -> dict:
        return dict(self.__dict__)


STATS = _Stats()


def plan_stats() -> dict:
    """Counters of this process: builds, hits, misses, evictions, fallbacks, build_seconds, the
    launch graphs' captures, replays and failures (launch_graphs.py), the autotuner's checked
    spin (``tune_*``: autotune.spin_stats)."""
    from . import autotune

    return {**STATS.snapshot(), **launch_graphs.STATS.snapshot(), **autotune.spin_stats()}


# ---------------------------------------------------------------- handles


@dataclass
class _Handle:
    handle: object
    stream: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


_handles: dict[int, _Handle] = {}
_handles_lock = threading.Lock()


def handle_for(device: int) -> _Handle:
    """The one cuDNN handle of ``device`` (created on first use)."""
    h = _handles.get(device)
    if h is None:
        import cudnn

        with _handles_lock:
            h = _handles.get(device)
            if h is None:
                with torch.cuda.device(device):
                    h = _handles[device] = _Handle(cudnn.create_handle())
    return h


# ---------------------------------------------------------------- releases kept out of captures

# cudnn-frontend 1.32 names the hazard (cudnn/_pygraph.py): a cuDNN release timed by the garbage collector
# "inside someone else's stream capture, poisons every later launch". (The threaded faults the H200 showed
# on 2026-12-04 had another cause, a side stream taken from torch's pool: docs/decisions.md, "The side
# stream is no pool stream"; this guard stays for the hazard the frontend names.) Python frees a plan where
# its last reference goes (an LRU eviction, ``clear()``, a memo replaced in another thread) or where the
# garbage collector runs, so:
# - a dropped Plan's cuDNN objects wait in ``_graveyard`` until a thread holds the device's handle lock
#   outside any capture (every capture of ours holds that lock): ``_drain``;
# - the garbage collector does not run while a capture of ours is open (``no_gc``), and no capture opens
#   while a collection that started before is still running in another thread (its finalizers may
#   release the GIL mid-way): that launch goes raw and the pointer set is captured at a later sighting.
_graveyard: dict[int, list] = {}  # device -> [(graph, raw launcher, graph set), ...] of dropped plans (bury)
_gc_lock = threading.Lock()  # no_gc's count of open blocks and the collector's state before the first
_gc_depth = 0
_gc_was_enabled = True
_collecting = [0]  # garbage collections running now, in any thread (gc.callbacks)
_exiting = False  # set by _release_at_exit: nothing is buried any more


def _gc_phase(phase: str, info: dict) -> None:
    _collecting[0] = max(0, _collecting[0] + (1 if phase == "start" else -1))


gc.callbacks.append(_gc_phase)


# A caller's own capture (torch.cuda.graph around cf ops) is not under the handle lock: a launch of ours
# that finds its stream capturing notes that stream, and nothing is released on the device until every
# noted stream has ended its capture (torch's default capture mode, "global", fails a capture at any
# thread's unsafe CUDA call, a release's among them).
_caller_captures: dict[int, dict] = {}  # device -> {stream a launch of ours found capturing: how many times}


def _note_capture(device: int, stream: int) -> None:
    noted = _caller_captures.setdefault(device, {})
    noted[stream] = noted.get(stream, 0) + 1  # counted: _caller_capture_open forgets a stream only unchanged


def _stream_capturing(stream: int) -> bool:
    """Whether ``stream`` (a raw CUstream) is capturing now; False for a stream that is gone."""
    drv = launch_graphs._driver  # bound by the first launch graph (not bound here: that may switch graphs off)
    if drv is not None and getattr(drv, "queries_capture", False):
        return drv.stream_capturing(stream)
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        return bool(_capturing())


def _caller_capture_open(device: int) -> bool:
    noted = _caller_captures.get(device)
    if not noted:
        return False
    for stream, seen in list(noted.items()):
        try:
            still = _stream_capturing(stream)  # the driver's query releases the GIL
        except Exception:  # noqa: BLE001 - a stream that cannot be asked is taken as ended
            still = False
        if not still and noted.get(stream) == seen:  # not noted again meanwhile (a new capture's first launch)
            noted.pop(stream, None)
    return bool(noted)


def _drain(device: int) -> None:
    """Release the dropped plans' cuDNN objects of ``device``. The caller holds its handle's lock and
    is not capturing; a caller's capture still open on the device (``_note_capture``) defers it."""
    dead = _graveyard.get(device)
    if dead and _caller_captures.get(device) and _caller_capture_open(device):
        return
    while dead:
        try:
            dead.pop()
        except IndexError:  # another thread emptied it meanwhile
            break


def bury(device: int, *objs) -> None:
    """Keep cuDNN objects (a graph a build or deserialize gave up on, a dropped plan's) alive until a
    thread holds ``device``'s handle lock outside any capture (``_drain``)."""
    kept = tuple(o for o in objs if o is not None)
    if kept and not _exiting:  # at exit they go now, in the exit's own collection (_release_at_exit)
        _graveyard.setdefault(device, []).append(kept)


def released() -> int:
    """How many dropped plans' cuDNN objects wait to be released (tests)."""
    return sum(len(v) for v in _graveyard.values())


@contextlib.contextmanager
def no_gc():
    """The garbage collector off for the block (nested and concurrent blocks counted), then back to
    what it was: no cuDNN object it would free is released while a capture of ours is open."""
    global _gc_depth, _gc_was_enabled
    with _gc_lock:
        if _gc_depth == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0 and _gc_was_enabled:
                gc.enable()


@contextlib.contextmanager
def held(h: _Handle, device: int):
    """``h`` (a device's shared handle) locked and bound to the device's side stream, for work that
    uses the handle without launching a caller's kernels: building a plan (validate, heuristics,
    check_support, finalize), the frontend's deserialize (whose warm-up captures one execute on the
    handle's stream) and rebuilding a recorded engine. cuDNN asks that a handle not be used by two
    threads at once, and the handle stays bound to the stream of the last launch, which may be
    another thread's, even one that is capturing: the side stream is launched to by no one (cf's own
    stream, not one of torch's pool: ``_side_stream``; launch graphs capture there, under this same
    lock). Not reentrant: nothing under it takes the lock."""
    import cudnn

    with h.lock, no_gc():  # the deserialize's warm-up is a capture
        _drain(device)
        side = _side_stream(device)
        if h.stream != side:
            cudnn.set_stream(handle=h.handle, stream=side)
            h.stream = side
        yield h


# ---------------------------------------------------------------- build


def _is_decline(exc: BaseException) -> bool:
    import cudnn

    return isinstance(exc, (cudnn.cudnnGraphNotSupportedError, NotImplementedError, ValueError, RuntimeError))


def barred_engines(spec) -> frozenset:
    """Engine ids that cuDNN offers for ``spec``'s graph but that compute it wrongly (measured on
    cuDNN 9.19 / H200; engine ids are per kind of graph, so a GEMM's eng0 is not a conv's).

    - GEMM eng0 (a GEMM with its epilogue, ranked first where there is no bias) runs leaky_relu
      as a plain ReLU, the slope dropped (20% off at 0.2, bench/results/leaky_probe.json), and
      GELU as its tanh approximation (22% off at z = -3.4, bench/results/act_range_probe.json).
    - conv eng0 (the one float32 engine without tensor cores for a conv with a bias) returns NaN
      for tanh past z ~ 44 ((e^2z - 1) / (e^2z + 1) overflowing, act_range_probe.json); with no
      other engine the op falls back to PyTorch, logged.
    - conv eng8 in the recompute graph of a conv's activation backward (conv fprop + bias +
      act' * dy, backward.recompute_grad: silu, sigmoid, GELU...). The heuristics rank it first
      for a grouped fp16 conv, and the gradients came out NaN or with a relative error of 60-330
      against float64 in all 12 grouped fp16 cases of bench/results/grouped_grad_probe_before_fix.json
      (silu, sigmoid, GELU; bias or not; 1x1 and 3x3), where the same graphs on eng7 (groups=1) and
      eng4 (bf16) are right and eng8 runs the grouped forward right. Barred from every conv
      recompute graph, grouped or not: nothing measured it right there.

    Found by tests/test_gpu_fuzz.py and tests/test_gpu_optimize_fuzz.py. A barred engine is
    deselected before any candidate is built, skipped by the autotuner, and a cache entry or
    engine record naming it is a miss.
    """
    fwd = getattr(spec, "fwd", spec)
    epi = getattr(fwd, "epilogue", None)
    if epi is None:
        return _NONE_BARRED
    acts = {epi.activation, getattr(spec, "activation", None)}
    if isinstance(fwd, MatmulSpec):
        return _ENG0 if acts & {"leaky_relu", "gelu"} else _NONE_BARRED
    if isinstance(fwd, ConvSpec):
        barred = _ENG0 if "tanh" in acts else _NONE_BARRED
        if isinstance(spec, RecomputeGradSpec):
            barred = barred | _ENG8
        return barred
    return _NONE_BARRED


_NONE_BARRED = frozenset()
_ENG0 = frozenset({0})
_ENG8 = frozenset({8})


def prepare(g, spec) -> None:
    """validate -> operation graph -> ranked candidates (heuristics A, then FALLBACK), minus
    the engines barred for this graph (``barred_engines``), and minus cuDNN's NONDETERMINISTIC
    ones while torch asks for deterministic kernels (``deterministic()``: use_deterministic_algorithms
    or cudnn.deterministic), for heuristic plans as for tuned ones.

    Raises UnsupportedError when cuDNN declines the graph (or has no deterministic engine for it).
    """
    import cudnn

    with _declines_as_unsupported(spec):
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([getattr(cudnn.heur_mode, m) for m in HEUR_MODES])
        barred = barred_engines(spec)
        if barred:
            g.deselect_engines([_bar_name(e) for e in sorted(barred)])
        if deterministic():
            g.deselect_numeric_notes([cudnn.numerical_note.NONDETERMINISTIC])
        if spec.dtype == "float32" and not getattr(spec, "allow_tf32", False):
            # true fp32: keep engines that do not round through TF32 tensor cores
            g.deselect_numeric_notes([cudnn.numerical_note.TENSOR_CORE])


def _bar_name(engine_id: int) -> str:
    """The deselect_engines() pattern of one engine. cuDNN-frontend matches it as a substring of
    each plan's name ("eng<id>" or "eng<id>_k<knob>=<v>..."): "eng0" can only be engine 0 (no
    other id starts with a 0), where "eng1" would also bar eng10-eng19, so any other engine is
    barred as "eng<id>_", which matches its plans with knobs and no other engine's. A plan of it
    without knobs escapes that pattern; finalize() and the autotuner refuse it by its id."""
    if engine_id < 0:
        raise ValueError(f"engine ids are >= 0, got {engine_id}")
    return "eng0" if engine_id == 0 else f"eng{engine_id}_"


def finalize(g, spec) -> None:
    """prepare, then build the first candidate that builds (heuristic choice); a knob-less plan
    of a barred engine (which the deselect pattern cannot name, ``_bar_name``) is refused."""
    prepare(g, spec)
    with _declines_as_unsupported(spec):
        g.check_support()
        g.build_plans()
    barred = barred_engines(spec)
    if barred:
        try:
            engine_id = int(g.get_engine_and_knobs_at_index(g._plan_index)[0])
        except Exception:  # noqa: BLE001 - no engine record: the deselect pattern stands
            return
        if engine_id in barred:
            raise UnsupportedError(f"{spec.op}: cuDNN's pick is a plan of engine {engine_id} without knobs, which "
                                   "computes this graph wrongly (plans.barred_engines)")


@contextlib.contextmanager
def _declines_as_unsupported(spec):
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - cuDNN raises several types for "cannot"
        if not _is_decline(exc):
            raise
        raise UnsupportedError(f"cuDNN declined {spec.op}: {type(exc).__name__}: {exc}") from exc


def _engine_name(g) -> str:
    try:
        return str(g.get_plan_name_at_index(g._plan_index))
    except Exception:  # noqa: BLE001 - a name is for logs only
        return "?"


def _raw_launcher(graph, uids, handle):
    """(entry point, slot of each buffer, pointer array, its address, plan index) for
    launching ``graph`` with raw device pointers, or None when this frontend or this
    plan does not offer it (python engines, graph-bound inputs, unknown slots)."""
    if not RAW_EXECUTE:
        return None
    try:
        if getattr(graph, "selected_engine", None) is not None or getattr(graph, "_data_bindings", None):
            return None
        lowered = graph._lowered_graph
        lowered._prepare_variant_pack_template()
        order = [int(u) for u in lowered._get_variant_pack_uids_sorted()]
        if sorted(order) != sorted(uids) or len(set(order)) != len(order):
            return None
        index = -1
        if getattr(graph, "_plans", None):
            cpp = graph._materialize_backend_plan(graph._plan_index).cpp_index
            index = -1 if cpp is None else int(cpp)
        slots = tuple(order.index(u) for u in uids)  # buffer i (roles order) -> pointer slot
        array = (ctypes.c_uint64 * len(order))()
        return lowered._execute_with_raw_ptrs, slots, array, ctypes.addressof(array), len(order), index, \
            int(handle.backend_handle)
    except Exception as exc:  # noqa: BLE001 - private API drift: the public path still works
        log.debug("raw-pointer launch unavailable (%s: %s); using the public execute", type(exc).__name__, exc)
        return None


_workspaces: dict = {}  # (device, stream) -> uint8 tensor, reused by every launch on that stream
_workspace_lock = threading.Lock()  # taken on a miss only: a hit reads the dict without it


_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


def _workspace_ptr(device: int, stream: int, size: int, capturing: bool | None = None) -> tuple:
    """(pointer, keep-alive) of at least ``size`` bytes usable on ``stream``. Launches on
    one stream run in order, so one buffer per stream serves them all; under CUDA graph
    capture it comes from the allocator (the graph's pool) like any captured tensor."""
    if _capturing() if capturing is None else capturing:
        t = torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", device))
        return t.data_ptr(), t
    key = (device, stream)
    t = _workspaces.get(key)
    if t is None or t.numel() < size:
        with _workspace_lock:  # threads on new streams evict at once: one oldest key each, none popped twice
            t = _workspaces.get(key)
            if t is None or t.numel() < size:
                while t is None and len(_workspaces) >= 16:  # many short-lived streams: drop the oldest buffer
                    _workspaces.pop(next(iter(_workspaces)))  # (the allocator frees it in its stream's order)
                t = _workspaces[key] = torch.empty(max(size, 2 * t.numel() if t is not None else size),
                                                   dtype=torch.uint8, device=torch.device("cuda", device))
    return t.data_ptr(), t


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_side_streams: dict = {}  # device -> raw CUstream that launch graphs are captured on (nobody launches there)
_side_lock = threading.Lock()


def _side_stream(device: int) -> int:
    """The stream launch graphs are captured on and builds bind the handle to: one of cf's own, made
    by the driver, never one of torch's pool (which hands each of its 32 streams out again, to any
    thread: a thread launching on the stream of another thread's capture breaks that capture and
    gets its kernels recorded in it instead of run)."""
    s = _side_streams.get(device)
    if s is None:
        with _side_lock:
            s = _side_streams.get(device)
            if s is None:
                try:
                    s = launch_graphs.private_stream(device)
                except (OSError, AttributeError, RuntimeError) as exc:
                    log.warning("cudnn_fuse: no private side stream on cuda:%d (%s): a torch pool stream is used, which "
                                "another thread may be handed too", device, exc)
                    s = torch.cuda.Stream(device).cuda_stream
                _side_streams[device] = s
    return s


def _stream_of(device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream


# torch's C getter itself where it has one: no Python frame per launch (the C memo calls it too)
_current_stream = _raw_stream if _raw_stream is not None else _stream_of


class Plan:
    """A built graph with its fixed uids and workspace size, bound to a device."""

    __slots__ = ("spec", "graph", "uids", "workspace_size", "device", "engine", "_handle", "_ordered", "_raw",
                 "_graphs")

    def __init__(self, spec, graph, device: int, engine: str | None = None):
        self.spec = spec
        self.graph = graph
        self.uids = uids_of(spec)
        self.device = device
        # a deserialized graph has no IR of its operands: it is fed {uid: tensor}
        self._ordered = engine is None
        self._handle = h = handle_for(device)
        with h.lock:  # the frontend may still place the chosen plan in the backend (a handle call)
            self.workspace_size = int(graph.get_workspace_size())
            self.engine = engine if engine is not None else _engine_name(graph)
            self._raw = _raw_launcher(graph, self.uids, h.handle)
        # repeated pointer sets replay as CUDA graphs (launch_graphs.py); None: always raw
        self._graphs = launch_graphs.new_set(spec) if self._raw is not None else None

    def __del__(self):
        # the cuDNN objects wait for a thread that holds the handle's lock outside any capture (_drain)
        try:
            bury(getattr(self, "device", 0), getattr(self, "graph", None), getattr(self, "_raw", None),
                 getattr(self, "_graphs", None))
        except Exception:  # noqa: BLE001 - at interpreter exit the module may be half torn down
            pass

    @property
    def raw(self) -> bool:
        """Whether this plan launches through raw device pointers."""
        return self._raw is not None

    def launch(self, ptrs) -> None:
        """Execute with raw device pointers (``ptrs`` in roles order) on the current
        stream; only for plans with ``raw`` True. A pointer set seen before replays as
        a CUDA graph of this very launch (launch_graphs.py)."""
        device = self.device
        stream = _current_stream(device)
        capturing = stream != 0 and _capturing()  # the legacy default stream (0) is never captured
        if capturing:
            _note_capture(device, stream)
        if self.workspace_size:
            ws, keep = _workspace_ptr(device, stream, self.workspace_size, capturing)
        else:
            ws = keep = 0
        h = self._handle
        graphs = self._graphs
        with h.lock:  # one handle per device: stream switch + launch must not interleave
            if graphs is not None and not capturing and not graphs.off and launch_graphs.ENABLED and \
                    _current_device() == device:
                key = (ws, *ptrs)
                ex = graphs.execs.get(key)
                if ex is not None:  # a replay: the hot path
                    # an int is a graph executable; the rest launch themselves (KernelReplay, SequenceReplay)
                    rc = graphs._drv.launch(ex, stream) if type(ex) is int else ex.launch(stream)
                    if not rc:
                        graphs.reuses += 1
                        launch_graphs.STATS.replays += 1
                        return
                elif graphs.sighted(key):
                    ex = self._capture(graphs, key, ptrs, ws)
                    if ex is not None:
                        rc = graphs._drv.launch(ex, stream) if type(ex) is int else ex.launch(stream)
                        if not rc:
                            launch_graphs.STATS.replays += 1
                            return
                if ex is not None:
                    what = "cuGraphLaunch" if type(ex) is int else \
                        "cuLaunchKernelEx" if type(ex) is launch_graphs.KernelReplay else "a SequenceReplay's launch"
                    self._graph_failed(graphs, launch_graphs.DriverError(f"{what}: {graphs._drv.error_name(rc)}"))
            fn, slots, array, address, n, index, raw_handle = self._raw
            if h.stream != stream:
                import cudnn

                cudnn.set_stream(handle=h.handle, stream=stream)
                h.stream = stream
            for slot, p in zip(slots, ptrs):
                array[slot] = p
            fn(address, n, ws, raw_handle, index)
            if not capturing and _graveyard.get(device):  # under the lock, outside captures: release dropped plans
                _drain(device)
        del keep

    def _capture(self, graphs, key, ptrs, ws):
        """Capture this launch with ``ptrs`` on a side stream; the capture (a KernelReplay, or a graph
        executable's handle), or None (graphs off for this plan) when it cannot be captured. Called
        under the handle lock."""
        import cudnn

        if not launch_graphs.room():
            return None  # the process holds MAX_LIVE graphs: raw until some are dropped
        fn, slots, array, address, n, index, raw_handle = self._raw
        h = self._handle
        side = _side_stream(self.device)

        def work():
            for slot, p in zip(slots, ptrs):
                array[slot] = p
            fn(address, n, ws, raw_handle, index)

        try:
            # nothing is released and no cuDNN stream switch is made while the capture is open
            with torch.cuda.device(self.device), no_gc():
                if _collecting[0]:  # another thread is mid-collection: not now (raw, captured later)
                    return None
                _drain(self.device)
                if h.stream != side:
                    cudnn.set_stream(handle=h.handle, stream=side)
                    h.stream = side
                ex = graphs._drv.capture(side, work, kernel_only=graphs.kernel_only)
        except launch_graphs.NotOneKernel as exc:  # a long kernel's plan replays as its kernel or not at all
            launch_graphs.STATS.declined += 1
            graphs.disable()
            log.debug("cudnn_fuse: %s plan (%s) launches raw: its kernel is long and %s", self.spec.op, self.engine, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - a plan that cannot be captured keeps launching raw
            self._graph_failed(graphs, exc)
            return None
        graphs.add(key, ex)
        return ex

    def _graph_failed(self, graphs, exc) -> None:
        launch_graphs.clear_runtime_error()
        launch_graphs.STATS.failures += 1
        graphs.disable()
        log.info("cudnn_fuse: %s plan (%s) launches without CUDA graphs from now on: %s: %s", self.spec.op,
                 self.engine, type(exc).__name__, exc)

    def run(self, buffers) -> None:
        """Execute on torch's current stream of this plan's device.

        ``buffers``: the operand tensors in ``builders.roles_of(spec)`` order.
        """
        if self._raw is not None:
            self.launch([b.data_ptr() for b in buffers])
            return
        ws = torch.empty(self.workspace_size, dtype=torch.uint8, device=torch.device("cuda", self.device)) if self.workspace_size else None
        stream = torch.cuda.current_stream(self.device).cuda_stream
        if stream != 0 and _capturing():
            _note_capture(self.device, stream)
        h = self._handle
        with h.lock:  # one handle per device: stream switch + launch must not interleave
            if h.stream != stream:
                import cudnn

                cudnn.set_stream(handle=h.handle, stream=stream)
                h.stream = stream
            if self._ordered:
                self.graph.execute(buffers, ws, handle=h.handle, tensor_uids=self.uids)
            else:
                self.graph.execute(dict(zip(self.uids, buffers)), ws, handle=h.handle)


# ---------------------------------------------------------------- LRU


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

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

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
            with self._lock:  # one lock per key while anyone waits on it: one build at a time, even across a clear()
                building = self._building.get(key)
                if building is None:
                    building = self._building[key] = [threading.Lock(), 0]
                building[1] += 1
            try:
                with building[0]:
                    item = self._lookup(key)  # another thread may have built it meanwhile
                    if item is None:
                        STATS.misses += 1
                        try:
                            with pinned_mode(det):  # every read of the mode in the load or build is the key's
                                item = (self._builder or _load_or_build)(spec, device)
                        except UnsupportedError as exc:
                            # keep the message only: the exception's traceback would pin
                            # this caller's frames (and its tensors) for the entry's life
                            item = _Declined(str(exc))
                        self._store(key, item)
                    else:
                        STATS.hits += 1
            finally:
                with self._lock:
                    building[1] -= 1
                    if building[1] == 0 and self._building.get(key) is building:
                        del self._building[key]
        else:
            STATS.hits += 1
        if isinstance(item, _Declined):
            raise UnsupportedError(item.reason)
        return item


class _Declined:
    """A remembered 'cuDNN cannot run this spec'."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


def _load_or_build(spec, device: int):
    from .loader import load_or_build  # the load order (disk cache, rebuild, build) lives there

    return load_or_build(spec, device)


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
    if _graveyard and not (torch.cuda.is_available() and torch.cuda.is_initialized() and _capturing()):
        for device, h in list(_handles.items()):
            with h.lock:
                _drain(device)


def _release_at_exit() -> None:
    """Drop the process's plans while the interpreter, CUDA and cuDNN are all still up.

    cudnn-frontend's objects (graphs, tensors, plans) still alive when its extension module
    is torn down are reported on stderr by nanobind as leaked instances, dozens of lines
    after a run that built plans; freed here, they are destroyed normally instead. Plans the
    collection finds are released in it, not buried: a graveyard left to the interpreter's teardown
    would be destroyed after CUDA and cuDNN are gone (the likely reading of a segmentation fault in
    the final collection of a GPU pytest run on the H200)."""
    global _exiting
    try:
        _exiting = True
        clear()
        gc.collect()
    except Exception as exc:  # noqa: BLE001 - exit must go on whatever a destructor raised
        log.debug("releasing plans at exit: %s: %s", type(exc).__name__, exc)


atexit.register(_release_at_exit)
