"""Launch graphs (launch_graphs.py): when Plan.launch captures, replays or launches raw, on a
stand-in driver and a stand-in cuDNN entry point (the real capture and replay are GPU tests,
test_gpu_launch_graphs.py). What must hold: a pointer set is captured on its AFTER-th sighting
and replayed after that; the key holds every pointer including the workspace; torch's own
capture, another current device, or graphs switched off always launch raw; a failed capture or
replay launches raw that very call and turns the plan's graphs off; a plan keeps at most PER_PLAN
graphs and destroys the ones it drops."""

from __future__ import annotations

import contextlib
import functools
import ctypes
import types

import pytest
import torch

from cudnn_fuse import handles, launch_graphs, loader, plans
from recorded import recorded_spec
from tests.racing import race


class FakeDriver:
    def __init__(self, fail_capture=False, launch_rc=0):
        self.events, self.fail_capture, self.launch_rc = [], fail_capture, launch_rc
        self.next = 100
        self.destroyed = []

    kernels = True  # the real Driver's: whether captures may replay as their kernel

    def capture(self, stream, work, kernel_only=False):
        self.events.append(("begin", stream) if not kernel_only else ("begin kernel only", stream))
        work()
        if kernel_only:  # this stand-in's captures are never one kernel node
            raise launch_graphs.NotOneKernel("the capture is not one kernel node")
        if self.fail_capture:
            raise launch_graphs.DriverError("cuStreamEndCapture: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED")
        self.next += 1
        self.events.append(("instantiated", self.next))
        return self.next

    def launch(self, ex, stream):
        self.events.append(("replay", ex, stream))
        return self.launch_rc

    def error_name(self, rc):
        return f"CUresult {rc}"

    def destroy(self, ex):
        self.destroyed.append(ex)


class Rig:
    """A Plan with a stand-in raw entry point recording (stream at launch, pointers, workspace)."""

    def __init__(self, monkeypatch, drv, workspace=0):
        import cudnn

        self.raw_calls = []
        self.stream, self.device, self.capturing = 7, 0, False
        array = (ctypes.c_uint64 * 3)()
        self.handle = handles._Handle(handle=object())
        handle = self.handle

        def entry(address, n, ws, raw_handle, index):
            self.raw_calls.append((handle.stream, tuple(array), ws))

        p = object.__new__(plans.Plan)
        p.spec = types.SimpleNamespace(op="matmul")
        p.engine, p.device, p.workspace_size, p.graph, p.uids, p._ordered = "eng0", 0, workspace, None, (1, 2, 3), True
        p._handle = handle
        p._raw = (entry, (0, 1, 2), array, ctypes.addressof(array), 3, -1, 0)
        p._graphs = launch_graphs.GraphSet(drv)
        self.plan, self.drv = p, drv
        self.ws = 5000
        monkeypatch.setattr(launch_graphs, "ENABLED", True)  # off by default: these tests switch it on
        monkeypatch.setattr(handles, "_caller_captures", {})  # the streams its launches find capturing
        monkeypatch.setattr(plans, "_current_stream", lambda d: self.stream)
        monkeypatch.setattr(plans, "_capturing", lambda: self.capturing)
        monkeypatch.setattr(plans, "_current_device", lambda: self.device)
        monkeypatch.setattr(plans, "_side_stream", lambda d: 99)
        monkeypatch.setattr(plans, "_workspace_ptr", lambda d, s, size, capturing=None: (self.ws, None))
        monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())

        def set_stream(handle, stream):
            self.handle.stream = stream
        monkeypatch.setattr(cudnn, "set_stream", set_stream)

    def replays(self):
        return [e for e in self.drv.events if e[0] == "replay"]


@pytest.fixture
def after2(monkeypatch):
    monkeypatch.setattr(launch_graphs, "AFTER", 2)


def test_a_pointer_set_is_captured_on_its_second_sighting_and_replayed_after(monkeypatch, after2):
    rig = Rig(monkeypatch, FakeDriver())
    before = launch_graphs.STATS.snapshot()
    rig.plan.launch([11, 12, 13])  # first sighting: raw, on the current stream
    assert rig.raw_calls == [(7, (11, 12, 13), 0)] and rig.replays() == []
    rig.plan.launch([11, 12, 13])  # second: captured on the side stream, then replayed on the current one
    assert rig.raw_calls[1] == (99, (11, 12, 13), 0)
    assert rig.drv.events[0] == ("begin", 99) and rig.replays() == [("replay", 101, 7)]
    rig.stream = 8
    rig.plan.launch([11, 12, 13])  # from now on a replay only, on whatever stream is current
    assert len(rig.raw_calls) == 2 and rig.replays()[-1] == ("replay", 101, 8)
    after = launch_graphs.STATS.snapshot()
    assert after["graph_captures"] - before["graph_captures"] == 1
    assert after["graph_replays"] - before["graph_replays"] == 2
    assert {k: v for k, v in loader.plan_stats().items() if k.startswith("graph_")} == after
    # a raw launch after the capture switches the handle back to the current stream
    rig.plan.launch([21, 22, 23])
    assert rig.raw_calls[-1] == (8, (21, 22, 23), 0)


def test_every_pointer_is_in_the_key_the_workspace_too(monkeypatch, after2):
    rig = Rig(monkeypatch, FakeDriver(), workspace=64)
    for _ in range(2):
        rig.plan.launch([1, 2, 3])
    assert rig.replays() == [("replay", 101, 7)]
    for changed in ([1, 2, 4], [0, 2, 3], [1, 9, 3]):
        rig.plan.launch(changed)  # a first sighting of each: raw
    assert len(rig.replays()) == 1
    rig.ws = 6000  # the stream's workspace grew (a new buffer): the old graph must not serve
    rig.plan.launch([1, 2, 3])
    assert len(rig.replays()) == 1 and rig.raw_calls[-1] == (7, (1, 2, 3), 6000)
    rig.plan.launch([1, 2, 3])
    assert rig.replays()[-1] == ("replay", 102, 7) and rig.raw_calls[-1] == (99, (1, 2, 3), 6000)


@pytest.mark.parametrize("why", ["torch is capturing", "another device is current", "graphs off"])
def test_these_launch_raw_every_time(monkeypatch, after2, why):
    rig = Rig(monkeypatch, FakeDriver())
    if why == "torch is capturing":
        rig.capturing = True
    elif why == "another device is current":
        rig.device = 1
    else:
        rig.plan._graphs = None
    for _ in range(4):
        rig.plan.launch([1, 2, 3])
    assert rig.replays() == [] and [c[0] for c in rig.raw_calls] == [7] * 4
    assert not rig.drv.events


def test_a_failed_capture_launches_raw_that_call_and_turns_the_plans_graphs_off(monkeypatch, after2):
    rig = Rig(monkeypatch, FakeDriver(fail_capture=True))
    cleared = []
    monkeypatch.setattr(launch_graphs, "clear_runtime_error", lambda: cleared.append(1))
    failures = launch_graphs.STATS.failures
    rig.plan.launch([1, 2, 3])
    rig.plan.launch([1, 2, 3])  # the capture fails: this call still runs, raw, on the current stream
    assert rig.raw_calls[-1] == (7, (1, 2, 3), 0) and rig.raw_calls[-2][0] == 99
    assert rig.plan._graphs.off and cleared == [1] and launch_graphs.STATS.failures == failures + 1
    n = len(rig.drv.events)
    for _ in range(3):
        rig.plan.launch([1, 2, 3])
    assert len(rig.drv.events) == n and [c[0] for c in rig.raw_calls[-3:]] == [7, 7, 7]


def test_a_failed_replay_launches_raw_and_drops_the_graphs(monkeypatch, after2):
    rig = Rig(monkeypatch, FakeDriver(launch_rc=700))
    monkeypatch.setattr(launch_graphs, "clear_runtime_error", lambda: None)
    rig.plan.launch([1, 2, 3])
    rig.plan.launch([1, 2, 3])
    assert rig.raw_calls[-1] == (7, (1, 2, 3), 0)  # the replay failed: launched raw
    assert rig.plan._graphs.off and rig.drv.destroyed == [101]


def test_a_plan_keeps_at_most_per_plan_graphs(monkeypatch, after2):
    monkeypatch.setattr(launch_graphs, "PER_PLAN", 3)
    rig = Rig(monkeypatch, FakeDriver())
    for k in range(5):
        for _ in range(3):
            rig.plan.launch([k, 2, 3])
    assert list(rig.plan._graphs.execs) == [(0, 2, 2, 3), (0, 3, 2, 3), (0, 4, 2, 3)]
    assert rig.drv.destroyed == [101, 102]
    rig.plan._graphs.release()
    assert sorted(rig.drv.destroyed) == [101, 102, 103, 104, 105]


def test_a_plan_whose_graphs_are_not_reused_stops_capturing_until_they_are(monkeypatch, after2):
    monkeypatch.setattr(launch_graphs, "CHURN_CAPTURES", 4)
    monkeypatch.setattr(launch_graphs, "CHURN_REUSES_PER_CAPTURE", 2)
    rig = Rig(monkeypatch, FakeDriver())
    gs = rig.plan._graphs
    replays = launch_graphs.STATS.replays
    for k in range(4):  # each pointer set seen 3 times, then never again: 4 captures, 4 reuses
        for _ in range(3):
            rig.plan.launch([k, 0, 0])
    assert (gs.captures, gs.reuses, launch_graphs.STATS.replays - replays) == (4, 4, 8)
    for k in range(4, 8):  # the gate: 4 reuses < 2 x 4 captures, so these launch raw, uncaptured
        for _ in range(3):
            rig.plan.launch([k, 0, 0])
    assert gs.captures == 4 and not gs.off and len(gs.execs) == 4
    assert [c[1][0] for c in rig.raw_calls[-12:]] == [4, 4, 4, 5, 5, 5, 6, 6, 6, 7, 7, 7]
    for _ in range(4):  # the graphs it holds get reused: 8 reuses >= 2 x 4, captures resume
        rig.plan.launch([0, 0, 0])
    assert gs.reuses == 8
    for _ in range(2):
        rig.plan.launch([9, 0, 0])
    assert gs.captures == 5 and (0, 9, 0, 0) in gs.execs
    kept = Rig(monkeypatch, FakeDriver())
    for k in range(8):  # captures each replayed often: never gated
        for _ in range(12):
            kept.plan.launch([k, 0, 0])
    assert kept.plan._graphs.captures == 8 and len(kept.plan._graphs.execs) == 8


def test_a_steady_pointer_set_after_a_phase_of_churn_gets_captured(monkeypatch):
    """cf.capture's warm-up of a 100-call chain shows a plan 100 pointer sets that never recur: the gate
    shuts after CHURN_CAPTURES of them. A steady loop afterwards (one pointer set, forever) must not
    launch raw for good: after CHURN_WAIT refused captures a new window opens and it is captured (on
    the H200, 2 of 3 rounds of the suite's host row ran 14.9-15.6 us a call against 7.6 for that reason,
    bench/results/native/suite_host_overhead.json)."""
    gs = launch_graphs.GraphSet(FakeDriver())
    for _ in range(3):  # the chain's warm-up: 100 pointer sets, 3 sightings each
        for i in range(100):
            key = (0, i)
            if key not in gs.execs and gs.sighted(key):
                gs.execs[key] = i
                gs.captures += 1
    assert launch_graphs.CHURN_CAPTURES <= gs.captures < 100 and gs.reuses == 0  # the gate shut during it
    wait = launch_graphs.CHURN_WAIT * gs.backoff - gs.gated  # the refusals left before the next window
    for n in range(1, 10_000):  # then one pointer set, call after call
        if gs.sighted((0, "steady")):
            break
    assert n <= launch_graphs.AFTER * wait, (n, wait)


def test_a_plan_whose_pointer_sets_never_recur_captures_ever_more_rarely():
    gs = launch_graphs.GraphSet(FakeDriver())
    due = 0
    for i in range(30_000):  # every pointer set due once (AFTER sightings), never reused
        due += 1
        if gs._gate_open():
            gs.captures += 1
    # windows of CHURN_CAPTURES captures, each after twice the last wait: a few hundred captures, not 30000
    assert launch_graphs.CHURN_CAPTURES * 5 <= gs.captures <= launch_graphs.CHURN_CAPTURES * 12, gs.captures
    assert gs.backoff >= 2 ** 8
    gs.reuses += launch_graphs.CHURN_REUSES_PER_CAPTURE * gs.captures  # the window pays after all: the wait resets
    assert gs._gate_open() and gs.backoff == 1


@pytest.mark.parametrize("after", [1, 3])
def test_after_is_the_sightings_before_a_capture(monkeypatch, after):
    monkeypatch.setattr(launch_graphs, "AFTER", after)
    rig = Rig(monkeypatch, FakeDriver())
    for _ in range(after):
        rig.plan.launch([1, 2, 3])
    assert len(rig.replays()) == 1 and len(rig.raw_calls) == after  # the last raw call is the capture's
    assert rig.raw_calls[-1][0] == 99


def test_the_count_of_sightings_is_bounded(monkeypatch, after2):
    monkeypatch.setattr(launch_graphs, "SEEN_CAP", 4)
    gs = launch_graphs.GraphSet(FakeDriver())
    for k in range(10):
        assert gs.sighted(k) is False
        assert len(gs.seen) <= 4


def test_no_driver_no_graphs(monkeypatch):
    monkeypatch.setattr(launch_graphs, "_driver", None)
    monkeypatch.setattr(launch_graphs, "ENABLED", True)

    def no_lib(*a, **k):
        raise OSError("libcuda.so.1: cannot open shared object file")
    monkeypatch.setattr(launch_graphs, "Driver", no_lib)
    assert launch_graphs.new_set() is None and launch_graphs.ENABLED is False
    monkeypatch.setattr(launch_graphs, "ENABLED", False)
    monkeypatch.setattr(launch_graphs, "Driver", lambda: pytest.fail("graphs are off: no driver"))
    assert launch_graphs.new_set() is None


def test_the_driver_binds_the_entry_points_by_their_abi_names():
    calls = []

    class Lib:
        def __getattr__(self, name):
            def f(*a):
                calls.append((name, a))
                return 0
            return f

    d = launch_graphs.Driver(Lib())
    d.capture(42, lambda: calls.append(("work",)))
    names = [c[0] for c in calls]
    assert names == ["cuStreamBeginCapture_v2", "work", "cuStreamEndCapture", "cuGraphInstantiateWithFlags"]
    assert calls[0][1][1] == launch_graphs.CAPTURE_MODE_THREAD_LOCAL
    assert d.launch(7, 9) == 0 and calls[-1] == ("cuGraphLaunch", (7, 9))
    with pytest.raises(launch_graphs.DriverError, match="cuGraphLaunch"):
        d.check(3, "cuGraphLaunch")


def test_a_capture_that_raises_still_ends_the_capture():
    calls = []

    class Lib:
        def __getattr__(self, name):
            def f(*a):
                calls.append(name)
                return 0
            return f

    d = launch_graphs.Driver(Lib())

    def work():
        raise RuntimeError("cuDNN: operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError, match="capturing"):
        d.capture(42, work)
    assert calls == ["cuStreamBeginCapture_v2", "cuStreamEndCapture"]


def test_set_launch_graphs_off_takes_effect_at_the_next_launch(monkeypatch, after2):
    import cudnn_fuse as cf

    monkeypatch.setattr(launch_graphs, "ENABLED", True)
    rig = Rig(monkeypatch, FakeDriver())
    for _ in range(2):
        rig.plan.launch([1, 2, 3])
    assert len(rig.replays()) == 1
    cf.set_launch_graphs(False)
    rig.plan.launch([1, 2, 3])
    assert len(rig.replays()) == 1 and rig.raw_calls[-1] == (7, (1, 2, 3), 0)
    cf.set_launch_graphs(True)
    rig.plan.launch([1, 2, 3])
    assert len(rig.replays()) == 2
    with pytest.raises(TypeError, match="enabled"):
        cf.set_launch_graphs("no")


def test_the_default_stream_is_never_asked_whether_it_captures(monkeypatch, after2):
    rig = Rig(monkeypatch, FakeDriver())
    rig.stream = 0  # the legacy default stream cannot be captured: the check is skipped there

    def asked():
        raise AssertionError("asked")
    monkeypatch.setattr(plans, "_capturing", asked)
    for _ in range(3):
        rig.plan.launch([1, 2, 3])
    assert rig.replays()[-1] == ("replay", 101, 0)


def _ts(*shape, dtype="float16"):
    from cudnn_fuse.spec import TensorSpec

    return TensorSpec.contiguous(shape, dtype)




def _m(*s, dtype=torch.float16):
    return torch.empty(*s, device="meta", dtype=dtype)


def _cl(t):
    return t.contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("name,worth", [
    ("linear 64x256x256", True), ("linear 2048^3", False), ("linear m1 1024x1024", True),
    ("conv b1 c64 56x56", True), ("conv b32 c64 56x56", False), ("sdpa b1 h12 s128", True),
    ("sdpa b4 h16 s2048", False), ("dgrad b32 c256 14x14", False), ("dgrad b1 c64 8x8", True),
    ("wgrad b32 c256 14x14", False), ("act_grad 64x256", True), ("act_grad 8192x8192", False),
    ("sdpa backward b1 h12 s128", True), ("sdpa backward b2 h16 s4096", False),
])
def test_only_short_kernels_get_graphs(name, worth):
    import cudnn_fuse as cf
    from cudnn_fuse import spec as S

    geo = dict(stride=(1, 1), pre_padding=(1, 1), post_padding=(1, 1), dilation=(1, 1))
    specs = {
        "linear 64x256x256": lambda: recorded_spec(lambda: cf.linear(_m(64, 256), _m(256, 256), _m(256), activation="relu")),
        "linear 2048^3": lambda: recorded_spec(lambda: cf.linear(_m(2048, 2048), _m(2048, 2048), _m(2048))),
        "linear m1 1024x1024": lambda: recorded_spec(lambda: cf.linear(_m(1, 1024), _m(1024, 1024), _m(1024),
                                                                   activation="gelu")),
        "conv b1 c64 56x56": lambda: recorded_spec(lambda: cf.conv2d(_cl(_m(1, 64, 56, 56)), _cl(_m(64, 64, 3, 3)), _m(64),
                                                                 padding=1, activation="relu")),
        "conv b32 c64 56x56": lambda: recorded_spec(lambda: cf.conv2d(_cl(_m(32, 64, 56, 56)), _cl(_m(64, 64, 3, 3)),
                                                                  _m(64), padding=1, activation="relu")),
        "sdpa b1 h12 s128": lambda: recorded_spec(lambda: cf.scaled_dot_product_attention(
            _m(1, 12, 128, 64), _m(1, 12, 128, 64), _m(1, 12, 128, 64), is_causal=True)),
        "sdpa b4 h16 s2048": lambda: recorded_spec(lambda: cf.scaled_dot_product_attention(
            _m(4, 16, 2048, 128), _m(4, 16, 2048, 128), _m(4, 16, 2048, 128))),
        "dgrad b32 c256 14x14": lambda: S.ConvDgradSpec(_ts(32, 256, 14, 14), _ts(256, 256, 3, 3), _ts(32, 256, 14, 14),
                                                        **geo),
        "dgrad b1 c64 8x8": lambda: S.ConvDgradSpec(_ts(1, 64, 8, 8), _ts(64, 64, 3, 3), _ts(1, 64, 8, 8), **geo),
        "wgrad b32 c256 14x14": lambda: S.ConvWgradSpec(_ts(32, 256, 14, 14), _ts(32, 256, 14, 14), _ts(256, 256, 3, 3),
                                                        **geo),
        "act_grad 64x256": lambda: S.ActGradSpec(_ts(64, 256), _ts(64, 256), _ts(64, 256), "gelu"),
        "act_grad 8192x8192": lambda: S.ActGradSpec(_ts(8192, 8192), _ts(8192, 8192), _ts(8192, 8192), "gelu"),
        "sdpa backward b1 h12 s128": lambda: S.SdpaBwdSpec(*(_ts(1, 12, 128, 64) for _ in range(5)),
                                                           _ts(1, 12, 128, 1, dtype="float32"),
                                                           *(_ts(1, 12, 128, 64) for _ in range(3)), is_causal=True),
        "sdpa backward b2 h16 s4096": lambda: S.SdpaBwdSpec(*(_ts(2, 16, 4096, 64) for _ in range(5)),
                                                            _ts(2, 16, 4096, 1, dtype="float32"),
                                                            *(_ts(2, 16, 4096, 64) for _ in range(3)), is_causal=True),
    }
    spec = specs[name]()
    assert launch_graphs.estimated_us(spec) is not None
    assert launch_graphs.worth_graphs(spec) is worth, launch_graphs.estimated_us(spec)


def test_a_spec_that_cannot_be_estimated_gets_no_graphs(monkeypatch):
    assert launch_graphs.estimated_us(types.SimpleNamespace(op="mystery")) is None
    assert launch_graphs.worth_graphs(types.SimpleNamespace(op="mystery")) is False
    monkeypatch.setattr(launch_graphs, "ENABLED", True)
    monkeypatch.setattr(launch_graphs, "_driver", FakeDriver())
    assert launch_graphs.new_set(types.SimpleNamespace(op="mystery")) is None
    assert isinstance(launch_graphs.new_set(), launch_graphs.GraphSet)


def _long_conv_spec():
    import cudnn_fuse as cf

    return recorded_spec(lambda: cf.conv2d(_cl(_m(32, 128, 56, 56)), _cl(_m(128, 128, 3, 3)), _m(128), padding=1,
                                       activation="relu"))


@pytest.mark.parametrize("case", ["default", "kernel replays off"])
def test_a_long_kernel_gets_kernel_replays_only(monkeypatch, case):
    spec = _long_conv_spec()
    est = launch_graphs.estimated_us(spec)
    assert est > launch_graphs.MAX_US and not launch_graphs.worth_graphs(spec)  # too long for graph replays
    drv = FakeDriver()
    drv.kernels = case != "kernel replays off"
    monkeypatch.setattr(launch_graphs, "ENABLED", True)
    monkeypatch.setattr(launch_graphs, "_driver", drv)
    gs = launch_graphs.new_set(spec)
    if case == "kernel replays off":
        assert gs is None
    else:
        assert isinstance(gs, launch_graphs.GraphSet) and gs.kernel_only is True
    short = launch_graphs.new_set(recorded_spec(lambda: __import__("cudnn_fuse").linear(_m(64, 256), _m(256, 256))))
    assert isinstance(short, launch_graphs.GraphSet) and short.kernel_only is False  # graphs or kernels, either


def test_a_long_kernels_capture_that_is_not_one_kernel_is_dropped_and_it_launches_raw(monkeypatch, after2):
    rig = Rig(monkeypatch, FakeDriver())
    rig.plan._graphs = launch_graphs.GraphSet(rig.drv, kernel_only=True)
    monkeypatch.setattr(launch_graphs, "clear_runtime_error", lambda: pytest.fail("a decline is not a failure"))
    failures, declined = launch_graphs.STATS.failures, launch_graphs.STATS.declined
    rig.plan.launch([1, 2, 3])
    rig.plan.launch([1, 2, 3])  # captured (kernel only), not one kernel: dropped, and this call launches raw
    assert rig.drv.events == [("begin kernel only", 99)] and rig.replays() == []
    assert rig.raw_calls[-1] == (7, (1, 2, 3), 0) and rig.plan._graphs.off
    assert launch_graphs.STATS.declined == declined + 1 and launch_graphs.STATS.failures == failures
    assert loader.plan_stats()["graph_declined"] == launch_graphs.STATS.declined
    for _ in range(3):
        rig.plan.launch([1, 2, 3])
    assert len(rig.drv.events) == 1 and [c[0] for c in rig.raw_calls[-3:]] == [7, 7, 7]  # no capture again


def test_a_long_kernels_one_kernel_capture_replays_as_its_kernel(monkeypatch, after2):
    class KernelDriver(FakeDriver):
        def capture(self, stream, work, kernel_only=False):
            assert kernel_only
            work()
            self.lib = NodeLib()
            return launch_graphs.Driver(self.lib)._kernel_of(NodeLib.GRAPH, stream)

    rig = Rig(monkeypatch, KernelDriver())
    rig.plan._graphs = launch_graphs.GraphSet(rig.drv, kernel_only=True)
    for _ in range(4):
        rig.plan.launch([1, 2, 3])
    assert isinstance(rig.plan._graphs.execs[(0, 1, 2, 3)], launch_graphs.KernelReplay)
    assert len([c for c in rig.drv.lib.calls if c[0] == "cuLaunchKernelEx"]) == 3 and len(rig.raw_calls) == 2


@pytest.mark.parametrize("case", ["memset and kernel", "two kernels", "kernel replay off"])
def test_a_kernel_only_capture_of_another_graph_is_never_instantiated(monkeypatch, case):
    lib = NodeLib({"memset and kernel": (2, 0), "two kernels": (0, 0)}.get(case, (0,)))
    d = launch_graphs.Driver(lib)
    d.kernels = case != "kernel replay off"  # a driver that cannot launch captured kernels
    with pytest.raises(launch_graphs.NotOneKernel) as err:
        d.capture(42, lambda: None, kernel_only=True)
    assert str(err.value).endswith({"memset and kernel": "(memset, kernel)", "two kernels": "(kernel, kernel)",
                                    "kernel replay off": "kernel replays are off"}[case])
    assert "cuGraphInstantiateWithFlags" not in lib.names()
    name, args = lib.calls[-1]
    assert name == "cuGraphDestroy" and getattr(args[0], "value", args[0]) == NodeLib.GRAPH  # the graph dropped


def test_no_capture_past_the_process_cap(monkeypatch, after2):
    """Past MAX_LIVE live graphs no capture is made. The count is the process's: an earlier test's
    GraphSet collected mid-test gives its graphs back and lowers it (this test failed so, once the
    suite ran with matplotlib installed and more garbage about), so leftovers are collected first
    and the collector is off while the count is read."""
    import gc

    rig = Rig(monkeypatch, FakeDriver())
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        monkeypatch.setattr(launch_graphs.STATS, "live", launch_graphs.MAX_LIVE)
        for _ in range(4):
            rig.plan.launch([1, 2, 3])
        assert rig.replays() == [] and not rig.plan._graphs.off  # raw, and graphs stay on for when there is room
        monkeypatch.setattr(launch_graphs.STATS, "live", 0)
        rig.plan.launch([1, 2, 3])
        rig.plan.launch([1, 2, 3])
        assert len(rig.replays()) == 1 and launch_graphs.STATS.live == 1
        rig.plan._graphs.release()
        assert launch_graphs.STATS.live == 0
    finally:
        if was:
            gc.enable()


def test_on_by_default_and_off_by_environment():
    import subprocess
    import sys

    env = {k: v for k, v in __import__("os").environ.items() if k != "CUDNN_FUSE_LAUNCH_GRAPHS"}
    code = "from cudnn_fuse import launch_graphs as g; print(g.ENABLED)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True"]
    for off in ("0", "off", "False"):
        env["CUDNN_FUSE_LAUNCH_GRAPHS"] = off
        code_off = "from cudnn_fuse import launch_graphs as g; print(g.ENABLED, g.new_set() is None)"
        out = subprocess.run([sys.executable, "-c", code_off], env=env, capture_output=True, text=True,
                             check=True).stdout
        assert out.split() == ["False", "True"], off


class NodeLib:
    """A stand-in libcuda whose captured graph has the given node types; its kernel node has a
    2x3x1 grid of 128 threads, 4096 bytes of shared memory, parameters at 0x5000 and a cluster
    dimension (attribute 4); records every call by name."""

    GRAPH, NODE, FUNC, PARAMS = 0x100, 0x200, 0x300, 0x5000

    EXTRA = 0x6000

    def __init__(self, types_=(0,), fail_attr=(), func=FUNC, args="params"):
        self.types, self.fail_attr, self.func = list(types_), set(fail_attr), func
        self.args = args  # how the kernel's arguments come back: "params", "extra" or "none"
        self.calls = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        handler = getattr(type(self), "_" + name, None)

        def f(*a):
            self.calls.append((name, a))
            return handler(self, *a) if handler is not None else 0
        return f

    def _cuStreamEndCapture(self, stream, graph):
        graph._obj.value = self.GRAPH
        return 0

    def _cuGraphInstantiateWithFlags(self, ex, graph, flags):
        ex._obj.value = 0x900
        return 0

    def _cuGraphGetNodes(self, graph, nodes, n):
        if nodes is not None:
            for i in range(len(self.types)):
                nodes[i] = self.NODE + i
        n._obj.value = len(self.types)
        return 0

    def _cuGraphNodeGetType(self, node, kind):
        kind._obj.value = self.types[node - self.NODE]
        return 0

    def _cuGraphKernelNodeGetParams_v2(self, node, p):
        p = p._obj
        p.func, p.kern = self.func, 0x777
        p.kernelParams = self.PARAMS if self.args == "params" else 0
        p.extra = self.EXTRA if self.args == "extra" else 0
        p.gx, p.gy, p.gz, p.bx, p.by, p.bz, p.smem = 2, 3, 1, 128, 1, 1, 4096
        return 0

    def _cuGraphKernelNodeGetAttribute(self, node, aid, value):
        if aid in self.fail_attr:
            return 1  # CUDA_ERROR_INVALID_VALUE
        if aid == 4:
            value._obj.words[0] = 2 | (1 << 32)  # cluster (2, 1, 1)
            value._obj.words[1] = 1
        return 0

    def _cuKernelGetFunction(self, f, kern):
        f._obj.value = 0x301
        return 0

    def names(self):
        return [c[0] for c in self.calls]


def test_a_one_kernel_graph_replays_as_its_kernel():
    lib = NodeLib()
    d = launch_graphs.Driver(lib)
    k = d.capture(42, lambda: None)
    assert isinstance(k, launch_graphs.KernelReplay)
    assert "cuGraphInstantiateWithFlags" not in lib.names() and "cuGraphDestroy" not in lib.names()
    assert k.func == NodeLib.FUNC and k.params == NodeLib.PARAMS and k.attribute_ids == [4]
    cfg = k.cfg
    assert (cfg.gx, cfg.gy, cfg.gz, cfg.bx, cfg.by, cfg.bz, cfg.smem, cfg.hStream) == (2, 3, 1, 128, 1, 1, 4096, 42)
    assert bytes(k.attrs[0].value.bytes)[:12] == (2).to_bytes(4, "little") + (1).to_bytes(4, "little") * 2
    assert k.launch(42) == 0
    name, args = lib.calls[-1]
    assert name == "cuLaunchKernelEx" and [getattr(a, "value", a) for a in args[1:]] == [NodeLib.FUNC, NodeLib.PARAMS, None]
    assert ctypes.addressof(args[0]._obj) == ctypes.addressof(k.cfg)  # the config itself, by reference
    k.launch(43)  # another stream: the config follows it
    assert k.cfg.hStream == 43 and k.stream == 43
    d.destroy(k)
    assert lib.calls[-1] == ("cuGraphDestroy", (NodeLib.GRAPH,))


@pytest.mark.parametrize("kernels", [True, False])
def test_a_capture_with_no_node_is_refused_not_replayed(monkeypatch, kernels):
    """A launch that went to another stream while the side stream captured (another thread moved the
    shared handle's stream) leaves an empty graph. Instantiated, it would 'replay' nothing for that
    pointer set from then on, so the output is never written: the capture fails instead (the plan
    launches raw) and the empty graph is destroyed."""
    lib = NodeLib(())
    d = launch_graphs.Driver(lib)
    d.kernels = kernels
    with pytest.raises(launch_graphs.DriverError, match="no node"):
        d.capture(42, lambda: None)
    assert "cuGraphInstantiateWithFlags" not in lib.names() and lib.names()[-1] == "cuGraphDestroy"


def test_a_kernel_whose_arguments_come_as_one_buffer_replays_with_that_buffer():
    # cuBLAS's kernels (cuDNN's eng0 on the H200) are launched with extra (CU_LAUNCH_PARAM_BUFFER_POINTER)
    lib = NodeLib(args="extra")
    k = launch_graphs.Driver(lib).capture(42, lambda: None)
    assert isinstance(k, launch_graphs.KernelReplay) and k.params is None
    assert k.launch(42) == 0
    name, args = lib.calls[-1]
    assert name == "cuLaunchKernelEx" and [getattr(a, "value", a) for a in args[1:]] == [NodeLib.FUNC, None, NodeLib.EXTRA]


def test_a_kernel_node_with_no_arguments_readable_is_not_launched_directly():
    lib = NodeLib(args="none")
    ex = launch_graphs.Driver(lib).capture(42, lambda: None)
    assert ex == 0x900 and "cuGraphInstantiateWithFlags" in lib.names()


@pytest.mark.parametrize("case", ["memset and kernel", "two kernels", "a memset", "cluster unreadable",
                                  "cooperative unreadable", "kernel replay off"])
def test_other_graphs_replay_as_graphs(monkeypatch, case):
    types_ = {"memset and kernel": (2, 0), "two kernels": (0, 0), "a memset": (2,)}.get(case, (0,))
    fail = {"cluster unreadable": (4,), "cooperative unreadable": (2,)}.get(case, ())
    lib = NodeLib(types_, fail_attr=fail)
    d = launch_graphs.Driver(lib)
    d.kernels = case != "kernel replay off"
    ex = d.capture(42, lambda: None)
    assert ex == 0x900 and "cuGraphInstantiateWithFlags" in lib.names()
    assert lib.names()[-1] == "cuGraphDestroy"  # the graph, once instantiated
    # one read is the node count (an empty capture is refused); the kernel check reads them again
    assert (lib.names().count("cuGraphGetNodes") > 1) is (case != "kernel replay off")
    d.destroy(ex)
    assert lib.calls[-1] == ("cuGraphExecDestroy", (0x900,))


def test_an_unreadable_hint_is_left_out_and_a_library_kernel_gets_its_function():
    lib = NodeLib(fail_attr=(14,), func=0)  # no function handle in the node: the CUkernel's
    k = launch_graphs.Driver(lib).capture(42, lambda: None)
    assert isinstance(k, launch_graphs.KernelReplay) and k.func == 0x301 and k.attribute_ids == [4]


def test_a_driver_without_the_kernel_entry_points_replays_graphs(caplog):
    class Old(NodeLib):
        def __getattr__(self, name):
            if name == "cuLaunchKernelEx":
                raise AttributeError(name)
            return super().__getattr__(name)

    lib = Old()
    d = launch_graphs.Driver(lib)
    assert d.kernels is False and d.capture(42, lambda: None) == 0x900


def test_a_plan_launches_its_kernel_replay_and_counts_it(monkeypatch, after2):
    class KernelDriver(FakeDriver):
        def capture(self, stream, work, kernel_only=False):
            work()
            lib = NodeLib()
            self.lib = lib
            return launch_graphs.Driver(lib)._kernel_of(NodeLib.GRAPH, stream)

    rig = Rig(monkeypatch, KernelDriver())
    kernels = launch_graphs.STATS.kernels
    for _ in range(4):
        rig.plan.launch([1, 2, 3])
    k = rig.plan._graphs.execs[(0, 1, 2, 3)]
    assert isinstance(k, launch_graphs.KernelReplay) and launch_graphs.STATS.kernels == kernels + 1
    launches = [c for c in rig.drv.lib.calls if c[0] == "cuLaunchKernelEx"]
    assert len(launches) == 3 and len(rig.raw_calls) == 2 and rig.replays() == []  # never a graph launch
    assert k.stream == 7
    rig.stream = 8
    rig.plan.launch([1, 2, 3])
    assert k.cfg.hStream == 8


def test_a_failed_kernel_launch_launches_raw_and_drops_the_graphs(monkeypatch, after2):
    class Failing(NodeLib):
        def _cuLaunchKernelEx(self, *a):
            return 1

    class KernelDriver(FakeDriver):
        def capture(self, stream, work, kernel_only=False):
            work()
            return launch_graphs.Driver(Failing())._kernel_of(NodeLib.GRAPH, stream)

    monkeypatch.setattr(launch_graphs, "clear_runtime_error", lambda: None)
    rig = Rig(monkeypatch, KernelDriver())
    rig.plan.launch([1, 2, 3])
    rig.plan.launch([1, 2, 3])  # captured; its kernel launch fails: raw that call, graphs off
    assert rig.raw_calls[-1] == (7, (1, 2, 3), 0) and rig.plan._graphs.off
    assert len(rig.drv.destroyed) == 1 and isinstance(rig.drv.destroyed[0], launch_graphs.KernelReplay)


UNIT_CLUSTER, PAIR_CLUSTER = [1 | (1 << 32), 1], [2 | (1 << 32), 1]  # (1, 1, 1) and (2, 1, 1)


class AttrLib(NodeLib):
    """A NodeLib whose kernel node has the given attribute values (id -> 64-bit words), whose
    capture stream has the given ones, and whose function says (``must``) whether it must be
    launched with a cluster size; ``missing``: entry points it lacks."""

    def __init__(self, node, stream=None, must=0, missing=()):
        super().__init__()
        self.node_vals, self.stream_vals, self.must, self.missing = node, stream or {}, must, set(missing)

    def __getattr__(self, name):
        if name in getattr(self, "missing", ()):
            raise AttributeError(name)
        return super().__getattr__(name)

    def _cuGraphKernelNodeGetAttribute(self, node, aid, value):
        for i, w in enumerate(self.node_vals.get(aid, ())):
            value._obj.words[i] = w
        return 0

    def _cuStreamGetAttribute(self, stream, aid, value):
        assert stream == 42  # the capture's stream
        for i, w in enumerate(self.stream_vals.get(aid, ())):
            value._obj.words[i] = w
        return 0

    def _cuFuncGetAttribute(self, out, aid, func):
        assert aid == launch_graphs.FUNC_CLUSTER_SIZE_MUST_BE_SET and func == NodeLib.FUNC
        out._obj.value = self.must
        return 0


DEFAULT_MAP = {9: [256]}  # the memory sync domain map (default 0, remote 1) a stream has by default


@pytest.mark.parametrize("case,want", [
    ("one-block cluster, the stream's map", []),
    ("two-block cluster", [4, 5]),
    ("one-block cluster the kernel insists on", [4, 5]),
    ("no cluster, a policy", []),
    ("a map other than the stream's", [9]),
    ("a priority the stream lacks", [8]),
    ("no stream or function queries", [4, 5, 9]),
])
def test_a_kernel_replay_leaves_out_what_a_plain_launch_gets_anyway(monkeypatch, case, want):
    node = {4: UNIT_CLUSTER, 5: [1], **DEFAULT_MAP}
    stream, must, missing = dict(DEFAULT_MAP), 0, ()
    if case == "two-block cluster":
        node[4] = PAIR_CLUSTER
    elif case == "one-block cluster the kernel insists on":
        must = 1
    elif case == "no cluster, a policy":
        del node[4]
    elif case == "a map other than the stream's":
        stream[9] = [1]
        del node[4]
    elif case == "a priority the stream lacks":
        node = {8: [3], **DEFAULT_MAP}
    elif case == "no stream or function queries":
        missing = ("cuStreamGetAttribute", "cuFuncGetAttribute")
    lib = AttrLib(node, stream, must, missing)
    k = launch_graphs.Driver(lib).capture(42, lambda: None)
    assert isinstance(k, launch_graphs.KernelReplay) and k.attribute_ids == want
    assert k.cfg.numAttrs == len(want)
    for i, aid in enumerate(want):  # a kept attribute carries the node's own value
        assert list(k.attrs[i].value.words[:len(node[aid])]) == node[aid]
    assert k.launch(42) == 0 and lib.names()[-1] == "cuLaunchKernelEx"


class ChainLib(NodeLib):
    """NodeLib with edges (``edges``: [(from index, to index)], ``data``: edge index -> (from_port,
    to_port, type)), memset nodes (index -> params) and the memset launches. Edges are read with
    cuGraphGetEdges_v2 unless ``v2`` is False (a driver without it); the plain query fails on an edge
    with data (CUDA_ERROR_LOSSY_QUERY) when it fills the arrays, as the driver's does."""

    def __init__(self, types_, edges, memsets=None, data=None, v2=True, **kw):
        super().__init__(types_, **kw)
        self.edges, self.memsets, self.data, self.v2 = list(edges), dict(memsets or {}), dict(data or {}), v2

    def __getattr__(self, name):
        if name == "cuGraphGetEdges_v2" and not self.v2:
            raise AttributeError(name)
        return super().__getattr__(name)

    def _fill(self, frm, to, m):
        if frm is not None:
            for i, (a, b) in enumerate(self.edges):
                frm[i], to[i] = self.NODE + a, self.NODE + b
        m._obj.value = len(self.edges)

    def _cuGraphGetEdges(self, graph, frm, to, m):
        # as the H200's driver (bench/results/launch_graphs/programmatic_bc73b89/): the count comes back,
        # the arrays' fill fails on an edge with data
        if frm is not None and any(any(d) for d in self.data.values()):
            return launch_graphs.CUDA_ERROR_LOSSY_QUERY
        self._fill(frm, to, m)
        return 0

    def _cuGraphGetEdges_v2(self, graph, frm, to, data, m):
        self._fill(frm, to, m)
        if data is not None:
            for i, (fp, tp, kind) in self.data.items():
                data[i].from_port, data[i].to_port, data[i].type = fp, tp, kind
        return 0

    def _cuGraphMemsetNodeGetParams(self, node, p):
        dst, value, size, width, height, pitch = self.memsets[node - self.NODE]
        p = p._obj
        p.dst, p.value, p.elementSize, p.width, p.height, p.pitch = dst, value, size, width, height, pitch
        return 0


def _plain(args):
    return [getattr(a, "value", a) for a in args]


def test_a_memset_then_kernel_chain_launches_as_a_memset_then_the_kernel():
    # nodes listed kernel first, the edge says the memset (node 1) runs before the kernel (node 0)
    lib = ChainLib((0, 2), edges=[(1, 0)], memsets={1: (0xD000, 0, 4, 256, 1, 0)})
    d = launch_graphs.Driver(lib)
    assert d.sequences
    seq = d.capture(42, lambda: None)
    assert isinstance(seq, launch_graphs.SequenceReplay) and seq.kinds == ["memset", "kernel"]
    assert "cuGraphInstantiateWithFlags" not in lib.names() and "cuGraphDestroy" not in lib.names()
    assert seq.launch(43) == 0
    (n1, a1), (n2, a2) = lib.calls[-2:]
    assert n1 == "cuMemsetD32Async" and _plain(a1) == [0xD000, 0, 256, 43]
    assert n2 == "cuLaunchKernelEx" and seq.steps[1].cfg.hStream == 43
    d.destroy(seq)
    name, args = lib.calls[-1]
    assert name == "cuGraphDestroy" and _plain(args) == [NodeLib.GRAPH]


@pytest.mark.parametrize("size,height,name", [(1, 1, "cuMemsetD8Async"), (2, 1, "cuMemsetD16Async"),
                                               (4, 3, "cuMemsetD2D32Async"), (1, 2, "cuMemsetD2D8Async")])
def test_a_memset_launches_with_its_element_size_and_rows(size, height, name):
    lib = ChainLib((2, 0), edges=[(0, 1)], memsets={0: (0xE000, 7, size, 64, height, 512)})
    seq = launch_graphs.Driver(lib).capture(42, lambda: None)
    seq.launch(42)
    got_name, args = [c for c in lib.calls if c[0].startswith("cuMemset")][-1]
    assert got_name == name
    want = [0xE000, 512, 7, 64, height, 42] if height > 1 else [0xE000, 7, 64, 42]
    assert _plain(args) == want


def test_a_chain_of_two_kernels_launches_both_in_the_edges_order():
    class Two(ChainLib):
        def _cuGraphKernelNodeGetParams_v2(self, node, p):
            super()._cuGraphKernelNodeGetParams_v2(node, p)
            p._obj.func = 0x300 + (node - self.NODE)  # each kernel its own function
            return 0

    lib = Two((0, 0, 0), edges=[(2, 0), (0, 1)])
    seq = launch_graphs.Driver(lib).capture(42, lambda: None)
    assert [st.func for st in seq.steps] == [0x302, 0x300, 0x301]
    seq.launch(42)
    launched = [_plain(a)[1] for n, a in lib.calls if n == "cuLaunchKernelEx"]
    assert launched == [0x302, 0x300, 0x301]


@pytest.mark.parametrize("port,dependent", [(launch_graphs.PORT_PROGRAMMATIC, True),
                                             (launch_graphs.PORT_LAUNCH_ORDER, False)])
def test_kernels_chained_by_programmatic_edges_launch_as_those_launches(port, dependent):
    # the H200's split-K wgrad: a workspace-init kernel, then two kernels each a programmatic dependent
    # of the one before; nodes listed out of order, edges 2 -> 0 -> 1
    class Three(ChainLib):
        def _cuGraphKernelNodeGetParams_v2(self, node, p):
            super()._cuGraphKernelNodeGetParams_v2(node, p)
            p._obj.func = 0x300 + (node - self.NODE)
            return 0

    lib = Three((0, 0, 0), edges=[(2, 0), (0, 1)], data={0: (port, 0, 1), 1: (port, 0, 1)})
    seq = launch_graphs.Driver(lib).capture(42, lambda: None, kernel_only=True)
    assert isinstance(seq, launch_graphs.SequenceReplay) and seq.kinds == ["kernel"] * 3
    assert [st.func for st in seq.steps] == [0x302, 0x300, 0x301]
    pdl = launch_graphs.ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
    assert [pdl in st.attribute_ids for st in seq.steps] == [False, dependent, dependent]
    for st in seq.steps[1:] if dependent else ():
        i = st.attribute_ids.index(pdl)
        assert st.attrs[i].value.words[0] == 1 and st.cfg.numAttrs == len(st.attribute_ids)
    assert seq.launch(42) == 0
    launched = [_plain(a)[1] for n, a in lib.calls if n == "cuLaunchKernelEx"]
    assert launched == [0x302, 0x300, 0x301]
    assert "cuGraphGetEdges" not in lib.names()  # the v2 query read the edges and their data


@pytest.mark.parametrize("v2", [True, False])
def test_plain_edges_read_with_either_query(v2):
    lib = ChainLib((2, 0), edges=[(0, 1)], memsets={0: (0xD000, 0, 4, 16, 1, 0)}, v2=v2)
    seq = launch_graphs.Driver(lib).capture(42, lambda: None)
    assert isinstance(seq, launch_graphs.SequenceReplay) and seq.kinds == ["memset", "kernel"]
    assert launch_graphs.ATTR_PROGRAMMATIC_STREAM_SERIALIZATION not in seq.steps[1].attribute_ids
    assert ("cuGraphGetEdges_v2" in lib.names()) is v2 and ("cuGraphGetEdges" in lib.names()) is not v2


def test_the_edge_data_struct_is_the_drivers_eight_bytes():
    assert ctypes.sizeof(launch_graphs._EdgeData) == 8
    assert [f[0] for f in launch_graphs._EdgeData._fields_[:3]] == ["from_port", "to_port", "type"]


@pytest.mark.parametrize("case", ["no edges (two first nodes)", "a fork", "an edge not reported whole",
                                  "an edge of an unknown type", "a programmatic edge to a port",
                                  "a programmatic edge from a memset", "a memcpy",
                                  "an 8-byte memset", "an unreadable kernel", "too many nodes", "sequences off"])
def test_other_graphs_still_replay_as_graphs(monkeypatch, case):
    types_, edges, memsets, kw = (2, 0), [(0, 1)], {0: (0xD000, 0, 4, 16, 1, 0)}, {}
    if case == "no edges (two first nodes)":
        edges = []
    elif case == "a fork":
        types_, edges = (2, 0, 0), [(0, 1), (0, 2)]
    elif case == "an edge not reported whole":  # a driver without the v2 query, an edge with data
        types_, kw = (0, 0), {"v2": False, "data": {0: (1, 0, 1)}}
    elif case == "an edge of an unknown type":
        types_, kw = (0, 0), {"data": {0: (0, 0, 7)}}
    elif case == "a programmatic edge to a port":
        types_, kw = (0, 0), {"data": {0: (1, 1, 1)}}
    elif case == "a programmatic edge from a memset":
        kw["data"] = {0: (1, 0, 1)}
    elif case == "a memcpy":
        types_ = (1, 0)
    elif case == "an 8-byte memset":
        memsets = {0: (0xD000, 0, 8, 16, 1, 0)}
    elif case == "an unreadable kernel":
        kw["fail_attr"] = (4,)  # the cluster dimension: required
    elif case == "too many nodes":
        n = launch_graphs.MAX_SEQUENCE + 1
        types_, edges = (0,) * n, [(i, i + 1) for i in range(n - 1)]
    lib = ChainLib(types_, edges, memsets, **kw)
    d = launch_graphs.Driver(lib)
    if case == "sequences off":  # a driver without the sequences' entry points
        d.sequences = False
    ex = d.capture(42, lambda: None)
    assert ex == 0x900 and "cuGraphInstantiateWithFlags" in lib.names(), case
    edge_query = "cuGraphGetEdges" + ("" if case == "an edge not reported whole" else "_v2")
    assert (edge_query in lib.names()) is (case not in ("sequences off", "too many nodes"))
    long_kernels = launch_graphs.Driver(ChainLib(types_, edges, memsets, **kw))
    long_kernels.sequences = d.sequences
    with pytest.raises(launch_graphs.NotOneKernel):  # a long kernel's capture of it: declined
        long_kernels.capture(42, lambda: None, kernel_only=True)


def test_a_long_kernels_memset_and_kernel_capture_is_kept_as_a_sequence():
    lib = ChainLib((2, 0), edges=[(0, 1)], memsets={0: (0xD000, 0, 4, 16, 1, 0)})
    seq = launch_graphs.Driver(lib).capture(42, lambda: None, kernel_only=True)
    assert isinstance(seq, launch_graphs.SequenceReplay)


def test_a_failing_step_stops_the_sequence_and_returns_its_error():
    class Failing(ChainLib):
        def _cuMemsetD32Async(self, *a):
            return 700

    lib = Failing((2, 0), edges=[(0, 1)], memsets={0: (0xD000, 0, 4, 16, 1, 0)})
    seq = launch_graphs.Driver(lib).capture(42, lambda: None)
    assert seq.launch(42) == 700 and "cuLaunchKernelEx" not in lib.names()


def test_a_plan_replays_its_sequence_and_counts_it(monkeypatch, after2):
    class SeqDriver(FakeDriver):
        def capture(self, stream, work, kernel_only=False):
            work()
            self.lib = ChainLib((2, 0), edges=[(0, 1)], memsets={0: (0xD000, 0, 4, 16, 1, 0)})
            return launch_graphs.Driver(self.lib).capture(stream, lambda: None, kernel_only=kernel_only)

    for kernel_only in (False, True):
        rig = Rig(monkeypatch, SeqDriver())
        rig.plan._graphs = launch_graphs.GraphSet(rig.drv, kernel_only=kernel_only)
        k, s = launch_graphs.STATS.kernels, launch_graphs.STATS.sequences
        for _ in range(4):
            rig.plan.launch([1, 2, 3])
        seq = rig.plan._graphs.execs[(0, 1, 2, 3)]
        assert isinstance(seq, launch_graphs.SequenceReplay)
        assert launch_graphs.STATS.kernels == k + 1 and launch_graphs.STATS.sequences == s + 1
        names = rig.drv.lib.names()
        assert names.count("cuMemsetD32Async") == 3 and names.count("cuLaunchKernelEx") == 3
        assert len(rig.raw_calls) == 2 and rig.replays() == []  # never a graph launch
        assert loader.plan_stats()["graph_sequences"] == launch_graphs.STATS.sequences


def test_a_failed_sequence_launch_launches_raw_and_drops_the_graphs(monkeypatch, after2):
    class Failing(ChainLib):
        def _cuLaunchKernelEx(self, *a):
            return 700

    class SeqDriver(FakeDriver):
        def capture(self, stream, work, kernel_only=False):
            work()
            lib = Failing((2, 0), edges=[(0, 1)], memsets={0: (0xD000, 0, 4, 16, 1, 0)})
            self.d = launch_graphs.Driver(lib)
            return self.d.capture(stream, lambda: None)

        def destroy(self, ex):
            self.destroyed.append(ex)

    rig = Rig(monkeypatch, SeqDriver())
    monkeypatch.setattr(launch_graphs, "clear_runtime_error", lambda: None)
    rig.plan.launch([1, 2, 3])
    rig.plan.launch([1, 2, 3])  # captured, its launch fails: the call runs raw, graphs dropped
    assert rig.raw_calls[-1] == (7, (1, 2, 3), 0) and rig.plan._graphs.off
    assert len(rig.drv.destroyed) == 1 and isinstance(rig.drv.destroyed[0], launch_graphs.SequenceReplay)


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("height", [1, 3])
def test_memset_steps_pass_what_the_bound_prototypes_accept(size, height):
    """The Driver binds the memsets with prototypes (value c_ubyte / c_ushort / c_uint); a MemsetStep's
    arguments must pass them (ctypes refuses a c_uint where a c_ubyte is declared: found on the GPU)."""
    calls = []
    u64, sz, vp = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
    fns = {}
    for s in (1, 2, 4):
        v = launch_graphs._MEMSET_VALUE[s]
        fns[(s, False)] = ctypes.CFUNCTYPE(ctypes.c_int, u64, v, sz, vp)(lambda *a: calls.append(a) or 0)
        fns[(s, True)] = ctypes.CFUNCTYPE(ctypes.c_int, u64, sz, v, sz, sz, vp)(lambda *a: calls.append(a) or 0)
    p = launch_graphs._MemsetNodeParams()
    p.dst, p.value, p.elementSize, p.width, p.height, p.pitch = 0x1000, 7, size, 16, height, 64
    assert launch_graphs.MemsetStep(fns, p).launch(5) == 0
    assert calls[-1] == ((0x1000, 64, 7, 16, 3, 5) if height > 1 else (0x1000, 7, 16, 5))


def test_the_live_graph_count_comes_back_exactly_after_captures_and_releases_on_many_devices(monkeypatch):
    """Captures and releases hold their own device's handle lock only, so two devices' update
    STATS.live (the count MAX_LIVE caps) at once. Under the GIL a bare `STATS.live += 1` is not
    interrupted in practice (CPython 3.11 switches threads at calls and backward jumps, none of which
    lie inside it), but a free-threaded build interleaves any two instructions; this test makes that
    happen under the GIL: every instruction of launch_graphs' code lets the other threads run
    (an opcode trace that sleeps 0). Without a lock around the updates the count drifted."""
    import gc
    import time

    here = launch_graphs.__file__
    stats = launch_graphs.Stats()
    monkeypatch.setattr(launch_graphs, "STATS", stats)  # a count of this test's graphs alone
    monkeypatch.setattr(launch_graphs, "PER_PLAN", 2)  # add() drops (and counts down) graphs too

    def opcode(frame, event, arg):
        if event == "opcode":
            time.sleep(0)  # the GIL to another thread between any two instructions
        return opcode

    def tracer(frame, event, arg):
        if frame.f_code.co_filename != here:
            return None
        frame.f_trace_opcodes = True
        return opcode

    threads_n, rounds, graphs = 8, 20, 3
    errors = []

    def device(d):
        try:
            drv = FakeDriver()
            for r in range(rounds):
                gs = launch_graphs.GraphSet(drv)
                for k in range(graphs):
                    gs.add((d, r, k), 1000 + k)
                gs.release()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    gc.collect()  # no earlier test's GraphSet is released (into this count) mid-test
    was = gc.isenabled()
    gc.disable()
    try:
        race([functools.partial(device, d) for d in range(threads_n)], tracer)
    finally:
        if was:
            gc.enable()
    assert errors == []
    assert stats.live == 0, f"{stats.live} graphs counted live after every graph was destroyed"
    assert stats.captures == threads_n * rounds * graphs
