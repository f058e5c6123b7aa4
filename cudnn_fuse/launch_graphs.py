"""Repeated raw launches captured once and replayed.

cuDNN's raw-pointer execute is most of the host time of cf's eager call; a replay of the same
launch costs a few microseconds (docs/launch.md). So a plan's launch whose pointer set (every
operand and output, and the workspace) has been seen ``AFTER`` times is captured once into a
CUDA graph and replayed from then on.

Why this is exact: a captured cuDNN execute is its kernel launches with those pointers as
arguments, and the pointer set is the key. A replay therefore runs exactly the launch the
same pointers would have run. Tensor contents are read when the graph runs, as a launch
reads them. No scalar is passed by value (``builders`` puts every scalar into the graph
itself), so nothing else is baked in.

A capture that is one kernel node is not replayed as a graph but launched as that kernel
(``KernelReplay``, cuLaunchKernelEx with the node's function, dimensions, parameters and
attributes): graph launches block the host once a few dozen are queued behind busy GPU work, and
cost a short kernel device time there that a kernel launch does not (docs/launch.md). A chain of
kernels and memsets is launched as those operations in turn (``SequenceReplay``); anything else
replays as a graph.

What it does not do:
- It never captures while torch captures (``cf.capture``, ``torch.cuda.graph``): those
  launches stay raw and become part of the user's graph.
- It does not serve a device other than the current one.
- A capture that fails (an engine that does something capture cannot record) turns graphs
  off for that plan, which keeps launching raw.

The graphs are driven through the CUDA driver API (libcuda, present wherever CUDA runs),
not torch.cuda.CUDAGraph: torch's replay also re-seeds its RNG state on every replay, extra
work that a one-kernel graph would pay per call. On by default; ``CUDNN_FUSE_LAUNCH_GRAPHS=0``
(or ``cf.set_launch_graphs(False)``) turns it off.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
from collections import OrderedDict

from . import envvars
from . import spec as S

log = logging.getLogger(__name__)

ENABLED = envvars.flag(envvars.LAUNCH_GRAPHS, True)  # also cf.set_launch_graphs
AFTER = 3  # sightings of a pointer set before its capture
PER_PLAN = 64  # graphs one plan keeps (least recently used dropped): a model's same-shaped layers share a plan
MAX_LIVE = 8192  # graphs alive in the process, all plans together; past it no new capture
SEEN_CAP = 256  # pointer sets counted per plan before the counts start over
# A capture costs ~100 us or more. Where pointer sets recur only a few times each (intermediates' addresses
# drifting through the allocator's pool), capturing them costs more than their replays save. So past
# CHURN_CAPTURES captures a plan captures again only while its graphs have been reused (replayed after
# the launch that captured them) at least CHURN_REUSES_PER_CAPTURE times per capture on average. A gate,
# not an off switch: captures resume once the reuses catch up.
CHURN_CAPTURES = 32
CHURN_REUSES_PER_CAPTURE = 4
# The gate judges a window of the plan's life, not all of it: a phase of churn (cf.capture's warm-up of a chain
# of 100 calls, each its own pointer set) would otherwise shut captures off for good, and a steady loop after
# it would launch raw forever (its sightings never become reuses). After CHURN_WAIT gated sightings (each one
# a capture the gate refused) a new window opens; each window that does not pay for itself doubles the next
# wait, up to CHURN_MAX_BACKOFF, so a plan whose pointer sets never recur captures ever more rarely.
CHURN_WAIT = 2 * CHURN_CAPTURES
CHURN_MAX_BACKOFF = 1024

CAPTURE_MODE_THREAD_LOCAL = 1  # CU_STREAM_CAPTURE_MODE_THREAD_LOCAL: other threads' CUDA calls are unaffected


class Stats:
    """Process-wide counters (``cf.plan_stats()`` reports them under ``graph_*``)."""

    __slots__ = ("captures", "kernels", "sequences", "replays", "failures", "declined", "live")

    def __init__(self):
        self.captures = self.kernels = self.sequences = self.replays = self.failures = self.declined = self.live = 0

    def snapshot(self) -> dict:
        # declined: long kernels' captures that were not one kernel node (dropped; the plan launches raw)
        # kernels: captures launched directly (KernelReplay or SequenceReplay); sequences: of those, the chains
        return {"graph_captures": self.captures, "graph_kernels": self.kernels, "graph_sequences": self.sequences,
                "graph_replays": self.replays,
                "graph_failures": self.failures, "graph_declined": self.declined, "graph_live": self.live}


STATS = Stats()
# Taken by whatever counts graphs made or destroyed (GraphSet.add, GraphSet.release): captures and releases
# run under their own device's handle lock, so two devices' may run at once, and STATS.live (MAX_LIVE's count)
# must come back to exactly what it was. Replays count without it (the GIL keeps a lone `+= 1` whole; a lock
# there would cost every replay).
_count_lock = threading.Lock()


class DriverError(RuntimeError):
    pass


class NotOneKernel(Exception):
    """A capture asked to be one kernel (``kernel_only``) was not: its graph is dropped and the plan
    launches raw (a long kernel's launches replay only as their kernel, never as a graph)."""


# ------------------------------------------------------- a one-kernel graph, launched as its kernel
#
# A graph launch costs the host more than the kernel launch it holds, and once a few dozen graph launches
# are queued behind busy GPU work the next one waits for the GPU, where kernel launches queue ~1000
# (docs/launch.md). So a captured
# graph that is one kernel node is not instantiated: its kernel is launched directly, with the node's
# function, grid, block, shared memory, parameters (the node's own copy, kept alive with the graph) and
# launch attributes. That is the launch the capture recorded, as a graph replay is. Graphs of more than
# one node (a memset before the kernel, several kernels) replay as SequenceReplay where they are a chain,
# else as graphs.


class _KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint),
                ("bx", ctypes.c_uint), ("by", ctypes.c_uint), ("bz", ctypes.c_uint), ("smem", ctypes.c_uint),
                ("kernelParams", ctypes.c_void_p), ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p),
                ("ctx", ctypes.c_void_p)]


class _AttrValue(ctypes.Union):  # CUlaunchAttributeValue (64 bytes)
    _fields_ = [("bytes", ctypes.c_ubyte * 64), ("words", ctypes.c_uint64 * 8)]


class _LaunchAttr(ctypes.Structure):  # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("_pad", ctypes.c_ubyte * 4), ("value", _AttrValue)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint), ("bx", ctypes.c_uint),
                ("by", ctypes.c_uint), ("bz", ctypes.c_uint), ("smem", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("numAttrs", ctypes.c_uint)]


NODE_TYPE_KERNEL = 0  # CU_GRAPH_NODE_TYPE_KERNEL
NODE_TYPE_NAMES = ("kernel", "memcpy", "memset", "host", "graph", "empty", "wait_event", "event_record",
                   "ext_semaphore_signal", "ext_semaphore_wait", "mem_alloc", "mem_free", "batch_mem_op", "conditional")
# The kernel-node attributes (CUlaunchAttributeID) a direct launch carries over when set: access policy
# window 1, cooperative 2, cluster dimension 4, cluster scheduling policy 5, priority 8, memory sync domain
# map 9 and domain 10, preferred cluster dimension 11, shared memory carveout 14. Cooperative and the
# cluster dimension change what a kernel computes: a node whose values of those cannot be read is not
# launched directly. The others are placement and scheduling hints, carried when readable.
NODE_ATTRS = (1, 2, 4, 5, 8, 9, 10, 11, 14)
REQUIRED_ATTRS = (2, 4)
# A captured node carries values a plain launch would get anyway: the stream's own access policy window,
# priority and memory sync domain (map) (what the node inherited from the capture stream), and a cluster of
# one block with its scheduling policy (every block of a launch without clusters is a cluster of one).
# Those are left out of the direct launch (``trim_attrs``): a launch
# with a stream's values on that stream, or a 1x1x1 cluster for a kernel that does not insist on one, is
# the launch without them. Left out, a retargeted launch gets the new stream's values, as the raw launch
# would.
STREAM_ATTRS = (1, 8, 9, 10)  # CUlaunchAttributeID values that are also CUstreamAttrID values
FUNC_CLUSTER_SIZE_MUST_BE_SET = 10  # CU_FUNC_ATTRIBUTE_CLUSTER_SIZE_MUST_BE_SET

# A capture that is a chain of kernel and memset nodes (a memset before the kernel: SDPA's and AMAX's, some
# convs' forward, dz and dgrad; a kernel and its reduction) is launched as those operations in turn
# (SequenceReplay).
MAX_SEQUENCE = 8  # nodes in a chain launched one by one; a longer graph replays as a graph
NODE_TYPE_MEMSET = 2
# Programmatic dependent launch: a kernel launched with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
# (6) may start once the kernel before it triggers (griddepcontrol.launch_dependents) and waits for that
# kernel's results in its own code (cudaGridDependencySynchronize). Captured, that is an edge of type
# PROGRAMMATIC (1) from the earlier kernel's PROGRAMMATIC port (1), which the plain edge query cannot report
# (CUDA_ERROR_LOSSY_QUERY when it fills the arrays): cuDNN's split-K wgrad on Hopper is three kernels
# chained so, declined for that until the edges were read with their data. Such an edge is
# replayed as the launch that made it, the dependent kernel launched with attribute 6 set; an edge from the
# LAUNCH_ORDER port (2) is replayed as a plain stream dependency, a stronger order whose grid-dependency wait
# returns at once. Anything else about an edge declines the sequence.
ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6
EDGE_TYPE_PROGRAMMATIC = 1
PORT_PROGRAMMATIC, PORT_LAUNCH_ORDER = 1, 2
CUDA_ERROR_LOSSY_QUERY = 402


class _EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


def _unit_cluster(value) -> bool:
    """Whether a cluster-dimension attribute value is one block (x = y = z = 1)."""
    w0, w1 = value.words[0], value.words[1]
    return (w0 & 0xFFFFFFFF, w0 >> 32, w1 & 0xFFFFFFFF) == (1, 1, 1)


# The memoized op call in C (cudnn_fuse/_native.c, built by setup.py where a C compiler is): it launches a
# KernelReplay's kernel itself. Optional: without it, or with CUDNN_FUSE_NATIVE=0, everything runs in Python.
try:
    from . import _native
except ImportError as exc:  # not built (no compiler at install time), or built for another Python
    _native = None
    log.debug("cudnn_fuse._native is not available (%s): the ops' memoized calls run in Python", exc)
NATIVE = _native is not None and envvars.flag(envvars.NATIVE, True)
_KernelBase = _native.KernelLaunch if _native is not None else object


class KernelReplay(_KernelBase):
    """A captured one-kernel graph's kernel, launched directly (cuLaunchKernelEx). Holds the graph,
    whose node owns the kernel's parameter values; ``Driver.destroy`` frees it. Where the native
    module is built, the same launch is bound for C too (``_native.KernelLaunch``): the ops' memoized
    calls launch it from there, with a copy of this config on their stream."""

    __slots__ = ("graph", "attrs", "cfg", "cfg_ref", "stream", "_launch", "_func", "_params", "_extra")

    def __init__(self, launch, graph, func, node: _KernelNodeParams, attrs, stream: int):
        """``launch``: cuLaunchKernelEx without a prototype (``_bare``): it is called with ready ctypes
        objects, which ctypes passes on unconverted."""
        self._launch, self.graph = launch, graph
        self._func, self._params = ctypes.c_void_p(func), ctypes.c_void_p(node.kernelParams)
        self._extra = ctypes.c_void_p(node.extra) if node.extra else None
        self.attrs = (_LaunchAttr * max(1, len(attrs)))()
        for i, (aid, value) in enumerate(attrs):
            self.attrs[i].id = aid
            ctypes.memmove(ctypes.byref(self.attrs[i].value), ctypes.byref(value), ctypes.sizeof(_AttrValue))
        self.cfg = _LaunchConfig(node.gx, node.gy, node.gz, node.bx, node.by, node.bz, node.smem, stream,
                                 self.attrs, len(attrs))
        self.cfg_ref = ctypes.byref(self.cfg)
        self.stream = stream
        if _native is not None and isinstance(launch, ctypes._CFuncPtr):  # a stand-in in Python stays unbound
            self._bind(ctypes.cast(launch, ctypes.c_void_p).value, ctypes.addressof(self.cfg),
                       ctypes.sizeof(_LaunchConfig), _LaunchConfig.hStream.offset, func, node.kernelParams or 0,
                       node.extra or 0)

    def launch(self, stream: int) -> int:
        """Launch the kernel on ``stream``; the CUresult."""
        if stream != self.stream:
            self.cfg.hStream = stream
            self.stream = stream
        return self._launch(self.cfg_ref, self._func, self._params, self._extra)

    @property
    def func(self) -> int:
        return self._func.value

    @property
    def params(self) -> int:
        return self._params.value

    @property
    def attribute_ids(self) -> list:
        return [self.attrs[i].id for i in range(self.cfg.numAttrs)]


class _MemsetNodeParams(ctypes.Structure):  # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [("dst", ctypes.c_uint64), ("pitch", ctypes.c_size_t), ("value", ctypes.c_uint),
                ("elementSize", ctypes.c_uint), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]


_MEMSET_VALUE = {1: ctypes.c_ubyte, 2: ctypes.c_ushort, 4: ctypes.c_uint}  # element size -> value type


class MemsetStep:
    """A captured memset node, launched as the driver's memset on a stream: cuMemsetD{8,16,32}Async
    (one row) or cuMemsetD2D{8,16,32}Async (``height`` rows ``pitch`` bytes apart), ``width`` elements
    of ``elementSize`` bytes set to ``value``."""

    __slots__ = ("_fn", "_args")

    def __init__(self, fns: dict, p: _MemsetNodeParams):
        """``fns``: {(element size, 2D?): bound memset function}."""
        rows = max(1, p.height)
        self._fn = fns[(p.elementSize, rows > 1)]
        value = _MEMSET_VALUE[p.elementSize](p.value)  # the type the function's prototype takes
        if rows > 1:
            self._args = (ctypes.c_uint64(p.dst), ctypes.c_size_t(p.pitch), value, ctypes.c_size_t(p.width),
                          ctypes.c_size_t(rows))
        else:
            self._args = (ctypes.c_uint64(p.dst), value, ctypes.c_size_t(p.width))

    def launch(self, stream: int) -> int:
        return self._fn(*self._args, stream)  # the prototype's c_void_p takes the int as it is


class SequenceReplay:
    """A captured graph that is a chain of kernel and memset nodes, launched as those operations in
    the chain's order on one stream (what the graph's edges order). Holds the graph, whose kernel nodes
    own their parameter values; ``Driver.destroy`` frees it."""

    __slots__ = ("graph", "steps")

    def __init__(self, graph, steps):
        self.graph, self.steps = graph, tuple(steps)

    def launch(self, stream: int) -> int:
        """Launch every step on ``stream`` in turn; the first failing step's CUresult, or 0. A step
        that fails leaves the later ones unlaunched: the caller then runs the whole op raw."""
        for step in self.steps:
            rc = step.launch(stream)
            if rc:
                return rc
        return 0

    @property
    def kinds(self) -> list:
        return ["kernel" if isinstance(st, KernelReplay) else "memset" for st in self.steps]


def _bare(lib, name: str):
    """``name`` of ``lib`` with no argument prototype, as its own function object (a CDLL's attribute is
    shared with every other user of that library handle). Called with ready ctypes objects, which ctypes
    passes on unconverted: a call costs 0.32 us against 0.48 with a POINTER(struct) prototype and an
    integer argument converted per call (CPU host, 4-argument libc stand-in)."""
    f = lib[name] if isinstance(lib, ctypes.CDLL) else getattr(lib, name)
    f.restype = ctypes.c_int
    return f


class Driver:
    """The CUDA driver entry points of one-kernel graphs, through ctypes: capture, instantiate,
    launch, destroy, and the node queries and kernel launch of ``KernelReplay`` (optional: a driver
    without them replays every capture as a graph)."""

    def __init__(self, lib=None):
        lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
        vp, P = ctypes.c_void_p, ctypes.POINTER

        def fn(name, *args):
            f = getattr(lib, name)
            f.argtypes, f.restype = list(args), ctypes.c_int
            return f

        self._begin = fn("cuStreamBeginCapture_v2", vp, ctypes.c_int)
        self._end = fn("cuStreamEndCapture", vp, P(vp))
        self._instantiate = fn("cuGraphInstantiateWithFlags", P(vp), vp, ctypes.c_ulonglong)
        self.launch = fn("cuGraphLaunch", vp, vp)  # (exec, stream) -> CUresult; the hot path calls it directly
        self._exec_destroy = fn("cuGraphExecDestroy", vp)
        self._graph_destroy = fn("cuGraphDestroy", vp)
        self._name = getattr(lib, "cuGetErrorName", None)
        self._is_capturing = getattr(lib, "cuStreamIsCapturing", None)
        if self._is_capturing is not None:
            self._is_capturing.argtypes, self._is_capturing.restype = [vp, P(ctypes.c_int)], ctypes.c_int
        if _native is not None and isinstance(lib, ctypes.CDLL):  # the C memo's capture test (a real driver only)
            try:
                _native.set_driver(ctypes.cast(lib.cuStreamIsCapturing, ctypes.c_void_p).value)
            except AttributeError:
                pass
        self.kernels = True  # one-kernel captures launched as their kernel; False where the driver cannot
        self._stream_attr = self._func_attr = None  # bound with the kernel entry points (trim_attrs)
        self.sequences = False  # chains of kernels and memsets launched one by one (bound below)
        self._edges = self._edges_v2 = self._memset_params = None
        self._memsets: dict = {}
        try:  # every capture's node count is checked (an empty capture is refused), replays or not
            self._nodes = fn("cuGraphGetNodes", vp, vp, P(ctypes.c_size_t))
        except AttributeError:
            self._nodes = None
        if self.kernels:
            try:
                if self._nodes is None:  # bound above for every capture's node count
                    raise AttributeError("cuGraphGetNodes")
                self._node_type = fn("cuGraphNodeGetType", vp, P(ctypes.c_int))
                try:
                    self._node_params = fn("cuGraphKernelNodeGetParams_v2", vp, P(_KernelNodeParams))
                except AttributeError:
                    self._node_params = fn("cuGraphKernelNodeGetParams", vp, P(_KernelNodeParams))
                self._node_attr = fn("cuGraphKernelNodeGetAttribute", vp, ctypes.c_int, P(_AttrValue))
                self._launch_kernel = _bare(lib, "cuLaunchKernelEx")
                self._stream_attr = getattr(lib, "cuStreamGetAttribute", None)
                if self._stream_attr is not None:
                    self._stream_attr.argtypes, self._stream_attr.restype = [vp, ctypes.c_int, P(_AttrValue)], ctypes.c_int
                self._func_attr = getattr(lib, "cuFuncGetAttribute", None)
                if self._func_attr is not None:
                    self._func_attr.argtypes, self._func_attr.restype = [P(ctypes.c_int), ctypes.c_int, vp], ctypes.c_int
                try:
                    self._kernel_function = fn("cuKernelGetFunction", P(vp), vp)
                except AttributeError:
                    self._kernel_function = None
                self._bind_sequences(lib, fn)
            except AttributeError as exc:
                log.info("launch graphs replay as graphs: this driver lacks %s", exc)
                self.kernels = False

    def _bind_sequences(self, lib, fn) -> None:
        """The entry points of SequenceReplay (edges, memset nodes, the memsets); a driver that lacks
        one launches such captures as graphs."""
        vp, P = ctypes.c_void_p, ctypes.POINTER
        try:
            self._edges = fn("cuGraphGetEdges", vp, vp, vp, P(ctypes.c_size_t))
            try:  # CUDA 12.3+: the edges with their data (programmatic dependencies)
                self._edges_v2 = fn("cuGraphGetEdges_v2", vp, vp, vp, vp, P(ctypes.c_size_t))
            except AttributeError:
                self._edges_v2 = None
            self._memset_params = fn("cuGraphMemsetNodeGetParams", vp, P(_MemsetNodeParams))
            u64, sz = ctypes.c_uint64, ctypes.c_size_t
            for size, suffix in ((1, "8"), (2, "16"), (4, "32")):
                value = _MEMSET_VALUE[size]
                self._memsets[(size, False)] = fn(f"cuMemsetD{suffix}Async", u64, value, sz, vp)
                self._memsets[(size, True)] = fn(f"cuMemsetD2D{suffix}Async", u64, sz, value, sz, sz, vp)
        except AttributeError as exc:
            log.info("launch graphs: node sequences off, this driver lacks %s", exc)
            self._edges = self._edges_v2 = self._memset_params = None
            self._memsets = {}
            return
        self.sequences = True

    @property
    def queries_capture(self) -> bool:
        """Whether this driver has ``cuStreamIsCapturing`` (``stream_capturing`` can answer)."""
        return self._is_capturing is not None

    def stream_capturing(self, stream: int) -> bool:
        """Whether ``stream`` is capturing (active or invalidated, as torch counts it); False for a
        stream the driver does not know (one that was destroyed)."""
        if self._is_capturing is None:
            raise AttributeError("cuStreamIsCapturing")
        status = ctypes.c_int(0)
        return self._is_capturing(stream, ctypes.byref(status)) == 0 and status.value != 0

    def error_name(self, rc: int) -> str:
        if self._name is not None:
            s = ctypes.c_char_p()
            try:
                if self._name(ctypes.c_int(rc), ctypes.byref(s)) == 0 and s.value:
                    return s.value.decode()
            except Exception:  # noqa: BLE001 - a name for a log line only
                pass
        return f"CUresult {rc}"

    def check(self, rc: int, what: str) -> None:
        if rc:
            raise DriverError(f"{what}: {self.error_name(rc)}")

    def capture(self, stream: int, work, kernel_only: bool = False):
        """Capture ``work()`` (launches on ``stream``) into a graph; returns a ``KernelReplay`` when
        the graph is one kernel node (and ``kernels``), else the instantiated executable's handle,
        or with ``kernel_only`` raises NotOneKernel instead of instantiating. Raises DriverError, or
        what ``work`` raised, leaving the stream out of capture either way."""
        self.check(self._begin(stream, CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture")
        graph = ctypes.c_void_p()
        try:
            work()
        finally:
            rc = self._end(stream, ctypes.byref(graph))
        kept = None
        try:
            self.check(rc, "cuStreamEndCapture")
            if graph.value and self.node_count(graph.value) == 0:  # the launch went to another stream
                raise DriverError("the capture holds no node: the launch did not reach the capture stream")
            if self.kernels and graph.value:
                kept = self._kernel_of(graph.value, stream)
                if kept is None and self.sequences:
                    kept = self._sequence_of(graph.value, stream)
                if kept is not None:
                    return kept
            if kernel_only:
                what = "one kernel node or a chain of kernels and memsets" if self.sequences else "one kernel node"
                raise NotOneKernel(f"the capture is not {what} ({self.node_kinds(graph.value)})"
                                   if self.kernels else "kernel replays are off")
            ex = ctypes.c_void_p()
            self.check(self._instantiate(ctypes.byref(ex), graph, 0), "cuGraphInstantiate")
            return ex.value
        finally:
            if graph.value and kept is None:
                self._graph_destroy(graph)

    def node_count(self, graph: int):
        """The number of ``graph``'s nodes, or None where unreadable."""
        if self._nodes is None:
            return None
        try:
            n = ctypes.c_size_t(0)
            return None if self._nodes(graph, None, ctypes.byref(n)) else n.value
        except Exception:  # noqa: BLE001 - unreadable: the caller's other checks decide
            return None

    def node_kinds(self, graph: int) -> str:
        """The kinds of ``graph``'s nodes, comma-separated ("kernel, memset"), for logs; "?" where unreadable."""
        try:
            n = ctypes.c_size_t(0)
            if self._nodes(graph, None, ctypes.byref(n)):
                return "?"
            nodes = (ctypes.c_void_p * max(1, n.value))()
            if self._nodes(graph, nodes, ctypes.byref(n)):
                return "?"
            kinds = []
            for i in range(n.value):
                kind = ctypes.c_int(-1)
                self._node_type(nodes[i], ctypes.byref(kind))
                kinds.append(NODE_TYPE_NAMES[kind.value] if 0 <= kind.value < len(NODE_TYPE_NAMES) else str(kind.value))
            return ", ".join(kinds) if kinds else "no nodes"
        except Exception:  # noqa: BLE001 - a log detail, never a failure
            return "?"

    def _kernel_of(self, graph: int, stream: int):
        """The KernelReplay of ``graph`` when it is one kernel node whose launch can be read back
        whole, else None (it then replays as a graph, or as a SequenceReplay)."""
        n = ctypes.c_size_t(0)
        if self._nodes(graph, None, ctypes.byref(n)) or n.value != 1:
            return None
        nodes = (ctypes.c_void_p * 1)()
        kind = ctypes.c_int(-1)
        if self._nodes(graph, nodes, ctypes.byref(n)) or n.value != 1 or \
                self._node_type(nodes[0], ctypes.byref(kind)) or kind.value != NODE_TYPE_KERNEL:
            return None
        return self._kernel_node(nodes[0], graph, stream)

    def _kernel_node(self, node_handle, graph, stream: int, programmatic: bool = False):
        """The KernelReplay of one kernel node of ``graph`` (which keeps its parameters), or None when
        its launch cannot be read back whole; ``programmatic``: launched as a programmatic dependent of
        the launch before it (attribute 6, see ATTR_PROGRAMMATIC_STREAM_SERIALIZATION)."""
        node = _KernelNodeParams()
        # its arguments: kernelParams, or extra (one buffer, CU_LAUNCH_PARAM_BUFFER_POINTER: cuBLAS's
        # kernels inside cuDNN's eng0). Either array, and what it points to, is the node's own until the
        # node is destroyed (cuGraphKernelNodeGetParams), so the graph kept alive keeps it valid.
        if self._node_params(node_handle, ctypes.byref(node)) or not (node.kernelParams or node.extra):
            return None
        func = node.func
        if not func:
            f = ctypes.c_void_p()
            if not node.kern or self._kernel_function is None or self._kernel_function(ctypes.byref(f), node.kern):
                return None
            func = f.value
        attrs = []
        for aid in NODE_ATTRS:
            value = _AttrValue()
            if self._node_attr(node_handle, aid, ctypes.byref(value)):
                if aid in REQUIRED_ATTRS:
                    return None
                continue
            if any(value.bytes):
                attrs.append((aid, value))
        attrs = self.trim_attrs(attrs, func, stream)
        if programmatic:
            value = _AttrValue()
            value.words[0] = 1  # programmaticStreamSerializationAllowed
            attrs = [*attrs, (ATTR_PROGRAMMATIC_STREAM_SERIALIZATION, value)]
        return KernelReplay(self._launch_kernel, graph, func, node, attrs, stream)

    def _sequence_of(self, graph: int, stream: int):
        """The SequenceReplay of ``graph`` when its 2..MAX_SEQUENCE nodes are kernels (each readable
        whole) and memsets (of 1, 2 or 4-byte elements) in one chain (every node after at most one,
        before at most one, one first node, all reached from it), else None. Edges are plain, or
        programmatic between two kernels (see ATTR_PROGRAMMATIC_STREAM_SERIALIZATION); any other edge,
        or one the driver cannot report whole, declines it."""
        if self._edges is None:
            return None
        n = ctypes.c_size_t(0)
        if self._nodes(graph, None, ctypes.byref(n)) or not 1 < n.value <= MAX_SEQUENCE:
            return None
        count = n.value
        nodes = (ctypes.c_void_p * count)()
        if self._nodes(graph, nodes, ctypes.byref(n)) or n.value != count:
            return None
        edges = self._edge_list(graph, count - 1)
        if edges is None:
            return None
        handles = [nodes[i] for i in range(count)]
        following, preceded, programmatic = {}, set(), set()
        for a, b, data in edges:
            if a in following or b in preceded or a not in handles or b not in handles:
                return None
            if data is not None and (data.type, data.from_port, data.to_port) != (0, 0, 0):
                if data.type != EDGE_TYPE_PROGRAMMATIC or data.to_port != 0 or \
                        data.from_port not in (PORT_PROGRAMMATIC, PORT_LAUNCH_ORDER):
                    return None
                if data.from_port == PORT_PROGRAMMATIC:
                    programmatic.add(b)
            following[a] = b
            preceded.add(b)
        firsts = [h for h in handles if h not in preceded]
        if len(firsts) != 1:
            return None
        order = [firsts[0]]
        while order[-1] in following and len(order) <= count:
            order.append(following[order[-1]])
        if len(order) != count:
            return None
        steps = []
        for h in order:
            kind = ctypes.c_int(-1)
            if self._node_type(h, ctypes.byref(kind)):
                return None
            if kind.value == NODE_TYPE_KERNEL:
                step = self._kernel_node(h, graph, stream, programmatic=h in programmatic)
            elif kind.value == NODE_TYPE_MEMSET:
                p = _MemsetNodeParams()
                if self._memset_params(h, ctypes.byref(p)) or (p.elementSize, max(1, p.height) > 1) not in self._memsets:
                    return None
                step = MemsetStep(self._memsets, p)
            else:
                return None
            if step is None:
                return None
            if h in programmatic and not (isinstance(step, KernelReplay) and steps and isinstance(steps[-1], KernelReplay)):
                return None  # a programmatic edge joins two kernels
            steps.append(step)
        return SequenceReplay(graph, steps)

    def _edge_list(self, graph: int, want: int):
        """``graph``'s edges as [(from, to, CUgraphEdgeData or None)] when there are exactly ``want``;
        through cuGraphGetEdges_v2 (with each edge's data) where the driver has it, else the plain
        query, which fails on an edge with data (CUDA_ERROR_LOSSY_QUERY); None on any failure."""
        m = ctypes.c_size_t(0)
        frm, to = (ctypes.c_void_p * max(1, want))(), (ctypes.c_void_p * max(1, want))()
        if self._edges_v2 is not None:
            if self._edges_v2(graph, None, None, None, ctypes.byref(m)) or m.value != want:
                return None
            data = (_EdgeData * max(1, want))()
            if self._edges_v2(graph, frm, to, data, ctypes.byref(m)) or m.value != want:
                return None
            return [(frm[i], to[i], data[i]) for i in range(want)]
        if self._edges(graph, None, None, ctypes.byref(m)) or m.value != want:
            return None
        if self._edges(graph, frm, to, ctypes.byref(m)) or m.value != want:
            return None
        return [(frm[i], to[i], None) for i in range(want)]

    def trim_attrs(self, attrs, func, stream: int) -> list:
        """``attrs`` ([(id, value)] of a kernel node captured on ``stream``) less those a plain
        launch of ``func`` on that stream gets anyway (see STREAM_ATTRS): values equal to the
        stream's own, and a one-block cluster with its scheduling policy when ``func`` does not
        insist on a cluster size. What cannot be read is kept."""
        values = dict(attrs)
        cluster = values.get(4)
        drop_cluster = False
        if cluster is not None and _unit_cluster(cluster) and self._func_attr is not None:
            must = ctypes.c_int(1)
            drop_cluster = self._func_attr(ctypes.byref(must), FUNC_CLUSTER_SIZE_MUST_BE_SET, func) == 0 and must.value == 0
        kept = []
        for aid, value in attrs:
            if aid == 4 and drop_cluster or aid == 5 and (cluster is None or drop_cluster):
                continue
            if aid in STREAM_ATTRS and self._stream_attr is not None:
                own = _AttrValue()
                if self._stream_attr(stream, aid, ctypes.byref(own)) == 0 and bytes(own.bytes) == bytes(value.bytes):
                    continue
            kept.append((aid, value))
        return kept

    def destroy(self, ex) -> None:
        if isinstance(ex, (KernelReplay, SequenceReplay)):
            self._graph_destroy(ex.graph)  # launched kernels copied their parameters at launch
        else:
            self._exec_destroy(ex)  # an exec still running is freed once it completes


_driver = None
_driver_lock = threading.Lock()

CU_STREAM_NON_BLOCKING = 1


def private_stream(device: int, lib=None) -> int:
    """A new non-blocking stream of ``device`` (a raw CUstream) that is nobody else's: made with
    cuStreamCreate in the device's primary context, never destroyed. torch's streams come from a
    pool of 32 per device and priority, handed out in turn, so the 33rd ``torch.cuda.Stream()`` of a
    process is the first one again: a side stream taken from the pool is, sooner or later, some
    thread's own stream too (docs/decisions.md, "The side stream is no pool stream"). Raises OSError
    or RuntimeError where the driver cannot make one."""
    lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
    vp, P, c_int = ctypes.c_void_p, ctypes.POINTER, ctypes.c_int
    calls = {"cuDeviceGet": [P(c_int), c_int], "cuDevicePrimaryCtxRetain": [P(vp), c_int],
             "cuCtxPushCurrent_v2": [vp], "cuCtxPopCurrent_v2": [P(vp)], "cuStreamCreate": [P(vp), ctypes.c_uint]}
    fns = {}
    for name, args in calls.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = args, c_int
        fns[name] = f

    def check(rc, what):
        if rc != 0:
            raise RuntimeError(f"{what} failed: CUresult {rc}")

    dev, ctx, stream, popped = c_int(0), vp(), vp(), vp()
    check(fns["cuDeviceGet"](ctypes.byref(dev), device), "cuDeviceGet")
    check(fns["cuDevicePrimaryCtxRetain"](ctypes.byref(ctx), dev.value), "cuDevicePrimaryCtxRetain")
    check(fns["cuCtxPushCurrent_v2"](ctx), "cuCtxPushCurrent")
    try:
        check(fns["cuStreamCreate"](ctypes.byref(stream), CU_STREAM_NON_BLOCKING), "cuStreamCreate")
    finally:
        fns["cuCtxPopCurrent_v2"](ctypes.byref(popped))
    return int(stream.value)


def driver():
    """The process's Driver, or None when graphs are off or libcuda cannot be bound."""
    global _driver, ENABLED
    if _driver is None and ENABLED:
        with _driver_lock:
            if _driver is None and ENABLED:
                try:
                    _driver = Driver()
                except (OSError, AttributeError) as exc:
                    log.info("launch graphs off: the CUDA driver API is not reachable (%s)", exc)
                    ENABLED = False
    return _driver


class GraphSet:
    """One plan's captured graphs, keyed by pointer set, and the sightings of pointer sets not
    captured yet. Used under the plan's handle lock (one launch at a time per device)."""

    __slots__ = ("execs", "seen", "off", "captures", "replays", "reuses", "kernel_only", "gated", "backoff", "_base",
                 "_drv")

    def __init__(self, drv, kernel_only: bool = False):
        self.execs: OrderedDict = OrderedDict()
        self.seen: dict = {}
        self.off = False
        self.kernel_only = kernel_only  # a long kernel's plan: its captures replay as their kernel or not at all
        self.captures = self.reuses = 0  # reuses: graph launches other than a capture's own
        self.gated, self.backoff, self._base = 0, 1, (0, 0)  # the churn gate's window (CHURN_WAIT)
        self._drv = drv

    def sighted(self, key) -> bool:
        """Count a sighting of ``key`` (not captured yet); True when it is due for a capture and the
        plan's captures pay for themselves (CHURN_CAPTURES, CHURN_REUSES_PER_CAPTURE, CHURN_WAIT)."""
        n = self.seen.get(key, 0) + 1
        if n >= AFTER:
            self.seen.pop(key, None)
            return self._gate_open()
        if len(self.seen) >= SEEN_CAP:
            self.seen.clear()
        self.seen[key] = n
        return False

    def _gate_open(self) -> bool:
        """Whether a due capture may go ahead: the window's captures pay for themselves (or are few yet), or
        the gate has refused CHURN_WAIT x backoff of them since the window opened (then a new window opens)."""
        captures, reuses = self.captures - self._base[0], self.reuses - self._base[1]
        if captures < CHURN_CAPTURES or reuses >= CHURN_REUSES_PER_CAPTURE * captures:
            if captures >= CHURN_CAPTURES:
                self.backoff = 1  # this window pays: the next gated phase waits the least again
            return True
        self.gated += 1
        if self.gated < CHURN_WAIT * self.backoff:
            return False
        self.gated, self._base = 0, (self.captures, self.reuses)
        self.backoff = min(2 * self.backoff, CHURN_MAX_BACKOFF)
        log.debug("launch graphs: a new capture window for one plan after %d captures and %d reuses", self.captures,
                  self.reuses)
        return True

    def add(self, key, ex) -> None:
        self.execs[key] = ex
        self.captures += 1
        direct = isinstance(ex, (KernelReplay, SequenceReplay))
        sequence = isinstance(ex, SequenceReplay)
        with _count_lock:
            STATS.captures += 1
            STATS.kernels += direct  # captures that replay as direct launches (their kernel, or a chain of them)
            STATS.sequences += sequence
            STATS.live += 1
        while len(self.execs) > PER_PLAN:
            _, old = self.execs.popitem(last=False)
            self._drv.destroy(old)
            with _count_lock:
                STATS.live -= 1
        if self.captures - self._base[0] == CHURN_CAPTURES and \
                self.reuses - self._base[1] < CHURN_REUSES_PER_CAPTURE * CHURN_CAPTURES:
            log.debug("launch graphs: %d captures but %d reuses for one plan; it captures again once they catch up",
                      self.captures, self.reuses)

    def disable(self) -> None:
        self.off = True
        self.seen.clear()
        self.release()

    def release(self) -> None:
        execs, self.execs = self.execs, OrderedDict()
        if execs:
            with _count_lock:  # never held while a destructor could run: nothing under it allocates
                STATS.live -= len(execs)
        for ex in execs.values():
            try:
                self._drv.destroy(ex)
            except Exception:  # noqa: BLE001 - at interpreter exit the driver may be gone
                pass

    def __del__(self):
        self.release()


def set_launch_graphs(enabled: bool) -> None:
    """Whether repeated launches replay as CUDA graphs (default on; ``CUDNN_FUSE_LAUNCH_GRAPHS=0``
    starts a process with them off). Turning them off takes effect at the next launch; turning
    them on serves plans built from then on (``cudnn_fuse.loader.clear()`` reloads the others)."""
    global ENABLED
    if not isinstance(enabled, bool):
        raise TypeError(f"set_launch_graphs: enabled must be a bool, got {enabled!r}")
    ENABLED = enabled


def room() -> bool:
    """Whether one more graph may be captured (MAX_LIVE)."""
    return STATS.live < MAX_LIVE


# A graph launch pays off only where the host is the bottleneck: a kernel shorter than cuDNN's raw execute.
# On a GPU kept busy, a graph launch costs the GPU time a stream launch does not. So only plans whose kernel
# is estimated (at a Hopper card's peaks: the estimate is a floor) to take at most MAX_US replay their
# captures as graphs.
#
# A one-kernel capture launched as its kernel (KernelReplay) is a plain kernel launch on the caller's stream,
# with no graph-launch cost on the GPU, and it costs the host a fraction of cuDNN's execute. So plans of
# longer kernels get kernel replays only: a capture of theirs that is not one kernel node (or a chain of
# them) is dropped, and the plan launches raw from then on (docs/launch.md).
PEAK_FLOPS = 989e12  # dense fp16/bf16 tensor-core peak of an H100/H200 SXM
PEAK_BYTES_PER_S = 4.8e12  # HBM3e of an H200 (the higher of the two: the estimate stays a floor)
MAX_US = 4.0

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


def _tensors(spec):
    for f in dataclasses.fields(spec):
        v = getattr(spec, f.name)
        if isinstance(v, S.TensorSpec):
            yield v
        elif dataclasses.is_dataclass(v) and hasattr(v, "operands"):  # a training graph's forward
            yield from _tensors(v)


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _flops(spec) -> int:
    if isinstance(spec, (S.ConvDgradSpec, S.ConvWgradSpec)):
        w = spec.w if isinstance(spec, S.ConvDgradSpec) else spec.dw
        return 2 * _prod(spec.dy.shape) * _prod(w.shape[1:])
    if isinstance(spec, S.ActGradSpec):
        return 0
    if isinstance(spec, S.SdpaBwdSpec):
        return int(2.5 * S.flops(spec))  # the forward's products and about 1.5x more
    return S.flops(spec)


def estimated_us(spec):
    """A floor of ``spec``'s kernel time in microseconds (flops and bytes at PEAK_FLOPS, PEAK_BYTES_PER_S),
    or None when it cannot be estimated."""
    try:
        moved = sum(_prod(t.shape) * _ITEMSIZE.get(t.dtype, 4) for t in _tensors(spec))
        return 1e6 * max(_flops(spec) / PEAK_FLOPS, moved / PEAK_BYTES_PER_S)
    except Exception:  # noqa: BLE001 - an unknown spec: no graphs
        return None


def worth_graphs(spec) -> bool:
    """Whether ``spec``'s launches are short enough for graph replays to pay (MAX_US)."""
    est = estimated_us(spec)
    return est is not None and est <= MAX_US


def new_set(spec=None):
    """A GraphSet for a new plan of ``spec``, or None when graphs are off or its kernel cannot be
    estimated. A kernel too long for graph replays to pay (``worth_graphs``) gets a set of kernel
    replays only (``kernel_only``), where the driver launches captured kernels; else None."""
    if not ENABLED:
        return None
    est = estimated_us(spec) if spec is not None else 0.0
    if est is None:
        return None
    kernel_only = est > MAX_US  # not worth_graphs
    drv = driver()
    if drv is None or kernel_only and not drv.kernels:
        return None
    return GraphSet(drv, kernel_only=kernel_only)


def clear_runtime_error() -> None:
    """Reset the CUDA runtime's last error after a failed capture, so that torch's next launch
    check does not report it. Best effort, through the libcudart this process has loaded."""
    for lib in _cudarts():
        try:
            lib.cudaGetLastError()
        except Exception:  # noqa: BLE001
            pass


_cudart_libs = None


def _cudarts() -> list:
    global _cudart_libs
    if _cudart_libs is None:
        libs = []
        try:
            with open("/proc/self/maps") as f:
                paths = {line.split()[-1] for line in f if "libcudart" in line and line.rstrip().endswith(tuple("0123456789o"))}
            for p in sorted(paths):
                try:
                    libs.append(ctypes.CDLL(p))
                except OSError:
                    pass
        except OSError:
            pass
        _cudart_libs = libs
    return _cudart_libs
