"""`cudnn-fuse doctor` reports the plan cache and exits 1 when it is unusable."""

from __future__ import annotations

import os

from cudnn_fuse import cli


def test_doctor_reports_a_healthy_cache(cache_dir, capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "cache entries" in out and "0 (0 pinned)" in out
    assert "read-write, permissions 0o700" in out


def test_doctor_flags_a_world_writable_cache(cache_dir, capsys):
    os.chmod(cache_dir, 0o777)
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "plan cache unusable" in out and "world-writable" in out
