"""CPU tests of cudnn_fuse.cublaslt's gates and of how the backward paths use it (the GEMM itself
runs in tests/test_gpu_cublaslt.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from cudnn_fuse import backward, cublaslt, torch_ops


def test_declines_on_the_cpu_and_for_float32():
    dz, x = torch.randn(64, 80, dtype=torch.bfloat16), torch.randn(64, 96, dtype=torch.bfloat16)
    assert not cublaslt.usable(dz, x)
    assert cublaslt.wgrad_bgrad(dz, x) is None
    assert cublaslt.wgrad_bgrad(dz.float(), x.float()) is None


def test_a_missing_library_is_logged_once_and_declines(monkeypatch, caplog):
    monkeypatch.setattr(cublaslt, "_SONAMES", ("libcudnn_fuse_no_such_cublaslt.so.99",))
    monkeypatch.setattr(cublaslt, "_lib", None)
    monkeypatch.setattr(cublaslt, "_lib_state", "unloaded")
    with caplog.at_level(logging.INFO, logger="cudnn_fuse.cublaslt"):
        assert cublaslt._load() is None
        assert cublaslt._load() is None
    assert cublaslt._lib_state == "missing"
    assert sum("cuBLASLt not found" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("mode,need_w,need_b,expect_call", [
    ("cublaslt", True, True, True), ("torch", True, True, False),
    ("cublaslt", True, False, False), ("cublaslt", False, True, False)])
def test_wgrad_asks_cublaslt_only_for_both_gradients(monkeypatch, mode, need_w, need_b, expect_call):
    calls = []
    monkeypatch.setattr(backward, "WGRAD", mode)
    monkeypatch.setattr(backward, "usable", lambda *ts: True)
    monkeypatch.setattr(cublaslt, "wgrad_bgrad", lambda dz2, x2: calls.append((dz2.shape, x2.shape)) or ("dw", "db"))
    dz2, x2 = torch.randn(8, 4), torch.randn(8, 3)
    out = backward.wgrad(dz2, x2, need_w, need_b)
    assert (out == ("dw", "db")) == expect_call
    assert calls == ([(torch.Size([8, 4]), torch.Size([8, 3]))] if expect_call else [])


def test_wgrad_refuses_operands_the_backward_cannot_take(monkeypatch):
    """backward.usable's gate (CPU, float32, grad mode on for a double backward, fake tensors)
    comes first: cuBLASLt never sees them."""
    monkeypatch.setattr(backward, "WGRAD", "cublaslt")
    monkeypatch.setattr(cublaslt, "wgrad_bgrad", lambda *a: pytest.fail("called"))
    assert backward.wgrad(torch.randn(8, 4, dtype=torch.bfloat16), torch.randn(8, 3, dtype=torch.bfloat16),
                          True, True) is None


@pytest.mark.parametrize("answer", ["stand-in", None])
def test_linear_products_take_the_one_gemm_or_fall_back(monkeypatch, answer):
    """torch_ops' linear backward takes dW and db from backward.wgrad when it answers, and
    torch's GEMM and column sum when it declines; dx is torch's product either way."""
    torch.manual_seed(0)
    dz, x, w = torch.randn(2, 5, 4), torch.randn(2, 5, 3), torch.randn(4, 3)
    sentinel = (torch.full((4, 3), 7.0), torch.full((4,), 9.0))
    seen = []
    monkeypatch.setattr(backward, "wgrad", lambda dz2, x2, nw, nb: seen.append((dz2.shape, x2.shape, nw, nb))
                        or (sentinel if answer else None))
    dx, dw, db = torch_ops._linear_products(dz, x, w, True, True, True)
    assert seen == [(torch.Size([10, 4]), torch.Size([10, 3]), True, True)]
    torch.testing.assert_close(dx, dz @ w)
    if answer:
        assert dw is sentinel[0] and db is sentinel[1]
    else:
        torch.testing.assert_close(dw, dz.reshape(10, 4).t() @ x.reshape(10, 3))
        torch.testing.assert_close(db, dz.reshape(10, 4).sum(0))


@pytest.mark.parametrize("switch", ["torch", "cudnn"])
def test_deterministic_mode_declines_before_loading_anything(monkeypatch, switch):
    """torch.use_deterministic_algorithms / cudnn.deterministic: the GEMM and sum stay torch's
    (cuBLASLt's pick is not checked for run-to-run determinism)."""
    monkeypatch.setattr(cublaslt, "usable", lambda dz2, x2: True)
    monkeypatch.setattr(cublaslt, "_load", lambda: pytest.fail("cuBLASLt loaded in deterministic mode"))
    dz, x = torch.randn(64, 80, dtype=torch.bfloat16), torch.randn(64, 96, dtype=torch.bfloat16)
    if switch == "torch":
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    else:
        monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    assert cublaslt.wgrad_bgrad(dz, x) is None


def test_a_refused_plan_is_logged_once_and_remembered(monkeypatch, caplog):
    """A cuBLAS error while planning a shape: None (the caller's torch math), one warning, and the
    shape is not planned again."""
    class Lib:
        calls = 0

        def __getattr__(self, name):
            def refuse(*a):
                Lib.calls += 1
                return 15  # CUBLAS_STATUS_NOT_SUPPORTED
            return refuse

    monkeypatch.setattr(cublaslt, "usable", lambda dz2, x2: True)
    monkeypatch.setattr(cublaslt, "_load", lambda: Lib())
    monkeypatch.setattr(cublaslt, "_failed", set())
    monkeypatch.setattr(cublaslt.torch.cuda, "device", lambda dev: __import__("contextlib").nullcontext())
    dz, x = torch.randn(64, 80, dtype=torch.bfloat16), torch.randn(64, 96, dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="cudnn_fuse.cublaslt"):
        assert cublaslt.wgrad_bgrad(dz, x) is None
        n = Lib.calls
        assert cublaslt.wgrad_bgrad(dz, x) is None
    assert n >= 1 and Lib.calls == n  # the second call planned nothing
    assert sum("declined" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("mode", ["torch", "cublaslt"])
def test_mlp_grads_wiring(monkeypatch, mode):
    """backward.mlp_grads with its cuDNN graphs stood in by torch math (float32, CPU): the six
    gradients equal autograd's in both modes; with WGRAD=cublaslt, dW2+db2 and dW1+db1 come from
    one wgrad_bgrad call each and db1 is not asked of the dz graph, else the dz graph sums db1."""
    torch.manual_seed(0)
    x = torch.randn(2, 6, 8, requires_grad=True)
    w1, b1 = torch.randn(16, 8, requires_grad=True), torch.randn(16, requires_grad=True)
    w2, b2 = torch.randn(8, 16, requires_grad=True), torch.randn(8, requires_grad=True)
    z1 = x @ w1.t() + b1
    y1 = torch.nn.functional.gelu(z1)
    out = y1 @ w2.t() + b2
    gy = torch.randn_like(out)
    want = torch.autograd.grad(out, (x, w1, b1, w2, b2), gy)
    asked, calls = [], []

    def act_grad_graph(dy3, w2_3, z3, act, slope, dbias=False):
        asked.append(dbias)
        dz = torch.ops.aten.gelu_backward(dy3 @ w2_3, z3)
        return (dz, dz.sum((0, 1)).float()) if dbias else dz

    monkeypatch.setattr(backward, "matmul_act_grad", act_grad_graph)
    monkeypatch.setattr(backward, "mm", torch.matmul)
    monkeypatch.setattr(backward, "WGRAD", mode)
    monkeypatch.setattr(backward, "usable", lambda *ts: True)
    monkeypatch.setattr(cublaslt, "usable", lambda dz2, x2: True)
    monkeypatch.setattr(cublaslt, "wgrad_bgrad", lambda dz2, x2: calls.append(tuple(dz2.shape)) or (dz2.t() @ x2, dz2.sum(0)))
    with torch.no_grad():
        got = backward.mlp_grads(x.detach(), w1.detach(), [z1.detach(), y1.detach()], w2.detach(), gy, "gelu", 0.01,
                                 (True,) * 5 + (False,))
    for g, w in zip(got[:5], want):
        torch.testing.assert_close(g, w)
    assert got[5] is None
    if mode == "cublaslt":
        assert calls == [(12, 8), (12, 16)] and asked == [False]
    else:
        assert calls == [] and asked == [backward.MLP_DBIAS == "fused"]
