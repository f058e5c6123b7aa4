"""GPU: cf.scaled_mm through cuBLASLt (nvmath) and torch._scaled_mm, against the float32 reference:
every epilogue, output format and engine; saturation; the amax before scale_result; CUDA graph capture
and torch.compile."""

from __future__ import annotations

import logging

import pytest
import torch

import cudnn_fuse as cf
from cudnn_fuse import fp8_gemm, reference

pytestmark = pytest.mark.gpu

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.fixture(autouse=True)
def _fp8_gpu():
    if not fp8_gemm.fp8_capable(torch.device("cuda")):
        pytest.skip("FP8 GEMMs need compute capability 8.9 or newer")


def _ops(M=64, K=128, N=96, seed=0, da=E4, db=E4, batch=()):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(*batch, M, K, device="cuda", generator=g).to(da)
    w = torch.randn(N, K, device="cuda", generator=g).to(db)  # a weight [N, K]: b = w.t() is K-major
    return a, w.t(), torch.tensor(0.5, device="cuda"), torch.tensor(0.25, device="cuda")


def _close(y, want, out):
    """Within the output format's rounding of each element (e4m3: 2**-3 relative; e5m2: 2**-2) plus an
    error bounded by the result's largest magnitude: an FP8 GEMM accumulates with less than float32's
    precision on Hopper, and an epilogue in torch rounds an intermediate to 16 bits."""
    rtol = {E4: 0.13, E5: 0.26, torch.float32: 1e-3, torch.float16: 2e-3}.get(out, 1e-2)
    scale = want.float().abs().max().item()
    torch.testing.assert_close(y.float(), want.float(), atol=max(rtol, 4e-3) * scale, rtol=rtol)


def _close_but_for_flips(y, want):
    """fc1's weight gradient in an FP8 MLP: its dY is fc2's FP8 dgrad through GELU's derivative, cast to
    e5m2, and where the GPU's GEMM rounds a bf16 element of it differently from the reference's, the cast
    may take the other e5m2 neighbour (2**-2 apart): a few elements of the gradient are off by up to e5m2's
    step, the rest within bfloat16's."""
    _close(y, want, E5)
    rtol = 1e-2
    atol = rtol * want.float().abs().max().item()
    off = ((y.float() - want.float()).abs() > atol + rtol * want.float().abs()).float().mean().item()
    assert off < 0.01, f"{off:.2%} of the elements beyond bfloat16's tolerance"


@pytest.mark.parametrize("act", [None, "relu", "gelu_tanh", "gelu", "silu"])
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float16, torch.float32, E4, E5])
@pytest.mark.parametrize("M", [64, 40])  # 40: not a multiple of 16, torch._scaled_mm's
def test_every_epilogue_and_output_matches_the_reference(act, out, M):
    a, b, sa, sb = _ops(M=M)
    bias = torch.randn(96, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(M, 96, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor(0.5, device="cuda") if out in (E4, E5) else None
    y, am = cf.scaled_mm(a, b, sa, sb, bias=bias, activation=act, residual=res, out_dtype=out, scale_result=scale,
                         return_amax=True)
    want, want_am = reference.scaled_mm(a, b, sa, sb, bias, act, res, out, scale, True)
    assert y.dtype == out and y.shape == (M, 96) and y.is_contiguous()
    _close(y, want, out)
    assert am.shape == () and am.item() == pytest.approx(want_am.item(), rel=1e-2)


def test_cublaslt_plans_the_aligned_product_and_reuses_its_plan():
    a, b, sa, sb = _ops(M=128, K=256, N=128, seed=1)
    before = fp8_gemm.plan_count()
    y1 = cf.scaled_mm(a, b, sa, sb, activation="relu")
    made = fp8_gemm.plan_count() - before
    refused = fp8_gemm.refused()
    assert made == 1 or refused, "the aligned product neither planned nor was refused"
    if made:
        a2, _, sa2, _ = _ops(M=128, K=256, N=128, seed=2)
        y2 = cf.scaled_mm(a2, b, sa2 * 2, sb, activation="relu")  # new operands and scales, the same plan
        assert fp8_gemm.plan_count() - before == 1
        _close(y2, reference.scaled_mm(a2, b, sa2 * 2, sb, None, "relu"), torch.bfloat16)
    _close(y1, reference.scaled_mm(a, b, sa, sb, None, "relu"), torch.bfloat16)


def test_an_fp8_output_saturates_and_its_amax_is_taken_before_the_scale():
    a, b, sa, sb = _ops(M=64, K=128, N=64, seed=3)
    big = torch.tensor(1e4, device="cuda")  # every |result| * 1e4 passes e4m3's 448
    y, am = cf.scaled_mm(a, b, sa, sb, out_dtype=E4, scale_result=big, return_amax=True)
    want, want_am = reference.scaled_mm(a, b, sa, sb, out_dtype=E4, scale_result=big, return_amax=True)
    assert not torch.isnan(y.float()).any()
    assert y.float().abs().max().item() == torch.finfo(E4).max
    assert am.item() == pytest.approx(want_am.item(), rel=1e-2)
    assert am.item() < 1e3  # the result's, not the scaled one's


def test_batched_a_rowwise_scales_and_a_row_major_b():
    a, b, sa, sb = _ops(M=32, batch=(3,), seed=4)
    y = cf.scaled_mm(a, b, sa, sb, activation="gelu_tanh")
    _close(y, reference.scaled_mm(a, b, sa, sb, None, "gelu_tanh"), torch.bfloat16)
    a2, b2, _, _ = _ops(M=64, seed=5)
    ra = torch.rand(64, 1, device="cuda") + 0.5
    rb = torch.rand(1, 96, device="cuda") + 0.5
    _close(cf.scaled_mm(a2, b2, ra, rb), reference.scaled_mm(a2, b2, ra, rb), torch.bfloat16)
    b_rows = b2.contiguous()  # [K, N] row-major: transposed once, logged
    _close(cf.scaled_mm(a2, b_rows, ra[:1, 0].reshape(()), rb[0, :1].reshape(())),
           reference.scaled_mm(a2, b_rows, ra[:1, 0].reshape(()), rb[0, :1].reshape(())), torch.bfloat16)


def test_it_replays_in_a_cuda_graph():
    a, b, sa, sb = _ops(M=128, seed=6)
    bias = torch.randn(96, device="cuda", dtype=torch.bfloat16)
    fn = lambda: cf.scaled_mm(a, b, sa, sb, bias=bias, activation="relu", out_dtype=E4, return_amax=True)
    want_y, want_am = fn()  # plans outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y, am = fn()
    a.copy_(_ops(M=128, seed=7)[0])
    g.replay()
    torch.cuda.synchronize()
    want_y, want_am = reference.scaled_mm(a, b, sa, sb, bias, "relu", None, E4, None, True)
    _close(y, want_y, E4)
    assert am.item() == pytest.approx(want_am.item(), rel=1e-2)


def test_it_compiles_in_one_graph_on_the_gpu():
    a, b, sa, sb = _ops(M=64, seed=8)
    bias = torch.randn(96, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    fn = torch.compile(lambda *t: cf.scaled_mm(*t, bias=bias, activation="gelu_tanh", out_dtype=E4,
                                               return_amax=True), fullgraph=True)
    y, am = fn(a, b, sa, sb)
    want, want_am = reference.scaled_mm(a, b, sa, sb, bias, "gelu_tanh", None, E4, None, True)
    _close(y, want, E4)
    assert am.item() == pytest.approx(want_am.item(), rel=1e-2)


def test_the_engines_in_use_are_logged(caplog):
    """What cuBLASLt declined is in the log and in refused(), once per plan key (printed for the run's log)."""
    before = dict(fp8_gemm.refused())
    with caplog.at_level(logging.INFO, logger="cudnn_fuse.fp8_gemm"):
        a, b, sa, sb = _ops(M=256, K=256, N=256, seed=9)
        for act in ("relu", "gelu_tanh"):
            for out in (torch.bfloat16, E4):
                cf.scaled_mm(a, b, sa, sb, bias=torch.zeros(256, device="cuda", dtype=torch.bfloat16),
                             activation=act, out_dtype=out, return_amax=True)
    for key, why in fp8_gemm.refused().items():
        print("cuBLASLt declined", key, why)
        if key in before:
            continue
        assert str(key) in caplog.text


def _fp8_module(kind, recipe):
    """(the module in bfloat16 on the CPU, its first linear): an FP8 Linear, or an FP8 FusedMLP whose fc1's
    GELU runs in its GEMM's epilogue without autograd."""
    r = cf.Float8CurrentScaling() if recipe == "current" else cf.DelayedScaling(amax_history_len=4)
    if kind == "linear":
        m = cf.nn.Linear(256, 512, fp8=r).to(torch.bfloat16)
        return m, m
    m = cf.nn.FusedMLP(cf.nn.Linear(256, 512, activation="gelu_tanh"), torch.nn.Linear(512, 128),
                       fp8=r).to(torch.bfloat16)
    return m, m.fc1


@pytest.fixture
def fp8_always(monkeypatch):
    """FP8 layers run FP8 at every shape (no timing against bfloat16): the tests of their arithmetic."""
    from cudnn_fuse import fp8

    monkeypatch.setattr(fp8, "_timeable", lambda x: False)
    monkeypatch.setattr(fp8, "_paid", {})  # no choice made by an earlier test


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_fp8_layers_run_fp8_gemms_and_match_their_cpu_reference(recipe, kind, fp8_always):
    import copy

    torch.manual_seed(0)
    cpu, cpu_first = _fp8_module(kind, recipe)
    gpu = copy.deepcopy(cpu).cuda()
    gpu_first = gpu if kind == "linear" else gpu.fc1
    scales = "fp8_scales" if kind == "linear" else "fc1_fp8_scales"
    before = fp8_gemm.plan_count()
    for step in range(3):  # delayed scaling reads the history the steps before wrote
        x = torch.randn(64, 256, dtype=torch.bfloat16)
        cx, gx = x.clone().requires_grad_(), x.cuda().requires_grad_()
        cy, gy = cpu(cx), gpu(gx)
        g = torch.randn_like(cy)
        cy.backward(g)
        gy.backward(g.cuda())
        _close(gy.detach().cpu(), cy.detach(), torch.bfloat16)
        _close(gx.grad.cpu(), cx.grad, torch.bfloat16)
        if kind == "mlp":
            _close_but_for_flips(gpu_first.weight.grad.cpu(), cpu_first.weight.grad)
        else:
            _close(gpu_first.weight.grad.cpu(), cpu_first.weight.grad, torch.bfloat16)
        torch.testing.assert_close(getattr(gpu, scales).cpu(), getattr(cpu, scales), rtol=1e-2, atol=0)
        cpu_first.weight.grad = gpu_first.weight.grad = None
    assert fp8_gemm.plan_count() > before or fp8_gemm.refused()  # the GEMMs ran through cuBLASLt's FP8 path
    with torch.no_grad():  # bias (and fc1's GELU) in the GEMM's epilogue
        _close(gpu(gx.detach()).cpu(), cpu(cx.detach()), torch.bfloat16)


def test_a_new_plan_takes_its_algorithm_from_the_plan_cache(monkeypatch):
    from cudnn_fuse.cache import open_default_cache

    a, b, sa, sb = _ops(M=128, K=512, N=256, seed=3)
    y1 = cf.scaled_mm(a, b, sa, sb, activation="gelu_tanh")
    if fp8_gemm.refused():
        pytest.skip(f"cuBLASLt refused: {fp8_gemm.refused()}")
    entries = [meta for _, meta, _ in open_default_cache().entries() if meta.get("op") == "scaled_mm"]
    assert entries and entries[0]["engine"].startswith("cuBLASLt algorithm")
    monkeypatch.setattr(fp8_gemm, "_kept", fp8_gemm.Kept(fp8_gemm.MAX_PLANS, fp8_gemm.log, "x"))  # a new process
    before = dict(fp8_gemm.STATS)
    y2 = cf.scaled_mm(a, b, sa, sb, activation="gelu_tanh")
    assert fp8_gemm.STATS["from_cache"] == before["from_cache"] + 1
    assert fp8_gemm.STATS["heuristics"] == before["heuristics"]
    torch.testing.assert_close(y2, y1)  # the same algorithm


def test_a_recorded_fp8_gemm_prewarms_and_serves_a_new_process(tmp_path, monkeypatch):
    from cudnn_fuse import manifest, prewarm
    from cudnn_fuse.cache import open_default_cache

    a, b, sa, sb = _ops(M=256, K=512, N=128, seed=4)
    with cf.record(tmp_path / "m.json"):
        cf.scaled_mm(a, b, sa, sb, activation="relu")
    monkeypatch.setattr(fp8_gemm, "_kept", fp8_gemm.Kept(fp8_gemm.MAX_PLANS, fp8_gemm.log, "x"))
    open_default_cache().clear()  # the run stored its heuristic choice: the pre-warm starts from nothing
    entries = manifest.load(tmp_path / "m.json")
    rows = prewarm.prewarm(entries, cache=open_default_cache(), autotune=True)
    assert [r.status for r in rows] == ["built"], rows
    again = prewarm.prewarm(entries, cache=open_default_cache(), autotune=True)
    assert [r.status for r in again] == ["cached"]  # tuned, stored and found by its own keys
    monkeypatch.setattr(fp8_gemm, "_kept", fp8_gemm.Kept(fp8_gemm.MAX_PLANS, fp8_gemm.log, "x"))  # a new process
    before = fp8_gemm.STATS["from_cache"]
    y = cf.scaled_mm(a, b, sa, sb, activation="relu")
    assert fp8_gemm.STATS["from_cache"] == before + 1
    _close(y, reference.scaled_mm(a, b, sa, sb, None, "relu"), torch.bfloat16)


def _attn_want(q, k, v, dq, dk, dv, causal, scale_s):
    import math

    qf, kf, vf = q.double() * dq.double(), k.double() * dk.double(), v.double() * dv.double()
    rep = q.shape[1] // k.shape[1]
    kf, vf = kf.repeat_interleave(rep, 1), vf.repeat_interleave(rep, 1)
    s = qf @ kf.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
    p = torch.softmax(s, -1)
    p = (p * scale_s).clamp(-448, 448).to(E4).double() / scale_s
    return p @ vf


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads_kv", [8, 2])
def test_fp8_attention_runs_cudnns_graph_and_matches_the_reference(causal, heads_kv):
    from cudnn_fuse import fp8_attention

    if not fp8_attention.fp8_attention_capable(torch.device("cuda")):
        pytest.skip("cuDNN's FP8 attention needs compute capability 9.0")
    g = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(2, 8, 512, 128, device="cuda", generator=g).to(E4)
    k = torch.randn(2, heads_kv, 512, 128, device="cuda", generator=g).to(E4)
    v = torch.randn(2, heads_kv, 512, 128, device="cuda", generator=g).to(E4)
    dq, dk, dv = (torch.tensor(x, device="cuda") for x in (0.5, 0.5, 0.25))
    scale_o = torch.tensor(4.0, device="cuda")
    before = dict(fp8_attention.refused())
    o, am = cf.scaled_dot_product_attention_fp8(q, k, v, dq, dk, dv, is_causal=causal, scale_o=scale_o)
    new_refusals = {key: why for key, why in fp8_attention.refused().items() if key not in before}
    print("cuDNN FP8 attention declined:", new_refusals or "nothing")
    want = _attn_want(q, k, v, dq, dk, dv, causal, 448.0)
    assert o.dtype == E4 and o.shape == q.shape
    err = ((o.double() / 4.0 - want).abs().max() / want.abs().max()).item()
    assert err < 0.08, err  # an FP8 output: within about one E4M3 step of the result
    assert am.item() == pytest.approx(want.abs().max().item(), rel=3e-2)
    if heads_kv == 8:
        assert not new_refusals, new_refusals  # the plain MHA shape is cuDNN's own: it must take it


def test_an_fp8_attention_graph_comes_back_from_the_plan_cache(monkeypatch):
    from cudnn_fuse import fp8_attention

    if not fp8_attention.fp8_attention_capable(torch.device("cuda")):
        pytest.skip("cuDNN's FP8 attention needs compute capability 9.0")
    g = torch.Generator(device="cuda").manual_seed(12)
    q, k, v = (torch.randn(1, 4, 256, 64, device="cuda", generator=g).to(E4) for _ in range(3))
    d = torch.tensor(0.5, device="cuda")
    o1, _ = cf.scaled_dot_product_attention_fp8(q, k, v, d, d, d, is_causal=True)
    monkeypatch.setattr(fp8_attention, "_kept", fp8_gemm.Kept(8, fp8_attention.log, "x"))  # a new process
    before = dict(fp8_attention.STATS)
    o2, _ = cf.scaled_dot_product_attention_fp8(q, k, v, d, d, d, is_causal=True)
    print("FP8 attention graphs:", fp8_attention.STATS)
    assert fp8_attention.STATS["from_cache"] == before["from_cache"] + 1, "stored graph not deserialized"
    assert torch.equal(o1.view(torch.uint8), o2.view(torch.uint8))
    from cudnn_fuse import prewarm
    from cudnn_fuse.cache import open_default_cache
    from cudnn_fuse.manifest import Entry

    other = fp8_attention.spec_of(q[:, :, :128], k[:, :, :128], v[:, :, :128], False, 0.125)
    rows = prewarm.prewarm([Entry(other)], cache=open_default_cache())
    assert [r.status for r in rows] == ["built"], rows
    assert [r.status for r in prewarm.prewarm([Entry(other)], cache=open_default_cache())] == ["cached"]


@pytest.mark.parametrize("fmt", [E4, E5])
@pytest.mark.parametrize("n", [1, 4095, 3 * 4096 + 17, 1 << 22])
def test_the_triton_cast_matches_torchs_bit_for_bit(fmt, n):
    from cudnn_fuse import fp8_cast

    if not fp8_cast._triton_kernel():
        pytest.skip("no Triton")
    x = (torch.randn(n, device="cuda") * 500).bfloat16()
    if n > 8:
        x[n // 2] = float("nan")
    scale = torch.tensor(0.75, device="cuda")
    y, am = fp8_cast.cast_amax(x, fmt, scale)
    ty, tam = fp8_cast.torch_cast_amax(x, fmt, scale)
    assert torch.equal(y.view(torch.uint8), ty.view(torch.uint8))  # NaN's bits too
    assert torch.equal(am.isnan(), tam.isnan()) and (am.isnan() or am.item() == tam.item())
    y2, am2 = fp8_cast.cast_amax(x.t() if x.dim() > 1 else x[::2], fmt)  # a strided input
    ty2, tam2 = fp8_cast.torch_cast_amax(x[::2], fmt)
    assert torch.equal(y2.view(torch.uint8), ty2.view(torch.uint8))


@pytest.mark.parametrize("fmt", [E4, E5])
@pytest.mark.parametrize("shape", [(1, 1), (64, 64), (100, 37), (4096, 1000), (129, 4160)])
def test_the_triton_cast_and_transpose_matches_torchs_bit_for_bit(fmt, shape):
    from cudnn_fuse import fp8_cast

    if not fp8_cast._triton_kernel():
        pytest.skip("no Triton")
    x = (torch.randn(shape[0], shape[1] + 5, device="cuda") * 500).bfloat16()[:, 3:3 + shape[1]]  # padded rows
    x[shape[0] // 2, shape[1] // 2] = float("nan") if shape[0] > 1 else x[0, 0]
    scale = torch.tensor(0.75, device="cuda")
    y, yt, am = fp8_cast.cast_transpose_amax(x, fmt, scale)
    ty, tam = fp8_cast.torch_cast_amax(x, fmt, scale)
    assert y.shape == shape and yt.shape == shape[::-1] and yt.is_contiguous()
    assert torch.equal(y.view(torch.uint8), ty.view(torch.uint8))
    assert torch.equal(yt.view(torch.uint8), ty.t().contiguous().view(torch.uint8))
    assert torch.equal(am.isnan(), tam.isnan()) and (am.isnan() or am.item() == tam.item())


@pytest.mark.parametrize("source", ["own", "zero", "history"])
@pytest.mark.parametrize("shape", [(1, 1), (4096, 1000), (129, 4160)])
def test_the_recipe_cast_derives_the_scale_as_torchs_ops_do_on_the_gpu(shape, source):
    """The kernel that derives its scale (many programs read the scale element its first one writes)
    gives the torch path's state and cast, bit for bit, flat and transposed."""
    from cudnn_fuse import fp8_cast

    if not fp8_cast._triton_kernel():
        pytest.skip("no Triton")
    x = (torch.randn(shape, device="cuda") * 50).bfloat16()
    src = {"own": x.float().abs().max(), "zero": torch.zeros((), device="cuda"),
           "history": torch.tensor(5.0, device="cuda")}[source]
    delayed = source == "history"
    for transpose in (False, True):
        got_s, want_s = (torch.tensor([3.0, 0.0], device="cuda") for _ in range(2))
        got = fp8_cast.cast_scaled(x, E4, src, got_s[0], 1, None if delayed else got_s[1], transpose, delayed)
        want = fp8_cast._torch_cast(x, E4, want_s[0], src, 1, None if delayed else want_s[1], transpose)
        assert torch.equal(got_s, want_s) and torch.equal(got[3], want[3])
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
        if transpose:
            assert torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8))
        if delayed:
            assert got[2].item() == want[2].item()


def test_quantize_fp8_on_the_gpu_is_the_cpus():
    t = torch.randn(300, 200, device="cuda", dtype=torch.bfloat16) * 5
    q, d = cf.quantize_fp8(t)
    qc, dc = cf.quantize_fp8(t.cpu())
    torch.testing.assert_close(d.cpu(), dc)
    assert torch.equal(q.cpu().float(), qc.float())


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_a_layer_times_fp8_against_bfloat16_once_per_shape(training, monkeypatch):
    """``fp8.pays`` times both ways on the GPU (finite, positive figures), once per shape bucket, and the
    layer runs the way it chose: its FP8 state moves only where FP8 was chosen."""
    from cudnn_fuse import fp8

    monkeypatch.setattr(fp8, "_paid", {})
    real, seen = fp8._timed, []
    monkeypatch.setattr(fp8, "_timed", lambda *a: seen.append(real(*a)) or seen[-1])
    lin = cf.nn.Linear(256, 512, fp8=cf.Float8CurrentScaling()).to("cuda", torch.bfloat16)
    x = torch.randn(4, 120, 256, device="cuda", dtype=torch.bfloat16, requires_grad=training)
    with torch.set_grad_enabled(training):
        for rows in (100, 120):  # 400 and 480 rows, one bucket: timed once
            lin(x[:, :rows])
    assert len(seen) == 1 and all(0 < ms < 100 for ms in seen[0]), seen
    chose_fp8 = list(fp8._paid.values()) == [True]
    assert bool(lin.fp8_amax_history[0, 0] > 0) == chose_fp8


def test_a_plan_made_in_one_thread_runs_in_another():
    """Autograd runs the backward on its own device thread: an FP8 GEMM planned by the forward's thread
    must run there (nvmath's CUDA layer wanted the device set in each thread)."""
    import threading

    a, b, sa, sb = _ops(M=64, K=128, N=96)
    want = cf.scaled_mm(a, b, sa, sb)
    got, errors = [], []

    def other():
        try:
            got.append(cf.scaled_mm(a, b, sa, sb))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert not errors and torch.equal(got[0], want), errors
