"""FP8 training recipes and the FP8 linear's autograd.

A recipe turns a tensor's amax into the factor that maps it onto an FP8 format (``scale``: the tensor is
multiplied by it before the cast, and the GEMM divides by it), as TransformerEngine and torchao do:

- ``Float8CurrentScaling``: from the amax of the tensor being cast, this step;
- ``DelayedScaling``: from the history of earlier steps' amaxes (their max, or the most recent),
  this step's amax joining the history after its cast.

``scale = fp8_max / amax / 2**margin``; an amax of 0, inf or NaN keeps the previous scale (1 at first).
Under torch.distributed, ``DelayedScaling`` max-reduces the amaxes of a whole training step across ranks
in one all_reduce, when the next step's first cast comes, so that every rank scales alike; current
scaling uses each rank's own amax (a reduction per cast would cost a collective per tensor).
"hybrid" casts the forward's X and W to E4M3 and the backward's dY to E5M2; "e4m3" casts all three to
E4M3. On a GPU with FP8 GEMMs (compute capability 8.9 or newer) the linear's three GEMMs are FP8 GEMMs
(fp8_gemm.py); elsewhere, or where K or N is not a multiple of 16, they dequantize and multiply in
float32, what an FP8 GEMM with float32 accumulation computes.

A layer pays for FP8 where its GEMMs are large: the casts are passes over X, W and dY, and each FP8 GEMM
and cast costs host time a call. So the first call of a layer's shape on the GPU times both ways once
(``pays``: the layer's FP8 casts and GEMMs against torch's bfloat16 GEMMs, forward and, when training,
backward), and a shape measured slower in FP8 runs in bfloat16, logged once with the figures.
"""

from __future__ import annotations

import copy
import logging
import time

import torch

from . import fp8_cast, fp8_gemm
from .autotune import runoff
from .errors import ArgumentError
from .reference import activation as torch_activation

log = logging.getLogger(__name__)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMATS = {"hybrid": (E4M3, E5M2), "e4m3": (E4M3, E4M3)}
ROLES = ("x", "w", "dy")  # the tensors a linear casts, in the order of its scale buffer


scale_from_amax = fp8_cast.scale_from_amax  # fp8_max / amax / 2**margin, or the previous scale


def _int_arg(where: str, name: str, value, low: int) -> int:
    """``value`` where it is an int of at least ``low``: TypeError for another type (a bool included),
    ArgumentError for a smaller int."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < low:
        raise ArgumentError(f"{where}{name} must be {'positive' if low == 1 else 'at least ' + str(low)}, "
                            f"got {name}={value!r}")
    return value


def _choice(where: str, name: str, value, choices) -> str:
    """``value`` where it is one of the strings ``choices``: TypeError for a non-string, else ArgumentError."""
    if not isinstance(value, str):
        raise TypeError(f"{where}{name} must be a str, one of {sorted(choices)}, got {type(value).__name__}")
    if value not in choices:
        raise ArgumentError(f"{where}{name} must be one of {sorted(choices)}, got {value!r}")
    return value


def quantize_fp8(t: torch.Tensor, dtype=E4M3, margin: int = 0) -> tuple:
    """(``t`` cast to the FP8 ``dtype`` with a per-tensor scale from its own amax, the float32 dequantization
    factor of one element): the operands ``scaled_mm`` and ``scaled_dot_product_attention_fp8`` take, in two
    passes over ``t`` (its amax, then one kernel that scales, saturates and casts). The scale is
    ``fp8_max / amax / 2**margin``; a tensor whose amax is 0, inf or NaN is cast with scale 1."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"quantize_fp8: t must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point() or t.dtype in fp8_gemm.FP8_DTYPES:
        raise ArgumentError(f"quantize_fp8: t must be a floating-point tensor that is not FP8, got t.dtype={t.dtype}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"quantize_fp8: dtype must be a torch.dtype, got {type(dtype).__name__} ({dtype!r})")
    if dtype not in (E4M3, E5M2):
        raise ArgumentError(f"quantize_fp8: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype!r}")
    _int_arg("quantize_fp8: ", "margin", margin, 0)
    scale = torch.ones((), dtype=torch.float32, device=t.device)  # kept where the amax is not finite and positive
    q, _, _, inv = fp8_cast.cast_scaled(t, dtype, fp8_gemm.fast_amax(t), scale, margin, own_amax=False)
    return q, inv


class _Recipe:
    def __init__(self, margin: int = 0, fp8_format: str = "hybrid"):
        where = f"{type(self).__name__}: "
        self.margin = _int_arg(where, "margin", margin, 0)
        self.fp8_format = _choice(where, "fp8_format", fp8_format, FORMATS)

    def formats(self) -> tuple:
        """(forward format, backward format)."""
        return FORMATS[self.fp8_format]

    history_len = 1
    scales_from_history = False  # DelayedScaling: its scale is known before the tensor's amax

    def source(self, amax, history):
        """The amax this cast's scale derives from: the tensor's own (``amax``), or its ``history``'s."""
        return amax

    def scale(self, amax, history, previous, fmt):
        """The scale a cast multiplies by, from ``amax`` (the tensor's) or ``history``; ``previous`` where
        that amax is 0, inf or NaN."""
        return scale_from_amax(self.source(amax, history), fmt, self.margin, previous)

    def before_cast(self, history, i) -> None:  # recipes with cross-rank amaxes (DelayedScaling) override these
        pass

    def after_cast(self, history, i) -> None:
        pass

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


class Float8CurrentScaling(_Recipe):
    """Each tensor's scale from its own amax, this step (TransformerEngine's and torchao's default)."""


class DelayedScaling(_Recipe):
    """Each tensor's scale from the amaxes of the last ``amax_history_len`` steps (``amax_compute_algo``
    "max" or "most_recent"); this step's amax joins the history after its cast."""

    def __init__(self, margin: int = 0, amax_history_len: int = 1024, amax_compute_algo: str = "max",
                 fp8_format: str = "hybrid"):
        super().__init__(margin, fp8_format)
        where = f"{type(self).__name__}: "
        self.amax_history_len = _int_arg(where, "amax_history_len", amax_history_len, 1)
        self.amax_compute_algo = _choice(where, "amax_compute_algo", amax_compute_algo, ("max", "most_recent"))

        self._pending: dict = {}  # (id(history), role) -> (history, role) of the amaxes pushed since the last reduction

    scales_from_history = True

    @property
    def history_len(self) -> int:
        return self.amax_history_len

    def __getstate__(self):  # a copied or pickled recipe starts with nothing pending (the rows are the old model's)
        return {**self.__dict__, "_pending": {}}

    @staticmethod
    def _reducing() -> bool:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def before_cast(self, history: torch.Tensor, i: int) -> None:
        """Reduce the pending amaxes when this role's last one is among them: its next cast is a new step."""
        if (id(history), i) in self._pending:
            self.reduce_amaxes()

    def after_cast(self, history: torch.Tensor, i: int) -> None:
        if self._reducing():
            self._pending[(id(history), i)] = (history, i)

    def reduce_amaxes(self) -> None:
        """Max-reduce across ranks every amax pushed since the last reduction, in one all_reduce: every
        layer's x, w and dY of a training step, reduced when the step after begins (a rank's own amaxes
        would give each rank other scales). Called by the casts; a user may call it at a step's end."""
        pending, self._pending = list(self._pending.values()), {}
        if not pending or not self._reducing():
            return
        import torch.distributed as dist

        with torch.no_grad():
            vals = torch.stack([h[i, 0] for h, i in pending])
            dist.all_reduce(vals, op=dist.ReduceOp.MAX)
            for (h, i), v in zip(pending, vals):
                h[i, 0] = v

    def source(self, amax, history):
        """The amax of ``history`` (newest first; zeros where no step has been) before ``amax`` joins."""
        return history[0] if self.amax_compute_algo == "most_recent" else history.amax()


def check_recipe(recipe) -> None:
    if recipe is not None and not isinstance(recipe, _Recipe):
        raise TypeError(f"fp8 must be None, cf.Float8CurrentScaling() or cf.DelayedScaling(), got {recipe!r}")


class Casts:
    """A module's FP8 state: per role (x, w, dy) its current scale and amax history, in buffers the module
    owns (``scales``: [3]; ``history``: [3, history_len], newest first)."""

    def __init__(self, recipe, scales: torch.Tensor, history: torch.Tensor):
        # every call casts the weight anew: an update in place need not show (fused optimizers step without
        # bumping the tensor's version counter), and a cast kept across calls would serve the old values
        self.recipe, self.scales, self.history = recipe, scales, history

    def cast(self, t: torch.Tensor, role: str, fmt) -> tuple:
        """(``t`` cast to ``fmt`` with its role's scale, the dequantization factor 1 / scale as a [1]
        tensor); the state is updated in place: the scale this cast used, the amax pushed into the
        history."""
        q, _, inv = self._cast(t, role, fmt, False)
        return q, inv

    def cast_t(self, t: torch.Tensor, role: str, fmt) -> tuple:
        """(the cast of 2-D ``t``, its transpose contiguous, the dequantization factor): both from one pass
        over ``t``, the layouts an FP8 GEMM needs of an operand it reduces along either dimension."""
        return self._cast(t, role, fmt, True)

    def _cast(self, t: torch.Tensor, role: str, fmt, transpose: bool) -> tuple:
        i, recipe = ROLES.index(role), self.recipe
        recipe.before_cast(self.history, i)
        if recipe.scales_from_history:  # the scale is known before the cast: one pass casts and takes the amax
            src = recipe.source(None, self.history[i])
            q, qt, amax, inv = fp8_cast.cast_scaled(t, fmt, src, self.scales[i], recipe.margin, None, transpose)
            self._push(i, amax)
        else:  # the scale needs this tensor's amax first; a one-step history is written by the cast
            amax = fp8_gemm.fast_amax(t)
            last = self.history[i, 0] if self.history.shape[1] == 1 else None
            q, qt, _, inv = fp8_cast.cast_scaled(t, fmt, amax, self.scales[i], recipe.margin, last, transpose,
                                                 own_amax=False)
            if last is None:
                self._push(i, amax)
        recipe.after_cast(self.history, i)
        return q, qt, inv

    def _push(self, i: int, amax) -> None:
        """``amax`` into role ``i``'s history, newest first."""
        with torch.no_grad():
            self.history[i] = torch.roll(self.history[i], 1)
            self.history[i, 0] = amax


def gemm(aq: torch.Tensor, da: torch.Tensor, bq: torch.Tensor, db: torch.Tensor, out_dtype, bias=None,
         activation=None, residual=None, negative_slope: float = 0.01):
    """``act((aq * da) @ (bq * db) + bias + residual)`` as ``out_dtype``, from FP8 ``aq`` [M, K] and ``bq``
    [K, N] and their dequantization factors ``da`` and ``db`` ([1] each; ``residual`` [M, N]): an FP8 GEMM with that epilogue on a
    GPU that has them (``bq`` K-major, as Hopper's FP8 GEMMs want: the callers pass transposed copies),
    where K and N are multiples of 16; else the dequantized operands in float32, what an FP8 GEMM with
    float32 accumulation computes."""
    if aq.is_cuda and aq.shape[1] % 16 == 0 and bq.shape[1] % 16 == 0 and fp8_gemm.fp8_capable(aq.device):
        y, _ = fp8_gemm.scaled_mm_2d(aq, bq, da, db, bias, activation, residual, out_dtype, None, False,
                                     negative_slope)
        return y
    y = (aq.float() * da) @ (bq.float() * db)
    y = y if bias is None else y + bias.float()
    y = y if residual is None else y + residual.float()
    return torch_activation(y, activation, negative_slope).to(out_dtype)


def linear(x, weight, bias, casts: "Casts", activation=None, residual=None, negative_slope: float = 0.01):
    """``act(x @ weightᵀ + bias + residual)`` with x and the weight cast to FP8 by ``casts``. With autograd,
    ``LinearFunction`` (its backward casts dY), then the residual and activation; without, one GEMM whose
    epilogue takes the bias, residual and activation where the engine has them."""
    operands = (x, weight, bias, residual)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in operands):
        y = LinearFunction.apply(x, weight, bias, casts)
        y = y if residual is None else y + residual
        return torch_activation(y, activation, negative_slope)
    fwd = casts.recipe.formats()[0]
    out_shape = (*x.shape[:-1], weight.shape[0])
    fused_residual = residual is not None and tuple(residual.shape) == out_shape and residual.dtype == x.dtype
    xq, x_inv = casts.cast(x.reshape(-1, x.shape[-1]), "x", fwd)
    wq, w_inv = casts.cast(weight, "w", fwd)
    if residual is not None and not fused_residual:  # a broadcast residual: added before the activation
        y = gemm(xq, x_inv, wq.t(), w_inv, x.dtype, bias).reshape(out_shape) + residual
        return torch_activation(y, activation, negative_slope)
    r2 = residual.reshape(-1, out_shape[-1]) if fused_residual else None
    return gemm(xq, x_inv, wq.t(), w_inv, x.dtype, bias, activation, r2, negative_slope).reshape(out_shape)


class LinearFunction(torch.autograd.Function):
    """y = dequant(x_q) @ dequant(w_q).T + bias; dx and dw from dY cast to the backward format. The three
    GEMMs are FP8 GEMMs on a GPU that has them (``gemm``). Hopper's FP8 GEMMs take both operands K-major,
    so each cast also writes its tensor's transpose (one pass, ``Casts.cast_t``): X·Wᵀ reads x_q and
    w_q, dY·W reads dy_q and w_qᵀ, dYᵀ·X reads dy_qᵀ and x_qᵀ; the forward keeps x_qᵀ and w_qᵀ."""

    @staticmethod
    def forward(ctx, x, weight, bias, casts):
        fwd, bwd = casts.recipe.formats()
        x2 = x.reshape(-1, x.shape[-1])
        xq, xqt, x_inv = casts.cast_t(x2, "x", fwd)
        wq, wqt, w_inv = casts.cast_t(weight, "w", fwd)
        y = gemm(xq, x_inv, wq.t(), w_inv, x.dtype, bias)
        ctx.save_for_backward(xqt, wqt, x_inv, w_inv)
        ctx.casts, ctx.bwd, ctx.shape, ctx.dtypes = casts, bwd, x.shape, (x.dtype, weight.dtype)
        ctx.has_bias = bias is not None
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        xqt, wqt, x_inv, w_inv = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dyq, dyqt, dy_inv = ctx.casts.cast_t(dy2, "dy", ctx.bwd)
        dx = gemm(dyq, dy_inv, wqt.t(), w_inv, ctx.dtypes[0]).reshape(ctx.shape)  # dY·W, over N
        dw = gemm(dyqt, dy_inv, xqt.t(), x_inv, ctx.dtypes[1])  # dYᵀ·X, over the tokens
        db = dy2.sum(0, dtype=torch.float32).to(ctx.dtypes[1]) if ctx.has_bias else None  # no float32 copy of dY
        return dx, dw, db, None



# the choice between FP8 and bfloat16 for a layer's shape: rounds timed alternately (ABBA), of REPEATS calls
# each, per shape once a process; FP8 stays unless it took MARGIN longer than bfloat16
PAYS_ROUNDS = 4
PAYS_REPEATS = 5
PAYS_MARGIN = 0.03
_paid: dict = {}  # (M's power-of-two bucket, K, N, dtypes, device, training, delayed) -> FP8 pays


def pays(x: torch.Tensor, weight: torch.Tensor, bias, recipe) -> bool:
    """Whether the linear of ``weight`` runs FP8 on rows like ``x``'s (only their number, dtype and device
    are read: fc2 of an MLP asks with fc1's input): measured once per shape (the rows by their power-of-two
    bucket) on a GPU with FP8 GEMMs, and remembered. A shape not yet measured runs FP8 untimed on the CPU's
    reference path, inside a capture (which a timing would break; a shape measured before keeps its
    choice there), and under torch.distributed (ranks timing apart could choose apart, and a delayed
    recipe's amax reduction needs every rank's casts); under torch.compile every shape runs FP8."""
    if torch.compiler.is_compiling() or x.dim() == 0:
        return True
    K, N = weight.shape[1], weight.shape[0]
    M = x.numel() // max(x.shape[-1], 1)
    training = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    key = (1 << max(M - 1, 0).bit_length(), K, N, x.dtype, weight.dtype, x.device.index, training,
           recipe.scales_from_history)
    got = _paid.get(key)
    if got is not None:
        return got
    if not _timeable(x):
        return True
    try:
        fp8_ms, bf16_ms = _timed(M, x.dtype, weight.detach(), None if bias is None else bias.detach(), recipe,
                                 training)
    except Exception as e:  # noqa: BLE001 - a timing that cannot run leaves the FP8 the user asked for
        log.debug("FP8 linear %dx%d->%d not timed (%s: %s): FP8", M, K, N, type(e).__name__, e)
        got = True
    else:
        got = fp8_ms <= bf16_ms * (1.0 + PAYS_MARGIN)
        if not got:
            log.info("FP8 linear %dx%d->%d%s: bfloat16 runs it (%.3f ms a call against FP8's %.3f ms)", M, K, N,
                     " (training)" if training else "", bf16_ms, fp8_ms)
    _paid[key] = got
    return got


def _timeable(x: torch.Tensor) -> bool:
    return x.is_cuda and fp8_gemm.fp8_capable(x.device) and not torch.cuda.is_current_stream_capturing() and \
        not DelayedScaling._reducing()


def _timed(M: int, dtype, w, bias, recipe, training: bool) -> tuple:
    """(FP8 ms, bfloat16 ms) a call of the layer's GEMMs on random [M, K] rows: the forward and, when
    ``training``, the two backward GEMMs with dY's cast, each way's wall time over back-to-back calls
    (the longer of its device and its host time), on scratch FP8 state."""
    dev = w.device
    casts = Casts(copy.copy(recipe), torch.ones(3, device=dev), torch.zeros(3, recipe.history_len, device=dev))
    fwd, bwd = recipe.formats()
    x2 = torch.randn(M, w.shape[1], device=dev, dtype=dtype)
    dy = torch.randn(M, w.shape[0], device=dev, dtype=dtype) if training else None

    def fp8_call():
        if not training:  # the layer's own inference call (no autograd here)
            linear(x2, w, bias, casts)
            return
        xq, xqt, xd = casts.cast_t(x2, "x", fwd)
        wq, wqt, wd = casts.cast_t(w, "w", fwd)
        gemm(xq, xd, wq.t(), wd, x2.dtype, bias)
        dyq, dyqt, dyd = casts.cast_t(dy, "dy", bwd)
        gemm(dyq, dyd, wqt.t(), wd, x2.dtype)
        gemm(dyqt, dyd, xqt.t(), xd, w.dtype)

    def bf16_call():
        torch.nn.functional.linear(x2, w, bias)
        if training:
            torch.mm(dy, w)
            torch.mm(dy.t(), x2)

    def wall_ms(fn) -> float:
        torch.cuda.synchronize(x2.device)
        t0 = time.perf_counter()
        for _ in range(PAYS_REPEATS):
            fn()
        torch.cuda.synchronize(x2.device)
        return (time.perf_counter() - t0) * 1e3 / PAYS_REPEATS

    with torch.no_grad():
        for _ in range(2):  # plans, kernels and allocations made before the timing
            fp8_call()
            bf16_call()
        return runoff(lambda: wall_ms(fp8_call), lambda: wall_ms(bf16_call), PAYS_ROUNDS)
