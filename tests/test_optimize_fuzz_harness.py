"""The GPU optimize() fuzz's harness (tests/test_gpu_optimize_fuzz.py: run_case, failures) can fail.

On the CPU, where cf's ops run their PyTorch reference, the harness runs the same draws in fp16 and
bf16: an unbugged cf passes every case, and with one bug planted at a time (in the reference's
forward, in optimize()'s BatchNorm fold or in cf's CPU backward) every case the bug touches fails.
A case is touched when one of cf's errors grew more than 3x over the unbugged run's (or a
structural problem appeared). This is how the harness's bounds were calibrated: wide enough for
16-bit rounding through whole models, tight enough for the bugs a rewrite could make.
"""

from __future__ import annotations

import pytest
import torch

import test_gpu_optimize_fuzz as T
from cudnn_fuse import nn as cfnn
from cudnn_fuse import reference, torch_ops

SEEDS = T.SEEDS  # the GPU test's 80
DTYPES = (torch.float16, torch.bfloat16)

_epilogue, _activation, _linear, _fold = reference.epilogue, reference.activation, reference.linear, cfnn._fold_bn
_pre_grad, _act_grad, _products, _conv_products = (torch_ops._pre_activation_grad, torch_ops._act_grad,
                                                   torch_ops._linear_products, torch_ops._conv2d_products_torch)


def no_residual(z, bias=None, residual=None, *a, **k):
    return _epilogue(z, bias, None, *a, **k)


def act_before_residual(z, bias=None, residual=None, act=None, negative_slope=0.01, return_amax=False,
                        bias_shape=None, out_dtype=None, owned=False):
    y = _epilogue(z, bias, None, act, negative_slope, False, bias_shape, torch.float32)
    y = (y + residual.float() if residual is not None else y).to(out_dtype or z.dtype)
    return (y, reference.amax(y)) if return_amax else y


def silu_as_gelu(z, name, negative_slope=0.01):
    return _activation(z, "gelu" if name == "silu" else name, negative_slope)


def slope_lost(z, name, negative_slope=0.01):
    return _activation(z, name, 0.01)


def linear_no_bias(x, weight, bias=None, *a, **k):
    return _linear(x, weight, None, *a, **k)


def fold_no_mean(w, b, bn):
    wf, bf = _fold(w, b, bn)
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    return wf, (bf + bn.running_mean * scale).to(bf.dtype)  # the running mean left out


def fold_var_not_sqrt(w, b, bn):
    scale = bn.weight / (bn.running_var + bn.eps)
    wf = w * scale.view(-1, 1, 1, 1).to(w.dtype)
    b0 = b if b is not None else torch.zeros_like(bn.running_mean)
    return wf, ((b0 - bn.running_mean) * scale + bn.bias).to(w.dtype)


def relu_grad_everywhere(ctx, gy, y, recompute_z):
    return gy if ctx.act == "relu" else _pre_grad(ctx, gy, y, recompute_z)


def bias_grad_mean(dz, x, w, need_x, need_w, need_b):
    dx, dw, db = _products(dz, x, w, need_x, need_w, need_b)
    return dx, dw, (dz.reshape(-1, w.shape[0]).mean(0) if need_b else None)


def conv_residual_grad_lost(ctx, x, w, dz):
    out = list(_conv_products(ctx, x, w, dz))
    out[9] = torch.zeros_like(out[9]) if out[9] is not None else None
    return tuple(out)


MUTATIONS = {
    "residual dropped": (reference, "epilogue", no_residual),
    "activation before the residual add": (reference, "epilogue", act_before_residual),
    "silu computed as gelu": (reference, "activation", silu_as_gelu),
    "leaky_relu slope lost": (reference, "activation", slope_lost),
    "linear bias dropped": (reference, "linear", linear_no_bias),
    "BN fold without the running mean": (cfnn, "_fold_bn", fold_no_mean),
    "BN fold by 1/var": (cfnn, "_fold_bn", fold_var_not_sqrt),
    "ReLU backward passes every gradient": (torch_ops, "_pre_activation_grad", relu_grad_everywhere),
    "linear bias gradient averaged": (torch_ops, "_linear_products", bias_grad_mean),
    "conv residual gradient zeroed": (torch_ops, "_conv2d_products_torch", conv_residual_grad_lost),
}

_base: dict = {}


def _run(dtype):
    return {seed: T.run_case(seed, dtype, device="cpu") for seed in SEEDS}


def _unbugged(dtype):
    if dtype not in _base:
        _base[dtype] = _run(dtype)
    return _base[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_harness_passes_cfs_cpu_path(dtype):
    recs = _unbugged(dtype)
    bad = {s: T.failures(r, dtype) for s, r in recs.items() if T.failures(r, dtype)}
    assert not bad, bad
    assert sum(r["fused"] for r in recs.values()) >= len(recs) // 2  # optimize() rewrote most models


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bug", list(MUTATIONS))
def test_the_harness_fails_every_case_a_planted_bug_touches(bug, dtype, monkeypatch):
    base = _unbugged(dtype)
    obj, attr, fn = MUTATIONS[bug]
    monkeypatch.setattr(obj, attr, fn)
    recs = _run(dtype)
    touched = [s for s, r in recs.items()
               if r["problems"] or any(v["cf"] > 3 * max(base[s]["errors"][k]["cf"], 1e-12)
                                       for k, v in r["errors"].items() if k in base[s]["errors"])]
    assert touched, f"{bug}: no case of {len(SEEDS)} exercises it"
    passed = [s for s in touched if not T.failures(recs[s], dtype)]
    assert not passed, f"{bug} ({dtype}): touched cases {passed} passed the harness"
