import importlib.metadata
import subprocess
import sys

import pytest
import torch

import cudnn_fuse
from cudnn_fuse import cli, env
from cudnn_fuse._version import __version__

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the no-GPU output")


@pytest.fixture(autouse=True)
def fresh_probe():
    env.clear_cache()
    yield
    env.clear_cache()


def test_version_prints_package_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"cudnn-fuse {__version__}\n"


def test_version_is_single_sourced():
    try:
        installed = importlib.metadata.version("cudnn-fuse")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("cudnn-fuse is not installed (running from source)")
    assert installed == __version__


@pytest.mark.parametrize("module", ["cudnn_fuse", "cudnn_fuse.cli"])
def test_python_dash_m_runs_the_cli(module):
    # python -m cudnn_fuse.cli once exited 0 having done nothing (no __main__ guard)
    out = subprocess.run([sys.executable, "-m", module, "--version"],
                         capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout) == (0, f"cudnn-fuse {__version__}\n")


def test_no_command_prints_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "doctor" in capsys.readouterr().out


def test_unknown_command_is_a_usage_error(capsys):
    assert cli.main(["frobnicate"]) == 2
    assert "invalid choice" in capsys.readouterr().err


@no_gpu
def test_doctor_without_gpu_is_healthy(capsys, cache_dir):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "no CUDA GPU" in out
    for label, value in env.describe():
        assert label in out and value in out
    assert str(cache_dir / env.namespace()) in out
    problems = out.split("problems:")[1]
    assert problems.split()[0] == "none"


def test_doctor_names_the_cache_directory_once(capsys, cache_dir):
    """The doctor printed a "cache dir" row (env's: the root) and a "cache directory" row (the
    namespace's folder under it): two names, two values, for one thing."""
    cli.main(["doctor"])
    rows = [line.split(None, 2) for line in capsys.readouterr().out.splitlines()
            if line.startswith("cache dir")]
    assert [r[:2] for r in rows] == [["cache", "dir"]], rows
    assert rows[0][2] == str(cache_dir / env.namespace())


def test_doctor_says_which_path_the_memoized_calls_take(capsys, cache_dir):
    from cudnn_fuse import ops

    on = ops.native_enabled()
    try:
        for enabled in (True, False):
            ops.set_native(enabled)
            assert cli.main(["doctor"]) == 0
            row = next(line for line in capsys.readouterr().out.splitlines() if "memoized calls" in line)
            assert ("C (cudnn_fuse._native)" in row) is (enabled and ops._native is not None), row
            assert ("Python" in row) is not (enabled and ops._native is not None), row
    finally:
        ops.set_native(on)


def test_doctor_fails_on_unsupported_frontend(capsys, monkeypatch):
    import cudnn

    monkeypatch.setattr(cudnn, "__version__", "1.31.0")
    assert cli.main(["doctor"]) == 1
    problems = capsys.readouterr().out.split("problems:")[1]
    assert "1.31.0" in problems


def test_doctor_fails_without_frontend(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", None)
    assert cli.main(["doctor"]) == 1
    assert "not importable" in capsys.readouterr().out.split("problems:")[1]


def test_doctor_fails_on_gpu_without_cudnn_library(capsys, monkeypatch):
    fp = {**env.fingerprint(), "gpu_name": "NVIDIA H200", "compute_capability": "9.0",
          "sm_count": 132, "cudnn_backend": None}
    monkeypatch.setattr(env, "fingerprint", lambda device=None: dict(fp))
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "cuDNN backend library" in out.split("problems:")[1]
    assert "no CUDA GPU" not in out


@pytest.mark.skipif(not hasattr(cudnn_fuse, "conv2d"), reason="cudnn_fuse ops not written yet")
def test_demo_runs_every_op(capsys):
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line}
    # fp32 on the CPU runs the same math as torch; fp16/bf16 on the GPU differs by rounding
    tolerance = 2e-2 if torch.cuda.is_available() else 1e-5
    for op in ("conv2d", "linear", "matmul", "scaled_dot_product_attention"):
        assert float(rows[op][-1]) <= tolerance, rows[op]
    assert "plan stats" in out and "fallbacks=" in out
    if not torch.cuda.is_available():
        assert "no CUDA GPU" in out
