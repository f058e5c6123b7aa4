"""GPU tests of the host fast path: raw-pointer launches and the per-signature memo.

Every fast result is compared bit for bit with the public cuDNN execute path on the
same plan, for plans built here and plans deserialized from the disk cache.
"""

from __future__ import annotations

import pytest
import torch

import cudnn_fuse as cf
from cudnn_fuse import handles, loader, ops, plans

pytestmark = pytest.mark.gpu


def rnd(*shape, dtype=torch.float16, scale=1.0, cl=False):
    t = (torch.randn(*shape, device="cuda") * scale).to(dtype)
    return t.to(memory_format=torch.channels_last) if cl else t


def _cases():
    x = rnd(8, 32, 16, 16, cl=True)
    w = rnd(64, 32, 3, 3, scale=0.1, cl=True)
    b = rnd(64)
    r = rnd(8, 64, 16, 16, cl=True)
    xl, wl, bl = rnd(4, 64, 256, dtype=torch.bfloat16), rnd(512, 256, dtype=torch.bfloat16, scale=0.05), \
        rnd(512, dtype=torch.bfloat16)
    a, bm = rnd(3, 128, 96), rnd(3, 96, 160, scale=0.1)
    q, k, v = (rnd(2, 4, 128, 64, dtype=torch.bfloat16) for _ in range(3))
    return {
        "conv_bias_res_relu": lambda: cf.conv2d(x, w, b, padding=1, activation="relu", residual=r),
        "conv_amax": lambda: cf.conv2d(x, w, b, padding=1, activation="gelu", return_amax=True),
        "linear_gelu": lambda: cf.linear(xl, wl, bl, activation="gelu"),
        "linear_amax": lambda: cf.linear(xl, wl, bl, activation="relu", return_amax=True),
        "matmul_batched_silu": lambda: cf.matmul(a, bm, activation="silu"),
        "sdpa_causal": lambda: cf.scaled_dot_product_attention(q, k, v, is_causal=True),
    }


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.fixture
def public_path(monkeypatch):
    def set_raw(on: bool):
        monkeypatch.setattr(plans, "RAW_EXECUTE", on)
        loader.clear()
    return set_raw


CASES = ["conv_bias_res_relu", "conv_amax", "linear_gelu", "linear_amax", "matmul_batched_silu", "sdpa_causal"]


@pytest.mark.parametrize("name", CASES)
def test_raw_launch_equals_public_execute(name, public_path, cache_dir):
    fn = _cases()[name]
    public_path(False)
    with torch.no_grad():
        ref = _as_tuple(fn())
        assert not any(p.raw for p in loader.plans_in_memory())
        public_path(True)
        built = [_as_tuple(fn()) for _ in range(3)]  # built (from disk), then memo, then memo
        assert all(p.raw for p in loader.plans_in_memory())
    for out in built:
        for o, r in zip(out, ref):
            assert o.shape == r.shape and o.stride() == r.stride() and o.dtype == r.dtype
            assert torch.equal(o, r), name


def test_deserialized_plans_launch_raw(cache_dir):
    from cudnn_fuse.cache import open_default_cache

    cases = _cases()
    with torch.no_grad():
        first = {k: _as_tuple(fn()) for k, fn in cases.items()}  # built and stored
        pc = open_default_cache()
        unstored = [p.spec.op for p in loader.plans_in_memory() if pc.get(p.spec.digest()) is None]
        if unstored:  # a plan cuDNN cannot serialize stays in memory only: say which
            import warnings

            warnings.warn(f"not stored in the plan cache: {unstored}")
        assert len(unstored) <= 1, unstored
        loader.clear()
        before = cf.plan_stats()
        again = {k: _as_tuple(fn()) for k, fn in cases.items()}  # deserialized from disk
    after = cf.plan_stats()
    counts = {k: after[k] - before[k] for k in ("loads", "builds", "rebuilds")}
    assert counts == {"loads": len(cases) - len(unstored), "builds": len(unstored), "rebuilds": 0}, counts
    assert all(p.raw for p in loader.plans_in_memory()), [(p.spec.op, p.engine, p.raw) for p in loader.plans_in_memory()]
    for k in cases:
        for o, r in zip(again[k], first[k]):
            assert torch.equal(o, r), k


def test_memo_serves_repeat_calls_and_only_those(cache_dir):
    x, w, b = rnd(64, 256), rnd(256, 256, scale=0.06), rnd(256)
    loader.clear()
    with torch.no_grad():
        y0 = cf.linear(x, w, b, activation="relu")
        assert len(ops.memo_keys()) == 1
        hits = cf.plan_stats()["hits"]
        y1 = cf.linear(x, w, b, activation="relu")
        assert cf.plan_stats()["hits"] == hits, "a memo hit must not reach the plan LRU"
        assert torch.equal(y0, y1)
        # new values, same signature: the memo reads the new tensors
        x2 = rnd(64, 256)
        y_memo = cf.linear(x2, w, b, activation="relu")
        loader.clear()  # forgets the memo too: the next call takes the slow path
        assert len(ops.memo_keys()) == 0
        assert torch.equal(y_memo, cf.linear(x2, w, b, activation="relu"))
        assert len(ops.memo_keys()) == 1
        # another attribute is another signature
        cf.linear(x, w, b, activation="gelu")
        assert len(ops.memo_keys()) == 2
        # a column-major x is a view the plan reads as is: memoized under its own strides
        xt = rnd(256, 64).t()
        yt = cf.linear(xt, w, b, activation="relu")
        assert len(ops.memo_keys()) == 3
        assert torch.equal(cf.linear(xt, w, b, activation="relu"), yt)
        # x [4, 64, 256] with batch dims that do not merge: reshape copies it, never memoized
        xc = rnd(64, 4, 256).transpose(0, 1)
        yc = cf.linear(xc, w, b, activation="relu")
        assert len(ops.memo_keys()) == 3
        assert (yc.float() - torch.relu(xc.float() @ w.float().t() + b.float())).abs().max() < 2e-2
    # autograd goes through the custom op, not the memo
    xg = x.clone().requires_grad_(True)
    cf.linear(xg, w, b, activation="relu").float().sum().backward()
    assert xg.grad is not None
    inference = [k for k in plans.FAST if isinstance(k, tuple) and k[0] == "linear"]
    assert len(inference) == 3, "a training call must not add to, or be served by, the inference memo"
    assert any(isinstance(k, tuple) and k[0] == "linear:train" for k in plans.FAST)


def test_memo_skips_nchw_conv_and_record_sees_memoized_calls(cache_dir, tmp_path):
    x = rnd(4, 16, 8, 8)  # NCHW: converted (copied) on every call, never memoized
    w, b = rnd(32, 16, 3, 3, scale=0.1, cl=True), rnd(32)
    loader.clear()
    with torch.no_grad():
        y = cf.conv2d(x, w, b, padding=1, activation="relu")
        cf.conv2d(x, w, b, padding=1, activation="relu")
        assert len(ops.memo_keys()) == 0
        xc = x.contiguous(memory_format=torch.channels_last)
        assert torch.equal(cf.conv2d(xc, w, b, padding=1, activation="relu"), y)
        assert len(ops.memo_keys()) == 1
        out = tmp_path / "m.json"
        with cf.record(str(out)):
            cf.conv2d(xc, w, b, padding=1, activation="relu")
    import json

    assert len(json.loads(out.read_text())["entries"]) == 1


def test_memo_on_side_streams_and_under_capture(cache_dir):
    x, w, b = rnd(64, 256), rnd(256, 256, scale=0.06), rnd(256)
    with torch.no_grad():
        ref = cf.linear(x, w, b, activation="gelu")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            ys = [cf.linear(x, w, b, activation="gelu") for _ in range(3)]
        torch.cuda.current_stream().wait_stream(s)
        for y in ys:
            assert torch.equal(y, ref)

        def f(t):
            return cf.linear(cf.linear(t, w, b, activation="gelu"), w, b)

        g = cf.capture(f, x)
        x2 = rnd(64, 256)
        out = g(x2).clone()
        assert torch.equal(out, f(x2))


def test_memo_serves_attention_and_skips_bool_masks(cache_dir):
    q, k, v = (rnd(2, 4, 128, 64, dtype=torch.bfloat16) for _ in range(3))
    qs = rnd(2, 128, 4, 64, dtype=torch.bfloat16).transpose(1, 2)  # BSHD memory: the output keeps it
    mask = torch.rand(128, 128, device="cuda") > 0.3
    loader.clear()
    with torch.no_grad():
        o1 = cf.scaled_dot_product_attention(q, k, v, is_causal=True)
        o2 = cf.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert len(ops.memo_keys()) == 1 and torch.equal(o1, o2)
        b1 = cf.scaled_dot_product_attention(qs, k, v)
        b2 = cf.scaled_dot_product_attention(qs, k, v)
        assert len(ops.memo_keys()) == 2 and b2.stride() == b1.stride() and torch.equal(b1, b2)
        m1 = cf.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        m2 = cf.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert len(ops.memo_keys()) == 2 and torch.equal(m1, m2)  # the bool mask became a new bias: no memo
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
        assert (m1.float() - ref).abs().max() < 2e-2


def test_training_forward_uses_the_memo_and_backward_specs_are_reused(cache_dir):
    x = rnd(4, 32, 16, 16, cl=True).requires_grad_()
    w = rnd(32, 32, 3, 3, scale=0.1, cl=True).requires_grad_()
    b = rnd(32).requires_grad_()
    loader.clear()
    grads = []
    for _ in range(3):
        y = cf.conv2d(x, w, b, padding=1, activation="relu")
        y.float().square().mean().backward()
        grads.append((y.detach().clone(), x.grad.clone(), w.grad.clone(), b.grad.clone()))
        x.grad = w.grad = b.grad = None
    assert any(isinstance(k, tuple) and k[0] == "conv2d:train" for k in plans.FAST)
    # the backward is the signature's program: act-grad (+ dbias), dgrad, wgrad, on raw launches
    progs = [v for k, v in plans.FAST.items() if isinstance(k, tuple) and k[0] == "convprog"]
    assert len(progs) == 1 and progs[0] is not False
    assert progs[0].dz_plan.raw and progs[0].dgrad.raw and progs[0].wgrad.raw
    assert [p.spec.op for p in (progs[0].dz_plan, progs[0].dgrad, progs[0].wgrad)] == \
        ["act_grad", "conv_dgrad", "conv_wgrad"]
    for later in grads[1:]:
        for a, b_ in zip(later, grads[0]):
            assert torch.equal(a, b_)
    xr, wr, br = (t.detach().float().requires_grad_() for t in (x, w, b))
    torch.relu(torch.nn.functional.conv2d(xr, wr, br, padding=1)).square().mean().backward()
    assert (grads[0][1].float() - xr.grad).norm() / xr.grad.norm() < 2e-2


def _offset_view(t: torch.Tensor, elements: int = 1) -> torch.Tensor:
    """t's values at t's shape and strides (so t's memo key), its data ``elements`` past a 16-byte boundary."""
    flat = torch.empty(t.untyped_storage().nbytes() // t.element_size() + 16, dtype=t.dtype, device=t.device)
    v = flat.as_strided(t.shape, t.stride(), storage_offset=elements)
    v.copy_(t)
    assert v.stride() == t.stride() and v.data_ptr() % 16
    return v


@pytest.mark.parametrize("native_on", [True, False])
def test_unlaunchable_views_of_remembered_signatures_get_torchs_answer(cache_dir, native_on):
    """A misaligned view (cuDNN refuses the pointer) and a negated view (its memory holds the values
    unnegated) have the memo key of the plain tensors a call remembered: each gets torch's answer, as
    a logged fallback, in inference and in the conv training call's remembered forward; the plain call
    still launches."""
    was = ops.native_enabled()
    if native_on and not ops.set_native(True):
        pytest.skip("cudnn_fuse._native is not built")
    ops.set_native(native_on)
    try:
        loader.clear()
        xl, wl, bl = rnd(64, 256, dtype=torch.bfloat16), rnd(512, 256, dtype=torch.bfloat16, scale=0.05), \
            rnd(512, dtype=torch.bfloat16)
        x = rnd(4, 32, 16, 16, cl=True)
        w = rnd(32, 32, 3, 3, scale=0.1, cl=True)
        b = rnd(32)

        def lin(xx, ww):
            return cf.linear(xx, ww, bl, activation="relu")

        def conv(xx, ww):
            return cf.conv2d(xx, ww, b, padding=1, activation="relu")

        with torch.no_grad():
            for fn, a_, w_ in ((lin, xl, wl), (conv, x, w)):
                ref = fn(a_, w_)
                for _ in range(3):
                    assert torch.equal(fn(a_, w_), ref)  # remembered: the memo serves it
                for args, want in (((_offset_view(a_), w_), ref), ((a_, _offset_view(w_)), ref),
                                   ((torch._neg_view(a_), w_), None), ((a_, torch._neg_view(w_)), None)):
                    before = plans.STATS.fallbacks
                    got = fn(*args)
                    if want is None:  # torch's own op on the negated values
                        want = fn(*(t.resolve_neg().clone() if t.is_neg() else t for t in args))
                    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
                    assert plans.STATS.fallbacks > before, args  # torch's op ran, not the plan
                assert torch.equal(fn(a_, w_), ref)
        # training: the conv's remembered forward (its slot launch) meets a misaligned input. No
        # activation: a ReLU's mask would flip where the fallback's y and cuDNN's differ around 0
        xt = x.detach().clone().requires_grad_()
        for _ in range(3):
            xt.grad = None
            y = cf.conv2d(xt, w, b, padding=1)
            y.float().sum().backward()
        xm = _offset_view(x.detach()).requires_grad_()
        before = plans.STATS.fallbacks
        ym = cf.conv2d(xm, w, b, padding=1)
        ym.float().sum().backward()
        assert plans.STATS.fallbacks > before
        torch.testing.assert_close(ym.float(), y.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(xm.grad.float(), xt.grad.float(), rtol=2e-2, atol=2e-2)
    finally:
        ops.set_native(was)


def test_builds_on_threads_beside_launches_and_a_capture(cache_dir):
    """Plan builds (heuristics, finalize) hold the shared handle's lock on the side stream: three threads
    building new signatures while a fourth launches a remembered one on its own stream and captures it
    into a CUDA graph (thread-local capture mode) all get right answers, none deadlocks, and the capture
    replays what it captured."""
    import threading

    loader.clear()
    torch.manual_seed(1)
    w, b = rnd(256, 256, scale=0.05), rnd(256)
    x0 = rnd(64, 256)
    cf.linear(x0, w, b, activation="relu")  # remembered before the threads start
    # every operand made now: torch's CUDA generator refuses an offset increment in another thread
    # while a capture is under way
    xs = [[rnd(16 * (1 + 3 * i + k) + 8, 256) for i in range(6)] for k in range(3)]  # six builds a thread
    x_new = rnd(64, 256)
    torch.cuda.synchronize()
    errors = []

    def right(y, x):
        want = torch.relu(x.float() @ w.float().t() + b.float())
        err = ((y.float() - want).norm() / want.norm()).item()
        assert err < 1e-2, err

    def builder(k):
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s), torch.no_grad():
                for x in xs[k]:
                    y = cf.linear(x, w, b, activation="relu")
                    s.synchronize()
                    right(y, x)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    def launcher():
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s), torch.no_grad():
                x = x0.clone()
                for _ in range(3):
                    for _ in range(20):
                        y = cf.linear(x, w, b, activation="relu")
                    s.synchronize()
                    right(y, x)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
                        yg = cf.linear(x, w, b, activation="relu")
                    x.copy_(x_new)
                    g.replay()
                    s.synchronize()
                    right(yg, x)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=builder, args=(k,)) for k in range(3)] + [threading.Thread(target=launcher)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert errors == []
    assert not handles.handle_for(0).lock.locked()
