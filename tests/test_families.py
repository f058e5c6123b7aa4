"""Shape families (families.py) and manifests with sizes: a spec rebuilt at other sizes is exactly the
spec the op makes at those sizes, whatever the operands' layouts; record collapses a family's sizes into
one entry and prewarm expands it back."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import cudnn_fuse as cf
from cudnn_fuse import families, manifest, prewarm
from cudnn_fuse.manifest import ManifestError

M16 = dict(device="meta", dtype=torch.float16)


def _one(fn):
    """The single spec ``fn`` makes (on meta tensors: shapes only)."""
    with cf.record() as rec:
        fn()
    (e,) = rec.entries
    return e.spec


def _linear(m, batch=2, bias=True, residual=False, act="gelu"):
    w, b = torch.empty(48, 32, **M16), torch.empty(48, **M16)
    x = torch.empty(batch, m, 32, **M16)
    r = torch.empty(batch, m, 48, **M16) if residual else None
    return lambda: cf.linear(x, w, b if bias else None, activation=act, residual=r)


def _bmm(m, batch, broadcast_b):
    a = torch.empty(batch, m, 32, **M16)
    b = torch.empty(32, 16, **M16) if broadcast_b else torch.empty(batch, 32, 16, **M16)
    return lambda: cf.matmul(a, b, activation="relu")


def _sdpa(s, batch=2, layout="bhsd", gqa=False, mask=None, causal=True, s_kv=None):
    h, hkv, d = 4, (2 if gqa else 4), 16
    s_kv = s if s_kv is None else s_kv
    if layout == "bhsd":
        q, k, v = torch.empty(batch, h, s, d, **M16), torch.empty(batch, hkv, s_kv, d, **M16), \
            torch.empty(batch, hkv, s_kv, d, **M16)
    elif layout == "bshd":
        q = torch.empty(batch, s, h, d, **M16).transpose(1, 2)
        k = torch.empty(batch, s_kv, hkv, d, **M16).transpose(1, 2)
        v = torch.empty(batch, s_kv, hkv, d, **M16).transpose(1, 2)
    else:  # one packed projection: [B, S, (h + 2 hkv) * d]
        qkv = torch.empty(batch, s, (h + 2 * hkv) * d, **M16)
        q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
        q, k, v = (t.unflatten(-1, (-1, d)).transpose(1, 2) for t in (q, k, v))
    m = None
    if mask == "bool":
        m = torch.empty(batch, 1, s, s_kv, device="meta", dtype=torch.bool)
    elif mask == "float":
        m = torch.empty(1, 1, s, s_kv, **M16)
    return lambda: cf.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal and mask is None,
                                                   enable_gqa=gqa)


CASES = {
    "linear+bias+gelu": lambda n, b: _linear(n, b),
    "linear+residual": lambda n, b: _linear(n, b, residual=True, act=None),
    "linear no bias": lambda n, b: _linear(n, b, bias=False, act="relu"),
    "batched matmul": lambda n, b: _bmm(n, b, False),
    "matmul, one b for the batch": lambda n, b: _bmm(n, b, True),
    "sdpa bhsd": lambda n, b: _sdpa(n, b),
    "sdpa bshd view": lambda n, b: _sdpa(n, b, "bshd"),
    "sdpa packed qkv": lambda n, b: _sdpa(n, b, "packed"),
    "sdpa packed gqa": lambda n, b: _sdpa(n, b, "packed", gqa=True),
    "sdpa bool mask": lambda n, b: _sdpa(n, b, mask="bool"),
    "sdpa float bias": lambda n, b: _sdpa(n, b, mask="float"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_spec_rebuilt_at_other_sizes_is_the_spec_the_op_makes_there(case):
    make = CASES[case]
    ref = _one(make(5, 2))
    fam = families.family(ref)
    assert fam is not None
    for n, b in [(5, 2), (17, 2), (64, 3), (3, 7), (128, 5)]:
        want = _one(make(n, b))
        assert families.with_sizes(ref, **families.sizes(want)) == want, (n, b)
        assert families.family(want) == fam


def test_what_is_not_a_dynamic_size_makes_another_family():
    base = families.family(_one(_linear(5)))
    assert families.family(_one(_linear(5, act="relu"))) != base  # another epilogue
    assert families.family(_one(_linear(5, bias=False))) != base
    w = torch.empty(64, 32, **M16)  # another N
    assert families.family(_one(lambda: cf.linear(torch.empty(2, 5, 32, **M16), w, activation="gelu"))) != base
    assert families.family(_one(_sdpa(8, layout="bhsd"))) != families.family(_one(_sdpa(8, layout="bshd")))
    assert families.family(_one(_sdpa(8, causal=True))) != families.family(_one(_sdpa(8, causal=False)))


def test_convs_have_no_family():
    spec = _one(lambda: cf.conv2d(torch.empty(2, 8, 7, 7, **M16), torch.empty(8, 8, 3, 3, **M16), padding=1))
    assert families.sizes(spec) is None and families.family(spec) is None and families.with_sizes(spec) is None


def test_seq_moves_both_sequence_lengths_and_bad_sizes_are_named():
    spec = _one(_sdpa(8))
    assert families.sizes(families.with_sizes(spec, seq=40)) == {"batch": 2, "seq_q": 40, "seq_kv": 40}
    assert families.with_sizes(spec, seq=40) == _one(_sdpa(40))
    cross = _one(_sdpa(8, s_kv=24, causal=False))
    assert families.with_sizes(cross, seq_kv=100) == _one(_sdpa(8, s_kv=100, causal=False))
    with pytest.raises(ValueError, match=r"no dynamic size \['n'\]"):
        families.with_sizes(spec, n=3)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="seq_q must be a positive int"):
            families.with_sizes(spec, seq_q=bad)


def test_an_operand_whose_strides_follow_no_layout_has_no_family():
    from cudnn_fuse.spec import Epilogue, MatmulSpec, TensorSpec

    a = TensorSpec((1, 6, 8), (48, 8, 1), "float16")
    b = TensorSpec((1, 8, 4), (32, 4, 1), "float16")
    y = TensorSpec((1, 6, 4), (24, 4, 1), "float16")
    assert families.family(MatmulSpec(a, b, y, Epilogue())) is not None
    odd = TensorSpec((1, 6, 8), (48, 7, 1), "float16")  # rows 7 apart with 8 columns: overlapping
    assert families.family(MatmulSpec(odd, b, y, Epilogue())) is None
    assert families.with_sizes(MatmulSpec(odd, b, y, Epilogue()), m=12) is None


def _manifest(tmp_path, entries):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"schema": manifest.SCHEMA, "version": manifest.VERSION, "entries": entries}))
    return path


def test_a_manifest_entry_with_sizes_expands_to_its_familys_specs(tmp_path):
    spec = _one(_sdpa(8))
    path = _manifest(tmp_path, [{"spec": spec.to_dict(), "name": "attn",
                                 "sizes": {"seq": {"range": [16, 1024]}, "batch": [1, 4]}}])
    (entry,) = manifest.load(path)
    got = manifest.expand([entry])
    assert [e.name for e in got] == [f"attn[seq={s},batch={b}]" for s in (16, 128, 1024) for b in (1, 4)]
    assert [e.spec for e in got] == [_one(_sdpa(s, b)) for s in (16, 128, 1024) for b in (1, 4)]
    assert manifest.expand([manifest.Entry(spec)]) == [manifest.Entry(spec)]  # no sizes: itself


@pytest.mark.parametrize("sizes, match", [
    ({"n": [1]}, "has no size 'n': sdpa varies batch, seq_q, seq_kv, seq"),
    ({"seq": []}, "seq must be a non-empty list of positive ints"),
    ({"seq": [0, 8]}, "seq must be a non-empty list"),
    ({"seq": {"range": [64, 8]}}, r"1 <= lo <= hi"),
    ({"seq": {"range": [1, 8], "step": 2}}, r"range"),
    ([1, 2], "sizes must be an object"),
])
def test_bad_sizes_are_refused_naming_the_entry_and_field(tmp_path, sizes, match):
    path = _manifest(tmp_path, [{"spec": _one(_sdpa(8)).to_dict(), "sizes": sizes}])
    with pytest.raises(ManifestError, match=r"entries\[0\]\.sizes") as exc:
        manifest.load(path)
    assert exc.match(match)


def test_sizes_on_a_spec_of_no_family_are_refused(tmp_path):
    conv = _one(lambda: cf.conv2d(torch.empty(2, 8, 7, 7, **M16), torch.empty(8, 8, 3, 3, **M16), padding=1))
    with pytest.raises(ManifestError, match="has no sizes to vary"):
        manifest.load(_manifest(tmp_path, [{"spec": conv.to_dict(), "sizes": {"batch": [1, 2]}}]))


def test_record_writes_a_familys_sizes_as_one_entry_and_prewarm_expands_it(tmp_path, capsys, cache_dir):
    path = tmp_path / "rec.json"
    lengths = [8, 24, 40]
    with cf.record(path):
        for s in lengths:
            _sdpa(s)()
            _linear(s)()
        cf.conv2d(torch.empty(2, 8, 7, 7, **M16), torch.empty(8, 8, 3, 3, **M16), padding=1)
    entries = manifest.load(path)
    by_op = {e.spec.op: e for e in entries}
    assert len(entries) == 3 and by_op["conv2d"].sizes is None
    assert by_op["sdpa"].sizes == {"seq": lengths} and by_op["sdpa"].count == 3
    assert by_op["matmul"].sizes == {"m": [2 * s for s in lengths]}  # linear's rows: batch x sequence
    want = {_one(_sdpa(s)) for s in lengths} | {_one(_linear(s)) for s in lengths} | {by_op["conv2d"].spec}
    assert {e.spec for e in manifest.expand(entries)} == want
    from cudnn_fuse import cli

    assert cli.main(["prewarm", str(path), "--dry-run"]) == 0
    assert "7/7" in capsys.readouterr().err  # every size, each once


def test_record_lists_what_a_prewarm_can_build_and_writes_a_range_past_it():
    many = [manifest.Entry(_one(_sdpa(s))) for s in range(8, 8 + 12 * 8, 8)]  # 12 lengths: listed
    (e,) = manifest.collapse(many)
    assert e.sizes == {"seq": list(range(8, 8 + 12 * 8, 8))}
    sweep = [manifest.Entry(_one(_sdpa(s))) for s in range(1, manifest.MAX_LISTED + 2)]  # one more: a range
    (e,) = manifest.collapse(sweep)
    assert e.sizes == {"seq": {"range": [1, manifest.MAX_LISTED + 1]}}
    cross = [manifest.Entry(_one(_sdpa(8, s_kv=s, causal=False))) for s in (16, 32)]
    (c,) = manifest.collapse(cross)
    assert c.sizes == {"seq_kv": [16, 32]}
    assert [x.spec for x in manifest.collapse([many[0]])] == [many[0].spec]  # one size: the entry as it was


def test_prewarm_builds_an_expanded_entry_once_per_size(cache_dir):
    entries = manifest.expand([manifest.Entry(_one(_linear(4)), sizes={"m": [8, 16, 8]})])
    built = []
    rows = prewarm.prewarm(entries, builder=built.append)
    assert len(entries) == len(rows) == 2 and {r.status for r in rows} == {"built"}
    assert sorted(built, key=lambda s: s.y.shape) == [_one(_linear(4, batch=2)), _one(_linear(8, batch=2))]


def _strided(shape, rng, dtype="float16"):
    """A TensorSpec of ``shape`` in a random dim order with random padding, size-1 dims given any stride."""
    from cudnn_fuse.spec import TensorSpec

    order = list(range(len(shape)))
    rng.shuffle(order)
    stride, acc = [0] * len(shape), 1
    for i in reversed(order):
        stride[i] = acc if shape[i] != 1 or rng.random() < 0.5 else rng.choice([1, 7, acc * 3])
        acc *= max(shape[i], 1) * rng.choice([1, 1, 2])
    return TensorSpec(tuple(shape), tuple(stride), dtype)


def _random_specs(rng, n):
    from cudnn_fuse.spec import Epilogue, MatmulSpec, SdpaSpec

    out = []
    for _ in range(n):
        b, m = rng.choice([1, 2, 3]), rng.choice([1, 4, 5, 9])
        if rng.random() < 0.5:
            k, nn = 8, rng.choice([8, 12])
            epi = Epilogue(_strided((1, 1, nn), rng) if rng.random() < 0.5 else None,
                           _strided((b, m, nn), rng) if rng.random() < 0.3 else None,
                           rng.choice([None, "relu", "leaky_relu"]), rng.choice([0.01, 0.2]), rng.random() < 0.3)
            out.append(MatmulSpec(_strided((b, m, k), rng), _strided((rng.choice([1, b]), k, nn), rng),
                                  _strided((b, m, nn), rng), epi))
        else:
            h, d, skv = 2, 16, rng.choice([m, 6])
            bias = _strided((rng.choice([1, b]), 1, m, skv), rng) if rng.random() < 0.3 else None
            out.append(SdpaSpec(_strided((b, h, m, d), rng), _strided((b, h, skv, d), rng), _strided((b, h, skv, d), rng),
                                _strided((b, h, m, d), rng), bias, rng.random() < 0.5, rng.choice([0.25, 1, 1.0])))
    return out


def test_the_family_keys_memo_gives_every_spec_the_key_its_json_gives():
    """Family keys are memoized by operand forms and attributes: two specs that share a memo entry must have
    one key computed from their JSON. Every spec's key, each computed alone, is the key the warm memo gives."""
    from cudnn_fuse.spec import MatmulSpec

    import random

    rng = random.Random(5)
    specs = _random_specs(rng, 400) + [_one(CASES[c](n, b)) for c in CASES for n, b in [(5, 2), (17, 1), (64, 3)]]
    for spec in specs[:60]:  # the same operands with other attributes: one form, other keys
        if type(spec) is MatmulSpec:
            e = spec.epilogue
            specs += [dataclasses.replace(spec, epilogue=dataclasses.replace(e, activation=a, negative_slope=0.3, amax=not e.amax))
                      for a in ("gelu", "leaky_relu")] + [dataclasses.replace(spec, allow_tf32=True)]
        else:
            specs += [dataclasses.replace(spec, is_causal=not spec.is_causal), dataclasses.replace(spec, scale=0.5)]
    alone = []
    for spec in specs:
        families._KEYS.clear()
        alone.append(families.family(spec))
    assert sum(k is None for k in alone) > 10 and len({k for k in alone if k}) > 50  # the fuzz reaches both
    for order in (list(range(len(specs))), rng.sample(range(len(specs)), len(specs))):
        families._KEYS.clear()
        assert [families.family(specs[i]) for i in order] == [alone[i] for i in order]
