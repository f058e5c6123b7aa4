"""Dropped plans are released outside launch-graph captures (plans._graveyard, handles.no_gc).

cudnn-frontend 1.32 names the hazard (cudnn/_pygraph.py): a cuDNN release timed by the garbage
collector inside another thread's stream capture poisons later launches. (The threaded faults the
H200 showed had another cause, tests/test_side_stream.py.) What must hold, on
the stand-in driver and entry point of tests/test_launch_graphs.py: a dropped Plan's cuDNN objects
outlive it until a thread holds the device's handle lock outside any capture; a capture opens with
nothing left to release, the garbage collector off and the handle already on the side stream; the
collector's state is given back as it was; torch's own capture releases nothing."""

from __future__ import annotations

import gc
import threading
import types
import weakref

import pytest

from cudnn_fuse import handles, launch_graphs, loader, plans
from tests.test_launch_graphs import FakeDriver, Rig


class CudnnObject:
    """Stands in for a plan's frontend graph: records the handle lock's state when it is freed."""

    def __init__(self, handle, log):
        self.handle, self.log = handle, log

    def __del__(self):
        self.log.append(("released", self.handle.lock.locked()))


@pytest.fixture
def empty_graveyard(monkeypatch):
    gc.collect()  # earlier tests' plans freed now, into the real graveyard, not this test's
    graveyard = {}  # the plans' launches drain what handles.bury keeps: one dict, as in the package
    monkeypatch.setattr(handles, "_graveyard", graveyard)
    monkeypatch.setattr(plans, "_graveyard", graveyard)
    monkeypatch.setattr(launch_graphs, "AFTER", 2)


def dropped_plan(rig, log):
    """A second plan on the rig's handle holding a stand-in cuDNN object, dropped; its object's weakref."""
    p = object.__new__(plans.Plan)
    p.spec, p.device, p._handle = types.SimpleNamespace(op="matmul"), 0, rig.handle
    p.graph, p._raw, p._graphs = CudnnObject(rig.handle, log), None, None
    ref = weakref.ref(p.graph)
    del p
    return ref


def test_a_dropped_plan_waits_for_a_launch_outside_captures(monkeypatch, empty_graveyard):
    rig = Rig(monkeypatch, FakeDriver())
    log = []
    ref = dropped_plan(rig, log)
    assert ref() is not None and handles.released() == 1 and log == []  # freed with the plan: not yet
    rig.capturing = True  # torch captures this launch: nothing is released inside it
    rig.plan.launch([1, 2, 3])
    assert ref() is not None and handles.released() == 1
    rig.capturing = False
    rig.plan.launch([1, 2, 3])  # a raw launch: under the handle's lock, no capture open
    assert ref() is None and handles.released() == 0 and log == [("released", True)]


def test_a_capture_opens_with_nothing_to_release_the_collector_off_and_the_side_stream_bound(
        monkeypatch, empty_graveyard):
    seen = []

    class Driver(FakeDriver):
        def capture(self, stream, work, kernel_only=False):
            seen.append({"released": list(log), "gc": gc.isenabled(), "bound": rig.handle.stream,
                         "waiting": handles.released()})
            binds_before = len(binds)
            out = super().capture(stream, work, kernel_only)
            seen[-1]["binds_inside"] = len(binds) - binds_before
            return out

    rig = Rig(monkeypatch, Driver())
    import cudnn

    binds = []
    set_stream = cudnn.set_stream
    monkeypatch.setattr(cudnn, "set_stream", lambda handle, stream: binds.append(stream) or set_stream(handle, stream))
    log = []
    rig.plan.launch([1, 2, 3])  # first sighting: raw (releases nothing: nothing waits yet)
    ref = dropped_plan(rig, log)
    assert gc.isenabled()
    rig.plan.launch([1, 2, 3])  # second: captured
    assert len(seen) == 1
    assert seen[0] == {"released": [("released", True)], "gc": False, "bound": 99, "waiting": 0, "binds_inside": 0}
    assert ref() is None and gc.isenabled()  # the collector is back on after the capture
    assert rig.replays()  # and the capture replayed as before


def test_the_collector_stays_off_for_a_caller_who_turned_it_off_and_nested_blocks_count():
    assert gc.isenabled()
    with handles.no_gc():
        with handles.no_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer block is still open
    assert gc.isenabled()
    gc.disable()
    try:
        with handles.no_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the caller's own setting is kept
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), handles.no_gc():
        raise RuntimeError("a failed capture")
    assert gc.isenabled()  # given back on the way out of an error too


def test_overlapping_blocks_in_two_threads_turn_the_collector_back_on_once_both_end():
    inside, release = threading.Event(), threading.Event()
    states = []

    def other():
        with handles.no_gc():
            inside.set()
            release.wait(10)
        states.append(("other ended", gc.isenabled()))

    t = threading.Thread(target=other)
    with handles.no_gc():
        t.start()
        assert inside.wait(10)
    states.append(("first ended", gc.isenabled()))  # the other block is still open
    release.set()
    t.join(10)
    assert states == [("first ended", False), ("other ended", True)]


def test_a_plan_freed_by_the_collector_waits_too(monkeypatch, empty_graveyard):
    """A frontend object has no finalizer of its own (its C++ destructor runs when it is deallocated):
    the stand-in here has none either, so the collector's finalizing pass runs only the plan's."""

    class Held:
        pass

    rig = Rig(monkeypatch, FakeDriver())
    p = object.__new__(plans.Plan)
    p.spec, p.device, p._handle = types.SimpleNamespace(op="matmul"), 0, rig.handle
    p.graph, p._raw, p._graphs = Held(), None, None
    p.spec.plan = p  # a reference cycle: only a collection frees the plan
    del p
    assert handles.released() == 0  # the cycle holds the plan
    gc.collect()
    assert handles.released() == 1  # collected: its graph waits, alive
    kept = plans._graveyard[0][-1][0]
    assert type(kept) is Held
    ref = weakref.ref(kept)
    del kept
    rig.plan.launch([1, 2, 3])
    assert ref() is None and handles.released() == 0


def test_clear_releases_under_each_handles_lock(monkeypatch, empty_graveyard):
    rig = Rig(monkeypatch, FakeDriver())
    monkeypatch.setattr(handles, "_handles", {0: rig.handle})
    monkeypatch.setattr(loader, "_LRU", loader.PlanLRU(4))
    log = []
    ref = dropped_plan(rig, log)
    loader.clear()
    assert ref() is None and log == [("released", True)] and handles.released() == 0


def test_a_plan_whose_init_failed_is_dropped_quietly(empty_graveyard):
    p = object.__new__(plans.Plan)  # no attribute set: __init__ raised before any
    del p
    assert handles.released() == 0


@pytest.fixture
def stand_in_handle(monkeypatch, empty_graveyard):
    """Device 0's handle, a stand-in bound to another thread's stream 7; cuDNN's set_stream a no-op."""
    import cudnn

    h = handles._Handle(handle=0x1234, stream=7)
    monkeypatch.setitem(handles._handles, 0, h)
    monkeypatch.setattr(cudnn, "set_stream", lambda handle, stream: None)
    monkeypatch.setattr(plans, "_side_stream", lambda device: 99)
    monkeypatch.setattr(handles, "_side_stream", lambda device: 99)
    return h


def test_a_graph_a_deserialize_gave_up_on_waits_too(monkeypatch, stand_in_handle):
    import cudnn

    from cudnn_fuse import loader

    class Broken:
        def deserialize(self, handle, blob):
            raise RuntimeError("nonsense blob")

    monkeypatch.setattr(cudnn, "pygraph", lambda handle: Broken())
    monkeypatch.setattr(loader, "_warned", set())  # the process's one warning stays for the tests that read it
    entry = types.SimpleNamespace(blob=b"blob", meta={}, key="0123456789abcdef")
    assert loader._deserialize(object(), entry, 0) is None
    assert handles.released() == 1 and type(handles._graveyard[0][0][0]) is Broken
    with handles.held(stand_in_handle, 0):  # the next build or deserialize releases it, under the lock
        pass
    assert handles.released() == 0


def test_no_capture_opens_while_a_collection_runs_in_another_thread(monkeypatch, empty_graveyard):
    """A collection started before the capture (another thread's, its finalizers releasing the GIL
    mid-way) is not stopped by turning the collector off: that launch goes raw, captured later."""
    rig = Rig(monkeypatch, FakeDriver())
    monkeypatch.setattr(plans, "_collecting", [1])
    for _ in range(2):  # the second sighting is due for a capture
        rig.plan.launch([1, 2, 3])
    assert [e for e in rig.drv.events if e[0].startswith("begin")] == [] and len(rig.raw_calls) == 2
    plans._collecting[0] = 0
    for _ in range(2):
        rig.plan.launch([1, 2, 3])
    assert rig.drv.events[0] == ("begin", 99) and rig.replays() == [("replay", 101, 7)]


def test_collections_are_counted_while_they_run():
    seen = []

    class Cycle:
        def __init__(self):
            self.me = self

        def __del__(self):
            seen.append(plans._collecting[0])

    Cycle()
    gc.collect()
    assert seen == [1] and plans._collecting[0] == 0


def test_a_graph_a_rebuild_gave_up_on_waits_too(monkeypatch, stand_in_handle):
    from cudnn_fuse import loader

    class Refused:
        def validate(self):
            raise RuntimeError("engine refused")

    monkeypatch.setattr(loader, "barred_engines", lambda spec: frozenset())
    monkeypatch.setattr(loader, "build_graph", lambda spec, handle: Refused())
    with pytest.raises(RuntimeError, match="engine refused"):
        loader.rebuild(object(), 7, {}, 0)
    assert handles.released() == 1 and type(plans._graveyard[0][0][0]) is Refused


def test_a_callers_capture_defers_releases_from_other_threads_until_it_ends(monkeypatch, empty_graveyard):
    """A caller's torch.cuda.graph around a cf op holds no lock of ours: the stream a launch found
    capturing is noted, and no thread releases anything on the device until that capture has ended."""
    rig = Rig(monkeypatch, FakeDriver())
    open_streams = set()
    monkeypatch.setattr(handles, "_caller_captures", {})
    monkeypatch.setattr(handles, "_stream_capturing", lambda s: s in open_streams)
    rig.capturing, rig.stream = True, 7
    open_streams.add(7)
    rig.plan.launch([1, 2, 3])  # inside the caller's capture: noted
    assert handles._caller_captures == {0: {7: 1}}
    log = []
    ref = dropped_plan(rig, log)
    rig.capturing, rig.stream = False, 8  # another thread, its own stream, no capture of its own
    for _ in range(3):
        rig.plan.launch([4, 5, 6])  # raw launches and a capture of ours: none releases
        loader.clear()
    assert ref() is not None and handles.released() == 1 and log == []
    assert rig.replays()  # the second launch was captured (on our side stream), the third replayed
    open_streams.discard(7)  # the caller's capture ended
    rig.plan.launch([7, 8, 9])  # a raw launch (a pointer set not seen before)
    assert ref() is None and handles.released() == 0 and log == [("released", True)]
    assert handles._caller_captures == {0: {}}  # the ended capture is forgotten


def test_a_stream_that_cannot_be_asked_counts_as_ended(monkeypatch, empty_graveyard):
    rig = Rig(monkeypatch, FakeDriver())
    monkeypatch.setattr(handles, "_caller_captures", {0: {7: 1}})

    def gone(stream):
        raise RuntimeError("invalid resource handle")

    monkeypatch.setattr(handles, "_stream_capturing", gone)
    log = []
    ref = dropped_plan(rig, log)
    rig.plan.launch([1, 2, 3])
    assert ref() is None and log == [("released", True)] and handles._caller_captures == {0: {}}


def test_the_drivers_capture_query_reads_the_status_it_is_given():
    """Driver.stream_capturing over a stand-in cuStreamIsCapturing: active (1) and invalidated (2)
    count as capturing, none (0) and an error (a destroyed stream) do not."""
    import ctypes

    answers = {11: (0, 1), 12: (0, 2), 13: (0, 0), 14: (400, 0)}

    def is_capturing(stream, status):
        rc, value = answers[stream]
        ctypes.cast(status, ctypes.POINTER(ctypes.c_int))[0] = value
        return rc

    drv = object.__new__(launch_graphs.Driver)
    drv._is_capturing = is_capturing
    assert drv.queries_capture
    assert [drv.stream_capturing(s) for s in (11, 12, 13, 14)] == [True, True, False, False]
    drv._is_capturing = None
    assert not drv.queries_capture
    with pytest.raises(AttributeError):
        drv.stream_capturing(11)


def test_at_exit_plans_in_cycles_are_released_by_the_exits_collection_not_buried(monkeypatch, empty_graveyard):
    """A graveyard left for the interpreter's teardown is destroyed after CUDA and cuDNN are gone (a
    segmentation fault at the end of a GPU pytest run): the exit's collection releases what it finds."""
    rig = Rig(monkeypatch, FakeDriver())
    log = []
    p = object.__new__(plans.Plan)
    p.spec, p.device, p._handle = types.SimpleNamespace(op="matmul"), 0, rig.handle
    p.graph, p._raw, p._graphs = CudnnObject(rig.handle, log), None, None
    p.spec.plan = p  # a cycle: only the collector frees it
    ref = weakref.ref(p.graph)
    del p
    monkeypatch.setattr(handles, "_exiting", False)
    loader._release_at_exit()
    assert handles._exiting and ref() is None and handles.released() == 0 and log == [("released", False)]


def test_a_capture_noted_while_its_stream_is_asked_is_not_forgotten(monkeypatch, empty_graveyard):
    """The driver's query that a noted stream has ended releases the GIL. A new capture on that stream,
    noted by its first launch meanwhile, was forgotten with the old one (the stream was in the set
    already), and the graveyard was then drained inside it. A stream is forgotten only if it was not
    noted again while it was asked."""
    state = {"capturing": False}
    monkeypatch.setattr(handles, "_caller_captures", {})
    handles._note_capture(0, 5)  # a caller's capture on stream 5, since ended

    def asked(stream):
        v = state["capturing"]
        state["capturing"] = True  # meanwhile a new capture begins on stream 5 ...
        handles._note_capture(0, 5)  # ... and its first launch of ours notes it
        return v

    monkeypatch.setattr(handles, "_stream_capturing", asked)
    assert handles._caller_capture_open(0) is True
    assert handles._caller_captures == {0: {5: 2}}
