"""torch (cuBLAS) as one more candidate engine for matmul-class graphs.

On the H200, cuDNN's GEMM engines run large compute-bound matmuls up to ~15% slower than
cuBLAS (bench/results/peers.json: matmul + bias + GELU at M = 16384, 0.86x of the best peer;
the fused keep-z forward of a training MLP, 0.60 vs 0.51 ms a layer), so fusing the epilogue
does not pay for the slower mainloop there. The autotuner times this implementation beside
cuDNN's candidates; when it is faster, the cache entry says so (``use_torch``) and the op runs
it: cuBLAS's matmul with the bias in its epilogue (``addmm``), then the residual, the activation
in place and the amax as one reduction — what eager PyTorch does, with no extra copy.

It also stands in for MatmulActGradSpec (nn.FusedMLP's backward: dz = act'(z) * (a @ b)) as
cuBLAS's product then torch's own activation-backward kernel (what eager autograd runs), so the
autotuner keeps the one graph only where it beats the two kernels.

Only for 16-bit MatmulSpec, SaveZSpec and MatmulActGradSpec (fp32 would follow torch's global TF32 flags, not the
spec's), and never when deterministic algorithms are required (cuBLAS's determinism depends on
CUBLAS_WORKSPACE_CONFIG, which cudnn_fuse does not control).
"""

from __future__ import annotations

import torch

from .builders import roles_of
from .spec import MatmulActGradSpec, MatmulSpec, SaveZSpec

ENGINE_NAME = "torch"
_DTYPES = ("float16", "bfloat16")


# activations whose backward torch computes from the pre-activation z with one kernel
_ACT_BACKWARD = ("gelu", "gelu_tanh", "silu", "leaky_relu", "relu")


def supports(spec) -> bool:
    """Whether this implementation can stand in for ``spec``'s graph."""
    if type(spec) is MatmulActGradSpec:
        return spec.fwd.a.dtype in _DTYPES and spec.activation in _ACT_BACKWARD
    fwd = spec.fwd if isinstance(spec, SaveZSpec) else spec
    if not isinstance(fwd, MatmulSpec) or type(spec) not in (MatmulSpec, SaveZSpec):
        return False
    if fwd.a.dtype not in _DTYPES or getattr(fwd, "allow_tf32", False):
        return False
    return not (isinstance(spec, SaveZSpec) and fwd.epilogue.amax)


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


def _act_backward_out(g: torch.Tensor, z: torch.Tensor, dz: torch.Tensor, act, slope: float) -> None:
    """dz = act'(z) * g with torch's backward kernels (their ``out=`` forms; dz may be g)."""
    if act == "gelu":
        torch.ops.aten.gelu_backward.grad_input(g, z, grad_input=dz)
    elif act == "gelu_tanh":
        torch.ops.aten.gelu_backward.grad_input(g, z, approximate="tanh", grad_input=dz)
    elif act == "silu":
        torch.ops.aten.silu_backward.grad_input(g, z, grad_input=dz)
    elif act == "leaky_relu":
        torch.ops.aten.leaky_relu_backward.grad_input(g, z, slope, False, grad_input=dz)
    elif act == "relu":
        torch.ops.aten.threshold_backward.grad_input(g, z, 0, grad_input=dz)
    else:
        raise ValueError(f"torch engine: no backward for activation {act!r}")


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


class TorchPlan:
    """A plan whose launch is torch's: same ``run(buffers)`` contract as plans.Plan (buffers in
    ``roles_of(spec)`` order); it takes no raw pointers, so the ops' launch memo passes it by."""

    __slots__ = ("spec", "device", "engine", "roles", "workspace_size", "cudnn_plan")
    raw = False

    def __init__(self, spec, device: int, cudnn_plan=None):
        self.spec, self.device, self.engine = spec, device, ENGINE_NAME
        self.roles = roles_of(spec)
        self.workspace_size = 0
        self.cudnn_plan = cudnn_plan  # the cached cuDNN plan it stands in for (None in tests)

    @property
    def graph(self):
        return self.cudnn_plan.graph if self.cudnn_plan is not None else None

    def run(self, buffers) -> None:
        t = dict(zip(self.roles, buffers))
        if type(self.spec) is MatmulActGradSpec:
            dz = t["dz"]
            _gemm_into(dz, t["a"], t["b"], None)  # the product, then act's backward in place
            _act_backward_out(dz, t["src"], dz, self.spec.activation, self.spec.negative_slope)
            if "dbias" in t:
                dims = [i for i, n in enumerate(self.spec.dbias.shape) if n == 1]
                t["dbias"].copy_(dz.sum(dims, keepdim=True, dtype=torch.float32))
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
