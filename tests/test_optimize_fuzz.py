"""Seeded random models through ``cf.optimize`` on the CPU: the rewritten model must compute what
the original computes, in eval mode (BatchNorm folded) and in train mode (outputs, input and
parameter gradients), whatever the pattern matcher decides to fuse or leave alone.

The models are drawn from the patterns optimize() knows and their near misses: Conv2d with or
without a bias, BatchNorm2d, every activation as a module, in place, or as a function call
(with slopes and approximations), residual adds in either operand order, adds that broadcast
or that share their producer with another user, Linear stacks, Linear-GELU-Linear blocks with
and without a residual, and an activation optimize() does not fuse (Hardswish). float64, so a
wrong rewrite cannot hide in rounding.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudnn_fuse as cf

ACT_MODULES = [lambda r: nn.ReLU(), lambda r: nn.ReLU(inplace=True), lambda r: nn.GELU(),
               lambda r: nn.GELU(approximate="tanh"), lambda r: nn.SiLU(), lambda r: nn.Tanh(), lambda r: nn.Sigmoid(),
               lambda r: nn.LeakyReLU(r.choice([0.01, 0.2])), lambda r: nn.Hardswish(), lambda r: nn.Identity()]
ACT_FUNCS = [F.relu, torch.relu, F.gelu, lambda t: F.gelu(t, approximate="tanh"), F.silu, torch.tanh, torch.sigmoid,
             lambda t: F.leaky_relu(t, 0.2), lambda t: F.leaky_relu(t, negative_slope=0.05), lambda t: t]


class ConvUnit(nn.Module):
    """conv [-> bn] [-> + skip] [-> act], the act a module or a function, the skip as drawn."""

    def __init__(self, r: random.Random, cin: int, cout: int):
        super().__init__()
        k = r.choice([1, 3])
        self.stride = r.choice([1, 1, 2])
        self.conv = nn.Conv2d(cin, cout, k, self.stride, k // 2, bias=r.random() < 0.5,
                              groups=r.choice([1, 2]) if cin % 2 == 0 and cout % 2 == 0 else 1)
        self.bn = nn.BatchNorm2d(cout) if r.random() < 0.5 else None
        self.skip = r.choice(["none", "input", "input_left", "broadcast", "shared", "twice"]) \
            if (cin == cout and self.stride == 1 and self.conv.groups == 1) else r.choice(["none", "none", "broadcast"])
        self.act_module = ACT_MODULES[r.randrange(len(ACT_MODULES))](r) if r.random() < 0.6 else None
        self.act_func = ACT_FUNCS[r.randrange(len(ACT_FUNCS))] if self.act_module is None else None

    def forward(self, x):
        y = self.conv(x)
        if self.bn is not None:
            y = self.bn(y)
        if self.skip == "input":
            y = y + x
        elif self.skip == "input_left":
            y = x + y
        elif self.skip == "broadcast":
            y = y + y.mean(dim=(2, 3), keepdim=True)  # [N, C, 1, 1]: cannot ride in the epilogue
        elif self.skip == "shared":
            return self._act(y + x) + 0.5 * y  # the conv output has a second user
        elif self.skip == "twice":  # one module called twice (shared weights), once with an epilogue
            return self._act(self.conv(torch.tanh(y)) + x) + y
        return self._act(y)

    def _act(self, y):
        return self.act_module(y) if self.act_module is not None else self.act_func(y)


class LinearUnit(nn.Module):
    def __init__(self, r: random.Random, width: int):
        super().__init__()
        self.kind = r.choice(["single", "single", "mlp", "mlp_res", "two_users"])
        hidden = r.choice([8, 24, 32])
        bias = r.random() < 0.7
        if self.kind == "single":
            self.a = nn.Linear(width, width, bias=bias)
            self.act = ACT_MODULES[r.randrange(len(ACT_MODULES))](r)
            self.res = r.random() < 0.4
        else:
            self.a = nn.Linear(width, hidden, bias=bias)
            self.act = r.choice([nn.GELU(), nn.GELU(approximate="tanh"), nn.SiLU(), nn.ReLU()])
            self.b = nn.Linear(hidden, width, bias=r.random() < 0.7)

    def forward(self, x):
        if self.kind == "single":
            y = self.act(self.a(x))
            return y + x if self.res else y
        h = self.act(self.a(x))
        if self.kind == "two_users":
            return self.b(h) + h.mean(-1, keepdim=True)  # the activation has another user
        y = self.b(h)
        return y + x if self.kind == "mlp_res" else y


class RandomCNN(nn.Module):
    def __init__(self, r: random.Random):
        super().__init__()
        chans = [r.choice([4, 8])]
        units = []
        for _ in range(r.randint(1, 4)):
            cout = chans[-1] if r.random() < 0.5 else r.choice([4, 8, 12])
            units.append(ConvUnit(r, chans[-1], cout))
            chans.append(cout)
        self.units = nn.Sequential(*units)
        self.cin = chans[0]

    def forward(self, x):
        return self.units(x)


class RandomMLP(nn.Module):
    def __init__(self, r: random.Random):
        super().__init__()
        self.width = r.choice([8, 16])
        self.units = nn.Sequential(*[LinearUnit(r, self.width) for _ in range(r.randint(1, 3))])

    def forward(self, x):
        return self.units(x)


def _randomize(model, r: random.Random):
    g = torch.Generator().manual_seed(r.randrange(1 << 30))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.3)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.num_features, generator=g) * 0.2)


def _draw(seed: int):
    r = random.Random(seed)
    torch.manual_seed(seed)
    if seed % 2:
        model = RandomCNN(r)
        x = torch.randn(2, model.cin, r.choice([6, 9]), r.choice([6, 8]))
        if r.random() < 0.5:
            x = x.contiguous(memory_format=torch.channels_last)
    else:
        model = RandomMLP(r)
        x = torch.randn(r.choice([(5,), (2, 3)]) + (model.width,))
    _randomize(model, r)
    return model.double(), x.double()


SEEDS = list(range(120))


@pytest.mark.parametrize("seed", SEEDS)
def test_optimized_random_model_equals_the_original(seed):
    model, x = _draw(seed)
    # eval: BatchNorm folded into the convs
    ref = copy.deepcopy(model).eval()
    opt = cf.optimize(copy.deepcopy(model).eval())
    summary = opt.cudnn_fuse_summary
    with torch.no_grad():
        want, got = ref(x), opt(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=lambda m: f"eval, seed {seed}: {m}\n{summary}")

    # train: BatchNorm kept (batch statistics), gradients of the input and of every parameter
    ref = copy.deepcopy(model).train()
    opt = cf.optimize(copy.deepcopy(model).train())
    xr, xo = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    gy = torch.randn_like(ref(xr))
    yr, yo = ref(xr), opt(xo)
    torch.testing.assert_close(yo, yr, rtol=1e-9, atol=1e-9, msg=lambda m: f"train, seed {seed}: {m}")
    (yr * gy).sum().backward()
    (yo * gy).sum().backward()
    torch.testing.assert_close(xo.grad, xr.grad, rtol=1e-8, atol=1e-9, msg=lambda m: f"dx, seed {seed}: {m}")
    ref_params = dict(ref.named_parameters())
    opt_params = dict(opt.named_parameters())
    # the same names (state_dict keys), except inside a fused MLP (fc1/fc2)
    renamed = {k for k in ref_params if k not in opt_params}
    allowed = {k for k in renamed if ".a." in k or ".b." in k}
    assert renamed <= allowed, \
        f"seed {seed}: parameters renamed: {sorted(renamed - allowed)} -> {sorted(set(opt_params) - set(ref_params))}"
    if not any(isinstance(m, cf.nn.FusedMLP) for m in opt.modules()):
        # a checkpoint of the optimized model loads into the original, key for key
        copy.deepcopy(model).load_state_dict(opt.state_dict(), strict=True)
    common = [k for k in ref_params if k in opt_params]
    for k in common:
        pr, po = ref_params[k], opt_params[k]
        assert (pr.grad is None) == (po.grad is None), f"seed {seed}: gradient of {k}"
        if pr.grad is not None:
            torch.testing.assert_close(po.grad, pr.grad, rtol=1e-8, atol=1e-9, msg=lambda m: f"d{k}, seed {seed}: {m}")


def test_the_draw_exercises_fusion_and_its_refusals():
    """Across the seeds optimize() both replaces and leaves alone, for several reasons."""
    replaced, left = [], []
    for seed in SEEDS:
        model, _ = _draw(seed)
        s = cf.optimize(copy.deepcopy(model).eval()).cudnn_fuse_summary
        replaced += [what for _, what in s.replaced]
        left += [why for _, why in s.left_alone]
    parts = {p for what in replaced for p in what.split(" + ")}
    assert {"Conv2d", "BatchNorm2d(folded)", "Linear", "residual add", "(alone)", "relu", "gelu", "gelu_tanh", "silu",
            "tanh", "sigmoid", "leaky_relu", "Linear (fused MLP backward)"} <= parts, parts
    assert any("no epilogue" in why for why in left)
    assert any("shared weights" in why for why in left)
    units = [u for seed in SEEDS for u in _draw(seed)[0].modules() if isinstance(u, ConvUnit)]
    assert {u.skip for u in units} == {"none", "input", "input_left", "broadcast", "shared", "twice"}
