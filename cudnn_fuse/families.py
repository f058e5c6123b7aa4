"""Shape families: a spec split into its family (everything but the sizes that change from call to call
of one layer) and those sizes.

A layer served with variable batch sizes or sequence lengths makes one spec per size. Those specs differ
only in a few extents, and in the strides those extents drive; a family key names what they share, so
that a manifest can give a range of sizes for one entry, and a kernel cache can serve the family. Which
sizes are dynamic, per op:

- ``matmul`` (and ``linear``, which arrives as a matmul): the batch and the rows ``m``;
- ``sdpa``: the batch and the sequence lengths ``seq_q`` and ``seq_kv`` (``seq``: both, self-attention's);
- convs and the training graphs: none (no family: every spec is its own).

Each operand keeps its layout: the order of its dimensions in memory and any padding between them
(packed q/k/v, a row pitch), as integer factors (``_layout``). ``with_sizes`` rebuilds the family's
spec at other sizes with those layouts; a spec it cannot rebuild exactly has no family.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Optional

from .spec import Epilogue, MatmulSpec, SdpaSpec, TensorSpec

DYNAMIC = {"matmul": ("batch", "m"), "sdpa": ("batch", "seq_q", "seq_kv")}
# names for sizes that move together: self-attention's one sequence length
ALIASES = {"sdpa": {"seq": ("seq_q", "seq_kv")}}


def names(op: str) -> tuple:
    """The size names a manifest or ``with_sizes`` may give for ``op``."""
    return DYNAMIC.get(op, ()) + tuple(ALIASES.get(op, {}))


def sizes(spec) -> Optional[dict]:
    """The dynamic sizes of ``spec`` ({name: extent}), or None for a spec of no family."""
    if type(spec) is MatmulSpec:
        return {"batch": spec.y.shape[0], "m": spec.y.shape[1]}
    if type(spec) is SdpaSpec:
        return {"batch": spec.q.shape[0], "seq_q": spec.q.shape[2], "seq_kv": spec.k.shape[2]}
    return None


def _dims(spec) -> Optional[dict]:
    """{operand field: {dim index: size name}}: which extent of which operand is which dynamic size."""
    s = sizes(spec)
    if s is None:
        return None
    batch = s["batch"]
    out = {}
    if type(spec) is MatmulSpec:
        rows = {"a": True, "y": True}
        for name, t in (("a", spec.a), ("b", spec.b), ("y", spec.y), ("bias", spec.epilogue.bias),
                        ("residual", spec.epilogue.residual)):
            if t is None or len(t.shape) != 3:
                continue
            d = {}
            # a and y carry the batch always; the others only where they are not broadcast (b, the
            # weight side, is one matrix for every batch unless it has the batch's extent past 1)
            if t.shape[0] == batch and (name in ("a", "y") or batch > 1):
                d[0] = "batch"
            # b's middle dim is K; an epilogue operand's is the rows unless broadcast
            if name in rows or (name != "b" and t.shape[1] == s["m"] and s["m"] > 1):
                d[1] = "m"
            out[name] = d
        return out
    for name, t, seq in (("q", spec.q, "seq_q"), ("k", spec.k, "seq_kv"), ("v", spec.v, "seq_kv"),
                         ("o", spec.o, "seq_q"), ("bias", spec.bias, None)):
        if t is None:
            continue
        d = {}
        if t.shape[0] == batch and (name != "bias" or batch > 1):
            d[0] = "batch"
        if seq is not None:
            d[2] = seq
        else:  # the score bias [B|1, H|1, Sq, Skv]
            if t.shape[2] == s["seq_q"]:
                d[2] = "seq_q"
            if t.shape[3] == s["seq_kv"]:
                d[3] = "seq_kv"
        out[name] = d
    return out


def _layout(t: TensorSpec, dynamic) -> Optional[tuple]:
    """How ``t``'s strides follow from its extents: (dims innermost first, the innermost stride, one rule
    per outer dim, the strides of static size-1 dims kept as they are), or None where they do not.

    Past a dynamic dim a stride is that dim's stride times its extent times an integer pitch factor
    (``("pitch", f)``); past a static one, a fixed multiple of the inner stride (``("times", k)``),
    which keeps any padding between static dims (packed q/k/v heads) as it is. A static dim of extent 1
    has no place in memory (torch may give it any stride): it joins the chain where its stride fits,
    and keeps its own stride otherwise."""
    return _chain(t, range(len(t.shape)), dynamic) or _chain(
        t, [i for i in range(len(t.shape)) if t.shape[i] != 1 or i in dynamic], dynamic)


def _chain(t: TensorSpec, dims, dynamic) -> Optional[tuple]:
    chained = list(dims)
    pinned = tuple((i, t.stride[i]) for i in range(len(t.shape)) if i not in chained)
    order = sorted(chained, key=lambda i: (t.stride[i], -i))  # ties: the later dim inner, as torch's contiguous
    rules = []
    for inner, outer in zip(order, order[1:]):
        if inner in dynamic:
            dense = t.stride[inner] * max(t.shape[inner], 1)
            if dense == 0 or t.stride[outer] % dense:
                return None
            rules.append(("pitch", t.stride[outer] // dense))
        else:
            if t.stride[inner] == 0 or t.stride[outer] % t.stride[inner]:
                return None
            rules.append(("times", t.stride[outer] // t.stride[inner]))
    return tuple(order), (t.stride[order[0]] if order else 1), tuple(rules), pinned


def _rebuilt(t: TensorSpec, layout: tuple, shape: tuple) -> TensorSpec:
    order, base, rules, pinned = layout
    stride = [0] * len(shape)
    if order:
        stride[order[0]] = base
    for (inner, outer), (kind, k) in zip(zip(order, order[1:]), rules):
        stride[outer] = stride[inner] * (max(shape[inner], 1) if kind == "pitch" else 1) * k
    for i, st in pinned:
        stride[i] = st
    return TensorSpec(tuple(shape), tuple(stride), t.dtype)


def _fields(spec) -> dict:
    if type(spec) is MatmulSpec:
        return {"a": spec.a, "b": spec.b, "y": spec.y, "bias": spec.epilogue.bias, "residual": spec.epilogue.residual}
    return {"q": spec.q, "k": spec.k, "v": spec.v, "o": spec.o, "bias": spec.bias}


def with_sizes(spec, **new) -> Optional[object]:
    """``spec``'s family member at the sizes ``new`` (names of ``DYNAMIC[spec.op]`` or ``ALIASES``; the
    others keep theirs), every operand in its own layout; None for a spec of no family. Raises ValueError naming
    an unknown size or one that is not a positive int."""
    dims = _dims(spec)
    if dims is None:
        return None
    aliases = ALIASES.get(spec.op, {})
    unknown = set(new) - set(DYNAMIC[spec.op]) - set(aliases)
    if unknown:
        raise ValueError(f"{spec.op} has no dynamic size {sorted(unknown)} (it has "
                         f"{', '.join(DYNAMIC[spec.op] + tuple(aliases))})")
    for k, v in new.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"size {k} must be a positive int, got {v!r}")
    for alias, names in aliases.items():
        if alias in new:
            new = {**{n: new[alias] for n in names}, **{k: v for k, v in new.items() if k != alias}}
    target = {**sizes(spec), **new}
    fields = _fields(spec)
    rebuilt = {}
    for name, d in dims.items():
        t = fields[name]
        layout = _layout(t, d)
        if layout is None:
            return None
        shape = tuple(target[d[i]] if i in d else n for i, n in enumerate(t.shape))
        rebuilt[name] = _rebuilt(t, layout, shape)
    if type(spec) is MatmulSpec:
        epi = spec.epilogue
        epi = type(epi)(rebuilt.get("bias", epi.bias), rebuilt.get("residual", epi.residual), epi.activation,
                        epi.negative_slope, epi.amax)
        return MatmulSpec(rebuilt["a"], rebuilt.get("b", spec.b), rebuilt["y"], epi, spec.allow_tf32)
    return SdpaSpec(rebuilt["q"], rebuilt["k"], rebuilt["v"], rebuilt["o"], rebuilt.get("bias", spec.bias),
                    spec.is_causal, spec.scale)


# Family keys by their forms (below): every new size of a known layer asks for its family on its first call,
# and the digest of the spec's JSON costs several times the forms' own computation.
_KEYS: dict = {}
KEYS_CAPACITY = 4096


def family(spec) -> Optional[str]:
    """The family key of ``spec`` (a hex digest), or None where it has no family: another op, or an
    operand layout ``with_sizes`` could not rebuild exactly."""
    dims = _dims(spec)
    if dims is None:
        return None
    fields = _fields(spec)
    forms = []
    for name, dd in dims.items():
        t = fields[name]
        layout = _layout(t, dd)
        if layout is None:
            return None
        forms.append((name, tuple(-1 if i in dd else n for i, n in enumerate(t.shape)), layout, t.dtype))
    memo = (type(spec), tuple(forms), _rest(spec, dims))
    key = _KEYS.get(memo)
    if key is None:
        key = _family_digest(spec, forms)
        if len(_KEYS) >= KEYS_CAPACITY:
            _KEYS.clear()
        _KEYS[memo] = key
    return key or None


def _rest(spec, dims) -> tuple:
    """What a family key depends on besides its operands' forms: the other operands as they are (None where
    absent) and the attributes, each with its exact type (1 and 1.0 hash alike but are two JSON spellings)."""
    out = []
    for f in dataclasses.fields(spec):
        v = getattr(spec, f.name)
        if type(v) is Epilogue:
            out.extend((g.name, type(w), w) for g in dataclasses.fields(v) if g.name not in dims
                       for w in (getattr(v, g.name),))
        elif f.name not in dims:
            out.append((f.name, type(v), v))
    return tuple(out)


def _family_digest(spec, forms) -> str:
    """``family``'s key computed from the spec's canonical JSON with each operand of ``forms`` (``family``'s:
    name, shape with -1 for a dynamic extent, layout, dtype) in place of the operand; "" where ``with_sizes``
    does not rebuild the spec exactly."""
    if with_sizes(spec) != spec:
        return ""
    d = spec.to_dict()
    for name, shape, (order, base, rules, pinned), dtype in forms:
        form = {"shape": ["*" if n == -1 else n for n in shape], "order": list(order),
                "base": base, "rules": [list(r) for r in rules], "pinned": [list(p) for p in pinned],
                "dtype": dtype}
        if name in ("bias", "residual") and type(spec) is MatmulSpec:
            d["epilogue"][name] = form
        else:
            d[name] = form
    return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
