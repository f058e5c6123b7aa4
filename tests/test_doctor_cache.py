"""`cudnn-fuse doctor` reports the plan cache and exits 1 when it is unusable."""

from __future__ import annotations

import os

import pytest

from cudnn_fuse import cli, env


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


def test_doctor_reports_a_corrupt_database_it_moved_aside(cache_dir, capsys):
    """Opening the cache moves a corrupt cache.db aside (its entries lost) and logs a warning; the
    doctor said "problems: none" and exited 0."""
    from cudnn_fuse import env
    from cudnn_fuse.cache import PlanCache

    PlanCache(cache_dir).close()
    (cache_dir / env.namespace() / "cache.db").write_bytes(b"not a database " * 500)
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "corrupt" in out.split("problems:")[1]
    assert cli.main(["doctor"]) == 0  # the fresh one is healthy


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b""], ids=["not-json", "a-list", "empty"])
def test_doctor_reports_a_damaged_fingerprint(cache_dir, capsys, content):
    """A fingerprint.json that is no fingerprint passed the doctor ("problems: none", exit 0)."""
    from cudnn_fuse.cache import PlanCache

    PlanCache(cache_dir).close()
    (cache_dir / env.namespace() / "fingerprint.json").write_bytes(content)
    assert cli.main(["doctor"]) == 1
    problems = capsys.readouterr().out.split("problems:")[1]
    assert "fingerprint.json" in problems and "cudnn-fuse cache verify" in problems
    assert cli.main(["cache", "verify"]) == 1  # rewrites it
    capsys.readouterr()
    assert cli.main(["doctor"]) == 0
