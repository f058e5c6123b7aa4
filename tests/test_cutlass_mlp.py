"""cudnn_fuse.cutlass_mlp on the CPU: what it declines and how it loads (the kernels are GPU-tested in
tests/test_gpu_cutlass_mlp.py)."""

import logging

import pytest
import torch

from cudnn_fuse import backward, cutlass_mlp, torch_ops


@pytest.fixture
def fresh_loader(monkeypatch):
    monkeypatch.setattr(cutlass_mlp, "_lib", None)
    monkeypatch.setattr(cutlass_mlp, "_lib_tried", False)
    monkeypatch.setattr(cutlass_mlp, "_warned", set())
    yield


def test_missing_library_is_one_warning_and_none(fresh_loader, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CUDNN_FUSE_CUTLASS_LIB", str(tmp_path / "nope.so"))
    with caplog.at_level(logging.WARNING, logger="cudnn_fuse.cutlass_mlp"):
        assert not cutlass_mlp.available()
        assert not cutlass_mlp.available()
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
    assert "nope.so" in caplog.text
    x, w, b = torch.randn(8, 8), torch.randn(8, 8), torch.randn(8)
    assert cutlass_mlp.linear_gelu_aux(x, w, b) is None
    assert cutlass_mlp.dgelu(x, w, x) is None


def test_library_path_follows_the_environment(monkeypatch):
    monkeypatch.delenv("CUDNN_FUSE_CUTLASS_LIB", raising=False)
    assert cutlass_mlp.library_path().endswith("cudnn_fuse/_cutlass_mlp.so")
    monkeypatch.setenv("CUDNN_FUSE_CUTLASS_LIB", "/x/y.so")
    assert cutlass_mlp.library_path() == "/x/y.so"


class _FakeLib:
    """Stands in for the shared library: any use of it raises (a decline must not reach it)."""

    def __getattr__(self, name):
        raise AttributeError(name)


def test_declines_before_touching_the_library(fresh_loader, monkeypatch):
    lib = _FakeLib()
    monkeypatch.setattr(cutlass_mlp, "_lib", lib)
    monkeypatch.setattr(cutlass_mlp, "_lib_tried", True)
    bf = torch.bfloat16
    x, w, b = torch.randn(16, 32, dtype=bf), torch.randn(24, 32, dtype=bf), torch.randn(24, dtype=bf)
    assert cutlass_mlp.linear_gelu_aux(x, w, b) is None  # CPU tensors
    assert cutlass_mlp.linear_gelu_aux(x, w, None) is None  # no bias
    assert cutlass_mlp.linear_gelu_aux(x, w[:, :16], b) is None  # K mismatch
    assert cutlass_mlp.linear_gelu_aux(x, w, b[:8]) is None  # bias shape
    assert cutlass_mlp.dgelu(torch.randn(16, 24, dtype=bf), torch.randn(24, 40, dtype=bf),
                             torch.randn(16, 40, dtype=bf)) is None  # CPU
    assert cutlass_mlp.dgelu(torch.randn(16, 24, dtype=bf), torch.randn(24, 40, dtype=bf),
                             torch.randn(16, 32, dtype=bf)) is None  # z's width
    assert not cutlass_mlp.usable(x, w)  # CPU: not usable whatever the dtype
    assert not cutlass_mlp.usable(None)


def test_config_env_is_bounded(monkeypatch, caplog):
    from cudnn_fuse import envvars

    with caplog.at_level(logging.WARNING):
        assert envvars.parse("CUDNN_FUSE_CUTLASS_BWD_CONFIG", "192", 0, integer=True,
                             maximum=cutlass_mlp.MAX_CONFIG) == 0
    assert "CUDNN_FUSE_CUTLASS_BWD_CONFIG" in caplog.text
    assert envvars.parse("CUDNN_FUSE_CUTLASS_FWD_CONFIG", "-1", 0, integer=True, minimum=-1,
                         maximum=cutlass_mlp.MAX_CONFIG) == -1


def test_forward_left_to_torch_and_unknown_tiles_decline(fresh_loader, monkeypatch):
    """FWD_CONFIG -1 (and any tile number the library does not have) declines before any launch."""
    monkeypatch.setattr(cutlass_mlp, "_lib", _FakeLib())  # any attribute access would raise
    monkeypatch.setattr(cutlass_mlp, "_lib_tried", True)
    x, w, b = torch.randn(8, 8), torch.randn(8, 8), torch.randn(8)
    monkeypatch.setattr(cutlass_mlp, "FWD_CONFIG", -1)
    assert cutlass_mlp.linear_gelu_aux(x, w, b) is None
    monkeypatch.setattr(cutlass_mlp, "FWD_CONFIG", 7)  # tile 7: not built
    assert cutlass_mlp.linear_gelu_aux(x, w, b) is None
    monkeypatch.setattr(cutlass_mlp, "BWD_CONFIG", 16 + 6)
    assert cutlass_mlp.dgelu(x, w, x) is None


def test_fused_mlp_on_cpu_with_the_cutlass_mode_matches_eager(monkeypatch):
    """The mode names CUDA kernels: on the CPU the node runs the reference, gradients equal eager's."""
    monkeypatch.setattr(backward, "MLP", "cutlass")
    called = []
    monkeypatch.setattr(cutlass_mlp, "linear_gelu_aux", lambda *a: called.append("fwd"))
    monkeypatch.setattr(cutlass_mlp, "dgelu", lambda *a: called.append("bwd"))
    torch.manual_seed(0)
    x = torch.randn(6, 16, requires_grad=True)
    w1, b1 = torch.randn(32, 16, requires_grad=True), torch.randn(32, requires_grad=True)
    w2, b2 = torch.randn(16, 32, requires_grad=True), torch.randn(16, requires_grad=True)
    out = torch_ops.mlp(x, w1, b1, w2, b2, "gelu", None, 0.01)
    ref = torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(x, w1, b1)), w2, b2)
    torch.testing.assert_close(out, ref)
    g = torch.autograd.grad(out.square().sum(), (x, w1, b1, w2, b2))
    gr = torch.autograd.grad(ref.square().sum(), (x, w1, b1, w2, b2))
    for a, b in zip(g, gr):
        torch.testing.assert_close(a, b)
    assert called == []  # the CUDA kernels are never asked for CPU tensors


# ------------------------------------------------------------------ build-kernels (a fake nvcc)

FAKE_NVCC = """#!{python}
import os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_NVCC_LOG"], "a") as f:
    f.write(" ".join(args) + "\\n")
fail = os.environ.get("FAKE_NVCC_FAIL")
if fail and any(fail in a for a in args):
    sys.stderr.write("error: fake failure in " + fail + "\\n")
    sys.exit(3)
out = args[args.index("-o") + 1]
with open(out, "w") as f:
    f.write("linked" if "-shared" in args else "object")
"""


@pytest.fixture
def fake_toolchain(tmp_path, monkeypatch):
    import sys

    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text(FAKE_NVCC.replace("{python}", sys.executable))
    nvcc.chmod(0o755)
    cut = tmp_path / "cutlass"
    for rel in ("include/cutlass/cutlass.h", "include/cute/tensor.hpp", "tools/util/include/cutlass/util/packed_stride.hpp"):
        (cut / rel).parent.mkdir(parents=True, exist_ok=True)
        (cut / rel).write_text("")
    log = tmp_path / "nvcc.log"
    monkeypatch.setenv("FAKE_NVCC_LOG", str(log))
    monkeypatch.delenv("FAKE_NVCC_FAIL", raising=False)
    return nvcc, cut, log


def test_build_compiles_each_unit_then_links_atomically(fake_toolchain, tmp_path, fresh_loader):
    nvcc, cut, log = fake_toolchain
    out = tmp_path / "lib" / "_cutlass_mlp.so"
    seen = []
    path = cutlass_mlp.build(str(cut), str(nvcc), str(out), jobs=2, progress=lambda d, t: seen.append((d, t)))
    assert path == str(out) and out.read_text() == "linked"
    lines = log.read_text().splitlines()
    compiles = [line for line in lines if " -c " in line]
    assert len(compiles) == 2 * cutlass_mlp.TILES + 1 and len(lines) == len(compiles) + 1
    units = sorted(line.split("-DCF_TU_TILE=")[1].split()[0] + line.split("-DCF_TU_FWD=")[1].split()[0]
                   for line in compiles if "CF_TU_TILE" in line)
    assert units == sorted(f"{t}{f}" for t in range(cutlass_mlp.TILES) for f in (0, 1))  # every (tile, direction) once
    assert sum("-DCF_TU_MAIN" in line for line in compiles) == 1
    assert all("-arch=sm_90a" in line and f"-I{cut}/include" in line and cutlass_mlp.SOURCE in line for line in compiles)
    assert "-shared" in lines[-1] and lines[-1].count(".o") == len(compiles)  # the link takes every object
    total = len(compiles) + 1
    assert seen[0] == (0, total) and seen[-1] == (total, total) and len(seen) == total + 1
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert not [p for p in out.parent.iterdir() if p.name != out.name]  # no temporary left beside it


def test_a_failing_unit_raises_with_nvccs_words_and_keeps_the_old_library(fake_toolchain, tmp_path, monkeypatch):
    nvcc, cut, log = fake_toolchain
    out = tmp_path / "_cutlass_mlp.so"
    out.write_text("previous build")
    monkeypatch.setenv("FAKE_NVCC_FAIL", "-DCF_TU_TILE=3")
    with pytest.raises(RuntimeError, match="fake failure in -DCF_TU_TILE=3"):
        cutlass_mlp.build(str(cut), str(nvcc), str(out), jobs=1)
    assert out.read_text() == "previous build"
    assert "-shared" not in log.read_text()  # nothing linked


def test_build_names_the_bad_argument(fake_toolchain, tmp_path, monkeypatch):
    nvcc, cut, _ = fake_toolchain
    monkeypatch.delenv("CUTLASS_DIR", raising=False)
    with pytest.raises(ValueError, match="--cutlass-dir: give"):
        cutlass_mlp.build(None, str(nvcc), str(tmp_path / "x.so"))
    (cut / "tools/util/include/cutlass/util/packed_stride.hpp").unlink()
    with pytest.raises(ValueError, match="--cutlass-dir: .* has no tools/util/include"):
        cutlass_mlp.build(str(cut), str(nvcc), str(tmp_path / "x.so"))
    with pytest.raises(ValueError, match="--nvcc: '/no/such/nvcc' is not an executable"):
        cutlass_mlp.find_nvcc("/no/such/nvcc")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("NVCC", raising=False)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nocuda"))
    with pytest.raises(ValueError, match="--nvcc: no nvcc found"):
        cutlass_mlp.find_nvcc(None)
    monkeypatch.setenv("NVCC", str(nvcc))
    assert cutlass_mlp.find_nvcc(None) == str(nvcc)


def test_cli_build_kernels(fake_toolchain, tmp_path, capsys, monkeypatch, fresh_loader):
    from cudnn_fuse.cli import main

    nvcc, cut, _ = fake_toolchain
    out = tmp_path / "k" / "_cutlass_mlp.so"
    # built somewhere off the search path: the table says how to load it; exit 0
    assert main(["build-kernels", "--cutlass-dir", str(cut), "--nvcc", str(nvcc), "--output", str(out)]) == 0
    got = capsys.readouterr()
    assert "14/14 100%" in got.err and "eta" in got.err  # the bar with counts
    assert str(out) in got.out and f"CUDNN_FUSE_CUTLASS_LIB={out}" in got.out
    # on the search path but not a loadable library (the fake wrote text): exit 1, says so
    monkeypatch.setenv("CUDNN_FUSE_CUTLASS_LIB", str(out))
    assert main(["build-kernels", "--cutlass-dir", str(cut), "--nvcc", str(nvcc), "--output", str(out)]) == 1
    assert "no (see the log)" in capsys.readouterr().out
    assert main(["build-kernels", "--cutlass-dir", str(tmp_path / "nope"), "--nvcc", str(nvcc)]) == 2
    assert "--cutlass-dir" in capsys.readouterr().err
    assert main(["build-kernels", "--cutlass-dir", str(cut), "--jobs", "0"]) == 2
    assert "--jobs" in capsys.readouterr().err


def test_library_search_order(monkeypatch, tmp_path):
    monkeypatch.delenv("CUDNN_FUSE_CUTLASS_LIB", raising=False)
    cands = cutlass_mlp.library_candidates()
    assert cands[0].endswith("cudnn_fuse/_cutlass_mlp.so") and cands[1] == cutlass_mlp.user_library_path()
    monkeypatch.setenv("CUDNN_FUSE_CUTLASS_LIB", str(tmp_path / "a.so"))
    assert cutlass_mlp.library_candidates() == [str(tmp_path / "a.so")]


def test_auto_mode_uses_cutlass_only_where_built_and_the_block_qualifies(monkeypatch):
    monkeypatch.setattr(backward, "MLP", "auto")
    t = torch.empty(2, dtype=torch.bfloat16)
    monkeypatch.setattr(cutlass_mlp, "available", lambda: True)
    assert not torch_ops._cutlass_block("gelu", t)  # CPU tensor
    cuda_like = type("T", (), {"dtype": torch.bfloat16, "is_cuda": True})()
    assert torch_ops._cutlass_block("gelu", cuda_like)
    assert not torch_ops._cutlass_block("gelu_tanh", cuda_like) and not torch_ops._cutlass_block("silu", cuda_like)
    half_like = type("T", (), {"dtype": torch.float16, "is_cuda": True})()
    assert not torch_ops._cutlass_block("gelu", half_like)
    monkeypatch.setattr(cutlass_mlp, "available", lambda: False)
    assert not torch_ops._cutlass_block("gelu", cuda_like)  # not built: torch's kernels
    monkeypatch.setattr(backward, "MLP", "torch")
    monkeypatch.setattr(cutlass_mlp, "available", lambda: True)
    assert not torch_ops._cutlass_block("gelu", cuda_like)  # =torch turns them off
    monkeypatch.setattr(backward, "MLP", "cutlass")
    monkeypatch.setattr(cutlass_mlp, "available", lambda: False)
    assert torch_ops._cutlass_block("gelu", cuda_like)  # asked for: the kernels' own decline logs it


def test_dimension_gate():
    assert cutlass_mlp._dims_ok(8, 16, 24)
    assert not cutlass_mlp._dims_ok(0, 16, 24)
    assert not cutlass_mlp._dims_ok(8, 12, 24) and not cutlass_mlp._dims_ok(8, 16, 20) and not cutlass_mlp._dims_ok(9, 16, 24)
    assert not cutlass_mlp._dims_ok(2 ** 31, 8, 8)
