"""cf.nn modules and cf.optimize() on small CNN and transformer models (CPU path)."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudnn_fuse as cf
from cudnn_fuse import nn as cfnn
from cudnn_fuse.optimize import optimize

torch.manual_seed(0)


# ----------------------------------------------------------------------------- modules


def test_conv2d_module_is_a_torch_conv_with_a_fused_epilogue():
    m = cfnn.Conv2d(4, 6, 3, padding=1, activation="relu")
    assert isinstance(m, nn.Conv2d) and "activation='relu'" in repr(m)
    x, r = torch.randn(2, 4, 5, 5), torch.randn(2, 6, 5, 5)
    torch.testing.assert_close(m(x, r), F.relu(F.conv2d(x, m.weight, m.bias, padding=1) + r))


def test_conv2d_module_with_reflect_padding_runs_torch():
    m = cfnn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect", activation="tanh")
    x = torch.randn(1, 2, 6, 6)
    torch.testing.assert_close(m(x), torch.tanh(nn.Conv2d.forward(m, x)))


@pytest.mark.parametrize("recompute", [False, True])
def test_linear_module_outputs_and_gradients_match_torch(recompute):
    m = cfnn.Linear(8, 5, activation="gelu", recompute=recompute)
    ref = nn.Linear(8, 5)
    ref.load_state_dict(m.state_dict())
    x = torch.randn(3, 8, requires_grad=True)
    y = m(x)
    torch.testing.assert_close(y, F.gelu(ref(x)))
    y.square().sum().backward()
    g_ours = (x.grad.clone(), m.weight.grad.clone(), m.bias.grad.clone())
    x.grad = None
    F.gelu(ref(x)).square().sum().backward()
    for a, b in zip(g_ours, (x.grad, ref.weight.grad, ref.bias.grad)):
        torch.testing.assert_close(a, b)


def _saved_count(fn) -> int:
    n = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: n.append(t.numel()) or t, lambda t: t):
        fn()
    return sum(n)


def test_recompute_saves_less_than_keeping_the_pre_activation():
    x = torch.randn(64, 32, requires_grad=True)
    keep = cfnn.Linear(32, 128, activation="gelu", recompute=False)
    redo = cfnn.Linear(32, 128, activation="gelu", recompute=True)
    redo.load_state_dict(keep.state_dict())
    saved_keep, saved_redo = _saved_count(lambda: keep(x)), _saved_count(lambda: redo(x))
    inputs = 64 * 32 + 128 * 32 + 128  # x, weight, bias
    assert saved_redo <= inputs  # recompute: no M x N tensor is kept
    assert saved_keep >= 64 * 128  # the pre-activation is kept for a backward without recomputation


def test_modules_reject_unknown_activation():
    with pytest.raises(ValueError, match="activation"):
        cfnn.Linear(2, 2, activation="swishy")
    with pytest.raises(ValueError, match="activation"):
        cfnn.Conv2d(2, 2, 1, activation="mish")


def test_state_dict_round_trips_with_torch_modules():
    t_conv, c_conv = nn.Conv2d(3, 4, 3), cfnn.Conv2d(3, 4, 3, activation="silu")
    c_conv.load_state_dict(t_conv.state_dict())
    t2 = nn.Conv2d(3, 4, 3)
    t2.load_state_dict(c_conv.state_dict())
    assert set(t_conv.state_dict()) == set(c_conv.state_dict())
    torch.testing.assert_close(t2.weight, t_conv.weight)
    t_lin, c_lin = nn.Linear(3, 4, bias=False), cfnn.Linear(3, 4, bias=False, activation="relu")
    c_lin.load_state_dict(t_lin.state_dict())
    torch.testing.assert_close(c_lin.weight, t_lin.weight)


# ----------------------------------------------------------------------------- models


class Bottleneck(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c // 2, 1, bias=False), nn.BatchNorm2d(c // 2)
        self.conv2, self.bn2 = nn.Conv2d(c // 2, c // 2, 3, padding=1, bias=False), nn.BatchNorm2d(c // 2)
        self.conv3, self.bn3 = nn.Conv2d(c // 2, c, 1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.blocks = nn.Sequential(Bottleneck(16), Bottleneck(16))
        self.pad = nn.Conv2d(16, 16, 3, padding=1, padding_mode="reflect")
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = self.pad(self.blocks(self.stem(x)))
        return self.head(x.mean((2, 3)))


class Attention(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(o.transpose(1, 2).reshape(B, S, D))


class TransformerBlock(nn.Module):
    def __init__(self, d=32, h=4):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, h)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(self.act(self.fc(self.ln2(x))))


def _randomize_bn(model):
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    return model


def test_optimize_cnn_eval_folds_bn_and_fuses_residuals():
    model = _randomize_bn(SmallCNN()).eval()
    x = torch.randn(2, 3, 12, 12)
    opt = optimize(model)
    torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)
    s = opt.cudnn_fuse_summary
    patterns = dict(s.replaced)
    assert patterns["stem.0"] == "Conv2d + BatchNorm2d(folded) + relu"
    assert patterns["blocks.0.conv3"] == "Conv2d + BatchNorm2d(folded) + residual add + relu"
    assert patterns["blocks.1.conv2"] == "Conv2d + BatchNorm2d(folded) + relu"
    left = dict(s.left_alone)
    assert "padding_mode='reflect'" in left["pad"]
    assert "no epilogue" in left["head"]
    # the folded BatchNorms stay the model's (state_dict, statistics) but the graph calls none of them
    assert not [n for n in opt.graph.nodes if n.op == "call_module" and isinstance(opt.get_submodule(n.target),
                                                                                  nn.BatchNorm2d)]
    assert list(opt.state_dict()) == list(model.state_dict())
    assert sum(isinstance(m, cfnn.Conv2d) for m in opt.modules()) == 7
    # the original model is untouched
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())


def test_optimize_cnn_train_mode_keeps_bn_and_matches_gradients():
    model = SmallCNN().train()
    opt = optimize(model)
    s = dict(opt.cudnn_fuse_summary.left_alone)
    assert any("training mode" in why for why in s.values())
    assert any(isinstance(m, nn.BatchNorm2d) for m in opt.modules())
    x = torch.randn(2, 3, 8, 8)
    ref = copy.deepcopy(model)
    y_opt, y_ref = opt(x), ref(x)
    torch.testing.assert_close(y_opt, y_ref, rtol=1e-5, atol=1e-6)
    y_opt.square().sum().backward()
    y_ref.square().sum().backward()
    grads_opt = {n: p.grad for n, p in opt.named_parameters()}
    for n, p in ref.named_parameters():
        key = n if n in grads_opt else None
        if key is not None:
            torch.testing.assert_close(grads_opt[key], p.grad, rtol=1e-4, atol=1e-6)


def test_optimize_transformer_block_same_outputs_and_gradients():
    model = TransformerBlock()
    opt = optimize(model)
    patterns = [p for _, p in opt.cudnn_fuse_summary.replaced]
    assert "F.scaled_dot_product_attention" in patterns
    # the MLP (fc -> gelu_tanh -> out + x) is one block whose backward crosses the layers
    assert "Linear + gelu_tanh + Linear + residual add (fused MLP backward)" in patterns
    assert "Linear + residual add" in patterns  # the projections' residual rides in the epilogue
    assert sum(isinstance(m, cfnn.FusedMLP) for m in opt.modules()) == 1
    x = torch.randn(2, 7, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y_opt, y_ref = opt(x), model(x2)
    torch.testing.assert_close(y_opt, y_ref, rtol=1e-5, atol=1e-6)
    y_opt.square().sum().backward()
    y_ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-6)
    ref_grads = dict(model.named_parameters())
    shared = 0
    for n, p in opt.named_parameters():
        if n in ref_grads:
            torch.testing.assert_close(p.grad, ref_grads[n].grad, rtol=1e-4, atol=1e-6)
            shared += 1
    assert shared >= 4


def _fused_mlp(act="gelu", bias=True, dtype=torch.float64):
    fc1 = cfnn.Linear(12, 40, bias=bias, activation=act, dtype=dtype)
    fc2 = nn.Linear(40, 12, bias=bias, dtype=dtype)
    return cfnn.FusedMLP(fc1, fc2)


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("residual", [False, True])
def test_fused_mlp_outputs_and_gradients_match_torch(act, bias, residual):
    torch.manual_seed(3)
    m = _fused_mlp(act, bias)
    ref = nn.Sequential(nn.Linear(12, 40, bias=bias), nn.GELU() if act == "gelu" else
                        nn.GELU(approximate="tanh") if act == "gelu_tanh" else nn.SiLU(), nn.Linear(40, 12, bias=bias))
    ref = ref.double()
    ref[0].load_state_dict(m.fc1.state_dict())
    ref[2].load_state_dict(m.fc2.state_dict())
    x = torch.randn(3, 5, 12, dtype=torch.float64, requires_grad=True)
    r = torch.randn(3, 5, 12, dtype=torch.float64, requires_grad=True) if residual else None
    x2 = x.detach().clone().requires_grad_()
    r2 = r.detach().clone().requires_grad_() if residual else None
    out = m(x, r) if residual else m(x)
    expect = ref(x2) + r2 if residual else ref(x2)
    torch.testing.assert_close(out, expect)
    g = torch.randn_like(out)
    out.backward(g)
    expect.backward(g)
    torch.testing.assert_close(x.grad, x2.grad)
    if residual:
        torch.testing.assert_close(r.grad, r2.grad)
    for mine, theirs in ((m.fc1, ref[0]), (m.fc2, ref[2])):
        torch.testing.assert_close(mine.weight.grad, theirs.weight.grad)
        if bias:
            torch.testing.assert_close(mine.bias.grad, theirs.bias.grad)


def test_fused_mlp_gradcheck_and_frozen_first_layer():
    m = _fused_mlp("silu")
    x = torch.randn(4, 12, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w1, b1, w2, b2: cf.torch_ops.mlp(x, w1, b1, w2, b2, "silu", None, 0.01),
                                    (x, m.fc1.weight, m.fc1.bias, m.fc2.weight, m.fc2.bias))
    m.fc1.requires_grad_(False)  # fine-tuning only the second layer: no gradient reaches the first
    m(x.detach()).sum().backward()
    assert m.fc1.weight.grad is None and m.fc2.weight.grad is not None


def test_fused_mlp_training_path_only_when_it_pays(monkeypatch):
    calls = []
    real = cf.torch_ops.mlp
    monkeypatch.setattr(cf.torch_ops, "mlp", lambda *a: calls.append(a[5]) or real(*a))
    m = _fused_mlp("gelu")
    x = torch.randn(4, 12, dtype=torch.float64)
    m(x)
    assert calls == ["gelu"]  # the weights train: the cross-layer backward
    with torch.no_grad():
        m(x)
    m.fc1.recompute = True
    m(x)
    relu = cfnn.FusedMLP(cfnn.Linear(12, 40, activation="relu", dtype=torch.float64), m.fc2)
    torch.testing.assert_close(relu(x), F.linear(F.relu(F.linear(x, relu.fc1.weight, relu.fc1.bias)), m.fc2.weight,
                                                  m.fc2.bias))
    assert calls == ["gelu"]  # inference, recompute and ReLU (backward from the output) run the two layers


def test_fused_mlp_validates_its_arguments():
    with pytest.raises(ValueError, match="fc1"):
        cfnn.FusedMLP(nn.Linear(4, 8), nn.Linear(8, 4))
    with pytest.raises(ValueError, match="fc2"):
        cfnn.FusedMLP(cfnn.Linear(4, 8, activation="gelu"), nn.Linear(6, 4))
    m = _fused_mlp("gelu", dtype=torch.float32)
    with pytest.raises(ValueError, match="in_features"):
        m(torch.randn(3, 5))
    with pytest.raises(ValueError, match="residual"):
        m(torch.randn(3, 12), torch.randn(3, 5))
    x64 = torch.randn(3, 12, dtype=torch.float64)
    with pytest.raises(RuntimeError) as theirs:  # torch refuses a float64 input of float32 layers
        F.linear(x64, m.fc1.weight, m.fc1.bias)
    with pytest.raises(RuntimeError, match="dtype") as ours:  # and cf lets torch's own error through
        m(x64)
    assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value)


class _MLPs(nn.Module):
    """Linear -> act -> Linear in the shapes optimize() must and must not turn into a FusedMLP."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))  # fused
        self.b1, self.b_act, self.b2 = nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 8)  # fused with the residual
        self.c = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.Tanh())  # fc2 has its own act
        self.d1, self.d2 = nn.Linear(8, 16), nn.Linear(16, 8)  # the activation has two users
        self.e = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))  # ReLU: backward from the output

    def forward(self, x):
        x = self.a(x)
        x = x + self.b2(self.b_act(self.b1(x)))
        x = self.c(x)
        h = F.gelu(self.d1(x))
        x = self.d2(h) + h.mean(-1, keepdim=True)
        return self.e(x)


def _same_outputs_and_input_grads(opt, model, x, seed=None):
    """``opt(x)`` and ``model(x)`` agree, and so do the gradients they give ``x`` (each call after
    ``torch.manual_seed(seed)`` when given); ``opt``'s output."""
    xs = [x.detach().clone().requires_grad_() for _ in range(2)]
    ys = []
    for m, xi in zip((opt, model), xs):
        if seed is not None:
            torch.manual_seed(seed)
        ys.append(m(xi))
    torch.testing.assert_close(ys[0], ys[1])
    for y in ys:
        y.square().sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad)
    return ys[0]


def test_optimize_fuses_linear_act_linear_blocks_and_leaves_the_rest():
    torch.manual_seed(0)
    model = _MLPs()
    opt = optimize(model)
    patterns = dict(opt.cudnn_fuse_summary.replaced)
    assert patterns["a.0"] == "Linear + gelu + Linear (fused MLP backward)"
    assert patterns["b1"] == "Linear + silu + Linear + residual add (fused MLP backward)"
    assert patterns["c.0"] == "Linear + gelu" and patterns["c.2"] == "Linear + tanh"
    assert patterns["d1"] == "Linear + gelu" and patterns["d2"] == "Linear + residual add"
    assert patterns["e.0"] == "Linear + relu"
    assert sum(isinstance(m, cfnn.FusedMLP) for m in opt.modules()) == 2
    _same_outputs_and_input_grads(opt, model, torch.randn(3, 8))
    # the blocks' parameters are the original modules' own (shared, so they trained)
    ref = dict(model.named_parameters())
    fused = [m for m in opt.modules() if isinstance(m, cfnn.FusedMLP)]
    assert fused[0].fc2.weight.shape == ref["a.2.weight"].shape
    torch.testing.assert_close(fused[0].fc2.weight.grad, ref["a.2.weight"].grad)
    torch.testing.assert_close(fused[1].fc1.bias.grad, ref["b1.bias"].grad)


def test_optimize_with_recompute_keeps_two_linears():
    opt = optimize(nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)), recompute=True)
    assert dict(opt.cudnn_fuse_summary.replaced) == {"0": "Linear + gelu"}
    assert not any(isinstance(m, cfnn.FusedMLP) for m in opt.modules())


def test_fused_mlp_under_torch_compile_fullgraph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    opt = optimize(model)
    x = torch.randn(4, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y = torch.compile(opt, fullgraph=True, backend="aot_eager")(x)
    y2 = model(x2)
    torch.testing.assert_close(y, y2)
    y.sum().backward()
    y2.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    # the block holds the layers unregistered: compiled, their parameters still get their gradients
    got, want = dict(opt.named_parameters()), dict(model.named_parameters())
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k].grad, want[k].grad, msg=k)


def test_optimize_untraceable_model_rewrites_its_children():
    class Untraceable(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))

        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow: torch.fx cannot trace this
                return self.mlp(x)
            return -self.mlp(x)

    model = Untraceable()
    opt = optimize(model)
    assert dict(opt.cudnn_fuse_summary.replaced).get("mlp.0") == "Linear + relu"
    assert "not traceable" in dict(opt.cudnn_fuse_summary.left_alone)["Untraceable"]
    x = torch.randn(4, 8)
    torch.testing.assert_close(opt(x), model(x))


class TiedLM(nn.Module):
    """GPT-2's head in small: an embedding tied to an output Linear 4099 wide (misaligned rows
    in 16-bit), inside a forward torch.fx cannot trace."""

    def __init__(self, vocab=4099, d=256):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.body = nn.Sequential(nn.Linear(d, d), nn.GELU())
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        h = self.body(self.wte(ids))
        if h.sum() > -1e9:  # data-dependent: the model does not trace, its children are rewritten
            h = h * 1.0
        return self.lm_head(h)


def test_aligned_linear_padded_forward_equals_linear_with_gradients():
    for dtype, n, bias in ((torch.float32, 1001, True), (torch.bfloat16, 1001, False), (torch.float32, 13, True)):
        lin = nn.Linear(24, n, bias=bias).to(dtype)
        al = cfnn.AlignedLinear(lin)
        assert al.weight is lin.weight and al.bias is lin.bias
        x1 = torch.randn(3, 5, 24, dtype=dtype, requires_grad=True)
        x2 = x1.detach().clone().requires_grad_()
        ref, out = F.linear(x1, lin.weight, lin.bias), al.padded_forward(x2)
        assert out.shape == ref.shape and out.stride(-2) % 8 == 0  # rows 16-byte aligned in 16-bit too
        torch.testing.assert_close(out, ref)
        g = torch.randn_like(ref)
        gw_ref = torch.autograd.grad(ref, (x1, lin.weight), g)
        gw_out = torch.autograd.grad(out, (x2, lin.weight), g)
        for a, b in zip(gw_out, gw_ref):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b)


def test_aligned_linear_pads_only_misaligned_widths():
    assert cfnn.AlignedLinear.misaligned(50257) and cfnn.AlignedLinear.misaligned(1001)
    assert cfnn.AlignedLinear.misaligned(12)  # 24 bytes in 16-bit
    assert not cfnn.AlignedLinear.misaligned(1000) and not cfnn.AlignedLinear.misaligned(4096)
    model = nn.Sequential(nn.Linear(8, 1000), nn.Linear(1000, 2001), nn.Linear(2001, 10))
    opt = optimize(model)
    summary = dict(opt.cudnn_fuse_summary.replaced)
    assert list(summary.values()) == ["Linear, output 2001 wide padded to 2008 (aligned GEMM)"]
    left = dict(opt.cudnn_fuse_summary.left_alone)
    assert "no epilogue" in left["0"] and "no epilogue" in left["2"]  # aligned; misaligned but small
    x = torch.randn(4, 8)
    torch.testing.assert_close(opt(x), model(x))


def test_optimize_keeps_a_tied_lm_head_tied_and_its_gradient_shared():
    torch.manual_seed(0)
    model = TiedLM()
    opt = optimize(model)
    assert isinstance(opt.lm_head, cfnn.AlignedLinear) and isinstance(opt.lm_head, nn.Linear)
    assert opt.lm_head.weight is opt.wte.weight  # the tie survives the deepcopy and the rewrite
    assert "padded to 4104" in dict(opt.cudnn_fuse_summary.replaced)["lm_head"]
    assert "lm_head.weight" in opt.state_dict() and "lm_head.bias" not in opt.state_dict()
    ids = torch.randint(0, 4099, (2, 7))
    torch.testing.assert_close(opt(ids), model(ids))
    # the padded path (what the GPU runs), through the whole model: same loss, same tied gradient
    opt.lm_head.forward = opt.lm_head.padded_forward
    for m in (opt, model):
        F.cross_entropy(m(ids).flatten(0, 1), ids.flatten()).backward()
    torch.testing.assert_close(opt.wte.weight.grad, model.wte.weight.grad)


def test_optimize_logs_a_summary(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="cudnn_fuse.optimize"):
        optimize(TransformerBlock())
    assert any("replaced" in r.getMessage() for r in caplog.records)


def test_optimize_autotune_flag_turns_on_tuning(monkeypatch):
    from cudnn_fuse import autotune

    monkeypatch.setattr(autotune, "_enabled", None)
    optimize(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), autotune=True)
    assert autotune.autotune_enabled()
    monkeypatch.setattr(autotune, "_enabled", None)


def test_small_training_run_tracks_eager_loss():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.SiLU(),
                          nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
    opt_model = optimize(model)
    ref = copy.deepcopy(model)
    o1, o2 = torch.optim.SGD(opt_model.parameters(), lr=0.2), torch.optim.SGD(ref.parameters(), lr=0.2)
    x, target = torch.randn(16, 3, 6, 6), torch.randint(0, 10, (16,))
    losses = []
    for _ in range(20):
        l1 = F.cross_entropy(opt_model(x), target)
        l2 = F.cross_entropy(ref(x), target)
        for o, l in ((o1, l1), (o2, l2)):
            o.zero_grad()
            l.backward()
            o.step()
        losses.append((l1.item(), l2.item()))
    assert losses[-1][0] < losses[0][0] * 0.8  # it learns
    for a, b in losses:
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b))


def test_public_namespace_has_nn_and_optimize():
    assert cf.nn.Linear is cfnn.Linear
    assert cf.optimize is optimize


def test_modules_take_a_broadcast_or_other_dtype_residual_like_torch():
    """optimize() fuses ``layer(x) + t`` without knowing t's shape: a t that broadcasts (or
    promotes) must give torch's answer, not an error."""
    torch.manual_seed(0)
    lin = cfnn.Linear(8, 6, activation="relu")
    x = torch.randn(3, 8)
    for r in (torch.randn(3, 1), torch.randn(6), torch.randn(3, 6, dtype=torch.float64)):
        out = lin(x, r)
        expect = F.relu(F.linear(x, lin.weight, lin.bias) + r)
        assert out.dtype == expect.dtype
        torch.testing.assert_close(out, expect)
    with pytest.raises(ValueError, match="residual"):
        lin(x, torch.randn(3, 5))
    conv = cfnn.Conv2d(4, 6, 3, padding=1, activation="silu")
    xc = torch.randn(2, 4, 5, 5)
    for r in (torch.randn(2, 1, 5, 5), torch.randn(6, 1, 1)):
        torch.testing.assert_close(conv(xc, r), F.silu(F.conv2d(xc, conv.weight, conv.bias, padding=1) + r))
    with pytest.raises(ValueError, match="residual"):
        conv(xc, torch.randn(2, 3, 5, 5))
    mlp = _fused_mlp("gelu", dtype=torch.float32)
    xm, rm = torch.randn(3, 12), torch.randn(3, 1)
    torch.testing.assert_close(mlp(xm, rm), mlp.fc2(F.gelu(F.linear(xm, mlp.fc1.weight, mlp.fc1.bias))) + rm)


def test_fused_mlp_backward_drops_its_intermediates_and_survives_retain_graph():
    """z1 and y1 are freed during the backward (as eager autograd frees them between its nodes);
    a second backward through a retained graph recomputes them and gives the same gradients."""
    import gc
    import weakref

    torch.manual_seed(0)
    m = _fused_mlp("gelu")
    x = torch.randn(6, 12, dtype=torch.float64, requires_grad=True)
    out = m(x)
    z1, y1 = out.grad_fn.inter
    assert z1.shape == y1.shape == (6, 40)
    refs = [weakref.ref(z1), weakref.ref(y1)]
    del z1, y1
    g = torch.randn_like(out)
    out.backward(g, retain_graph=True)
    gc.collect()
    assert [r() for r in refs] == [None, None]
    first = [p.grad.clone() for p in m.parameters()] + [x.grad.clone()]
    out.backward(g)  # the retained graph again: recomputed intermediates, the same gradients once more
    for a, b in zip([p.grad for p in m.parameters()] + [x.grad], first):
        torch.testing.assert_close(a, 2 * b)


def test_fused_mlp_under_saved_tensor_hooks_saves_through_them():
    torch.manual_seed(0)
    m = _fused_mlp("silu")
    x = torch.randn(6, 12, dtype=torch.float64, requires_grad=True)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(tuple(t.shape)) or t, lambda t: t):
        out = m(x)
    assert packed.count((6, 40)) == 2  # z1 and y1 went through the hooks (save_on_cpu would move them)
    assert out.grad_fn.inter is None
    x2 = x.detach().clone().requires_grad_()
    eager = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: eager.append(tuple(t.shape)) or t, lambda t: t):
        ref = F.linear(F.silu(F.linear(x2, m.fc1.weight, m.fc1.bias)), m.fc2.weight, m.fc2.bias)
    # what eager saves (x, w1, z1, y1, w2), no more: the GPU test counts the same on the H200
    assert sum(math.prod(s) for s in packed) == sum(math.prod(s) for s in eager), (packed, eager)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


def test_saved_tensor_hooks_probe_assumes_hooks_when_torch_cannot_say(monkeypatch):
    from cudnn_fuse import torch_ops

    assert torch_ops._saved_tensor_hooks_active() is False
    with torch.autograd.graph.save_on_cpu():
        assert torch_ops._saved_tensor_hooks_active() is True
    monkeypatch.delattr(torch._C._autograd, "_top_saved_tensors_default_hooks")
    assert torch_ops._saved_tensor_hooks_active() is True  # then FusedMLP saves the standard way
    m = _fused_mlp("gelu")
    out = m(torch.randn(3, 12, dtype=torch.float64))
    assert out.grad_fn.inter is None


@pytest.mark.parametrize("rshape", [(1, 6, 8, 8), (2, 6, 1, 1), (1, 6, 1, 8), (6, 1, 1), (2, 1, 8, 8), (2, 6, 8, 8)])
def test_conv2d_module_adds_a_residual_that_broadcasts_in_batch_or_space(rshape):
    """A residual of the output's rank and channels that broadcasts in batch or space ([1, K, P, Q],
    [N, K, 1, 1]: a position embedding) was handed to the op, which takes the output's shape only, and
    raised where torch adds it (an optimize()d `relu(conv(x) + pos)` too). It is added after the op."""
    torch.manual_seed(0)
    m = cf.nn.Conv2d(4, 6, 3, padding=1, activation="relu")
    x, r = torch.randn(2, 4, 8, 8), torch.randn(rshape)
    ref = torch.relu(torch.nn.functional.conv2d(x, m.weight, m.bias, padding=1) + r)
    torch.testing.assert_close(m(x, r), ref)


def test_conv2d_module_fuses_a_same_shape_residual_with_sizes_of_1(monkeypatch):
    """Batch 1 and a 1x1 output: the residual has the output's shape (sizes of 1 included) and still rides
    in the op's epilogue."""
    from cudnn_fuse import functional

    seen = []
    real = functional.conv2d
    monkeypatch.setattr(functional, "conv2d", lambda *a, **k: (seen.append(k.get("residual") is not None), real(*a, **k))[1])
    m = cf.nn.Conv2d(4, 6, 3, activation="relu")
    x, r = torch.randn(1, 4, 3, 3), torch.randn(1, 6, 1, 1)
    torch.testing.assert_close(m(x, r), torch.relu(torch.nn.functional.conv2d(x, m.weight, m.bias) + r))
    assert seen == [True]


class _InplaceAlias(nn.Module):
    def __init__(self):
        super().__init__()
        self.c0, self.conv = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        h = self.c0(x)
        skip = h  # an alias: in eager it sees the in-place sum
        h += self.conv(x)
        return F.relu(h) + skip


class _InplaceBetween(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        y += x  # the conv's own output changed in place: a residual
        x += 1  # the caller's input changed in place before the activation reads y
        return F.relu(y) * 2


@pytest.mark.parametrize("model", [_InplaceAlias, _InplaceBetween], ids=["alias", "between"])
def test_optimize_keeps_in_place_adds_in_place(model):
    """fx traces `h += y` as `h + y` (its Proxy has no __iadd__), so an optimized model made a new tensor
    where the model changed one: an alias of h kept the old values (up to 1.59 off), and a caller's input
    was left unchanged. Augmented assignments now trace as in-place calls, a fused call never moves past
    one, and `h += layer(x)` (h changed) is not a residual."""
    torch.manual_seed(0)
    m = model().eval()
    o = optimize(copy.deepcopy(m))
    x = torch.randn(2, 4, 8, 8)
    x_eager, x_opt = x.clone(), x.clone()
    with torch.no_grad():
        torch.testing.assert_close(o(x_opt), m(x_eager))
    assert torch.equal(x_opt, x_eager)  # the caller's input changed alike
    if model is _InplaceAlias:  # traced as the in-place call it is
        assert any(getattr(n.target, "__name__", "") == "_inplace_iadd" for n in o.graph.nodes if n.op == "call_function")
    else:  # the conv does not move past `x += 1`
        assert [w for w, _ in o.cudnn_fuse_summary.left_alone] == ["conv"]


def test_optimize_fuses_a_layers_own_output_added_to_in_place():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x, h):
            y = self.conv(x)
            y += h
            return F.relu(y)

    m = M().eval()
    o = optimize(copy.deepcopy(m))
    assert [p for _, p in o.cudnn_fuse_summary.replaced] == ["Conv2d + residual add + relu"]
    x, h = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(o(x, h), m(x, h))


def test_optimize_takes_a_layer_called_with_its_input_by_keyword():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.conv = nn.Linear(4, 4), nn.Conv2d(3, 4, 1)

        def forward(self, x, img):
            return F.relu(self.fc(input=x)), F.relu(self.conv(input=img))

    m = M().eval()
    o = optimize(copy.deepcopy(m))  # raised IndexError (the rewrites read node.args[0])
    assert sorted(p for _, p in o.cudnn_fuse_summary.replaced) == ["Conv2d + relu", "Linear + relu"]
    x, img = torch.randn(3, 4), torch.randn(2, 3, 5, 5)
    with torch.no_grad():
        for a, b in zip(o(x, img), m(x, img)):
            torch.testing.assert_close(a, b)


def test_optimize_adds_a_python_number_the_way_torch_does():
    """`layer(x) + x.shape[-1]` traces as an add of an fx value, which optimize() takes for a residual;
    at run time it is an int, which the fused modules then took for a tensor (AttributeError)."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.conv = nn.Linear(4, 4), nn.Conv2d(4, 4, 1)

        def forward(self, x, img):
            return F.gelu(self.fc(x) + x.shape[-1]), F.relu(self.conv(img) + img.size(0))

    m = M().eval()
    o = optimize(copy.deepcopy(m))
    assert all("residual add" in p for _, p in o.cudnn_fuse_summary.replaced)
    x, img = torch.randn(3, 4), torch.randn(2, 4, 5, 5)
    with torch.no_grad():
        for a, b in zip(o(x, img), m(x, img)):
            torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="residual of type list"):
        cf.nn.Conv2d(4, 4, 1)(img, [1.0])


def test_optimize_leaves_an_mlp_whose_second_layer_is_shared():
    """A second Linear also called elsewhere went into the FusedMLP anyway: its parameters then sat in
    the state_dict twice (fc1.fc2.* and fc2.*)."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3 = nn.Linear(4, 8), nn.Linear(8, 4), nn.Linear(4, 8)

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(x))) + self.fc2(self.fc3(x))

    m = M()  # training: where a FusedMLP is formed
    o = optimize(copy.deepcopy(m))
    assert "fc2" in [w for w, _ in o.cudnn_fuse_summary.left_alone]  # traced, and the shared layer left
    assert sorted(o.state_dict()) == sorted(m.state_dict())
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(o(x), m(x))


class _MLPModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8, dtype=torch.float64)
        self.fc1, self.act = nn.Linear(8, 24, dtype=torch.float64), nn.GELU()
        self.fc2 = nn.Linear(24, 8, dtype=torch.float64)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


def test_an_optimized_mlp_block_keeps_the_state_dict_keys():
    """The FusedMLP took fc1's place and held fc1 and fc2 as its children: keys fc1.fc1.* and fc1.fc2.*,
    and (after 04f30b4 kept unused modules) fc2.* beside them, the same tensors; the original's
    checkpoint did not load, nor the optimized one's into the original."""
    m = _MLPModel()  # training: where a FusedMLP is formed
    o = optimize(copy.deepcopy(m))
    blocks = [b for b in o.modules() if isinstance(b, cfnn.FusedMLP)]
    assert len(blocks) == 1 and blocks[0].fc1 is o.fc1 and blocks[0].fc2 is o.fc2
    assert list(o.state_dict()) == list(m.state_dict())
    assert [n for n, _ in o.named_parameters()] == [n for n, _ in m.named_parameters()]
    other = _MLPModel()
    o.load_state_dict(other.state_dict(), strict=True)  # the block reads the loaded values
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(o(x), other(x))
    _MLPModel().load_state_dict(o.state_dict(), strict=True)
    assert "holds the model's layers: 8 -> 24 (gelu) -> 8" in repr(o)

    twin = copy.deepcopy(o)  # the copy's block holds the copy's layers, not the original's
    block = next(b for b in twin.modules() if isinstance(b, cfnn.FusedMLP))
    assert block.fc1 is twin.fc1 and block.fc2 is twin.fc2 and twin.fc1 is not o.fc1
    twin.to(torch.float32)  # .to() reaches the layers through their owner
    assert block.fc1.weight.dtype == torch.float32
    y = twin(x.float().detach().requires_grad_(True))
    y.sum().backward()
    assert twin.fc1.weight.grad is not None and twin.fc2.weight.grad is not None


def test_a_standalone_fused_mlp_owns_its_layers_unless_told():
    fc1, fc2 = cfnn.Linear(4, 8, activation="gelu"), nn.Linear(8, 4)
    assert list(cfnn.FusedMLP(fc1, fc2).state_dict()) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    held = cfnn.FusedMLP(fc1, fc2, own=False)
    assert list(held.state_dict()) == [] and held.fc1 is fc1
    with pytest.raises(TypeError, match="own must be a bool"):
        cfnn.FusedMLP(fc1, fc2, own="no")


class _WithSurface(nn.Module):
    scale = 2

    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 4)
        self.config, self.num_classes = {"hidden": 12}, 4

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))

    def predict(self, x):
        return self(x).argmax(-1) * self.scale

    @property
    def hidden(self):
        return self.fc1.out_features

    @classmethod
    def build(cls):
        return cls()

    def activation_name(self):
        return type(self.act).__name__


def test_an_optimized_model_keeps_its_own_methods_and_attributes():
    """optimize() returned a bare GraphModule: model.predict, model.config and the like were gone."""
    m = _WithSurface()
    o = optimize(copy.deepcopy(m))
    from cudnn_fuse.optimize import OptimizedGraphModule

    assert isinstance(o, OptimizedGraphModule)
    x = torch.randn(3, 6)
    assert torch.equal(o.predict(x), m.predict(x))
    assert (o.config, o.num_classes, o.hidden, o.scale) == ({"hidden": 12}, 4, 12, 2)
    assert type(o.build()) is _WithSurface and o.model_class is _WithSurface
    assert o.activation_name() == "GELU"  # fused into fc1's call, but still the model's module
    with pytest.raises(AttributeError, match="no_such"):
        o.no_such
    twin = copy.deepcopy(o)  # carried through fx's deepcopy
    assert twin.num_classes == 4 and twin.config == {"hidden": 12} and twin.config is not o.config
    assert torch.equal(twin.predict(x), m.predict(x))
    assert list(o.state_dict()) == list(m.state_dict())  # the carried attributes are not state


def test_an_optimized_model_saved_whole_loads_back_with_its_surface():
    """torch.save of the whole optimized model loaded back as a plain GraphModule: model.predict and
    the carried attributes were gone. It loads back as an OptimizedGraphModule, outputs unchanged."""
    import io

    from cudnn_fuse.optimize import OptimizedGraphModule

    m = _WithSurface()
    o = optimize(copy.deepcopy(m))
    buf = io.BytesIO()
    torch.save(o, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert isinstance(back, OptimizedGraphModule) and back.model_class is _WithSurface
    x = torch.randn(3, 6)
    assert torch.equal(back(x), o(x)) and torch.equal(back.predict(x), m.predict(x))
    assert (back.config, back.num_classes, back.hidden) == ({"hidden": 12}, 4, 12)
    assert list(back.state_dict()) == list(m.state_dict())
    assert "cudnn_fuse" in back.code  # the rewrite survives: cf's modules and ops, not the originals


class _IdentityBetween(nn.Module):
    """A ViT-style MLP block whose identities stand between the layers and the residual add, and
    dropouts that do not return their input (p > 0) or have a hook, which must stay."""

    def __init__(self, p_mid=0.0, p_out=0.0):
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(p_mid), nn.Linear(32, 8), nn.Dropout(p_out))
        self.skip = nn.Identity()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        y = x + self.mlp(self.ln(x))
        return self.skip(F.relu(F.dropout(self.proj(y), p=0.0, training=self.training))) + y


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_optimize_looks_through_calls_that_return_their_input(mode):
    torch.manual_seed(0)
    model = _IdentityBetween().train(mode == "train")
    opt = optimize(model)
    patterns = dict(opt.cudnn_fuse_summary.replaced)
    assert patterns["mlp.0"] == "Linear + gelu + Linear + residual add (fused MLP backward)"
    assert patterns["proj"] == "Linear + relu"
    called = {n.target for n in opt.graph.nodes if n.op == "call_module"}
    assert not called & {"mlp.2", "mlp.4", "skip"}  # no call left for them
    assert isinstance(opt.get_submodule("mlp.2"), nn.Dropout) and isinstance(opt.skip, nn.Identity)  # still registered
    _same_outputs_and_input_grads(opt, model, torch.randn(4, 8))


@pytest.mark.parametrize("p_mid", [0.1, 0.0])
def test_optimize_fuses_a_residual_across_eval_dropouts_and_runs_them_in_training(p_mid):
    """A dropout of p > 0 returns its input in eval mode only: the residual is fused across it, and the
    fused layer (a Linear, or a FusedMLP) runs it again once the model is put in training mode (same
    random draws as the model)."""
    torch.manual_seed(0)
    model = _IdentityBetween(p_mid=p_mid, p_out=0.3).eval()
    opt = optimize(model)
    patterns = dict(opt.cudnn_fuse_summary.replaced)
    called = {n.target for n in opt.graph.nodes if n.op == "call_module"}
    if p_mid:
        assert patterns["mlp.0"] == "Linear + gelu"  # the dropout after the GELU is no residual's: a call
        assert patterns["mlp.3"] == "Linear + dropout (eval) + residual add"
        assert "mlp.2" in called
    else:
        assert patterns["mlp.0"] == "Linear + gelu + Linear + dropout (eval) + residual add (fused MLP backward)"
    assert "mlp.4" not in called
    x = torch.randn(16, 8)
    torch.testing.assert_close(opt(x), model(x))
    opt.train()
    assert opt.get_submodule("mlp.4").training  # still the model's module: train() reaches it
    y = _same_outputs_and_input_grads(opt, model.train(), x, seed=5)
    assert (y != model.eval()(x)).any()  # dropout ran
    opt.eval()
    torch.testing.assert_close(opt(x), model.eval()(x))
    buf = io.BytesIO()
    torch.save(copy.deepcopy(opt), buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False).train()  # the copy's layer holds the copy's dropout
    torch.manual_seed(5)
    torch.testing.assert_close(back(x), y.detach())


def test_optimize_keeps_dropouts_with_hooks_or_in_training_mode():
    hooked = _IdentityBetween().eval()
    hooked.mlp[4].register_forward_hook(lambda m, i, o: o * 2)
    opt = optimize(hooked)
    assert "mlp.4" in {n.target for n in opt.graph.nodes if n.op == "call_module"}
    x = torch.randn(4, 8)
    torch.testing.assert_close(opt(x), hooked(x))
    training = _IdentityBetween(p_out=0.1).train()  # a dropout in training mode stands between: no residual
    patterns = dict(optimize(training).cudnn_fuse_summary.replaced)
    assert patterns["mlp.0"] == "Linear + gelu + Linear (fused MLP backward)"


class _TiedAE(nn.Module):
    """A conv + BatchNorm2d whose weight the forward also reads itself (a tied decoder, a regularizer)."""

    def __init__(self):
        super().__init__()
        self.enc, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x):
        h = F.relu(self.bn(self.enc(x)))
        return F.conv_transpose2d(h, self.enc.weight, padding=1), self.enc.weight.pow(2).sum()


def test_a_folded_conv_keeps_its_own_weight_for_every_other_reader():
    """Folding a BatchNorm2d leaves the conv's own weight where the rest of the forward (a tied decoder, a
    regularizer) and the state_dict read it; the fused conv runs on it folded."""
    model = _randomize_bn(_TiedAE()).eval()
    opt = optimize(model)
    assert dict(opt.cudnn_fuse_summary.replaced)["enc"] == "Conv2d + BatchNorm2d(folded) + relu"
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        (a, ra), (b, rb) = model(x), opt(x)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rb, ra)
    assert opt.enc.weight is model.enc.weight or torch.equal(opt.enc.weight, model.enc.weight)


def test_a_folded_model_saves_and_loads_the_originals_state_dict():
    """The optimized model's state_dict is the original's, key for key and value for value, and a checkpoint
    of the original (other weights and statistics) loads into it strictly and is what it then computes."""
    model = _randomize_bn(SmallCNN()).eval()
    opt = optimize(model)
    mine, theirs = opt.state_dict(), model.state_dict()
    assert list(mine) == list(theirs) and all(torch.equal(mine[k], theirs[k]) for k in theirs)
    other = _randomize_bn(SmallCNN()).eval()
    opt.load_state_dict(other.state_dict())
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), other(x), rtol=1e-4, atol=1e-5)
    back = SmallCNN().eval()
    back.load_state_dict(opt.state_dict())  # and back into the plain model
    with torch.no_grad():
        torch.testing.assert_close(back(x), other(x))


def test_a_folded_conv_folds_again_after_an_in_place_change():
    """A weight or statistic changed in place after optimize() (weight averaging, a recalibrated BatchNorm)
    is what the next call folds."""
    model = _randomize_bn(SmallCNN()).eval()
    opt = optimize(model, inplace=True)
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        opt(x)
        model.stem[0].weight.mul_(1.5)
        model.stem[1].running_var.mul_(3.0)
        model.stem[1].bias.add_(0.25)
        want = model(x)  # the model rewritten in place is the optimized one: check against a plain copy
    plain = SmallCNN().eval()
    plain.load_state_dict(opt.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(want, plain(x), rtol=1e-4, atol=1e-5)


def test_gradients_in_eval_mode_reach_the_folded_convs_and_batchnorms_parameters():
    """An eval-mode model trained or probed with autograd (frozen statistics, saliency): the folded layers'
    gradients reach the conv's weight and the BatchNorm2d's affine parameters, as the original's do."""
    model = _randomize_bn(SmallCNN()).eval()
    opt = optimize(model)
    x = torch.randn(2, 3, 12, 12)
    model(x).square().sum().backward()
    opt(x).square().sum().backward()
    ref, got = dict(model.named_parameters()), dict(opt.named_parameters())
    for name in ("stem.0.weight", "stem.1.weight", "stem.1.bias"):
        assert got[name].grad is not None, name
        torch.testing.assert_close(got[name].grad, ref[name].grad, rtol=1e-4, atol=1e-4)


class _Methods(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(8, 16), nn.Linear(16, 2)
        self.c, self.bn = nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3)

    def embed(self, x):
        return self.proj(x)

    def conv_features(self, im):
        return self.c(im)

    def forward(self, x, im):
        return self.head(F.gelu(self.proj(x))), F.relu(self.bn(self.c(im)) + im)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_the_models_methods_calling_a_fused_layer_get_the_layer_alone(mode):
    """A method of the model (an embed() or forward_features() helper) that calls a layer optimize() fused
    gets that layer's own output: no activation, no residual, no BatchNorm2d folded in."""
    torch.manual_seed(0)
    model = _randomize_bn(_Methods())
    model.train(mode == "train")
    opt = optimize(model)
    fused = {"proj", "c"} if mode == "eval" else {"proj"}  # a training BatchNorm2d is not folded
    assert fused <= {k.split(".")[0] for k, _ in opt.cudnn_fuse_summary.replaced}
    x, im = torch.randn(3, 8), torch.randn(2, 3, 5, 5)
    with torch.no_grad():
        torch.testing.assert_close(opt.embed(x), model.embed(x))
        torch.testing.assert_close(opt.conv_features(im), model.conv_features(im))
        torch.testing.assert_close(opt.proj(x), model.proj(x))
        if mode == "eval":
            for a, b in zip(opt(x, im), model(x, im)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_fold_made_inside_a_cuda_graph_capture_is_not_kept(monkeypatch):
    """A first call inside a capture folds into the graph's memory pool, which its replays reuse: that fold
    serves the captured call only, and the next call outside folds again."""
    model = _randomize_bn(SmallCNN()).eval()
    opt = optimize(model)
    conv = opt.stem[0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with torch.no_grad():
        w, _ = conv._weights()
    assert "_fold_cache" not in conv.__dict__
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with torch.no_grad():
        w2, _ = conv._weights()
    assert conv.__dict__["_fold_cache"][1] is w2 and torch.equal(w, w2)


class _CalledOutOfOrder(nn.Module):
    """Layers registered in one order and called in another, in the model and in a container."""

    def __init__(self):
        super().__init__()
        self.k, self.q = nn.Linear(8, 8), nn.Linear(8, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.register_buffer("late", torch.ones(8))
        self.first = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(self.q(x)) + torch.tanh(self.k(x)) * self.late
        return self.first(self.block(h))


def _orders(m):
    return ([n for n, _ in m.named_parameters()], [n for n, _ in m.named_buffers()],
            [n for n, _ in m.named_children()], list(m.state_dict()))


def test_parameters_buffers_and_state_dict_keep_the_originals_order_in_copies_too():
    """fx registered a traced model's layers in the order its forward first calls them: an optimizer's state
    saved on the original (positional) went to other parameters of the optimized model."""
    import copy
    import io

    torch.manual_seed(0)
    model = _CalledOutOfOrder().train()
    opt = cf.optimize(model)
    assert opt.cudnn_fuse_summary.replaced
    buf = io.BytesIO()
    torch.save(opt, buf)
    for m in (opt, copy.deepcopy(opt), torch.load(io.BytesIO(buf.getvalue()), weights_only=False)):
        got = _orders(m)
        assert got[0] == _orders(model)[0] and got[1] == _orders(model)[1] and got[3] == _orders(model)[3]
        assert got[2][:len(_orders(model)[2])] == _orders(model)[2]  # a fused module of its own comes last


def test_an_optimizer_checkpoint_of_the_original_resumes_on_the_optimized_model():
    import copy

    torch.manual_seed(0)
    model = _CalledOutOfOrder().train()
    opt_model = cf.optimize(model)
    adam = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(3):
        adam.zero_grad()
        model(torch.randn(4, 8)).pow(2).sum().backward()
        adam.step()
    ckpt = copy.deepcopy((model.state_dict(), adam.state_dict()))

    def resume(m):
        m.load_state_dict(ckpt[0])
        o = torch.optim.Adam(m.parameters(), lr=1e-2)
        o.load_state_dict(copy.deepcopy(ckpt[1]))  # its tensors are shared with the optimizer otherwise
        torch.manual_seed(1)
        for _ in range(3):
            o.zero_grad()
            m(torch.randn(4, 8)).pow(2).sum().backward()
            o.step()
        return m.state_dict()

    want, got = resume(copy.deepcopy(model)), resume(opt_model)
    for k in want:
        torch.testing.assert_close(got[k], want[k])


class _FrozenNorms(nn.Module):
    """mmdet's ``norm_eval``: its train() keeps the BatchNorms in eval mode."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Linear(4, 4)

    def train(self, mode=True):
        super().train(mode)
        self.bn.eval()
        return self

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


class _Clamped(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def __call__(self, x):
        return super().__call__(x.clamp(-1, 1))

    def forward(self, x):
        return torch.relu(self.fc(x))


class _HoldsFrozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = _FrozenNorms(), nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.head(self.body(x)))


@pytest.mark.parametrize("make,x", [(_FrozenNorms, (2, 3, 6, 6)), (_HoldsFrozen, (2, 3, 6, 6)), (_Clamped, (2, 4))],
                         ids=["train-override", "container-train-override", "call-override"])
@pytest.mark.parametrize("first", ["eval", "train"])
def test_a_class_that_overrides_train_or_call_keeps_it(make, x, first):
    torch.manual_seed(0)
    model = make()
    getattr(model, first)()
    opt = cf.optimize(model)
    assert any("overrides" in why for _, why in opt.cudnn_fuse_summary.left_alone)
    for mode in ("train", "eval", "train"):
        getattr(model, mode)(), getattr(opt, mode)()
        inp = torch.randn(*x) * 3
        torch.testing.assert_close(opt(inp), model(inp))
    assert [m.training for m in opt.modules()] == [m.training for m in model.modules()]
    torch.testing.assert_close(opt.state_dict(), model.state_dict())


_HELPERS = {"__name__": "user_helpers", "torch": torch}  # a helper module of the model's package
exec("def add_optional(x, extra):\n    return x + extra if isinstance(extra, torch.Tensor) else x\n", _HELPERS)


class _HelperAsks(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, extra=None):
        return torch.relu(_HELPERS["add_optional"](self.fc(x), extra))


def test_a_type_test_on_a_traced_value_in_a_helper_of_another_module_is_refused_too():
    import builtins

    torch.manual_seed(0)
    model = _HelperAsks().eval()
    opt = cf.optimize(model)
    assert builtins.isinstance is isinstance and isinstance.__module__ == "builtins"  # put back
    assert any("type of a traced value" in why for _, why in opt.cudnn_fuse_summary.left_alone)
    x, e = torch.randn(2, 8), torch.randn(2, 8)
    torch.testing.assert_close(opt(x, e), model(x, e))
    torch.testing.assert_close(opt(x), model(x))


def _mlp_seq():
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


@pytest.mark.parametrize("change", ["replace-fused", "replace-in-mlp", "setitem", "delitem", "append"])
def test_a_layer_replaced_added_or_removed_after_optimize_is_the_one_that_runs(change, caplog):
    """A new head or adapter put in place after optimize(): the traced graph called the layer it held (or passed
    a plain layer the fused one's arguments); the model now runs its own forward, with one warning."""
    torch.manual_seed(0)
    model = _mlp_seq().eval()
    opt = cf.optimize(model)
    assert opt.cudnn_fuse_summary.replaced
    new = nn.Linear(8, 8) if change == "replace-fused" else nn.Linear(16, 8)
    with caplog.at_level("WARNING", logger="cudnn_fuse.optimize"):
        for m in (model, opt):
            if change == "replace-fused":
                m[0] = new
            elif change == "replace-in-mlp":
                setattr(m, "4", new)
            elif change == "setitem":
                m[-1] = new
            elif change == "delitem":
                del m[-1]
                del m[-1]
            else:
                m.append(nn.Tanh())
    assert sum("after optimize()" in r.getMessage() for r in caplog.records) == 1
    x = torch.randn(4, 8)
    torch.testing.assert_close(opt(x), model(x))
    assert len(opt) == len(model) and list(opt.state_dict()) == list(model.state_dict())


def test_a_slice_of_an_optimized_sequential_is_a_sequential_computing_the_originals_layers():
    torch.manual_seed(0)
    model = _mlp_seq().eval()
    opt = cf.optimize(model)
    x = torch.randn(4, 8)
    for part, want in ((opt[:3], model[:3]), (opt[1:], model[1:]), (opt[::2], model[::2])):
        assert isinstance(part, nn.Sequential) and list(part.state_dict()) == list(want.state_dict())
        torch.testing.assert_close(part(x), want(x))
