"""docs/spec.md §3 and §4 written as plainly as possible, for checking the
backends.

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


def eviction_rank(norms, positions, offset, n_sink, recent, keep, valid):
    """docs/spec.md §4 step 1 at ``offset``: a slot's key in the rank, first
    kept to first evicted (protected rows, then evictable ones by score,
    NaN last, then padding; equal keys by position, then slot)."""
    lo, hi = (0, math.inf) if valid is None else valid
    end = min(offset, hi)

    def rank(s: int):
        p = positions[s]
        if valid is not None and not lo <= p < hi:
            return (2, False, 0.0, p, s)
        if p < lo + n_sink or p >= end - recent:
            return (0, False, 0.0, p, s)
        score = norms[s] if keep == "low" else -norms[s]
        nan = math.isnan(score)
        return (1, nan, 0.0 if nan else score, p, s)

    return rank


def evict_and_fill_sources(
    norms: list[float],
    positions: list[int],
    filled: int,
    offset: int,
    budget: int,
    n_sink: int,
    recent: int,
    keep: str,
    layout: str,
    valid: tuple[int, int] | None = None,
) -> list[int]:
    """docs/spec.md §4 steps 0-2 for one head: the input slot of the row
    that lands in each output slot of ``[0, kept)``. ``valid``: the head's
    ``(lo, hi)``; None, every row real."""
    slots = range(filled)
    rank = eviction_rank(norms, positions, offset, n_sink, recent, keep, valid)
    kept_set = set(sorted(slots, key=rank)[:budget])
    kept_in_order = [s for s in slots if s in kept_set]
    if layout == "temporal":
        return kept_in_order
    kept = len(kept_in_order)
    movers = [s for s in kept_in_order if s >= kept]
    return [s if s in kept_set else movers.pop(0) for s in range(kept)]


def order_tree(
    norms: list[float],
    positions: list[int],
    n_slots: int,
    count: int,
    next_offset: int,
    n_sink: int,
    recent: int,
    keep: str,
    valid: tuple[int, int] | None = None,
) -> list[list[int]]:
    """docs/spec.md §4 step 4 for one head: its two halves, each
    ``n_slots + 1`` entries, over output rows of which slots ``[0, count)``
    are occupied, for the step at ``next_offset``."""
    lo, hi = (0, math.inf) if valid is None else valid
    end = min(next_offset, hi)
    rank = eviction_rank(norms, positions, next_offset, n_sink, recent, keep, valid)

    def real(s):
        return valid is None or lo <= positions[s] < hi

    def window(s: int) -> bool:
        return s < count and real(s) and positions[s] >= end - recent

    def eviction_key(s):
        return (s < count, rank(s) if s < count else (), s)

    def window_key(s):
        return (not window(s), positions[s] if window(s) else 0, s)

    halves = []
    for best, stamp in ((lambda a, b: max(a, b, key=eviction_key), count),
                        (lambda a, b: min(a, b, key=window_key), next_offset)):
        def winner(node):
            return node - n_slots if node >= n_slots else best(winner(2 * node), winner(2 * node + 1))

        half = [stamp] + [winner(i) for i in range(1, n_slots)]
        if n_slots >= 1:
            half.append(winner(1) if n_slots >= 2 else 0)
        halves.append(half)
    return halves


def _f32(x) -> "np.float32":
    import numpy as np

    return np.float32(x)


def row_scores(keys, values, state, scorer: str, offset: int = 0, valid=None):
    """docs/spec.md §2a for one head, element by element in numpy float32:
    ``keys [S, D]`` (and ``values [S, D_v]``) as float32 arrays, ``state
    [D]`` float32, ``valid`` a ``(lo, hi)`` pair. Returns ``(scores, state)``."""
    import numpy as np

    tiny = np.float32(2.0**-126)
    nan = np.uint32(0x7FC00000).view(np.float32)

    def flush(x):
        x = np.float32(x)
        return np.float32(0.0) if abs(x) < tiny else x

    def canonical(x):
        return nan if np.isnan(x) else np.float32(x)

    def pinned_sum(terms):
        width = 1
        while width < len(terms):
            width *= 2
        t = [np.float32(x) for x in terms] + [np.float32(0.0)] * (width - len(terms))
        while len(t) > 1:
            half = len(t) // 2
            t = [flush(t[i] + t[i + half]) for i in range(half)]
        return t[0]

    def norm(x):
        with np.errstate(invalid="ignore", over="ignore"):
            return canonical(np.sqrt(pinned_sum([flush(np.float32(a) * np.float32(a)) for a in x])))

    def dot(x, y):
        with np.errstate(invalid="ignore", over="ignore"):
            return pinned_sum([flush(np.float32(a) * np.float32(b)) for a, b in zip(x, y)])

    total = None if state is None else [np.float32(x) for x in state]
    scores = []
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for j, k in enumerate(keys):
            real = valid is None or valid[0] <= offset + j < valid[1]
            score = np.float32(0.0)
            if scorer == "knorm":
                score = norm(k)
            elif scorer == "vnorm":
                score = canonical(flush(norm(k) / norm(values[j])))
            elif scorer == "qfilter":
                score = canonical(flush(-dot(k, total)))
            elif real:
                n = norm(k)
                if not np.isfinite(n):
                    score = nan
                else:
                    d = flush(n * norm(total))
                    if d != 0:
                        score = canonical(flush(dot(k, total) / d))
                    if n != 0:
                        total = [flush(m + flush(np.float32(a) / n)) for m, a in zip(total, k)]
            scores.append(score if real else np.float32(0.0))
    return np.array(scores, dtype=np.float32), None if total is None else np.array(total, dtype=np.float32)
