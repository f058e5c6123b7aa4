"""The forward of an optimized model fetches each submodule path it uses more than once into a local
(optimize._hoisted): fx's code spells ``self.a.b.c`` at every call, one nn.Module.__getattr__ per dot.
The output, pickling, copying and torch.compile are as before."""

from __future__ import annotations

import copy
import importlib
import io

import pytest
import torch
from torch import nn

import cudnn_fuse as cf

opt = importlib.import_module("cudnn_fuse.optimize")  # the module (cf.optimize is the function)


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Dropout(0.0), nn.Linear(2 * d, d))
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x + self.mlp(self.ln(x)) * self.scale


class Net(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(n)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.blocks(x))


def test_shared_paths_are_fetched_once_and_the_output_is_unchanged():
    torch.manual_seed(0)
    m = Net().eval()
    o = cf.optimize(m)
    code = o.code
    assert "_cf_m0 = self.blocks" in code
    assert code.count("self.blocks") == 1  # every other use goes through the local
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(o(x), m(x))


def test_an_optimized_model_pickles_copies_and_compiles_with_its_hoisted_forward():
    torch.manual_seed(0)
    m = Net().eval()
    o = cf.optimize(m)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        want = m(x)
        buf = io.BytesIO()
        torch.save(o, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert "_cf_m0" in loaded.code and isinstance(loaded, opt.OptimizedGraphModule)
        torch.testing.assert_close(loaded(x), want)
        c = copy.deepcopy(o)
        assert "_cf_m0" in c.code
        torch.testing.assert_close(c(x), want)
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(o, fullgraph=True)(x), want)
    o.train()
    y = o(x.requires_grad_())
    y.sum().backward()
    assert all(p.grad is not None for p in o.parameters() if p.requires_grad)


def test_hoisting_leaves_code_with_nothing_shared_and_avoids_taken_names():
    assert opt._hoisted("def forward(self, x):\n    return self.a(x)\n") is None
    assert opt._hoisted("x = 1\n") is None
    src = ("def forward(self, x):\n    _cf_m0 = x + 1\n    y = self.a.b(_cf_m0)\n    return self.a.c(y)\n")
    out = opt._hoisted(src)
    assert "_cf_m1 = self.a" in out and "_cf_m1.b(_cf_m0)" in out and "_cf_m1.c(y)" in out
    ns = {}
    exec(out, ns)

    class A:
        b = staticmethod(lambda v: v * 2)
        c = staticmethod(lambda v: v - 3)

    class S:
        a = A()

    assert ns["forward"](S(), 5) == (5 + 1) * 2 - 3


def test_indexed_paths_fx_spells_with_getattr_are_fetched_once():
    torch.manual_seed(0)
    m = Net().eval()
    o = cf.optimize(m)
    code = o.code
    # fx spells a Sequential's index getattr(self.blocks, '0'): each block is fetched once, at the top
    for i in range(3):
        assert code.count(f"getattr(_cf_m0, '{i}')") == 1, code
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(o(x), m(x))
    src = ("def forward(self, x):\n    y = getattr(getattr(self.f, '0'), 'if').w + getattr(self.f, '0').b\n"
           "    return getattr(getattr(self.f, '0'), 'if').v(y) + getattr(x, 'real')\n")
    out = opt._hoisted(src)
    assert "getattr(_cf_m1, 'if')" in out and "getattr(x, 'real')" in out  # a keyword stays a getattr
    ns = {}
    exec(out, ns)

    class Leaf:
        w, b = 2, 3
        v = staticmethod(lambda y: y * 10)

    class S:
        f = type("F", (), {"0": Leaf()})()

    setattr(Leaf, "if", Leaf())
    assert ns["forward"](S(), 1) == (2 + 3) * 10 + 1


class _Attn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(B, N, C))


def test_an_unpickled_model_keeps_its_attention_one_call_for_both_modes():
    """fx traces the pickled code again: the attention optimize() put there stays one call (traced into, its
    check of the grad mode was refused and the load failed), and decides per call as before."""
    torch.manual_seed(0)
    m = _Attn()
    o = cf.optimize(m)
    buf = io.BytesIO()
    torch.save(o, buf)  # grad mode on, as a user saves
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert [n.target for n in loaded.graph.nodes if n.op == "call_function"].count(opt.attention) == 1
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), m(x))
    loaded(x).square().sum().backward()
    m(x).square().sum().backward()
    for (name, p), q in zip(m.named_parameters(), loaded.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_an_optimized_conv_model_traces_with_torch_jit_trace(mode):
    import warnings

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 1))
    m.train(mode == "train")
    o = cf.optimize(m)
    x = torch.randn(2, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jit's TracerWarnings: its trace keeps the sizes it saw
        traced = torch.jit.trace(o, x, check_trace=False)
    torch.testing.assert_close(traced(x), m(x))
