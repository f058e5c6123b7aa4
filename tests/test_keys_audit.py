"""An audit of the plan keys (2026-12-04): what a spec digest, the plan LRU, the ops' memo (Python and C) and the
backward's cached specs are keyed on, against what changes the graph or the launch. Each test here failed before its
fix: a tensor attribute changed in place was served its old plan by the memo, a backward spec's plan slot served
another device's buffers, a strided or expanded bias was launched as if it were dense, and specs that are equal
(-0.0 and 0.0, 1 and 1.0) had two digests. No GPU: plans are stand-ins that record what they are given."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import cudnn_fuse as cf
from cudnn_fuse import backward, loader, ops, plans
from cudnn_fuse.builders import roles_of
from cudnn_fuse.spec import ActGradSpec, Epilogue, MatmulSpec, SdpaBwdSpec, SdpaSpec, SdpaTrainSpec, TensorSpec
from tests.memo_paths import PATHS, on_memo_path
from tests.test_spec import conv_spec, sdpa_spec


class _RecordingPlan:
    """A plan that runs nothing and records the spec of each launch and the buffers of each run."""

    raw = True
    engine = "recording"
    workspace_size = 0

    def __init__(self, spec, device, log):
        self.spec, self.device, self.log = spec, device, log

    def launch(self, ptrs):
        self.log.append((self, None))

    def run(self, buffers):
        self.log.append((self, list(buffers)))


@pytest.fixture(params=PATHS)
def fused(request, monkeypatch):
    """The fused path on CPU tensors (plans that record), on the Python memo or the C memo; yields the log."""
    log = []
    with on_memo_path(request.param, monkeypatch, lambda spec, device: _RecordingPlan(spec, device, log)):
        yield log


def _cl16(*shape):
    return torch.randn(shape).half().contiguous(memory_format=torch.channels_last)


# ------------------------------------------------------- a tensor attribute changed in place (the memo)


@pytest.mark.parametrize("name, first, then", [("stride", 2, 1), ("padding", 2, 1), ("dilation", 2, 1),
                                               ("negative_slope", 0.25, 0.5)])
def test_a_tensor_attribute_changed_in_place_is_not_served_its_old_plan(fused, name, first, then):
    """torch takes stride=torch.tensor(2) (and a tensor slope); the memo key held the tensor itself, equal to
    itself after ``t.fill_(1)``: the second call was launched on the stride-2 plan with a stride-2 output."""
    x, w = _cl16(1, 4, 8, 8), _cl16(4, 4, 3, 3)
    t = torch.tensor(first)
    kw = {name: t, **({"activation": "leaky_relu"} if name == "negative_slope" else {})}
    with torch.no_grad():
        cf.conv2d(x, w, **kw)
        t.fill_(then)
        y = cf.conv2d(x, w, **kw)
    want = dict(kw, **{name: then})
    spec = fused[-1][0].spec
    assert tuple(y.shape) == tuple(torch.nn.functional.conv2d(x.float(), w.float(), **{
        k: v for k, v in want.items() if k in ("stride", "padding", "dilation")}).shape)
    if name == "negative_slope":
        assert spec.epilogue.negative_slope == then
    else:
        assert getattr(spec, name if name != "padding" else "pre_padding") == (then, then)


def test_a_tensor_attribute_makes_a_call_unkeyable_on_both_paths():
    x = torch.randn(2, 3)
    assert ops._memo("conv2d", x, None, None, None, (torch.tensor(1), 0, 1, 1, None, False, 0.01)) == (None, None)
    assert ops._memo("conv2d", x, None, None, None, ((1, torch.tensor(1)), 0, 1, 1, None, False, 0.01)) == (None, None)
    if ops._native is not None:
        plans.FAST.clear()
        assert ops._native.call("conv2d", "conv2d:grad", x, None, None, None, (torch.tensor(1),)) is None


# ------------------------------------------------------- the backward's cached specs (device)


class _OnDevice:
    """A CPU tensor's memory reported as on cuda:<index> (a torch.device needs no GPU): what _cached_spec
    and _try read of a buffer."""

    def __init__(self, t, index):
        self.t, self.device, self.shape, self.dtype = t, torch.device("cuda", index), t.shape, t.dtype

    def stride(self):
        return self.t.stride()

    def data_ptr(self):
        return self.t.data_ptr()

    def is_neg(self):
        return False


def test_a_backward_spec_slot_never_serves_another_devices_buffers(monkeypatch):
    """backward._cached_spec keeps each spec's plan beside it; its key had no device, so the same layer on cuda:1
    (a replica) was launched on cuda:0's plan."""
    log = []
    monkeypatch.setattr(loader, "get_plan", lambda spec, device: _RecordingPlan(spec, device, log))
    plans.FAST.clear()
    try:
        for index in (0, 1, 0, 1):
            bufs = [_OnDevice(torch.empty(s, dtype=torch.float16), index) for s in ((1, 4, 8), (1, 8, 6), (1, 4, 6))]
            spec = backward._cached_spec("mm", (), bufs, lambda: MatmulSpec(*(TensorSpec.of(b) for b in bufs),
                                                                            Epilogue()))
            assert backward._try("matmul_backward", spec, bufs)
        assert [(plan.device, bufs[0].device.index) for plan, bufs in log] == [(0, 0), (1, 1), (0, 0), (1, 1)]
    finally:
        plans.FAST.clear()


# ------------------------------------------------------- a strided or expanded bias


def _declared_bias(spec):
    return getattr(spec, "fwd", spec).epilogue.bias


def _bias_runs(log):
    """(buffer strides, declared strides) of every bias a plan ran, dims of size 1 left out (their strides
    address nothing)."""
    out = []
    for plan, bufs in log:
        if bufs is None or "bias" not in roles_of(plan.spec):
            continue
        b, decl = bufs[roles_of(plan.spec).index("bias")], _declared_bias(plan.spec)
        out.append((tuple(s for s, n in zip(b.stride(), b.shape) if n != 1),
                    tuple(s for s, n in zip(decl.stride, decl.shape) if n != 1)))
    return out


def _odd_biases(n):
    return {"strided": torch.randn(2 * n).half()[::2], "expanded": torch.tensor(0.5).half().expand(n)}


@pytest.mark.parametrize("kind", ["strided", "expanded"])
def test_a_forward_bias_reaches_the_plan_as_its_spec_declares_it(fused, kind):
    """The graphs declare the bias dense ([K] in a row); a bias[::2] or an expanded scalar went in as its view,
    so cuDNN would have read K elements in a row from its pointer: other values, or past its storage."""
    bias = _odd_biases(6)[kind]
    with torch.no_grad():
        cf.conv2d(_cl16(1, 4, 8, 8), _cl16(6, 4, 3, 3), bias)
        cf.linear(torch.randn(4, 8).half(), torch.randn(6, 8).half(), bias)
        cf.matmul(torch.randn(2, 4, 8).half(), torch.randn(8, 6).half(), bias)
    runs = _bias_runs(fused)
    assert len(runs) == 3 and all(have == want for have, want in runs), runs
    assert ops.memo_keys() == []  # a copy fed the plan: nothing remembered


@pytest.mark.parametrize("kind", ["strided", "expanded"])
def test_a_backward_bias_reaches_the_plan_as_its_spec_declares_it(monkeypatch, kind):
    """The same in the backward graphs that recompute the pre-activation (gemm_dz, conv_dz) and in the
    forward that keeps it (linear_save_z)."""
    log = []
    monkeypatch.setattr(loader, "get_plan", lambda spec, device: _RecordingPlan(spec, device, log))
    plans.FAST.clear()
    h = torch.float16
    try:
        bias = _odd_biases(6)[kind]
        a3, b3, dy3 = torch.randn(1, 4, 8, dtype=h), torch.randn(1, 8, 6, dtype=h), torch.randn(1, 4, 6, dtype=h)
        assert backward.gemm_dz(a3, b3, bias, None, dy3, "gelu", 0.01) is not None
        assert backward.linear_save_z(torch.randn(4, 8, dtype=h), torch.randn(6, 8, dtype=h), bias, None, "gelu",
                                      0.01) is not None
        x, w = _cl16(1, 4, 8, 8), _cl16(6, 4, 3, 3)
        geo = ((1, 1), (1, 1), (1, 1), (1, 1), 1)
        assert backward.conv_dz(x, w, bias, None, _cl16(1, 6, 8, 8), None, geo, "gelu", 0.01, False) is not None
        runs = _bias_runs(log)
        assert len(runs) == 3 and all(have == want for have, want in runs), runs
    finally:
        plans.FAST.clear()


# ------------------------------------------------------- equal specs, one digest


def test_equal_slopes_and_scales_have_one_digest():
    """-0.0 == 0.0 and 1 == 1.0: such specs are equal (the plan LRU holds one plan for them) but their canonical
    JSON differed ("-0.0", "1"), so the disk cache and pre-warm held two keys for one graph."""
    leaky = lambda s: conv_spec(epilogue=Epilogue(activation="leaky_relu", negative_slope=s))  # noqa: E731
    assert leaky(-0.0) == leaky(0.0) and leaky(-0.0).digest() == leaky(0.0).digest()
    t = TensorSpec((2, 3), (3, 1), "float16")
    assert ActGradSpec(t, t, t, "leaky_relu", -0.0).digest() == ActGradSpec(t, t, t, "leaky_relu", 0.0).digest()
    for a, b in ((1, 1.0), (-0.0, 0.0)):
        assert sdpa_spec(scale=a).digest() == sdpa_spec(scale=b).digest()
    assert sdpa_spec(is_causal=1).digest() == sdpa_spec(is_causal=True).digest()
    s = sdpa_spec(scale=2)
    st = TensorSpec((2, 4, 16, 1), (64, 16, 1, 1), "float32")
    train = SdpaTrainSpec(s.q, s.k, s.v, s.o, st, scale=2)
    bwd = SdpaBwdSpec(s.q, s.k, s.v, s.o, s.o, st, s.q, s.k, s.v, scale=2)
    assert type(s.scale) is type(train.scale) is type(bwd.scale) is float
    assert isinstance(s, SdpaSpec) and s.to_dict()["scale"] == 2.0
    # and a different slope or scale still has its own
    assert leaky(0.1).digest() != leaky(0.0).digest() and sdpa_spec(scale=0.5).digest() != sdpa_spec(scale=1).digest()


_TF32_PROBE = r"""
import torch
from cudnn_fuse import ops

m = torch.backends.cuda.matmul
m.fp32_precision = "tf32"  # the API torch recommends
try:
    m.allow_tf32
    print("legacy-readable")  # an older torch: nothing to check
    raise SystemExit(0)
except RuntimeError:
    pass
out = [ops.tf32_enabled("matmul")]
m.fp32_precision = "ieee"
out.append(ops.tf32_enabled("matmul"))
m.fp32_precision = "none"
torch.backends.fp32_precision = "tf32"  # "none" defers to the backend's "all", then to "generic"
out.append(ops.tf32_enabled("matmul"))
c = torch.backends.cudnn
c.conv.fp32_precision, c.rnn.fp32_precision = "ieee", "tf32"
try:
    c.allow_tf32
    out.append("cudnn legacy readable")
except RuntimeError:
    pass
out.append(ops.tf32_enabled("conv"))
c.conv.fp32_precision, c.rnn.fp32_precision = "tf32", "ieee"
out.append(ops._conv_tf32(torch.empty(1)))
print(out)
"""


def test_tf32_is_read_through_the_fp32_precision_api():
    """torch 2.13 raises RuntimeError from the legacy allow_tf32 getters once the fp32_precision API set
    the matmul's precision (or cuDNN's conv and RNN apart), and every float32 matmul / conv of cf's
    raised with it. Run in a subprocess: the setting is process-wide and sticks."""
    out = subprocess.run([sys.executable, "-c", _TF32_PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "legacy-readable":
        pytest.skip("this torch answers the legacy TF32 getters whatever the fp32_precision API set")
    assert out.stdout.strip() == "[True, False, True, False, True]"
