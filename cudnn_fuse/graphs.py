"""CUDA graph capture of code that calls cudnn_fuse ops (or anything capturable).

``capture(fn, *example_inputs)`` warms ``fn`` up on a side stream (so every plan
is built, and every lazy initialisation done, before capture), captures one
call into a CUDA graph over static copies of the inputs, and returns a callable
that copies new inputs into those static buffers and replays the graph.
Plan.run binds the cuDNN handle to torch's current stream, which under
``torch.cuda.graph`` is the capture stream, so the executes are recorded there.

Autograd: a static input is a leaf that requires grad where its example input did, so a ``fn``
that runs a whole training step (forward, ``backward()``, ``optimizer.step()``, as torch's
"whole-network capture") captures the backward too and every replay repeats it. What ``fn``
returns comes back detached: the autograd graph recorded during the capture belongs to the capture,
and a backward through it outside a replay would read whichever replay last overwrote its saved
tensors, once (the second raises), and send input gradients to the example inputs.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


class CapturedGraph:
    """A replayable CUDA graph of ``fn`` over static input buffers.

    Calling it with tensors of the example inputs' shapes and dtypes copies them
    into the static inputs, replays, and returns the static outputs: the same
    tensors every time, overwritten by the next replay (clone what you keep).
    """

    def __init__(self, fn, example_inputs, warmup: int = 3, pool=None):
        _check_arguments(fn, example_inputs, warmup)
        if not torch.cuda.is_available():
            raise RuntimeError("capture: CUDA graphs need a CUDA GPU")
        self.fn = fn
        devices = []
        for i, x in enumerate(example_inputs):
            if isinstance(x, torch.Tensor):
                if not x.is_cuda:
                    raise ValueError(f"capture: example input {i} is on {x.device}; CUDA graphs need CUDA tensors")
                if x.device not in devices:
                    devices.append(x.device)
        if len(devices) > 1:  # one graph records one device's stream: the others' work would run once, not replay
            raise ValueError(f"capture: example inputs are on {len(devices)} devices ({', '.join(map(str, devices))}); "
                             "a CUDA graph captures one device: capture each device's part separately")
        # The capture records the current device's stream only: inputs on another GPU than the current one would
        # run their ops eagerly on that GPU's stream during capture, and every replay would return those values.
        self.device = devices[0] if devices else torch.device("cuda", torch.cuda.current_device())
        with torch.cuda.device(self.device):
            self.static_inputs = tuple(_static(x) for x in example_inputs)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(max(1, warmup)):
                    fn(*self.static_inputs)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                outputs = fn(*self.static_inputs)
            self.static_outputs = torch.utils._pytree.tree_map(_detached, outputs)

    def __call__(self, *inputs):
        if len(inputs) != len(self.static_inputs):
            raise ValueError(f"captured graph takes {len(self.static_inputs)} inputs, got {len(inputs)}")
        copies = []  # every input checked before any is copied: a refused call leaves the static inputs as they were
        for i, (static, new) in enumerate(zip(self.static_inputs, inputs)):
            if not isinstance(static, torch.Tensor):
                if new is not static and not _equal(new, static):
                    raise ValueError(f"captured graph: non-tensor input {i} changed ({static!r} -> {new!r}); capture again")
                continue
            if new is static:
                continue
            if not isinstance(new, torch.Tensor) or new.shape != static.shape or new.dtype != static.dtype:
                raise ValueError(f"captured graph: input {i} must be a tensor of shape {tuple(static.shape)} and dtype "
                                 f"{static.dtype}, got {getattr(new, 'shape', type(new).__name__)}")
            copies.append((static, new))
        # the copies and the replay on the graph's device's current stream; the copies record no autograd
        # history (a static input that requires grad is a leaf, which an in-place copy would refuse)
        with torch.cuda.device(self.device), torch.no_grad():
            for static, new in copies:
                static.copy_(new)
            self.graph.replay()
        return self.static_outputs

    def replay(self):
        """Replay with whatever the static inputs hold now."""
        with torch.cuda.device(self.device):
            self.graph.replay()
        return self.static_outputs


def _static(x):
    """The static buffer of an example input: a copy with no history, a leaf that requires grad
    where the example did (its gradients, in a captured backward, land in its ``.grad``)."""
    if not isinstance(x, torch.Tensor):
        return x
    return x.detach().clone().requires_grad_(x.requires_grad)


def _detached(out):
    return out.detach() if isinstance(out, torch.Tensor) and out.requires_grad else out


def _check_arguments(fn, example_inputs, warmup) -> None:
    if not callable(fn):
        raise TypeError(f"capture: fn must be callable, got {type(fn).__name__}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"capture: warmup must be a non-negative int (calls before the capture), got {warmup!r}")
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor) and any(
                isinstance(leaf, torch.Tensor) for leaf in torch.utils._pytree.tree_leaves(x)):
            # a list or dict of tensors would be captured as the caller's own tensors (never copied into
            # static buffers), and a later call's container could not be checked or copied
            raise TypeError(f"capture: example input {i} is a {type(x).__name__} holding tensors; pass each tensor "
                            "as its own argument (fn(*tensors)), so that its static buffer is copied into on replay")


def _equal(a, b) -> bool:
    """Whether a non-tensor input equals the captured one; an == that raises or is no bool counts as changed."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - e.g. numpy arrays' ambiguous truth value
        return False


def capture(fn, *example_inputs, warmup: int = 3) -> CapturedGraph:
    """Capture ``fn(*example_inputs)`` into one CUDA graph; returns a replaying callable."""
    return CapturedGraph(fn, example_inputs, warmup=warmup)
