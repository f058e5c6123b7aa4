"""`cudnn-fuse autotune` on the CPU: argument parsing, errors, the no-GPU answer, the bar."""

from __future__ import annotations

import argparse

import pytest
import torch

from cudnn_fuse import cli
from cudnn_fuse.cli_autotune import shape


def test_shape_parses_and_rejects():
    assert shape("64x128x56x56") == (64, 128, 56, 56)
    assert shape("8192X4096") == (8192, 4096)
    for bad in ("64x", "axb", "0x3", "-1x4", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="shape|sizes"):
            shape(bad)


def test_bad_shape_is_a_usage_error(capsys):
    assert cli.main(["autotune", "--op", "conv2d", "--input", "64xQ"]) == 2
    assert "64xQ" in capsys.readouterr().err


def test_unknown_op_is_a_usage_error(capsys):
    assert cli.main(["autotune", "--op", "conv3d", "--input", "1x1"]) == 2
    assert "conv3d" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_without_gpu_says_so_and_exits_2(capsys):
    rc = cli.main(["autotune", "--op", "conv2d", "--input", "8x16x8x8", "--weight", "16x16x3x3", "--activation", "relu"])
    assert rc == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def _meta(use_torch, runoff):
    from cudnn_fuse import autotune

    def cand(index, name, ms, r=None):
        return {"index": index, "name": name, "knobs": {"k24": 41} if index >= 0 else {}, "median_ms": ms,
                "workspace": 0, "status": "timed", "runoff_ms": r}

    return {"winner_index": 3, "engine_name": "eng7_k24=41", "use_torch": use_torch,
            "candidates": [cand(3, "eng7", 3.86, runoff[0]), cand(5, "eng0", 4.10),
                           cand(autotune.TORCH_INDEX, "torch", 3.90, runoff[1])]}


def test_the_candidate_report_stars_the_choice_and_shows_a_runoff():
    from cudnn_fuse.cli_autotune import candidate_report

    text = candidate_report(_meta(True, (3.88, 3.64)), 2 * 16384 * 4096 * 16384)
    lines = text.splitlines()
    starred = [ln for ln in lines if ln.lstrip().startswith("*")]
    assert len(starred) == 1 and "torch" in starred[0]  # torch won the runoff though its median read slower
    assert "runoff" in text and "cuDNN winner 3.8800 ms, torch 3.6400 ms" in text
    assert "winner torch (cuBLAS + epilogue)" in text
    assert [ln for ln in lines if "eng7" in ln and "3.8600" in ln]  # medians as timed, fastest first
    assert text.index("3.8600") < text.index("3.9000") < text.index("4.1000")
    plain = candidate_report(_meta(False, (None, None)), 1.0)  # no runoff: no runoff line, cuDNN starred
    assert "runoff" not in plain and "winner eng7_k24=41" in plain
    assert [ln for ln in plain.splitlines() if ln.lstrip().startswith("*")][0].split()[1] == "3"


@pytest.mark.parametrize("argv, said", [
    (["--op", "conv2d", "--input", "8x16x8x8", "--weight", "16x16x3x3", "--activation", "swish"], "activation"),
    (["--op", "conv2d", "--input", "8x16x8x8", "--weight", "16x8x3x3"], "channel mismatch"),
    (["--op", "conv2d", "--input", "8x16x8x8", "--weight", "16x16x3x3", "--stride", "0", "--residual"], "stride"),
    (["--op", "linear", "--input", "64x32", "--weight", "16x64", "--residual"], "in_features"),
    (["--op", "linear", "--input", "64x32"], "--weight is required"),
    (["--op", "sdpa", "--input", "64"], "scaled_dot_product_attention"),
    (["--op", "conv2d", "--input", "1000000000000x1000000000000", "--weight", "3x3x3x3"], "argument --input"),
    (["--op", "conv2d", "--input", "8x16x8x8", "--weight", "16x16x3x3", "--budget-s", "nan"], "argument --budget-s"),
    # options the op does not take were dropped without a word, and another graph tuned and stored
    (["--op", "conv2d", "--input", "8x16x8x8", "--weight", "16x16x3x3", "--causal"], "--causal not taken by --op conv2d"),
    (["--op", "sdpa", "--input", "2x4x16x64", "--activation", "relu", "--bias"], "--activation, --bias not taken"),
    (["--op", "linear", "--input", "64x32", "--weight", "16x32", "--stride", "2"], "--stride not taken by --op linear"),
])
def test_bad_arguments_are_named_on_any_machine(capsys, argv, said):
    """Checked before the GPU is looked for (on the meta device: nothing allocated): without a GPU
    they said "needs a CUDA GPU"; with one, a size past memory or int64, or --residual beside a bad
    stride, raised a traceback."""
    assert cli.main(["autotune", *argv]) == 2
    assert said in capsys.readouterr().err


def test_the_residual_takes_the_ops_own_output_shape():
    """GPU-only path, run on the meta device. A residual for a b with batch dims broadcast over a
    was made [64, 16], a's rows by b's columns, and cf refused it (a valid request that exited 2)."""
    import cudnn_fuse
    from cudnn_fuse.cli_autotune import _inputs

    args = argparse.Namespace(op="matmul", input=(64, 32), weight=(8, 32, 16), dtype="bf16", activation="relu",
                              bias=True, residual=True, amax=True, stride=1, padding=0, dilation=1, groups=1,
                              nchw=False, causal=False)
    y, amax = _inputs(args, "meta")(cudnn_fuse)
    assert y.shape == (8, 64, 16) and amax.shape == ()
    # an unbatched (3-D) conv input: x.to(channels_last) raised RuntimeError (a traceback on the GPU)
    args = argparse.Namespace(**{**vars(args), "op": "conv2d", "input": (16, 8, 8), "weight": (16, 16, 3, 3)})
    y, amax = _inputs(args, "meta")(cudnn_fuse)
    assert y.shape == (16, 6, 6)


def test_an_op_past_gpu_memory_is_no_traceback(capsys, monkeypatch):
    """GPU-only path, on the CPU: the inputs' allocation is made to fail as it does on a GPU."""
    from cudnn_fuse import cli_autotune

    checked = cli_autotune._inputs

    def inputs(args, device="cuda"):
        if device == "cuda":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.45 TiB")
        return checked(args, device)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli_autotune, "_inputs", inputs)
    assert cli.main(["autotune", "--op", "linear", "--input", "1000000x1000000", "--weight", "1000000x1000000"]) == 1
    assert "does not fit in GPU memory" in capsys.readouterr().err
