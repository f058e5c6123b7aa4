"""cudnn_fuse.cutlass_mlp on the CPU: what it declines and how it loads (the kernels are GPU-tested in
tests/test_gpu_cutlass_mlp.py)."""

import logging

import pytest
import torch

from cudnn_fuse import backward, cutlass_mlp, torch_ops


@pytest.fixture
def fresh_loader(monkeypatch):
    monkeypatch.setattr(cutlass_mlp, "_lib", None)
    monkeypatch.setattr(cutlass_mlp, "_lib_tried", False)
    monkeypatch.setattr(cutlass_mlp, "_warned", set())
    yield


def test_missing_library_is_one_warning_and_none(fresh_loader, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CUDNN_FUSE_CUTLASS_LIB", str(tmp_path / "nope.so"))
    with caplog.at_level(logging.WARNING, logger="cudnn_fuse.cutlass_mlp"):
        assert not cutlass_mlp.available()
        assert not cutlass_mlp.available()
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
    assert "nope.so" in caplog.text
    x, w, b = torch.randn(8, 8), torch.randn(8, 8), torch.randn(8)
    assert cutlass_mlp.linear_gelu_aux(x, w, b) is None
    assert cutlass_mlp.dgelu(x, w, x) is None


def test_library_path_follows_the_environment(monkeypatch):
    monkeypatch.delenv("CUDNN_FUSE_CUTLASS_LIB", raising=False)
    assert cutlass_mlp.library_path().endswith("cudnn_fuse/_cutlass_mlp.so")
    monkeypatch.setenv("CUDNN_FUSE_CUTLASS_LIB", "/x/y.so")
    assert cutlass_mlp.library_path() == "/x/y.so"


class _FakeLib:
    """Stands in for the shared library: records calls, never launches."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        raise AttributeError(name)


def test_declines_before_touching_the_library(fresh_loader, monkeypatch):
    lib = _FakeLib()
    monkeypatch.setattr(cutlass_mlp, "_lib", lib)
    monkeypatch.setattr(cutlass_mlp, "_lib_tried", True)
    bf = torch.bfloat16
    x, w, b = torch.randn(16, 32, dtype=bf), torch.randn(24, 32, dtype=bf), torch.randn(24, dtype=bf)
    assert cutlass_mlp.linear_gelu_aux(x, w, b) is None  # CPU tensors
    assert cutlass_mlp.linear_gelu_aux(x, w, None) is None  # no bias
    assert cutlass_mlp.linear_gelu_aux(x, w[:, :16], b) is None  # K mismatch
    assert cutlass_mlp.linear_gelu_aux(x, w, b[:8]) is None  # bias shape
    assert cutlass_mlp.dgelu(torch.randn(16, 24, dtype=bf), torch.randn(24, 40, dtype=bf),
                             torch.randn(16, 40, dtype=bf)) is None  # CPU
    assert cutlass_mlp.dgelu(torch.randn(16, 24, dtype=bf), torch.randn(24, 40, dtype=bf),
                             torch.randn(16, 32, dtype=bf)) is None  # z's width
    assert not cutlass_mlp.usable(x, w)  # CPU: not usable whatever the dtype
    assert not cutlass_mlp.usable(None)


def test_config_env_is_bounded(monkeypatch, caplog):
    from cudnn_fuse import envvars

    with caplog.at_level(logging.WARNING):
        assert envvars.parse("CUDNN_FUSE_CUTLASS_BWD_CONFIG", "192", 0, integer=True,
                             maximum=cutlass_mlp.MAX_CONFIG) == 0
    assert "CUDNN_FUSE_CUTLASS_BWD_CONFIG" in caplog.text
    assert envvars.parse("CUDNN_FUSE_CUTLASS_FWD_CONFIG", "-1", 0, integer=True, minimum=-1,
                         maximum=cutlass_mlp.MAX_CONFIG) == -1


def test_forward_left_to_torch_and_unknown_tiles_decline(fresh_loader, monkeypatch):
    """FWD_CONFIG -1 (and any tile number the library does not have) declines before any launch."""
    monkeypatch.setattr(cutlass_mlp, "_lib", _FakeLib())  # any attribute access would raise
    monkeypatch.setattr(cutlass_mlp, "_lib_tried", True)
    x, w, b = torch.randn(8, 8), torch.randn(8, 8), torch.randn(8)
    monkeypatch.setattr(cutlass_mlp, "FWD_CONFIG", -1)
    assert cutlass_mlp.linear_gelu_aux(x, w, b) is None
    monkeypatch.setattr(cutlass_mlp, "FWD_CONFIG", 7)  # tile 7: not built
    assert cutlass_mlp.linear_gelu_aux(x, w, b) is None
    monkeypatch.setattr(cutlass_mlp, "BWD_CONFIG", 16 + 6)
    assert cutlass_mlp.dgelu(x, w, x) is None


def test_fused_mlp_on_cpu_with_the_cutlass_mode_matches_eager(monkeypatch):
    """The mode names CUDA kernels: on the CPU the node runs the reference, gradients equal eager's."""
    monkeypatch.setattr(backward, "MLP", "cutlass")
    called = []
    monkeypatch.setattr(cutlass_mlp, "linear_gelu_aux", lambda *a: called.append("fwd"))
    monkeypatch.setattr(cutlass_mlp, "dgelu", lambda *a: called.append("bwd"))
    torch.manual_seed(0)
    x = torch.randn(6, 16, requires_grad=True)
    w1, b1 = torch.randn(32, 16, requires_grad=True), torch.randn(32, requires_grad=True)
    w2, b2 = torch.randn(16, 32, requires_grad=True), torch.randn(16, requires_grad=True)
    out = torch_ops.mlp(x, w1, b1, w2, b2, "gelu", None, 0.01)
    ref = torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(x, w1, b1)), w2, b2)
    torch.testing.assert_close(out, ref)
    g = torch.autograd.grad(out.square().sum(), (x, w1, b1, w2, b2))
    gr = torch.autograd.grad(ref.square().sum(), (x, w1, b1, w2, b2))
    for a, b in zip(g, gr):
        torch.testing.assert_close(a, b)
    assert called == []  # the CUDA kernels are never asked for CPU tensors
