"""Plans follow torch.use_deterministic_algorithms: while it is on, every plan (heuristic or tuned)
is chosen among cuDNN's deterministic engines, is cached under a key of its own, and lives in its
own in-memory slots (the plan LRU, the per-signature memo, the conv backward programs), so a
plan chosen without the filter (or torch's cuBLAS stand-in) never serves a deterministic call,
nor the other way round. CPU: the keys and the deselect call on a recording graph."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

import cudnn_fuse as cf
from cudnn_fuse import engines, loader, ops, plans, prewarm, families
from cudnn_fuse.manifest import Entry
from tuning import RecordingGraph, deterministic




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
            assert engines.deterministic() is on
    assert engines.deterministic() is torch.are_deterministic_algorithms_enabled()
    old = torch.backends.cudnn.deterministic
    try:  # torch's own cuDNN switch counts too
        torch.backends.cudnn.deterministic = True
        assert engines.deterministic() is True
        with deterministic(False):
            assert engines.deterministic() is True
        torch.backends.cudnn.deterministic = False
        assert engines.deterministic() is False
    finally:
        torch.backends.cudnn.deterministic = old


def test_prepare_deselects_nondeterministic_engines_only_while_torch_requires_it():
    import cudnn

    spec = _spec()
    with deterministic(True):
        g = _RecordingGraph()
        engines.prepare(g, spec)
    assert ("deselect_numeric_notes", ([cudnn.numerical_note.NONDETERMINISTIC],)) in g.calls
    names = [c[0] for c in g.calls]
    assert names.index("create_execution_plans") < names.index("deselect_numeric_notes")  # before any build
    assert not any(n.startswith("build_plan") for n in names)
    with deterministic(False):
        g = _RecordingGraph()
        engines.prepare(g, spec)
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
        built.append(engines.deterministic())
        return object()

    lru = loader.PlanLRU(8, builder=builder)
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
            self.det = engines.deterministic()

        def run(self, buffers):
            ran.append(self.det)

    monkeypatch.setattr(loader._LRU, "_builder", lambda spec, device: StandIn())
    loader.clear()
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
        loader.clear()
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

        def get(self, key, count=True):
            self.asked.append(key)
            return None

    for on in (False, True):
        with deterministic(on):
            cache = Cache()
            rows = prewarm.prewarm([Entry(spec)], dry_run=True, cache=cache)
            assert cache.asked == [loader.cache_digest(spec)] and rows[0].digest == loader.cache_digest(spec)[:16]


# ------------------------------------------------------------------ one read of the mode per lookup
#
# torch.use_deterministic_algorithms is process-wide: another thread may switch it at any moment. A call
# keys its memo entry (or its backward slot, or its plan LRU slot) under the mode it read, and must then
# look up, load or build its plan under that same mode, not under one read again later: else a plan chosen
# under one mode is filed under the other's key and serves it (a plan chosen without the filter serving a
# deterministic call). Each test below switches the mode at the moment between two such reads.


def _flip():
    """Switch torch's mode to the other one, as another thread could at this moment."""
    torch.use_deterministic_algorithms(not torch.are_deterministic_algorithms_enabled(), warn_only=True)


_REAL = object()


def _flip_at_first(monkeypatch, name: str, returns=_REAL) -> None:
    """ops.<name> switched for a wrapper whose first call flips the mode (``_flip``), then returns what
    the real function returns (or ``returns``): the switch lands between the two reads around it."""
    real, flips = getattr(ops, name), []

    def wrapper(*args):
        if not flips:
            flips.append(1)
            _flip()
        return real(*args) if returns is _REAL else returns

    monkeypatch.setattr(ops, name, wrapper)


class _ModePlan:
    """A stand-in plan that notes the mode it was built under (engines.deterministic() in the builder)."""

    raw = True
    engine = "stand-in"

    def __init__(self, spec, ran):
        self.spec, self.det, self.ran = spec, engines.deterministic(), ran

    def launch(self, ptrs):
        self.ran.append((self.spec.op, self.det))

    def run(self, buffers):
        self.ran.append((self.spec.op, self.det))


@pytest.fixture
def mode_lru(monkeypatch):
    """The process's plan LRU building _ModePlans; (ran, lru): what ran under which plan's mode."""
    ran = []
    lru = loader.PlanLRU(64, builder=lambda spec, device: _ModePlan(spec, ran))
    monkeypatch.setattr(loader, "_LRU", lru)
    monkeypatch.setattr(ops, "_native_call", None)  # the Python memo (the C call files nothing: it only serves)
    plans.FAST.clear()
    yield ran, lru
    plans.FAST.clear()


def _lru_modes(lru):
    return sorted({k[2] for k in lru._items})


@pytest.mark.parametrize("start", [False, True], ids=["to deterministic", "from deterministic"])
def test_an_op_files_its_plan_under_the_mode_it_was_planned_under(mode_lru, monkeypatch, start):
    """ops._memo reads the mode into the memo key; the plan was then looked up (loader.get_plan) under the
    mode read again. Switched between the two reads, the plan chosen under the new mode was remembered
    under the old mode's key, and every later call of that mode launched it."""
    ran, lru = mode_lru
    real = ops._why_not_fused
    # runs after the memo key was made, before the plan is looked up; None: the cuDNN path, on CPU tensors
    _flip_at_first(monkeypatch, "_why_not_fused", returns=None)
    x, w = torch.randn(4, 8).half(), torch.randn(16, 8).half()
    with deterministic(start), torch.no_grad():
        cf.linear(x, w, None, activation="relu")
        assert torch.are_deterministic_algorithms_enabled() is (not start)  # switched mid-call
    keys = [k for k in ops.memo_keys() if k[0] == "linear"]
    assert len(keys) == 1 and keys[0][-1] is start  # keyed under the mode the call began in
    launch = plans.FAST[keys[0]]
    assert launch.plan.det is start, "a plan chosen under the other mode was filed under this mode's key"
    assert _lru_modes(lru) == [start]
    monkeypatch.setattr(ops, "_why_not_fused", real)
    with deterministic(start), torch.no_grad():
        ran.clear()
        cf.linear(x, w, None, activation="relu")  # served by the memo
    assert ran == [("matmul", start)]


def test_a_backward_graphs_slot_gets_the_plan_of_its_specs_mode(mode_lru, monkeypatch):
    """backward._cached_spec keys the spec (and its plan slot) under the mode it reads; _try then looked
    the plan up under the mode read again, and the slot kept it for every later call of the first mode."""
    from cudnn_fuse import backward

    ran, lru = mode_lru
    _flip_at_first(monkeypatch, "_unlaunchable")  # _try's first step: after _cached_spec read the mode
    cl = torch.channels_last
    dz = torch.randn(2, 8, 6, 6).half().contiguous(memory_format=cl)
    w = torch.randn(8, 8, 3, 3).half().contiguous(memory_format=cl)
    x = torch.empty(2, 8, 8, 8).half().contiguous(memory_format=cl)
    geo = ((1, 1), (0, 0), (0, 0), (1, 1), 1)
    with deterministic(False):
        backward.conv_dgrad(dz, w, x, geo)
    with deterministic(False):
        backward.conv_dgrad(dz, w, x, geo)  # the slot's plan
    assert ran == [("conv_dgrad", False), ("conv_dgrad", False)]
    assert _lru_modes(lru) == [False]


def test_a_conv_backward_program_gets_plans_of_its_keys_mode(mode_lru, monkeypatch):
    """backward.conv_program keys the signature's program under the mode it reads, and the program's
    plans were looked up under the mode read again while it was built."""
    from cudnn_fuse import backward

    ran, lru = mode_lru
    _flip_at_first(monkeypatch, "_conv_layout")  # the program's build, before its plans are looked up
    cl = torch.channels_last
    x = torch.randn(2, 8, 8, 8).half().contiguous(memory_format=cl)
    w = torch.randn(8, 8, 3, 3).half().contiguous(memory_format=cl)
    gy = torch.randn(2, 8, 6, 6).half().contiguous(memory_format=cl)
    geo = ((1, 1), (0, 0), (0, 0), (1, 1), 1)
    with deterministic(True):
        backward.conv_program(x, w, None, gy, geo, None, 0.01, True, True, False)
    with deterministic(True):
        backward.conv_program(x, w, None, gy, geo, None, 0.01, True, True, False)  # the remembered program
    assert ran == [("conv_dgrad", True), ("conv_wgrad", True)] * 2
    assert _lru_modes(lru) == [True]


def test_a_training_convs_remembered_call_keeps_a_forward_launch_of_its_mode(mode_lru, monkeypatch):
    """ops.conv2d remembers a training call (its validated call, under the ":grad" key with the mode)
    whose slot keeps the forward's launch; the forward looked that launch up under the mode read again,
    and the slot kept a launch of the other mode for every later call of the key's mode."""
    from cudnn_fuse import backward

    ran, lru = mode_lru
    # after the ":grad" key was made, before the autograd forward's own lookup
    _flip_at_first(monkeypatch, "_via_custom_op")
    monkeypatch.setattr(ops, "_why_not_fused", lambda op, ts: None)  # the cuDNN path, on CPU tensors
    monkeypatch.setattr(backward, "usable", lambda *ts: False)  # torch's backward: the forward is the point
    cl = torch.channels_last
    x = torch.randn(2, 8, 6, 6).half().to(memory_format=cl).requires_grad_()
    w = torch.randn(8, 8, 3, 3).half().to(memory_format=cl).requires_grad_()
    for _ in range(3):
        with deterministic(False):
            cf.conv2d(x, w, None, padding=1, activation="relu")
    forwards = [r for r in ran if r[0] == "conv2d"]
    assert forwards[1:] == [("conv2d", False)] * 2, "a forward launch of the other mode served the key's mode"


class _BuiltGraph(RecordingGraph):
    """A recording graph that also answers what a stored entry asks of its plan."""

    _plan_index = 0

    def get_engine_and_knobs_at_index(self, i):
        return 7, {}

    def serialize(self, as_bytes=True):
        return b"blob"


class _Cache:
    """A disk cache that has nothing and keeps what is put, with a directory for the tune lock."""

    def __init__(self, path):
        self.dir, self.puts = path, []

    def get(self, key, count=True):
        return None

    def put(self, key, meta, blob, pinned=False):
        self.puts.append((key, meta))
        return True


class _FlipLRU(loader.PlanLRU):
    """The plan LRU, the mode switched right after it made its key (its first lookup), before the load."""

    def _lookup(self, key):
        if not getattr(self, "flipped", False):
            self.flipped = True
            _flip()
        return super()._lookup(key)


@pytest.mark.parametrize("tuned", [False, True], ids=["heuristic", "tuned"])
@pytest.mark.parametrize("where", ["plan lru, before the load", "plan lru, during the build", "load_or_build"])
def test_a_build_files_its_entry_under_the_mode_it_chose_its_engine_under(monkeypatch, tmp_path, tuned, where):
    """The plan LRU read the mode for its key; the loader read it again for the disk cache's key, again
    for the engine filter (engines.prepare), again in the autotuner and again for the entry's record.
    Switched between two of those reads, a plan chosen among all engines was stored under the
    deterministic key (or the other way round), with a record of the other mode, and kept in the plan
    LRU under the first mode."""
    import cudnn

    from cudnn_fuse import autotune

    graphs, tuner_modes = [], []

    def build_graph(spec, handle):  # after the cache's key was made, before the engines are filtered
        if where != "plan lru, before the load":
            _flip()
        graphs.append(_BuiltGraph())
        return graphs[-1]

    def tune(g, spec, h, device, uids, roles, get_plan=None):
        tuner_modes.append(engines.deterministic())  # autotune.tune reads it so for its own filter
        return None, types.SimpleNamespace(index=0), []

    pc = _Cache(tmp_path)
    monkeypatch.setattr(loader, "_cache", lambda device=None: pc)
    monkeypatch.setattr(autotune, "autotune_enabled", lambda: tuned)
    monkeypatch.setattr(autotune, "tune", tune)
    monkeypatch.setattr(autotune, "torch_wins", lambda w, t: False)
    monkeypatch.setattr(autotune, "gemm_wins", lambda w, t: False)
    monkeypatch.setattr(loader, "handle_for", lambda device: types.SimpleNamespace(handle=1))
    monkeypatch.setattr(loader, "held", lambda h, device: contextlib.nullcontext(h))
    monkeypatch.setattr(loader, "build_graph", build_graph)
    monkeypatch.setattr(loader, "Plan", lambda spec, g, device, engine=None: types.SimpleNamespace(
        spec=spec, graph=g, device=device, engine="eng7", workspace_size=0))
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "stand-in")
    spec = _spec()
    for start in (False, True):
        lru = _FlipLRU(4) if where == "plan lru, before the load" else loader.PlanLRU(4)  # builder: load_or_build
        pc.puts.clear()
        with deterministic(start):
            plain = spec.digest()
            want = loader.cache_digest(spec)
            plan = loader.load_or_build(spec, 0) if where == "load_or_build" else lru.get(spec, 0)
            assert torch.are_deterministic_algorithms_enabled() is (not start)  # switched mid-call
        filtered = ("deselect_numeric_notes", ([cudnn.numerical_note.NONDETERMINISTIC],)) in plan.graph.calls
        assert filtered is start, "the engines were filtered under the other mode"
        if tuned:
            assert tuner_modes[-1] is start
        entry = [(k, m) for k, m in pc.puts if not loader.is_record(m)]
        fam = [k for k, m in pc.puts if m.get("kind") == "family-record"]
        if tuned:  # the shape family's record, under the mode too
            with deterministic(start):
                assert fam == [loader.family_record_key(families.family(spec))]
        assert [k for k, _ in entry] == [want] and (want == plain) is (not start)
        assert entry[0][1]["deterministic"] is start
        if where != "load_or_build":
            assert list(lru._items) == [(spec, 0, start)]  # kept under the mode it was built under
