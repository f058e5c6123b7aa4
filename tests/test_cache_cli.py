"""`cudnn-fuse cache ...` through argparse and run_cache_command, on a temporary cache."""

import argparse
import datetime
import hashlib
import json
import os
import re
import stat
import subprocess
import sys

import pytest

from cudnn_fuse import env
from cudnn_fuse.cache import PlanCache
from cudnn_fuse.cache_cli import (
    add_cache_commands, parse_duration, parse_size, run_cache_command,
)

NS = "clins"
META = {"spec": {"op": "conv2d"}, "engine": {"id": 7, "knobs": {}}, "workspace_bytes": 1 << 20,
        "tuned_at": "2026-05-09T07:35:25"}


def key(name) -> str:
    return hashlib.sha256(str(name).encode()).hexdigest()


def import_counts(out: str) -> dict:
    """import's table: {"imported": n, "skipped": n, "rejected": n, "failed": n}."""
    *_, header, rule, row = out.strip().splitlines()
    return dict(zip(("imported", "skipped", "rejected", "failed"), map(int, row.split())))


def cli(*argv) -> int:
    parser = argparse.ArgumentParser(prog="cudnn-fuse")
    add_cache_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["cache", *argv])
    assert args.run is run_cache_command
    return args.run(args)


@pytest.fixture
def warm(cache_dir):
    cache = PlanCache(cache_dir, namespace=NS)
    assert cache.put(key("conv"), META, b"c" * 100, pinned=True)
    assert cache.put(key("mm"), {"op": "matmul", "engine": "eng12", "workspace_bytes": 0,
                                 "tuned_at": 1.7e9}, b"m" * 50_000)
    assert cache.get(key("conv")) is not None and cache.get(key("absent")) is None
    cache.close()
    return cache_dir


def test_ls_prints_a_table_of_the_plans(warm, capsys):
    assert cli("ls", "--namespace", NS) == 0
    out = capsys.readouterr().out
    header, rule, *rows = out.splitlines()
    assert header.split() == ["key", "op", "engine", "workspace", "size", "pinned", "tuned_at"]
    conv = next(r for r in rows if r.startswith(key("conv")[:12]))
    assert conv.split()[1:5] == ["conv2d", "7", "1.0", "MiB"] and "yes" in conv
    assert "2026-05-09T07:35:25" in conv
    mm = next(r for r in rows if r.startswith(key("mm")[:12]))
    assert mm.split()[1:3] == ["matmul", "eng12"] and "49.0 KiB" in mm
    assert datetime.datetime.fromtimestamp(1.7e9).strftime("%Y-%m-%d %H:%M") in mm
    assert "2 plans" in out


def test_ls_names_what_a_tuned_entry_runs_instead_of_its_cudnn_plan(cache_dir, capsys):
    cache = PlanCache(cache_dir, namespace=NS)
    assert cache.put(key("gemm"), {"op": "conv2d", "engine_id": 39, "use_gemm": True, "tuned": True}, b"g" * 10)
    assert cache.put(key("torch"), {"op": "matmul", "engine_id": 4, "use_torch": True, "tuned": True}, b"t" * 10)
    assert cache.put(key("plain"), {"op": "conv2d", "engine_id": 41, "use_gemm": False}, b"p" * 10)
    assert cache.put(key("family"), {"kind": "family-record", "op": "matmul", "anchors": [{}, {}]}, b"")
    cache.close()
    assert cli("ls", "--namespace", NS) == 0
    rows = {r[:12]: r for r in capsys.readouterr().out.splitlines()}
    assert "family (2 tuned sizes)" in rows[key("family")[:12]]
    assert "gemm (conv 39)" in rows[key("gemm")[:12]]
    assert "torch (cuDNN 4)" in rows[key("torch")[:12]]
    assert rows[key("plain")[:12]].split()[1:3] == ["conv2d", "41"]


def test_ls_of_an_empty_cache_creates_nothing(tmp_path, capsys):
    assert cli("ls", "--dir", str(tmp_path / "none")) == 0  # this machine's namespace, not made yet
    assert "no plans cached" in capsys.readouterr().out
    assert cli("ls", "--dir", str(tmp_path / "none"), "--namespace", NS) == 1  # one asked for by name
    assert "the directory does not exist" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()


ACTIONS_ON_A_NAMESPACE = [["ls"], ["stats"], ["verify"], ["prune"], ["clear"], ["export", "out.jsonl"]]


@pytest.mark.parametrize("argv", ACTIONS_ON_A_NAMESPACE, ids=lambda a: a[0])
def test_a_namespace_that_is_not_there_is_named_and_nothing_is_made(warm, argv, capsys, monkeypatch, tmp_path):
    """`cache ls --namespace <typo>` said "no plans cached" and exited 0; `cache clear --namespace
    <typo>` made that namespace's directory and database."""
    monkeypatch.chdir(tmp_path)
    PlanCache(warm, namespace="otherns").close()
    assert cli(*argv, "--namespace", "no_such_ns") == 1
    captured = capsys.readouterr()
    assert "no plans cached" not in captured.out and "exported" not in captured.out + captured.err
    assert f"error: no namespace 'no_such_ns' under {warm} (namespaces there: clins, otherns)" in captured.err
    assert sorted(p.name for p in warm.iterdir()) == [NS, "otherns"]
    assert not (tmp_path / "out.jsonl").exists()
    assert cli(*argv, "--namespace", NS) == 0


def test_an_empty_dir_is_refused(warm, capsys):
    assert cli("ls", "--dir", "") == 2
    assert "--dir is empty" in capsys.readouterr().err


def test_stats_show_entries_and_hit_rate(warm, capsys):
    PlanCache(warm, namespace="otherns").close()
    assert cli("stats", "--namespace", NS) == 0
    out = capsys.readouterr().out
    assert re.search(r"^entries +2 \(1 pinned\)$", out, re.M)
    assert re.search(r"^hit rate +50\.0%$", out, re.M)  # one hit, one miss in `warm`
    assert re.search(r"^other namespaces +otherns$", out, re.M)


def test_stats_default_to_this_machines_namespace(cache_dir, capsys):
    assert cli("stats") == 0
    assert env.namespace() in capsys.readouterr().out


def fault_rows(out: str) -> dict:
    """verify's fault table: {key prefix or file: [op, fault, pinned, action...]}."""
    lines = out.split("found in")[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:3] == ["key", "op", "fault"])
    rows = {}
    for line in lines[start + 2:]:
        key_, op, kind, pinned, rest = line.split(maxsplit=4)
        rows[key_ if key_ != "-" else kind] = [op, kind, pinned, rest]
    return rows


def test_verify_names_the_corrupt_entry_it_removes_and_fails(warm, capsys):
    """verify said only "1 bad, 1 removed" (no key, no fault) and exited 0."""
    value = next(warm.rglob("*.val"))
    data = bytearray(value.read_bytes())
    data[-1] ^= 1
    value.write_bytes(bytes(data))
    assert cli("verify", "--namespace", NS) == 1
    out = capsys.readouterr().out
    assert "checked 2 entries: 1 ok, 1 bad, 1 removed" in out
    op, kind, pinned, action = fault_rows(out)[key("mm")[:12]]
    assert (op, kind, pinned) == ("matmul", "checksum", "no") and action.startswith("removed")
    assert [k for k, _, _ in PlanCache(warm, namespace=NS).entries()] == [key("conv")]
    assert cli("verify", "--namespace", NS) == 0  # sound now
    assert "no faults" in capsys.readouterr().out


def test_verify_says_it_removed_a_pinned_entry(cache_dir, capsys):
    """A corrupt pre-warmed (pinned) entry went with exit 0 and not a word."""
    cache = PlanCache(cache_dir, namespace=NS)
    assert cache.put(key("pinned"), META, b"p" * 40_000, pinned=True)
    assert cache.put(key("fine"), META, b"f" * 100)
    cache.close()
    value = next(cache_dir.rglob("*.val"))
    value.write_bytes(value.read_bytes()[:-10])  # truncated
    assert cli("verify", "--namespace", NS) == 1
    captured = capsys.readouterr()
    op, kind, pinned, action = fault_rows(captured.out)[key("pinned")[:12]]
    assert (op, kind, pinned) == ("conv2d", "truncated", "yes") and action.startswith("removed")
    assert "warning: removed 1 pinned entry (pre-warmed)" in captured.err
    assert [k for k, _, _ in PlanCache(cache_dir, namespace=NS).entries()] == [key("fine")]


def test_prune_and_clear(warm, capsys):
    assert cli("prune", "--namespace", NS, "--max-bytes", "0") == 0
    assert "removed 1 entry" in capsys.readouterr().out  # the pinned one stays
    assert cli("prune", "--namespace", NS, "--older-than", "0s", "--include-pinned") == 0
    assert "removed 1 entry" in capsys.readouterr().out
    assert cli("clear", "--namespace", NS) == 0
    assert "removed 0 entries" in capsys.readouterr().out


def test_export_then_import_elsewhere(warm, tmp_path, capsys):
    out_file = tmp_path / "plans.jsonl"
    assert cli("export", str(out_file), "--namespace", NS) == 0
    assert "exported 2 entries" in capsys.readouterr().out
    target = tmp_path / "target"
    assert cli("import", str(out_file), "--dir", str(target), "--namespace", NS) == 0
    assert import_counts(capsys.readouterr().out) == dict(imported=2, skipped=0, rejected=0, failed=0)
    assert PlanCache(target, namespace=NS).stats()["pinned"] == 1


def test_import_from_another_namespace_needs_force(warm, tmp_path, capsys):
    out_file = tmp_path / "plans.jsonl"
    assert cli("export", str(out_file), "--namespace", NS) == 0
    assert cli("import", str(out_file), "--namespace", "elsewhere") == 1
    err = capsys.readouterr().err
    assert f"'{NS}'" in err and "'elsewhere'" in err and "--force" in err
    assert cli("import", str(out_file), "--namespace", "elsewhere", "--force") == 0
    assert import_counts(capsys.readouterr().out)["imported"] == 2


def test_import_reports_rejected_entries(warm, tmp_path, capsys):
    out_file = tmp_path / "plans.jsonl"
    assert cli("export", str(out_file), "--namespace", NS) == 0
    header, first, second = out_file.read_text().splitlines()
    record = json.loads(first)
    record["entry"] = record["entry"][:-6] + "AAAA=="
    out_file.write_text("\n".join([header, json.dumps(record), second]) + "\n")
    assert cli("import", str(out_file), "--dir", str(tmp_path / "t"), "--namespace", NS) == 1
    assert import_counts(capsys.readouterr().out) == dict(imported=1, skipped=0, rejected=1, failed=0)


def test_a_refused_directory_is_an_error(tmp_path, capsys):
    os.chmod(tmp_path, 0o777)
    assert cli("ls", "--dir", str(tmp_path), "--namespace", NS) == 1
    err = capsys.readouterr().err
    assert "disabled" in err and "world-writable" in err


def test_a_refused_directory_is_said_once_from_the_command_line(tmp_path):
    """The warning and the error both gave the whole reason, one above the other."""
    os.chmod(tmp_path, 0o777)
    out = subprocess.run([sys.executable, "-m", "cudnn_fuse", "cache", "ls", "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.count("world-writable") == 1, out.stderr
    assert out.stderr.rstrip().endswith("error: the plan cache is disabled (the warning above says why)")


def test_cache_needs_an_action():
    with pytest.raises(SystemExit):
        cli()


@pytest.mark.parametrize("text, value", [("1048576", 2**20), ("512M", 512 * 2**20),
                                         ("2g", 2 * 2**30), ("1.5KiB", 1536), ("0", 0)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text, value", [("3600", 3600), ("12h", 43200), ("30d", 2592000),
                                         ("1.5m", 90)])
def test_parse_duration(text, value):
    assert parse_duration(text) == value


@pytest.mark.parametrize("parse, text", [(parse_size, "lots"), (parse_duration, "1y")])
def test_bad_sizes_and_durations_are_usage_errors(parse, text):
    with pytest.raises(argparse.ArgumentTypeError, match=repr(text)):
        parse(text)


def test_verify_removes_entries_that_name_a_barred_engine(cache_dir, capsys):
    """An entry written before its engine was barred (engines.barred_engines) and its engine
    record go; an entry of another engine, or of eng0 for a graph it computes right, stays."""
    from cudnn_fuse import loader
    from cudnn_fuse.spec import Epilogue, MatmulSpec, TensorSpec

    def mm(act):
        a = TensorSpec.contiguous((1, 64, 32), "float16")
        b = TensorSpec((1, 32, 48), (1536, 1, 32), "float16")
        return MatmulSpec(a, b, TensorSpec.contiguous((1, 64, 48), "float16"),
                          Epilogue(activation=act, negative_slope=0.2))

    leaky, relu = mm("leaky_relu"), mm("relu")
    cache = PlanCache(cache_dir, namespace=NS)
    bad, other, fine = leaky.digest(), key("other"), relu.digest()
    assert cache.put(bad, {"op": "matmul", "spec": leaky.to_dict(), "engine_id": 0}, b"x" * 10)
    assert cache.put(loader.engine_record_key(bad), {"op": "matmul", "engine_id": 0, "kind": "engine-record"}, b"")
    assert cache.put(other, {"op": "matmul", "spec": leaky.to_dict(), "engine_id": 4}, b"y" * 10)
    assert cache.put(fine, {"op": "matmul", "spec": relu.to_dict(), "engine_id": 0}, b"z" * 10)
    leaky2 = MatmulSpec(leaky.a, leaky.b, leaky.y, Epilogue(activation="leaky_relu", negative_slope=0.3))
    assert cache.put(leaky2.digest(), {"op": "matmul", "spec": leaky2.to_dict(), "engine_id": 0}, b"p" * 10,
                     pinned=True)  # pre-warmed: rebuilt in place by the loader, never removed here
    cache.close()
    assert cli("verify", "--namespace", NS) == 1
    out = capsys.readouterr().out
    assert "3 entries name an engine that computes their graph wrongly" in out
    assert ": 2 removed, 1 pinned left" in out
    rows = fault_rows(out)
    assert rows[bad[:12]][:3] == ["matmul", "barred-engine", "no"] and rows[bad[:12]][3].startswith("removed")
    assert rows[loader.engine_record_key(bad)[:12]][1:3] == ["barred-engine", "no"]
    assert rows[leaky2.digest()[:12]][2] == "yes"
    assert rows[leaky2.digest()[:12]][3].startswith("left: pinned, a process rebuilds it in place")
    cache = PlanCache(cache_dir, namespace=NS)
    assert cache.get(bad) is None and cache.get(loader.engine_record_key(bad)) is None
    assert cache.get(other) is not None and cache.get(fine) is not None and cache.get(leaky2.digest()) is not None
    cache.close()
    assert cli("verify", "--namespace", NS) == 1  # the pinned one alone is left: one entry, in the singular
    assert "1 entry names an engine that computes its graph wrongly" in capsys.readouterr().out


@pytest.fixture
def small(cache_dir):
    """Two entries whose export (under 2 KiB) fits in a pipe's buffer."""
    cache = PlanCache(cache_dir, namespace=NS)
    assert cache.put(key("a"), META, b"a" * 100) and cache.put(key("b"), META, b"b" * 100, pinned=True)
    cache.close()
    return cache_dir


def test_export_into_a_pipe_writes_it_and_leaves_the_pipe(small, tmp_path, capsys):
    """A pipe or device is written in place: it was replaced by a regular file (as root, an export to
    /dev/null put a 0600 file where the device had been)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader, so opening the writing end does not block
    try:
        assert cli("export", str(fifo), "--namespace", NS) == 0
        data = os.read(reader, 1 << 16)
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert "exported 2 entries" in capsys.readouterr().err  # the stream carries the export alone
    lines = data.decode().splitlines()
    assert len(lines) == 3 and json.loads(lines[0])["namespace"] == NS
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_export_through_a_symlink_replaces_its_target(small, tmp_path):
    target, link = tmp_path / "target.jsonl", tmp_path / "link.jsonl"
    target.write_text("old\n")
    link.symlink_to(target)
    assert cli("export", str(link), "--namespace", NS) == 0
    assert link.is_symlink() and len(target.read_text().splitlines()) == 3


def test_export_errors_name_the_file_asked_for(small, tmp_path, capsys):
    assert cli("export", str(tmp_path), "--namespace", NS) == 1
    assert f"cannot export to {str(tmp_path)!r}: it is a directory" in capsys.readouterr().err
    missing = tmp_path / "nope" / "x.jsonl"
    assert cli("export", str(missing), "--namespace", NS) == 1
    err = capsys.readouterr().err
    assert str(missing) in err and ".tmp-" not in err  # not our temp file beside it


def test_ctrl_c_mid_export_leaves_the_old_file_and_no_temp(small, tmp_path, capsys, monkeypatch):
    from cudnn_fuse import cli as main_cli

    out_file = tmp_path / "plans.jsonl"
    out_file.write_text("the old export\n")
    valid = PlanCache._valid_entries

    def interrupted(self, *args):
        yield next(valid(self, *args))
        raise KeyboardInterrupt

    monkeypatch.setattr(PlanCache, "_valid_entries", interrupted)
    try:
        rc = main_cli.main(["cache", "export", str(out_file), "--namespace", NS])
    except KeyboardInterrupt:  # caught here, or it would end the test session
        pytest.fail("Ctrl-C came out of the CLI: a traceback")
    assert rc == 130
    assert "interrupted" in capsys.readouterr().err
    assert out_file.read_text() == "the old export\n"
    assert [p.name for p in tmp_path.iterdir() if p.name != "cudnn_fuse_cache"] == ["plans.jsonl"]


def test_import_rejects_a_line_that_is_not_utf8_and_goes_on(small, tmp_path, capsys):
    """A byte that is not UTF-8 stopped the whole import ('utf-8' codec can't decode...), with the
    good lines around it unread."""
    out_file = tmp_path / "plans.jsonl"
    assert cli("export", str(out_file), "--namespace", NS) == 0
    header, first, second = out_file.read_bytes().splitlines()
    out_file.write_bytes(b"\n".join([header, first, b"\xff\xfe{not utf-8}", second]) + b"\n")
    assert cli("import", str(out_file), "--dir", str(tmp_path / "t"), "--namespace", NS) == 1
    assert import_counts(capsys.readouterr().out) == dict(imported=2, skipped=0, rejected=1, failed=0)


@pytest.mark.parametrize("content", [b"\x7fELF\x02\x01\x01\x00\xb0\xff" * 50, b"[" * 100_000 + b"]" * 100_000],
                         ids=["binary", "nested"])
def test_import_of_a_file_that_is_no_export_says_so(small, tmp_path, capsys, content):
    """A binary file said "'utf-8' codec can't decode"; JSON nested past Python's recursion
    limit raised RecursionError (a traceback)."""
    path = tmp_path / "other"
    path.write_bytes(content)
    assert cli("import", str(path), "--namespace", NS) == 1
    assert "not a cudnn_fuse plan cache export" in capsys.readouterr().err


def test_import_rejects_a_deeply_nested_entry_line(small, tmp_path, capsys):
    out_file = tmp_path / "plans.jsonl"
    assert cli("export", str(out_file), "--namespace", NS) == 0
    with open(out_file, "a") as f:
        f.write("[" * 100_000 + "]" * 100_000 + "\n")
    assert cli("import", str(out_file), "--dir", str(tmp_path / "t"), "--namespace", NS) == 1
    assert import_counts(capsys.readouterr().out) == dict(imported=2, skipped=0, rejected=1, failed=0)


def test_stats_of_an_unreadable_database_fail(small, capsys):
    (small / NS / "cache.db").write_bytes(b"not a database " * 500)
    for suffix in ("-wal", "-shm"):
        (small / NS / f"cache.db{suffix}").unlink(missing_ok=True)
    assert cli("stats", "--namespace", NS) == 1  # it exited 0, its counts all zero
    assert re.search(r"^error +file is not a database$", capsys.readouterr().out, re.M)


def test_a_size_past_a_float_is_no_traceback():
    assert parse_size("9" * 400) >= 10**399  # float() overflowed: OverflowError out of argparse


def test_ls_and_verify_take_odd_numbers_in_an_entrys_metadata(cache_dir, capsys):
    """Metadata is JSON from whoever wrote the entry (an imported export too): a tuned_at past the
    platform's dates and an engine id of Infinity raised OverflowError out of ls and verify."""
    cache = PlanCache(cache_dir, namespace=NS)
    assert cache.put(key("far"), {"op": "conv2d", "tuned_at": 1e300, "workspace_bytes": 1e300}, b"f")
    assert cache.put(key("nan"), {"op": "conv2d", "tuned_at": float("nan"), "workspace_bytes": float("nan")}, b"n")
    assert cache.put(key("inf"), {"op": "matmul", "engine_id": float("inf"), "spec": {"op": "matmul"}}, b"i")
    cache.close()
    assert cli("ls", "--namespace", NS) == 0
    rows = {r[:12]: r.split() for r in capsys.readouterr().out.splitlines()}
    assert rows[key("far")[:12]][-1] == "1e+300" and rows[key("far")[:12]][3] == "?"
    assert rows[key("nan")[:12]][-1] == "nan"
    assert cli("verify", "--namespace", NS) == 0
    assert "checked 3 entries: 3 ok" in capsys.readouterr().out


def test_long_actions_draw_a_bar_and_short_ones_do_not(cache_dir, tmp_path, capsys):
    """verify, export and import of a large cache show progress (progress.Bar: plain lines off a
    terminal) and end with their report; a handful of entries gets no bar."""
    cache = PlanCache(cache_dir, namespace=NS)
    for i in range(120):
        assert cache.put(key(i), META, bytes([i]) * 64)
    cache.close()
    out_file = tmp_path / "plans.jsonl"
    assert cli("verify", "--namespace", NS) == 0
    captured = capsys.readouterr()
    assert "verifying clins: 120/120 100%" in captured.err and "no faults" in captured.out
    assert cli("export", str(out_file), "--namespace", NS) == 0
    assert "exporting clins: 120/120 100%" in capsys.readouterr().err
    assert cli("import", str(out_file), "--dir", str(tmp_path / "t"), "--namespace", NS) == 0
    captured = capsys.readouterr()
    assert "importing plans.jsonl: 120/120 100%" in captured.err
    assert import_counts(captured.out)["imported"] == 120
    small = PlanCache(tmp_path / "small", namespace=NS)
    assert small.put(key("one"), META, b"1")
    small.close()
    assert cli("verify", "--dir", str(tmp_path / "small"), "--namespace", NS) == 0
    assert capsys.readouterr().err == ""
