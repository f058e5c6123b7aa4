"""Why are cudnn_fuse.triton_gemm's kernels slower than Inductor's Triton GEMM template at the MLP's
shape (bench/results/triton_gemm_probe_runs)? Times, on the backward's dY @ W2 (8192 x 2048 @
2048 x 8192, bf16) and the forward's x @ W1^T: the library's kernels; a plain-store GEMM with the
library's mainloop and runtime sizes; the same with sizes and strides as constexprs, Inductor's
contiguity hints and indices rematerialized after the loop; that kernel with gelu_backward (and the
column sums) in its epilogue; and Inductor's own template (max-autotune, Triton backend only),
with and without gelu_backward fused into it. Device ms, median behind a spin; one JSON.

    python3 bench/triton_gemm_diag.py --out DIR
"""

import argparse
import glob
import os
import shutil
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import device_ms, heat, write_json  # noqa: E402
from cudnn_fuse import triton_act, triton_gemm  # noqa: E402
from cudnn_fuse._triton_kernels import _act_grad  # noqa: E402


@triton.jit
def _body(a_ptr, b_ptr, z_ptr, c_ptr, part_ptr, M, N, K, s_am, s_ak, s_bk, s_bn,
          EPI: tl.constexpr, SUM: tl.constexpr, HINT: tl.constexpr, REMAT: tl.constexpr, EARLY: tl.constexpr,
          BETA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    width = GROUP_M * grid_n
    group_id = pid // width
    group_size = min(grid_m - group_id * GROUP_M, GROUP_M)
    pid_m = group_id * GROUP_M + (pid % group_size)
    pid_n = (pid % width) // group_size
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    if HINT:
        ram = tl.max_contiguous(tl.multiple_of(rm % M, BM), BM)
        rbn = tl.max_contiguous(tl.multiple_of(rn % N, BN), BN)
    else:
        ram = rm % M
        rbn = rn % N
    rk = tl.arange(0, BK)
    if EARLY:
        zo = (pid_m * BM + tl.arange(0, BM))[:, None] * N + (pid_n * BN + tl.arange(0, BN))[None, :]
        z_early = tl.load(z_ptr + zo)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        kk = k * BK + rk
        a = tl.load(a_ptr + ram[:, None] * s_am + kk[None, :] * s_ak)
        b = tl.load(b_ptr + kk[:, None] * s_bk + rbn[None, :] * s_bn)
        acc += tl.dot(a, b)
    if REMAT:
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    offs = rm[:, None] * N + rn[None, :]
    out = acc.to(c_ptr.dtype.element_ty)
    if EPI:
        if EARLY:
            z = z_early.to(tl.float32)
        else:
            z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        out = _act_grad(out.to(tl.float32), z, 0, BETA).to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + offs, out, mask=mask)
    if SUM:
        s = tl.sum(tl.where(mask, out.to(tl.float32), 0.0), axis=0)
        tl.store(part_ptr + pid_m * N + rn, s, mask=rn < N)


@triton.jit
def k_runtime(a_ptr, b_ptr, z_ptr, c_ptr, part_ptr, M, N, K, s_am, s_ak, s_bk, s_bn,
              EPI: tl.constexpr, SUM: tl.constexpr, HINT: tl.constexpr, REMAT: tl.constexpr, BETA: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, EARLY: tl.constexpr = False):
    _body(a_ptr, b_ptr, z_ptr, c_ptr, part_ptr, M, N, K, s_am, s_ak, s_bk, s_bn,
          EPI, SUM, HINT, REMAT, EARLY, BETA, BM, BN, BK, GROUP_M)


@triton.jit
def k_const(a_ptr, b_ptr, z_ptr, c_ptr, part_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
            s_am: tl.constexpr, s_ak: tl.constexpr, s_bk: tl.constexpr, s_bn: tl.constexpr,
            EPI: tl.constexpr, SUM: tl.constexpr, HINT: tl.constexpr, REMAT: tl.constexpr, BETA: tl.constexpr,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, EARLY: tl.constexpr = False):
    _body(a_ptr, b_ptr, z_ptr, c_ptr, part_ptr, M, N, K, s_am, s_ak, s_bk, s_bn,
          EPI, SUM, HINT, REMAT, EARLY, BETA, BM, BN, BK, GROUP_M)


@triton.jit
def _pid(tile, M: tl.constexpr, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    grid_m = tl.cdiv(M, BM)
    width = GROUP_M * tl.cdiv(N, BN)
    group_id = tile // width
    group_size = min(grid_m - group_id * GROUP_M, GROUP_M)
    return group_id * GROUP_M + (tile % group_size), (tile % width) // group_size


@triton.jit
def _epilogue(acc, z, c_ptr, part_ptr, pid_m, pid_n, rm, rn, N: tl.constexpr, EPI: tl.constexpr, SUM: tl.constexpr,
              BETA: tl.constexpr):
    out = acc.to(c_ptr.dtype.element_ty)
    if EPI:
        out = _act_grad(out.to(tl.float32), z.to(tl.float32), 0, BETA).to(c_ptr.dtype.element_ty)
    if SUM:
        tl.store(part_ptr + pid_m * N + rn, tl.sum(out.to(tl.float32), axis=0))
    return out


@triton.jit
def k_persist(a_ptr, b_ptr, z_ptr, c_ptr, part_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
              s_am: tl.constexpr, s_ak: tl.constexpr, s_bk: tl.constexpr, s_bn: tl.constexpr,
              EPI: tl.constexpr, SUM: tl.constexpr, FLATTEN: tl.constexpr, PROGS: tl.constexpr, BETA: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """Persistent (PROGS programs walk the tiles), pointer loads; sizes divisible by the tiles."""
    start = tl.program_id(0)
    tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    tile_c = start - PROGS
    for tile in tl.range(start, tiles, PROGS, flatten=FLATTEN):
        pid_m, pid_n = _pid(tile, M, N, BM, BN, GROUP_M)
        ram = tl.max_contiguous(tl.multiple_of(pid_m * BM + tl.arange(0, BM), BM), BM)
        rbn = tl.max_contiguous(tl.multiple_of(pid_n * BN + tl.arange(0, BN), BN), BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(K // BK):
            kk = ki * BK + tl.arange(0, BK)
            a = tl.load(a_ptr + ram[:, None] * s_am + kk[None, :] * s_ak)
            b = tl.load(b_ptr + kk[:, None] * s_bk + rbn[None, :] * s_bn)
            acc = tl.dot(a, b, acc)
        tile_c += PROGS
        pid_m, pid_n = _pid(tile_c, M, N, BM, BN, GROUP_M)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        offs = rm[:, None] * N + rn[None, :]
        z = tl.load(z_ptr + offs) if EPI else acc
        tl.store(c_ptr + offs, _epilogue(acc, z, c_ptr, part_ptr, pid_m, pid_n, rm, rn, N, EPI, SUM, BETA))


@triton.jit
def k_tma(a_desc, b_desc, z_desc, c_desc, part_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
          EPI: tl.constexpr, SUM: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr, PROGS: tl.constexpr,
          BETA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """Persistent, TMA loads and stores through host tensor descriptors (B as [K, N] row-major)."""
    start = tl.program_id(0)
    tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    tile_c = start - PROGS
    for tile in tl.range(start, tiles, PROGS, flatten=FLATTEN, warp_specialize=WS):
        pid_m, pid_n = _pid(tile, M, N, BM, BN, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(K // BK):
            a = a_desc.load([pid_m * BM, ki * BK])
            b = b_desc.load([ki * BK, pid_n * BN])
            acc = tl.dot(a, b, acc)
        tile_c += PROGS
        pid_m, pid_n = _pid(tile_c, M, N, BM, BN, GROUP_M)
        rn = pid_n * BN + tl.arange(0, BN)
        z = z_desc.load([pid_m * BM, pid_n * BN]) if EPI else acc
        out = acc.to(tl.bfloat16)
        if EPI:
            out = _act_grad(out.to(tl.float32), z.to(tl.float32), 0, BETA).to(tl.bfloat16)
        if SUM:
            tl.store(part_ptr + pid_m * N + rn, tl.sum(out.to(tl.float32), axis=0))
        c_desc.store([pid_m * BM, pid_n * BN], out)


CONFIGS = [(128, 128, 64, 8, 3, 4), (128, 128, 64, 8, 4, 4), (128, 128, 64, 8, 3, 8), (128, 256, 64, 8, 3, 8),
           (256, 128, 64, 8, 3, 8), (128, 128, 32, 8, 4, 4)]


META = {}


def _meta(tag, ck):
    """Registers, spills and shared memory of a compiled kernel (what bounds CTAs per SM)."""
    if tag not in META:
        try:
            META[tag] = {"regs": ck.n_regs, "spills": ck.n_spills, "shared": ck.metadata.shared}
        except Exception as e:  # noqa: BLE001
            META[tag] = repr(e)[:80]


PCONFIGS = [(128, 128, 64, 8, 3, 4), (128, 128, 64, 8, 2, 4), (128, 256, 64, 8, 3, 8), (128, 128, 64, 8, 4, 8)]
OCC_CONFIGS = [(128, 128, 64, 8, 2, 4), (128, 128, 32, 8, 3, 4), (64, 128, 64, 8, 3, 4), (128, 64, 64, 8, 3, 4),
               (128, 128, 64, 8, 3, 4), (128, 256, 64, 8, 3, 8)]


def launcher(kern, a, b, z, c, part, epi, sum_, hint, remat, cfg, early=False, tag=None):
    M, K = a.shape
    N = b.shape[1]
    bm, bn, bk, g, st, w = cfg
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    beta = triton_act._act_id("gelu")[1]
    args = (a, b, z, c, part, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1))

    def go():
        ck = kern[grid](*args, EPI=epi, SUM=sum_, HINT=hint, REMAT=remat, BETA=beta, BM=bm, BN=bn, BK=bk,
                        GROUP_M=g, EARLY=early, num_stages=st, num_warps=w)
        if tag:
            _meta(tag, ck)
    return go


def persist_launcher(a, b, z, c, part, epi, sum_, cfg, flatten, progs, tag):
    M, K = a.shape
    N = b.shape[1]
    bm, bn, bk, g, st, w = cfg
    beta = triton_act._act_id("gelu")[1]

    def go():
        ck = k_persist[(progs,)](a, b, z, c, part, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                                 EPI=epi, SUM=sum_, FLATTEN=flatten, PROGS=progs, BETA=beta, BM=bm, BN=bn, BK=bk,
                                 GROUP_M=g, num_stages=st, num_warps=w)
        _meta(tag, ck)
    return go


def tma_launcher(a, b, z, c, part, epi, sum_, cfg, flatten, ws, progs, tag):
    from triton.tools.tensor_descriptor import TensorDescriptor
    M, K = a.shape
    N = b.shape[1]
    bm, bn, bk, g, st, w = cfg
    beta = triton_act._act_id("gelu")[1]
    da = TensorDescriptor.from_tensor(a, [bm, bk])
    db = TensorDescriptor.from_tensor(b, [bk, bn])
    dz = TensorDescriptor.from_tensor(z, [bm, bn])
    dc = TensorDescriptor.from_tensor(c, [bm, bn])

    def go():
        ck = k_tma[(progs,)](da, db, dz, dc, part, M, N, K, EPI=epi, SUM=sum_, FLATTEN=flatten, WS=ws, PROGS=progs,
                             BETA=beta, BM=bm, BN=bn, BK=bk, GROUP_M=g, num_stages=st, num_warps=w)
        _meta(tag, ck)
    return go


def time_or_none(fn):
    try:
        fn()
        torch.cuda.synchronize()
        return device_ms(fn)
    except Exception as e:  # noqa: BLE001 - out of shared memory, say
        return f"{type(e).__name__}: {str(e)[:120]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    dt = torch.bfloat16
    gy = torch.randn(8192, 2048, device="cuda", dtype=dt)
    w2 = (torch.randn(2048, 8192, device="cuda") / 90).to(dt)
    x = torch.randn(8192, 2048, device="cuda", dtype=dt)
    w1 = (torch.randn(8192, 2048, device="cuda") / 45).to(dt)
    z = torch.randn(8192, 8192, device="cuda", dtype=dt)
    c = torch.empty_like(z)
    part = torch.empty(8192 // 64, 8192, device="cuda", dtype=torch.float32)  # one row per tile row, BM >= 64
    os.makedirs(args.out, exist_ok=True)
    heat(1.0)
    res = {"triton": triton.__version__, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
           "eager": {"mm_bwd": device_ms(lambda: gy @ w2), "mm_fwd": device_ms(lambda: x @ w1.t()),
                     "mm_gelu_backward": device_ms(lambda: torch.ops.aten.gelu_backward(gy @ w2, z)),
                     "mm_gelu_backward_sum": device_ms(lambda: torch.ops.aten.gelu_backward(gy @ w2, z).sum(0))},
           "variants": {}}
    ref = torch.ops.aten.gelu_backward(gy @ w2, z)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res["sms"] = sms
    for cfg in PCONFIGS:
        row = {}
        t0 = time.perf_counter()
        for occ in (1, 2):
            for flatten in (True, False):
                tag = f"persist_occ{occ}{'_flat' if flatten else ''}"
                for epi, sum_, what in ((False, False, "mm"), (True, False, "gelu_bwd"), (True, True, "gelu_bwd_sum")):
                    row[f"{tag}_{what}"] = time_or_none(persist_launcher(gy, w2, z, c, part, epi, sum_, cfg, flatten,
                                                                         occ * sms, f"{cfg}{tag}_{what}"))
                    if what == "gelu_bwd" and isinstance(row[f"{tag}_{what}"], float):
                        row[f"{tag}_gelu_bwd_differ_frac"] = float((c != ref).float().mean())
            for flatten, ws in ((True, False), (False, False)):  # warp_specialize failed to compile for sm_90 (Triton 3.9, CPU)
                tag = f"tma_occ{occ}{'_flat' if flatten else ''}{'_ws' if ws else ''}"
                for epi, sum_, what in ((False, False, "mm"), (True, False, "gelu_bwd"), (True, True, "gelu_bwd_sum")):
                    if ws and sum_:  # Triton's warp specialization asserts on the column reduction (3.9, CPU compile)
                        continue
                    try:
                        go = tma_launcher(gy, w2, z, c, part, epi, sum_, cfg, flatten, ws, occ * sms, f"{cfg}{tag}_{what}")
                        row[f"{tag}_{what}"] = time_or_none(go)
                    except Exception as e:  # noqa: BLE001
                        row[f"{tag}_{what}"] = f"{type(e).__name__}: {str(e)[:120]}"
                    if what == "gelu_bwd" and isinstance(row[f"{tag}_{what}"], float):
                        row[f"{tag}_gelu_bwd_differ_frac"] = float((c != ref).float().mean())
        res["variants"]["persistent " + str(cfg)] = row
        write_json(os.path.join(args.out, "triton_gemm_diag.json"), res)
        print("persistent", cfg, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()},
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
    for cfg in OCC_CONFIGS:
        row = {}
        t0 = time.perf_counter()
        for early in (False, True):
            tag = "const_hint" + ("_early" if early else "")
            for epi, sum_, what in ((False, False, "mm"), (True, False, "gelu_bwd"), (True, True, "gelu_bwd_sum")):
                if early and not epi:
                    continue
                row[f"{tag}_{what}"] = time_or_none(launcher(k_const, gy, w2, z, c, part, epi, sum_, True, True, cfg,
                                                             early, f"{cfg}{tag}_{what}"))
        res["variants"]["occupancy " + str(cfg)] = row
        res["kernel_meta"] = META
        write_json(os.path.join(args.out, "triton_gemm_diag.json"), res)
        print("occupancy", cfg, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()},
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
    res["kernel_meta"] = META
    if os.environ.get("DIAG_SKIP_FIRST"):
        CONFIGS.clear()
    for cfg in CONFIGS:
        row = {}
        t0 = time.perf_counter()
        triton_gemm.BWD_CONFIG = cfg
        triton_gemm._kernels = None
        row["library_bwd_no_sum"] = time_or_none(lambda: triton_gemm.matmul_act_grad(gy, w2, z, "gelu", False))
        for name, kern in (("runtime", k_runtime), ("const", k_const)):
            for hint, remat in ((False, False), (True, True)):
                tag = f"{name}{'_hint' if hint else ''}"
                row[f"{tag}_mm_bwd"] = time_or_none(launcher(kern, gy, w2, z, c, part, False, False, hint, remat, cfg))
                row[f"{tag}_mm_fwd"] = time_or_none(launcher(kern, x, w1.t(), z, c, part, False, False, hint, remat, cfg))
                row[f"{tag}_gelu_bwd"] = time_or_none(launcher(kern, gy, w2, z, c, part, True, False, hint, remat, cfg))
                row[f"{tag}_gelu_bwd_sum"] = time_or_none(launcher(kern, gy, w2, z, c, part, True, True, hint, remat, cfg))
                if isinstance(row[f"{tag}_gelu_bwd"], float):
                    launcher(kern, gy, w2, z, c, part, True, False, hint, remat, cfg)()
                    row[f"{tag}_gelu_bwd_differ_frac"] = float((c != ref).float().mean())
        res["variants"][str(cfg)] = row
        print(cfg, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()},
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
    res["kernel_meta"] = META
    ind = {}
    if os.environ.get("DIAG_SKIP_INDUCTOR"):
        write_json(os.path.join(args.out, "triton_gemm_diag.json"), res)
        return
    import torch._inductor.config as ic
    with ic.patch(max_autotune=True, max_autotune_gemm_backends="TRITON", epilogue_fusion=True):
        for name, fn, inputs in (("mm", lambda a, b: a @ b, (gy, w2)),
                                 ("mm_gelu_backward", lambda a, b, zz: torch.ops.aten.gelu_backward(a @ b, zz), (gy, w2, z)),
                                 ("mm_gelu_backward_sum",
                                  lambda a, b, zz: torch.ops.aten.gelu_backward(a @ b, zz).sum(0), (gy, w2, z))):
            torch._dynamo.reset()
            t0 = time.perf_counter()
            try:
                f = torch.compile(fn, mode="max-autotune-no-cudagraphs", dynamic=False)
                f(*inputs)
                torch.cuda.synchronize()
                ind[name] = device_ms(lambda: f(*inputs))
            except Exception as e:  # noqa: BLE001
                ind[name] = f"{type(e).__name__}: {str(e)[:200]}"
            ind[name + "_compile_s"] = round(time.perf_counter() - t0, 1)
            print("inductor triton-only", name, ind[name], flush=True)
    res["inductor_triton_only"] = ind
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "triton_gemm_diag.json"), res)
    # Inductor's generated kernels (the templates with their epilogues), for reading
    kdir = os.path.join(args.out, "inductor_kernels")
    os.makedirs(kdir, exist_ok=True)
    import tempfile
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or tempfile.gettempdir()
    n = 0
    for p in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        try:
            txt = open(p).read()
        except OSError:
            continue
        if "triton_tem" in txt and "def call" in txt and n < 8:
            shutil.copy(p, os.path.join(kdir, f"output_code_{n}.py"))
            n += 1
    print("copied", n, "inductor output files from", root)


if __name__ == "__main__":
    main()
