"""Shared test setup: GPU tests skip without CUDA; each cache test gets its own directory."""

import logging

import pytest
import torch


def pytest_configure(config):
    # The library logs and never prints. With no handler on its logger, logging's last-resort
    # handler would write warnings (e.g. "no CUDA GPU") to stderr outside pytest's capture.
    # A NullHandler stops that; records still propagate to the root logger, so caplog and
    # pytest's failure reports still see them.
    logging.getLogger("cudnn_fuse").addHandler(logging.NullHandler())


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


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
