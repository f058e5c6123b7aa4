"""Project exceptions."""


class UnsupportedError(RuntimeError):
    """cuDNN cannot run this spec (no engine, an unsupported layout or dtype).

    The ops turn it into a logged fallback to the PyTorch reference; it never
    reaches the user.
    """


class ArgumentError(ValueError, RuntimeError):
    """A bad argument value (mismatched shapes, an unknown activation, a slope without leaky_relu, ...)
    given to an op, a ``cudnn_fuse.nn`` module or ``optimize()``; its message names the argument
    and shows its value(s).

    A ValueError, as the contract says, and a RuntimeError too: torch raises RuntimeError for a bad
    call (``F.conv2d`` of mismatched channels, ``torch.matmul`` of mismatched inner dimensions), so
    code written around torch's ops (``except RuntimeError``) catches cf's errors in the same places,
    as ``torch.OutOfMemoryError`` is a RuntimeError. Bad types (a non-tensor operand, a non-bool
    flag) stay TypeError.
    """
