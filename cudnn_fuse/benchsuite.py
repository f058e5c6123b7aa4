"""Benchmark suite: cudnn_fuse against PyTorch's peers, workload by workload.

For each workload: cf with heuristic plans, cf autotuned, torch eager, torch.compile (default)
and torch.compile max-autotune-no-cudagraphs, all in one process; attention adds torch SDPA on
each backend (flash, cuDNN, efficient); batch-1 small ops and whole models add CUDA-graph
variants (cf.capture, torch eager captured, torch.compile reduce-overhead).

Timing: CUDA events, warm-up, medians, fresh random inputs
(never zeros), L2 rotation of input sets for small working sets (plus an L2 flush between
calls where rotation alone cannot leave the cache), the bf16 matmul ceiling and the HBM copy
rate measured in the same run, and cf timed twice (``cf_ms_repeat``) as a noise gauge.
Kernel workloads are timed as device time (calls queued behind a GPU spin, so host overhead
is hidden); small ops and whole models back to back, host included, as a user sees them.

A failing variant records null and its reason; the suite never aborts. torch.compile
max-autotune is slow to compile, so the suite runs in parts (``--part``), each under a time
budget (``--budget-s``: expensive variants that would end past it are skipped, with the
reason recorded), and the parts' JSON files are merged (``--merge``).

    cudnn-fuse bench --list
    cudnn-fuse bench --part core --out peers_core.json
    cudnn-fuse bench --only 'sdpa_causal.*s4096' --no-max-autotune
    cudnn-fuse bench --merge peers_*.json --out bench/results/peers.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

SCHEMA = "cudnn_fuse.bench.peers"
VERSION = 1
KINDS = ("conv", "matmul", "attention", "small", "model")
CF_VARIANTS = ("cf", "cf_autotuned", "cf_repeat", "cf_captured", "cf_compiled")
PEER_VARIANTS = ("torch_eager", "torch_compile", "torch_compile_max_autotune", "sdpa_flash", "sdpa_cudnn",
                 "sdpa_efficient", "torch_eager_captured", "torch_compile_reduce_overhead")
MAX_AUTOTUNE = "torch_compile_max_autotune"
COMPUTE_BOUND_TARGET = 0.85  # the suite's target: compute-bound workloads >= 85% of the measured bf16 ceiling
# Under this roofline floor a kernel is latency-bound whatever its intensity (a batch-1 conv's 8 us
# against a 0.3 us floor): it does not count as compute-bound for the 85% target.
MIN_COMPUTE_BOUND_FLOOR_MS = 0.01
# the cards' datasheet peaks: dense bf16 TFLOP/s and HBM TB/s, the most specific name first
CARD_PEAKS = (("H100 PCIe", 756.0, 2.0), ("H100 NVL", 835.0, 3.9), ("H100", 989.4, 3.35), ("H200", 989.4, 4.8))


# ================================================================ workloads


@dataclass
class Variant:
    """One way to run a workload: ``setup()`` returns ``fn(*inputs)`` (building, compiling or
    capturing as needed; its first call is timed as setup). ``est_s``: expected setup seconds,
    for the time budget; ``expensive`` variants are the ones the budget may skip."""

    name: str
    setup: Callable[[], Callable]
    expensive: bool = False
    est_s: float = 1.0
    cleanup: Optional[Callable[[], None]] = None


@dataclass
class Case:
    """A workload made real on the GPU: input sets (rotated through while timing, for L2),
    variants in run order, timing mode ("device" or "wall"), whether to flush L2 between calls."""

    inputs: list
    variants: list
    mode: str = "device"
    flush_l2: bool = False


@dataclass
class Workload:
    name: str
    kind: str
    group: str  # parts are made of groups
    flops: int  # per call
    bytes: Optional[int]  # fewest bytes a call must move (inputs read once, outputs written once)
    build: Callable[["Options"], Case] = field(repr=False, compare=False)
    anchor: bool = False  # one of the four headline shapes (bench/quick.py times them alone); marked in the JSON
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ConvLayer:
    """One conv of ResNet-50 after optimize(): BN folded into a bias, act(conv + bias [+ residual])."""

    n: int
    c: int
    hw: int
    k: int
    r: int
    stride: int
    activation: Optional[str]
    residual: bool

    @property
    def pad(self) -> int:
        return self.r // 2

    @property
    def out_hw(self) -> int:
        return (self.hw + 2 * self.pad - self.r) // self.stride + 1

    @property
    def flops(self) -> int:
        return 2 * self.n * self.k * self.out_hw ** 2 * self.c * self.r * self.r

    @property
    def bytes(self) -> int:  # fp16
        y = self.n * self.k * self.out_hw ** 2
        return 2 * (self.n * self.c * self.hw ** 2 + self.k * self.c * self.r * self.r + self.k + y * (2 if self.residual else 1))

    @property
    def name(self) -> str:
        epi = "_res" if self.residual else ""
        epi += f"_{self.activation}" if self.activation else ""
        return (f"conv_rn50_bs{self.n}_c{self.c}_k{self.k}_{self.hw}_r{self.r}_s{self.stride}_bias{epi}")


def resnet50_convs(batch: int) -> list:
    """Every conv call of torchvision's resnet50 at 224x224, in forward order (53 calls),
    as optimize() fuses them: BN folded; ReLU after conv1/conv2 of each bottleneck; conv3
    takes the residual then ReLU; the downsample conv has neither."""
    calls = [ConvLayer(batch, 3, 224, 64, 7, 2, "relu", False)]
    inplanes, hw = 64, 56  # after the stem's max-pool
    for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            s = stride if i == 0 else 1
            calls.append(ConvLayer(batch, inplanes, hw, planes, 1, 1, "relu", False))
            calls.append(ConvLayer(batch, planes, hw, planes, 3, s, "relu", False))
            if i == 0:  # the downsample conv: its output is conv3's residual, so it runs first
                calls.append(ConvLayer(batch, inplanes, hw, planes * 4, 1, s, None, False))
            calls.append(ConvLayer(batch, planes, hw // s, planes * 4, 1, 1, "relu", True))
            inplanes, hw = planes * 4, hw // s
    return calls


def distinct_resnet50_convs(batch: int) -> list:
    """(layer, count) for each distinct conv of resnet50, first-use order."""
    counts: dict = {}
    for layer in resnet50_convs(batch):
        counts[layer] = counts.get(layer, 0) + 1
    return list(counts.items())


def attention_flops(b: int, h: int, s: int, d: int, causal: bool) -> int:
    """Forward FLOPs of QK^T and PV (4*B*H*S*S*D); causal does half."""
    f = 4 * b * h * s * s * d
    return f // 2 if causal else f


def _resnet50_flops(batch: int) -> int:
    return sum(layer.flops for layer in resnet50_convs(batch)) + 2 * batch * 2048 * 1000


def gpt2_flops(batch: int, seq: int, layers: int = 12, d: int = 768, heads: int = 12, vocab: int = 50257,
               training: bool = False) -> int:
    """Matmul + attention FLOPs of GPT-2's forward (x3 for a training step)."""
    t = batch * seq
    per_layer = 2 * t * d * 3 * d + 2 * t * d * d + 2 * 2 * t * d * 4 * d
    per_layer += attention_flops(batch, heads, seq, d // heads, causal=True)
    f = layers * per_layer + 2 * t * d * vocab
    return 3 * f if training else f


def registry() -> list:
    """Every workload of the suite, in run order. Builders touch the GPU only when called."""
    out = []
    out += _anchor_workloads()
    out += _mlp_workloads()
    out += _amax_workloads()
    out += _small_workloads()
    for batch in (32, 1):
        distinct = distinct_resnet50_convs(batch)
        for layer, count in distinct:
            out.append(Workload(layer.name, "conv", f"conv_bs{batch}", layer.flops, layer.bytes, _conv_builder(layer),
                                info={"count_in_resnet50": count}))
    out += _attention_workloads()
    out += _model_workloads()
    names = [w.name for w in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise AssertionError(f"duplicate workload names: {dup}")
    return out


def _anchor_workloads() -> list:
    conv = ConvLayer(64, 128, 56, 128, 3, 1, "relu", False)
    m, k, n = 8192, 4096, 4096
    return [
        Workload("anchor_conv3x3_bias_relu_fp16_nhwc_n64_c128_56_k128", "conv", "anchor", conv.flops, conv.bytes,
                 _conv_builder(conv), anchor=True),
        Workload("anchor_matmul_8192x4096x4096_bias_gelu_bf16", "matmul", "anchor", 2 * m * n * k,
                 2 * (m * k + k * n + n + m * n), _matmul_builder(m, k, n, "gelu", bias=True), anchor=True),
        Workload("anchor_matmul_4096cubed_relu_amax_bf16", "matmul", "anchor", 2 * 4096 ** 3,
                 2 * 3 * 4096 ** 2, _matmul_builder(4096, 4096, 4096, "relu", amax=True), anchor=True),
    ]


def _mlp_workloads() -> list:
    """Transformer MLP up-projection, d_model 4096 -> 16384, + GELU, bf16."""
    k, n = 4096, 16384
    return [Workload(f"mlp_linear_gelu_bf16_m{m}_k{k}_n{n}", "matmul", "mlp", 2 * m * n * k,
                     2 * (m * k + n * k + n + m * n), _linear_builder(m, k, n, "gelu")) for m in (1, 16, 128, 4096, 16384)]


def _amax_workloads() -> list:
    out = []
    for m, k, n, act in ((1024, 4096, 4096, "relu"), (8192, 8192, 8192, None), (16384, 4096, 4096, "relu")):
        out.append(Workload(f"matmul_amax_bf16_{m}x{k}x{n}_{act or 'noact'}", "matmul", "amax", 2 * m * n * k,
                            2 * (m * k + k * n + m * n), _matmul_builder(m, k, n, act, amax=True)))
    return out


def _small_workloads() -> list:
    """Batch-1 ops where the host's launch cost dominates; timed back to back, with and without CUDA graphs."""
    return [
        Workload("small_linear_relu_bf16_m1_768x768", "small", "small", 2 * 768 * 768, 2 * (768 * 768 + 3 * 768),
                 _small_builder("linear")),
        Workload("small_conv3x3_bias_relu_fp16_n1_c64_56_k64", "small", "small",
                 ConvLayer(1, 64, 56, 64, 3, 1, "relu", False).flops, ConvLayer(1, 64, 56, 64, 3, 1, "relu", False).bytes,
                 _small_builder("conv")),
        Workload("small_sdpa_causal_bf16_b1_h12_s128_d64", "small", "small", attention_flops(1, 12, 128, 64, True),
                 2 * 4 * 12 * 128 * 64, _small_builder("sdpa")),
        Workload("small_mlp_stack8_linear_gelu_bf16_m1_1024", "small", "small", 8 * 2 * 1024 * 1024,
                 2 * 8 * (1024 * 1024 + 1024), _small_builder("stack")),
    ]


def _attention_workloads() -> list:
    """S = 512..8192 at 16k tokens per batch, causal and not, D = 64 (32 heads) and 128 (16 heads);
    GQA (4 kv heads, causal, D = 128). The B4 H16 S4096 D128 causal one is the attention anchor."""
    out = []
    for s in (512, 1024, 2048, 4096, 8192):
        b = 16384 // s
        for d, h in ((64, 32), (128, 16)):
            for causal in (True, False):
                out.append(_attention(b, h, h, s, d, causal))
        out.append(_attention(b, 16, 4, s, 128, True))
    return out


def _attention(b, hq, hkv, s, d, causal) -> Workload:
    mode = "causal" if causal else "full"
    gqa = f"_gqa_hkv{hkv}" if hkv != hq else ""
    name = f"sdpa_{mode}_bf16_b{b}_h{hq}{gqa}_s{s}_d{d}"
    anchor = (b, hq, hkv, s, d, causal) == (4, 16, 16, 4096, 128, True)
    return Workload(name, "attention", "attention", attention_flops(b, hq, s, d, causal),
                    2 * (2 * b * hq * s * d + 2 * b * hkv * s * d), _attention_builder(b, hq, hkv, s, d, causal),
                    anchor=anchor)


def _model_workloads() -> list:
    return [
        Workload("model_resnet50_fp16_cl_bs32", "model", "model_resnet50_bs32", _resnet50_flops(32), None,
                 _resnet_builder(32)),
        Workload("model_resnet50_fp16_cl_bs1", "model", "model_resnet50_bs1", _resnet50_flops(1), None,
                 _resnet_builder(1)),
        Workload("model_gpt2_small_bf16_b8_s1024_infer", "model", "model_gpt2_infer", gpt2_flops(8, 1024), None,
                 _gpt2_builder(training=False)),
        Workload("model_gpt2_small_bf16_b8_s1024_train_step", "model", "model_gpt2_train",
                 gpt2_flops(8, 1024, training=True), None, _gpt2_builder(training=True)),
    ]


# Parts: each fits one device-machine call of at most 10 minutes (default budget 8). Every part
# measures the ceilings too; "core" the host overhead, "attention" the time to ready.
# "models" is the four model parts at once, for a run without max-autotune.
PARTS = {
    "core": ("anchor", "amax", "mlp"),
    "attention": ("small", "attention"),
    "conv32": ("conv_bs32",),
    "conv1": ("conv_bs1",),
    "resnet50_bs32": ("model_resnet50_bs32",),
    "resnet50_bs1": ("model_resnet50_bs1",),
    "gpt2_infer": ("model_gpt2_infer",),
    "gpt2_train": ("model_gpt2_train",),
    "models": ("model_resnet50_bs32", "model_resnet50_bs1", "model_gpt2_infer", "model_gpt2_train"),
}
HOST_OVERHEAD_PARTS = (None, "all", "core")
TIME_TO_READY_PARTS = (None, "all", "attention")


def select(workloads: Sequence[Workload], only: Optional[str] = None, kinds: Optional[Sequence[str]] = None,
           part: Optional[str] = None) -> list:
    """The workloads matching the regex ``only`` (re.search on the name), ``kinds`` and ``part``."""
    if part is not None and part != "all" and part not in PARTS:
        raise ValueError(f"part must be one of {sorted(PARTS) + ['all']}, got {part!r}")
    bad = sorted(set(kinds or ()) - set(KINDS))
    if bad:
        raise ValueError(f"kinds must be among {list(KINDS)}, got {bad}")
    try:
        pattern = re.compile(only) if only else None
    except re.error as exc:
        raise ValueError(f"--only: {only!r} is no regular expression ({exc})") from None
    out = []
    for w in workloads:
        if part not in (None, "all") and w.group not in PARTS[part]:
            continue
        if kinds and w.kind not in kinds:
            continue
        if pattern is not None and not pattern.search(w.name):
            continue
        out.append(w)
    return out


# ================================================================ builders (GPU)


def _rand(*shape, dtype, scale=1.0, cl=False):
    """Fresh normal values (never zeros) on the GPU; channels_last if ``cl``."""
    t = (torch.randn(*shape, device="cuda") * scale).to(dtype)
    return t.contiguous(memory_format=torch.channels_last) if cl else t


def l2_bytes() -> int:
    try:
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size)
    except Exception:  # noqa: BLE001 - an older torch: a Hopper card's 50-60 MB
        return 60 << 20


def rotation_sets(set_bytes: int, l2: int, cap: int = 16, factor: int = 3) -> tuple:
    """(input sets, flush) for L2 rotation: enough sets that cycling through them moves
    ``factor`` x L2 (at most ``cap``); flush the L2 between calls when even ``cap`` sets fit."""
    if set_bytes <= 0:
        return 1, True
    want = math.ceil(factor * l2 / set_bytes)
    sets = max(1, min(cap, want))
    return sets, sets * set_bytes < factor * l2


def _tensor_bytes(inputs) -> int:
    return sum(t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor))


def _rotated(make_set, opts) -> tuple:
    first = make_set()
    n, flush = rotation_sets(_tensor_bytes(first), l2_bytes(), cap=opts.max_sets)
    return [first] + [make_set() for _ in range(n - 1)], flush


def _memo(setup):
    """A setup run once; later calls return the same callable (cf_repeat times cf's callable again).
    ``once.done()`` says whether it ran."""
    box = []

    def once():
        if not box:
            box.append(setup())
        return box[0]
    once.done = lambda: bool(box)
    return once


def _compile(fn, mode: Optional[str]):
    def setup():
        torch._dynamo.reset()  # a fresh cache: each compile is cold and fixed-shape (no recompile limit, no dynamic dims)
        return torch.compile(fn, mode=mode, dynamic=False)
    return setup


def _cf_setup(fn, autotune: bool):
    import cudnn_fuse as cf

    def setup():
        if autotune:
            from . import loader

            loader.clear()  # the in-memory heuristic plan would be reused; the disk entry is upgraded when tuned
        cf.set_autotune(autotune)
        return fn
    return setup


def _autotune_off() -> None:
    import cudnn_fuse as cf

    cf.set_autotune(False)


def kernel_variants(cf_fn, torch_fn, extra_peers=(), tuned_est_s=5.0, max_autotune_est_s=30.0) -> list:
    """cf (heuristics), torch eager, extra peers, torch.compile default and max-autotune, cf again
    (noise gauge), cf autotuned: in this order, so the heuristic plan is timed before it is upgraded."""
    cf_heur = _memo(_cf_setup(cf_fn, autotune=False))
    return ([Variant("torch_eager", lambda: torch_fn), Variant("cf", cf_heur)] + list(extra_peers) + [
        Variant("torch_compile", _compile(torch_fn, None), expensive=True, est_s=8.0),
        Variant(MAX_AUTOTUNE, _compile(torch_fn, "max-autotune-no-cudagraphs"), expensive=True,
                est_s=max_autotune_est_s),
        Variant("cf_repeat", cf_heur),
        Variant("cf_autotuned", _cf_setup(cf_fn, autotune=True), expensive=True, est_s=tuned_est_s,
                cleanup=_autotune_off),
    ])


COMPILED_VARIANTS = ("torch_compile", MAX_AUTOTUNE, "torch_compile_reduce_overhead", "cf_compiled")


def compiled_last(variants) -> list:
    """``variants`` with every torch.compile mode moved to the end, the rest in their order, for
    wall-clock cases: once torch.compile has run in a process, an eager op's host time rises
    (an 8-layer stack's heuristic plan once read 0.101 ms before the compile variants and 0.152
    after), so
    every eager variant, cf's autotuned one included, is timed before any compile."""
    return sorted(variants, key=lambda v: v.name in COMPILED_VARIANTS)


def graph_variants(cf_fn, torch_fn, example) -> list:
    """The CUDA-graph variants of small ops and models: cf.capture of cf, of torch eager, and
    torch.compile reduce-overhead."""
    import cudnn_fuse as cf

    return [
        Variant("cf_captured", lambda: cf.capture(cf_fn, *example)),
        Variant("torch_eager_captured", lambda: cf.capture(torch_fn, *example)),
        Variant("torch_compile_reduce_overhead", _compile(torch_fn, "reduce-overhead"), expensive=True, est_s=15.0),
    ]


def _conv_builder(layer: ConvLayer):
    def build(opts) -> Case:
        import cudnn_fuse as cf

        h, s, p, act = torch.float16, layer.stride, layer.pad, layer.activation

        def make_set():
            x = _rand(layer.n, layer.c, layer.hw, layer.hw, dtype=h, cl=True)
            w = _rand(layer.k, layer.c, layer.r, layer.r, dtype=h, scale=(layer.c * layer.r ** 2) ** -0.5, cl=True)
            b = _rand(layer.k, dtype=h)
            r = _rand(layer.n, layer.k, layer.out_hw, layer.out_hw, dtype=h, cl=True) if layer.residual else None
            return (x, w, b, r)

        def cf_fn(x, w, b, r):
            return cf.conv2d(x, w, b, s, p, activation=act, residual=r)

        def torch_fn(x, w, b, r):
            y = F.conv2d(x, w, b, s, p)
            if r is not None:
                y = y + r
            return F.relu(y) if act == "relu" else y

        sets, flush = _rotated(make_set, opts)
        return Case(sets, kernel_variants(cf_fn, torch_fn, max_autotune_est_s=25.0), flush_l2=flush)
    return build


def _act(y, act):
    return {None: lambda t: t, "relu": F.relu, "gelu": F.gelu}[act](y)


def _linear_builder(m, k, n, act):
    def build(opts) -> Case:
        import cudnn_fuse as cf

        bf = torch.bfloat16

        def make_set():
            return (_rand(m, k, dtype=bf), _rand(n, k, dtype=bf, scale=k ** -0.5), _rand(n, dtype=bf))

        def cf_fn(x, w, b):
            return cf.linear(x, w, b, activation=act)

        def torch_fn(x, w, b):
            return _act(F.linear(x, w, b), act)

        sets, flush = _rotated(make_set, opts)
        return Case(sets, kernel_variants(cf_fn, torch_fn), flush_l2=flush)
    return build


def _matmul_builder(m, k, n, act, bias=False, amax=False):
    def build(opts) -> Case:
        import cudnn_fuse as cf

        bf = torch.bfloat16

        def make_set():
            return (_rand(m, k, dtype=bf), _rand(k, n, dtype=bf, scale=k ** -0.5), _rand(n, dtype=bf) if bias else None)

        def cf_fn(a, b, c):
            return cf.matmul(a, b, c, activation=act, return_amax=amax)

        def torch_fn(a, b, c):
            y = _act(torch.addmm(c, a, b) if c is not None else a @ b, act)
            return (y, y.abs().amax().float()) if amax else y

        sets, flush = _rotated(make_set, opts)
        return Case(sets, kernel_variants(cf_fn, torch_fn), flush_l2=flush)
    return build


def _sdpa_backend(backend_name, fn):
    def setup():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)

        def run(*args):
            with sdpa_kernel(backend):
                return fn(*args)
        return run
    return setup


def _attention_builder(b, hq, hkv, s, d, causal):
    def build(opts) -> Case:
        import cudnn_fuse as cf

        bf, gqa = torch.bfloat16, hq != hkv

        def make_set():
            return (_rand(b, hq, s, d, dtype=bf), _rand(b, hkv, s, d, dtype=bf), _rand(b, hkv, s, d, dtype=bf))

        def cf_fn(q, k, v):
            return cf.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

        def torch_fn(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

        peers = [Variant(f"sdpa_{short}", _sdpa_backend(full, torch_fn)) for short, full in
                 (("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION"))]
        sets, flush = _rotated(make_set, opts)
        return Case(sets, kernel_variants(cf_fn, torch_fn, peers, max_autotune_est_s=10.0), flush_l2=flush)
    return build


def _small_builder(op: str):
    def build(opts) -> Case:
        import cudnn_fuse as cf

        bf, h = torch.bfloat16, torch.float16
        if op == "linear":
            inputs = (_rand(1, 768, dtype=bf), _rand(768, 768, dtype=bf, scale=768 ** -0.5), _rand(768, dtype=bf))

            def cf_fn(x, w, b):
                return cf.linear(x, w, b, activation="relu")

            def torch_fn(x, w, b):
                return F.relu(F.linear(x, w, b))
        elif op == "conv":
            inputs = (_rand(1, 64, 56, 56, dtype=h, cl=True), _rand(64, 64, 3, 3, dtype=h, scale=1 / 24, cl=True),
                      _rand(64, dtype=h))

            def cf_fn(x, w, b):
                return cf.conv2d(x, w, b, 1, 1, activation="relu")

            def torch_fn(x, w, b):
                return F.relu(F.conv2d(x, w, b, 1, 1))
        elif op == "sdpa":
            inputs = tuple(_rand(1, 12, 128, 64, dtype=bf) for _ in range(3))

            def cf_fn(q, k, v):
                return cf.scaled_dot_product_attention(q, k, v, is_causal=True)

            def torch_fn(q, k, v):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # a stack of 8 Linear+GELU layers at batch 1
            ws = [_rand(1024, 1024, dtype=bf, scale=1 / 32) for _ in range(8)]
            bs = [_rand(1024, dtype=bf) for _ in range(8)]
            inputs = (_rand(1, 1024, dtype=bf),)

            def cf_fn(x):
                for w, b in zip(ws, bs):
                    x = cf.linear(x, w, b, activation="gelu")
                return x

            def torch_fn(x):
                for w, b in zip(ws, bs):
                    x = F.gelu(F.linear(x, w, b))
                return x
        variants = compiled_last(kernel_variants(cf_fn, torch_fn, max_autotune_est_s=20.0)
                                 + graph_variants(cf_fn, torch_fn, inputs))
        return Case([inputs], variants, mode="wall")
    return build


def _no_grad(fn):
    def run(*args):
        with torch.no_grad():
            return fn(*args)
    return run


def _model_variants(model, example, forward, tuned_est_s, max_autotune_est_s, captured=True, optimize_kw=None):
    """Variants of a whole model: ``forward(module, *inputs)`` runs one inference or training step."""
    import copy

    import cudnn_fuse as cf

    kw = optimize_kw or {}

    def eager():
        return lambda *a: forward(model, *a)

    def cf_setup(autotune):
        def setup():
            if autotune:
                from . import loader

                loader.clear()
            cf.set_autotune(autotune)
            opt = cf.optimize(model, autotune=autotune, **kw)
            return lambda *a: forward(opt, *a)
        return setup

    def compiled(mode):
        def setup():
            torch._dynamo.reset()
            cm = torch.compile(copy.deepcopy(model), mode=mode, dynamic=False)
            return lambda *a: forward(cm, *a)
        return setup

    def cf_compiled():  # torch.compile over the optimize()d model (convs stay cuDNN custom ops; see cf.set_compile_inline)
        torch._dynamo.reset()
        cm = torch.compile(cf.optimize(model, **kw), dynamic=False)
        return lambda *a: forward(cm, *a)

    cf_heur = _memo(cf_setup(False))
    tuned = _memo(cf_setup(True))
    # every variant that runs eager Python first, torch.compile's last: once torch.compile has run
    # in a process, an eager model's host time per step rises (GPT-2 8x1024 through optimize():
    # the same kernels, 7.8 -> 11.3 ms a step), and a model's step is
    # host-sensitive (wall-clock timing), so cf and eager are timed before any compile
    out = [Variant("torch_eager", eager), Variant("cf", cf_heur)]
    if captured:
        out.append(Variant("torch_eager_captured", lambda: cf.capture(eager(), *example)))
    out += [Variant("cf_repeat", cf_heur),  # the noise gauge, before autotuning upgrades cf's plans
            Variant("cf_autotuned", tuned, expensive=True, est_s=tuned_est_s, cleanup=_autotune_off)]
    if captured:
        def cf_captured():  # the autotuned model if it was built (not over budget), else the heuristic one
            return cf.capture((tuned if tuned.done() else cf_heur)(), *example)

        out.append(Variant("cf_captured", cf_captured))
    out.append(Variant("torch_compile", compiled(None), expensive=True, est_s=60.0))
    out.append(Variant("cf_compiled", cf_compiled, expensive=True, est_s=60.0))
    if captured:
        out.append(Variant("torch_compile_reduce_overhead", compiled("reduce-overhead"), expensive=True, est_s=80.0))
    # last: minutes to compile a whole model; the budget skips it (with the reason) where it cannot end in time
    out.append(Variant(MAX_AUTOTUNE, compiled("max-autotune-no-cudagraphs"), expensive=True, est_s=max_autotune_est_s))
    return out


def _resnet_builder(batch: int):
    def build(opts) -> Case:
        import torchvision

        cl = torch.channels_last
        model = torchvision.models.resnet50().cuda().half().eval().to(memory_format=cl)
        x = _rand(batch, 3, 224, 224, dtype=torch.float16, cl=True)
        variants = _model_variants(model, (x,), _no_grad(lambda m, x: m(x)), tuned_est_s=90.0,
                                   max_autotune_est_s=280.0)
        return Case([(x,)], variants, mode="wall")
    return build


def gpt2_small(training: bool):
    """transformers' GPT-2 small, bf16, random weights, no dropout, ``use_cache=False``, on 8×1024
    random ids, as the suite and the GPT-2 bench scripts run it: (model, ids, step), where
    ``step(m, ids)`` runs one inference step (the logits) or one training step (forward, the LM loss,
    backward, gradients dropped; the loss)."""
    import transformers

    cfg = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg).cuda().to(torch.bfloat16).train(training)
    ids = torch.randint(0, cfg.vocab_size, (8, 1024), device="cuda")
    if not training:
        return model, ids, _no_grad(lambda m, ids: m(ids).logits)

    def step(m, ids):
        loss = m(ids, labels=ids).loss
        loss.backward()
        for p in m.parameters():
            p.grad = None
        return loss.detach()

    return model, ids, step


def _gpt2_builder(training: bool):
    def build(opts) -> Case:
        model, ids, forward = gpt2_small(training)
        variants = _model_variants(model, (ids,), forward, tuned_est_s=60.0,
                                   max_autotune_est_s=420.0 if training else 300.0, captured=not training)
        return Case([(ids,)], variants, mode="wall")
    return build


# ================================================================ timing (GPU)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _spin(us: float) -> None:
    """Hold the GPU busy about ``us`` microseconds (~2 GHz clock), so the host can queue ahead."""
    torch.cuda._sleep(int(2e3 * min(us, 2e6)))


def host_enqueue_us(fn, inputs, calls: int = 8) -> float:
    """Host microseconds to issue one call while the GPU is held busy (no waiting on the device)."""
    _spin(20000 + 1000 * calls)
    t0 = time.perf_counter()
    for i in range(calls):
        fn(*inputs[i % len(inputs)])
    dt = time.perf_counter() - t0
    sync()
    return 1e6 * dt / calls


def device_times(fn, inputs, iters: int, host_us: float, flush: Optional[torch.Tensor] = None) -> list:
    """Device milliseconds of ``iters`` calls (fewer when some were dropped), queued behind a spin
    long enough for the host to issue all of them, so each event pair times kernels and not launch
    overhead; the spin is checked, and lengthened when the host outran it (autotune.spin_timed).
    Input sets rotate; ``flush`` (a buffer > L2) is zeroed between calls, outside the events."""
    from .autotune import spin_timed

    def call(i):
        fn(*inputs[i % len(inputs)])

    before = (lambda i: flush.zero_()) if flush is not None else None
    return spin_timed(call, iters, 1.5 * (host_us + (15 if flush is not None else 0)), before=before,
                      base_us=500.0, remember=False)


def wall_block_ms(fn, inputs, per_block: int, blocks: int) -> list:
    """Milliseconds per call of ``blocks`` blocks of ``per_block`` back-to-back calls (events
    around each block, no spin): the host's launch cost counts, as a user sees it."""
    out = []
    for _ in range(blocks):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for i in range(per_block):
            fn(*inputs[i % len(inputs)])
        e.record()
        out.append((s, e))
    sync()
    return [s.elapsed_time(e) / per_block for s, e in out]


def _warm(fn, inputs, min_calls: int = 3, min_s: float = 0.05) -> float:
    """Warm-up calls (at least ``min_calls`` and ``min_s``); returns wall ms per call, synced."""
    sync()
    t0, n = time.perf_counter(), 0
    while n < min_calls or time.perf_counter() - t0 < min_s:
        fn(*inputs[n % len(inputs)])
        n += 1
        if n >= 10000:
            break
    sync()
    return 1e3 * (time.perf_counter() - t0) / n


class Timer:
    """Times a variant's callable on a Case: median device ms ("device") or back-to-back ms
    per call ("wall"). ``target_ms``: device time to spend on each variant's timed calls."""

    def __init__(self, target_ms: float = 200.0):
        self.target_ms = target_ms
        self._flush = None

    def flush_buffer(self) -> torch.Tensor:
        if self._flush is None:
            self._flush = torch.empty(3 * l2_bytes() // 4, dtype=torch.int32, device="cuda")
        return self._flush

    def __call__(self, name: str, fn, case: Case) -> float:
        if case.mode == "wall":  # host-bound paths settle slower (seen: resnet50 bs1 2.8 ms, then 1.8 ms)
            est = _warm(fn, case.inputs, min_calls=10, min_s=0.3)
            per_block = max(1, min(1000, int(5.0 / max(est, 1e-3))))  # blocks of ~5 ms
            blocks = max(10, min(30, int(self.target_ms / (per_block * est))))
            return statistics.median(wall_block_ms(fn, case.inputs, per_block, blocks))
        from . import autotune

        est = _warm(fn, case.inputs)
        cfg = autotune.DEFAULT_CONFIG
        if est >= cfg.heat_min_ms and cfg.heat_s > 0:  # every variant timed at a sustained run's clocks
            calls = iter(range(10**9))
            autotune.heat_gpu(lambda: fn(*case.inputs[next(calls) % len(case.inputs)]), cfg.heat_s)
        iters = max(10, min(100, int(self.target_ms / max(est, 1e-3))))
        host = host_enqueue_us(fn, case.inputs)
        flush = self.flush_buffer() if case.flush_l2 else None
        return statistics.median(device_times(fn, case.inputs, iters, host, flush))


def rel_err(got, want) -> Optional[float]:
    """||got - want|| / ||want|| in fp32 (the worst over paired tuple outputs); None if not comparable."""
    if isinstance(want, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(want):
            return None
        errs = [rel_err(g, w) for g, w in zip(got, want)]
        return None if any(e is None for e in errs) else max(errs)
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor) or got.shape != want.shape:
        return None
    g, w = got.detach().float(), want.detach().float()
    denom = w.norm().item()
    diff = (g - w).norm().item()
    return diff / denom if denom > 0 else diff


def _detach_clone(out):
    if isinstance(out, (tuple, list)):
        return tuple(_detach_clone(o) for o in out)
    return out.detach().clone() if isinstance(out, torch.Tensor) else out


# ================================================================ running


@dataclass
class Options:
    max_autotune: bool = True
    budget_s: float = 480.0  # expensive variants that would end past it are skipped
    deadline_s: float = 530.0  # nothing new starts past it
    target_ms: float = 200.0
    max_sets: int = 16
    time_to_ready: bool = True
    host_overhead: bool = True


def _short(exc: BaseException) -> str:
    msg = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {msg[:300]}"


def skip_reason(v: Variant, opts: Options, elapsed_s: float) -> Optional[str]:
    """Why ``v`` is not run now (None: run it)."""
    if v.name == MAX_AUTOTUNE and not opts.max_autotune:
        return "disabled (--no-max-autotune)"
    if elapsed_s > opts.deadline_s:
        return f"over the run's deadline ({elapsed_s:.0f} s > {opts.deadline_s:.0f} s)"
    if v.expensive and elapsed_s + v.est_s > opts.budget_s:
        return (f"over the run's time budget (at {elapsed_s:.0f} s, about {v.est_s:.0f} s more "
                f"> {opts.budget_s:.0f} s)")
    return None


def _fallbacks() -> int:
    from .loader import plan_stats

    return plan_stats()["fallbacks"]


def new_record(w: Workload) -> dict:
    return {"name": w.name, "kind": w.kind, "group": w.group, "anchor": w.anchor, "flops": w.flops, "bytes": w.bytes,
            "cf_ms": None, "cf_autotuned_ms": None, "cf_ms_repeat": None, "cf_variants": {}, "peers": {},
            "errors": {}, "skipped": {}, "setup_s": {}, "rel_err": {}, "notes": [], "info": dict(w.info)}


def store(rec: dict, variant: str, ms: Optional[float]) -> None:
    """Put a variant's time where the schema wants it."""
    ms = None if ms is None else round(float(ms), 5)
    if variant == "cf":
        rec["cf_ms"] = ms
    elif variant == "cf_autotuned":
        rec["cf_autotuned_ms"] = ms
    elif variant == "cf_repeat":
        rec["cf_ms_repeat"] = ms
    elif variant in CF_VARIANTS:
        rec["cf_variants"][variant] = ms
    else:
        rec["peers"][variant] = ms


def run_workload(w: Workload, opts: Options, started: float, timer: Callable = None,
                 clock: Callable[[], float] = time.perf_counter, on_variant: Callable[[dict], None] = None) -> dict:
    """Build ``w``'s case and run its variants one after another; a failure is recorded, never raised.

    ``started``: the run's start on ``clock`` (for the budget). ``timer(name, fn, case)`` -> ms
    is injectable, as is ``clock``, so the logic is tested without a GPU. ``on_variant(record)``
    is called after each variant (the suite saves the record so far: a killed call keeps it).
    """
    timer = timer or Timer(opts.target_ms)
    rec = new_record(w)
    t_build = clock()
    try:
        case = w.build(opts)
    except Exception as exc:  # noqa: BLE001 - a workload that cannot be built is a record, not a crash
        rec["errors"]["build"] = _short(exc)
        return finish_record(rec)
    rec["timing"] = {"mode": case.mode, "input_sets": len(case.inputs), "l2_flush": case.flush_l2,
                     "build_s": round(clock() - t_build, 3)}
    ref = None
    for v in case.variants:
        why = skip_reason(v, opts, clock() - started)
        if why:
            rec["skipped"][v.name] = why
            store(rec, v.name, None)
            continue
        ref = _run_variant(rec, v, case, timer, clock, ref)
        if on_variant is not None:
            on_variant(rec)
    del case
    _release()
    return finish_record(rec)


def _run_variant(rec, v, case, timer, clock, ref):
    """Set up, check against torch eager's output, time; returns the reference output."""
    fallbacks = _fallbacks()
    graphs = _graph_counters()
    held = _plan_ids() if v.name in ENGINE_VARIANTS else None
    fn = out = None
    t0 = clock()
    try:
        fn = v.setup()
        out = fn(*case.inputs[0])
        sync()
        rec["setup_s"][v.name] = round(clock() - t0, 3)
        if v.name == "torch_eager":
            ref = _detach_clone(out)
        elif ref is not None:
            err = rel_err(out, ref)
            if err is not None:
                rec["rel_err"][v.name] = float(f"{err:.3g}")
        out = None
        store(rec, v.name, timer(v.name, fn, case))
    except Exception as exc:  # noqa: BLE001 - a failing variant scores null with its reason
        rec["errors"][v.name] = _short(exc)
        store(rec, v.name, None)
    finally:
        fn = out = None
        if v.cleanup is not None:
            v.cleanup()
    if held is not None:  # the engines of the plans this variant built (cf_autotuned's setup clears the memory)
        engines = _new_engines(held)
        if engines:
            rec.setdefault("engines", {})[v.name] = engines
    moved = {k: n - graphs[k] for k, n in _graph_counters().items() if n != graphs[k]}
    if moved:  # launch graphs (launch_graphs.py): what this variant captured and replayed
        rec.setdefault("launch_graphs", {})[v.name] = moved
    fell_back = _fallbacks() - fallbacks
    if fell_back and v.name in CF_VARIANTS:
        rec["notes"].append(f"{v.name}: {fell_back} op call(s) fell back to PyTorch (cf.plan_stats)")
    return ref


ENGINE_VARIANTS = ("cf", "cf_autotuned")
ENGINES_LISTED = 12  # distinct engines listed a variant (a model builds dozens of plans)


def _plan_ids() -> set:
    from .loader import plans_in_memory

    return {id(p) for p in plans_in_memory()}


def _new_engines(held: set) -> dict:
    """{"plans": n, "engines": [distinct engine names, at most ENGINES_LISTED]} of the plans in
    memory now that were not in ``held`` (ids); {} when there are none."""
    from .loader import plans_in_memory

    new = [p for p in plans_in_memory() if id(p) not in held]
    if not new:
        return {}
    names = sorted({str(getattr(p, "engine", type(p).__name__)) for p in new})
    return {"plans": len(new), "engines": names[:ENGINES_LISTED]}


def _graph_counters() -> dict:
    from .launch_graphs import STATS

    snap = STATS.snapshot()
    snap.pop("graph_live", None)
    return snap


def _release() -> None:
    try:
        torch._dynamo.reset()
    except Exception:  # noqa: BLE001
        pass
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def finish_record(rec: dict) -> dict:
    """Derived fields: best peer, best cf, speedups (a peer's ms over cf's)."""
    peers = {k: v for k, v in rec["peers"].items() if _finite(v)}
    rec["best_peer"] = min(peers, key=peers.get) if peers else None
    rec["best_peer_ms"] = peers[rec["best_peer"]] if peers else None
    cfs = {k: v for k, v in [("cf", rec["cf_ms"]), ("cf_autotuned", rec["cf_autotuned_ms"])]
           + list(rec["cf_variants"].items()) if _finite(v)}
    rec["cf_best"] = min(cfs, key=cfs.get) if cfs else None
    rec["cf_best_ms"] = cfs[rec["cf_best"]] if cfs else None
    rec["speedup_vs_best_peer"] = _ratio(rec["best_peer_ms"], rec["cf_best_ms"])
    rec["speedup_autotuned_vs_best_peer"] = _ratio(rec["best_peer_ms"], rec["cf_autotuned_ms"])
    rec["speedup_autotuned_vs_max_autotune"] = _ratio(rec["peers"].get(MAX_AUTOTUNE), rec["cf_autotuned_ms"])
    noise = _ratio(abs(rec["cf_ms"] - rec["cf_ms_repeat"]), rec["cf_ms"]) \
        if _finite(rec["cf_ms"]) and _finite(rec["cf_ms_repeat"]) else None
    rec["cf_repeat_spread"] = noise
    return rec


def _ratio(a, b) -> Optional[float]:
    if not isinstance(a, (int, float)) or not _finite(b) or isinstance(a, bool):
        return None
    return round(a / b, 4)


def geomean(xs) -> Optional[float]:
    xs = [x for x in xs if _finite(x)]
    return round(math.exp(sum(math.log(x) for x in xs) / len(xs)), 4) if xs else None


def summarize(doc: dict) -> dict:
    """Per-workload roofline fields and the run's summary against the suite's targets. A record merged
    from a part carries that run's ceilings (``run_ceiling_tflops``, ``run_hbm_tbps``, see ``merge``)
    and is judged against them: the ceiling measured in the same run, on the same GPU, not another
    part's (two machines of one GPU model differed by 12% in sustained bf16 matmul throughput)."""
    peak = doc["card_peak"] = card_peak(doc.get("device"))
    for rec in doc["workloads"]:
        ceiling, bw = _run_ceilings(rec, doc)
        ridge = ceiling / bw if _finite(ceiling) and _finite(bw) else None  # FLOP per byte
        ms = rec.get("cf_autotuned_ms") if _finite(rec.get("cf_autotuned_ms")) else rec.get("cf_best_ms")
        rec["cf_tflops"] = round(rec["flops"] / ms / 1e9, 2) if _finite(ms) else None
        rec["intensity"] = round(rec["flops"] / rec["bytes"], 2) if rec.get("bytes") else None
        floor = _floor_ms(rec, ceiling, bw)
        rec["compute_bound"] = (rec["intensity"] >= ridge and floor >= MIN_COMPUTE_BOUND_FLOOR_MS) \
            if ridge and rec["intensity"] else None
        rec["floor_ms"] = round(floor, 5) if floor else None
        rec["roofline_fraction"] = round(floor / ms, 4) if floor and _finite(ms) else None
        rec["cf_gbps"] = round(rec["bytes"] / ms / 1e6, 1) if rec.get("bytes") and _finite(ms) else None
        rec["peak_fraction"] = _peak_fraction(rec, peak)
    kernels = [r for r in doc["workloads"] if r["kind"] in ("conv", "matmul", "attention")]
    below = [r["name"] for r in kernels if _finite(r.get("speedup_autotuned_vs_best_peer"))
             and r["speedup_autotuned_vs_best_peer"] < 1.0]
    compute = [r for r in kernels if r.get("compute_bound") and _finite(r.get("cf_tflops"))]
    under = [r["name"] for r in compute if r["cf_tflops"] < COMPUTE_BOUND_TARGET * _run_ceilings(r, doc)[0]]
    gm_ma = geomean(r.get("speedup_autotuned_vs_max_autotune") for r in doc["workloads"])
    doc["summary"] = {
        "workloads": len(doc["workloads"]),
        "measured": sum(1 for r in doc["workloads"] if _finite(r.get("cf_best_ms"))),
        "geomean_speedup_vs_best_peer": geomean(r.get("speedup_vs_best_peer") for r in doc["workloads"]),
        "geomean_autotuned_vs_max_autotune": gm_ma,
        "geomean_autotuned_vs_max_autotune_by_kind": {
            k: geomean(r.get("speedup_autotuned_vs_max_autotune") for r in doc["workloads"] if r["kind"] == k)
            for k in KINDS},
        "kernels_autotuned_below_best_peer": below,
        "compute_bound_under_85pct_of_ceiling": under,
        "targets": {"autotuned_ge_best_peer": not below if kernels else None,
                    "geomean_vs_max_autotune_ge_1_25": (gm_ma >= 1.25) if gm_ma else None,
                    "compute_bound_ge_85pct": (not under) if compute else None},
    }
    return doc


def _run_ceilings(rec: dict, doc: dict) -> tuple:
    """(bf16 TFLOP/s, HBM TB/s) of the run that measured ``rec``: its part's where merged, else the doc's."""
    ceiling, bw = rec.get("run_ceiling_tflops"), rec.get("run_hbm_tbps")
    return (ceiling if _finite(ceiling) else doc.get("ceiling_tflops"), bw if _finite(bw) else doc.get("hbm_tbps"))


def card_peak(device) -> Optional[dict]:
    """The datasheet peaks of ``device`` (its name as torch gives it), or None for a card not listed."""
    for name, tflops, tbps in CARD_PEAKS:
        if device and name in device:
            return {"card": name, "bf16_tflops": tflops, "hbm_tbps": tbps}
    return None


def _peak_fraction(rec, peak) -> Optional[float]:
    """cf's achieved throughput over the card's peak: TFLOP/s for a compute-bound row, GB/s otherwise."""
    if not peak or rec.get("compute_bound") is None:
        return None
    if rec["compute_bound"]:
        return round(rec["cf_tflops"] / peak["bf16_tflops"], 4) if _finite(rec.get("cf_tflops")) else None
    return round(rec["cf_gbps"] / (peak["hbm_tbps"] * 1e3), 4) if _finite(rec.get("cf_gbps")) else None


def _floor_ms(rec, ceiling, bw) -> Optional[float]:
    """The roofline floor: max(flops / ceiling, bytes / bandwidth), in ms."""
    if not _finite(ceiling) or not rec.get("flops"):
        return None
    t = rec["flops"] / (ceiling * 1e9)
    if rec.get("bytes") and _finite(bw):
        t = max(t, rec["bytes"] / (bw * 1e9))
    return t


# ================================================================ run-level measurements (GPU)


def measure_ceilings(n: int = 8192, copy_bytes: int = 2 << 30) -> dict:
    """bf16 matmul TFLOP/s (n^3, random data) and HBM copy TB/s (bytes read + written), medians."""
    a = _rand(n, n, dtype=torch.bfloat16)
    b = _rand(n, n, dtype=torch.bfloat16)
    _warm(lambda: a @ b, [()], min_calls=5, min_s=1.0)  # clocks ramp up from idle (345 MHz seen)
    ms = statistics.median(device_times(lambda: a @ b, [()], 50, host_us=50))
    del a, b
    src = _rand(copy_bytes // 2, dtype=torch.float16)
    dst = torch.empty_like(src)
    _warm(lambda: dst.copy_(src), [()], min_calls=3)
    copy_ms = statistics.median(device_times(lambda: dst.copy_(src), [()], 20, host_us=50))
    del src, dst
    torch.cuda.empty_cache()
    return {"ceiling_tflops": round(2 * n ** 3 / ms / 1e9, 1), "hbm_tbps": round(2 * copy_bytes / copy_ms / 1e9, 3),
            "ceiling_detail": {"matmul": f"bf16 {n}x{n}x{n} torch.matmul, median of 50", "matmul_ms": round(ms, 4),
                               "copy_bytes": copy_bytes, "copy_ms": round(copy_ms, 4)}}


def host_us(fn, calls: int) -> float:
    """Host microseconds per call over ``calls`` back-to-back calls (a tiny op: the host is the bottleneck)."""
    for _ in range(100):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return 1e6 * (time.perf_counter() - t0) / calls


def measure_host_overhead(calls: int = 10000, ops_per_graph: int = 100) -> tuple:
    """Host time per call of cf.linear(x, w, b, activation="relu") at 64x256x256 fp16 (eager),
    the same op replayed ``ops_per_graph`` times per graph under cf.capture (captured, per op),
    and torch's F.relu(F.linear(x, w, b)) (torch_eager). Returns (schema dict, detail dict)."""
    import cudnn_fuse as cf

    h = torch.float16
    x, w, b = _rand(64, 256, dtype=h), _rand(256, 256, dtype=h, scale=1 / 16), _rand(256, dtype=h)
    eager = host_us(lambda: cf.linear(x, w, b, activation="relu"), calls)
    torch_eager = host_us(lambda: F.relu(F.linear(x, w, b)), calls)
    from . import loader as _plans
    from .launch_graphs import ENABLED as graphs_were_on

    cf.set_launch_graphs(False)  # without launch graphs (CUDNN_FUSE_LAUNCH_GRAPHS=0), for the record
    _plans.clear()
    try:
        without_graphs = host_us(lambda: cf.linear(x, w, b, activation="relu"), calls)
    finally:
        cf.set_launch_graphs(graphs_were_on)
        _plans.clear()

    def many(x):
        return [cf.linear(x, w, b, activation="relu") for _ in range(ops_per_graph)]

    g = cf.capture(many, x)
    captured = host_us(g.replay, max(10, calls // ops_per_graph)) / ops_per_graph
    one = cf.capture(lambda x: cf.linear(x, w, b, activation="relu"), x)
    single = host_us(one.replay, calls)
    return ({"eager": round(eager, 2), "captured": round(captured, 3), "torch_eager": round(torch_eager, 2)},
            {"calls": calls, "ops_per_graph": ops_per_graph, "captured_single_op_replay_us": round(single, 2),
             "eager_no_launch_graphs_us": round(without_graphs, 2),
             "shape": "x 64x256, w 256x256, fp16, relu"})


_TTR_CHILD = r"""
import json, sys, time
t_start = time.time()
import torch, torchvision
mode, batch, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
t_imported = time.time()
model = torchvision.models.resnet50().cuda().half().eval().to(memory_format=torch.channels_last)
x = torch.randn(batch, 3, 224, 224, device="cuda").half().contiguous(memory_format=torch.channels_last)
torch.cuda.synchronize()
t0 = time.time()
if mode == "cf":
    import cudnn_fuse as cf
    run = cf.optimize(model)
else:
    run = torch.compile(model)
with torch.no_grad():
    run(x)
torch.cuda.synchronize()
t_ready = time.time()
stats = {}
if mode == "cf":
    stats = {k: cf.plan_stats()[k] for k in ("builds", "loads", "fallbacks")}
json.dump({"t_start": t_start, "t_ready": t_ready, "import_s": t_imported - t_start,
           "first_forward_s": t_ready - t0, "plan_stats": stats}, open(out, "w"))
"""


def _ttr_run(mode: str, batch: int, env: dict, timeout: float = 420.0) -> dict:
    """One fresh process: import, build resnet50, its first forward (cf.optimize or torch.compile)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ttr.json")
        t_spawn = time.time()
        p = subprocess.run([sys.executable, "-c", _TTR_CHILD, mode, str(batch), out], env=env,
                           capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"{mode} child failed ({p.returncode}): {p.stderr[-600:]}")
        with open(out) as f:
            r = json.load(f)
    return {"ready_s": round(r["t_ready"] - t_spawn, 2), "first_forward_s": round(r["first_forward_s"], 2),
            "import_s": round(r["import_s"], 2), **({"plan_stats": r["plan_stats"]} if r["plan_stats"] else {})}


def measure_time_to_ready(batch: int = 32) -> dict:
    """Process start to resnet50's first forward result: cf.optimize() with a cold then a warm
    plan cache, torch.compile with a cold then a warm Inductor cache (fresh processes each)."""
    out: dict = {"batch": batch, "what": "fresh process start -> first resnet50 fp16 channels_last forward done"}
    with tempfile.TemporaryDirectory() as plans_dir, tempfile.TemporaryDirectory() as inductor_dir:
        env = dict(os.environ, CUDNN_FUSE_CACHE_DIR=plans_dir, TORCHINDUCTOR_CACHE_DIR=inductor_dir)
        for key, mode in (("cf_cold_plan_cache", "cf"), ("cf", "cf"), ("torch_compile", "compile"),
                          ("torch_compile_warm_inductor_cache", "compile")):
            try:
                r = _ttr_run(mode, batch, env)
                out[key] = r["ready_s"]
                out[key + "_detail"] = r
            except Exception as exc:  # noqa: BLE001
                out[key] = None
                out[key + "_error"] = _short(exc)
    return out


# ================================================================ documents


def new_doc(part: Optional[str], opts: Options) -> dict:
    import cudnn_fuse

    return {"schema": SCHEMA, "version": VERSION, "device": device_name(), "torch": torch.__version__,
            "cudnn_fuse": cudnn_fuse.__version__, "cudnn": _cudnn_version(), "ceiling_tflops": None, "hbm_tbps": None,
            "host_overhead_us": None, "time_to_ready_s": None, "workloads": [],
            "parts": [{"part": part or "all", "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                       "max_autotune": opts.max_autotune, "budget_s": opts.budget_s, "wall_s": None}]}


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _cudnn_version():
    try:
        return torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001
        return None


def write_json(path: str, doc: dict) -> None:
    """Write atomically (manifest.write_json: temp file + os.replace), so a killed run leaves the last
    complete file."""
    from .manifest import write_json as atomic_write_json

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write_json(doc, path)


def merge(docs: Sequence[dict]) -> dict:
    """One document from parts: workloads concatenated (a name measured twice keeps the record
    with more measured variants, later part on ties), each stamped with its part's ceilings
    (``run_ceiling_tflops``, ``run_hbm_tbps``); the document's ceilings are the highest a part measured;
    the host overhead and time to ready come from the part that measured them."""
    if not docs:
        raise ValueError("merge needs at least one document")
    for i, d in enumerate(docs):
        schema = d.get("schema") if isinstance(d, dict) else None
        if schema != SCHEMA:
            raise ValueError(f"document {i} is not a {SCHEMA} document (schema {schema!r})")
        if not isinstance(d.get("workloads"), list) or not all(
                isinstance(r, dict) and isinstance(r.get("name"), str) for r in d["workloads"]):
            raise ValueError(f"document {i}: workloads must be a list of records with a name")
    devices = sorted({d.get("device") for d in docs})
    out = {k: v for k, v in docs[0].items() if k not in ("workloads", "parts", "summary")}
    out["device"] = devices[0] if len(devices) == 1 else " | ".join(devices)
    for key in ("ceiling_tflops", "hbm_tbps"):
        vals = [d.get(key) for d in docs if _finite(d.get(key))]
        out[key] = max(vals) if vals else None
    best = max((d for d in docs if _finite(d.get("ceiling_tflops"))), key=lambda d: d["ceiling_tflops"], default=None)
    out["ceiling_detail"] = best.get("ceiling_detail") if best else None
    for key in ("host_overhead_us", "host_overhead_detail", "time_to_ready_s"):
        out[key] = next((d[key] for d in reversed(docs) if d.get(key)), None)
    by_name: dict = {}
    for d in docs:
        for rec in d["workloads"]:
            rec = dict(rec)
            for key, run_key in (("ceiling_tflops", "run_ceiling_tflops"), ("hbm_tbps", "run_hbm_tbps")):
                if not _finite(rec.get(run_key)) and _finite(d.get(key)):
                    rec[run_key] = d[key]  # judged against its own run's ceilings (summarize)
            old = by_name.get(rec["name"])
            if old is None or _measured(rec) >= _measured(old):
                by_name[rec["name"]] = rec
    order = {w.name: i for i, w in enumerate(registry())}
    out["workloads"] = sorted(by_name.values(), key=lambda r: (order.get(r["name"], len(order)), r["name"]))
    out["parts"] = [p for d in docs for p in d.get("parts", [])]
    return summarize(out)


def _measured(rec: dict) -> int:
    vals = [rec.get("cf_ms"), rec.get("cf_autotuned_ms")] + list(rec.get("peers", {}).values()) \
        + list(rec.get("cf_variants", {}).values())
    return sum(1 for v in vals if _finite(v))


# ================================================================ the run


def run_suite(workloads: Sequence[Workload], opts: Options, part: Optional[str] = None, out_path: Optional[str] = None,
              emit: Callable[[str], None] = lambda s: None, timer: Callable = None,
              clock: Callable[[], float] = time.perf_counter, extras: bool = True) -> dict:
    """Run ``workloads`` (ceilings, host overhead and time to ready first when ``extras``), writing
    the document to ``out_path`` after each workload so a killed run keeps what it measured."""
    started = clock()
    doc = new_doc(part, opts)
    if extras:
        _extras(doc, opts, part, emit)
        _save(doc, out_path)
    for i, w in enumerate(workloads):
        t0 = clock()
        emit(f"[{t0 - started:6.0f} s] {i + 1}/{len(workloads)} {w.name}")
        rec = run_workload(w, opts, started, timer=timer, clock=clock,
                           on_variant=lambda r: _save({**doc, "workloads": doc["workloads"] + [finish_record(dict(r))]},
                                                      out_path))
        rec["wall_s"] = round(clock() - t0, 2)
        doc["workloads"].append(rec)
        emit("    " + format_record(rec))
        doc["parts"][0]["wall_s"] = round(clock() - started, 1)
        _save(doc, out_path)
    if extras and workloads:
        _remeasure_ceilings(doc, emit)
    doc["parts"][0]["wall_s"] = round(clock() - started, 1)
    summarize(doc)
    _save(doc, out_path)
    return doc


def _remeasure_ceilings(doc: dict, emit) -> None:
    """Measure the ceilings again at the end (the GPU warm) and keep the higher: two fresh machines
    of the smoke run gave 752 and 687 TFLOP/s at the start of a part."""
    try:
        again = measure_ceilings()
    except Exception as exc:  # noqa: BLE001
        doc["ceiling_error"] = _short(exc)
        return
    detail = {"start": doc.get("ceiling_detail"), "end": again["ceiling_detail"],
              "start_tflops": doc.get("ceiling_tflops"), "end_tflops": again["ceiling_tflops"]}
    for key in ("ceiling_tflops", "hbm_tbps"):
        doc[key] = max(v for v in (doc.get(key), again[key]) if v is not None)
    doc["ceiling_detail"] = detail
    emit(f"ceiling at the end: bf16 matmul {again['ceiling_tflops']} TFLOP/s, HBM copy {again['hbm_tbps']} TB/s")


def _save(doc, path) -> None:
    if path:
        write_json(path, summarize(doc))


def _extras(doc: dict, opts: Options, part: Optional[str], emit) -> None:
    try:
        doc.update(measure_ceilings())
        emit(f"ceiling: bf16 matmul {doc['ceiling_tflops']} TFLOP/s, HBM copy {doc['hbm_tbps']} TB/s")
    except Exception as exc:  # noqa: BLE001
        doc["ceiling_error"] = _short(exc)
    if opts.host_overhead and part in HOST_OVERHEAD_PARTS:
        try:
            doc["host_overhead_us"], doc["host_overhead_detail"] = measure_host_overhead()
            emit(f"host overhead per call, us: {doc['host_overhead_us']}")
        except Exception as exc:  # noqa: BLE001
            doc["host_overhead_error"] = _short(exc)
    if opts.time_to_ready and part in TIME_TO_READY_PARTS:
        doc["time_to_ready_s"] = measure_time_to_ready()
        emit("time to ready, s: " + json.dumps({k: v for k, v in doc["time_to_ready_s"].items()
                                                  if not isinstance(v, dict) and k != "what"}))


def _fmt(ms) -> str:
    return "-" if not _finite(ms) else f"{ms:.4g}"


def format_record(rec: dict) -> str:
    """One line: cf, cf autotuned, every peer; failures marked."""
    parts = [f"cf {_fmt(rec['cf_ms'])}", f"tuned {_fmt(rec['cf_autotuned_ms'])}"]
    parts += [f"{k} {_fmt(v)}" for k, v in rec["cf_variants"].items()]
    parts += [f"{k} {_fmt(v)}" for k, v in rec["peers"].items()]
    line = "  ".join(parts) + " ms"
    if rec.get("speedup_autotuned_vs_best_peer"):
        line += f"  x{rec['speedup_autotuned_vs_best_peer']:.2f} vs {rec['best_peer']}"
    if rec["errors"]:
        line += "  errors: " + ", ".join(rec["errors"])
    return line


def format_summary(doc: dict) -> str:
    rows = [("workload", "cf ms", "tuned ms", "best peer", "peer ms", "speedup")]
    for r in doc["workloads"]:
        rows.append((r["name"], _fmt(r["cf_ms"]), _fmt(r["cf_autotuned_ms"]), r.get("best_peer") or "-",
                     _fmt(r.get("best_peer_ms")), _fmt(r.get("speedup_autotuned_vs_best_peer"))))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    s = doc.get("summary", {})
    lines.append(f"geomean speedup vs best peer {s.get('geomean_speedup_vs_best_peer')}, autotuned vs max-autotune "
                 f"{s.get('geomean_autotuned_vs_max_autotune')}; ceiling {doc.get('ceiling_tflops')} TFLOP/s")
    return "\n".join(lines)


# ================================================================ command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part", help=f"run one part: {', '.join(PARTS)} (or all)")
    p.add_argument("--only", metavar="REGEX", help="only workloads whose name matches (re.search)")
    p.add_argument("--kinds", help=f"comma-separated kinds among {', '.join(KINDS)}")
    p.add_argument("--max-autotune", action=argparse.BooleanOptionalAction, default=True,
                   help="time torch.compile max-autotune-no-cudagraphs (slow to compile)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="expensive variants that would end past this many seconds are skipped (default 480)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="nothing new starts past this many seconds (default budget + 50)")
    p.add_argument("--target-ms", type=float, default=200.0, help="device time spent timing each variant")
    p.add_argument("--no-extras", action="store_true", help="skip the ceilings, host overhead and time to ready")
    p.add_argument("--no-time-to-ready", action="store_true", help="skip the time-to-ready processes (about 90 s)")
    p.add_argument("--out", help="the JSON to write (default bench/results/peers.json, or peers_<part>.json)")
    p.add_argument("--list", action="store_true", help="list the selected workloads and exit")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="merge part files into --out (no GPU needed)")


def default_out(part: Optional[str]) -> str:
    name = "peers.json" if part in (None, "all") else f"peers_{part}.json"
    return os.path.join("bench", "results", name)


def main(args: argparse.Namespace, emit: Callable[[str], None], err: Callable[[str], None]) -> int:
    """The ``cudnn-fuse bench`` command (also bench/peers.py); returns the exit status.
    ``emit``/``err`` write a line to stdout/stderr: the CLI prints, the suite never does."""
    kinds = [k for k in (args.kinds or "").split(",") if k]
    try:
        chosen = select(registry(), args.only, kinds, args.part)
    except (ValueError, re.error) as exc:
        err(f"cudnn-fuse bench: {exc}")
        return 2
    if args.merge:
        try:
            docs = []
            for path in args.merge:
                with open(path) as f:
                    try:
                        docs.append(json.load(f))
                    except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested past Python's limit
                        raise ValueError(f"{path}: not JSON ({exc})") from None
            doc = merge(docs)
        except (OSError, ValueError) as exc:
            err(f"cudnn-fuse bench --merge: {exc}")
            return 2
        out = args.out or default_out(None)
        write_json(out, doc)
        emit(format_summary(doc))
        emit(f"merged {len(docs)} part(s), {len(doc['workloads'])} workloads -> {out}")
        return 0
    if args.list:
        for w in chosen:
            emit(f"{w.name:60s} {w.kind:9s} {w.group:22s} {w.flops / 1e9:12.3f} GFLOP")
        emit(f"{len(chosen)} workloads")
        return 0
    if not torch.cuda.is_available():
        err("cudnn-fuse bench: benchmarks need a CUDA GPU, and torch sees none "
            f"(torch {torch.__version__}); --list and --merge work without one")
        return 2
    opts = Options(max_autotune=args.max_autotune, budget_s=args.budget_s,
                   deadline_s=args.deadline_s if args.deadline_s is not None else args.budget_s + 50,
                   target_ms=args.target_ms, time_to_ready=not (args.no_extras or args.no_time_to_ready),
                   host_overhead=not args.no_extras)
    out = args.out or default_out(args.part)
    doc = run_suite(chosen, opts, args.part, out, emit=emit, extras=not args.no_extras)
    emit(format_summary(doc))
    emit(f"wrote {out}")
    return 0
