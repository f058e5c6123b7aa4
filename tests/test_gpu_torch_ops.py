"""GPU tests of the PyTorch integration: gradients, optimize() on real models,
a short training run, torch.compile, CuPy."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudnn_fuse as cf
from cudnn_fuse import reference

from grad_check import ACTS, DTYPES, check_grads, rel

pytestmark = pytest.mark.gpu

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
def test_linear_and_matmul_gradients(dtype, act):
    x, w, b = torch.randn(2, 64, 96, device="cuda"), torch.randn(80, 96, device="cuda") / 10, torch.randn(80, device="cuda")
    check_grads(lambda x, w, b: cf.linear(x, w, b, activation=act),
                lambda x, w, b: reference.activation(F.linear(x, w, b), act), (x, w, b), dtype)
    check_grads(lambda x, w, b: cf.matmul(x, w.t(), b, activation=act),
                lambda x, w, b: reference.activation(x @ w.t() + b, act), (x, w, b), dtype)


def test_forward_with_grad_runs_the_fused_graph():
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    before = cf.plan_stats()["fallbacks"]
    y = cf.linear(x, w, activation="gelu")
    assert cf.plan_stats()["fallbacks"] == before
    y.sum().backward()
    assert x.grad is not None and w.grad is not None


def test_torch_compile_fullgraph_on_cuda():
    torch._dynamo.reset()
    w = torch.randn(256, 256, device="cuda", dtype=torch.float16) / 16

    def f(x):
        return cf.linear(cf.linear(x, w, activation="relu"), w, activation="silu")

    x = torch.randn(64, 256, device="cuda", dtype=torch.float16)
    out = torch.compile(f, fullgraph=True)(x)
    assert rel(out, f(x)) < 1e-3


def test_resnet50_through_optimize_matches_eager():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet50().cuda().half().eval().to(memory_format=torch.channels_last)
    x = torch.randn(8, 3, 224, 224, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
    opt = cf.optimize(model)
    replaced = dict(opt.cudnn_fuse_summary.replaced)
    assert sum("Conv2d" in p for p in replaced.values()) == 53  # every conv of resnet50
    assert sum("residual add" in p for p in replaced.values()) == 16  # one per bottleneck
    with torch.no_grad():
        ref, out = model.float()(x.float()), opt(x)
    assert rel(out, ref) < 2e-2


def test_gpt2_through_optimize_matches_eager():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=256, n_head=4, n_positions=256, vocab_size=1000)
    model = transformers.GPT2LMHeadModel(cfg).cuda().eval()
    ids = torch.randint(0, 1000, (2, 128), device="cuda")
    with torch.no_grad():
        ref = model(ids).logits
        opt = cf.optimize(model)
        out = opt(ids).logits
    assert rel(out, ref) < 1e-3
    # attention goes through transformers' AttentionInterface; the rest does not trace with fx
    assert opt.config._attn_implementation == "cudnn_fuse"
    left = dict(opt.cudnn_fuse_summary.left_alone)
    assert any("not traceable" in why for why in left.values())


def test_gpt2_odd_vocab_lm_head_runs_aligned_and_matches_eager():
    """GPT-2's 50257-wide lm_head (tied to wte) runs as AlignedLinear: same logits, same tied gradient."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=256, n_head=4, n_positions=128, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg).cuda().to(torch.bfloat16)
    opt = cf.optimize(model)
    assert isinstance(opt.lm_head, cf.nn.AlignedLinear) and opt.lm_head.weight is opt.transformer.wte.weight
    ids = torch.randint(0, cfg.vocab_size, (2, 128), device="cuda")
    with torch.no_grad():
        ref, out = model(ids).logits, opt(ids).logits
    assert out.shape == ref.shape == (2, 128, 50257) and out.stride()[-2:] == (50264, 1)  # a view of aligned rows
    assert rel(out, ref) < 1e-2
    for m in (model, opt):
        m.train()
        m(ids, labels=ids).loss.backward()
    g, g_ref = opt.transformer.wte.weight.grad, model.transformer.wte.weight.grad
    assert rel(g.float(), g_ref.float()) < 3e-2


def test_training_100_steps_tracks_eager_loss():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
                          nn.SiLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 64), nn.GELU(),
                          nn.Linear(64, 10)).cuda()
    ref = copy.deepcopy(model)
    opt = cf.optimize(model)
    o1, o2 = torch.optim.Adam(opt.parameters(), lr=2e-3), torch.optim.Adam(ref.parameters(), lr=2e-3)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 3, 16, 16, device="cuda", generator=g)
    target = torch.randint(0, 10, (64,), device="cuda", generator=g)
    diffs, first, last = [], None, None
    for step in range(100):
        l1 = F.cross_entropy(opt(x), target)
        l2 = F.cross_entropy(ref(x), target)
        for o, l in ((o1, l1), (o2, l2)):
            o.zero_grad()
            l.backward()
            o.step()
        first = first if first is not None else l1.item()
        last = l1.item()
        diffs.append(abs(l1.item() - l2.item()) / max(l2.item(), 1e-3))
    assert math.isfinite(last) and last < 0.7 * first  # it learns (memorises the batch)
    assert max(diffs[:50]) < 0.02 and max(diffs) < 0.1  # and tracks eager's loss curve


def test_cupy_in_cupy_out():
    cp = pytest.importorskip("cupy")
    x = cp.random.randn(64, 128).astype(cp.float16)
    w = (cp.random.randn(96, 128) * 0.1).astype(cp.float16)
    y = cf.linear(x, w, activation="relu")
    assert isinstance(y, cp.ndarray) and y.shape == (64, 96)
    ref = cp.maximum(x.astype(cp.float32) @ w.astype(cp.float32).T, 0)
    assert float(cp.linalg.norm(y.astype(cp.float32) - ref) / cp.linalg.norm(ref)) < 1e-2


def test_a_model_optimized_on_the_cpu_then_moved_gets_channels_last_conv_weights():
    """optimize() on the CPU leaves the fused convs' weights NCHW (cf's CPU conv runs on NCHW operands);
    moved to CUDA they become channels_last, as optimize() on CUDA makes them, and both models give
    the same outputs; moved back, NCHW again. The Parameter objects are the optimizer's still."""
    torch.manual_seed(0)

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 1), nn.SiLU()).eval()

    on_cpu = cf.optimize(make())
    convs = [m for m in on_cpu.modules() if isinstance(m, cf.nn.Conv2d)]
    assert convs and all(m.weight.is_contiguous() for m in convs)
    params = [m.weight for m in convs]
    moved = on_cpu.cuda().half()
    assert all(m.weight is p for m, p in zip(convs, params))
    for m in convs:
        assert m.weight.is_cuda and m.weight.is_contiguous(memory_format=torch.channels_last), m.weight.stride()
    direct = cf.optimize(make().cuda().half())
    for m in direct.modules():
        if isinstance(m, cf.nn.Conv2d):
            assert m.weight.is_contiguous(memory_format=torch.channels_last)
    x = torch.randn(4, 16, 20, 20, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        a, b = moved(x), direct(x)
        ref = make().cuda().double()(x.double())
    assert ((a.double() - b.double()).norm() / b.double().norm()).item() < 1e-3
    assert ((a.double() - ref).norm() / ref.norm()).item() < 1e-2
    back = moved.cpu()
    assert all(m.weight.device.type == "cpu" and m.weight.is_contiguous() for m in back.modules()
               if isinstance(m, cf.nn.Conv2d))


def test_cupy_every_op_on_a_cupy_stream_with_amax():
    """Each public op takes CuPy arrays made on a non-blocking CuPy stream and returns CuPy arrays whose
    values, read on that stream, equal the torch call's (DLPack orders the two libraries' streams)."""
    cp = pytest.importorskip("cupy")
    torch.manual_seed(0)
    h = torch.float16
    x = torch.randn(4, 32, 16, 16, device="cuda", dtype=h).to(memory_format=torch.channels_last)
    wc = (torch.randn(48, 32, 3, 3, device="cuda", dtype=h) * 0.05).to(memory_format=torch.channels_last)
    a, b = torch.randn(128, 256, device="cuda", dtype=h), torch.randn(256, 64, device="cuda", dtype=h) * 0.1
    q = torch.randn(2, 4, 128, 64, device="cuda", dtype=h)
    calls = [
        (cf.conv2d, (x, wc), dict(padding=1, activation="relu", return_amax=True)),
        (cf.matmul, (a, b), dict(activation="gelu", return_amax=True)),
        (cf.linear, (a, b.t().contiguous()), dict(activation="silu")),
        (cf.scaled_dot_product_attention, (q, q, q), dict(is_causal=True)),
    ]
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        for fn, args, kw in calls:
            want = fn(*args, **kw)
            torch.cuda.synchronize()
            ins = [cp.empty(tuple(t.shape), dtype=cp.float16) for t in args]
            for arr, t in zip(ins, args):  # written on the CuPy stream: the op must wait for them
                arr[...] = cp.asarray(t.contiguous().cpu().numpy())
            got = fn(*ins, **kw)
            want = want if isinstance(want, tuple) else (want,)
            got = got if isinstance(got, tuple) else (got,)
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert isinstance(g, cp.ndarray) and g.shape == tuple(w.shape), fn.__name__
                ref = w.float().cpu().numpy()
                val = cp.asnumpy(g.astype(cp.float32), stream=s)
                s.synchronize()
                err = float(abs(val - ref).max()) / max(float(abs(ref).max()), 1e-6)
                assert err < 1e-2, (fn.__name__, err)


@pytest.mark.parametrize("inline", [None, ()], ids=["default", "all_custom_ops"])
def test_torch_compile_trains_on_cuda_with_eager_gradients(inline):
    """A training step under torch.compile on CUDA, with linear / matmul / attention inlined as
    torch ops (the default) or all kept as custom ops, whose backward formulas AOTAutograd traces
    with fake tensors (so the torch math): the gradients equal cf's eager ones."""
    prev = cf.set_compile_inline(inline) if inline is not None else None
    try:
        _compile_training_step()
    finally:
        if prev is not None:
            cf.set_compile_inline(prev)


def _compile_training_step():
    torch._dynamo.reset()
    torch.manual_seed(0)
    dt = torch.bfloat16
    conv = cf.nn.Conv2d(16, 32, 3, padding=1, activation="relu").cuda().to(dt)
    mlp = nn.Sequential(cf.nn.Linear(32, 128, activation="gelu", recompute=True),
                        cf.nn.Linear(128, 64, activation="gelu_tanh", recompute=False),
                        cf.nn.Linear(64, 64, activation="relu")).cuda().to(dt)
    wm = (torch.randn(64, 64, device="cuda", dtype=dt) / 8).requires_grad_()

    def step(x):
        h = conv(x).mean(dim=(2, 3))                                  # [B, 32]
        h = mlp(h)                                                     # [B, 64]
        q = h.view(2, 4, -1, 16)                                      # [2, 4, B/2*... , 16]
        o = cf.scaled_dot_product_attention(q, q, q, is_causal=True)
        return cf.matmul(o.reshape(-1, 64), wm, activation="silu").float().square().mean()

    x = torch.randn(32, 16, 12, 12, device="cuda", dtype=dt).to(memory_format=torch.channels_last)
    params = [*conv.parameters(), *mlp.parameters(), wm]
    step(x).backward()
    eager = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    loss = torch.compile(step, fullgraph=True)(x)
    loss.backward()
    assert torch.isfinite(loss)
    for e, p in zip(eager, params):
        assert rel(p.grad, e) < 3e-2
