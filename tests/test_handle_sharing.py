"""The device's one cuDNN handle is shared by every thread: whatever binds it to a stream and uses it
(a launch, the autotuner's timed launches, the frontend's deserialize with its throwaway capture,
every plan build: heuristics, finalize, a recorded engine's rebuild, the tuner's candidates) does so
under the handle's lock, and leaves plans' record of the bound stream true. The cuDNN
calls are stand-ins here; the H200 runs are the GPU tests."""

from __future__ import annotations

import threading
import types

import pytest

from cudnn_fuse import autotune, engines, handles, loader
from cudnn_fuse.errors import UnsupportedError


class FakeGraph:
    def __init__(self, log, h, fail=False):
        self.log, self.h, self.fail = log, h, fail

    def deserialize(self, handle, blob):
        self.log.append(("deserialize", handle, blob, self.h.lock.locked(), self.log_stream()))
        if self.fail:
            raise RuntimeError("nonsense blob")

    def log_stream(self):
        return next((a[2] for a in reversed(self.log) if a[0] == "set_stream"), None)


@pytest.fixture
def shared(monkeypatch):
    import cudnn

    log = []
    h = handles._Handle(handle=0x1234, stream=7)  # bound to another thread's stream 7 by its last launch
    monkeypatch.setitem(handles._handles, 0, h)
    monkeypatch.setattr(cudnn, "set_stream", lambda handle, stream: log.append(("set_stream", handle, stream)))
    monkeypatch.setattr(handles, "_side_stream", lambda device: 99)
    monkeypatch.setattr(loader, "Plan", lambda spec, g, device, engine=None: ("plan", g, engine))
    return types.SimpleNamespace(h=h, log=log, cudnn=cudnn)


def _entry():
    return types.SimpleNamespace(blob=b"blob", meta={"engine_name": "eng7"}, key="0123456789abcdef")


def test_deserialize_runs_under_the_handle_lock_on_the_side_stream(shared, monkeypatch):
    """The frontend's deserialize captures one execute on the handle's stream: it must not be a stream
    another thread launches to (stream 7 here), nor run while another thread uses the handle."""
    monkeypatch.setattr(shared.cudnn, "pygraph", lambda handle: FakeGraph(shared.log, shared.h))
    plan = loader._deserialize(object(), _entry(), 0)
    assert plan[0] == "plan" and plan[2] == "eng7"
    assert shared.log == [("set_stream", 0x1234, 99), ("deserialize", 0x1234, b"blob", True, 99)]
    assert shared.h.stream == 99 and not shared.h.lock.locked()  # the record stays true; the lock is free


def test_a_failed_deserialize_releases_the_lock(shared, monkeypatch, caplog):
    monkeypatch.setattr(shared.cudnn, "pygraph", lambda handle: FakeGraph(shared.log, shared.h, fail=True))
    assert loader._deserialize(object(), _entry(), 0) is None
    assert not shared.h.lock.locked() and shared.h.stream == 99
    assert "did not deserialize" in caplog.text


def test_deserialize_waits_for_a_launch_holding_the_handle(shared, monkeypatch):
    """A launch of another thread holds the lock: the deserialize starts only once it is done."""
    monkeypatch.setattr(shared.cudnn, "pygraph", lambda handle: FakeGraph(shared.log, shared.h))
    done = threading.Event()
    with shared.h.lock:
        t = threading.Thread(target=lambda: (loader._deserialize(object(), _entry(), 0), done.set()))
        t.start()
        assert not done.wait(0.3) and shared.log == []
    t.join(10)
    assert done.is_set() and [a[0] for a in shared.log] == ["set_stream", "deserialize"]


class BuildGraph:
    """A graph whose handle calls record whether the shared handle's lock was held and the stream the
    handle was bound to (the last set_stream) at the time."""

    def __init__(self, shared, plans_count=0):
        self.shared, self.n = shared, plans_count
        self._plans = [None] * plans_count

    def _note(self, what, *args):
        self.shared.log.append((what, *args, self.shared.h.lock.locked(), self.shared.h.stream))

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *a, **k: self._note(name, *a)

    def get_execution_plan_count(self):
        self._note("count")
        return self.n

    def get_plan_name_at_index(self, i):
        return f"eng{i}"

    def get_engine_and_knobs_at_index(self, i):
        return i, {}

    def get_workspace_size_plan_at_index(self, i):
        self._note("workspace", i)
        return 0


SPEC = types.SimpleNamespace(op="matmul")


def _fake_plan(shared):
    def make(spec, g, device, engine=None):
        # a Plan takes the handle's lock itself (its graph queries): it must not be made under held()
        assert not shared.h.lock.locked(), "a Plan was made while the handle lock was held (it would deadlock)"
        return types.SimpleNamespace(spec=spec, graph=g, device=device, engine=engine or "eng?")
    return make


def test_a_heuristic_build_holds_the_handle_on_the_side_stream(shared, monkeypatch):
    """Heuristics and finalize use the shared handle: under its lock, bound to the side stream, never
    to stream 7 where another thread launches (and might be capturing)."""
    monkeypatch.setattr(loader, "build_graph", lambda spec, handle: BuildGraph(shared))
    monkeypatch.setattr(loader, "finalize", lambda g, spec: g.build_plans())
    monkeypatch.setattr(loader, "Plan", _fake_plan(shared))
    plan = loader._build_and_store(None, SPEC, "d" * 64, 0, False, 0.0)
    assert plan.spec is SPEC
    assert shared.log == [("set_stream", 0x1234, 99), ("build_plans", True, 99)]
    assert not shared.h.lock.locked() and shared.h.stream == 99


def test_a_tuned_build_prepares_under_the_handle_and_tunes_outside_it(shared, monkeypatch):
    """The candidates are listed under held(); the tuner then runs without the lock (it takes it for
    each build and each timed launch itself: holding it across the budget would block every launch)."""
    seen = []

    def tune(g, spec, h, device, uids, roles, get_plan=None):
        seen.append((h is shared.h, shared.h.lock.locked()))
        return 0, types.SimpleNamespace(index=0), []

    monkeypatch.setattr(loader, "build_graph", lambda spec, handle: BuildGraph(shared))
    monkeypatch.setattr(loader, "prepare", lambda g, spec: g.create_execution_plans())
    monkeypatch.setattr(loader, "uids_of", lambda spec: [1])
    monkeypatch.setattr(loader, "roles_of", lambda spec: ["x"])
    monkeypatch.setattr(autotune, "tune", tune)
    monkeypatch.setattr(autotune, "torch_wins", lambda w, t: False)
    monkeypatch.setattr(autotune, "gemm_wins", lambda w, t: False)
    monkeypatch.setattr(loader, "Plan", _fake_plan(shared))
    loader._build_and_store(None, SPEC, "d" * 64, 0, True, 0.0)
    assert shared.log == [("set_stream", 0x1234, 99), ("create_execution_plans", True, 99)]
    assert seen == [(True, False)] and not shared.h.lock.locked()


def test_a_rebuild_holds_the_handle_on_the_side_stream(shared, monkeypatch):
    monkeypatch.setattr(loader, "build_graph", lambda spec, handle: BuildGraph(shared, 1))
    monkeypatch.setattr(loader, "barred_engines", lambda spec: frozenset())
    monkeypatch.setattr(loader, "Plan", _fake_plan(shared))
    loader.rebuild("spec", 3, {}, 0)
    calls = [a for a in shared.log if a[0] != "set_stream"]
    assert [a[0] for a in calls] == ["validate", "build_operation_graph", "create_execution_plan", "count",
                                     "build_plan_at_index"]
    assert all(a[-2:] == (True, 99) for a in calls), calls
    assert not shared.h.lock.locked()


def test_a_build_waits_for_a_launch_holding_the_handle(shared, monkeypatch):
    monkeypatch.setattr(loader, "build_graph", lambda spec, handle: BuildGraph(shared))
    monkeypatch.setattr(loader, "finalize", lambda g, spec: g.build_plans())
    monkeypatch.setattr(loader, "Plan", _fake_plan(shared))
    done = threading.Event()
    with shared.h.lock:
        t = threading.Thread(target=lambda: (loader._build_and_store(None, SPEC, "d" * 64, 0, False, 0.0),
                                             done.set()))
        t.start()
        assert not done.wait(0.3) and shared.log == []
    t.join(10)
    assert done.is_set() and [a[0] for a in shared.log] == ["set_stream", "build_plans"]


def test_a_failed_build_releases_the_lock(shared, monkeypatch):
    def refuse(g, spec):
        raise UnsupportedError("cuDNN declined it")

    monkeypatch.setattr(loader, "build_graph", lambda spec, handle: BuildGraph(shared))
    monkeypatch.setattr(loader, "finalize", refuse)
    with pytest.raises(UnsupportedError):
        loader._build_and_store(None, SPEC, "d" * 64, 0, False, 0.0)
    assert not shared.h.lock.locked()


@pytest.fixture
def tuner(shared, monkeypatch):
    """autotune.tune with its CUDA pieces stood in for: the caller's stream is 77."""
    import torch

    monkeypatch.setattr(autotune, "random_buffers", lambda spec, roles, device, n: [["x"]] * n)
    monkeypatch.setattr(autotune, "_working_set_bytes", lambda bufs: 1 << 40)  # no L2 rotation
    monkeypatch.setattr(autotune, "device_ms", lambda fn, n, *a, **k: [fn() or 1.0 for _ in range(n)])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(L2_cache_size=1 << 20))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: types.SimpleNamespace(cuda_stream=77))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)
    monkeypatch.setattr(engines, "barred_engines", lambda spec: frozenset())
    return autotune.Config(budget_s=30, warmup=1, repeats=2, torch_candidate=False, gemm_candidate=False, heat_s=0)


def test_the_tuner_builds_on_the_side_stream_and_times_on_the_callers(shared, tuner):
    """Each candidate's build holds the lock on the side stream (99); each timed launch holds it bound
    to the tuner's stream (77); plans' record of the binding is true at every step."""
    g = BuildGraph(shared, 2)
    index, winner, timings = autotune.tune(g, SPEC, shared.h, 0, [1], ["x"], tuner)
    assert index in (0, 1) and len(timings) == 2
    calls = [a for a in shared.log if a[0] != "set_stream"]
    builds = [a for a in calls if a[0] in ("count", "build_plan_at_index", "workspace")]
    launches = [a for a in calls if a[0] == "execute_plan_at_index"]
    assert builds and launches
    assert all(a[-2:] == (True, 99) for a in builds), builds
    assert all(a[-2:] == (True, 77) for a in launches), launches
    # every bind was recorded: the record never says one stream while the handle is on another
    binds = [a[2] for a in shared.log if a[0] == "set_stream"]
    assert binds[0] == 99 and 77 in binds and shared.h.stream == binds[-1]
    assert not shared.h.lock.locked()


def test_a_raw_handle_tunes_unlocked(shared, tuner):
    """A handle of the caller's own (not the shared record) is the caller's to guard."""
    g = BuildGraph(shared, 1)
    autotune.tune(g, SPEC, 0x4321, 0, [1], ["x"], tuner)
    calls = [a for a in shared.log if a[0] != "set_stream"]
    assert calls and not any(a[-2] for a in calls)
    assert all(a[1] == 0x4321 for a in shared.log if a[0] == "set_stream")
