"""nn.FusedMLP's exact-GELU epilogues as CUTLASS 3 Hopper GEMMs (CUDNN_FUSE_MLP_KERNELS=cutlass).

cuBLASLt's GELU epilogues compute the tanh approximation only, so a block with ``nn.GELU()``
(approximate="none") had no fused GEMM on this stack. ``cudnn_fuse/csrc/cutlass_mlp.cu`` is two
CUTLASS 3 warp-specialized GEMMs with their epilogues built from CUTLASS's own fusion operations
(LinCombPerRowBiasEltActAux, LinCombDeEltAct) and aten's GELU formulas:

- ``linear_gelu_aux``: z = x @ w1.T + b1 and y = gelu(z) from ONE GEMM (z its aux output);
- ``dgelu``: dz = (dY @ W2) * gelu'(z) from ONE GEMM (z read in its epilogue).

Each element is computed as eager computes it from the rounded bf16 values (GELU of the bf16 z,
gelu_backward of the bf16 product), so outputs differ from eager's only where the GEMMs' own fp32
sums round differently. bf16 on sm_90 only, every dimension a multiple of 8, contiguous operands.

The kernels are an optional shared library built on the user's machine by
``cudnn-fuse build-kernels --cutlass-dir DIR`` (nvcc 12.3+ and a CUTLASS 3 checkout's headers; the
source ships in the package), loaded through ctypes from ``$CUDNN_FUSE_CUTLASS_LIB``, else the
package's directory, else the user data directory (``library_candidates()``). Anything they cannot
take, or a missing library, answers None and the caller runs torch's kernels; a failure is logged once.

``CUDNN_FUSE_CUTLASS_FWD_CONFIG`` / ``CUDNN_FUSE_CUTLASS_BWD_CONFIG`` pick each kernel's launch:
tile + 16 * log2(swizzle) + 64 * raster order, the tiles as cutlass_mlp.cu lists them
(``bench/cutlass_mlp_probe.py`` times them); a forward config of -1 leaves the forward to torch's kernels.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Optional, Tuple

import torch

from . import envvars

log = logging.getLogger(__name__)

TILES = 6  # cutlass_mlp.cu's kConfigs
MAX_CONFIG = 64 * 3 - 1
# The probe's picks at 8192 x 2048 -> 8192 bf16 on the H200 (bench/results/cutlass_mlp/cutlass_mlp_probe_d7d4ec8.json):
# forward ping-pong 128x128x64, cluster 1x2, swizzle 8 (0.504 ms against eager's addmm + GELU 0.542);
# backward ping-pong 128x128x64, cluster 1x1, swizzle 8 (0.522 ms against the product + gelu_backward 0.596).
FWD_CONFIG = envvars.number("CUDNN_FUSE_CUTLASS_FWD_CONFIG", 2 + 16 * 3, integer=True, minimum=-1, maximum=MAX_CONFIG)
BWD_CONFIG = envvars.number("CUDNN_FUSE_CUTLASS_BWD_CONFIG", 1 + 16 * 3, integer=True, minimum=0, maximum=MAX_CONFIG)
_lib = None
_lib_tried = False
_lock = threading.Lock()
_warned: set = set()
_ws: dict = {}  # (device index, stream) -> a uint8 workspace tensor
stats = {"forward": 0, "backward": 0, "declined": 0}


LIB_NAME = "_cutlass_mlp.so"
SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "cutlass_mlp.cu")


def user_library_path() -> str:
    import platformdirs

    return os.path.join(platformdirs.user_data_dir("cudnn-fuse"), "kernels", LIB_NAME)


def library_candidates() -> list:
    """Where the library is looked for, in order: $CUDNN_FUSE_CUTLASS_LIB alone where set, else the
    package's directory, then the user data directory."""
    env = os.environ.get("CUDNN_FUSE_CUTLASS_LIB")
    if env:
        return [env]
    return [os.path.join(os.path.dirname(__file__), LIB_NAME), user_library_path()]


def library_path() -> str:
    """The first candidate that exists (the first candidate where none does)."""
    cands = library_candidates()
    return next((c for c in cands if os.path.exists(c)), cands[0])


def reset() -> None:
    """Forget the loaded (or missing) library: the next call looks again (after build-kernels)."""
    global _lib, _lib_tried
    with _lock:
        _lib, _lib_tried = None, False


def _load():
    global _lib, _lib_tried
    if _lib_tried:
        return _lib
    with _lock:
        if _lib_tried:
            return _lib
        path = library_path()
        try:
            lib = ctypes.CDLL(path)
            vp, i32, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
            lib.cf_cutlass_linear_gelu_aux.argtypes = [i32, i32, i32, i32, vp, vp, vp, vp, vp, vp, sz, i32, vp,
                                                       ctypes.POINTER(sz)]
            lib.cf_cutlass_dgelu.argtypes = [i32, i32, i32, i32, vp, vp, vp, vp, vp, sz, i32, vp, ctypes.POINTER(sz)]
            lib.cf_cutlass_linear_gelu_aux.restype = lib.cf_cutlass_dgelu.restype = i32
            _lib = lib
        except (OSError, AttributeError) as exc:
            quiet = not os.path.exists(path) and not os.environ.get("CUDNN_FUSE_CUTLASS_LIB")
            (log.debug if quiet else log.warning)(  # never built: the usual case, not worth a warning
                "CUTLASS MLP kernels unavailable (%s: %s); torch's kernels run%s", path, exc,
                " (cudnn-fuse build-kernels builds them)" if quiet else "")
        _lib_tried = True
    return _lib


def available() -> bool:
    return _load() is not None


def usable(*ts: Optional[torch.Tensor]) -> bool:
    """bf16 CUDA tensors, contiguous, 16-byte aligned, on an sm_90 device."""
    first = ts[0]
    if first is None or not first.is_cuda or torch.cuda.get_device_capability(first.device) != (9, 0):
        return False
    return all(t is None or (t.dtype == torch.bfloat16 and t.is_cuda and t.device == first.device
                             and t.is_contiguous() and t.data_ptr() % 16 == 0) for t in ts)


def _dims_ok(m: int, n: int, k: int) -> bool:
    """Non-empty, every dimension a multiple of 8 (16-byte rows for TMA) and within int32."""
    return m > 0 and not (m % 8 or n % 8 or k % 8) and max(m, n, k) < 2 ** 31


def _warn_once(what: str, rc: int) -> None:
    stats["declined"] += 1
    if what not in _warned:
        _warned.add(what)
        log.warning("CUTLASS %s declined (status %d); torch's kernels run", what, rc)


def _call(fn, what: str, dev: torch.device, args_before_ws: tuple) -> bool:
    """Query the workspace, then launch on the current stream. True where the kernel ran."""
    stream = torch.cuda.current_stream(dev)
    need = ctypes.c_size_t(0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    # a workspace query: the same arguments with the first operand null
    q = (args_before_ws[0], args_before_ws[1], args_before_ws[2], args_before_ws[3], None) + args_before_ws[5:]
    rc = fn(*q, None, 0, sms, ctypes.c_void_p(stream.cuda_stream), ctypes.byref(need))
    if rc != 0:
        _warn_once(what, rc)
        return False
    ws = None
    if need.value:
        ws = torch.empty(need.value, dtype=torch.uint8, device=dev)
    rc = fn(*args_before_ws, ws.data_ptr() if ws is not None else None, need.value, sms,
            ctypes.c_void_p(stream.cuda_stream), ctypes.byref(need))
    if rc != 0:
        _warn_once(what, rc)
        return False
    return True


def linear_gelu_aux(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]
                    ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """``(y, z)``: z = x @ w.T + bias and y = gelu(z) (exact) from ONE GEMM. x [..., K], w [N, K],
    bias [N] (required). None where the kernels cannot take it."""
    if FWD_CONFIG < 0 or FWD_CONFIG % 16 >= TILES:
        return None
    if bias is None or w.dim() != 2 or x.dim() < 1 or x.shape[-1] != w.shape[1] or bias.shape != (w.shape[0],):
        return None
    lib = _load()
    if lib is None:
        return None
    n, k = w.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if not _dims_ok(m, n, k) or not usable(x2, w, bias):
        return None
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    z = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if not _call(lib.cf_cutlass_linear_gelu_aux, "linear + GELU forward", x.device,
                 (FWD_CONFIG, m, n, k, x2.data_ptr(), w.data_ptr(), bias.data_ptr(), y.data_ptr(), z.data_ptr())):
        return None
    stats["forward"] += 1
    shape = tuple(x.shape[:-1]) + (n,)
    return y.view(shape), z.view(shape)


def dgelu(gy: torch.Tensor, w2: torch.Tensor, z: torch.Tensor) -> Optional[torch.Tensor]:
    """dz = (gy @ w2) * gelu'(z) (exact GELU) from ONE GEMM. gy [..., K], w2 [K, N] (the next layer's
    weight), z [..., N]. None where the kernels cannot take it."""
    if BWD_CONFIG % 16 >= TILES or w2.dim() != 2 or gy.shape[-1] != w2.shape[0] or z.shape[-1] != w2.shape[1]:
        return None
    lib = _load()
    if lib is None:
        return None
    k, n = w2.shape
    gy2 = gy.reshape(-1, k)
    z2 = z.reshape(-1, n)
    m = gy2.shape[0]
    if z2.shape[0] != m or not _dims_ok(m, n, k) or not usable(gy2, w2, z2):
        return None
    dz = torch.empty((m, n), dtype=z.dtype, device=z.device)
    if not _call(lib.cf_cutlass_dgelu, "GELU backward", z.device,
                 (BWD_CONFIG, m, n, k, gy2.data_ptr(), w2.data_ptr(), z2.data_ptr(), dz.data_ptr())):
        return None
    stats["backward"] += 1
    return dz.view(z.shape)


# ------------------------------------------------------------------------------- build


def find_nvcc(nvcc: Optional[str] = None) -> str:
    """``nvcc`` as given, else $NVCC, else on PATH, else $CUDA_HOME/bin/nvcc; ValueError naming --nvcc."""
    import shutil

    for cand in (nvcc, os.environ.get("NVCC"), shutil.which("nvcc"),
                 os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
        if cand and cand == nvcc:
            raise ValueError(f"--nvcc: {nvcc!r} is not an executable file")
    raise ValueError("--nvcc: no nvcc found (PATH, $NVCC, $CUDA_HOME/bin); CUDA 12.3 or later is needed")


def check_cutlass_dir(cutlass_dir: Optional[str]) -> str:
    """The CUTLASS checkout's root; ValueError naming --cutlass-dir where its headers are missing."""
    d = cutlass_dir or os.environ.get("CUTLASS_DIR")
    if not d:
        raise ValueError("--cutlass-dir: give a CUTLASS 3 checkout (git clone https://github.com/NVIDIA/cutlass) "
                         "or set $CUTLASS_DIR")
    for rel in ("include/cutlass/cutlass.h", "include/cute/tensor.hpp", "tools/util/include/cutlass/util/packed_stride.hpp"):
        if not os.path.isfile(os.path.join(d, rel)):
            raise ValueError(f"--cutlass-dir: {d!r} has no {rel} (a CUTLASS 3 checkout's root is needed)")
    return os.path.abspath(d)


def build_commands(nvcc: str, cutlass_dir: str, workdir: str, arch: str = "sm_90a", extra: tuple = ()) -> tuple:
    """([(object file, compile command)], link command writing ``workdir/_cutlass_mlp.so``): one
    translation unit per (direction, tile) and one for the dispatch, so they compile in parallel."""
    base = [nvcc, "-O3", "-std=c++17", f"-arch={arch}", "--expt-relaxed-constexpr", "-diag-suppress", "20012",
            "-Xcompiler=-fPIC", "-DNDEBUG", "-I" + os.path.join(cutlass_dir, "include"),
            "-I" + os.path.join(cutlass_dir, "tools", "util", "include"), *extra]
    units = [(f"fwd{f}_tile{t}", [f"-DCF_TU_FWD={f}", f"-DCF_TU_TILE={t}"]) for f in (1, 0) for t in range(TILES)]
    units.append(("main", ["-DCF_TU_MAIN"]))
    compiles = []
    for name, defs in units:
        obj = os.path.join(workdir, name + ".o")
        compiles.append((obj, base + defs + ["-c", SOURCE, "-o", obj]))
    libdirs = [d for d in (os.path.join(os.path.dirname(os.path.dirname(nvcc)), sub) for sub in ("lib64", "lib"))
               if os.path.isdir(d)]
    link = [nvcc, f"-arch={arch}", "-shared", *("-L" + d for d in libdirs), *(o for o, _ in compiles),
            "-o", os.path.join(workdir, LIB_NAME)]
    return compiles, link


def build(cutlass_dir: Optional[str] = None, nvcc: Optional[str] = None, output: Optional[str] = None,
          jobs: Optional[int] = None, progress=None, extra_flags: tuple = ()) -> str:
    """Compile and link the kernels; returns the library's path. ``output``: where to write it (default:
    the package's directory where writable, else the user data directory). ``progress(done, total)``
    after each step. The library is replaced atomically, and only by a complete build; a failed step
    raises RuntimeError with nvcc's last lines."""
    import subprocess
    import tempfile
    from concurrent.futures import ThreadPoolExecutor, as_completed

    cutlass_dir = check_cutlass_dir(cutlass_dir)
    nvcc = find_nvcc(nvcc)
    if output is None:
        pkg = os.path.dirname(__file__)
        output = os.path.join(pkg, LIB_NAME) if os.access(pkg, os.W_OK) else user_library_path()
    out_dir = os.path.dirname(os.path.abspath(output))
    os.makedirs(out_dir, exist_ok=True)
    if not os.access(out_dir, os.W_OK):
        raise ValueError(f"--output: cannot write to {out_dir}")
    with tempfile.TemporaryDirectory(prefix="cudnn_fuse_build_") as work:
        compiles, link = build_commands(nvcc, cutlass_dir, work, extra=tuple(extra_flags))
        total, done = len(compiles) + 1, 0
        if progress is not None:
            progress(0, total)

        def run(cmd):
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                tail = "\n".join((p.stderr or p.stdout or "").strip().splitlines()[-15:])
                raise RuntimeError(f"{os.path.basename(cmd[0])} failed ({p.returncode}) on "
                                   f"{cmd[-1] if cmd[-2] == '-o' else cmd}:\n{tail}")

        workers = max(1, jobs or min(len(compiles), os.cpu_count() or 1))
        with ThreadPoolExecutor(workers) as pool:
            futures = [pool.submit(run, cmd) for _, cmd in compiles]
            try:
                for f in as_completed(futures):
                    f.result()
                    done += 1
                    if progress is not None:
                        progress(done, total)
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
        run(link)
        built = os.path.join(work, LIB_NAME)
        tmp = output + f".tmp{os.getpid()}"
        import shutil

        shutil.copyfile(built, tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, output)
        if progress is not None:
            progress(total, total)
    log.info("built %s", output)
    reset()
    return output
