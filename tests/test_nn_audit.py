"""The nn modules' audit (2026-12-04, CPU): what a probe against the torch modules found wrong, each
test failing without its fix (docs/decisions.md, "An audit of the nn modules")."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudnn_fuse as cf
from cudnn_fuse import nn as cfnn

torch.manual_seed(0)


def _grads(model, x):
    xs = x.detach().clone().requires_grad_(True)
    y = model(xs)
    y.square().sum().backward()
    out = [y.detach(), xs.grad] + [p.grad for p in model.parameters()]
    model.zero_grad()
    return out


def _close(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v)


@pytest.mark.parametrize("case", ["reflect", "circular", "conv_broadcast_residual", "linear_broadcast_residual"])
def test_an_unknown_activation_set_after_construction_is_named(case):
    """The paths that run torch's conv or add a broadcast residual after the op applied the activation by
    a dict lookup: KeyError: 'swishy'."""
    if case in ("reflect", "circular"):
        m, args = cfnn.Conv2d(2, 3, 3, padding=1, padding_mode=case), (torch.randn(1, 2, 5, 5),)
    elif case == "conv_broadcast_residual":
        m, args = cfnn.Conv2d(2, 3, 1), (torch.randn(2, 2, 4, 4), torch.randn(1, 3, 1, 1))
    else:
        m, args = cfnn.Linear(4, 3), (torch.randn(2, 4), torch.randn(2, 1))
    m.activation = "swishy"
    with pytest.raises(ValueError, match="activation must be None or one of .*'swishy'"):
        m(*args)


@pytest.mark.parametrize("make", [lambda s: cfnn.Conv2d(2, 2, 1, activation="leaky_relu", negative_slope=s),
                                  lambda s: cfnn.Linear(2, 2, activation="leaky_relu", negative_slope=s),
                                  lambda s: cfnn.TransposedLinear(nn.Linear(2, 2), "leaky_relu", s)])
def test_negative_slope_must_be_a_number_where_it_is_given(make):
    """A string used to be taken, and the first training call failed with 'could not convert string to
    float' (naming nothing)."""
    with pytest.raises(TypeError, match="negative_slope must be a real number"):
        make("0.2")
    make(0.2)
    make(torch.tensor(0.2))  # a 0-dim tensor, as the ops take one


def test_negative_slope_changed_to_a_string_is_named_by_the_training_path():
    m = cfnn.Linear(3, 2, activation="leaky_relu", negative_slope=0.2)
    m.negative_slope = "a"
    with pytest.raises(TypeError, match="negative_slope"):
        m(torch.randn(2, 3, requires_grad=True))


class _ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.bn1 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.c2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        return F.relu(self.bn2(self.c2(F.relu(self.bn1(self.c1(x))))))


@pytest.mark.parametrize("grad", [True, False])
def test_a_layer_with_a_folded_batchnorm_refuses_training_mode(grad):
    """optimize() of an eval-mode model folds BatchNorm2d into the convs; model.train() then ran the folded
    layers, where torch normalizes with the batch's statistics: another output without a word."""
    model = _ConvBN().eval()
    with torch.no_grad():
        for bn in (model.bn1, model.bn2):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
    fast = cf.optimize(model)
    assert "folded_bn='bn1'" in repr(fast)
    x = torch.randn(2, 3, 6, 6, requires_grad=grad)
    torch.testing.assert_close(fast(x), model(x))
    fast.train()
    model.train()
    with pytest.raises(RuntimeError, match="folded BatchNorm2d 'bn1'.*eval"):
        fast(x)  # with grad: the ConvChain's one-node path, which runs the layers one by one for this
    fast.eval()
    model.eval()
    torch.testing.assert_close(fast(x), model(x))


class _Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = cfnn.Linear(8, 8, activation="relu")
        self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return F.relu(self.b(self.a(x))) + self.c(x)


def test_optimize_traces_a_model_holding_cf_modules():
    """torch.fx traced into a cf module's forward, whose Python branches on tensors made the whole model
    untraceable: its other patterns were left unfused ('not traceable by torch.fx')."""
    model = _Mixed()
    fast = cf.optimize(model)
    assert [w for w, _ in fast.cudnn_fuse_summary.replaced] == ["b", "c"]
    assert not fast.cudnn_fuse_summary.left_alone
    assert list(fast.state_dict()) == list(model.state_dict())
    x = torch.randn(3, 8)
    _close(_grads(fast, x), _grads(model, x))


class _Wrap(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body, self.fc = body, nn.Linear(6, 4)

    def forward(self, x):
        return F.relu(self.fc(self.body(x).mean((2, 3))))


def test_optimize_again_keeps_the_layers_of_a_conv_chain():
    """A model holding an optimized one (a ConvChain, whose layers the graph does not call): tracing it kept
    only what the graph calls, and the chained layers' parameters left the model (state_dict, optimizer)."""
    stack = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 6, 3, padding=1), nn.ReLU())
    ref = _Wrap(copy.deepcopy(stack))
    model = _Wrap(cf.optimize(stack, chain_convs=True))
    model.load_state_dict(ref.state_dict())
    fast = cf.optimize(model)
    assert ("fc", "Linear + relu") in fast.cudnn_fuse_summary.replaced
    assert list(fast.state_dict()) == list(ref.state_dict())
    assert len(list(fast.parameters())) == len(list(ref.parameters()))
    x = torch.randn(2, 3, 5, 5)
    _close(_grads(fast, x), _grads(ref, x))
    twice = cf.optimize(cf.optimize(ref, chain_convs=True), chain_convs=True)
    assert list(twice.state_dict()) == list(ref.state_dict())
    _close(_grads(twice, x), _grads(ref, x))


class _NamedLikeAChain(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 3, 3, padding=1), nn.Conv2d(3, 3, 3, padding=1)
        self.cudnn_fuse_chain_0 = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        return self.cudnn_fuse_chain_0(F.relu(self.c2(F.relu(self.c1(x)))))


def test_a_chain_does_not_take_the_name_of_a_layer_of_the_model():
    """The chain was registered as cudnn_fuse_chain_0 over a child of that name: the child's parameters
    left the state_dict and parameters() (an optimizer would not train them)."""
    model = _NamedLikeAChain()
    fast = cf.optimize(model, chain_convs=True)
    assert list(fast.state_dict()) == list(model.state_dict())
    assert len(list(fast.parameters())) == len(list(model.parameters()))
    x = torch.randn(1, 3, 5, 5)
    _close(_grads(fast, x), _grads(model, x))


class _Conv1D(nn.Module):  # transformers' Conv1D: an [in, out] weight
    def __init__(self):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(5, 4)), nn.Parameter(torch.randn(4))


@pytest.mark.parametrize("make", [lambda: cfnn.Linear(5, 4), lambda: cfnn.Linear(5, 4, activation="gelu"),
                                  lambda: cfnn.Linear(5, 4, activation="gelu", recompute=True),
                                  lambda: cfnn.FusedMLP(cfnn.Linear(5, 8, activation="gelu"), nn.Linear(8, 4)),
                                  lambda: cfnn.TransposedLinear(_Conv1D(), "gelu"),
                                  lambda: cfnn.Conv2d(5, 4, 1)])
@pytest.mark.parametrize("x", [[1.0] * 5, None])
@pytest.mark.parametrize("with_residual", [False, True])
def test_an_input_that_is_no_tensor_is_named(make, x, with_residual):
    """torch's modules say "argument 'input' must be Tensor"; cf's read x.shape or x.requires_grad first:
    AttributeError: 'list' object has no attribute 'shape' (naming nothing)."""
    m = make()
    residual = (torch.zeros(1, 4, 1, 1) if isinstance(m, nn.Conv2d) else torch.zeros(4)) if with_residual else None
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        m(x, residual) if with_residual else m(x)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.spare = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("cache", torch.zeros(2), persistent=False)

    def forward(self, x):
        return F.relu(self.fc(x))


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.head, self.aux = _Block(), nn.Linear(4, 3), nn.Linear(4, 2)  # aux: not in forward
        self.register_buffer("step", torch.zeros((), dtype=torch.long))
        self.temperature = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.head(self.block(x))


def test_optimize_keeps_what_the_forward_does_not_use():
    """fx.GraphModule keeps what the traced forward reads: a head used only in another mode, a buffer or
    Parameter read elsewhere left the optimized model's state_dict and parameters(); the original's
    state_dict no longer loaded strictly, and a checkpoint of the optimized model lost them."""
    model = _WithUnused()
    fast = cf.optimize(model)
    assert ("block.fc", "Linear + relu") in fast.cudnn_fuse_summary.replaced
    assert sorted(fast.state_dict()) == sorted(model.state_dict())
    assert sorted(n for n, _ in fast.named_parameters()) == sorted(n for n, _ in model.named_parameters())
    assert sorted(n for n, _ in fast.named_buffers()) == sorted(n for n, _ in model.named_buffers())
    assert fast.aux is model.aux or torch.equal(fast.aux.weight, model.aux.weight)
    fast.load_state_dict(model.state_dict())
    model.load_state_dict(fast.state_dict())
    x = torch.randn(3, 4)
    _close(_grads(fast, x), _grads(model, x))


@pytest.mark.parametrize("flag", ["recompute", "autotune", "inplace"])
def test_optimize_flags_must_be_bools(flag):
    """optimize(model, inplace="False") rewrote the caller's model (a non-empty string is true), and
    cf.nn.Linear(recompute="False") recomputed."""
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    before = copy.deepcopy(model)
    with pytest.raises(TypeError, match=f"optimize: {flag} must be a bool, got 'False'"):
        cf.optimize(model, **{flag: "False"})
    assert [type(m) for m in model] == [type(m) for m in before]  # left as it was
    with pytest.raises(TypeError, match="recompute must be a bool, got 'False'"):
        cfnn.Linear(4, 8, activation="gelu", recompute="False")
    assert cfnn.Linear(4, 8, activation="gelu", recompute=True).recompute is True
