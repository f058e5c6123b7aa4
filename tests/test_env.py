import hashlib
import json
import subprocess
import sys

import pytest
import torch

from cudnn_fuse import env
from cudnn_fuse._version import __version__

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the no-GPU values")

SAMPLE = {  # an H200-like fingerprint, independent of this machine
    "gpu_name": "NVIDIA H200",
    "compute_capability": "9.0",
    "sm_count": 132,
    "driver": "570.86.15",
    "cuda_runtime": "13.0",
    "cudnn_backend": 91900,
    "cudnn_frontend": "1.32.0",
    "torch": "2.11.0+cu130",
    "package": "0.1.0",
}
CHANGED = {
    "gpu_name": "NVIDIA H100 80GB HBM3",
    "compute_capability": "8.9",
    "sm_count": 114,
    "driver": "575.51.03",
    "cuda_runtime": "12.8",
    "cudnn_backend": 91000,
    "cudnn_frontend": "1.32.1",
    "torch": "2.12.0+cu130",
    "package": "0.1.1",
}


@pytest.fixture(autouse=True)
def fresh_probe():
    env.clear_cache()
    yield
    env.clear_cache()


def test_fingerprint_has_exactly_the_documented_keys():
    assert set(env.fingerprint()) == set(SAMPLE) == set(env.FIELDS)


def test_fingerprint_reports_this_process_versions():
    import cudnn

    fp = env.fingerprint()
    assert fp["torch"] == torch.__version__
    assert fp["package"] == __version__
    assert fp["cuda_runtime"] == torch.version.cuda
    assert fp["cudnn_frontend"] == cudnn.__version__
    json.dumps(fp)  # namespace() hashes its JSON: every value must serialize


@no_gpu
def test_fingerprint_without_gpu_leaves_gpu_fields_none():
    fp = env.fingerprint()
    assert (fp["gpu_name"], fp["compute_capability"], fp["sm_count"]) == (None, None, None)


def test_fingerprint_returns_a_copy_of_the_cached_probe():
    env.fingerprint()["torch"] = "tampered"
    assert env.fingerprint()["torch"] == torch.__version__


def test_missing_cudnn_library_gives_none_not_an_exception(monkeypatch):
    import cudnn

    def no_library():
        raise RuntimeError("Unable to find symbol cudnnGetVersion")

    monkeypatch.setattr(cudnn, "backend_version", no_library)
    assert env.fingerprint()["cudnn_backend"] is None
    monkeypatch.setattr(cudnn, "backend_version", lambda: 91900)
    env.clear_cache()
    assert env.fingerprint()["cudnn_backend"] == 91900


def test_unimportable_frontend_gives_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", None)  # makes `import cudnn` raise ImportError
    fp = env.fingerprint()
    assert fp["cudnn_frontend"] is None and fp["cudnn_backend"] is None


def test_namespace_is_sha256_prefix_of_canonical_json():
    canonical = json.dumps(SAMPLE, sort_keys=True, separators=(",", ":"))
    assert env.namespace(SAMPLE) == hashlib.sha256(canonical.encode()).hexdigest()[:16]


def test_namespace_is_stable_for_identical_input():
    reordered = dict(reversed(list(SAMPLE.items())))
    assert env.namespace(SAMPLE) == env.namespace(dict(SAMPLE)) == env.namespace(reordered)
    assert env.namespace() == env.namespace(env.fingerprint())


@pytest.mark.parametrize("field", sorted(SAMPLE))
def test_namespace_changes_when_any_field_changes(field):
    base = env.namespace(SAMPLE)
    assert env.namespace({**SAMPLE, field: CHANGED[field]}) != base
    assert env.namespace({**SAMPLE, field: None}) != base


@pytest.mark.parametrize("version, text", [(91900, "9.19.0"), (90100, "9.1.0"),
                                           (8906, "8.9.6"), (90002, "9.0.2")])
def test_backend_version_string(version, text):
    assert env.backend_version_string(version) == text


def test_problems_accepts_supported_frontend_without_gpu():
    assert env.problems({**SAMPLE, "gpu_name": None, "cudnn_backend": None}) == []
    assert env.problems(SAMPLE) == []


@pytest.mark.parametrize("change, words", [
    ({"cudnn_frontend": None}, "not importable"),
    ({"cudnn_frontend": "1.31.0"}, "1.31.0"),
    ({"cudnn_frontend": "1.33.0"}, "1.33.0"),
    ({"cudnn_backend": None}, "cuDNN backend library"),
])
def test_problems_names_what_is_broken(change, words):
    found = env.problems({**SAMPLE, **change})
    assert len(found) == 1 and words in found[0]


def test_describe_rows(cache_dir):
    rows = dict(env.describe(SAMPLE))
    assert list(rows) == ["python", "torch", "CUDA runtime", "driver", "cudnn frontend",
                          "cudnn backend", "GPU name", "compute capability", "SM count",
                          "fingerprint namespace", "cache dir"]
    assert rows["cudnn backend"] == "9.19.0 (91900)"
    assert rows["SM count"] == "132"
    assert rows["fingerprint namespace"] == env.namespace(SAMPLE)
    assert rows["cache dir"] == str(cache_dir)


def test_cache_dir_defaults_to_user_cache_dir(monkeypatch):
    import platformdirs

    monkeypatch.delenv("CUDNN_FUSE_CACHE_DIR", raising=False)
    assert env.cache_dir() == platformdirs.user_cache_dir("cudnn_fuse")


def test_driver_prefers_torch_query(monkeypatch):
    monkeypatch.setattr(torch.cuda, "driver_version", lambda: "570.86.15", raising=False)
    assert env._driver_version() == "570.86.15"


def test_driver_from_nvidia_smi_takes_first_gpu_line(monkeypatch):
    monkeypatch.delattr(torch.cuda, "driver_version", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(env.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    seen = {}

    def fake_run(cmd, **kwargs):
        seen.update(kwargs)
        return subprocess.CompletedProcess(cmd, 0, stdout="570.86.15\n570.86.15\n", stderr="")

    monkeypatch.setattr(env.subprocess, "run", fake_run)
    assert env._driver_version() == "570.86.15"
    assert seen["timeout"] > 0


def test_driver_is_none_when_nvidia_smi_hangs(monkeypatch):
    monkeypatch.delattr(torch.cuda, "driver_version", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(env.shutil, "which", lambda name: "/usr/bin/nvidia-smi")

    def hang(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    monkeypatch.setattr(env.subprocess, "run", hang)
    assert env._driver_version() is None
