"""cudnn_fuse: cuDNN's fused graphs as ordinary PyTorch ops.

    import cudnn_fuse as cf
    y = cf.conv2d(x, w, b, padding=1, activation="relu")
    y, amax = cf.linear(x, w, b, activation="gelu", return_amax=True)
    o = cf.scaled_dot_product_attention(q, k, v, is_causal=True)
"""

from ._version import __version__
from .errors import UnsupportedError
from .ops import conv2d, linear, matmul, scaled_dot_product_attention
from .plans import plan_stats

__all__ = [
    "__version__",
    "conv2d",
    "linear",
    "matmul",
    "scaled_dot_product_attention",
    "plan_stats",
    "UnsupportedError",
]
