"""The ops' fused path driven on CPU tensors with stand-in plans, on the Python memo or the C memo
(cudnn_fuse._native): what the memo and key tests run through."""

from __future__ import annotations

import contextlib

import pytest

from cudnn_fuse import loader

PATHS = ["python", "native"]


class NoOpPlan:
    """A cuDNN plan that runs nothing: with it a 16-bit CPU call takes the fused path and is remembered
    (ops._remember), as a GPU call is."""

    raw = True
    engine = "no-op"

    def __init__(self, spec):
        self.spec = spec

    def launch(self, ptrs):
        pass

    def run(self, buffers):
        pass


@contextlib.contextmanager
def on_memo_path(path: str, monkeypatch, make_plan):
    """Inside: ``ops`` on the ``path`` memo ("python" or "native"; skipped where the C module is not
    built), every plan ``make_plan(spec, device)``, every call fused. The memo path is restored (which
    clears the memo) after."""
    from cudnn_fuse import ops

    if path == "native" and ops._native is None:
        pytest.skip("cudnn_fuse._native is not built")
    was = ops.native_enabled()
    ops.set_native(path == "native")
    monkeypatch.setattr(loader, "get_plan", make_plan)
    monkeypatch.setattr(ops, "_why_not_fused", lambda op, ts: None)
    try:
        yield ops
    finally:
        ops.set_native(was)
