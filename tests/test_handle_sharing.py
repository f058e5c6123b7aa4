"""The device's one cuDNN handle is shared by every thread: whatever binds it to a stream and uses it
(a launch, the autotuner's timed launches, the frontend's deserialize with its throwaway capture)
does so under the handle's lock, and leaves plans' record of the bound stream true. The cuDNN
calls are stand-ins here; the H200 runs are the GPU tests."""

from __future__ import annotations

import threading
import types

import pytest

from cudnn_fuse import loader, plans


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
    h = plans._Handle(handle=0x1234, stream=7)  # bound to another thread's stream 7 by its last launch
    monkeypatch.setitem(plans._handles, 0, h)
    monkeypatch.setattr(cudnn, "set_stream", lambda handle, stream: log.append(("set_stream", handle, stream)))
    monkeypatch.setattr(loader, "_side_stream", lambda device: 99)
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
