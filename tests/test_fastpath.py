"""CPU tests of the host fast path's logic: when a call may use the memo, what gets
remembered, how a remembered signature launches, and the raw-launch set-up on fake
frontend graphs. The launches themselves are GPU tests (test_gpu_fastpath.py)."""

from __future__ import annotations

import types

import pytest
import torch

import cudnn_fuse as cf
from cudnn_fuse import loader, ops, plans


class FakePlan:
    raw = True

    def __init__(self):
        self.launched = []

    def launch(self, ptrs):
        self.launched.append(list(ptrs))


@pytest.fixture(autouse=True)
def _empty_memo():
    plans.FAST.clear()
    yield
    plans.FAST.clear()


def test_memo_keys_plain_and_training_calls_apart(tmp_path):
    x = torch.randn(2, 3)

    def name(*ops_args):
        key, _ = ops._memo("op", *ops_args, None, None, ())
        return None if key is None else key[0]

    assert name(x, None) == "op"
    xg = x.clone().requires_grad_(True)
    assert name(xg, None) == "op:grad" and name(x, xg) == "op:grad"  # any operand requiring grad
    with torch.no_grad():
        assert name(xg, None) == "op"
    with cf.record(str(tmp_path / "m.json")):
        assert name(x, None) is None and name(xg, None) is None
    assert name(x, None) == "op"
    assert name(x, "not a tensor") is None  # validation, not the memo, names bad arguments


def test_a_training_key_never_takes_a_raw_launch():
    x = torch.randn(2, 3, dtype=torch.float16)
    plan = types.SimpleNamespace(raw=True)
    ops._remember(("op:grad",), (x, None, None, None), plan, [x, x], x)
    assert ("op:grad",) not in ops._FAST
    ops._remember_call(("op",), lambda *a: None)  # and a plain key never holds a training call
    assert ("op",) not in ops._FAST


def test_remember_and_launch_pass_pointers_in_role_order():
    x, w, b = (torch.randn(4, 8, dtype=torch.float16), torch.randn(6, 8, dtype=torch.float16),
               torch.randn(6, dtype=torch.float16))
    y = torch.empty(4, 6, dtype=torch.float16)
    amax = torch.empty((), dtype=torch.float32)
    plan = FakePlan()
    buffers = [x.view(1, 4, 8), w.t().unsqueeze(0), b.view(1, 1, 6), y.view(1, 4, 6), amax.view(1, 1, 1)]
    ops._remember("k", (x, w, b, None), plan, buffers, (y, amax))
    launch = plans.FAST["k"]
    x2 = torch.randn(4, 8, dtype=torch.float16)
    y2, a2 = launch(x2, w, b, None)
    assert y2.shape == (4, 6) and y2.stride() == (6, 1) and y2.dtype == torch.float16
    assert a2.shape == () and a2.dtype == torch.float32
    assert plan.launched == [[x2.data_ptr(), w.data_ptr(), b.data_ptr(), y2.data_ptr(), a2.data_ptr()]]


@pytest.mark.parametrize("present", [(True, False), (False, True), (True, True), (False, False)])
def test_a_remembered_launch_skips_the_absent_operands(present):
    """Bias and residual present or not: the pointers are the present operands' in role order,
    then the output's; the output is new every call, with the remembered geometry."""
    x, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(6, 8, dtype=torch.bfloat16)
    b = torch.randn(6, dtype=torch.bfloat16) if present[0] else None
    r = torch.randn(4, 6, dtype=torch.bfloat16) if present[1] else None
    y = torch.empty(4, 6, dtype=torch.bfloat16)
    plan = FakePlan()
    ins = [t for t in (x, w, b, r) if t is not None]
    ops._remember("k", (x, w, b, r), plan, ins + [y], y)
    launch = plans.FAST["k"]
    y1, y2 = launch(x, w, b, r), launch(x, w, b, r)
    assert y1.shape == (4, 6) and y1.dtype == torch.bfloat16 and y1.data_ptr() != y2.data_ptr()
    assert plan.launched == [[t.data_ptr() for t in ins] + [y1.data_ptr()], [t.data_ptr() for t in ins] + [y2.data_ptr()]]


def test_a_remembered_output_of_another_dtype_keeps_its_dtype():
    """An output whose dtype is not the first operand's is allocated with its own."""
    x = torch.randn(4, 8, dtype=torch.float16)
    y = torch.empty(4, 6, dtype=torch.bfloat16)
    out = ops._Launch(FakePlan(), y, False, x)(x, x, None, None)
    assert out.dtype == torch.bfloat16 and out.shape == (4, 6)
    same = ops._Launch(FakePlan(), torch.empty(2, 3, dtype=torch.float16), False, x)(x, x, None, None)
    assert same.dtype == torch.float16 and same.shape == (2, 3) and same.device == x.device


def test_remember_keeps_the_layout_of_the_output():
    x = torch.randn(2, 4, 5, 5, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    w = torch.randn(8, 4, 3, 3, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    y = torch.empty(2, 8, 5, 5, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    ops._remember("c", (x, w, None, None), FakePlan(), [x, w, y], y)
    out = plans.FAST["c"](x, w, None, None)
    assert out.stride() == y.stride() and out.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("why", ["copied input", "copied output", "fp32", "no raw launch", "no key"])
def test_remember_refuses(why):
    dtype = torch.float32 if why == "fp32" else torch.float16
    x, w = torch.randn(4, 8, dtype=dtype), torch.randn(6, 8, dtype=dtype)
    y = torch.empty(4, 6, dtype=dtype)
    plan = FakePlan()
    if why == "no raw launch":
        plan.raw = False
    xin = x.clone() if why == "copied input" else x
    yout = y.clone() if why == "copied output" else y
    ops._remember(None if why == "no key" else "k", (x, w, None, None), plan, [xin, w.t(), y], yout)
    assert plans.FAST == {}


def test_cpu_calls_never_memoize_and_clear_forgets():
    x, w, b = torch.randn(4, 8, dtype=torch.float16), torch.randn(6, 8, dtype=torch.float16), torch.randn(6, dtype=torch.float16)
    with torch.no_grad():
        for _ in range(2):
            cf.linear(x, w, b, activation="relu")
            cf.matmul(x, w.t())
            cf.conv2d(torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3))
            q = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16)
            cf.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert plans.FAST == {}
    plans.FAST["k"] = object()
    loader.clear()
    assert plans.FAST == {}


def test_unhashable_arguments_take_the_validated_path():
    x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    with torch.no_grad():
        y = cf.conv2d(x, w, stride=[1, 1], padding=[1, 1])  # lists: no memo key, same answer
    assert y.shape == (1, 3, 5, 5)
    with pytest.raises(TypeError, match="weight"):
        cf.linear(torch.randn(2, 3), "w")


def _fake_graph(order, engine=None, bindings=None, plans_=None, fail=False):
    lowered = types.SimpleNamespace(
        _prepare_variant_pack_template=lambda: None,
        _get_variant_pack_uids_sorted=(lambda: (_ for _ in ()).throw(RuntimeError("no template"))) if fail else
        (lambda: list(order)),
        _execute_with_raw_ptrs=lambda *a: None)
    g = types.SimpleNamespace(selected_engine=engine, _data_bindings=bindings or {}, _lowered_graph=lowered,
                              _plans=plans_ or [], _plan_index=0)
    g._materialize_backend_plan = lambda i: types.SimpleNamespace(cpp_index=7)
    return g


HANDLE = types.SimpleNamespace(backend_handle=1234)


def test_raw_launcher_maps_roles_to_pointer_slots():
    fn, slots, array, address, n, index, handle = plans._raw_launcher(_fake_graph([1, 2, 4, 10]), (1, 2, 4, 10), HANDLE)
    assert slots == (0, 1, 2, 3) and n == 4 and index == -1 and handle == 1234 and len(array) == 4
    _, slots, *_ = plans._raw_launcher(_fake_graph([1, 2, 10]), (2, 1, 10), HANDLE)
    assert slots == (1, 0, 2)
    *_, index, _ = plans._raw_launcher(_fake_graph([1, 2, 10], plans_=[object()]), (1, 2, 10), HANDLE)
    assert index == 7  # the backend plan the selection walk built


@pytest.mark.parametrize("case", ["python engine", "graph-bound input", "other uids", "template fails", "switched off"])
def test_raw_launcher_declines(case, monkeypatch):
    kw = {"python engine": dict(engine=object()), "graph-bound input": dict(bindings={7: 1.0}),
          "template fails": dict(fail=True)}.get(case, {})
    order = [1, 2, 3, 10] if case == "other uids" else [1, 2, 10]
    if case == "switched off":
        monkeypatch.setattr(plans, "RAW_EXECUTE", False)
    assert plans._raw_launcher(_fake_graph(order, **kw), (1, 2, 10), HANDLE) is None


@pytest.mark.parametrize("s1,s2", [((), ()), ((3,), ()), ((2, 1), (4,)), ((1, 5, 1), (3, 1, 7)), ((2, 3), (2, 3)),
                                   ((0,), (1,)), ((4, 1, 2), (1,)), ((2, 3), (3, 3)), ((5,), (2, 5, 4))])
def test_broadcast_shapes_matches_torch(s1, s2):
    try:
        want = tuple(torch.broadcast_shapes(s1, s2))
    except RuntimeError:
        with pytest.raises(RuntimeError):
            ops.broadcast_shapes(s1, s2)
        return
    assert ops.broadcast_shapes(s1, s2) == want
    assert ops.broadcast_shapes(torch.Size(s1), torch.Size(s2)) == want


def _count(monkeypatch, name):
    seen = []
    real = getattr(ops, name)

    def counted(*a, **k):
        seen.append(1)
        return real(*a, **k)

    monkeypatch.setattr(ops, name, counted)
    return seen


@pytest.mark.parametrize("op", ["conv2d", "linear", "matmul"])
def test_training_calls_validate_once_per_signature(monkeypatch, op):
    loader.clear()
    checks = _count(monkeypatch, "_check_epilogue")
    torch.manual_seed(0)
    if op == "conv2d":
        x, w, b = torch.randn(2, 4, 6, 6), torch.randn(8, 4, 3, 3), torch.randn(8)

        def call(x, w, b):
            return cf.conv2d(x, w, b, padding=1, activation="relu")

        def ref(x, w, b):
            return torch.relu(torch.nn.functional.conv2d(x, w, b, padding=1))
    else:
        x, w, b = torch.randn(3, 5, 16), torch.randn(24, 16), torch.randn(24)
        if op == "matmul":
            w = w.t().contiguous()

        def call(x, w, b):
            return getattr(cf, op)(x, w, b, activation="gelu")

        def ref(x, w, b):
            return torch.nn.functional.gelu((x @ w.t() if op == "linear" else x @ w) + b)

    def grads(fn, *ts):
        leaves = [t.detach().clone().requires_grad_() for t in ts]
        fn(*leaves).square().sum().backward()
        return [t.grad for t in leaves]

    first = grads(call, x, w, b)
    assert len(checks) == 1
    again = grads(call, x + 1, w, b)  # new values, same signature: no validation, right gradients
    assert len(checks) == 1
    for got, want in zip(again, grads(ref, x + 1, w, b)):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert all(torch.allclose(g, r, atol=1e-4, rtol=1e-4) for g, r in zip(first, grads(ref, x, w, b)))
    grads(call, x[:1], w, b)  # another shape: validated again
    assert len(checks) == 2
    with torch.no_grad():  # inference does not read or add training entries
        call(x, w, b)
    assert len(checks) == 3
    # a bad call of a signature never seen still names its argument
    with pytest.raises((ValueError, TypeError)):
        getattr(cf, op)(x.detach().requires_grad_(), w, torch.randn(7), activation="relu")
    assert len(checks) == 4
    loader.clear()  # forgets the training entries too
    grads(call, x, w, b)
    assert len(checks) == 5


def test_training_memo_is_off_while_recording(monkeypatch, tmp_path):
    loader.clear()
    checks = _count(monkeypatch, "_check_epilogue")
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
    cf.linear(x, w, activation="relu").sum().backward()
    with cf.record(str(tmp_path / "m.json")):
        cf.linear(x, w, activation="relu").sum().backward()
    assert len(checks) == 2
    loader.clear()


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_training_conv_keeps_its_forward_launch_in_the_validated_call(monkeypatch, native):
    """A training conv2d's remembered (validated) call holds the forward's launch once it ran:
    later calls of the signature do not look the forward up in the memo again, and launch it.
    With the C memo the public call's hits never reach ops._memo (only its first miss does)."""
    from cudnn_fuse import backward

    if native and ops._native is None:
        pytest.skip("cudnn_fuse._native is not built")
    monkeypatch.setattr(ops, "_native_call", ops._native.call if native else None)

    launched = []

    class Plan:
        raw = True
        engine = "fake"

        def __init__(self, spec):
            self.spec = spec

        def launch(self, ptrs):
            launched.append(self.spec.op)

        def run(self, buffers):
            launched.append(self.spec.op)

    loader.clear()
    monkeypatch.setattr(loader, "get_plan", lambda spec, device: Plan(spec))
    monkeypatch.setattr(ops, "_why_not_fused", lambda op, ts: None)  # the cuDNN path, on CPU tensors
    monkeypatch.setattr(backward, "usable", lambda *ts: True)
    names = []
    real = ops._memo

    def memo(name, *a):
        names.append(name)
        return real(name, *a)

    monkeypatch.setattr(ops, "_memo", memo)
    cl = torch.channels_last
    x = torch.randn(2, 8, 6, 6).half().to(memory_format=cl).requires_grad_()
    w = torch.randn(8, 8, 3, 3).half().to(memory_format=cl).requires_grad_()
    b = torch.randn(8).half().requires_grad_()
    for _ in range(3):
        cf.conv2d(x, w, b, padding=1, activation="relu").backward(torch.ones(2, 8, 6, 6).half().to(memory_format=cl))
    # the public call looks itself up every time (in C, past its first miss); the autograd forward only the first time
    assert names == (["conv2d", "conv2d:train"] if native else ["conv2d", "conv2d:train", "conv2d", "conv2d"])
    assert launched.count("conv2d") == 3  # the forward graph ran on every call
    assert launched.count("conv_dgrad") == 3 and launched.count("conv_wgrad") == 3  # the replayed backward
    loader.clear()


@pytest.mark.parametrize("amax", [False, True])
def test_a_torch_plan_is_remembered_and_reruns_on_views_of_the_callers_operands(amax):
    """torch's own kernels standing in for a graph (torch_engine.TorchPlan) are memoized too: a later
    call of the signature views its operands as the plan's buffers were (the caller's memory, no copy),
    allocates the outputs with their remembered geometry, and runs the plan; the result equals the
    slow path's."""
    from cudnn_fuse import torch_engine
    from cudnn_fuse.spec import Epilogue, MatmulSpec, TensorSpec

    M, K, N = 4, 8, 6
    spec = MatmulSpec(TensorSpec.contiguous((1, M, K), "float16"), TensorSpec((1, K, N), (K * N, 1, K), "float16"),
                      TensorSpec.contiguous((1, M, N), "float16"),
                      Epilogue(bias=TensorSpec((1, 1, N), (N, N, 1), "float16"), activation="relu", amax=amax))
    plan = torch_engine.TorchPlan(spec, 0)
    ran = []
    real = plan.run
    plan = type("Counting", (torch_engine.TorchPlan,), {"run": lambda self, b: (ran.append(b), real(b))[1]})(spec, 0)
    x, w, b = (torch.randn(M, K).half(), torch.randn(N, K).half(), torch.randn(N).half())
    y = torch.empty(M, N, dtype=torch.float16)
    am = torch.empty((1, 1, 1), dtype=torch.float32)
    buffers = [x.view(1, M, K), w.t().unsqueeze(0), b.view(1, 1, N), y.view(1, M, N)] + ([am] if amax else [])
    plan.run(buffers)
    ops._remember("k", (x, w, b, None), plan, buffers, (y, am.view(())) if amax else y)
    launch = plans.FAST["k"]
    assert isinstance(launch, ops._TorchLaunch)
    x2 = torch.randn(M, K).half()
    out = launch(x2, w, b, None)
    y2, a2 = out if amax else (out, None)
    want = torch.relu(x2.float() @ w.float().t() + b.float())
    assert y2.shape == (M, N) and y2.stride() == (N, 1) and torch.allclose(y2.float(), want, atol=1e-2, rtol=1e-2)
    bufs = ran[-1]
    assert bufs[0].data_ptr() == x2.data_ptr() and bufs[1].data_ptr() == w.data_ptr()  # views, not copies
    assert bufs[1].shape == (1, K, N) and bufs[1].stride() == w.t().unsqueeze(0).stride()
    if amax:
        assert a2.shape == () and a2.item() == pytest.approx(y2.float().abs().max().item())
    x3 = torch.randn(2 * M, K).half()[M:]  # a view at an offset: viewed where it lies
    y3 = launch(x3, w, b, None)
    y3 = y3[0] if amax else y3
    assert torch.allclose(y3.float(), torch.relu(x3.float() @ w.float().t() + b.float()), atol=1e-2, rtol=1e-2)


def test_a_plan_that_is_neither_raw_nor_torchs_is_not_remembered():
    x = torch.randn(4, 8, dtype=torch.float16)
    ops._remember("k", (x, None, None, None), types.SimpleNamespace(raw=False), [x, x], x)
    assert "k" not in plans.FAST
