"""Numeric settings read from the environment at import.

A value that does not parse, or is out of range, is logged (naming the variable) and the default
used: a typo in one variable must not make ``import cudnn_fuse`` raise in every command of a
process (before, ``CUDNN_FUSE_MAX_PLANS=abc`` did, with a ValueError that named no variable).
"""

from __future__ import annotations

import logging
import math
import os

log = logging.getLogger(__name__)


def number(var: str, default: float, *, minimum: float = 0.0, integer: bool = False, maximum: float = math.inf):
    """``$var`` as a number >= ``minimum`` and <= ``maximum`` (an int where ``integer``: "1073741824" or
    "1e9" alike), else ``default`` with a warning. NaN is refused; inf passes where it is not an integer
    and ``maximum`` is inf."""
    return parse(var, os.environ.get(var), default, minimum=minimum, integer=integer, maximum=maximum)


def parse(var: str, raw, default: float, *, minimum: float = 0.0, integer: bool = False, maximum: float = math.inf):
    """``number``'s reading of ``raw``, the value of ``var`` (None or blank: ``default``, silently)."""
    if raw is None or not raw.strip():
        return default
    try:
        v = float(raw)
        if integer:
            if not math.isfinite(v) or v != int(v):
                raise ValueError
            v = int(raw) if raw.strip().lstrip("+-").isdigit() else int(v)  # exact for long digit strings
        if not minimum <= v <= maximum:  # NaN compares False
            raise ValueError
        return v
    except (TypeError, ValueError, OverflowError):
        log.warning("%s=%r: want %s >= %s%s; using %s", var, raw, "an integer" if integer else "a number",
                    minimum, "" if maximum == math.inf else f" and <= {maximum:g}", default)
        return default
