"""GPU: what was tested only on the CPU before, on real plans. A real pre-warm (autotuned, the 1x1
conv's GEMM candidate on) pins every entry it stores, the GEMM entry included, and a plain run's
entry stays unpinned. Under torch's determinism switches every plan a conv training step uses is
chosen among deterministic engines, the step repeats bit for bit, and its plans live under cache
keys of their own. A squeeze-excitation conv's [N, C, 1, 1] input (NCHW and channels_last at once)
runs as the GEMM and matches float64."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import cudnn_fuse as cf
from cudnn_fuse import autotune, conv_gemm, engines, loader, prewarm
from cudnn_fuse.manifest import Entry
from tuning import autotuning

pytestmark = pytest.mark.gpu


def _cl(t):
    return t.contiguous(memory_format=torch.channels_last)


@contextlib.contextmanager
def deterministic(on: bool, via_cudnn: bool = False):
    old = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
           torch.backends.cudnn.deterministic)
    if via_cudnn:
        torch.backends.cudnn.deterministic = on
    else:
        torch.use_deterministic_algorithms(on, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old[0], warn_only=old[1])
        torch.backends.cudnn.deterministic = old[2]


def _pins() -> dict:
    return {i.key: i.pinned for i in loader._cache().entry_info()}


def test_a_real_prewarm_pins_its_entries_and_the_gemm_entry(cache_dir):
    x = _cl(torch.randn(2, 64, 14, 14, device="meta", dtype=torch.float16))
    w1 = _cl(torch.randn(96, 64, 1, 1, device="meta", dtype=torch.float16))
    w3 = _cl(torch.randn(64, 64, 3, 3, device="meta", dtype=torch.float16))
    with cf.record() as rec:
        cf.conv2d(x, w1, torch.randn(96, device="meta", dtype=torch.float16), activation="relu")
        cf.conv2d(x, w3, None, padding=1, activation="relu")
        cf.linear(torch.randn(64, 256, device="meta", dtype=torch.float16),
                  torch.randn(128, 256, device="meta", dtype=torch.float16), None, activation="gelu")
    specs = [e.spec for e in rec.entries]
    with autotuning(budget_s=1, gemm_candidate=True):
        rows = prewarm.prewarm([Entry(s) for s in specs], autotune=True)
    assert [r.status for r in rows] == ["built"] * 3, [(r.status, r.reason) for r in rows]
    pins = _pins()
    for s in specs:
        d = loader.cache_digest(s)
        assert pins[d] is True and pins[loader.engine_record_key(d)] is True, s.op
    conv1 = loader._cache().get(loader.cache_digest(specs[0]))
    gd = loader.cache_digest(conv_gemm.gemm_spec(specs[0]))
    assert gd in pins, "the 1x1 conv's tuning stores its GEMM's entry beside its own"
    assert pins[gd] is True  # whichever won: the GEMM entry may serve the conv
    assert conv1.meta["tuned"] is True
    assert [c["status"] for c in conv1.meta["candidates"] if c["index"] == autotune.GEMM_INDEX] == ["timed"]
    # a plain run's entry is not pinned
    loader.clear()
    a = torch.randn(32, 256, device="cuda", dtype=torch.float16)
    cf.linear(a, torch.randn(64, 256, device="cuda", dtype=torch.float16), None, activation="relu")
    torch.cuda.synchronize()
    plain = set(_pins()) - set(pins)
    assert plain and not any(_pins()[k] for k in plain)


def _conv_step(x, w, b):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    b = b.detach().requires_grad_()
    y = cf.conv2d(x, w, b, padding=1, activation="relu")
    y2 = cf.conv2d(y, w, b, padding=1, activation="relu")
    (y2.float() * torch.linspace(-1, 1, y2.numel(), device="cuda").view_as(y2)).sum().backward()
    return [t.grad.clone() for t in (x, w, b)]


@pytest.mark.parametrize("via_cudnn", [False, True])
def test_a_deterministic_training_step_repeats_bit_for_bit_on_deterministic_engines(cache_dir, via_cudnn):
    from cudnn_fuse.autotune import _has_note

    g = torch.Generator(device="cuda").manual_seed(0)
    x = _cl(torch.randn(16, 64, 28, 28, device="cuda", generator=g).half())
    w = _cl((torch.randn(64, 64, 3, 3, device="cuda", generator=g) / 24).half())
    b = torch.randn(64, device="cuda", generator=g).half()
    loader.clear()
    with deterministic(True, via_cudnn):
        assert engines.deterministic()
        first = _conv_step(x, w, b)
        for _ in range(3):
            again = _conv_step(x, w, b)
            for a, c in zip(first, again):
                assert torch.equal(a, c)
        held = loader.plans_in_memory()
        assert held
        for p in held:
            g_ = getattr(p, "graph", None)
            if g_ is not None and getattr(g_, "_plans", None):
                assert not _has_note(g_, g_._plan_index, "NONDETERMINISTIC"), p.engine
        det_keys = set(_pins())
    # the same step without the switches stores entries under other keys, and the grads agree
    loader.clear()
    loose = _conv_step(x, w, b)
    for a, c in zip(first, loose):
        torch.testing.assert_close(a.float(), c.float(), rtol=2e-2, atol=2e-2)
    assert set(_pins()) - det_keys, "the deterministic entries must not have served the plain step"
    metas = [loader._cache().get(k).meta for k in det_keys]
    assert any(m.get("deterministic") is True for m in metas if not loader.is_record(m))


def test_an_se_convs_nchw_1x1_input_runs_as_the_gemm(cache_dir):
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(8, 256, 1, 1, device="cuda", generator=g).half()  # contiguous: NCHW and channels_last
    w = _cl((torch.randn(64, 256, 1, 1, device="cuda", generator=g) / 16).half())
    b = torch.randn(64, device="cuda", generator=g).half()
    with cf.record() as rec:
        cf.conv2d(x.to("meta"), w.to("meta"), b.to("meta"), activation="relu")
    assert conv_gemm.gemm_spec(rec.entries[0].spec) is not None
    with autotuning(budget_s=1, gemm_candidate=True):
        y = cf.conv2d(x, w, b, activation="relu")
        torch.cuda.synchronize()
        meta = loader._cache().get(loader.cache_digest(rec.entries[0].spec)).meta
        gemm_rows = [c for c in meta["candidates"] if c["index"] == autotune.GEMM_INDEX]
        assert [c["status"] for c in gemm_rows] == ["timed"]  # the squeeze-excitation input qualified
    want = F.relu(F.conv2d(x.double(), w.double(), b.double()))
    assert ((y.double() - want).abs().max() / want.abs().max()).item() < 1e-2
