"""What long command-line work shows: a progress bar with counts and ETA, and readable tables.

Used by the CLI verbs and by pre-warming. The library itself never prints: these write to the
stream they are given (stderr for bars), only when a command asks for them.
"""

from __future__ import annotations

import sys
import time
from typing import Sequence


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns, two spaces apart, a dashed rule under the headers."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(row) for row in cells[1:]])


def human_bytes(n) -> str:
    """1536 -> "1.5 KiB"."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # unreachable


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Bar:
    """Progress of ``done`` out of ``total`` on a stream (stderr by default): counts, percentage,
    elapsed time and ETA. On a terminal one line redrawn in place; elsewhere (a log file, a pipe,
    CI) a plain line at the start, at each quarter and at the end, so that a log holds a few
    readable lines rather than every frame joined by carriage returns."""

    STEPS = 4  # plain lines between the first and the last, off a terminal

    def __init__(self, label: str, stream=None, width: int = 30):
        # stderr is looked up now, not at import: a redirected stderr (tests, a caller) gets the bar
        self.label, self.stream, self.width, self.t0 = label, stream or sys.stderr, width, time.perf_counter()
        self.tty = _is_terminal(self.stream)
        self._said = -1  # off a terminal: the last quarter written

    def sub(self, what: str) -> "Bar":
        """A bar of its own for nested work (a 1x1 conv's GEMM, tuned as a matmul)."""
        return Bar(f"{self.label} ({what})", self.stream, self.width)

    def __call__(self, done: int, total: int) -> None:
        frac = done / total if total > 0 else 1.0  # nothing to do is all done: the line ends
        elapsed = time.perf_counter() - self.t0
        eta = 0.0 if done >= total else elapsed / done * (total - done) if done else float("nan")
        eta_s = f"{eta:5.1f}s" if eta == eta else "   ?s"
        counts = f"{done}/{total} {100 * frac:3.0f}% {elapsed:5.1f}s elapsed, eta {eta_s}"
        if self.tty:
            bar = "#" * int(frac * self.width)
            self.stream.write(f"\r{self.label} [{bar:<{self.width}}] {counts}")
            if done >= total:
                self.stream.write("\n")
        else:
            step = self.STEPS if done >= total else int(frac * self.STEPS)
            if step <= self._said:
                return
            self._said = step
            self.stream.write(f"{self.label}: {counts}\n")
        self.stream.flush()
