"""Plan cache faults that need other processes: concurrency, SIGKILL, a held lock, a file-size
limit, a read-only mount, fork (docs/cache.md's fault cases 6, 7, 8, 9, 11, 12, 14).

Faults are injected for real: children are spawned with multiprocessing and killed with
SIGKILL. Children import cudnn_fuse.cache without the package __init__ (which imports torch,
about 4 s per process); the cache module needs neither torch nor cuDNN.
"""

import hashlib
import importlib.util
import json
import logging
import multiprocessing as mp
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

LIGHT_IMPORT = "CUDNN_FUSE_TEST_LIGHT_IMPORT"
if os.environ.get(LIGHT_IMPORT) == "1" and "cudnn_fuse" not in sys.modules:
    _spec = importlib.util.find_spec("cudnn_fuse")
    sys.modules["cudnn_fuse"] = importlib.util.module_from_spec(_spec)  # __init__ not run

from cudnn_fuse.cache import PlanCache, encode_entry  # noqa: E402

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="POSIX process faults")

NS = "faultns"
SPAWN = mp.get_context("spawn")
CHILD_TIMEOUT_S = 60


def key(name) -> str:
    return hashlib.sha256(str(name).encode()).hexdigest()


def blob_for(k: str, size: int) -> bytes:
    return (hashlib.sha256(k.encode()).digest() * (size // 32 + 1))[:size]


def meta_for(k: str) -> dict:
    return {"spec": {"op": "conv2d", "key": k}, "engine": {"id": 3, "knobs": {"tile": 2}},
            "workspace_bytes": 4096, "tuned_at": 1.7e9}


SMALL, LARGE = 300, 48 * 1024  # inline in cache.db / a value file


def capture_logs() -> list:
    """Records of the cudnn_fuse loggers in this (child) process, INFO and up."""
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("cudnn_fuse")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return records


def warnings_in(records) -> list[str]:
    return [r.getMessage() for r in records if r.levelno >= logging.WARNING]


def val_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.val"))


@pytest.fixture(autouse=True)
def light_children(monkeypatch):
    monkeypatch.setenv(LIGHT_IMPORT, "1")


@contextmanager
def children():
    """A list to start processes into; any still alive at exit is killed (nothing hangs)."""
    procs = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)


def wait_for(path: Path, proc, timeout=CHILD_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.is_alive(), f"child exited with {proc.exitcode} before {path.name}"
        assert time.monotonic() < deadline, f"child never reached {path.name}"
        time.sleep(0.01)


def sigkill(proc) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=10)
    assert proc.exitcode == -signal.SIGKILL


def rows_per_key(root: Path) -> dict:
    con = sqlite3.connect(root / NS / "cache.db")
    try:
        return dict(con.execute("SELECT key, count(*) FROM Cache GROUP BY key").fetchall())
    finally:
        con.close()


# ---------------------------------------------------------------- case 6: 8 processes, cold cache


def _cold_cache_worker(root, keys, barrier, out):
    records = capture_logs()
    cache = PlanCache(root, namespace=NS, timeout=20)
    barrier.wait(CHILD_TIMEOUT_S)
    order = list(keys)
    random.shuffle(order)
    report = dict(puts=0, put_failures=0, bad_reads=0)
    for i, k in order:
        size = SMALL if i % 2 else LARGE
        if cache.get(k) is None:
            report["puts"] += 1
            report["put_failures"] += not cache.put(k, meta_for(k), blob_for(k, size))
        entry = cache.get(k)
        if entry is None or entry.blob != blob_for(k, size) or entry.meta != meta_for(k):
            report["bad_reads"] += 1
    report["warnings"] = warnings_in(records)
    out.put(report)


def test_eight_spawned_processes_on_a_cold_cache(tmp_path):
    root = tmp_path / "cold"  # does not exist yet: the processes race to create everything
    keys = [(i, key(f"cold{i}")) for i in range(12)]
    barrier, out = SPAWN.Barrier(8), SPAWN.Queue()
    with children() as procs:
        for _ in range(8):
            procs.append(SPAWN.Process(target=_cold_cache_worker,
                                       args=(str(root), keys, barrier, out)))
            procs[-1].start()
        reports = [out.get(timeout=CHILD_TIMEOUT_S) for _ in procs]
        for p in procs:
            p.join(timeout=CHILD_TIMEOUT_S)
            assert p.exitcode == 0
    assert all(r["bad_reads"] == 0 for r in reports), reports
    assert all(r["put_failures"] == 0 for r in reports), reports
    assert all(r["warnings"] == [] for r in reports), reports
    assert sum(r["puts"] for r in reports) >= len(keys)
    assert rows_per_key(root) == {k: 1 for _, k in keys}
    cache = PlanCache(root, namespace=NS)
    assert cache.verify()["ok"] == len(keys)


# ---------------------------------------------------------------- case 7: reader racing deletes


def _race_writer(root, items, barrier, seconds, out):
    cache = PlanCache(root, namespace=NS)
    barrier.wait(CHILD_TIMEOUT_S)
    stop_at = time.time() + seconds
    rounds = 0
    while time.time() < stop_at:
        for k, blob in items:
            cache.put(k, meta_for(k), blob)
        cache.delete(items[0][0])
        cache.prune(max_bytes=0)
        rounds += 1
    out.put(("writer", rounds))


def _race_reader(root, items, barrier, seconds, out):
    records = capture_logs()
    cache = PlanCache(root, namespace=NS)
    barrier.wait(CHILD_TIMEOUT_S)
    stop_at = time.time() + seconds
    hits = misses = bad = 0
    while time.time() < stop_at:
        for k, blob in items:
            entry = cache.get(k)
            if entry is None:
                misses += 1
            elif entry.blob == blob and entry.meta == meta_for(k):
                hits += 1
            else:
                bad += 1
    out.put(("reader", hits, misses, bad, warnings_in(records)))


def test_reader_racing_delete_and_prune_sees_whole_entries_or_misses(tmp_path):
    root = tmp_path / "race"
    PlanCache(root, namespace=NS).close()
    items = [(key("race-file"), blob_for("f", LARGE)), (key("race-inline"), blob_for("i", SMALL))]
    barrier, out = SPAWN.Barrier(3), SPAWN.Queue()
    with children() as procs:
        targets = (_race_writer, _race_reader, _race_reader)
        for target in targets:
            procs.append(SPAWN.Process(target=target, args=(str(root), items, barrier, 2.0, out)))
            procs[-1].start()
        reports = [out.get(timeout=CHILD_TIMEOUT_S) for _ in procs]
    readers = [r for r in reports if r[0] == "reader"]
    writer_rounds = next(r[1] for r in reports if r[0] == "writer")
    assert writer_rounds > 10
    for _, hits, misses, bad, warned in readers:
        assert bad == 0  # never partial or foreign bytes
        assert warned == []  # a race is a plain miss, not a fault
        assert hits > 0 and misses > 0  # the race really happened


# ---------------------------------------------------------------- case 8: SIGKILL during a write


def _killed_mid_file_write(root, ready):
    import cudnn_fuse.cache as cache_module

    def write_half_then_hang(path, data):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, data[: len(data) // 2])
        Path(ready).touch()
        time.sleep(CHILD_TIMEOUT_S)

    cache = PlanCache(root, namespace=NS)
    cache_module._write_private_file = write_half_then_hang
    cache.put(key("killed"), meta_for("killed"), blob_for("killed", LARGE))


def _killed_before_commit(root, ready):
    cache = PlanCache(root, namespace=NS)
    store = cache._get_store()
    insert = store._row_insert

    def insert_then_hang(*args):  # inside diskcache's write transaction, before its commit
        insert(*args)
        Path(ready).touch()
        time.sleep(CHILD_TIMEOUT_S)

    store._row_insert = insert_then_hang
    cache.put(key("killed"), meta_for("killed"), blob_for("killed", LARGE))


@pytest.mark.parametrize("target", [_killed_mid_file_write, _killed_before_commit],
                         ids=["mid-file-write", "inside-transaction"])
def test_sigkill_during_a_write_leaves_no_half_entry(tmp_path, caplog, target):
    root, ready = tmp_path / "kill", tmp_path / "ready"
    survivor = PlanCache(root, namespace=NS)
    assert survivor.put(key("before"), meta_for("before"), blob_for("before", LARGE))
    with children() as procs:
        procs.append(SPAWN.Process(target=target, args=(str(root), str(ready))))
        procs[0].start()
        wait_for(ready, procs[0])
        sigkill(procs[0])
    assert len(val_files(root)) == 2  # the survivor's entry and the killed writer's file
    with caplog.at_level(logging.INFO, logger="cudnn_fuse"):
        assert survivor.get(key("killed")) is None
        assert survivor.put(key("after"), meta_for("after"), blob_for("after", SMALL))
        assert survivor.get(key("after")).blob == blob_for("after", SMALL)
        assert survivor.get(key("before")).blob == blob_for("before", LARGE)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert [k for k, _, _ in survivor.entries()] == [key("before"), key("after")]
    young = survivor.verify()  # a fresh orphan may belong to a live writer: kept
    assert (young["bad"], young["orphans"], young["orphans_removed"]) == (0, 1, 0)
    swept = survivor.verify(orphan_grace_s=0)
    assert (swept["ok"], swept["bad"], swept["orphans_removed"]) == (2, 0, 1)
    assert len(val_files(root)) == 1


def _put_forever(root):
    cache = PlanCache(root, namespace=NS)
    for i in range(10**6):
        k = key(f"loop{i}")
        cache.put(k, meta_for(k), blob_for(k, LARGE if i % 2 else SMALL))


def test_sigkill_at_random_points_of_a_write_loop_leaves_only_valid_entries(tmp_path):
    root = tmp_path / "loop"
    PlanCache(root, namespace=NS).close()
    rng = random.Random(0)
    for _ in range(3):
        with children() as procs:
            procs.append(SPAWN.Process(target=_put_forever, args=(str(root),)))
            procs[0].start()
            deadline = time.monotonic() + CHILD_TIMEOUT_S
            while not rows_per_key(root) or rng.random() < 0.9:  # kill after >= 1 commit
                assert time.monotonic() < deadline
                time.sleep(0.02)
            sigkill(procs[0])
        counts = PlanCache(root, namespace=NS).verify(orphan_grace_s=0)
        assert counts["bad"] == 0 and counts["checked"] == counts["ok"] > 0
        cache = PlanCache(root, namespace=NS)
        assert all(cache.get(k) is not None for k, _, _ in cache.entries())


# ---------------------------------------------------------------- case 9: killed holding the lock


def _hold_write_lock(root, ready):
    cache = PlanCache(root, namespace=NS)
    store = cache._get_store()
    with store.transact():  # BEGIN IMMEDIATE: the write lock, held until killed
        store.set(key("locked"), encode_entry(key("locked"), {}, b"uncommitted"))
        Path(ready).touch()
        time.sleep(CHILD_TIMEOUT_S)


def test_sigkill_while_holding_the_write_lock(tmp_path, caplog):
    root, ready = tmp_path / "lock", tmp_path / "ready"
    first = PlanCache(root, namespace=NS)
    assert first.put(key("a"), meta_for("a"), blob_for("a", SMALL))
    first.close()
    with children() as procs:
        procs.append(SPAWN.Process(target=_hold_write_lock, args=(str(root), str(ready))))
        procs[0].start()
        wait_for(ready, procs[0])
        with caplog.at_level(logging.INFO, logger="cudnn_fuse"):
            t0 = time.monotonic()
            other = PlanCache(root, namespace=NS, timeout=0.5)
            stored = other.put(key("b"), meta_for("b"), blob_for("b", SMALL))
            again = other.put(key("c"), meta_for("c"), blob_for("c", SMALL))
            hit = other.get(key("a"))
            elapsed = time.monotonic() - t0
        sigkill(procs[0])
    assert (stored, again) == (False, False)  # ran without the cache instead of waiting
    assert elapsed < 5
    assert hit is not None and hit.blob == blob_for("a", SMALL)  # readers are not blocked
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "[locked]" in warned[0]
    after = PlanCache(root, namespace=NS, timeout=0.5)  # the kernel dropped the dead lock
    assert after.put(key("b"), meta_for("b"), blob_for("b", SMALL))
    assert after.get(key("b")) is not None
    assert after.get(key("locked")) is None  # the killed transaction rolled back
    assert after.verify()["bad"] == 0


# ---------------------------------------------------------------- case 11: file-size limit


def _file_size_limited(root, out):
    import resource

    records = capture_logs()
    cache = PlanCache(root, namespace=NS)
    small_ok = cache.put(key("small"), meta_for("small"), blob_for("small", SMALL))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    big = [cache.put(key(f"big{i}"), meta_for("big"), blob_for("big", 256 * 1024))
           for i in range(3)]
    hit = cache.get(key("small"))
    out.put(dict(small_ok=small_ok, big=big, hit=hit is not None and hit.blob == blob_for(
        "small", SMALL), big_miss=cache.get(key("big0")) is None,
        write_failures=cache.stats()["write_failures"], warnings=warnings_in(records)))


def test_file_size_limit_makes_put_return_false_with_one_warning(tmp_path):
    root, out = tmp_path / "fsize", SPAWN.Queue()
    with children() as procs:
        procs.append(SPAWN.Process(target=_file_size_limited, args=(str(root), out)))
        procs[0].start()
        report = out.get(timeout=CHILD_TIMEOUT_S)
        procs[0].join(timeout=CHILD_TIMEOUT_S)
    assert procs[0].exitcode == 0
    assert report["small_ok"] and report["hit"] and report["big_miss"]
    assert report["big"] == [False, False, False] and report["write_failures"] == 3
    assert len(report["warnings"]) == 1, report["warnings"]
    assert "[disk-full]" in report["warnings"][0] and "File too large" in report["warnings"][0]
    assert val_files(root) == []  # no partial value file left behind


# ---------------------------------------------------------------- case 12: read-only directory


def read_only_report(root) -> dict:
    """Open a pre-warmed cache in a directory this process cannot write; what happened."""
    records = capture_logs()
    cache = PlanCache(root, namespace=NS)
    small, large = cache.get(key("small")), cache.get(key("large"))
    report = dict(
        read_only=cache.read_only, disabled=cache.disabled,
        small=small is not None and small.blob == blob_for("small", SMALL),
        large=large is not None and large.blob == blob_for("large", LARGE),
        miss=cache.get(key("absent")) is None,
        puts=[cache.put(key("absent"), {}, b"x"), cache.put(key("absent2"), {}, b"y")],
        entries=cache.stats()["entries"],
        warnings=warnings_in(records),
        infos=[r.getMessage() for r in records if r.levelno == logging.INFO])
    cache.close()
    return report


def prewarm(root: Path) -> None:
    cache = PlanCache(root, namespace=NS)
    assert cache.put(key("small"), meta_for("small"), blob_for("small", SMALL), pinned=True)
    assert cache.put(key("large"), meta_for("large"), blob_for("large", LARGE), pinned=True)
    cache.close()


def snapshot(root: Path) -> dict:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")}


def chmod_tree(root: Path, dir_mode: int, file_mode: int) -> None:
    for p in [root, *root.rglob("*")]:
        os.chmod(p, dir_mode if p.is_dir() else file_mode)


def run_on_read_only_mount(root: Path) -> dict:
    """read_only_report() in a child that sees ``root`` through a read-only bind mount."""
    script = ('mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" || exit 77\n'
              'exec "$1" -c "$2" "$0" "$3"')
    code = ("import json, sys; sys.path.insert(0, sys.argv[2]); import test_cache_faults as t; "
            "print(json.dumps(t.read_only_report(sys.argv[1])))")
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(root),
         sys.executable, code, str(Path(__file__).parent)],
        capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    if proc.returncode == 77:
        pytest.skip(f"cannot make a read-only bind mount here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_read_only_directory_serves_hits_and_refuses_puts_quietly(tmp_path):
    root = tmp_path / "prewarmed"
    prewarm(root)
    assert not (root / NS / "cache.db-shm").exists()  # closed cleanly: SQLite must cope without
    before = snapshot(root)
    chmod_tree(root, 0o500, 0o400)
    try:
        if os.geteuid() != 0:
            report = read_only_report(root)
        elif shutil.which("unshare"):  # root ignores chmod; a read-only mount binds root too
            report = run_on_read_only_mount(root)
        else:
            pytest.skip("root without unshare: see test_cache.py's forced read-only test")
    finally:
        chmod_tree(root, 0o700, 0o600)
    assert report["read_only"] and report["disabled"] is None
    assert report["small"] and report["large"] and report["miss"]
    assert report["puts"] == [False, False] and report["entries"] == 2
    assert report["warnings"] == []
    assert len(report["infos"]) == 1 and "read-only" in report["infos"][0]
    assert snapshot(root) == before


# ---------------------------------------------------------------- case 14: fork after open


def test_fork_after_open_children_use_the_cache(tmp_path, caplog):
    root = tmp_path / "fork"
    cache = PlanCache(root, namespace=NS)
    assert cache.put(key("parent"), meta_for("parent"), blob_for("parent", LARGE))
    assert cache.get(key("parent")) is not None  # connections are open when we fork
    fork, out = mp.get_context("fork"), None
    out = fork.Queue()

    def dataloader_worker(i):
        records = capture_logs()
        k = key(f"child{i}")
        hit = cache.get(key("parent"))
        stored = cache.put(k, meta_for(k), blob_for(k, SMALL if i else LARGE))
        back = cache.get(k)
        out.put(dict(i=i, hit=hit is not None and hit.blob == blob_for("parent", LARGE),
                     stored=stored, back=back is not None, faults=cache.stats()["faults"],
                     warnings=warnings_in(records)))

    with children() as procs:
        for i in range(3):
            procs.append(fork.Process(target=dataloader_worker, args=(i,)))
            procs[-1].start()
        with caplog.at_level(logging.WARNING, logger="cudnn_fuse"):
            for j in range(20):  # the parent keeps using its connections meanwhile
                k = key(f"parent{j}")
                assert cache.put(k, meta_for(k), blob_for(k, SMALL))
                assert cache.get(k) is not None
        reports = sorted((out.get(timeout=CHILD_TIMEOUT_S) for _ in procs), key=lambda r: r["i"])
        for p in procs:
            p.join(timeout=CHILD_TIMEOUT_S)
            assert p.exitcode == 0
    for r in reports:
        assert r["hit"] and r["stored"] and r["back"], r
        assert r["faults"] == 0 and r["warnings"] == [], r
    assert all(cache.get(key(f"child{i}")) is not None for i in range(3))
    assert caplog.records == [] and cache.stats()["faults"] == 0
    assert cache.verify()["bad"] == 0

