"""torch.autocast: cf's ops cast their arguments as autocast casts F.linear / F.conv2d /
torch.matmul / SDPA's, so mixed-precision models keep working after optimize() (CPU autocast,
bfloat16; the GPU path is tests/test_gpu_autocast.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudnn_fuse as cf
from cudnn_fuse import ops

BF16 = torch.bfloat16


def amp(enabled=True):
    return torch.autocast("cpu", dtype=BF16, enabled=enabled)


def close(a, b, tol=2e-2):
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    a, b = a.double(), b.double()
    assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item()), (a - b).abs().max().item()


def _operands(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(3, 5, 16, generator=g),
        "w": torch.randn(8, 16, generator=g) / 4,
        "b": torch.randn(8, generator=g),
        "r": torch.randn(3, 5, 8, generator=g),
        "img": torch.randn(2, 3, 9, 9, generator=g),
        "k": torch.randn(4, 3, 3, 3, generator=g) / 3,
        "kb": torch.randn(4, generator=g),
        "q": torch.randn(2, 2, 6, 8, generator=g),
        "mask": torch.randn(6, 6, generator=g),
    }


# (cf call, torch's own expression of it) on fp32 operands
CASES = {
    "linear": (lambda o: cf.linear(o["x"], o["w"], o["b"], activation="gelu", residual=o["r"]),
               lambda o: F.gelu(F.linear(o["x"], o["w"], o["b"]) + o["r"].to(BF16))),
    "matmul": (lambda o: cf.matmul(o["x"], o["w"].t(), o["b"], activation="relu"),
               lambda o: F.relu(torch.matmul(o["x"], o["w"].t()) + o["b"].to(BF16))),
    "conv2d": (lambda o: cf.conv2d(o["img"], o["k"], o["kb"], padding=1, activation="silu"),
               lambda o: F.silu(F.conv2d(o["img"], o["k"], o["kb"], padding=1))),
    "sdpa": (lambda o: cf.scaled_dot_product_attention(o["q"], o["q"] * 0.5, o["q"], attn_mask=o["mask"]),
             lambda o: F.scaled_dot_product_attention(o["q"], o["q"] * 0.5, o["q"], attn_mask=o["mask"])),
}


@pytest.mark.parametrize("name", CASES)
def test_an_op_under_autocast_computes_in_its_dtype(name):
    cf_call, torch_call = CASES[name]
    o = _operands()
    with amp():
        y, t = cf_call(o), torch_call(o)
    assert y.dtype == BF16 and t.dtype == BF16
    close(y, t)
    # exactly the op called outside autocast on the operands autocast would cast
    cast = {k: v.to(BF16) for k, v in o.items()}
    assert torch.equal(y, cf_call(cast))


@pytest.mark.parametrize("name", ["linear", "matmul", "conv2d"])
def test_mixed_dtypes_under_autocast_no_longer_raise(name):
    """A bf16 activation meeting fp32 parameters (an autocast model's normal state) ran into the
    ops' dtype check before; outside autocast torch refuses the mix, and cf raises torch's own error
    (dtypes the fused op does not take run torch's expression)."""
    cf_call, torch_call = CASES[name]
    o = _operands()
    mixed = dict(o, x=o["x"].to(BF16), img=o["img"].to(BF16))
    with amp():
        y = cf_call(mixed)
    assert y.dtype == BF16
    assert torch.equal(y, cf_call({k: v.to(BF16) for k, v in o.items()}))
    with pytest.raises(RuntimeError) as theirs:
        torch_call(mixed)
    with pytest.raises(type(theirs.value)) as ours:
        cf_call(mixed)
    assert str(ours.value) == str(theirs.value)


def test_autocast_disabled_or_float64_is_left_alone():
    o = _operands()
    with amp(enabled=False):
        assert cf.linear(o["x"], o["w"], o["b"]).dtype == torch.float32
    x64, w64 = o["x"].double(), o["w"].double()
    with amp():
        y = cf.linear(x64, w64)
        t = F.linear(x64, w64)  # autocast leaves float64 alone; so does cf
    assert y.dtype == torch.float64 == t.dtype
    assert torch.allclose(y, t)


def test_amax_stays_float32_under_autocast():
    o = _operands()
    with amp():
        y, am = cf.linear(o["x"], o["w"], o["b"], activation="relu", return_amax=True)
    assert y.dtype == BF16 and am.dtype == torch.float32
    assert am.item() == pytest.approx(y.float().abs().max().item(), rel=1e-2)


def test_autocast_dtype_reads_the_first_operands_device_type():
    x = torch.randn(2, 2)
    assert ops.autocast_dtype(x) is None
    assert ops.autocast_dtype("not a tensor") is None
    with amp():
        assert ops.autocast_dtype(x) is BF16
        with torch.autocast("cpu", dtype=torch.float16):
            assert ops.autocast_dtype(x) is torch.float16
    cast = ops.autocast_cast(BF16, "cpu", x, x.double(), torch.arange(3), None, x.to(BF16))
    assert [None if t is None else t.dtype for t in cast] == [BF16, torch.float64, torch.int64, None, BF16]


@pytest.mark.parametrize("name", ["linear", "conv2d"])
def test_gradients_reach_fp32_parameters_in_fp32(name):
    o = _operands()
    leaves = {k: v.clone().requires_grad_() for k, v in o.items()}
    with amp():
        y = CASES[name][0](leaves)
    y.float().square().sum().backward()
    # the same op on explicitly cast operands, with the casts' gradients
    ref = {k: v.clone().requires_grad_() for k, v in o.items()}
    yr = CASES[name][0]({k: v.to(BF16) for k, v in ref.items()})
    yr.float().square().sum().backward()
    assert torch.equal(y, yr)
    names = ("x", "w", "b") if name == "linear" else ("img", "k", "kb")
    for k in names:
        assert leaves[k].grad.dtype == torch.float32
        assert torch.equal(leaves[k].grad, ref[k].grad), k


# ------------------------------------------------------------------ modules and optimize()


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2, self.c3 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        h = F.relu(self.c1(x))
        h = F.relu(self.c2(h) + h)  # a residual the epilogue takes
        h = self.c3(h) + x.mean(1, keepdim=True).float()  # an fp32 term: torch's add promotes
        return self.head(h.mean((2, 3)))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(F.relu(self.fc2(F.gelu(self.fc1(x))) + x))


@pytest.mark.parametrize("make, shape", [(CNN, (2, 3, 8, 8)), (MLP, (6, 16))], ids=["cnn", "mlp"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_optimized_model_under_autocast_matches_torch(make, shape, train):
    torch.manual_seed(0)
    model = make().train(train)
    opt = cf.optimize(copy.deepcopy(model))
    assert any(type(m).__module__ == "cudnn_fuse.nn" for m in opt.modules())
    x = torch.randn(shape)
    xs = [x.clone().requires_grad_(train) for _ in range(2)]
    with amp():
        want, got = model(xs[0]), opt(xs[1])
    assert got.dtype == want.dtype
    close(got, want, tol=3e-2)
    if train:
        want.float().sum().backward()
        got.float().sum().backward()
        close(xs[1].grad, xs[0].grad, tol=5e-2)
        for (n, p), q in zip(model.named_parameters(), opt.parameters()):
            assert q.grad is not None and q.grad.dtype == torch.float32, n
            close(q.grad, p.grad, tol=5e-2)


@pytest.mark.parametrize("recompute", [False, True])
def test_linear_module_training_under_autocast(recompute):
    torch.manual_seed(0)
    ref = nn.Linear(16, 24)
    mod = cf.nn.Linear(16, 24, activation="gelu", recompute=recompute)
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(5, 16)
    xa, xb = x.clone().requires_grad_(), x.to(BF16).requires_grad_()  # fp32 input, and a bf16 one
    for xi in (xa, xb):
        with amp():
            y, t = mod(xi), F.gelu(ref(xi))
        assert y.dtype == BF16 == t.dtype
        close(y, t)
        y.float().sum().backward()
        assert xi.grad.dtype == xi.dtype and mod.weight.grad.dtype == torch.float32
    # a residual in another dtype than the op's is added after it, as torch adds it
    r32 = torch.randn(5, 24)
    with amp():
        y, t = mod(x, r32), F.gelu(ref(x) + r32)
    assert y.dtype == torch.float32 == t.dtype
    close(y, t)


def test_fused_mlp_training_under_autocast():
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
    cfc1 = cf.nn.Linear(16, 32, activation="gelu")
    cfc1.load_state_dict(fc1.state_dict())
    block = cf.nn.FusedMLP(cfc1, copy.deepcopy(fc2))
    x = torch.randn(6, 16)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with amp():
        assert block._fused(xa, None)
        y, t = block(xa), fc2(F.gelu(fc1(xb)))
    assert y.dtype == BF16 == t.dtype
    close(y, t)
    y.float().sum().backward()
    t.float().sum().backward()
    close(xa.grad, xb.grad, tol=5e-2)
    close(block.fc2.weight.grad, fc2.weight.grad, tol=5e-2)
    assert cfc1.weight.grad.dtype == torch.float32


def test_conv_module_residual_dtype_under_autocast():
    torch.manual_seed(0)
    ref = nn.Conv2d(4, 4, 3, padding=1)
    mod = cf.nn.Conv2d(4, 4, 3, padding=1, activation="relu")
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(1, 4, 6, 6)
    with amp():
        fused = mod(x, x.to(BF16))  # the op's dtype: rides in the epilogue
        promoted = mod(x, x)  # fp32: torch's add promotes, so does the module
        want_fused, want_promoted = F.relu(ref(x) + x.to(BF16)), F.relu(ref(x) + x)
    assert fused.dtype == BF16 and promoted.dtype == torch.float32
    close(fused, want_fused)
    close(promoted, want_promoted)


def test_compiled_ops_under_autocast_fullgraph():
    o = _operands()

    def f(x, w, b, img, k):
        return cf.linear(x, w, b, activation="relu"), cf.conv2d(img, k, padding=1, activation="relu")

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    with amp():
        got = compiled(o["x"], o["w"], o["b"], o["img"], o["k"])
        want = f(o["x"], o["w"], o["b"], o["img"], o["k"])
    for g, w in zip(got, want):
        assert g.dtype == BF16
        close(g, w)
