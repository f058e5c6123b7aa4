"""A built cuDNN plan bound to a device, and its launch.

``Plan.run(buffers)`` executes through the ordered path on torch's current stream with a workspace
from torch's caching allocator; ``Plan.launch(ptrs)`` takes raw device pointers, and a pointer set
seen before replays its capture (launch_graphs.py). Plans are found, loaded or built by loader.py.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass

import torch

from . import launch_graphs
from .builders import uids_of
from .engines import _engine_name
from .handles import (
    _capturing,
    _collecting,
    _current_device,
    _current_stream,
    _drain,
    _graveyard,
    _note_capture,
    _side_stream,
    bury,
    handle_for,
    no_gc,
)

log = logging.getLogger(__name__)

# Launch through cudnn-frontend 1.32's raw-pointer entry point (private, pinned with the frontend
# version; several microseconds less host time than the public ordered execute, docs/launch.md).
# Any plan it cannot describe, or a frontend without it, keeps the public path.
RAW_EXECUTE = True

# The ops' per-signature memo (ops.py): (op, operand metadata, attributes) -> a
# launcher bound to a plan. Lives here so that ``clear()`` forgets both together.
FAST: dict = {}
FAST_CAPACITY = 4096



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
    family_hits: int = 0  # tuned plans of a new size from its family's tuned engine (no tuning)
    standins: int = 0  # new sizes of a known family served by torch's kernels while their plan waits
    swaps: int = 0  # stand-ins replaced by their built plan
    process_builds: int = 0  # of those, plans the build process built (loaded here, no build in this process)

    def snapshot(self) -> dict:
        return dict(self.__dict__)


STATS = _Stats()


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
