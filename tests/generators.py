"""Hypothesis strategies for keys, values, payloads, norms and valid ranges,
special values included."""

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


# Payload dtypes of every element size (docs/spec.md §5), as a quantized
# cache stores packed words, scales and biases, and more. Not float64: the
# GPU has none.
PAYLOAD_DTYPES = [
    mx.bool_, mx.uint8, mx.int8, mx.uint16, mx.int16, mx.float16, mx.bfloat16,
    mx.uint32, mx.int32, mx.float32, mx.uint64, mx.int64, mx.complex64,
]


def fill_bits(rng: np.random.Generator, shape, dtype: mx.Dtype) -> mx.array:
    """An array of ``shape`` and ``dtype`` holding random bits (bools 0 or 1)."""
    *lead, width = shape
    if dtype == mx.bool_:
        return mx.array(rng.integers(0, 2, size=shape).astype(bool))
    raw = rng.integers(0, 256, size=(*lead, width * dtype.size), dtype=np.uint8)
    return mx.array(raw).view(dtype)


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


def key_norms_arrays(rng: np.random.Generator, shape, *, palette: str = "normal",
                     dtype: str = "float32") -> list[mx.array]:
    """The arrays of one key_norms call: keys of ``shape`` (``[..., D]``)."""
    return [fill(rng, shape, palette, dtype)]


def protected_topk_gather_shapes(n_heads, n_prior, n_new, key_dim, value_dim) -> list[tuple]:
    """Shapes of protected_topk_gather's six arrays, in argument order."""
    return [
        (n_heads, n_prior, key_dim), (n_heads, n_prior, value_dim), (n_heads, n_prior),
        (n_heads, n_new, key_dim), (n_heads, n_new, value_dim), (n_heads, n_new),
    ]


def protected_topk_gather_arrays(
    rng: np.random.Generator, n_heads: int, n_prior: int, n_new: int, key_dim: int,
    value_dim: int | None = None, *, key_palette: str = "normal", value_palette: str = "normal",
    norm_palette: str = "normal", dtypes=("float16", "float32"), shape_changes=None,
) -> list[mx.array]:
    """The arrays of one protected_topk_gather call: prior keys, values and
    norms, then the new block's. ``dtypes`` are the keys' and the values';
    ``shape_changes`` maps an argument index to the shape it takes instead
    (an invalid relation, for the checks)."""
    shapes = protected_topk_gather_shapes(n_heads, n_prior, n_new, key_dim,
                                          key_dim if value_dim is None else value_dim)
    shapes = [(shape_changes or {}).get(i, shape) for i, shape in enumerate(shapes)]
    palettes = (key_palette, value_palette)
    return [
        fill_norms(rng, shape, norm_palette) if i % 3 == 2 else fill(rng, shape, palettes[i % 3], dtypes[i % 3])
        for i, shape in enumerate(shapes)
    ]


def evict_and_fill_shapes(n_heads, slots, n_new, key_dim, value_dim, *, quantized: bool = False) -> list[tuple]:
    """Shapes of evict_and_fill's six arrays, in argument order; with
    ``quantized`` the ten flat arrays of ``evict_and_fill_arrays(...,
    quantized=True)``."""
    if quantized:
        return [
            (n_heads, slots, key_dim), (n_heads, slots, 2), (n_heads, slots, value_dim),
            (n_heads, slots), (n_heads, slots),
            (n_heads, n_new, key_dim), (n_heads, n_new, 2), (n_heads, n_new, value_dim),
            (n_heads, n_new), (n_heads, 2),
        ]
    return [
        (n_heads, slots, key_dim), (n_heads, slots, value_dim), (n_heads, slots), (n_heads, slots),
        (n_heads, n_new, key_dim), (n_heads, n_new, value_dim),
    ]


# The dtypes of evict_and_fill_arrays(..., quantized=True), in its order.
_QUANTIZED_DTYPES = [mx.uint32, mx.float16, mx.float16, mx.float32, mx.int32,
                     mx.uint32, mx.float16, mx.float16, mx.float32, mx.int32]


def _evict_and_fill_positions(rng, shape, positions, layout) -> mx.array:
    if not isinstance(positions, str):
        return mx.array(np.asarray(positions).astype(np.int32))
    if positions == "distinct":
        order = np.stack([rng.permutation(shape[-1]) for _ in range(int(np.prod(shape[:-1])))])
        order = np.sort(order, axis=1) if layout == "temporal" else order
        order = order.reshape(shape)
    elif positions == "equal":
        order = np.full(shape, 3)
    else:
        order = rng.integers(0, 9, size=shape)
    return mx.array(order.astype(np.int32))


def evict_and_fill_arrays(
    rng: np.random.Generator, n_heads: int, slots: int, n_new: int, key_dim: int,
    value_dim: int | None = None, *, positions="distinct", layout: str = "slots",
    key_palette: str = "normal", value_palette: str = "normal", norm_palette: str = "normal",
    dtypes=("float16", "float32"), shape_changes=None, norms: mx.array | None = None,
    positions_first: bool = False, quantized: bool = False,
) -> list[mx.array]:
    """The arrays of one evict_and_fill call: a cache's key, value, norm and
    position buffers of ``slots`` slots, then the new block's keys and values.
    ``positions``: ``"distinct"`` (each head a permutation of the slots,
    sorted for the temporal layout), ``"equal"`` (all 3: only the slot tells
    ranks apart), ``"random"`` (any of 0..8, repeats included) or the
    positions themselves; ``norms``: the stored norms instead of drawn ones;
    ``positions_first``: the positions drawn before the other arrays.
    ``shape_changes`` as in ``protected_topk_gather_arrays``.

    ``quantized``: the ten arrays of a quantized-style call, flat: keys as
    (packed uint32, float16 scales), float16 values, norms, positions, the
    new rows' three, their norms (``new_norms``) and the valid ranges
    (``valid``), all small integers (the palettes, dtypes and ``positions``
    do not apply)."""
    value_dim = key_dim if value_dim is None else value_dim
    shapes = evict_and_fill_shapes(n_heads, slots, n_new, key_dim, value_dim, quantized=quantized)
    shapes = [(shape_changes or {}).get(i, shape) for i, shape in enumerate(shapes)]
    if quantized:
        arrays = [mx.array(rng.integers(-1, 12, size=shape).astype(np.float32)).astype(dtype)
                  for shape, dtype in zip(shapes, _QUANTIZED_DTYPES)]
        arrays[9] = mx.array(rng.integers(0, 4, size=shapes[9]).astype(np.int32))
        return arrays
    drawn_positions = _evict_and_fill_positions(rng, shapes[3], positions, layout) if positions_first else None
    palettes = (key_palette, value_palette)
    arrays = []
    for i, shape in enumerate(shapes):
        if i == 2:
            arrays.append(fill_norms(rng, shape, norm_palette) if norms is None else norms)
        elif i == 3:
            arrays.append(drawn_positions if positions_first else
                          _evict_and_fill_positions(rng, shape, positions, layout))
        else:
            part = 0 if i in (0, 4) else 1
            arrays.append(fill(rng, shape, palettes[part], dtypes[part]))
    return arrays


@st.composite
def protected_topk_gather_cases(draw, max_rows=4, max_prior=40, max_new=40, dims=DIMS, long_rows=False):
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


def _payload_group(draw, rng, n_heads, slots, n_new, dims, first_floating=None):
    """One of ``keys``/``values`` as the tuple form: an array or a tuple of
    1-3 of any dtype and width, with its new rows."""
    count = draw(st.integers(1, 3))
    stored, new = [], []
    for i in range(count):
        if i == 0 and first_floating is not None:
            dtype = DTYPES[first_floating]
        else:
            dtype = draw(st.sampled_from(PAYLOAD_DTYPES))
        width = draw(st.sampled_from(dims))
        stored.append(fill_bits(rng, (n_heads, slots, width), dtype))
        new.append(fill_bits(rng, (n_heads, n_new, width), dtype))
    if count == 1 and draw(st.booleans()):
        return stored[0], new[0]
    return tuple(stored), tuple(new)


def _protected_real(offset, n_sink, recent, lo, hi) -> list[int]:
    """The real positions below ``offset`` that a batch cache's head with
    range ``[lo, hi)`` holds for sure: its sequence's sinks and recent
    window (docs/spec.md §4)."""
    end = min(offset, hi)
    start = max(lo, 0)
    sinks = range(start, max(start, min(end, lo + n_sink)))
    window = range(max(start, end - recent), max(start, end))
    return sorted(set(sinks) | set(window))


def _batch_positions(rng, filled, offset, n_sink, recent, lo, hi, layout):
    """``filled`` distinct positions below ``offset`` for a head of a batch
    whose real positions are ``[lo, hi)``: the sequence's own sinks and
    recent window among its real ones, the rest real or padding (left
    padding below ``lo``, right padding from ``hi``), as a batch cache
    holds them."""
    must = _protected_real(offset, n_sink, recent, lo, hi)
    rest = np.setdiff1d(np.arange(offset), must)
    chosen = np.concatenate([must, rng.choice(rest, size=filled - len(must), replace=False)])
    chosen = np.sort(chosen) if layout == "temporal" else rng.permutation(chosen)
    return chosen.astype(np.int32)


def _valid_range(draw, offset):
    """A head's (lo, hi): left padding below lo, right padding from hi
    (INT32_MAX while decoding), now and then an empty or an odd range."""
    lo = draw(st.integers(0, offset + 2))
    hi = draw(st.one_of(
        st.just(2**31 - 1),
        st.integers(lo, offset + 3),
        st.integers(-(2**31), 2**31 - 1),
    ))
    if draw(st.integers(0, 9)) == 0:
        lo = draw(st.integers(-(2**31), 2**31 - 1))
    return lo, hi


@st.composite
def evict_and_fill_cases(draw, cache_like=True, max_heads=3, max_budget=24, max_new=6, dims=DIMS,
               long_rows=False, payloads=False, ranges=False):
    """Arguments of one evict_and_fill call: ``(arrays, config)``.

    ``cache_like``: states the cache produces (distinct positions below
    ``offset`` with the sinks and the recent window present, shuffled slots
    for the slot layout, sorted for the temporal one), decode steps
    (``filled = budget + 1``) drawn often. Otherwise anything the op
    accepts: random and duplicate positions, any ``offset`` and ``filled``.
    Slots past ``filled`` hold garbage in both. ``long_rows`` also draws
    budgets of 250-700, which span several 256-row chunks of the Metal
    kernel.

    ``payloads``: keys and values in the tuple form too (any dtypes and
    widths, docs/spec.md §5), the new rows' norms given (``new_norms`` in
    ``config``) whenever the keys are not one floating array, and now and
    then when they are. ``ranges``: each head's valid range (``valid`` in
    ``config``); with ``cache_like``, positions as a batch cache holds them
    (the sequence's own sinks and recent window present, padding anywhere
    else).
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
    else:
        offset = draw(st.integers(0, budget + 8))
    valid = [_valid_range(draw, offset) for _ in range(n_heads)] if ranges else None
    if cache_like and ranges:
        filled = max([filled] + [len(_protected_real(offset, n_sink, recent, *v)) for v in valid])
    elif cache_like:
        must = len(set(range(min(n_sink, offset))) | set(range(max(0, offset - recent), offset)))
        filled = max(filled, must)
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
        if cache_like and ranges:
            lo, hi = valid[n]
            positions[n, :filled] = _batch_positions(rng, filled, offset, n_sink, recent, lo, hi, layout)
        elif cache_like:
            positions[n, :filled] = _cache_positions(rng, filled, offset, n_sink, recent, layout)
        else:
            positions[n, :filled] = rng.integers(-3, offset + 4, size=filled)
    config = dict(
        filled=filled, offset=offset, capacity=capacity, budget=budget,
        n_sink=n_sink, recent=recent, keep=keep, layout=layout,
    )
    norms = fill_norms(rng, (n_heads, slots), palette)
    if payloads and draw(st.booleans()):
        floating = draw(st.one_of(st.none(), st.sampled_from(sorted(DTYPES))))
        keys, new_keys = _payload_group(draw, rng, n_heads, slots, n_new, dims, floating)
        values, new_values = _payload_group(draw, rng, n_heads, slots, n_new, dims)
        computable = isinstance(keys, mx.array) and keys.dtype in DTYPES.values()
        if not computable or draw(st.booleans()):
            config["new_norms"] = fill_norms(rng, (n_heads, n_new), palette)
    else:
        keys = fill(rng, (n_heads, slots, key_dim), palette, key_dtype)
        values = fill(rng, (n_heads, slots, value_dim), "special", value_dtype)
        new_keys = fill(rng, (n_heads, n_new, key_dim), palette, key_dtype)
        new_values = fill(rng, (n_heads, n_new, value_dim), "special", value_dtype)
        if payloads and draw(st.integers(0, 3)) == 0:
            config["new_norms"] = fill_norms(rng, (n_heads, n_new), palette)
    if ranges:
        config["valid"] = mx.array(np.array(valid, dtype=np.int64).astype(np.int32).reshape(n_heads, 2))
    arrays = (keys, values, norms, mx.array(positions), new_keys, new_values)
    return arrays, config
