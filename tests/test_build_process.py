"""The build process: a new size's plan is built in a process of its own and stored in the plan cache, where
the caller loads it; the stand-in serves until then, with no build in the caller's process. Its faults (it
cannot start, dies, stores elsewhere, declines, fails) never fail an op: the caller builds as it would
without one. cuDNN and the GPU are stood in for, in the build process too (tests/build_child_standin.py)."""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import time
import types

import pytest

from cudnn_fuse import build_child, build_process, envvars, families, loader, torch_engine
from cudnn_fuse.cache import PlanCache
from tuning import StoredPlan, family_spec, stood_in_builds

HERE = os.path.dirname(os.path.abspath(__file__))
NAMESPACE = "standin_test"


@pytest.fixture
def env(tmp_path, monkeypatch):
    ns = stood_in_builds(monkeypatch, PlanCache(tmp_path / "cache", namespace=NAMESPACE))
    ns.lru = loader.PlanLRU(64)
    ns.lru.get(family_spec(512), 0)  # a plan of the family: its other sizes stand in
    ns.built.clear()
    return ns


def _use(monkeypatch, bp):
    monkeypatch.setattr(build_process, "default", lambda: bp)
    return bp


def _child(delay: float = 0.0, namespace: str = NAMESPACE):
    return build_process.BuildProcess([sys.executable, os.path.join(HERE, "build_child_standin.py"), namespace,
                                       str(delay)])


def _calls_until_swapped(env, spec, limit_s: float = 60.0):
    """Call ``spec`` until it is no stand-in; (the plan, how many calls it took)."""
    deadline, n = time.monotonic() + limit_s, 0
    while True:
        n += 1
        plan = env.lru.get(spec, 0)
        if not getattr(plan, "standin", False) or time.monotonic() > deadline:
            return plan, n
        time.sleep(0.01)


# ------------------------------------------------------------------ end to end, with a real build process


def test_a_new_size_is_built_by_the_build_process_and_loaded_never_built_here(env, monkeypatch):
    bp = _use(monkeypatch, _child(delay=0.3))
    builds = loader.STATS.builds
    try:
        spec = family_spec(300)
        stand = env.lru.get(spec, 0)
        assert isinstance(stand, loader.StandIn) and stand.request is None  # met once: nothing asked
        assert env.lru.get(spec, 0) is stand and stand.request and stand.request.status is None  # asked, building
        for _ in range(3 * loader.STANDIN_CALLS):  # past the calls that would build here: still waiting
            assert env.lru.get(spec, 0) is stand
        plan, _ = _calls_until_swapped(env, spec)
        assert isinstance(plan, StoredPlan) and env.built == []  # loaded from the entry the build process stored
        assert loader.STATS.swaps == 1 and loader.STATS.process_builds == 1
        assert loader.STATS.builds == builds
        assert env.pc.get(loader.cache_digest(spec)) is not None
        assert env.lru.get(spec, 0) is plan
    finally:
        bp.close()


def test_a_size_the_build_process_declines_keeps_torchs_kernels_with_its_reason(env, monkeypatch):
    bp = _use(monkeypatch, _child())
    try:
        spec = family_spec(13)
        plan, _ = _calls_until_swapped(env, spec)
        assert type(plan) is torch_engine.TorchPlan and "no engine for 13 rows" in plan.reason
        assert env.built == [] and loader.STATS.swaps == 1 and loader.STATS.process_builds == 0
    finally:
        bp.close()


def test_a_build_process_that_dies_is_turned_off_and_the_caller_builds_as_before(env, monkeypatch, caplog):
    bp = _use(monkeypatch, _child())
    try:
        spec = family_spec(66)  # kills the build process
        with caplog.at_level(logging.WARNING, logger="cudnn_fuse.build_process"):
            plan, _ = _calls_until_swapped(env, spec)
        assert isinstance(plan, StoredPlan) and env.built == [spec]  # built here, on a call of the stand-in's
        assert bp.off and "exited with code 3" in bp.off
        assert "built in the calling process" in caplog.text
        nxt = env.lru.get(family_spec(40), 0)
        env.lru.get(family_spec(40), 0)
        assert nxt.request is False  # off for the process: not asked again
        for _ in range(loader.STANDIN_CALLS):
            plan = env.lru.get(family_spec(40), 0)
        assert isinstance(plan, StoredPlan) and env.built[-1] == family_spec(40)
    finally:
        bp.close()


def test_a_build_process_storing_in_another_namespace_is_turned_off(env, monkeypatch):
    bp = _use(monkeypatch, _child(namespace="elsewhere"))
    try:
        plan, _ = _calls_until_swapped(env, family_spec(300))
        assert isinstance(plan, StoredPlan) and env.built == [family_spec(300)]  # built here after all
        assert "namespace 'elsewhere'" in bp.off
    finally:
        bp.close()


# ------------------------------------------------------------------ BuildProcess itself


_ECHO = r"""
import json, sys, time
for line in sys.stdin:
    req = json.loads(line)
    m = req["spec"]["m"]
    if m == "slow":
        time.sleep(30)
    print("a line that is no reply", flush=True)
    status = {"ok": "ok", "no": "declined"}.get(m, "failed")
    print(json.dumps({"id": req["id"], "status": status, "reason": "because " + m, "namespace": "ns"}), flush=True)
"""


def _echo():
    return build_process.BuildProcess([sys.executable, "-c", _ECHO])


def test_requests_are_answered_asked_once_and_waited_for():
    bp = _echo()
    try:
        ok = bp.submit({"m": "ok"}, "d1", 0, "/c", "ns")
        assert bp.submit({"m": "ok"}, "d1", 0, "/c", "ns") is ok  # the same plan: one request
        no = bp.submit({"m": "no"}, "d2", 0, "/c", "ns")
        bad = bp.submit({"m": "??"}, "d3", 0, "/c", "ns")
        assert bp.wait(30) and bp.pending() == 0
        assert (ok.status, no.status, no.reason, bad.status) == ("ok", "declined", "because no", "failed")
        assert bp.submit({"m": "ok"}, "d3", 0, "/c", "ns") is not bad  # a failed request may be asked again
        other = bp.submit({"m": "ok"}, "d1", 1, "/c", "ns")
        assert other is not ok  # another device, another plan
        assert bp.wait(30) and other.status == "ok" and bp.off is None
    finally:
        bp.close()


def test_a_full_pipe_never_blocks_the_caller():
    bp = _echo()
    try:
        bp.submit({"m": "slow"}, "d0", 0, "/c", "ns")  # it reads no more for 30 s
        big = {"m": "ok", "pad": "x" * 4096}
        t0 = time.perf_counter()
        reqs = [bp.submit(big, f"k{i}", 0, "/c", "ns") for i in range(200)]  # 800 KB: far past a pipe's buffer
        assert time.perf_counter() - t0 < 2.0 and all(r.status is None for r in reqs)
        assert not bp.wait(0.05)
    finally:
        bp.close()
    assert all(r.status == "failed" for r in reqs)  # closed: what was pending failed, nothing hangs


def test_a_build_process_that_cannot_start_is_off_and_says_why(caplog):
    bp = build_process.BuildProcess(["/nonexistent/python-for-cudnn-fuse"])
    with caplog.at_level(logging.WARNING, logger="cudnn_fuse.build_process"):
        assert bp.submit({"m": "ok"}, "d", 0, "/c", "ns") is None
    assert "could not start" in bp.off and "could not start" in caplog.text


def test_a_crash_reports_the_build_process_stderr(caplog):
    bp = build_process.BuildProcess([sys.executable, "-c", "import sys; sys.stdin.readline(); "
                                                           "sys.stderr.write('boom: CUDA out of memory\\n'); sys.exit(7)"])
    with caplog.at_level(logging.WARNING, logger="cudnn_fuse.build_process"):
        req = bp.submit({"m": "ok"}, "d", 0, "/c", "ns")
        assert bp.wait(30) and req.status == "failed" and "code 7" in req.reason
    assert "exited with code 7" in bp.off and "CUDA out of memory" in caplog.text
    assert bp.submit({"m": "ok"}, "d2", 0, "/c", "ns") is None


def test_the_default_build_process_follows_the_variable(monkeypatch):
    monkeypatch.setattr(build_process, "_default", None)
    monkeypatch.setenv(envvars.BUILD_PROCESS, "0")
    assert build_process.default() is None
    monkeypatch.setenv(envvars.BUILD_PROCESS, "1")
    bp = build_process.default()
    assert isinstance(bp, build_process.BuildProcess) and build_process.default() is bp
    assert bp._proc is None  # started at its first request, not before


# ------------------------------------------------------------------ the build process's side


def test_serve_stores_each_plan_and_answers_every_request(env, monkeypatch):
    monkeypatch.setattr(loader, "_cache", lambda device=None: env.pc)
    monkeypatch.setenv(envvars.CACHE_DIR, "/somewhere/else")
    lines = [json.dumps({"id": 1, "spec": family_spec(300).to_dict(), "device": 0, "cache_dir": str(env.pc.path)}),
             "not json", json.dumps({"id": 2, "spec": {"op": "nope"}, "device": 0, "cache_dir": str(env.pc.path)}),
             json.dumps({"id": 3, "spec": family_spec(301).to_dict(), "device": 0, "cache_dir": str(env.pc.path)})]
    env.decline = False
    out = io.StringIO()
    real_build = loader.build_graph

    def build(spec, h):
        if spec.a.shape[1] == 301:
            raise loader.UnsupportedError("declined at 301")
        return real_build(spec, h)

    monkeypatch.setattr(loader, "build_graph", build)
    build_child.serve(iter(lines), out)
    replies = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [r["id"] for r in replies] == [1, 2, 3]
    assert replies[0]["status"] == "ok" and replies[0]["namespace"] == NAMESPACE
    assert replies[1]["status"] == "failed" and "ValueError" in replies[1]["reason"]
    assert replies[2]["status"] == "declined" and "301" in replies[2]["reason"]
    assert os.environ[envvars.CACHE_DIR] == str(env.pc.path)  # the parent's cache, as it asked
    assert env.pc.get(loader.cache_digest(family_spec(300))) is not None
    assert loader.plans_in_memory() == []  # nothing kept: the plan is on disk


def test_serve_refuses_a_read_only_cache(env, monkeypatch):
    monkeypatch.setattr(loader, "_cache", lambda device=None: types.SimpleNamespace(read_only=True, namespace="n"))
    out = io.StringIO()
    build_child.serve(iter([json.dumps({"id": 5, "spec": family_spec(300).to_dict(), "device": 0,
                                        "cache_dir": "/x"})]), out)
    reply = json.loads(out.getvalue())
    assert reply["status"] == "failed" and "writable" in reply["reason"] and env.built == []


# ------------------------------------------------------------------ the loader's side, with a build process stood in


class _Manual:
    """A build process whose answers the test gives."""

    def __init__(self):
        self.asked = []

    def submit(self, spec_dict, digest, device, cache_path, namespace):
        self.asked.append((spec_dict, digest, device, cache_path, namespace))
        return build_process.Request()


def test_the_stand_in_asks_once_on_its_second_call_and_waits_without_building(env, monkeypatch):
    bp = _use(monkeypatch, _Manual())
    spec = family_spec(300)
    stand = env.lru.get(spec, 0)
    assert bp.asked == []
    env.lru.get(spec, 0)
    assert len(bp.asked) == 1 and bp.asked[0][1:] == (loader.cache_digest(spec), 0, str(env.pc.path), NAMESPACE)
    for _ in range(10):
        assert env.lru.get(spec, 0) is stand
    assert len(bp.asked) == 1 and env.built == []
    loader.load_or_build(spec, 0)  # what the build process does: the entry on disk
    built = list(env.built)
    stand.request._answer("ok")
    plan = env.lru.get(spec, 0)
    assert isinstance(plan, StoredPlan) and env.built == built and loader.STATS.process_builds == 1


def test_a_failed_request_means_a_build_here_on_the_usual_call(env, monkeypatch):
    _use(monkeypatch, _Manual())
    spec = family_spec(300)
    stand = env.lru.get(spec, 0)
    env.lru.get(spec, 0)
    stand.request._answer("failed", "it died")
    for _ in range(loader.STANDIN_CALLS - loader.BUILD_REQUEST_CALLS - 1):
        assert env.lru.get(spec, 0) is stand
    plan = env.lru.get(spec, 0)  # the call after the first STANDIN_CALLS
    assert isinstance(plan, StoredPlan) and env.built == [spec] and loader.STATS.process_builds == 0


def test_an_ok_whose_entry_is_gone_is_built_here(env, monkeypatch):
    _use(monkeypatch, _Manual())
    spec = family_spec(300)
    stand = env.lru.get(spec, 0)
    env.lru.get(spec, 0)
    stand.request._answer("ok")  # but nothing stored (evicted, or the disk refused it)
    plan = env.lru.get(spec, 0)
    assert isinstance(plan, StoredPlan) and env.built == [spec] and loader.STATS.process_builds == 0


def _slow_loads(env, monkeypatch, seconds: float = 4.0) -> None:
    """Each load of a stored plan takes ``seconds`` of the test's clock (env.now)."""
    load = loader._deserialize

    def slow_load(spec, entry, device):
        env.now += seconds
        return load(spec, entry, device)

    monkeypatch.setattr(loader, "_deserialize", slow_load)


def _asked(env, spec, answer: str | None = "ok"):
    """A stand-in for ``spec`` called twice (asked for), its plan stored as the build process would, then the
    build process's ``answer`` (None: none yet): the stand-in."""
    stand = env.lru.get(spec, 0)
    env.lru.get(spec, 0)
    if answer == "ok":
        loader.load_or_build(spec, 0)  # what the build process stores
    if answer is not None:
        stand.request._answer(answer)
    return stand


def test_swaps_are_paced_one_load_a_call_at_most_half_the_time(env, monkeypatch):
    bp = _use(monkeypatch, _Manual())
    _slow_loads(env, monkeypatch)
    specs = [family_spec(m) for m in (300, 400, 500)]
    stands = [_asked(env, spec, None) for spec in specs]  # a block meets a new size: three stand-ins
    for spec in specs:
        loader.load_or_build(spec, 0)
    assert len(bp.asked) == 3
    for stand in stands:
        stand.request._answer("ok")
    swaps = loader.STATS.swaps
    first = [env.lru.get(spec, 0) for spec in specs]  # one call of the block: one load, two still stand in
    assert isinstance(first[0], StoredPlan) and first[1:] == stands[1:] and loader.STATS.swaps == swaps + 1
    env.now += 3.9  # less than the load took: the next call loads nothing
    assert [env.lru.get(spec, 0) for spec in specs][1:] == stands[1:]
    env.now += 0.1
    second = [env.lru.get(spec, 0) for spec in specs]
    assert isinstance(second[1], StoredPlan) and second[2] is stands[2]
    env.now += 4.0
    assert isinstance(env.lru.get(specs[2], 0), StoredPlan) and loader.STATS.swaps == swaps + 3
    assert env.built == specs  # built once each, by "the build process": loaded here, never built
    env.lru.clear()  # forgetting the plans forgets the pace: the next swap need not wait
    spec = family_spec(600)
    _asked(env, spec)
    assert isinstance(env.lru.get(spec, 0), StoredPlan)  # at once, though the last load ended just now


def test_a_build_here_keeps_its_call_whatever_the_pace_of_loads(env, monkeypatch):
    _use(monkeypatch, _Manual())
    _slow_loads(env, monkeypatch)
    loaded, built = family_spec(300), family_spec(400)
    _asked(env, loaded)
    other = _asked(env, built, "failed")
    assert isinstance(env.lru.get(loaded, 0), StoredPlan)  # a load: the next one waits 4 s
    for _ in range(loader.STANDIN_CALLS - loader.BUILD_REQUEST_CALLS - 1):
        assert env.lru.get(built, 0) is other
    plan = env.lru.get(built, 0)  # the call after the first STANDIN_CALLS, the clock unmoved
    assert isinstance(plan, StoredPlan) and env.built == [loaded, built]


@pytest.mark.parametrize("case", ["no build process", "no cache", "read-only cache"])
def test_without_a_build_process_or_a_cache_it_could_fill_the_old_way_holds(env, monkeypatch, case):
    bp = _Manual()
    _use(monkeypatch, None if case == "no build process" else bp)
    if case == "no cache":
        monkeypatch.setattr(loader, "_cache", lambda device=None: None)  # CUDNN_FUSE_CACHE=0
    if case == "read-only cache":
        monkeypatch.setattr(env.pc, "read_only", True)
    spec = family_spec(300)
    stand = env.lru.get(spec, 0)
    for _ in range(loader.STANDIN_CALLS - 1):
        assert env.lru.get(spec, 0) is stand
    plan = env.lru.get(spec, 0)
    assert isinstance(plan, StoredPlan) and env.built == [spec] and bp.asked == []
    assert stand.request is False


def test_nothing_is_asked_or_swapped_inside_a_capture(env, monkeypatch):
    bp = _use(monkeypatch, _Manual())
    monkeypatch.setattr(loader, "_capturing", lambda: True)
    spec = family_spec(300)
    stand = env.lru.get(spec, 0)
    for _ in range(3 * loader.STANDIN_CALLS):
        assert env.lru.get(spec, 0) is stand
    assert bp.asked == [] and families.family(spec) is not None
