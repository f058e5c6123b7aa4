"""optimize()'s layers run cuDNN's fused graphs in inference and torch's own expression in a training step
(``fuse_training=False``): the step is the original model's, gradients included; a cf.nn.Linear built by
hand keeps its fused training graphs unless told otherwise."""

from __future__ import annotations

import copy
import importlib
import pickle

import pytest
import torch
import torch.nn.functional as F

import cudnn_fuse as cf
from cudnn_fuse import functional, torch_ops

optimize_mod = importlib.import_module("cudnn_fuse.optimize")  # the package's ``optimize`` is the function


class Block(torch.nn.Module):
    """Linear + GELU + Linear (an MLP), Linear + residual + ReLU, attention and a lone Linear + SiLU."""

    def __init__(self, d=16):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.proj = torch.nn.Linear(d, d)
        self.gate = torch.nn.Linear(d, d)

    def forward(self, x):
        h = self.fc2(F.gelu(self.fc1(x)))
        h = F.relu(self.proj(h) + x)
        q = h.view(h.shape[0], h.shape[1], 2, -1).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(h.shape)
        return F.silu(self.gate(a))


def _spy_cf(monkeypatch):
    """Count the calls of cf's fused paths."""
    calls = []

    def spy(name, real):
        def wrapped(*a, **k):
            calls.append(name)
            return real(*a, **k)
        return wrapped

    for mod, name in ((torch_ops, "linear_save_z"), (torch_ops, "mlp"), (functional, "linear"),
                      (optimize_mod, "scaled_dot_product_attention")):
        monkeypatch.setattr(mod, name, spy(name, getattr(mod, name)))
    return calls


def _grads(model, x):
    x = x.clone().requires_grad_(True)
    y = model(x)
    y.pow(2).sum().backward()
    return y.detach(), x.grad, [p.grad.clone() for p in model.parameters()]


def test_a_training_step_through_optimize_is_the_original_models(monkeypatch):
    torch.manual_seed(0)
    ref = Block().double()
    opt = cf.optimize(copy.deepcopy(ref))
    kinds = {type(m).__name__ for m in opt.modules()}
    assert {"FusedMLP", "Linear"} <= kinds and "F.scaled_dot_product_attention" in str(opt.cudnn_fuse_summary)
    calls = _spy_cf(monkeypatch)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    want, got = _grads(ref, x), _grads(opt, x)
    assert calls == []  # not one fused call in the step
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with torch.no_grad():  # inference: the fused ops
        torch.testing.assert_close(opt(x), ref(x))
    assert {"linear", "scaled_dot_product_attention"} <= set(calls)


def test_frozen_weights_and_no_grad_inputs_run_the_fused_graphs(monkeypatch):
    torch.manual_seed(0)
    opt = cf.optimize(Block().double()).requires_grad_(False)
    calls = _spy_cf(monkeypatch)
    opt(torch.randn(2, 6, 16, dtype=torch.float64))  # grad mode on, but nothing to record
    assert "linear" in calls and "scaled_dot_product_attention" in calls


def test_a_hand_built_linear_keeps_its_fused_training_graphs_unless_told(monkeypatch):
    calls = _spy_cf(monkeypatch)
    x = torch.randn(3, 8, requires_grad=True)
    fused = cf.nn.Linear(8, 4, activation="gelu")
    fused(x).sum().backward()
    assert calls == ["linear_save_z"]
    plain = cf.nn.Linear(8, 4, activation="gelu", fuse_training=False)
    plain.load_state_dict(fused.state_dict())
    x2 = x.detach().clone().requires_grad_(True)
    y = plain(x2)
    y.sum().backward()
    assert calls == ["linear_save_z"]
    torch.testing.assert_close(y, F.gelu(F.linear(x, fused.weight, fused.bias)))
    torch.testing.assert_close(x2.grad, x.grad)
    assert "fuse_training=False" in repr(plain) and "fuse_training" not in repr(fused)


def test_hf_conv1d_trains_on_its_own_addmm(monkeypatch):
    transformers = pytest.importorskip("transformers")
    conv = transformers.pytorch_utils.Conv1D(12, 8).double()
    m = cf.nn.TransposedLinear(conv, "gelu", fuse_training=False)
    calls = _spy_cf(monkeypatch)
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    y = m(x)
    y.sum().backward()
    want_x = x.detach().clone().requires_grad_(True)
    want = F.gelu(conv(want_x))
    want.sum().backward()
    assert calls == [] and torch.equal(y, want) and torch.equal(x.grad, want_x.grad)
    with torch.no_grad():
        torch.testing.assert_close(m(x), want)
    assert calls == ["linear"]


def test_fuse_training_must_be_a_bool_and_old_pickles_keep_fusing(monkeypatch):
    with pytest.raises(TypeError, match="fuse_training"):
        cf.nn.Linear(4, 4, activation="relu", fuse_training="no")
    with pytest.raises(TypeError, match="fuse_training"):
        cf.nn.FusedMLP(cf.nn.Linear(4, 8, activation="gelu"), torch.nn.Linear(8, 4), fuse_training=1)
    m = cf.nn.Linear(4, 4, activation="gelu")
    del m.fuse_training  # a layer pickled before the attribute existed
    m = pickle.loads(pickle.dumps(m))
    calls = _spy_cf(monkeypatch)
    m(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert calls == ["linear_save_z"]


def test_recompute_asks_for_the_fused_training_graphs(monkeypatch):
    """optimize(recompute=True): the layers keep no pre-activation, so they train on cuDNN's recomputing
    graphs (the memory that option is for); the attention still trains on torch's."""
    torch.manual_seed(0)
    ref = Block().double()
    opt = cf.optimize(copy.deepcopy(ref), recompute=True)
    lins = [m for m in opt.modules() if isinstance(m, cf.nn.Linear)]
    assert lins and all(m.fuse_training and m.recompute for m in lins)
    calls = _spy_cf(monkeypatch)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    want, got = _grads(ref, x), _grads(opt, x)
    assert "linear" in calls and "scaled_dot_product_attention" not in calls
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b)
