"""optimize(): an RMSNorm written out in torch ops becomes one ``F.rms_norm`` call (cudnn_fuse.nn.RMSNorm),
told by its computation: the same answer, the same state_dict, the same gradients, and modules that only
look like one are left as they are."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudnn_fuse as cf
from cudnn_fuse import nn as cfnn
from cudnn_fuse.optimize import _rms_norm_eps


class LlamaStyle(nn.Module):
    """transformers' LlamaRMSNorm, written as it is there."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class _Norm(nn.Module):
    """One 1-D weight (``init(d)``) and an epsilon: what the norms below share."""

    def __init__(self, d, eps=1e-6, init=torch.ones):
        super().__init__()
        self.weight = nn.Parameter(init(d))
        self.eps = eps


class DivStyle(_Norm):
    """The same norm as a division by the root mean square."""

    def __init__(self, d, eps=1e-5):
        super().__init__(d, eps, lambda d: torch.rand(d) + 0.5)

    def forward(self, x):
        return x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight


class HandLayerNorm(_Norm):
    """Subtracts the mean first: a LayerNorm without bias, not an RMSNorm."""

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class OffsetStyle(_Norm):
    """Gemma's scale by (1 + weight): another computation, left alone."""

    def __init__(self, d, eps=1e-6):
        super().__init__(d, eps, torch.zeros)

    def forward(self, x):
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class WrongAxis(_Norm):
    """The mean over the first axis."""

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + self.eps)


class Block(nn.Module):
    """A pre-norm MLP block: the norm, then Linear + GELU + Linear and the residual."""

    def __init__(self, d=32):
        super().__init__()
        self.norm = LlamaStyle(d)
        self.up = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(self.act(self.up(self.norm(x))))


def test_the_pattern_is_told_by_its_computation():
    assert _rms_norm_eps(LlamaStyle(16, eps=1e-6)) == 1e-6
    assert _rms_norm_eps(DivStyle(16, eps=1e-5)) == 1e-5
    for other in (HandLayerNorm(16), OffsetStyle(16), WrongAxis(16), nn.RMSNorm(16), nn.LayerNorm(16)):
        assert _rms_norm_eps(other) is None, type(other).__name__
    hooked = LlamaStyle(16)
    hooked.register_forward_hook(lambda *a: None)
    assert _rms_norm_eps(hooked) is None  # the replacement would not run the hook
    with_buffer = LlamaStyle(16)
    with_buffer.register_buffer("extra", torch.ones(1))
    assert _rms_norm_eps(with_buffer) is None


@pytest.mark.parametrize("cls", [LlamaStyle, DivStyle])
def test_a_lone_norm_is_replaced_and_answers_as_before(cls):
    torch.manual_seed(0)
    m = cls(48)
    with torch.no_grad():
        m.weight.copy_(torch.rand(48) + 0.5)
    o = cf.optimize(m)
    assert isinstance(o, cfnn.RMSNorm) and "rms_norm" in str(o.cudnn_fuse_summary)
    x = torch.randn(4, 7, 48) * 3 + 1
    torch.testing.assert_close(o(x), m(x), rtol=1e-5, atol=1e-6)
    assert o.weight is not m.weight and torch.equal(o.weight, m.weight)  # optimize() copied the model
    assert list(o.state_dict()) == list(m.state_dict()) == ["weight"]


def test_inside_a_traced_block_the_norm_and_the_mlp_are_both_replaced():
    torch.manual_seed(0)
    m = Block().eval()
    o = cf.optimize(m)
    patterns = [p for _, p in o.cudnn_fuse_summary.replaced]
    assert any("rms_norm" in p for p in patterns) and any("Linear + gelu + Linear" in p for p in patterns)
    assert isinstance(o.get_submodule("norm"), cfnn.RMSNorm)
    x = torch.randn(3, 5, 32)
    with torch.no_grad():
        torch.testing.assert_close(o(x), m(x), rtol=1e-5, atol=1e-5)
    assert set(o.state_dict()) == set(m.state_dict())
    o.load_state_dict(m.state_dict())


def test_an_epsilon_set_on_the_replaced_norm_after_optimize_takes_effect():
    torch.manual_seed(0)
    m = Block().eval()
    o = cf.optimize(m)
    assert isinstance(o.get_submodule("norm"), cfnn.RMSNorm)
    m.norm.variance_epsilon = o.norm.variance_epsilon = 1.0
    assert o.norm.variance_epsilon == 1.0 and "variance_epsilon" not in vars(o.norm)
    x = torch.randn(3, 5, 32)
    with torch.no_grad():
        torch.testing.assert_close(o(x), m(x), rtol=1e-5, atol=1e-5)
    o.norm.train(), o.norm.eval()  # its own attributes stay its own
    assert not o.norm.training and o.norm.weight is vars(o.norm)["original"].weight


def test_gradients_match_the_written_out_norm():
    torch.manual_seed(0)
    m = LlamaStyle(24)
    with torch.no_grad():
        m.weight.copy_(torch.rand(24) + 0.5)
    o = cf.optimize(m)
    x = torch.randn(6, 24, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    g = torch.randn(6, 24)
    (m(x) * g).sum().backward()
    (o(x2) * g).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(o.weight.grad, m.weight.grad, rtol=1e-4, atol=1e-5)


def test_bf16_rounds_once_and_stays_within_its_rounding():
    torch.manual_seed(0)
    m = LlamaStyle(64).to(torch.bfloat16)
    with torch.no_grad():
        m.weight.copy_(torch.rand(64) + 0.5)
    o = cf.optimize(m)
    x = (torch.randn(16, 64) * 2).to(torch.bfloat16)
    want = F.rms_norm(x.float(), (64,), m.weight.float(), 1e-6)  # float32 throughout
    got, eager = o(x), m(x)
    assert got.dtype == eager.dtype == torch.bfloat16
    # one rounding, where the written-out norm rounds its normalized x and then its product
    assert (got.float() - want).abs().max() <= (eager.float() - want).abs().max() + 1e-6
    torch.testing.assert_close(got, eager, rtol=2e-2, atol=2e-2)


def test_calls_it_does_not_cover_run_the_modules_own_forward():
    torch.manual_seed(0)
    m = LlamaStyle(16).to(torch.bfloat16)
    o = cf.optimize(m)
    x32 = torch.randn(3, 16)  # another dtype than the weight's: the module promotes to float32
    assert o(x32).dtype == m(x32).dtype == torch.float32
    torch.testing.assert_close(o(x32), m(x32), rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(o(x32), m(x32), rtol=0, atol=0)
    with pytest.raises(RuntimeError):  # a wrong width raises as the module does
        o(torch.randn(3, 8, dtype=torch.bfloat16))


def test_what_callers_read_of_the_replaced_module_is_still_there_and_it_copies():
    m = LlamaStyle(8, eps=1e-5)
    o = cf.optimize(m)
    assert o.variance_epsilon == 1e-5 and o.eps == 1e-5
    with pytest.raises(AttributeError):
        o.no_such_attribute
    for twin in (copy.deepcopy(o), pickle.loads(pickle.dumps(o))):
        x = torch.randn(2, 8)
        torch.testing.assert_close(twin(x), o(x))
        assert twin.variance_epsilon == 1e-5


def test_a_shared_norm_is_replaced_once_for_every_call_site():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = LlamaStyle(16)

        def forward(self, x):
            return self.norm(self.norm(x) * 2)

    m = Twice()
    o = cf.optimize(m)
    assert [p for _, p in o.cudnn_fuse_summary.replaced if "rms_norm" in p] == \
        ["LlamaStyle (an RMSNorm in torch ops) -> torch's fused rms_norm kernel"]
    x = torch.randn(4, 16)
    torch.testing.assert_close(o(x), m(x), rtol=1e-5, atol=1e-6)
    assert len(list(o.parameters())) == 1


def test_transformers_llama_norms_are_replaced():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100)
    m = tf.LlamaForCausalLM(cfg).eval()
    o = cf.optimize(m)
    norms = [w for w, p in o.cudnn_fuse_summary.replaced if "rms_norm" in p]
    assert len(norms) == 2 * 2 + 1  # two a layer, and the final one
    ids = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(o(ids).logits, m(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_norm_that_answers_16_bit_input_in_float32_is_left_alone():
    class Upcasting(_Norm):
        def forward(self, x):
            x = x.float()
            return self.weight.float() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    m = Upcasting(16)
    assert _rms_norm_eps(m) is None  # F.rms_norm would answer bf16 input in bf16
    o = cf.optimize(m)
    assert not isinstance(o, cfnn.RMSNorm)
    assert o(torch.randn(2, 16, dtype=torch.bfloat16)).dtype == torch.float32


def test_each_optimize_call_tells_its_norms_anew():
    m = DivStyle(16)
    handle = m.register_forward_hook(lambda *a: None)
    assert not isinstance(cf.optimize(m, inplace=True), cfnn.RMSNorm)  # a hook the replacement would not run
    handle.remove()
    assert isinstance(cf.optimize(m, inplace=True), cfnn.RMSNorm)

