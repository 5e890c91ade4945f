"""A batch of L2-norm eviction caches for mlx-lm 0.32's batch protocol.

``BatchL2NormKVCache`` is to ``L2NormKVCache`` what mlx-lm's
``BatchKVCache`` is to ``KVCache``: ``BatchGenerator``, ``batch_generate``
and ``mlx_lm.server`` build it with ``L2NormKVCache.merge``, grow it with
``extend``, shrink it with ``filter`` and take sequences back out with
``extract``. Each ``update_and_fetch`` is one ``evict_and_fill`` on the
``[B, H]`` heads, with each sequence's valid range, so padding is never a
token: each sequence keeps exactly the rows that a single-sequence cache
fed its tokens keeps (docs/spec.md §4, the batch rule; §8, batches).

Positions are one timeline ``T`` for the batch; sequence ``b``'s tokens are
``[lo_b, min(T, hi_b))`` and ``offset`` (the RoPE offset) is ``T - lo_b``.
Every padding row sits in the front slots of its sequence, at the position
equal to its slot, in every head and layer, so one mlx-lm causal mask with
per-sequence left padding fits every head although the kept positions of
real rows differ from head to head.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from .cache import L2NormKVCache, UnsavableScorer, _register_with_mlx_lm, _storage_dtype, order_tree_argument, step_capacity
from .cache_commit import all_or_nothing, deep_copy_sharing_scorer
from .batch_state import check_batch_fields, slot_flaws
from .cache_state import check_block, check_state
from .ops.evict_and_fill import check_layout, evict_and_fill_unchecked
from .sharing import note_shared_read
from .scorers import DEFAULT_SCORER, check_scorer, score_rows, scorer_label
from .validation import INT32_MAX, check_config, check_int

# hi_b of a sequence whose tokens run on (no right-padded prefill pending).
OPEN = INT32_MAX
_CONFIG = ("budget", "n_sink", "recent", "keep", "layout", "scorer")


def _config_of(cache) -> tuple:
    return tuple(getattr(cache, name) for name in _CONFIG)


def _check_same_config(caches, what: str) -> tuple:
    first = _config_of(caches[0])
    for index, cache in enumerate(caches[1:], 1):
        for name, a, b in zip(_CONFIG, first, _config_of(cache)):
            if a != b:
                raise ValueError(
                    f"mlx_knorm: {what}: every cache must have the same {name}; "
                    f"caches[0] has {name}={a!r}, caches[{index}] has {name}={b!r}"
                )
        mine, theirs = caches[0]._filters, cache._filters
        if (mine is None) != (theirs is None) or (mine is not None and (
                mine.shape != theirs.shape or not mx.array_equal(mine, theirs).item())):
            raise ValueError(f"mlx_knorm: {what}: caches[{index}] ranks by other query filters than caches[0]")
    return first


def _sequences(cache) -> int:
    return cache.batch_size if isinstance(cache, BatchL2NormKVCache) else 1


def _checked_batch_states(caches) -> list:
    """The scorer states of ``caches`` (single or batch caches): each None
    or an array whose first axis holds the cache's sequences, all of one
    shape beyond it, as the batch operations take them; else ``ValueError``
    (a user's scorer's state is whatever it returned)."""
    states = [c._score_sum for c in caches]
    shapes = {tuple(s.shape[1:]) for s in states if isinstance(s, mx.array) and s.ndim}
    for cache, state in zip(caches, states):
        if state is None:
            continue
        fits = isinstance(state, mx.array) and state.ndim and state.shape[0] == _sequences(cache)
        if not fits or len(shapes) > 1:
            got = f"{list(state.shape)}" if isinstance(state, mx.array) else type(state).__name__
            raise ValueError(
                f"mlx_knorm: a user's scorer ({scorer_label(caches[0].scorer)}) batches only with a state "
                f"that is None or an array, batch-first (one row per sequence, the same shape beyond it), "
                f"got {got} for {_sequences(cache)} sequences")
    return states


def _joined_sums(caches) -> mx.array | None:
    """keydiff's running sums (or a user's scorer's states) of ``caches``
    (single or batch caches, in order) along the batch axis, +0 for a cache
    that has none yet; None where none has one. One cache's state is taken
    as it is: nothing is joined."""
    if len(caches) == 1:
        return caches[0]._score_sum
    sums = _checked_batch_states(caches)
    template = next((s for s in sums if s is not None), None)
    if template is None:
        return None
    return mx.concatenate([mx.zeros((_sequences(c), *template.shape[1:]), template.dtype) if s is None else s
                           for c, s in zip(caches, sums)], axis=0)


def _padding_front(rows: mx.array, count: int) -> mx.array:
    """``rows [B, H, n, ...]`` behind ``count`` zero slots."""
    if count == 0:
        return rows
    pad = [(0, 0)] * rows.ndim
    pad[2] = (count, 0)
    return mx.pad(rows, pad)


def _slot_positions(batch: int, heads: int, slots: int) -> mx.array:
    """int32 ``[B, H, slots]``: each slot's own index, the padding rows' position."""
    return mx.broadcast_to(mx.arange(slots, dtype=mx.int32), (batch, heads, slots))


class BatchL2NormKVCache(_BaseCache):
    """``B`` sequences' L2-norm eviction caches for one layer, one
    configuration (docs/spec.md §8, batches). Made by
    ``L2NormKVCache.merge(caches)`` (or empty, with the configuration and
    ``left_padding``, as ``BatchKVCache(left_padding)`` is)."""

    def __init__(self, left_padding, *, budget: int, n_sink: int, recent: int, keep: str,
                 layout: str = "slots", scorer=DEFAULT_SCORER, filters: mx.array | None = None) -> None:
        self.budget, self.n_sink, self.recent, self.keep = check_config(budget, n_sink, recent, keep)
        self.layout = check_layout(layout)
        # What the sequences' caches rank by (docs/spec.md §2a): keydiff's
        # running sums [B, H, D] (None before the first block), qfilter's filters.
        self.scorer = check_scorer(scorer)
        self._filters = filters
        self._score_sum = None
        self.keys = self.values = self.norms = self.slot_positions = None
        self.filled = 0
        self.timeline = 0
        self._lo = [check_int(p, "left_padding entry") for p in left_padding]
        if any(p < 0 for p in self._lo):
            raise ValueError(f"mlx_knorm: left_padding entries must be >= 0, got {self._lo}")
        self._hi = [OPEN] * len(self._lo)
        self._real = [0] * len(self._lo)
        self._ranges_changed()

    def __deepcopy__(self, memo) -> "BatchL2NormKVCache":
        """Every field deep-copied but the scorer, which the copy shares
        (so it batches with the original)."""
        return deep_copy_sharing_scorer(self, memo)

    # -- host bookkeeping ---------------------------------------------------

    def _ranges_changed(self) -> None:
        """Rebuild the arrays made from the host ranges: ``offset`` [B] and
        the op's ``valid``."""
        self.offset = mx.array([self.timeline - lo for lo in self._lo], dtype=mx.int32)
        pairs = [v for pair in zip(self._lo, self._hi) for v in pair]
        self._ranges = mx.array(pairs, dtype=mx.int32).reshape(-1, 2)
        # The order tree ranks by the ranges it was built for.
        self._tree = None
        # Rows of the last step, while its rows are what keys_and_values gives.
        self._last_steps = None

    def _valid(self, heads: int) -> mx.array:
        batch = len(self._lo)
        return mx.broadcast_to(self._ranges[:, None, :], (batch, heads, 2))

    def _buffers(self) -> list:
        return [self.keys, self.values, self.norms, self.slot_positions]

    def _set_buffers(self, buffers, tree=None) -> None:
        """The slot buffers and, where a step just made it, their order
        tree; any other change drops the tree (docs/spec.md §8)."""
        self.keys, self.values, self.norms, self.slot_positions = buffers
        self._tree = tree

    def _padded(self) -> bool:
        """A right-padded prefill is pending (``prepare`` until ``finalize``)."""
        return any(hi != OPEN for hi in self._hi)

    @property
    def batch_size(self) -> int:
        return len(self._lo)

    # -- the step -----------------------------------------------------------

    @all_or_nothing
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Absorb ``[B, H, S, D]`` keys/values: one §4 step with each
        sequence's valid range; returns the kept rows and the new rows
        (views of slots ``[0, kept + S)``)."""
        dims = None if self.keys is None else (*self.norms.shape[:2], self.keys.shape[3], self.values.shape[3])
        check_block(keys, values, dims, self.timeline)
        batch, heads, steps, _ = keys.shape
        if batch != self.batch_size:
            raise ValueError(
                f"mlx_knorm: BatchL2NormKVCache holds {self.batch_size} sequences; "
                f"got keys {list(keys.shape)}"
            )
        kept = self.size()
        if self.keys is None:
            dtype = _storage_dtype(keys, values)
            buffers = [
                mx.zeros((batch, heads, 0, keys.shape[3]), dtype),
                mx.zeros((batch, heads, 0, values.shape[3]), dtype),
                mx.zeros((batch, heads, 0), mx.float32),
                mx.zeros((batch, heads, 0), mx.int32),
            ]
        else:
            buffers = self._buffers()
            dtype = self.keys.dtype
        capacity = step_capacity(kept + steps, buffers[2].shape[2], self.budget)
        new_keys, new_values = keys.astype(dtype), values.astype(dtype)
        new_norms, score_sum = None, self._score_sum
        if self.scorer != "knorm":
            # Each sequence's padding rows score +0 and join no running sum.
            new_norms, score_sum = score_rows(self.scorer, new_keys, new_values, self._score_sum,
                                              offset=self.timeline, valid=self._valid(heads),
                                              filters=self._filters)
        previous_tree = self._tree
        tree = order_tree_argument(self.layout, self.budget, self.recent, previous_tree)
        # The op writes in place only if it holds the buffers' last reference.
        self._set_buffers([None] * 4)
        try:
            out = evict_and_fill_unchecked(
                *buffers, new_keys, new_values,
                filled=self.filled, offset=self.timeline, capacity=capacity,
                budget=self.budget, n_sink=self.n_sink, recent=self.recent, keep=self.keep,
                layout=self.layout, new_norms=new_norms, valid=self._valid(heads), tree=tree,
            )
        except BaseException:
            self._set_buffers(buffers, previous_tree)
            raise
        self._set_buffers(out[:4], out[4] if tree is not False else None)
        self._score_sum = score_sum
        start, stop = self.timeline, self.timeline + steps
        self._real = [
            min(real, kept) + max(0, min(stop, hi) - max(start, lo))
            for real, lo, hi in zip(self._real, self._lo, self._hi)
        ]
        self.filled = kept + steps
        self.timeline = stop
        self.offset = self.offset + steps
        self._last_steps = steps
        return self._occupied()

    def _occupied(self):
        return self.keys[..., : self.filled, :], self.values[..., : self.filled, :]

    def keys_and_values(self):
        """The keys and values the last step's attention read, in the order
        its mask assumes (mlx-lm 0.32.2's ``BatchKVCache.keys_and_values``):
        slots ``[0, filled)``, each sequence's padding in front. ``(None,
        None)`` when empty (docs/spec.md §8, KV sharing)."""
        if self.keys is None:
            return None, None
        keys, values = self._occupied()
        if self._last_steps is not None:
            first = mx.array([self.timeline - self._last_steps - lo for lo in self._lo], dtype=mx.int32)
            note_shared_read(keys, first)
        return keys, values

    def size(self) -> int:
        """Rows each head attends to before the next block: ``min(filled, budget)``."""
        return min(self.filled, self.budget)

    def empty(self) -> bool:
        return self.keys is None

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        """mlx-lm's causal mask over the kept rows ++ ``N`` new rows, with
        each sequence's padding rows (the front ``P_b`` slots in every head,
        docs/spec.md §8) hidden."""
        if window_size is not None:
            raise ValueError(
                f"mlx_knorm: BatchL2NormKVCache cannot serve a sliding-window layer "
                f"(window_size={window_size}): kept rows sit at different positions in "
                "different heads"
            )
        kept = self.size()
        padding = [kept - min(real, kept) for real in self._real]
        if any(padding):
            return create_causal_mask(N, offset=kept, left_padding=mx.array(padding, dtype=mx.int32))
        return create_attention_mask(N, offset=kept, return_array=return_array, window_size=None)

    # -- prefill ------------------------------------------------------------

    @all_or_nothing
    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """``left_padding`` (an empty cache only): each sequence's first real
        position. ``lengths`` with ``right_padding``: the next blocks hold
        ``lengths[b]`` real tokens of sequence ``b`` and then padding, until
        ``finalize()``."""
        if left_padding is not None:
            if self.keys is not None or self.timeline:
                raise ValueError("mlx_knorm: left_padding can only be added to an empty BatchL2NormKVCache")
            left_padding = [check_int(p, "left_padding entry") for p in left_padding]
            if len(left_padding) != self.batch_size or any(p < 0 for p in left_padding):
                raise ValueError(
                    f"mlx_knorm: left_padding must be {self.batch_size} entries >= 0, got {left_padding}"
                )
            self._lo = [lo + p for lo, p in zip(self._lo, left_padding)]
        if right_padding is not None and max(right_padding, default=0) > 0:
            if self._padded():
                # Its ranges would make the padding rows stored since real.
                raise ValueError("mlx_knorm: BatchL2NormKVCache.prepare: a right-padded prefill is pending; "
                                 "finalize() it first")
            early = [b for b, lo in enumerate(self._lo) if lo > self.timeline]
            if early:
                # Their next rows are left padding, not the real tokens lengths counts.
                raise ValueError(f"mlx_knorm: BatchL2NormKVCache.prepare: sequences {early} are still in their "
                                 f"left padding (first position past the timeline {self.timeline}); a "
                                 "right-padded prefill needs every sequence's left padding fed first")
            if lengths is None or len(lengths) != self.batch_size:
                raise ValueError(
                    f"mlx_knorm: right_padding needs lengths, one per sequence ({self.batch_size})"
                )
            lengths = [check_int(n, "lengths entry") for n in lengths]
            if any(n < 0 for n in lengths):
                raise ValueError(f"mlx_knorm: lengths entries must be >= 0, got {lengths}")
            self._hi = [self.timeline + n for n in lengths]
        self._ranges_changed()

    @all_or_nothing
    def finalize(self) -> None:
        """After a right-padded prefill: move each sequence's padding rows to
        the front of its slots and its tokens' positions to end at the
        timeline, as a left-padded prompt's end (docs/spec.md §8)."""
        if not self._padded():
            return
        shift = [0 if hi == OPEN else self.timeline - min(hi, self.timeline) for hi in self._hi]
        if self.keys is not None:
            filled = self.filled
            rows = [b[:, :, :filled] for b in self._buffers()]
            positions = rows[3]
            real = (positions >= self._ranges[:, None, 0:1]) & (positions < self._ranges[:, None, 1:2])
            slot = mx.arange(filled, dtype=mx.int32)
            # Padding first, then the real rows, each in slot order.
            order = mx.argsort(mx.where(real, slot + filled, slot), axis=2)
            rows = [mx.take_along_axis(b, order if b.ndim == 3 else order[..., None], axis=2) for b in rows]
            real = mx.take_along_axis(real, order, axis=2)
            moved = rows[3] + mx.array(shift, dtype=mx.int32)[:, None, None]
            rows[3] = mx.where(real, moved, slot)
            self._set_buffers(rows)
        self._lo = [lo + d for lo, d in zip(self._lo, shift)]
        self._hi = [OPEN] * self.batch_size
        self._ranges_changed()

    # -- joins and leaves ---------------------------------------------------

    @all_or_nothing
    def filter(self, batch_indices) -> None:
        """Keep the given sequences (in place), dropping the leading slots
        that are padding in every one kept."""
        indices = [check_int(i, "batch_indices entry") for i in (
            batch_indices.tolist() if isinstance(batch_indices, mx.array) else batch_indices)]
        if any(not 0 <= i < self.batch_size for i in indices):
            raise ValueError(f"mlx_knorm: BatchL2NormKVCache.filter: batch_indices {indices} must lie in "
                             f"[0, {self.batch_size})")
        kept_all = indices == list(range(self.batch_size))
        if not kept_all:
            _checked_batch_states([self])
        self._lo = [self._lo[i] for i in indices]
        self._hi = [self._hi[i] for i in indices]
        self._real = [self._real[i] for i in indices]
        if self._score_sum is not None and not kept_all:
            self._score_sum = self._score_sum[mx.array(indices, dtype=mx.int32)]
        if self.keys is not None:
            index = mx.array(indices, dtype=mx.int32)
            rows = [b[index] for b in self._buffers()]
            drop = 0 if self._padded() or not indices else min(self.filled - r for r in self._real)
            if drop:
                # The padding rows left keep their positions from their slots up.
                rows = [b[:, :, drop : self.filled] for b in rows]
                lo = mx.array(self._lo, dtype=mx.int32)[:, None, None]
                rows[3] = mx.where(rows[3] < lo, rows[3] - drop, rows[3])
                self.filled -= drop
            self._set_buffers(rows)
        self._ranges_changed()

    @all_or_nothing
    def extend(self, other: "BatchL2NormKVCache") -> None:
        """Append ``other``'s sequences (in place): both sides' slots are
        aligned at the back, the shorter side behind padding slots, on one
        timeline (docs/spec.md §8)."""
        if not isinstance(other, BatchL2NormKVCache):
            raise TypeError(f"mlx_knorm: BatchL2NormKVCache.extend: other must be a BatchL2NormKVCache, "
                            f"got {type(other).__name__}")
        _check_same_config([self, other], "BatchL2NormKVCache.extend")
        if self._padded() or other._padded():
            raise ValueError("mlx_knorm: BatchL2NormKVCache.extend: finalize() the right-padded prefill first")
        sides = [self, other]
        score_sum = _joined_sums(sides)
        filled = max(c.filled for c in sides)
        timeline = max(c.timeline + filled - c.filled for c in sides)
        template = next((c for c in sides if c.keys is not None), None)
        if template is not None:
            heads = template.norms.shape[1]
            parts = []
            for c in sides:
                batch, front = c.batch_size, filled - c.filled
                if c.keys is None:
                    rows = [mx.zeros((batch, heads, 0, b.shape[3]), b.dtype) for b in template._buffers()[:2]]
                    rows += [mx.zeros((batch, heads, 0), mx.float32), mx.zeros((batch, heads, 0), mx.int32)]
                else:
                    if c.keys.shape[3] != template.keys.shape[3] or c.values.shape[3] != template.values.shape[3] \
                            or heads != c.norms.shape[1] or c.keys.dtype != template.keys.dtype:
                        raise ValueError(
                            "mlx_knorm: BatchL2NormKVCache.extend: other holds rows of other heads, widths "
                            f"or dtype: keys {list(other.keys.shape)} {other.keys.dtype}, values "
                            f"{list(other.values.shape)} vs keys {list(self.keys.shape)} {self.keys.dtype}, "
                            f"values {list(self.values.shape)}"
                        )
                    rows = [b[:, :, : c.filled] for b in c._buffers()]
                positions = rows[3]
                lo = mx.array(c._lo, dtype=mx.int32)[:, None, None] if c.batch_size else mx.zeros((0, 1, 1), mx.int32)
                rows = [_padding_front(b, front) for b in rows]
                shifted = _padding_front(positions + (timeline - c.timeline), front)
                is_real = _padding_front(positions >= lo, front)
                rows[3] = mx.where(is_real, shifted, _slot_positions(batch, heads, filled))
                parts.append(rows)
            self._set_buffers([mx.concatenate([p[i] for p in parts], axis=0) for i in range(4)])
        self._score_sum = score_sum
        self._lo = [lo + timeline - c.timeline for c in sides for lo in c._lo]
        self._hi = [OPEN] * len(self._lo)
        self._real = self._real + other._real
        self.filled = filled
        self.timeline = timeline
        self._ranges_changed()

    @classmethod
    def merge(cls, caches) -> "BatchL2NormKVCache":
        """One batch of single-sequence ``L2NormKVCache``s: each one's
        logical state behind padding slots, on one timeline."""
        caches = list(caches)
        if not caches:
            raise ValueError("mlx_knorm: L2NormKVCache.merge: caches is empty")
        for index, cache in enumerate(caches):
            if type(cache) is not L2NormKVCache:
                raise ValueError(
                    f"mlx_knorm: L2NormKVCache.merge: caches[{index}] is a {type(cache).__name__}; "
                    "only L2NormKVCache layers merge"
                )
        budget, n_sink, recent, keep, layout, scorer = _check_same_config(caches, "L2NormKVCache.merge")
        states = [c._kept_rows() for c in caches]
        template = None
        for index, (cache, rows) in enumerate(zip(caches, states)):
            if rows is None:
                continue
            if rows[0].shape[0] != 1:
                raise ValueError(
                    f"mlx_knorm: L2NormKVCache.merge: caches[{index}] holds a batch of "
                    f"{rows[0].shape[0]} sequences; merge takes single-sequence caches"
                )
            if template is None:
                template = (index, rows)
                continue
            first_index, first = template
            for name, a, b in (("heads", first[0].shape[1], rows[0].shape[1]),
                               ("key width", first[0].shape[3], rows[0].shape[3]),
                               ("value width", first[1].shape[3], rows[1].shape[3]),
                               ("dtype", first[0].dtype, rows[0].dtype)):
                if a != b:
                    raise ValueError(
                        f"mlx_knorm: L2NormKVCache.merge: every cache must hold rows of the same "
                        f"{name}; caches[{first_index}] has {a}, caches[{index}] has {b}"
                    )
        kept = [0 if rows is None else rows[3].shape[2] for rows in states]
        offsets = [c.offset for c in caches]
        filled = max(kept)
        timeline = max(o + filled - k for o, k in zip(offsets, kept))
        first = caches[0]
        batch = cls([timeline - o for o in offsets], budget=budget, n_sink=n_sink, recent=recent,
                    keep=keep, layout=layout, scorer=scorer, filters=first._filters)
        batch._score_sum = _joined_sums(caches)
        batch.timeline = timeline
        batch._real = kept
        if template is not None:
            heads = template[1][0].shape[1]
            parts = []
            for rows, k, o in zip(states, kept, offsets):
                if rows is None:
                    rows = [mx.zeros((1, heads, 0, *b.shape[3:]), b.dtype) for b in template[1]]
                front = filled - k
                rows = [_padding_front(b, front) for b in rows]
                rows[3] = mx.concatenate(
                    [_slot_positions(1, heads, front), rows[3][:, :, front:] + (timeline - o)], axis=2)
                parts.append(rows)
            batch._set_buffers([mx.concatenate([p[i] for p in parts], axis=0) for i in range(4)])
            batch.filled = filled
        batch._ranges_changed()
        return batch

    @all_or_nothing
    def extract(self, idx: int) -> L2NormKVCache:
        """Sequence ``idx`` as an ``L2NormKVCache``: its real rows after the
        pending eviction, its own positions and offset."""
        return self._extracted(idx)

    def _extracted(self, idx: int) -> L2NormKVCache:
        """``extract``'s work, which the state setter runs inside its own change."""
        idx = check_int(idx, "idx")
        if not 0 <= idx < self.batch_size:
            raise ValueError(f"mlx_knorm: BatchL2NormKVCache.extract: idx {idx} is out of range "
                             f"for {self.batch_size} sequences")
        cache = L2NormKVCache(budget=self.budget, n_sink=self.n_sink, recent=self.recent,
                              keep=self.keep, layout=self.layout, scorer=self.scorer, filters=self._filters)
        lo, end = self._lo[idx], min(self.timeline, self._hi[idx])
        if self.keys is None or end <= lo:
            return cache  # no token of this sequence yet: the empty cache
        kept = self.size()
        real = min(self._real[idx], kept)
        rows = [b[idx : idx + 1, :, : self.filled] for b in self._buffers()]
        if kept < self.filled:
            no_rows = [mx.zeros((1, b.shape[1], 0, b.shape[3]), b.dtype) for b in rows[:2]]
            rows = evict_and_fill_unchecked(
                *rows, *no_rows, filled=self.filled, offset=self.timeline, capacity=kept,
                budget=self.budget, n_sink=self.n_sink, recent=self.recent, keep=self.keep,
                layout="temporal", new_norms=mx.zeros((1, rows[2].shape[1], 0), mx.float32),
                valid=self._valid(rows[2].shape[1])[idx : idx + 1],
            )
        positions = rows[3]
        is_real = (positions >= lo) & (positions < self._hi[idx])
        # The real rows in temporal order, then the padding.
        order = mx.argsort(mx.where(is_real, positions, INT32_MAX), axis=2)[:, :, :real]
        rows = [mx.take_along_axis(b, order if b.ndim == 3 else order[..., None], axis=2) for b in rows]
        fields = (rows[0], rows[1], rows[2], rows[3] - lo, end - lo,
                  self.budget, self.n_sink, self.recent, self.keep, self.layout)
        if callable(self.scorer):
            # Its scores are the callable's, which nothing else recomputes;
            # its state is batch-first, as merge, extend and filter take it.
            state = self._score_sum
            if isinstance(state, mx.array) and state.ndim:
                state = state[idx : idx + 1]
            cache._load(check_state(fields, user_scorer=self.scorer, user_state=state))
        else:
            cache.state = (*fields, *self._scorer_fields(slice(idx, idx + 1)))
        return cache

    def _scorer_fields(self, rows=slice(None)) -> tuple:
        """The state's scorer fields (as ``L2NormCacheBase._scorer_fields``)
        for the sequences ``rows``; a user's scorer's, which no file holds,
        for the whole batch."""
        if callable(self.scorer):
            return (UnsavableScorer(self.scorer), self._score_sum)
        if self.scorer == "knorm":
            return ()
        if self.scorer == "keydiff":
            return ("keydiff", None if self._score_sum is None else self._score_sum[rows])
        return (self.scorer, self._filters)

    # -- state and accounting -----------------------------------------------

    @property
    def state(self):
        """``(keys, values, norms, positions, ranges, real_rows, timeline,
        filled, budget, n_sink, recent, keep, layout)``: the buffers as
        stored, int32 ``[B, 2]`` valid ranges and ``[B]`` real row counts,
        then the host fields, then the scorer's fields (a user's scorer's:
        which no file can hold, and its state, as the layer cache's)."""
        return (*self._buffers(), self._ranges, mx.array(self._real, dtype=mx.int32),
                self.timeline, self.filled, self.budget, self.n_sink, self.recent, self.keep, self.layout,
                *self._scorer_fields())

    @state.setter
    @all_or_nothing
    def state(self, v) -> None:
        (budget, n_sink, recent, keep, layout, scorer, scorer_array, arrays, pairs, counts, timeline,
         filled) = check_batch_fields(v)
        batch = len(pairs)
        self.budget, self.n_sink, self.recent, self.keep, self.layout = budget, n_sink, recent, keep, layout
        self.scorer = scorer
        self._filters = scorer_array if scorer == "qfilter" else None
        self._score_sum = scorer_array if scorer == "keydiff" else None
        self._set_buffers(arrays)
        self.timeline, self.filled = timeline, filled
        self._lo, self._hi = (list(x) for x in zip(*pairs)) if batch else ([], [])
        self._real = counts
        self._ranges_changed()
        # Each sequence's rows must be a state a single cache loads (what
        # extract() gives and the step assumes), in the slots where the
        # steps leave them; else nothing changes.
        i = 0
        try:
            flaws = slot_flaws(self)
            for i in range(batch):
                if flaws[i] is not None:
                    raise ValueError(flaws[i])
                self._extracted(i)
        except (ValueError, TypeError) as err:
            error = ValueError if isinstance(err, ValueError) else TypeError
            raise error(f"mlx_knorm: BatchL2NormKVCache state, sequence {i}: {err}") from None

    @property
    def meta_state(self) -> tuple[str, ...]:
        return tuple(str(x) for x in (self.timeline, self.filled, self.budget, self.n_sink, self.recent,
                                      self.keep, self.layout))

    @meta_state.setter
    @all_or_nothing
    def meta_state(self, v) -> None:
        # The state carries every field (mlx-lm 0.32's from_state sets only
        # the state); a meta state must agree with it.
        if tuple(str(x) for x in v) != self.meta_state:
            raise ValueError(f"mlx_knorm: BatchL2NormKVCache meta_state {tuple(v)} does not match "
                             f"the state's {self.meta_state}")

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers: keys, values, norms and positions, every
        slot, the order tree, and a scorer's arrays."""
        if self.keys is None:
            return 0
        extra = [a for a in (self._tree, self._score_sum, self._filters) if isinstance(a, mx.array)]
        return sum(b.nbytes for b in self._buffers()) + sum(a.nbytes for a in extra)

    @property
    def order_tree(self) -> mx.array | None:
        """The order tree of the buffers (docs/spec.md §4 step 4), int32
        ``[B, H, 2, capacity + 1]``, which the next decode step evicts
        through; None where the next step builds it."""
        return self._tree


_register_with_mlx_lm((BatchL2NormKVCache,))

__all__ = ["BatchL2NormKVCache"]
