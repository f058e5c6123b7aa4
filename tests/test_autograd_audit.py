"""Autograd audit (CPU, float64): a backward that recomputes from a tensor held by reference, not
saved for backward, must not read a value changed since the forward. FusedMLP's first bias (a
second backward with retain_graph=True, or create_graph=True) and ConvChain's biases
(create_graph=True) were read as they were at the backward: after an in-place change the
gradients were silently wrong (torch's, which keep the pre-activation, stayed right). They now
raise autograd's in-place error, as a saved tensor would; a ConvChain's create_graph backward
reads the forward's own biases, not a layer's bias attribute replaced since."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudnn_fuse as cf

F64 = torch.float64
INPLACE = "modified by an inplace operation"


def _mlp():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 3)).double()
    fc1, fc2 = cf.nn.Linear(4, 6, activation="gelu").double(), nn.Linear(6, 3).double()
    fc1.load_state_dict(ref[0].state_dict())
    fc2.load_state_dict(ref[2].state_dict())
    return ref, cf.nn.FusedMLP(fc1, fc2), torch.randn(5, 4, dtype=F64)


def _chain():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 2, 3, padding=1)).double()
    l1 = cf.nn.Conv2d(2, 3, 3, padding=1, activation="relu").double()
    l2 = cf.nn.Conv2d(3, 2, 3, padding=1).double()
    l1.load_state_dict(ref[0].state_dict())
    l2.load_state_dict(ref[2].state_dict())
    chain, x = cf.nn.ConvChain([l1, l2]), torch.randn(2, 2, 5, 5, dtype=F64)
    assert chain._one_node(x) is not None  # one autograd node: the path this is about
    return ref, chain, [l1, l2], x


def test_fused_mlp_second_backward_after_an_in_place_bias_change_raises():
    ref, mlp, x = _mlp()
    assert mlp._fused(x.requires_grad_(), None)  # the one-node path this is about
    y = mlp(x)
    y.pow(2).sum().backward(retain_graph=True)
    with torch.no_grad():
        mlp.fc1.bias.add_(1.0)
    with pytest.raises(RuntimeError, match=INPLACE):  # was: gradients from the changed bias, silently
        y.pow(2).sum().backward()


def test_fused_mlp_create_graph_after_an_in_place_bias_change_raises():
    ref, mlp, x = _mlp()
    y = mlp(x.requires_grad_())
    with torch.no_grad():
        mlp.fc1.bias.add_(1.0)
    with pytest.raises(RuntimeError, match=INPLACE):
        torch.autograd.grad(y.pow(2).sum(), [x, mlp.fc1.weight], create_graph=True)


def test_fused_mlp_first_backward_after_an_in_place_bias_change_stays_torchs():
    """The first backward reads the kept pre-activation, as torch's: no error, torch's gradients."""
    ref, mlp, x = _mlp()
    outs = []
    for model, bias in ((ref, ref[0].bias), (mlp, mlp.fc1.bias)):
        xx = x.clone().requires_grad_()
        y = model(xx)
        with torch.no_grad():
            bias.add_(1.0)
        y.pow(2).sum().backward()
        outs.append([xx.grad] + [p.grad for p in model.parameters()])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)


def test_conv_chain_create_graph_after_an_in_place_bias_change_raises():
    ref, chain, layers, x = _chain()
    y = chain(x.requires_grad_())
    with torch.no_grad():
        layers[0].bias.add_(1.0)
    with pytest.raises(RuntimeError, match=INPLACE):  # was: second derivatives off by 1e5, silently
        torch.autograd.grad(y.pow(2).sum(), [x, layers[0].weight], create_graph=True)


def test_conv_chain_create_graph_reads_the_forwards_biases():
    """A layer's bias replaced after the forward: the create_graph backward still differentiates
    the forward's computation (torch's gradients, first and second order)."""
    ref, chain, layers, x = _chain()
    results = []
    for model, params, holder in ((ref, list(ref.parameters()), ref[0]), (chain, None, layers[0])):
        params = params or [p for m in layers for p in (m.weight, m.bias)]
        xx = x.clone().requires_grad_()
        y = model(xx)
        holder.bias = nn.Parameter(holder.bias.detach() + 1.0)  # the forward's bias stays as it was
        grads = torch.autograd.grad(y.pow(2).sum(), [xx] + params, create_graph=True)
        penalty = sum(g.pow(2).sum() for g in grads)
        results.append(list(grads) + list(torch.autograd.grad(penalty, [xx] + params)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def test_conv_chain_backward_after_an_in_place_bias_change_stays_torchs():
    """Without create_graph the chain reads no bias value (torch's conv saves none): no error."""
    ref, chain, layers, x = _chain()
    outs = []
    for model, bias, params in ((ref, ref[0].bias, list(ref.parameters())),
                                (chain, layers[0].bias, [p for m in layers for p in (m.weight, m.bias)])):
        xx = x.clone().requires_grad_()
        y = model(xx)
        with torch.no_grad():
            bias.add_(1.0)
        outs.append(torch.autograd.grad(F.mse_loss(y, torch.zeros_like(y)), [xx] + params))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)
