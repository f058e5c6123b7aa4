"""Threads made to interleave: the CPU tests of races (lost updates, torn reads) run through here."""

from __future__ import annotations

import sys
import threading


def race(targets, tracer=None) -> None:
    """Run each callable in ``targets`` in its own thread, all joined, with a 1 µs switch interval so
    that the threads interleave as often as CPython lets them; ``tracer`` (a sys.settrace function)
    is set in every thread, to force switches between any two lines. The interval and the trace are
    restored whatever happens."""
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    if tracer is not None:
        threading.settrace(tracer)
    try:
        threads = [threading.Thread(target=t) for t in targets]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        if tracer is not None:
            threading.settrace(None)
        sys.setswitchinterval(switch)
