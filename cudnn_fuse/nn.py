"""Drop-in modules: subclasses of torch.nn.Conv2d / torch.nn.Linear whose forward
is one fused cuDNN graph (op + bias [+ residual] + activation).

Their parameters and state_dict are the torch modules' own, so checkpoints move
freely between ``torch.nn.Conv2d`` and ``cudnn_fuse.nn.Conv2d``.
"""

from __future__ import annotations

import torch
from torch.nn.modules import module as _torch_module

from . import fp8 as fp8_
from . import functional, manifest, ops, reference, torch_ops
from .backward import _traced
from .errors import ArgumentError
from .spec import ACTIVATIONS, canonical_activation

# activations whose backward needs their input (ReLU's needs only its output)
NEEDS_INPUT = frozenset(ACTIVATIONS) - {"relu"}


_NUMBERS = (bool, int, float, torch.SymInt, torch.SymFloat, torch.SymBool)
_SHAPE_MEMO = 64  # pairs of input and residual shapes a conv layer remembers the fit of


def _broadcast_residual(residual, out_shape, dtype) -> bool:
    """A residual the epilogue cannot take as it is: another shape (it broadcasts, e.g. a
    [..., 1] term optimize() found added to the layer's output) or another dtype (torch's add
    promotes), or a Python number (optimize() cannot tell `layer(x) + x.shape[-1]` from a tensor's
    add). The module then runs the op without it and adds it the way torch would."""
    if residual is None:
        return False
    if not isinstance(residual, torch.Tensor):
        return isinstance(residual, _NUMBERS)
    if residual.dtype == dtype and tuple(residual.shape) == tuple(out_shape):
        return False
    return _broadcastable(residual.shape, out_shape)


def _broadcastable(a, b) -> bool:
    """Whether shapes ``a`` and ``b`` broadcast together (either may grow: ``layer(x) + r`` takes a
    residual of a larger batch as torch's add does). One that does not goes to the op, which names it."""
    try:
        ops.broadcast_shapes(tuple(a), tuple(b))  # plain Python for int shapes (torch's imports sympy)
        return True
    except RuntimeError:
        return False


def _described(residual) -> str:
    if isinstance(residual, torch.Tensor):
        return f"residual.shape={tuple(residual.shape)}"
    return f"residual of type {type(residual).__name__}"


def dropouts_before_residual(module: torch.nn.Module, dropouts) -> None:
    """Record on a fused layer the dropouts that stood between it and its residual add: optimize()
    fuses the residual across them while they return their input (eval mode); while one of them is
    in training mode, the layer runs them between its output and the add, as the model did. Held
    as a plain attribute: they stay the model's modules, where they were."""
    module.__dict__["_dropouts"] = tuple(dropouts)


def records_grad(*ts) -> bool:
    """Whether autograd records a call on these operands (grad mode on and one of them requiring grad): a
    training step."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in ts)


def _trains_unfused(layer, x, residual) -> bool:
    """Whether this call of ``layer`` (weight, bias, fuse_training) is a training step it leaves to torch's
    own expression (``fuse_training=False``; a layer pickled before the attribute existed fuses)."""
    return not getattr(layer, "fuse_training", True) and isinstance(x, torch.Tensor) and \
        records_grad(x, layer.weight, layer.bias, residual)


def _tail(layer, z, residual):
    """``act(dropouts(z) + residual)`` of a layer's GEMM output ``z``, as torch computes it (in eval mode each
    dropout returns its input)."""
    z = _through_dropouts(layer, z)
    return reference.activation(z if residual is None else z + residual, layer.activation, layer.negative_slope)


def _check_fuse_training(fuse_training) -> bool:
    if not isinstance(fuse_training, bool):
        raise TypeError(f"fuse_training must be a bool, got {fuse_training!r}")
    return fuse_training


def _dropping(module) -> bool:
    return any(d.training and getattr(d, "p", 1) != 0 for d in module.__dict__.get("_dropouts", ()))


def _through_dropouts(module, y):
    for d in module.__dict__.get("_dropouts", ()):
        y = d(y)
    return y


def _plain(layer, epilogue) -> bool:
    """Whether this call of ``layer`` computes the layer alone: a layer ``optimize()`` put at a model's own
    path (``graph_epilogue``) runs its epilogue, folded BatchNorm2d included, only where the rewritten graph
    calls it (``epilogue=True``); called by anything else (a method of the model, ``model.layer(x)``), it
    computes what the layer it replaced computed."""
    return not epilogue if epilogue is not None else layer.__dict__.get("graph_epilogue", False)


def _out_dtype(x) -> torch.dtype:
    """The dtype the layer's op computes and returns for input ``x``: torch.autocast's where it is on
    for x's device type (float64 stays float64, as autocast leaves it), else x's own."""
    amp = ops.autocast_dtype(x)
    if amp is None or not x.is_floating_point() or x.dtype is torch.float64:
        return x.dtype
    return amp


def _check_activation(activation, negative_slope=0.01):
    """(activation, negative_slope) as a module keeps them: the canonical name (``m.activation == "gelu"``
    after ``activation=nn.GELU()``) and the slope (nn.LeakyReLU's own), checked as the ops check them
    (spec.canonical_activation: a slope only with leaky_relu)."""
    _check_slope(negative_slope)
    return canonical_activation(activation, negative_slope)


def _check_slope(negative_slope) -> None:
    """A real number (or a 0-dim real tensor, as the ops take one). Checked where it is given: a string
    used to fail at the first training call with 'could not convert string to float', naming nothing."""
    try:
        ops._float_arg("", "negative_slope", negative_slope)
    except TypeError:
        raise TypeError(f"negative_slope must be a real number, got {negative_slope!r}") from None


def _mixed(x, *others) -> bool:
    """Tensors of dtypes the fused ops do not take (ops._torch_dtypes): the layer's op then runs torch's
    own expression. False where x is no tensor or another operand is no tensor (the op names it)."""
    if not isinstance(x, torch.Tensor) or not all(t is None or isinstance(t, torch.Tensor) for t in others):
        return False
    return ops._torch_dtypes(x, *others) is not None


def weight_format(device):
    """The memory format a cf conv layer's weight takes on ``device``: NCHW
    (``torch.contiguous_format``) on the CPU, where cf's conv runs on NCHW operands (torch 2.13's CPU
    conv corrupts the heap on channels_last ones, docs/decisions.md) and would copy a channels_last
    weight at every call; ``torch.channels_last`` on CUDA, what cf's cuDNN conv takes without a copy
    (``optimize()`` has always made it so), and on meta, which stands for the device a model is
    materialized on later; None on any other device (left as it is)."""
    kind = torch.device(device).type
    if kind == "cpu":
        return torch.contiguous_format
    if kind in ("cuda", "meta"):
        return torch.channels_last
    return None


def _plain_weight(w) -> bool:
    """A 4-D Parameter of plain tensor data, whose ``.data`` can be given another layout (not a tensor
    subclass such as a FakeTensor or a DTensor, not a parametrized weight: that is no Parameter here)."""
    return isinstance(w, torch.nn.Parameter) and type(w.data) is torch.Tensor and w.dim() == 4


def _fold_bn(w, b, bn):
    """A conv's weight ``w`` and bias ``b`` (or None) with the eval-mode BatchNorm2d ``bn`` folded in, computed
    in float32 at least, then in the weight's dtype and memory format."""
    f = torch.promote_types(w.dtype, torch.float32)
    scale = 1 / torch.sqrt(bn.running_var.to(f) + bn.eps)
    if bn.weight is not None:
        scale = bn.weight.to(f) * scale
    shift = bn.bias.to(f) if bn.bias is not None else 0.0
    b0 = b.to(f) if b is not None else 0.0
    bias = ((b0 - bn.running_mean.to(f)) * scale + shift).to(w.dtype)
    fmt = torch.channels_last if w.dim() == 4 and not w.is_contiguous() and \
        w.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
    weight = (w.to(f) * scale.view(-1, 1, 1, 1)).to(w.dtype).contiguous(memory_format=fmt)
    return weight, bias


class Conv2d(torch.nn.Conv2d):
    """``torch.nn.Conv2d`` + fused epilogue: ``act(conv(x) + bias + residual)``.

    ``forward(x, residual=None, *, epilogue=None)``; x [N, C, H, W] (channels_last is fastest on CUDA).
    ``epilogue=False`` computes the conv alone (torch.nn.Conv2d's output); None means True, except for a
    layer ``optimize()`` put at a model's path, which fuses only where the rewritten graph calls it.

    The weight's memory format follows its device (``weight_format``): moved to another device
    (``.to()``, ``.cuda()``, ``.cpu()``, ``.to_empty()``, or ``torch.load`` with a ``map_location``
    of a pickled layer), it becomes NCHW on the CPU and channels_last on CUDA. Only its ``.data``
    changes: the Parameter stays the same object (optimizers and tied layers keep it), the values
    and the state_dict are unchanged. A call that asks for a format itself
    (``.to(memory_format=...)``, which changes the weight's strides) is left as asked.

    ``folded_bn``: the path of the BatchNorm2d that ``optimize()`` folded into this layer (eval mode
    only), else None. The layer keeps the conv's own weight and bias (its state_dict is the conv's) and
    runs on them folded with that BatchNorm2d's current statistics and affine parameters (``fold``),
    which stays the model's module. Such a layer refuses to run in training mode, where the BatchNorm2d
    would have used the batch's statistics (its output would differ from the model's without a word).
    """

    folded_bn = None  # a class default: layers pickled before it existed load with it
    graph_epilogue = False  # see _plain

    def __init__(self, *args, activation=None, negative_slope: float = 0.01, **kwargs):
        super().__init__(*args, **kwargs)
        self.activation, self.negative_slope = _check_activation(activation, negative_slope)

    def fold(self, bn: torch.nn.BatchNorm2d, path: str) -> None:
        """Run on this conv's weight and bias folded with the eval-mode ``bn`` (found at ``path``), read at
        each call: a weight or statistic changed in place, loaded or moved is folded again."""
        self.__dict__["_bn"] = bn  # not a child: it stays where it is in the model
        self.__dict__.pop("_fold_cache", None)
        self.folded_bn = path

    def _weights(self):
        """The weight and bias the fused op runs on: the conv's own, or folded with its BatchNorm2d. Folded
        again where autograd records (gradients reach the conv's and the BatchNorm2d's parameters) or
        torch.compile traces; else kept while the tensors folded stay the same (their data and versions)."""
        own = self._parameters
        w, b = own["weight"], own["bias"]
        bn = self.__dict__.get("_bn")
        if bn is None:
            return w, b
        bp, bb = bn._parameters, bn._buffers  # read directly: a call reads them all
        g, beta, rm, rv = bp.get("weight"), bp.get("bias"), bb["running_mean"], bb["running_var"]
        if torch.is_grad_enabled() and (w.requires_grad or any(t is not None and t.requires_grad for t in (b, g, beta))) \
                or torch.compiler.is_compiling():
            return _fold_bn(w, b, bn)
        key = (w.data_ptr(), w._version, rm.data_ptr(), rm._version, rv.data_ptr(), rv._version,
               b is not None and (b.data_ptr(), b._version), g is not None and (g.data_ptr(), g._version),
               beta is not None and (beta.data_ptr(), beta._version))
        cache = self.__dict__.get("_fold_cache")
        if cache is None or cache[0] != key:
            with torch.no_grad():
                folded = _fold_bn(w, b, bn)
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return folded  # made in a CUDA graph's memory pool, which its replays reuse: not kept past it
            cache = self.__dict__["_fold_cache"] = (key, *folded)
        return cache[1], cache[2]

    def forward(self, x, residual=None, *, epilogue=None):
        if self.training and self.folded_bn is not None:
            self._folded_in_training()
        if _plain(self, epilogue):  # the conv alone, as torch.nn.Conv2d
            return self._conv_forward(x, self.weight, self.bias)
        weight, bias = self._weights()
        act, r = self.activation, residual
        odd = residual is not None and (_dropping(self) or isinstance(x, torch.Tensor) and (  # else the op names x
            not isinstance(residual, torch.Tensor) or residual.dtype != _out_dtype(x)
            or residual.dim() != x.dim()
            or residual.shape[-3] != self.out_channels
            or self._broadcasts(x, residual)))
        if odd:  # a broadcast or other-dtype residual, or dropouts before it: added after the op, as torch adds it
            act, r = None, None
        if self.padding_mode != "zeros":  # cuDNN pads with zeros only
            z = self._conv_forward(x, weight, bias)
            y = reference.epilogue(z, None, r, act, self.negative_slope)
        else:
            y = functional.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, self.groups,
                           activation=act, residual=r, negative_slope=self.negative_slope)
        if not odd:
            return y
        if not (isinstance(residual, _NUMBERS) or isinstance(residual, torch.Tensor) and
                _broadcastable(residual.shape, y.shape)):
            raise ArgumentError(f"conv2d: residual must have the output's shape {tuple(y.shape)} or broadcast with it, "
                             f"got {_described(residual)}")
        return reference.activation(_through_dropouts(self, y) + residual, self.activation, self.negative_slope)

    def _apply(self, fn, recurse=True):
        w = self._parameters.get("weight")
        before = (w.device.type, w.stride()) if _plain_weight(w) else None
        out = super()._apply(fn, recurse)
        w = self._parameters.get("weight")  # the same Parameter, unless torch was told to make new ones
        if before is not None and _plain_weight(w) and w.device.type != before[0] and w.stride() == before[1]:
            self._weight_to_device_format()  # moved, with no format asked for
        return out

    def _weight_to_device_format(self) -> None:
        """Give the weight ``weight_format(its device)`` by setting its ``.data`` (the Parameter object
        stays: optimizers, tied layers and hooks on it keep working); nothing when it has it already."""
        w = self._parameters.get("weight")
        if not _plain_weight(w):
            return
        fmt = weight_format(w.device)
        if fmt is None:
            return
        d = w.data
        new = reference.nchw(d) if fmt is torch.contiguous_format else d.to(memory_format=fmt)
        if new is not d:
            w.data = new

    def __getstate__(self):
        state = super().__getstate__()
        w = self._parameters.get("weight")
        if _plain_weight(w):  # where the weight was: loaded onto another device, it takes that device's format
            state["_pickled_weight_device"] = w.device.type
        return state

    def __setstate__(self, state):
        was = state.pop("_pickled_weight_device", None)
        super().__setstate__(state)
        w = self._parameters.get("weight")
        if was is not None and _plain_weight(w) and w.device.type != was:  # torch.load's map_location moved it
            self._weight_to_device_format()

    def _folded_in_training(self):
        raise RuntimeError(f"conv2d: optimize() folded BatchNorm2d {self.folded_bn!r} into this layer because the model "
                           "was in eval mode; in training mode that BatchNorm2d would normalize with the batch's "
                           "statistics, which the folded layer cannot: call .eval() on the model, or optimize() it "
                           "in train mode to train it")

    def _broadcasts(self, x, residual) -> bool:
        """Whether a residual of the output's rank and channels has another shape (it broadcasts with the
        output: [1, K, P, Q], [N, K, 1, 1], or a larger batch or map than the output's). One that fits no
        geometry goes to the op, which names it. Remembered per pair of shapes (``_SHAPE_MEMO`` of them):
        the output's shape costs more host time than the rest of a call."""
        key = (x.shape, residual.shape)
        compiling = torch.compiler.is_compiling()  # symbolic sizes: no memo
        memo = None if compiling else self.__dict__.get("_residual_shapes")
        if memo is not None and key in memo:
            return memo[key]
        try:
            pre, post = ops._conv_padding(self.padding, tuple(self.weight.shape[-2:]), self.dilation, self.stride)
            odd = tuple(residual.shape) != ops.conv_out_shape(x.shape, self.weight.shape, self.stride, pre, post,
                                                              self.dilation)
        except (TypeError, ValueError, IndexError):
            odd = False
        if not compiling:
            if memo is None or len(memo) >= _SHAPE_MEMO:
                memo = self.__dict__["_residual_shapes"] = {}
            memo[key] = odd
        return odd

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", activation={self.activation!r}" if self.activation else "") + \
            (f", folded_bn={self.folded_bn!r}" if self.folded_bn is not None else "")


_functorch_active = ops._functorch_on  # whether a torch.func transform is active


def _autocast() -> bool:
    try:
        return torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")
    except TypeError:  # a torch whose is_autocast_enabled takes no device
        return torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()


class ConvChain(torch.nn.Module):
    """Convs applied in turn (``cudnn_fuse.nn.Conv2d``, each with no activation or ReLU and no
    residual: ``optimize(model)`` builds it for such a run of layers) whose
    eager training step is ONE autograd node: the layers' forwards run in turn, and the backward
    runs each layer's replayed backward program in turn (``torch_ops._ConvChain``), where each
    layer on its own would be a Python autograd node (its apply, saved-tensor unpacking and the
    engine's call into Python, tens of microseconds a layer: docs/training.md).
    Inference, torch.compile, autocast, functorch transforms, an active ``cf.record``, tensor
    subclasses and any hook on the layers (or a global module hook) run the layers one by one,
    exactly as without the chain.

    The layers are not this module's children: they stay where they were (the model's own
    children, so the state_dict keys, ``.to()`` and optimizers see them as before) and this module
    holds them in a plain list. ``chained=False`` makes it run them one by one always."""

    def __init__(self, layers, chained: bool = True):
        super().__init__()
        layers = list(layers)
        if len(layers) < 1 or not all(ConvChain.chainable(m) for m in layers):
            raise ArgumentError("ConvChain: layers must be cudnn_fuse.nn.Conv2d modules with no activation or ReLU")
        self._layers = layers  # a plain list: not registered, the layers stay their owner's children
        if not isinstance(chained, bool):
            raise TypeError(f"ConvChain: chained must be a bool, got {chained!r}")
        self.chained = chained
        self._geo_cache = None

    @staticmethod
    def chainable(m) -> bool:
        return type(m) is Conv2d and m.activation in (None, "relu") and m.padding_mode == "zeros"

    @property
    def layers(self) -> list:
        return list(self._layers)

    def _geos(self):
        """Each layer's (stride, pre, post, dilation, groups), remembered while the layers' attributes
        stay the same (they are read on every call: a changed padding is seen)."""
        sig = tuple((m.stride, m.padding, m.dilation, m.groups, m.kernel_size) for m in self._layers)
        if self._geo_cache is not None and self._geo_cache[0] == sig:
            return self._geo_cache[1]
        geos = []
        for stride, padding, dilation, groups, ksize in sig:
            stride, dilation = tuple(stride), tuple(dilation)
            pre, post = ops._conv_padding(padding, tuple(ksize), dilation, stride)
            geos.append((stride, tuple(pre), tuple(post), dilation, groups))
        self._geo_cache = (sig, tuple(geos))
        return self._geo_cache[1]

    def _one_node(self, x):
        """The layers' parameters [w0, b0, w1, b1, ...] when this call runs as one node, else None."""
        if not self.chained or not torch.is_grad_enabled() or type(x) is not torch.Tensor or x.dim() != 4:
            return None
        if torch.compiler.is_compiling() or _autocast() or _functorch_active() or _traced(x) or manifest._active:
            return None
        g = _torch_module
        if g._global_forward_hooks or g._global_forward_pre_hooks or g._global_backward_hooks or \
                g._global_backward_pre_hooks:
            return None
        wants = x.requires_grad
        params = []
        P = torch.nn.Parameter
        for m in self._layers:
            if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks or \
                    m.folded_bn is not None:  # its weights are folded at its call (or it says why it cannot run)
                return None
            own = m._parameters
            w, b = own["weight"], own.get("bias")
            if type(w) is not P or (b is not None and type(b) is not P):
                return None
            wants = wants or w.requires_grad or (b is not None and b.requires_grad)
            params += (w, b)
        return params if wants else None

    def forward(self, x):
        params = self._one_node(x)
        if params is not None:
            return torch_ops.conv_chain(x, self._layers, self._geos(), params)
        for m in self._layers:
            x = m(x, epilogue=True)
        return x

    def extra_repr(self) -> str:
        return f"{len(self._layers)} layers, chained={self.chained}"


class _FP8State:
    """A module's FP8 state, per FP8 linear it runs (``layer``: "" for its own, "fc1_", ...): the scales and
    amax histories of x, w and dY, buffers ``{layer}fp8_scales`` [3] and ``{layer}fp8_amax_history``
    [3, history_len] in the state_dict, so a checkpoint resumes with them. A checkpoint without them (a
    plain bfloat16 one) loads and the state starts fresh; they stay float32 when the module is cast to 16
    bits (a 16-bit scale would round every cast's scale)."""

    _FP8_STATE = ("fp8_scales", "fp8_amax_history")

    def _register_fp8_state(self, recipe, layers, device) -> None:
        for layer in layers:
            self.register_buffer(f"{layer}fp8_scales", torch.ones(3, device=device))
            self.register_buffer(f"{layer}fp8_amax_history", torch.zeros(3, recipe.history_len, device=device))

    def _fp8_casts(self, layer: str = "") -> "fp8_.Casts":
        return fp8_.Casts(self.fp8, getattr(self, f"{layer}fp8_scales"), getattr(self, f"{layer}fp8_amax_history"))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        for key in list(missing_keys):  # this module's own FP8 buffers only
            rest = key[len(prefix):]
            if key.startswith(prefix) and "." not in rest and rest.endswith(self._FP8_STATE):
                missing_keys.remove(key)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for name, t in self._buffers.items():
            if t is not None and name.endswith(self._FP8_STATE) and t.dtype != torch.float32:
                self._buffers[name] = t.float()
        return self


class Linear(_FP8State, torch.nn.Linear):
    """``torch.nn.Linear`` + fused epilogue: ``act(x @ W.T + bias + residual)``.

    ``recompute`` matters for activations whose backward needs their input
    (GELU, SiLU, ...): with ``recompute=True`` the forward saves no pre-activation
    and the backward recomputes it inside one fused matmul + bias +
    activation-backward graph; with ``False`` (torch's trade) one forward graph
    writes both the pre-activation and the output, and the backward reads the
    kept pre-activation.

    ``fp8``: a recipe (``cf.Float8CurrentScaling()``, ``cf.DelayedScaling()``) casts x and the weight
    to FP8 in the forward and dY in the backward, their scales and amax histories buffers of the module
    (fp8.py); in and out features must be multiples of 16, else the layer runs unquantized (logged once).
    On a GPU with FP8 GEMMs (compute capability 8.9 or newer) its three GEMMs are FP8 GEMMs; without
    autograd the bias, a ReLU or tanh-GELU and the residual run in the GEMM's epilogue.

    ``fuse_training=False`` (what ``optimize(model)`` builds): a call autograd records (a training step)
    runs torch's own expression, ``act(F.linear(x, weight, bias) + residual)``, and only inference runs the
    fused graph. A training step through the fused graphs runs the kernels torch's does, at more host time
    a call (docs/training.md).
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *, activation=None,
                 recompute: bool = False, negative_slope: float = 0.01, fp8=None, fuse_training: bool = True):
        super().__init__(in_features, out_features, bias, device, dtype)
        activation, negative_slope = _check_activation(activation, negative_slope)
        if not isinstance(recompute, bool):  # recompute="False" was on
            raise TypeError(f"recompute must be a bool, got {recompute!r}")
        fp8_.check_recipe(fp8)
        self.activation = activation
        self.recompute = recompute
        self.negative_slope = negative_slope
        self.fp8 = fp8
        self.fuse_training = _check_fuse_training(fuse_training)
        if fp8 is not None:
            self._register_fp8_state(fp8, ("",), device)

    def _fp8_forward(self, x, residual):
        if self.in_features % 16 or self.out_features % 16:
            ops._fallback("linear", "FP8 needs in_features and out_features that are multiples of 16: bfloat16")
            return None
        if not fp8_.pays(x, self.weight, self.bias, self.fp8):  # measured slower than bfloat16 at this shape
            return None
        return fp8_.linear(x, self.weight, self.bias, self._fp8_casts(), self.activation, residual,
                           self.negative_slope)

    graph_epilogue = False  # see _plain

    def forward(self, x, residual=None, *, epilogue=None):
        if _plain(self, epilogue):  # the layer alone, as torch.nn.Linear
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if self.fp8 is not None and isinstance(x, torch.Tensor):
            y = self._fp8_forward(x, residual)
            if y is not None:
                return y
        if _trains_unfused(self, x, residual):  # torch's own expression, what the replaced modules ran
            return _tail(self, torch.nn.functional.linear(x, self.weight, self.bias), residual)
        act = self.activation
        if residual is not None and (_dropping(self) or isinstance(x, torch.Tensor) and
                                     _broadcast_residual(residual, tuple(x.shape[:-1]) + (self.out_features,),
                                                         _out_dtype(x))):
            return _tail(self, functional.linear(x, self.weight, self.bias), residual)
        keep_z = act in NEEDS_INPUT and not self.recompute and not ops._inline_under_compile("linear") \
            and not _functorch_active()
        if keep_z and torch.is_grad_enabled() and isinstance(x, torch.Tensor) and \
                (x.requires_grad or self.weight.requires_grad):  # x not a tensor: functional.linear names it
            w, b = self.weight, self.bias
            cast = ops.autocast_args(x, x, w, b, residual)  # the op bypassed casts as autocast would
            if cast is None:
                if not _mixed(x, w, b, residual):  # else torch's own expression (functional.linear)
                    self._check(x, residual)
                    return torch_ops.linear_save_z(x, w, b, act, residual, self.negative_slope)
            else:
                dev, (x, w, b, residual) = cast
                with ops._autocast_off(dev):
                    if not _mixed(x, w, b, residual):
                        self._check(x, residual, w, b)
                        return torch_ops.linear_save_z(x, w, b, act, residual, self.negative_slope)
                    return functional.linear(x, w, b, activation=act, residual=residual,
                                             negative_slope=self.negative_slope)
        return functional.linear(x, self.weight, self.bias, activation=act, residual=residual,
                          negative_slope=self.negative_slope)

    def _check(self, x, residual, *params) -> None:
        """functional.linear's argument checks, for the path that bypasses it (``params``: the weight and
        bias as cast under autocast; the module's own by default)."""
        weight, bias = params or (self.weight, self.bias)
        ops._check_tensor("x", x, "linear")
        ops._check_floating("linear", "x", x)
        ops._check_same("linear", "x", x, weight=weight, bias=bias, residual=residual)
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ArgumentError(f"linear: x has in_features={x.shape[-1] if x.dim() else None} but "
                                f"weight.shape={tuple(self.weight.shape)} expects {self.in_features}")
        ops._check_epilogue("linear", self.activation, residual, tuple(x.shape[:-1]) + (self.out_features,))
        _check_slope(self.negative_slope)  # this path reads it as float(negative_slope)

    def extra_repr(self) -> str:
        extra = f", activation={self.activation!r}" if self.activation else ""
        if self.activation in NEEDS_INPUT:
            extra += f", recompute={self.recompute}"
        if getattr(self, "fp8", None) is not None:
            extra += f", fp8={self.fp8!r}"
        if not getattr(self, "fuse_training", True):
            extra += ", fuse_training=False"
        return super().extra_repr() + extra


class FusedMLP(_FP8State, torch.nn.Module):
    """``fc2(act(fc1(x))) [+ residual]``: a Linear -> activation -> Linear block (a transformer
    MLP) whose training backward crosses the layer boundary.

    ``fc1`` is a ``cudnn_fuse.nn.Linear`` with the activation, ``fc2`` a ``torch.nn.Linear``; both
    hold the original modules' Parameters. For an activation whose backward needs its input
    (GELU, SiLU, ...) with ``recompute=False``, a training step keeps the pre-activation like
    torch does, in ONE autograd node on eager's kernels (cuBLAS GEMMs, aten's activation and its
    backward), dropping each intermediate as soon as the backward has read it. Inference,
    ``recompute=True`` and torch.compile run ``fc1`` then ``fc2``, exactly what the two modules
    would run.

    ``own=False`` (what ``optimize(model)`` builds): the layers are not this module's children but
    stay where they were, the model's own, so the state_dict keys (``fc1.weight``, ``fc2.weight``),
    ``.to()`` and optimizers see them as before, as with ConvChain; this module holds them as plain
    attributes and reads their parameters at each call.

    ``fp8``: a recipe (``cf.Float8CurrentScaling()``, ``cf.DelayedScaling()``) runs both layers as FP8
    linears (``Linear``'s ``fp8``), their scales and amax histories this module's buffers
    (``fc1_fp8_scales``, ``fc1_fp8_amax_history``, ``fc2_...``); fc1 must then carry no recipe of its
    own. Features that are not multiples of 16 run the bfloat16 block (logged once). Without autograd,
    fc1's activation (ReLU, tanh-GELU) runs in its GEMM's epilogue.

    ``fuse_training=False`` (what ``optimize(model)`` builds): a training step runs ``fc1`` then ``fc2``.
    """

    def __init__(self, fc1: "Linear", fc2: torch.nn.Linear, *, own: bool = True, fp8=None,
                 fuse_training: bool = True):
        super().__init__()
        self.fuse_training = _check_fuse_training(fuse_training)
        if not isinstance(fc1, Linear) or fc1.activation is None:
            raise ArgumentError("FusedMLP: fc1 must be a cudnn_fuse.nn.Linear with an activation")
        if not isinstance(fc2, torch.nn.Linear) or fc2.in_features != fc1.out_features:
            raise ArgumentError(f"FusedMLP: fc2 must be a torch.nn.Linear taking fc1's {fc1.out_features} outputs")
        if not isinstance(own, bool):
            raise TypeError(f"FusedMLP: own must be a bool, got {own!r}")
        fp8_.check_recipe(fp8)
        if fp8 is not None and (getattr(fc1, "fp8", None) is not None or getattr(fc2, "fp8", None) is not None):
            raise ArgumentError("FusedMLP: fp8 is given, so fc1 and fc2 must have no recipe of their own")
        if own:
            self.fc1, self.fc2 = fc1, fc2
        else:  # plain attributes, found before nn.Module.__getattr__: not registered, not in state_dict
            self.__dict__["fc1"], self.__dict__["fc2"] = fc1, fc2
        self.fp8 = fp8
        if fp8 is not None:
            self._register_fp8_state(fp8, ("fc1_", "fc2_"), fc1.weight.device)

    def _fp8_mlp(self, x, residual):
        """Both layers as FP8 linears, each where it is measured faster so (``fp8.pays``), else in bfloat16;
        None where their features are not multiples of 16, or neither layer pays."""
        fc1, fc2 = self.fc1, self.fc2
        if fc1.in_features % 16 or fc1.out_features % 16 or fc2.out_features % 16:
            ops._fallback("linear", "FP8 needs in_features and out_features that are multiples of 16: bfloat16")
            return None
        first = fp8_.pays(x, fc1.weight, fc1.bias, self.fp8)
        second = fp8_.pays(x, fc2.weight, fc2.bias, self.fp8)  # fc1's output has x's rows
        if not first and not second:
            return None
        h = fp8_.linear(x, fc1.weight, fc1.bias, self._fp8_casts("fc1_"), fc1.activation, None,
                        fc1.negative_slope) if first else fc1(x, epilogue=True)
        if second:
            return fp8_.linear(h, fc2.weight, fc2.bias, self._fp8_casts("fc2_"), None, residual, 0.01)
        return functional.linear(h, fc2.weight, fc2.bias, residual=residual)

    def _fused(self, x, residual) -> bool:
        fc1 = self.fc1
        if fc1.activation not in NEEDS_INPUT or fc1.recompute or not torch.is_grad_enabled() or \
                not getattr(self, "fuse_training", True):
            return False
        if ops._inline_under_compile("linear") or torch.compiler.is_compiling() or _functorch_active():
            return False
        ps = (x, fc1.weight, fc1.bias, self.fc2.weight, self.fc2.bias, residual)
        if _mixed(*ps):  # torch's own expressions, by fc1 then the second linear
            return False
        return any(isinstance(t, torch.Tensor) and t.requires_grad for t in ps)  # x not a tensor: the op names it

    def forward(self, x, residual=None):
        fc1, fc2 = self.fc1, self.fc2
        if getattr(self, "fp8", None) is not None and isinstance(x, torch.Tensor) and not _dropping(self):
            y = self._fp8_mlp(x, residual)
            if y is not None:
                return y
        if residual is not None and _dropping(self):
            return _through_dropouts(self, fc2(fc1(x, epilogue=True))) + residual
        if residual is not None and isinstance(x, torch.Tensor) and \
                _broadcast_residual(residual, tuple(x.shape[:-1]) + (fc2.out_features,), _out_dtype(x)):
            return fc2(fc1(x, epilogue=True)) + residual
        if self._fused(x, residual):
            operands = (x, fc1.weight, fc1.bias, fc2.weight, fc2.bias, residual)
            cast = ops.autocast_args(x, *operands)  # the op bypassed casts as autocast would
            if cast is None:
                return self._mlp(*operands)
            with ops._autocast_off(cast[0]):
                return self._mlp(*cast[1])
        h = fc1(x, epilogue=True)
        if residual is None:
            return fc2(h)
        return functional.linear(h, fc2.weight, fc2.bias, residual=residual)

    def _mlp(self, x, w1, b1, w2, b2, residual):
        """The fused training block on (cast) operands, after functional.linear's checks."""
        fc1, fc2 = self.fc1, self.fc2
        fc1._check(x, None, w1, b1)
        ops._check_same("linear", "x", x, weight=w2, bias=b2, residual=residual)
        ops._check_epilogue("linear", None, residual, tuple(x.shape[:-1]) + (fc2.out_features,))
        return torch_ops.mlp(x, w1, b1, w2, b2, fc1.activation, residual, fc1.negative_slope)

    def extra_repr(self) -> str:
        fp8 = f"fp8={self.fp8!r}" if getattr(self, "fp8", None) is not None else ""
        if "fc1" in self._modules:  # its own children: printed below
            return fp8
        fc1, fc2 = self.fc1, self.fc2
        return (f"holds the model's layers: {fc1.in_features} -> {fc1.out_features} ({fc1.activation}) -> "
                f"{fc2.out_features}" + (", " + fp8 if fp8 else ""))


class TransposedLinear(torch.nn.Module):
    """A linear layer kept as an ``[in, out]`` weight (transformers' Conv1D, GPT-2),
    run as one fused ``act(x @ W + bias + residual)``: the weight is read through
    its transposed view, never copied, and stays the original module's Parameter. ``fuse_training=False``
    (what ``optimize(model)`` builds): a call autograd records runs Conv1D's own ``addmm`` and the
    activation."""

    def __init__(self, conv1d, activation=None, negative_slope: float = 0.01, *, fuse_training: bool = True):
        super().__init__()
        activation, negative_slope = _check_activation(activation, negative_slope)
        self.weight, self.bias = conv1d.weight, conv1d.bias
        self.activation, self.negative_slope = activation, negative_slope
        self.fuse_training = _check_fuse_training(fuse_training)

    graph_epilogue = False  # see _plain

    def forward(self, x, residual=None, *, epilogue=None):
        plain = _plain(self, epilogue)
        if plain or _trains_unfused(self, x, residual):  # Conv1D's own expression
            z = torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], self.weight.shape[1])
            return z if plain else _tail(self, z, residual)
        if residual is not None and (_dropping(self) or isinstance(x, torch.Tensor) and
                                     _broadcast_residual(residual, tuple(x.shape[:-1]) + (self.weight.shape[1],),
                                                         _out_dtype(x))):
            return _tail(self, functional.linear(x, self.weight.t(), self.bias), residual)
        return functional.linear(x, self.weight.t(), self.bias, activation=self.activation, residual=residual,
                          negative_slope=self.negative_slope)

    def extra_repr(self) -> str:
        return (f"in={self.weight.shape[0]}, out={self.weight.shape[1]}, activation={self.activation!r}" +
                ("" if getattr(self, "fuse_training", True) else ", fuse_training=False"))


class AlignedLinear(torch.nn.Linear):
    """A linear layer with no epilogue whose output width is not a multiple of 16 bytes
    (GPT-2's lm_head: 50257 outputs). Its output rows start at odd addresses, so cuBLAS falls
    back to an sm75 ``align1`` kernel (7x the aligned GEMM's time for GPT-2's logits at 8×1024,
    docs/decisions.md). On the GPU this layer runs the
    GEMM on a weight padded with zero rows to an aligned width and returns the first
    ``out_features`` columns as a view of that aligned buffer, as torch.compile's padded mm does:
    the row stride is the padded width, so ``.view()`` across the last dim needs ``.contiguous()``
    first (``.reshape()``, ``.float()``, softmax and cross-entropy take it as it is); a contiguous
    copy would cost 0.9 ms of GPT-2's 6.9. Gradients flow to the original Parameters, so tied
    weights (lm_head / wte) stay tied; state_dict is ``torch.nn.Linear``'s."""

    MIN_WEIGHT = 1 << 20  # elements: a smaller layer is left to torch (the weight pad's launches cost more)
    MIN_MACS = 1 << 30  # per call: below it the misaligned kernel is cheaper than the weight pad + GEMM

    def __init__(self, linear: torch.nn.Linear):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters (ties kept)
        self.train(linear.training)

    @property
    def pad(self) -> int:
        """Zero rows that make the output 16-byte aligned in 16-bit, for the weight as it is now: a tied
        weight resized in place (transformers' ``resize_token_embeddings`` replaces the embedding's
        ``weight.data``) changes the width, and a pad fixed at construction would no longer align it."""
        return (-self.weight.shape[0]) % 8

    @staticmethod
    def misaligned(out_features: int) -> bool:
        """Rows not 16-byte aligned in 16-bit (8 columns). fp32 counts too: under autocast its
        GEMM writes bf16/fp16 rows."""
        return out_features % 8 != 0

    @classmethod
    def wanted(cls, linear: torch.nn.Linear) -> bool:
        """optimize()'s test: a large layer whose 16-bit output rows are misaligned."""
        return cls.misaligned(linear.out_features) and linear.in_features * linear.out_features >= cls.MIN_WEIGHT

    def forward(self, x):
        n = self.weight.shape[0]  # the width F.linear gives (out_features is only an attribute)
        if n % 8 and x.is_cuda and x.dtype in _ALIGNED_DTYPES and x.numel() * n >= self.MIN_MACS:
            return self.padded_forward(x)
        return torch.nn.functional.linear(x, self.weight, self.bias)

    def padded_forward(self, x):
        """``F.linear`` computed at an aligned output width, then cut back to a view (on any device)."""
        n, pad = self.weight.shape[0], self.pad
        w = torch.nn.functional.pad(self.weight, (0, 0, 0, pad))
        b = None if self.bias is None else torch.nn.functional.pad(self.bias, (0, pad))
        return torch.nn.functional.linear(x, w, b)[..., :n]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", padded to {self.weight.shape[0] + self.pad}"


_ALIGNED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class RMSNorm(torch.nn.Module):
    """An RMSNorm written out in torch ops (transformers' LlamaRMSNorm: an fp32 upcast, ``pow``, ``mean``,
    ``rsqrt`` and two multiplies, six to eight kernels) run as torch's one ``F.rms_norm`` kernel, which
    computes in float32 and rounds once. ``optimize()`` builds it from a module whose computation it has
    checked (``cudnn_fuse.optimize``); cuDNN's norm graphs run no faster there (docs/decisions.md). Holds the
    module's own ``weight`` Parameter (state_dict unchanged); a call it does not cover (another dtype than
    the weight's, autocast, another width) runs the module's own forward."""

    def __init__(self, module: torch.nn.Module, eps: float):
        super().__init__()
        self.weight = module.weight  # the same Parameter
        self.eps = float(eps)
        self.__dict__["original"] = module  # unregistered: its weight is this module's
        self.train(module.training)

    def forward(self, x):
        w = self.weight
        if self.eps is not None and isinstance(x, torch.Tensor) and x.dtype == w.dtype and x.device == w.device \
                and x.shape[-1:] == w.shape and not _autocast():
            return torch.nn.functional.rms_norm(x, w.shape, w, self.eps)
        original = self.__dict__["original"]
        if original.weight is not w:  # moved or replaced on this module since
            original.weight = w
        return original(x)

    def __setattr__(self, name: str, value) -> None:
        """An attribute of the module it replaces (``variance_epsilon``) is set there, and from then on that
        module's own forward runs: the setting may change what it computes (its epsilon)."""
        original = self.__dict__.get("original")
        if original is not None and name in vars(original) and name not in self.__dict__:
            setattr(original, name, value)
            self.__dict__["eps"] = None
            return
        super().__setattr__(name, value)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # what callers read of the module it replaces (variance_epsilon, ...)
            original = self.__dict__.get("original")
            if original is None:  # mid-copy or mid-unpickling
                raise
            return getattr(original, name)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, replaces {type(self.__dict__['original']).__name__}"
