"""cf.capture's argument checks on the CPU (its replays are GPU tests: test_gpu_cache.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import cudnn_fuse as cf
from cudnn_fuse import graphs


class _Graph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


def _captured(monkeypatch, *static_inputs):
    """A CapturedGraph over CPU static buffers with a stand-in graph (no CUDA here)."""
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    g = object.__new__(graphs.CapturedGraph)
    g.static_inputs, g.static_outputs, g.device, g.graph = static_inputs, ("out",), torch.device("cuda", 0), _Graph()
    return g


def test_capture_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="CUDA"):
        cf.capture(lambda t: t, torch.ones(2))


def test_a_refused_call_leaves_every_static_input_as_it_was(monkeypatch):
    """Input 1 is refused after input 0 was checked: before, input 0 was already overwritten, so a later
    replay() computed from half of the refused call's inputs."""
    a, b = torch.zeros(4), torch.zeros(3)
    g = _captured(monkeypatch, a, b)
    with pytest.raises(ValueError, match="input 1 must be a tensor of shape"):
        g(torch.ones(4), torch.ones(5))
    assert torch.equal(a, torch.zeros(4)) and g.graph.replays == 0
    with pytest.raises(ValueError, match="input 1 must be a tensor"):
        g(torch.ones(4), "not a tensor")
    assert torch.equal(a, torch.zeros(4))
    assert g(torch.ones(4), torch.full((3,), 2.0)) == ("out",)
    assert torch.equal(a, torch.ones(4)) and torch.equal(b, torch.full((3,), 2.0)) and g.graph.replays == 1


def test_a_changed_non_tensor_input_is_refused_before_any_copy(monkeypatch):
    a = torch.zeros(2)
    g = _captured(monkeypatch, a, 3)
    with pytest.raises(ValueError, match="non-tensor input 1 changed"):
        g(torch.ones(2), 4)
    assert torch.equal(a, torch.zeros(2)) and g.graph.replays == 0
    with pytest.raises(ValueError, match="takes 2 inputs, got 1"):
        g(torch.ones(2))


@pytest.mark.parametrize("fn, inputs, warmup, error, match", [
    ("not callable", (torch.ones(2),), 3, TypeError, "fn must be callable, got str"),
    (lambda t: t, (torch.ones(2),), -1, ValueError, "warmup must be a non-negative int"),
    (lambda t: t, (torch.ones(2),), 2.5, ValueError, "warmup must be a non-negative int"),
    (lambda t: t, (torch.ones(2),), True, ValueError, "warmup must be a non-negative int"),
    (lambda ts: ts, ([torch.ones(2), torch.ones(3)],), 3, TypeError, "example input 0 is a list holding tensors"),
    (lambda a, d: d, (torch.ones(2), {"k": torch.ones(2)}), 3, TypeError, "example input 1 is a dict holding tensors"),
])
def test_bad_arguments_are_named_before_anything_runs(fn, inputs, warmup, error, match):
    """They were found only on a GPU, after the warm-up had run, if at all: a list of tensors was captured as
    the caller's own tensors (never copied into on replay), and a later call with another list raised
    "Boolean value of Tensor with more than one value is ambiguous"."""
    with pytest.raises(error, match=match):
        cf.capture(fn, *inputs, warmup=warmup)


def test_a_non_tensor_input_whose_equality_is_no_bool_counts_as_changed(monkeypatch):
    class Odd:
        def __eq__(self, other):
            raise RuntimeError("ambiguous")

    static = Odd()
    g = _captured(monkeypatch, torch.zeros(2), static)
    assert g(torch.ones(2), static) == ("out",)  # the same object: no comparison
    with pytest.raises(ValueError, match="non-tensor input 1 changed"):
        g(torch.ones(2), Odd())


def test_a_static_input_is_a_leaf_with_the_examples_requires_grad():
    """Before, a static input was ``x.clone()``: for an example that requires grad, a non-leaf whose
    history led back to the example, so a captured backward sent input gradients to the caller's
    example tensor."""
    x = torch.randn(3, requires_grad=True)
    s = graphs._static(x)
    assert s.is_leaf and s.requires_grad and s.grad_fn is None
    assert torch.equal(s, x) and s.data_ptr() != x.data_ptr()
    ids = torch.arange(4)
    assert not graphs._static(ids).requires_grad and graphs._static(5) == 5


def test_new_values_are_copied_into_a_static_input_that_requires_grad(monkeypatch):
    """An in-place copy into a leaf that requires grad is refused by autograd outside no_grad."""
    s = graphs._static(torch.zeros(3, requires_grad=True))
    g = _captured(monkeypatch, s)
    new = torch.ones(3, requires_grad=True)
    assert g(new) == ("out",)
    assert torch.equal(s.detach(), torch.ones(3)) and s.is_leaf and s.grad_fn is None and g.graph.replays == 1


def test_outputs_come_back_without_the_captures_autograd_graph():
    w = torch.randn(3, requires_grad=True)
    y = w * 2
    out = torch.utils._pytree.tree_map(graphs._detached, {"y": y, "n": 1, "t": [torch.ones(1)]})
    assert not out["y"].requires_grad and out["y"].grad_fn is None and out["n"] == 1
    assert torch.equal(out["y"], y.detach())
