"""cudnn_fuse._native, the memoized op call in C: it must serve exactly the calls ops._memo serves,
with the same keys, allocate and launch as ops._PyLaunch does, replay a plan's kernel captures as
Plan.launch does, and hand everything else to the plan's Python launch. The driver is a ctypes
stand-in here (a C-callable function recording each launch); the H200 runs are
tests/test_gpu_native.py."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import sys
import threading
import types

import pytest
import torch

import cudnn_fuse as cf
from cudnn_fuse import handles, launch_graphs, loader, ops, plans
from tests.racing import race

native = ops._native
needs_native = pytest.mark.skipif(native is None, reason="cudnn_fuse._native is not built")
ATTRS = ("relu", False, 0.01)


def test_the_module_is_built_wherever_a_c_compiler_is():
    """setup.py's extension is optional (an install without a compiler keeps the Python path), so a
    broken build would pass silently: where this machine has a compiler, it must have been built."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine")
    assert native is not None
    assert ops.native_enabled() is (os.environ.get("CUDNN_FUSE_NATIVE", "1") not in ("0", "off", "false", "no"))


@pytest.fixture(autouse=True)
def _clean():
    on = ops.native_enabled()
    plans.FAST.clear()
    yield
    ops.set_native(on)
    plans.FAST.clear()


LAUNCH_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)


class FakeLaunch:
    """cuLaunchKernelEx's stand-in, callable from C: records what each launch was given."""

    def __init__(self, rc=0):
        self.calls, self.rc, self.record, self.count = [], rc, True, 0
        self.fn = LAUNCH_FN(self._launch)

    def _launch(self, cfg, func, params, extra):
        self.count += 1
        if not self.record:
            return self.rc
        c = launch_graphs._LaunchConfig.from_address(cfg)
        self.calls.append({"cfg": cfg, "grid": (c.gx, c.gy, c.gz), "block": (c.bx, c.by, c.bz), "smem": c.smem,
                           "stream": c.hStream or 0, "attrs": [c.attrs[i].id for i in range(c.numAttrs)],
                           "func": func, "params": params, "extra": extra})
        return self.rc


def kernel_replay(fake, stream=7, params=0x5000, extra=0):
    node = launch_graphs._KernelNodeParams()
    node.gx, node.gy, node.gz, node.bx, node.by, node.bz, node.smem = 2, 3, 1, 128, 1, 1, 4096
    node.kernelParams, node.extra = params, extra
    value = launch_graphs._AttrValue()
    value.words[0] = 2 | (1 << 32)
    value.words[1] = 1
    return launch_graphs.KernelReplay(fake.fn, 0x100, 0x300, node, [(4, value)], stream)


# ------------------------------------------------------------------------------ KernelLaunch


@needs_native
def test_a_kernel_replay_launches_from_c_with_its_own_copy_of_the_config():
    fake = FakeLaunch()
    k = kernel_replay(fake)
    assert k.native_bound
    assert k.native_launch(55) == 0
    call = fake.calls[-1]
    assert call["stream"] == 55 and call["grid"] == (2, 3, 1) and call["block"] == (128, 1, 1)
    assert call["smem"] == 4096 and call["attrs"] == [4]
    assert (call["func"], call["params"], call["extra"]) == (0x300, 0x5000, None)
    # a copy: the shared config (which the Python path retargets under the handle lock) is untouched
    assert call["cfg"] != ctypes.addressof(k.cfg) and k.cfg.hStream == 7 and k.stream == 7
    k2 = kernel_replay(fake, params=0, extra=0x6000)  # cuBLAS's kernels: one argument buffer
    assert k2.native_launch(7) == 0 and (fake.calls[-1]["params"], fake.calls[-1]["extra"]) == (None, 0x6000)
    failing = FakeLaunch(rc=719)
    assert kernel_replay(failing).native_launch(7) == 719  # the CUresult comes back as it is


@needs_native
def test_a_stand_in_launch_in_python_stays_unbound_and_bad_layouts_are_refused():
    node = launch_graphs._KernelNodeParams()
    k = launch_graphs.KernelReplay(lambda *a: 0, 0x100, 0x300, node, [], 7)
    assert not k.native_bound
    with pytest.raises(RuntimeError, match="not bound"):
        k.native_launch(7)
    for size, off in ((0, 0), (4096, 0), (56, 52), (56, sys.maxsize)):  # the last once overflowed the bound
        with pytest.raises(ValueError):
            k._bind(0x1000, 0x2000, size, off, 0x300, 0, 0)
    with pytest.raises(ValueError):
        k._bind(0, 0x2000, 56, 32, 0x300, 0, 0)


# ---------------------------------------------------------------------------------- the memo


def _operands(dtype=torch.float16):
    torch.manual_seed(0)
    return (torch.randn(4, 8, dtype=dtype), torch.randn(6, 8, dtype=dtype), torch.randn(6, dtype=dtype),
            torch.randn(4, 6, dtype=dtype))


@needs_native
@pytest.mark.parametrize("case", ["plain", "no bias", "residual", "training", "grad off", "deterministic"])
def test_the_c_memo_serves_exactly_the_keys_ops_memo_makes(case, monkeypatch):
    x, w, b, r = _operands()
    ops_args = {"plain": (x, w, b, None), "no bias": (x, w, None, None), "residual": (x, w, b, r),
                "training": (x, w.clone().requires_grad_(), b, None), "grad off": (x, w.clone().requires_grad_(), b, None),
                "deterministic": (x, w, b, None)}[case]
    ctx = torch.no_grad() if case == "grad off" else contextlib.nullcontext()
    if case == "deterministic":
        monkeypatch.setattr(ops, "_det_cudnn", lambda: True)
    seen = []
    with ctx:
        key, _ = ops._memo("linear", *ops_args, ATTRS)
        assert key[0] == ("linear:grad" if case == "training" else "linear")
        plans.FAST[key] = lambda *a: seen.append(a) or "served"
        assert native.call("linear", "linear:grad", *ops_args, ATTRS) == "served"
        assert len(seen) == 1 and all(s is o for s, o in zip(seen[0], ops_args))
        other = ("gelu", False, 0.01)  # another attribute: another key, a miss
        assert native.call("linear", "linear:grad", *ops_args, other) is None
        assert native.call("matmul", "matmul:grad", *ops_args, ATTRS) is None
    if case == "deterministic":  # the mode is in the key: the other mode's call misses
        monkeypatch.setattr(ops, "_det_cudnn", lambda: False)
        assert native.call("linear", "linear:grad", *ops_args, ATTRS) is None


@needs_native
@pytest.mark.parametrize("case", ["parameter first", "not a tensor", "unhashable", "recording", "functorch"])
def test_the_c_memo_declines_where_ops_memo_declines(case, monkeypatch, tmp_path):
    x, w, b, _ = _operands()
    served = []
    first, bias, attrs = x, b, ATTRS
    if case == "parameter first":  # type(a) is not torch.Tensor: the memo never serves it
        first = torch.nn.Parameter(x, requires_grad=False)
    elif case == "not a tensor":
        bias = [0.0] * 6
    elif case == "unhashable":
        attrs = (["relu"], False, 0.01)
    elif case == "functorch":
        monkeypatch.setattr(ops, "_functorch_on", lambda: True)
    with contextlib.ExitStack() as stack:
        if case == "recording":
            stack.enter_context(cf.record(str(tmp_path / "m.json")))
        assert ops._memo("linear", first, w, bias, None, attrs) == (None, None)
        # an entry under the key a plain call would have: never reached
        key, _ = ops._memo("linear", x, w, b, None, ATTRS) if case != "recording" else (("linear",), None)
        plans.FAST[key] = lambda *a: served.append(a) or "served"
        assert native.call("linear", "linear:grad", first, w, bias, None, attrs) is None
    assert served == []


@needs_native
def test_the_public_ops_take_the_c_memo_and_the_python_path_on_a_miss(monkeypatch):
    x, w, b, _ = _operands(torch.float32)
    calls = []
    real = native.call
    monkeypatch.setattr(ops, "_native_call", lambda *a: calls.append(a[0]) or real(*a))
    with torch.no_grad():
        want = cf.linear(x, w, b, activation="relu")  # CPU: no plan, so no entry; the reference runs
        key, _ = ops._memo("linear", x, w, b, None, ATTRS)
        plans.FAST[key] = lambda *a: "from the memo"
        assert cf.linear(x, w, b, activation="relu") == "from the memo"
        plans.FAST.clear()
        torch.testing.assert_close(cf.linear(x, w, b, activation="relu"), want)
    assert calls == ["linear"] * 3
    ops.set_native(False)
    assert ops._native_call is None and ops._Launch is ops._PyLaunch and not ops.native_enabled()
    with torch.no_grad():
        torch.testing.assert_close(cf.linear(x, w, b, activation="relu"), want)


def test_set_native_switches_the_entries_and_clears_the_memo():
    plans.FAST["k"] = 1
    assert ops.set_native(False) is False and plans.FAST == {} and ops._Launch is ops._PyLaunch
    assert ops.set_native(True) is (native is not None)
    assert ops._Launch is (ops._native_launch if native is not None else ops._PyLaunch)
    with pytest.raises(TypeError, match="enabled must be a bool"):
        ops.set_native(1)


def test_cudnn_fuse_native_0_starts_a_process_on_the_python_path():
    code = "from cudnn_fuse import ops; print(ops.native_enabled(), ops._Launch.__name__)"
    env = {**os.environ, "CUDNN_FUSE_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "_PyLaunch"]


# ------------------------------------------------------------------------- the guarded index

needs_guards = pytest.mark.skipif(native is None or ops._tensor_guards is None,
                                  reason="cudnn_fuse._native or torch's TensorGuards is missing")


def _hits():
    st = native.stats()
    return st["guarded_hits"], st["keyed_hits"]


def _index_lists():
    return [v for k, v in plans.FAST.items() if isinstance(k, tuple) and k and k[0] is native.INDEX_MARK]


@needs_guards
def test_a_keyed_hit_registers_a_guard_that_serves_the_next_calls():
    x, w, b, _ = _operands()
    key, _ = ops._memo("linear", x, w, b, None, ATTRS)
    seen = []
    plans.FAST[key] = lambda *a: seen.append(a) or "served"
    g0, k0 = _hits()
    assert native.call("linear", "linear:grad", x, w, b, None, ATTRS) == "served"
    assert _hits() == (g0, k0 + 1) and len(_index_lists()) == 1 and len(_index_lists()[0]) == 1
    assert ops.memo_keys() == [key]  # the index shares the dict, not the memo's keys
    x2 = torch.randn(4, 8, dtype=torch.float16)  # another tensor, the same metadata
    for _ in range(3):
        assert native.call("linear", "linear:grad", x2, w, b, None, ATTRS) == "served"
    assert _hits() == (g0 + 3, k0 + 1) and len(_index_lists()[0]) == 1
    assert seen[-1][0] is x2
    plans.FAST.clear()  # whatever clears the memo clears the index
    assert native.call("linear", "linear:grad", x2, w, b, None, ATTRS) is None and _index_lists() == []


@needs_guards
@pytest.mark.parametrize("change", ["stride", "dtype", "requires_grad", "inference_mode", "another shape"])
def test_a_guard_that_fails_takes_the_exact_key(change):
    """Whatever the guard rejects goes to the exact key: a call that key would serve is served (and gets
    its own guard), one it would not is a miss for the Python path."""
    x, w, b, _ = _operands()
    key, _ = ops._memo("linear", x, w, b, None, ATTRS)
    plans.FAST[key] = lambda *a: "first"
    assert native.call("linear", "linear:grad", x, w, b, None, ATTRS) == "first"
    ctx = contextlib.nullcontext()
    if change == "stride":  # the same shape, transposed memory
        x = torch.randn(8, 4, dtype=torch.float16).t()
    elif change == "dtype":
        x = x.float()
    elif change == "requires_grad":
        w = w.clone().requires_grad_()
    elif change == "inference_mode":
        ctx = torch.inference_mode()
    elif change == "another shape":
        x = torch.randn(5, 8, dtype=torch.float16)
    g0, k0 = _hits()
    with ctx:
        out = native.call("linear", "linear:grad", x, w, b, None, ATTRS)
        if change == "inference_mode":  # the exact key holds no dispatch state: it serves, with a new guard
            assert out == "first" and _hits() == (g0, k0 + 1)
            assert native.call("linear", "linear:grad", x, w, b, None, ATTRS) == "first"
            assert _hits() == (g0 + 1, k0 + 1)
        else:
            assert out is None and _hits() == (g0, k0)
            other, _ = ops._memo("linear", x, w, b, None, ATTRS)
            assert other != key and other is not None
            plans.FAST[other] = lambda *a: "second"
            assert native.call("linear", "linear:grad", x, w, b, None, ATTRS) == "second"
            assert native.call("linear", "linear:grad", x, w, b, None, ATTRS) == "second"
            assert _hits() == (g0 + 1, k0 + 1)
    x0, w0, b0, _ = _operands()
    assert native.call("linear", "linear:grad", x0, w0, b0, None, ATTRS) == "first"  # the first still guarded


@needs_guards
def test_operands_passed_twice_keep_the_exact_key():
    """TensorGuards refuses aliased operands, so such a call registers no guard (it would never pass)."""
    a = torch.randn(6, 6, dtype=torch.float16)
    key, _ = ops._memo("matmul", a, a, None, None, ATTRS)
    plans.FAST[key] = lambda *args: "served"
    g0, k0 = _hits()
    for _ in range(3):
        assert native.call("matmul", "matmul:grad", a, a, None, None, ATTRS) == "served"
    assert _hits() == (g0, k0 + 3) and _index_lists() == []


@needs_guards
def test_a_full_memo_takes_no_new_guards(monkeypatch):
    monkeypatch.setattr(plans, "FAST_CAPACITY", 1)
    x, w, b, _ = _operands()
    key, _ = ops._memo("linear", x, w, b, None, ATTRS)
    plans.FAST[key] = lambda *a: "served"
    assert native.call("linear", "linear:grad", x, w, b, None, ATTRS) == "served"
    assert _index_lists() == [] and len(plans.FAST) == 1


@needs_guards
def test_each_index_list_keeps_the_latest_guards_first():
    """Different operands with the same input shape and attributes share one list (the weight differs):
    each is found, the one found moves to the front, and the list keeps at most GUARDS_PER_KEY."""
    x = torch.randn(4, 8, dtype=torch.float16)
    ws = [torch.randn(n, 8, dtype=torch.float16) for n in range(2, 12)]
    for i, w in enumerate(ws):
        key, _ = ops._memo("linear", x, w, None, None, ATTRS)
        plans.FAST[key] = lambda *a, i=i: i
        assert native.call("linear", "linear:grad", x, w, None, None, ATTRS) == i
    lists = _index_lists()
    assert len(lists) == 1 and len(lists[0]) == 8
    g0, _ = _hits()
    assert native.call("linear", "linear:grad", x, ws[-3], None, None, ATTRS) == len(ws) - 3
    assert _hits()[0] == g0 + 1 and lists[0][0][1](None) == len(ws) - 3  # moved to the front
    assert native.call("linear", "linear:grad", x, ws[0], None, None, ATTRS) == 0  # dropped: the exact key


_REENTRY_CHILD = """
import sys, torch
from cudnn_fuse import ops, plans
native = ops._native
HOOK = [None]


class S(torch.Tensor):  # sizes and strides answered by Python: a guard's check runs this code
    @staticmethod
    def __new__(cls, elem):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(), dtype=elem.dtype,
                                                 device=elem.device, dispatch_sizes_strides_policy="strides")
        r.elem = elem
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if HOOK[0] is not None:
            h, HOOK[0] = HOOK[0], None
            h()
        e = args[0].elem
        table = {torch.ops.aten.sym_size.default: lambda: e.shape, torch.ops.aten.sym_stride.default: e.stride,
                 torch.ops.aten.sym_numel.default: e.numel, torch.ops.aten.dim.default: e.dim,
                 torch.ops.aten.sym_storage_offset.default: e.storage_offset}
        if func in table:
            return table[func]()
        raise NotImplementedError(func)


ATTRS = ("relu", False, 0.01)
x = torch.randn(4, 8, dtype=torch.float16)
wa, wb = torch.randn(6, 8, dtype=torch.float16), torch.randn(7, 8, dtype=torch.float16)
for w in (wa, wb):
    key, _ = ops._memo("linear", x, w, None, None, ATTRS)
    plans.FAST[key] = lambda *a: "served"
with torch.no_grad():
    for w in (wa, wb):
        native.call("linear", "linear:grad", x, S(w), None, None, ATTRS)
    lists = [v for k, v in plans.FAST.items() if isinstance(k, tuple) and k and k[0] is native.INDEX_MARK]
    assert len(lists) == 1 and len(lists[0]) == 2, lists
    lst, saved = lists[0], []
    if sys.argv[1] == "shrink":  # the pairs stay alive elsewhere, the list empties mid-loop
        HOOK[0] = lambda: (saved.extend(lst), lst.clear())
    else:  # the pair being checked, and its TensorGuards, lose their last reference mid-check
        HOOK[0] = lambda: lst.clear()
    print(native.call("linear", "linear:grad", x, S(wa), None, None, ATTRS))
"""


@needs_guards
@pytest.mark.parametrize("mode", ["shrink", "free"])
def test_a_guard_check_that_changes_its_list_is_survived(mode):
    """A guard's check can run Python (an operand whose sizes come from __torch_dispatch__), which can
    change the index list being walked, or drop the guard being checked. The C walk once kept the
    list's length and a borrowed pair across the check: a read past the list, or of freed memory
    (a segfault). Run in a child, so a regression is a failed test, not a dead run."""
    p = subprocess.run([sys.executable, "-c", _REENTRY_CHILD, mode], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "served", (p.returncode, p.stdout[-500:], p.stderr[-2000:])


def _child(code: str, *args: str) -> str:
    """``code`` run by a fresh interpreter (a crash is a failed test, not a dead run): its stdout, stripped,
    once it has exited 0."""
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, (p.returncode, p.stdout[-500:], p.stderr[-2000:])
    return p.stdout.strip()


# A weight whose is_neg() first runs what a test put in HOOK: what another thread may do while the C call
# has released the GIL there (the children below).
_HOOKED_IS_NEG = """
class W(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "is_neg" and HOOK:
            HOOK.pop()()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
"""

_DROPPED_ENTRY_CHILD = """
import torch
from cudnn_fuse import ops, plans
native = ops._native
ATTRS = ("relu", False, 0.01)
events, HOOK = [], []


class Entry:  # a remembered call whose only reference is the memo's
    def __call__(self, *a):
        events.append("called")
        return "served"

    def __del__(self):
        events.append("freed")


""" + _HOOKED_IS_NEG + """

x = torch.randn(4, 8, dtype=torch.float16)
w = torch.randn(6, 8, dtype=torch.float16).as_subclass(W)
key, _ = ops._memo("linear", x, w, None, None, ATTRS)
assert key is not None
plans.FAST[key] = Entry()
HOOK.append(lambda: (plans.FAST.clear(), events.append("cleared")))
with torch.no_grad():
    out = native.call("linear", "linear:grad", x, w, None, None, ATTRS)
print(out, events, len(plans.FAST))
"""


@needs_native
def test_an_entry_dropped_from_the_memo_while_its_key_is_checked_is_survived():
    """The exact key's hit asks each operand's is_neg() before it calls the entry. That call goes into
    torch, whose bindings release the GIL (and a subclass's __torch_function__ runs Python), so another
    thread can replace or clear the memo meanwhile. The C call once held the entry as a borrowed
    reference across it: the entry could be freed and then called (segmentation faults of threaded C-path
    calls on the H200, 2026-12-04). Here the clearing runs inside is_neg itself; the entry must outlive
    the call. Run in a child, so a regression is a failed test, not a dead run."""
    # served once, then freed: the cleared memo holds nothing (the call once filed the dropped entry under
    # a guard in the emptied memo, which then served it until the next clear)
    assert _child(_DROPPED_ENTRY_CHILD) == "served ['cleared', 'called', 'freed'] 0"


_SNAPSHOT_CHILD = """
import torch
from cudnn_fuse import ops, plans
native = ops._native
ATTRS = ("relu", False, 0.01)
HOOK = []


class Entry:
    def __init__(self, name):
        self.name = name

    def __call__(self, *a):
        return self.name


""" + _HOOKED_IS_NEG + """

x = torch.randn(4, 8, dtype=torch.float16)
w = torch.randn(6, 8, dtype=torch.float16).as_subclass(W)
k_inf, _ = ops._memo("linear", x, w, None, None, ATTRS)
w.requires_grad_(True)
k_grad, _ = ops._memo("linear", x, w, None, None, ATTRS)
w.requires_grad_(False)
assert k_inf[0] == "linear" and k_grad[0] == "linear:grad", (k_inf[0], k_grad[0])
plans.FAST[k_inf], plans.FAST[k_grad] = Entry("inference"), Entry("training")
HOOK.append(lambda: w.requires_grad_(True))
first = native.call("linear", "linear:grad", x, w, None, None, ATTRS)  # found frozen, unfrozen meanwhile
second = native.call("linear", "linear:grad", x, w, None, None, ATTRS)  # w requires grad now
print(first, second)
"""


@needs_guards
def test_a_guard_describes_the_operands_its_key_was_made_from():
    """The guard filed for an exact-key hit is made before is_neg() runs. Made after, it described
    operands another thread had changed meanwhile (a frozen weight unfrozen), paired with the entry
    of the earlier key: every later training call passed that guard and got the inference launch
    (no grad_fn, gradients lost) until the memo was cleared. Here the change runs inside is_neg()."""
    assert _child(_SNAPSHOT_CHILD) == "inference training"


_MEMO_CHURN_CHILD = """
import sys, threading, time, torch
from cudnn_fuse import ops, plans
native = ops._native
ATTRS = ("relu", False, 0.01)
x, w = torch.randn(4, 8), torch.randn(6, 8)
key, _ = ops._memo("linear", x, w, None, None, ATTRS)


class Entry:
    def __call__(self, *a):
        return 1


stop, calls, errors = time.time() + float(sys.argv[1]), [0], []


def caller():
    try:
        with torch.no_grad():
            while time.time() < stop:
                r = native.call("linear", "linear:grad", x, w, None, None, ATTRS)
                assert r in (1, None), r
                calls[0] += 1
    except Exception as exc:
        errors.append(repr(exc))


def replacer():  # a memo replaced and cleared as concurrent first calls and loader.clear() do
    while time.time() < stop:
        plans.FAST.clear()
        plans.FAST[key] = Entry()


threads = [threading.Thread(target=caller) for _ in range(3)] + [threading.Thread(target=replacer)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("ok" if calls[0] > 1000 and not errors else ("failed", calls[0], errors[:3]))
"""


@needs_native
def test_threads_calling_while_the_memo_is_replaced_do_not_crash():
    """Plain tensors, three threads calling one remembered signature in C while a fourth replaces and
    clears the memo. Before the entry was held across is_neg() (which releases the GIL) this child
    died of a segmentation fault in about half of its 1-2 s runs on the 2-core CPU machine; the test
    above fails every time without it. Bounded by time, not a timing measurement."""
    assert _child(_MEMO_CHURN_CHILD, "3") == "ok"


# ------------------------------------------------------------------ Launch: allocation, pointers


class RecordingPlan:
    raw = True

    def __init__(self):
        self.launched = []

    def launch(self, ptrs):
        self.launched.append(list(ptrs))


@pytest.mark.parametrize("path", ["python", "native"])
@pytest.mark.parametrize("amax", [False, True])
def test_both_launch_types_allocate_and_pass_pointers_alike(path, amax):
    if path == "native" and native is None:
        pytest.skip("cudnn_fuse._native is not built")
    make = ops._PyLaunch if path == "python" else ops._native_launch
    x, w, b, r = _operands(torch.bfloat16)
    y = torch.empty(6, 4, dtype=torch.bfloat16).t()  # a transposed output: its strides are kept
    plan = RecordingPlan()
    launch = make(plan, y, amax, x)
    out = launch(x, w, None, r)
    y2, am = out if amax else (out, None)
    assert y2.shape == (4, 6) and y2.stride() == (1, 4) and y2.dtype == torch.bfloat16
    want = [x.data_ptr(), w.data_ptr(), r.data_ptr(), y2.data_ptr()]
    if amax:
        assert am.shape == () and am.dtype == torch.float32
        want.append(am.data_ptr())
    assert plan.launched == [want]
    other = make(plan, torch.empty(4, 6, dtype=torch.float32), False, x)(x, w, b, None)  # not x's dtype
    assert other.dtype == torch.float32 and other.shape == (4, 6)


@pytest.mark.parametrize("path", ["python", "native"])
@pytest.mark.parametrize("helper", [True, False])
def test_a_0_dim_output_with_amax_gets_a_float32_amax(path, helper, monkeypatch):
    """A matmul of two 1-D operands has a 0-dim y, whose size is the empty tuple as amax's is: the
    amax buffer is still float32, with torch's allocation helper or without it (a plan with no
    launch graphs on CUDA, or a torch without the helper: the generic calls). The C path once told
    the two allocations apart by their size tuple and gave amax a's dtype."""
    if path == "native" and native is None:
        pytest.skip("cudnn_fuse._native is not built")
    if not helper:
        monkeypatch.setattr(ops, "_alloc_cpu", None)
    make = ops._PyLaunch if path == "python" else ops._native_launch
    a, b = torch.randn(8, dtype=torch.float16), torch.randn(8, dtype=torch.float16)
    plan = RecordingPlan()
    y, am = make(plan, torch.empty((), dtype=torch.float16), True, a)(a, b, None, None)
    assert y.shape == () and y.dtype == torch.float16
    assert am.shape == () and am.dtype == torch.float32
    assert plan.launched == [[a.data_ptr(), b.data_ptr(), y.data_ptr(), am.data_ptr()]]


@needs_native
def test_an_uninitialised_launch_raises_instead_of_crashing():
    """Launch.__new__ without __init__ leaves every field empty: reading one or calling it must raise
    (it crashed the process). Run in a child, so a regression is a failed test, not a dead run."""
    code = ("import torch\n"
            "from cudnn_fuse import _native\n"
            "L = _native.Launch.__new__(_native.Launch)\n"
            "for f in (lambda: L.plan, lambda: L(torch.zeros(2), None, None, None)):\n"
            "    try:\n"
            "        f()\n"
            "    except RuntimeError as e:\n"
            "        assert 'not initialised' in str(e), e\n"
            "    else:\n"
            "        raise SystemExit('no error')\n"
            "print('ok')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", (p.returncode, p.stderr[-2000:])


@needs_native
def test_a_launch_is_not_initialised_twice():
    """Re-running __init__ on a live Launch cleared its plan first, and the old plan's __del__ (Python)
    could call the half-cleared Launch, which then called a method on no plan (a segmentation fault).
    It is refused. In a child, so a regression is a failed test, not a dead run."""
    code = ("import torch\n"
            "from cudnn_fuse import _native\n"
            "class P:\n"
            "    raw = True\n"
            "    def launch(self, ptrs): pass\n"
            "args = ((4, 6), (6, 1), torch.float16, torch.device('cpu'), False, True)\n"
            "L = _native.Launch(P(), *args)\n"
            "try:\n"
            "    L.__init__(P(), *args)\n"
            "except TypeError as e:\n"
            "    assert 'already initialised' in str(e), e\n"
            "else:\n"
            "    raise SystemExit('no error')\n"
            "print('ok', type(L.plan).__name__)\n")
    assert _child(code) == "ok P"


@needs_native
def test_an_operand_whose_data_ptr_is_no_int_raises_its_error():
    """A subclass operand whose data_ptr() answers no int: the C launch returned None with the
    conversion's TypeError still set (a SystemError in the caller). Now the error itself comes out."""
    class B(torch.Tensor):
        def data_ptr(self):
            return None

    a, b = torch.randn(4, 8).half(), torch.randn(6, 8).half().as_subclass(B)
    launch = ops._native_launch(RecordingPlan(), torch.empty(4, 6, dtype=torch.float16), False, a)
    with pytest.raises(TypeError):
        launch(a, b, None, None)


def _misaligned_like(t: torch.Tensor) -> torch.Tensor:
    """A view with t's shape and strides (so the same memo key) whose data starts 2 bytes off."""
    flat = torch.randn(t.numel() + 8, dtype=t.dtype)
    v = flat[1:1 + t.numel()].view(t.shape)
    assert v.stride() == t.stride() and v.data_ptr() % 16 and t.data_ptr() % 16 == 0
    return v


@pytest.mark.parametrize("path", ["python", "native"])
@pytest.mark.parametrize("view", ["misaligned a", "negated a", "negated b"])
def test_an_unlaunchable_view_of_a_remembered_signature_is_not_launched(path, view):
    """The memo key holds shapes, strides, dtypes and devices, not addresses nor neg bits:

    - a view at an odd offset has the key of an aligned tensor that was remembered, and cuDNN refuses
      its pointer;
    - a negated view (the .imag of a .conj(), torch._neg_view) has a plain tensor's key, and memory
      holding the values unnegated: a raw pointer would compute with the wrong sign.

    Neither memo path launches them (twice: the plain call in between registers a C guard); the call
    goes to the slow path, whose _run falls back to torch."""
    if path == "native" and native is None:
        pytest.skip("cudnn_fuse._native is not built")
    if path == "python":
        ops.set_native(False)
    x, w, _, _ = _operands()
    plan = RecordingPlan()
    key, _ = ops._memo("linear", x, w, None, None, ATTRS)
    plans.FAST[key] = ops._Launch(plan, torch.empty(4, 6, dtype=torch.float16), False, x)
    odd = {"misaligned a": (_misaligned_like(x), w), "negated a": (torch._neg_view(x), w),
           "negated b": (x, torch._neg_view(w))}[view]
    assert ops._memo("linear", *odd, None, None, ATTRS)[0] == key
    with torch.no_grad():
        if path == "native":
            for _ in range(2):
                assert native.call("linear", "linear:grad", *odd, None, None, ATTRS) is None
                assert isinstance(native.call("linear", "linear:grad", x, w, None, None, ATTRS), torch.Tensor)
        assert ops._memo("linear", *odd, None, None, ATTRS) == (key, None)
        assert ops._memo("linear", x, w, None, None, ATTRS)[1] is plans.FAST[key]
    assert [p[0] for p in plan.launched] == ([x.data_ptr()] * 2 if path == "native" else [])


def test_a_misaligned_operand_runs_torchs_op_not_the_plan(monkeypatch):
    """_run (the first call's launch) and backward._try (every training graph) decline operands off
    the graphs' alignment before asking for a plan: cuDNN would refuse the launch."""
    from cudnn_fuse import backward

    monkeypatch.setattr(loader, "get_plan", lambda *a: pytest.fail("a plan was asked for misaligned operands"))
    x = torch.randn(4, 8, dtype=torch.float16)
    xm = _misaligned_like(x)
    before = plans.STATS.fallbacks
    plan, out = ops._run("linear", object(), [xm, torch.empty(4, 8, dtype=torch.float16)], lambda: "torch's")
    assert (plan, out) == (None, "torch's") and plans.STATS.fallbacks == before + 1
    assert backward._try("linear_backward", object(), [x, xm], quiet=True) is False
    assert backward._try("linear_backward", object(), [xm], quiet=False) is False
    assert plans.STATS.fallbacks == before + 2


def test_a_negated_operand_runs_torchs_op_not_the_plan(monkeypatch):
    """_run and backward._try decline a negated view before asking for a plan, and the op's answer is
    torch's, with the sign the view reads as (CPU: the op's own reference path)."""
    from cudnn_fuse import backward

    monkeypatch.setattr(loader, "get_plan", lambda *a: pytest.fail("a plan was asked for a negated view"))
    x = torch.randn(4, 8, dtype=torch.float16)
    xn = torch._neg_view(x)
    assert ops._unlaunchable([x, None]) is None
    assert ops._unlaunchable([None, xn]) == ops.NEGATED
    before = plans.STATS.fallbacks
    plan, out = ops._run("linear", object(), [xn, torch.empty(4, 8, dtype=torch.float16)], lambda: "torch's")
    assert (plan, out) == (None, "torch's") and plans.STATS.fallbacks == before + 1
    assert backward._try("linear_backward", object(), [x, xn], quiet=True) is False
    z = torch.randn(4, 8, dtype=torch.complex64)
    w = torch.randn(6, 8)
    assert z.conj().imag.is_neg()
    torch.testing.assert_close(cf.linear(z.conj().imag, w), torch.nn.functional.linear(-z.imag, w))


@needs_native
def test_a_remembered_training_launch_that_declines_takes_the_ops_path(monkeypatch):
    """A conv training call keeps its forward's launch in a slot; a native launch answers None for
    operands it may not take (a guard reads no address, so a misaligned view reaches it): the forward
    then asks the memo and the op's own path, never returns None."""
    from cudnn_fuse import torch_ops

    calls = []
    monkeypatch.setattr(ops, "_memo", lambda *a: (None, None))
    monkeypatch.setattr(ops, "_conv2d_fwd", lambda x, *a, **k: calls.append(k) or torch.ones(1, 2, 3, 3))
    x = torch.randn(1, 2, 3, 3, requires_grad=True)
    w = torch.randn(2, 2, 1, 1, requires_grad=True)
    slot = [lambda *a: None]
    y = torch_ops.conv2d_train(x, w, None, None, ((1, 1), (0, 0), (0, 0), (1, 1), 1, None, 0.01), slot)
    assert isinstance(y, torch.Tensor) and y.shape == (1, 2, 3, 3) and calls == [{"memo": None}]


@needs_native
def test_a_native_launch_hands_errors_on():
    class Broken:
        def launch(self, ptrs):
            raise RuntimeError("the plan's own error")

    x, w, _, _ = _operands()
    with pytest.raises(RuntimeError, match="the plan's own error"):
        ops._native_launch(Broken(), torch.empty(4, 6, dtype=torch.float16), False, x)(x, w, None, None)
    with pytest.raises(TypeError):
        ops._native_launch(Broken(), torch.empty(4, 6, dtype=torch.float16), False, x)(x, w, None)


# -------------------------------------------------------------- the replay, on a stand-in plan


class Rig:
    """A plans.Plan whose raw entry point records, whose captures are KernelReplays bound to a
    FakeLaunch, behind a memo entry for cf.linear(x, w, b, activation="relu") on CPU tensors."""

    def __init__(self, monkeypatch, workspace=0):
        import cudnn

        self.fake = FakeLaunch()
        self.raw_calls, self.stream, self.device, self.capturing, self.ws = [], 7, 0, False, 0x7000
        array = (ctypes.c_uint64 * 4)()
        handle = handles._Handle(handle=object())

        def entry(address, n, ws, raw_handle, index):
            self.raw_calls.append((handle.stream, tuple(array), ws))

        rig = self

        class Drv:
            kernels = True

            def capture(self, stream, work, kernel_only=False):
                work()
                return kernel_replay(rig.fake, stream)

            def destroy(self, ex):
                pass

            def error_name(self, rc):
                return f"CUresult {rc}"

        p = object.__new__(plans.Plan)
        p.spec = types.SimpleNamespace(op="linear")
        p.engine, p.device, p.workspace_size, p.graph, p.uids, p._ordered = "stand-in", 0, workspace, None, (1, 2, 3, 4), True
        p._handle = handle
        p._raw = (entry, (0, 1, 2, 3), array, ctypes.addressof(array), 4, -1, 0)
        p._graphs = launch_graphs.GraphSet(Drv())
        self.plan = p
        monkeypatch.setattr(launch_graphs, "ENABLED", True)
        monkeypatch.setattr(launch_graphs, "AFTER", 2)
        monkeypatch.setattr(launch_graphs, "clear_runtime_error", lambda: None)
        monkeypatch.setattr(plans, "_current_stream", lambda d: self.stream)
        monkeypatch.setattr(plans, "_capturing", lambda: self.capturing)
        monkeypatch.setattr(plans, "_current_device", lambda: self.device)
        monkeypatch.setattr(plans, "_side_stream", lambda d: 99)
        self.keep = torch.empty(1)
        monkeypatch.setattr(plans, "_workspace_ptr", lambda d, s, size, capturing=None: (self.ws, self.keep))
        monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
        monkeypatch.setattr(cudnn, "set_stream", lambda handle, stream: setattr(p._handle, "stream", stream),
                            raising=False)
        self.x, self.w, self.b, _ = _operands()
        key, _ = ops._memo("linear", self.x, self.w, self.b, None, ATTRS)
        plans.FAST[key] = ops._Launch(p, torch.empty(4, 6, dtype=torch.float16), False, self.x)
        # CUDA's caching allocator hands a call's output the address the last one freed; CPU malloc may
        # not: every output of the stand-in takes one buffer, so that pointer sets repeat as on the GPU
        self.out = torch.empty(4, 6, dtype=torch.float16)
        monkeypatch.setattr(torch.Tensor, "new_empty_strided", lambda t, size, stride: self.out)
        monkeypatch.setattr(ops, "_alloc_cpu", lambda size, stride, dtype: self.out)  # torch's helper, where it has it

    def call(self) -> int:
        """One call; the output's address."""
        with torch.no_grad():
            y = cf.linear(self.x, self.w, self.b, activation="relu")
        assert y.shape == (4, 6) and y.dtype == torch.float16
        return y.data_ptr()


def _counters(graphs):
    return graphs.reuses, launch_graphs.STATS.replays, native.stats()["native_replays"]


@needs_native
def test_the_c_path_replays_a_kernel_capture_itself(monkeypatch):
    rig = Rig(monkeypatch)
    graphs = rig.plan._graphs
    ys = [rig.call() for _ in range(2)]  # a sighting, then the capture (both through plan.launch)
    assert ys[0] == ys[1]
    assert len(rig.raw_calls) == 2 and len(graphs.execs) == 1 and len(rig.fake.calls) == 1
    before = _counters(graphs)
    for _ in range(3):
        rig.call()
    assert len(rig.raw_calls) == 2 and len(rig.fake.calls) == 4  # three more launches, all from C
    assert [c["stream"] for c in rig.fake.calls[1:]] == [7, 7, 7]
    after = _counters(graphs)
    assert [a - b for a, b in zip(after, before)] == [3, 3, 3]
    rig.stream = 8  # another stream: the copy of the config carries it, the shared one is untouched
    rig.call()
    ex = next(iter(graphs.execs.values()))
    assert rig.fake.calls[-1]["stream"] == 8 and ex.cfg.hStream == 7


@needs_native
@pytest.mark.parametrize("case", ["graphs off", "launch graphs disabled", "another device", "torch captures",
                                  "launch fails"])
def test_the_c_path_hands_the_launch_to_the_plan(monkeypatch, case):
    rig = Rig(monkeypatch)
    ys = [rig.call() for _ in range(2)]
    assert ys[0] == ys[1]
    graphs = rig.plan._graphs
    served = native.stats()["native_replays"]
    if case == "graphs off":
        graphs.off = True
    elif case == "launch graphs disabled":
        monkeypatch.setattr(launch_graphs, "ENABLED", False)
    elif case == "another device":
        rig.device = 1
    elif case == "torch captures":
        rig.capturing = True
    elif case == "launch fails":
        rig.fake.rc = 700  # CUDA_ERROR_LAUNCH_FAILED, from now on
    raw = len(rig.raw_calls)
    rig.call()
    assert native.stats()["native_replays"] == served  # nothing launched from C
    assert len(rig.raw_calls) == raw + 1  # the plan's own launch ran it raw
    if case == "launch fails":  # C's launch failed, the plan's tried once more, then raw, with graphs off
        assert len(rig.fake.calls) == 3 and graphs.off and graphs.execs == {}


@needs_native
def test_the_workspace_pointer_is_part_of_the_c_key(monkeypatch):
    rig = Rig(monkeypatch, workspace=256)
    ys = [rig.call() for _ in range(2)]
    assert ys[0] == ys[1]
    key = next(iter(rig.plan._graphs.execs))
    assert key[0] == 0x7000 and rig.raw_calls[-1][2] == 0x7000
    served = native.stats()["native_replays"]
    rig.call()
    assert native.stats()["native_replays"] == served + 1
    rig.ws = 0x8000  # another workspace buffer: another pointer set, not replayed
    rig.call()
    assert native.stats()["native_replays"] == served + 1 and rig.raw_calls[-1][2] == 0x8000


@needs_native
def test_threads_share_the_c_path(monkeypatch):
    rig = Rig(monkeypatch)
    ys = [rig.call() for _ in range(2)]
    assert ys[0] == ys[1]
    errors = []

    def work():
        try:
            for _ in range(200):
                rig.call()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(rig.fake.calls) + len(rig.raw_calls) >= 800 + 2  # every call launched once, one way or the other


@needs_native
def test_the_c_path_leaks_no_references(monkeypatch):
    """Every path through the C call (guarded hit, keyed hit, miss, a replay from C, the plan's launch)
    gives back every reference it takes: the operands', the entry's and the plan's counts are the same
    after a thousand calls, and no objects pile up."""
    import gc

    rig = Rig(monkeypatch)
    for _ in range(5):  # sighted, captured, replayed; the guard registered
        rig.call()
    launch = next(v for k, v in plans.FAST.items() if k in ops.memo_keys())
    x2 = torch.randn(5, 8, dtype=torch.float16)  # a miss every call (another shape)
    watched = (rig.x, rig.w, rig.b, rig.out, launch, rig.plan, rig.plan._graphs, x2)
    rig.fake.record = False  # the stand-in's own records would pile up
    launches = rig.fake.count
    gc.collect()
    before = [sys.getrefcount(o) for o in watched]
    objects = len(gc.get_objects())
    for _ in range(1000):
        rig.call()
        with torch.no_grad():
            assert native.call("linear", "linear:grad", x2, rig.w, rig.b, None, ATTRS) is None
    gc.collect()
    assert [sys.getrefcount(o) for o in watched] == before
    assert len(gc.get_objects()) - objects < 50
    st = native.stats()
    assert rig.fake.count - launches == 1000 and st["native_replays"] >= 1000 and st["guarded_hits"] >= 1000


@needs_native
def test_replay_counters_lose_no_update_between_the_c_and_python_paths(monkeypatch):
    """The replay counters (a plan's graphs.reuses, which the churn gate reads, and plan_stats()'s
    graph_replays) are bumped without a lock: from C (_native.c's bump(), no handle lock) and from
    Plan.launch (under the handle lock), both on every replay. Each update is whole under the GIL: the C
    bump runs no Python between its read and its write (the counters are plain __slots__), and CPython
    switches threads in Python code only at calls and backward jumps, none of which lie inside a
    `x.n += 1`. So they stay lock-free (a lock would cost every replay); this holds them to it, with
    threads switching as often as CPython lets them."""
    rig = Rig(monkeypatch)
    ys = [rig.call() for _ in range(2)]  # a sighting, then the capture
    assert ys[0] == ys[1]
    graphs = rig.plan._graphs
    rig.fake.record = False
    ptrs = [rig.x.data_ptr(), rig.w.data_ptr(), rig.b.data_ptr(), rig.out.data_ptr()]  # the captured pointer set
    before = _counters(graphs)
    calls, errors = 2000, []

    def from_c():
        try:
            for _ in range(calls):
                rig.call()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def from_python():
        try:
            for _ in range(calls):
                rig.plan.launch(ptrs)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    race((from_c, from_python) * 4)
    assert errors == []
    reuses, replays, native_replays = (a - b for a, b in zip(_counters(graphs), before))
    assert native_replays == 4 * calls and len(rig.raw_calls) == 2  # C replayed its calls; nothing ran raw
    assert (reuses, replays) == (8 * calls, 8 * calls)
