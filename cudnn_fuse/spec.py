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
        # 1 and 1.0 are one slope, and so are -0.0 and 0.0 (equal specs, one in-memory plan): keep the
        # canonical JSON (the digest) from splitting
        object.__setattr__(self, "negative_slope", float(self.negative_slope) + 0.0)
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


def _check_sdpa_attrs(spec) -> None:
    """An attention spec's scale as a float (1 and 1.0, -0.0 and 0.0 are one scale: equal specs, one
    in-memory plan) and is_causal as a bool, so that equal specs have one canonical JSON (one digest)."""
    object.__setattr__(spec, "scale", float(spec.scale) + 0.0)
    object.__setattr__(spec, "is_causal", bool(spec.is_causal))


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

    def __post_init__(self):
        _check_sdpa_attrs(self)

    def operands(self):
        return (self.q, self.k, self.v)


# ------------------------------------------------------------ training graphs
#
# New op families for autograd (issue 4). The forward specs above keep their
# canonical JSON (existing caches and digests depend on it); training variants
# are separate classes. A spec that wraps a forward spec (``fwd``) nests the
# forward's own to_dict, op and schema_version included, so it round-trips.


class _WrapsForward(_SpecMixin):
    fwd: Any

    def to_dict(self) -> dict:
        d = {"schema_version": SCHEMA_VERSION, "op": self.op}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "fwd":
                d[f.name] = v.to_dict()
            else:
                d[f.name] = dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
        return d

    def operands(self):
        return self.fwd.operands()

    @property
    def allow_tf32(self) -> bool:
        return self.fwd.allow_tf32


@dataclass(frozen=True)
class SaveZSpec(_WrapsForward):
    """A conv/matmul forward with an activation that also writes its pre-activation
    ``z = op(x) + bias + residual`` (the backward of GELU-like activations reads it)."""

    fwd: Any  # ConvSpec | MatmulSpec with an activation (amax: cuDNN's graph only; the torch engine declines it)
    z: TensorSpec
    op = "save_z"

    def __post_init__(self):
        # Without an activation z is y: the graph would mark its one tensor as both and have no
        # tensor with z's uid, so its buffers would not match uids_of (a plumbing error at run time).
        # Refused here, so that neither an op nor a hand-written manifest can make one.
        if not isinstance(self.fwd, (ConvSpec, MatmulSpec)):
            raise ValueError(f"save_z: fwd must be a ConvSpec or MatmulSpec, got {type(self.fwd).__name__}")
        if self.fwd.epilogue.activation is None:
            raise ValueError(f"save_z: fwd.epilogue.activation must be one of {ACTIVATIONS}, got None "
                             "(without an activation z is y: run the forward itself)")


@dataclass(frozen=True)
class RecomputeGradSpec(_WrapsForward):
    """dz = act'(z) * dy where z = op(x) + bias + residual is recomputed inside the
    graph (never stored); optionally dbias = sum of dz over all but the bias axis."""

    fwd: Any  # ConvSpec | MatmulSpec with an activation
    dy: TensorSpec
    dz: TensorSpec
    dbias: Optional[TensorSpec] = None  # float32, the bias's broadcast shape
    op = "recompute_grad"


def _check_act_grad(spec) -> None:
    """An activation-backward spec's name check (Epilogue's) and slope normalization (the
    slope means something only for leaky_relu, so other activations' specs key the same)."""
    Epilogue(activation=spec.activation)
    object.__setattr__(spec, "negative_slope", float(spec.negative_slope) + 0.0 if spec.activation == "leaky_relu" else 0.01)


@dataclass(frozen=True)
class ActGradSpec(_SpecMixin):
    """dz = act'(src) * dy from a saved tensor: the pre-activation z, or for ReLU
    its output y (the mask y > 0 is z > 0); optionally dbias = sum of dz."""

    dy: TensorSpec
    src: TensorSpec
    dz: TensorSpec
    activation: str
    negative_slope: float = 0.01
    dbias: Optional[TensorSpec] = None
    op = "act_grad"

    def __post_init__(self):
        _check_act_grad(self)

    def operands(self):
        return (self.dy, self.src)


@dataclass(frozen=True)
class ConvDgradSpec(_SpecMixin):
    """dx = conv_dgrad(dy, w): the data gradient of a ConvSpec's convolution."""

    dy: TensorSpec
    w: TensorSpec
    dx: TensorSpec
    stride: Tuple[int, int]
    pre_padding: Tuple[int, int]
    post_padding: Tuple[int, int]
    dilation: Tuple[int, int]
    allow_tf32: bool = False
    op = "conv_dgrad"

    def operands(self):
        return (self.dy, self.w)


@dataclass(frozen=True)
class ConvWgradSpec(_SpecMixin):
    """dw = conv_wgrad(x, dy): the weight gradient of a ConvSpec's convolution."""

    x: TensorSpec
    dy: TensorSpec
    dw: TensorSpec
    stride: Tuple[int, int]
    pre_padding: Tuple[int, int]
    post_padding: Tuple[int, int]
    dilation: Tuple[int, int]
    allow_tf32: bool = False
    op = "conv_wgrad"

    def operands(self):
        return (self.x, self.dy)


@dataclass(frozen=True)
class SdpaTrainSpec(_SpecMixin):
    """Attention forward that also writes the softmax stats (float32 [B, H, Sq, 1])
    its backward reads. Same fields as SdpaSpec plus ``stats``."""

    q: TensorSpec
    k: TensorSpec
    v: TensorSpec
    o: TensorSpec
    stats: TensorSpec
    bias: Optional[TensorSpec] = None
    is_causal: bool = False
    scale: float = 1.0
    op = "sdpa_train"

    def __post_init__(self):
        _check_sdpa_attrs(self)

    def operands(self):
        return (self.q, self.k, self.v)


@dataclass(frozen=True)
class SdpaBwdSpec(_SpecMixin):
    """Attention backward from the forward's output and stats: dq, dk, dv."""

    q: TensorSpec
    k: TensorSpec
    v: TensorSpec
    o: TensorSpec
    do: TensorSpec
    stats: TensorSpec
    dq: TensorSpec
    dk: TensorSpec
    dv: TensorSpec
    bias: Optional[TensorSpec] = None
    is_causal: bool = False
    scale: float = 1.0
    op = "sdpa_backward"

    def __post_init__(self):
        _check_sdpa_attrs(self)

    def operands(self):
        return (self.q, self.k, self.v)


OpSpec = Any  # ConvSpec | MatmulSpec | SdpaSpec | the training specs above

_BY_OP = {c.op: c for c in (ConvSpec, MatmulSpec, SdpaSpec, SaveZSpec, RecomputeGradSpec, ActGradSpec,
                            ConvDgradSpec, ConvWgradSpec, SdpaTrainSpec, SdpaBwdSpec)}


def spec_from_dict(d: dict) -> OpSpec:
    """Inverse of ``to_dict``; raises ValueError for a foreign schema or op."""
    d = dict(d)
    version = d.pop("schema_version", None)
    if version != SCHEMA_VERSION:
        raise ValueError(f"spec schema_version must be {SCHEMA_VERSION}, got {version!r}")
    op = d.pop("op", None)
    cls = _BY_OP.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ValueError(f"spec op must be one of {sorted(_BY_OP)}, got {op!r}")

    def tensor(v):
        return None if v is None else TensorSpec(tuple(v["shape"]), tuple(v["stride"]), v["dtype"])

    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in d:
            continue
        v = d[f.name]
        if f.name == "fwd":
            v = spec_from_dict(v)
        elif f.name == "epilogue":
            v = Epilogue(tensor(v["bias"]), tensor(v["residual"]), v["activation"], v["negative_slope"], v["amax"])
        elif isinstance(v, dict):
            v = tensor(v)
        elif isinstance(v, list):
            v = tuple(v)
        kwargs[f.name] = v
    return cls(**kwargs)


def flops(spec) -> int:
    """2 x the multiply-adds of the main op (the epilogue is noise next to it);
    causal attention counts only the score pairs it computes; a training graph around a
    forward (save_z, recompute_grad) counts its forward's product."""
    if isinstance(getattr(spec, "fwd", None), (ConvSpec, MatmulSpec)):
        return flops(spec.fwd)
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
