"""Shared test setup: GPU tests skip without CUDA; every test runs on its own plan-cache directory.

No test reads or writes the user's real plan cache (platformdirs' user cache dir, or the
$CUDNN_FUSE_CACHE_DIR the suite was started with): ``isolated_cache`` points
$CUDNN_FUSE_CACHE_DIR, and the user cache dir of subprocesses, at a temporary directory per
test, and drops the process-wide default caches around each test. ``ORIGINAL_CACHE_DIR`` is
the directory the suite must leave alone (tests/test_cache_isolation.py checks it).
"""

import logging
import os
import shutil
import sys
import tempfile

import platformdirs
import pytest
import torch

# Read at import, before anything below changes the environment.
ORIGINAL_CACHE_DIR = os.environ.get("CUDNN_FUSE_CACHE_DIR") or platformdirs.user_cache_dir("cudnn_fuse")
_VARIABLES = ("CUDNN_FUSE_CACHE_DIR", "XDG_CACHE_HOME", "HOME")
_original_env = {name: os.environ.get(name) for name in _VARIABLES}
_session_root = None


def _point_caches_at(root: str, setenv) -> str:
    """Set $CUDNN_FUSE_CACHE_DIR and the user cache dir to folders under ``root``; returns the
    plan-cache folder (not created: a test may want to see the library create it)."""
    xdg = os.path.join(root, "xdg_cache")
    setenv("XDG_CACHE_HOME", xdg)  # platformdirs' user cache dir on Linux, also in subprocesses
    if sys.platform == "darwin":  # ~/Library/Caches there; a HOME of our own moves it
        setenv("HOME", os.path.join(root, "home"))
    plan_cache = os.path.join(root, "cudnn_fuse_cache")
    setenv("CUDNN_FUSE_CACHE_DIR", plan_cache)
    return plan_cache


def pytest_configure(config):
    # The library logs and never prints. With no handler on its logger, logging's last-resort
    # handler would write warnings (e.g. "no CUDA GPU") to stderr outside pytest's capture.
    # A NullHandler stops that; records still propagate to the root logger, so caplog and
    # pytest's failure reports still see them.
    logging.getLogger("cudnn_fuse").addHandler(logging.NullHandler())
    # Collection (test modules' imports) and anything outside a test get a cache of the
    # whole run's own; each test then gets its own (isolated_cache).
    global _session_root
    _session_root = tempfile.mkdtemp(prefix="cudnn_fuse_tests_")
    _point_caches_at(_session_root, os.environ.__setitem__)


def pytest_unconfigure(config):
    for name, value in _original_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if _session_root is not None:
        shutil.rmtree(_session_root, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def _drop_default_caches() -> None:
    """Close and forget the process-wide default caches (cache.open_default_cache): one opened
    by an earlier test holds that test's directory."""
    from cudnn_fuse import cache as cache_module

    with cache_module._default_lock:
        opened = [c for c in cache_module._defaults.values() if c is not None]
        cache_module._defaults.clear()
    for c in opened:
        c.close()


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path_factory, monkeypatch):
    """Every test: $CUDNN_FUSE_CACHE_DIR (and the user cache dir, for subprocesses) in a fresh
    temporary directory, and no default cache carried over from another test. Returns the
    plan-cache directory, which does not exist yet (``cache_dir`` gives one that does)."""
    from cudnn_fuse import build_process, loader

    plan_cache = _point_caches_at(str(tmp_path_factory.mktemp("cache_home")), monkeypatch.setenv)
    monkeypatch.setenv("CUDNN_FUSE_BUILD_PROCESS", "0")  # new sizes build in the test's process unless it asks
    _drop_default_caches()
    loader._KNOWN_FAMILIES.clear()  # the shape families an earlier test's plans made known
    yield plan_cache
    if build_process._default is not None:  # a test's build process ends with it
        build_process._default.close()
        build_process._default = None
    _drop_default_caches()


@pytest.fixture
def original_cache_dir() -> str:
    """The plan-cache directory of the environment the suite was started in: the user's."""
    return ORIGINAL_CACHE_DIR


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh, empty plan-cache directory (mode 0700), set as $CUDNN_FUSE_CACHE_DIR."""
    path = tmp_path / "cudnn_fuse_cache"
    path.mkdir(mode=0o700)
    monkeypatch.setenv("CUDNN_FUSE_CACHE_DIR", str(path))
    return path


@pytest.fixture
def strict_fp32():
    """fp32 means fp32: TF32 off in torch for the test (cf follows torch's switches), restored after."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
