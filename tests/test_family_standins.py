"""A new size of a known shape family runs torch's kernels at once (loader.StandIn) and gets its own plan
on a later call of its own (STANDIN_CALLS), swapped in; the family is known from a plan of another size
in this process or from its record in the plan cache (a fresh process). Sizes on disk, unknown families,
families-less specs, deterministic mode, autotuning and captures keep the old way; cache faults mean a
build, never a failed op. cuDNN, the torch check and the GPU are stood in for on the CPU."""

from __future__ import annotations

import types

import pytest
import torch

from cudnn_fuse import families, loader, ops, torch_engine
from cudnn_fuse.cache import PlanCache
from cudnn_fuse.spec import ConvSpec, TensorSpec
from tuning import StoredPlan, deterministic, family_spec, stood_in_builds


@pytest.fixture
def env(tmp_path, monkeypatch):
    ns = stood_in_builds(monkeypatch, PlanCache(tmp_path / "cache", namespace="standin_test"))
    ns.lru = loader.PlanLRU(64)
    return ns




def _fresh_process(env):
    """What a new process has: the plan cache on disk, nothing in memory."""
    loader._KNOWN_FAMILIES.clear()
    env.lru = loader.PlanLRU(64)


def test_a_new_size_of_a_known_family_stands_in_then_swaps_in_its_plan(env):
    first = env.lru.get(family_spec(512), 0)
    assert isinstance(first, StoredPlan) and env.built == [family_spec(512)]  # no family known yet: built
    rec = env.pc.get(loader.family_record_key(families.family(family_spec(512))), count=False)
    assert rec is not None and rec.meta["anchors"] == []  # the family is known to later processes
    stand = env.lru.get(family_spec(300), 0)
    assert isinstance(stand, loader.StandIn) and isinstance(stand, torch_engine.TorchPlan) and stand.standin
    assert env.built == [family_spec(512)] and loader.STATS.standins == 1
    assert "waits" in loader.describe(stand)
    for _ in range(loader.STANDIN_CALLS - 1):
        assert env.lru.get(family_spec(300), 0) is stand  # its first calls: no build
    assert env.built == [family_spec(512)] and loader.STATS.swaps == 0
    plan = env.lru.get(family_spec(300), 0)  # the STANDIN_CALLS-th call after: built, swapped in
    assert isinstance(plan, StoredPlan) and env.built[-1] == family_spec(300) and loader.STATS.swaps == 1
    assert env.lru.get(family_spec(300), 0) is plan and env.pc.get(loader.cache_digest(family_spec(300))) is not None


def test_a_fresh_process_knows_the_family_from_the_cache_and_loads_sizes_on_disk(env):
    env.lru.get(family_spec(512), 0)
    _fresh_process(env)
    assert isinstance(env.lru.get(family_spec(512), 0), StoredPlan)  # on disk: loaded, not stood in for
    _fresh_process(env)
    assert isinstance(env.lru.get(family_spec(77), 0), loader.StandIn)  # known from the family record alone
    assert env.built == [family_spec(512)]


def test_an_entry_written_without_its_family_record_makes_the_family_known_once_loaded(env):
    env.lru.get(family_spec(512), 0)
    env.pc.delete(loader.family_record_key(families.family(family_spec(512))))  # as an older cudnn_fuse wrote it
    _fresh_process(env)
    assert isinstance(env.lru.get(family_spec(90), 0), StoredPlan) and env.built[-1] == family_spec(90)  # nothing known: built
    _fresh_process(env)
    env.pc.delete(loader.family_record_key(families.family(family_spec(512))))
    assert isinstance(env.lru.get(family_spec(512), 0), StoredPlan) and env.built[-1] == family_spec(90)  # loaded, not built
    assert isinstance(env.lru.get(family_spec(60), 0), loader.StandIn)  # its family is known now


@pytest.mark.parametrize("case", ["unknown family", "no family", "deterministic", "autotune", "direct load"])
def test_what_keeps_building_at_once(env, monkeypatch, case):
    if case != "unknown family":
        env.lru.get(family_spec(512), 0)
    if case == "no family":  # a conv: no dynamic dimension
        x = TensorSpec.contiguous((2, 8, 8, 8), "float16")
        w = TensorSpec.contiguous((8, 8, 3, 3), "float16")
        spec = ConvSpec(x, w, TensorSpec.contiguous((2, 8, 6, 6), "float16"), (1, 1), (0, 0), (0, 0), (1, 1), 1)
        assert families.family(spec) is None
    else:
        spec = family_spec(300)
    if case == "autotune":
        from cudnn_fuse import autotune

        monkeypatch.setattr(autotune, "autotune_enabled", lambda: True)
        monkeypatch.setattr(loader, "_from_family", lambda *a: None)
        monkeypatch.setattr(loader, "prepare", lambda g, spec: None)
        monkeypatch.setattr(autotune, "tune", lambda *a, **k: (None, types.SimpleNamespace(index=0), []))
        monkeypatch.setattr(autotune, "torch_wins", lambda w, t: False)
        monkeypatch.setattr(autotune, "gemm_wins", lambda w, t: False)
    if case == "deterministic":
        with deterministic(True):
            plan = env.lru.get(spec, 0)
    elif case == "direct load":  # prewarm and the autotune CLI build what they are given
        plan = loader.load_or_build(spec, 0)
    else:
        plan = env.lru.get(spec, 0)
    assert not getattr(plan, "standin", False) and env.built[-1] == spec and loader.STATS.standins == 0


def test_no_swap_inside_a_capture_and_a_declined_size_keeps_torchs_kernels(env):
    env.lru.get(family_spec(512), 0)
    stand = env.lru.get(family_spec(300), 0)
    env.capturing = True
    for _ in range(3 * loader.STANDIN_CALLS):
        assert env.lru.get(family_spec(300), 0) is stand  # a build would not survive the capture
    env.capturing, env.decline = False, True
    plan = env.lru.get(family_spec(300), 0)
    assert type(plan) is torch_engine.TorchPlan and not plan.standin and "declined" in plan.reason
    assert loader.STATS.swaps == 1 and env.lru.get(family_spec(300), 0) is plan


def test_a_faulty_family_record_means_a_build(env, monkeypatch):
    env.lru.get(family_spec(512), 0)
    _fresh_process(env)
    real_get = env.pc.get

    def get(key, *a, **k):
        if key.startswith("family") or key == loader.family_record_key(families.family(family_spec(512))):
            raise OSError("disk I/O error")
        return real_get(key, *a, **k)

    monkeypatch.setattr(env.pc, "get", get)
    plan = env.lru.get(family_spec(300), 0)
    assert isinstance(plan, StoredPlan) and env.built[-1] == family_spec(300)


def test_the_ops_memo_holds_a_stand_in_only_while_its_plan_builds(monkeypatch):
    from cudnn_fuse import build_process

    monkeypatch.setattr(ops, "_FAST", {})
    spec = family_spec(300)
    torch.manual_seed(0)
    x, w = torch.randn(1, 300, 32, dtype=torch.bfloat16), torch.randn(48, 32, dtype=torch.bfloat16)
    b, y = w.t().unsqueeze(0), torch.empty(1, 300, 48, dtype=torch.bfloat16)  # the linear's buffers, as ops makes them
    key = ("linear", 1)
    stand = loader.StandIn(spec, 0)
    ops._remember(key, [x, w], stand, [x, b, y], y)
    assert ops._FAST == {}  # its plan not asked for yet: the plan lookup counts its calls
    stand.request = False
    ops._remember(key, [x, w], stand, [x, b, y], y)
    assert ops._FAST == {}  # no build process: the lookup builds the plan on its STANDIN_CALLS-th call
    stand.request = build_process.Request()
    ops._remember(key, [x, w], stand, [x, b, y], y)
    entry = ops._FAST[key]
    assert isinstance(entry, ops._StandInLaunch)
    other = object()
    ops._FAST["index"] = [("check", entry), ("check", other)]  # the C memo's guarded index, in the same dict
    want = torch.nn.functional.gelu(torch.nn.functional.linear(x.float(), w.float()))
    calls = stand.calls
    torch.testing.assert_close(entry(x, w, None, None).float(), want, atol=3e-2, rtol=2e-2)  # torch's kernels
    assert stand.calls == calls + 1 and ops._FAST[key] is entry  # counted, still held while it builds
    stand.request._answer("ok")
    torch.testing.assert_close(entry(x, w, None, None).float(), want, atol=3e-2, rtol=2e-2)  # this call still served
    assert stand.calls == calls + 2
    assert key not in ops._FAST and ops._FAST["index"] == [("check", other)]  # the next call takes the slow path
    ops._remember(key, [x, w], stand, [x, b, y], y)
    assert key not in ops._FAST  # answered: the plan lookup swaps it in
    ops._remember(key, [x, w], torch_engine.TorchPlan(spec, 0), [x, b, y], y)
    assert type(ops._FAST[key]) is ops._TorchLaunch  # a settled torch-kernel plan is remembered


def test_a_linear_at_a_new_size_is_served_from_the_memo_while_its_plan_builds_then_swaps(env, monkeypatch):
    """The op path end to end, the GPU stood in for: the first call stands in, the second asks the build
    process for the plan, the calls after it take the memo (no plan lookup) until the answer, and the
    call after that swaps the plan in."""
    import tuning
    from cudnn_fuse import build_process, functional

    monkeypatch.setattr(ops, "_FAST", {})
    monkeypatch.setattr(ops, "_why_not_fused", lambda op, ts: None)
    monkeypatch.setattr(ops, "_unlaunchable", lambda buffers: None)
    monkeypatch.setattr(ops, "_Launch", lambda plan, y, amax, a: ("raw launch", plan))
    monkeypatch.setattr(tuning.StoredPlan, "run", lambda self, buffers: None, raising=False)
    monkeypatch.setattr(loader, "_KNOWN_FAMILIES", set())
    req = build_process.Request()
    asked = []
    monkeypatch.setattr(loader, "_request_build", lambda spec, device: asked.append(spec) or req)

    def get_plan(spec, device):  # another size of the family has a plan
        loader._KNOWN_FAMILIES.add(families.family(spec))
        return env.lru.get(spec, device)
    monkeypatch.setattr(loader, "get_plan", get_plan)
    torch.manual_seed(0)
    x, w = torch.randn(1, 300, 32, dtype=torch.bfloat16), torch.randn(48, 32, dtype=torch.bfloat16)
    want = torch.nn.functional.gelu(torch.nn.functional.linear(x.float(), w.float()))

    def call(check=True):
        with torch.no_grad():
            y = functional.linear(x, w, activation="gelu")
        if check:
            torch.testing.assert_close(y.float(), want, atol=3e-2, rtol=2e-2)

    def held():
        return [v for v in ops._FAST.values() if isinstance(v, ops._StandInLaunch)]

    call()
    assert loader.STATS.standins == 1 and not asked and not held()  # stands in; the plan not asked for yet
    call()
    assert len(asked) == 1 and len(held()) == 1  # asked on its second call, held while it builds
    hits = loader.STATS.hits
    for _ in range(3):
        call()
    assert loader.STATS.hits == hits and held()[0].plan.calls == 4  # no lookup, every call counted
    entry = held()[0]

    def guarded():
        return [v for v in ops._FAST.values() if type(v) is list and any(p[-1] is entry for p in v)]
    assert guarded() or ops._native_call is None  # the C memo's guarded index holds it too, where it runs
    req._answer("ok")
    call()  # served by torch's kernels once more; the entry forgets itself, in both indexes
    assert not held() and not guarded() and loader.STATS.swaps == 0
    call(check=False)  # the slow path: the plan lookup swaps in the plan (a stood-in one, computing nothing)
    assert loader.STATS.swaps == 1 and len(env.built) == 1 and not held()


def test_a_caller_capture_open_on_another_stream_also_defers_the_swap(monkeypatch):
    """The guard torch_check uses: this thread's stream capturing, or a caller's capture that a launch of
    ours found open (a build would break a global-mode capture in another thread)."""
    from cudnn_fuse import handles

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(handles, "capture_noted", lambda: True)
    assert loader._capturing()
    monkeypatch.setattr(handles, "capture_noted", lambda: False)
    assert not loader._capturing()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert loader._capturing()


def _sdpa_spec(s: int, causal=True, bias=False, kv_heads=4):
    from cudnn_fuse.spec import SdpaSpec

    q = TensorSpec.contiguous((2, 4, s, 16), "bfloat16")
    kv = TensorSpec.contiguous((2, kv_heads, s, 16), "bfloat16")
    b = TensorSpec.contiguous((1, 1, s, s), "bfloat16") if bias else None
    return SdpaSpec(q, kv, kv, TensorSpec.contiguous((2, 4, s, 16), "bfloat16"), b, causal, 0.25)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attention_at_a_new_length_stands_in_then_swaps(env, kv_heads):
    env.lru.get(_sdpa_spec(256, kv_heads=kv_heads), 0)
    stand = env.lru.get(_sdpa_spec(200, kv_heads=kv_heads), 0)
    assert isinstance(stand, loader.StandIn) and loader.STATS.standins == 1
    for _ in range(loader.STANDIN_CALLS - 1):
        assert env.lru.get(_sdpa_spec(200, kv_heads=kv_heads), 0) is stand
    plan = env.lru.get(_sdpa_spec(200, kv_heads=kv_heads), 0)
    assert isinstance(plan, StoredPlan) and env.built[-1] == _sdpa_spec(200, kv_heads=kv_heads)


def test_attention_with_both_a_bias_and_a_causal_mask_builds_at_once(env):
    env.lru.get(_sdpa_spec(256, bias=True), 0)
    plan = env.lru.get(_sdpa_spec(200, bias=True), 0)  # torch's SDPA takes a mask or is_causal, not both
    assert isinstance(plan, StoredPlan) and env.built[-1] == _sdpa_spec(200, bias=True)
    env.lru.get(_sdpa_spec(256, causal=False, bias=True), 0)
    assert isinstance(env.lru.get(_sdpa_spec(200, causal=False, bias=True), 0), loader.StandIn)


@pytest.mark.parametrize("causal,bias,kv_heads,bshd", [(True, False, 4, False), (False, True, 4, True),
                                                       (True, False, 2, False), (False, False, 1, True)])
def test_torchs_attention_standing_in_computes_the_op(causal, bias, kv_heads, bshd):
    from cudnn_fuse import reference
    from cudnn_fuse.spec import SdpaSpec

    torch.manual_seed(0)
    s = 24
    q = torch.randn(2, 4, s, 16, dtype=torch.bfloat16)
    k, v = (torch.randn(2, kv_heads, s, 16, dtype=torch.bfloat16) for _ in range(2))
    mask = torch.randn(1, 1, s, s, dtype=torch.bfloat16) if bias else None
    o = torch.empty(2, s, 4, 16, dtype=torch.bfloat16).transpose(1, 2) if bshd else torch.empty_like(q)
    spec = SdpaSpec(ops._spec(q), ops._spec(k), ops._spec(v), ops._spec(o), ops._spec(mask) if bias else None,
                    causal, 0.3)
    assert torch_engine.stands_in(spec) and not torch_engine.supports(spec)  # a stand-in, never a tuning candidate
    loader.StandIn(spec, 0).run([t for t in (q, k, v, mask, o) if t is not None])
    mask32 = mask.float() if bias else None
    want = reference.scaled_dot_product_attention(q.float(), k.float(), v.float(), mask32, 0.0, causal, 0.3,
                                                  kv_heads != 4)
    torch.testing.assert_close(o.float(), want, atol=2e-2, rtol=2e-2)


def test_the_ops_memo_keeps_attention_on_the_slow_path_under_torchs_kernels(monkeypatch):
    monkeypatch.setattr(ops, "_FAST", {})
    q = torch.zeros(2, 4, 200, 16, dtype=torch.bfloat16)
    ops._remember(("sdpa", 1), [q, q, q, None], torch_engine.TorchPlan(_sdpa_spec(200, False), 0), [q, q, q, q], q)
    assert ops._FAST == {}


def test_torchs_attention_standing_in_never_takes_torchs_cudnn_backend(monkeypatch):
    """torch's cuDNN attention builds a graph per new shape: the stand-in would pay what it exists to avoid."""
    from cudnn_fuse import reference

    seen = []
    real = reference.scaled_dot_product_attention

    def spy(*a):
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()))
        return real(*a)

    monkeypatch.setattr(reference, "scaled_dot_product_attention", spy)
    q = torch.randn(2, 4, 200, 16, dtype=torch.bfloat16)
    o = torch.empty_like(q)
    loader.StandIn(_sdpa_spec(200, causal=False), 0).run([q, q, q, o])
    assert seen == [(False, True)] and torch.backends.cuda.cudnn_sdp_enabled()  # restored after
