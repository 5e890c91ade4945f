"""docs/spec.md §3 written as plainly as possible, for checking the backends.

Slow (a Python sort per row) and independent of the package's code.
"""

from __future__ import annotations

import math


def kept_rows(norms: list[float], budget: int, n_sink: int, recent: int, keep: str) -> list[int]:
    n_total = len(norms)
    if n_total <= budget:
        return list(range(n_total))
    sinks = min(n_sink, n_total)
    tail = min(recent, n_total - sinks)
    middle = range(sinks, n_total - tail)

    def rank(j: int):
        score = norms[j] if keep == "low" else -norms[j]
        return (math.isnan(score), 0.0 if math.isnan(score) else score, j)

    chosen = sorted(middle, key=rank)[: budget - sinks - tail]
    return sorted([*range(sinks), *chosen, *range(n_total - tail, n_total)])
