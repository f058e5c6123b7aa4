"""A 1x1, stride-1, unpadded, ungrouped convolution over channels_last tensors is a GEMM.

Its input [N, C, H, W] in channels_last memory is the row-major matrix [N*H*W, C], its weight
[K, C, 1, 1] the matrix [K, C], and its output (and residual) in channels_last memory the
row-major [N*H*W, K]: ``y = x @ w.T + bias``, the same bytes, no copy. cuDNN's GEMM engines ran
about half of ResNet-50's such layers faster than its conv engines did, and torch.compile
max-autotune beat cf's conv on one of them by lowering it to a GEMM (docs/decisions.md). So the
autotuner times the GEMM (the very MatmulSpec ``cf.linear`` makes of those views, tuned and cached
as its own entry) beside the conv's candidates, and a tuned conv entry that found it faster says
so (``use_gemm``); the op then launches the GEMM plan on the conv's own pointers.

Only for 16-bit ConvSpec (fp32 would follow torch's global TF32 flags, not the spec's).
"""

from __future__ import annotations

from typing import Optional

from .spec import ConvSpec, Epilogue, MatmulSpec, TensorSpec, channels_last_strides

_DTYPES = ("float16", "bfloat16")


def gemm_spec(spec) -> Optional[MatmulSpec]:
    """The MatmulSpec that computes ``spec`` on views of its own operands, or None when ``spec``
    is not a 1x1 stride-1 unpadded ungrouped conv over dense channels_last x, y and residual, with
    its weight, output, bias and residual in x's dtype and its bias's K elements dense. The GEMM
    reads the conv's own memory through these declarations (the raw launch gets the conv's
    pointers), so an operand it cannot declare exactly (a hand-written manifest's) declines it:
    the conv keeps its own plan."""
    if type(spec) is not ConvSpec or spec.x.dtype not in _DTYPES or spec.allow_tf32:
        return None
    if spec.w.dtype != spec.x.dtype or spec.y.dtype != spec.x.dtype:
        return None
    N, C, H, W = spec.x.shape
    K, Cw, R, S = spec.w.shape
    if (R, S) != (1, 1) or Cw != C or spec.groups != 1 or tuple(spec.stride) != (1, 1) \
            or tuple(spec.dilation) != (1, 1) or tuple(spec.pre_padding) != (0, 0) or tuple(spec.post_padding) != (0, 0):
        return None
    if tuple(spec.y.shape) != (N, K, H, W) or min(N, C, H, W, K) < 1:
        return None
    if not _channels_last(spec.x) or not _channels_last(spec.y):
        return None
    if (K > 1 and spec.w.stride[0] != C) or (C > 1 and spec.w.stride[1] != 1):  # [K, C] row-major
        return None
    epi = spec.epilogue
    M, dt = N * H * W, spec.x.dtype
    bias = residual = None
    if epi.bias is not None:
        if tuple(epi.bias.shape) != (1, K, 1, 1) or epi.bias.dtype != dt or (K > 1 and epi.bias.stride[1] != 1):
            return None  # the GEMM's bias is K dense elements of x's dtype
        bias = TensorSpec((1, 1, K), (K, K, 1), dt)  # what linear's epilogue names its [K] bias
    if epi.residual is not None:
        r = epi.residual
        if tuple(r.shape) != tuple(spec.y.shape) or not _channels_last(r) or r.dtype != dt:
            return None
        residual = TensorSpec((1, M, K), (M * K, K, 1), dt)
    # exactly the spec cf.linear makes of x.reshape(1, M, C) and weight.t().unsqueeze(0)
    # (tests/test_conv_gemm.py records both), so the two share one cache entry
    return MatmulSpec(
        a=TensorSpec((1, M, C), (M * C, C, 1), dt),
        b=TensorSpec((1, C, K), (C, 1, C), dt),
        y=TensorSpec((1, M, K), (M * K, K, 1), dt),
        epilogue=Epilogue(bias=bias, residual=residual, activation=epi.activation,
                          negative_slope=epi.negative_slope, amax=epi.amax),
        allow_tf32=False,
    )


def _channels_last(t: TensorSpec) -> bool:
    """Dense channels_last memory: the strides of channels_last_strides wherever the dim is longer
    than 1 (a size-1 dim's stride never addresses memory, and torch leaves it ambiguous: a
    [N, C, 1, 1] tensor, the input of a squeeze-excitation 1x1 conv, is NCHW and channels_last at once)."""
    return all(s == w for n, s, w in zip(t.shape, t.stride, channels_last_strides(t.shape)) if n != 1)


def matrix_views(spec: ConvSpec, buffers) -> list:
    """The conv's operands (``roles_of(spec)`` order: x, w, [bias], [residual], y, [amax]) as
    the GEMM's (a, b, [bias], [residual], y, [amax]): views, the same storage and pointers
    (``view``, never ``reshape``: a copy of the output would be written and dropped)."""
    N, C, H, W = spec.x.shape
    K = spec.w.shape[0]
    M = N * H * W
    it = iter(buffers)
    x, w = next(it), next(it)
    out = [x.permute(0, 2, 3, 1).view(1, M, C), w.view(K, C).t().unsqueeze(0)]
    epi = spec.epilogue
    if epi.bias is not None:
        out.append(next(it).view(1, 1, K))
    if epi.residual is not None:
        out.append(next(it).permute(0, 2, 3, 1).view(1, M, K))
    out.append(next(it).permute(0, 2, 3, 1).view(1, M, K))
    if epi.amax:
        out.append(next(it).view(1, 1, 1))
    return out


class GemmConvPlan:
    """A conv's plan that runs the GEMM plan of its matrix views: the ``run(buffers)`` /
    ``launch(ptrs)`` contract of plans.Plan, with the conv's buffers or pointers (which are
    the GEMM's: ``matrix_views`` moves nothing)."""

    __slots__ = ("spec", "gemm", "device", "engine")

    def __init__(self, spec: ConvSpec, gemm):
        self.spec, self.gemm, self.device = spec, gemm, gemm.device
        self.engine = "gemm:" + str(getattr(gemm, "engine", "?"))

    @property
    def raw(self) -> bool:
        return bool(getattr(self.gemm, "raw", False))

    @property
    def workspace_size(self) -> int:
        return int(getattr(self.gemm, "workspace_size", 0))

    @property
    def graph(self):
        return getattr(self.gemm, "graph", None)

    def launch(self, ptrs) -> None:
        self.gemm.launch(ptrs)

    def run(self, buffers) -> None:
        if self.raw:
            self.gemm.launch([b.data_ptr() for b in buffers])
        else:  # torch's cuBLAS stand-in (or the public execute): tensors of the GEMM's shapes
            self.gemm.run(matrix_views(self.spec, buffers))
