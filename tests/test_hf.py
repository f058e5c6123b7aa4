"""transformers models through optimize(): attention switched to cudnn_fuse, outputs equal.

transformers comes with the test extra (`pip install ".[test]"`), so CI runs these on the CPU;
the GPU machine's image has it too."""

from __future__ import annotations

import pytest
import torch

import cudnn_fuse as cf

transformers = pytest.importorskip("transformers")


def _models():
    yield transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64,
                                                               vocab_size=100, bos_token_id=0, eos_token_id=0))
    yield transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64,
                                                                 intermediate_size=128, num_attention_heads=8,
                                                                 num_key_value_heads=2, vocab_size=100))


@pytest.mark.parametrize("model", list(_models()), ids=lambda m: type(m).__name__)
def test_attention_is_switched_and_outputs_match(model):
    torch.manual_seed(0)
    model = model.eval()
    ids = torch.randint(0, 100, (2, 16))
    pad = torch.ones(2, 16, dtype=torch.long)
    pad[1, :5] = 0  # left padding: the padding mask must reach the attention
    with torch.no_grad():
        ref, ref_pad = model(ids).logits, model(ids, attention_mask=pad).logits
        opt = cf.optimize(model)
        out, out_pad = opt(ids).logits, opt(ids, attention_mask=pad).logits
    assert opt.config._attn_implementation == "cudnn_fuse"
    assert model.config._attn_implementation == "sdpa"  # the original is untouched
    assert any("cudnn_fuse attention" in p for _, p in opt.cudnn_fuse_summary.replaced)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(out_pad, ref_pad)


def test_attention_calls_reach_cudnn_fuse(monkeypatch):
    from cudnn_fuse import hf

    calls = []
    real = hf.attention_forward
    monkeypatch.setattr(hf, "attention_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = next(_models()).eval()
    opt = cf.optimize(model)
    with torch.no_grad():
        opt(torch.randint(0, 100, (1, 8)))
    assert len(calls) == 2  # one per layer


def test_gradients_flow_through_the_switched_attention():
    model = list(_models())[1].train()
    opt = cf.optimize(model)
    ids = torch.randint(0, 100, (2, 8))
    loss = opt(ids, labels=ids).loss
    loss.backward()
    ref_loss = model(ids, labels=ids).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    g = dict(opt.named_parameters())
    for n, p in model.named_parameters():
        if n in g and g[n].grad is not None:
            torch.testing.assert_close(g[n].grad, p.grad, rtol=1e-4, atol=1e-6)


def test_gpt2_mlp_conv1d_gelu_is_fused_and_trains():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=100, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).train()  # no dropout: the two runs must agree
    opt = cf.optimize(model)
    patterns = dict(opt.cudnn_fuse_summary.replaced)
    assert patterns["transformer.h.0.mlp.c_fc"] == "Conv1D + gelu_tanh"
    assert "no epilogue" in dict(opt.cudnn_fuse_summary.left_alone)["transformer.h.0.mlp.c_proj"]
    fused = opt.get_submodule("transformer.h.0.mlp.c_fc")
    assert isinstance(fused.weight, torch.nn.Parameter) and fused.weight.shape == (64, 256)  # [in, out], shared
    ids = torch.randint(0, 100, (2, 8))
    loss, ref = opt(ids, labels=ids).loss, model(ids, labels=ids).loss
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(fused.weight.grad, model.transformer.h[0].mlp.c_fc.weight.grad, rtol=1e-4, atol=1e-6)


def _gpt2(vocab=50257, d=32):
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=d, n_head=4, n_positions=32, vocab_size=vocab, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0)).train()


def test_gpt2_full_vocab_lm_head_is_aligned_tied_and_trains_the_same():
    model = _gpt2()
    opt = cf.optimize(model)
    assert isinstance(opt.lm_head, cf.nn.AlignedLinear) and opt.lm_head.weight is opt.transformer.wte.weight
    assert "50257 wide padded to 50264" in dict(opt.cudnn_fuse_summary.replaced)["lm_head"]
    opt.lm_head.forward = opt.lm_head.padded_forward  # the GPU's path, on the CPU
    ids = torch.randint(0, 50257, (2, 16))
    out = opt(ids, labels=ids)
    assert out.logits.shape == (2, 16, 50257) and out.logits.stride()[-2:] == (50264, 1)
    ref = model(ids, labels=ids)
    torch.testing.assert_close(out.loss, ref.loss)
    out.loss.backward()
    ref.loss.backward()
    torch.testing.assert_close(opt.transformer.wte.weight.grad, model.transformer.wte.weight.grad,
                               rtol=1e-4, atol=1e-6)


def test_torch_compile_over_an_optimized_gpt2_is_one_graph_with_the_same_gradients():
    model = _gpt2(vocab=100, d=64)
    opt = cf.optimize(model)
    ids = torch.randint(0, 100, (2, 16))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(opt)(ids)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    torch._dynamo.reset()
    loss = torch.compile(opt, dynamic=False)(ids, labels=ids).loss
    ref = model(ids, labels=ids).loss
    torch.testing.assert_close(loss, ref)
    loss.backward()
    ref.backward()
    g = dict(opt.named_parameters())
    shared = [n for n, _ in model.named_parameters() if n in g]
    assert "transformer.wte.weight" in shared and len(shared) >= 10
    for n, p in model.named_parameters():
        if n in g:
            torch.testing.assert_close(g[n].grad, p.grad, rtol=1e-4, atol=1e-6)
    fused = opt.get_submodule("transformer.h.0.mlp.c_fc")  # Conv1D + gelu_tanh
    torch.testing.assert_close(fused.weight.grad, model.transformer.h[0].mlp.c_fc.weight.grad, rtol=1e-4, atol=1e-6)


def _attention_calls(monkeypatch, theirs=None):
    """Record (mask is None, is_causal) of every cf attention call, traced or run; and in ``theirs`` whether
    each call of transformers' own sdpa attention (a training step's) had no mask."""
    from transformers.integrations import sdpa_attention

    from cudnn_fuse import functional

    calls, real, real_theirs = [], functional.scaled_dot_product_attention, sdpa_attention.sdpa_attention_forward

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append((attn_mask is None, kw.get("is_causal")))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    def spy_theirs(module, q, k, v, attention_mask, *a, **kw):
        if theirs is not None:
            theirs.append(attention_mask is None)
        return real_theirs(module, q, k, v, attention_mask, *a, **kw)

    monkeypatch.setattr(functional, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", spy_theirs)
    return calls


def _transformers_never_skips(monkeypatch):
    """What transformers < 5.2x does under torch.compile (torch < 2.14) and under CUDA-graph
    capture: it never lets a causal mask be skipped while tracing."""
    import transformers.masking_utils as mu

    monkeypatch.setattr(mu, "_ignore_causal_mask_sdpa", lambda *a, **k: False)


def test_a_plain_causal_mask_is_not_built_even_under_torch_compile(monkeypatch):
    model = _gpt2(vocab=100, d=64).eval()
    opt = cf.optimize(model)
    _transformers_never_skips(monkeypatch)
    calls = _attention_calls(monkeypatch)
    ids = torch.randint(0, 100, (2, 16))
    torch._dynamo.reset()
    with torch.no_grad():
        out, ref = torch.compile(opt, dynamic=False)(ids).logits, model(ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert calls and all(c == (True, True) for c in calls)  # traced with no mask: is_causal


def test_a_padding_mask_is_still_built_and_applied(monkeypatch):
    model = _gpt2(vocab=100, d=64).eval()
    opt = cf.optimize(model)
    calls = _attention_calls(monkeypatch)
    ids = torch.randint(0, 100, (2, 16))
    pad = torch.ones(2, 16, dtype=torch.long)
    pad[1, 11:] = 0  # the second sequence is 11 tokens long
    with torch.no_grad():
        out = opt(ids, attention_mask=pad).logits
        ref = model(ids, attention_mask=pad).logits
    torch.testing.assert_close(out[:, :11], ref[:, :11], rtol=1e-4, atol=1e-5)
    assert calls and all(c[0] is False for c in calls)  # a mask went to attention


def test_causal_mask_defers_to_transformers_outside_the_plain_case(monkeypatch):
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    from cudnn_fuse.hf import causal_mask

    kw = dict(batch_size=2, q_length=8, kv_length=8, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
              attention_mask=None, local_size=None, allow_is_causal_skip=True, device="cpu")
    assert causal_mask(**kw) is None
    _transformers_never_skips(monkeypatch)
    assert causal_mask(**kw) is None and sdpa_mask(**kw).shape == (2, 1, 8, 8)  # the skip is cf's own
    for change in (dict(kv_length=12), dict(q_offset=4, kv_length=12), dict(q_offset=torch.tensor(0)),
                   dict(local_size=4), dict(allow_is_causal_skip=False),
                   dict(attention_mask=torch.tensor([[1] * 8, [1] * 5 + [0] * 3]).bool())):
        args = {**kw, **change}
        mine, theirs = causal_mask(**args), sdpa_mask(**args)
        assert (mine is None) == (theirs is None), change
        if theirs is not None:
            assert torch.equal(mine, theirs), change


def _cacheless_gpt2():
    """GPT-2 as the benchmarks run it (use_cache=False): transformers then checks the positions
    for packed sequences, which it cannot do while tracing."""
    model = _gpt2(vocab=100, d=64)
    model.config.use_cache = False
    return model


@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
def test_no_packed_sequence_mask_is_traced_for_a_call_without_position_ids(monkeypatch, train):
    """Under torch.compile a cache-less GPT-2 call given no position_ids gets no mask (is_causal),
    where transformers alone materializes its packed-sequence mask; outputs and gradients equal
    the original model's."""
    import transformers.masking_utils as mu

    model = _cacheless_gpt2().train(train)
    opt = cf.optimize(model)
    theirs = []
    calls = _attention_calls(monkeypatch, theirs)
    ids = torch.randint(0, 100, (2, 16))
    torch._dynamo.reset()
    compiled = torch.compile(opt, dynamic=False)
    if train:
        out, ref = compiled(ids, labels=ids).loss, model(ids, labels=ids).loss
        out.backward()
        ref.backward()
        torch.testing.assert_close(opt.transformer.h[0].attn.c_attn.weight.grad,
                                   model.transformer.h[0].attn.c_attn.weight.grad, rtol=1e-4, atol=1e-6)
    else:
        with torch.no_grad():
            out, ref = compiled(ids).logits, model(ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    if train:  # a training step runs transformers' own attention, given no mask either
        assert theirs and all(theirs) and not calls
    else:
        assert calls and all(c == (True, True) for c in calls) and not theirs
    assert hasattr(mu.find_packed_sequence_indices, "cudnn_fuse_wrapped")
    assert not getattr(cf.hf._calls, "stack", [])  # every call popped what it pushed


def test_packed_position_ids_still_mask_between_sequences(monkeypatch):
    """Positions that restart (two sequences packed in a row) keep transformers' packed mask,
    eager and compiled: the shortcut is only for calls that were given no position_ids."""
    model = _cacheless_gpt2().eval()
    opt = cf.optimize(model)
    calls = _attention_calls(monkeypatch)
    ids = torch.randint(0, 100, (2, 16))
    pos = torch.cat([torch.arange(10), torch.arange(6)]).expand(2, 16)
    torch._dynamo.reset()
    with torch.no_grad():
        ref = model(ids, position_ids=pos).logits
        eager = opt(ids, position_ids=pos).logits
        compiled = torch.compile(opt, dynamic=False)(ids, position_ids=pos).logits
    for out in (eager, compiled):
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert calls and all(c[0] is False for c in calls)  # a mask went to attention every time
    # and the mask mattered: the second sequence does not see the first
    with torch.no_grad():
        unpacked = model(ids).logits
    assert not torch.allclose(unpacked[:, 10:], ref[:, 10:], atol=1e-4)


def test_an_eager_call_that_contradicts_the_shortcut_switches_it_off(monkeypatch, caplog):
    """If a model given no position_ids ever numbers them with restarts (found eagerly), traced
    calls stop assuming plain positions, with one warning."""
    from cudnn_fuse import hf

    monkeypatch.setattr(hf, "_packing_shortcut", {"on": True})
    find = hf.plain_positions_skip_packing(lambda p: "found" if p[0, -1] < p.shape[1] - 1 else None)
    plain, restarting = torch.arange(8).expand(2, 8), torch.cat([torch.arange(4), torch.arange(4)]).expand(2, 8)
    hf._plain_call_stack().append(True)
    try:
        assert find(plain) is None
        with caplog.at_level("WARNING", logger="cudnn_fuse.hf"):
            assert find(restarting) == "found"
        assert hf._packing_shortcut["on"] is False and "packs several sequences" in caplog.text
    finally:
        hf._plain_call_stack().pop()


def test_the_call_stack_is_popped_when_the_forward_raises():
    opt = cf.optimize(_cacheless_gpt2())
    with pytest.raises(Exception):
        opt(torch.randint(0, 100, (2, 64)))  # longer than n_positions=32
    assert not getattr(cf.hf._calls, "stack", [])


@pytest.mark.gpu
def test_gpu_captured_cacheless_gpt2_runs_causal_attention_and_matches_eager(monkeypatch):
    """cf.capture of a cache-less GPT-2 (the peers suite's model): attention is captured with no
    mask (is_causal), where transformers alone would build its packed-sequence mask during the
    capture; replays equal eager cf on new inputs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = _cacheless_gpt2().eval().cuda().to(torch.bfloat16)
    opt = cf.optimize(model)
    ids = torch.randint(0, 100, (4, 32), device="cuda")

    def fwd(i):
        with torch.no_grad():
            return opt(i).logits

    calls = _attention_calls(monkeypatch)
    g = cf.capture(fwd, ids)
    assert calls and all(c == (True, True) for c in calls)  # warm-up and capture alike
    new = torch.randint(0, 100, (4, 32), device="cuda")
    out = g(new).float()
    ref = fwd(new).float()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2
