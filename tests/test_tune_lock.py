"""The cross-process tune lock: one tuner per key, the others wait (bounded) or use its result."""

from __future__ import annotations

import threading
import types

from cudnn_fuse import loader


class FakeCache:
    def __init__(self, path):
        self.dir = path
        self.entries = {}

    def get(self, key, count=True):
        meta = self.entries.get(key)
        return None if meta is None else types.SimpleNamespace(key=key, meta=meta, blob=b"")


def _hold(pc, digest, held: threading.Event, release: threading.Event, results: list):
    with loader._tune_lock(pc, digest) as mine:
        results.append(mine)
        held.set()
        release.wait(10)


def test_second_tuner_times_out_then_uses_the_first_ones_result(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "TUNE_WAIT_S", 0.3)
    pc, digest = FakeCache(tmp_path), "ab" * 32
    held, release, results = threading.Event(), threading.Event(), []
    t = threading.Thread(target=_hold, args=(pc, digest, held, release, results))
    t.start()
    assert held.wait(5)
    with loader._tune_lock(pc, digest) as mine:  # flock: a second open file description conflicts
        assert mine is False  # waited 0.3 s, the holder still tunes: run heuristics meanwhile
    pc.entries[digest] = {"tuned": True}  # the holder stores its tuned plan ...
    release.set()  # ... and lets go
    t.join(5)
    assert results == [True]
    with loader._tune_lock(pc, digest) as mine:
        assert mine is False  # the key is tuned now: load it, do not tune again


def test_a_free_lock_is_taken_and_released(tmp_path):
    pc = FakeCache(tmp_path)
    for _ in range(2):  # released on exit, so it can be taken again
        with loader._tune_lock(pc, "cd" * 32) as mine:
            assert mine is True
    assert (tmp_path / "locks" / ("cd" * 32 + ".lock")).exists()


def test_no_lock_dir_means_tuning_unlocked(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    pc = FakeCache(blocker)  # locks/ cannot be created under a file
    with loader._tune_lock(pc, "ef" * 32) as mine:
        assert mine is True
