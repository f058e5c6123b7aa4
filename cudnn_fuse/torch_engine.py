"""torch's own kernels as one more candidate for conv and matmul-class graphs.

cuDNN's graph engines can run a computation slower than the kernel torch picks for it: cuBLAS's
GEMMs beat cuDNN's GEMM engines on large compute-bound matmuls, and torch's depthwise convs run
kernels the graph API does not offer (docs/autotune.md, "torch as one more candidate"). Where
this implementation is faster the cache entry says so (``use_torch``) and the op runs it: the
matmul with the bias in its epilogue (``addmm``) or the conv with its bias, written into the op's
output, then the residual, the activation in place and the amax as one reduction — what eager
PyTorch does, with no extra copy. The autotuner times it beside cuDNN's candidates; a heuristic
plan is checked against it once (loader.py).

It also stands in for a new size of a known shape family while that size's plan waits
(loader.StandIn, ``stands_in``), attention included.

Only for 16-bit specs (fp32 would follow torch's global TF32 flags, not the spec's), convs with
symmetric padding, and never when deterministic algorithms are required (torch's kernel choice
there depends on settings cudnn_fuse does not control).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import reference
from .builders import roles_of
from .spec import ConvSpec, MatmulSpec, SaveZSpec, SdpaSpec

ENGINE_NAME = "torch"
_DTYPES = ("float16", "bfloat16")


def supports(spec) -> bool:
    """Whether this implementation can stand in for ``spec``'s graph."""
    if type(spec) is ConvSpec:
        return spec.x.dtype in _DTYPES and tuple(spec.pre_padding) == tuple(spec.post_padding)
    fwd = spec.fwd if isinstance(spec, SaveZSpec) else spec
    if not isinstance(fwd, MatmulSpec) or type(spec) not in (MatmulSpec, SaveZSpec):
        return False
    if fwd.a.dtype not in _DTYPES or getattr(fwd, "allow_tf32", False):
        return False
    return not (isinstance(spec, SaveZSpec) and fwd.epilogue.amax)


def stands_in(spec) -> bool:
    """Whether torch's kernels can serve ``spec`` while its own plan waits (loader.StandIn): what
    ``supports`` takes, and attention forward (torch's SDPA on its flash, memory-efficient or math
    kernels, which need no build: ``_sdpa_run``) of 16-bit operands without both a bias and a causal mask
    (torch takes one or the other). Not a tuning candidate: the stand-in is replaced by the plan."""
    if type(spec) is SdpaSpec:
        return spec.q.dtype in _DTYPES and not (spec.is_causal and spec.bias is not None)
    return supports(spec)


# torch's attention backends that need no build for a new shape: its cuDNN backend builds a graph per
# shape (tens of ms, as a plan build does), which a stand-in exists to avoid
_NO_BUILD_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa_run(spec: SdpaSpec, t: dict) -> None:
    """torch's attention on the plan's buffers (4-D, k and v with their own heads under GQA: the
    reference's GQA, which keeps torch's fused kernels), written into the op's output; never through
    torch's cuDNN backend."""
    q, k = t["q"], t["k"]
    with sdpa_kernel(_NO_BUILD_SDPA):
        o = reference.scaled_dot_product_attention(q, k, t["v"], t.get("bias"), 0.0, spec.is_causal, spec.scale,
                                                   q.shape[1] != k.shape[1])
    t["o"].copy_(o)


def _act_out(z: torch.Tensor, y: torch.Tensor, act, slope: float) -> None:
    """y = act(z) written into y; y may be z itself (elementwise ``out=`` ops take an aliased output)."""
    if act is None:
        if y is not z:
            y.copy_(z)
    elif act == "relu":
        torch.clamp_min(z, 0, out=y)
    elif act == "gelu":
        torch.ops.aten.gelu.out(z, out=y)
    elif act == "gelu_tanh":
        torch.ops.aten.gelu.out(z, approximate="tanh", out=y)
    elif act == "silu":
        torch.ops.aten.silu.out(z, out=y)
    elif act == "tanh":
        torch.tanh(z, out=y)
    elif act == "sigmoid":
        torch.sigmoid(z, out=y)
    elif act == "leaky_relu":
        torch.ops.aten.leaky_relu.out(z, slope, out=y)
    else:
        raise ValueError(f"torch engine: unknown activation {act!r}")


def _gemm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias) -> None:
    """out = a @ b (+ bias): one cuBLAS call, the bias in its epilogue when there is one batch."""
    if out.shape[0] == 1 and a.shape[0] == 1 and b.shape[0] == 1:
        if bias is not None:
            torch.addmm(bias.reshape(-1), a[0], b[0], out=out[0])
        else:
            torch.mm(a[0], b[0], out=out[0])
        return
    torch.matmul(a, b, out=out)
    if bias is not None:
        out.add_(bias)


# each activation applied in place: (tensor, negative_slope) -> None
_IN_PLACE = {
    "relu": lambda z, s: torch.relu_(z),
    "gelu": lambda z, s: torch._C._nn.gelu_(z),
    "gelu_tanh": lambda z, s: torch._C._nn.gelu_(z, approximate="tanh"),
    "silu": lambda z, s: torch._C._nn.silu_(z),
    "tanh": lambda z, s: torch.tanh_(z),
    "sigmoid": lambda z, s: torch.sigmoid_(z),
    "leaky_relu": lambda z, s: torch._C._nn.leaky_relu_(z, s),
}


def eager_call(spec, op: str):
    """What eager PyTorch runs for a call of ``op`` ("conv2d", "linear" or "matmul") that ``spec``
    describes, on the caller's own operands (x or a, weight or b, bias, residual; None where absent),
    the residual added and the activation applied in place: a remembered torch-kernel call at
    eager's host cost, where the plan's own run (``TorchPlan.run``) takes views of the operands and
    out= variants. None where it does not apply (an amax, another op): the plan's run serves."""
    if getattr(spec, "epilogue", None) is None or spec.epilogue.amax or not supports(spec):
        return None
    if type(spec) is ConvSpec and op == "conv2d":
        geo = tuple(spec.stride), tuple(spec.pre_padding), tuple(spec.dilation), spec.groups

        def base(x, w, bias):
            return F.conv2d(x, w, bias, *geo)
    elif type(spec) is MatmulSpec and op == "linear":
        base = F.linear
    elif type(spec) is MatmulSpec and op == "matmul":
        def base(a, b, bias):
            y = torch.matmul(a, b)
            return y if bias is None else y.add_(bias)
    else:
        return None
    act, slope = _IN_PLACE.get(spec.epilogue.activation), spec.epilogue.negative_slope

    def call(a, b, c, d):
        y = base(a, b, c)
        if d is not None:
            y.add_(d)
        if act is not None:
            act(y, slope)
        return y
    return call


class TorchPlan:
    """A plan whose launch is torch's: same ``run(buffers)`` contract as plans.Plan (buffers in
    ``roles_of(spec)`` order); it takes no raw pointers, so the ops' launch memo passes it by."""

    __slots__ = ("spec", "device", "engine", "roles", "workspace_size", "cudnn_plan", "reason")
    raw = False
    standin = False  # a stand-in (loader.StandIn) is replaced later: the ops' memo holds it only while its plan builds

    def __init__(self, spec, device: int, cudnn_plan=None, reason: str = ""):
        self.spec, self.device, self.engine = spec, device, ENGINE_NAME
        self.roles = roles_of(spec)
        self.workspace_size = 0
        self.cudnn_plan = cudnn_plan  # the cached cuDNN plan it stands in for (None in tests)
        self.reason = reason  # why torch's kernels run, with the timings that decided (optimize's summary)

    @property
    def graph(self):
        return self.cudnn_plan.graph if self.cudnn_plan is not None else None

    def run(self, buffers) -> None:
        t = dict(zip(self.roles, buffers))
        if type(self.spec) is ConvSpec:
            _conv_run(self.spec, t)
            return
        if type(self.spec) is SdpaSpec:
            _sdpa_run(self.spec, t)
            return
        save_z = isinstance(self.spec, SaveZSpec)
        fwd = self.spec.fwd if save_z else self.spec
        epi = fwd.epilogue
        z = t["z"] if save_z else t["y"]
        _gemm_into(z, t["a"], t["b"], t.get("bias"))
        if "residual" in t:
            z.add_(t["residual"])
        if save_z:
            _act_out(z, t["y"], epi.activation, epi.negative_slope)
        else:
            _act_out(z, z, epi.activation, epi.negative_slope)
        if epi.amax:
            y = t["y"]
            t["amax"].copy_(torch.linalg.vector_norm(y, float("inf")).reshape(t["amax"].shape))


def _conv_run(spec: ConvSpec, t: dict) -> None:
    """torch's own conv kernel for these operands, then the bias, the residual and the activation,
    each pass writing the op's output (aten's ``convolution.out`` would copy into it: one pass more
    than eager), then the amax."""
    y, epi = t["y"], spec.epilogue
    src = torch.ops.aten.convolution(t["x"], t["w"], None, list(spec.stride), list(spec.pre_padding),
                                     list(spec.dilation), False, [0, 0], spec.groups)
    for name in ("bias", "residual"):
        if name in t:
            torch.add(src, t[name], out=y)
            src = y
    if epi.activation is not None:
        _act_out(src, y, epi.activation, epi.negative_slope)
    elif src is not y:
        y.copy_(src)
    if epi.amax:
        t["amax"].copy_(torch.linalg.vector_norm(y, float("inf")).reshape(t["amax"].shape))
