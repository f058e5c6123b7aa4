"""One cuDNN handle per device, the streams it is bound to, and releases kept out of captures.

cuDNN asks that a handle not be used by two threads at once and that nothing be released while a
stream capture is open; every launch, build and deserialize of the package goes through the
device's one handle under its lock (``held`` for work that launches none of the caller's kernels).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
from dataclasses import dataclass, field

import torch

from . import launch_graphs

log = logging.getLogger(__name__)


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
# "inside someone else's stream capture, poisons every later launch". Python frees a plan where
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


_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing
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


def capture_noted() -> bool:
    """Whether a launch of ours found a caller's stream capturing that may still be open, on any
    device (``_note_capture``; cleared as the captures end)."""
    return any(_caller_capture_open(device) for device in list(_caller_captures))


def exiting() -> None:
    """From now on dropped cuDNN objects go at once (interpreter exit), not to the graveyard."""
    global _exiting
    _exiting = True


def drain_all() -> None:
    """Release the dropped plans' cuDNN objects of every device, each under its handle's lock, unless
    this thread's stream is capturing (then they wait)."""
    if _graveyard and not (torch.cuda.is_available() and torch.cuda.is_initialized() and _capturing()):
        for device, h in list(_handles.items()):
            with h.lock:
                _drain(device)
