"""cudnn_fuse.tuned_gemm on the CPU: layouts, the winner's rule, the timing plan under a budget,
and the plan cache's records (stored, loaded, refused) with cuBLASLt stood in by a stub."""

from __future__ import annotations

import contextlib
import ctypes
import logging

import pytest
import torch

from cudnn_fuse import cublaslt as lt
from cudnn_fuse import tuned_gemm as tg
from cudnn_fuse.cache import PlanCache

SIG = (0, lt._R_16BF, 8192, 2048, 8192, lt._OP_N, 8192, lt._OP_T, 8192, True)


def test_operand_layouts():
    a = torch.empty(128, 64)
    assert tg._operand(a) == (lt._OP_N, 64)  # row-major: its memory column-major is a^T
    assert tg._operand(a.t()) == (lt._OP_T, 64)  # a transposed view: op T of the same memory
    assert tg._operand(torch.empty(128, 256)[:, :64]) == (lt._OP_N, 256)  # a column slice keeps its row stride
    assert tg._operand(torch.empty(128, 66)[:, :64]) is None  # rows 132 bytes apart: not 16-byte aligned
    assert tg._operand(torch.empty(128, 64, 2)[:, :, 0]) is None  # no unit stride


def test_signature_declines_cpu_operands():
    a, b = torch.empty(128, 64, dtype=torch.bfloat16), torch.empty(64, 128, dtype=torch.bfloat16)
    assert tg.signature(a, b, None) is None
    assert tg.mm(a, b) is None  # the caller runs torch's call


@pytest.mark.parametrize("medians, margin, winner", [
    ({"torch": 1.0, 0: 0.98, 1: 0.95}, 0.01, 1),      # the fastest algorithm, well ahead
    ({"torch": 1.0, 0: 0.995}, 0.01, "torch"),          # within the margin: torch's call stays
    ({"torch": 1.0, 0: 1.2, 1: 1.1}, 0.01, "torch"),    # every algorithm slower
    ({"torch": 1.0}, 0.01, "torch"),                    # nothing else ran
    ({"torch": 1.0, 3: 0.995}, 0.0, 3),                 # no margin: any gain counts
])
def test_choose(medians, margin, winner):
    assert tg.choose(medians, margin) == winner


def test_plan_rounds_fits_the_budget():
    rounds, launches, keep = tg.plan_rounds(17, 0.4, 1.0)  # the MLP's GEMMs: all 17, every round
    assert (rounds, launches, keep) == (7, 5, 17)
    assert rounds * keep * (launches + 1) * 0.4 / 1000 <= 1.0
    rounds, launches, keep = tg.plan_rounds(17, 0.01, 1.0)  # short GEMMs: 20 launches a sample
    assert (rounds, launches, keep) == (7, 20, 17)
    assert tg.plan_rounds(17, 2.0, 1.0) == (7, 3, 17)  # 2 ms: 0.95 s, still every round
    rounds, launches, keep = tg.plan_rounds(17, 5.0, 1.0)  # 5 ms: 3 rounds, one candidate left out
    assert (rounds, launches, keep) == (3, 3, 16) and rounds * keep * (launches + 1) * 5.0 / 1000 <= 1.0
    rounds, launches, keep = tg.plan_rounds(17, 20.0, 1.0)  # a 20 ms GEMM: torch and the first three
    assert (rounds, launches, keep) == (3, 3, 4)
    assert tg.plan_rounds(17, 100.0, 1.0) == (3, 3, 2)  # torch and one algorithm at least


def test_cache_key_is_per_signature_hex():
    k = tg.cache_key(SIG)
    assert len(k) == 64 and int(k, 16) >= 0 and k == tg.cache_key(tuple(SIG))
    assert k != tg.cache_key(SIG[:-1] + (False,))  # the bias is part of the key
    spec = tg._spec(SIG)
    assert spec["op"] == "cublaslt_gemm" and spec["dtype"] == "bfloat16" and spec["b"]["transposed"]


class StubLib:
    """Every cuBLASLt call succeeds, except cublasLtMatmulAlgoCheck's answer, which the test sets."""

    def __init__(self, check_status=0, check_workspace=4):
        self.check_status, self.check_workspace, self.checked = check_status, check_workspace, []

    def __getattr__(self, name):
        return lambda *args: 0

    def cublasLtMatmulAlgoCheck(self, handle, desc, la, lb, lc, ld, algo, result):
        self.checked.append(bytes(algo._obj))
        result._obj.workspaceSize = self.check_workspace
        return self.check_status


@pytest.fixture
def cache(tmp_path, monkeypatch):
    pc = PlanCache(tmp_path / "c", namespace="test")
    monkeypatch.setattr(tg, "_cache", lambda sig: pc)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(lt, "_local", type(lt._local)())
    tg.clear()
    yield pc
    tg.clear()
    pc.close()


def _meta():
    return {"format": tg.FORMAT, "op": "cublaslt_gemm", "spec": tg._spec(SIG), "engine": "cublaslt algo 3"}


def test_a_stored_algorithm_is_checked_then_used(cache):
    algo = bytes(range(64))
    assert cache.put(tg.cache_key(SIG), _meta(), algo)
    lib = StubLib(check_workspace=4096)
    pick = tg._from_cache(SIG, lib, torch.device("cuda", 0))
    assert isinstance(pick, tg._Pick) and bytes(pick.algo) == algo and pick.workspace == 4096
    assert lib.checked == [algo]


def test_a_stored_torch_pick_needs_no_check(cache):
    cache.put(tg.cache_key(SIG), {**_meta(), "engine": "torch"}, b"torch")
    lib = StubLib()
    assert tg._from_cache(SIG, lib, torch.device("cuda", 0)) == tg.TORCH and lib.checked == []


@pytest.mark.parametrize("fault", ["refused", "short", "other_spec", "not_a_gemm"])
def test_a_bad_record_is_a_miss_and_one_warning(cache, caplog, fault):
    meta, blob, lib = _meta(), bytes(64), StubLib()
    if fault == "refused":
        lib = StubLib(check_status=7)  # CUBLAS_STATUS_INVALID_VALUE: not an algorithm for this GEMM
    elif fault == "short":
        blob = bytes(40)
    elif fault == "other_spec":
        meta = {**meta, "spec": tg._spec(SIG[:2] + (4096,) + SIG[3:])}
    else:
        meta = {"spec": {"op": "matmul"}, "engine": "eng0"}  # a cuDNN plan's entry under the same key
    cache.put(tg.cache_key(SIG), meta, blob)
    with caplog.at_level(logging.WARNING, logger="cudnn_fuse.tuned_gemm"):
        assert tg._from_cache(SIG, lib, torch.device("cuda", 0)) is None
        assert tg._from_cache(SIG, lib, torch.device("cuda", 0)) is None
    assert len([r for r in caplog.records if "treated as a miss" in r.getMessage()]) == 1


def test_a_pick_is_stored_as_its_algorithm_bytes(cache):
    algo = (ctypes.c_uint64 * 8)(*range(8))
    tg._store(SIG, tg._Pick(algo, 0), _meta())
    entry = cache.get(tg.cache_key(SIG))
    assert entry.blob == bytes(algo) and entry.meta["engine"] == "cublaslt algo 3"
    tg._store(SIG, tg.TORCH, {**_meta(), "engine": "torch"})
    assert cache.get(tg.cache_key(SIG)).blob == b"torch"


def test_a_read_only_cache_stores_nothing_and_fails_nothing(tmp_path, monkeypatch):
    PlanCache(tmp_path / "c", namespace="test").close()
    pc = PlanCache(tmp_path / "c", namespace="test", read_only=True)
    monkeypatch.setattr(tg, "_cache", lambda sig: pc)
    tg._store(SIG, tg.TORCH, _meta())  # no exception
    assert pc.get(tg.cache_key(SIG)) is None
    pc.close()


def test_products_autograd_must_record_are_left_to_torch():
    a, b = torch.ones(128, 64, requires_grad=True), torch.ones(64, 128)
    assert tg._takes(a.detach(), b, None)  # inside a Function's forward/backward: grad mode off or no grad
    with torch.no_grad():
        assert tg._takes(a, b, None)
    assert not tg._takes(a, b, None)  # grad mode with an operand requiring grad (a create_graph backward)
    assert not tg._takes(b, b, torch.zeros(128, requires_grad=True))


def test_plan_stats_report_the_tuned_gemms(monkeypatch):
    import cudnn_fuse as cf

    monkeypatch.setitem(tg.stats, "runs", tg.stats["runs"] + 3)
    s = cf.plan_stats()
    assert s["gemm_runs"] == tg.stats["runs"] and {"gemm_tuned", "gemm_loaded"} <= set(s)
