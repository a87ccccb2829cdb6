"""The CPU micro-benchmarks' timer: the best of some calls after one warm-up, in milliseconds."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3
