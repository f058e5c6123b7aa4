"""The environment variables a user sets, and the one module that reads them.

Every variable is read where it is used (a test or a process may set it before the first call),
through ``flag``, ``number`` or ``text``. A value that does not parse, or is out of range, is
logged (naming the variable) and the default used: a typo in one variable must not make
``import cudnn_fuse`` raise, nor turn a feature on.
"""

from __future__ import annotations

import logging
import math
import os

log = logging.getLogger(__name__)

CACHE_DIR = "CUDNN_FUSE_CACHE_DIR"
CACHE = "CUDNN_FUSE_CACHE"
AUTOTUNE = "CUDNN_FUSE_AUTOTUNE"
TUNE_BUDGET_S = "CUDNN_FUSE_TUNE_BUDGET_S"
WORKSPACE_CAP = "CUDNN_FUSE_WORKSPACE_CAP"
MAX_PLANS = "CUDNN_FUSE_MAX_PLANS"
TUNE_WAIT_S = "CUDNN_FUSE_TUNE_WAIT_S"
NATIVE = "CUDNN_FUSE_NATIVE"
LAUNCH_GRAPHS = "CUDNN_FUSE_LAUNCH_GRAPHS"
COMPILE_INLINE = "CUDNN_FUSE_COMPILE_INLINE"
BUILD_PROCESS = "CUDNN_FUSE_BUILD_PROCESS"

# name -> (default as a user would write it, what it does): the README's table lists exactly these
VARIABLES = {
    CACHE_DIR: ("user cache dir", "where the plan cache lives"),
    CACHE: ("1", "0: no disk cache (plans in memory only)"),
    AUTOTUNE: ("0", "1: time every candidate engine of a new plan and keep the fastest"),
    TUNE_BUDGET_S: ("10", "autotune time budget per graph, seconds"),
    WORKSPACE_CAP: ("1073741824", "autotune skips engines needing more workspace, bytes"),
    MAX_PLANS: ("1024", "plans kept in memory per process"),
    TUNE_WAIT_S: ("60", "how long a process waits for another one tuning the same plan, seconds (at most 3600)"),
    NATIVE: ("1", "0: memoized calls run in Python instead of the C extension"),
    LAUNCH_GRAPHS: ("1", "0: no launch-graph replays of repeated launches"),
    COMPILE_INLINE: ("conv2d,linear,matmul,sdpa", "ops torch.compile traces as their PyTorch expression"),
    BUILD_PROCESS: ("1", "0: plans of new sizes are built in the calling process, not a build process of their own"),
}

ON_WORDS = ("1", "true", "yes", "on")
OFF_WORDS = ("0", "false", "no", "off")


def parse_flag(raw) -> bool | None:
    """``raw`` as a switch: True for 1/true/yes/on, False for 0/false/no/off (any case, spaces
    ignored), None for anything else."""
    word = str(raw).strip().lower()
    if word in ON_WORDS:
        return True
    if word in OFF_WORDS:
        return False
    return None


def flag(var: str, default: bool) -> bool:
    """``$var`` as a switch (``parse_flag``); unset or blank: ``default``; anything else: ``default``
    with a warning."""
    raw = os.environ.get(var)
    if raw is None or not raw.strip():
        return default
    value = parse_flag(raw)
    if value is None:
        _warn_once(var, raw, "%s=%r: want one of %s or %s; using %s", var, raw, "/".join(ON_WORDS),
                   "/".join(OFF_WORDS), "1" if default else "0")
        return default
    return value


_warned: set = set()


def _warn_once(var: str, raw, msg: str, *args) -> None:
    """A bad value is said once per process, however often its variable is read."""
    if (var, raw) not in _warned:
        _warned.add((var, raw))
        log.warning(msg, *args)


def text(var: str, default: str | None = None) -> str | None:
    """``$var`` as it is set (``default`` where unset)."""
    return os.environ.get(var, default)


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
        _warn_once(var, raw, "%s=%r: want %s >= %s%s; using %s", var, raw, "an integer" if integer else "a number",
                   f"{minimum:g}", "" if maximum == math.inf else f" and <= {maximum:g}", default)
        return default
