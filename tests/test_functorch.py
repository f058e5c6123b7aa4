"""torch.func transforms (vmap, grad, jacrev, jvp, hessian) over cf's ops and optimize()d models:
under a transform an op runs its PyTorch reference (a logged fallback), which every transform
supports. Before, training-mode calls raised (cf's eager autograd.Functions have no
setup_context), and a remembered launch could have been served a wrapped tensor."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, hessian, jacrev, jvp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

import cudnn_fuse as cf
from cudnn_fuse import ops

F64 = torch.float64


def _ops(x, w, b, img, k, q):
    return (cf.linear(x, w, b, activation="gelu"), cf.matmul(x, w.t(), b, activation="silu"),
            cf.conv2d(img, k, None, padding=1, activation="tanh"),
            cf.scaled_dot_product_attention(q, q, q, is_causal=True))


def _torch(x, w, b, img, k, q):
    with sdpa_kernel(SDPBackend.MATH):  # torch's CPU flash kernel has no forward AD (jvp); cf picks math itself
        o = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    return F.gelu(F.linear(x, w, b)), F.silu(x @ w.t() + b), torch.tanh(F.conv2d(img, k, None, padding=1)), o


def _args(requires_grad=False):
    g = torch.Generator().manual_seed(0)
    ts = (torch.randn(3, 4, generator=g, dtype=F64), torch.randn(5, 4, generator=g, dtype=F64),
          torch.randn(5, generator=g, dtype=F64), torch.randn(1, 2, 5, 5, generator=g, dtype=F64),
          torch.randn(3, 2, 3, 3, generator=g, dtype=F64), torch.randn(1, 2, 4, 3, generator=g, dtype=F64))
    return tuple(t.requires_grad_(requires_grad) for t in ts)


@pytest.mark.parametrize("requires_grad", [False, True], ids=["inference", "training"])
def test_vmap_over_each_op(requires_grad):
    args = _args(requires_grad)
    batched = tuple(torch.stack([a, a * 0.5, -a]) for a in args)
    got, want = vmap(_ops)(*batched), vmap(_torch)(*batched)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_grad_jacrev_jvp_hessian_of_each_op():
    args = _args()
    for i in range(4):
        def f(*a, i=i):
            return _ops(*a)[i].square().sum()

        def t(*a, i=i):
            return _torch(*a)[i].square().sum()

        argnums = tuple(range(6))
        for a, b in zip(grad(f, argnums=argnums)(*args), grad(t, argnums=argnums)(*args)):
            torch.testing.assert_close(a, b)
        torch.testing.assert_close(jacrev(lambda x: _ops(x, *args[1:])[i])(args[0]),
                                   jacrev(lambda x: _torch(x, *args[1:])[i])(args[0]))
        tangents = tuple(torch.ones_like(a) for a in args)
        torch.testing.assert_close(jvp(f, args, tangents), jvp(t, args, tangents))
    torch.testing.assert_close(hessian(lambda x: cf.linear(x, args[1], args[2], activation="gelu").sum())(args[0]),
                               hessian(lambda x: F.gelu(F.linear(x, args[1], args[2])).sum())(args[0]))


def test_a_remembered_launch_is_not_served_to_a_transform():
    x, w, b = _args()[:3]
    cf.linear(x, w, b, activation="relu")  # a plain call: its signature is remembered
    before = cf.plan_stats()["fallbacks"]
    out = vmap(lambda x: cf.linear(x, w, b, activation="relu"))(x.unsqueeze(1))
    torch.testing.assert_close(out.squeeze(1), F.relu(F.linear(x, w, b)))
    assert ops._memo("linear", x, w, b, None, ("relu", False, 0.01))[0] is not None  # outside: keyed again
    assert cf.plan_stats()["fallbacks"] > before  # the transform's call was a (logged) fallback


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = F.relu(self.conv(x)).mean((2, 3))
        return self.fc2(F.gelu(self.fc1(h)))


def test_per_sample_gradients_of_an_optimized_model():
    """The torch.func recipe for per-sample gradients (functional_call + vmap(grad)), on an
    optimize()d model in training mode: FusedMLP and the fused conv take the reference."""
    torch.manual_seed(0)
    model = Net().double().train()
    opt = cf.optimize(copy.deepcopy(model))
    assert any(isinstance(m, cf.nn.FusedMLP) for m in opt.modules())
    x, y = torch.randn(5, 2, 6, 6, dtype=F64), torch.randint(0, 3, (5,))

    def per_sample(m):
        params = {k: v.detach() for k, v in m.named_parameters()}

        def loss(p, xi, yi):
            return F.cross_entropy(functional_call(m, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

        return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)

    got, want = per_sample(opt), per_sample(model)
    # the fused block holds fc1 and fc2 where they were: the same parameter names
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k])
