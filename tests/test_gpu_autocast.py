"""torch.autocast on the GPU: cf's ops take fp32 (and mixed) operands under autocast, cast them
as autocast casts torch's own ops, and run the fused 16-bit graph; optimize()d models train
under autocast + GradScaler as torch's do."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudnn_fuse as cf

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _operands():
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*s, scale=1.0):
        return torch.randn(*s, device="cuda", generator=g) * scale

    return {"x": r(4, 64, 256), "w": r(512, 256, scale=1 / 16), "b": r(512), "res": r(4, 64, 512),
            "img": r(8, 64, 28, 28).to(memory_format=torch.channels_last), "k": r(64, 64, 3, 3, scale=1 / 24),
            "kb": r(64), "q": r(2, 8, 256, 64), "kv": r(2, 8, 256, 64)}


CASES = {
    "linear": (lambda o: cf.linear(o["x"], o["w"], o["b"], activation="gelu", residual=o["res"]),
               lambda o, dt: F.gelu(F.linear(o["x"], o["w"], o["b"]) + o["res"].to(dt))),
    "matmul": (lambda o: cf.matmul(o["x"], o["w"].t(), o["b"], activation="relu"),
               lambda o, dt: F.relu(torch.matmul(o["x"], o["w"].t()) + o["b"].to(dt))),
    "conv2d": (lambda o: cf.conv2d(o["img"], o["k"], o["kb"], padding=1, activation="relu"),
               lambda o, dt: F.relu(F.conv2d(o["img"], o["k"], o["kb"], padding=1))),
    "sdpa": (lambda o: cf.scaled_dot_product_attention(o["q"], o["kv"], o["kv"], is_causal=True),
             lambda o, dt: F.scaled_dot_product_attention(o["q"], o["kv"], o["kv"], is_causal=True)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", CASES)
def test_fp32_operands_under_autocast_run_the_fused_16bit_graph(name, dtype):
    cf_call, torch_call = CASES[name]
    o = _operands()
    before = cf.plan_stats()["fallbacks"]
    with torch.autocast("cuda", dtype=dtype):
        y = cf_call(o)
        t = torch_call(o, dtype)
    assert cf.plan_stats()["fallbacks"] == before  # the cuDNN graph ran, not the reference
    assert y.dtype == dtype == t.dtype
    assert rel(y, t) < (1e-2 if dtype is torch.float16 else 3e-2)
    torch.testing.assert_close(y, cf_call({k: v.to(dtype) for k, v in o.items()}), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["linear", "conv2d"])
def test_mixed_operands_under_autocast(name):
    """A 16-bit activation meeting fp32 parameters: autocast's normal state between layers."""
    cf_call, torch_call = CASES[name]
    o = _operands()
    mixed = dict(o, x=o["x"].half(), img=o["img"].half())
    with torch.autocast("cuda", dtype=torch.float16):
        y, t = cf_call(mixed), torch_call(mixed, torch.float16)
    assert y.dtype == torch.float16
    assert rel(y, t) < 1e-2


def test_optimized_cnn_trains_under_autocast_and_grad_scaler():
    """fp32 parameters, fp16 autocast, GradScaler: the optimize()d model memorises a batch
    along eager's loss curve, both stepped in turn on the same data."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                          nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10)).cuda().to(memory_format=torch.channels_last)
    fused = cf.optimize(copy.deepcopy(eager))
    assert sum(type(m).__module__ == "cudnn_fuse.nn" for m in fused.modules()) >= 2
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 3, 16, 16, device="cuda", generator=g).to(memory_format=torch.channels_last)
    target = torch.randint(0, 10, (64,), device="cuda", generator=g)
    runs = [(m, torch.optim.Adam(m.parameters(), lr=2e-3), torch.amp.GradScaler("cuda")) for m in (fused, eager)]
    curves = ([], [])
    for step in range(80):
        for (model, opt, scaler), curve in zip(runs, curves):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), target)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            curve.append(loss.item())
    assert all(p.grad.dtype == torch.float32 for p in fused.parameters() if p.grad is not None)
    c, e = curves
    assert c[-1] < 0.7 * c[0], c  # it learns (memorises the batch)
    assert max(abs(a - b) for a, b in zip(c, e)) < 0.05 * e[0], (c, e)  # along eager's curve


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_mlp_backward_under_autocast(dtype):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).cuda()
    fused = cf.optimize(copy.deepcopy(mlp))
    assert any(isinstance(m, cf.nn.FusedMLP) for m in fused.modules())
    for m in fused.modules():  # the fused training node (optimize() trains on torch's expression)
        if hasattr(m, "fuse_training"):
            m.fuse_training = True
    x = torch.randn(512, 256, device="cuda")
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    before = cf.plan_stats()["fallbacks"]
    with torch.autocast("cuda", dtype=dtype):
        y, t = fused(xa), mlp(xb)
    assert y.dtype == dtype == t.dtype
    y.float().square().sum().backward()
    t.float().square().sum().backward()
    assert cf.plan_stats()["fallbacks"] == before
    tol = 2e-2 if dtype is torch.float16 else 5e-2
    assert rel(y, t) < tol and rel(xa.grad, xb.grad) < tol
    for p, q in zip(fused.parameters(), mlp.parameters()):
        assert p.grad.dtype == torch.float32 and rel(p.grad, q.grad) < tol


def test_gpt2_under_autocast_matches_eager_autocast():
    """transformers' GPT-2 in fp32 under bf16 autocast, training mode (dropout off): logits and
    gradients of the optimize()d model against torch's own autocast run."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=256, n_head=4, n_positions=256, vocab_size=1000,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg).cuda().train()
    opt = cf.optimize(copy.deepcopy(model))
    ids = torch.randint(0, 1000, (2, 128), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref, out = model(ids, labels=ids), opt(ids, labels=ids)
    assert out.logits.dtype == ref.logits.dtype
    assert rel(out.logits, ref.logits) < 3e-2
    ref.loss.backward()
    out.loss.backward()
    grads = [(p.grad, q.grad) for p, q in zip(opt.parameters(), model.parameters()) if q.grad is not None]
    assert grads and all(g.dtype == torch.float32 for g, _ in grads)
    assert max(rel(g, h) for g, h in grads) < 1e-1
