"""The audit of the two non-cuDNN engines the autotuner can pick (docs/decisions.md, "An audit of the
conv-as-GEMM and torch engines on the CPU"), on the CPU.

conv_gemm: a raw GEMM launch gets the conv's own pointers and reads them through the GEMM spec's
strides, not through torch's views (``matrix_views`` serves only the non-raw path). So these
tests place each conv operand in memory by the ConvSpec's strides (at an offset into its storage),
read the same memory through ``gemm_spec``'s shapes and strides, compute the GEMM's function with
reference.matmul, write y (and amax) back through the GEMM's strides, and read y through the
conv's strides: it must be reference.conv2d of the conv's operands. Specs are the ones the op
records (its GPU geometry, both NCHW policies, sliced and ambiguous layouts) and ones with every
other dense or padded stride order, which must either not qualify or read right.

torch_engine: its epilogue against reference.matmul for both 16-bit dtypes, every activation,
bias / residual / amax, batch broadcasting either way, into a strided y written in place."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import cudnn_fuse as cf
from cudnn_fuse import autotune, conv_gemm, reference, torch_engine
from cudnn_fuse.builders import roles_of
from cudnn_fuse.spec import Epilogue, MatmulSpec, TensorSpec

from recorded import recorded_spec

_DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
ACTS = [None, "relu", "gelu", "gelu_tanh", "silu", "tanh", "sigmoid", "leaky_relu"]




def _gemm_reads_the_conv(spec, gen) -> bool:
    """Whether the GEMM of ``gemm_spec(spec)``, reading and writing the conv's memory through its own
    strides, computes the conv (the raw launch's view of the operands)."""
    mspec = conv_gemm.gemm_spec(spec)
    croles, mroles = roles_of(spec), roles_of(mspec)
    assert len(croles) == len(mroles)
    gc, gm = autotune._geometry(spec), autotune._geometry(mspec)
    conv, gemm = {}, {}
    for rc, rm in zip(croles, mroles):
        shape, stride, dt = gc[rc]
        span = 1 + sum((n - 1) * s for n, s in zip(shape, stride))
        store = torch.full((span + 16,), float("nan"), dtype=_DT[dt])  # an offset view: ptr != storage start
        conv[rc] = torch.as_strided(store, shape, stride, 8)
        if rc not in ("y", "amax"):
            conv[rc].copy_(torch.randn(shape, generator=gen))
        mshape, mstride, mdt = gm[rm]
        assert _DT[mdt] == store.dtype, (rc, rm)
        gemm[rm] = torch.as_strided(store, mshape, mstride, 8)
    epi = mspec.epilogue
    out = reference.matmul(gemm["a"], gemm["b"], gemm["bias"].reshape(-1) if "bias" in gemm else None,
                           epi.activation, gemm.get("residual"), epi.amax, epi.negative_slope)
    gemm["y"].copy_(out[0] if epi.amax else out)
    if epi.amax:
        gemm["amax"].copy_(out[1].reshape(gemm["amax"].shape))
    ce = spec.epilogue
    want = reference.conv2d(conv["x"], conv["w"], conv["bias"].reshape(-1) if "bias" in conv else None,
                            activation=ce.activation, residual=conv.get("residual"), return_amax=ce.amax,
                            negative_slope=ce.negative_slope)
    wy = want[0] if ce.amax else want
    ok = torch.allclose(conv["y"].double(), wy.double(), rtol=2e-2, atol=3e-2)
    if ce.amax:
        ok = ok and abs(conv["amax"].item() - want[1].item()) <= 2e-2 * abs(want[1].item()) + 1e-6
    return bool(ok)


def _random_conv_call(seed):
    g = torch.Generator().manual_seed(seed)

    def pick(*vals):
        return vals[int(torch.randint(len(vals), (1,), generator=g))]

    N, C, H, W, K = pick(1, 2, 3), pick(1, 3, 8), pick(1, 2, 5), pick(1, 4), pick(1, 2, 7)
    dt, layout = pick(torch.float16, torch.bfloat16), pick("channels_last", "nchw", "sliced_n", "sliced_h")
    x = torch.randn(N + (layout == "sliced_n"), C, H + (layout == "sliced_h"), W, generator=g).to(dt)
    if layout != "nchw":
        x = x.contiguous(memory_format=torch.channels_last)
    x = x[1:] if layout == "sliced_n" else x[:, :, 1:] if layout == "sliced_h" else x
    w = torch.randn(K, C, 1, 1, generator=g).to(dt)
    if pick(False, True):
        w = w.contiguous(memory_format=torch.channels_last)
    b = torch.randn(K, generator=g).to(dt) if pick(False, True) else None
    r = torch.randn(N, K, H, W, generator=g).to(dt) if pick(False, True) else None
    if r is not None and pick(False, True):
        r = r.contiguous(memory_format=torch.channels_last)
    act = pick(*ACTS)
    kw = dict(activation=act, residual=r, return_amax=pick(False, True),
              negative_slope=0.2 if act == "leaky_relu" else 0.01)  # a slope goes with leaky_relu only
    return lambda: cf.conv2d(x, w, b, **kw)


def test_the_gemm_reads_the_convs_own_memory_through_its_strides(monkeypatch):
    """Every 1x1 conv the op records (NCHW inputs converted, offset, sliced and size-1 layouts)
    qualifies, and computes the conv through the GEMM spec's strides."""
    gen = torch.Generator().manual_seed(0)
    for seed in range(60):
        spec = recorded_spec(_random_conv_call(seed))
        assert conv_gemm.gemm_spec(spec) is not None, spec
        assert _gemm_reads_the_conv(spec, gen), spec


def _strides(shape, order, pad):
    """Dense strides of ``shape`` with its dims laid out in ``order`` (outermost first), the innermost
    dim's rows padded by ``pad`` elements."""
    stride, acc = [0] * len(shape), 1
    for i, d in enumerate(reversed(order)):
        stride[d] = acc
        acc *= max(shape[d], 1) + (pad if i == 0 else 0)
    return tuple(stride)


@pytest.mark.parametrize("seed", range(4))
def test_no_layout_the_gemm_would_misread_qualifies(seed):
    """The op's spec with x, w, y and the residual given other dense or padded stride orders: each
    one gemm_spec accepts reads right (the others it must refuse)."""
    gen, orders = torch.Generator().manual_seed(seed), list(itertools.permutations(range(4)))
    accepted = refused = 0
    for i in range(60):
        g = torch.Generator().manual_seed(1000 * seed + i)

        def pick(*vals):
            return vals[int(torch.randint(len(vals), (1,), generator=g))]

        N, C, H, W, K = pick(1, 2), pick(1, 3, 8), pick(1, 2, 3), pick(1, 4), pick(1, 2, 5)
        x = torch.randn(N, C, H, W).half().contiguous(memory_format=torch.channels_last)
        w, b = torch.randn(K, C, 1, 1).half(), torch.randn(K).half() if pick(False, True) else None
        r = torch.randn(N, K, H, W).half().contiguous(memory_format=torch.channels_last) if pick(False, True) else None
        spec = recorded_spec(lambda: cf.conv2d(x, w, b, activation=pick(None, "relu"), residual=r,
                                           return_amax=pick(False, True)))

        def other(t):
            return dataclasses.replace(t, stride=_strides(t.shape, pick(*orders), pick(0, 0, 1)))

        spec = dataclasses.replace(spec, **{f: other(getattr(spec, f)) for f in ("x", "w", "y") if pick(False, True)})
        if spec.epilogue.residual is not None and pick(False, True):
            spec = dataclasses.replace(spec, epilogue=dataclasses.replace(spec.epilogue,
                                                                          residual=other(spec.epilogue.residual)))
        if conv_gemm.gemm_spec(spec) is None:
            refused += 1
            continue
        accepted += 1
        assert _gemm_reads_the_conv(spec, gen), spec
    assert accepted >= 10 and refused >= 10


def _ulps(dtype):
    return 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("act", ACTS)
def test_the_torch_engine_against_the_reference(dtype, act):
    """Bias, residual and amax, batches broadcast either way, into a y with padded rows (written in
    place: the padding keeps its poison). The torch engine rounds z (eager's order) where the
    reference rounds once: within a few units of the 16-bit rounding of the result."""
    g = torch.Generator().manual_seed(ACTS.index(act))
    M, K, N = 9, 16, 12
    dt = str(dtype).replace("torch.", "")
    for bias, residual, amax, (Ba, Bb) in itertools.product((False, True), (False, True), (False, True),
                                                            ((1, 1), (3, 3), (3, 1), (1, 3))):
        B = max(Ba, Bb)
        a = torch.randn(Ba, M, K, generator=g).to(dtype)
        b = torch.randn(Bb, N, K, generator=g).to(dtype).transpose(1, 2)  # a weight's transposed view
        bi = torch.randn(N, generator=g).to(dtype) if bias else None
        r = torch.randn(B, M, N, generator=g).to(dtype) if residual else None
        y_store = torch.full((B, M, N + 3), 7.0, dtype=dtype)
        y = y_store[:, :, :N]
        am = torch.full((1, 1, 1), -1.0)
        epi = Epilogue(bias=TensorSpec((1, 1, N), (N, N, 1), dt) if bias else None,
                       residual=TensorSpec.of(r) if residual else None, activation=act, negative_slope=0.3,
                       amax=amax)
        spec = MatmulSpec(TensorSpec.of(a), TensorSpec.of(b), TensorSpec.of(y), epi)
        assert torch_engine.supports(spec)
        bufs = {"a": a, "b": b, "bias": bi.view(1, 1, N) if bias else None, "residual": r, "y": y, "amax": am}
        torch_engine.TorchPlan(spec, 0).run([bufs[k] for k in roles_of(spec)])
        want = reference.matmul(a, b, bi, act, r, False, 0.3).double()
        case = (bias, residual, amax, Ba, Bb)
        assert ((y.double() - want).abs() <= 8 * _ulps(dtype) * (want.abs() + 1)).all(), case
        assert (y_store[:, :, N:] == 7).all(), case  # written in place, through y's strides
        if amax:
            assert am.item() == y.float().abs().max().item(), case
        else:
            assert am.item() == -1.0, case


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_torch_engines_activations_are_the_references_to_one_unit(dtype):
    """The engine's activation (``_act_out``, into another tensor and in place) on 16-bit z against
    reference.activation in float32, rounded once: the same function to a unit of the 16-bit result, or of fp16's smallest normal
    number in the tails (torch's erf differs there in fp16 GELU). Tight enough to tell GELU from its
    tanh form, and the slope."""
    unit = 2.0 ** -10 if dtype == torch.float16 else 2.0 ** -7
    z = torch.linspace(-8, 8, 4001).to(dtype)

    def near(got, want):
        return bool(((got.float() - want.float()).abs() <= unit * want.float().abs() + 2.0 ** -14).all())

    for act in ACTS:
        want = reference.activation(z.float(), act, 0.3).to(dtype)
        y = torch.empty_like(z)
        torch_engine._act_out(z, y, act, 0.3)
        inplace = z.clone()
        torch_engine._act_out(inplace, inplace, act, 0.3)
        assert near(y, want) and near(inplace, want), act
