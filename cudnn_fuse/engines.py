"""Which cuDNN engines may serve a graph, and how a graph is finalized.

The heuristics' ranked engine configs are the candidates; engines known to compute a graph wrongly
are barred; while torch asks for deterministic kernels only deterministic engines remain, and the
mode is pinned for the whole of one plan lookup. ``finalize`` builds the first candidate that
builds: the heuristic plan.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from .errors import UnsupportedError
from .spec import ConvSpec, MatmulSpec, RecomputeGradSpec

# cuDNN heuristic modes whose ranked engine configs become the candidates (the first that builds
# is the heuristic plan; the autotuner times them all). Mode B offered the same configs.
HEUR_MODES = ("A", "FALLBACK")

_det_algorithms = getattr(torch._C, "_get_deterministic_algorithms", None) or torch.are_deterministic_algorithms_enabled
_det_cudnn = getattr(torch._C, "_get_cudnn_deterministic", None) or (lambda: bool(torch.backends.cudnn.deterministic))


class _Mode(threading.local):
    det = None  # this thread's pinned mode (pinned_mode), or None: torch's flags


_mode = _Mode()


def deterministic() -> bool:
    """Whether torch asks for deterministic kernels: ``torch.use_deterministic_algorithms(True)``
    or ``torch.backends.cudnn.deterministic = True`` (which torch's own cuDNN convs honour), since a
    plan chosen under one setting must not serve the other.

    While this thread looks a plan up (``pinned_mode``), the answer is the mode pinned for that
    lookup: the plan LRU's key, the disk cache's key, the engine filter, the autotuner's and the
    entry's record then all take the one mode read once (or the one the caller's memo key holds),
    whatever another thread switches meanwhile. The memos read torch's C getters themselves
    (``_det_algorithms() or _det_cudnn()``) and pin what they read for the lookup they key."""
    det = _mode.det
    return (_det_algorithms() or _det_cudnn()) if det is None else det


class pinned_mode:
    """Within the block, ``deterministic()`` answers ``det`` in this thread (None: the mode now, read
    once; an outer pin stands). ``as`` gives the mode pinned."""

    __slots__ = ("det", "_old")

    def __init__(self, det=None):
        self.det = det

    def __enter__(self) -> bool:
        self._old = _mode.det
        _mode.det = det = bool(self.det) if self.det is not None else deterministic()
        return det

    def __exit__(self, *exc) -> None:
        _mode.det = self._old


def _is_decline(exc: BaseException) -> bool:
    import cudnn

    return isinstance(exc, (cudnn.cudnnGraphNotSupportedError, NotImplementedError, ValueError, RuntimeError))


def barred_engines(spec) -> frozenset:
    """Engine ids that cuDNN offers for ``spec``'s graph but that compute it wrongly (measured on
    cuDNN 9.19; engine ids are per kind of graph, so a GEMM's eng0 is not a conv's; the
    measurements are in docs/decisions.md, "Engines that compute a graph wrongly are barred").

    - GEMM eng0 (a GEMM with its epilogue, ranked first where there is no bias) runs leaky_relu
      as a plain ReLU, the slope dropped, and GELU as its tanh approximation.
    - conv eng0 (the one float32 engine without tensor cores for a conv with a bias) returns NaN
      for tanh past z ~ 44 ((e^2z - 1) / (e^2z + 1) overflowing); with no other engine the op
      falls back to PyTorch, logged.
    - conv eng8 in the recompute graph of a conv's activation backward (conv fprop + bias +
      act' * dy, backward.recompute_grad: silu, sigmoid, GELU...): ranked first for a grouped fp16
      conv, its gradients came out NaN or far off float64, where the same graphs on other engines
      are right. Barred from every conv recompute graph, grouped or not: nothing measured it right.

    Found by the GPU fuzz tests. A barred engine is deselected before any candidate is built,
    skipped by the autotuner, and a cache entry or engine record naming it is a miss.
    """
    fwd = getattr(spec, "fwd", spec)
    epi = getattr(fwd, "epilogue", None)
    if epi is None:
        return _NONE_BARRED
    acts = {epi.activation, getattr(spec, "activation", None)}
    if isinstance(fwd, MatmulSpec):
        return _ENG0 if acts & {"leaky_relu", "gelu"} else _NONE_BARRED
    if isinstance(fwd, ConvSpec):
        barred = _ENG0 if "tanh" in acts else _NONE_BARRED
        if isinstance(spec, RecomputeGradSpec):
            barred = barred | _ENG8
        return barred
    return _NONE_BARRED


_NONE_BARRED = frozenset()
_ENG0 = frozenset({0})
_ENG8 = frozenset({8})


def prepare(g, spec) -> None:
    """validate -> operation graph -> ranked candidates (heuristics A, then FALLBACK), minus
    the engines barred for this graph (``barred_engines``), and minus cuDNN's NONDETERMINISTIC
    ones while torch asks for deterministic kernels (``deterministic()``: use_deterministic_algorithms
    or cudnn.deterministic), for heuristic plans as for tuned ones.

    Raises UnsupportedError when cuDNN declines the graph (or has no deterministic engine for it).
    """
    import cudnn

    with _declines_as_unsupported(spec):
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([getattr(cudnn.heur_mode, m) for m in HEUR_MODES])
        barred = barred_engines(spec)
        if barred:
            g.deselect_engines([_bar_name(e) for e in sorted(barred)])
        if deterministic():
            g.deselect_numeric_notes([cudnn.numerical_note.NONDETERMINISTIC])
        if spec.dtype == "float32" and not getattr(spec, "allow_tf32", False):
            # true fp32: keep engines that do not round through TF32 tensor cores
            g.deselect_numeric_notes([cudnn.numerical_note.TENSOR_CORE])


def _bar_name(engine_id: int) -> str:
    """The deselect_engines() pattern of one engine. cuDNN-frontend matches it as a substring of
    each plan's name ("eng<id>" or "eng<id>_k<knob>=<v>..."): "eng0" can only be engine 0 (no
    other id starts with a 0), where "eng1" would also bar eng10-eng19, so any other engine is
    barred as "eng<id>_", which matches its plans with knobs and no other engine's. A plan of it
    without knobs escapes that pattern; finalize() and the autotuner refuse it by its id."""
    if engine_id < 0:
        raise ValueError(f"engine ids are >= 0, got {engine_id}")
    return "eng0" if engine_id == 0 else f"eng{engine_id}_"


def finalize(g, spec) -> None:
    """prepare, then build the first candidate that builds (heuristic choice); a knob-less plan
    of a barred engine (which the deselect pattern cannot name, ``_bar_name``) is refused."""
    prepare(g, spec)
    with _declines_as_unsupported(spec):
        g.check_support()
        g.build_plans()
    barred = barred_engines(spec)
    if barred:
        try:
            engine_id = int(g.get_engine_and_knobs_at_index(g._plan_index)[0])
        except Exception:  # noqa: BLE001 - no engine record: the deselect pattern stands
            return
        if engine_id in barred:
            raise UnsupportedError(f"{spec.op}: cuDNN's pick is a plan of engine {engine_id} without knobs, which "
                                   "computes this graph wrongly (engines.barred_engines)")


@contextlib.contextmanager
def _declines_as_unsupported(spec):
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - cuDNN raises several types for "cannot"
        if not _is_decline(exc):
            raise
        raise UnsupportedError(f"cuDNN declined {spec.op}: {type(exc).__name__}: {exc}") from exc


def _engine_name(g) -> str:
    try:
        return str(g.get_plan_name_at_index(g._plan_index))
    except Exception:  # noqa: BLE001 - a name is for logs only
        return "?"
