"""The one spec an op call makes, read through cf.record (no GPU needed: specs are recorded on
CPU and meta tensors too). Shared by the conv-as-GEMM, engines-audit and launch-graph tests."""

from __future__ import annotations


def recorded_spec(fn):
    """The spec of the one fused call ``fn`` makes (asserts there is exactly one)."""
    import cudnn_fuse as cf

    with cf.record() as rec:
        fn()
    specs = [e.spec for e in rec.entries]
    assert len(specs) == 1, specs
    return specs[0]
