"""The reference's state API (``veloxquant_mlx.quantizers.knorm``), name for
name, built on the two ops (``mlx_knorm.ops``).

States are immutable: every update returns a new ``KnormState`` and a failed
call raises before anything is computed, leaving the caller's state as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .ops.key_norms import key_norms_unchecked
from .ops.protected_topk_gather import check_block, protected_topk_gather_unchecked
from .validation import check_config, check_floating, check_rank


@dataclass
class KnormState:
    """Per-head L2-norm eviction state.

    Attributes:
        keys:   [n_kept, D] float16 kept key rows, or None before the first update.
        values: [n_kept, D] float16 kept value rows, or None before the first update.
        norms:  [n_kept] float32 key norms, computed once at insertion.
        n_sink: leading positions never evicted.
        budget: most rows kept at any time (sinks included).
        recent: trailing protected window (0 = off, as in the paper).
        keep:   "low" keeps the lowest-norm rows (the paper); "high" the highest.
    """

    keys: mx.array | None
    values: mx.array | None
    norms: mx.array | None
    n_sink: int
    budget: int
    recent: int
    keep: str


def init_knorm_state(
    n_sink: int, budget: int, head_dim: int, recent: int = 0, keep: str = "low"
) -> KnormState:
    """An empty state. ``head_dim`` is accepted for API parity, as in the reference.

    Raises:
        ValueError: if ``keep`` is invalid, ``budget < 1``, ``n_sink`` or
            ``recent`` is negative, or ``n_sink + recent >= budget``.
    """
    budget, n_sink, recent, keep = check_config(budget, n_sink, recent, keep)
    return KnormState(None, None, None, n_sink, budget, recent, keep)


def knorm_update(state: KnormState, new_keys: mx.array, new_values: mx.array) -> KnormState:
    """Absorb a block of S tokens (``[S, D]``), evict down to the budget in one step.

    Rows are stored as float16; norms come from ``new_keys`` as passed.
    """
    if not isinstance(state, KnormState):
        raise TypeError(f"mlx_knorm: state must be a KnormState, got {type(state).__name__}")
    budget, n_sink, recent, keep = check_config(state.budget, state.n_sink, state.recent, state.keep)
    for name, x in (("new_keys", new_keys), ("new_values", new_values)):
        check_floating(x, name)
        check_rank(x, 2, name)
    if state.keys is None:
        prior_keys = mx.zeros((0, new_keys.shape[1]), dtype=mx.float16)
        prior_values = mx.zeros((0, new_values.shape[1]), dtype=mx.float16)
        prior_norms = mx.zeros((0,), dtype=mx.float32)
    else:
        prior_keys, prior_values, prior_norms = state.keys, state.values, state.norms
    check_block(
        prior_keys[None], prior_values[None], prior_norms[None], new_keys[None], new_values[None]
    )
    # One head of the batched update; rows are stored as float16.
    keys, values, norms = knorm_update_batched(
        prior_keys[None].astype(mx.float16),
        prior_values[None].astype(mx.float16),
        prior_norms[None],
        new_keys[None],
        new_values[None],
        budget,
        n_sink,
        recent,
        keep,
    )
    return KnormState(keys[0], values[0], norms[0], n_sink, budget, recent, keep)


def knorm_update_batched(
    prior_keys: mx.array,
    prior_values: mx.array,
    prior_norms: mx.array,
    new_keys: mx.array,
    new_values: mx.array,
    budget: int,
    n_sink: int,
    recent: int,
    keep: str,
    *,
    return_indices: bool = False,
) -> tuple[mx.array, mx.array, mx.array] | tuple[mx.array, mx.array, mx.array, mx.array]:
    """``knorm_update`` over N = B*H rows at once (``[N, n_prior, D]`` priors,
    ``[N, S, D]`` new rows; ``n_prior`` may be 0).

    New rows are cast to the prior dtypes after their norms are taken. Returns
    ``(keys, values, norms)`` of ``[N, min(n_total, budget), ...]`` in temporal
    order, plus the uint32 kept row indices into ``prior ++ new`` when
    ``return_indices``.
    """
    budget, n_sink, recent, keep = check_config(budget, n_sink, recent, keep)
    check_block(prior_keys, prior_values, prior_norms, new_keys, new_values)
    keys, values, norms, indices = protected_topk_gather_unchecked(
        prior_keys,
        prior_values,
        prior_norms,
        new_keys.astype(prior_keys.dtype),
        new_values.astype(prior_values.dtype),
        key_norms_unchecked(new_keys),
        budget,
        n_sink,
        recent,
        keep,
    )
    if return_indices:
        return keys, values, norms, indices
    return keys, values, norms


def knorm_get_kv(state: KnormState) -> tuple[mx.array, mx.array]:
    """``(keys, values)``; ``[0, 1]`` float16 placeholders before the first update."""
    if state.keys is None:
        empty = mx.zeros((0, 1), dtype=mx.float16)
        return empty, empty
    return state.keys, state.values


def knorm_fp16_bytes(state: KnormState) -> int:
    """Bytes stored for K + V at 2 bytes per element."""
    if state.keys is None:
        return 0
    n, dim = state.keys.shape
    return n * dim * 2 * 2


def full_knorm_fp16_bytes(tokens_seen: int, head_dim: int) -> int:
    """float16 K + V bytes had all ``tokens_seen`` tokens been stored."""
    return tokens_seen * head_dim * 2 * 2
