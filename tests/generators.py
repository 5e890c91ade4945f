"""Hypothesis strategies for keys, values and norms, special values included."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import strategies as st

from mlx_knorm.validation import FLOAT_DTYPES as DTYPES

DIMS = [1, 2, 3, 7, 31, 33, 64, 80, 96, 112, 128, 256]
PALETTES = ["normal", "ties", "special", "large", "subnormal", "zeros"]

_LARGE = {"float16": 6.0e4, "bfloat16": 1.0e30, "float32": 1.0e30}
_TINY = {"float16": 3.0e-7, "bfloat16": 1.0e-39, "float32": 1.0e-42}


def fill(rng: np.random.Generator, shape, palette: str, dtype_name: str) -> mx.array:
    """An array of ``shape`` whose values follow ``palette``."""
    if palette == "normal":
        x = rng.standard_normal(shape)
    elif palette == "ties":
        x = rng.integers(-2, 3, size=shape).astype(np.float64)
    elif palette == "special":
        x = rng.standard_normal(shape)
        specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0])
        mask = rng.random(shape) < 0.2
        x[mask] = rng.choice(specials, size=int(mask.sum()))
    elif palette == "large":
        x = rng.uniform(-1.0, 1.0, size=shape) * _LARGE[dtype_name]
    elif palette == "subnormal":
        x = rng.uniform(-4.0, 4.0, size=shape) * _TINY[dtype_name]
    else:
        x = np.zeros(shape)
    return mx.array(x.astype(np.float32)).astype(DTYPES[dtype_name])


def fill_norms(rng: np.random.Generator, shape, palette: str) -> mx.array:
    """float32 norms as a caller may pass them: any float, NaN, -0 and ties included."""
    if palette == "ties":
        x = rng.integers(0, 3, size=shape).astype(np.float32)
    elif palette == "special":
        x = np.abs(rng.standard_normal(shape)).astype(np.float32)
        specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0], dtype=np.float32)
        mask = rng.random(shape) < 0.25
        x[mask] = rng.choice(specials, size=int(mask.sum()))
    elif palette == "zeros":
        x = np.where(rng.random(shape) < 0.5, np.float32(0.0), np.float32(-0.0))
    else:
        x = np.abs(rng.standard_normal(shape)).astype(np.float32) * 10
    return mx.array(x.astype(np.float32))


@st.composite
def gather_cases(draw, max_rows=4, max_prior=40, max_new=40, dims=DIMS, long_rows=False):
    """Arguments of one protected_topk_gather call plus its configuration.

    ``long_rows`` also draws priors of 250-700 rows, which span several
    256-row chunks of the Metal kernel's compaction.
    """
    n_rows = draw(st.integers(1, max_rows))
    prior_sizes = st.integers(0, max_prior)
    if long_rows:
        prior_sizes = st.one_of(prior_sizes, st.integers(250, 700))
    n_prior = draw(prior_sizes)
    n_new = draw(st.integers(0, max_new))
    dim = draw(st.sampled_from(dims))
    # Multi-head latent attention stores keys and values of different widths.
    value_dim = draw(st.one_of(st.just(dim), st.sampled_from(dims)))
    n_total = n_prior + n_new
    budget = draw(
        st.one_of(
            st.integers(1, max(1, n_total + 2)),
            st.integers(max(1, n_total - 3), n_total + 1),
        ).filter(lambda b: b >= 1)
    )
    n_sink = draw(st.integers(0, budget - 1))
    recent = draw(st.integers(0, budget - 1 - n_sink))
    keep = draw(st.sampled_from(["low", "high"]))
    key_dtype = draw(st.sampled_from(sorted(DTYPES)))
    value_dtype = draw(st.sampled_from([key_dtype, "float16", "float32"]))
    palette = draw(st.sampled_from(PALETTES))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    arrays = (
        fill(rng, (n_rows, n_prior, dim), palette, key_dtype),
        fill(rng, (n_rows, n_prior, value_dim), "normal", value_dtype),
        fill_norms(rng, (n_rows, n_prior), palette),
        fill(rng, (n_rows, n_new, dim), palette, key_dtype),
        fill(rng, (n_rows, n_new, value_dim), "normal", value_dtype),
        fill_norms(rng, (n_rows, n_new), palette),
    )
    return arrays, (budget, n_sink, recent, keep)


def _cache_positions(rng, filled, offset, n_sink, recent, layout):
    """Distinct positions below ``offset`` for ``filled`` slots, the sinks and
    the recent window among them, as the cache stores them: any slot order
    for the slot layout, ascending for the temporal one."""
    must = sorted(set(range(min(n_sink, offset))) | set(range(max(0, offset - recent), offset)))
    rest = np.setdiff1d(np.arange(offset), must)
    chosen = np.concatenate([must, rng.choice(rest, size=filled - len(must), replace=False)])
    chosen = np.sort(chosen) if layout == "temporal" else rng.permutation(chosen)
    return chosen.astype(np.int32)


@st.composite
def step_cases(draw, cache_like=True, max_heads=3, max_budget=24, max_new=6, dims=DIMS, long_rows=False):
    """Arguments of one evict_and_fill call: ``(arrays, config)``.

    ``cache_like``: states the cache produces (distinct positions below
    ``offset`` with the sinks and the recent window present, shuffled slots
    for the slot layout, sorted for the temporal one), decode steps
    (``filled = budget + 1``) drawn often. Otherwise anything the op
    accepts: random and duplicate positions, any ``offset`` and ``filled``.
    Slots past ``filled`` hold garbage in both. ``long_rows`` also draws
    budgets of 250-700, which span several 256-row chunks of the Metal
    kernel.
    """
    n_heads = draw(st.integers(1, max_heads))
    budgets = st.integers(1, max_budget)
    if long_rows:
        budgets = st.one_of(budgets, st.integers(250, 700))
    budget = draw(budgets)
    n_sink = draw(st.integers(0, budget - 1))
    recent = draw(st.integers(0, budget - 1 - n_sink))
    keep = draw(st.sampled_from(["low", "high"]))
    layout = draw(st.sampled_from(["slots", "temporal"]))
    n_new = draw(st.integers(0, max_new))
    filled = draw(st.one_of(
        st.just(budget + 1),  # a decode step: one row leaves
        st.integers(budget + 2, budget + max_new + 2),  # several leave
        st.integers(0, budget + max_new + 2),
    ))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if cache_like:
        offset = filled + draw(st.integers(0, 2 * budget))
        must = len(set(range(min(n_sink, offset))) | set(range(max(0, offset - recent), offset)))
        filled = max(filled, must)
    else:
        offset = draw(st.integers(0, budget + 8))
    slots = filled + draw(st.integers(0, 3))
    kept = min(filled, budget)
    capacity = draw(st.sampled_from(sorted({max(slots, kept + n_new), kept + n_new, kept + n_new + 2})))
    key_dim = draw(st.sampled_from(dims))
    value_dim = draw(st.one_of(st.just(key_dim), st.sampled_from(dims)))
    key_dtype = draw(st.sampled_from(sorted(DTYPES)))
    value_dtype = draw(st.sampled_from(sorted(DTYPES)))
    palette = draw(st.sampled_from(PALETTES))
    positions = rng.integers(-(2**31), 2**31, size=(n_heads, slots), dtype=np.int64).astype(np.int32)
    for n in range(n_heads):
        if cache_like:
            positions[n, :filled] = _cache_positions(rng, filled, offset, n_sink, recent, layout)
        else:
            positions[n, :filled] = rng.integers(-3, offset + 4, size=filled)
    arrays = (
        fill(rng, (n_heads, slots, key_dim), palette, key_dtype),
        fill(rng, (n_heads, slots, value_dim), "special", value_dtype),
        fill_norms(rng, (n_heads, slots), palette),
        mx.array(positions),
        fill(rng, (n_heads, n_new, key_dim), palette, key_dtype),
        fill(rng, (n_heads, n_new, value_dim), "special", value_dtype),
    )
    config = dict(
        filled=filled, offset=offset, capacity=capacity, budget=budget,
        n_sink=n_sink, recent=recent, keep=keep, layout=layout,
    )
    return arrays, config
