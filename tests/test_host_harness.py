"""bench/host_harness.py --eager measures the paths it names: the memoized call replays its
stand-in plan's captures as graphs, as kernels (KernelReplay), or launches raw."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import host_harness  # noqa: E402


def test_the_eager_rows_take_the_paths_they_name():
    rows = host_harness.eager_rows(calls=300, rounds=2)
    assert set(rows) == {"graph_replays", "kernel_replays", "raw"}
    us, entry, replays = rows["graph_replays"]
    assert entry == "int" and replays >= 600 and us > 0
    us, entry, replays = rows["kernel_replays"]
    assert entry == "KernelReplay" and replays >= 600 and us > 0
    us, entry, replays = rows["raw"]
    assert entry is None and replays == 0 and us > 0
    from cudnn_fuse import ops

    assert ops._FAST == {}  # the stand-in entries are gone

