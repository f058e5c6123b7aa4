"""Seeded random cases for cf's functional ops, checked against an independent reference.

Each case draws its shapes, memory layout (contiguous, channels_last, transposed or sliced
views), dtype, epilogue (bias, activation, residual, AMAX) and, for attention, mask kind,
GQA, causality and scale. The reference is not cf's own (``cudnn_fuse.reference``): it is
composed here from plain torch ops in float64 on the CPU, from the same (upcast) inputs.

Every case runs twice with fresh values of the same shapes and strides, so the second call
goes through the per-signature memo (a cached launch) and must be right too. A subset also
checks gradients against float64 autograd of the reference. The later calls draw every operand
at unit scale (the first scales weights by 1/sqrt(fan-in)), so pre-activations reach the tens and
hundreds: that is how the float32 conv engine's tanh overflow showed (engines.barred_engines).

Used by tests/test_fuzz.py (the CPU path, in CI) and tests/test_gpu_fuzz.py (cuDNN on the GPU).
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import cudnn_fuse as cf


ACTS = [None, "relu", "gelu", "gelu_tanh", "silu", "tanh", "sigmoid", "leaky_relu"]
# Norm-wise relative error against float64. 16-bit outputs round at 2^-11 (fp16) / 2^-8 (bf16)
# per element; the bounds leave room for that and for cuDNN's activation approximations, and
# stay under what one flipped ReLU mask per draw costs a gradient (0.2-4% in the double-rounding
# bug tests/test_fuzz.py found in the 16-bit CPU GEMM).
# Measured on the H200 (tests/test_gpu_fuzz.py, 150 cases): fused forwards within 2.7e-4 (fp16)
# and 2.6e-3 (bf16), gradients within 4.8e-4 / 4.4e-3; on the CPU path 8.5e-4 / 7e-3 at most.
TOL = {torch.float16: 1e-3, torch.bfloat16: 6e-3, torch.float32: 1e-4}
GRAD_TOL = {torch.float16: 2.5e-3, torch.bfloat16: 1.2e-2, torch.float32: 1e-4}


def _slope(p) -> float:
    """The drawn slope where the activation takes one (leaky_relu); the default, which every activation
    takes, elsewhere (a slope with another activation is an ArgumentError)."""
    return p["slope"] if p["act"] == "leaky_relu" else 0.01


def act_ref(z, act, slope):
    if act is None:
        return z
    return {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu,
            "tanh": torch.tanh, "sigmoid": torch.sigmoid,
            "leaky_relu": lambda t: F.leaky_relu(t, slope)}[act](z)


def rel_err(out, ref) -> float:
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(out).all():
        return math.inf
    denom = ref.norm().item()
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)


@dataclass
class Case:
    """One drawn case: ``make(device)`` returns (inputs, kwargs); ``run`` calls cf; ``ref`` the float64 reference."""

    name: str
    op: str
    dtype: torch.dtype
    params: dict
    grad: bool = False
    amax: bool = False
    notes: list = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.name}: {self.op} {str(self.dtype)[6:]} {self.params}"


# ----------------------------------------------------------------------------- drawing


def _layout(rng, t: torch.Tensor, kind: str) -> torch.Tensor:
    """``t``'s values in another memory layout: contiguous, channels_last, or a strided view."""
    if kind == "channels_last" and t.dim() == 4:
        return t.contiguous(memory_format=torch.channels_last)
    if kind == "sliced":  # a view into a bigger buffer, last dim strided by 2 or offset
        big = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
        view = big[..., 1::2] if rng.random() < 0.5 else big[..., : t.shape[-1]]
        view.copy_(t)
        return view
    if kind == "transposed" and t.dim() >= 2:  # same values, the last two dims swapped in memory
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    return t.contiguous()


def _rand(shape, dtype, device, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float32) * scale).to(dtype).to(device)


def draw_conv(rng: random.Random, dtypes, small: bool) -> dict:
    g = rng.choice([1, 1, 1, 2, 4, "dw"])
    cg = rng.choice([4, 8, 16] if small else [8, 16, 32, 64])
    if g == "dw":
        C = cg
        groups = C
        K = C * rng.choice([1, 2])
    else:
        groups = g
        C = cg * groups
        K = groups * rng.choice([4, 8, 16, 24] if small else [8, 16, 48, 64])
    R, S = rng.choice([(1, 1), (3, 3), (3, 3), (5, 5), (1, 3), (3, 1), (2, 2), (7, 7)])
    stride = rng.choice([1, 1, 2, (1, 2)])
    dilation = rng.choice([1, 1, 1, 2])
    pad = rng.choice(["int", "pair", "same", "valid"])
    if pad == "same" and stride != 1:
        pad = "int"
    padding = {"int": rng.choice([0, 1, 2]), "pair": (rng.choice([0, 1]), rng.choice([1, 2])), "same": "same",
               "valid": "valid"}[pad]
    lo = max(R, S) * dilation + 1
    H, W = rng.randint(lo, lo + (8 if small else 20)), rng.randint(lo, lo + (8 if small else 20))
    N = rng.choice([1, 2, 3] if small else [1, 2, 4, 8])
    return dict(N=N, C=C, H=H, W=W, K=K, R=R, S=S, stride=stride, padding=padding, dilation=dilation, groups=groups,
                unbatched=rng.random() < 0.1, layout=rng.choice(["contiguous", "channels_last", "channels_last", "sliced"]),
                w_layout=rng.choice(["contiguous", "channels_last"]), bias=rng.random() < 0.7,
                act=rng.choice(ACTS), residual=rng.random() < 0.3, slope=rng.choice([0.01, 0.2]))


def draw_matmul(rng: random.Random, dtypes, small: bool) -> dict:
    kind = rng.choice(["linear", "linear", "matmul", "matmul"])
    dims = [8, 16, 24, 40, 64, 72, 96, 128] + ([] if small else [256, 384, 1000])
    M, K, N = rng.choice([1, 3, *dims]), rng.choice(dims), rng.choice(dims)
    batch = rng.choice([(), (), (2,), (3, 2)])
    bbatch = () if kind == "linear" else rng.choice([(), batch, (1,) * len(batch)] if batch else [()])
    return dict(kind=kind, M=M, K=K, N=N, batch=batch, bbatch=bbatch,
                a_layout=rng.choice(["contiguous", "contiguous", "transposed", "sliced"]),
                b_layout=rng.choice(["contiguous", "transposed", "sliced"]),
                bias=rng.random() < 0.6, act=rng.choice(ACTS), residual=rng.random() < 0.3,
                slope=rng.choice([0.01, 0.2]), vector=kind == "matmul" and rng.random() < 0.08)


def draw_sdpa(rng: random.Random, dtypes, small: bool) -> dict:
    hkv = rng.choice([1, 2, 4])
    hq = hkv * rng.choice([1, 1, 2, 4])
    D = rng.choice([32, 64, 64, 128] if not small else [16, 32, 64])
    sq = rng.choice([1, 7, 64, 128, 200] if not small else [1, 5, 16, 33])
    skv = rng.choice([sq, sq, 64, 129, 256] if not small else [sq, 16, 40])
    causal = rng.random() < 0.35
    mask = None if causal else rng.choice([None, None, "bool", "float"])
    mshape = rng.choice(["sq_skv", "b1", "1h", "full"]) if mask else None
    return dict(B=rng.choice([1, 2, 3]), Hq=hq, Hkv=hkv, Sq=sq, Skv=skv, D=D,
                Dv=D if rng.random() < 0.85 else rng.choice([32, 64]), causal=causal, mask=mask, mshape=mshape,
                scale=rng.choice([None, None, 0.3]), layout=rng.choice(["bhsd", "bshd"]),
                three_d=hq == hkv == 1 and rng.random() < 0.3)


def draw(seed: int, n: int, ops=("conv2d", "matmul", "sdpa"), dtypes=(torch.float16, torch.bfloat16), small=False,
         grad_every=3, amax_every=7):
    """``n`` cases cycling through ``ops``; the drawing depends on ``seed`` only."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        op = ops[i % len(ops)]
        dtype = rng.choice(dtypes)
        p = {"conv2d": draw_conv, "matmul": draw_matmul, "sdpa": draw_sdpa}[op](rng, dtypes, small)
        amax = op != "sdpa" and i % amax_every == amax_every - 1 and not p.get("vector")
        grad = (i // len(ops)) % grad_every == 0 and not amax
        out.append(Case(f"case{i}", op, dtype, p, grad=grad, amax=amax))
    return out


# ----------------------------------------------------------------------------- running


def _conv(case: Case, device, gen):
    p, dt = case.params, case.dtype
    shape = (p["C"], p["H"], p["W"]) if p["unbatched"] else (p["N"], p["C"], p["H"], p["W"])
    rng = random.Random(zlib.crc32(case.name.encode()))
    x = _layout(rng, _rand(shape, dt, device, gen), p["layout"] if not p["unbatched"] else "contiguous")
    w = _layout(rng, _rand((p["K"], p["C"] // p["groups"], p["R"], p["S"]), dt, device, gen,
                           1 / math.sqrt(p["C"] // p["groups"] * p["R"] * p["S"])), p["w_layout"])
    b = _rand((p["K"],), dt, device, gen, 0.5) if p["bias"] else None
    kw = dict(stride=p["stride"], padding=p["padding"], dilation=p["dilation"], groups=p["groups"])
    z64 = F.conv2d(x.detach().double().cpu(), w.detach().double().cpu(), None, **kw)
    r = _rand(tuple(z64.shape), dt, device, gen) if p["residual"] else None
    if r is not None and rng.random() < 0.5 and r.dim() == 4:
        r = r.contiguous(memory_format=torch.channels_last)
    ins = dict(x=x, weight=w, bias=b, residual=r)

    def run(t):
        return cf.conv2d(t["x"], t["weight"], t["bias"], activation=p["act"], residual=t["residual"],
                         return_amax=case.amax, negative_slope=_slope(p), **kw)

    def ref(t):
        z = F.conv2d(t["x"], t["weight"], None, **kw)
        if t["bias"] is not None:
            z = z + t["bias"].reshape(-1, 1, 1)
        if t["residual"] is not None:
            z = z + t["residual"]
        return act_ref(z, p["act"], p["slope"])

    return ins, run, ref


def _matmul(case: Case, device, gen):
    p, dt = case.params, case.dtype
    rng = random.Random(zlib.crc32(case.name.encode()))
    if p["kind"] == "linear":
        x = _layout(rng, _rand((*p["batch"], p["M"], p["K"]), dt, device, gen), p["a_layout"])
        w = _layout(rng, _rand((p["N"], p["K"]), dt, device, gen, 1 / math.sqrt(p["K"])), p["b_layout"])
        out_shape = (*p["batch"], p["M"], p["N"])
    elif p["vector"]:
        x = _layout(rng, _rand((*p["batch"], p["M"], p["K"]), dt, device, gen), p["a_layout"])
        w = _rand((p["K"],), dt, device, gen, 1 / math.sqrt(p["K"]))
        out_shape = (*p["batch"], p["M"])
    else:
        x = _layout(rng, _rand((*p["batch"], p["M"], p["K"]), dt, device, gen), p["a_layout"])
        w = _layout(rng, _rand((*p["bbatch"], p["K"], p["N"]), dt, device, gen, 1 / math.sqrt(p["K"])), p["b_layout"])
        out_shape = (*p["batch"], p["M"], p["N"])
    has_bias = p["bias"] and not p["vector"]
    b = _rand((p["N"],), dt, device, gen, 0.5) if has_bias else None
    r = _rand(out_shape, dt, device, gen) if p["residual"] else None
    ins = dict(a=x, b=w, bias=b, residual=r)
    fn = cf.linear if p["kind"] == "linear" else cf.matmul

    def run(t):
        return fn(t["a"], t["b"], t["bias"], activation=p["act"], residual=t["residual"], return_amax=case.amax,
                  negative_slope=_slope(p))

    def ref(t):
        z = F.linear(t["a"], t["b"]) if p["kind"] == "linear" else torch.matmul(t["a"], t["b"])
        if t["bias"] is not None:
            z = z + t["bias"]
        if t["residual"] is not None:
            z = z + t["residual"]
        return act_ref(z, p["act"], p["slope"])

    return ins, run, ref


def _sdpa(case: Case, device, gen):
    p, dt = case.params, case.dtype
    B, Hq, Hkv, Sq, Skv, D, Dv = (p[k] for k in ("B", "Hq", "Hkv", "Sq", "Skv", "D", "Dv"))

    def make(h, s, d):
        if p["layout"] == "bshd":
            return _rand((B, s, h, d), dt, device, gen).transpose(1, 2)
        return _rand((B, h, s, d), dt, device, gen)

    q, k, v = make(Hq, Sq, D), make(Hkv, Skv, D), make(Hkv, Skv, Dv)
    if p["three_d"]:
        q, k, v = q[:, 0], k[:, 0], v[:, 0]
    mask = None
    if p["mask"]:
        full = (B, Hq, Sq, Skv)
        shape = {"sq_skv": (Sq, Skv), "b1": (B, 1, Sq, Skv), "1h": (1, Hq, Sq, Skv), "full": full}[p["mshape"]]
        if p["three_d"]:
            shape = {"sq_skv": (Sq, Skv), "b1": (B, Sq, Skv), "1h": (1, Sq, Skv), "full": (B, Sq, Skv)}[p["mshape"]]
        if p["mask"] == "bool":
            mask = torch.rand(*shape, generator=gen) < 0.7
            mask[..., 0] = True  # no row fully masked (torch gives NaN there)
        else:
            mask = (torch.randn(*shape, generator=gen) * 2).to(dt)
        mask = mask.to(device)
    ins = dict(q=q, k=k, v=v, attn_mask=mask)
    gqa = Hq != Hkv

    def run(t):
        return cf.scaled_dot_product_attention(t["q"], t["k"], t["v"], attn_mask=t["attn_mask"], is_causal=p["causal"],
                                               scale=p["scale"], enable_gqa=gqa)

    def ref(t):
        q, k, v = t["q"], t["k"], t["v"]
        if gqa:
            k = k.repeat_interleave(Hq // Hkv, dim=-3)
            v = v.repeat_interleave(Hq // Hkv, dim=-3)
        scale = p["scale"] if p["scale"] is not None else 1 / math.sqrt(D)
        s = (q @ k.transpose(-1, -2)) * scale
        if p["causal"]:
            s = s.masked_fill(~torch.ones(Sq, Skv, dtype=torch.bool, device=s.device).tril(), float("-inf"))
        m = t["attn_mask"]
        if m is not None:
            s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m
        return torch.softmax(s, dim=-1) @ v

    return ins, run, ref


MAKERS = {"conv2d": _conv, "matmul": _matmul, "sdpa": _sdpa}


def _to_ref(ins: dict, grad: bool) -> dict:
    out = {}
    for k, t in ins.items():
        if t is None:
            out[k] = None
        elif t.dtype == torch.bool:
            out[k] = t.cpu()
        else:
            out[k] = t.detach().double().cpu().requires_grad_(grad)
    return out


def check(case: Case, device: str, seed: int = 0, eager: bool = False) -> dict:
    """Run ``case`` twice (fresh values, same signature); where ``case.grad``, a third time, the
    last two with gradients (the first training call, then its memoized launch).

    Returns {"fwd": [errors], "grad": {name: error}, "amax": [errors]}; raises on a wrong shape,
    dtype or layout. Thresholds are left to the caller. ``eager`` adds "eager_fwd" and
    "eager_grad": the same errors of the reference composition run by eager torch on the case's
    own device and dtype (what a fallback to PyTorch is held to).
    """
    gen = torch.Generator().manual_seed(seed)
    ins, run, ref = MAKERS[case.op](case, device, gen)
    res = {"fwd": [], "grad": {}, "amax": [], "eager_fwd": [], "eager_grad": {}}
    for rep in range(3 if case.grad else 2):
        if rep:  # the same shapes and strides, new values: the memoized launch
            for t in ins.values():
                if t is not None and t.dtype != torch.bool:
                    t.copy_(_rand(tuple(t.shape), t.dtype, "cpu", gen).to(t.device))
        want_grad = case.grad and rep >= 1  # the first training call, then its memo
        leaves = {}
        if want_grad:
            for k, t in ins.items():
                if t is not None and t.dtype != torch.bool and (k != "attn_mask"):
                    leaves[k] = t.detach().requires_grad_(True)
            call_ins = {k: leaves.get(k, t) for k, t in ins.items()}
        else:
            call_ins = ins
        out = run(call_ins)
        r_ins = _to_ref(call_ins, want_grad)
        with torch.enable_grad() if want_grad else torch.no_grad():
            r = ref(r_ins)
        if case.amax:
            y, a = out
            assert a.dtype == torch.float32 and a.dim() == 0, f"{case}: amax {a.dtype} {tuple(a.shape)}"
            ra = r.abs().max().item()
            res["amax"].append(abs(a.item() - ra) / max(ra, 1e-6))
        else:
            y = out
        assert tuple(y.shape) == tuple(r.shape), f"{case}: shape {tuple(y.shape)} != {tuple(r.shape)}"
        assert y.dtype == case.dtype, f"{case}: dtype {y.dtype}"
        assert y.device.type == torch.device(device).type, f"{case}: device {y.device}"
        res["fwd"].append(rel_err(y, r))
        e_ins = None
        if eager:
            e_ins = {k: (t.detach().requires_grad_(want_grad) if t is not None and t.dtype != torch.bool else t)
                     for k, t in call_ins.items()}
            with torch.enable_grad() if want_grad else torch.no_grad():
                e = ref(e_ins)
            res["eager_fwd"].append(rel_err(e, r))
        if want_grad:
            gy = _rand(tuple(y.shape), torch.float32, "cpu", gen)
            (y.float() * gy.to(y.device)).sum().backward()
            (r * gy.double()).sum().backward()
            if e_ins is not None:
                (e.float() * gy.to(e.device)).sum().backward()
            for k, t in leaves.items():
                rt = r_ins[k]
                assert t.grad is not None, f"{case}: no gradient for {k}"
                assert tuple(t.grad.shape) == tuple(t.shape), f"{case}: grad {k} shape {tuple(t.grad.shape)}"
                res["grad"][f"{k} (call {rep + 1})"] = rel_err(t.grad, rt.grad)
                if e_ins is not None:
                    res["eager_grad"][f"{k} (call {rep + 1})"] = rel_err(e_ins[k].grad, rt.grad)
    return res


def failures(case: Case, res: dict, as_eager: bool = False, grads_as_eager: bool = False) -> list:
    """The checks of ``res`` over their thresholds, as readable strings.

    ``as_eager`` (a case that fell back to PyTorch): each bound is also at least 1.25x eager
    torch's own error on the same inputs (``check(eager=True)``). A fallback computes what eager
    PyTorch computes, rounding the 16-bit product before a residual is added: where z + r
    cancels, that flips ReLU masks against float64 for eager as much as for cf.
    ``grads_as_eager``: the same for the gradients only (torch's float32 weight gradient of a
    5x5 channels_last conv was 5.8e-4 off float64 on the H200, and cf's backward runs it).
    """
    bad = []

    def bound(tol, eager_err, widen=None):
        widen = as_eager if widen is None else widen
        return max(tol, 1.25 * eager_err) if widen and eager_err is not None else tol

    eager_fwd = res.get("eager_fwd") or []
    for i, e in enumerate(res["fwd"]):
        tol = bound(TOL[case.dtype], eager_fwd[i] if i < len(eager_fwd) else None)
        if not e <= tol:
            bad.append(f"forward (call {i + 1}) rel err {e:.3g} > {tol:.3g}")
    for i, e in enumerate(res["amax"]):
        if not e <= 1e-2:
            bad.append(f"amax (call {i + 1}) rel err {e:.3g} > 0.01")
    eager_grad = res.get("eager_grad") or {}
    for k, e in res["grad"].items():
        tol = bound(GRAD_TOL[case.dtype], eager_grad.get(k), as_eager or grads_as_eager)
        if not e <= tol:
            bad.append(f"grad {k} rel err {e:.3g} > {tol:.3g}")
    return bad


def custom_op_call(case: Case, ins: dict):
    """(registered custom op, its arguments) for ``case``'s operands: what the op's autograd and
    torch.compile paths call (``cudnn_fuse::conv2d`` / ``linear`` / ``matmul`` / attention)."""
    from cudnn_fuse import ops, torch_ops

    p = case.params
    if case.op == "conv2d":
        stride = ops._pair("stride", p["stride"], "conv2d", 1)
        dil = ops._pair("dilation", p["dilation"], "conv2d", 1)
        pre, post = ops._conv_padding(p["padding"], (p["R"], p["S"]), dil, stride)
        return torch_ops.conv2d_op, (ins["x"], ins["weight"], ins["bias"], list(stride), list(pre), list(post),
                                     list(dil), p["groups"], p["act"], ins["residual"], case.amax, float(p["slope"]))
    if case.op == "matmul":
        op = torch_ops.linear_op if p["kind"] == "linear" else torch_ops.matmul_op
        return op, (ins["a"], ins["b"], ins["bias"], p["act"], ins["residual"], case.amax, float(p["slope"]))
    return torch_ops.sdpa_op, (ins["q"], ins["k"], ins["v"], ins["attn_mask"], p["causal"], p["scale"],
                               p["Hq"] != p["Hkv"])
