"""Test helpers for autotuning and the loader: autotuning switched on with a given Config for a
block (plans in memory cleared before and after), a dict-backed stand-in for PlanCache's
get/delete/put that the loader's read path uses, a graph that records the calls made on it, and a
stored graph and plan with a shape family's spec for the loader's build and store path."""

from __future__ import annotations

import contextlib
import types

from cudnn_fuse import autotune, loader, set_autotune


@contextlib.contextmanager
def deterministic(on: bool):
    """torch.use_deterministic_algorithms(on, warn_only=True) for the block, the old setting restored."""
    import torch

    old = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(on, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old[0], warn_only=old[1])


@contextlib.contextmanager
def autotuning(**config):
    """Autotune on, autotune.DEFAULT_CONFIG = Config(**config), in-memory plans cleared around."""
    loader.clear()
    set_autotune(True)
    old = autotune.DEFAULT_CONFIG
    autotune.DEFAULT_CONFIG = autotune.Config(**config)
    try:
        yield
    finally:
        autotune.DEFAULT_CONFIG = old
        set_autotune(False)
        loader.clear()


class DictCache:
    """get / delete / put over a dict of entries; puts are recorded, not stored."""

    def __init__(self, entries):
        self.entries, self.puts = entries, []

    def get(self, key, count=True):
        return self.entries.get(key)

    def delete(self, key):
        self.entries.pop(key, None)

    def put(self, *a, **k):
        self.puts.append(a)


def entry(meta, blob=b"x"):
    """A cache entry as the loader reads one: meta, blob, key."""
    return types.SimpleNamespace(meta=meta, blob=blob, key="k" * 64)


class RecordingGraph:
    """Records the calls made on a cuDNN graph (engines.prepare's), accepting any."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *a, **k: self.calls.append((name, a))


def stand_in_device(monkeypatch, pc) -> None:
    """The loader on the plan cache ``pc`` with fresh counters, and the GPU, its device context and the
    device's handle stood in for (a build's own pieces are the caller's to stand in)."""
    import torch

    from cudnn_fuse import plans

    monkeypatch.setattr(loader, "_cache", lambda device=None: pc)
    monkeypatch.setattr(loader, "STATS", plans._Stats())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "stand-in GPU")
    monkeypatch.setattr(loader, "handle_for", lambda d: types.SimpleNamespace(handle=None))
    monkeypatch.setattr(loader, "held", lambda h, d: contextlib.nullcontext())


def stood_in_builds(monkeypatch, pc, deserialize: bool = True):
    """The loader on ``pc`` (stand_in_device) building StoredGraphs with no check against torch, and a
    namespace whose ``built`` lists the specs built; ``decline = True`` makes builds raise UnsupportedError,
    ``capturing = True`` makes the loader see a capture. With ``deserialize``, stored entries load as
    StoredPlans. The clock that paces swaps reads ``ns.now``, which stands still unless a test moves it:
    every swap then takes no time and the next one may follow at once."""
    ns = types.SimpleNamespace(pc=pc, built=[], decline=False, capturing=False, now=0.0)
    monkeypatch.setattr(loader, "_now", lambda: ns.now)
    stand_in_device(monkeypatch, pc)

    def build_graph(spec, h):
        if ns.decline:
            raise loader.UnsupportedError("no engine for this size")
        ns.built.append(spec)
        return StoredGraph()

    monkeypatch.setattr(loader, "build_graph", build_graph)
    monkeypatch.setattr(loader, "finalize", lambda g, spec: None)
    monkeypatch.setattr(loader, "torch_check", lambda plan, spec, device: None)
    monkeypatch.setattr(loader, "Plan", StoredPlan)
    if deserialize:
        monkeypatch.setattr(loader, "_deserialize", lambda spec, entry, device: StoredPlan(spec, StoredGraph(), device))
    monkeypatch.setattr(loader, "_capturing", lambda: ns.capturing)
    return ns


def family_spec(m: int, dtype: str = "bfloat16"):
    """A linear's matmul of ``m`` rows (32 -> 48, GELU): one shape family over m."""
    from cudnn_fuse.spec import Epilogue, MatmulSpec, TensorSpec

    a = TensorSpec.contiguous((1, m, 32), dtype)
    b = TensorSpec((1, 32, 48), (32, 1, 32), dtype)
    return MatmulSpec(a, b, TensorSpec.contiguous((1, m, 48), dtype), Epilogue(activation="gelu"))


class StoredGraph:
    """What the loader's store asks of a built graph: its engine and knobs, and a blob."""

    _plan_index = 0

    def __init__(self, engine_id: int = 39):
        self.engine_id = engine_id

    def get_engine_and_knobs_at_index(self, i):
        return self.engine_id, {"k24": 7}

    def serialize(self, as_bytes=True):
        return b"plan"


class StoredPlan:
    """plans.Plan's place in the loader: spec, graph, device, engine name."""

    raw = True

    def __init__(self, spec, graph, device, engine=None):
        self.spec, self.graph, self.device, self.workspace_size = spec, graph, device, 0
        self.engine = f"eng{graph.engine_id}"
