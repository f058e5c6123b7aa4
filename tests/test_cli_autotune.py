"""`cudnn-fuse autotune` on the CPU: argument parsing, errors, the no-GPU answer, the bar."""

from __future__ import annotations

import argparse
import io

import pytest
import torch

from cudnn_fuse import cli
from cudnn_fuse.cli_autotune import Bar, shape


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


def test_bar_shows_counts_percent_and_eta():
    out = io.StringIO()
    bar = Bar("tuning conv2d", stream=out)
    bar(0, 4)
    bar(2, 4)
    bar(4, 4)
    text = out.getvalue()
    assert "0/4" in text and "2/4" in text and "4/4 100%" in text
    assert "eta" in text and text.endswith("\n")
