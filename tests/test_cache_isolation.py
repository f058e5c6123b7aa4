"""The suite never touches the user's plan cache: conftest.isolated_cache gives every test, and the
subprocesses it starts, a cache directory of its own (before, the doctor tests made namespaces in
the user's cache that `cudnn-fuse cache stats` then listed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import platformdirs

from cudnn_fuse import cli, env
from cudnn_fuse.cache import default_cache_dir, list_namespaces


def _listing(root) -> dict | None:
    """Every file and folder under ``root`` with its size and modification time; None if absent."""
    root = Path(root)
    if not root.exists():
        return None
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            with_stat = path.lstat()
            out[str(path.relative_to(root))] = (with_stat.st_size, with_stat.st_mtime_ns)
    return out


def test_each_test_has_a_cache_dir_of_its_own(isolated_cache, original_cache_dir):
    assert default_cache_dir() == Path(isolated_cache)
    assert Path(isolated_cache).resolve() != Path(original_cache_dir).resolve()
    # a subprocess that drops $CUDNN_FUSE_CACHE_DIR falls back to the user cache dir: a temporary one too
    user_dir = Path(platformdirs.user_cache_dir("cudnn_fuse"))
    assert Path(isolated_cache).parent in user_dir.parents


def test_cli_runs_leave_the_user_cache_alone(isolated_cache, original_cache_dir, monkeypatch, capsys):
    before = _listing(original_cache_dir)
    fp = {**env.fingerprint(), "gpu_name": "NVIDIA isolation-test GPU", "compute_capability": "9.0"}
    monkeypatch.setattr(env, "fingerprint", lambda device=None: dict(fp))
    cli.main(["doctor"])  # opens (and makes) the namespace of a GPU this machine has not got
    cli.main(["cache", "stats"])
    capsys.readouterr()
    no_variable = {k: v for k, v in os.environ.items() if k != "CUDNN_FUSE_CACHE_DIR"}
    done = subprocess.run([sys.executable, "-m", "cudnn_fuse", "doctor"], env=no_variable,
                          capture_output=True, text=True, timeout=300)
    assert "cache dir" in done.stdout, done.stderr
    assert _listing(original_cache_dir) == before
    # they did write, into the test's own directories
    assert env.namespace(fp) in list_namespaces(isolated_cache)
    assert list_namespaces(platformdirs.user_cache_dir("cudnn_fuse"))
