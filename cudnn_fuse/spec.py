"""Op specs: frozen, hashable descriptions of one fused op, and their digests.

A spec holds everything that changes the cuDNN graph (shapes, strides, dtypes,
attributes, epilogue) and nothing else (no data pointers, no values, no device
index). Its digest is the sha256 of its canonical JSON and is the plan key.

This module imports neither torch's CUDA pieces nor cuDNN; ``TensorSpec.of``
only reads a tensor's metadata.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

SCHEMA_VERSION = 1

DTYPES = ("float16", "bfloat16", "float32")
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "tanh", "sigmoid", "leaky_relu")


@dataclass(frozen=True)
class TensorSpec:
    """Shape, strides (in elements) and dtype name of one operand."""

    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, t: Any) -> "TensorSpec":
        return cls(tuple(t.shape), tuple(t.stride()), str(t.dtype).replace("torch.", ""))

    @classmethod
    def contiguous(cls, shape, dtype: str) -> "TensorSpec":
        return cls(tuple(shape), contiguous_strides(shape), dtype)


def contiguous_strides(shape) -> Tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(strides))


def channels_last_strides(shape) -> Tuple[int, ...]:
    n, c, h, w = shape
    c1, h1, w1 = max(c, 1), max(h, 1), max(w, 1)
    return (h1 * w1 * c1, 1, w1 * c1, c1)


@dataclass(frozen=True)
class Epilogue:
    """What follows the main op: y = act(op(x) + bias + residual); amax = max|y|.

    ``bias`` and ``residual`` are the operands' specs as the graph sees them
    (bias already reshaped to broadcast against the output).
    """

    bias: Optional[TensorSpec] = None
    residual: Optional[TensorSpec] = None
    activation: Optional[str] = None
    negative_slope: float = 0.01
    amax: bool = False

    def __post_init__(self):
        # 1 and 1.0 are one slope: keep the canonical JSON (the digest) from splitting
        object.__setattr__(self, "negative_slope", float(self.negative_slope))
        if self.activation is not None and self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be None or one of {ACTIVATIONS}, got {self.activation!r}")
        if self.activation != "leaky_relu" and self.negative_slope != 0.01:
            # The slope means nothing for other activations; normalise it so it
            # cannot split the cache.
            object.__setattr__(self, "negative_slope", 0.01)


class _SpecMixin:
    op: str

    def to_dict(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "op": self.op, **dataclasses.asdict(self)}

    def canonical_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    @property
    def dtype(self) -> str:
        return self.operands()[0].dtype


@dataclass(frozen=True)
class ConvSpec(_SpecMixin):
    """2-D forward convolution on 4-D tensors, any memory layout (strides)."""

    x: TensorSpec
    w: TensorSpec
    y: TensorSpec
    stride: Tuple[int, int]
    pre_padding: Tuple[int, int]
    post_padding: Tuple[int, int]
    dilation: Tuple[int, int]
    groups: int
    epilogue: Epilogue = field(default_factory=Epilogue)
    allow_tf32: bool = False
    op = "conv2d"

    def operands(self):
        return (self.x, self.w)


@dataclass(frozen=True)
class MatmulSpec(_SpecMixin):
    """Batched matmul on 3-D views: a [Ba, M, K] @ b [Bb, K, N] -> y [B, M, N].

    Ba and Bb are B or 1 (broadcast); ``linear`` arrives here with b being the
    transposed weight view (strides, no copy).
    """

    a: TensorSpec
    b: TensorSpec
    y: TensorSpec
    epilogue: Epilogue = field(default_factory=Epilogue)
    allow_tf32: bool = False
    op = "matmul"

    def operands(self):
        return (self.a, self.b)


@dataclass(frozen=True)
class SdpaSpec(_SpecMixin):
    """Attention forward on [B, H, S, D] views (BHSD or BSHD memory via strides).

    ``bias`` is an additive score bias [B|1, H|1, Sq, Skv] (a boolean mask is
    turned into 0 / -inf before it reaches the graph).
    """

    q: TensorSpec
    k: TensorSpec
    v: TensorSpec
    o: TensorSpec
    bias: Optional[TensorSpec] = None
    is_causal: bool = False
    scale: float = 1.0
    op = "sdpa"

    def operands(self):
        return (self.q, self.k, self.v)


OpSpec = Any  # ConvSpec | MatmulSpec | SdpaSpec


def spec_from_dict(d: dict) -> OpSpec:
    """Inverse of ``to_dict``; raises ValueError for a foreign schema or op."""
    d = dict(d)
    version = d.pop("schema_version", None)
    if version != SCHEMA_VERSION:
        raise ValueError(f"spec schema_version must be {SCHEMA_VERSION}, got {version!r}")
    op = d.pop("op", None)
    cls = {"conv2d": ConvSpec, "matmul": MatmulSpec, "sdpa": SdpaSpec}.get(op)
    if cls is None:
        raise ValueError(f"spec op must be conv2d, matmul or sdpa, got {op!r}")

    def tensor(v):
        return None if v is None else TensorSpec(tuple(v["shape"]), tuple(v["stride"]), v["dtype"])

    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in d:
            continue
        v = d[f.name]
        if f.name == "epilogue":
            v = Epilogue(tensor(v["bias"]), tensor(v["residual"]), v["activation"], v["negative_slope"], v["amax"])
        elif isinstance(v, dict):
            v = tensor(v)
        elif isinstance(v, list):
            v = tuple(v)
        kwargs[f.name] = v
    return cls(**kwargs)


def flops(spec) -> int:
    """2 x the multiply-adds of the main op (the epilogue is noise next to it);
    causal attention counts only the score pairs it computes."""
    if isinstance(spec, ConvSpec):
        n, k, p, q = spec.y.shape
        _, cg, r, s = spec.w.shape
        return 2 * n * k * p * q * cg * r * s
    if isinstance(spec, MatmulSpec):
        b, m, n = spec.y.shape
        return 2 * b * m * n * spec.a.shape[-1]
    b, h, sq, d = spec.q.shape
    skv, dv = spec.k.shape[-2], spec.v.shape[-1]
    if not spec.is_causal:
        pairs = sq * skv
    elif sq <= skv:  # row i sees keys 0..i (top-left aligned, like torch)
        pairs = sq * (sq + 1) // 2
    else:
        pairs = skv * (skv + 1) // 2 + (sq - skv) * skv
    return 2 * b * h * pairs * (d + dv)
