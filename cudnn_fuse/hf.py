"""Hugging Face transformers integration: attention through cudnn_fuse.

transformers' models do not trace with torch.fx, but they route attention through
``AttentionInterface``. ``use_cudnn_fuse_attention(model)`` registers an
implementation named "cudnn_fuse" that calls ``cf.scaled_dot_product_attention``
with transformers' own "sdpa" semantics, and switches the model to it.
"""

from __future__ import annotations

import inspect
import logging
import threading

log = logging.getLogger(__name__)

NAME = "cudnn_fuse"


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      position_bias=None, **kwargs):
    """transformers' sdpa_attention_forward contract, on cudnn_fuse's SDPA.

    query/key/value: [B, H, S, D] (key/value with their own head count: GQA needs no
    repeat); returns (attn_output [B, S, H, D] contiguous, None).
    """
    from .functional import scaled_dot_product_attention
    from .nn import records_grad

    # a training step runs transformers' own: the same cuDNN kernel on Hopper, at less host time a call
    if position_bias is not None or kwargs.get("output_attentions", False) or \
            records_grad(query, key, value, attention_mask):
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
    then runs a masked kernel (GPT-2 8x1024: 2.5x the causal kernel's time, docs/decisions.md). The
    case needs no tensor's value: no padding
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


# Calls of switched models that were given no position_ids, attention mask or cache, innermost
# last (a stack per thread: pushed by a forward pre-hook, popped by a forward hook that runs even
# when the forward raises). See plain_positions_skip_packing.
_calls = threading.local()
_packing_shortcut = {"on": True}  # off for good once an eager call contradicts it (see below)


def _plain_call_stack() -> list:
    stack = getattr(_calls, "stack", None)
    if stack is None:
        stack = _calls.stack = []
    return stack


def plain_positions_skip_packing(find_packed):
    """transformers' packed-sequence detection, knowing which calls number their positions 0..S-1.

    Called with position_ids and no attention mask or cache (a training or a cache-less forward),
    transformers looks for several sequences packed in one row (positions that restart) and, if
    there are any, masks attention between them. The look needs the positions' values, so while
    tracing (torch.compile, and CUDA-graph capture: ``cf.capture``) it assumes packing and
    materializes a [B, 1, S, S] mask; attention then runs a masked kernel (GPT-2 8x1024: 2.5x the
    causal kernel's time, docs/decisions.md).
    A model that was itself given no position_ids numbers them 0..S-1 in every row (transformers'
    decoders use ``arange`` / ``cache_position``), so there is nothing packed to find: during such a
    call (see ``_track_plain_calls``) the answer is None, traced or not. Eager calls still run
    transformers' own check, and if it ever finds packing in such a call (a model that numbers its
    positions some other way) the shortcut is switched off for good, with a warning."""
    def find(position_ids):
        stack = getattr(_calls, "stack", None)
        if not (stack and stack[-1] and _packing_shortcut["on"] and position_ids.dim() == 2):
            return find_packed(position_ids)
        from transformers.utils.import_utils import is_tracing

        if is_tracing(position_ids):
            return None
        found = find_packed(position_ids)
        if found is not None:
            _packing_shortcut["on"] = False
            log.warning("cudnn_fuse: a model given no position_ids packs several sequences in a row; "
                        "traced attention keeps transformers' packed-sequence mask from now on")
        return found

    find.cudnn_fuse_wrapped = find_packed
    return find


class _PlainCallStart:
    """The forward pre-hook of ``_track_plain_calls``: pushes whether the call got none of the
    ``watched`` (name, position) arguments (False when nothing is watched: a forward without
    position_ids). A class and not a closure so that the model still pickles (``torch.save(model)``:
    a local function made that fail); unpickled, in a process that has switched no model yet, it
    registers cf's attention with transformers again, which the model's config names (else the
    model's first forward raised transformers' KeyError)."""

    def __init__(self, watched):
        self.watched = watched

    def __call__(self, module, args, kwargs):
        _plain_call_stack().append(self.watched is not None and all(
            kwargs.get(n, args[i] if i < len(args) else None) is None for n, i in self.watched))

    def __setstate__(self, state):
        self.__dict__.update(state)
        if _register() and self.watched is not None:
            _wrap_packed_detection()


def _plain_call_end(module, args, kwargs, output):
    """The forward hook of ``_track_plain_calls`` (module-level: picklable); runs even when the forward raises."""
    stack = _plain_call_stack()
    if stack:
        stack.pop()


def _track_plain_calls(model) -> bool:
    """Forward hooks that push/pop whether a call of ``model`` got no position_ids, attention mask
    or cache; False when its forward takes no position_ids (nothing to track: its hooks push False,
    and are there for ``_PlainCallStart``'s unpickling)."""
    names = list(inspect.signature(model.forward).parameters)
    tracked = "position_ids" in names
    if not getattr(model, "_cudnn_fuse_plain_hooks", False):
        watched = [(n, names.index(n)) for n in ("position_ids", "attention_mask", "past_key_values")
                   if n in names] if tracked else None
        model.register_forward_pre_hook(_PlainCallStart(watched), with_kwargs=True)
        model.register_forward_hook(_plain_call_end, with_kwargs=True, always_call=True)
        model._cudnn_fuse_plain_hooks = True
    return tracked


def _wrap_packed_detection() -> None:
    """Install plain_positions_skip_packing over transformers' detection (once)."""
    try:
        import transformers.masking_utils as mu
    except ImportError:
        return
    current = getattr(mu, "find_packed_sequence_indices", None)
    if current is not None and not hasattr(current, "cudnn_fuse_wrapped"):
        mu.find_packed_sequence_indices = plain_positions_skip_packing(current)


def _register() -> bool:
    """Register cf's attention and its masks with transformers under NAME; False where this
    transformers cannot take them."""
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
    return True


def use_cudnn_fuse_attention(model) -> bool:
    """Switch a transformers model that uses "sdpa" attention to cudnn_fuse's; True if switched."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if not _register():
        return False
    try:
        model.set_attn_implementation(NAME)
    except Exception as exc:  # noqa: BLE001 - an older transformers: leave the model as it was
        log.info("transformers model kept its attention (%s)", exc)
        return False
    if _track_plain_calls(model):
        _wrap_packed_detection()
    return True
