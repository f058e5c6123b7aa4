"""A build process (cudnn_fuse.build_child) with cuDNN and the GPU stood in for, as tests/tuning.py's helpers
do in the test's own process: it stores real plan-cache entries of stand-in graphs, in namespace argv[1].
A spec of m rows builds after argv[2] seconds; m = 13 is declined and m = 66 kills the process."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cudnn_fuse import build_child, envvars, loader  # noqa: E402
from cudnn_fuse.cache import PlanCache  # noqa: E402
from tuning import StoredGraph, stood_in_builds  # noqa: E402


def main() -> None:
    namespace, delay = sys.argv[1], float(sys.argv[2])
    caches = {}

    def cache(device=None):
        path = os.environ[envvars.CACHE_DIR]
        if path not in caches:
            caches[path] = PlanCache(path, namespace=namespace)
        return caches[path]

    def build_graph(spec, h):
        import time

        m = spec.a.shape[1]
        if m == 66:
            os._exit(3)
        if m == 13:
            raise loader.UnsupportedError("no engine for 13 rows")
        time.sleep(delay)
        return StoredGraph()

    with pytest.MonkeyPatch.context() as mp:
        stood_in_builds(mp, None, deserialize=False)
        mp.setattr(loader, "_cache", cache)
        mp.setattr(loader, "build_graph", build_graph)
        sys.argv = sys.argv[:1]
        build_child.main()


if __name__ == "__main__":
    main()
