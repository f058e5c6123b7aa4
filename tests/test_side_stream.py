"""The side stream (launch-graph captures, builds) is cf's own, made by the driver, not one of torch's.

torch hands out the 32 streams of each pool in turn, so a side stream taken from that pool is, after
32 more ``torch.cuda.Stream()`` calls anywhere in the process, some thread's own stream too: on the
H200 that thread's torch ops were then refused ("operation not permitted when stream is capturing")
or recorded into another thread's launch-graph capture, and its outputs came out wrong
(bench/results/thread_stress_*.json; docs/decisions.md, "The side stream is no pool stream").
Here on a stand-in driver library: the calls ``launch_graphs.private_stream`` makes, and the
fallback of ``plans._side_stream``."""

from __future__ import annotations

import ctypes
import logging

import pytest
import torch

from cudnn_fuse import handles, launch_graphs, plans


class FakeCuda:
    """Records the driver calls and fills their out-parameters."""

    def __init__(self, fail=None):
        self.calls, self.fail, self.current = [], fail, []

    def _fn(self, name, body):
        def f(*args):
            self.calls.append(name)
            if name == self.fail:
                return 999
            body(*args)
            return 0
        return f

    def __getattr__(self, name):
        def out(p, value, kind):
            ctypes.cast(p, ctypes.POINTER(kind))[0] = value

        bodies = {
            "cuDeviceGet": lambda p, ordinal: out(p, ordinal + 10, ctypes.c_int),
            "cuDevicePrimaryCtxRetain": lambda p, dev: out(p, 0x1000 + dev, ctypes.c_void_p),
            "cuCtxPushCurrent_v2": lambda ctx: self.current.append(ctx),
            "cuCtxPopCurrent_v2": lambda p: out(p, self.current.pop(), ctypes.c_void_p),
            "cuStreamCreate": lambda p, flags: (self.calls.append(("flags", flags)), out(p, 0xABC0 + len(self.current), ctypes.c_void_p)),
        }
        if name not in bodies:
            raise AttributeError(name)
        fn = self._fn(name, bodies[name])
        object.__setattr__(self, name, fn)
        return fn


def test_a_private_stream_is_created_non_blocking_in_the_devices_primary_context():
    lib = FakeCuda()
    s = launch_graphs.private_stream(1, lib=lib)
    assert s == 0xABC1  # created while the context was pushed
    assert lib.calls == ["cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxPushCurrent_v2", "cuStreamCreate",
                         ("flags", launch_graphs.CU_STREAM_NON_BLOCKING), "cuCtxPopCurrent_v2"]
    assert lib.current == []  # the thread's context is given back


def test_a_failed_create_still_pops_the_context_and_names_the_call():
    lib = FakeCuda(fail="cuStreamCreate")
    with pytest.raises(RuntimeError, match="cuStreamCreate failed: CUresult 999"):
        launch_graphs.private_stream(0, lib=lib)
    assert lib.calls[-1] == "cuCtxPopCurrent_v2" and lib.current == []


def test_a_failed_retain_pushes_nothing():
    lib = FakeCuda(fail="cuDevicePrimaryCtxRetain")
    with pytest.raises(RuntimeError, match="cuDevicePrimaryCtxRetain"):
        launch_graphs.private_stream(0, lib=lib)
    assert "cuCtxPushCurrent_v2" not in lib.calls


def test_the_side_stream_is_made_once_per_device_by_the_driver(monkeypatch):
    made = []
    monkeypatch.setattr(handles, "_side_streams", {})
    monkeypatch.setattr(launch_graphs, "private_stream", lambda d: made.append(d) or 500 + d)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: pytest.fail("a torch pool stream was taken"))
    assert [plans._side_stream(d) for d in (0, 0, 1, 0, 1)] == [500, 500, 501, 500, 501]
    assert made == [0, 1]


def test_without_the_driver_the_side_stream_is_a_pool_stream_and_a_warning_says_so(monkeypatch, caplog):
    class Pool:
        cuda_stream = 77

    def no_driver(device):
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(handles, "_side_streams", {})
    monkeypatch.setattr(launch_graphs, "private_stream", no_driver)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: Pool())
    with caplog.at_level(logging.WARNING, logger="cudnn_fuse"):
        assert plans._side_stream(0) == 77 and plans._side_stream(0) == 77
    warned = [r for r in caplog.records if "side stream" in r.getMessage()]
    assert len(warned) == 1 and "libcuda.so.1" in warned[0].getMessage()
