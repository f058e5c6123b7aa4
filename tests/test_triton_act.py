"""cudnn_fuse.triton_act on the CPU: what it declines, its fallback when Triton cannot be used, its
launch geometry, and nn.FusedMLP's wiring of the fused dz + db1 pass (the kernels themselves run in
tests/test_gpu_triton_act.py)."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from cudnn_fuse import backward, torch_ops, triton_act
from tests.grad_check import env_setting
from tests.test_backward import _mlp_inputs, _mlp_ref, compare


def test_mode_defaults_to_torch_and_the_env_picks_triton():
    code = "from cudnn_fuse import triton_act; print(triton_act.MODE)"
    assert env_setting(code, "CUDNN_FUSE_MLP_ELEMENTWISE") == "torch"
    assert env_setting(code, "CUDNN_FUSE_MLP_ELEMENTWISE", " Triton ") == "triton"


def test_torch_mode_takes_nothing(monkeypatch):
    monkeypatch.setattr(triton_act, "MODE", "torch")
    z = torch.randn(4, 8, dtype=torch.bfloat16)
    assert not triton_act.usable("gelu", z)
    assert triton_act.act_forward(z, "gelu") is None
    assert triton_act.act_grad_dbias(z, z, "gelu", True) is None


@pytest.mark.parametrize("why, tensors, act", [
    ("cpu", lambda: (torch.randn(4, 8, dtype=torch.bfloat16),), "gelu"),
    ("activation", lambda: (torch.randn(4, 8, dtype=torch.bfloat16),), "relu"),
    ("no activation", lambda: (torch.randn(4, 8, dtype=torch.bfloat16),), None),
])
def test_declines_before_touching_triton(monkeypatch, why, tensors, act):
    """Declined calls never import Triton: a stand-in that fails the test if it is asked."""
    monkeypatch.setattr(triton_act, "MODE", "triton")
    monkeypatch.setattr(triton_act, "_get", lambda: pytest.fail(f"{why}: Triton asked for a declined call"))
    assert not triton_act.usable(act, *tensors())


class _FakeCuda:
    """A tensor-like that claims to be on CUDA, for the checks that come before any kernel."""

    def __init__(self, shape=(4, 8), dtype=torch.bfloat16, contiguous=True, device="cuda:0"):
        self.shape, self.dtype, self._c, self.device = torch.Size(shape), dtype, contiguous, device
        self.is_cuda = True

    def numel(self):
        return self.shape.numel()

    def is_contiguous(self):
        return self._c


@pytest.mark.parametrize("tensors, ok", [
    ((_FakeCuda(),), True),
    ((_FakeCuda(), _FakeCuda()), True),
    ((_FakeCuda(dtype=torch.float32),), False),
    ((_FakeCuda(shape=(0, 8)),), False),
    ((_FakeCuda(), _FakeCuda(shape=(8, 4))), False),
    ((_FakeCuda(), _FakeCuda(dtype=torch.float16)), False),
    ((_FakeCuda(), _FakeCuda(contiguous=False)), False),
    ((_FakeCuda(), _FakeCuda(device="cuda:1")), False),
])
def test_operand_checks(monkeypatch, tensors, ok):
    monkeypatch.setattr(triton_act, "MODE", "triton")
    monkeypatch.setattr(triton_act, "_get", lambda: ("fwd", "bwd"))
    before = triton_act.stats["declined"]
    assert triton_act.usable("gelu", *tensors) is ok
    assert triton_act.stats["declined"] == before + (not ok)


def test_missing_triton_logs_once_and_declines(monkeypatch, caplog):
    """No Triton (this CPU build has none): one warning, then every call declines quietly."""
    monkeypatch.setattr(triton_act, "MODE", "triton")
    monkeypatch.setattr(triton_act, "_kernels", None)
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    with caplog.at_level(logging.WARNING, logger="cudnn_fuse.triton_act"):
        assert not triton_act.usable("gelu", _FakeCuda())
        assert not triton_act.usable("silu", _FakeCuda(), _FakeCuda())
    warnings = [r for r in caplog.records if "Triton unusable" in r.getMessage()]
    assert len(warnings) == 1 and "CUDNN_FUSE_MLP_ELEMENTWISE" in warnings[0].getMessage()
    assert triton_act._kernels is False


def test_a_failing_kernel_turns_triton_off(monkeypatch, caplog):
    monkeypatch.setattr(triton_act, "MODE", "triton")

    def boom(*a, **k):
        raise RuntimeError("launch failed")

    class Launcher:
        def __getitem__(self, grid):
            return boom

    monkeypatch.setattr(triton_act, "_kernels", (Launcher(), Launcher()))
    monkeypatch.setattr(triton_act, "usable", lambda act, *t: True)
    z = torch.randn(4, 8)
    monkeypatch.setattr(torch.cuda, "device", lambda d: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with caplog.at_level(logging.WARNING, logger="cudnn_fuse.triton_act"):
        assert triton_act.act_forward(z, "gelu") is None
    assert triton_act._kernels is False
    assert any("launch failed" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("m, col_blocks, bm, sms", [(8192, 32, 16, 132), (8192, 8, 16, 132), (5, 32, 16, 132),
                                                    (100000, 1, 8, 132), (17, 1, 16, 4), (8192, 1000, 16, 132)])
def test_rows_per_program_cover_every_row_in_bm_multiples(m, col_blocks, bm, sms):
    rows = triton_act._rows_per_prog(m, col_blocks, bm, sms)
    chunks = -(-m // rows)
    assert rows % bm == 0 and rows >= bm
    assert chunks * rows >= m > (chunks - 1) * rows  # every row in exactly one chunk, no empty chunk
    assert chunks * col_blocks <= max(4 * sms, col_blocks)  # about four programs per SM at most


def test_activation_constants_are_atens():
    """kBeta of aten's GELU backward (exact) and of its tanh form, as float32."""
    import math
    assert triton_act._GELU_BETA == pytest.approx(0.3989422804014327, rel=1e-7)  # 1/sqrt(2 pi)
    assert triton_act._TANH_BETA == pytest.approx(math.sqrt(2 / math.pi), rel=1e-7)
    assert set(triton_act.ACTS) <= set(torch_ops._NATIVE_ACT_GRAD)


@pytest.mark.parametrize("act", ["gelu", "silu"])
@pytest.mark.parametrize("need_db1", [True, False])
def test_fused_mlp_takes_dz_and_db1_from_one_pass(monkeypatch, act, need_db1):
    """With the elementwise mode on, nn.FusedMLP's torch node takes dz and db1 from
    act_grad_dbias (stood in by a torch computation that records its calls), asks the linear
    products for no bias sum, and its gradients are still autograd's."""
    monkeypatch.setattr(backward, "MLP", "torch")
    monkeypatch.setattr(triton_act, "MODE", "triton")
    calls = []

    def fake(dy, z, a, need_db):
        calls.append((tuple(dy.shape), a, need_db))
        dz = torch_ops._NATIVE_ACT_GRAD[a](dy, z, 0.01)
        return dz, (dz.reshape(-1, dz.shape[-1]).sum(0) if need_db else None)

    monkeypatch.setattr(triton_act, "act_grad_dbias", fake)
    x, w1, b1, w2, b2, _ = _mlp_inputs(bias=need_db1)
    inputs = (x, w1, b1, w2, b2) if need_db1 else (x, w1, w2)
    fn = (lambda *t: torch_ops.mlp(*t, act, None, 0.01)) if need_db1 else \
        (lambda x, w1, w2: torch_ops.mlp(x, w1, None, w2, None, act, None, 0.01))
    ref = _mlp_ref(act)
    compare(fn, ref if need_db1 else (lambda x, w1, w2: ref(x, w1, None, w2, None)), inputs)
    assert calls and all(c[1] == act and c[2] is need_db1 for c in calls)


def test_fused_mlp_falls_back_when_the_pass_declines(monkeypatch):
    monkeypatch.setattr(backward, "MLP", "torch")
    monkeypatch.setattr(triton_act, "MODE", "triton")
    monkeypatch.setattr(triton_act, "act_grad_dbias", lambda *a: None)
    x, w1, b1, w2, b2, _ = _mlp_inputs()
    compare(lambda *t: torch_ops.mlp(*t, "gelu", None, 0.01), _mlp_ref("gelu"), (x, w1, b1, w2, b2))


def test_capture_declines_a_specialization_not_compiled_yet(monkeypatch):
    """Under CUDA graph capture only kernels already compiled (and launched) may run: Triton would
    otherwise compile and load a module inside the capture."""
    monkeypatch.setattr(triton_act, "_launched", set())
    z = torch.randn(32, 48)
    key = triton_act._specialization("forward", "gelu", (z,), (z.numel(),), (2048, 8))
    assert key == triton_act._specialization("forward", "gelu", (torch.randn(32, 48),), (1536,), (2048, 8))
    assert key != triton_act._specialization("forward", "gelu", (z,), (1537,), (2048, 8))
    assert key != triton_act._specialization("forward", "gelu", (z[:, 1:],), (1536,), (2048, 8))  # 4-byte offset
    assert key != triton_act._specialization("forward", "silu", (z,), (1536,), (2048, 8))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    before = triton_act.stats["declined"]
    assert not triton_act._may_launch(key)
    assert triton_act.stats["declined"] == before + 1
    triton_act._launched.add(key)
    assert triton_act._may_launch(key)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert triton_act._may_launch(("anything",))


@pytest.mark.parametrize("raw, expect", [("", None), ("32,256,8,1000000,1", (32, 256, 8, 1000000, 1)),
                                         ("32,256,8", None), ("24,256,8,4,1", None), ("16,256,0,4,1", None),
                                         ("a,b", None)])
def test_backward_config_from_the_environment(monkeypatch, caplog, raw, expect):
    default = (16, 256, 8, 8, 1)
    monkeypatch.setenv("CUDNN_FUSE_MLP_ELEMENTWISE_CONFIG", raw)
    with caplog.at_level(logging.WARNING, logger="cudnn_fuse.triton_act"):
        got = triton_act._env_config("CUDNN_FUSE_MLP_ELEMENTWISE_CONFIG", default)
    assert got == (expect or default)
    assert any("ignored" in r.getMessage() for r in caplog.records) is (raw != "" and expect is None)
