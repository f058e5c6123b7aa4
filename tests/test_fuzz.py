"""Seeded random cases of every functional op on the CPU path (tests/fuzz.py), against a
float64 reference composed from plain torch ops: shapes, layouts, epilogues, masks, GQA,
memoized second calls and gradients. The same cases, larger, run on cuDNN in test_gpu_fuzz.py."""

from __future__ import annotations

import pytest
import torch

from fuzz import GRAD_TOL, MAKERS, TOL, check, custom_op_call, draw, failures

CASES = draw(seed=20261201, n=300, dtypes=(torch.float32, torch.bfloat16, torch.float16), small=True)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_cpu_op_matches_float64_reference(case):
    res = check(case, "cpu", seed=int(case.name[4:]))
    bad = failures(case, res)
    assert not bad, f"{case}: " + "; ".join(bad)


def test_the_draw_covers_every_op_layout_and_epilogue():
    ops = {c.op for c in CASES}
    assert ops == {"conv2d", "matmul", "sdpa"}
    conv = [c.params for c in CASES if c.op == "conv2d"]
    assert {p["layout"] for p in conv} >= {"contiguous", "channels_last", "sliced"}
    assert any(p["groups"] > 1 for p in conv) and any(p["padding"] == "same" for p in conv)
    mm = [c.params for c in CASES if c.op == "matmul"]
    assert {p["kind"] for p in mm} == {"linear", "matmul"} and any(p["batch"] for p in mm)
    at = [c.params for c in CASES if c.op == "sdpa"]
    assert any(p["causal"] for p in at) and {p["mask"] for p in at} >= {None, "bool", "float"}
    assert any(p["Hq"] != p["Hkv"] for p in at)
    assert {c.op for c in CASES if c.grad} == ops and {c.op for c in CASES if c.amax} == {"conv2d", "matmul"}
    assert {p["act"] for p in conv + mm} >= {None, "relu", "gelu", "silu", "leaky_relu"}


def test_the_check_fails_a_wrong_answer(monkeypatch):
    """The harness is not vacuous: an op that is off by 3% (or whose gradient is) fails it."""
    import cudnn_fuse as cf

    case = next(c for c in CASES if c.op == "matmul" and c.grad and c.params["kind"] == "linear")
    real = cf.linear
    monkeypatch.setattr(cf, "linear", lambda *a, **k: real(*a, **k) * 1.03)
    bad = failures(case, check(case, "cpu", seed=1))
    assert any("forward" in b for b in bad) and any("grad" in b for b in bad)
    assert TOL[case.dtype] < 0.03 and GRAD_TOL[case.dtype] < 0.03


def test_a_fallback_is_held_to_eager_torchs_own_error():
    """failures(as_eager=True) widens a bound to 1.25x eager torch's error on the same inputs,
    never below the float64 bound, and only where asked."""
    case = next(c for c in CASES if c.dtype == torch.bfloat16)
    res = {"fwd": [0.02], "grad": {"x (call 2)": 0.03}, "amax": [], "eager_fwd": [0.018],
           "eager_grad": {"x (call 2)": 0.025}}
    assert len(failures(case, res)) == 2  # over the float64 bounds
    assert failures(case, res, as_eager=True) == []  # within 1.25x of eager's
    res["eager_fwd"], res["eager_grad"] = [0.001], {"x (call 2)": 0.001}
    assert len(failures(case, res, as_eager=True)) == 2  # eager is accurate here: cf must be too
    res2 = check(case, "cpu", seed=3, eager=True)
    assert len(res2["eager_fwd"]) == len(res2["fwd"]) and all(e >= 0 for e in res2["eager_fwd"])


def test_gradients_can_be_held_to_eager_alone():
    case = next(c for c in CASES if c.dtype == torch.float32)
    res = {"fwd": [1e-3], "grad": {"w (call 2)": 1e-3}, "amax": [], "eager_fwd": [1e-3], "eager_grad": {"w (call 2)": 1e-3}}
    bad = failures(case, res, grads_as_eager=True)
    assert len(bad) == 1 and bad[0].startswith("forward")  # the forward keeps the float64 bound


def test_the_strict_fp32_fixture_turns_tf32_off(strict_fp32):
    """The GPU fuzz and op tests use it (conftest.py): float32 cases are held to 1e-4."""
    assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32


OPCHECK_CASES = draw(seed=99, n=90, dtypes=(torch.float32, torch.bfloat16), small=True)


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=[c.name for c in OPCHECK_CASES])
def test_custom_ops_pass_opcheck_on_drawn_cases(case):
    """The registered ops' schema, fake kernels (shapes, strides, dtypes against the real
    output) and autograd registration, on drawn layouts and epilogues."""
    ins, _run, _ref = MAKERS[case.op](case, "cpu", torch.Generator().manual_seed(1))
    op, args = custom_op_call(case, ins)
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            a.requires_grad_(case.grad)
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
