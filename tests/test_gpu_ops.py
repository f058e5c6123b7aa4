"""GPU tests: every op x epilogue x dtype through the fused cuDNN path, against
an fp64 (fp32 for attention) reference computed on upcast inputs.

Run on the device machine: ``python3 -m pytest -m gpu tests``.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F

import cudnn_fuse as cf
from cudnn_fuse import loader, reference
from cudnn_fuse.spec import ACTIVATIONS
from fuzz import GRAD_TOL

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("strict_fp32")]  # fp32 means fp32

ACTS = [None, *ACTIVATIONS]  # every activation cf fuses, and none
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
TOL = {torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float32: 1e-5}


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "output has NaN/Inf"
    denom = ref.norm().item()
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)


def rnd(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device="cuda", dtype=torch.float32) * scale).to(dtype)


class Fused:
    """Asserts that the block ran fused graphs only (no fallback) and counts builds."""

    def __init__(self, allow_fallback=False):
        self.allow_fallback = allow_fallback

    def __enter__(self):
        self.before = cf.plan_stats()
        return self

    def __exit__(self, *exc):
        after = cf.plan_stats()
        self.builds = after["builds"] - self.before["builds"]
        self.loads = after["loads"] - self.before["loads"]
        self.fallbacks = after["fallbacks"] - self.before["fallbacks"]
        if exc[0] is None and not self.allow_fallback:
            assert self.fallbacks == 0, "the op fell back to PyTorch"
        return False


def expect_fused(dtype, kind):
    """fp32 matmul with TF32 off is documented to fall back (cuDNN rounds via TF32)."""
    return not (dtype == torch.float32 and kind == "matmul")


# ------------------------------------------------------------------ conv2d


def conv_case(dtype, act, bias=True, residual=True, amax=False, N=4, C=32, H=14, W=14, K=48, R=3, stride=1, padding=1,
              dilation=1, groups=1, channels_last=True, slope=0.01):
    x = rnd(N, C, H, W, dtype=dtype)
    w = rnd(K, C // groups, R, R, dtype=dtype, scale=1 / math.sqrt(C // groups * R * R))
    if channels_last:
        x, w = x.to(memory_format=torch.channels_last), w.to(memory_format=torch.channels_last)
    b = rnd(K, dtype=dtype) if bias else None
    z = F.conv2d(x.double(), w.double(), None, stride, padding, dilation, groups)
    r = rnd(*z.shape, dtype=dtype) if residual else None
    if r is not None and channels_last:
        r = r.to(memory_format=torch.channels_last)
    ref = reference.epilogue(z, b.double() if b is not None else None, r.double() if r is not None else None, act, slope,
                             amax, bias_shape=(1, -1, 1, 1))
    out = cf.conv2d(x, w, b, stride, padding, dilation, groups, activation=act, residual=r, return_amax=amax,
                    negative_slope=slope)
    return out, ref


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
def test_conv_every_activation(dtype, act):
    with Fused():
        y, ref = conv_case(dtype, act)
    assert y.dtype == dtype and y.shape == ref.shape
    assert rel_err(y, ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias,residual,amax", [(False, False, False), (True, False, False), (False, True, False),
                                                (False, False, True), (True, True, True)])
def test_conv_epilogue_combinations(dtype, bias, residual, amax):
    # true-fp32 conv + AMAX: cuDNN 9.19 has no non-tensor-core engine for it -> logged fallback
    with Fused(allow_fallback=dtype == torch.float32 and amax):
        out, ref = conv_case(dtype, "relu", bias, residual, amax)
    if amax:
        (y, a), (ry, ra) = out, ref
        assert a.dtype == torch.float32 and a.dim() == 0
        assert abs(a.item() - ra.item()) <= 1e-2 * ra.item()
        assert abs(a.item() - y.abs().max().item()) <= 1e-2 * ra.item()
    else:
        y, ry = out, ref
    assert rel_err(y, ry) <= TOL[dtype]


CONV_SHAPES = {
    "prime": dict(N=3, C=8, H=13, W=11, K=24, R=3),
    "stride2": dict(stride=2),
    "dilation2": dict(dilation=2, padding=2),
    "groups4": dict(groups=4),
    "depthwise": dict(C=32, K=32, groups=32),
    "1x1": dict(R=1, padding=0),
    "batch1": dict(N=1),
    "7x7s2": dict(C=16, K=64, R=7, stride=2, padding=3, H=32, W=32),
    "nchw": dict(channels_last=False),
    "nchw_stride2": dict(channels_last=False, stride=2),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(CONV_SHAPES))
def test_conv_odd_shapes(dtype, name):
    # bf16 depthwise: cuDNN 9.19 has no engine on Hopper (fp16/fp32 only) -> logged fallback
    with Fused(allow_fallback=name == "depthwise" and dtype == torch.bfloat16):
        y, ref = conv_case(dtype, "silu", **CONV_SHAPES[name])
    assert rel_err(y, ref) <= TOL[dtype]


def test_conv_output_is_channels_last_and_equal_for_both_input_layouts():
    x = rnd(2, 16, 8, 8, dtype=torch.float16)
    w = rnd(16, 16, 3, 3, dtype=torch.float16)
    y_cl = cf.conv2d(x.to(memory_format=torch.channels_last), w, padding=1)
    assert y_cl.is_contiguous(memory_format=torch.channels_last)
    y = cf.conv2d(x, w, padding=1)  # NCHW in: converted (measured faster, docs/decisions.md)
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(y, y_cl)


def test_conv_same_padding_even_kernel_and_unbatched():
    x = rnd(16, 10, 9, dtype=torch.float16)
    w = rnd(8, 16, 4, 4, dtype=torch.float16, scale=0.1)
    y = cf.conv2d(x, w, padding="same")
    ref = F.conv2d(x.double(), w.double(), padding="same")
    assert y.shape == ref.shape == (8, 10, 9)
    assert rel_err(y, ref) <= 1e-2


# ------------------------------------------------------------------ linear / matmul


def mm_case(dtype, act, kind="linear", bias=True, residual=True, amax=False, M=96, K=128, N=80, batch=(), bbatch=(),
            slope=0.01):
    if kind == "linear":
        x = rnd(*batch, M, K, dtype=dtype)
        w = rnd(N, K, dtype=dtype, scale=1 / math.sqrt(K))
        z = F.linear(x.double(), w.double())
    else:
        x = rnd(*batch, M, K, dtype=dtype)
        w = rnd(*bbatch, K, N, dtype=dtype, scale=1 / math.sqrt(K))
        z = torch.matmul(x.double(), w.double())
    b = rnd(N, dtype=dtype) if bias else None
    r = rnd(*z.shape, dtype=dtype) if residual else None
    ref = reference.epilogue(z, b.double() if b is not None else None, r.double() if r is not None else None, act, slope,
                             amax)
    op = cf.linear if kind == "linear" else cf.matmul
    out = op(x, w, b, activation=act, residual=r, return_amax=amax, negative_slope=slope)
    return out, ref


@pytest.mark.parametrize("kind", ["linear", "matmul"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
def test_matmul_every_activation(kind, dtype, act):
    with Fused(allow_fallback=not expect_fused(dtype, "matmul")):
        y, ref = mm_case(dtype, act, kind)
    assert y.dtype == dtype and y.shape == ref.shape
    assert rel_err(y, ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias,residual,amax", [(False, False, False), (True, False, False), (False, True, False),
                                                (False, False, True), (True, True, True)])
def test_matmul_epilogue_combinations(dtype, bias, residual, amax):
    with Fused(allow_fallback=not expect_fused(dtype, "matmul")):
        out, ref = mm_case(dtype, "gelu", "matmul", bias, residual, amax)
    if amax:
        (y, a), (ry, ra) = out, ref
        assert a.dtype == torch.float32 and a.dim() == 0
        assert abs(a.item() - ra.item()) <= 1e-2 * ra.item()
    else:
        y, ry = out, ref
    assert rel_err(y, ry) <= TOL[dtype]


def test_fp32_matmul_uses_cudnn_when_tf32_allowed():
    torch.backends.cuda.matmul.allow_tf32 = True
    with Fused() as f:
        y, ref = mm_case(torch.float32, "relu", "matmul")
    assert f.fallbacks == 0
    assert rel_err(y, ref) <= 2e-3  # TF32 rounding


MM_SHAPES = {
    "prime": dict(M=97, K=64, N=40),
    "prime_k": dict(M=64, K=61, N=40),
    "m1": dict(M=1),
    "batched": dict(batch=(3,), bbatch=(3,)),
    "broadcast_b": dict(batch=(2, 3), bbatch=()),
    "broadcast_b1": dict(batch=(4,), bbatch=(1,)),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(MM_SHAPES))
def test_matmul_odd_shapes(dtype, name):
    # prime K breaks cuDNN's 16-byte alignment: a logged fallback is allowed there
    with Fused(allow_fallback=name.startswith("prime")):
        y, ref = mm_case(dtype, "relu", "matmul", **MM_SHAPES[name])
    assert rel_err(y, ref) <= TOL[dtype]


def test_linear_batched_input_and_weight_not_copied():
    x = rnd(2, 5, 64, dtype=torch.bfloat16)
    w = rnd(48, 64, dtype=torch.bfloat16, scale=0.1)
    with Fused():
        y = cf.linear(x, w)
    assert y.shape == (2, 5, 48)
    assert rel_err(y, F.linear(x.double(), w.double())) <= 1e-2


def test_matmul_transposed_operands_and_vectors():
    a = rnd(64, 32, dtype=torch.float16).t()  # [32, 64] column-major
    b = rnd(48, 64, dtype=torch.float16).t()  # [64, 48] column-major
    with Fused():
        y = cf.matmul(a, b)
    assert rel_err(y, a.double() @ b.double()) <= 1e-2
    v = rnd(64, dtype=torch.float16)
    assert cf.matmul(a, v).shape == (32,)
    assert rel_err(cf.matmul(a, v), a.double() @ v.double()) <= 1e-2


# ------------------------------------------------------------------ attention


def sdpa_ref(q, k, v, mask=None, causal=False, scale=None, gqa=False):
    q, k, v = q.float(), k.float(), v.float()
    if gqa:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    return torch.softmax(s, -1) @ v


SDPA_CASES = {
    "bhsd": dict(),
    "causal": dict(causal=True),
    "scale": dict(scale=0.3),
    "bshd": dict(bshd=True, causal=True),
    "gqa_32_8_s777": dict(H=32, Hkv=8, S=777, causal=True),
    "mqa": dict(H=8, Hkv=1),
    "d128_batch1": dict(B=1, D=128, causal=True),
    "s_not_64": dict(S=200, Skv=333),
    "bool_mask": dict(mask="bool"),
    "additive_mask": dict(mask="float"),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", list(SDPA_CASES))
def test_sdpa(dtype, name):
    c = dict(B=2, H=8, Hkv=None, S=256, Skv=None, D=64, causal=False, scale=None, bshd=False, mask=None)
    c.update(SDPA_CASES[name])
    B, H, S, D = c["B"], c["H"], c["S"], c["D"]
    Hkv, Skv = c["Hkv"] or H, c["Skv"] or S

    def make(h, s):
        if c["bshd"]:
            return rnd(B, s, h, D, dtype=dtype).transpose(1, 2)
        return rnd(B, h, s, D, dtype=dtype)

    q, k, v = make(H, S), make(Hkv, Skv), make(Hkv, Skv)
    mask = None
    if c["mask"] == "bool":
        mask = torch.rand(B, 1, S, Skv, device="cuda") > 0.3
        mask[..., 0] = True  # no fully masked row
    elif c["mask"] == "float":
        mask = rnd(B, H, S, Skv, dtype=dtype)
    with Fused(allow_fallback=dtype == torch.float32):
        o = cf.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=c["causal"], scale=c["scale"],
                                            enable_gqa=Hkv != H)
    ref = sdpa_ref(q, k, v, mask, c["causal"], c["scale"], Hkv != H)
    assert o.shape == ref.shape
    assert rel_err(o, ref) <= (1e-2 if dtype != torch.float32 else 1e-5)
    if c["bshd"]:
        assert o.transpose(1, 2).is_contiguous(), "BSHD in, BSHD out"


def test_sdpa_3d_inputs():
    q, k, v = (rnd(4, 128, 64, dtype=torch.bfloat16) for _ in range(3))
    with Fused():
        o = cf.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert o.shape == (4, 128, 64)
    assert rel_err(o, sdpa_ref(q, k, v, causal=True)) <= 1e-2


# ------------------------------------------------------------------ plans, streams, outputs


def test_second_call_builds_nothing():
    x = rnd(8, 64, 16, 16, dtype=torch.float16).to(memory_format=torch.channels_last)
    w = rnd(64, 64, 3, 3, dtype=torch.float16, scale=0.05).to(memory_format=torch.channels_last)
    b = rnd(64, dtype=torch.float16)
    loader.clear()
    with Fused() as first:
        cf.conv2d(x, w, b, padding=1, activation="relu")
    with Fused() as second:
        for _ in range(5):
            cf.conv2d(rnd(*x.shape, dtype=x.dtype).to(memory_format=torch.channels_last), w, b, padding=1,
                      activation="relu")
    # a warm disk cache loads the plan instead of building it: either way, one plan, once
    assert first.builds + first.loads == 1
    assert second.builds == 0 and second.loads == 0


def test_non_default_stream_is_correct():
    a = rnd(512, 256, dtype=torch.bfloat16)
    b = rnd(256, 384, dtype=torch.bfloat16)
    cf.matmul(a, b, activation="relu")  # build and bind the handle to the default stream first
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(2_000_000)  # keep the side stream busy: a launch on the wrong stream would race ahead
        a2 = a * 2
        y = cf.matmul(a2, b, activation="relu")
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert rel_err(y, F.relu(a2.double() @ b.double())) <= 1e-2
    # and back on the default stream
    y0 = cf.matmul(a, b, activation="relu")
    assert rel_err(y0, F.relu(a.double() @ b.double())) <= 1e-2


def test_outputs_are_fresh_tensors_the_caller_can_keep():
    x = rnd(64, 128, dtype=torch.float16)
    w = rnd(96, 128, dtype=torch.float16, scale=0.1)
    y1 = cf.linear(x, w, activation="relu")
    keep = y1.clone()
    y2 = cf.linear(rnd(64, 128, dtype=torch.float16), w, activation="relu")
    assert y1.data_ptr() != y2.data_ptr()
    assert torch.equal(y1, keep), "a later call overwrote an earlier output"
    y1.add_(1)  # writable, owns its storage
    assert y1.untyped_storage().nbytes() >= y1.numel() * y1.element_size()
    q = rnd(2, 4, 64, 64, dtype=torch.float16)
    o1 = cf.scaled_dot_product_attention(q, q, q)
    o2 = cf.scaled_dot_product_attention(q * 0.5, q, q)
    assert o1.data_ptr() != o2.data_ptr()


def test_nan_propagates_through_fused_matmul():
    a = rnd(64, 64, dtype=torch.float16)
    a[3, 5] = float("nan")
    b = rnd(64, 64, dtype=torch.float16)
    y, amax = cf.matmul(a, b, return_amax=True)
    assert torch.isnan(y[3]).all()
    assert not torch.isnan(y[:3]).any()


def test_zero_size_batch_returns_empty():
    x = torch.empty(0, 16, 8, 8, device="cuda", dtype=torch.float16)
    w = rnd(8, 16, 3, 3, dtype=torch.float16)
    y, amax = cf.conv2d(x, w, padding=1, return_amax=True)
    assert y.shape == (0, 8, 8, 8) and amax.item() == 0.0


# ------------------------------------------------------------------ barred engines


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["linear", "matmul"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("slope", [0.01, 0.2, 0.5])
@pytest.mark.parametrize("n", [64, 256])
def test_gemm_leaky_relu_keeps_its_slope(dtype, kind, bias, slope, n):
    """cuDNN 9.19's eng0, the heuristics' first pick for a GEMM + leaky_relu with no bias, runs
    it as a plain ReLU (20% off at slope 0.2: bench/results/leaky_probe.json); it is barred."""
    x = rnd(n, n, dtype=dtype)
    w = rnd(n, n, dtype=dtype, scale=n ** -0.5)
    b = rnd(n, dtype=dtype) if bias else None
    n0 = len(loader.plans_in_memory())
    with Fused():
        y = (cf.linear(x, w, b, activation="leaky_relu", negative_slope=slope) if kind == "linear"
             else cf.matmul(x, w.t(), b, activation="leaky_relu", negative_slope=slope))
    ref = F.leaky_relu(F.linear(x.double(), w.double(), b.double() if b is not None else None), slope)
    assert rel_err(y, ref) <= TOL[dtype] / 3
    assert not [p.engine for p in loader.plans_in_memory()[n0:] if re.fullmatch(r"eng0(_.*)?", p.engine)]


def test_training_forward_and_autotune_never_run_the_barred_engine(cache_dir):
    """The keep-z training forward and an autotuned plan of a no-bias leaky_relu GEMM: right
    answers, and eng0 neither runs nor is timed (the tuned entry records it skipped)."""
    from cudnn_fuse import autotune, cache

    torch.manual_seed(0)
    x = rnd(256, 256, dtype=torch.float16).requires_grad_(True)
    w = rnd(384, 256, dtype=torch.float16, scale=1 / 16).requires_grad_(True)
    y = cf.linear(x, w, activation="leaky_relu", negative_slope=0.2)
    x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    ref = F.leaky_relu(F.linear(x64, w64), 0.2)
    assert rel_err(y, ref) <= 1e-3
    gy = torch.randn_like(ref)
    y.backward(gy.to(y.dtype))
    ref.backward(gy)
    assert rel_err(x.grad, x64.grad) <= 5e-3 and rel_err(w.grad, w64.grad) <= 5e-3

    autotune.set_autotune(True)
    try:
        loader.clear()
        x2 = rnd(512, 256, dtype=torch.float16)
        y2 = cf.linear(x2, w.detach(), activation="leaky_relu", negative_slope=0.2)
    finally:
        autotune.set_autotune(None)
    ref2 = F.leaky_relu(F.linear(x2.double(), w.detach().double()), 0.2)
    assert rel_err(y2, ref2) <= 1e-3
    pc = cache.open_default_cache()
    tuned = [meta for _key, meta, _size in pc.entries()
             if meta.get("tuned") and meta.get("op") == "matmul" and '"leaky_relu"' in json.dumps(meta.get("spec"))]
    assert tuned, "no tuned entry was written"
    for meta in tuned:
        assert meta["engine_id"] != 0
        for c in meta.get("candidates", []):
            if c.get("engine_id") == 0:
                assert str(c.get("status", "")).startswith("skipped:"), c



def test_conv_fp32_tanh_stays_finite_for_large_preactivations():
    """cuDNN 9.19's float32 conv eng0 (a conv with a bias, TF32 off) returns NaN for tanh past
    z ~ 44; it is barred, and the op takes another engine or the logged PyTorch fallback."""
    x = rnd(2, 64, 11, 14, dtype=torch.float32, scale=4.0)
    w = rnd(8, 64, 3, 3, dtype=torch.float32)  # unit weights: |z| up to ~100
    b = rnd(8, dtype=torch.float32)
    with Fused(allow_fallback=True):
        y = cf.conv2d(x, w, b, stride=2, activation="tanh")
    z = F.conv2d(x.double(), w.double(), b.double(), stride=2)
    assert z.abs().max() > 60
    assert torch.isfinite(y).all()
    # float32 accumulation of 576 products of |z| up to ~150: ~1e-5 of z near 0, where tanh' = 1
    assert (y.double() - torch.tanh(z)).abs().max() <= 2e-4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("act", ["silu", "sigmoid", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_conv_activation_gradients_are_right(dtype, act, groups, bias):
    """cuDNN 9.19's conv eng8, the heuristics' first pick for the recompute graph (conv fprop +
    bias + act' * dy) of a grouped fp16 conv, gave gradients NaN or 60-330 (relative) off float64
    (bench/results/grouped_grad_probe_before_fix.json; found by tests/test_gpu_optimize_fuzz.py); it is
    barred from conv recompute graphs, and no backward plan of these convs runs it."""
    torch.manual_seed(groups)
    x = rnd(8, 16, 16, 15, dtype=dtype).requires_grad_(True)
    w = rnd(16, 16 // groups, 3, 3, dtype=dtype, scale=(9 * 16 // groups) ** -0.5).requires_grad_(True)
    b = rnd(16, dtype=dtype).requires_grad_(True) if bias else None
    gy = rnd(8, 16, 16, 15, dtype=dtype)
    n0 = len(loader.plans_in_memory())
    y = cf.conv2d(x, w, b, 1, 1, 1, groups, activation=act)
    y.backward(gy)
    torch.cuda.synchronize()
    leaves = [x, w] + ([b] if bias else [])
    ref = [t.detach().double().requires_grad_(True) for t in leaves]
    fn = {"silu": F.silu, "sigmoid": torch.sigmoid, "gelu": F.gelu,
          "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[act]
    fn(F.conv2d(ref[0], ref[1], ref[2] if bias else None, 1, 1, 1, groups)).backward(gy.double())
    for name, got, want in zip("xwb", leaves, ref):
        assert rel_err(got.grad, want.grad) <= GRAD_TOL[dtype], f"d{name}"
    recompute = [p for p in loader.plans_in_memory()[n0:] if p.spec.op == "recompute_grad"]
    assert not [p.engine for p in recompute if re.fullmatch(r"eng8(_.*)?", p.engine)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gemm_gelu_is_the_erf_gelu_on_its_tail(dtype):
    """cuDNN 9.19's GEMM eng0 (first pick with no bias) runs GELU as its tanh approximation,
    22% off at z = -3.4; it is barred. Identity GEMM: y = gelu(a) elementwise."""
    a = torch.linspace(-4, -2, 256 * 16, device="cuda").reshape(256, 16).to(dtype)
    with Fused():
        y = cf.matmul(a, torch.eye(16, device="cuda", dtype=dtype), activation="gelu")
    want = F.gelu(a.double())
    assert ((y.double() - want).abs() / want.abs()).max() <= 2e-2
