"""GPU: cf.nn.ConvChain (optimize(chain_convs=True)) on cuDNN. A chained training step runs the
same forward plans and the same replayed backward programs as the layers one by one, so its
outputs and gradients equal theirs bit for bit (where the engines are deterministic: a piece whose
raw launches disagree with themselves is compared at that spread), every layer's backward takes
its program (no general path), and the step's peak memory is the layers' own."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cudnn_fuse as cf
from cudnn_fuse import backward, loader

pytestmark = pytest.mark.gpu


def _stack(c, layers, act=True):
    mods = []
    for _ in range(layers):
        mods.append(nn.Conv2d(c, c, 3, padding=1))
        if act:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def _step(model, x):
    xs = x.detach().clone().requires_grad_()
    y = model(xs)
    y.float().square().mean().backward()
    out = [y.detach().clone(), xs.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return out


def _same(a, b, spread):
    for u, v, s in zip(a, b, spread):
        if s == 0:
            assert torch.equal(u, v)
        else:
            assert (u.float() - v.float()).abs().max().item() <= 4 * s


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("act", [True, False], ids=["relu", "no_act"])
def test_a_chained_step_equals_the_layers_one_by_one(cache_dir, dtype, act, monkeypatch):
    torch.manual_seed(0)
    base = _stack(64, 4, act).cuda().to(dtype)
    single = cf.optimize(copy.deepcopy(base), chain_convs=False)
    chained = cf.optimize(copy.deepcopy(base), chain_convs=True)
    assert any(isinstance(m, cf.nn.ConvChain) for m in chained.modules())
    x = torch.randn(8, 64, 28, 28, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
    for _ in range(2):  # plans and programs built, launch sets warm
        _step(single, x), _step(chained, x)
    a, a2 = _step(single, x), _step(single, x)
    spread = [(u.float() - v.float()).abs().max().item() for u, v in zip(a, a2)]
    general = []
    real = backward.conv_dz
    monkeypatch.setattr(backward, "conv_dz", lambda *args, **kw: general.append(1) or real(*args, **kw))
    b = _step(chained, x)
    assert not general, "every chained layer's backward must take its replayed program"
    _same(b, a, spread)
    ref = _step(base, x)  # torch's eager layers: close (another kernel, another rounding)
    for u, v in zip(b, ref):
        torch.testing.assert_close(u.float(), v.float(), rtol=5e-2, atol=5e-2)


def test_a_chained_step_takes_no_more_memory(cache_dir):
    torch.manual_seed(1)
    base = _stack(128, 6).cuda().half()
    single = cf.optimize(copy.deepcopy(base), chain_convs=False)
    chained = cf.optimize(copy.deepcopy(base), chain_convs=True)
    x = torch.randn(16, 128, 28, 28, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)

    def peak(model):
        for _ in range(2):
            _step(model, x)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_bytes = torch.cuda.memory_allocated()
        _step(model, x)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base_bytes

    one_by_one, chain = peak(single), peak(chained)
    assert chain <= one_by_one + 2 * x.numel() * x.element_size(), (chain, one_by_one)  # a gradient's worth of slack


def test_a_chained_nchw_input_and_a_frozen_first_layer(cache_dir):
    torch.manual_seed(2)
    base = _stack(32, 3).cuda().half()
    base[0].weight.requires_grad_(False)
    single = cf.optimize(copy.deepcopy(base), chain_convs=False)
    chained = cf.optimize(copy.deepcopy(base), chain_convs=True)
    x = torch.randn(4, 32, 16, 16, device="cuda", dtype=torch.float16)  # NCHW: the layers convert it
    xs, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    ys, yc = single(xs), chained(xc)
    assert ys.stride() == yc.stride()
    ys.float().sum().backward()
    yc.float().sum().backward()
    torch.testing.assert_close(xc.grad, xs.grad, rtol=1e-2, atol=1e-2)
    for p, q in zip(single.parameters(), chained.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-2, atol=1e-2)
    loader.clear()
