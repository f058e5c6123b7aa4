"""CPU tests of cudnn_fuse.triton_gemm's gates (CUDNN_FUSE_MLP_KERNELS=triton): the launch
configuration from the environment, declines before Triton is imported, the compile key, a failed
build logged once. Triton is not needed (nor installed in CI); the kernels run in
tests/test_gpu_triton_gemm.py."""

from __future__ import annotations

import logging

import pytest
import torch

from cudnn_fuse import triton_gemm
from tests.grad_check import env_setting


@pytest.mark.parametrize("raw,expect", [
    ("64,128,32,4,3,4", (64, 128, 32, 4, 3, 4)),
    ("", triton_gemm.FWD_CONFIG),
    ("64,128,32", None),          # too few
    ("64,100,32,4,3,4", None),    # a tile not a power of two
    ("8,128,32,4,3,4", None),     # a tile under 16
    ("64,128,32,4,3,6", None),    # warps not a power of two
    ("a,b,c,d,e,f", None)])
def test_launch_configuration_from_the_environment(monkeypatch, caplog, raw, expect):
    monkeypatch.setenv("CUDNN_FUSE_TEST_TGEMM", raw)
    default = (128, 256, 64, 8, 3, 8)
    with caplog.at_level(logging.WARNING, logger="cudnn_fuse.triton_gemm"):
        got = triton_gemm._parse_config("CUDNN_FUSE_TEST_TGEMM", default)
    if expect is None:
        assert got == default
        assert any("CUDNN_FUSE_TEST_TGEMM" in r.getMessage() and "ignored" in r.getMessage() for r in caplog.records)
    else:
        assert got == (expect if raw else default)
        assert not caplog.records


def test_the_environment_sets_the_configurations_at_import():
    code = "from cudnn_fuse import triton_gemm; print(triton_gemm.FWD_CONFIG, triton_gemm.BWD_CONFIG)"
    out = env_setting(code, "CUDNN_FUSE_TRITON_GEMM_FWD", "64,64,32,4,2,4")
    assert out.startswith("(64, 64, 32, 4, 2, 4) ")


def test_declines_before_building_anything(monkeypatch):
    monkeypatch.setattr(triton_gemm, "_kernels", None)
    monkeypatch.setattr(triton_gemm, "_build", lambda: pytest.fail("Triton was asked for"))
    x, w, b = torch.randn(16, 32, dtype=torch.bfloat16), torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    before = triton_gemm.stats["declined"]
    assert not triton_gemm.usable("gelu", x, w, b)  # the CPU
    assert triton_gemm.linear_act(x, w, b, "gelu") is None
    assert triton_gemm.matmul_act_grad(x, w.t(), torch.randn(16, 64, dtype=torch.bfloat16), "gelu", True) is None
    assert not triton_gemm.usable("relu", x, w, b)  # not an activation of ACTS: declined, not counted
    assert triton_gemm.stats["declined"] - before == 3
    assert triton_gemm._kernels is None


def test_a_failed_build_is_logged_once_and_declines(monkeypatch, caplog):
    monkeypatch.setattr(triton_gemm, "_kernels", None)

    def broken():
        raise ImportError("no module named triton")
    monkeypatch.setattr(triton_gemm, "_build", broken)
    with caplog.at_level(logging.WARNING, logger="cudnn_fuse.triton_gemm"):
        assert triton_gemm._get() is None
        assert triton_gemm._get() is None
    assert triton_gemm._kernels is False
    assert sum("Triton unusable" in r.getMessage() for r in caplog.records) == 1


def test_the_compile_key_follows_what_triton_specializes_on():
    a = torch.empty(64, 32, dtype=torch.bfloat16)
    k0 = triton_gemm._key("f", "gelu", (1,), False, (a,), (64, 32, 1))
    assert k0 == triton_gemm._key("f", "gelu", (1,), False, (a,), (128, 48, 1))  # still multiples of 16, a 1
    assert k0 != triton_gemm._key("f", "gelu", (1,), False, (a,), (64, 33, 1))  # 33 is not a multiple of 16
    assert k0 != triton_gemm._key("f", "gelu", (1,), False, (a,), (64, 32, 2))  # 1 is specialized
    assert k0 != triton_gemm._key("f", "gelu", (1,), False, (a.half(),), (64, 32, 1))
    assert k0 != triton_gemm._key("f", "silu", (1,), False, (a,), (64, 32, 1))
    off = a.view(-1)[1:]  # a pointer 2 bytes past a 16-byte boundary
    assert k0 != triton_gemm._key("f", "gelu", (1,), False, (off,), (64, 32, 1))
    assert triton_gemm._grid(300, 130, (128, 64, 32, 8, 3, 4)) == (3 * 3,)
