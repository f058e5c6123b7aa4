"""`cudnn-fuse cache` on a cache it cannot use, on a damaged fingerprint.json, and verify's list of
faults, each fault injected for real.

Before: on a root below a file or a directory this user cannot read, `cache ls` said "no plans cached"
and `cache stats` printed a table of zeros, both exiting 0 (a read-only open saw no database), while
`doctor` and `verify` exited 1; a fingerprint.json that is no fingerprint was taken by verify and
export (which wrote ``"fingerprint": null``); verify named no fault and exited 0.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import sqlite3
import tempfile
import time
import traceback
from pathlib import Path

import pytest

from cudnn_fuse import env
from cudnn_fuse.cache import PlanCache
from cudnn_fuse.cache_cli import add_cache_commands

NS = "clins"
META = {"spec": {"op": "conv2d"}, "engine_id": 7, "workspace_bytes": 0}
NOBODY = 65534


def key(name) -> str:
    return hashlib.sha256(str(name).encode()).hexdigest()


def cli(*argv) -> int:
    parser = argparse.ArgumentParser(prog="cudnn-fuse")
    add_cache_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["cache", *argv])
    return args.run(args)


def fill(root, namespace=NS) -> None:
    cache = PlanCache(root, namespace=namespace)
    assert cache.put(key("a"), META, b"a" * 100) and cache.put(key("b"), META, b"b" * 40_000, pinned=True)
    cache.close()


@pytest.fixture
def export_file(tmp_path):
    """A valid export of namespace NS, to import."""
    fill(tmp_path / "source")
    path = tmp_path / "plans.jsonl"
    assert PlanCache(tmp_path / "source", namespace=NS).export(path) == 2
    return path


def verbs(export_file, out_file):
    return {"ls": ["ls"], "stats": ["stats"], "verify": ["verify"], "prune": ["prune"], "clear": ["clear"],
            "export": ["export", str(out_file)], "import": ["import", str(export_file)]}


VERBS = ["ls", "stats", "verify", "prune", "clear", "export", "import"]


# ---------------------------------------------------------------- a cache that cannot be opened


def _below_a_file(base):
    (base / "file").write_text("not a directory\n")
    return base / "file" / "cache", "is not a directory"


def _a_file(base):
    (base / "file").write_text("not a directory\n")
    return base / "file", "not a directory"


def _world_writable(base):
    fill(base / "ww")
    os.chmod(base / "ww", 0o777)
    return base / "ww", "world-writable"


def _world_writable_namespace(base):
    fill(base / "cache")
    os.chmod(base / "cache" / NS, 0o777)
    return base / "cache", "world-writable"


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("make", [_below_a_file, _a_file, _world_writable, _world_writable_namespace],
                         ids=["below-a-file", "a-file", "world-writable", "world-writable-namespace"])
def test_every_verb_says_why_the_cache_cannot_be_opened(tmp_path, capsys, export_file, make, verb):
    (tmp_path / "base").mkdir()
    root, reason = make(tmp_path / "base")
    before = sorted(str(p) for p in (tmp_path / "base").rglob("*"))
    argv = verbs(export_file, tmp_path / "out.jsonl")[verb]
    assert cli(*argv, "--dir", str(root), "--namespace", NS) == 1
    captured = capsys.readouterr()
    assert captured.out == ""  # no "no plans cached", no table of zeros
    assert captured.err.startswith("error: the plan cache is disabled") or "warning above" in captured.err
    assert reason in captured.err
    assert sorted(str(p) for p in (tmp_path / "base").rglob("*")) == before  # nothing made
    assert not (tmp_path / "out.jsonl").exists()


def _as_a_user(fn):
    """``fn()`` (an exit status) where file permissions bind: as this user, or for root (whom no
    permission stops) in a forked child that drops to uid/gid 65534. Returns (status, stdout, stderr)."""
    if os.geteuid() != 0:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return fn(), out.getvalue(), err.getvalue()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                status = fn()
            payload = [status, out.getvalue(), err.getvalue()]
        except BaseException:  # noqa: BLE001 - reported to the parent
            payload = [-1, "", traceback.format_exc()]
        data = json.dumps(payload).encode()
        while data:
            data = data[os.write(write, data):]
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return tuple(json.loads(data))


@pytest.fixture
def perm_base(tmp_path):
    """A folder the test's user can enter: tmp_path for a user; for root, one in the system's temp
    folder (tmp_path's parents are root's, 0700) that uid 65534 can enter."""
    if os.geteuid() != 0:
        yield tmp_path
        return
    # every module the verbs import, imported here: the child may not read Python's own folder
    fill(tmp_path / "warm")
    for argv in (["verify"], ["stats"], ["export", str(tmp_path / "w.jsonl")], ["import", str(tmp_path / "w.jsonl")]):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            cli(*argv, "--dir", str(tmp_path / "warm"), "--namespace", NS)
    base = tempfile.mkdtemp(prefix="cudnn_fuse_perm_")
    os.chmod(base, 0o711)
    try:
        yield Path(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _owned_by_the_user(path) -> None:
    if os.geteuid() == 0:
        for p in [path, *path.rglob("*")]:
            os.lchown(p, NOBODY, NOBODY)


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("unreadable", ["root", "namespace"])
def test_every_verb_says_it_cannot_read_the_cache(perm_base, tmp_path, export_file, verb, unreadable):
    """A cache directory of mode 000: before, ls and stats read it as empty and exited 0."""
    root = perm_base / "cache"
    fill(root)
    outside = perm_base / "files"  # the export to write and the one to import, where the user may
    outside.mkdir()
    shutil.copy(export_file, outside / "plans.jsonl")
    _owned_by_the_user(root)
    _owned_by_the_user(outside)
    locked = root if unreadable == "root" else root / NS
    os.chmod(locked, 0)
    argv = verbs(outside / "plans.jsonl", outside / "out.jsonl")[verb]
    try:
        status, out, err = _as_a_user(lambda: cli(*argv, "--dir", str(root), "--namespace", NS))
    finally:
        os.chmod(locked, 0o700)
    assert status == 1, (out, err)
    assert out == "" and "cannot be read by this user" in err and str(locked) in err, (out, err)
    assert not (outside / "out.jsonl").exists()
    con = sqlite3.connect(root / NS / "cache.db")  # (root may not open another user's cache)
    assert con.execute("SELECT count(*) FROM Cache").fetchone()[0] == 2  # nothing removed
    con.close()


def test_an_unreadable_cache_disables_the_library_with_a_warning(perm_base, caplog):
    """The ops' cache too: every lookup missed without a word."""
    root = perm_base / "cache"
    fill(root)
    _owned_by_the_user(root)
    os.chmod(root / NS, 0)

    def lookup():
        cache = PlanCache(root, namespace=NS)
        print(cache.disabled)
        return int(cache.get(key("a")) is None)

    try:
        status, out, _ = _as_a_user(lookup)
    finally:
        os.chmod(root / NS, 0o700)
    assert status == 1 and "cannot be read by this user" in out


# ---------------------------------------------------------------- --namespace


@pytest.mark.parametrize("verb", [v for v in VERBS if v != "import"])
def test_an_unknown_namespace_is_named_with_the_known_ones(tmp_path, capsys, export_file, verb):
    fill(tmp_path / "cache", "known_a")
    fill(tmp_path / "cache", "known_b")
    argv = verbs(export_file, tmp_path / "out.jsonl")[verb]
    assert cli(*argv, "--dir", str(tmp_path / "cache"), "--namespace", "nosuch") == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "no namespace 'nosuch'" in captured.err and "known_a, known_b" in captured.err
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["known_a", "known_b"]


def test_import_may_make_a_namespace(tmp_path, capsys, export_file):
    assert cli("import", str(export_file), "--dir", str(tmp_path / "cache"), "--namespace", NS) == 0
    assert len(list(PlanCache(tmp_path / "cache", namespace=NS).entries())) == 2


# ---------------------------------------------------------------- fingerprint.json


GARBAGE = {"not-json": b'{"gpu_name": ', "a-list": b"[1, 2, 3]\n", "empty": b"",
           "another-namespace": json.dumps({"gpu_name": "NVIDIA H200", "torch": "2.13"}).encode()}


@pytest.mark.parametrize("content", GARBAGE.values(), ids=GARBAGE.keys())
def test_verify_reports_a_damaged_fingerprint_and_export_refuses_it(cache_dir, tmp_path, capsys, content):
    fill(cache_dir)
    (cache_dir / NS / "fingerprint.json").write_bytes(content)
    out_file = tmp_path / "out.jsonl"
    assert cli("export", str(out_file), "--namespace", NS) == 1
    err = capsys.readouterr().err
    assert "not exporting namespace clins" in err and "fingerprint.json" in err and "cache verify" in err
    assert not out_file.exists()
    assert cli("verify", "--namespace", NS) == 1
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.split()[:3] == ["-", "-", "fingerprint"])
    assert "removed" in row and "fingerprint.json" in row
    assert not (cache_dir / NS / "fingerprint.json").exists()
    assert cli("verify", "--namespace", NS) == 0
    assert cli("export", str(out_file), "--namespace", NS) == 0
    assert json.loads(out_file.read_text().splitlines()[0])["fingerprint"] is None  # none known, none claimed


def test_verify_rewrites_this_machines_damaged_fingerprint(cache_dir, capsys):
    PlanCache(cache_dir).close()
    path = cache_dir / env.namespace() / "fingerprint.json"
    assert json.loads(path.read_text()) == env.fingerprint()
    path.write_text("[]")
    assert cli("verify") == 1
    assert "rewritten with this machine's fingerprint" in capsys.readouterr().out
    assert json.loads(path.read_text()) == env.fingerprint()
    assert cli("verify") == 0


# ---------------------------------------------------------------- verify's faults


def test_verify_lists_every_kind_of_fault(cache_dir, capsys):
    fill(cache_dir)
    cache = PlanCache(cache_dir, namespace=NS)
    assert cache.put(key("pickled"), {"op": "matmul"}, b"p" * 10)
    assert cache.put(key("gone"), {"op": "sdpa"}, b"g" * 40_000)
    cache.close()
    con = sqlite3.connect(cache_dir / NS / "cache.db", isolation_level=None)
    con.execute("UPDATE Cache SET mode = 4 WHERE key = ?", (key("pickled"),))  # a pickle row
    (filename,) = con.execute("SELECT filename FROM Cache WHERE key = ?", (key("gone"),)).fetchone()
    con.close()
    (cache_dir / NS / filename).unlink()
    (b_file,) = [p for p in cache_dir.rglob("*.val")]  # the pinned 40 kB entry "b"
    b_file.write_bytes(b_file.read_bytes()[:1000])
    orphan = cache_dir / NS / "ee" / "ff" / ("1" * 28 + ".val")
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"half a plan")
    os.utime(orphan, (time.time() - 3600,) * 2)
    assert cli("verify", "--namespace", NS) == 1
    out = capsys.readouterr().out
    assert "checked 4 entries: 1 ok, 3 bad, 3 removed" in out
    rows = {line.split()[0] if line.split()[0] != "-" else line.split()[2]: line.split(maxsplit=5)
            for line in out.split("found in")[1].splitlines()[4:]}
    assert rows[key("pickled")[:12]][1:4] == ["?", "unsafe-row", "no"]  # a pickle row is not read, not even its op
    assert rows[key("gone")[:12]][1:4] == ["?", "missing-file", "no"]  # its metadata went with its file
    assert rows[key("b")[:12]][1:4] == ["conv2d", "truncated", "yes"]
    assert rows["orphan"][3:5] == ["-", "removed"]
    assert all(r[4].startswith("removed") for r in rows.values())
    assert not orphan.exists()


def test_verify_of_a_read_only_cache_lists_the_faults_it_leaves(cache_dir, capsys):
    fill(cache_dir)
    value = next(cache_dir.rglob("*.val"))
    value.write_bytes(value.read_bytes()[:-1])
    cache = PlanCache(cache_dir, namespace=NS, read_only=True)
    counts = cache.verify()
    cache.close()
    assert [(f["key"], f["kind"], f["pinned"], f["removed"]) for f in counts["faults"]] == [
        (key("b"), "truncated", True, False)]
