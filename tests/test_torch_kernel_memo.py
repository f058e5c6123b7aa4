"""A remembered call whose plan is torch's own kernels runs eager's expression on the caller's operands
(torch_engine.eager_call): the slow path's output, at eager's host cost; the plan's own run stays for
what that expression cannot give. On the Python memo and the C memo, with CPU stand-ins."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cudnn_fuse as cf
from cudnn_fuse import loader, ops, torch_engine
from memo_paths import PATHS, on_memo_path

ACTS = [None, "relu", "gelu", "gelu_tanh", "silu", "tanh", "sigmoid", "leaky_relu"]


def _eager_act(y, act, slope=0.01):
    if act is None:
        return y
    if act == "leaky_relu":
        return F.leaky_relu(y, slope)
    if act == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    return getattr(F, act)(y) if act != "tanh" else torch.tanh(y)


class _Counting(torch_engine.TorchPlan):
    runs = 0

    def run(self, buffers):
        type(self).runs += 1
        super().run(buffers)


@pytest.fixture
def counting(monkeypatch):
    _Counting.runs = 0
    yield lambda spec, device=0: _Counting(spec, 0)
    loader.clear()


def _close(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("act", ACTS)
def test_a_remembered_torch_kernel_linear_runs_eagers_expression(path, act, monkeypatch, counting):
    torch.manual_seed(0)
    x, w, b, r = torch.randn(2, 5, 16).half(), torch.randn(24, 16).half() / 4, torch.randn(24).half(), \
        torch.randn(2, 5, 24).half()
    with on_memo_path(path, monkeypatch, counting):
        for residual in (None, r):
            first = cf.linear(x, w, b, activation=act, residual=residual)
            runs = _Counting.runs
            again = [cf.linear(x, w, b, activation=act, residual=residual) for _ in range(3)]
            assert _Counting.runs == runs  # the plan's run is not what repeats
            want = _eager_act(F.linear(x.float(), w.float(), b.float()) + (0 if residual is None else r.float()), act)
            for y in [first] + again:
                _close(y, want.half())
                assert y.stride() == first.stride()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("act", ["relu", "silu", "leaky_relu"])
def test_a_remembered_torch_kernel_conv_runs_eagers_expression(path, act, monkeypatch, counting):
    torch.manual_seed(0)
    cl = torch.channels_last
    x = torch.randn(2, 8, 7, 7).half().to(memory_format=cl)
    w = (torch.randn(8, 1, 3, 3).half() / 3).to(memory_format=cl)  # depthwise, as torch's kernels win there
    b, r = torch.randn(8).half(), torch.randn(2, 8, 7, 7).half().to(memory_format=cl)
    slope = 0.2 if act == "leaky_relu" else 0.01
    with on_memo_path(path, monkeypatch, counting):
        first = cf.conv2d(x, w, b, padding=1, groups=8, activation=act, residual=r, negative_slope=slope)
        runs = _Counting.runs
        again = cf.conv2d(x, w, b, padding=1, groups=8, activation=act, residual=r, negative_slope=slope)
        assert _Counting.runs == runs
    want = _eager_act(F.conv2d(x.float(), w.float(), b.float(), padding=1, groups=8) + r.float(), act, slope)
    for y in (first, again):
        _close(y, want.half())
        assert y.is_contiguous(memory_format=cl) and y.stride() == first.stride()


@pytest.mark.parametrize("path", PATHS)
def test_a_remembered_torch_kernel_matmul_runs_eagers_expression(path, monkeypatch, counting):
    torch.manual_seed(0)
    a, b, bias = torch.randn(3, 4, 16).half(), torch.randn(16, 8).half() / 4, torch.randn(8).half()
    with on_memo_path(path, monkeypatch, counting):
        first = cf.matmul(a, b, bias, activation="gelu")
        runs = _Counting.runs
        again = cf.matmul(a, b, bias, activation="gelu")
        assert _Counting.runs == runs
    want = F.gelu(a.float() @ b.float() + bias.float()).half()
    for y in (first, again):
        _close(y, want)


def _remembered(op, spec, ins, buffers, y):
    plan = _Counting(spec, 0)
    plan.run(buffers)
    return ops._TorchLaunch(plan, ins, buffers, y, None, op)


def _linear_spec(M, K, N, act="relu"):
    from cudnn_fuse.spec import Epilogue, MatmulSpec, TensorSpec

    return MatmulSpec(TensorSpec.contiguous((1, M, K), "float16"), TensorSpec((1, K, N), (K * N, 1, K), "float16"),
                      TensorSpec.contiguous((1, M, N), "float16"),
                      Epilogue(bias=TensorSpec((1, 1, N), (N, N, 1), "float16"), activation=act))


def test_an_eager_expression_whose_output_is_not_the_slow_paths_gives_way_to_the_plans_run(counting):
    """The slow path's output geometry is the contract: where eager's expression gives other strides, the
    remembered call runs the plan (from that call on) and returns the slow path's geometry."""
    M, K, N = 4, 8, 6
    x, w, b = torch.randn(M, K).half(), torch.randn(N, K).half(), torch.randn(N).half()
    yb = torch.empty_strided((1, M, N), (M * N, 1, M), dtype=torch.float16)  # the slow path wrote column-major
    buffers = [x.view(1, M, K), w.t().unsqueeze(0), b.view(1, 1, N), yb]
    launch = ops._TorchLaunch(_Counting(_linear_spec(M, K, N), 0), [x, w, b], buffers, yb[0], None, "linear")
    out = launch(x, w, b, None)
    assert launch.direct is None and _Counting.runs == 1
    assert out.stride() == (1, M)
    _close(out, torch.relu(F.linear(x.float(), w.float(), b.float())).half())


def test_an_eager_expression_that_raises_gives_way_to_the_plans_run(counting):
    M, K, N = 4, 8, 6
    x, w, b = torch.randn(M, K).half(), torch.randn(N, K).half(), torch.randn(N).half()
    y = torch.empty(M, N, dtype=torch.float16)
    buffers = [x.view(1, M, K), w.t().unsqueeze(0), b.view(1, 1, N), y.view(1, M, N)]
    launch = _remembered("linear", _linear_spec(M, K, N), [x, w, b], buffers, y)

    def boom(*a):
        raise RuntimeError("no kernel for this")
    launch.direct = boom
    runs = _Counting.runs
    out = launch(x, w, b, None)
    assert launch.direct is None and _Counting.runs == runs + 1
    _close(out, torch.relu(F.linear(x.float(), w.float(), b.float())).half())


def test_eager_call_applies_only_where_eagers_expression_is_the_computation():
    from cudnn_fuse.spec import Epilogue, MatmulSpec

    spec = _linear_spec(4, 8, 6)
    assert torch_engine.eager_call(spec, "linear") is not None
    assert torch_engine.eager_call(spec, "matmul") is not None
    assert torch_engine.eager_call(spec, "conv2d") is None  # a matmul spec under another op's name
    assert torch_engine.eager_call(spec, "k") is None
    amax = MatmulSpec(spec.a, spec.b, spec.y, Epilogue(activation="relu", amax=True))
    assert torch_engine.eager_call(amax, "linear") is None  # the amax: the plan's run
