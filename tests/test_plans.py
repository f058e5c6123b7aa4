"""PlanLRU on the CPU with a fake builder: one build per (digest, device), LRU bound, remembered failures,
one build under a thread race. Every test gets fresh plans.STATS counters."""

import contextlib
import gc
import threading
import time
import weakref

import pytest
import torch

from cudnn_fuse import loader, plan_stats, plans
from cudnn_fuse.errors import UnsupportedError
from cudnn_fuse.spec import Epilogue, MatmulSpec, TensorSpec
from tests.racing import race


@pytest.fixture(autouse=True)
def fresh_stats(monkeypatch):
    stats = plans._Stats()  # one object, counted by the LRU (loader) and the launches (plans) alike
    monkeypatch.setattr(plans, "STATS", stats)
    monkeypatch.setattr(loader, "STATS", stats)
    return stats


def spec(m=16, dtype="float16", act=None):
    """A distinct MatmulSpec per (m, dtype, act), built anew on every call."""
    return MatmulSpec(TensorSpec.contiguous((1, m, 32), dtype), TensorSpec.contiguous((1, 32, 8), dtype),
                      TensorSpec.contiguous((1, m, 8), dtype), Epilogue(activation=act))


class FakeBuilder:
    """Records (digest, device) per call and returns a fresh plan object; optionally sleeps or fails."""

    def __init__(self, sleep=0.0, fail=None):
        self.calls = []
        self.sleep = sleep
        self.fail = fail
        self._lock = threading.Lock()

    def __call__(self, spec, device):
        with self._lock:
            self.calls.append((spec.digest(), device))
        if self.sleep:
            time.sleep(self.sleep)
        if self.fail is not None:
            raise self.fail(f"fake builder declines {spec.digest()[:8]}")
        return ("plan", spec.digest(), device, object())


def test_builds_once_per_digest_and_device(fresh_stats):
    fake = FakeBuilder()
    lru = loader.PlanLRU(8, builder=fake)
    p0 = lru.get(spec(), 0)
    assert lru.get(spec(), 0) is p0, "an equal spec built anew hits the same plan"
    p1 = lru.get(spec(), 1)
    assert p1 is not p0 and p1[2] == 1, "another device is another plan"
    other = lru.get(spec(act="relu"), 0)
    assert other is not p0
    assert fake.calls == [(spec().digest(), 0), (spec().digest(), 1), (spec(act="relu").digest(), 0)]
    assert len(lru) == 3
    assert fresh_stats.misses == 3 and fresh_stats.hits == 1


def test_hits_are_counted(fresh_stats):
    fake = FakeBuilder()
    lru = loader.PlanLRU(4, builder=fake)
    for _ in range(7):
        lru.get(spec(), 0)
    assert len(fake.calls) == 1
    assert fresh_stats.hits == 6 and fresh_stats.misses == 1
    assert plan_stats()["hits"] == 6 and plan_stats()["misses"] == 1
    assert plan_stats() is not plan_stats(), "a snapshot, not the live counters"


def test_capacity_evicts_the_least_recently_used(fresh_stats):
    fake = FakeBuilder()
    lru = loader.PlanLRU(2, builder=fake)
    s1, s2, s3 = spec(16), spec(32), spec(48)
    p1 = lru.get(s1, 0)
    lru.get(s2, 0)
    assert lru.get(s1, 0) is p1  # s1 is now the most recently used
    lru.get(s3, 0)  # evicts s2, not s1
    assert len(lru) == 2 and fresh_stats.evictions == 1
    n = len(fake.calls)
    assert lru.get(s1, 0) is p1 and len(fake.calls) == n, "s1 survived"
    lru.get(s2, 0)
    assert len(fake.calls) == n + 1 and fake.calls[-1][0] == s2.digest(), "s2 was evicted and is rebuilt"
    assert len(lru) == 2 and fresh_stats.evictions == 2


def test_capacity_one_and_many_keys_stay_bounded(fresh_stats):
    lru = loader.PlanLRU(1, builder=FakeBuilder())
    for m in range(1, 20):
        lru.get(spec(m), m % 3)
        assert len(lru) == 1
    assert fresh_stats.evictions == 18


@pytest.mark.parametrize("capacity", [0, -1])
def test_capacity_below_one_is_a_value_error(capacity):
    with pytest.raises(ValueError, match="capacity"):
        loader.PlanLRU(capacity, builder=FakeBuilder())


def test_unsupported_is_remembered_and_reraised(fresh_stats):
    fake = FakeBuilder(fail=UnsupportedError)
    lru = loader.PlanLRU(4, builder=fake)
    for _ in range(5):  # float32: torch's kernels would follow torch's TF32 flags, not the spec's
        with pytest.raises(UnsupportedError, match="fake builder declines"):
            lru.get(spec(dtype="float32"), 0)
    assert len(fake.calls) == 1, "an unsupported spec costs one build attempt"
    with pytest.raises(UnsupportedError):
        lru.get(spec(dtype="float32"), 1)
    assert len(fake.calls) == 2, "per device"


def test_a_declined_16_bit_spec_runs_torchs_kernels_remembered(fresh_stats):
    from cudnn_fuse import torch_engine
    from tuning import deterministic

    fake = FakeBuilder(fail=UnsupportedError)
    lru = loader.PlanLRU(4, builder=fake)
    plan = lru.get(spec(act="gelu"), 0)
    assert type(plan) is torch_engine.TorchPlan and "no engine" in loader.describe(plan)
    assert lru.get(spec(act="gelu"), 0) is plan and len(fake.calls) == 1 and plan in lru.plans()
    a, b = torch.randn(1, 16, 32, dtype=torch.float16), torch.randn(1, 32, 8, dtype=torch.float16)
    y = torch.empty(1, 16, 8, dtype=torch.float16)
    plan.run([a, b, y])
    torch.testing.assert_close(y, torch.nn.functional.gelu(a.float() @ b.float()).half(), atol=1e-2, rtol=1e-2)
    with deterministic(True), pytest.raises(UnsupportedError):  # torch's kernels are no deterministic engine
        lru.get(spec(act="gelu"), 0)


def test_other_builder_errors_are_not_remembered(fresh_stats):
    # A bug or a transient fault is not "cuDNN cannot": it propagates and the next call tries again.
    fake = FakeBuilder(fail=KeyError)
    lru = loader.PlanLRU(4, builder=fake)
    for _ in range(2):
        with pytest.raises(KeyError):
            lru.get(spec(), 0)
    assert len(fake.calls) == 2 and len(lru) == 0
    fake.fail = None
    assert lru.get(spec(), 0)[0] == "plan"


def test_clear_forgets_every_plan(fresh_stats):
    fake = FakeBuilder()
    lru = loader.PlanLRU(4, builder=fake)
    lru.get(spec(), 0)
    lru.clear()
    assert len(lru) == 0
    lru.get(spec(), 0)
    assert len(fake.calls) == 2


def _race(lru, key_spec, n=8):
    barrier = threading.Barrier(n)
    results, errors = [None] * n, []

    def worker(i):
        barrier.wait()
        try:
            results[i] = lru.get(key_spec, 0)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    return results, errors


def test_concurrent_gets_build_once(fresh_stats):
    fake = FakeBuilder(sleep=0.2)
    lru = loader.PlanLRU(4, builder=fake)
    results, errors = _race(lru, spec())
    assert not errors
    assert len(fake.calls) == 1
    assert all(r is results[0] for r in results)
    assert fresh_stats.misses == 1


def test_concurrent_gets_of_different_keys_do_not_serialize(fresh_stats):
    # The per-key lock must not be one global lock: 4 builds of 0.3 s in parallel take ~0.3 s, not 1.2 s.
    fake = FakeBuilder(sleep=0.3)
    lru = loader.PlanLRU(8, builder=fake)
    barrier = threading.Barrier(4)

    def worker(m):
        barrier.wait()
        lru.get(spec(m), 0)

    threads = [threading.Thread(target=worker, args=(m,)) for m in (8, 16, 24, 32)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(fake.calls) == 4
    assert time.perf_counter() - t0 < 0.9


def test_concurrent_unsupported_is_built_once(fresh_stats):
    fake = FakeBuilder(sleep=0.2, fail=UnsupportedError)
    lru = loader.PlanLRU(4, builder=fake)
    results, errors = _race(lru, spec(dtype="float32"))
    assert len(fake.calls) == 1
    assert len(errors) == 8 and all(isinstance(e, UnsupportedError) for e in errors)


def test_concurrent_gets_count_every_call(fresh_stats):
    lru = loader.PlanLRU(4, builder=FakeBuilder(sleep=0.2))
    _race(lru, spec())
    assert fresh_stats.hits + fresh_stats.misses == 8


def test_remembered_failure_does_not_pin_callers_frames(fresh_stats):
    lru = loader.PlanLRU(4, builder=FakeBuilder(fail=UnsupportedError))

    class Buffer:  # stands in for a CUDA tensor held in the caller's frame
        pass

    def caller():
        buf = Buffer()
        ref = weakref.ref(buf)
        try:
            lru.get(spec(dtype="float32"), 0)
        except UnsupportedError:
            pass
        return ref

    refs = [caller() for _ in range(3)]
    gc.collect()
    assert all(r() is None for r in refs), "the cached failure keeps the callers' locals alive"


def test_get_plan_goes_through_the_loader(monkeypatch):
    """The process-wide LRU builds through loader.load_or_build (disk cache, then build), a new size of a
    known shape family standing in with torch's kernels."""
    from cudnn_fuse import loader

    seen = []
    sentinel = object()
    monkeypatch.setattr(loader, "load_or_build", lambda spec, device, standin: seen.append((spec, device, standin))
                        or sentinel)
    monkeypatch.setattr(loader, "_LRU", loader.PlanLRU(4))
    spec = object.__new__(type("S", (), {"__hash__": lambda self: 1, "__eq__": lambda self, o: self is o}))
    assert loader.get_plan(spec, 0) is sentinel
    assert loader.get_plan(spec, 0) is sentinel
    assert seen == [(spec, 0, True)]


def test_plans_are_released_at_exit_before_teardown():
    """Plans still held when the process exits are freed by an atexit hook, while the
    interpreter (and cuDNN's extension) still runs: nanobind reports frontend objects alive
    at its teardown as leaks on stderr."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys
        from cudnn_fuse import loader, plans

        class Held:  # stands in for a plan: records when and how it was freed
            def __init__(self, cycle):
                self.me = self if cycle else None
            def __del__(self):
                sys.stdout.write("freed finalizing=%s\\n" % sys.is_finalizing())
                sys.stdout.flush()

        plans.FAST["k"] = Held(cycle=False)
        loader._LRU._store("spec", Held(cycle=True))  # a reference cycle: only a collection frees it
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["freed finalizing=False"] * 2, (out.stdout, out.stderr)


def test_one_key_is_built_by_one_thread_at_a_time_even_across_clears():
    """Threads waiting on a key's build lock each dropped the key's lock entry when done, even one a
    newer caller had made after a clear(): that caller then built the key beside a waiter (up to 5
    builds of one key at once in a CPU run). The entry now lives while anyone waits on it. Bounded
    by a count of builds, not by a timing."""
    import threading
    import time

    active, peak, count, guard = [0], [0], [0], threading.Lock()

    def builder(spec, device):
        with guard:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            count[0] += 1
        time.sleep(0.002)
        with guard:
            active[0] -= 1
        return object()

    lru = loader.PlanLRU(4, builder=builder)
    stop = threading.Event()

    def caller():
        while not stop.is_set():
            lru.get("spec", 0)

    def clearer():
        deadline = time.monotonic() + 30
        while not stop.is_set() and count[0] < 150 and time.monotonic() < deadline:
            lru.clear()
            time.sleep(0.001)
        stop.set()

    threads = [threading.Thread(target=caller) for _ in range(8)] + [threading.Thread(target=clearer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert count[0] >= 50, count[0]  # the clears made the key be built again and again
    assert peak[0] == 1, peak[0]
    assert lru._building == {}


def test_threads_on_new_streams_evict_workspaces_without_errors_or_overshoot(monkeypatch):
    """Per-stream workspaces are capped at 16; threads on new streams evict the oldest. Two at once
    popped the same oldest key (KeyError out of the op) or, each seeing room, grew the dict past the
    cap. Evictions and growth take a lock now; a hit does not. The stand-in allocation (a CPU tensor)
    yields the GIL as the real one may."""
    import sys
    import threading
    import time

    real_empty = torch.empty

    def empty(n, dtype=None, device=None):
        time.sleep(0.0005)
        return real_empty(n, dtype=dtype)

    monkeypatch.setattr(plans, "_workspaces", {})
    monkeypatch.setattr(torch, "empty", empty)
    errors, sizes = [], []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)

    def worker(tid):
        for i in range(150):
            try:
                plans._workspace_ptr(0, 1000 * tid + i % 40 + 1, 256, capturing=False)
            except Exception as exc:  # noqa: BLE001 - what the test looks for
                errors.append(repr(exc))
            sizes.append(len(plans._workspaces))

    try:
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(old)
    assert errors == [], errors[:3]
    assert max(sizes) <= 16, max(sizes)


def test_the_loaders_time_sums_lose_no_update_across_threads(monkeypatch, fresh_stats):
    """plan_stats()'s load_seconds and cache_get_seconds (and deserialize_seconds, autotune_seconds) were
    summed as `STATS.x += time.perf_counter() - t0`: that reads STATS.x, then calls perf_counter, where
    CPython may switch threads (a call checks for a switch), and another thread's += in between was lost.
    Threads loading plans from the cache at once lost a share of their seconds. Here perf_counter is a
    stand-in that advances by exactly 1 a call in each thread, so each load adds exactly 3 and each cache
    read 1, and the sums are known."""
    import types

    from cudnn_fuse import autotune, loader

    ticks = threading.local()

    def perf_counter():
        ticks.n = getattr(ticks, "n", 0) + 1
        return float(ticks.n)

    entry = types.SimpleNamespace(meta={"tuned": False}, blob=b"blob", key="0" * 64)
    pc = types.SimpleNamespace(get=lambda key: entry)
    monkeypatch.setattr(loader, "STATS", fresh_stats)
    monkeypatch.setattr(loader, "time", types.SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(loader, "_cache", lambda device=None: pc)
    monkeypatch.setattr(loader, "_deserialize", lambda spec, entry, device: ("plan", spec))
    monkeypatch.setattr(autotune, "autotune_enabled", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    threads_n, loads = 8, 2000
    s = spec()
    errors = []

    def work():
        try:
            for _ in range(loads):
                assert loader.load_or_build(s, 0) == ("plan", s)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    race([work] * threads_n)
    assert errors == []
    n = threads_n * loads
    assert fresh_stats.loads == n
    assert (fresh_stats.load_seconds, fresh_stats.cache_get_seconds) == (3.0 * n, 1.0 * n)
