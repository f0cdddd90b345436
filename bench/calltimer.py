"""Time one call at a time: the timer ``bench/allocator.py`` and ``bench/sglang_allocator.py``
share (the latter runs inside an SGLang environment: standard library only)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable


def time_calls(fn: Callable[[], object], reset: Callable[[], None], reps: int, warmup: int) -> list[float]:
    """Microseconds of ``reps`` calls of ``fn``, each alone (``perf_counter_ns``, the
    garbage collector off), ``reset`` (untimed) after each; ``warmup`` calls first,
    not recorded."""
    out = []
    clock = time.perf_counter_ns
    gc.disable()
    try:
        for _ in range(warmup):
            fn()
            reset()
        for _ in range(reps):
            t0 = clock()
            fn()
            t1 = clock()
            out.append((t1 - t0) / 1000.0)
            reset()
    finally:
        gc.enable()
    return out
