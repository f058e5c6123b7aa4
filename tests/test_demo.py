"""`cudnn-fuse demo` on the CPU: both models run through optimize() and match eager, record every
op spec a GPU would build, and time no import as their cold start."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import torch

from cudnn_fuse import cli, demo


def test_demo_models_match_eager_and_restore_the_cache_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDNN_FUSE_CACHE_DIR", str(tmp_path))
    rows, notes = demo.run(torch.cuda.is_available())
    assert [r[0] for r in rows] == ["resnet-style CNN", "transformer block"]
    for r in rows:
        assert float(r[-1]) < 1e-3  # rel err against eager
        assert float(r[2]) > 0 and float(r[3]) > 0
    assert int(rows[0][5]) == 4  # the CNN's fused convs were recorded (stem + 3 distinct bottleneck convs)
    assert int(rows[1][5]) >= 2  # the transformer's attention and GEMMs: "specs 0" before on the CPU
    assert str(tmp_path) == os.environ["CUDNN_FUSE_CACHE_DIR"]
    if not torch.cuda.is_available():
        assert any("no GPU" in n and "PyTorch reference" in n for n in notes)


def test_demo_records_in_the_dtype_and_layout_a_gpu_runs():
    """On the CPU the models run fp32, for which cf records only convs (fp32 linear, matmul and
    attention build no cuDNN graph on a GPU either): the transformer recorded nothing."""
    models = {name: (model, x) for name, model, x in demo._models(torch.device("cpu"), False)}
    cnn = demo.record_specs("resnet-style CNN", *models["resnet-style CNN"])
    assert [e.spec.op for e in cnn] == ["conv2d"] * 4
    block = demo.record_specs("transformer block", *models["transformer block"])
    assert "sdpa" in {e.spec.op for e in block} and "matmul" in {e.spec.op for e in block}
    dtypes = {name: {t["dtype"] for e in entries for t in _tensors(e.spec.to_dict())}
              for name, entries in (("cnn", cnn), ("block", block))}
    assert dtypes == {"cnn": {"float16"}, "block": {"bfloat16"}}
    x_stride = cnn[0].spec.to_dict()["x"]["stride"]
    assert x_stride[1] == 1  # channels_last, as the GPU demo runs it
    assert next(models["resnet-style CNN"][0].parameters()).device.type == "cpu"  # the model itself untouched


def _tensors(d):
    """The tensor specs ({shape, stride, dtype}) in a spec's dict, at any depth."""
    if isinstance(d, dict):
        if {"shape", "stride", "dtype"} <= set(d):
            yield d
        else:
            for v in d.values():
                yield from _tensors(v)


def test_the_cold_start_times_no_import_of_torch_dynamo(tmp_path):
    """The transformer's "cold start" was ~1.3 s of torch._dynamo's first import (its SDPA
    reference, run on meta tensors under cf.record), not plan work. In a fresh process (where
    torch._dynamo is not imported yet) every timed first call must find it imported."""
    script = textwrap.dedent("""
        import json, sys
        import torch
        from cudnn_fuse import demo
        seen = []
        timed = demo._first_call_ms
        def first_call_ms(fn, on_gpu):
            seen.append("torch._dynamo" in sys.modules)
            return timed(fn, on_gpu)
        demo._first_call_ms = first_call_ms
        assert "torch._dynamo" not in sys.modules
        rows, notes = demo.run(torch.cuda.is_available())
        print(json.dumps(seen))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert len(seen) >= 4 and all(seen), seen  # every timed call: the cold and warm starts, the medians


def test_demo_command_prints_both_tables_and_says_what_ran(capsys):
    assert cli.main(["demo"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "models through cf.optimize()" in out
    assert re.search(r"resnet-style CNN\s+\S+ \S+\s+[\d.]+\s+[\d.]+", out)
    block = next(line for line in out.splitlines() if line.startswith("transformer block"))
    assert int(block.split()[7]) >= 2  # specs
    assert "demo" in captured.err and "6/6" in captured.err  # the bar: 4 ops, 2 models
    if not torch.cuda.is_available():
        assert "no CUDA GPU: the ops ran their PyTorch reference" in out
