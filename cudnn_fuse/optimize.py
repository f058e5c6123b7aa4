"""``optimize(model)``: rewrite a model's fusable patterns onto cudnn_fuse ops.

Patterns (found on a torch.fx trace of the model, or of each child module
when the whole model does not trace):

- Conv2d [+ BatchNorm2d, folded, eval mode only] [+ residual add] [+ activation]
  -> cudnn_fuse.nn.Conv2d (the residual rides in the epilogue);
- Linear [+ residual add] [+ activation] -> cudnn_fuse.nn.Linear;
- Linear + GELU-like activation + Linear [+ residual add] (a transformer MLP) ->
  cudnn_fuse.nn.FusedMLP (its backward fuses the activation's backward into the second
  layer's data-gradient GEMM; not with ``recompute``);
- unless ``chain_convs=False``: a run of 2+ of those convs with no
  activation or ReLU and no residual, each the next one's only input -> one
  cudnn_fuse.nn.ConvChain, whose training step is one autograd node (the layers stay
  where they were: state_dict keys unchanged);
- F.scaled_dot_product_attention call sites -> cudnn_fuse.scaled_dot_product_attention (``attention``);
- a module that computes an RMSNorm in torch ops of its own (transformers' LlamaRMSNorm) ->
  cudnn_fuse.nn.RMSNorm, torch's one F.rms_norm kernel (``_rms_norm_eps`` tells it by its computation);
- a large Linear (>= 1M weights) with nothing to fuse whose output width is not a multiple of
  16 bytes (GPT-2's lm_head, 50257 wide) -> cudnn_fuse.nn.AlignedLinear (aligned GEMM on a padded weight; torch's
  is 7x slower there).

The Linear patterns and attention run cuDNN's fused graphs where autograd records nothing (inference); a
training step through them runs torch's own expression (``fuse_training=False``): on the models measured,
the fused training graphs ran torch's kernels at more host time a call, and a host-bound step ran slower
than eager's (docs/training.md). ``recompute=True`` asks for the recomputing training graphs, which keep
no pre-activation (less memory, a slower step): those layers train fused. FP8 layers train on their FP8
GEMMs.

Calls that return their input in every mode (nn.Identity, dropouts of p=0) are taken out of the
graph first, so that they do not stand between a layer and its epilogue; a Linear's (or Conv1D's, or a
MLP's, or conv's) residual add is also fused across dropouts and drop-paths in eval mode, which the fused
layer runs again in training mode. fx fixes the training mode a forward reads at trace time and takes every argument
for a given tensor, so a module is traced in both modes and with its optional arguments None, and one whose
graphs differ, that checkpoints, that reads torch's global state (grad mode, autocast, determinism), that
draws random numbers with no tensor argument (a LayerDrop's ``torch.rand([]) < p``), that sets its modules'
attributes or changes a list, dict or set of theirs in place (collected features, a cache), or that has hooks or
a class saving its state_dict its own way (``get_extra_state``) on itself or on a submodule fx traces through, has
its children rewritten instead (each submodule keeps its own mode; a trace leaves every attribute, the contents of
those containers and the random streams as they were); a rewrite that fails leaves its module as it was;
a drop-path (a module with no state whose forward reads its mode) stays a call. Nothing is
fused across an in-place change of a tensor the fused call would read later. A node is fused into its
producer only when the producer's output has no other user. A fused module takes the replaced module's path (a FusedMLP and a ConvChain are added
beside the layers they hold, which stay where they were), so parameter names (state_dict keys)
stay the original's (a BatchNorm2d folded in eval mode stays too, folded into its conv at each call);
a module called from several places (shared weights) is left alone. Everything replaced and
everything left alone (with the reason) is logged once at INFO and kept on the model as
``cudnn_fuse_summary``. Hooks registered after ``optimize()`` on a replaced layer see its fused output, and
a layer or container fused into its neighbours runs no hooks of its own. A model traced whole keeps the
original's plain attributes, which its graph read as constants; one set to another value after ``optimize()``
(a temperature, a dropout rate) makes the model run its class's own forward over its fused layers from then on,
so it computes with the new value, without the fusions across layers (one warning).
"""

from __future__ import annotations

import ast
import builtins
import collections
import contextlib
import copy
import functools
import inspect
import keyword
import logging
import operator
import random
import sys
import threading
import types
import weakref
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.utils import checkpoint as _checkpoint

from . import fp8 as fp8_
from . import nn as cfnn
from .functional import scaled_dot_product_attention
from .spec import torch_activation

log = logging.getLogger(__name__)

_ADDS = {operator.add, operator.iadd, torch.add}


@dataclass
class Summary:
    replaced: list = field(default_factory=list)  # (where, pattern)
    left_alone: list = field(default_factory=list)  # (where, reason)
    runs: list = field(default_factory=list)  # (where, what its plans run): filled by a run on example inputs

    def __str__(self) -> str:
        lines = [f"cudnn_fuse.optimize: {len(self.replaced)} replaced, {len(self.left_alone)} left alone"]
        lines += [f"  replaced {where}: {what}" for where, what in self.replaced]
        lines += [f"  left {where}: {why}" for where, why in self.left_alone]
        lines += [f"  runs {where}: {what}" for where, what in self.runs]
        return "\n".join(lines)

    @property
    def torch_kernels(self) -> list:
        """(where, why) of the replaced layers that run torch's own kernels: cuDNN's best plan for
        their shapes timed slower, so they run as they did before (known after a run on example inputs)."""
        return [(where, what) for where, what in self.runs if what.startswith("torch's kernels")]


# transformers' activation modules, by class name (no import of transformers needed);
# NewGELU / FastGELU / GELUTanh are the tanh approximation, GELUActivation the erf GELU
_HF_ACTIVATIONS = {"NewGELUActivation": "gelu_tanh", "FastGELUActivation": "gelu_tanh", "GELUTanh": "gelu_tanh",
                   "PytorchGELUTanh": "gelu_tanh", "GELUActivation": "gelu", "SiLUActivation": "silu"}


def _is_hf_conv1d(m) -> bool:
    """transformers' Conv1D (GPT-2): a linear layer with a [in, out] weight."""
    if type(m).__name__ != "Conv1D" or not hasattr(m, "nf"):
        return False
    w = m._parameters.get("weight")  # not m.weight: under fx tracing that is a Proxy
    return w is not None and w.dim() == 2


# Augmented assignments (h += y) as in-place calls. fx's Proxy has no __iadd__, so Python falls back to
# __add__ and the traced graph makes a new tensor where the model changed one in place: any alias of it
# (skip = h before h += conv(x)), and a caller's input, then kept the old values (a wrong answer
# optimize() gave). These stand in for operator's in-place functions in the graph, marked side-effectful
# so that dead-code elimination keeps one whose result is unused; module-level, so a traced model pickles.
_INPLACE_OPS = ("iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul", "iand", "ior", "ixor",
                "ilshift", "irshift")


def _make_inplace(name: str):
    op = getattr(operator, name)

    def inplace(a, b):
        return op(a, b)

    inplace.__name__ = inplace.__qualname__ = f"_inplace_{name}"
    inplace.__module__ = __name__
    if hasattr(fx.node, "has_side_effect"):
        fx.node.has_side_effect(inplace)
    return inplace


_INPLACE = {name: _make_inplace(name) for name in _INPLACE_OPS}
_INPLACE_FNS = frozenset(_INPLACE.values())
globals().update({f.__name__: f for f in _INPLACE.values()})
_ADDS.add(_INPLACE["iadd"])  # y = conv(x); y += h: a residual (y is the conv's own output)


class _Proxy(fx.Proxy):
    """fx's Proxy whose augmented assignments trace as in-place calls (_INPLACE)."""


for _name, _fn in _INPLACE.items():
    setattr(_Proxy, f"__{_name}__", lambda self, other, _fn=_fn: self.tracer.create_proxy("call_function", _fn,
                                                                                          (self, other), {}))


_CHECKPOINTED = "its forward checkpoints (torch.utils.checkpoint, which a trace would drop)"


def _global_state(what: str) -> str:
    return f"its forward reads {what}, which one traced graph would fix at its value at optimize() time"


_TYPE_ASKED = ("its forward asks the type of a traced value (isinstance, type, torch.is_tensor), which one traced "
               "graph would fix")


# Functions a forward must not call while it is traced, with why, by the module where forwards find them.
# A trace runs the forward once: a checkpoint would be traced through (and gone, every activation kept for
# the backward), and a branch on torch's global state (grad mode, autocast, determinism) would keep the
# side taken at optimize() time, under torch.no_grad() or autocast as well. ``no_grad``/``autocast``
# blocks in a forward call these too on entering: a trace would drop the block.
_REFUSED_IN = {
    _checkpoint: {"checkpoint": _CHECKPOINTED, "checkpoint_sequential": _CHECKPOINTED},
    torch: {
        "is_grad_enabled": _global_state("the grad mode (torch.is_grad_enabled, a no_grad block)"),
        "is_inference_mode_enabled": _global_state("the inference mode (torch.is_inference_mode_enabled)"),
        **{name: _global_state(f"the autocast state (torch.{name}, an autocast block)") for name in (
            "is_autocast_enabled", "is_autocast_cpu_enabled", "get_autocast_dtype", "get_autocast_gpu_dtype",
            "get_autocast_cpu_dtype")},
        "are_deterministic_algorithms_enabled": _global_state("torch.are_deterministic_algorithms_enabled()"),
        "is_tensor": _TYPE_ASKED,
    },
}
# {id(function): why}, of the functions as torch defines them (names this torch lacks are left out); by id:
# found by identity in the modules' globals, whatever else those hold
_REFUSED = {id(vars(space)[name]): why for space, whys in _REFUSED_IN.items() for name, why in whys.items()
            if name in vars(space)}
# Type tests refused only when the model's code (_asked_by_the_model) asks them of a traced value
# (_holds_proxy): a trace sees fx's Proxy there, no tensor (nor a list or a number), and would keep the branch
# a Proxy takes for every input. ``isinstance`` is found in the builtins, where a trace puts its refuser.
_ISINSTANCE = builtins.isinstance
_REFUSED_ON_PROXY = {id(_ISINSTANCE), id(torch.is_tensor)}
# code that asks about Proxies by design: fx's and torch's, this library's, Python's own
_TRACING_CODE = ("torch", "cudnn_fuse", *sys.stdlib_module_names)


def _asked_by_the_model() -> bool:
    """Whether the code calling the refused function (two frames up: past its refuser) is the model's: a
    module outside _TRACING_CODE (a helper module of the model's package, transformers', timm's)."""
    name = sys._getframe(2).f_globals.get("__name__") or ""
    return name.partition(".")[0] not in _TRACING_CODE


# Methods a forward must not call while it is traced, put on their classes as the trace runs (_method_refuser):
# a custom autograd Function's apply (traced through, only its forward's ops are recorded and its own backward
# is gone: a gradient reversal would not reverse), and entering inference mode, which a trace would drop
# (torch.inference_mode calls no function a namespace holds, and as a decorator runs from torch's code).
_REFUSED_METHODS = ((torch.autograd.Function, "apply"), (torch.autograd.grad_mode.inference_mode, "__enter__"))
_CUSTOM_FUNCTION = ("its forward calls a custom autograd Function, whose own backward one traced graph would drop "
                    "(only its forward's operations are traced)")
_INFERENCE_MODE = _global_state("the inference mode (a torch.inference_mode block)")


def _method_refuser(me: int, cls, name: str, fn):
    """What stands on ``cls`` for its method ``name`` (``fn`` as its class holds it) while thread ``me`` traces."""
    if name == "apply":
        apply = fn.__func__

        def refuse_apply(klass, *args, **kwargs):
            if threading.get_ident() == me and _holds_proxy(list(args) + list(kwargs.values())) \
                    and _asked_by_the_model():
                raise _NotOneGraph(_CUSTOM_FUNCTION)
            return apply(klass, *args, **kwargs)
        return classmethod(refuse_apply)

    def refuse_enter(self, *args, **kwargs):
        if threading.get_ident() == me:
            raise _NotOneGraph(_INFERENCE_MODE)
        return fn(self, *args, **kwargs)
    return refuse_enter


class _NotOneGraph(Exception):
    """A forward that no one traced graph runs as it is (``str()`` says why): its children are rewritten."""


_TRACING = threading.RLock()  # one trace at a time swaps the _REFUSED functions


def _holds_proxy(value) -> bool:
    """Whether ``value`` is a traced value, or a list, tuple or dict holding one (asked of the builtins'
    own isinstance: a trace puts a refuser that calls this one in its place)."""
    if _ISINSTANCE(value, fx.Proxy):
        return True
    if _ISINSTANCE(value, (list, tuple)):
        return any(_holds_proxy(v) for v in value)
    return _ISINSTANCE(value, dict) and any(_holds_proxy(v) for v in value.values())


def _refused(value):
    """Why a forward calling ``value`` is not traced (``_REFUSED``), or None."""
    return _REFUSED.get(id(value))


# cf's own modules (a model already optimized, or built with them) are leaves: traced into, their forwards'
# Python branches on tensors made the whole model untraceable, and it lost its other fusions
_CF_MODULES = (cfnn.Conv2d, cfnn.Linear, cfnn.FusedMLP, cfnn.ConvChain, cfnn.TransposedLinear, cfnn.AlignedLinear)


class _Tracer(fx.Tracer):
    """torch.fx's tracer, with transformers' Conv1D and activation modules and RMSNorms written out in torch
    ops kept as leaves (fx would trace into them and the patterns would not see the modules), and augmented
    assignments traced as the in-place calls they are (_Proxy)."""

    def __init__(self, norms=frozenset()):
        # ``attention`` and ``_training`` (put in the graph after its trace) stay calls where fx traces the graph's
        # code again (unpickling a model): traced into, attention's check of the grad mode would be refused, and
        # either would fix one mode
        super().__init__(autowrap_functions=(attention, _training))
        self.norms = norms  # ids of the modules _rms_norm_eps recognized: told before tracing, as it traces

    def proxy(self, node) -> fx.Proxy:
        return _Proxy(node, self)

    def trace(self, root, concrete_args=None):
        """fx's trace, refusing (_NotOneGraph) a forward that calls one of ``_REFUSED`` (it checkpoints, or
        reads torch's global state, or asks the type of a traced value). Where the forwards find them (the
        modules torch and torch.utils.checkpoint, any name their modules' globals bound one to, and the
        builtins' ``isinstance``), each raises while tracing, and is put back however the trace ends. Only this
        thread's calls raise: another thread's (a model served meanwhile entering ``torch.no_grad()``) reach the
        function itself; traces take turns (_TRACING), so that none puts back another's stand-ins."""
        me = threading.get_ident()

        def refuser(why, fn):
            on_proxy = id(fn) in _REFUSED_ON_PROXY

            def refuse(*args, **kwargs):
                if threading.get_ident() == me and (not on_proxy or (args and _holds_proxy(args[0])
                                                                     and _asked_by_the_model())):
                    raise _NotOneGraph(why)
                if fn is _ISINSTANCE and len(args) == 2 and not kwargs:  # ``isinstance(c, type)`` in a model's module
                    return fn(args[0], _unrefused(args[1]))
                return fn(*args, **kwargs)
            return refuse

        def type_refuser(*args, **kwargs):
            """``type`` in the globals of a forward's own module: ``type(x)`` of a traced value is fx's Proxy."""
            if len(args) == 1 and not kwargs and threading.get_ident() == me and _holds_proxy(args[0]):
                raise _NotOneGraph(_TYPE_ASKED)
            return builtins.type(*args, **kwargs)

        def _unrefused(classes):
            if classes is type_refuser:
                return builtins.type
            if _ISINSTANCE(classes, tuple):
                return tuple(_unrefused(c) for c in classes)
            return classes

        with _TRACING:
            forwards = [getattr(type(m).forward, "__globals__", {}) for m in root.modules()]
            spaces = {id(d): d for d in [vars(space) for space in _REFUSED_IN] + forwards}
            saved = [(space, name, value) for space in spaces.values() for name, value in list(space.items())
                     if _refused(value) is not None]
            typed = []
            methods = [(cls, name, cls.__dict__[name]) for cls, name in _REFUSED_METHODS]
            try:
                for space, name, fn in saved:
                    space[name] = refuser(_refused(fn), fn)
                for cls, name, fn in methods:
                    setattr(cls, name, _method_refuser(me, cls, name, fn))
                builtins.isinstance = refuser(_TYPE_ASKED, _ISINSTANCE)  # found there by every module's code
                # ``type`` cannot be swapped in the builtins (every class test in the process would see a function):
                # a global of that name shadows it for the model's own modules' code only
                typed += [space for space in spaces.values() if "type" not in space
                          and (space.get("__name__") or "").partition(".")[0] not in _TRACING_CODE]
                for space in typed:
                    space["type"] = type_refuser
                return super().trace(root, concrete_args)
            finally:
                for cls, name, fn in methods:
                    setattr(cls, name, fn)
                builtins.isinstance = _ISINSTANCE
                for space in typed:
                    if space.get("type") is type_refuser:
                        del space["type"]
                for space, name, fn in saved:
                    space[name] = fn

    def is_leaf_module(self, m, qualname) -> bool:
        name = type(m).__name__
        if name in _HF_ACTIVATIONS or _is_hf_conv1d(m) or isinstance(m, _CF_MODULES + (cfnn.RMSNorm,)):
            return True
        if id(m) in self.norms:  # replaced whole (_Rewriter.run)
            return True
        if not m._modules and _own_state_dict_methods(type(m)):  # a call: it keeps its state_dict as itself
            return True
        return _mode_switch(m) or super().is_leaf_module(m, qualname)


def _mode_switch(m: nn.Module) -> bool:
    """A module with no parameters, buffers or children whose forward reads ``self.training`` (a stochastic
    depth or drop-path, torchvision's StochasticDepth): kept a call, so that it follows the model's mode
    at run time, where traced into it would leave one mode's graph for both."""
    if m._parameters or m._buffers or m._modules:
        return False
    code = getattr(getattr(type(m), "forward", None), "__code__", None)
    return code is not None and "training" in code.co_names


def _identity_in_eval(m: nn.Module) -> bool:
    """Whether ``m`` (a _mode_switch module, in eval mode) returns its input itself: asked of a probe."""
    probe = torch.zeros(2, 3, 4, 5)
    try:
        with torch.no_grad():
            return m(probe) is probe
    except Exception:  # noqa: BLE001 - it does not take such input: not one to fuse across
        return False


# the steps an RMSNorm written out in torch ops takes (transformers' LlamaRMSNorm and its copies)
_RMS_STEPS = {"to", "float", "type", "type_as", "pow", "square", "mean", "add", "rsqrt", "sqrt", "mul", "truediv",
              "div", "reciprocal", "getattr", "__add__", "__mul__", "__truediv__", "__radd__", "__rmul__"}


def _step_name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")


def _rms_norm_eps(m: nn.Module):
    """The epsilon of a module that computes ``F.rms_norm(x, weight.shape, weight, eps)`` in torch ops of its
    own, else None. Told by its computation, not its name: one 1-D ``weight``, no children or buffers, a
    forward of one input traced to those steps only, with one float constant (the epsilon), and equal to
    ``F.rms_norm`` on a random input and weight (the CPU) to 1e-5 in float32 and to their rounding in bfloat16
    and float16, in the input's dtype (a module that answers 16-bit input in float32 is another computation).
    torch's own RMSNorm already runs ``F.rms_norm``. Told once per module in an ``optimize()`` call
    (``_NORMS``): each trace of a parent asks again for every module under it."""
    if m not in _NORMS:
        _NORMS[m] = _told_rms_norm_eps(m)
    return _NORMS[m]


_NORMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> eps or None; optimize() clears it


def _told_rms_norm_eps(m: nn.Module):
    if type(m).__module__.startswith("torch.") or isinstance(m, _CF_MODULES + (cfnn.RMSNorm,)):
        return None
    w = m._parameters.get("weight")
    if w is None or w.dim() != 1 or len(m._parameters) != 1 or m._buffers or m._modules or _hooked(m):
        return None
    try:
        graph = fx.Tracer().trace(m)
    except Exception:  # noqa: BLE001 - an untraceable forward is not the pattern
        return None
    consts = []
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if node.op not in ("call_function", "call_method") or _step_name(node) not in _RMS_STEPS:
            return None
        consts += [a for a in node.args if isinstance(a, float)]
    if sum(n.op == "placeholder" for n in graph.nodes) != 1 or len(consts) != 1:
        return None
    eps = consts[0]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, w.shape[0], generator=gen) * 2 + 1
    probe_w = torch.rand(w.shape[0], generator=gen) + 0.5
    # in float32 also rows whose mean square is near eps, where eps's place shows (under the root or
    # beside it, x / (sqrt(mean(x^2)) + eps), differ there by up to 1.4x and by 1e-6 at unit scale)
    small = torch.randn(4, w.shape[0], generator=gen) * torch.tensor([1e-1, 1.0, 1e1, 1e3]).unsqueeze(1) * \
        max(eps, 1e-12) ** 0.5
    # F.rms_norm answers in its input's dtype, computing in float32 and rounding once
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-2)):
        xd, wd = (torch.cat([x, small.expand(2, 4, -1)], 1) if dtype is torch.float32 else x).to(dtype), \
            probe_w.to(dtype)
        try:
            with torch.no_grad():
                got = torch.func.functional_call(m, {"weight": wd}, (xd,))
        except Exception:  # noqa: BLE001 - it does not run on such input: not the pattern
            return None
        want = F.rms_norm(xd.float(), w.shape, wd.float(), eps).to(dtype)
        if not (isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == dtype and
                torch.allclose(got.float(), want.float(), rtol=tol, atol=tol / 10)):
            return None
    return eps


def _calls_without_identities(module, graph: fx.Graph) -> list:
    """What ``graph`` calls and reads, in order, less its calls that return their input (``_is_identity``: a
    dropout of p=0 runs the same in both modes, whatever ``training`` it is given) and fx's own checks of
    concrete arguments. Erases the identities from ``graph``."""
    for node in list(graph.nodes):
        if _is_identity(module, node) and isinstance(node.args[0], fx.Node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    calls = []
    for node in graph.nodes:
        if node.op in ("call_function", "call_method", "call_module", "get_attr"):
            name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", repr(node.target))
            if "assert" not in name:
                calls.append((node.op, name, tuple(str(a) for a in node.args), tuple(sorted(
                    (k, str(v)) for k, v in node.kwargs.items()))))
    return calls


def _training(module: nn.Module, _anchor=None) -> bool:
    """``module``'s mode as the graph runs (_mode_read_at_run_time)."""
    return module.training


def _graph_constants(graph: fx.Graph) -> set:
    """The dtypes and devices ``graph``'s nodes take as constant arguments."""
    found = set()

    def visit(a):
        if isinstance(a, (torch.dtype, torch.device)):
            found.add(a)
        return a

    for node in graph.nodes:
        fx.node.map_aggregate((node.args, node.kwargs), visit)
    return found


def _mode_read_at_run_time(module: nn.Module, graph: fx.Graph, other: fx.Graph) -> bool:
    """Where the graphs of the two modes (``graph`` in the modules' own, ``other`` in the flipped ones) differ
    only in arguments that are the mode itself (``training=True`` against ``training=False``: a leaf function
    given ``self.training``, torchvision's shifted-window attention), make ``graph`` read the flag of the module
    whose forward passed it (its path in the node's module stack) as it runs, and say so; else leave it and say
    not."""
    nodes = [n for n in graph.nodes if n.op != "output"]
    others = [n for n in other.nodes if n.op != "output"]
    if len(nodes) != len(others):
        return False
    at, other_at = {n: i for i, n in enumerate(nodes)}, {n: i for i, n in enumerate(others)}
    flags = []  # (node, key: argument index or keyword)
    for a, b in zip(nodes, others):
        if (a.op, a.target, len(a.args), sorted(a.kwargs)) != (b.op, b.target, len(b.args), sorted(b.kwargs)):
            return False
        for key, x, y in [*zip(range(len(a.args)), a.args, b.args), *((k, a.kwargs[k], b.kwargs[k]) for k in a.kwargs)]:
            if isinstance(x, fx.Node) and isinstance(y, fx.Node):
                if at.get(x) != other_at.get(y):
                    return False
            elif type(x) is bool and type(y) is bool and x is not y:
                flags.append((a, key))
            elif type(x) is not type(y) or str(x) != str(y):
                return False
    paths = [list(stack.values())[-1][0] if (stack := node.meta.get("nn_module_stack")) else "" for node, _ in flags]
    # each read is given a value of the graph too (the call's first), so that fx records it again where it
    # traces the graph's code (unpickling): given the module alone, its wrapper would call it and keep the bool
    anchors = [next((a for a in n.args if isinstance(a, fx.Node)), None) for n, _ in flags]
    if not flags or not all(paths) or None in anchors:  # the root's own flag: no node of the graph stands for it
        return False
    for (node, key), path in zip(flags, paths):  # the flag of that module itself, not a value made of it
        value = node.args[key] if isinstance(key, int) else node.kwargs[key]
        try:
            if value is not module.get_submodule(path).training:
                return False
        except AttributeError:  # a path fx named that is not a submodule's
            return False
    for (node, key), path, anchor in zip(flags, paths, anchors):
        with graph.inserting_before(node):
            flag = graph.call_function(_training, (graph.get_attr(path), anchor))
        if isinstance(key, int):
            node.args = (*node.args[:key], flag, *node.args[key + 1:])
        else:
            node.kwargs = {**node.kwargs, key: flag}
    return True


def _optional_params(module) -> list:
    """The names of ``module.forward``'s parameters that default to None."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _trace(module) -> fx.GraphModule:
    """``module``'s traced GraphModule, refused (_NotOneGraph) where one graph would not run the forward in
    every case. fx fixes at trace time what a forward reads of its mode (``F.dropout(x, p, self.training)``,
    a branch on it), and takes every argument for a given tensor (``if mask is None`` never holds for its
    Proxy): so it is traced again with every module in the other mode, and with its optional arguments
    None, and refused where those graphs differ from the first. Each trace leaves the modules' own
    attributes as they were (_Snapshot): a forward that caches what it computes (``self.scales = ...`` on its
    first call, a dict filled in place) stored a Proxy there, which the model's first real call then read; and
    the random streams, where a draw made as it traces is refused (_random_streams_kept). A module with hooks,
    or a class of its own that saves or loads its state_dict, on itself or on a submodule the trace runs through
    is refused before tracing (_kept_whole): its object stays and its children are rewritten."""
    norms = frozenset(id(m) for m in module.modules() if m is not module and _rms_norm_eps(m) is not None)
    why = _kept_whole(module, _Tracer(norms))
    if why is not None:
        raise _NotOneGraph(why)
    snapshot = _Snapshot(module)

    def trace_aside(concrete_args=None):
        try:
            with _random_streams_kept():
                return _Tracer(norms).trace(module, concrete_args)
        finally:
            changed = snapshot.restore()
            if changed is not None:
                raise _NotOneGraph(changed)

    for m in snapshot.modules:  # each its own flag flipped (a child may be set apart); not train(): an override
        m.training = not m.training  # may do more than set them
    other = trace_aside()
    optional = _optional_params(module)
    try:
        bare = trace_aside({name: None for name in optional}) if optional else None
    except _NotOneGraph:
        raise
    except Exception as exc:  # noqa: BLE001 - it traces only with every argument given
        raise _NotOneGraph(f"its forward branches on whether an optional argument is given ({type(exc).__name__} "
                           "without it)") from exc
    try:
        with _random_streams_kept():
            graph = _Tracer(norms).trace(module)
        calls = _calls_without_identities(module, graph)
        if calls != _calls_without_identities(module, other):
            if not _mode_read_at_run_time(module, graph, other):
                raise _NotOneGraph("its forward depends on the training mode")
            calls = _calls_without_identities(module, graph)
        if bare is not None and calls != _calls_without_identities(module, bare):
            raise _NotOneGraph("its forward branches on whether an optional argument is given")
        gm = fx.GraphModule(module, graph)  # takes the tensor constants fx set on the module
    finally:
        changed = snapshot.restore()
    if changed is not None:
        raise _NotOneGraph(changed)
    gm.training = module.training  # its own flag only: each submodule keeps its mode (a frozen BatchNorm)
    _restore_unused(module, gm)
    _reorder(gm, _key_order(module))
    _buffers_out_of_state(module, gm)
    return gm


class _Snapshot:
    """What a trace may change of ``module``'s modules, taken before it: their attributes, their registries
    (parameters, buffers, submodules) and the contents of the lists, dicts, sets and deques they hold (features
    a forward collects, a cache it fills: compared by identity, as an fx Proxy answers ``==`` with a Proxy)."""

    def __init__(self, module: nn.Module):
        named = list(module.named_modules())
        self.root, self.modules = module, [m for _, m in named]
        self.attrs = [(m, dict(vars(m)), {k: dict(vars(m)[k]) for k in _REGISTRIES}) for m in self.modules]
        self.contents = [(f"{path}.{name}" if path else name, value, _items(value)) for path, m in named
                         for name, value in vars(m).items()
                         if name not in _MODULE_INTERNALS and isinstance(value, _FILLED_IN_PLACE)]
        # a plain object's fields (``self.stats.calls += 1``, a schedule's step): set as it traces, never again
        self.objects = [(f"{path}.{name}" if path else name, value, dict(vars(value))) for path, m in named
                        for name, value in vars(m).items() if name not in _MODULE_INTERNALS and _plain_object(value)]
        # a traced-through forward runs the ops of its real tensors as it is traced: ``self.count.add_(1)`` on a
        # buffer changes it then and never again (not in the graph); told by the tensors' version counters
        budget = [_RESTORED_BYTES]
        self.tensors = [[name, t, t._version, _copy_to_restore(t, budget)] for name, t in
                        [*module.named_parameters(), *module.named_buffers()]
                        if not t.is_inference()]  # inference tensors keep no version (nor take in-place changes)

    def restore(self):
        """Put every module's attributes and the contents of its containers back; why the forward had changed
        any (fx's tensor constants on the root and the mode flags aside), else None."""
        changed = False
        for m, attrs, registries in self.attrs:
            now = vars(m)
            for name in [n for n in now if n not in attrs]:  # fx's tensor constants, a forward's caches
                changed |= not (m is self.root and name.startswith("_tensor_constant"))
                del now[name]
            for name, value in attrs.items():
                if now.get(name, _MISSING) is not value:
                    changed |= name != "training"
                    now[name] = value
            for name, saved in registries.items():  # a parameter, buffer or module set by the forward
                if now[name] != saved or any(now[name][k] is not v for k, v in saved.items()):
                    changed = True
                    now[name].clear()
                    now[name].update(saved)
        filled = [(where, value) for where, value, items in self.contents if _put_back(value, items)]
        filled += [(where, value) for where, value, fields in self.objects if _put_back_fields(value, fields)]
        written = [entry[0] for entry in self.tensors if _put_back_tensor(entry)]
        if written:
            return _WRITTEN.format(written[0])
        if changed:
            return _STATEFUL
        if filled:
            where, value = filled[0]
            return _FILLED.format(f"{type(value).__name__} {where}")
        return None


_WRITTEN = ("its forward changes {} in place (a count, a running statistic), which its traced graph would not do "
            "when it runs")
_RESTORED_BYTES = 64 << 20  # buffers copied before a trace, at most this much in all, to be put back if it changed them


def _copy_to_restore(t: torch.Tensor, budget: list):
    """A copy of buffer ``t``'s values made before a trace, where they fit in what is left of ``budget[0]`` bytes
    (parameters, and buffers past it: None, a change is then only told)."""
    if isinstance(t, nn.Parameter) or t.is_meta:
        return None
    try:
        size = t.numel() * t.element_size()
    except (RuntimeError, ValueError):  # an uninitialized (lazy) buffer
        return None
    if size > budget[0]:
        return None
    budget[0] -= size
    return t.detach().clone()


def _put_back_tensor(entry: list) -> bool:
    """Whether the tensor of a _Snapshot entry [name, tensor, version, copy] was changed in place since; its
    values put back from the copy where there is one, else a warning that optimize() changed it."""
    name, t, version, saved = entry
    if t._version == version:
        return False
    if saved is not None:
        with torch.no_grad():
            t.copy_(saved)
    else:
        log.warning("cudnn_fuse.optimize: %s was changed in place while its model's forward was traced, and is "
                    "too large (or a parameter) to have been copied before: its values are not those it had before "
                    "optimize()", name)
    entry[2] = t._version  # put back: a later trace compares with now
    return True


# plain attributes a forward may change in place: ``self.feats.append(h)``, ``self.cache[key] = t``
_FILLED_IN_PLACE = (list, dict, set, collections.deque)
_FILLED = ("its forward changes the {} in place (collected features, a cache), which its traced graph would not do "
           "when it runs")


def _plain_object(value) -> bool:
    """An object of a plain class of its own (a SimpleNamespace, a dataclass, a small stats class) whose fields
    a forward may set: not a module, tensor, class, function or Python module."""
    return not isinstance(value, _NOT_PLAIN) and isinstance(getattr(value, "__dict__", None), dict)


_NOT_PLAIN = (nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
              types.MethodType, functools.partial)


def _put_back_fields(value, fields: dict) -> bool:
    """Give plain object ``value`` back the fields ``fields`` (its ``vars`` before) where it holds others;
    whether it did."""
    now = vars(value)
    if now.keys() == fields.keys() and all(now[k] is v for k, v in fields.items()):
        return False
    now.clear()
    now.update(fields)
    return True


def _items(value) -> list:
    """The objects a list, dict (keys and values), set or deque holds, in its order."""
    return [x for item in value.items() for x in item] if isinstance(value, dict) else list(value)


def _put_back(value, items: list) -> bool:
    """Give ``value`` (a _FILLED_IN_PLACE container) back the objects ``items`` (``_items`` of it before) where
    it holds others; whether it did."""
    now = _items(value)
    if isinstance(value, set):
        same = len(now) == len(items) and {id(x) for x in now} == {id(x) for x in items}
    else:
        same = len(now) == len(items) and all(a is b for a, b in zip(now, items))
    if same:
        return False
    value.clear()
    if isinstance(value, dict):
        value.update(zip(items[::2], items[1::2]))
    elif isinstance(value, set):
        value.update(items)
    else:  # a list, a deque
        value.extend(items)
    return True


def _buffers_out_of_state(module, gm) -> None:
    """Make non-persistent each buffer fx gave ``gm`` or a module it rebuilt that is no persistent buffer of
    the original at that path: fx registers what its graph reads as a persistent buffer, so its tensor constants
    and a plain tensor attribute (``self.scale = torch.tensor([2.0])``) became state_dict keys the original
    lacks. The set is carried to ``gm``'s copies, whose buffers fx registers anew."""
    for path, target in gm.named_modules(remove_duplicate=False):
        try:
            orig = module.get_submodule(path)
        except AttributeError:
            orig = None
        if target is orig:
            continue
        for name in target._buffers:
            if orig is None or name not in orig._buffers or name in orig._non_persistent_buffers_set:
                target._non_persistent_buffers_set.add(name)
    _carried(gm, {"_non_persistent_buffers_set": gm._non_persistent_buffers_set})


# Methods a class may override that a traced model would lose: ``train``/``eval`` (a detector's frozen
# BatchNorms, mmdet's ``norm_eval``) of the model or of a container the trace runs through, which become
# the GraphModule's and bare modules' own; ``__call__`` of the model, which fx bypasses to call its forward.
_KEPT_METHODS = ("train", "eval")


def _kept_whole(module, tracer):
    """Why ``module`` must not be traced whole, else None: it, or a submodule the tracer runs through (no
    leaf), has hooks, or a class that saves its state_dict its own way (``get_extra_state``, an override of
    ``_save_to_state_dict``). Traced, the root's hooks are not run (fx calls its forward), and fx rebuilds the
    root and the submodules it runs through as bare modules, without their backward and state_dict hooks and
    their class's state_dict methods: the state_dict lost their keys (``block._extra_state``), and a checkpoint
    of the original no longer loaded strictly. Such a submodule without children is no reason: the tracer keeps
    it a call, itself. A class's own ``_load_from_state_dict`` is none either: the rebuilt module runs it
    (``_load_as_class``). Nor may a class override one of _KEPT_METHODS, or the model ``__call__``."""
    overrides = None  # said where nothing else is: hooks and state_dict methods name more
    if type(module).__call__ is not nn.Module.__call__:
        overrides = f"its class {type(module).__name__} overrides __call__, which its traced graph would not run"
    for path, m in _traced_through(module, tracer):
        overridden = [n for n in _KEPT_METHODS if getattr(type(m), n) is not getattr(nn.Module, n)]
        if overridden and overrides is None:
            where = f"its submodule {path} ({type(m).__name__})" if path else f"its class {type(m).__name__}"
            overrides = f"{where} overrides {overridden[0]}(), which the traced model would not call"
        if _has_hooks(m):
            names = _hook_names(m)
            return (f"it has hooks ({names}), which its traced graph would not keep" if not path else
                    f"its submodule {path}, which a trace runs through, has hooks ({names}), which the traced graph "
                    "would not keep")
        own = ", ".join(n for n in _own_state_dict_methods(type(m)) if n != "_load_from_state_dict")
        if own:
            return (f"its class {type(m).__name__} defines {own}, which its traced graph would not keep (its "
                    "state_dict would change)" if not path else f"its submodule {path} ({type(m).__name__}), which a "
                    f"trace runs through, defines {own}, which the traced graph would not keep (the state_dict "
                    "would change)")
    return overrides


def _traced_through(module, tracer):
    """(path, module) of ``module`` ("") and of each submodule the tracer runs through (no leaf). A container
    that is never called (a ModuleList) is looked through: its children are called directly."""
    stack = [("", module)]
    while stack:
        path, m = stack.pop()
        yield path, m
        for name, child in m.named_children():
            q = f"{path}.{name}" if path else name
            if type(child).forward is nn.Module.forward or not tracer.is_leaf_module(child, q):
                stack.append((q, child))


# nn.Module's methods that make and load a module's state_dict entries; a class's own overrides of them are not
# kept by a module fx rebuilds
_STATE_DICT_METHODS = ("get_extra_state", "set_extra_state", "_save_to_state_dict", "_load_from_state_dict")


def _own_state_dict_methods(cls) -> list:
    """The ``_STATE_DICT_METHODS`` that ``cls`` overrides outside torch. torch's own (a BatchNorm's
    ``_load_from_state_dict``, inherited by timm's BatchNormAct2d) save the keys nn.Module's would."""
    own = []
    for name in _STATE_DICT_METHODS:
        fn = getattr(cls, name, None)
        if fn is not getattr(nn.Module, name) and not str(getattr(fn, "__module__", "")).startswith("torch."):
            own.append(name)
    return own


def _load_as_class(module: nn.Module, cls, args: tuple) -> None:
    """Load ``module``'s own state_dict entries (``args``: nn.Module._load_from_state_dict's) as ``cls``, the
    class of the module it was traced from, does where it overrides that: such an override reads checkpoints of
    its older versions (torchvision's MLPBlock renames their keys) by the version they were saved with. Run on a
    stand-in of ``cls`` sharing ``module``'s attributes, so that its zero-argument ``super()`` finds an instance
    of its class."""
    load = getattr(cls, "_load_from_state_dict", None) if isinstance(cls, type) else None
    if load is None or load is nn.Module._load_from_state_dict:
        nn.Module._load_from_state_dict(module, *args)
        return
    stand_in = object.__new__(cls)
    object.__setattr__(stand_in, "__dict__", module.__dict__)
    load(stand_in, *args)


def _random_state():
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, random.getstate()


def _set_random_state(state) -> None:
    cpu, cuda, py = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(py)


def _random_state_changed(before, after) -> bool:
    if not torch.equal(before[0], after[0]) or before[2] != after[2]:
        return True
    return before[1] is not None and after[1] is not None and any(
        not torch.equal(a, b) for a, b in zip(before[1], after[1]))


@contextlib.contextmanager
def _random_streams_kept():
    """Runs its block (a trace) and puts torch's random streams (the CPU's, CUDA's where initialized) and
    Python's ``random`` back as they were; raises _NotOneGraph where the block drew from them. fx runs a call
    with no Proxy argument (``torch.randn(8)``, a LayerDrop's ``torch.rand([]) < p``) as it traces: the
    graph would keep that one draw as a constant. A draw on a Proxy (dropout, ``randn_like(x)``) is
    recorded, not run, so the streams stay as they were exactly where the graph draws at run time."""
    before = _random_state()
    try:
        yield
    finally:
        after = _random_state()
        _set_random_state(before)
    if _random_state_changed(before, after):
        raise _NotOneGraph(_RANDOM)


_RANDOM = "its forward draws random numbers at trace time (with no tensor argument), which one graph would fix"
_MISSING = object()
_REGISTRIES = ("_parameters", "_buffers", "_modules")
_STATEFUL = "its forward sets attributes of its modules (a cache, a counter), which one graph would fix"


def _restore_unused(module, gm) -> None:
    """Put back what fx.GraphModule left out because the traced forward does not use it: submodules,
    parameters and buffers (a head used only in another mode, a buffer read elsewhere, the layers of
    a ConvChain already in the model, which the graph does not call). Left out, they left the
    state_dict, so that the original's no longer loaded key for key, and parameters(). Every path of a
    module shared by two parents is put back (the graph reaches it by one), and a buffer the graph reads
    stays non-persistent where it was (fx.GraphModule registers what it copies as persistent)."""
    for name, m in module.named_modules(remove_duplicate=False):  # parents before their children
        if not name:
            target = gm
        else:
            try:
                target = gm.get_submodule(name)
            except AttributeError:
                gm.add_submodule(name, m)  # with its own subtree
                continue
        if target is m:
            continue
        for pname, p in m._parameters.items():  # a container GraphModule rebuilt with what the graph reads
            if p is not None and pname not in target._parameters:
                target.register_parameter(pname, p)
        for bname, b in m._buffers.items():
            if b is not None and bname not in target._buffers:
                target.register_buffer(bname, b, persistent=bname not in m._non_persistent_buffers_set)
            elif bname in m._non_persistent_buffers_set:
                target._non_persistent_buffers_set.add(bname)


def _key_order(root: nn.Module) -> dict:
    """{path: (submodule names, parameter names, buffer names)} of every module under ``root``, in the order
    they were registered: what ``parameters()``, ``state_dict()`` and an optimizer's state follow."""
    return {name: (list(m._modules), list(m._parameters), list(m._buffers))
            for name, m in root.named_modules(remove_duplicate=False)}


def _reorder(root: nn.Module, order: dict) -> None:
    """Register the submodules, parameters and buffers of each module under ``root`` in ``order``
    (``_key_order`` of the original), those the original lacks (fused modules) last. fx registers a traced
    model's in the order its forward first uses them, and ``parameters()`` followed: an optimizer's state
    saved on the original, positional, went to other parameters of the optimized model."""
    for name, (mods, params, bufs) in order.items():
        try:
            target = root.get_submodule(name) if name else root
        except AttributeError:
            continue
        for attr, keys in (("_modules", mods), ("_parameters", params), ("_buffers", bufs)):
            held = getattr(target, attr)
            if list(held) == keys[:len(held)]:
                continue
            first = [k for k in keys if k in held]
            known = set(first)
            items = [(k, held[k]) for k in first] + [(k, v) for k, v in held.items() if k not in known]
            held.clear()
            held.update(items)


def _module_activation(m):
    """(activation name, negative_slope) of an activation module (transformers' by class name, torch's
    by spec.torch_activation, nn.Identity excepted: nothing to fuse), or None."""
    hf = _HF_ACTIVATIONS.get(type(m).__name__)
    if hf is not None:
        return hf, 0.01
    found = torch_activation(m) if isinstance(m, nn.Module) else None
    if found is None or found[0] is None:
        return None
    name, slope = found
    return name, 0.01 if slope is None else float(slope)


def _function_activation(node: fx.Node):
    t = node.target
    if node.op == "call_method":
        return {"relu": ("relu", 0.01), "sigmoid": ("sigmoid", 0.01), "tanh": ("tanh", 0.01)}.get(t)
    if node.op != "call_function" or isinstance(t, nn.Module):
        return None
    found = torch_activation(t)  # the function's name; F.gelu's approximate and F.leaky_relu's slope are arguments
    if found is None:
        return None
    name = found[0]
    if name == "gelu" and node.kwargs.get("approximate") == "tanh":
        return "gelu_tanh", 0.01
    if name == "leaky_relu":
        slope = node.args[1] if len(node.args) > 1 else node.kwargs.get("negative_slope", 0.01)
        return "leaky_relu", float(slope)
    return name, 0.01


# nn.Module's hook dicts: a module replaced, or rebuilt by fx, comes without them (state_dict hooks add or
# rename keys, load hooks take them back); the names this torch lacks are skipped
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
               "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def _has_hooks(m: nn.Module) -> bool:
    return any(vars(m).get(name) for name in _HOOK_DICTS)


def _hook_names(m: nn.Module) -> str:
    """``m``'s hooks by kind and name (``forward_pre: _PlainCallStart``), for a reason given: cudnn_fuse's
    own (transformers' models get forward hooks from use_cudnn_fuse_attention) told from the user's."""
    found = []
    for kind in _HOOK_DICTS:
        for hook in (vars(m).get(kind) or {}).values():
            hook = getattr(hook, "__func__", hook)
            name = getattr(hook, "__qualname__", None) or type(hook).__qualname__
            if (getattr(hook, "__module__", None) or type(hook).__module__) == f"{__package__}.hf":
                name += " (cudnn_fuse's transformers attention switch)"
            found.append(f"{kind.strip('_').removesuffix('_hooks')}: {name}")
    return ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")


def _hooked(m: nn.Module):
    """Why ``m`` must keep running as itself, or None: a hook on it (a fused module would not run
    it or keep its state_dict hooks; the user's, or old-style spectral_norm / weight_norm / pruning, whose
    pre-hook computes the weight), or a weight or bias that is no Parameter (what such a pre-hook leaves
    there)."""
    if _has_hooks(m):
        return "it has hooks (a fused module would not run them)"
    for name in ("weight", "bias"):
        t = m.__dict__.get(name)
        if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
            return f"its {name} is no Parameter (a hook computes it: spectral_norm, weight_norm or pruning)"
    return None


def _parametrized(m: nn.Module) -> bool:
    return isinstance(m, (nn.Conv2d, nn.Linear)) and parametrize.is_parametrized(m)


def _activation_of(gm, node: fx.Node):
    if node.op == "call_module":
        m = gm.get_submodule(node.target)
        return None if _hooked(m) else _module_activation(m)
    extra_ok = 2 if node.target is F.leaky_relu else 1  # leaky_relu's slope may be positional
    if len(node.args) > extra_ok or not set(node.kwargs) <= _ACTIVATION_KWARGS:
        return None  # another argument (``out=``, whose write a fused call would not make) changes the call
    return _function_activation(node)


# the keyword arguments of an activation call that a fused epilogue takes as it is (or reads: _function_activation)
_ACTIVATION_KWARGS = frozenset({"approximate", "negative_slope", "inplace"})


def _inplace_arg(fn, args, kwargs) -> bool:
    """Whether a call of ``fn`` passes ``inplace=True``, by name or by position (``F.relu(x, True)``)."""
    if kwargs.get("inplace") is True:
        return True
    if not any(a is True for a in args):
        return False
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):  # a builtin without a signature, or arguments it does not take
        return False
    return bound.arguments.get("inplace") is True


def _mutates(gm, node: fx.Node) -> bool:
    """Whether ``node`` changes a tensor in place: an augmented assignment (_INPLACE), item assignment
    (``x[i] = v``), an in-place method or torch function (``x.mul_(2)``, ``torch.relu_(x)``), a call
    given ``inplace=True`` or ``out=`` or a module built with ``inplace=True`` (``nn.ReLU(inplace=True)``)."""
    t = node.target
    if node.kwargs.get("out") is not None:  # torch.clamp(x, min=0, out=x)
        return True
    if node.op == "call_function":
        if t in _INPLACE_FNS or t is operator.setitem:
            return True
        name = getattr(t, "__name__", "")
        return (name.endswith("_") and not name.startswith("_")) or _inplace_arg(t, node.args, node.kwargs)
    if node.op == "call_method":
        return isinstance(t, str) and t.endswith("_") and not t.startswith("_")
    if node.op == "call_module":
        return getattr(gm.get_submodule(t), "inplace", False) is True
    return False


def _inplace_between(gm, first: fx.Node, last: fx.Node, fused=()) -> bool:
    """Whether an in-place change (``_mutates``) other than the ``fused`` calls lies between ``first``
    and ``last`` in the graph's order. A fused call takes ``last``'s place and reads its operands there:
    one changed in place between the two (y = conv(x); x += 1; relu(y), or nn.ReLU(inplace=True) on
    x) would be read changed."""
    node = first.next
    while node is not last and node.op != "root":
        if node not in fused and _mutates(gm, node):
            return True
        node = node.next
    return False


def _eliminate_dead_code(gm) -> None:
    """fx's dead-code elimination that keeps in-place changes (``_mutates``): fx keeps the calls it knows
    to be impure only, and dropped ``x.mul_(2)`` where its result went unused (the model read ``x``)."""
    for node in reversed(list(gm.graph.nodes)):
        if node.op not in ("placeholder", "output") and not node.users and not node.is_impure() and \
                not _mutates(gm, node):
            gm.graph.erase_node(node)


def _only_user(node: fx.Node):
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _residual_of(node: fx.Node, prev: fx.Node):
    """The other operand when ``node`` is ``prev + other`` (a tensor), else None. ``other += prev``
    is not one: it changes ``other`` in place, which any alias of it (and a caller's input) sees, and
    a fused residual would not."""
    if node.op != "call_function" or node.target not in _ADDS or node.kwargs or len(node.args) != 2:
        return None
    a, b = node.args
    if node.target is _INPLACE["iadd"] and a is not prev:
        return None
    other = b if a is prev else a if b is prev else None
    return other if isinstance(other, fx.Node) and other is not prev else None


_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _is_identity(gm, node: fx.Node) -> bool:
    """Whether ``node`` returns its input itself in every mode: nn.Identity, a dropout of p=0 (torch
    returns the input tensor, not a copy) or torchvision's StochasticDepth of p=0, without hooks; or an
    F.dropout call whose traced arguments say p=0 or training=False. Taken out of the graph, they no
    longer stand between a layer and its epilogue (ViT's Linear -> Dropout(0.0) -> residual add), and
    cost no module call."""
    if node.op == "call_module":
        m = gm.get_submodule(node.target)
        if _hooked(m) or len(node.args) != 1 or node.kwargs:
            return False
        if type(m) is nn.Identity:
            return True
        p = getattr(m, "p", None)
        stochastic = type(m).__name__ == "StochasticDepth" and type(m).__module__.startswith("torchvision")
        return (isinstance(m, _DROPOUTS) or stochastic) and isinstance(p, (int, float)) and p == 0
    if node.op == "call_function" and node.target is F.dropout and node.args:
        params = dict(zip(("input", "p", "training", "inplace"), node.args), **node.kwargs)
        p, training = params.get("p", 0.5), params.get("training", True)
        return isinstance(p, (int, float)) and isinstance(training, bool) and (p == 0 or not training)
    return False


def _new_conv(conv: nn.Conv2d, act, slope, bn=None, bn_path=None) -> cfnn.Conv2d:
    """A cudnn_fuse.nn.Conv2d on ``conv``'s own parameters (training keeps working on them), with the eval-mode
    BatchNorm2d ``bn`` folded in at each call where one is given (it then refuses training mode: the
    BatchNorm2d's batch statistics are not the folded ones)."""
    m = cfnn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, conv.dilation,
                    conv.groups, bias=conv.bias is not None, padding_mode=conv.padding_mode, device="meta",
                    dtype=conv.weight.dtype, activation=act, negative_slope=slope)
    m.weight, m.bias = conv.weight, conv.bias
    if bn is not None:
        m.fold(bn, bn_path)
    m.train(conv.training)
    return m


def attention(*args, **kwargs):
    """The attention optimize() puts at F.scaled_dot_product_attention's call sites: cudnn_fuse's where
    autograd records nothing, torch's own in a training step (the same cuDNN kernel on Hopper, with less
    host time a call: docs/training.md)."""
    if cfnn.records_grad(*args, *kwargs.values()):
        return F.scaled_dot_product_attention(*args, **kwargs)
    return scaled_dot_product_attention(*args, **kwargs)


def _fp8_takes(lin: nn.Linear) -> bool:
    """Whether a Linear can run FP8 (its GEMMs need features that are multiples of 16)."""
    return lin.in_features % 16 == 0 and lin.out_features % 16 == 0


def _new_linear(lin: nn.Linear, act, slope, recompute, fp8=None) -> cfnn.Linear:
    m = cfnn.Linear(lin.in_features, lin.out_features, lin.bias is not None, lin.weight.device, lin.weight.dtype,
                    activation=act, recompute=recompute, negative_slope=slope, fp8=fp8, fuse_training=recompute)
    m.weight, m.bias = lin.weight, lin.bias  # share the parameters (training keeps working on them)
    m.train(lin.training)
    return m


# the fused modules optimize() puts at a replaced layer's own path
_AT_LAYER_PATHS = (cfnn.Conv2d, cfnn.Linear, cfnn.TransposedLinear)


class _Rewriter:
    def __init__(self, gm: fx.GraphModule, summary: Summary, prefix: str, recompute: bool, chain_convs: bool = False,
                 fp8=None):
        self.gm, self.summary, self.prefix, self.recompute = gm, summary, prefix, recompute
        self.chain_convs, self.fp8 = chain_convs, fp8
        self.count = 0
        self.calls_of: collections.Counter = collections.Counter()  # call sites per module path (run)

    def new_name(self, prefix: str) -> str:
        """A submodule name not taken (a model optimized before has its own cudnn_fuse_chain_0)."""
        while True:
            name = f"{prefix}{self.count}"
            self.count += 1
            if not hasattr(self.gm, name):
                return name

    def where(self, node) -> str:
        return f"{self.prefix}{node.target if node.op == 'call_module' else node.name}"

    def epilogue(self, last: fx.Node, dropouts: list | None = None):
        """Follow [residual add] [activation] after ``last``: (nodes, residual, (act, slope)). Given a
        ``dropouts`` list, the residual add may come after dropouts in eval mode (``_eval_dropout``):
        their modules' paths are appended to it."""
        fused, residual, act = [], None, None
        start, held = last, len(dropouts) if dropouts is not None else 0
        nxt = _only_user(last)
        between = []
        while dropouts is not None and nxt is not None and self._eval_dropout(nxt):
            between.append(nxt)
            nxt = _only_user(nxt)
        other = _residual_of(nxt, between[-1] if between else last) if nxt is not None else None
        if between and other is None:
            nxt = _only_user(last)  # no residual after them: the dropouts stay calls
        elif other is not None:
            fused += between + [nxt]
            if between:
                dropouts.extend(n.target for n in between)
            residual, last = other, nxt
            nxt = _only_user(last)
        if nxt is not None:
            act = _activation_of(self.gm, nxt)
            if act is not None:
                fused.append(nxt)
        if fused and _inplace_between(self.gm, start, fused[-1], fused):
            # the fused call would read the layer's input where the epilogue ends, after the change
            self.summary.left_alone.append((self.where(start), "epilogue not fused: a tensor is changed in place "
                                            "between the layer and it"))
            if dropouts is not None:
                del dropouts[held:]
            return [], None, None
        return fused, residual, act

    def _eval_dropout(self, node: fx.Node) -> bool:
        """A dropout module in eval mode (it returns its input until the model is put in training mode)
        called on one tensor, without hooks."""
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
            return False
        m = self.gm.get_submodule(node.target)
        return (isinstance(m, _DROPOUTS) or _mode_switch(m) and _identity_in_eval(m)) and not m.training and \
            not _hooked(m) and self.calls_of[node.target] == 1

    def through(self, module: nn.Module, dropouts: list) -> nn.Module:
        """``module`` told the dropouts it was fused across (kept registered where they were)."""
        if dropouts:
            cfnn.dropouts_before_residual(module, [self.gm.get_submodule(d) for d in dropouts])
        return module

    def replace(self, first: fx.Node, fused: list, module: nn.Module, args: tuple, pattern: str,
                name: str | None = None) -> bool:
        """False (left alone, with the reason) when a tensor changes in place between the nodes."""
        # The fused module takes the replaced one's place, so parameter names (state_dict keys,
        # optimizer groups by name) stay the original's (run() leaves shared modules alone).
        if fused and _inplace_between(self.gm, first, fused[-1], fused):
            self.summary.left_alone.append((self.where(first), "a tensor is changed in place between the layer "
                                            "and its epilogue"))
            return False
        if name is None:
            name = first.target if first.op == "call_module" else self.new_name("cudnn_fuse_")
        module.train((self.gm.get_submodule(first.target) if first.op == "call_module" else self.gm).training)
        self.gm.add_submodule(name, module)
        kwargs = {}
        if name == first.target and isinstance(module, _AT_LAYER_PATHS):
            # the layer's epilogue only where this graph calls it: other code calling model.<path> (a method
            # of the model's) gets the layer it called before
            module.graph_epilogue, kwargs = True, {"epilogue": True}
        last = fused[-1] if fused else first
        with self.gm.graph.inserting_after(last):
            new = self.gm.graph.call_module(name, args, kwargs)
        last.replace_all_uses_with(new)
        for n in reversed([first] + fused):
            self.gm.graph.erase_node(n)
        self.summary.replaced.append((self.where(first), pattern))
        return True

    def conv(self, node: fx.Node) -> None:
        conv = self.gm.get_submodule(node.target)
        if conv.padding_mode != "zeros":
            self.summary.left_alone.append((self.where(node), f"padding_mode={conv.padding_mode!r} (cuDNN pads zeros)"))
            return
        fused, pattern, bn, folded = [], ["Conv2d"], None, None
        last = node
        bn_node = _only_user(node)
        if bn_node is not None and bn_node.op == "call_module" and isinstance(self.gm.get_submodule(bn_node.target),
                                                                              nn.BatchNorm2d):
            bn = self.gm.get_submodule(bn_node.target)
            why = _hooked(bn)
            if why is not None:
                self.summary.left_alone.append((self.where(bn_node), f"BatchNorm2d not folded: {why}"))
                return
            if bn.training or not bn.track_running_stats:
                self.summary.left_alone.append((self.where(bn_node), "BatchNorm2d in training mode (folded only in eval)"))
                return
            if conv.training:  # a frozen BatchNorm2d in a model that trains: the conv's weight still learns
                self.summary.left_alone.append((self.where(bn_node), "BatchNorm2d in eval mode under a Conv2d in "
                                                "training mode (its weight trains: folded only in eval)"))
                return
            folded = self.where(bn_node)
            fused.append(bn_node)
            pattern.append("BatchNorm2d(folded)")
            last = bn_node
        dropouts = []
        more, residual, act = self.epilogue(last, dropouts)
        fused += more
        if residual is not None:
            pattern.append("residual add")
        if act is not None:
            pattern.append(act[0])
        if len(pattern) == 1:
            # nothing to fuse, but the plain conv still runs as one cuDNN graph
            pattern.append("(alone)")
        m = self.through(_new_conv(conv, act[0] if act else None, act[1] if act else 0.01, bn, folded), dropouts)
        args = (node.args[0],) + ((residual,) if residual is not None else ())
        self.replace(node, fused, m, args, " + ".join(pattern))

    def linear(self, node: fx.Node) -> None:
        lin = self.gm.get_submodule(node.target)
        dropouts = None if self.fp8 is not None and _fp8_takes(lin) else []
        fused, residual, act = self.epilogue(node, dropouts)
        if not fused and self.fp8 is not None and _fp8_takes(lin):
            self.replace(node, [], _new_linear(lin, None, 0.01, self.recompute, self.fp8), (node.args[0],),
                         "Linear (FP8)")
            return
        if not fused:
            if cfnn.AlignedLinear.wanted(lin):
                m = cfnn.AlignedLinear(lin)
                self.replace(node, [], m, (node.args[0],), _aligned_pattern(m))
                return
            self.summary.left_alone.append((self.where(node), "no epilogue to fuse (torch's linear is as fast)"))
            return
        fp8 = self.fp8 if self.fp8 is not None and _fp8_takes(lin) else None
        if residual is None and act is not None and act[0] in cfnn.NEEDS_INPUT and not self.recompute and fp8 is None:
            if self.mlp(node, fused[-1], lin, act):
                return
        m = self.through(_new_linear(lin, act[0] if act else None, act[1] if act else 0.01, self.recompute, fp8),
                         dropouts)
        pattern = ["Linear"] + (["dropout (eval)"] if dropouts else []) + \
            (["residual add"] if residual is not None else []) + ([act[0]] if act else []) + \
            (["(FP8)"] if fp8 is not None else [])
        args = (node.args[0],) + ((residual,) if residual is not None else ())
        self.replace(node, fused, m, args, " + ".join(pattern))

    def mlp(self, node: fx.Node, act_node: fx.Node, lin: nn.Linear, act) -> bool:
        """Linear -> act -> Linear [+ residual add] -> one cudnn_fuse.nn.FusedMLP, whose backward
        turns the second layer's data gradient into the first layer's dz in one graph. Only
        for an activation whose backward reads the kept pre-activation; False (nothing
        replaced) when the activation's only user is not a plain Linear, or that Linear has an
        activation of its own."""
        nxt = _only_user(act_node)
        if nxt is None or nxt.op != "call_module" or nxt.args != (act_node,) or nxt.kwargs:
            return False
        lin2 = self.gm.get_submodule(nxt.target)
        if type(lin2) is not nn.Linear or _hooked(lin2) or _parametrized(lin2) or self.calls_of[nxt.target] > 1:
            return False  # a shared second layer would sit in the FusedMLP and where it was: its parameters twice
        dropouts = []
        more, residual, act2 = self.epilogue(nxt, dropouts)
        if act2 is not None:
            return False
        fc1 = _new_linear(lin, act[0], act[1], False)
        m = self.through(cfnn.FusedMLP(fc1, lin2, own=False, fuse_training=False), dropouts)
        pattern = f"Linear + {act[0]} + Linear" + (" + dropout (eval)" if dropouts else "") + \
            (" + residual add" if residual is not None else "")
        args = (node.args[0],) + ((residual,) if residual is not None else ())
        if not self.replace(node, [act_node, nxt] + more, m, args, pattern + " (fused MLP backward)",
                            name=self.new_name("cudnn_fuse_mlp_")):
            return True  # left alone, with the reason
        # the layers stay where they were (the block holds them, unregistered): state_dict keys unchanged;
        # fc1 runs its activation only where the block calls it
        fc1.graph_epilogue = True
        self.gm.add_submodule(node.target, fc1.train(lin.training))
        return True

    def conv1d(self, node: fx.Node) -> None:
        """transformers' Conv1D + [residual] + activation -> one fused linear on the transposed weight view."""
        dropouts = []
        fused, residual, act = self.epilogue(node, dropouts)
        if not fused:
            self.summary.left_alone.append((self.where(node), "no epilogue to fuse (torch's addmm is as fast)"))
            return
        m = self.through(cfnn.TransposedLinear(self.gm.get_submodule(node.target), act[0] if act else None,
                                               act[1] if act else 0.01, fuse_training=self.recompute), dropouts)
        pattern = ["Conv1D"] + (["dropout (eval)"] if dropouts else []) + \
            (["residual add"] if residual is not None else []) + ([act[0]] if act else [])
        args = (node.args[0],) + ((residual,) if residual is not None else ())
        self.replace(node, fused, m, args, " + ".join(pattern))

    def rms_norm(self, node: fx.Node, m: nn.Module) -> None:
        """An RMSNorm written out in torch ops -> cudnn_fuse.nn.RMSNorm (torch's one kernel), at the module's
        path: every call site takes it, and it holds the same weight."""
        self.gm.add_submodule(node.target, cfnn.RMSNorm(m, _rms_norm_eps(m)).train(m.training))
        self.summary.replaced.append((self.where(node), _RMS_PATTERN.format(type(m).__name__)))

    def skip_identities(self) -> None:
        """Take the calls that return their input (``_is_identity``) out of the graph; their modules
        stay registered where they were."""
        for node in list(self.gm.graph.nodes):
            if _is_identity(self.gm, node) and isinstance(node.args[0], fx.Node):
                node.replace_all_uses_with(node.args[0])
                self.gm.graph.erase_node(node)

    def run(self) -> None:
        self.skip_identities()
        # call sites per module path, counted once: a replacement calls the path it replaces
        calls_of = self.calls_of = collections.Counter(n.target for n in self.gm.graph.nodes if n.op == "call_module")
        for node in list(self.gm.graph.nodes):
            if node.graph is not self.gm.graph or node not in self.gm.graph.nodes:
                continue
            if node.op == "call_module":
                m = self.gm.get_submodule(node.target)
                calls = calls_of[node.target]
                if type(m) in (nn.Conv2d, nn.Linear) or _is_hf_conv1d(m):
                    if not node.args and len(node.kwargs) == 1:  # layer(input=x): its one argument, named
                        node.args, node.kwargs = tuple(node.kwargs.values()), {}
                    if len(node.args) != 1 or node.kwargs:
                        self.summary.left_alone.append((self.where(node), "called with other arguments than its input"))
                        continue
                if calls > 1 and (type(m) in (nn.Conv2d, nn.Linear) or _is_hf_conv1d(m)):
                    self.summary.left_alone.append((self.where(node), f"called from {calls} places (shared weights: "
                                                    "a fused copy would put its parameters in the state_dict twice)"))
                    continue
                if _parametrized(m):
                    self.summary.left_alone.append((self.where(node), "parametrized (torch.nn.utils.parametrize: "
                                                    "its weight is computed at each call)"))
                    continue
                why = _hooked(m) if type(m) in (nn.Conv2d, nn.Linear) or _is_hf_conv1d(m) else None
                if why is not None:
                    self.summary.left_alone.append((self.where(node), why))
                    continue
                if type(m) is nn.Conv2d:
                    self.conv(node)
                elif type(m) is nn.Linear:
                    self.linear(node)
                elif _is_hf_conv1d(m):
                    self.conv1d(node)
                elif _rms_norm_eps(m) is not None:
                    self.rms_norm(node, m)
            elif node.op == "call_function" and node.target is F.scaled_dot_product_attention:
                node.target = attention
                self.summary.replaced.append((self.where(node), "F.scaled_dot_product_attention"))
        _eliminate_dead_code(self.gm)
        if self.chain_convs:
            self.chain()  # after the clean-up: the chained layers stay the model's children
        self.gm.graph.lint()
        self.gm.recompile()

    def chain(self) -> None:
        """Runs of 2+ chainable cudnn_fuse.nn.Conv2d calls (no activation or ReLU, no residual), each
        the next one's only input and used by it alone -> one cudnn_fuse.nn.ConvChain call, whose
        training step is one autograd node. The layers stay registered where they were."""
        calls_of = collections.Counter(n.target for n in self.gm.graph.nodes if n.op == "call_module")

        def chainable(node) -> bool:
            return node.op == "call_module" and calls_of[node.target] == 1 and \
                cfnn.ConvChain.chainable(self.gm.get_submodule(node.target)) and len(node.args) == 1 and \
                node.kwargs == {"epilogue": True}

        runs, run = [], []
        for node in list(self.gm.graph.nodes):
            if chainable(node) and run and node.args[0] is run[-1] and _only_user(run[-1]) is node:
                run.append(node)
                continue
            if len(run) >= 2:
                runs.append(run)
            run = [node] if chainable(node) else []
        if len(run) >= 2:
            runs.append(run)
        for run in runs:
            if _inplace_between(self.gm, run[0], run[-1]):
                continue  # the chain would read its input where the last layer was: after the change
            name = self.new_name("cudnn_fuse_chain_")
            layers = [self.gm.get_submodule(n.target) for n in run]
            # the ConvChain holds the layers in a plain list; add_submodule registers only the chain
            self.gm.add_submodule(name, cfnn.ConvChain(layers, chained=True).train(layers[0].training))
            with self.gm.graph.inserting_after(run[-1]):
                new = self.gm.graph.call_module(name, (run[0].args[0],))
            run[-1].replace_all_uses_with(new)
            for n in reversed(run):
                self.gm.graph.erase_node(n)
            where = ", ".join(f"{self.prefix}{n.target}" for n in run)
            self.summary.replaced.append((where, f"{len(run)} convs chained (one autograd node for their training step)"))


def _aligned_pattern(m: cfnn.AlignedLinear) -> str:
    return f"Linear, output {m.out_features} wide padded to {m.out_features + m.pad} (aligned GEMM)"


class _TracedConstants:
    """A plain attribute carried over from the original (``traced_constants``) set to another value: the traced
    graph read it as a constant at optimize() time, so from then on the OptimizedGraphModule that holds this
    module runs its model class's own forward over its fused layers (``_untrace``), which reads the new value;
    where that cannot be, a warning says the traced forward keeps the old one. Never while the module is built,
    copied or unpickled (the attribute is not there yet then), nor for the same value set again."""

    def __setattr__(self, name: str, value) -> None:
        d = self.__dict__
        carried = name in d.get("traced_constants", ()) and name in d
        old = d[name] if carried else value
        held = d["_modules"].get(name) if "traced_constants" in d and "_modules" in d else None
        super().__setattr__(name, value)
        if name == "untraced_by" and isinstance(self, OptimizedGraphModule):
            _run_own_forward(self)  # a deepcopy sets it after its recompile
        if carried:
            _carried(self, {name: value})  # a deepcopy sets the value it has now
        if _changed(old, value):
            _untrace(self, name, old)
        elif held is not None and self._modules.get(name) is not held:
            _untrace(self, name, held, replaced=True)  # a new head or adapter the traced graph would not call

    def add_module(self, name: str, module) -> None:
        held = self._modules.get(name, False)
        super().add_module(name, module)
        d = self.__dict__
        if "traced_constants" not in d or held is module:
            return  # built, copied or unpickled; or the same layer again
        keys = d.get("container_keys")
        if keys is not None and name not in keys:
            keys.append(name)  # a Sequential's append, a ModuleList's
        _untrace(self, name, held or None, replaced=True)


# values a traced forward compares or computes with as Python does: set again with an equal one of the same
# type, the graph's constant still holds; any other value counts as new unless it is the same object
_PLAIN_VALUES = (bool, int, float, complex, str, bytes, type(None), tuple)


def _changed(old, new) -> bool:
    if old is new:
        return False
    if type(old) is type(new) and isinstance(old, _PLAIN_VALUES):
        try:
            return bool(old != new)
        except Exception:  # noqa: BLE001 - a tuple holding tensors: no single answer, so it is new
            return True
    return True


def _untrace(module: nn.Module, name: str, old, replaced: bool = False) -> None:
    """``module``'s carried attribute ``name`` was ``old`` when the graph was traced: its root (the
    OptimizedGraphModule itself, or the one holding this FusedContainer) runs its model class's own forward from
    now on, warned once per root; where no root is found or its forward cannot run over the layers it holds, the
    warning alone (once per module and name)."""
    d = module.__dict__
    cls = d.get("model_class") or d.get("container_class") or type(module)
    if isinstance(module, OptimizedGraphModule):
        root = module
    else:
        ref = _ROOTS.get(module)
        root = ref() if ref is not None else None
    if root is not None and "untraced_by" in root.__dict__:
        return  # it runs its own forward already
    if root is None or not _can_run_untraced(root):
        warned = _WARNED.setdefault(module, set())
        if name not in warned:
            warned.add(name)
            log.warning("cudnn_fuse.optimize: %s.%s %s after optimize(): the traced forward keeps the %s it "
                        "had at optimize() time (%.80r), the original class's methods see the new one; set it "
                        "before optimize()", cls.__name__, name, "replaced" if replaced else "set",
                        "layer" if replaced else "value", old)
        return
    by = f"{cls.__name__}.{name}"
    root.__dict__["untraced_by"] = by
    _carried(root, {"untraced_by": by})  # a deepcopy runs its own forward too (a pickle keeps __dict__)
    _run_own_forward(root)
    log.warning("cudnn_fuse.optimize: %s %s after optimize(): the traced graph %s (%.80r), so this %s now runs "
                "its own forward over its fused layers (fusions across layers are off); set it before optimize(), "
                "or call optimize() again on the original with the new value, to fuse across them again", by,
                "replaced" if replaced else "set", "calls the layer it held" if replaced else "fixed its old value",
                old, root.__dict__["model_class"].__name__)


def _can_run_untraced(root: nn.Module) -> bool:
    """Whether ``root``'s model class's forward can run over what ``root`` holds: it and each of its containers
    hold every layer of the original at its name, and no such forward calls a zero-argument ``super()`` (which
    asks for an instance of its class, not the module standing for it)."""
    for m in (root, *_own_containers(root)):
        cls = m.__dict__.get("model_class" if m is root else "container_class")
        if cls is None or any(m._modules.get(k) is None for k in m.__dict__.get("container_keys", ())):
            return False
        if "__class__" in getattr(getattr(cls.forward, "__code__", None), "co_freevars", ()):
            return False
    return True


def _own_containers(root: nn.Module):
    """The FusedContainers under ``root`` (an OptimizedGraphModule), not those of another one inside it."""
    stack = list(root.children())
    while stack:
        m = stack.pop()
        if isinstance(m, OptimizedGraphModule):
            continue
        if isinstance(m, FusedContainer):
            yield m
        stack.extend(m.children())


def _run_own_forward(root: nn.Module) -> None:
    """From now on ``root`` (an OptimizedGraphModule whose ``untraced_by`` is set) runs its model class's own
    forward: put in place of the generated one on fx's per-instance class, where torch.compile's guards see the
    change (a flag read inside the forward they would not), and the signature stays the generated one's."""
    cls, traced = type(root), type(root).forward
    if getattr(traced, "__cudnn_fuse_own__", False):
        return

    @functools.wraps(traced)
    def forward(self, *args, **kwargs):
        return self.__dict__["model_class"].forward(self, *args, **kwargs)

    forward.__cudnn_fuse_own__ = True
    cls.forward = forward


_WARNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> names warned about
# FusedContainer -> weak reference to the OptimizedGraphModule holding it, set at each recompile (a build, a
# deepcopy, an unpickling) so that copies point at their own root and nothing unpicklable is in their __dict__
_ROOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Layers:
    """Indexing, length and iteration of a rewritten Sequential or ModuleList, in the original's order: ``[i]``
    is the layer at the original's i-th name (a fused layer computes that layer alone, called so)."""

    def _layers(self) -> list:
        cls = self.__dict__.get("container_class") or self.__dict__.get("model_class") or nn.Module
        if not issubclass(cls, (nn.Sequential, nn.ModuleList)):
            raise TypeError(f"{cls.__name__} is no sequence of layers")
        return [self._modules.get(k) for k in self.__dict__.get("container_keys", self._modules)]

    def __bool__(self) -> bool:  # a module is true, whatever its length
        return True

    def __getitem__(self, i):
        layers = self._layers()
        if not isinstance(i, slice):
            return layers[i]
        cls = self.__dict__.get("container_class") or self.__dict__.get("model_class")
        if issubclass(cls, nn.ModuleList):
            return nn.ModuleList(layers[i])
        keys = self.__dict__.get("container_keys", list(self._modules))
        return nn.Sequential(collections.OrderedDict(zip(keys[i], layers[i])))  # fused layers compute their own

    def __setitem__(self, i, module) -> None:
        self._layers()  # a sequence of layers
        setattr(self, self.__dict__.get("container_keys", list(self._modules))[i], module)

    def __delitem__(self, i) -> None:
        layers, keys = self._layers(), self.__dict__.get("container_keys", list(self._modules))
        gone = keys[i] if isinstance(i, slice) else [keys[i]]
        if not gone:
            return
        for k in gone:
            del self._modules[k]
        keys[:] = [k for k in keys if k not in gone]
        _untrace(self, gone[0], layers[i], replaced=True)

    def __len__(self) -> int:
        return len(self._layers())

    def __iter__(self):
        return iter(self._layers())


class OptimizedGraphModule(_TracedConstants, fx.GraphModule):
    """What ``optimize()`` returns for a model that traced: the rewritten GraphModule, which still
    answers to the original model's own methods, properties and class attributes (bound to this
    module) and carries its plain instance attributes, as torch.compile's OptimizedModule answers
    for its ``_orig_mod``. So ``model.predict(x)``, ``model.num_classes`` or ``model.config`` work
    after ``model = cf.optimize(model)``. Every layer stays at its path (a folded BatchNorm2d, an activation
    fused into a layer), and a fused layer called by anything but the rewritten forward computes the layer
    it replaced, so such a method computes what it did. ``model_class`` is the original's class
    (``isinstance`` sees the GraphModule). A carried attribute that the traced graph read as a constant, set to
    another value here or on one of its containers (``model.tau = 4.0``), makes it run ``model_class.forward``
    over its fused layers from then on (``untraced_by`` names the attribute; copies and pickles keep it), so it
    computes with the new value, without the fusions across layers."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules
        except AttributeError as exc:
            return _of_class(self, self.__dict__.get("model_class"), name, exc)

    def _load_from_state_dict(self, *args):
        _load_as_class(self, self.__dict__.get("model_class"), args)

    def _apply(self, fn, recurse=True):
        # a forward may read its parameters' dtype or device as it runs (``x.to(next(self.parameters()).dtype)``):
        # the traced graph holds the one it read, so once a move changes them (``.double()``, ``.to("cuda")``),
        # a graph holding an old one runs the class's own forward over its fused layers from then on
        before = {(t.dtype, t.device) for t in (*self.parameters(), *self.buffers())}
        out = super()._apply(fn, recurse)
        after = {(t.dtype, t.device) for t in (*self.parameters(), *self.buffers())}
        gone = {v for pair in before - after for v in pair} - {v for pair in after for v in pair}
        held = _graph_constants(self.graph) & gone if gone and "untraced_by" not in self.__dict__ else set()
        if held:
            what = "dtype" if any(isinstance(v, torch.dtype) for v in held) else "device"
            _untrace(self, f"parameters' {what}", sorted(map(str, held)))
        return out

    def recompile(self):
        """fx's recompile, then the generated forward fetches each submodule path that it uses more
        than once into a local first (``_hoisted``): every ``self.a.b.c`` in fx's code is one
        nn.Module.__getattr__ per dot, which for a 12-block transformer made the traced model's host
        time about 1.2x the original's (docs/decisions.md, "optimize()")."""
        python_code = super().recompile()
        src = _hoisted(self._code)
        if src is not None:
            try:
                forward = fx.graph_module._forward_from_src(src, python_code.globals,
                                                            getattr(self._graph, "_co_fields", {}))
            except Exception as exc:  # noqa: BLE001 - fx's own code stays
                log.debug("optimize: hoisted forward not compiled (%s); fx's code kept", exc)
            else:
                self._code = src
                type(self).forward = forward
        if "untraced_by" in self.__dict__:
            _run_own_forward(self)
        for container in _own_containers(self):
            _ROOTS[container] = weakref.ref(self)
        return python_code

    def __reduce__(self):
        # fx pickles the generated code and rebuilds a plain GraphModule from it (torch.save of the
        # whole model): rebuilt, it is made an OptimizedGraphModule again; its carried attributes
        # (model_class, config, ...) are in the pickled __dict__ and fx sets them back
        rebuild, args = super().__reduce__()
        return (_rebuilt_optimized, (rebuild, args, _key_order(self)))

    def __deepcopy__(self, memo):
        # fx rebuilds the copy's modules in the order its graph uses them: the copy keeps this one's
        new = super().__deepcopy__(memo)
        _reorder(new, _key_order(self))
        return new


class _OptimizedSequence(_Layers, OptimizedGraphModule):
    """An OptimizedGraphModule of a Sequential or ModuleList: indexed, measured and iterated as it was."""


def _surface_class(model_class) -> type:
    return _OptimizedSequence if issubclass(model_class, (nn.Sequential, nn.ModuleList)) else OptimizedGraphModule


def _self_chain(node):
    """('a', '0', 'c') for the expression ``self.a.0.c``, as fx spells it (``getattr(self.a, '0').c``
    for a name that is no identifier, a Sequential's or ModuleList's index), else None."""
    names = []
    while True:
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                and len(node.args) == 2 and not node.keywords and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str):
            names.append(node.args[1].value)
            node = node.args[0]
        else:
            break
    return tuple(reversed(names)) if isinstance(node, ast.Name) and node.id == "self" and names else None


def _step(node, attr: str):
    """``node.attr``, or ``getattr(node, 'attr')`` where ``attr`` is no identifier."""
    if attr.isidentifier() and not keyword.iskeyword(attr):
        return ast.Attribute(node, attr, ast.Load())
    return ast.Call(ast.Name("getattr", ast.Load()), [node, ast.Constant(attr)], [])


def _hoisted(src: str):
    """``src`` (fx's generated forward) with every ``self.a.b`` path read more than once (itself or as
    the start of a longer path) fetched once into a local at the top of the function, each from the
    longest fetched path it extends; None where nothing is shared or the code is not one plain
    function. The paths are submodules, parameters and buffers, which a traced forward never assigns."""
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return None
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    if len(fns) != 1 or fns[0].name != "forward":
        return None
    fn = fns[0]
    chains = []

    class Collect(ast.NodeVisitor):
        def visit_Attribute(self, node):
            c = _self_chain(node)
            if c is None:
                self.generic_visit(node)
            else:
                chains.append(c)

        visit_Call = visit_Attribute

    Collect().visit(fn)
    uses = collections.Counter(c[:k] for c in chains for k in range(1, len(c) + 1))
    shared = sorted((p for p, n in uses.items() if n > 1), key=len)
    if not shared:
        return None
    taken = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {a.arg for a in ast.walk(tree)
                                                                         if isinstance(a, ast.arg)}
    names, i = {}, 0
    for p in shared:
        while f"_cf_m{i}" in taken:
            i += 1
        names[p] = f"_cf_m{i}"
        i += 1

    def expr(chain, whole=True):
        """``chain`` from the longest fetched path it extends (itself where ``whole``), or from self."""
        for k in range(len(chain) - (0 if whole else 1), 0, -1):
            if chain[:k] in names:
                node, rest = ast.Name(names[chain[:k]], ast.Load()), chain[k:]
                break
        else:
            node, rest = ast.Name("self", ast.Load()), chain
        for attr in rest:
            node = _step(node, attr)
        return node

    class Rewrite(ast.NodeTransformer):
        def visit_Attribute(self, node):
            c = _self_chain(node)
            if c is None:
                return self.generic_visit(node)
            return ast.copy_location(expr(c), node)

        visit_Call = visit_Attribute

    Rewrite().visit(fn)
    fn.body[0:0] = [ast.Assign([ast.Name(names[p], ast.Store())], expr(p, whole=False), lineno=0) for p in shared]
    # fx's code starts with blank lines, and its pickling appends it to an import block
    return "\n\n\n" + ast.unparse(ast.fix_missing_locations(tree)) + "\n"


def _rebuilt_optimized(rebuild, args, order=None) -> fx.GraphModule:
    gm = rebuild(*args)
    if order:
        _reorder(gm, order)
    cls = type(gm)  # fx's per-instance subclass
    d = gm.__dict__
    body = args[0] if args and isinstance(args[0], dict) else {}
    # fx registers every buffer it unpickles as persistent: the pickled module's non-persistent ones stay so
    gm._non_persistent_buffers_set.update(n for n in body.get("_non_persistent_buffers_set", ()) if n in gm._buffers)
    if "_version" in body:  # nn.Module's class attribute: fx sets only what the module lacks
        d["_version"] = body["_version"]
    if "model_class" in d and cls.__bases__ == (fx.GraphModule,):
        cls.__bases__ = (_surface_class(d["model_class"]),)
        # fx rebuilds the module's meta empty: what a deepcopy of it must set again is carried again
        kept = {"model_class", "container_keys", "traced_constants", "untraced_by", "cudnn_fuse_summary",
                "_non_persistent_buffers_set", "_version", *d.get("traced_constants", ())}
        _carried(gm, {k: v for k, v in d.items() if k in kept})
        gm.recompile()  # its own, now that it is one
    return gm


# nn.Module's own instance attributes (training, _parameters, ...): not the model's to carry over
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def _keep_model_surface(gm: fx.GraphModule, model: nn.Module) -> None:
    """Make ``gm`` (traced from ``model``) an OptimizedGraphModule that answers to ``model``'s own
    attributes; they survive ``copy.deepcopy`` (fx's user-preserved attributes)."""
    cls = type(gm)  # fx's per-instance subclass, which holds the generated forward
    if cls.__bases__ != (fx.GraphModule,) or isinstance(model, fx.GraphModule):
        return
    cls.__bases__ = (_surface_class(type(model)),)
    plain = {k: v for k, v in vars(model).items() if k not in _MODULE_INTERNALS and k not in gm.__dict__ and
             not isinstance(v, (nn.Module, nn.Parameter))}
    carried = {"model_class": type(model), "container_keys": list(model._modules), **plain,
               "traced_constants": frozenset(plain), "_version": model._version}  # the state_dict's metadata
    gm.__dict__.update(carried)
    _carried(gm, carried)


class FusedContainer(_TracedConstants, _Layers, nn.Module):
    """A container of a traced model's layers (``model.features``, ``model.layer1``) as fx rebuilt it: it holds
    its layers, the original's plain attributes (``num_heads``) and answers to its class's methods. The fused
    graph may cross its edges, so called alone it runs its class's own forward, unfused: every layer stays at
    its path and a fused layer called so computes the layer it replaced. A carried attribute set to another
    value here makes the OptimizedGraphModule holding it (its root) run its model's own forward from then on."""

    def _class_name(self) -> str:
        return getattr(self.__dict__.get("container_class"), "__name__", "container")

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError as exc:
            return _of_class(self, self.__dict__.get("container_class"), name, exc)

    def _load_from_state_dict(self, *args):
        _load_as_class(self, self.__dict__.get("container_class"), args)

    def forward(self, *args, **kwargs):
        cls = self.__dict__.get("container_class")
        keys = self.__dict__.get("container_keys", ())
        if cls is None or any(self._modules.get(k) is None for k in keys):
            raise RuntimeError(f"cudnn_fuse.optimize traced the model as a whole: this {self._class_name()} holds its "
                               "fused layers but does not run on its own; call the whole model, or optimize the "
                               "original submodule on its own (cf.optimize(model.<path>)) to run it alone")
        return cls.forward(self, *args, **kwargs)


def _of_class(module, cls, name: str, exc: AttributeError):
    """``cls``'s own attribute ``name`` (a method, property or class attribute), bound to ``module``; else
    ``exc`` raised."""
    if cls is None or (name.startswith("__") and name.endswith("__")):
        raise exc
    try:
        attr = inspect.getattr_static(cls, name)
    except AttributeError:
        raise exc from None
    get = getattr(type(attr), "__get__", None)
    return attr if get is None else get(attr, module, cls)  # a method bound to this module


def _keep_container_surfaces(gm: fx.GraphModule, model: nn.Module) -> None:
    """Give the containers fx rebuilt as bare modules (``features``, ``encoder.layers.encoder_layer_0``) the
    plain attributes of the originals, their classes' methods and, called alone, their classes' forward
    (FusedContainer)."""
    for name, orig in model.named_modules():
        if not name:
            continue
        try:
            now = gm.get_submodule(name)
        except AttributeError:
            continue
        if type(now) is not nn.Module:
            continue
        now.training = orig.training  # fx made it in training mode
        if type(orig) is nn.Module:
            continue
        now.__class__ = FusedContainer
        now.__dict__["container_class"], now.__dict__["container_keys"] = type(orig), list(orig._modules)
        plain = {k: v for k, v in vars(orig).items() if k not in _MODULE_INTERNALS and k not in now.__dict__ and
                 not isinstance(v, (nn.Module, nn.Parameter))}
        now.__dict__.update(plain, traced_constants=frozenset(plain), _version=orig._version)


def _carried(gm, attrs: dict) -> None:
    """Have fx set ``attrs`` again on a deepcopy of ``gm`` (its user-preserved attributes, torch 2.13); a
    GraphModule's deepcopy keeps no other instance attribute."""
    meta = getattr(gm, "meta", None) if isinstance(gm, fx.GraphModule) else None
    if isinstance(meta, dict):
        key = getattr(fx.graph_module, "_USER_PRESERVED_ATTRIBUTES_KEY", "_user_preserved_attributes")
        meta.setdefault(key, {}).update(attrs)


_LONE = "a lone {} (its parent does not trace, so no epilogue is seen to fuse)"


_RMS_PATTERN = "{} (an RMSNorm in torch ops) -> torch's fused rms_norm kernel"


def _rewrite(module: nn.Module, summary: Summary, prefix: str, recompute: bool, chain_convs: bool = False,
             fp8=None, done: dict | None = None) -> nn.Module:
    """The traced + rewritten module, or the module with its children rewritten. A module met again (a
    child shared by two parents that do not trace) is given its first rewrite, not a copy of its own:
    ``done`` holds them by id for one ``optimize()`` call."""
    done = {} if done is None else done
    hit = done.get(id(module))
    if hit is not None:
        return hit[1]
    out = _rewrite_one(module, summary, prefix, recompute, chain_convs, fp8, done)
    done[id(module)] = (module, out)  # the module held: its id is not reused while the call runs
    return out


def _rewrite_one(module: nn.Module, summary: Summary, prefix: str, recompute: bool, chain_convs: bool, fp8,
                 done: dict) -> nn.Module:
    eps = _rms_norm_eps(module)
    if eps is not None:
        summary.replaced.append((prefix.rstrip(".") or type(module).__name__, _RMS_PATTERN.format(type(module).__name__)))
        return cfnn.RMSNorm(module, eps).train(module.training)
    if type(module) is nn.Linear:  # a lone Linear child (e.g. an untraceable model's lm_head)
        where = prefix.rstrip(".") or "Linear"
        why = _hooked(module)  # an AlignedLinear in its place would not run the hooks
        if why is not None:
            summary.left_alone.append((where, why))
        elif fp8 is not None and _fp8_takes(module):
            summary.replaced.append((where, "Linear (FP8)"))
            return _new_linear(module, None, 0.01, recompute, fp8).train(module.training)
        elif cfnn.AlignedLinear.wanted(module):
            m = cfnn.AlignedLinear(module).train(module.training)
            summary.replaced.append((where, _aligned_pattern(m)))
            return m
        else:
            summary.left_alone.append((where, _LONE.format("Linear") if prefix else
                                       "no epilogue to fuse (torch's linear is as fast)"))
        return module
    if prefix and (type(module) is nn.Conv2d or _is_hf_conv1d(module)):  # a lone layer, as above: logged
        summary.left_alone.append((prefix.rstrip("."), _LONE.format(type(module).__name__)))
        return module
    try:
        gm = _trace(module)
    except Exception as exc:  # noqa: BLE001 - untraceable forward: try its children
        where = prefix.rstrip(".") or type(module).__name__
        why = str(exc) if isinstance(exc, _NotOneGraph) else f"not traceable by torch.fx ({type(exc).__name__})"
        if not list(module.children()):
            if isinstance(exc, _NotOneGraph) and type(module).__module__.startswith("torch.nn."):
                return module  # a dropout or norm of torch's: nothing in it to fuse
            summary.left_alone.append((where, why))
            return module
        summary.left_alone.append((where, f"{why}; its children are rewritten one by one"))
        for name, child in list(module.named_children()):
            setattr(module, name, _rewrite(child, summary, f"{prefix}{name}.", recompute, chain_convs, fp8, done))
        return module
    return _rewritten(gm, module, summary, prefix, recompute, chain_convs, fp8)


def _rewritten(gm: fx.GraphModule, module: nn.Module, summary: Summary, prefix: str, recompute: bool,
               chain_convs: bool, fp8) -> nn.Module:
    """``gm`` (traced from ``module``) rewritten, with ``module``'s surface; ``module`` itself where nothing was
    fused, or where the rewrite failed: logged, and left alone with the reason, rather than ``optimize()``
    failing on a model the original runs."""
    replaced, left = len(summary.replaced), len(summary.left_alone)
    try:
        _Rewriter(gm, summary, prefix, recompute, chain_convs, fp8).run()
        if len(summary.replaced) == replaced:
            # nothing fused: keep the original module (a GraphModule lacks the attributes other
            # code may read, e.g. transformers reads ``attn_dropout.p``)
            return module
        _keep_model_surface(gm, module)
        _keep_container_surfaces(gm, module)
        if isinstance(gm, OptimizedGraphModule):
            gm.recompile()  # its own: the forward fetches shared submodule paths once
    except Exception as exc:  # noqa: BLE001 - the original module runs as it did
        where = prefix.rstrip(".") or type(module).__name__
        del summary.replaced[replaced:], summary.left_alone[left:]
        first = (str(exc).splitlines() or [""])[0]
        why = f"its traced graph could not be rewritten ({type(exc).__name__}: {first:.200})"
        log.warning("cudnn_fuse.optimize: %s: %s; it is left as it was", where, why, exc_info=True)
        summary.left_alone.append((where, why))
        return module
    return gm


def _channels_last_off_the_cpu(t: torch.Tensor) -> torch.Tensor:
    """What ``Module.to(memory_format=torch.channels_last)`` does to a 4-D tensor, for tensors off the
    CPU: channels_last is what cuDNN's convs take without a copy, while on the CPU cf's conv runs on
    NCHW operands (a channels_last one is copied at every call) and torch's own CPU conv corrupts the
    heap on some (docs/decisions.md). Other ranks stay as they are (``Module.to`` raised on a 5-D one)."""
    if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):  # a lazy module's, before its first call
        return t
    return t.to(memory_format=torch.channels_last) if t.dim() == 4 and t.device.type != "cpu" else t


def _class_name(cls) -> str:
    """A class's name as its users spell it: the shortest module path that exports it (torch.nn.Linear,
    not torch.nn.modules.linear.Linear)."""
    parts = (getattr(cls, "__module__", None) or "").split(".")
    qual = getattr(cls, "__qualname__", cls.__name__)
    for i in range(1, len(parts) + 1):
        path = ".".join(parts[:i])
        if getattr(sys.modules.get(path), qual, None) is cls:
            return f"{path}.{qual}"
    return f"{'.'.join(parts)}.{qual}" if parts != [""] else qual


def _described(model) -> str:
    if isinstance(model, type):
        what = "the class" if issubclass(model, nn.Module) else "the type"
        return f"{what} {_class_name(model)} (make an instance: {model.__name__}(...))"
    return f"{model!r:.80} of type {type(model).__name__}"


def optimize(model: nn.Module, autotune: bool = False, recompute: bool = False, inplace: bool = False,
             chain_convs: bool = True, example_inputs=None, fp8=None) -> nn.Module:
    """Return ``model`` with its fusable patterns on cudnn_fuse ops (see the module doc).

    Eval mode folds BatchNorm2d into the convs (inference); in train mode BN stays.
    A model with convs has its 4-D parameters and buffers moved to channels_last once where they
    are on a GPU (or meta); on the CPU they stay as they are, and the fused convs' weights are
    NCHW there (cf's CPU conv runs on NCHW operands). A fused conv's weight follows its device
    later (``cudnn_fuse.nn.Conv2d``: channels_last once moved to CUDA). ``autotune`` turns on
    autotuning of new plans; ``recompute=True``: the Linear layers keep no pre-activation and train on
    cuDNN's recomputing graphs (less memory, a slower step), where by default a training step runs torch's
    own expression.
    ``chain_convs`` (default on): runs of fused convs with no
    activation or ReLU, each feeding only the next, become one ``cudnn_fuse.nn.ConvChain``
    whose training step is one autograd node (state_dict keys unchanged).
    The original model is left untouched unless ``inplace``.
    ``fp8``: a recipe (``cf.Float8CurrentScaling()``, ``cf.DelayedScaling()``) makes every Linear whose
    features are multiples of 16 an FP8 ``cudnn_fuse.nn.Linear`` (with its epilogue where it has one; no
    FusedMLP then), its FP8 scales and amax histories in the state_dict.
    ``example_inputs`` (a tensor, a tuple of arguments or a dict of keyword arguments): the optimized
    model is called once on them, so its plans are built (or autotuned) here rather than at its first
    call, and the summary says per replaced layer what runs: cuDNN's engine, or torch's own kernels
    where those timed faster for its shapes (``summary.torch_kernels``), with the timings; the call leaves
    the model's state (buffers, plain attributes) and the random streams as they were.

    A model traced whole reads its plain attributes (``self.tau``, a dropout's ``self.p``) as constants
    of the traced graph: set to another value after ``optimize()``, the model runs its class's own forward
    over its fused layers from then on (a warning is logged), which computes with the new value but fuses
    nothing across layers; set them before ``optimize()`` to keep those fusions.

    Raises TypeError for a ``model`` that is no torch.nn.Module instance (None, a string, a module class)
    and for flags that are not bools.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize: model must be a torch.nn.Module instance, got {_described(model)}")
    for name, flag in (("autotune", autotune), ("recompute", recompute), ("inplace", inplace),
                       ("chain_convs", chain_convs)):
        if not isinstance(flag, bool):  # inplace="False" rewrote the caller's model
            raise TypeError(f"optimize: {name} must be a bool, got {flag!r}")
    if example_inputs is not None:
        _example_call(example_inputs)  # a wrong type is named before the model is copied and rewritten
    fp8_.check_recipe(fp8)
    if autotune:
        from .autotune import set_autotune

        set_autotune(True)
    if not inplace:
        try:
            model = copy.deepcopy(model)
        except RuntimeError as exc:  # e.g. old-style torch.nn.utils.weight_norm after a forward
            raise RuntimeError(f"optimize: the model cannot be copied ({exc}); pass inplace=True to rewrite it "
                               "in place") from exc
        if any(p.requires_grad and not p.is_leaf for p in model.parameters()):  # torch's copy of a ScriptModule
            why = ("the model's copy has parameters that are not leaf tensors (torch's deepcopy of a torch.jit.script "
                   "submodule), which get no gradient; pass inplace=True to rewrite the model in place")
            if model.training:
                raise RuntimeError(f"optimize: {why}")
            log.warning("cudnn_fuse.optimize: %s before training it", why)
    summary = Summary()
    _NORMS.clear()  # told anew: a module changed since the last call (a hook added) is told again
    from .hf import use_cudnn_fuse_attention

    if use_cudnn_fuse_attention(model):
        summary.replaced.append((type(model).__name__, "transformers sdpa attention -> cudnn_fuse attention"))
    streams = _random_state()  # the fused modules are built with initialized weights (then replaced): draws
    try:
        out = _rewrite(model, summary, "", recompute, chain_convs, fp8)
    finally:
        _set_random_state(streams)
    if any(isinstance(m, nn.Conv2d) for m in out.modules()):
        out = out._apply(_channels_last_off_the_cpu)
        for m in out.modules():
            if isinstance(m, cfnn.Conv2d):
                m._weight_to_device_format()
    out.cudnn_fuse_summary = summary
    _carried(out, {"cudnn_fuse_summary": summary})
    if example_inputs is not None:
        _run_example(out, example_inputs, summary)
    log.info("%s", summary)
    return out


def _example_call(example_inputs):
    """(args, kwargs) of ``example_inputs``: a tensor, a tuple or list of arguments, or a dict of keyword
    arguments."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    raise TypeError("optimize: example_inputs must be a tensor, a tuple or list of arguments or a dict of keyword "
                    f"arguments, got {type(example_inputs).__name__}")


def _run_example(model: nn.Module, example_inputs, summary: Summary) -> None:
    """Call ``model`` once on ``example_inputs``: its plans are loaded or built (and checked against
    torch's kernels, or autotuned) now rather than at its first call, and ``summary.runs`` says, per
    replaced layer, what its plans run."""
    from . import loader, manifest

    args, kwargs = _example_call(example_inputs)
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, _CF_MODULES)]
    seen: dict = {name: {} for name, _ in layers}
    stack: list = []

    def enter(name):
        def hook(mod, inputs):
            block = manifest.record()
            stack.append((name, block, block.__enter__(), _device_of(inputs)))
        return hook

    def leave(mod, inputs, output):
        name, block, rec, device = stack.pop()
        block.__exit__(None, None, None)
        for e in rec.entries:
            seen[name].setdefault(e.spec, device)

    handles = [h for name, m in layers for h in (m.register_forward_pre_hook(enter(name)),
                                                    m.register_forward_hook(leave))]
    # the call leaves no trace in the model or the random streams: a training-mode forward updates the
    # BatchNorms' running statistics, a forward may count its calls, and dropouts draw random numbers
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    attrs = _plain_attributes(model)
    cuda = sorted({t.device.index or 0 for t in list(model.parameters()) + [b for b, _ in buffers] if t.is_cuda})
    try:
        with torch.random.fork_rng(devices=cuda), \
                torch.no_grad() if not model.training else contextlib.nullcontext():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
        while stack:  # a forward that raised inside a layer
            stack.pop()[1].__exit__(None, None, None)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        _restore_plain_attributes(attrs)
    held = {(p.spec, p.device): p for p in loader.plans_in_memory()}
    for name, _ in layers:
        what = [loader.describe(held[key]) if key in held else "PyTorch's ops (the fused call fell back)"
                for key in seen[name].items()]
        summary.runs.append((name, "; ".join(dict.fromkeys(what)) if what else "PyTorch's ops (no fused call ran: "
                             "CPU tensors, or operands the fused path does not take)"))


def _plain_attributes(model: nn.Module) -> list:
    """(module, its plain attributes) of ``model``'s modules, to put back after an example call (a counter, a
    cache its forward sets). Not of a lazy module yet to be materialized (the call makes its parameters, and
    takes its hooks off: both wanted), nor of cudnn_fuse's own modules (what they keep are caches keyed by
    what they were computed from)."""
    lazy = torch.nn.modules.lazy.LazyModuleMixin
    return [(m, {k: v for k, v in vars(m).items() if k not in _REGISTRIES}) for m in model.modules()
            if not isinstance(m, _CF_MODULES + (cfnn.RMSNorm,)) and
            not (isinstance(m, lazy) and m.has_uninitialized_params())]


def _restore_plain_attributes(attrs: list) -> None:
    """Put back what ``_plain_attributes`` took: attributes the call added go, changed ones get their old
    value. A parameter, buffer or submodule the call registered stays (a lazily made buffer)."""
    for m, saved in attrs:
        now = vars(m)
        registered = set().union(*(now[k] for k in _REGISTRIES))
        for name in [n for n in now if n not in saved and n not in _REGISTRIES]:
            del now[name]
        for name, value in saved.items():
            if name not in registered and now.get(name, _MISSING) is not value:
                now[name] = value


def _device_of(inputs):
    """The device index the layer's plans are keyed by (its first tensor input's, as the ops key them)."""
    return next((t.device.index for t in inputs if isinstance(t, torch.Tensor)), None)
