"""cudnn_fuse: cuDNN's fused graphs as ordinary PyTorch ops.

    import cudnn_fuse as cf
    y = cf.conv2d(x, w, b, padding=1, activation="relu")
    y, amax = cf.linear(x, w, b, activation="gelu", return_amax=True)
    o = cf.scaled_dot_product_attention(q, k, v, is_causal=True)
"""

from ._version import __version__
from .autotune import set_autotune
from .errors import ArgumentError, UnsupportedError
from . import nn
from .graphs import capture
from .launch_graphs import set_launch_graphs
from .manifest import record
from .optimize import optimize
from .fp8 import DelayedScaling, Float8CurrentScaling, quantize_fp8
from .functional import (conv2d, linear, matmul, scaled_dot_product_attention, scaled_dot_product_attention_fp8,
                         scaled_mm)
from .loader import plan_stats
from .ops import set_compile_inline


def cache_stats() -> dict:
    """Plan counters of this process (builds, loads, hits, autotune seconds, ...) and,
    under "disk", the persistent cache's (entries, bytes, hit rate, ...) or None."""
    from .cache import open_default_cache

    pc = open_default_cache()
    return {**plan_stats(), "disk": pc.stats() if pc is not None else None}


def __getattr__(name):
    if name == "PlanCache":  # imported lazily: diskcache is not needed until a plan is stored
        from .cache import PlanCache

        return PlanCache
    raise AttributeError(f"module 'cudnn_fuse' has no attribute {name!r}")

__all__ = [
    "__version__",
    "conv2d",
    "linear",
    "matmul",
    "scaled_dot_product_attention",
    "scaled_mm",
    "scaled_dot_product_attention_fp8",
    "quantize_fp8",
    "Float8CurrentScaling",
    "DelayedScaling",
    "plan_stats",
    "cache_stats",
    "capture",
    "record",
    "nn",
    "optimize",
    "set_autotune",
    "set_compile_inline",
    "set_launch_graphs",
    "PlanCache",
    "UnsupportedError",
    "ArgumentError",
]
