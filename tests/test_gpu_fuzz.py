"""Seeded random cases of every functional op on the GPU (tests/fuzz.py): cuDNN's fused graphs,
their memoized second calls and their backward, against a float64 reference composed from plain
torch ops on the CPU. Shapes, layouts (channels_last, transposed, sliced views, BSHD), groups,
padding modes, epilogues, AMAX, masks, GQA and causality are drawn; fallbacks are allowed (held
to eager PyTorch's own accuracy on the same inputs) but most cases must run fused (held to the
float64 bounds of fuzz.py).

It found cuDNN's eng0 dropping a GEMM's leaky_relu slope (engines.barred_engines)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import cudnn_fuse as cf

from fuzz import check, draw, failures

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("strict_fp32")]

CASES = draw(seed=7, n=300, dtypes=(torch.float16, torch.bfloat16, torch.float16, torch.bfloat16, torch.float32))
_fused = {}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_gpu_op_matches_float64_reference(case):
    before = cf.plan_stats()
    res = check(case, "cuda", seed=int(case.name[4:]), eager=True)
    torch.cuda.synchronize()
    after = cf.plan_stats()
    fused = after["fallbacks"] == before["fallbacks"]
    _fused[case.name] = (case, fused, res)
    # a fallback's forward, and any gradient (cf's backward runs torch's kernels for some
    # pieces), is held to eager torch's own accuracy on the same inputs where that is worse
    bad = failures(case, res, as_eager=not fused, grads_as_eager=True)
    assert not bad, f"{case}: " + "; ".join(bad)


def test_most_16bit_cases_ran_fused():
    """The draw exercises cuDNN, not only the fallback (runs after the cases above)."""
    report = os.environ.get("CUDNN_FUSE_FUZZ_REPORT")  # every case's errors, for the record
    if report:
        with open(report, "w") as f:
            json.dump([{"case": str(c), "fused": fused, **res} for c, fused, res in _fused.values()], f, indent=0)
    ran = [(c, fused) for c, fused, _ in _fused.values() if c.dtype != torch.float32]
    if len(ran) < 50:
        pytest.skip("the fuzz cases did not run in this session")
    for op in ("conv2d", "matmul", "sdpa"):
        mine = [f for c, f in ran if c.op == op]
        assert sum(mine) >= 0.6 * len(mine), f"{op}: only {sum(mine)} of {len(mine)} 16-bit cases ran fused"
