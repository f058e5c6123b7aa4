"""Specs: what TensorSpec.of reads, and which changes do and do not move a digest."""

import dataclasses
import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from cudnn_fuse.spec import (
    ACTIVATIONS,
    SCHEMA_VERSION,
    ConvSpec,
    Epilogue,
    MatmulSpec,
    SdpaSpec,
    TensorSpec,
    channels_last_strides,
    contiguous_strides,
    spec_from_dict,
)

# ----------------------------------------------------------------- builders


def conv_spec(dtype="float16", epilogue=None, **kw):
    x = TensorSpec.contiguous((2, 4, 9, 9), dtype)
    w = TensorSpec.contiguous((8, 4, 3, 3), dtype)
    shape = (2, 8, 9, 9)
    y = TensorSpec(shape, channels_last_strides(shape), dtype)
    args = dict(x=x, w=w, y=y, stride=(1, 1), pre_padding=(1, 1), post_padding=(1, 1), dilation=(1, 1), groups=1,
                epilogue=epilogue or Epilogue())
    args.update(kw)
    return ConvSpec(**args)


def matmul_spec(dtype="bfloat16", epilogue=None, **kw):
    args = dict(a=TensorSpec.contiguous((3, 16, 32), dtype), b=TensorSpec((1, 32, 24), (768, 1, 32), dtype),
                y=TensorSpec.contiguous((3, 16, 24), dtype), epilogue=epilogue or Epilogue())
    args.update(kw)
    return MatmulSpec(**args)


def sdpa_spec(dtype="float16", **kw):
    q = TensorSpec.contiguous((2, 4, 16, 64), dtype)
    kv = TensorSpec.contiguous((2, 2, 32, 64), dtype)
    args = dict(q=q, k=kv, v=kv, o=TensorSpec.contiguous((2, 4, 16, 64), dtype), bias=None, is_causal=False,
                scale=0.125)
    args.update(kw)
    return SdpaSpec(**args)


def full_epilogue(shape, dtype):
    """An epilogue with every optional part on (so each can be switched off)."""
    k = shape[1]
    return Epilogue(bias=TensorSpec((1, k, 1, 1), (k, 1, k, k), dtype),
                    residual=TensorSpec.contiguous(shape, dtype), activation="leaky_relu", negative_slope=0.2,
                    amax=True)


# ------------------------------------------------------------- TensorSpec.of


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_tensor_spec_of_reads_contiguous_geometry_and_dtype(dtype):
    t = torch.empty(2, 3, 5, dtype=dtype)
    s = TensorSpec.of(t)
    assert s.shape == (2, 3, 5)
    assert s.stride == (15, 5, 1)
    assert s.dtype == str(dtype).split(".")[-1]
    assert isinstance(s.shape, tuple) and isinstance(s.stride, tuple)


@pytest.mark.parametrize("make", [
    lambda: torch.empty(4, 6).t(),
    lambda: torch.empty(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
    lambda: torch.empty(3, 1).expand(3, 7),
    lambda: torch.empty(8, 10)[::2, 1:],
    lambda: torch.empty(5, 4).t().unsqueeze(0),
], ids=["transposed", "channels_last", "expanded", "sliced", "linear_weight_view"])
def test_tensor_spec_of_reads_strides_of_views(make):
    t = make()
    s = TensorSpec.of(t)
    assert s.shape == tuple(t.shape)
    assert s.stride == tuple(t.stride())


def test_contiguous_helpers_agree_with_torch():
    for shape in [(2, 3, 4, 5), (1, 7, 1, 3), (4,), (3, 2)]:
        assert contiguous_strides(shape) == torch.empty(shape).stride()
        assert TensorSpec.contiguous(shape, "float32") == TensorSpec.of(torch.empty(shape))
    for shape in [(2, 3, 4, 5), (1, 8, 7, 3), (3, 2, 1, 2)]:
        t = torch.empty(shape).contiguous(memory_format=torch.channels_last)
        assert channels_last_strides(shape) == t.stride()


# ------------------------------------------------------------ digest: stable


@pytest.mark.parametrize("make", [
    lambda: conv_spec(),
    lambda: conv_spec(epilogue=full_epilogue((2, 8, 9, 9), "float16")),
    lambda: matmul_spec(),
    lambda: matmul_spec(epilogue=Epilogue(bias=TensorSpec((1, 1, 24), (24, 24, 1), "bfloat16"), activation="gelu",
                                          amax=True)),
    lambda: sdpa_spec(),
    lambda: sdpa_spec(bias=TensorSpec.contiguous((1, 4, 16, 32), "float16"), is_causal=True, scale=0.1),
], ids=["conv", "conv_epilogue", "matmul", "matmul_epilogue", "sdpa", "sdpa_bias_causal"])
def test_digest_is_stable_and_survives_a_json_round_trip(make):
    s1, s2 = make(), make()
    assert s1 is not s2
    assert s1 == s2 and s1.digest() == s2.digest()
    assert s1.canonical_json() == s2.canonical_json()
    d = s1.digest()
    assert len(d) == 64 and int(d, 16) >= 0
    # the digest is the sha256 of the canonical JSON (the contract's key definition)
    assert d == hashlib.sha256(s1.canonical_json().encode()).hexdigest()
    doc = json.loads(s1.canonical_json())
    assert doc["schema_version"] == SCHEMA_VERSION and doc["op"] == s1.op
    # canonical: sorted keys, no whitespace, so re-encoding reproduces it byte for byte
    assert json.dumps(doc, sort_keys=True, separators=(",", ":")) == s1.canonical_json()
    back = spec_from_dict(json.loads(s1.canonical_json()))
    assert type(back) is type(s1)
    assert back == s1
    assert back.digest() == d
    assert hash(back) == hash(s1)


def test_digest_does_not_depend_on_the_interpreter_hash_seed():
    code = ("import json, sys; from cudnn_fuse.spec import spec_from_dict; "
            "print(spec_from_dict(json.loads(sys.argv[1])).digest())")
    s = conv_spec(epilogue=full_epilogue((2, 8, 9, 9), "float16"))
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code, s.canonical_json()], capture_output=True, text=True, env=env,
                         check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.strip() == s.digest()


# ------------------------------------------------------- digest: sensitive


def _changed_tensor_specs(t: TensorSpec):
    """Variants of ``t`` that differ in exactly one of shape, stride, dtype."""
    shape = (t.shape[0] + 1,) + t.shape[1:]
    stride = tuple(reversed(t.stride)) if tuple(reversed(t.stride)) != t.stride else (t.stride[0] + 1,) + t.stride[1:]
    dtype = "float32" if t.dtype != "float32" else "float16"
    return {"shape": dataclasses.replace(t, shape=shape), "stride": dataclasses.replace(t, stride=stride),
            "dtype": dataclasses.replace(t, dtype=dtype)}


def _changed_epilogues(e: Epilogue):
    """One variant per Epilogue field (each differing from ``e`` in that field only)."""
    out = {}
    for f in dataclasses.fields(Epilogue):
        v = getattr(e, f.name)
        if f.name in ("bias", "residual"):
            out[f"epilogue.{f.name}=None"] = dataclasses.replace(e, **{f.name: None})
            for k, t in _changed_tensor_specs(v).items():
                out[f"epilogue.{f.name}.{k}"] = dataclasses.replace(e, **{f.name: t})
        elif f.name == "activation":
            for act in [None] + [a for a in ACTIVATIONS if a != v]:
                out[f"epilogue.activation={act}"] = dataclasses.replace(e, activation=act)
        elif f.name == "negative_slope":
            assert e.activation == "leaky_relu"  # the only activation the slope means something for
            out["epilogue.negative_slope"] = dataclasses.replace(e, negative_slope=v + 0.1)
        elif f.name == "amax":
            out["epilogue.amax"] = dataclasses.replace(e, amax=not v)
        else:
            raise AssertionError(f"Epilogue grew a field this test does not vary: {f.name}")
    return out


def _variants(spec):
    """(label, changed spec) for every dataclass field of ``spec``."""
    out = {}
    for f in dataclasses.fields(spec):
        v = getattr(spec, f.name)
        if isinstance(v, TensorSpec):
            for k, t in _changed_tensor_specs(v).items():
                out[f"{f.name}.{k}"] = dataclasses.replace(spec, **{f.name: t})
            if f.name == "bias":
                out["bias=None"] = dataclasses.replace(spec, bias=None)
        elif v is None and f.name == "bias":
            out["bias=spec"] = dataclasses.replace(spec, bias=TensorSpec.contiguous((1, 1, 16, 32), spec.q.dtype))
        elif isinstance(v, Epilogue):
            for k, e in _changed_epilogues(v).items():
                out[k] = dataclasses.replace(spec, epilogue=e)
        elif isinstance(v, bool):
            out[f.name] = dataclasses.replace(spec, **{f.name: not v})
        elif isinstance(v, int):
            out[f.name] = dataclasses.replace(spec, **{f.name: v + 1})
        elif isinstance(v, float):
            out[f.name] = dataclasses.replace(spec, **{f.name: v * 2 + 0.5})
        elif isinstance(v, tuple):
            out[f"{f.name}[0]"] = dataclasses.replace(spec, **{f.name: (v[0] + 1,) + v[1:]})
            out[f"{f.name}[1]"] = dataclasses.replace(spec, **{f.name: v[:1] + (v[1] + 1,) + v[2:]})
        else:
            raise AssertionError(f"{type(spec).__name__}.{f.name} has a type this test does not vary: {type(v)}")
    return out


_BASES = {
    "conv": lambda: conv_spec(epilogue=full_epilogue((2, 8, 9, 9), "float16")),
    "conv_asym": lambda: conv_spec(stride=(2, 1), pre_padding=(0, 1), post_padding=(1, 2), dilation=(1, 2), groups=2,
                                   w=TensorSpec.contiguous((8, 2, 3, 3), "float16"), allow_tf32=True,
                                   epilogue=full_epilogue((2, 8, 9, 9), "float16")),
    "matmul": lambda: matmul_spec(epilogue=Epilogue(bias=TensorSpec((1, 1, 24), (24, 24, 1), "bfloat16"),
                                                    residual=TensorSpec.contiguous((3, 16, 24), "bfloat16"),
                                                    activation="leaky_relu", negative_slope=0.3, amax=False)),
    "sdpa": lambda: sdpa_spec(),
    "sdpa_bias": lambda: sdpa_spec(bias=TensorSpec.contiguous((1, 4, 16, 32), "float16"), is_causal=True),
}


@pytest.mark.parametrize("base", sorted(_BASES))
def test_every_field_changes_the_digest(base):
    spec = _BASES[base]()
    variants = _variants(spec)
    top = {f.name for f in dataclasses.fields(spec)}
    covered = {label.split(".")[0].split("[")[0].split("=")[0] for label in variants}
    assert covered == top, f"fields not varied: {top - covered}"
    d = spec.digest()
    digests = {label: v.digest() for label, v in variants.items()}
    same = [label for label, dg in digests.items() if dg == d]
    assert not same, f"these changes left the digest unchanged: {same}"
    for label, v in variants.items():
        assert v != spec, label
        # a changed spec survives its own round trip, with its own digest
        assert spec_from_dict(json.loads(v.canonical_json())).digest() == digests[label], label


def test_each_activation_has_its_own_digest():
    digests = {act: conv_spec(epilogue=Epilogue(activation=act)).digest() for act in (None,) + ACTIVATIONS}
    assert len(set(digests.values())) == len(digests)


def test_op_families_never_share_a_digest_namespace():
    # the same geometry under two ops must not collide
    t = TensorSpec.contiguous((1, 4, 4), "float16")
    m = MatmulSpec(t, t, t)
    d = m.to_dict()
    d["op"] = "conv2d"
    assert json.loads(m.canonical_json())["op"] == "matmul"
    assert hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest() != m.digest()


# ----------------------------------------------------- digest: insensitive


def _conv_spec_of(x, w):
    """A ConvSpec made through the public path TensorSpec.of, as ops.py does."""
    y = torch.empty(x.shape[0], w.shape[0], x.shape[2], x.shape[3], dtype=x.dtype, device=x.device)
    return conv_spec(x=TensorSpec.of(x), w=TensorSpec.of(w), y=TensorSpec.of(y),
                     epilogue=Epilogue(bias=TensorSpec.of(torch.empty(1, 8, 1, 1, dtype=x.dtype, device=x.device)),
                                       activation="relu", amax=True))


def test_tensor_values_pointers_grad_and_device_do_not_change_the_digest():
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(2, 4, 9, 9, generator=g, dtype=torch.float16)
    w1 = torch.randn(8, 4, 3, 3, generator=g, dtype=torch.float16)
    x2 = torch.randn(2, 4, 9, 9, generator=g, dtype=torch.float16).requires_grad_()
    w2 = torch.randn(8, 4, 3, 3, generator=g, dtype=torch.float16).requires_grad_()
    x3 = torch.empty(2, 4, 9, 9, dtype=torch.float16, device="meta")  # another device, no data at all
    w3 = torch.empty(8, 4, 3, 3, dtype=torch.float16, device="meta")
    assert x1.data_ptr() != x2.data_ptr() and not torch.equal(x1, x2.detach())
    specs = [_conv_spec_of(x1, w1), _conv_spec_of(x2, w2), _conv_spec_of(x3, w3)]
    assert len({s.digest() for s in specs}) == 1
    assert specs[0] == specs[1] == specs[2]
    # and the geometry is really what was read: a transposed layout does change it
    x4 = torch.empty(2, 9, 9, 4, dtype=torch.float16).permute(0, 3, 1, 2)
    assert _conv_spec_of(x4, w1).digest() != specs[0].digest()


def test_sdpa_spec_from_different_tensors_with_one_geometry_has_one_digest():
    def make(device, grad):
        q, k, v = (torch.randn(2, 3, 5, 8, dtype=torch.bfloat16, device=device, requires_grad=grad)
                   if device != "meta" else torch.empty(2, 3, 5, 8, dtype=torch.bfloat16, device="meta")
                   for _ in range(3))
        return SdpaSpec(TensorSpec.of(q), TensorSpec.of(k), TensorSpec.of(v), TensorSpec.of(q), None, True, 0.5)

    assert make("cpu", False).digest() == make("cpu", True).digest() == make("meta", False).digest()


@pytest.mark.parametrize("act", [None] + [a for a in ACTIVATIONS if a != "leaky_relu"])
def test_negative_slope_is_normalised_for_non_leaky_activations(act):
    e1, e2 = Epilogue(activation=act), Epilogue(activation=act, negative_slope=0.7)
    assert e2.negative_slope == e1.negative_slope
    assert e1 == e2
    assert conv_spec(epilogue=e1).digest() == conv_spec(epilogue=e2).digest()
    assert matmul_spec(epilogue=e1).digest() == matmul_spec(epilogue=e2).digest()


def test_negative_slope_is_kept_for_leaky_relu():
    e = Epilogue(activation="leaky_relu", negative_slope=0.7)
    assert e.negative_slope == 0.7
    assert conv_spec(epilogue=e).digest() != conv_spec(epilogue=Epilogue(activation="leaky_relu")).digest()


def test_equal_specs_have_equal_digests_int_vs_float_slope():
    e_int = Epilogue(activation="leaky_relu", negative_slope=1)
    e_float = Epilogue(activation="leaky_relu", negative_slope=1.0)
    assert conv_spec(epilogue=e_int) == conv_spec(epilogue=e_float)
    assert conv_spec(epilogue=e_int).digest() == conv_spec(epilogue=e_float).digest()


_SPELLINGS = [  # (another spelling, the canonical name)
    ("ReLU", "relu"), ("RELU", "relu"), ("GELU", "gelu"), ("Gelu_Tanh", "gelu_tanh"), ("SiLU", "silu"),
    ("Leaky_ReLU", "leaky_relu"), ("none", None), ("None", None), ("IDENTITY", None),
    (torch.nn.ReLU(), "relu"), (torch.nn.ReLU(inplace=True), "relu"), (torch.nn.functional.relu, "relu"),
    (torch.relu, "relu"), (torch.nn.GELU(), "gelu"), (torch.nn.GELU(approximate="tanh"), "gelu_tanh"),
    (torch.nn.functional.gelu, "gelu"), (torch.nn.SiLU(), "silu"), (torch.nn.functional.silu, "silu"),
    (torch.tanh, "tanh"), (torch.nn.Tanh(), "tanh"), (torch.sigmoid, "sigmoid"), (torch.nn.Sigmoid(), "sigmoid"),
    (torch.nn.functional.leaky_relu, "leaky_relu"), (torch.nn.Identity(), None),
]


@pytest.mark.parametrize("spelling, name", _SPELLINGS, ids=[repr(s)[:30] for s, _ in _SPELLINGS])
def test_a_spec_made_from_any_spelling_of_an_activation_is_the_canonical_one(spelling, name):
    """Specs (and so cache keys) only ever see the canonical names: one plan for "ReLU" and "relu"."""
    e = Epilogue(activation=spelling)
    assert e.activation == name and e == Epilogue(activation=name)
    assert conv_spec(epilogue=e).digest() == conv_spec(epilogue=Epilogue(activation=name)).digest()
    assert conv_spec(epilogue=e).canonical_json() == conv_spec(epilogue=Epilogue(activation=name)).canonical_json()


def test_a_spec_made_from_nn_leaky_relu_takes_its_slope():
    e = Epilogue(activation=torch.nn.LeakyReLU(0.2))
    assert (e.activation, e.negative_slope) == ("leaky_relu", 0.2)
    assert e == Epilogue(activation="leaky_relu", negative_slope=0.2)


# ---------------------------------------------------------------- rejects


@pytest.mark.parametrize("act", ["swish", "", "gelu_approx_tanh", 3, "leakyrelu"])
def test_unknown_activation_is_a_value_error(act):
    with pytest.raises(ValueError, match="activation"):
        Epilogue(activation=act)


@pytest.mark.parametrize("version", [0, SCHEMA_VERSION + 1, None, str(SCHEMA_VERSION), "missing"])
def test_spec_from_dict_rejects_a_foreign_schema_version(version):
    d = json.loads(conv_spec().canonical_json())
    if version == "missing":
        del d["schema_version"]
    else:
        d["schema_version"] = version
    with pytest.raises(ValueError, match="schema_version"):
        spec_from_dict(d)


@pytest.mark.parametrize("op", ["conv3d", "Conv2d", "", None, "missing"])
def test_spec_from_dict_rejects_an_unknown_op(op):
    d = json.loads(matmul_spec().canonical_json())
    if op == "missing":
        del d["op"]
    else:
        d["op"] = op
    with pytest.raises(ValueError, match="op"):
        spec_from_dict(d)


def test_spec_from_dict_does_not_mutate_its_argument():
    d = json.loads(sdpa_spec().canonical_json())
    before = json.dumps(d, sort_keys=True)
    spec_from_dict(d)
    assert json.dumps(d, sort_keys=True) == before


def _every_spec_class():
    """One spec of every class, with its optional operands present and absent."""
    from tests.test_backward import _specs

    from cudnn_fuse.spec import ScaledMMSpec, SdpaFP8Spec

    e8 = "float8_e4m3fn"
    out = [conv_spec(), matmul_spec(), sdpa_spec(), sdpa_spec(is_causal=True, scale=0.5),
           matmul_spec(epilogue=Epilogue(TensorSpec((1, 1, 8), (8, 8, 1), "bfloat16"),
                                         TensorSpec((2, 5, 8), (40, 8, 1), "bfloat16"), "leaky_relu", 0.2, True)),
           ScaledMMSpec(TensorSpec((16, 32), (32, 1), e8), TensorSpec((32, 16), (1, 32), e8),
                        TensorSpec((16, 16), (16, 1), "bfloat16"), Epilogue(activation="gelu", amax=True)),
           SdpaFP8Spec(*(TensorSpec((1, 2, 16, 64), (2048, 1024, 64, 1), e8),) * 3, True, 0.125)]
    return out + list(_specs().values())


def _asdict_json(spec) -> str:
    """The canonical JSON as ``dataclasses.asdict`` makes it: the spelling every stored key was made with."""
    d = {"schema_version": SCHEMA_VERSION, "op": spec.op}
    for f in dataclasses.fields(spec):
        v = getattr(spec, f.name)
        if f.name == "fwd":
            d[f.name] = json.loads(_asdict_json(v))
        else:
            d[f.name] = dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
    return json.dumps(d, sort_keys=True, separators=(",", ":"))


def test_every_specs_json_is_spelled_as_dataclasses_asdict_spells_it():
    specs = _every_spec_class()
    assert len({type(s) for s in specs}) >= 12
    for spec in specs:
        assert spec.canonical_json() == _asdict_json(spec), type(spec).__name__
        assert spec.digest() == hashlib.sha256(_asdict_json(spec).encode()).hexdigest()
        if not hasattr(spec, "fwd"):  # the same values, tuples as tuples, as asdict gives them
            assert spec.to_dict() == {"schema_version": SCHEMA_VERSION, "op": spec.op, **dataclasses.asdict(spec)}
        d = spec.to_dict()
        d["op"] = "changed"  # a fresh dict each time: a caller's change reaches no spec
        assert spec.to_dict()["op"] == spec.op
