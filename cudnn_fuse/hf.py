"""Hugging Face transformers integration: attention through cudnn_fuse.

transformers' models do not trace with torch.fx, but they route attention through
``AttentionInterface``. ``use_cudnn_fuse_attention(model)`` registers an
implementation named "cudnn_fuse" that calls ``cf.scaled_dot_product_attention``
with transformers' own "sdpa" semantics, and switches the model to it.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

NAME = "cudnn_fuse"


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      position_bias=None, **kwargs):
    """transformers' sdpa_attention_forward contract, on cudnn_fuse's SDPA.

    query/key/value: [B, H, S, D] (key/value with their own head count: GQA needs no
    repeat); returns (attn_output [B, S, H, D] contiguous, None).
    """
    from .ops import scaled_dot_product_attention

    if position_bias is not None or kwargs.get("output_attentions", False):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, position_bias=position_bias, **kwargs)
    q_len, kv_len = query.shape[2], key.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(q_len > 1 and attention_mask is None and is_causal)
    if is_causal and kv_len > q_len:  # prefill with an empty static cache: as transformers' sdpa does
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                       is_causal=is_causal, scale=scaling,
                                       enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def causal_mask(*args, **kwargs):
    """transformers' sdpa mask, with one more case where no mask is built: a plain causal mask.

    transformers skips building the [B, 1, S, S] mask of a causal model without padding, and
    lets SDPA run ``is_causal``, only when it is not tracing: under torch.compile (before torch
    2.14) and under CUDA-graph capture (``cf.capture``) it materializes the mask, and attention
    then runs a masked kernel (GPT-2 8x1024 on the H200: 1.40 ms a forward against 0.55 causal,
    ``bench/results/step_profile_gpt2_infer.json``). The case needs no tensor's value: no padding
    mask, the causal mask function, no local window, queries and keys the same length, both at
    offset 0; then None (``attention_forward`` runs is_causal), traced or not. Anything else is
    transformers' own ``sdpa_mask``."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    q_len, kv_len = kwargs.get("q_length"), kwargs.get("kv_length")
    q_off, kv_off = kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0)
    local = kwargs.get("local_size")
    if (not args and kwargs.get("allow_is_causal_skip", True) and kwargs.get("attention_mask") is None
            and kwargs.get("mask_function", causal_mask_function) is causal_mask_function
            and isinstance(q_len, int) and q_len > 1 and q_len == kv_len
            and type(q_off) is int and type(kv_off) is int and q_off == kv_off == 0
            and (local is None or kv_len < local)):
        return None
    return sdpa_mask(*args, **kwargs)


def use_cudnn_fuse_attention(model) -> bool:
    """Switch a transformers model that uses "sdpa" attention to cudnn_fuse's; True if switched."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    try:
        from transformers import AttentionInterface
    except ImportError:
        return False
    AttentionInterface.register(NAME, attention_forward)
    try:  # the masks: what transformers builds for "sdpa" (else an unknown name gets none), see causal_mask
        from transformers import AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask  # noqa: F401 - the import is the capability check

        AttentionMaskInterface.register(NAME, causal_mask)
    except ImportError:
        log.info("transformers has no AttentionMaskInterface: its models keep their sdpa attention")
        return False
    try:
        model.set_attn_implementation(NAME)
    except Exception as exc:  # noqa: BLE001 - an older transformers: leave the model as it was
        log.info("transformers model kept its attention (%s)", exc)
        return False
    return True
