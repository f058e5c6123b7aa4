"""Environment fingerprint: what a serialized cuDNN plan depends on besides its spec.

The plan cache stores blobs under ``namespace()``, a hash of this fingerprint, so a new GPU,
driver, CUDA, cuDNN, torch or package version starts a clean namespace instead of feeding a
foreign blob to ``deserialize``. Probing never raises: an unknown field is None.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import platform
import shutil
import subprocess

import torch

from . import envvars
from ._version import __version__

logger = logging.getLogger(__name__)

FIELDS = (
    "gpu_name",
    "compute_capability",
    "sm_count",
    "driver",
    "cuda_runtime",
    "cudnn_backend",
    "cudnn_frontend",
    "torch",
    "package",
)
SUPPORTED_FRONTEND = (1, 32)  # matches pyproject's nvidia-cudnn-frontend>=1.32,<1.33
_NVIDIA_SMI_TIMEOUT_S = 5.0


def fingerprint(device: int | None = None) -> dict:
    """The environment fingerprint of a CUDA device (default: the current one).

    Returns a fresh dict with exactly the keys in ``FIELDS``; GPU fields are None without a
    GPU. Probed once per device per process: call ``clear_cache()`` after changing the
    environment in-process (tests).
    """
    if device is None:
        device = _current_device()
    return dict(_probe(device))


def clear_cache() -> None:
    """Forget the probed fingerprints so the next ``fingerprint()`` probes again."""
    _probe.cache_clear()
    _driver_version.cache_clear()


def namespace(fp: dict | None = None) -> str:
    """First 16 hex chars of the sha256 of the fingerprint's canonical JSON."""
    if fp is None:
        fp = fingerprint()
    canonical = json.dumps(fp, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def cache_dir() -> str:
    """Where the plan cache lives: $CUDNN_FUSE_CACHE_DIR, else the user cache dir."""
    configured = envvars.text(envvars.CACHE_DIR)
    if configured:
        return configured
    import platformdirs

    return platformdirs.user_cache_dir("cudnn_fuse")


def problems(fp: dict | None = None) -> list[str]:
    """What stops the fused path from working here; empty when nothing does.

    No GPU is not a problem: every op then runs its PyTorch reference.
    """
    if fp is None:
        fp = fingerprint()
    found = []
    frontend = fp["cudnn_frontend"]
    if frontend is None:
        found.append("cudnn frontend (nvidia-cudnn-frontend) is not importable")
    elif _major_minor(frontend) != SUPPORTED_FRONTEND:
        want = ".".join(map(str, SUPPORTED_FRONTEND))
        found.append(f"cudnn frontend {frontend} is not the supported {want}.x")
    if fp["gpu_name"] is not None and fp["cudnn_backend"] is None:
        found.append(f"a CUDA GPU ({fp['gpu_name']}) is present but the cuDNN backend library "
                     "cannot be loaded")
    return found


def describe(fp: dict | None = None) -> list[tuple[str, str]]:
    """Human-readable (label, value) rows for ``cudnn-fuse doctor``."""
    if fp is None:
        fp = fingerprint()

    def show(value) -> str:
        return "unknown" if value is None else str(value)

    no_gpu = fp["gpu_name"] is None
    backend = fp["cudnn_backend"]
    return [
        ("python", platform.python_version()),
        ("torch", show(fp["torch"])),
        ("CUDA runtime", "none (CPU build of torch)" if fp["cuda_runtime"] is None
         else fp["cuda_runtime"]),
        ("driver", show(fp["driver"])),
        ("cudnn frontend", "not importable" if fp["cudnn_frontend"] is None
         else fp["cudnn_frontend"]),
        ("cudnn backend", "not loadable" if backend is None
         else f"{backend_version_string(backend)} ({backend})"),
        ("GPU name", "none" if no_gpu else fp["gpu_name"]),
        ("compute capability", "-" if no_gpu else show(fp["compute_capability"])),
        ("SM count", "-" if no_gpu else show(fp["sm_count"])),
        ("fingerprint namespace", namespace(fp)),
        ("cache dir", cache_dir()),
    ]


def backend_version_string(version: int) -> str:
    """cudnnGetVersion() as text: 91900 -> "9.19.0", 8906 -> "8.9.6"."""
    # cuDNN 9 widened the minor field: major*10000 + minor*100 + patch (8.x: major*1000 + ...)
    major_unit = 10000 if version >= 90000 else 1000
    major, rest = divmod(version, major_unit)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"


def _major_minor(version: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return None


def _current_device() -> int:
    try:
        return torch.cuda.current_device() if torch.cuda.is_available() else -1
    except Exception as exc:  # a broken driver must not break the op that asked
        logger.debug("cannot query the current CUDA device: %r", exc)
        return -1


@functools.lru_cache(maxsize=None)
def _probe(device: int) -> tuple[tuple[str, object], ...]:
    # A tuple, not a dict: the cached value must not be mutable by callers.
    fp = dict.fromkeys(FIELDS)
    fp.update(torch=str(torch.__version__), package=__version__, cuda_runtime=torch.version.cuda)
    fp.update(_gpu_fields(device))
    fp.update(_cudnn_fields())
    if device >= 0 or fp["cuda_runtime"] is not None:
        fp["driver"] = _driver_version()
    return tuple(fp.items())


def _gpu_fields(device: int) -> dict:
    if device < 0:
        return {}
    try:
        props = torch.cuda.get_device_properties(device)
        return {
            "gpu_name": props.name,
            "compute_capability": f"{props.major}.{props.minor}",
            "sm_count": props.multi_processor_count,
        }
    except Exception as exc:
        logger.debug("cannot read CUDA device %d properties: %r", device, exc)
        return {}


def _cudnn_fields() -> dict:
    try:
        import cudnn
    except Exception as exc:  # ImportError, or an OSError from a broken native extension
        logger.debug("cudnn frontend not importable: %r", exc)
        return {}
    fields = {"cudnn_frontend": getattr(cudnn, "__version__", None)}
    try:
        # Raises RuntimeError when the cuDNN shared library is absent (CPU machines).
        fields["cudnn_backend"] = int(cudnn.backend_version())
    except Exception as exc:
        logger.debug("cuDNN backend library not loadable: %r", exc)
    return fields


@functools.lru_cache(maxsize=None)
def _driver_version() -> str | None:
    """The NVIDIA driver release (e.g. "570.86.15"): torch, else NVML, else nvidia-smi."""
    for probe in (_driver_from_torch, _driver_from_nvml, _driver_from_nvidia_smi):
        try:
            version = probe()
        except Exception as exc:
            logger.debug("driver probe %s failed: %r", probe.__name__, exc)
            continue
        if version:
            return str(version)
    return None


def _driver_from_torch():
    query = getattr(torch.cuda, "driver_version", None)
    return query() if query is not None else None


def _driver_from_nvml():
    import pynvml

    pynvml.nvmlInit()
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
    finally:
        pynvml.nvmlShutdown()
    return version.decode() if isinstance(version, bytes) else version


def _driver_from_nvidia_smi():
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    result = subprocess.run(
        [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=_NVIDIA_SMI_TIMEOUT_S, check=True,
    )
    lines = result.stdout.strip().splitlines()  # one line per GPU, same driver on all
    return lines[0].strip() if lines else None
