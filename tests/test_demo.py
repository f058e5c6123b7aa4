"""`cudnn-fuse demo` on the CPU: both models run through optimize() and match eager."""

from __future__ import annotations

import re

import torch

from cudnn_fuse import cli, demo


def test_demo_models_match_eager_and_restore_the_cache_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDNN_FUSE_CACHE_DIR", str(tmp_path))
    rows, notes = demo.run(torch.cuda.is_available())
    assert [r[0] for r in rows] == ["resnet-style CNN", "transformer block"]
    for r in rows:
        assert float(r[-1]) < 1e-3  # rel err against eager
        assert float(r[2]) > 0 and float(r[3]) > 0
    assert int(rows[0][5]) == 4  # the CNN's fused convs were recorded (stem + 3 distinct bottleneck convs)
    assert str(tmp_path) == __import__("os").environ["CUDNN_FUSE_CACHE_DIR"]
    if not torch.cuda.is_available():
        assert notes and "no GPU" in notes[0]


def test_demo_command_prints_both_tables(capsys):
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "models through cf.optimize()" in out
    assert re.search(r"resnet-style CNN\s+\S+ \S+\s+[\d.]+\s+[\d.]+", out)
    assert "transformer block" in out
