"""The model half of ``cudnn-fuse demo``: a small ResNet-style CNN and a transformer
block, built in memory, through ``optimize()`` -> record -> pre-warm -> warm start.

For each model: eager ms vs cf ms per forward, the op specs it records, the cold start
(empty cache: every plan built) against the warm start (in-memory plans dropped, a
pre-warmed disk cache: every plan loaded), and the largest relative error against eager.

The specs are recorded on the meta device in the dtype and layout the GPU runs (fp16
channels_last CNN, bf16 transformer), so a machine without a GPU records what one would
build: on the CPU the models run fp32 through the ops' PyTorch reference, and cf records a
spec only where a GPU would build a cuDNN graph, which fp32 linear, matmul and attention
never do.
"""

from __future__ import annotations

import copy
import os
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn


class _Bottleneck(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c // 4, 1, bias=False), nn.BatchNorm2d(c // 4)
        self.c2, self.b2 = nn.Conv2d(c // 4, c // 4, 3, padding=1, bias=False), nn.BatchNorm2d(c // 4)
        self.c3, self.b3 = nn.Conv2d(c // 4, c, 1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        out = F.relu(self.b1(self.c1(x)))
        out = F.relu(self.b2(self.c2(out)))
        return F.relu(self.b3(self.c3(out)) + x)


class SmallResNet(nn.Module):
    def __init__(self, c=128):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, 2, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.blocks = nn.Sequential(*[_Bottleneck(c) for _ in range(3)])
        self.fc = nn.Linear(c, 10)

    def forward(self, x):
        return self.fc(self.blocks(self.stem(x)).mean((2, 3)))


class Block(nn.Module):
    def __init__(self, d=512, h=8):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, S, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, S, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(o.transpose(1, 2).reshape(B, S, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


# name -> (dtype on the GPU, channels_last on the GPU)
GPU_FORMS = {"resnet-style CNN": (torch.float16, True), "transformer block": (torch.bfloat16, False)}


def _models(device, on_gpu):
    """(name, model, input) of each model, in the GPU's dtype and layout on a GPU, fp32 elsewhere."""
    torch.manual_seed(0)
    cnn = SmallResNet()
    x = torch.randn(32 if on_gpu else 2, 3, 64, 64)
    torch.manual_seed(0)
    block = Block()
    t = torch.randn(8 if on_gpu else 1, 512 if on_gpu else 64, 512)
    out = []
    for name, model, inp in (("resnet-style CNN", cnn, x), ("transformer block", block, t)):
        dtype, channels_last = GPU_FORMS[name] if on_gpu else (torch.float32, False)
        model, inp = model.to(device, dtype).eval(), inp.to(device, dtype)
        if channels_last:
            model, inp = model.to(memory_format=torch.channels_last), inp.to(memory_format=torch.channels_last)
        out.append((name, model, inp))
    return out


def record_specs(name: str, model: nn.Module, x: torch.Tensor) -> list:
    """The manifest entries of ``cf.optimize(model)(x)`` as a GPU runs it (``GPU_FORMS[name]``):
    recorded on the meta device, where the ops make every spec as on the GPU and compute nothing."""
    import cudnn_fuse as cf
    from cudnn_fuse import manifest

    dtype, channels_last = GPU_FORMS[name]
    form = torch.channels_last if channels_last else torch.contiguous_format
    meta_model = copy.deepcopy(model).to("meta", dtype).to(memory_format=form)
    meta_x = torch.empty(x.shape, dtype=dtype, device="meta", memory_format=form)
    with torch.no_grad(), manifest.record() as rec:
        cf.optimize(meta_model)(meta_x)
    return rec.entries


def _median_ms(fn, on_gpu, n=20) -> float:
    for _ in range(3):
        fn()
    return statistics.median(_first_call_ms(fn, on_gpu) for _ in range(n if on_gpu else 3))


def _first_call_ms(fn, on_gpu) -> float:
    if on_gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if on_gpu:
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0)


def run(on_gpu: bool, progress=None) -> tuple[list, list]:
    """Returns (table rows, notes); ``progress(done, total)`` is called as each model ends."""
    import cudnn_fuse as cf
    from cudnn_fuse import envvars, loader, prewarm

    # torch's decompositions import torch._dynamo at their first use (about 1.3 s): imported here,
    # it is not timed as the cold start, which is the plans' work
    import torch._dynamo  # noqa: F401

    device = torch.device("cuda" if on_gpu else "cpu")
    rows, notes = [], []
    saved = envvars.text(envvars.CACHE_DIR)
    models = _models(device, on_gpu)
    with tempfile.TemporaryDirectory() as cold_dir, tempfile.TemporaryDirectory() as warm_dir:
        try:
            for n, (name, model, x) in enumerate(models):
                if progress is not None:
                    progress(n, len(models))
                entries = record_specs(name, model, x)
                with torch.no_grad():
                    opt = cf.optimize(model)
                    os.environ[envvars.CACHE_DIR] = cold_dir  # an empty cache: a true cold start
                    loader.clear()
                    before = cf.plan_stats()
                    cold_ms = _first_call_ms(lambda: opt(x), on_gpu)
                    built = cf.plan_stats()["builds"] - before["builds"]
                    # pre-warm a second cache from the recorded manifest, then start warm from it
                    os.environ[envvars.CACHE_DIR] = warm_dir
                    if on_gpu:
                        prewarm.prewarm(entries, cache=cf.PlanCache())
                    loader.clear()
                    before = cf.plan_stats()
                    warm_ms = _first_call_ms(lambda: opt(x), on_gpu)
                    after = cf.plan_stats()
                    eager_ms, cf_ms = _median_ms(lambda: model(x), on_gpu), _median_ms(lambda: opt(x), on_gpu)
                    ref, out = model(x).float(), opt(x).float()
                err = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                rows.append([name, f"{device.type} {str(x.dtype).replace('torch.', '')}", f"{eager_ms:.3f}",
                             f"{cf_ms:.3f}", f"{eager_ms / cf_ms:.2f}x", len(entries),
                             f"{cold_ms:.0f} ({built} built)",
                             f"{warm_ms:.0f} ({after['builds'] - before['builds']} built, "
                             f"{after['loads'] - before['loads']} loaded)", f"{err:.1e}"])
        finally:
            if saved is None:
                os.environ.pop(envvars.CACHE_DIR, None)
            else:
                os.environ[envvars.CACHE_DIR] = saved
            loader.clear()
    if progress is not None:
        progress(len(models), len(models))
    forms = ", ".join(f"{name} {str(dtype).replace('torch.', '')}" for name, (dtype, _) in GPU_FORMS.items())
    notes.append(f"specs: the op specs each model records as a GPU runs it ({forms}), recorded on the meta device")
    if not on_gpu:
        notes.append("no GPU: the models ran fp32 through the ops' PyTorch reference; nothing was built or "
                     "pre-warmed, so the cold and warm starts hold no plan work (that needs a CUDA GPU)")
    return rows, notes


HEADERS = ["model", "device", "eager ms", "cf ms", "speedup", "specs", "cold start ms", "warm start ms", "rel err"]
