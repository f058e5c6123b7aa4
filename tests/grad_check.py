"""Gradient checks shared by the GPU test modules (imported, not collected)."""

from __future__ import annotations

import torch

import cudnn_fuse as cf
from cudnn_fuse import ops
from cudnn_fuse.spec import ACTIVATIONS

ACTS = [None, *ACTIVATIONS]  # every activation cf fuses, and none
DTYPES = [torch.float16, torch.bfloat16]

def rel(a, b) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def check_grads(fn, ref_fn, inputs, dtype, tol=1e-2, no_fallback=False):
    """Ours in ``dtype`` against fp32 autograd on the same (rounded) inputs upcast.

    The gradient bound is a small multiple of torch's own error in ``dtype`` (its
    autograd on the same inputs), floored at ``tol``: a 16-bit backward rounds dz
    and every grad, and kinks (ReLU at 0) amplify that (flash-attention's rule).
    ``no_fallback``: also assert that the backward ran on cuDNN graphs only.
    Returns the gradient errors.
    """
    ours = leaves(*[t.to(dtype) for t in inputs])
    refs = leaves(*[t.to(dtype).float() for t in inputs])
    torch_lp = leaves(*[t.to(dtype) for t in inputs])
    y, yr, yt = fn(*ours), ref_fn(*refs), ref_fn(*torch_lp)
    g = torch.randn_like(yr)
    before, said = cf.plan_stats()["fallbacks"], set(ops._said)
    y.backward(g.to(dtype))
    if no_fallback:
        assert cf.plan_stats()["fallbacks"] == before, f"the backward fell back to torch: {set(ops._said) - said}"
    yr.backward(g)
    yt.backward(g.to(dtype))
    assert rel(y, yr) <= tol
    errs = []
    for a, b, t in zip(ours, refs, torch_lp):
        err, bound = rel(a.grad, b.grad), max(tol, 2 * rel(t.grad, b.grad))
        errs.append(err)
        assert err <= bound, f"gradient error {err:.2e} over twice torch's own ({bound:.2e})"
    return errs


def env_setting(code: str, var: str, value=None) -> str:
    """What ``code`` prints in a fresh interpreter with ``var`` unset (``value`` None) or set to
    ``value``: a module-level setting read from the environment at import."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != var}
    if value is not None:
        env[var] = value
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def step_grads(models, x):
    """[x.grad] + every parameter's gradient of one ``model(x).float().square().mean()`` step,
    for each model (x's and the models' gradients cleared first)."""
    out = []
    for model in models:
        x.grad = None
        model.zero_grad()
        model(x).float().square().mean().backward()
        out.append([x.grad.clone()] + [p.grad.clone() for p in model.parameters()])
    return out


def mlp_operands(m, k, n, dtype, seed=0):
    """CUDA operands of a Linear(k, n) -> act -> Linear(n, k) block: x [m, k], w1 [n, k], b1 [n],
    w2 [k, n] and the output's gradient gy [m, k], from a seeded generator."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w1 = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5 * 2).to(dtype)
    b1 = torch.randn(n, device="cuda", generator=g).to(dtype)
    w2 = (torch.randn(k, n, device="cuda", generator=g) * k ** -0.5).to(dtype)
    gy = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    return x, w1, b1, w2, gy
