"""Manifests, record mode, pre-warm (dry run, skipping cached entries, failures) and
its sharding over 2 processes with the gloo backend — all on the CPU."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

import cudnn_fuse as cf
from cudnn_fuse import cli, manifest, prewarm
from cudnn_fuse.errors import UnsupportedError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _specs_from_ops():
    """Three distinct specs (and one repeat) recorded from CPU calls."""
    with manifest.record() as rec:
        x, w = torch.randn(2, 8, 10, 10).half(), torch.randn(16, 8, 3, 3).half()
        cf.conv2d(x, w, padding=1, activation="relu")
        cf.conv2d(x, w, padding=1, activation="relu")
        cf.linear(torch.randn(4, 32).bfloat16(), torch.randn(64, 32).bfloat16(), activation="gelu")
        q = torch.randn(1, 4, 16, 64).half()
        cf.scaled_dot_product_attention(q, q, q, is_causal=True)
    return rec.entries


def test_record_dedupes_and_counts_specs_made_as_on_the_gpu():
    entries = _specs_from_ops()
    assert [(e.spec.op, e.count) for e in entries] == [("conv2d", 2), ("matmul", 1), ("sdpa", 1)]
    conv = entries[0].spec
    # recorded as the GPU path builds it: NCHW input converted to channels_last
    assert conv.x.stride[1] == 1 and conv.y.stride[1] == 1
    assert conv.epilogue.activation == "relu" and conv.dtype == "float16"


def test_record_on_meta_tensors_computes_nothing_and_returns_shapes():
    with manifest.record() as rec:
        x = torch.empty(4, 16, 32, 32, device="meta", dtype=torch.float16)
        w = torch.empty(32, 16, 3, 3, device="meta", dtype=torch.float16)
        y = cf.conv2d(x, w, stride=2, padding=1, activation="silu")
    assert y.device.type == "meta" and y.shape == (4, 32, 16, 16)
    assert len(rec.entries) == 1 and rec.entries[0].spec.stride == (2, 2)


def test_manifest_round_trip(tmp_path):
    entries = _specs_from_ops()
    entries[1].name, entries[1].weight = "mlp.fc", 2.5
    path = tmp_path / "m.json"
    manifest.dump(entries, path, name="t", description="d")
    back = manifest.load(path)
    assert [e.spec for e in back] == [e.spec for e in entries]
    assert (back[1].name, back[1].weight, back[0].count) == ("mlp.fc", 2.5, 2)
    data = json.loads(path.read_text())
    assert data["schema"] == "cudnn_fuse.manifest" and data["version"] == 1


def _valid(tmp_path):
    path = tmp_path / "m.json"
    manifest.dump(_specs_from_ops(), path)
    return json.loads(path.read_text())


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.update(schema="other"), "schema"),
    (lambda d: d.update(version=9), "version"),
    (lambda d: d.update(entries={}), "entries must be a list"),
    (lambda d: d["entries"][1].update(count=0), r"entries\[1\]\.count"),
    (lambda d: d["entries"][2].update(weight=-1), r"entries\[2\]\.weight"),
    (lambda d: d["entries"][0].update(extra=1), r"entries\[0\] has unknown field"),
    (lambda d: d["entries"][1].pop("spec"), r"entries\[1\]\.spec is missing"),
    (lambda d: d["entries"][2]["spec"].update(op="conv3d"), r"entries\[2\]\.spec .*op"),
    (lambda d: d["entries"][0]["spec"].pop("x"), r"entries\[0\]\.spec .*x"),
    (lambda d: d["entries"][0]["spec"]["epilogue"].update(activation="swish"), r"entries\[0\]\.spec .*activation"),
    (lambda d: d["entries"][1].update(name=3), r"entries\[1\]\.name"),
    # each of these was taken as valid: dropped, or kept as given until a build failed on it
    (lambda d: d["entries"][2]["spec"].update(is_casual=True), r"entries\[2\]\.spec has unknown field.*is_casual"),
    (lambda d: d["entries"][0]["spec"]["x"].update(strides=[1]), r"entries\[0\]\.spec\.x has unknown field"),
    (lambda d: d["entries"][0]["spec"].update(x=5), r"entries\[0\]\.spec\.x must be an object"),
    (lambda d: d["entries"][0]["spec"]["x"].update(shape="abcd"), r"entries\[0\]\.spec\.x\.shape must be a list"),
    (lambda d: d["entries"][0]["spec"]["w"]["shape"].__setitem__(0, -16), r"entries\[0\]\.spec\.w\.shape"),
    (lambda d: d["entries"][1]["spec"]["a"]["stride"].pop(), r"entries\[1\]\.spec\.a: shape .* differ in length"),
    (lambda d: d["entries"][1]["spec"]["b"].update(dtype="float99"), r"entries\[1\]\.spec\.b\.dtype must be one of"),
    (lambda d: d["entries"][0]["spec"].update(groups="two"), r"entries\[0\]\.spec\.groups must be a positive int"),
    (lambda d: d["entries"][0]["spec"].update(stride="ab"), r"entries\[0\]\.spec\.stride must be a list of 2"),
    (lambda d: d["entries"][2]["spec"].update(is_causal="yes"), r"entries\[2\]\.spec\.is_causal must be true or false"),
    (lambda d: d["entries"][0]["spec"]["epilogue"].update(negative_slope="x"),
     r"entries\[0\]\.spec\.epilogue\.negative_slope must be a finite number"),
    (lambda d: d["entries"][1].update(weight=float("inf")), r"entries\[1\]\.weight"),
    # each of these raised TypeError or OverflowError: `cudnn-fuse prewarm` printed a traceback
    (lambda d: d["entries"][2]["spec"].update(op=["sdpa"]), r"entries\[2\]\.spec .*op must be one of"),
    (lambda d: d["entries"][1]["spec"].update(op={}), r"entries\[1\]\.spec .*op must be one of"),
    (lambda d: d["entries"][2]["spec"].update(scale=10**400), r"entries\[2\]\.spec\.scale must be a finite number"),
    (lambda d: d["entries"][0]["spec"]["epilogue"].update(negative_slope=-10**400),
     r"entries\[0\]\.spec\.epilogue\.negative_slope must be a finite number"),
    (lambda d: d["entries"][1].update(weight=10**400), r"entries\[1\]\.weight must be a positive number"),
    # a stride or dilation of 0 (cf.conv2d refuses it) was a dry run's "would build"
    (lambda d: d["entries"][0]["spec"].update(stride=[1, 0]), r"entries\[0\]\.spec\.stride must be .* positive ints"),
    (lambda d: d["entries"][0]["spec"].update(dilation=[0, 1]), r"entries\[0\]\.spec\.dilation must be .* positive"),
])
def test_bad_manifests_name_the_entry_and_field(tmp_path, mutate, match):
    data = _valid(tmp_path)
    mutate(data)
    with pytest.raises(manifest.ManifestError, match=match):
        manifest.parse(data)


@pytest.mark.parametrize("content", [b"{nope", b'{"schema": "\xff"}', b"[" * 100_000 + b"]" * 100_000],
                         ids=["not-json", "not-utf8", "nested"])
def test_load_reports_non_json(tmp_path, content):
    """Bytes that are not UTF-8, or JSON nested past Python's recursion limit, raised
    UnicodeDecodeError / RecursionError: `cudnn-fuse prewarm` printed a traceback."""
    p = tmp_path / "bad.json"
    p.write_bytes(content)
    with pytest.raises(manifest.ManifestError, match="not JSON"):
        manifest.load(p)


def test_an_interrupted_dump_leaves_the_old_manifest(tmp_path, monkeypatch):
    path = tmp_path / "m.json"
    manifest.dump(_specs_from_ops(), path)
    before = path.read_text()

    def interrupted(data, f, **kw):
        f.write('{"schema": "cudnn_fuse.manifest", "entr')
        raise KeyboardInterrupt

    monkeypatch.setattr(manifest.json, "dump", interrupted)
    with pytest.raises(KeyboardInterrupt):
        manifest.dump([], path)
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_a_nested_record_leaves_the_outer_manifest_whole(tmp_path):
    """The specs made inside an inner cf.record went to the inner recorder only: a script recorded by
    `cudnn-fuse record` that itself records one part lost that part from the outer manifest."""
    x, w = torch.randn(2, 8, 6, 6).half(), torch.randn(8, 8, 1, 1).half()
    with manifest.record(tmp_path / "outer.json") as outer:
        cf.conv2d(x, w, activation="relu")
        with manifest.record(tmp_path / "inner.json") as inner:
            cf.conv2d(x, w, activation="tanh")
            cf.conv2d(x, w, activation="relu")
        cf.conv2d(x, w, activation="silu")
    acts = [(e.spec.epilogue.activation, e.count) for e in manifest.load(tmp_path / "outer.json")]
    assert acts == [("relu", 2), ("tanh", 1), ("silu", 1)]
    assert [(e.spec.epilogue.activation, e.count) for e in manifest.load(tmp_path / "inner.json")] == \
        [("tanh", 1), ("relu", 1)]
    assert outer.entries[0].count == 2 and len(inner.entries) == 2
    cf.conv2d(x, w, activation="sigmoid")  # outside both blocks: recorded by neither
    assert len(outer.entries) == 3 and len(inner.entries) == 2


def test_an_inner_recorder_of_an_ended_block_passes_nothing_to_it():
    """Blocks in two threads need not end in order: one that ended takes no more specs."""
    a = manifest.Recorder()
    b = manifest.Recorder(outer=a)  # opened while a's block was active
    manifest._active.append(b)  # a's block has ended, b's is on
    try:
        b.add("spec")
    finally:
        manifest._active.remove(b)
    assert [e.count for e in b.entries] == [1] and a.entries == []


def test_active_reads_the_list_once(monkeypatch):
    """active() checked the list, then indexed it: a block ending in another thread between the two
    raised IndexError out of the op that asked."""

    class EndedBetween(list):
        def __bool__(self):  # non-empty when checked, empty when read
            return True

    monkeypatch.setattr(manifest, "_active", EndedBetween())
    assert manifest.active() is None


def test_record_refuses_a_destination_it_cannot_write_before_the_block_runs(tmp_path):
    """A path in a missing directory, or a directory, raised only when the manifest was written at
    the block's end: the whole run's recording was lost."""
    ran = []
    with pytest.raises(FileNotFoundError, match="no directory"):
        with manifest.record(tmp_path / "nope" / "m.json"):
            ran.append(1)
    with pytest.raises(IsADirectoryError, match="directory"):
        with manifest.record(tmp_path):
            ran.append(1)
    assert ran == [] and manifest.active() is None
    with manifest.record(str(tmp_path / "m.json")):  # a str path and a fresh file in a directory that is there
        ran.append(1)
    assert ran == [1] and manifest.load(tmp_path / "m.json") == []


@pytest.mark.parametrize("kw,match", [(dict(path=5), "path must be a file path"), (dict(name=5), "name must be a str"),
                                      (dict(path=None, description=["d"]), "description must be a str")])
def test_record_names_an_argument_of_the_wrong_type_before_the_block_runs(tmp_path, kw, match):
    ran = []
    kw = {"path": tmp_path / "m.json", **kw}
    with pytest.raises(TypeError, match=f"record: {match}"):
        with manifest.record(**kw):
            ran.append(1)
    assert ran == [] and manifest.active() is None and not (tmp_path / "m.json").exists()


class FakeCache:
    def __init__(self, tuned=()):
        self.meta = {d: {"tuned": t} for d, t in tuned}

    def get(self, digest, count=True):
        m = self.meta.get(digest)
        return None if m is None else type("E", (), {"meta": m})()


def test_prewarm_builds_skips_cached_and_reports_failures():
    entries = _specs_from_ops()
    built = []

    def builder(spec):
        if spec.op == "sdpa":
            raise UnsupportedError("cuDNN declined sdpa: no engine")
        built.append(spec.op)

    cache = FakeCache([(entries[0].spec.digest(), False)])
    rows = prewarm.prewarm(entries, builder=builder, cache=cache)
    assert [r.status for r in rows] == ["cached", "built", "failed"]
    assert built == ["matmul"] and "no engine" in rows[2].reason
    s = prewarm.summarize(rows, 1.0)
    assert (s["entries"], s["built"], s["already cached"], s["failed"]) == (3, 1, 1, 1)
    report = prewarm.format_report(rows, 1.0)
    assert "already cached" in report and "no engine" in report


def test_prewarm_autotune_rebuilds_heuristic_entries_only():
    entries = _specs_from_ops()
    cache = FakeCache([(entries[0].spec.digest(), False), (entries[1].spec.digest(), True)])
    built = []
    rows = prewarm.prewarm(entries, autotune=True, builder=lambda s: built.append(s.op), cache=cache)
    assert [r.status for r in rows] == ["built", "cached", "built"]


def test_dry_run_builds_nothing():
    entries = _specs_from_ops()
    rows = prewarm.prewarm(entries, dry_run=True, builder=lambda s: pytest.fail("built in a dry run"),
                           cache=FakeCache([(entries[2].spec.digest(), True)]))
    assert [r.status for r in rows] == ["would build", "would build", "cached"]


def test_cli_prewarm_dry_run_and_bad_manifest(tmp_path, capsys, cache_dir):
    path = tmp_path / "m.json"
    manifest.dump(_specs_from_ops(), path)
    assert cli.main(["prewarm", str(path), "--dry-run"]) == 0
    out = capsys.readouterr()
    assert "would build" in out.out and "3/3" in out.err  # table, and the progress bar on stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "cudnn_fuse.manifest", "version": 1, "entries": [{"count": 1}]}))
    assert cli.main(["prewarm", str(bad)]) == 2
    assert "entries[0].spec is missing" in capsys.readouterr().err


def test_cli_prewarm_takes_several_manifests_and_builds_shared_specs_once(tmp_path, capsys, cache_dir):
    entries = _specs_from_ops()
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    manifest.dump(entries[:2], a)
    manifest.dump(entries[1:], b)  # entries[1] is in both
    assert cli.main(["prewarm", str(a), str(b), "--dry-run"]) == 0
    out = capsys.readouterr()
    lines = out.out.splitlines()
    header = lines[0].split("  ")
    values = [v for v in lines[2].split(" ") if v]
    assert values[0] == "3" and values[3] == "3", (header, values)  # 3 entries, 3 would build
    assert "a.json, b.json" in out.err
    missing = tmp_path / "missing.json"
    assert cli.main(["prewarm", str(a), str(missing), "--dry-run"]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_cli_prewarm_takes_a_positive_number_of_gpus(tmp_path, capsys, cache_dir):
    path = tmp_path / "m.json"
    manifest.dump(_specs_from_ops(), path)
    for n in ("0", "-1", "two"):
        assert cli.main(["prewarm", str(path), "--dry-run", "--gpus", n]) == 2  # taken as 1 GPU
        assert f"argument --gpus: must be a positive int, got '{n}'" in capsys.readouterr().err


def test_an_empty_manifest_ends_its_bar(tmp_path, capsys, cache_dir):
    path = tmp_path / "m.json"
    manifest.dump([], path)
    assert cli.main(["prewarm", str(path), "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "0/0 100%" in err and err.endswith("\n")  # "0/1   0%", and the line left open


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="checks a CPU build of torch")
def test_cli_prewarm_on_gpus_without_cuda_says_so(tmp_path, capfd, cache_dir):
    """--gpus N forked N workers, each of which printed a traceback, and every entry failed."""
    path = tmp_path / "m.json"
    manifest.dump(_specs_from_ops(), path)
    assert cli.main(["prewarm", str(path), "--gpus", "2"]) == 2
    err = capfd.readouterr().err
    assert "needs a CUDA GPU" in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_cli_prewarm_without_gpu_says_so(tmp_path, capsys, cache_dir):
    path = tmp_path / "m.json"
    manifest.dump(_specs_from_ops(), path)
    assert cli.main(["prewarm", str(path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_cli_record_runs_a_script(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import sys, torch, cudnn_fuse as cf
        x, w = torch.randn(2, 8, 6, 6).half(), torch.randn(8, 8, 1, 1).half()
        for _ in range(int(sys.argv[1])):
            cf.conv2d(x, w, activation="tanh")
    """))
    out = tmp_path / "rec.json"
    assert cli.main(["record", "-o", str(out), "--", "python", str(script), "4"]) == 0
    entries = manifest.load(out)
    assert len(entries) == 1 and entries[0].count == 4 and entries[0].spec.epilogue.activation == "tanh"
    assert "1 distinct" in capsys.readouterr().out


def test_cli_record_checks_its_script_and_output_before_running(tmp_path, capsys):
    """A missing script raised FileNotFoundError after an empty manifest had been written; an
    output that could not be written raised after the whole script had run, its recording lost."""
    ran = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(ran)!r}, 'w').close()\n")
    out = tmp_path / "rec.json"
    assert cli.main(["record", "-o", str(out), "--", "python", str(tmp_path / "absent.py")]) == 2
    assert "no such script" in capsys.readouterr().err and not out.exists()
    assert cli.main(["record", "-o", str(tmp_path), "--", "python", str(script)]) == 2
    assert "it is a directory" in capsys.readouterr().err
    assert cli.main(["record", "-o", str(tmp_path / "nope" / "rec.json"), "--", str(script)]) == 2
    assert "no directory" in capsys.readouterr().err and not ran.exists()


def test_cli_record_reports_a_manifest_it_cannot_write(tmp_path, capsys, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("pass\n")

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(manifest, "dump", full)
    assert cli.main(["record", "-o", str(tmp_path / "rec.json"), "--", str(script)]) == 1
    assert "cannot write the manifest" in capsys.readouterr().err


SHARD_CHILD = textwrap.dedent("""
    import json, os, sys
    from cudnn_fuse import manifest, prewarm
    entries = manifest.load(sys.argv[1])
    built = []
    rows = prewarm.run_distributed(entries, builder=lambda spec: built.append(spec.digest()))
    print(json.dumps({"rank": int(os.environ["RANK"]), "built": built,
                      "rows": [r.__dict__ for r in rows]}))
""")


def test_sharding_over_two_processes_with_gloo(tmp_path):
    path = tmp_path / "m.json"
    entries = _specs_from_ops()
    manifest.dump(entries, path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   CUDA_VISIBLE_DEVICES="")
        procs.append(subprocess.Popen([sys.executable, "-c", SHARD_CHILD, str(path)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    results.sort(key=lambda r: r["rank"])
    built = results[0]["built"] + results[1]["built"]
    assert sorted(built) == sorted(e.spec.digest() for e in entries)  # each entry built once, by one rank
    assert results[0]["built"] and results[1]["built"]  # both ranks worked
    rank0_rows = results[0]["rows"]
    assert [r["index"] for r in rank0_rows] == [0, 1, 2]  # rank 0 gathered every rank's rows
    assert {r["rank"] for r in rank0_rows} == {0, 1}


def _slow_builder(rank):
    import time as _time

    def build(spec):
        _time.sleep(0.05)  # long enough that both workers take entries
    return build


def _failing_builder(rank):
    import time as _time

    def build(spec):
        _time.sleep(0.05)
        if rank == 1:
            raise RuntimeError("engine exploded")
    return build


def test_run_local_shares_one_queue_over_gpus(cache_dir):
    entries = _specs_from_ops() * 1
    many = [manifest.Entry(e.spec, name=f"e{i}") for i, e in enumerate(entries * 4)]
    ticks = []
    rows = prewarm.run_local(many, 2, builder_factory=_slow_builder, progress=lambda n, t: ticks.append((n, t)))
    assert [r.index for r in rows] == list(range(len(many)))
    assert all(r.status == "built" for r in rows)
    assert {r.rank for r in rows} == {0, 1}  # both workers took work
    assert ticks[0] == (0, len(many)) and ticks[-1] == (len(many), len(many))


def test_run_local_reports_a_failing_worker_per_entry(cache_dir):
    many = [manifest.Entry(e.spec, name=f"e{i}") for i, e in enumerate(_specs_from_ops() * 3)]
    rows = prewarm.run_local(many, 2, builder_factory=_failing_builder)
    assert len(rows) == len(many)
    failed = [r for r in rows if r.status == "failed"]
    assert failed and all(r.rank == 1 and "engine exploded" in r.reason for r in failed)


def _broken_worker(rank):
    raise RuntimeError(f"no GPU {rank}")


def test_run_local_workers_that_cannot_start_print_no_traceback(cache_dir, capfd):
    """A worker re-raised its start error: multiprocessing printed a traceback per worker, and the
    bar stayed at 0/N with its line open."""
    many = [manifest.Entry(e.spec, name=f"e{i}") for i, e in enumerate(_specs_from_ops())]
    ticks = []
    rows = prewarm.run_local(many, 2, builder_factory=_broken_worker, progress=lambda n, t: ticks.append((n, t)))
    assert [r.status for r in rows] == ["failed"] * 3 and "no GPU" in rows[0].reason
    assert ticks[-1] == (3, 3)
    assert "Traceback" not in capfd.readouterr().err


def _one_missing_gpu(rank):
    if rank == 1:
        raise RuntimeError("invalid device ordinal")
    return _slow_builder(rank)


def test_run_local_logs_a_worker_that_could_not_start(cache_dir, caplog):
    """--gpus above the GPUs there: the others took every entry, so no row failed, and nothing said
    that one worker never started."""
    many = [manifest.Entry(e.spec, name=f"e{i}") for i, e in enumerate(_specs_from_ops() * 2)]
    with caplog.at_level(logging.WARNING, logger="cudnn_fuse.prewarm"):
        rows = prewarm.run_local(many, 2, builder_factory=_one_missing_gpu)
    assert all(r.status == "built" and r.rank == 0 for r in rows)
    assert "rank 1" in caplog.text and "invalid device ordinal" in caplog.text


def test_a_worker_beyond_the_visible_gpus_says_so_in_one_line(monkeypatch):
    """--gpus 2 on a one-GPU H200 reported torch's five-line 'invalid device ordinal' text."""
    import queue

    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda r: pytest.fail("set_device reached"))
    work, results = queue.Queue(), queue.Queue()
    work.put(None)
    prewarm._local_worker(1, [], False, work, results)
    msgs = [results.get_nowait() for _ in range(results.qsize())]
    assert msgs == [{"worker_error": "rank 1: RuntimeError: there is no GPU 1 (1 visible); lower --gpus"},
                    {"worker_done": 1}]


def test_work_order_puts_expensive_entries_first():
    entries = _specs_from_ops()
    from cudnn_fuse.spec import flops

    order = prewarm.work_order(entries)
    costs = [flops(entries[i].spec) for i in order]
    assert sorted(order) == list(range(len(entries))) and costs == sorted(costs, reverse=True)


def test_the_default_builder_tunes_its_own_builds_and_restores_the_process_setting(monkeypatch):
    from cudnn_fuse import autotune as at
    from cudnn_fuse import loader, prewarm

    seen = []
    monkeypatch.setattr(loader, "load_or_build", lambda spec, device: seen.append((spec, device,
                                                                                   at.autotune_enabled())))
    monkeypatch.setattr(at, "_enabled", None)
    monkeypatch.delenv("CUDNN_FUSE_AUTOTUNE", raising=False)
    prewarm.default_builder(True, 1)("spec")
    assert seen == [("spec", 1, True)]
    assert at._enabled is None and at.autotune_enabled() is False  # the process's setting, untouched
    at.set_autotune(True)
    prewarm.default_builder(False, 0)("other")
    assert seen[-1] == ("other", 0, False) and at.autotune_enabled() is True

    def boom(spec, device):
        raise RuntimeError("cuDNN declined")
    monkeypatch.setattr(loader, "load_or_build", boom)
    with pytest.raises(RuntimeError):
        prewarm.default_builder(False, 0)("bad")
    assert at.autotune_enabled() is True  # restored on failure too
