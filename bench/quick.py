"""The quick check: four anchor workloads (a 3x3 conv, a large GEMM + bias + GELU, a GEMM +
ReLU + AMAX, causal attention), cf with its heuristic plan against torch eager, plus a conv on an
NCHW input and the host time per call of a tiny op. Writes quick.json.

cf_ms / torch_eager_ms are device times (calls queued behind a GPU spin, so the host's launch
overhead is not in them); *_back_to_back_ms are plain back-to-back calls, where a host slower than
the kernel shows; host_overhead is microseconds of host time per call.

    python3 bench/quick.py --out bench/results
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from cudnn_fuse import loader  # noqa: E402
from bench.common import device_ms, device_name, host_us, time_ms, write_json  # noqa: E402


def rnd(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def first_call_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0)


def workloads():
    cl = torch.channels_last
    x = rnd(64, 128, 56, 56, dtype=torch.float16).to(memory_format=cl)
    w = rnd(128, 128, 3, 3, dtype=torch.float16, scale=0.03).to(memory_format=cl)
    b = rnd(128, dtype=torch.float16)
    yield ("conv3x3_bias_relu_fp16_nhwc_n64_c128_56_k128", 2 * 64 * 128 * 56 * 56 * 128 * 9,
           lambda: cf.conv2d(x, w, b, padding=1, activation="relu"),
           lambda: F.relu(F.conv2d(x, w, b, padding=1)))

    a = rnd(8192, 4096, dtype=torch.bfloat16)
    wt = rnd(4096, 4096, dtype=torch.bfloat16, scale=0.015)
    bias = rnd(4096, dtype=torch.bfloat16)
    yield ("matmul_8192x4096x4096_bias_gelu_bf16", 2 * 8192 * 4096 * 4096,
           lambda: cf.matmul(a, wt, bias, activation="gelu"),
           lambda: F.gelu(torch.addmm(bias, a, wt)))

    a2 = rnd(4096, 4096, dtype=torch.bfloat16)
    b2 = rnd(4096, 4096, dtype=torch.bfloat16, scale=0.015)

    def torch_amax():
        y = F.relu(a2 @ b2)
        return y, y.abs().amax().float()

    yield ("matmul_4096cubed_relu_amax_bf16", 2 * 4096 ** 3,
           lambda: cf.matmul(a2, b2, activation="relu", return_amax=True), torch_amax)

    q, k, v = (rnd(4, 16, 4096, 128, dtype=torch.bfloat16) for _ in range(3))
    yield ("sdpa_causal_bf16_b4_h16_s4096_d128", 4 * 16 * 4096 * 4096 * 128 * 2,  # causal: half of 4*B*H*S*S*D
           lambda: cf.scaled_dot_product_attention(q, k, v, is_causal=True),
           lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))


def nchw_input():
    """The first workload's conv on an NCHW (contiguous) input, as a user may hold it, against torch's
    conv on the same tensors; and the cost of converting the input to channels_last alone."""
    x = rnd(64, 128, 56, 56, dtype=torch.float16)
    w = rnd(128, 128, 3, 3, dtype=torch.float16, scale=0.03)
    b = rnd(128, dtype=torch.float16)
    fn = lambda: cf.conv2d(x, w, b, padding=1, activation="relu")  # noqa: E731
    before = cf.plan_stats()["fallbacks"]
    fn()
    return {"cf_fell_back": cf.plan_stats()["fallbacks"] > before, "cf_ms": device_ms(fn),
            "convert_x_only_ms": device_ms(lambda: x.contiguous(memory_format=torch.channels_last)),
            "torch_eager_ms": device_ms(lambda: F.relu(F.conv2d(x, w, b, padding=1)))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for name, flops, cf_fn, torch_fn in workloads():
        build = first_call_ms(cf_fn)
        engine = loader.plans_in_memory()[-1].engine
        cf_ms, torch_ms = device_ms(cf_fn), device_ms(torch_fn)
        cf_b2b, torch_b2b = time_ms(cf_fn), time_ms(torch_fn)
        rows.append({"name": name, "cf_ms": round(cf_ms, 4), "torch_eager_ms": round(torch_ms, 4),
                     "cf_back_to_back_ms": round(cf_b2b, 4), "torch_back_to_back_ms": round(torch_b2b, 4),
                     "speedup": round(torch_ms / cf_ms, 3), "cf_tflops": round(flops / cf_ms / 1e9, 1),
                     "first_call_ms": round(build, 1), "engine": engine})
        print(f"{name:50s} cf {cf_ms:8.4f} ms  torch {torch_ms:8.4f} ms  x{torch_ms / cf_ms:5.2f}  "
              f"{flops / cf_ms / 1e9:6.1f} TFLOP/s  first call {build:7.1f} ms", flush=True)
    nchw = nchw_input()
    print("conv on an NCHW input:", nchw)
    x = rnd(64, 256, dtype=torch.float16)
    w = rnd(256, 256, dtype=torch.float16, scale=0.06)
    b = rnd(256, dtype=torch.float16)
    host = {"cf_linear_relu_64x256x256_us": round(host_us(lambda: cf.linear(x, w, b, activation="relu")), 2),
            "torch_relu_linear_us": round(host_us(lambda: F.relu(F.linear(x, w, b))), 2)}
    print("host time per call:", host)
    result = {"device": device_name(), "torch": torch.__version__, "workloads": rows, "conv_nchw_input": nchw,
              "host_overhead": host, "plan_stats": cf.plan_stats()}
    write_json(os.path.join(args.out, "quick.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
