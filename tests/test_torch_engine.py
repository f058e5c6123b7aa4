"""torch (cuBLAS) as an autotune candidate: its implementation of matmul-class graphs against the
reference, which specs it may stand in for, the timing and the decision, and the loader's use of
a tuned entry that chose it. CPU tensors: the implementation is plain torch."""

from __future__ import annotations

import types

import pytest
import torch

from cudnn_fuse import autotune, loader, reference, torch_engine
from cudnn_fuse.builders import roles_of
from cudnn_fuse.spec import ConvSpec, Epilogue, MatmulSpec, SaveZSpec, TensorSpec

ACTS = [None, "relu", "gelu", "gelu_tanh", "silu", "tanh", "sigmoid", "leaky_relu"]


def _matmul_spec(B, M, K, N, dtype="bfloat16", bias=True, residual=False, act="gelu", amax=False, slope=0.01,
                 b_batch=None):
    a = TensorSpec.contiguous((B, M, K), dtype)
    bb = B if b_batch is None else b_batch
    b = TensorSpec((bb, K, N), (K * N, 1, K), dtype)  # a transposed weight, as linear passes it
    y = TensorSpec.contiguous((B, M, N), dtype)
    epi = Epilogue(bias=TensorSpec((1, 1, N), (N, N, 1), dtype) if bias else None,
                   residual=TensorSpec.contiguous((B, M, N), dtype) if residual else None,
                   activation=act, negative_slope=slope, amax=amax)
    return MatmulSpec(a, b, y, epi)


def _conv_spec(N=2, C=4, H=9, K=4, R=3, groups=1, dtype="float16", pre=(1, 1), post=(1, 1), stride=(1, 1),
               bias=True, residual=False, act="relu", amax=False, slope=0.01):
    """A channels_last ConvSpec as cf.conv2d makes one."""
    def cl(n, c, h, w):
        return TensorSpec((n, c, h, w), (c * h * w, 1, w * c, c), dtype)

    P = (H + pre[0] + post[0] - R) // stride[0] + 1
    Q = (H + pre[1] + post[1] - R) // stride[1] + 1
    epi = Epilogue(bias=TensorSpec((1, K, 1, 1), (K, 1, K, K), dtype) if bias else None,
                   residual=cl(N, K, P, Q) if residual else None, activation=act, negative_slope=slope, amax=amax)
    return ConvSpec(cl(N, C, H, H), cl(K, C // groups, R, R), cl(N, K, P, Q), stride, pre, post, (1, 1), groups, epi)


def _buffers(spec):
    """Random operands in roles order, with the spec's shapes and strides (outputs poisoned)."""
    geo = autotune._geometry(spec)
    dt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    out = []
    for r in roles_of(spec):
        shape, stride, dtype = geo[r]
        t = torch.empty_strided(shape, stride, dtype=dt[dtype])
        t.copy_(torch.randn(shape) * (0.5 if r != "bias" else 1.0)) if r not in autotune._OUTPUT_ROLES else t.fill_(7)
        out.append(t)
    return out


def _close(got, want):
    """Within bf16 rounding of z (relative) plus a small absolute slack, element by element."""
    return bool(((got.float() - want).abs() <= 0.02 * want.abs() + 0.03).all())


def _expected(spec, t):
    fwd = spec.fwd if isinstance(spec, SaveZSpec) else spec
    epi = fwd.epilogue
    z = torch.matmul(t["a"].float(), t["b"].float())
    if "bias" in t:
        z = z + t["bias"].float()
    if "residual" in t:
        z = z + t["residual"].float()
    return z, reference.activation(z, epi.activation, epi.negative_slope)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias,residual,amax", [(True, False, False), (False, False, False), (True, True, True),
                                                (False, True, False)])
def test_matmul_matches_the_reference(act, bias, residual, amax):
    torch.manual_seed(0)
    spec = _matmul_spec(1, 24, 32, 40, bias=bias, residual=residual, act=act, amax=amax, slope=0.2)
    bufs = _buffers(spec)
    torch_engine.TorchPlan(spec, 0).run(bufs)
    t = dict(zip(roles_of(spec), bufs))
    _, want = _expected(spec, t)
    assert _close(t["y"], want)
    if amax:
        assert t["amax"].dtype == torch.float32
        assert t["amax"].item() == pytest.approx(t["y"].float().abs().max().item())


@pytest.mark.parametrize("B,b_batch", [(3, 3), (3, 1)])
def test_batched_and_broadcast_matmul(B, b_batch):
    torch.manual_seed(1)
    spec = _matmul_spec(B, 8, 16, 12, act="relu", b_batch=b_batch)
    bufs = _buffers(spec)
    torch_engine.TorchPlan(spec, 0).run(bufs)
    t = dict(zip(roles_of(spec), bufs))
    _, want = _expected(spec, t)
    assert t["y"].shape == (B, 8, 12)
    assert _close(t["y"], want)


@pytest.mark.parametrize("act", ["gelu", "relu", "silu", "leaky_relu"])  # no None: SaveZSpec refuses it (z is y)
def test_save_z_writes_both_outputs(act):
    torch.manual_seed(2)
    fwd = _matmul_spec(1, 16, 32, 24, act=act, residual=True, slope=0.3)
    spec = SaveZSpec(fwd, TensorSpec.contiguous((1, 16, 24), "bfloat16"))
    bufs = _buffers(spec)
    torch_engine.TorchPlan(spec, 0).run(bufs)
    t = dict(zip(roles_of(spec), bufs))
    z, y = _expected(spec, t)
    assert _close(t["z"], z)
    # y is act of the rounded z, as eager computes it
    assert torch.equal(t["y"], reference.activation(t["z"], act, 0.3).to(t["y"].dtype))


def test_supports_16_bit_matmul_class_graphs_and_convs_with_symmetric_padding():
    assert torch_engine.supports(_matmul_spec(1, 8, 8, 8))
    assert torch_engine.supports(_matmul_spec(1, 8, 8, 8, dtype="float16", amax=True))
    assert not torch_engine.supports(_matmul_spec(1, 8, 8, 8, dtype="float32"))
    fwd = _matmul_spec(1, 8, 8, 8)
    assert torch_engine.supports(SaveZSpec(fwd, TensorSpec.contiguous((1, 8, 8), "bfloat16")))
    fwd_amax = _matmul_spec(1, 8, 8, 8, amax=True)
    assert not torch_engine.supports(SaveZSpec(fwd_amax, TensorSpec.contiguous((1, 8, 8), "bfloat16")))
    assert torch_engine.supports(_conv_spec())
    assert torch_engine.supports(_conv_spec(groups=4, dtype="bfloat16"))
    assert not torch_engine.supports(_conv_spec(dtype="float32"))
    assert not torch_engine.supports(_conv_spec(pre=(0, 0), post=(1, 1)))  # torch pads both sides alike


@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias,residual,amax", [(True, False, False), (False, True, True), (True, True, False)])
def test_conv_matches_the_reference_in_the_ops_output_buffer(groups, act, bias, residual, amax):
    """torch's conv with its bias written into the op's own (channels_last) output, then the epilogue
    in place: the same values as the reference conv, the output buffer kept."""
    torch.manual_seed(1)
    spec = _conv_spec(groups=groups, bias=bias, residual=residual, act=act, amax=amax, slope=0.2, stride=(2, 2))
    bufs = _buffers(spec)
    t = dict(zip(roles_of(spec), bufs))
    y_ptr, y_stride = t["y"].data_ptr(), t["y"].stride()
    torch_engine.TorchPlan(spec, 0).run(bufs)
    assert t["y"].data_ptr() == y_ptr and t["y"].stride() == y_stride
    f = {k: v.float() for k, v in t.items()}
    want = reference.conv2d(f["x"], f["w"], f["bias"].reshape(-1) if bias else None, stride=2, padding=1,
                            groups=groups, activation=act, residual=f.get("residual"), negative_slope=0.2)
    assert _close(t["y"], want)
    if amax:
        assert t["amax"].item() == pytest.approx(t["y"].float().abs().max().item())


def _winner(ms):
    t = autotune.Timing(2, "eng4", 4, {}, 0)
    t.median_ms, t.status = ms, "timed"
    return t


def test_torch_timing_and_decision():
    cfg = autotune.Config(warmup=2, repeats=5, torch_candidate=True)
    runs = []
    fast = autotune.torch_timing(lambda: runs.append(1), lambda: 0.8, cfg)
    assert len(runs) == 2 and fast.index == autotune.TORCH_INDEX and fast.status == "timed"
    assert autotune.torch_wins(_winner(1.0), [_winner(1.0), fast])
    slow = autotune.torch_timing(lambda: None, lambda: 1.2, cfg)
    assert not autotune.torch_wins(_winner(1.0), [_winner(1.0), slow])
    assert not autotune.torch_wins(_winner(1.0), [_winner(1.0)])  # no torch candidate: cuDNN
    # each path costs the longer of its device time and its host time per call
    host = autotune.TORCH_HOST_MS
    tiny = autotune.torch_timing(lambda: None, lambda: 0.5 * host, cfg)
    assert not autotune.torch_wins(_winner(0.9 * host), [_winner(0.9 * host), tiny])  # launch-bound: host decides
    assert autotune.torch_wins(_winner(1.2 * host), [_winner(1.2 * host), tiny])
    close = autotune.torch_timing(lambda: None, lambda: 0.099, cfg)
    assert not autotune.torch_wins(_winner(0.1), [_winner(0.1), close])  # a tie keeps the fused plan
    better = autotune.torch_timing(lambda: None, lambda: 0.09, cfg)
    assert autotune.torch_wins(_winner(0.1), [_winner(0.1), better])  # device-bound: 10 us saved is 10 us

    def boom():
        raise RuntimeError("cuBLAS said no")

    failed = autotune.torch_timing(boom, lambda: 0.1, cfg)
    assert failed.status.startswith("failed") and not autotune.torch_wins(_winner(1.0), [failed])
    assert failed.to_dict()["median_ms"] is None  # stored as JSON like any failed candidate


def test_the_runoff_alternates_and_takes_medians():
    calls = []
    a_times, b_times = iter([1.0, 1.4, 1.1, 1.2]), iter([2.0, 2.2, 0.5, 2.4])

    def a():
        calls.append("a")
        return next(a_times)

    def b():
        calls.append("b")
        return next(b_times)

    assert autotune.runoff(a, b, 4) == (1.15, 2.1)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]  # ABBA: a drift weighs on both alike
    assert autotune.Config().runoff_rounds % 2 == 0  # an even count balances a steady drift


def _torch(ms):
    t = autotune.Timing(autotune.TORCH_INDEX, "torch", None, {}, 0)
    t.median_ms, t.status = ms, "timed"
    return t


class Drift:
    """Timings that grow by ``step`` ms per call, whichever candidate is timed (a GPU slowing
    down over a tuning); ``timer(own)``: a candidate whose true time is ``base + own``."""

    def __init__(self, step, base=1.0):
        self.now, self.step, self.base = 0.0, step, base

    def timer(self, own):
        def time_it():
            self.now += self.step
            return self.base + own + self.now
        return time_it


def test_a_close_call_against_torch_is_settled_by_a_runoff():
    cfg = autotune.Config(runoff_rounds=4, runoff_margin=0.15)
    # torch timed last, 0.3 ms of drift later, read 1.05 against the winner's 1.0; really it is 0.04 ms faster
    winner, torch_t = _winner(1.0), _torch(1.05)
    assert not autotune.torch_wins(winner, [winner, torch_t])
    clock = Drift(0.1)
    assert autotune.settle_torch(winner, torch_t, clock.timer(0.0), clock.timer(-0.04), cfg)
    assert torch_t.runoff_ms < winner.runoff_ms and autotune.torch_wins(winner, [winner, torch_t])
    assert torch_t.to_dict()["runoff_ms"] == round(torch_t.runoff_ms, 6)  # recorded with the candidates
    # and the other way: torch really slower; the runoff keeps cuDNN
    winner, torch_t = _winner(1.0), _torch(0.97)
    clock = Drift(0.1)
    assert autotune.settle_torch(winner, torch_t, clock.timer(0.0), clock.timer(0.04), cfg)
    assert not autotune.torch_wins(winner, [winner, torch_t])


@pytest.mark.parametrize("case", ["far apart", "launch-bound", "torch failed", "runoff fails", "no rounds"])
def test_no_runoff_where_the_medians_decide(case):
    cfg = autotune.Config(runoff_rounds=0 if case == "no rounds" else 4, runoff_margin=0.15)
    host = autotune.TORCH_HOST_MS
    winner = _winner(0.9 * host if case == "launch-bound" else 1.0)
    torch_t = _torch({"far apart": 0.7, "launch-bound": 0.85 * host}.get(case, 0.95))
    if case == "torch failed":
        torch_t.status = "failed:cuBLAS"
    ran = []

    def time_it():
        ran.append(1)
        if case == "runoff fails":
            raise RuntimeError("device lost")
        return 1.0

    assert not autotune.settle_torch(winner, torch_t, time_it, time_it, cfg)
    assert ran == ([1] if case == "runoff fails" else [])
    assert winner.runoff_ms == torch_t.runoff_ms == float("inf")
    assert autotune.torch_wins(winner, [winner, torch_t]) is (case in ("far apart", "runoff fails", "no rounds"))


def test_the_torch_candidate_is_on_by_default_and_a_config_field():
    assert autotune.Config().torch_candidate is True
    assert autotune.Config(torch_candidate=False).torch_candidate is False


def test_loader_serves_torch_only_where_the_tuned_entry_chose_it():
    spec = _matmul_spec(1, 8, 8, 8)
    cudnn_plan = types.SimpleNamespace(spec=spec, device=0, graph="g", raw=True)
    assert loader._maybe_torch(cudnn_plan, {"tuned": True}) is cudnn_plan
    assert loader._maybe_torch(cudnn_plan, {"use_torch": False}) is cudnn_plan
    tp = loader._maybe_torch(cudnn_plan, {"use_torch": True})
    assert isinstance(tp, torch_engine.TorchPlan) and tp.cudnn_plan is cudnn_plan and tp.raw is False
    assert tp.graph == "g" and tp.engine == "torch"
    fp32 = types.SimpleNamespace(spec=_matmul_spec(1, 8, 8, 8, dtype="float32"), device=0)
    assert loader._maybe_torch(fp32, {"use_torch": True}) is fp32  # not one it may stand in for


def test_a_torch_plan_is_memoized_as_a_torch_launch_never_a_raw_one():
    from cudnn_fuse import ops

    spec = _matmul_spec(1, 8, 8, 8, bias=False, act=None)
    x = torch.randn(8, 8, dtype=torch.bfloat16)
    y = torch.empty(8, 8, dtype=torch.bfloat16)
    ops._FAST.clear()
    ops._remember(("k",), (x, x, None, None), torch_engine.TorchPlan(spec, 0), [x, x, y], y)
    assert type(ops._FAST[("k",)]) is ops._TorchLaunch
    ops._FAST.clear()


def test_the_tuners_operands_leave_torchs_generator_alone():
    """The tuner draws its operands from a generator of its own: a tuning inside the user's first call
    must not shift the random numbers the program draws after it (run on CPU tensors here; the GPU
    tuner's device is a CUDA index)."""
    spec = _matmul_spec(2, 8, 16, 12, dtype="float32", residual=True)
    roles = roles_of(spec)
    torch.manual_seed(123)
    want = torch.rand(4)
    torch.manual_seed(123)
    sets = autotune.random_buffers(spec, roles, torch.device("cpu"), 2)
    assert torch.equal(torch.rand(4), want)  # the default generator did not move
    assert len(sets) == 2 and all(len(b) == len(roles) for b in sets)
    inputs = [i for i, r in enumerate(roles) if r not in autotune._OUTPUT_ROLES]
    assert inputs and all(sets[0][i].abs().sum() > 0 for i in inputs)
    assert not torch.equal(sets[0][inputs[0]], sets[1][inputs[0]])  # two sets: two draws (L2 rotation)
    assert autotune._generator(torch.device("cpu")) is autotune._generator(torch.device("cpu"))
