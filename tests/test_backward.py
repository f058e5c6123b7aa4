"""The cuDNN backward without a GPU: training specs (round trips, digests), their
builders' IR, and the backward's plumbing (views, strides, buffer order,
declines) run against an executor that interprets each spec with torch."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import cudnn_fuse as cf
from cudnn_fuse import backward, loader, reference, torch_ops
from cudnn_fuse.builders import UIDS, build_graph, roles_of, uids_of
from cudnn_fuse.errors import UnsupportedError
from cudnn_fuse.spec import (
    ActGradSpec,
    ConvDgradSpec,
    ConvSpec,
    ConvWgradSpec,
    Epilogue,
    MatmulSpec,
    RecomputeGradSpec,
    SaveZSpec,
    SdpaBwdSpec,
    SdpaTrainSpec,
    TensorSpec,
    spec_from_dict,
)

BF = "bfloat16"


def _mm(act="gelu", bias=True):
    a = TensorSpec.contiguous((1, 64, 32), BF)
    b = TensorSpec((1, 32, 48), (1536, 1, 32), BF)
    y = TensorSpec.contiguous((1, 64, 48), BF)
    return MatmulSpec(a, b, y, Epilogue(bias=TensorSpec((1, 1, 48), (48, 48, 1), BF) if bias else None, activation=act))


def _conv(act="silu"):
    x = TensorSpec.contiguous((2, 4, 9, 9), BF)
    w = TensorSpec.contiguous((8, 4, 3, 3), BF)
    y = TensorSpec.contiguous((2, 8, 9, 9), BF)
    return ConvSpec(x, w, y, (1, 1), (1, 1), (1, 1), (1, 1), 1, Epilogue(bias=TensorSpec((1, 8, 1, 1), (8, 1, 8, 8), BF),
                                                                        activation=act))


def _specs():
    y = TensorSpec.contiguous((1, 64, 48), BF)
    db = TensorSpec.contiguous((1, 1, 48), "float32")
    c4 = lambda *s: TensorSpec.contiguous(s, BF)  # noqa: E731
    q, st = c4(2, 4, 16, 64), TensorSpec.contiguous((2, 4, 16, 1), "float32")
    geo = ((2, 2), (1, 1), (0, 0), (1, 1))
    return {
        "save_z": SaveZSpec(_mm(), y),
        "recompute_mm": RecomputeGradSpec(_mm(), y, y, db),
        "recompute_conv": RecomputeGradSpec(_conv(), c4(2, 8, 9, 9), c4(2, 8, 9, 9), None),
        "act_grad": ActGradSpec(y, y, y, "leaky_relu", 0.2, db),
        "dgrad": ConvDgradSpec(c4(2, 8, 5, 5), c4(8, 4, 3, 3), c4(2, 4, 9, 9), *geo),
        "wgrad": ConvWgradSpec(c4(2, 4, 9, 9), c4(2, 8, 5, 5), c4(8, 4, 3, 3), *geo),
        "sdpa_train": SdpaTrainSpec(q, q, q, q, st, None, True, 0.125),
        "sdpa_bwd": SdpaBwdSpec(q, q, q, q, q, st, q, q, q, c4(1, 1, 16, 16), False, 0.125),
    }


# ------------------------------------------------------------------ specs


@pytest.mark.parametrize("name", list(_specs()))
def test_training_specs_round_trip_through_json(name):
    spec = _specs()[name]
    back = spec_from_dict(json.loads(spec.canonical_json()))
    assert back == spec and back.digest() == spec.digest()


def test_training_specs_have_distinct_digests_and_keep_the_forward_digest():
    specs = _specs()
    assert len({s.digest() for s in specs.values()}) == len(specs)
    # wrapping a forward spec never changes the forward's own key
    assert specs["save_z"].fwd.digest() == _mm().digest()
    assert specs["save_z"].digest() != _mm().digest()
    assert json.loads(specs["save_z"].canonical_json())["fwd"]["op"] == "matmul"


def test_act_grad_spec_normalises_the_slope_and_checks_the_activation():
    y = TensorSpec.contiguous((1, 4, 4), BF)
    assert ActGradSpec(y, y, y, "gelu", 0.3) == ActGradSpec(y, y, y, "gelu", 0.01)
    with pytest.raises(ValueError, match="activation"):
        ActGradSpec(y, y, y, "mish")


# ------------------------------------------------------------------ builders


NODES = {
    "save_z": ["matmul", "bias_add", "gelu.0"],
    "recompute_mm": ["matmul", "bias_add", "act_backward", "dbias"],
    "recompute_conv": ["conv", "bias_add", "act_backward"],
    "act_grad": ["act_backward", "dbias"],
    "dgrad": ["dgrad"],
    "wgrad": ["wgrad"],
    "sdpa_train": ["sdpa"],
    "sdpa_bwd": ["sdpa_backward"],
}


@pytest.mark.parametrize("name", list(_specs()))
def test_training_builders_nodes_and_fixed_uids(name):
    spec = _specs()[name]
    ir = build_graph(spec).inspect()
    assert [n["name"] for n in ir["nodes"]] == NODES[name]
    io = {n: t for n, t in ir["tensors"].items() if not t["is_virtual"]}
    # every role is a real tensor with its fixed uid, and nothing else is
    assert {n: t["uid"] for n, t in io.items()} == {r: UIDS[r] for r in roles_of(spec)}
    assert uids_of(spec) == tuple(UIDS[r] for r in roles_of(spec))
    for role in roles_of(spec):
        t = _geometry(spec, role)
        assert (tuple(io[role]["dim"]), tuple(io[role]["stride"])) == (t.shape, t.stride), role


def test_activation_backward_modes():
    modes = {}
    for act in ("relu", "gelu", "gelu_tanh", "silu", "tanh", "sigmoid", "leaky_relu"):
        y = TensorSpec.contiguous((1, 8, 8), BF)
        node = build_graph(ActGradSpec(y, y, y, act, 0.2)).inspect()["nodes"][0]
        modes[act] = (node["params"]["mode"], node["params"].get("negative_slope"), node["params"].get("swish_beta"))
    assert modes == {"relu": ("relu_backward", None, None), "gelu": ("gelu_backward", None, None),
                     "gelu_tanh": ("gelu_approx_tanh_backward", None, None), "silu": ("swish_backward", None, 1.0),
                     "tanh": ("tanh_backward", None, None), "sigmoid": ("sigmoid_backward", None, None),
                     "leaky_relu": ("leaky_relu_backward", 0.2, None)}


def test_sdpa_training_forward_asks_for_stats():
    ir = build_graph(_specs()["sdpa_train"]).inspect()
    assert ir["nodes"][0]["params"].get("generate_stats") is True


# ------------------------------------------------------------------ a torch executor for specs


def _geometry(spec, role) -> TensorSpec:
    for holder in (spec, getattr(spec, "fwd", None)):
        if holder is None:
            continue
        if hasattr(holder, role) and isinstance(getattr(holder, role), TensorSpec):
            return getattr(holder, role)
        epi = getattr(holder, "epilogue", None)
        if epi is not None and isinstance(getattr(epi, role, None), TensorSpec):
            return getattr(epi, role)
    raise KeyError(role)


def _act_grad(z, dy, act, slope):
    z = z.detach().float().requires_grad_()
    with torch.enable_grad():
        return torch.autograd.grad(reference.activation(z, act, slope), z, dy.float())[0]


def _forward_z(fwd, t):
    if isinstance(fwd, ConvSpec):
        z = reference.conv2d_padded(t["x"].float(), t["w"].float(), None, fwd.stride, fwd.pre_padding,
                                    fwd.post_padding, fwd.dilation, fwd.groups)
    else:
        z = t["a"].float() @ t["b"].float()
    if "bias" in t:
        z = z + t["bias"].float()
    if "residual" in t:
        z = z + t["residual"].float()
    return z


def _pad(spec):
    assert spec.pre_padding == spec.post_padding, "the test executor pads symmetrically"
    return dict(stride=spec.stride, padding=spec.pre_padding, dilation=spec.dilation)


def _sdpa_ref(t, spec):
    q, k, v = (t[r].float() for r in "qkv")
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) * spec.scale + (t["bias"].float() if "bias" in t else 0)
    if spec.is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s, v


def torch_exec(spec, buffers):
    """Run ``spec`` on ``buffers`` with torch, after checking the buffers follow
    roles_of(spec) and each one's shape and strides are the spec's."""
    roles = roles_of(spec)
    assert len(buffers) == len(roles)
    t = dict(zip(roles, buffers))
    for r, buf in t.items():
        g = _geometry(spec, r)
        # a stride of a size-1 dim is never read (the forward's bias spec writes K there too)
        strides = tuple(st for st, n in zip(buf.stride(), buf.shape) if n > 1)
        assert strides == tuple(st for st, n in zip(g.stride, g.shape) if n > 1), r
        assert (tuple(buf.shape), str(buf.dtype)[6:]) == (g.shape, g.dtype), r
    out = {}
    if isinstance(spec, MatmulSpec):
        out["y"] = t["a"].float() @ t["b"].float()
    elif isinstance(spec, SaveZSpec):
        out["z"] = _forward_z(spec.fwd, t)
        out["y"] = reference.activation(out["z"], spec.fwd.epilogue.activation, spec.fwd.epilogue.negative_slope)
    elif isinstance(spec, (RecomputeGradSpec, ActGradSpec)):
        if isinstance(spec, ActGradSpec):
            src, act, slope = t["src"], spec.activation, spec.negative_slope
        else:
            src, act, slope = _forward_z(spec.fwd, t), spec.fwd.epilogue.activation, spec.fwd.epilogue.negative_slope
        out["dz"] = _act_grad(src, t["dy"], act, slope)
        if "dbias" in t:
            out["dbias"] = out["dz"].sum([i for i, n in enumerate(spec.dbias.shape) if n == 1], keepdim=True)
    elif isinstance(spec, ConvDgradSpec):  # the groups are implied by the shapes, as cuDNN reads them
        g = spec.dx.shape[1] // spec.w.shape[1]
        out["dx"] = torch.nn.grad.conv2d_input(spec.dx.shape, t["w"].float(), t["dy"].float(), groups=g, **_pad(spec))
    elif isinstance(spec, ConvWgradSpec):
        g = spec.x.shape[1] // spec.dw.shape[1]
        out["dw"] = torch.nn.grad.conv2d_weight(t["x"].float(), spec.dw.shape, t["dy"].float(), groups=g,
                                                **_pad(spec))
    elif isinstance(spec, SdpaTrainSpec):
        s, v = _sdpa_ref(t, spec)
        out["o"], out["stats"] = s.softmax(-1) @ v, s.logsumexp(-1, keepdim=True)
    elif isinstance(spec, SdpaBwdSpec):
        leaves = {r: t[r].detach().float().requires_grad_() for r in "qkv"}
        with torch.enable_grad():
            s, v = _sdpa_ref({**t, **leaves}, spec)
            dq, dk, dv = torch.autograd.grad(s.softmax(-1) @ v, [leaves[r] for r in "qkv"], t["do"].float())
        out.update(dq=dq, dk=dk, dv=dv)
    else:
        raise AssertionError(type(spec))
    for r, v in out.items():
        t[r].copy_(v)


class Runner:
    """Stands in for backward._try; ``decline`` says which specs cuDNN 'declines'."""

    def __init__(self, decline=lambda spec: False):
        self.decline, self.ran, self.declined = decline, [], []

    def __call__(self, op, spec, buffers, quiet=False):
        if self.decline(spec):
            self.declined.append(spec.op)
            return False
        torch_exec(spec, buffers)
        self.ran.append(spec.op)
        return True


class ExecPlan:
    """A 'built' plan whose run is torch_exec (for the backward programs, which hold plans)."""

    raw = False

    def __init__(self, spec, runner):
        self.spec, self.runner = spec, runner

    def run(self, buffers):
        torch_exec(self.spec, list(buffers))
        self.runner.ran.append(self.spec.op)


@pytest.fixture
def cudnn_on_cpu(monkeypatch):
    """The cuDNN backward path on CPU bf16 tensors, graphs run by torch_exec (through _try, and
    through loader.get_plan for the replayed programs; ``runner.asked`` counts get_plan calls)."""
    from cudnn_fuse import loader

    torch.manual_seed(0)
    runner = Runner()
    runner.asked = []

    def get_plan(spec, device):
        runner.asked.append(spec.op)
        if runner.decline(spec):
            runner.declined.append(spec.op)
            raise UnsupportedError("declined by the test")
        return ExecPlan(spec, runner)

    loader.clear()  # no program or plan kept from another test's stand-ins
    monkeypatch.setattr(backward, "_try", runner)
    monkeypatch.setattr(loader, "get_plan", get_plan)
    monkeypatch.setattr(backward, "usable", lambda *ts: all(t.dtype in backward._DT for t in ts if t is not None))
    monkeypatch.setattr(backward, "sdpa_train_usable", lambda *ts: True)
    yield runner
    loader.clear()


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def grads_of(fn, inputs):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    y.backward(torch.ones_like(y) * torch.linspace(-1, 1, y.numel()).view(y.shape).to(y.dtype))
    return [lf.grad for lf in leaves]


def compare(fn, ref_fn, inputs, tol=2e-2):
    """Gradients in bf16 against fp32 autograd; the bound is max(tol, 2 x torch's
    own bf16 error), since a kink (ReLU) flips where bf16 rounding moves z."""
    ours = grads_of(fn, [t.to(torch.bfloat16) for t in inputs])
    refs = grads_of(ref_fn, [t.to(torch.bfloat16).float() for t in inputs])
    torch_bf16 = grads_of(ref_fn, [t.to(torch.bfloat16) for t in inputs])
    for a, b, t in zip(ours, refs, torch_bf16):
        assert a.dtype == torch.bfloat16 and a.shape == b.shape
        assert rel(a, b) <= max(tol, 2 * rel(t, b))


ACTS = [None, "relu", "gelu", "silu", "tanh", "leaky_relu"]


@pytest.mark.parametrize("act", ACTS)
def test_linear_backward_plumbing(cudnn_on_cpu, act):
    x, w, b, r = torch.randn(2, 6, 32), torch.randn(24, 32) / 5, torch.randn(24), torch.randn(2, 6, 24)
    compare(lambda x, w, b, r: cf.linear(x, w, b, activation=act, residual=r),
            lambda x, w, b, r: reference.activation(F.linear(x, w, b) + r, act), (x, w, b, r))
    if act in (None,):
        assert cudnn_on_cpu.ran == ["matmul", "matmul"]
    elif act == "relu":
        assert cudnn_on_cpu.ran == ["act_grad", "matmul", "matmul"]  # from the saved output
    else:
        assert cudnn_on_cpu.ran == ["recompute_grad", "matmul", "matmul"]


@pytest.mark.parametrize("shapes", [((3, 8, 16), (16, 12)), ((3, 8, 16), (3, 16, 12)), ((8, 16), (3, 16, 12)),
                                    ((2, 3, 8, 16), (16, 12)), ((16,), (3, 16, 12)), ((3, 8, 16), (16,))])
def test_matmul_backward_plumbing(cudnn_on_cpu, shapes):
    a, b = torch.randn(*shapes[0]), torch.randn(*shapes[1]) / 4
    compare(lambda a, b: cf.matmul(a, b, activation="gelu"), lambda a, b: F.gelu(a @ b), (a, b))


def test_matmul_backward_with_bias(cudnn_on_cpu):
    a, b, bias = torch.randn(3, 8, 16), torch.randn(16, 12) / 4, torch.randn(12)
    compare(lambda a, b, c: cf.matmul(a, b, c, activation="silu"), lambda a, b, c: F.silu(a @ b + c), (a, b, bias))


def test_linear_save_z_plumbing(cudnn_on_cpu):
    m = cf.nn.Linear(32, 24, activation="gelu", recompute=False)
    x = torch.randn(5, 32)
    compare(lambda x, w, b: torch_ops.linear_save_z(x, w, b, "gelu", None, 0.01),
            lambda x, w, b: F.gelu(F.linear(x, w, b)), (x, m.weight, m.bias))
    assert cudnn_on_cpu.ran == ["save_z", "act_grad", "matmul", "matmul"]


def _mlp_inputs(bias=True, residual=False):
    torch.manual_seed(1)
    x, w1, w2 = torch.randn(2, 5, 32), torch.randn(48, 32) / 5, torch.randn(24, 48) / 6
    b1, b2 = (torch.randn(48), torch.randn(24)) if bias else (None, None)
    r = torch.randn(2, 5, 24) if residual else None
    return x, w1, b1, w2, b2, r


def _mlp_ref(act):
    def ref(x, w1, b1, w2, b2, r=None):
        out = F.linear(reference.activation(F.linear(x, w1, b1), act), w2, b2)
        return out if r is None else out + r
    return ref


@pytest.mark.parametrize("act", ["gelu", "silu", "leaky_relu", "gelu_tanh"])
@pytest.mark.parametrize("residual", [False, True])
def test_mlp_runs_eagers_kernels_in_one_node(cudnn_on_cpu, act, residual):
    """The block's one node runs eager's kernels, forward and backward, even where cuDNN would take
    every graph (a residual goes through the second layer's fused linear); the gradients are
    autograd's."""
    x, w1, b1, w2, b2, r = _mlp_inputs(residual=residual)
    inputs = (x, w1, b1, w2, b2) + ((r,) if residual else ())
    compare(lambda *t: torch_ops.mlp(*t[:5], act, t[5] if residual else None, 0.01), _mlp_ref(act), inputs)
    assert "act_grad" not in cudnn_on_cpu.asked and "save_z" not in cudnn_on_cpu.asked


def test_mlp_backward_computes_only_the_gradients_asked_for():
    x, w1, b1, w2, b2, _ = _mlp_inputs()
    x, w1, b1, w2, b2 = (t.to(torch.bfloat16) for t in (x, w1, b1, w2, b2))
    w2 = w2.requires_grad_()  # only the second layer's weight trains: no gradient reaches the first layer
    torch_ops.mlp(x, w1, b1, w2, b2, "gelu", None, 0.01).sum().backward()
    assert w2.grad is not None and w2.grad.shape == w2.shape and w1.grad is None and x.grad is None
    x.requires_grad_()
    w2.grad = None
    torch_ops.mlp(x, w1, b1, w2, b2, "gelu", None, 0.01).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape and w1.grad is None and b1.grad is None


def test_dbias_declined_in_the_graph_falls_back_to_a_sum(monkeypatch, cudnn_on_cpu):
    cudnn_on_cpu.decline = lambda spec: getattr(spec, "dbias", None) is not None
    x, w, b = torch.randn(6, 32), torch.randn(24, 32) / 5, torch.randn(24)
    compare(lambda x, w, b: cf.linear(x, w, b, activation="gelu"), lambda x, w, b: F.gelu(F.linear(x, w, b)), (x, w, b))
    assert cudnn_on_cpu.declined == ["recompute_grad"] and cudnn_on_cpu.ran[0] == "recompute_grad"


def test_everything_declined_runs_the_reference(cudnn_on_cpu):
    cudnn_on_cpu.decline = lambda spec: True
    x, w, b = torch.randn(6, 32), torch.randn(24, 32) / 5, torch.randn(24)
    compare(lambda x, w, b: cf.linear(x, w, b, activation="gelu"), lambda x, w, b: F.gelu(F.linear(x, w, b)), (x, w, b))
    assert cudnn_on_cpu.ran == []


def test_declined_matmul_product_uses_torch(cudnn_on_cpu):
    cudnn_on_cpu.decline = lambda spec: isinstance(spec, MatmulSpec)
    x, w, b = torch.randn(6, 32), torch.randn(24, 32) / 5, torch.randn(24)
    compare(lambda x, w, b: cf.linear(x, w, b, activation="tanh"), lambda x, w, b: torch.tanh(F.linear(x, w, b)),
            (x, w, b))
    assert cudnn_on_cpu.ran == ["recompute_grad"]


@pytest.mark.parametrize("act", [None, "relu", "silu"])
@pytest.mark.parametrize("layout", ["nchw", "channels_last", "unbatched"])
def test_conv_backward_plumbing(cudnn_on_cpu, act, layout):
    x, w, b = torch.randn(2, 4, 9, 9), torch.randn(8, 4, 3, 3) / 6, torch.randn(8)
    if layout == "channels_last":
        x, w = x.to(memory_format=torch.channels_last), w.to(memory_format=torch.channels_last)
    elif layout == "unbatched":
        x = x[0]
    compare(lambda x, w, b: cf.conv2d(x, w, b, stride=2, padding=1, activation=act),
            lambda x, w, b: reference.activation(F.conv2d(x, w, b, stride=2, padding=1), act), (x, w, b))
    first = {None: [], "relu": ["act_grad"], "silu": ["recompute_grad"]}[act]
    assert cudnn_on_cpu.ran == first + ["conv_dgrad", "conv_wgrad"]


def _cl(*ts):
    return [t.to(torch.bfloat16).to(memory_format=torch.channels_last) if t.dim() == 4 else t.to(torch.bfloat16)
            for t in ts]


def _conv_step(x, w, b, act="relu", residual=None, gy=None):
    """One cf conv2d forward + backward on fresh leaves; their gradients (None where not asked)."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in (x, w, b)]
    y = cf.conv2d(*leaves, padding=1, activation=act, residual=residual)
    if gy is None:  # the layout a channels_last network's gradients arrive in
        gy = torch.linspace(-1, 1, y.numel()).view(y.shape).to(y.dtype).contiguous(memory_format=torch.channels_last)
    y.backward(gy)
    return [t.grad for t in leaves]


def _torch_grads(x, w, b, act="relu", gy=None, dtype=torch.float32):
    leaves = [t.detach().to(dtype).requires_grad_(t.requires_grad) for t in (x, w, b)]
    y = reference.activation(F.conv2d(*leaves, padding=1), act)
    y.backward(gy.to(dtype) if gy is not None else torch.linspace(-1, 1, y.numel()).view(y.shape).to(dtype))
    return [t.grad for t in leaves]


def _general_path(monkeypatch, x, w, b, act="relu", gy=None):
    """_conv_step's gradients with the programs off: the path each program must reproduce."""
    with monkeypatch.context() as m:
        m.setattr(backward, "conv_program", lambda *a, **k: None)
        return _conv_step(x, w, b, act, gy=gy)


def _same(ours, theirs):
    for a, c in zip(ours, theirs):
        assert (a is None and c is None) or torch.equal(a, c)


def _close(ours, x, w, b, act="relu", gy=None, tol=1e-2):
    """Each gradient against fp32 autograd, within max(tol, 2 x torch's own bf16 error) (bf16
    rounding can move a z across ReLU's kink)."""
    refs, theirs = _torch_grads(x, w, b, act, gy), _torch_grads(x, w, b, act, gy, torch.bfloat16)
    for a, r, t in zip(ours, refs, theirs):
        assert (a is None) == (r is None)
        if a is not None:
            assert a.dtype == torch.bfloat16 and a.shape == r.shape and rel(a, r) <= max(tol, 2 * rel(t, r))


@pytest.mark.parametrize("act", [None, "relu"])
def test_conv_backward_program_is_built_once_and_replayed(cudnn_on_cpu, monkeypatch, act):
    """A batched channels_last conv's backward is one remembered program per signature: its
    first call asks for the three plans, every later call launches them and asks for nothing."""
    x, w, b = _cl(torch.randn(2, 4, 9, 9), torch.randn(8, 4, 3, 3) / 6, torch.randn(8))
    for t in (x, w, b):
        t.requires_grad_()
    first = _conv_step(x, w, b, act)
    asked = list(cudnn_on_cpu.asked)
    assert asked == (["act_grad"] if act else []) + ["conv_dgrad", "conv_wgrad"]
    cudnn_on_cpu.ran.clear()
    for _ in range(2):
        again = _conv_step(x, w, b, act)
        for a, c in zip(first, again):
            assert torch.equal(a, c)
    assert cudnn_on_cpu.asked == asked  # replayed: no spec made, no plan asked for
    assert cudnn_on_cpu.ran == 2 * ((["act_grad"] if act else []) + ["conv_dgrad", "conv_wgrad"])
    _same(first, _general_path(monkeypatch, x, w, b, act))
    _close(first, x, w, b, act)


def test_conv_backward_program_with_the_bias_reduction_declined_sums_in_torch(cudnn_on_cpu, monkeypatch):
    cudnn_on_cpu.decline = lambda spec: getattr(spec, "dbias", None) is not None
    x, w, b = _cl(torch.randn(2, 4, 9, 9), torch.randn(8, 4, 3, 3) / 6, torch.randn(8))
    for t in (x, w, b):
        t.requires_grad_()
    ours = _conv_step(x, w, b)
    assert cudnn_on_cpu.declined == ["act_grad"] and cudnn_on_cpu.ran == ["act_grad", "conv_dgrad", "conv_wgrad"]
    _same(ours, _general_path(monkeypatch, x, w, b))
    _close(ours, x, w, b)


def test_conv_backward_program_runs_only_the_products_asked_for(cudnn_on_cpu, monkeypatch):
    x, w, b = _cl(torch.randn(2, 4, 9, 9), torch.randn(8, 4, 3, 3) / 6, torch.randn(8))
    w.requires_grad_()  # x and the bias are frozen: no dgrad, no bias reduction
    gx, gw, gb = _conv_step(x, w, b)
    assert gx is None and gb is None and cudnn_on_cpu.ran == ["act_grad", "conv_wgrad"]
    _same([gx, gw, gb], _general_path(monkeypatch, x, w, b))
    _close([gx, gw, gb], x, w, b)


@pytest.mark.parametrize("act", [None, "relu"])
def test_conv_backward_program_converts_a_gradient_in_another_layout(cudnn_on_cpu, monkeypatch, act):
    """An NCHW gradient into a channels_last conv (what a loss hands the last layer) is its own
    signature: a program that converts it first, as the general path does, and gives its results;
    the channels_last gradient keeps its own program."""
    x, w, b = _cl(torch.randn(2, 4, 9, 9), torch.randn(8, 4, 3, 3) / 6, torch.randn(8))
    for t in (x, w, b):
        t.requires_grad_()
    gy = torch.randn(2, 8, 9, 9).to(torch.bfloat16)  # contiguous (NCHW)
    ours = _conv_step(x, w, b, act, gy=gy)
    pieces = (["act_grad"] if act else []) + ["conv_dgrad", "conv_wgrad"]
    assert cudnn_on_cpu.asked == pieces and cudnn_on_cpu.ran == pieces
    _same(ours, _conv_step(x, w, b, act, gy=gy))
    assert cudnn_on_cpu.asked == pieces  # replayed
    _same(ours, _general_path(monkeypatch, x, w, b, act, gy=gy))
    _close(ours, x, w, b, act, gy=gy)
    _conv_step(x, w, b, act, gy=gy.contiguous(memory_format=torch.channels_last))
    assert len(cudnn_on_cpu.asked) == 2 * len(pieces)  # another signature, another program


@pytest.mark.parametrize("layouts", ["x nchw", "x and w nchw"])
def test_conv_backward_program_converts_an_nchw_input_or_weight_as_the_forward_did(cudnn_on_cpu, monkeypatch,
                                                                                    layouts):
    """Under the "convert" policy the forward ran an NCHW x (a network's first layer) or weight
    (cf.nn.Conv2d outside optimize()) as channels_last copies: the program converts them the same
    way, and gives the general path's gradients."""
    from cudnn_fuse import ops

    monkeypatch.setattr(ops, "conv_out_channels_last", lambda t: t.dim() == 4)  # as on a GPU: a channels_last y
    x, w, b = _cl(torch.randn(2, 4, 9, 9), torch.randn(8, 4, 3, 3) / 6, torch.randn(8))
    x = x.contiguous()
    if layouts == "x and w nchw":
        w = w.contiguous()
    for t in (x, w, b):
        t.requires_grad_()
    ours = _conv_step(x, w, b)
    assert cudnn_on_cpu.asked == ["act_grad", "conv_dgrad", "conv_wgrad"]
    _same(ours, _conv_step(x, w, b))
    assert len(cudnn_on_cpu.asked) == 3  # replayed
    _same(ours, _general_path(monkeypatch, x, w, b))
    _close(ours, x, w, b)
    prog = next(v for k, v in backward.plans.FAST.items() if isinstance(k, tuple) and k[0] == "convprog")
    assert prog.x_format == torch.channels_last and (prog.w_format is not None) == (layouts == "x and w nchw")


@pytest.mark.parametrize("case", ["stride2", "dilation2", "groups2", "depthwise", "1x1", "no-bias", "x-only",
                                  "5x5-pad2"])
@pytest.mark.parametrize("act", [None, "relu"])
def test_conv_backward_program_equals_the_general_path_across_geometries(cudnn_on_cpu, monkeypatch, case, act):
    torch.manual_seed(5)
    C, K, R, kw = 8, 12, 3, dict(padding=1)
    if case == "stride2":
        kw = dict(stride=2, padding=1)
    elif case == "dilation2":
        kw = dict(dilation=2, padding=2)
    elif case == "groups2":
        kw = dict(groups=2, padding=1)
    elif case == "depthwise":
        K, kw = 8, dict(groups=8, padding=1)
    elif case == "1x1":
        R, kw = 1, dict(padding=0)
    elif case == "5x5-pad2":
        R, kw = 5, dict(padding=2)
    groups = kw.get("groups", 1)
    x, w, b = _cl(torch.randn(2, C, 11, 11), torch.randn(K, C // groups, R, R) / (R * 3), torch.randn(K))
    x.requires_grad_(True)
    w.requires_grad_(case != "x-only")
    b.requires_grad_(case != "x-only")
    bias = None if case == "no-bias" else b

    def step():
        leaves = [t.detach().clone().requires_grad_(t.requires_grad) if t is not None else None for t in (x, w, bias)]
        y = cf.conv2d(*leaves, activation=act, **kw)
        y.backward(torch.linspace(-1, 1, y.numel()).view(y.shape).to(y.dtype).contiguous(memory_format=torch.channels_last))
        return [t.grad if t is not None else None for t in leaves]

    ours = step()
    assert cudnn_on_cpu.asked, "the program was not built"
    again = step()
    with monkeypatch.context() as m:
        m.setattr(backward, "conv_program", lambda *a, **k: None)
        general = step()
    _same(ours, again)
    _same(ours, general)
    if case == "x-only":
        assert ours[1] is None and ours[2] is None and "conv_wgrad" not in cudnn_on_cpu.asked


def test_conv_backward_program_gives_the_residual_its_gradient(cudnn_on_cpu):
    x, w, b = _cl(torch.randn(2, 4, 9, 9), torch.randn(8, 4, 3, 3) / 6, torch.randn(8))
    r = _cl(torch.randn(2, 8, 9, 9))[0].requires_grad_()
    for t in (x, w):
        t.requires_grad_()
    y = cf.conv2d(x, w, b, padding=1, activation="relu", residual=r)
    gy = torch.linspace(-1, 1, y.numel()).view(y.shape).to(y.dtype).contiguous(memory_format=torch.channels_last)
    y.backward(gy)
    assert cudnn_on_cpu.asked == ["act_grad", "conv_dgrad", "conv_wgrad"]
    rf = r.detach().float().requires_grad_()
    F.relu(F.conv2d(x.detach().float(), w.detach().float(), b.float(), padding=1) + rf).backward(gy.float())
    assert r.grad.dtype == torch.bfloat16 and rel(r.grad, rf.grad) < 1e-2


def test_conv_backward_under_record_takes_the_general_path_and_records_its_graphs(monkeypatch, tmp_path):
    """A signature with a program still records its backward graphs under cf.record: the
    recorded step takes the general path (through the real _try, which records)."""
    from cudnn_fuse import manifest, plans

    ran = []

    class Plan:
        raw = False

        def __init__(self, spec):
            self.spec = spec

        def run(self, buffers):
            torch_exec(self.spec, list(buffers))
            ran.append(self.spec.op)

    loader.clear()
    monkeypatch.setattr(loader, "get_plan", lambda spec, device: Plan(spec))
    monkeypatch.setattr(backward, "usable", lambda *ts: all(t.dtype in backward._DT for t in ts if t is not None))
    x, w, b = _cl(torch.randn(2, 4, 9, 9), torch.randn(8, 4, 3, 3) / 6, torch.randn(8))
    for t in (x, w, b):
        t.requires_grad_()
    first = _conv_step(x, w, b)  # the signature's program exists now
    assert any(isinstance(k, tuple) and k[0] == "convprog" and v is not False for k, v in plans.FAST.items())
    out = tmp_path / "m.json"
    with cf.record(str(out)):
        recorded = _conv_step(x, w, b)
    _same(first, recorded)
    ops_recorded = sorted(e.spec.op for e in manifest.load(str(out)))
    assert ops_recorded == ["act_grad", "conv2d", "conv_dgrad", "conv_wgrad"]  # the forward and the three
    loader.clear()


@pytest.mark.parametrize("groups", [2, 4])
def test_grouped_conv_backward_runs_the_cudnn_graphs(cudnn_on_cpu, groups):
    x, w, b = torch.randn(2, 8, 9, 9), torch.randn(12, 8 // groups, 3, 3) / 4, torch.randn(12)
    x, w = x.to(memory_format=torch.channels_last), w.to(memory_format=torch.channels_last)
    compare(lambda x, w, b: cf.conv2d(x, w, b, padding=1, groups=groups, activation="relu"),
            lambda x, w, b: F.relu(F.conv2d(x, w, b, padding=1, groups=groups)), (x, w, b))
    assert cudnn_on_cpu.ran == ["act_grad", "conv_dgrad", "conv_wgrad"]


def test_conv_backward_declined_dgrad_uses_torch(cudnn_on_cpu):
    cudnn_on_cpu.decline = lambda spec: isinstance(spec, ConvDgradSpec)
    x, w, b, r = torch.randn(2, 4, 9, 9), torch.randn(8, 4, 3, 3) / 6, torch.randn(8), torch.randn(2, 8, 9, 9)
    compare(lambda x, w, b, r: cf.conv2d(x, w, b, padding=1, activation="relu", residual=r),
            lambda x, w, b, r: F.relu(F.conv2d(x, w, b, padding=1) + r), (x, w, b, r))
    assert cudnn_on_cpu.ran == ["act_grad", "conv_wgrad"]


@pytest.mark.parametrize("case", ["causal-gqa", "mask", "bshd", "3d"])
def test_sdpa_backward_plumbing(cudnn_on_cpu, monkeypatch, case):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # torch_ops.sdpa picks the train op
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    kw, rep = {}, 1
    if case == "causal-gqa":
        k, v, kw, rep = k[:, :2].contiguous(), v[:, :2].contiguous(), dict(is_causal=True, enable_gqa=True), 2
    elif case == "mask":
        kw = dict(attn_mask=torch.rand(2, 1, 16, 16) > 0.3)
    elif case == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    else:
        q, k, v = q[0], k[0], v[0]

    def ref(q, k, v):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3),
                                              attn_mask=kw.get("attn_mask"), is_causal=kw.get("is_causal", False))

    compare(lambda q, k, v: torch_ops.sdpa(q, k, v, kw.get("attn_mask"), 0.0, kw.get("is_causal", False), None,
                                           kw.get("enable_gqa", False)), ref, (q, k, v))
    assert cudnn_on_cpu.ran == ["sdpa_train", "sdpa_backward"]


def _sdpa_ref_grads(q, k, v, **kw):
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*leaves, **kw).backward(torch.ones(q.shape))
    return [t.grad for t in leaves]


@pytest.mark.parametrize("via", ["function", "dispatcher"])
def test_sdpa_backward_after_a_declined_training_forward_is_torchs(cudnn_on_cpu, monkeypatch, via):
    """Either forward returns stats of the fake's shape; which backward runs follows which forward
    wrote them, not their shape: after torch's forward (cuDNN declined the training graph) the stats
    are no logsumexp, and cuDNN's backward, which would read them, is never asked."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # torch_ops.sdpa picks the train op
    cudnn_on_cpu.decline = lambda spec: spec.op in ("sdpa_train", "sdpa")
    q, k, v = (torch.randn(2, 4, 16, 8, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    if via == "function":
        o = torch_ops.sdpa(q, k, v, None, 0.0, True, None, False)
    else:
        o, stats = torch.ops.cudnn_fuse.scaled_dot_product_attention_train(q, k, v, None, True, None, False)
        assert stats.shape == (2, 4, 16, 1) and stats.dtype == torch.float32
    o.backward(torch.ones_like(o))
    assert cudnn_on_cpu.declined[0] == "sdpa_train" and cudnn_on_cpu.ran == []
    for got, want in zip((q.grad, k.grad, v.grad), _sdpa_ref_grads(q, k, v, is_causal=True)):
        assert rel(got, want) < 2e-2


def test_sdpa_training_op_through_the_dispatcher_keeps_cudnns_backward(cudnn_on_cpu, monkeypatch):
    """The mark of cuDNN's stats reaches the backward through the custom op's own autograd (opcheck's and
    torch.ops' path) as through the eager Function: its backward reads them."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    q, k, v = (torch.randn(2, 4, 16, 8, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    o, stats = torch.ops.cudnn_fuse.scaled_dot_product_attention_train(q, k, v, None, False, None, False)
    s = (q.detach().float() @ k.detach().float().transpose(-1, -2)) / 8 ** 0.5
    torch.testing.assert_close(stats, s.logsumexp(-1, keepdim=True))
    o.backward(torch.ones_like(o))
    assert cudnn_on_cpu.ran == ["sdpa_train", "sdpa_backward"]
    for got, want in zip((q.grad, k.grad, v.grad), _sdpa_ref_grads(q, k, v)):
        assert rel(got, want) < 2e-2


# ------------------------------------------------------------------ the CPU path itself


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("act", ["gelu", "silu", "relu"])
def test_linear_module_gradients_on_cpu_match_torch(act, recompute):
    torch.manual_seed(0)
    ref = torch.nn.Linear(16, 12).double()
    m = cf.nn.Linear(16, 12, activation=act, recompute=recompute).double()
    m.load_state_dict(ref.state_dict())
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    m(x).square().sum().backward()
    reference.activation(ref(x2), act).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(m.weight.grad, ref.weight.grad)
    torch.testing.assert_close(m.bias.grad, ref.bias.grad)


def test_linear_save_z_gradcheck_and_residual():
    x, w, b, r = (torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in ((3, 6), (4, 6), (4,), (3, 4)))
    assert torch.autograd.gradcheck(lambda *a: torch_ops.linear_save_z(*a[:3], "silu", a[3], 0.01), (x, w, b, r))


def test_linear_module_validates_on_the_save_z_path():
    m = cf.nn.Linear(16, 12, activation="gelu")
    with pytest.raises(ValueError, match="in_features"):
        m(torch.randn(3, 15, requires_grad=True))
    with pytest.raises(ValueError, match="residual"):
        m(torch.randn(3, 16, requires_grad=True), residual=torch.randn(3, 11))


def test_backward_is_not_usable_on_cpu_or_fp32():
    assert not backward.usable(torch.randn(2, 2, dtype=torch.bfloat16))
    assert not backward.usable(torch.randn(2, 2))


def test_opcheck_linear_save_z():
    args = (torch.randn(3, 6, requires_grad=True), torch.randn(4, 6, requires_grad=True), torch.randn(4), "gelu", None,
            0.01)
    torch.library.opcheck(torch_ops.linear_save_z_op, args)


def test_unsupported_error_is_what_try_catches(monkeypatch):

    def declined(spec, device):
        raise UnsupportedError("no engine")

    monkeypatch.setattr(loader, "get_plan", declined)
    t = torch.empty(1)
    assert backward._try("matmul_backward", _mm(), [t]) is False


def test_cached_specs_keep_their_plan_and_declines_are_asked_again(monkeypatch):
    from cudnn_fuse import loader

    class FakePlan:
        def __init__(self):
            self.runs = 0

        def run(self, buffers):
            self.runs += 1

    asked, decline = [], {"now": False}
    plan = FakePlan()

    def get_plan(spec, device):
        asked.append(spec)
        if decline["now"]:
            raise UnsupportedError("no engine")
        return plan

    monkeypatch.setattr(loader, "get_plan", get_plan)
    loader.clear()
    a, b = torch.empty(2, 4, 8), torch.empty(2, 8, 3)
    made = []

    def spec_of(bufs):
        return backward._cached_spec("mm", (), bufs, lambda: made.append(1) or _mm())

    s1 = spec_of((a, b))
    assert backward._try("matmul_backward", s1, [a]) and backward._try("matmul_backward", spec_of((a, b)), [a])
    assert len(made) == 1 and len(asked) == 1 and plan.runs == 2  # built once, looked up once, ran twice
    # other strides are another signature: another spec, asked for its own plan
    s2 = spec_of((a.transpose(1, 2).contiguous().transpose(1, 2), b))
    assert s2 is not s1 and backward._try("matmul_backward", s2, [a]) and len(asked) == 2
    # a spec not from the cache is asked every time (no slot: its id could be reused)
    backward._try("matmul_backward", _mm(), [a])
    backward._try("matmul_backward", _mm(), [a])
    assert len(asked) == 4
    # a declined cached spec keeps no plan: the next call asks again (the LRU remembers the decline)
    loader.clear()
    decline["now"] = True
    s3 = spec_of((a, b))
    assert not backward._try("matmul_backward", s3, [a], quiet=True)
    assert not backward._try("matmul_backward", s3, [a], quiet=True)
    assert asked[-2:] == [s3, s3]
    loader.clear()


@pytest.mark.parametrize("gemm_dbias", [False, True])
def test_gemm_bias_gradient_from_a_saved_z_either_way(cudnn_on_cpu, monkeypatch, gemm_dbias):
    """The saved-z path's bias gradient: a torch sum (the default) or the reduction fused into the
    act-grad graph; the same gradients either way."""
    monkeypatch.setattr(backward, "GEMM_FUSE_DBIAS", gemm_dbias)
    seen = []
    real = cudnn_on_cpu.__call__

    def spy(op, spec, buffers, quiet=False):
        if spec.op == "act_grad":
            seen.append(getattr(spec, "dbias", None) is not None)
        return real(op, spec, buffers, quiet)

    monkeypatch.setattr(backward, "_try", spy)
    m = cf.nn.Linear(32, 24, activation="gelu", recompute=False)
    compare(lambda x, w, b: torch_ops.linear_save_z(x, w, b, "gelu", None, 0.01),
            lambda x, w, b: F.gelu(F.linear(x, w, b)), (torch.randn(5, 32), m.weight, m.bias))
    assert seen == [gemm_dbias]


def test_eager_autograd_runs_without_the_dispatcher(monkeypatch):
    """Eager autograd goes through a plain autograd.Function with the custom op's formulas;
    the registered custom op (torch.compile's path) is not called."""
    def boom(*a, **k):
        raise AssertionError("the custom op ran in eager autograd")

    for name in ("conv2d_op", "linear_op", "matmul_op"):
        monkeypatch.setattr(torch_ops, name, boom)
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    cf.conv2d(x, w, padding=1, activation="gelu").sum().backward()
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    F.gelu(F.conv2d(xr, wr, padding=1)).sum().backward()
    assert torch.allclose(x.grad, xr.grad, atol=1e-5) and torch.allclose(w.grad, wr.grad, atol=1e-5)
    a = torch.randn(4, 5, requires_grad=True)
    cf.linear(a, torch.randn(3, 5), activation="relu").sum().backward()
    cf.matmul(a, torch.randn(5, 3), activation="silu").sum().backward()
    assert a.grad is not None


@pytest.mark.parametrize("name", list(_specs()))
def test_autotune_knows_every_operand_of_the_training_graphs(name):
    """The autotuner makes timing buffers from a spec's geometry: every role of every
    training graph must have one (else tuning those graphs would decline)."""
    from cudnn_fuse import autotune
    from cudnn_fuse.builders import roles_of

    spec = _specs()[name]
    geo = autotune._geometry(spec)
    for role in roles_of(spec):
        assert role in geo, role
        shape, stride, dtype = geo[role]
        assert len(shape) == len(stride) and dtype in ("float16", "bfloat16", "float32")
    if name == "act_grad":
        assert geo["dbias"] == ((1, 1, 48), (48, 48, 1), "float32")
    if name.startswith("recompute"):
        assert geo["dz"][0] == spec.dz.shape and geo["b" if name.endswith("mm") else "w"][0] == \
            (spec.fwd.b if name.endswith("mm") else spec.fwd.w).shape


def test_record_keeps_the_backward_graphs_that_ran(monkeypatch, tmp_path):
    """Under cf.record a training step's backward graphs are recorded (declined variants are not)."""
    from cudnn_fuse import manifest

    class Plan:
        def __init__(self, spec):
            self.spec = spec

        def run(self, buffers):
            torch_exec(self.spec, buffers)

    def get_plan(spec, device):
        if getattr(spec, "dbias", None) is not None:
            raise UnsupportedError("no fused dbias here")
        return Plan(spec)

    monkeypatch.setattr(backward.loader, "get_plan", get_plan)
    monkeypatch.setattr(backward, "usable", lambda *ts: all(t.dtype in backward._DT for t in ts if t is not None))
    x = torch.randn(6, 32, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(24, 32) / 5).to(torch.bfloat16).requires_grad_()
    b = torch.randn(24, dtype=torch.bfloat16, requires_grad=True)
    out = tmp_path / "train.json"
    with cf.record(str(out)):
        cf.linear(x, w, b, activation="gelu").float().sum().backward()
    entries = manifest.load(str(out))
    # the forward (a matmul spec, made as on a GPU), the recompute graph and the two products
    assert sorted(e.spec.op for e in entries) == ["matmul", "matmul", "matmul", "recompute_grad"]
    assert all(getattr(e.spec, "dbias", None) is None for e in entries)
    assert x.grad is not None and b.grad is not None


def test_conv_backward_program_takes_an_expanded_gradient(cudnn_on_cpu, monkeypatch):
    """y.sum().backward() hands the conv a stride-0 (expanded) gradient: the program densifies
    it as the general path does, and gives the same gradients."""
    x, w, b = _cl(torch.randn(2, 4, 9, 9), torch.randn(8, 4, 3, 3) / 6, torch.randn(8))
    for t in (x, w, b):
        t.requires_grad_()

    def step():
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        cf.conv2d(*leaves, padding=1, activation="relu").sum().backward()
        return [t.grad for t in leaves]

    ours = step()
    prog = next(v for k, v in backward.plans.FAST.items() if isinstance(k, tuple) and k[0] == "convprog")
    assert prog is not False and prog.gy_format is not None
    with monkeypatch.context() as m:
        m.setattr(backward, "conv_program", lambda *a, **k: None)
        _same(ours, step())
    _close(ours, x, w, b, gy=torch.ones(2, 8, 9, 9))
