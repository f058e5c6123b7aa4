"""optimize() leaves alone what a fused module would change: modules with hooks (the user's, or
old-style spectral_norm / weight_norm / pruning, whose pre-hook computes the weight), parametrized
modules, an activation module or BatchNorm with a hook. Before, old-style spectral_norm and
pruning made optimize() raise TypeError and a hook on a replaced module was dropped silently."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, prune, spectral_norm, weight_norm

import cudnn_fuse as cf


def _model():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4), nn.ReLU())


CASES = {  # name: (change to the model, the module path left alone)
    "spectral_norm": (lambda m: parametrizations.spectral_norm(m[0]), "0"),
    "weight_norm": (lambda m: parametrizations.weight_norm(m[3]), "3"),
    "old_spectral_norm": (lambda m: spectral_norm(m[6]), "6"),
    "old_weight_norm": (lambda m: weight_norm(m[3]), "3"),
    "prune": (lambda m: prune.l1_unstructured(m[0], "weight", 0.5), "0"),
    "forward_hook": (lambda m: m[3].register_forward_hook(lambda mod, i, o: o * 0.5), "3"),
    "forward_pre_hook": (lambda m: m[6].register_forward_pre_hook(lambda mod, i: (i[0] * 2,)), "6"),
    "full_backward_hook": (lambda m: m[6].register_full_backward_hook(lambda mod, gi, go: (gi[0] * 3,)), "6"),
    "activation_hook": (lambda m: m[4].register_forward_hook(lambda mod, i, o: o + 1), None),
    "batchnorm_hook": (lambda m: m[1].register_forward_hook(lambda mod, i, o: o * 2), "1"),
}


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", CASES)
def test_optimize_keeps_what_hooks_and_reparametrizations_do(name, train):
    change, left = CASES[name]
    models = []
    for _ in range(2):  # two identical models (old-style weight_norm cannot be deep-copied)
        torch.manual_seed(0)
        m = _model()
        change(m)
        models.append(m.train(train))
    ref, opt = models[0], cf.optimize(models[1], inplace=True)
    summary = opt.cudnn_fuse_summary
    assert summary.replaced, summary  # the rest is still fused
    if left is not None:
        assert any(where == left for where, _ in summary.left_alone), summary
    x = torch.randn(2, 3, 6, 6)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = ref(xa), opt(xb)
    tol = dict(rtol=1e-4, atol=1e-4)  # eval mode folds the BatchNorm: other rounding
    torch.testing.assert_close(got, want, **tol)
    want.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad, **tol)
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for n, p in opt.named_parameters():
        if n in grads:
            torch.testing.assert_close(p.grad, grads[n], **tol, msg=n)


def test_the_summary_says_why():
    torch.manual_seed(0)
    m = _model()
    spectral_norm(m[6])
    parametrizations.weight_norm(m[3])
    reasons = dict(cf.optimize(m).cudnn_fuse_summary.left_alone)
    assert "hooks" in reasons["6"]
    assert "parametrized" in reasons["3"]


def test_a_model_that_cannot_be_copied_names_inplace():
    torch.manual_seed(0)
    m = _model().train()
    weight_norm(m[3])
    m(torch.randn(1, 3, 6, 6))  # after a forward its weight is a non-leaf tensor: deepcopy refuses
    with pytest.raises(RuntimeError, match="inplace=True"):
        cf.optimize(m)
