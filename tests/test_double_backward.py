"""create_graph=True: the gradients cf's backward formulas return are differentiable themselves
(double backward: gradient penalties, Hessian-vector products), checked numerically by
torch.autograd.gradgradcheck in float64 on the CPU, and against torch on a gradient-penalty step.
Before, activations whose backward needs their input gave wrong second derivatives silently
(their pre-activation was detached) and SDPA's raised."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import gradcheck, gradgradcheck

import cudnn_fuse as cf
from cudnn_fuse import torch_ops

F64 = torch.float64
ACTS = [None, "relu", "gelu", "gelu_tanh", "silu", "tanh", "sigmoid", "leaky_relu"]


def leaf(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return (torch.randn(*shape, generator=g, dtype=F64) * scale).requires_grad_()


def both(fn, args):
    assert gradcheck(fn, args)
    assert gradgradcheck(fn, args)


@pytest.mark.parametrize("act", ACTS)
def test_linear(act):
    slope = 0.2 if act == "leaky_relu" else 0.01  # a slope goes with leaky_relu only
    both(lambda x, w, b, r: cf.linear(x, w, b, activation=act, residual=r, negative_slope=slope),
         (leaf(3, 4), leaf(5, 4, scale=0.5), leaf(5), leaf(3, 5)))


@pytest.mark.parametrize("act", ["relu", "gelu", "tanh"])
def test_matmul_batched(act):
    both(lambda a, b, bias: cf.matmul(a, b, bias, activation=act), (leaf(2, 3, 4), leaf(4, 5, scale=0.5), leaf(5)))


@pytest.mark.parametrize("act", ACTS)
def test_conv2d(act):
    both(lambda x, w, b, r: cf.conv2d(x, w, b, stride=1, padding=1, activation=act, residual=r),
         (leaf(1, 2, 4, 4), leaf(3, 2, 3, 3, scale=0.4), leaf(3), leaf(1, 3, 4, 4)))


def test_conv2d_asymmetric_padding_and_stride():
    both(lambda x, w: cf.conv2d(x, w, None, padding="same", activation="silu"),  # even kernel: pads 0 before, 1 after
         (leaf(1, 2, 5, 5), leaf(2, 2, 2, 2, scale=0.4)))
    both(lambda x, w: cf.conv2d(x, w, None, stride=2, padding=1, groups=2, activation="gelu"),
         (leaf(1, 4, 5, 5), leaf(4, 2, 3, 3, scale=0.4)))


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa(causal):
    both(lambda q, k, v, m: cf.scaled_dot_product_attention(q, k, v, attn_mask=None if causal else m, is_causal=causal),
         (leaf(1, 2, 3, 4), leaf(1, 2, 3, 4), leaf(1, 2, 3, 4), leaf(3, 3)))


@pytest.mark.parametrize("act", ["gelu", "silu"])
def test_kept_pre_activation_linear(act):
    both(lambda x, w, b: torch_ops.linear_save_z(x, w, b, act, None, 0.01), (leaf(3, 4), leaf(5, 4, scale=0.5), leaf(5)))


def test_kept_pre_activation_with_a_residual_names_the_way_out():
    x, w, b, r = leaf(3, 4), leaf(5, 4), leaf(5), leaf(3, 5)
    y = torch_ops.linear_save_z(x, w, b, "gelu", r, 0.01)
    y.sum().backward()  # a first-order backward is fine
    with pytest.raises(RuntimeError, match=r"cf\.nn\.Linear\(\.\.\., recompute=True\)"):
        torch.autograd.grad(torch_ops.linear_save_z(x, w, b, "gelu", r, 0.01).sum(), x, create_graph=True)


def test_a_gradient_penalty_through_a_residual_tanh_layer_keeping_z_names_recompute():
    """A "Linear + residual + tanh" layer keeping z: a create_graph backward through it raises and names
    recompute=True, whose layer then gives torch's second-order gradients. optimize()'s layer trains on
    torch's expression (fuse_training=False), so the penalty runs through it as through the original."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(5, 5)

        def forward(self, x):
            return torch.tanh(self.fc(x) + x)

    torch.manual_seed(0)
    ref = Block().double()
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)

    def penalty(m):
        g, = torch.autograd.grad(m(x).pow(2).sum(), x, create_graph=True)
        return torch.autograd.grad(g.pow(2).sum(), list(m.parameters()))

    def layer(recompute):
        fc = cf.nn.Linear(5, 5, dtype=torch.float64, activation="tanh", recompute=recompute)
        fc.load_state_dict(ref.fc.state_dict())

        class Fused(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = fc

            def forward(self, x):
                return self.fc(x, x)
        return Fused()

    want = penalty(ref)
    with pytest.raises(RuntimeError, match=r"cf\.nn\.Linear\(\.\.\., recompute=True\)"):
        penalty(layer(False))
    for model in (layer(True), cf.optimize(copy.deepcopy(ref)), cf.optimize(copy.deepcopy(ref), recompute=True)):
        got = penalty(model)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    fused = [(m.fuse_training, m.recompute) for r in (False, True)
             for m in cf.optimize(copy.deepcopy(ref), recompute=r).modules() if isinstance(m, cf.nn.Linear)]
    assert fused == [(False, False), (True, True)]  # rewritten both times


@pytest.mark.parametrize("act", ["gelu", "silu"])
def test_fused_mlp(act):
    both(lambda x, w1, b1, w2, b2: torch_ops.mlp(x, w1, b1, w2, b2, act, None, 0.01),
         (leaf(3, 4), leaf(6, 4, scale=0.5), leaf(6), leaf(4, 6, scale=0.5), leaf(4)))


def test_conv_chain_against_torch():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 3, 3, padding=1, bias=False)).double()
    layers = [cf.nn.Conv2d(2, 3, 3, padding=1, activation="relu"), cf.nn.Conv2d(3, 3, 3, padding=1, bias=False)]
    layers[0].load_state_dict(ref[0].state_dict())
    layers[1].load_state_dict(ref[2].state_dict())
    chain = cf.nn.ConvChain([m.double() for m in layers])
    x = leaf(2, 2, 5, 5)
    assert chain._one_node(x) is not None  # the one-node path is what runs

    def penalty(model):
        (gx,) = torch.autograd.grad(model(x).square().sum(), x, create_graph=True)
        return gx.square().sum()

    p_cf, p_ref = penalty(chain), penalty(ref)
    g_cf = torch.autograd.grad(p_cf, [layers[0].weight, layers[0].bias, layers[1].weight])
    g_ref = torch.autograd.grad(p_ref, [ref[0].weight, ref[0].bias, ref[2].weight])
    torch.testing.assert_close(p_cf, p_ref)
    for a, b in zip(g_cf, g_ref):
        torch.testing.assert_close(a, b)


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x):
        h = F.silu(self.c2(F.relu(self.c1(x))))
        return self.fc2(F.gelu(self.fc1(h.mean((2, 3)))))


def test_gradient_penalty_step_through_optimize_matches_torch():
    """A WGAN-GP critic step: the penalty's parameter gradients through the optimize()d model
    equal torch's."""
    torch.manual_seed(0)
    model = Critic().double().train()
    opt = cf.optimize(copy.deepcopy(model))
    assert any(type(m).__module__ == "cudnn_fuse.nn" for m in opt.modules())
    x = torch.randn(4, 3, 6, 6, dtype=F64)
    grads = []
    for m in (model, opt):
        xi = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(m(xi).sum(), xi, create_graph=True)
        loss = ((gx.flatten(1).norm(dim=1) - 1) ** 2).mean() + m(x).mean()
        grads.append(torch.autograd.grad(loss, list(m.parameters())))
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a)
