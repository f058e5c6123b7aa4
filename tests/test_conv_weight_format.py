"""A cf conv layer's weight follows its device: NCHW on the CPU (cf's CPU conv runs on NCHW operands,
so a channels_last weight was copied at every call, and torch's own CPU conv corrupts the heap on
some channels_last operands), channels_last on CUDA (and meta, which stands for the device a model
is materialized on). CUDA itself cannot run here: meta is the off-CPU device these tests move to,
through the same code path (``cudnn_fuse.nn.weight_format`` maps both to channels_last)."""

import copy
import io
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import cudnn_fuse as cf
from cudnn_fuse import nn as cfnn
from cudnn_fuse.demo import SmallResNet
from cudnn_fuse.reference import is_channels_last


def _nchw(t) -> bool:
    """Row-major strides (a 1x1 weight strided (C, 1, C, C) is_contiguous() but is no NCHW to torch's conv)."""
    return t.stride() == torch.empty(t.shape).stride()


def _channels_last(t) -> bool:
    return t.stride() == torch.empty(t.shape).to(memory_format=torch.channels_last).stride()


def _cf_convs(model):
    return [m for m in model.modules() if isinstance(m, cfnn.Conv2d)]


class _Copies(TorchDispatchMode):
    """Counts the copies (clone, copy_) that reach the dispatcher."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.clone, torch.ops.aten.copy_, torch.ops.aten._to_copy):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _copies(fn) -> int:
    with _Copies() as c:
        fn()
    return c.n


@pytest.mark.parametrize("train", [False, True])
def test_an_optimized_cnn_on_the_cpu_keeps_nchw_weights_and_copies_no_more_than_eager(train):
    """The demo's CNN: optimize() made every conv weight channels_last, and the CPU conv copied each weight,
    each channels_last input and each output (29 copies in an inference forward where eager made none).
    In train mode the BatchNorms stay, so the convs stay torch's: theirs were made channels_last too."""
    torch.manual_seed(0)
    model = SmallResNet(c=32).train(train)
    x = torch.randn(2, 3, 32, 32)
    opt = cf.optimize(model)
    convs = [m for m in opt.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 10 and len(_cf_convs(opt)) == (0 if train else 10)
    assert all(_nchw(m.weight) for m in convs), [m.weight.stride() for m in convs]
    if train:
        def step(m):
            return lambda: m(x).sum().backward()
    else:
        def step(m):
            return lambda: torch.no_grad()(m)(x)
    eager_n, cf_n = _copies(step(model)), _copies(step(opt))
    assert cf_n <= eager_n, (cf_n, eager_n)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)


def test_the_cpu_conv_copies_nothing_on_nchw_operands():
    torch.manual_seed(0)
    layer = cfnn.Conv2d(8, 16, 3, padding=1, activation="relu")
    x = torch.randn(2, 8, 9, 9, requires_grad=True)
    with torch.no_grad():
        assert _copies(lambda: layer(x)) == 0
    assert _copies(lambda: layer(x).sum().backward()) == 0
    assert x.grad is not None and layer.weight.grad is not None


_HOOKED = """
import torch, cudnn_fuse as cf
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 1, 2), torch.nn.ReLU())
m[0].register_forward_hook(lambda mod, i, o: None)  # a hooked conv: optimize() leaves it to torch
m = cf.optimize(m)
assert type(m[0]) is torch.nn.Conv2d
x = torch.randn(3, 8, 16, 16, requires_grad=True)
m(x).sum().backward()
print("ok", tuple(m[0].weight.stride()))
"""


def test_a_torch_conv_optimize_left_alone_keeps_its_nchw_weight_on_the_cpu(tmp_path):
    """optimize() made every 4-D tensor channels_last, also a conv it left to torch (here a hooked one):
    torch 2.13's CPU conv backward then corrupted the heap (tests/test_reference.py's crash case, a 1x1
    stride-2 conv of a [3, 8, 16, 16] input). Run in a subprocess: the old code crashed it."""
    script = tmp_path / "hooked.py"
    script.write_text(_HOOKED)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok (8, 1, 1, 1)" in res.stdout, (res.returncode, res.stdout[-500:],
                                                                      res.stderr[-2000:])


@pytest.fixture
def swap_on_moves():
    """torch swaps a moved Parameter's contents (the object stays) where it cannot set its ``.data``: a move
    to or from meta makes a new Parameter otherwise (a CPU -> CUDA move sets ``.data``, as the tests of
    ``_weight_to_device_format`` below do)."""
    was = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(was)


def test_the_weight_format_follows_the_device_keeping_the_parameter(swap_on_moves):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 1), torch.nn.ReLU())
    opt = cf.optimize(model)
    convs = _cf_convs(opt)
    assert len(convs) == 2 and all(_nchw(m.weight) for m in convs)
    params = [m.weight for m in convs]
    values = [p.detach().clone() for p in params]
    every = [(p, p.detach().clone()) for p in opt.parameters()]  # to_empty leaves the biases uninitialized too
    sgd = torch.optim.SGD(opt.parameters(), lr=0.1)
    opt.to("meta")  # off the CPU: what .cuda() does, on the device that stands for it here
    assert all(m.weight is p for m, p in zip(convs, params))
    assert all(m.weight.is_meta and _channels_last(m.weight) for m in convs), [m.weight.stride() for m in convs]
    assert convs[1].weight.stride() == (8, 1, 8, 8)  # a 1x1 weight restrided, as optimize() gives it on CUDA
    opt.to_empty(device="cpu")  # materialized on the CPU: NCHW again
    assert all(m.weight is p for m, p in zip(convs, params))
    assert all(_nchw(m.weight) and m.weight.device.type == "cpu" for m in convs)
    with torch.no_grad():
        for p, v in every:
            p.copy_(v)
    held = {id(q) for group in sgd.param_groups for q in group["params"]}
    assert all(id(p) in held for p in params)  # the optimizer holds the very Parameters the layers use
    opt(torch.rand(1, 3, 8, 8)).sum().backward()
    sgd.step()  # and it moves them: every weight that got a gradient changed, as SGD's rule says
    for p, v in zip(params, values):
        torch.testing.assert_close(p.detach(), v - 0.1 * p.grad)
    assert any(p.grad.abs().sum() > 0 for p in params)


def test_the_cuda_weight_format_is_channels_last():
    """The device -> format rule itself (no CUDA here: its device object is enough to ask)."""
    assert cfnn.weight_format(torch.device("cuda")) is torch.channels_last
    assert cfnn.weight_format("cuda:1") is torch.channels_last
    assert cfnn.weight_format("meta") is torch.channels_last
    assert cfnn.weight_format("cpu") is torch.contiguous_format
    assert cfnn.weight_format("mps") is None


def test_a_move_asks_the_format_of_the_new_device_only(monkeypatch):
    layer = cfnn.Conv2d(4, 8, 3)
    asked = []

    def spy(device):
        asked.append(torch.device(device).type)
        return torch.channels_last

    monkeypatch.setattr(cfnn, "weight_format", spy)
    layer._apply(lambda t: t.to("meta"))
    assert asked == ["meta"] and _channels_last(layer.weight)
    asked.clear()
    layer._apply(lambda t: t.clone())  # no move: nothing asked, nothing changed (fresh data, same strides)
    layer.half()
    assert asked == [] and _channels_last(layer.weight)


def test_a_new_format_is_set_on_the_same_parameter(monkeypatch):
    """What a CPU -> CUDA move ends with, on the CPU as if it were CUDA: the weight's ``.data`` takes
    channels_last; the Parameter object stays, tied layers stay tied, an optimizer and a hook on it work."""
    monkeypatch.setattr(cfnn, "weight_format", lambda device: torch.channels_last)
    torch.manual_seed(0)
    a, b = cfnn.Conv2d(4, 4, 3, padding=1), cfnn.Conv2d(4, 4, 3, padding=1, activation="relu")
    b.weight = a.weight
    w, before = a.weight, a.weight.detach().clone()
    seen = []
    w.register_hook(lambda g: seen.append(g.shape))
    sgd = torch.optim.SGD(list(a.parameters()) + [b.bias], lr=0.1)
    a._weight_to_device_format()
    b._weight_to_device_format()
    assert a.weight is w and b.weight is w and is_channels_last(w) and torch.equal(w, before)
    x = torch.randn(2, 4, 6, 6)
    b(a(x)).sum().backward()
    assert seen and w.grad is not None
    sgd.step()
    assert not torch.equal(w, before) and a.weight is w and b.weight is w


def test_tied_weights_stay_tied_across_moves(swap_on_moves):
    a, b = cfnn.Conv2d(4, 4, 3, padding=1), cfnn.Conv2d(4, 4, 3, padding=1)
    b.weight = a.weight
    seq = torch.nn.Sequential(a, b)
    seq.to("meta")
    assert a.weight is b.weight and _channels_last(a.weight)
    seq.to_empty(device="cpu")
    assert a.weight is b.weight and _nchw(a.weight)


def test_an_explicit_memory_format_is_left_as_asked():
    layer = cfnn.Conv2d(4, 8, 3)
    layer.to(memory_format=torch.channels_last)  # asked for on the CPU: kept (cf's conv copies it, as before)
    assert is_channels_last(layer.weight)
    x = torch.randn(2, 4, 7, 7)
    torch.testing.assert_close(layer(x), F.conv2d(x, layer.weight.contiguous(), layer.bias))
    layer.to("meta")
    assert _channels_last(layer.weight)
    layer.to(memory_format=torch.contiguous_format)  # asked for off the CPU: kept
    assert _nchw(layer.weight)
    assert _nchw(copy.deepcopy(layer).weight)  # a copy: no move


def test_a_pickled_layer_loaded_onto_another_device_takes_its_format():
    torch.manual_seed(0)
    layer = cfnn.Conv2d(4, 8, 3, activation="relu")
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    on_meta = torch.load(buf, map_location="meta", weights_only=False)
    assert on_meta.weight.is_meta and _channels_last(on_meta.weight), on_meta.weight.stride()
    assert "_pickled_weight_device" not in vars(on_meta)
    buf.seek(0)
    same = torch.load(buf, weights_only=False)  # the same device: as it was
    assert _nchw(same.weight) and torch.equal(same.weight, layer.weight)
    layer.to(memory_format=torch.channels_last)
    assert is_channels_last(copy.deepcopy(layer).weight)  # a copy on the same device keeps the format


def test_an_optimized_model_pickles_and_loads_its_state_dict_unchanged():
    torch.manual_seed(0)
    model = SmallResNet(c=16).eval()
    opt = cf.optimize(model)
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        want = opt(x)
    sd = opt.state_dict()
    assert all(_nchw(sd[k]) for k, m in opt.named_modules() for k in [k + ".weight"] if isinstance(m, cfnn.Conv2d))
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert all(_nchw(m.weight) for m in _cf_convs(back))
    cl = {k: (v.to(memory_format=torch.channels_last) if v.dim() == 4 else v) for k, v in sd.items()}
    back.load_state_dict(cl)  # copied into the weights: their NCHW layout stays
    assert all(_nchw(m.weight) for m in _cf_convs(back))
    with torch.no_grad():
        torch.testing.assert_close(back(x), want)


def test_a_parametrized_weight_is_left_alone():
    from torch.nn.utils import parametrize

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    layer = cfnn.Conv2d(4, 8, 3)
    parametrize.register_parametrization(layer, "weight", Double())
    layer.to("meta")
    layer.to_empty(device="cpu")
    assert layer.weight.shape == (8, 4, 3, 3)


def test_optimize_off_the_cpu_still_makes_channels_last_and_takes_5d_tensors():
    """On a non-CPU device (meta here, CUDA on the GPU) optimize() makes 4-D tensors channels_last as
    before; a 5-D one (a Conv3d's weight) made its Module.to(memory_format=channels_last) raise
    'required rank 4 tensor to use channels_last format'."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2 = torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 8, 3)
            self.c3 = torch.nn.Conv3d(2, 2, 1)  # not called by forward: a model holding a 5-D weight

        def forward(self, x):
            return self.c2(F.relu(self.c1(x)))

    with torch.device("meta"):
        model = Net()
    model.c2.register_forward_hook(lambda mod, i, o: None)  # left to torch
    opt = cf.optimize(model)
    convs = _cf_convs(opt)
    assert len(convs) == 1 and _channels_last(convs[0].weight) and convs[0].weight.is_meta
    assert type(opt.c2) is torch.nn.Conv2d and _channels_last(opt.c2.weight)  # the torch conv too, as before
    assert opt.c3.weight.dim() == 5 and opt.c3.weight.is_contiguous()
