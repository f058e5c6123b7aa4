"""Special-values audit (CPU): the ops' results against torch's on NaN, +-inf, -0.0, float16
overflow and empty outputs, and the output's metadata.

The kept pre-activation: a training forward of ``cf.nn.Linear`` with an activation whose backward
needs its input (GELU, SiLU, ...; ``recompute=False``, z kept) and of ``cf.nn.FusedMLP`` computes
y = act(z) of the 16-bit z it keeps, as the GPU's keep-z graph does (measured on the H200,
tests/test_gpu_backward.py) and as eager ``nn.Linear`` -> activation does. The inference call keeps
no z and rounds once, so the two differ by the rounding of z (about half an ulp of z), and where z
overflows to -inf, GELU and SiLU give NaN in training (as eager torch) and -0.0 under no_grad.
79d8e78 had made the CPU round once in training too; the H200 showed that the GPU does not, so
the CPU follows the GPU again.

The rest guards what was found right: NaN propagates through every activation (relu(NaN) is NaN,
as torch.relu's) and into amax, as ``y.abs().amax()``; amax of an empty output is a float32 0."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cudnn_fuse as cf
from cudnn_fuse import reference

HALF = (torch.float16, torch.bfloat16)
KEEP_Z_ACTS = ("gelu", "gelu_tanh", "silu", "tanh", "sigmoid", "leaky_relu")


def _linear(act, dt):
    m = cf.nn.Linear(1, 2, activation=act).to(dt)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([[1.0], [1.0]]))
        m.bias.copy_(torch.tensor([0.0, 1.0]))
    return m


_TORCH_ACT = {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu,
              "tanh": torch.tanh, "sigmoid": torch.sigmoid, "leaky_relu": lambda t: F.leaky_relu(t, 0.01)}


def _z(x, w, b, r, dt):
    """The pre-activation in float32, and rounded to dt."""
    z = F.linear(x.float(), w.float(), b.float())
    z = z if r is None else z + r.float()
    return z, z.to(dt)


@pytest.mark.parametrize("act", ["gelu", "silu"])
def test_keep_z_linear_overflowed_pre_activation_as_eager_torch(act):
    # z = -60000 + -60000: -inf once rounded to float16; act(-1.2e5) rounds to a zero, act(-inf) is NaN
    m = _linear(act, torch.float16)
    x = torch.tensor([[-60000.0]], dtype=torch.float16)
    r = torch.tensor([[-60000.0, 0.0]], dtype=torch.float16)
    with torch.no_grad():
        infer = m(x, r)
        eager = _TORCH_ACT[act](F.linear(x, m.weight, m.bias) + r)
        z32, _ = _z(x, m.weight, m.bias, r, torch.float16)
        once = _TORCH_ACT[act](z32).to(torch.float16)  # torch's own act of the same float32 tensor, rounded once
    got = m(x, r)
    assert got.requires_grad
    assert eager[0, 0].isnan() and got[0, 0].isnan()  # training: act(-inf), as eager torch
    # inference: act(-1.2e5) rounded once, a zero; its sign is a torch kernel detail (F.gelu of -1.2e5 gives -0.0
    # for a one-element tensor and +0.0 in a longer one on an AVX2 CPU), so it is torch's own for the same tensor
    assert infer[0, 0] == 0 and infer[0, 0].signbit() == once[0, 0].signbit()
    assert torch.equal(infer, once)
    assert torch.equal(got.detach()[0, 1:], infer[0, 1:])


@pytest.mark.parametrize("dt", HALF)
@pytest.mark.parametrize("act", KEEP_Z_ACTS)
def test_keep_z_linear_training_forward_is_act_of_the_kept_z(act, dt):
    torch.manual_seed(0)
    m = cf.nn.Linear(16, 32, activation=act).to(dt)
    x = torch.randn(4, 8, 16, dtype=dt) * 2
    r = torch.randn(4, 8, 32, dtype=dt)
    f = _TORCH_ACT[act]
    for res in (None, r):
        z32, z16 = _z(x, m.weight, m.bias, res, dt)
        with torch.no_grad():
            infer = m(x, res)
        got = m(x, res)
        assert got.requires_grad and got.dtype == dt and got.shape == infer.shape
        assert torch.equal(got.detach(), f(z16.float()).to(dt))  # the GPU graph's order
        assert torch.equal(infer, f(z32).to(dt))  # the inference call rounds once
        # apart by the rounding of z (|act'| <= 1.13 times half an ulp of z) and y's own rounding
        ulp = lambda t: torch.finfo(dt).eps * t.float().abs().clamp_min(torch.finfo(dt).tiny)  # noqa: E731
        assert ((got.detach().float() - infer.float()).abs() <= 0.6 * ulp(z16) + ulp(infer)).all()


@pytest.mark.parametrize("dt", HALF)
def test_fused_mlp_training_forward_is_act_of_the_kept_z(dt):
    torch.manual_seed(0)
    fc1, fc2 = cf.nn.Linear(16, 32, activation="gelu").to(dt), torch.nn.Linear(32, 8).to(dt)
    mlp = cf.nn.FusedMLP(fc1, fc2)
    x = torch.randn(64, 16, dtype=dt) * 3
    _, z16 = _z(x, fc1.weight, fc1.bias, None, dt)
    y1 = F.gelu(z16.float()).to(dt)
    got = mlp(x)
    assert got.requires_grad
    assert torch.equal(got.detach(), F.linear(y1.float(), fc2.weight.float(), fc2.bias.float()).to(dt))
    with torch.no_grad():
        infer = mlp(x)
    torch.testing.assert_close(got.detach(), infer, rtol=2e-2, atol=2e-2)


def test_fused_mlp_overflowed_pre_activation_as_eager_torch():
    dt = torch.float16
    fc1, fc2 = _linear("gelu", dt), torch.nn.Linear(2, 1).to(dt)
    with torch.no_grad():
        fc1.bias.copy_(torch.tensor([-60000.0, 1.0]))
        fc1.weight.fill_(1.0)
        fc2.weight.fill_(1.0)
        fc2.bias.zero_()
    mlp = cf.nn.FusedMLP(fc1, fc2)
    x = torch.tensor([[-60000.0]], dtype=dt)
    with torch.no_grad():
        infer = mlp(x)
        eager = fc2(F.gelu(F.linear(x, fc1.weight, fc1.bias)))
    got = mlp(x)
    assert eager.isnan().all() and got.isnan().all()  # gelu(-inf) in training, as eager torch
    assert not infer.isnan().any()  # the inference call: gelu(-1.2e5) = -0.0


def test_keep_z_backward_still_matches_torch():
    """The backward reads the kept z: gradients as torch's."""
    torch.manual_seed(0)
    m = cf.nn.Linear(6, 5, activation="gelu").double()
    t = torch.nn.Linear(6, 5).double()
    t.load_state_dict(m.state_dict())
    x1 = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    m(x1).sum().backward()
    F.gelu(t(x2)).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)
    torch.testing.assert_close(m.weight.grad, t.weight.grad)


# ----------------------------------------------------------------- found right: guards


def _ops(dt, where, val):
    torch.manual_seed(0)
    x, w, b, r = torch.randn(4, 8, dtype=dt), torch.randn(6, 8, dtype=dt), torch.randn(6, dtype=dt), \
        torch.randn(4, 6, dtype=dt)
    d = {"x": x, "w": w, "b": b, "r": r}
    d[where].view(-1)[1] = val
    return d["x"], d["w"], d["b"], d["r"]


@pytest.mark.parametrize("dt", (torch.float32, torch.float64) + HALF)
@pytest.mark.parametrize("where", ["x", "w", "b", "r"])
@pytest.mark.parametrize("act", [None, "relu", "gelu", "silu", "tanh", "sigmoid", "leaky_relu"])
def test_nan_propagates_into_y_and_amax_as_torch(dt, where, act):
    x, w, b, r = _ops(dt, where, float("nan"))
    acc = torch.float32 if dt in HALF else dt
    want = reference.activation(F.linear(x.to(acc), w.to(acc), b.to(acc)) + r.to(acc), act).to(dt)
    for y, amax in (cf.linear(x, w, b, activation=act, residual=r, return_amax=True),
                    cf.matmul(x, w.t(), b, activation=act, residual=r, return_amax=True)):
        assert y.isnan().any()
        assert torch.equal(y.isnan(), want.isnan())
        assert amax.dtype == torch.float32 and amax.shape == () and amax.isnan()  # as y.abs().amax()


def test_amax_of_empty_outputs_is_a_float32_zero():
    for dt in (torch.float32, torch.float64, torch.float16):
        outs = [cf.linear(torch.randn(0, 8, dtype=dt), torch.randn(5, 8, dtype=dt), return_amax=True),
                cf.matmul(torch.randn(3, 0, dtype=dt), torch.randn(0, 0, dtype=dt), return_amax=True),
                cf.conv2d(torch.randn(0, 3, 5, 5, dtype=dt), torch.randn(4, 3, 3, 3, dtype=dt),
                          torch.randn(4, dtype=dt), activation="relu", return_amax=True)]
        for y, amax in outs:
            assert y.numel() == 0 and y.dtype == dt
            assert amax.dtype == torch.float32 and amax.shape == () and amax.device == y.device
            assert amax.item() == 0.0
