"""Plans follow torch.use_deterministic_algorithms: while it is on, every plan (heuristic or tuned)
is chosen among cuDNN's deterministic engines, is cached under a key of its own, and lives in its
own in-memory slots (the plan LRU, the per-signature memo, the conv backward programs), so a
plan chosen without the filter (or torch's cuBLAS stand-in) never serves a deterministic call,
nor the other way round. CPU: the keys and the deselect call on a recording graph."""

from __future__ import annotations

import contextlib

import torch

import cudnn_fuse as cf
from cudnn_fuse import loader, ops, plans, prewarm
from cudnn_fuse.manifest import Entry
from tuning import RecordingGraph


@contextlib.contextmanager
def deterministic(on: bool):
    old = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(on, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old[0], warn_only=old[1])


def _spec():
    x = torch.randn(4, 8).half()
    w = torch.randn(16, 8).half()
    with cf.record() as rec:
        cf.linear(x, w, None, activation="relu")
    return rec.entries[0].spec


_RecordingGraph = RecordingGraph


def test_the_flag_is_torchs():
    for on in (True, False, True):
        with deterministic(on):
            assert plans.deterministic() is on
    assert plans.deterministic() is torch.are_deterministic_algorithms_enabled()
    old = torch.backends.cudnn.deterministic
    try:  # torch's own cuDNN switch counts too
        torch.backends.cudnn.deterministic = True
        assert plans.deterministic() is True
        with deterministic(False):
            assert plans.deterministic() is True
        torch.backends.cudnn.deterministic = False
        assert plans.deterministic() is False
    finally:
        torch.backends.cudnn.deterministic = old


def test_prepare_deselects_nondeterministic_engines_only_while_torch_requires_it():
    import cudnn

    spec = _spec()
    with deterministic(True):
        g = _RecordingGraph()
        plans.prepare(g, spec)
    assert ("deselect_numeric_notes", ([cudnn.numerical_note.NONDETERMINISTIC],)) in g.calls
    names = [c[0] for c in g.calls]
    assert names.index("create_execution_plans") < names.index("deselect_numeric_notes")  # before any build
    assert not any(n.startswith("build_plan") for n in names)
    with deterministic(False):
        g = _RecordingGraph()
        plans.prepare(g, spec)
    assert "deselect_numeric_notes" not in [c[0] for c in g.calls]  # a 16-bit spec: no TF32 filter either


def test_deterministic_plans_have_their_own_cache_key():
    spec = _spec()
    with deterministic(False):
        plain = loader.cache_digest(spec)
    with deterministic(True):
        det = loader.cache_digest(spec)
    assert plain == spec.digest() and det != plain and len(det) == 64
    assert loader.engine_record_key(det) != loader.engine_record_key(plain)


def test_the_plan_lru_keeps_one_plan_per_mode():
    built = []

    def builder(spec, device):
        built.append(plans.deterministic())
        return object()

    lru = plans.PlanLRU(8, builder=builder)
    spec = _spec()
    with deterministic(False):
        a = lru.get(spec, 0)
        assert lru.get(spec, 0) is a
    with deterministic(True):
        b = lru.get(spec, 0)
        assert b is not a and lru.get(spec, 0) is b
    with deterministic(False):
        assert lru.get(spec, 0) is a
    assert built == [False, True]


def test_a_backward_graphs_remembered_plan_serves_only_its_mode(monkeypatch):
    """backward's remembered specs carry a slot for their plan (backward._try fills it). The slot
    once ignored the mode: a conv dgrad planned without the determinism filter went on running that
    plan after torch.use_deterministic_algorithms(True) (process-wide, from any thread)."""
    from cudnn_fuse import backward

    ran = []

    class StandIn:
        def __init__(self):
            self.det = plans.deterministic()

        def run(self, buffers):
            ran.append(self.det)

    monkeypatch.setattr(plans._LRU, "_builder", lambda spec, device: StandIn())
    plans.clear()
    cl = torch.channels_last
    dz = torch.randn(2, 8, 6, 6).half().contiguous(memory_format=cl)
    w = torch.randn(8, 8, 3, 3).half().contiguous(memory_format=cl)
    x = torch.empty(2, 8, 8, 8).half().contiguous(memory_format=cl)
    geo = ((1, 1), (0, 0), (0, 0), (1, 1), 1)
    try:
        for on in (False, True, False, True):
            with deterministic(on):
                backward.conv_dgrad(dz, w, x, geo)
    finally:
        plans.clear()
    assert ran == [False, True, False, True]


def test_the_per_signature_memo_is_keyed_by_the_mode():
    x = torch.randn(2, 3, dtype=torch.float16)
    with deterministic(False):
        k_plain, _ = ops._memo("op", x, None, None, None, ())
    with deterministic(True):
        k_det, _ = ops._memo("op", x, None, None, None, ())
    assert k_plain != k_det and k_plain[:-1] == k_det[:-1]
    ops._FAST[k_plain] = "remembered"
    try:
        with deterministic(True):
            assert ops._memo("op", x, None, None, None, ())[1] is None  # not served across modes
        with deterministic(False):
            assert ops._memo("op", x, None, None, None, ())[1] == "remembered"
    finally:
        ops._FAST.pop(k_plain, None)


def test_prewarm_looks_for_the_entry_of_its_mode():
    spec = _spec()

    class Cache:
        def __init__(self):
            self.asked = []

        def get(self, key):
            self.asked.append(key)
            return None

    for on in (False, True):
        with deterministic(on):
            cache = Cache()
            rows = prewarm.prewarm([Entry(spec)], dry_run=True, cache=cache)
            assert cache.asked == [loader.cache_digest(spec)] and rows[0].digest == loader.cache_digest(spec)[:16]
