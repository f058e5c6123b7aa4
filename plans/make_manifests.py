"""Regenerate the shipped manifests: ResNet-50 (fp16, batch 32 and 1) and GPT-2 /
Llama-style decoder blocks (bf16, several sequence lengths).

The models are built on the "meta" device and run through ``cf.optimize`` under
``cf.record``: the specs are exactly those the GPU path builds, and nothing is
computed, so this runs anywhere (no GPU, no download):

    python3 plans/make_manifests.py
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


# ----------------------------------------------------------------------------- ResNet-50


class Bottleneck(nn.Module):
    """torchvision's ResNet-50 bottleneck (v1.5: the stride sits on the 3x3 conv)."""

    def __init__(self, cin, width, stride=1):
        super().__init__()
        cout = width * 4
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        # torchvision's order: the downsample runs after bn3, so optimize() hangs the
        # residual add + ReLU on conv3's epilogue, as it does for torchvision's model
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet50(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1, self.relu = nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        layers, cin = [], 64
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            stage = []
            for i in range(blocks):
                stage.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = width * 4
            layers.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(2048, 1000)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


# ----------------------------------------------------------------------------- decoders


class Attention(nn.Module):
    def __init__(self, d, heads, kv_heads, bias):
        super().__init__()
        self.h, self.kv, self.dh = heads, kv_heads, d // heads
        self.qkv = nn.Linear(d, (heads + 2 * kv_heads) * self.dh, bias=bias)
        self.proj = nn.Linear(d, d, bias=bias)

    def forward(self, x):
        B, S, _ = x.shape
        q, k, v = self.qkv(x).split([self.h * self.dh, self.kv * self.dh, self.kv * self.dh], -1)
        q = q.view(B, S, self.h, self.dh).transpose(1, 2)
        k = k.view(B, S, self.kv, self.dh).transpose(1, 2)
        v = v.view(B, S, self.kv, self.dh).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.h)
        return self.proj(o.transpose(1, 2).reshape(B, S, -1))


class GPT2Block(nn.Module):
    def __init__(self, d=768, heads=12):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, heads, bias=True)
        self.fc, self.act, self.out = nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(self.act(self.fc(self.ln2(x))))


class LlamaBlock(nn.Module):
    def __init__(self, d=2048, heads=32, kv_heads=8, hidden=5632):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.attn = Attention(d, heads, kv_heads, bias=False)
        self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _record(model, inputs, path, name, description):
    model = cf.optimize(model.eval())
    with cf.record(path, name=name, description=description) as rec:
        with torch.no_grad():
            for x in inputs:
                model(x)
    print(f"{os.path.relpath(path)}: {len(rec.entries)} specs, {sum(e.count for e in rec.entries)} calls")


def main() -> None:
    meta = torch.device("meta")
    resnet = ResNet50().to(meta, torch.float16)
    for bs in (32, 1):
        x = torch.empty(bs, 3, 224, 224, device=meta, dtype=torch.float16).to(memory_format=torch.channels_last)
        _record(resnet, [x], os.path.join(HERE, f"resnet50_fp16_bs{bs}.json"), f"resnet50 fp16 batch {bs}",
                "every conv of torchvision's ResNet-50 after cf.optimize (BN folded, residual + ReLU in the epilogue), "
                f"channels_last, 224x224, batch {bs}")
    seqs = (128, 512, 1024, 2048)
    gpt2 = GPT2Block().to(meta, torch.bfloat16)
    _record(gpt2, [torch.empty(8, s, 768, device=meta, dtype=torch.bfloat16) for s in seqs],
            os.path.join(HERE, "gpt2_block_bf16.json"), "gpt2-small block bf16",
            f"one GPT-2 small decoder block (attention + GELU MLP), batch 8, sequence lengths {list(seqs)}")
    llama = LlamaBlock().to(meta, torch.bfloat16)
    _record(llama, [torch.empty(1, s, 2048, device=meta, dtype=torch.bfloat16) for s in seqs],
            os.path.join(HERE, "llama_block_bf16.json"), "llama-style block bf16",
            f"one Llama-style decoder block (GQA 32/8 heads, SwiGLU MLP), batch 1, sequence lengths {list(seqs)}")


if __name__ == "__main__":
    main()
