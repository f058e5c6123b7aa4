"""GPU tests of the plan cache, the autotuner and CUDA graph capture.

Cache behaviour is checked in fresh processes (the plan cache and the plan LRU
are per process), each with its own cache directory.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap

import pytest
import torch

import cudnn_fuse as cf
from cudnn_fuse import autotune, engines, handles, loader
from cudnn_fuse.builders import build_graph, roles_of, uids_of

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = textwrap.dedent("""
    import json, torch, cudnn_fuse as cf
    torch.manual_seed(0)
    h = torch.float16
    x = torch.randn(8, 64, 28, 28, device="cuda").to(h).to(memory_format=torch.channels_last)
    w = (torch.randn(64, 64, 3, 3, device="cuda") * 0.05).to(h).to(memory_format=torch.channels_last)
    b = torch.randn(64, device="cuda").to(h)
    a = torch.randn(256, 512, device="cuda").to(torch.bfloat16)
    wl = (torch.randn(1024, 512, device="cuda") * 0.05).to(torch.bfloat16)
    q = torch.randn(2, 8, 256, 64, device="cuda").to(torch.bfloat16)
    y1 = cf.conv2d(x, w, b, padding=1, activation="relu")
    y2, amax = cf.linear(a, wl, activation="gelu", return_amax=True)
    y3 = cf.scaled_dot_product_attention(q, q, q, is_causal=True)
    ref1 = torch.relu(torch.nn.functional.conv2d(x.double(), w.double(), b.double(), padding=1))
    err1 = ((y1.double() - ref1).norm() / ref1.norm()).item()
    sums = [float(t.double().sum()) for t in (y1, y2, amax, y3)]
    print(json.dumps({"stats": cf.plan_stats(), "sums": sums, "err1": err1}))
""")


def run_child(cache_dir, **env):
    e = dict(os.environ, CUDNN_FUSE_CACHE_DIR=str(cache_dir), PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    e.update({k: str(v) for k, v in env.items()})
    p = subprocess.run([sys.executable, "-c", CHILD], env=e, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def test_warm_cache_builds_nothing_in_a_fresh_process_and_gives_identical_results(tmp_path):
    cold, _ = run_child(tmp_path)
    warm, _ = run_child(tmp_path)
    assert cold["stats"]["builds"] == 3 and cold["stats"]["loads"] == 0
    assert warm["stats"]["builds"] == 0 and warm["stats"]["loads"] == 3
    assert warm["sums"] == cold["sums"], "a deserialized plan must compute bit-identical results"
    assert warm["err1"] < 1e-2


def test_garbage_blob_with_a_valid_checksum_is_survived(tmp_path):
    cold, _ = run_child(tmp_path)
    from cudnn_fuse.cache import PlanCache

    pc = PlanCache(tmp_path)
    keys = [k for k, meta, _ in pc.entries() if not loader.is_record(meta)]
    assert len(keys) == 3
    rng = torch.Generator().manual_seed(1)
    for k in keys:
        entry = pc.get(k)
        garbage = bytes(torch.randint(0, 256, (len(entry.blob),), generator=rng, dtype=torch.uint8).tolist())
        assert pc.put(k, entry.meta, garbage)  # stored with a valid checksum: only cuDNN can reject it
    pc.close()
    after, stderr = run_child(tmp_path)  # a crash here would fail the child's return code
    assert after["stats"]["builds"] == 0, "rebuilt from the recorded engine, not built or tuned anew"
    assert after["stats"]["rebuilds"] == 3
    assert after["sums"] == cold["sums"]
    assert "did not deserialize" in stderr  # one warning names the fault


def test_autotune_upgrades_a_heuristic_entry_once(tmp_path):
    heur, _ = run_child(tmp_path)
    tuned, _ = run_child(tmp_path, CUDNN_FUSE_AUTOTUNE=1, CUDNN_FUSE_TUNE_BUDGET_S=2)
    again, _ = run_child(tmp_path, CUDNN_FUSE_AUTOTUNE=1)
    assert heur["stats"]["builds"] == 3
    assert tuned["stats"]["builds"] == 3 and tuned["stats"]["autotune_seconds"] > 0
    assert again["stats"]["builds"] == 0 and again["stats"]["loads"] == 3
    from cudnn_fuse.cache import PlanCache

    pc = PlanCache(tmp_path)
    metas = [m for k, m, _ in pc.entries() if not loader.is_record(m)]
    assert len(metas) == 3 and all(m["tuned"] for m in metas)
    assert all(len(m["candidates"]) >= 1 for m in metas)


def _median_ms(fn, iters=100, rounds=3):
    """Median device time over several rounds of calls queued behind a GPU spin."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    return statistics.median(t for _ in range(rounds) for t in autotune.device_ms(fn, iters))


def test_autotuned_pick_is_within_3_percent_of_the_best_candidate():
    h = torch.float16
    # 64x128x56x56: a working set over twice the L2, so neither side's timing measures the cache
    x = torch.randn(64, 128, 56, 56, device="cuda").to(h).to(memory_format=torch.channels_last)
    w = (torch.randn(128, 128, 3, 3, device="cuda") * 0.03).to(h).to(memory_format=torch.channels_last)
    b = torch.randn(128, device="cuda").to(h)
    loader.clear()
    cf.conv2d(x, w, b, padding=1, activation="relu")
    spec = loader.plans_in_memory()[-1].spec
    hd = handles.handle_for(0)
    with handles.held(hd, 0):
        g = build_graph(spec, hd.handle)
        engines.prepare(g, spec)
    _, winner, timings = autotune.tune(g, spec, hd, 0, uids_of(spec), roles_of(spec), autotune.Config(budget_s=60))
    y = torch.empty(64, 128, 56, 56, device="cuda", dtype=h).to(memory_format=torch.channels_last)
    bufs = [x, w, b.view(1, -1, 1, 1), y]
    independent = {}
    for t in timings:
        if t.status != "timed" or t.engine_id is None:
            continue
        p = loader.rebuild(spec, t.engine_id, t.knobs, 0)
        independent[t.index] = _median_ms(lambda p=p: p.run(bufs))
    assert winner.index in independent and len(independent) >= 2
    best = min(independent.values())
    assert independent[winner.index] <= 1.03 * best, (winner.index, independent)


def test_deserialized_plan_is_bit_identical_to_its_source():
    a = torch.randn(512, 768, device="cuda").to(torch.bfloat16)
    w = (torch.randn(3072, 768, device="cuda") * 0.03).to(torch.bfloat16)
    bias = torch.randn(3072, device="cuda").to(torch.bfloat16)
    loader.clear()
    y1 = cf.linear(a, w, bias, activation="gelu_tanh")
    plan = loader.plans_in_memory()[-1]

    class Entry:
        key = plan.spec.digest()
        meta = {"engine_name": plan.engine}
        blob = plan.graph.serialize(as_bytes=True)

    plan2 = loader._deserialize(plan.spec, Entry, 0)
    assert plan2 is not None
    y2 = torch.empty_like(y1)
    plan2.run([a.view(1, 512, 768), w.t().unsqueeze(0), bias.view(1, 1, -1), y2.view(1, 512, 3072)])
    assert torch.equal(y1, y2)


def test_capture_replays_and_reads_new_inputs():
    x = torch.randn(64, 256, device="cuda").to(torch.float16)
    w = (torch.randn(256, 256, device="cuda") * 0.06).to(torch.float16)
    b = torch.randn(256, device="cuda").to(torch.float16)

    def block(t):
        h = cf.linear(t, w, b, activation="relu")
        return cf.linear(h, w, b, activation="silu")

    g = cf.capture(block, x)
    for _ in range(3):
        x2 = torch.randn_like(x)
        out = g(x2)
        ref = torch.nn.functional.silu(torch.nn.functional.linear(
            torch.relu(torch.nn.functional.linear(x2.double(), w.double(), b.double())), w.double(), b.double()))
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    before = cf.plan_stats()["builds"]
    g(torch.randn_like(x))
    assert cf.plan_stats()["builds"] == before
    # eager calls after capture still run on the default stream correctly
    y = cf.linear(x, w, b, activation="relu")
    ref = torch.relu(torch.nn.functional.linear(x.double(), w.double(), b.double()))
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2


def test_capture_of_a_module_under_grad_mode_returns_detached_outputs():
    """A module's parameters require grad, so its capture records autograd history; the outputs come
    back detached (before, they carried the capture's autograd graph: a backward read whichever replay
    last ran, once, and sent input gradients to the example input)."""
    torch.manual_seed(0)
    m = cf.nn.Linear(256, 256, activation="gelu", device="cuda", dtype=torch.bfloat16)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = cf.capture(m, x)
    x2 = torch.randn_like(x)
    out = g(x2)
    assert not out.requires_grad and out.grad_fn is None and x.grad is None
    ref = torch.nn.functional.gelu(torch.nn.functional.linear(x2.double(), m.weight.double(), m.bias.double()))
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


def test_capture_of_a_whole_training_step_replays_it():
    """torch's whole-network capture with cf modules: forward, backward and the optimizer's step in one
    graph; each replay trains on its inputs as the same steps run eagerly do."""
    torch.manual_seed(0)

    def make():
        torch.manual_seed(1)
        return torch.nn.Sequential(cf.nn.Linear(256, 512, activation="gelu"), cf.nn.Linear(512, 128)).cuda()

    eager, captured = make(), make()
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
    opt_c = torch.optim.SGD(captured.parameters(), lr=0.05)  # no momentum: no optimizer state to capture
    xs = [torch.randn(64, 256, device="cuda") for _ in range(8)]
    ts = [torch.randn(64, 128, device="cuda") for _ in range(8)]

    def step(model, opt, x, t):
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(model(x), t)
        loss.backward()
        opt.step()
        return loss

    # the capture's warm-up runs the step 3 times on its example inputs: the eager twin does the same
    for _ in range(3):
        step(eager, opt_e, xs[0], ts[0])
    g = cf.capture(lambda x, t: step(captured, opt_c, x, t), xs[0], ts[0])
    for x, t in zip(xs[1:], ts[1:]):
        le = step(eager, opt_e, x, t)
        lc = g(x, t)
        assert not lc.requires_grad
        assert abs(lc.item() - le.item()) <= 1e-3 * max(1.0, abs(le.item())), (lc.item(), le.item())
    for pe, pc in zip(eager.parameters(), captured.parameters()):
        assert ((pc - pe).norm() / pe.norm()).item() < 1e-3


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_capture_of_inputs_on_another_gpu_than_the_current_one_replays_them():
    """Inputs on cuda:1 with cuda:0 current: the capture records cuda:1's stream (before, the ops ran
    once on cuda:1 during capture, the graph was empty and every replay returned those first values)."""
    dev = torch.device("cuda", 1)
    x = torch.randn(64, 256, device=dev).to(torch.float16)
    w = (torch.randn(256, 256, device=dev) * 0.06).to(torch.float16)
    b = torch.randn(256, device=dev).to(torch.float16)
    with torch.cuda.device(0):
        g = cf.capture(lambda t: cf.linear(t, w, b, activation="relu"), x)
        for _ in range(2):
            x2 = torch.randn_like(x)
            out = g(x2)
            ref = torch.relu(torch.nn.functional.linear(x2.double(), w.double(), b.double()))
            assert out.device == dev
            assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
        with pytest.raises(ValueError, match="2 devices"):
            cf.capture(lambda s, t: s + t, x, x.to("cuda:0"))


def test_concurrent_threads_share_one_plan_and_get_right_answers():
    import threading

    w = (torch.randn(384, 256, device="cuda") * 0.06).to(torch.bfloat16)
    loader.clear()
    before = cf.plan_stats()["builds"] + cf.plan_stats()["loads"]
    errors, results = [], []

    def worker(seed):
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                g = torch.Generator(device="cuda").manual_seed(seed)
                x = torch.randn(128, 256, device="cuda", generator=g).to(torch.bfloat16)
                for _ in range(20):
                    y = cf.linear(x, w, activation="relu")
                s.synchronize()
                ref = torch.relu(x.double() @ w.double().t())
                results.append(((y.double() - ref).norm() / ref.norm()).item())
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 8 and max(results) < 1e-2
    after = cf.plan_stats()
    assert after["builds"] + after["loads"] - before == 1  # one plan, built or loaded from a warm disk cache
