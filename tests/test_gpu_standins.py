"""GPU: a new size of a known shape family runs torch's kernels at once, then its own plan from its
STANDIN_CALLS-th call, or from when the build process has stored it, with the same results; a fresh process
knows the family from the plan cache."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import cudnn_fuse as cf
from cudnn_fuse import loader

pytestmark = pytest.mark.gpu


def _linear(m, w, b):
    x = torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16)
    return x, F.gelu(F.linear(x.float(), w.float(), b.float()))


def test_a_new_size_stands_in_then_swaps_with_the_same_results(cache_dir):
    torch.manual_seed(0)
    w = torch.randn(768, 512, device="cuda", dtype=torch.bfloat16) * 0.05
    b = torch.randn(768, device="cuda", dtype=torch.bfloat16)
    loader.clear()
    before = cf.plan_stats()
    x, ref = _linear(512, w, b)
    cf.linear(x, w, b, activation="gelu")  # the family's first size: built
    assert cf.plan_stats()["builds"] == before["builds"] + 1
    x, ref = _linear(300, w, b)
    for call in range(loader.STANDIN_CALLS + 2):
        y = cf.linear(x, w, b, activation="gelu")
        torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=2e-2)
        stats = cf.plan_stats()
        if call == 0:
            assert stats["standins"] == before["standins"] + 1 and stats["builds"] == before["builds"] + 1
    assert stats["swaps"] == before["swaps"] + 1 and stats["builds"] == before["builds"] + 2
    assert not getattr(loader.plans_in_memory()[-1], "standin", False)


_FRESH = """
import torch, cudnn_fuse as cf
from cudnn_fuse import loader
w = torch.randn(768, 512, device="cuda", dtype=torch.bfloat16)
x = torch.randn(77, 512, device="cuda", dtype=torch.bfloat16)
cf.linear(x, w, None, activation="gelu")
s = cf.plan_stats()
print("standins", s["standins"], "builds", s["builds"])
"""


def test_a_fresh_process_knows_the_family_from_the_cache(cache_dir):
    w = torch.randn(768, 512, device="cuda", dtype=torch.bfloat16)
    cf.linear(torch.randn(512, 512, device="cuda", dtype=torch.bfloat16), w, None, activation="gelu")
    out = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "standins 1 builds 0" in out.stdout


@pytest.mark.parametrize("causal,mask,gqa", [(True, False, False), (False, True, False), (True, False, True)])
def test_attention_at_a_new_length_stands_in_then_swaps_with_the_same_results(cache_dir, causal, mask, gqa):
    torch.manual_seed(0)
    loader.clear()

    def qkv(s):
        q = torch.randn(2, 8, s, 64, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(2, 2 if gqa else 8, s, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        m = torch.rand(s, s, device="cuda") > 0.2 if mask else None
        if m is not None:
            m.fill_diagonal_(True)
        return q, k, v, m

    q, k, v, m = qkv(256)
    cf.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, enable_gqa=gqa)  # the family's first
    before = cf.plan_stats()
    q, k, v, m = qkv(200)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=m, is_causal=causal,
                                         enable_gqa=gqa)
    for call in range(loader.STANDIN_CALLS + 2):
        o = cf.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, enable_gqa=gqa)
        torch.testing.assert_close(o.float(), ref, atol=2e-2, rtol=2e-2)
        if call == 0:
            stats = cf.plan_stats()
            assert stats["standins"] == before["standins"] + 1 and stats["builds"] == before["builds"]
    stats = cf.plan_stats()
    assert stats["swaps"] == before["swaps"] + 1 and stats["builds"] == before["builds"] + 1


def test_the_build_process_builds_a_new_size_off_the_hot_path(cache_dir, monkeypatch):
    """With the build process on (the default outside the tests), a new size's plan is built in that process
    and loaded here: no build in this process, the same results, and a call that swaps in well under a build."""
    import time

    from cudnn_fuse import build_process

    monkeypatch.setenv("CUDNN_FUSE_BUILD_PROCESS", "1")
    torch.manual_seed(0)
    w = torch.randn(1024, 768, device="cuda", dtype=torch.bfloat16) * 0.05
    b = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    loader.clear()
    x, _ = _linear(512, w, b)
    cf.linear(x, w, b, activation="gelu")  # the family's first size: built here
    before = cf.plan_stats()
    x, ref = _linear(333, w, b)
    calls, worst = 0, 0.0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y = cf.linear(x, w, b, activation="gelu")
        torch.cuda.synchronize()
        worst = max(worst, time.perf_counter() - t0) if calls else worst  # the first call may warm torch's
        torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=2e-2)
        calls += 1
        if cf.plan_stats()["swaps"] > before["swaps"]:
            break
        time.sleep(0.005)
    stats = cf.plan_stats()
    assert stats["swaps"] == before["swaps"] + 1 and stats["process_builds"] == before["process_builds"] + 1
    assert stats["builds"] == before["builds"]  # not one build in this process
    assert worst < 0.05, f"a call took {worst * 1e3:.1f} ms"
    torch.testing.assert_close(cf.linear(x, w, b, activation="gelu").float(), ref, atol=2e-2, rtol=2e-2)
    assert build_process.default().off is None


def test_a_stand_in_whose_plan_is_being_built_is_served_from_the_ops_memo(cache_dir, monkeypatch):
    """While the build process builds a stand-in's plan, its calls run from the ops' memo (no plan lookup, each
    counted on the stand-in); once the build process answers, the next call leaves the memo and the plan comes
    in (here built in this process: the build process answered that it failed)."""
    from cudnn_fuse import build_process, ops

    pending = build_process.Request()
    monkeypatch.setattr(loader, "_request_build", lambda spec, device: pending)
    torch.manual_seed(0)
    w = torch.randn(768, 512, device="cuda", dtype=torch.bfloat16) * 0.05
    b = torch.randn(768, device="cuda", dtype=torch.bfloat16)
    loader.clear()
    x, _ = _linear(512, w, b)
    cf.linear(x, w, b, activation="gelu")  # the family's first size: built
    x, ref = _linear(301, w, b)
    for _ in range(2):  # the stand-in's first call, then the one that asks for its plan
        torch.testing.assert_close(cf.linear(x, w, b, activation="gelu").float(), ref, atol=2e-2, rtol=2e-2)
    (stand,) = [p for p in loader.plans_in_memory() if getattr(p, "standin", False)]
    assert stand.request is pending and any(type(e) is ops._StandInLaunch for e in ops._FAST.values())
    before, calls = cf.plan_stats(), stand.calls
    for _ in range(8):
        torch.testing.assert_close(cf.linear(x, w, b, activation="gelu").float(), ref, atol=2e-2, rtol=2e-2)
    after = cf.plan_stats()
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])  # no plan lookup
    assert stand.calls == calls + 8 and after["swaps"] == before["swaps"]
    pending._answer("failed", "stood in for by the test")
    for _ in range(3):
        torch.testing.assert_close(cf.linear(x, w, b, activation="gelu").float(), ref, atol=2e-2, rtol=2e-2)
    assert cf.plan_stats()["swaps"] == before["swaps"] + 1
    assert not any(type(e) is ops._StandInLaunch for e in ops._FAST.values())
