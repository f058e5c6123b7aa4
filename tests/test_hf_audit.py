"""An audit of optimize() on transformers models (CPU, tiny random configs): what a user does with
the model after ``model = cf.optimize(model)``. See docs/decisions.md, "An audit of optimize() on
transformers models on the CPU"."""

from __future__ import annotations

import io

import pytest
import torch

import cudnn_fuse as cf

transformers = pytest.importorskip("transformers")


def _gpt2(vocab=100):
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=vocab, bos_token_id=0, eos_token_id=0,
        pad_token_id=0)).eval()


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=100, pad_token_id=0, bos_token_id=1, eos_token_id=2)).eval()


def _vit():
    torch.manual_seed(0)
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4, image_size=16,
        patch_size=8, num_labels=3)).eval()


def _inputs(model):
    torch.manual_seed(1)
    if isinstance(model, transformers.ViTForImageClassification):
        return {"pixel_values": torch.randn(2, 3, 16, 16)}
    return {"input_ids": torch.randint(3, 100, (2, 10))}


@pytest.mark.parametrize("build", [_gpt2, _vit], ids=["gpt2", "vit"])
def test_an_optimized_model_pickles_whole_and_runs_where_cf_attention_was_never_registered(build, monkeypatch):
    """torch.save(model) of an optimized transformers model raised "Can't pickle local object
    '_track_plain_calls.<locals>.after'" (the hooks were closures). Loaded in a process that never
    switched a model, its config names an attention transformers does not know: the first forward
    raised a KeyError. The hooks now pickle, and unpickled they register cf's attention again (the
    new process is played by taking the registrations out)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    model = build()
    opt = cf.optimize(model)
    buf = io.BytesIO()
    torch.save(opt, buf)
    for registry in (AttentionInterface._global_mapping, AttentionMaskInterface._global_mapping):
        monkeypatch.delitem(registry, cf.hf.NAME)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.config._attn_implementation == cf.hf.NAME
    assert cf.hf.NAME in AttentionInterface._global_mapping and cf.hf.NAME in AttentionMaskInterface._global_mapping
    x = _inputs(model)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**x).logits, model(**x).logits)
    assert not getattr(cf.hf._calls, "stack", [])


def test_a_hook_on_a_large_lm_head_still_runs():
    """GPT-2's lm_head (50257 wide) sits in a model that does not trace, and optimize() put an
    AlignedLinear in its place without looking at its hooks: a forward hook on it (a logit
    processor, a probe) was dropped without a word and the logits changed. It is left alone now,
    with the reason, as a hooked layer in a traced graph is."""
    model = _gpt2(vocab=50257)
    model.lm_head.register_forward_hook(lambda m, args, out: out.clamp(max=0.0))
    opt = cf.optimize(model)
    ids = torch.randint(0, 50257, (2, 8))
    with torch.no_grad():
        out, ref = opt(ids).logits, model(ids).logits
    assert (ref <= 0).all()
    torch.testing.assert_close(out, ref)
    assert "hooks" in dict(opt.cudnn_fuse_summary.left_alone)["lm_head"]
    unhooked = cf.optimize(_gpt2(vocab=50257))  # without a hook it is still aligned
    assert isinstance(unhooked.lm_head, cf.nn.AlignedLinear)


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_the_summary_names_every_layer_and_says_what_it_became(build):
    """Layers whose parent does not trace (GPT-2's attention Conv1Ds and lm_head, Llama's q/k/v/o
    projections and lm_head) were in neither list of the logged summary. Every Linear / Conv1D is
    now named, replaced ones are cf modules and the ones left alone are the model's own."""
    model = build()
    opt = cf.optimize(model)
    s = opt.cudnn_fuse_summary
    replaced, left = dict(s.replaced), dict(s.left_alone)
    layers = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"]
    assert layers and not [n for n in layers if n not in replaced and n not in left]
    for n in layers:
        kind = type(opt.get_submodule(n))
        assert (kind.__module__ == "cudnn_fuse.nn") == (n in replaced), (n, kind)


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_greedy_generation_with_left_padding_and_the_cache_gives_the_same_tokens(build):
    model = build()
    opt = cf.optimize(model)
    ids = torch.randint(3, 100, (2, 10))
    pad = torch.ones_like(ids)
    pad[1, :4] = 0
    ids[1, :4] = 0
    kw = dict(max_new_tokens=4, do_sample=False, attention_mask=pad, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(opt.generate(ids, **kw), model.generate(ids, **kw))
        assert torch.equal(opt.generate(ids, use_cache=False, **kw), model.generate(ids, use_cache=False, **kw))


@pytest.mark.parametrize("new_vocab", [50260, 50250, 50264, 50279])
def test_the_lm_heads_pad_follows_resize_token_embeddings(new_vocab):
    """GPT-2's lm_head is tied to wte: ``resize_token_embeddings`` replaces the shared weight's data in
    place and sets ``out_features``, keeping the AlignedLinear. Its pad was computed once, so the padded
    GEMM (still cut to the right width) was no longer aligned after a resize to another width (50257 ->
    50260 kept 7 zero rows: rows 50267 wide). It now follows the weight's shape."""
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, n_positions=32, vocab_size=50257)).eval()
    opt = cf.optimize(model)
    assert isinstance(opt.lm_head, cf.nn.AlignedLinear) and opt.lm_head.pad == 7
    for m in (model, opt):
        torch.manual_seed(3)
        m.resize_token_embeddings(new_vocab, mean_resizing=False)
    head = opt.lm_head
    assert isinstance(head, cf.nn.AlignedLinear) and head.weight is opt.transformer.wte.weight
    assert head.weight.shape[0] == head.out_features == new_vocab
    assert (new_vocab + head.pad) % 8 == 0 and 0 <= head.pad < 8
    assert f"padded to {new_vocab + head.pad}" in repr(head)
    head.forward = head.padded_forward  # the GPU's path, on the CPU
    ids = torch.randint(0, new_vocab, (2, 8))
    with torch.no_grad():
        out, ref = opt(ids).logits, model(ids).logits
    assert out.shape == (2, 8, new_vocab) and out.stride(-2) % 8 == 0  # rows 16-byte aligned in 16-bit
    torch.testing.assert_close(out, ref)


def test_an_aligned_linear_decides_to_pad_from_the_weights_width(monkeypatch):
    """forward's choice of the padded GEMM reads the weight's current width: resized to an aligned one it
    is plain F.linear (no pad), resized back to a misaligned one it pads again."""
    lin = torch.nn.Linear(16, 13)
    al = cf.nn.AlignedLinear(lin)
    padded = []
    monkeypatch.setattr(cf.nn.AlignedLinear, "padded_forward", lambda self, x: padded.append(self.pad) or
                        torch.nn.functional.linear(x, self.weight, self.bias))
    monkeypatch.setattr(cf.nn.AlignedLinear, "MIN_MACS", 0)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # forward's GPU test, on the CPU
    x = torch.randn(3, 16)
    for n, want in ((13, [3]), (16, []), (22, [2])):
        with torch.no_grad():
            lin.weight.data, lin.bias.data = torch.randn(n, 16), torch.randn(n)
        padded.clear()
        assert al(x).shape == (3, n) and padded == want and al.pad == (want[0] if want else 0)
