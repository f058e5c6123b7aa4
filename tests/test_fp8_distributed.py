"""DelayedScaling under torch.distributed (two CPU ranks over gloo): the amaxes of a whole training step are
max-reduced across ranks in one all_reduce, when the next step begins, so both ranks' histories and scales
agree though each rank's inputs differ."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, recipe_name: str, out: str) -> None:
    import cudnn_fuse as cf

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    calls = []
    real = dist.all_reduce

    def counting(t, *a, **k):
        calls.append(t.numel())
        return real(t, *a, **k)

    dist.all_reduce = counting
    torch.manual_seed(0)  # the same weights on both ranks
    recipe = cf.DelayedScaling(amax_history_len=4) if recipe_name == "delayed" else cf.Float8CurrentScaling()
    model = torch.nn.Sequential(cf.nn.Linear(16, 32, fp8=recipe), cf.nn.Linear(32, 16, fp8=recipe))
    torch.manual_seed(1 + rank)
    per_step = []
    for step in range(STEPS):
        x = torch.randn(8, 16) * (1 + 3 * rank)  # rank 1's activations are larger
        model(x).square().mean().backward()
        per_step.append(len(calls))
    torch.save({"histories": [m.fp8_amax_history.clone() for m in model],
                "scales": [m.fp8_scales.clone() for m in model], "calls": calls, "per_step": per_step}, out)
    dist.destroy_process_group()


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_delayed_scaling_reduces_a_steps_amaxes_across_ranks_once(tmp_path, recipe_name):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(2)]
    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, port, recipe_name, outs[r])) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    got = [torch.load(o) for o in outs]
    if recipe_name == "current":  # each rank's own amaxes: no collective, and the ranks differ
        assert got[0]["calls"] == [] and not torch.equal(got[0]["histories"][0], got[1]["histories"][0])
        return
    # steps 2 and 3 each began with one all_reduce of the step before's 2 layers x 3 roles
    assert got[0]["calls"] == got[1]["calls"] == [6, 6] and got[0]["per_step"] == [0, 1, 2]
    for a, b in zip(got[0]["histories"], got[1]["histories"]):
        torch.testing.assert_close(a[:, 1:], b[:, 1:])  # the reduced steps agree; the newest is still local
        assert (a[:, 1:3] > 0).all()
    for a, b in zip(got[0]["scales"], got[1]["scales"]):
        torch.testing.assert_close(a, b)  # so the scales the last step cast with agree
