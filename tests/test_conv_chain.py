"""cf.nn.ConvChain and optimize(chain_convs=True), on the CPU path: a run of fused convs (no
activation or ReLU, no residual, each feeding only the next) becomes one autograd node whose
outputs and gradients equal the layers run one by one (and torch's), whose state_dict keys are
the model's own, which runs the layers one by one wherever one node could change what the user
sees (hooks, inference, autocast, cf.record, torch.compile), and which optimize() forms only
where the layers' outputs have no other user. The cuDNN backward programs it calls are the
layers' own (their GPU tests: test_gpu_conv_chain.py)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import cudnn_fuse as cf
from cudnn_fuse import nn as cfnn
from cudnn_fuse import torch_ops

torch.manual_seed(0)


def _stack(c=6, layers=4, act=nn.ReLU, **conv_kw):
    mods = []
    for _ in range(layers):
        mods.append(nn.Conv2d(c, c, 3, padding=1, **conv_kw))
        if act is not None:
            mods.append(act())
    return nn.Sequential(*mods)


def _grads(model, x, loss=lambda y: y.float().square().mean()):
    xs = x.detach().clone().requires_grad_(x.requires_grad)
    y = model(xs)
    loss(y).backward()
    out = [y.detach()] + [xs.grad] + [p.grad for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return out


def _chains(model) -> list:
    return [m for m in model.modules() if isinstance(m, cfnn.ConvChain)]


def _close(a, b, dtype):
    tol = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 5e-2}[dtype]
    assert len(a) == len(b)
    for u, v in zip(a, b):
        if u is None or v is None:
            assert u is None and v is None
            continue
        torch.testing.assert_close(u.float(), v.float(), rtol=tol, atol=tol)


def test_optimize_chains_a_conv_relu_stack_and_keeps_the_state_dict_keys():
    base = _stack()
    m = cf.optimize(base, chain_convs=True)
    chains = _chains(m)
    assert len(chains) == 1 and chains[0].chained and len(chains[0].layers) == 4
    assert list(m.state_dict()) == list(base.state_dict())  # the layers stay the model's children
    assert [id(l) for l in chains[0].layers] == [id(m.get_submodule(n)) for n in ("0", "2", "4", "6")]
    assert any("4 convs chained" in what for _, what in m.cudnn_fuse_summary.replaced)
    plain = nn.Sequential(*[copy.deepcopy(l) for l in base])
    plain.load_state_dict(m.state_dict())  # interchangeable with the torch model both ways
    m.load_state_dict(base.state_dict())


def test_optimize_chains_by_default_and_not_when_asked_not_to():
    assert _chains(cf.optimize(_stack()))
    assert not _chains(cf.optimize(_stack(), chain_convs=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["relu", "no activation", "strided and dilated", "same padding, no bias",
                                  "groups", "nchw input", "input needs no grad", "first layer frozen"])
def test_the_chained_step_equals_the_layers_one_by_one_and_torch(dtype, case):
    kw, act, x_grad = {}, nn.ReLU, True
    if case == "no activation":
        act = None
    elif case == "groups":
        kw = {"groups": 2}
    base = _stack(act=act, **kw)
    if case == "strided and dilated":
        base = nn.Sequential(nn.Conv2d(6, 8, 3, stride=2, padding=2, dilation=2), nn.ReLU(),
                             nn.Conv2d(8, 8, 1), nn.Conv2d(8, 6, 3, padding=1), nn.ReLU())
    elif case == "same padding, no bias":
        base = nn.Sequential(nn.Conv2d(6, 6, 4, padding="same", bias=False), nn.ReLU(),
                             nn.Conv2d(6, 6, 3, padding="same"), nn.ReLU(), nn.Conv2d(6, 6, 2, padding="same", bias=False))
    elif case == "input needs no grad":
        x_grad = False
    base = base.to(dtype)
    if case == "first layer frozen":
        base[0].weight.requires_grad_(False)
        base[0].bias.requires_grad_(False)
        x_grad = False
    chained = cf.optimize(base, chain_convs=True)
    single = cf.optimize(base, chain_convs=False)
    assert len(_chains(chained)) == 1 and not _chains(single)
    x = torch.randn(2, 6, 9, 9, dtype=dtype)
    if case != "nchw input":
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_(x_grad)
    got, want, ref = _grads(chained, x), _grads(single, x), _grads(base, x)
    _close(got, want, dtype)
    _close(got, ref, dtype)
    assert got[0].is_contiguous(memory_format=torch.channels_last) == want[0].is_contiguous(
        memory_format=torch.channels_last)


def test_one_autograd_node_for_the_whole_chain():
    m = cf.optimize(_stack(layers=5), chain_convs=True)
    x = torch.randn(1, 6, 7, 7, requires_grad=True)
    y = m(x)
    assert type(y.grad_fn).__name__ == "_ConvChainBackward"
    inputs = [f for f, _ in y.grad_fn.next_functions if f is not None]
    assert len(inputs) == 1 + 2 * 5  # the input's and each weight's and bias's accumulation, nothing else
    single = cf.optimize(_stack(layers=5), chain_convs=False)
    y1 = single(x)
    assert type(y1.grad_fn).__name__ != "_ConvChainBackward"


def test_it_saves_what_the_layers_save_and_no_more():
    base = _stack(layers=3)
    chained, single = cf.optimize(base, chain_convs=True), cf.optimize(base, chain_convs=False)
    x = torch.randn(2, 6, 8, 8, requires_grad=True)

    def saved(model):
        ids = set()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: ids.add((t.data_ptr(), t.numel())) or t, lambda t: t):
            model(x)
        return sum(n for _, n in ids)

    assert saved(chained) <= saved(single)


def test_inference_eval_and_no_grad_run_the_layers_one_by_one(monkeypatch):
    m = cf.optimize(_stack(), chain_convs=True)
    monkeypatch.setattr(torch_ops._ConvChain, "apply", lambda *a: pytest.fail("no chain node in inference"))
    x = torch.randn(1, 6, 5, 5)
    with torch.no_grad():
        y = m(x)
    m.eval()
    with torch.inference_mode():
        torch.testing.assert_close(m(x), y)
    for p in m.parameters():
        p.requires_grad_(False)
    m(x)  # grad on, but nothing requires a gradient: one by one too


@pytest.mark.parametrize("hook", ["forward", "forward pre", "full backward", "global forward"])
def test_a_hook_on_a_layer_runs_them_one_by_one_and_fires(hook):
    m = cf.optimize(_stack(), chain_convs=True)
    fired = []
    layer = m.get_submodule("2")
    if hook == "forward":
        h = layer.register_forward_hook(lambda mod, i, o: fired.append(1))
    elif hook == "forward pre":
        h = layer.register_forward_pre_hook(lambda mod, i: fired.append(1))
    elif hook == "full backward":
        h = layer.register_full_backward_hook(lambda mod, gi, go: fired.append(1))
    else:
        h = torch.nn.modules.module.register_module_forward_hook(lambda mod, i, o: fired.append(1))
    try:
        x = torch.randn(1, 6, 5, 5, requires_grad=True)
        y = m(x)
        assert type(y.grad_fn).__name__ != "_ConvChainBackward"
        y.sum().backward()
        assert fired
    finally:
        h.remove()
    y = m(x)
    assert type(y.grad_fn).__name__ == "_ConvChainBackward"  # back to one node once the hook is gone


def test_autocast_and_record_run_them_one_by_one():
    m = cf.optimize(_stack(), chain_convs=True)
    x = torch.randn(1, 6, 5, 5, requires_grad=True)
    chain = _chains(m)[0]
    assert chain._one_node(x) is not None
    with torch.autocast("cpu", dtype=torch.bfloat16):  # (cf's ops take no autocast: the layers decide, one by one)
        assert chain._one_node(x) is None
    with cf.record():
        assert type(m(x).grad_fn).__name__ != "_ConvChainBackward"


def test_chained_is_on_by_default_and_false_runs_the_layers_one_by_one():
    layers = [cfnn.Conv2d(4, 4, 3, padding=1, activation="relu") for _ in range(2)]
    assert cfnn.ConvChain(layers).chained is True
    off = cfnn.ConvChain(layers, chained=False)
    x = torch.randn(1, 4, 5, 5, requires_grad=True)
    assert type(off(x).grad_fn).__name__ != "_ConvChainBackward"
    with pytest.raises(TypeError, match="chained"):
        cfnn.ConvChain(layers, chained="no")
    model = cf.optimize(_stack(), chain_convs=False)
    assert not any(isinstance(m, cfnn.ConvChain) for m in model.modules())


def test_only_chainable_layers():
    with pytest.raises(ValueError, match="ConvChain"):
        cfnn.ConvChain([cfnn.Conv2d(2, 2, 1, activation="silu")])
    with pytest.raises(ValueError, match="ConvChain"):
        cfnn.ConvChain([nn.Conv2d(2, 2, 1)])
    with pytest.raises(TypeError, match="chain_convs"):
        cf.optimize(_stack(), chain_convs="yes")


class Skip(nn.Module):
    """conv -> relu -> conv -> relu, the first output also added at the end (another user)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.c(torch.relu(self.b(h))) + h


class Mixed(nn.Module):
    """relu convs, a SiLU conv (not chainable), then relu convs again: two chains."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(4, 4, 3, padding=1) for _ in range(5))

    def forward(self, x):
        x = torch.relu(self.convs[1](torch.relu(self.convs[0](x))))
        x = nn.functional.silu(self.convs[2](x))
        return torch.relu(self.convs[4](torch.relu(self.convs[3](x))))


def test_chains_form_only_where_each_output_feeds_only_the_next():
    skip = cf.optimize(Skip(), chain_convs=True)
    # a's output has two users (b and the add), and c takes the add as its residual: nothing chains
    assert not _chains(skip)
    x = torch.randn(2, 4, 6, 6, requires_grad=True)
    _close(_grads(skip, x), _grads(_copy_weights(Skip(), skip), x), torch.float32)
    mixed = cf.optimize(Mixed(), chain_convs=True)
    assert sorted(len(c.layers) for c in _chains(mixed)) == [2, 2]
    ref = _copy_weights(Mixed(), mixed)
    _close(_grads(mixed, x), _grads(ref, x), torch.float32)


def _copy_weights(fresh, optimized):
    fresh.load_state_dict(optimized.state_dict())
    return fresh


def test_a_retained_graph_gives_the_same_gradients_twice():
    m = cf.optimize(_stack(), chain_convs=True)
    x = torch.randn(1, 6, 5, 5, requires_grad=True)
    y = m(x).square().sum()
    y.backward(retain_graph=True)
    first = [x.grad.clone()] + [p.grad.clone() for p in m.parameters()]
    x.grad = None
    for p in m.parameters():
        p.grad = None
    y.backward()
    for a, b in zip(first, [x.grad] + [p.grad for p in m.parameters()]):
        torch.testing.assert_close(a, b)


def test_an_output_modified_in_place_is_caught_as_for_the_layers():
    m = cf.optimize(_stack(), chain_convs=True)
    y = m(torch.randn(1, 6, 5, 5, requires_grad=True))
    y.add_(1)  # ReLU's backward reads the output it saved
    with pytest.raises(RuntimeError, match="inplace"):
        y.sum().backward()


def test_deepcopy_to_and_pickle_keep_the_chain_on_the_models_own_layers():
    m = cf.optimize(_stack(), chain_convs=True)
    for other in (copy.deepcopy(m), _roundtrip(m)):
        chain = _chains(other)[0]
        assert [id(l) for l in chain.layers] == [id(other.get_submodule(n)) for n in ("0", "2", "4", "6")]
        assert not any(id(l) in {id(k) for k in _chains(m)[0].layers} for l in chain.layers)
    half = m.to(torch.bfloat16)
    assert all(l.weight.dtype == torch.bfloat16 for l in _chains(half)[0].layers)
    x = torch.randn(1, 6, 5, 5, dtype=torch.bfloat16, requires_grad=True)
    half(x).float().sum().backward()
    assert all(l.weight.grad is not None and l.weight.grad.dtype == torch.bfloat16 for l in _chains(half)[0].layers)


def _roundtrip(m):
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_torch_compile_fullgraph_runs_the_chain_one_by_one_with_the_same_gradients():
    m = cf.optimize(_stack(layers=3), chain_convs=True)
    x = torch.randn(2, 6, 6, 6, requires_grad=True)
    want = _grads(m, x)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    _close(_grads(compiled, x), want, torch.float32)


def test_a_layers_changed_padding_is_seen():
    layers = [cfnn.Conv2d(3, 3, 3, padding=1, activation="relu") for _ in range(2)]
    chain = cfnn.ConvChain(layers, chained=True)
    x = torch.randn(1, 3, 7, 7, requires_grad=True)
    assert chain(x).shape[-1] == 7
    layers[1].padding = (0, 0)
    y = chain(x)
    assert y.shape[-1] == 5
    y.sum().backward()
    ref = torch.relu(nn.functional.conv2d(torch.relu(nn.functional.conv2d(x, layers[0].weight, layers[0].bias, padding=1)),
                                          layers[1].weight, layers[1].bias))
    torch.testing.assert_close(y, ref)


@pytest.mark.parametrize("seed", range(16))
def test_random_conv_runs_chain_and_match(seed):
    """Random runs (length, widths, kernels, strides, dilation, groups, bias, ReLU or none, dtype,
    layout, which grads are wanted): one chain over the whole run, equal to the layers one by one."""
    import random

    rnd = random.Random(seed)
    dtype = rnd.choice([torch.float32, torch.float16, torch.bfloat16])
    c, mods, size = rnd.choice([4, 6, 8]), [], 17
    for _ in range(rnd.randint(2, 5)):
        k = rnd.choice([1, 2, 3])
        out = rnd.choice([4, 6, 8])
        groups = 2 if c % 2 == 0 and out % 2 == 0 and rnd.random() < 0.3 else 1
        stride, pad = rnd.choice([1, 1, 2]), rnd.choice([0, 1]) if k > 1 else 0
        dil = rnd.choice([1, 2]) if k == 3 else 1
        nxt = (size + 2 * pad - dil * (k - 1) - 1) // stride + 1
        if nxt < 3:  # keep the image from vanishing
            stride, pad, dil = 1, (k - 1) // 2 + (k - 1) % 2, 1
            nxt = size + 2 * pad - (k - 1)
        size = nxt
        mods.append(nn.Conv2d(c, out, k, stride=stride, padding=pad, dilation=dil, groups=groups, bias=rnd.random() < 0.8))
        if rnd.random() < 0.7:
            mods.append(nn.ReLU())
        c = out
    base = nn.Sequential(*mods).to(dtype)
    for p in base.parameters():
        p.requires_grad_(rnd.random() < 0.85)
    chained = cf.optimize(base, chain_convs=True)
    single = cf.optimize(base, chain_convs=False)
    chains = _chains(chained)
    assert len(chains) == 1 and len(chains[0].layers) == sum(isinstance(m, nn.Conv2d) for m in mods)
    x = torch.randn(2, mods[0].in_channels, 17, 17, dtype=dtype)
    if rnd.random() < 0.5:
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_(rnd.random() < 0.6)
    if not x.requires_grad and not any(p.requires_grad for p in base.parameters()):
        base[0].weight.requires_grad_(True)
    _close(_grads(chained, x), _grads(single, x), dtype)
