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
