"""Distinct graphs for the cold-start benchmark: ResNet-style convs, MLP linears,
matmul + AMAX and attention, each a callable running one cf op on fresh random
inputs (seeded, so every process builds the same specs)."""

from __future__ import annotations

import torch

import cudnn_fuse as cf


def _r(*shape, dtype, scale=1.0, cl=False):
    t = (torch.randn(*shape, device="cuda") * scale).to(dtype)
    return t.to(memory_format=torch.channels_last) if cl else t


_ACT = {None: lambda t: t, "relu": torch.relu, "gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu}


def cold_start_graphs(eager: bool = False):
    """32 (name, fn) pairs; fn() runs one distinct fused graph. ``eager``: fn() runs the same
    computation as plain PyTorch ops instead (torch's cuDNN convs and attention, cuBLAS GEMMs, the
    epilogue as separate kernels): what a fresh process pays for torch's own first calls."""
    F = torch.nn.functional
    torch.manual_seed(0)
    h = torch.float16
    out = []
    convs = [  # (C, K, HW, R, stride, act, residual)
        (64, 64, 56, 1, 1, "relu", False), (64, 64, 56, 3, 1, "relu", False), (64, 256, 56, 1, 1, None, True),
        (256, 64, 56, 1, 1, "relu", False), (256, 128, 56, 1, 1, "relu", False), (128, 128, 28, 3, 1, "relu", False),
        (128, 512, 28, 1, 1, None, True), (512, 128, 28, 1, 1, "relu", False), (512, 256, 28, 1, 1, "relu", False),
        (256, 256, 14, 3, 1, "relu", False), (256, 1024, 14, 1, 1, None, True), (1024, 256, 14, 1, 1, "relu", False),
        (1024, 512, 14, 1, 1, "relu", False), (512, 512, 7, 3, 1, "relu", False), (512, 2048, 7, 1, 1, None, True),
        (2048, 512, 7, 1, 1, "silu", False),
    ]
    for C, K, HW, R, s, act, res in convs:
        x = _r(32, C, HW, HW, dtype=h, cl=True)
        w = _r(K, C, R, R, dtype=h, scale=(C * R * R) ** -0.5, cl=True)
        b = _r(K, dtype=h)
        P = (HW + 2 * (R // 2) - R) // s + 1
        r = _r(32, K, P, P, dtype=h, cl=True) if res else None
        name = f"conv_c{C}_k{K}_{HW}_r{R}_{act}{'_res' if res else ''}"
        if eager:  # cf's order: conv + bias, the residual, then the activation
            out.append((name, lambda x=x, w=w, b=b, R=R, s=s, act=act, r=r: _ACT[act](
                F.conv2d(x, w, b, s, R // 2) + (r if r is not None else 0))))
        else:
            out.append((name, lambda x=x, w=w, b=b, R=R, s=s, act=act, r=r: cf.conv2d(x, w, b, s, R // 2, activation=act,
                                                                                        residual=r)))
    bf = torch.bfloat16
    for M, K, N, act in [(1, 768, 3072, "gelu"), (16, 768, 3072, "gelu"), (128, 768, 3072, "gelu"),
                         (4096, 768, 3072, "gelu"), (4096, 3072, 768, None), (2048, 1024, 4096, "silu"),
                         (2048, 4096, 1024, None), (512, 2048, 2048, "relu")]:
        x, w, b = _r(M, K, dtype=bf), _r(N, K, dtype=bf, scale=K ** -0.5), _r(N, dtype=bf)
        out.append((f"linear_{M}x{K}x{N}_{act}",
                    (lambda x=x, w=w, b=b, act=act: _ACT[act](F.linear(x, w, b))) if eager else
                    (lambda x=x, w=w, b=b, act=act: cf.linear(x, w, b, activation=act))))
    for M in (1024, 2048, 4096, 8192):
        a, bm = _r(M, 1024, dtype=bf), _r(1024, 1024, dtype=bf, scale=1 / 32)
        out.append((f"matmul_{M}x1024x1024_relu_amax",
                    (lambda a=a, bm=bm: (lambda y: (y, y.abs().amax()))(torch.relu(a @ bm))) if eager else
                    (lambda a=a, bm=bm: cf.matmul(a, bm, activation="relu", return_amax=True))))
    for S, D, causal, hkv in [(512, 64, True, 8), (1024, 128, True, 8), (2048, 64, False, 8), (1024, 128, True, 2)]:
        q = _r(4, 8, S, D, dtype=bf)
        k, v = _r(4, hkv, S, D, dtype=bf), _r(4, hkv, S, D, dtype=bf)
        sdpa = F.scaled_dot_product_attention if eager else cf.scaled_dot_product_attention
        out.append((f"sdpa_s{S}_d{D}_{'causal' if causal else 'full'}_hkv{hkv}",
                    lambda q=q, k=k, v=v, c=causal, g=hkv != 8, sdpa=sdpa: sdpa(q, k, v, is_causal=c, enable_gqa=g)))
    assert len(out) == 32, len(out)
    return out
