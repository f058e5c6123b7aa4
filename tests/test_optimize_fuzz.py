"""Seeded random models through ``cf.optimize`` on the CPU: the rewritten model must compute what
the original computes, in eval mode (BatchNorm folded) and in train mode (outputs, input and
parameter gradients), whatever the pattern matcher decides to fuse or leave alone.

The models are drawn from the patterns optimize() knows and their near misses: Conv2d with or
without a bias, BatchNorm2d, every activation as a module, in place, or as a function call
(with slopes and approximations), residual adds in either operand order, adds that broadcast
or that share their producer with another user, Linear stacks, Linear-GELU-Linear blocks with
and without a residual, and an activation optimize() does not fuse (Hardswish): tests/model_fuzz.py,
``draw(seed)`` at its "cpu" sizes. float64, so a wrong rewrite cannot hide in rounding.
tests/test_gpu_optimize_fuzz.py runs the same patterns through cuDNN in fp16 and bf16.
"""

from __future__ import annotations

import copy

import pytest
import torch

import cudnn_fuse as cf
from model_fuzz import ConvUnit, draw

SEEDS = list(range(120))


@pytest.mark.parametrize("seed", SEEDS)
def test_optimized_random_model_equals_the_original(seed):
    model, x = draw(seed)
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
    # the same names (state_dict keys), fused MLP blocks included (their layers stay where they were)
    assert list(opt_params) == list(ref_params), \
        f"seed {seed}: parameters renamed: {sorted(set(ref_params) - set(opt_params))} -> " \
        f"{sorted(set(opt_params) - set(ref_params))}"
    # a checkpoint of the optimized model loads into the original, key for key, and back
    copy.deepcopy(model).load_state_dict(opt.state_dict(), strict=True)
    copy.deepcopy(opt).load_state_dict(model.state_dict(), strict=True)
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
        model, _ = draw(seed)
        s = cf.optimize(copy.deepcopy(model).eval()).cudnn_fuse_summary
        replaced += [what for _, what in s.replaced]
        left += [why for _, why in s.left_alone]
    parts = {p for what in replaced for p in what.split(" + ")}
    assert {"Conv2d", "BatchNorm2d(folded)", "Linear", "residual add", "(alone)", "relu", "gelu", "gelu_tanh", "silu",
            "tanh", "sigmoid", "leaky_relu", "Linear (fused MLP backward)"} <= parts, parts
    assert any("no epilogue" in why for why in left)
    assert any("shared weights" in why for why in left)
    units = [u for seed in SEEDS for u in draw(seed)[0].modules() if isinstance(u, ConvUnit)]
    assert {u.skip for u in units} == {"none", "input", "input_left", "broadcast", "shared", "twice"}
