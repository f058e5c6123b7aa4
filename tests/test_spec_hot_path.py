"""The per-call shortcuts of spec.py keep value semantics."""

from __future__ import annotations

import dataclasses

import torch

from cudnn_fuse.spec import ConvSpec, Epilogue, MatmulSpec, SdpaSpec, TensorSpec


def test_tensorspec_of_is_memoised_but_exact():
    a = TensorSpec.of(torch.empty(2, 3, dtype=torch.float16))
    assert TensorSpec.of(torch.empty(2, 3, dtype=torch.float16)) is a  # memo hit
    assert TensorSpec.of(torch.empty(2, 3, dtype=torch.bfloat16)).dtype == "bfloat16"
    assert TensorSpec.of(torch.empty(3, 2).t()).stride == (1, 2)
    assert TensorSpec.of(torch.empty(2, 3, device="meta")) == TensorSpec.of(torch.empty(2, 3))  # device is no part


def test_cached_hash_agrees_with_equality_for_every_spec_type():
    t = TensorSpec((4, 8), (8, 1), "float16")
    c = TensorSpec((1, 8, 4, 4), (128, 1, 32, 8), "float16")
    specs = [(MatmulSpec(t, t, t, Epilogue(activation="relu")), {"allow_tf32": True}),
             (ConvSpec(c, c, c, (1, 1), (0, 0), (0, 0), (1, 1), 1), {"groups": 2}),
             (SdpaSpec(c, c, c, c, None, True, 0.5), {"scale": 0.25})]
    for s, change in specs:
        twin = dataclasses.replace(s)
        assert twin == s and hash(twin) == hash(s)
        first = hash(s)
        assert hash(s) == first and "_hash" in s.__dict__  # computed once, then reused
        changed = dataclasses.replace(s, **change)
        assert changed != s and hash(changed) != hash(s)
        assert "_hash" not in s.to_dict() and "_hash" not in s.canonical_json()
