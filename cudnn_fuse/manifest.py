"""Plan manifests: the op specs a model will run, recorded once, pre-warmed offline.

A manifest is JSON (documented in plans/README.md):

    {"schema": "cudnn_fuse.manifest", "version": 1, "name": "...", "description": "...",
     "entries": [{"spec": <spec.to_dict()>, "count": 3, "weight": 1.0, "name": "layer1.0.conv2"}, ...]}

An entry may give sizes of the spec's shape family (families.py) to warm instead of its own:
``"sizes": {"m": [128, 256, 512]}`` or ``{"seq_q": {"range": [1, 4096]}, ...}``.

``record(path)`` writes every spec the ops build while it is active (deduplicated,
counted; one family's specs at several sizes as one entry with the sizes seen). Specs are made as the GPU path would make them, also for CPU and meta
tensors, so a manifest can be recorded without a GPU (a model on the "meta"
device records without computing anything).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from . import families
from .spec import _BY_OP, DTYPES, FP8_DTYPES, Epilogue, spec_from_dict

SCHEMA = "cudnn_fuse.manifest"
VERSION = 1


class ManifestError(ValueError):
    """A manifest that does not follow the schema; the message names the entry and field."""


# record lists up to MAX_LISTED sizes of a dimension, and ranges for every varying dimension past that or
# where the lists' product would pass MAX_PRODUCT: a list pre-warms every size seen, a range its ends and
# middle only, so ranges are kept for sweeps a pre-warm could not build size by size
MAX_LISTED = 256
MAX_PRODUCT = 1024


@dataclass
class Entry:
    spec: object
    count: int = 1
    weight: float = 1.0
    name: Optional[str] = None
    sizes: Optional[dict] = None  # {dynamic size: [sizes] or {"range": [lo, hi]}}: the spec's family at these

    def to_dict(self) -> dict:
        d = {"spec": self.spec.to_dict(), "count": self.count}
        if self.weight != 1.0:
            d["weight"] = self.weight
        if self.name:
            d["name"] = self.name
        if self.sizes:
            d["sizes"] = self.sizes
        return d

    def expand(self) -> list:
        """The entries this one stands for: itself, or with ``sizes`` one per size of its family (each
        list's sizes, each range's ends and middle; the product over the dimensions)."""
        if not self.sizes:
            return [self]
        axes = [(k, _points(v)) for k, v in self.sizes.items()]
        out = [{}]
        for k, pts in axes:
            out = [{**o, k: p} for o in out for p in pts]
        label = self.name or self.spec.op
        return [Entry(families.with_sizes(self.spec, **o), self.count, self.weight,
                      f"{label}[{','.join(f'{k}={v}' for k, v in o.items())}]") for o in out]


def _points(v) -> list:
    """A dimension's sizes: a list's, or a range's ends and geometric middle."""
    if isinstance(v, dict):
        lo, hi = v["range"]
        return sorted({lo, round(math.sqrt(lo * hi)), hi})
    return list(dict.fromkeys(v))


def expand(entries) -> list:
    """Every entry with sizes as one entry per size (``Entry.expand``), each spec once."""
    out, seen = [], set()
    for e in entries:
        for x in e.expand():
            if x.spec not in seen:
                seen.add(x.spec)
                out.append(x)
    return out


def collapse(entries) -> list:
    """Entries of one family at several sizes as one entry with ``sizes``: the sizes seen per dimension
    that varied, listed (up to MAX_LISTED, and MAX_PRODUCT over the dimensions) or as a range."""
    groups: "OrderedDict[object, list]" = OrderedDict()
    for e in entries:
        fam = families.family(e.spec)
        groups.setdefault(fam if fam is not None else ("spec", e.spec), []).append(e)
    out = []
    for group in groups.values():
        if len(group) == 1:
            out.append(group[0])
            continue
        seen = [families.sizes(e.spec) for e in group]
        for alias, tied in families.ALIASES.get(group[0].spec.op, {}).items():
            if all(len({s[n] for n in tied}) == 1 for s in seen):  # always equal: one size
                seen = [{**{k: v for k, v in s.items() if k not in tied}, alias: s[tied[0]]} for s in seen]
        varied = {k: sorted({s[k] for s in seen}) for k in seen[0] if len({s[k] for s in seen}) > 1}
        product = math.prod(len(v) for v in varied.values())
        sizes = {k: (v if len(v) <= MAX_LISTED and product <= MAX_PRODUCT else {"range": [v[0], v[-1]]})
                 for k, v in varied.items()}
        first = group[0]
        out.append(Entry(first.spec, sum(e.count for e in group), first.weight, first.name, sizes))
    return out


def _entry(i: int, raw) -> Entry:
    where = f"entries[{i}]"
    if not isinstance(raw, dict):
        raise ManifestError(f"{where} must be an object, got {type(raw).__name__}")
    unknown = set(raw) - {"spec", "count", "weight", "name", "sizes"}
    if unknown:
        raise ManifestError(f"{where} has unknown field(s) {sorted(unknown)}")
    if "spec" not in raw:
        raise ManifestError(f"{where}.spec is missing")
    _check_fields(f"{where}.spec", raw["spec"], "Any")
    try:
        spec = spec_from_dict(raw["spec"])
    except (ValueError, TypeError, KeyError) as exc:
        detail = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ManifestError(f"{where}.spec is not a valid op spec: {detail}") from None
    count = raw.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ManifestError(f"{where}.count must be a positive int, got {count!r}")
    weight = raw.get("weight", 1.0)
    if not _is_finite(weight) or weight <= 0:
        raise ManifestError(f"{where}.weight must be a positive number, got {weight!r}")
    name = raw.get("name")
    if name is not None and not isinstance(name, str):
        raise ManifestError(f"{where}.name must be a string, got {type(name).__name__}")
    sizes = raw.get("sizes")
    if sizes is not None:
        _check_sizes(f"{where}.sizes", spec, sizes)
    return Entry(spec, count, float(weight), name, sizes or None)


def _check_sizes(where: str, spec, sizes) -> None:
    if not isinstance(sizes, dict):
        raise ManifestError(f"{where} must be an object, got {type(sizes).__name__}")
    if sizes and families.family(spec) is None:
        raise ManifestError(f"{where}: a {spec.op} spec of this layout has no sizes to vary (only "
                            f"{', '.join(sorted(families.DYNAMIC))} graphs in dense or padded layouts have)")
    for k, v in sizes.items():
        if k not in families.names(spec.op):
            raise ManifestError(f"{where} has no size {k!r}: {spec.op} varies {', '.join(families.names(spec.op))}")
        if isinstance(v, dict):
            rng = v.get("range")
            if set(v) != {"range"} or not (isinstance(rng, list) and len(rng) == 2 and all(_is_int(x, 1) for x in rng)
                                           and rng[0] <= rng[1]):
                raise ManifestError(f"{where}.{k} must be a list of positive ints or {{\"range\": [lo, hi]}} with "
                                    f"1 <= lo <= hi, got {v!r}")
        elif not (isinstance(v, list) and v and all(_is_int(x, 1) for x in v)):
            raise ManifestError(f"{where}.{k} must be a non-empty list of positive ints or {{\"range\": [lo, hi]}}, "
                                f"got {v!r}")


_MAX_DIM = 2**63  # cuDNN's sizes and strides are int64


def _check_fields(where: str, v, kind: str) -> None:
    """``v`` is a JSON value of the spec field type ``kind`` (a field's annotation in spec.py).
    spec_from_dict drops unknown fields and keeps any value, so a misspelt field (``is_casual``)
    or a shape given as a string would pre-warm another spec than the one meant, or one that
    fails only when it is built."""
    if kind.startswith("Optional["):
        if v is None:
            return
        kind = kind[len("Optional["):-1]
    if kind in ("Any", "Epilogue", "TensorSpec"):  # a nested spec (``fwd``), an epilogue, an operand
        if not isinstance(v, dict):
            raise ManifestError(f"{where} must be an object, got {type(v).__name__}")
        if kind == "TensorSpec":
            _check_tensor(where, v)
            return
        op = v.get("op")
        cls = Epilogue if kind == "Epilogue" else _BY_OP.get(op) if isinstance(op, str) else None
        if cls is None:
            return  # an unknown op (or a list, which is no key): spec_from_dict names it
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = set(v) - set(fields) - ({"schema_version", "op"} if kind == "Any" else set())
        if unknown:
            raise ManifestError(f"{where} has unknown field(s) {sorted(unknown)}")
        for name, value in v.items():
            if name in fields:
                _check_fields(f"{where}.{name}", value, fields[name])
    elif kind == "Tuple[int, int]":
        least = 1 if where.endswith((".stride", ".dilation")) else 0  # a padding may be 0, as in cf.conv2d
        if not (isinstance(v, list) and len(v) == 2 and all(_is_int(d, least) for d in v)):
            raise ManifestError(f"{where} must be a list of 2 {('non-negative', 'positive')[least]} ints, got {v!r}")
    elif kind == "int" and not _is_int(v, 1):
        raise ManifestError(f"{where} must be a positive int, got {v!r}")
    elif kind == "bool" and not isinstance(v, bool):
        raise ManifestError(f"{where} must be true or false, got {v!r}")
    elif kind == "float" and not _is_finite(v):
        raise ManifestError(f"{where} must be a finite number, got {v!r}")
    elif kind == "str" and not isinstance(v, str):
        raise ManifestError(f"{where} must be a string, got {v!r}")


def _check_tensor(where: str, v: dict) -> None:
    unknown = set(v) - {"shape", "stride", "dtype"}
    if unknown:
        raise ManifestError(f"{where} has unknown field(s) {sorted(unknown)}")
    for name in ("shape", "stride", "dtype"):
        if name not in v:
            raise ManifestError(f"{where}.{name} is missing")
    for name in ("shape", "stride"):
        if not (isinstance(v[name], list) and all(_is_int(d, 0) for d in v[name])):
            raise ManifestError(f"{where}.{name} must be a list of non-negative ints, got {v[name]!r}")
    if len(v["shape"]) != len(v["stride"]):
        raise ManifestError(f"{where}: shape {v['shape']} and stride {v['stride']} differ in length")
    if v["dtype"] not in DTYPES + FP8_DTYPES:
        raise ManifestError(f"{where}.dtype must be one of {DTYPES + FP8_DTYPES}, got {v['dtype']!r}")


def _is_int(v, least: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and least <= v < _MAX_DIM


def _is_finite(v) -> bool:
    """A JSON number that is a finite float: an int of 400 digits is no float (OverflowError)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def parse(data) -> list:
    """Validate a decoded manifest; returns its entries. Raises ManifestError."""
    if not isinstance(data, dict):
        raise ManifestError(f"a manifest is a JSON object, got {type(data).__name__}")
    if data.get("schema") != SCHEMA:
        raise ManifestError(f"schema must be {SCHEMA!r}, got {data.get('schema')!r}")
    if data.get("version") != VERSION:
        raise ManifestError(f"version must be {VERSION}, got {data.get('version')!r}")
    entries = data.get("entries")
    if not isinstance(entries, list):
        raise ManifestError("entries must be a list")
    return [_entry(i, e) for i, e in enumerate(entries)]


def load(path) -> list:
    """The entries of the manifest file ``path``; ManifestError names what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, or nested past the recursion limit
        raise ManifestError(f"{path}: not JSON ({exc})") from None
    try:
        return parse(data)
    except ManifestError as exc:
        raise ManifestError(f"{path}: {exc}") from None


def dump(entries, path, name: str = "", description: str = "") -> None:
    """Write a manifest to ``path`` through a temp file renamed into place, so an interrupted or
    failed write leaves the old file (or none), never half a manifest."""
    write_json({"schema": SCHEMA, "version": VERSION, "name": name, "description": description,
                "entries": [e.to_dict() for e in entries]}, path)


def write_json(doc, path) -> None:
    """``doc`` as indented JSON in ``path``, through a temp file beside it renamed into place: an
    interrupted or failed write leaves the old file (or none), never half of one, and no temp file."""
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, sort_keys=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ----------------------------------------------------------------------------- recording


class Recorder:
    """Collects the specs the ops make, deduplicated and counted (thread-safe). A recorder
    opened inside another's block passes each spec on to it (``outer``): the outer block's
    manifest holds every spec made inside it, the inner block's too."""

    def __init__(self, outer: "Optional[Recorder]" = None):
        self._entries: "OrderedDict[object, Entry]" = OrderedDict()
        self._lock = threading.Lock()
        self._outer = outer

    def add(self, spec) -> None:
        with self._lock:
            e = self._entries.get(spec)
            if e is None:
                self._entries[spec] = Entry(spec)
            else:
                e.count += 1
        outer = self._outer
        while outer is not None and outer not in _active:  # a block that ended (another thread's) takes no more
            outer = outer._outer
        if outer is not None:
            outer.add(spec)

    @property
    def entries(self) -> list:
        with self._lock:
            return list(self._entries.values())


_active: list = []


def active() -> Optional[Recorder]:
    """The innermost active recorder, or None (checked by the ops on every fused call)."""
    try:  # one read: another thread's block may end between a check and an index
        return _active[-1]
    except IndexError:
        return None


@contextlib.contextmanager
def record(path=None, name: str = "", description: str = ""):
    """Record every op spec made inside the block; write a manifest to ``path`` at exit.

        with cf.record("plans/mymodel.json"):
            model(x)

    A ``path`` that is a directory, or in a directory that is not there, raises here, before the
    block runs (it may run for hours), not when the manifest is written.
    """
    for arg, value in (("name", name), ("description", description)):
        if not isinstance(value, str):
            raise TypeError(f"record: {arg} must be a str, got {type(value).__name__}")
    if path is not None:
        if not isinstance(path, (str, bytes, os.PathLike)):
            raise TypeError(f"record: path must be a file path (str or os.PathLike) or None, got {type(path).__name__}")
        _check_destination(path)
    rec = Recorder(active())
    _active.append(rec)
    try:
        yield rec
    finally:
        _active.remove(rec)
        if path is not None:
            dump(collapse(rec.entries), path, name=name, description=description)


def _check_destination(path) -> None:
    p = os.fspath(path)
    if os.path.isdir(p):
        raise IsADirectoryError(errno.EISDIR, "cannot write a manifest over a directory", p)
    parent = os.path.dirname(os.path.abspath(p))
    if not os.path.isdir(parent):
        raise FileNotFoundError(errno.ENOENT, "cannot write a manifest: no directory " + parent, p)
