"""GPU: torch (cuBLAS) as an autotune candidate of matmul-class graphs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cudnn_fuse as cf
from cudnn_fuse import autotune, loader, torch_engine
from tuning import autotuning

pytestmark = pytest.mark.gpu


@pytest.fixture
def tuned_cache(cache_dir):
    with autotuning(budget_s=3, torch_candidate=True):
        yield cache_dir


def test_tuned_entries_time_torch_and_the_op_follows_the_decision(tuned_cache):
    torch.manual_seed(0)
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    b = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    y = cf.linear(x, w, b, activation="gelu")
    plan = loader.plans_in_memory()[-1]
    from cudnn_fuse.cache import open_default_cache

    pc = open_default_cache()
    entry = pc.get(plan.spec.digest())
    assert entry is not None and entry.meta["tuned"]
    rows = [c for c in entry.meta["candidates"] if c["index"] == autotune.TORCH_INDEX]
    assert len(rows) == 1 and rows[0]["status"] == "timed" and rows[0]["median_ms"] > 0
    cudnn_best = min(c["median_ms"] for c in entry.meta["candidates"]
                     if c["index"] != autotune.TORCH_INDEX and c["median_ms"] is not None)
    won = next(c for c in entry.meta["candidates"] if c["index"] == entry.meta["winner_index"])
    if rows[0].get("runoff_ms") is not None:  # a close call, timed again alternately: that decided
        assert won["runoff_ms"] is not None
        assert abs(rows[0]["median_ms"] - won["median_ms"]) <= autotune.Config().runoff_margin * won["median_ms"]
        assert entry.meta["use_torch"] == autotune.torch_cheaper(won["runoff_ms"], rows[0]["runoff_ms"])
    else:
        assert entry.meta["use_torch"] == autotune.torch_cheaper(cudnn_best, rows[0]["median_ms"])
    assert isinstance(plan, torch_engine.TorchPlan) == entry.meta["use_torch"]
    ref = F.gelu(F.linear(x.float(), w.float(), b.float()))
    assert ((y.float() - ref).abs().max() / ref.abs().max()) < 2e-2
    # a fresh load of the entry makes the same choice
    loader.clear()
    y2 = cf.linear(x, w, b, activation="gelu")
    assert isinstance(loader.plans_in_memory()[-1], torch_engine.TorchPlan) == entry.meta["use_torch"]
    assert ((y2.float() - ref).abs().max() / ref.abs().max()) < 2e-2


@pytest.mark.parametrize("act", ["relu", "gelu", "silu", None])
def test_torch_plan_on_the_gpu_matches_eager(act):
    torch.manual_seed(1)
    from cudnn_fuse.spec import Epilogue, MatmulSpec, TensorSpec

    M, K, N = 256, 512, 384
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.05
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    a3, b3, y = x.view(1, M, K), w.t().unsqueeze(0), torch.empty(1, M, N, device="cuda", dtype=torch.bfloat16)
    amax = torch.empty(1, 1, 1, device="cuda", dtype=torch.float32)
    spec = MatmulSpec(TensorSpec.of(a3), TensorSpec.of(b3), TensorSpec.of(y),
                      Epilogue(bias=TensorSpec((1, 1, N), (N, N, 1), "bfloat16"), activation=act, amax=True))
    torch_engine.TorchPlan(spec, 0).run([a3, b3, b.view(1, 1, N), y, amax])
    eager = F.linear(x, w, b)
    eager = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, None: lambda t: t}[act](eager)
    assert torch.equal(y[0], eager)  # the same cuBLAS call and the same activation kernel as eager
    assert amax.item() == eager.float().abs().max().item()


def test_device_ms_times_the_kernel_behind_a_slow_host():
    """A callable that spends 300 us on the host before a ~3 us kernel: its events must time the kernel
    (the spin is checked and lengthened), not the host's 300 us."""
    import statistics
    import time

    x = torch.randn(4096, device="cuda")

    def slow_host():
        t = time.perf_counter()
        while time.perf_counter() - t < 300e-6:
            pass
        x.add_(1.0)

    for _ in range(3):
        slow_host()
    torch.cuda.synchronize()
    assert statistics.median(autotune.device_ms(slow_host, 30)) < 0.05


def test_a_tuned_batch1_linear_keeps_cudnn_on_a_busy_host(cache_dir):
    """Two Python threads take the GIL from the tuner: its timings must still be device times, so
    torch's candidate (whose host path costs TORCH_HOST_MS a call) cannot win a 4 us GEMV."""
    import threading

    from cudnn_fuse.cache import open_default_cache

    torch.manual_seed(0)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) / 32
    b = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    stop = threading.Event()

    def hog():
        while not stop.is_set():
            pass
    threads = [threading.Thread(target=hog, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        with autotuning(budget_s=3, torch_candidate=True):
            y = cf.linear(x, w, b, activation="gelu")
            torch.cuda.synchronize()
            plan = loader.plans_in_memory()[-1]
    finally:
        stop.set()
        for t in threads:
            t.join()
    entry = open_default_cache().get(plan.spec.digest())
    assert entry is not None and entry.meta["tuned"]
    cudnn_best = min(c["median_ms"] for c in entry.meta["candidates"]
                     if c["index"] != autotune.TORCH_INDEX and c["median_ms"] is not None)
    assert cudnn_best < 0.05, entry.meta["candidates"]
    assert not isinstance(plan, torch_engine.TorchPlan) and not entry.meta["use_torch"]
    ref = F.gelu(F.linear(x.float(), w.float(), b.float()))
    assert (y.float() - ref).abs().max().item() < 0.05 * ref.abs().max().item()
