"""Seeded random models for ``cf.optimize``: the patterns optimize() knows and their near misses.

Conv2d with or without a bias, BatchNorm2d, every activation as a module, in place, or as a
function call (with slopes and approximations), residual adds in either operand order, adds that
broadcast or that share their producer with another user, a conv called twice (shared weights),
Linear stacks, Linear-GELU-Linear blocks with and without a residual, and an activation
optimize() does not fuse (Hardswish).

``draw(seed, sizes)`` returns (float64 model, float64 input). ``sizes="cpu"`` is the draw of
tests/test_optimize_fuzz.py (tiny odd shapes, float64 on the CPU); ``sizes="gpu"`` draws the same
patterns at shapes cuDNN's fused 16-bit kernels take (channels, widths and hidden sizes multiples
of 8, groups at least 8 channels wide) and tensors large enough for 16-bit gradients to be
compared (see SIZES) for tests/test_gpu_optimize_fuzz.py.

Used by tests/test_optimize_fuzz.py (CPU, in CI) and tests/test_gpu_optimize_fuzz.py (GPU).
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn

ACT_MODULES = [lambda r: nn.ReLU(), lambda r: nn.ReLU(inplace=True), lambda r: nn.GELU(),
               lambda r: nn.GELU(approximate="tanh"), lambda r: nn.SiLU(), lambda r: nn.Tanh(), lambda r: nn.Sigmoid(),
               lambda r: nn.LeakyReLU(r.choice([0.01, 0.2])), lambda r: nn.Hardswish(), lambda r: nn.Identity()]
ACT_FUNCS = [F.relu, torch.relu, F.gelu, lambda t: F.gelu(t, approximate="tanh"), F.silu, torch.tanh, torch.sigmoid,
             lambda t: F.leaky_relu(t, 0.2), lambda t: F.leaky_relu(t, negative_slope=0.05), lambda t: t]

# The choices of each size family. "cpu" is the original draw: changing a list or the order of
# the draws changes every CPU model (tests/test_optimize_fuzz.py's seeds would test other models).
# "gpu": group_channels is the channels per group (a conv is grouped only where both sides split
# into groups that many channels wide: 16-bit tensor-core kernels want multiples of 8);
# max_strides, the stride-2 convs per model, and the inputs' sizes in draw() keep every
# activation at >= 4k elements (16k-64k in most convs): in 16 bits a ReLU whose input rounds
# across 0 flips one element of its gradient against float64, which costs a gradient's relative
# error up to about 3/sqrt(elements) (0.05 at 4k, 0.1 at 1k).
SIZES = {
    "cpu": dict(cin=[4, 8], cout=[4, 8, 12], group_channels=1, max_strides=None, width=[8, 16], hidden=[8, 24, 32]),
    "gpu": dict(cin=[8, 16], cout=[8, 16, 32], group_channels=8, max_strides=1, width=[16, 32], hidden=[32, 64]),
}


class ConvUnit(nn.Module):
    """conv [-> bn] [-> + skip] [-> act], the act a module or a function, the skip as drawn."""

    def __init__(self, r: random.Random, cin: int, cout: int, group_channels: int = 1, can_stride: bool = True):
        super().__init__()
        k = r.choice([1, 3])
        self.stride = r.choice([1, 1, 2])
        if not can_stride:  # drawn all the same: the draws that follow stay where they are
            self.stride = 1
        g2 = 2 * group_channels
        self.conv = nn.Conv2d(cin, cout, k, self.stride, k // 2, bias=r.random() < 0.5,
                              groups=r.choice([1, 2]) if cin % g2 == 0 and cout % g2 == 0 else 1)
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
    def __init__(self, r: random.Random, width: int, hidden_sizes=(8, 24, 32)):
        super().__init__()
        self.kind = r.choice(["single", "single", "mlp", "mlp_res", "two_users"])
        hidden = r.choice(list(hidden_sizes))
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
    def __init__(self, r: random.Random, sizes: str = "cpu"):
        super().__init__()
        s = SIZES[sizes]
        chans = [r.choice(s["cin"])]
        units = []
        strides = 0
        for _ in range(r.randint(1, 4)):
            cout = chans[-1] if r.random() < 0.5 else r.choice(s["cout"])
            can_stride = s["max_strides"] is None or strides < s["max_strides"]
            units.append(ConvUnit(r, chans[-1], cout, s["group_channels"], can_stride))
            strides += units[-1].stride == 2
            chans.append(cout)
        self.units = nn.Sequential(*units)
        self.cin = chans[0]

    def forward(self, x):
        return self.units(x)


class RandomMLP(nn.Module):
    def __init__(self, r: random.Random, sizes: str = "cpu"):
        super().__init__()
        s = SIZES[sizes]
        self.width = r.choice(s["width"])
        self.units = nn.Sequential(*[LinearUnit(r, self.width, s["hidden"]) for _ in range(r.randint(1, 3))])

    def forward(self, x):
        return self.units(x)


# activations with a kink (a jump in the derivative): in 16 bits their gradients flip where the
# input rounds across the kink (test_gpu_optimize_fuzz.py gives those models a wider floor)
KINKED_MODULES = (nn.ReLU, nn.LeakyReLU, nn.Hardswish)
KINKED_FUNCS = (ACT_FUNCS[0], ACT_FUNCS[1], ACT_FUNCS[7], ACT_FUNCS[8])  # F.relu, torch.relu, the leaky_relus


def kinked(model) -> bool:
    """Whether ``model`` (a RandomCNN or RandomMLP) has an activation with a kink."""
    return any(isinstance(m, KINKED_MODULES) or (isinstance(m, ConvUnit) and any(m.act_func is f for f in KINKED_FUNCS))
               for m in model.modules())


def _randomize(model, r: random.Random):
    g = torch.Generator().manual_seed(r.randrange(1 << 30))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.3)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.num_features, generator=g) * 0.2)


def draw(seed: int, sizes: str = "cpu"):
    """(model, x), both float64 on the CPU: a RandomCNN for an odd seed (its input channels_last
    half the time), a RandomMLP for an even one. Depends on ``seed`` and ``sizes`` only (it
    reseeds torch's global generator, which the modules' initializers draw from)."""
    if sizes not in SIZES:
        raise ValueError(f"sizes must be one of {sorted(SIZES)}, got {sizes!r}")
    r = random.Random(seed)
    torch.manual_seed(seed)
    if seed % 2:
        model = RandomCNN(r, sizes)
        if sizes == "cpu":
            x = torch.randn(2, model.cin, r.choice([6, 9]), r.choice([6, 8]))
        else:
            # one batch and height: cuDNN plans repeat across seeds (each new signature builds one)
            x = torch.randn(8, model.cin, 16, r.choice([15, 16]))
        if r.random() < 0.5:
            x = x.contiguous(memory_format=torch.channels_last)
    else:
        model = RandomMLP(r, sizes)
        rows = [(5,), (2, 3)] if sizes == "cpu" else [(256,), (8, 32), (4, 96)]
        x = torch.randn(r.choice(rows) + (model.width,))
    _randomize(model, r)
    return model.double(), x.double()
