"""The manifests in plans/ are valid and match what plans/make_manifests.py makes now."""

from __future__ import annotations

import importlib.util
import os

import pytest

from cudnn_fuse import manifest

PLANS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "plans")
FILES = ["resnet50_fp16_bs32.json", "resnet50_fp16_bs1.json", "gpt2_block_bf16.json", "llama_block_bf16.json"]


@pytest.mark.parametrize("name", FILES)
def test_shipped_manifest_is_valid(name):
    entries = manifest.load(os.path.join(PLANS, name))
    assert entries and all(e.count >= 1 for e in entries)


def test_resnet50_manifest_covers_every_conv():
    entries = manifest.load(os.path.join(PLANS, "resnet50_fp16_bs32.json"))
    assert {e.spec.op for e in entries} == {"conv2d"}
    assert sum(e.count for e in entries) == 53  # 1 stem + 16 x 3 bottleneck convs + 4 downsamples
    assert sum(e.count for e in entries if e.spec.epilogue.residual is not None) == 16
    assert all(e.spec.dtype == "float16" and e.spec.x.shape[0] == 32 for e in entries)


def test_shipped_manifests_are_up_to_date(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("make_manifests", os.path.join(PLANS, "make_manifests.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "HERE", str(tmp_path))
    mod.main()
    for name in FILES:
        fresh = manifest.load(tmp_path / name)
        shipped = manifest.load(os.path.join(PLANS, name))
        assert [(e.spec, e.count) for e in fresh] == [(e.spec, e.count) for e in shipped], name


def test_resnet50_manifest_matches_torchvision():
    """The hand-written ResNet-50 of make_manifests.py records torchvision's exact specs
    (torchvision is not importable beside CI's CPU torch: this runs where it is)."""
    import torch

    torchvision = pytest.importorskip("torchvision")
    import cudnn_fuse as cf

    m = torchvision.models.resnet50().to("meta", torch.float16).eval().to(memory_format=torch.channels_last)
    x = torch.empty(32, 3, 224, 224, device="meta", dtype=torch.float16).to(memory_format=torch.channels_last)
    opt = cf.optimize(m)
    with cf.record() as rec, torch.no_grad():
        opt(x)
    shipped = manifest.load(os.path.join(PLANS, "resnet50_fp16_bs32.json"))
    assert {e.spec: e.count for e in rec.entries} == {e.spec: e.count for e in shipped}
