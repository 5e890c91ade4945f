"""The checks every change of an ``L2NormKVCache`` or a
``QuantizedL2NormKVCache`` goes through (docs/spec.md §8): a whole state,
as it is loaded (``check_state``), and a block that ``update_and_fetch``
absorbs (``check_block``), from which the step builds a state that passes
``check_state`` by construction. So what a cache accepts is what
``save_prompt_cache`` writes and ``load_prompt_cache`` reads back, and a
refused change raises, naming the argument or field, before anything
changes. The quantized cache's state is the float cache's with its keys
and values as ``(packed, scales, biases)`` and two more fields; its norms
are checked against the dequantized keys within the quantization error.
A cache that ranks by another scorer (docs/spec.md §2a) adds two fields,
the scorer's name and its array (keydiff's running sum, qfilter's
filters), and its scores stand where the norms do: checked against the
stored rows where they follow from them (vnorm, qfilter; keydiff while no
row was ever evicted), and for keydiff within [-1, 1] otherwise."""

from __future__ import annotations

import re
from typing import NamedTuple

import mlx.core as mx

from .backend import check_key_width
from .ops.evict_and_fill import check_layout
from .ops.key_norms import key_norms_unchecked
from .validation import INT32_MAX, check_config, check_floating, check_int, dtype_name

FIELDS = ("keys", "values", "norms", "positions", "offset", "budget", "n_sink", "recent", "keep", "layout")
QUANTIZATION_FIELDS = ("group_size", "bits")
QUANTIZED_FIELDS = FIELDS + QUANTIZATION_FIELDS
# After the fields above, for a scorer other than knorm.
SCORER_FIELDS = ("scorer", "scorer_state")
STATE_SCORERS = ("keydiff", "vnorm", "qfilter")
META_FIELDS = FIELDS[5:]
STORAGE_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
# What mx.quantize takes in its affine mode (MLX 0.32; tests/test_cache_quantized.py asks it).
QUANTIZATION_BITS = (1, 2, 3, 4, 5, 6, 8)
QUANTIZATION_GROUP_SIZES = (32, 64, 128)
# The storage dtypes' unit roundoff and half their smallest subnormal, for
# the bound on a quantized row's norm (docs/spec.md §8).
_ROUNDOFF = {
    mx.float16: (2.0**-11, 2.0**-25),
    mx.bfloat16: (2.0**-8, 2.0**-134),
    mx.float32: (2.0**-24, 2.0**-150),
}
# What an infinite §2 norm stands for in that bound: any value from here
# up. A §2 sum overflows only for keys whose norm is about 2^64 or more
# (sqrt of float32's range), and a key quantized near there may have its
# own norm or its dequantized key's overflow alone; half of 2^64 leaves a
# margin far above the norms' rounding.
OVERFLOWED_NORM = 2.0**63


class CheckedState(NamedTuple):
    config: tuple[int, int, int, str]
    layout: str
    offset: int
    # keys, values, norms, positions [B, H, kept, ...], or None for an empty
    # cache; keys and values are (packed, scales, biases) tuples when quantized.
    rows: tuple | None
    # (group_size, bits) of a quantized cache, else None.
    quantization: tuple[int, int] | None = None
    # The scorer and its array: ("knorm", None), ("keydiff", running sum
    # [B, H, D_k] or None while empty), ("vnorm", None), ("qfilter", filters [H, D_k]).
    scorer: tuple[str, mx.array | None] = ("knorm", None)


class StateError(ValueError):
    """A state field that fails the load check. ``setting`` is the
    configuration field whose value the stored rows cannot satisfy, where
    one is to blame (a sink position missing: ``n_sink``)."""

    def __init__(self, field: str, message: str, setting: str | None = None,
                 kind: str = "L2NormKVCache"):
        super().__init__(f"mlx_knorm: {kind} state field '{field}': {message}")
        self.field = field
        self.detail = message
        self.setting = setting


def check_quantization(group_size, bits) -> tuple[int, int]:
    """``group_size`` and ``bits`` as ``mx.quantize`` takes them (affine)."""
    group_size = check_int(group_size, "group_size")
    bits = check_int(bits, "bits")
    if group_size not in QUANTIZATION_GROUP_SIZES:
        raise ValueError(
            f"mlx_knorm: group_size must be one of {QUANTIZATION_GROUP_SIZES} (what mx.quantize "
            f"takes), got {group_size}"
        )
    if bits not in QUANTIZATION_BITS:
        raise ValueError(
            f"mlx_knorm: bits must be one of {QUANTIZATION_BITS} (what mx.quantize takes), got {bits}"
        )
    return group_size, bits


def check_state(state, quantized: bool = False, *, user_scorer=None, user_state=None) -> CheckedState:
    """The state as ``L2NormKVCache.state`` (``quantized``:
    ``QuantizedL2NormKVCache.state``) writes it, checked; raises
    ``ValueError``/``TypeError`` naming the cache class and the field that
    is wrong. ``user_scorer``: the rows a batch cache ranked by that
    callable hands to one sequence's cache (no scorer fields; scores that
    nothing here can recompute, so every other field is checked), with
    ``user_state``, the callable's state for them."""
    kind = "QuantizedL2NormKVCache" if quantized else "L2NormKVCache"
    try:
        return _check_state(state, quantized, kind, user_scorer, user_state)
    except StateError as e:
        if kind == "L2NormKVCache":
            raise
        raise StateError(e.field, e.detail, e.setting, kind) from None


def _check_state(state, quantized: bool, kind: str, user_scorer=None, user_state=None) -> CheckedState:
    fields = QUANTIZED_FIELDS if quantized else FIELDS
    if isinstance(state, (tuple, list)) and len(state) == len(fields) + len(SCORER_FIELDS) \
            and callable(getattr(state[len(fields)], "scorer", None)):
        # A user's scorer (cache.UnsavableScorer), which says why no state holds it.
        raise StateError("scorer", repr(state[len(fields)]))
    # Scorer fields open with the scorer's name (a quantized cache's two
    # more fields, which a float cache never takes, are ints).
    if not isinstance(state, (tuple, list)) or len(state) not in (len(fields), len(fields) + len(SCORER_FIELDS)) \
            or (len(state) > len(fields) and not isinstance(state[len(fields)], str)):
        count = len(state) if isinstance(state, (tuple, list)) else type(state).__name__
        raise ValueError(
            f"mlx_knorm: {kind} state must have the {len(fields)} fields "
            f"({', '.join(fields)}), and then ({', '.join(SCORER_FIELDS)}) for a scorer other than "
            f"knorm, got {count}"
        )
    if user_scorer is not None and len(state) != len(fields):
        raise StateError("scorer", "a user's scorer's rows come with no scorer fields")
    scorer = (user_scorer, user_state) if user_scorer is not None else check_scorer_fields(state[len(fields):])
    state = state[:len(fields)]
    keys, values, norms, positions, offset, budget, n_sink, recent, keep, layout = state[:10]
    config = check_config(budget, n_sink, recent, keep)
    budget, n_sink, recent, _ = config
    layout = check_layout(layout)
    quantization = check_quantization(*state[10:]) if quantized else None
    offset = check_int(offset, "offset")
    if not 0 <= offset <= INT32_MAX:
        raise StateError("offset", f"must be in [0, 2**31), got {offset}")
    arrays = dict(keys=keys, values=values, norms=norms, positions=positions)
    if all(a is None for a in arrays.values()):
        if offset != 0:
            raise StateError("keys", f"no rows are stored but offset is {offset}")
        if scorer[0] == "keydiff" and scorer[1] is not None:
            raise StateError("scorer_state", "keydiff's running sum of an empty cache is None")
        return CheckedState(config, layout, offset, None, quantization, scorer)
    if quantized:
        keys, values = (_quantized_rows(arrays.pop(field), field) for field in ("keys", "values"))
    for field, a in arrays.items():
        if not isinstance(a, mx.array):
            raise TypeError(
                f"mlx_knorm: {kind} state field '{field}' must be an mlx.core.array, "
                f"got {type(a).__name__}"
            )
    kept = min(offset, budget)
    if quantized:
        _check_quantized_shapes_and_dtypes(keys, values, kept, *quantization)
        row_shape = keys[0].shape[:3]
    else:
        _check_shapes_and_dtypes(keys, values, kept)
        row_shape = keys.shape[:3]
    _check_norms_and_positions_shapes(norms, positions, row_shape)
    _check_positions(positions, offset, n_sink, recent)
    if user_scorer is not None:
        pass  # scores only the callable could recompute
    elif scorer[0] != "knorm":
        # A quantized cache's scores may come from the rows before a
        # conversion (to_quantized): their bounds only.
        if quantized:
            # The keys' width: a scale per group.
            row_shape = (*keys[1].shape[:3], keys[1].shape[3] * quantization[0])
            _check_scorer_array(scorer, row_shape)
            _check_score_bounds(scorer, row_shape, norms)
        else:
            _check_scores(scorer, keys, values, norms, offset)
    elif quantized:
        _check_quantized_norms(keys, norms, *quantization)
    else:
        stored = key_norms_unchecked(keys)
        if not mx.array_equal(stored.view(mx.uint32), norms.view(mx.uint32)).item():
            raise StateError("norms", "differ from the norms of the stored keys (docs/spec.md §2)")
    return CheckedState(config, layout, offset, (keys, values, norms, positions), quantization, scorer)


def check_scorer_fields(fields) -> tuple:
    """``(name, array)`` of the state's scorer fields (none: knorm)."""
    if not fields:
        return ("knorm", None)
    name, array = fields
    if name not in STATE_SCORERS:
        raise StateError("scorer", f"must be one of {STATE_SCORERS} (a knorm cache has no scorer fields), "
                                   f"got {name!r}")
    if name == "vnorm":
        if array is not None:
            raise StateError("scorer_state", "vnorm keeps no array: None")
        return (name, None)
    if array is None and name == "keydiff":
        return (name, None)
    if not isinstance(array, mx.array) or array.dtype != mx.float32:
        raise StateError("scorer_state", f"{name}'s array must be a float32 mlx.core.array")
    if name == "qfilter" and (array.ndim != 2 or not mx.all(mx.isfinite(array)).item()):
        raise StateError("scorer_state", f"qfilter's filters must be finite, [H, D], got {list(array.shape)}")
    return (name, array)


def _check_scorer_array(scorer: tuple, row_shape) -> None:
    """The scorer's array fits rows ``[B, H, n, D]``: qfilter's filters
    ``[H, D]``, keydiff's running sum finite ``[B, H, D]``."""
    name, array = scorer
    batch, heads, _, dim = row_shape
    if name == "qfilter" and tuple(array.shape) != (heads, dim):
        raise StateError("scorer_state", f"qfilter's filters are {list(array.shape)}, the keys' heads and "
                                         f"width [{heads}, {dim}]")
    if name == "keydiff" and (array is None or tuple(array.shape) != (batch, heads, dim)
                              or not mx.all(mx.isfinite(array)).item()):
        raise StateError("scorer_state", f"keydiff's running sum must be finite float32 [{batch}, {heads}, {dim}] "
                                         "once rows are stored")


def _check_score_bounds(scorer: tuple, row_shape, scores: mx.array) -> None:
    """What holds of a scorer's scores whatever the rows (``row_shape``
    ``[B, H, n, D]``, D the keys' width): the canonical NaN or a number, +0
    for a zero; keydiff's within ``±(D + 1)``, vnorm's ``>= +0``."""
    name, _ = scorer
    dim = row_shape[3]
    bits = scores.view(mx.uint32)
    fine = ~mx.isnan(scores) | (bits == 0x7FC00000)
    if name == "keydiff":
        # A cosine, but the norms drop squares below 2^-126 (§2a's flush), so
        # a key or sum of tiny components can score above 1: at most by a
        # factor sqrt(1 + D) for each of the two norms.
        fine = fine & (mx.isnan(scores) | (mx.abs(scores) <= (dim + 1) * (1.0 + 2.0**-20)))
    elif name == "vnorm":
        fine = fine & (bits < 0x80000000)
    if not mx.all(fine & (bits != 0x80000000)).item():
        raise StateError("norms", f"are not {name} scores (docs/spec.md §2a)")


def _check_scores(scorer: tuple, keys: mx.array, values: mx.array, scores: mx.array, offset: int) -> None:
    """The scores of the stored rows (docs/spec.md §2a), from the rows as
    the cache holds them: recomputed where they follow from the rows alone
    (vnorm, qfilter, and keydiff with every row since the start held, the
    running sum too); keydiff's otherwise +0, the canonical NaN or in
    [-1, 1] (a cosine, within rounding)."""
    from .scorers import score_rows

    name, array = scorer
    kept = keys.shape[2]
    _check_scorer_array(scorer, keys.shape)
    if name == "keydiff" and kept < offset:
        _check_score_bounds(scorer, keys.shape, scores)
        return
    expected, total = score_rows(name, keys, values, None, filters=array)
    if not mx.array_equal(expected.view(mx.uint32), scores.view(mx.uint32)).item():
        raise StateError("norms", f"differ from the {name} scores of the stored rows (docs/spec.md §2a)")
    if name == "keydiff" and not mx.array_equal(total.view(mx.uint32), array.view(mx.uint32)).item():
        raise StateError("scorer_state", "keydiff's running sum is not the sum of the stored rows' unit keys")


def _quantized_rows(rows, field: str) -> tuple[mx.array, mx.array, mx.array]:
    """A quantized state's keys or values: ``(packed, scales, biases)``, a
    tuple or (after a file round trip) a list of three arrays."""
    if not isinstance(rows, (tuple, list)) or len(rows) != 3:
        got = f"{len(rows)} items" if isinstance(rows, (tuple, list)) else type(rows).__name__
        raise TypeError(
            f"mlx_knorm: QuantizedL2NormKVCache state field '{field}' must be (packed, scales, "
            f"biases), three mlx.core.arrays, got {got}"
        )
    for i, a in enumerate(rows):
        if not isinstance(a, mx.array):
            raise TypeError(
                f"mlx_knorm: QuantizedL2NormKVCache state field '{field}[{i}]' must be an "
                f"mlx.core.array, got {type(a).__name__}"
            )
    return tuple(rows)


def _check_rows(keys: mx.array, kept: int, field: str = "keys") -> None:
    if keys.ndim != 4:
        raise StateError(field, f"must be [B, H, kept, D], got shape {list(keys.shape)}")
    if keys.shape[2] != kept:
        raise StateError(
            field, f"holds {keys.shape[2]} rows per head; offset and budget give {kept}", setting="budget"
        )


def _check_shapes_and_dtypes(keys, values, kept: int) -> None:
    _check_rows(keys, kept)
    if keys.dtype not in STORAGE_DTYPES:
        raise StateError("keys", f"must be float16, bfloat16 or float32, got {dtype_name(keys.dtype)}")
    check_key_width(keys.shape[-1], "L2NormKVCache state field 'keys'")
    if values.ndim != 4 or values.shape[:3] != keys.shape[:3]:
        raise StateError("values", f"shape {list(values.shape)} does not fit keys {list(keys.shape)}")
    if values.dtype != keys.dtype:
        raise StateError("values", f"dtype {dtype_name(values.dtype)} differs from keys {dtype_name(keys.dtype)}")


def _check_quantized_shapes_and_dtypes(keys, values, kept: int, group_size: int, bits: int) -> None:
    """Each of ``keys`` and ``values`` is ``(packed uint32 [B, H, kept,
    D * bits / 32], scales, biases [B, H, kept, D / group_size])``, all six
    on the same rows, scales and biases in one storage dtype."""
    _check_rows(keys[0], kept, "keys[0]")
    row_shape = keys[0].shape[:3]
    dtype = keys[1].dtype
    if dtype not in STORAGE_DTYPES:
        raise StateError("keys[1]", f"scales must be float16, bfloat16 or float32, got {dtype_name(dtype)}")
    for field, (packed, scales, biases) in (("keys", keys), ("values", values)):
        for i, a in enumerate((packed, scales, biases)):
            if a.ndim != 4 or a.shape[:3] != row_shape:
                raise StateError(
                    f"{field}[{i}]", f"shape {list(a.shape)} does not fit the rows {list(row_shape)}"
                )
        if packed.dtype != mx.uint32:
            raise StateError(f"{field}[0]", f"packed rows must be uint32, got {dtype_name(packed.dtype)}")
        for i, a in ((1, scales), (2, biases)):
            if a.dtype != dtype:
                raise StateError(
                    f"{field}[{i}]", f"dtype {dtype_name(a.dtype)} differs from the key scales' "
                    f"{dtype_name(dtype)}"
                )
        width = scales.shape[3] * group_size
        if biases.shape[3] != scales.shape[3] or packed.shape[3] * 32 != width * bits:
            raise StateError(
                field, f"widths {[a.shape[3] for a in (packed, scales, biases)]} are not those "
                f"of D = {width} at group_size {group_size} and {bits} bits"
            )
        if field == "keys":
            check_key_width(width, "QuantizedL2NormKVCache state field 'keys'")


def _check_norms_and_positions_shapes(norms, positions, row_shape) -> None:
    for field, a, dtype in (("norms", norms, mx.float32), ("positions", positions, mx.int32)):
        if tuple(a.shape) != tuple(row_shape):
            raise StateError(field, f"must be [B, H, kept] = {list(row_shape)}, got {list(a.shape)}")
        if a.dtype != dtype:
            raise StateError(field, f"must be {dtype_name(dtype)}, got {dtype_name(a.dtype)}")


def quantized_norm_bound(keys, group_size: int, bits: int) -> tuple[mx.array, mx.array]:
    """``(‖ŵ‖, bound)`` ``[B, H, rows]`` float32 for quantized ``keys``:
    the §2 norms of the dequantized keys ``ŵ``, and how far the norms of
    the keys they were quantized from can lie from them (docs/spec.md §8;
    infinite or NaN where a scale or bias is not finite)."""
    packed, scales, biases = keys
    unit, tiny = _ROUNDOFF[scales.dtype]
    levels = 2**bits - 1
    dequantized = mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits)
    groups = dequantized.astype(mx.float32).reshape(*scales.shape, group_size)
    largest = mx.abs(groups).max(axis=-1)
    s, b = mx.abs(scales.astype(mx.float32)), mx.abs(biases.astype(mx.float32))
    step = 1.25 * (s * (1 + 2 * unit * levels) + 2 * unit * (b + largest) + (2 * levels + 4) * tiny)
    bound = mx.sqrt(group_size * mx.sum(step * step, axis=-1))
    return key_norms_unchecked(dequantized), bound


def norm_distance(a: mx.array, b: mx.array) -> mx.array:
    """``|a - b|`` of two float32 §2 norms ``>= +0``, reading an infinite
    one as every value from ``OVERFLOWED_NORM`` up (docs/spec.md §8): the
    distance between the two sets, 0 where both overflowed."""
    lowest = lambda x: mx.where(x == mx.inf, OVERFLOWED_NORM, x)
    return mx.maximum(mx.maximum(lowest(a) - b, lowest(b) - a), 0.0)


def _check_quantized_norms(keys, norms, group_size: int, bits: int) -> None:
    """Norms of the keys before quantization, which are gone: each is
    ``>= +0`` or the canonical NaN, and a number within the quantization
    error of the dequantized key's norm where the row's scales and biases
    are finite."""
    if norms.size == 0:
        return
    bits_of = norms.view(mx.uint32)
    signed = bits_of >= 0x80000000
    nan = mx.isnan(norms)
    if mx.any(signed | (nan & (bits_of != 0x7FC00000))).item():
        raise StateError("norms", "must be >= +0 or the canonical NaN (docs/spec.md §2)")
    dequantized, bound = quantized_norm_bound(keys, group_size, bits)
    # A NaN norm is a key with a NaN component, which mx.quantize drops
    # (its row's scales stay finite): no row can refute it.
    checked = mx.isfinite(bound) & ~nan
    if mx.any(checked & (norm_distance(norms, dequantized) > bound)).item():
        raise StateError(
            "norms", "are not the norms of the stored keys before quantization: they lie "
            "farther from the dequantized keys' norms than the quantization error allows"
        )


def _check_positions(positions: mx.array, offset: int, n_sink: int, recent: int) -> None:
    """Increasing, inside ``[0, offset)``, and holding every protected
    position: the sinks and the recent window are never evicted. Vacuous
    without rows or without heads (``B`` or ``H`` of 0)."""
    rows = positions.shape[-1]
    if positions.size == 0:
        return
    if not mx.all(positions[..., 1:] > positions[..., :-1]).item():
        raise StateError("positions", "must increase along each head's rows")
    if positions[..., 0].min().item() < 0 or positions[..., -1].max().item() >= offset:
        raise StateError("positions", f"must lie in [0, offset={offset})")
    sinks = min(n_sink, rows)
    window = min(recent, rows - sinks)
    for setting, held, protected, what in (
        ("n_sink", positions[..., :sinks], (0, sinks), "sink positions"),
        ("recent", positions[..., rows - window :], (offset - window, offset), "recent window"),
    ):
        if not mx.all(held == mx.arange(*protected, dtype=mx.int32)).item():
            raise StateError(
                "positions",
                f"must hold the {what} [{protected[0]}, {protected[1]})",
                setting=setting,
            )


def check_block(keys, values, stored: tuple[int, int, int, int] | None, offset: int,
                group_size: int | None = None) -> None:
    """A block for ``update_and_fetch``: ``keys [B, H, S, D_k]`` and
    ``values [B, H, S, D_v]``, floating, against the stored ``(B, H, D_k,
    D_v)`` (None before the first block); for a quantized cache, widths
    that are multiples of its ``group_size``. The same on the first call
    and every later one, and on every backend. Runs on every decode step of
    every layer, so each shape is read once."""
    for name, x in (("keys", keys), ("values", values)):
        check_floating(x, name)
    key_shape, value_shape = keys.shape, values.shape
    for name, shape in (("keys", key_shape), ("values", value_shape)):
        if len(shape) != 4:
            raise ValueError(
                f"mlx_knorm: L2NormKVCache.update_and_fetch: {name} must be [B, H, S, D] "
                f"(rank 4), got shape {list(shape)}"
            )
    if key_shape[:3] != value_shape[:3]:
        raise ValueError(
            "mlx_knorm: L2NormKVCache.update_and_fetch: keys and values must agree in "
            f"B, H and S: keys {list(key_shape)} vs values {list(value_shape)}"
        )
    if stored is None:
        # Later blocks keep these widths, and a loaded state was checked for them.
        check_key_width(key_shape[3], "keys")
        if group_size is not None:
            for name, shape in (("keys", key_shape), ("values", value_shape)):
                if shape[3] % group_size:
                    raise ValueError(
                        f"mlx_knorm: QuantizedL2NormKVCache.update_and_fetch: {name} width "
                        f"{shape[3]} must be a multiple of group_size {group_size}"
                    )
    else:
        batch, heads, key_dim, value_dim = stored
        if key_shape[:2] != (batch, heads) or key_shape[3] != key_dim or value_shape[3] != value_dim:
            raise ValueError(
                f"mlx_knorm: L2NormKVCache holds [B, H, rows, D] = [{batch}, {heads}, rows, "
                f"{key_dim}] keys and [..., {value_dim}] values; got keys {list(key_shape)} "
                f"and values {list(value_shape)}"
            )
    if offset + key_shape[2] > INT32_MAX:
        raise ValueError(
            f"mlx_knorm: L2NormKVCache positions are int32: offset {offset} + "
            f"{key_shape[2]} new tokens must be < 2**31"
        )


def parse_meta_state(meta_state, quantized: bool = False) -> tuple:
    """``(budget, n_sink, recent, keep, layout)`` (``quantized``: then
    ``group_size, bits``) from ``meta_state``: the integers as decimal
    strings (as ``meta_state`` gives them) or ints; raises naming the field."""
    fields = META_FIELDS + QUANTIZATION_FIELDS if quantized else META_FIELDS
    kind = "QuantizedL2NormKVCache" if quantized else "L2NormKVCache"
    if not isinstance(meta_state, (tuple, list)) or len(meta_state) != len(fields):
        count = len(meta_state) if isinstance(meta_state, (tuple, list)) else type(meta_state).__name__
        raise ValueError(
            f"mlx_knorm: {kind} meta_state must have the {len(fields)} fields "
            f"({', '.join(fields)}), got {count}"
        )
    integers = [i for i, field in enumerate(fields) if field not in ("keep", "layout")]
    out = list(meta_state)
    for i in integers:
        out[i] = decimal_int(meta_state[i], f"{kind} meta_state field '{fields[i]}'")
    return tuple(out)


def decimal_int(value, label: str) -> int:
    """An int, or its decimal string (as ``meta_state`` writes integers);
    raises naming ``label`` (e.g. ``"L2NormKVCache meta_state field 'budget'"``)."""
    if isinstance(value, str):
        if not re.fullmatch(r"[+-]?[0-9]+", value):
            raise ValueError(f"mlx_knorm: {label} must be a decimal integer, got {value!r}")
        value = int(value)
    return check_int(value, label)
