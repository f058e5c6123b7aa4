"""Project exceptions."""


class UnsupportedError(RuntimeError):
    """cuDNN cannot run this spec (no engine, an unsupported layout or dtype).

    The ops turn it into a logged fallback to the PyTorch reference; it never
    reaches the user.
    """
