"""bench/host_harness.py --eager measures the paths it names: the memoized call replays its
stand-in plan's captures as graphs, as kernels (KernelReplay), or launches raw."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import host_harness  # noqa: E402


def test_the_eager_rows_take_the_paths_they_name():
    from cudnn_fuse import ops

    native = ops.native_enabled()
    rows = host_harness.eager_rows(calls=300, rounds=2)
    assert set(rows) == {"graph_replays", "kernel_replays", "raw"} | ({"kernel_replays_python"} if native else set())
    assert ops.native_enabled() is native  # the harness puts the process's path back
    if native:  # the Python path's row replays the same captures
        us, entry, replays = rows["kernel_replays_python"]
        assert entry == "KernelReplay" and replays >= 600 and us > 0
    us, entry, replays = rows["graph_replays"]
    assert entry == "int" and replays >= 600 and us > 0
    us, entry, replays = rows["kernel_replays"]
    assert entry == "KernelReplay" and replays >= 600 and us > 0
    us, entry, replays = rows["raw"]
    assert entry is None and replays == 0 and us > 0
    assert ops._FAST == {}  # the stand-in entries are gone

