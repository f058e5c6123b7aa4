"""Op specs: frozen, hashable descriptions of one fused op, and their digests.

A spec holds everything that changes the cuDNN graph (shapes, strides, dtypes,
attributes, epilogue) and nothing else (no data pointers, no values, no device
index). Its digest is the sha256 of its canonical JSON and is the plan key.

This module imports neither torch's CUDA pieces nor cuDNN; ``TensorSpec.of``
only reads a tensor's metadata.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import numbers
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

from .errors import ArgumentError

SCHEMA_VERSION = 1

DTYPES = ("float16", "bfloat16", "float32")
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")  # scaled_mm's operands and outputs
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "tanh", "sigmoid", "leaky_relu")
NO_ACTIVATION = ("none", "identity")  # names of no activation (any case), as None
DEFAULT_SLOPE = 0.01  # leaky_relu's, torch's default; the one slope every other activation takes

_FUNCTIONS = None  # {torch activation function: name}, made on first use (this module imports torch only then)


def _torch_functions() -> dict:
    global _FUNCTIONS
    if _FUNCTIONS is None:
        import torch
        import torch.nn.functional as F

        _FUNCTIONS = {F.relu: "relu", torch.relu: "relu", F.gelu: "gelu", F.silu: "silu", torch.tanh: "tanh",
                      F.tanh: "tanh", torch.sigmoid: "sigmoid", F.sigmoid: "sigmoid", F.leaky_relu: "leaky_relu"}
    return _FUNCTIONS


def torch_activation(obj):
    """(name, slope) of a torch activation function or module a user already has, or None for
    anything else: F.relu / torch.relu / nn.ReLU() -> "relu", F.gelu / nn.GELU() -> "gelu",
    nn.GELU(approximate="tanh") -> "gelu_tanh", F.silu / nn.SiLU(), torch.tanh / F.tanh / nn.Tanh(),
    torch.sigmoid / F.sigmoid / nn.Sigmoid(), F.leaky_relu -> "leaky_relu", nn.LeakyReLU(s) ->
    ("leaky_relu", s), nn.Identity() -> (None, None). ``slope`` is the module's own (nn.LeakyReLU's),
    else None. A module is matched with isinstance (optimize() has always matched them so); one with
    inplace=True is the same activation (the op's output is a new tensor anyway)."""
    if isinstance(obj, (str, numbers.Number)) or obj is None:
        return None
    from torch import nn

    if isinstance(obj, nn.Module):
        if isinstance(obj, nn.LeakyReLU):
            return "leaky_relu", obj.negative_slope
        if isinstance(obj, nn.GELU):
            approximate = {"none": "gelu", "tanh": "gelu_tanh"}.get(obj.approximate)
            return None if approximate is None else (approximate, None)
        for cls, name in ((nn.ReLU, "relu"), (nn.SiLU, "silu"), (nn.Tanh, "tanh"), (nn.Sigmoid, "sigmoid"),
                          (nn.Identity, None)):
            if isinstance(obj, cls):
                return name, None
        return None
    try:
        name = _torch_functions().get(obj)
    except TypeError:  # unhashable
        return None
    return None if name is None else (name, None)


def _slope_value(v, op: str):
    """A slope as a float: a real number (Python's or numpy's) or a 0-dim real tensor that does not
    require grad (torch's F.leaky_relu takes one); a symbolic number (tracing) as it is."""
    if type(v) is float or isinstance(v, numbers.Real):
        return float(v)
    if type(v).__name__ in ("SymFloat", "SymInt"):
        return v
    if hasattr(v, "dim") and hasattr(v, "is_complex") and v.dim() == 0 and not v.is_complex() \
            and not getattr(v, "requires_grad", False) and not getattr(v, "is_meta", False):
        return float(v)
    raise TypeError(f"{op}negative_slope must be a real number, got {v!r}")


def canonical_activation(activation, negative_slope=DEFAULT_SLOPE, op: str = "", strict: bool = True):
    """(name, negative_slope) for an ``activation`` and ``negative_slope`` argument: the name one of
    ACTIVATIONS or None, whatever spelling came in: a name in any case ("ReLU", "GELU"), "none" /
    "identity" (any case) for None, or a torch activation function or module (``torch_activation``).
    Specs, cache keys and modules only ever see the name this returns.

    ``strict`` (what the ops and modules check): a slope other than the default given with an
    activation other than "leaky_relu" raises ArgumentError (torch's F.relu takes no slope), as does one
    that contradicts an nn.LeakyReLU's own slope (which otherwise wins over the default); the slope must
    be a real number (TypeError). Not strict (a spec): such a slope is normalized to the default, so that
    it cannot split the cache. ``op``: the caller's name, the messages' prefix. An unknown activation
    raises ArgumentError naming ``activation`` and the accepted names."""
    where = f"{op}: " if op else ""
    own = None
    if activation is None:
        name = None
    elif isinstance(activation, str):
        name = activation.lower()
        if name in NO_ACTIVATION:
            name = None
        elif name not in ACTIVATIONS:
            raise _unknown_activation(where, activation)
    else:
        found = torch_activation(activation)
        if found is None:
            raise _unknown_activation(where, activation)
        name, own = found
    slope = _slope_value(negative_slope, where) if strict else negative_slope
    if own is not None:  # nn.LeakyReLU(s): its slope wins over the default, and conflicts with another one
        if strict and slope != DEFAULT_SLOPE and slope != own:
            raise ArgumentError(f"{where}negative_slope={slope} conflicts with activation={activation!r} "
                                f"(its own slope is {own}): give one of them")
        return name, float(own) if strict else own
    if name != "leaky_relu" and slope != DEFAULT_SLOPE:
        if strict:
            raise ArgumentError(f"{where}negative_slope={slope} is given with activation={name!r}: only "
                                f"'leaky_relu' takes a slope (leave negative_slope at its default {DEFAULT_SLOPE})")
        slope = DEFAULT_SLOPE
    return name, slope


def _unknown_activation(where: str, activation) -> ArgumentError:
    return ArgumentError(
        f"{where}activation must be None or one of {ACTIVATIONS} (any case; 'none' or 'identity' for None), or "
        "a torch activation (F.relu, torch.relu, nn.ReLU(), F.gelu, nn.GELU(), nn.GELU(approximate='tanh'), "
        "F.silu, nn.SiLU(), torch.tanh, nn.Tanh(), torch.sigmoid, nn.Sigmoid(), F.leaky_relu, nn.LeakyReLU(s), "
        f"nn.Identity()), got {activation!r}")


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
        # 1 and 1.0 are one slope, and so are -0.0 and 0.0 (equal specs, one in-memory plan), "ReLU" and
        # "relu" one activation: keep the canonical JSON (the digest) from splitting. The slope means
        # nothing for other activations than leaky_relu: normalized, so it cannot split the cache either.
        name, slope = canonical_activation(self.activation, float(self.negative_slope) + 0.0, strict=False)
        object.__setattr__(self, "activation", name)
        object.__setattr__(self, "negative_slope", float(slope) + 0.0)


def _plain(v):
    """``dataclasses.asdict``'s result for a spec's field value, without its generic recursion and deep
    copies (a spec's digest is taken on the first call at every new shape): the same dicts, tuples and
    scalars, so the canonical JSON, and with it every stored key, is unchanged."""
    if type(v) is TensorSpec:
        return {"shape": v.shape, "stride": v.stride, "dtype": v.dtype}
    if type(v) is tuple:
        return tuple([_plain(e) for e in v])
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if v is None or type(v) in (bool, int, float, str):
        return v
    return copy.deepcopy(v)  # what asdict does with any other value


class _SpecMixin:
    op: str

    def to_dict(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "op": self.op, **_plain(self)}

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
class ScaledMMSpec(_SpecMixin):
    """An FP8 GEMM a [M, K] @ b [K, N] -> y [M, N] with per-tensor scales and cf's epilogue, as the
    GPU path runs it (``functional.scaled_mm``: batched operands flattened to 2-D, b K-major; cuBLASLt
    through fp8_gemm.py). ``y.dtype`` is the output's dtype, ``epilogue.amax`` whether it is returned."""

    a: TensorSpec
    b: TensorSpec
    y: TensorSpec
    epilogue: Epilogue = field(default_factory=Epilogue)
    op = "scaled_mm"

    def operands(self):
        return (self.a, self.b)


@dataclass(frozen=True)
class SdpaFP8Spec(_SpecMixin):
    """FP8 attention forward (cuDNN's ``sdpa_fp8``, fp8_attention.py): q [B, H, S, D], k and v
    [B, Hk, S_kv, D] in one FP8 format, o in q's; ``scale`` the softmax scale it runs with."""

    q: TensorSpec
    k: TensorSpec
    v: TensorSpec
    is_causal: bool
    scale: float
    op = "sdpa_fp8"

    def operands(self):
        return (self.q, self.k, self.v)


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
# Op families for autograd. The forward specs above keep their
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
                d[f.name] = _plain(v) if dataclasses.is_dataclass(v) else v
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
    """An activation-backward spec's name check and canonical name (Epilogue's) and slope normalization
    (the slope means something only for leaky_relu, so other activations' specs key the same)."""
    epi = Epilogue(activation=spec.activation, negative_slope=spec.negative_slope)
    object.__setattr__(spec, "activation", epi.activation)
    object.__setattr__(spec, "negative_slope", epi.negative_slope)


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
                            ConvDgradSpec, ConvWgradSpec, SdpaTrainSpec, SdpaBwdSpec, ScaledMMSpec, SdpaFP8Spec)}


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
    if isinstance(spec, ScaledMMSpec):
        m, n = spec.y.shape
        return 2 * m * n * spec.a.shape[-1]
    b, h, sq, d = spec.q.shape
    skv, dv = spec.k.shape[-2], spec.v.shape[-1]
    if not spec.is_causal:
        pairs = sq * skv
    elif sq <= skv:  # row i sees keys 0..i (top-left aligned, like torch)
        pairs = sq * (sq + 1) // 2
    else:
        pairs = skv * (skv + 1) // 2 + (sq - skv) * skv
    return 2 * b * h * pairs * (d + dv)
