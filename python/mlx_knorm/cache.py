"""mlx-lm KV cache with L2-norm eviction (Devoto et al., EMNLP 2024).

``L2NormKVCache`` is a drop-in per-layer cache for ``mlx_lm`` that keeps at
most ``budget`` rows per head: the ``n_sink`` first tokens, the ``recent``
latest tokens, and, of the rest, the rows with the lowest key norm
(``keep="low"``, the paper's finding) or the highest (``keep="high"``).
It keeps the same rows as ``veloxquant_mlx.cache.knorm_cache.L2NormKVCache``
and follows the protocol of ``mlx_lm.models.cache.KVCache`` (mlx-lm 0.32).

Rows live in the slots of preallocated buffers (docs/spec.md §4, §8), like
``KVCache``'s, and each step is one ``evict_and_fill``: it applies the
eviction the previous step's new rows caused, compacts the kept rows and
writes the new ones behind them, in place once the step before has been
evaluated. ``update_and_fetch`` returns views of the occupied slots. Eviction
is deferred: a step attends to every kept row plus every new row; only the
rows stored for the next step are cut to the budget. So while no more than
``budget`` tokens have arrived the cache returns what ``KVCache`` returns,
and logits are bit-identical.

``layout="slots"`` (the default) lets a decode step move one row per head:
the spare row fills the evicted row's slot, so rows are not in temporal
order, which attention does not need (each key carries its RoPE rotation
and a query sees every kept row). ``layout="temporal"`` keeps temporal order
(logits bit-identical to the reference's cache) at the price of moving the
rows after the first evicted one.

A short block that a one-token-at-a-time cache would evict inside (a
speculative decoding verify block) attends exactly as those single steps
would, when the caches are linked by ``make_knorm_cache`` (docs/spec.md
§8, exact small blocks): the model asks one layer for the mask, and every
layer returns the rows each query would see as segments that the mask
separates; a longer verify block past the budget, which would attend as a
block, is refused (``refuse_long_verify_block``). ``trim(n)`` removes the
``n`` newest tokens exactly while no eviction has ranked them yet
(``trimmable()``), else as many as that allows, and returns how many, so
speculative decoding and mlx-lm's ``trim_prompt_cache`` work on these
caches. Every change of a cache is all or nothing (``cache_commit``). ``keys_and_values()`` returns
the rows the last step attended to, which layers that share another
layer's cache read (mlx_knorm.sharing).

``offset`` is the true absolute position (RoPE stays right after eviction);
``size()`` is the number of rows kept. ``keys`` and ``values`` are the
buffers, as ``KVCache``'s are (mlx-lm's pipeline-parallel models chain a
dependency onto ``cache.keys``, an array of the same shape; a buffer of
another shape is refused by the next step's op); ``state`` and
``positions`` present the kept rows in temporal order whatever the storage
order, computed when asked.

Limits: mlx-lm models build one attention mask from one layer's cache and
share it across layers. Every ``L2NormKVCache`` of a model holds the same
row count, so they agree; a model that asks for an array mask
(``return_array=True``, e.g. gemma2, deepseek_v3) would apply it to a
``skip_layers`` layer, whose row count differs once eviction starts, so
``make_knorm_cache`` refuses ``skip_layers`` for such models.
``L2NormKVCache.merge`` gives ``BatchL2NormKVCache`` (mlx_knorm.batch_cache),
so mlx-lm's ``BatchGenerator``, ``batch_generate`` and server batch these
caches with eviction per sequence; batches built by the caller (``[B, S]``
inputs, every sequence the same length) work on the plain cache too.

``L2NormKVCache.to_quantized`` gives ``QuantizedL2NormKVCache``, the same
cache with its rows in MLX's affine quantization (mlx-lm's ``kv_bits``):
norms are taken before quantization, so it keeps the float cache's rows.

Importing this module registers both classes, and ``BatchL2NormKVCache``,
in ``mlx_lm.models.cache``, because ``mlx_lm.models.cache.load_prompt_cache``
resolves the class names of a saved cache in that module's namespace.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
import warnings
from typing import Any, Iterable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as mlx_lm_cache
from mlx_lm.models.cache import CacheList, KVCache, _BaseCache, create_attention_mask

from .backend import current_backend, resolve
from .cache_commit import all_or_nothing, deep_copy_sharing_scorer
from .cache_state import StateError, check_block, check_state, parse_meta_state
from .defaults import (DEFAULT_BUDGET, DEFAULT_KEEP, DEFAULT_KV_GROUP_SIZE, DEFAULT_LAYOUT, DEFAULT_N_SINK,
                       DEFAULT_RECENT, DEFAULT_SKIP_LAYERS, default_recent, uses_order_tree)
from .ops.evict_and_fill import check_layout, evict_and_fill_unchecked
from .ops.key_norms import key_norms_unchecked
from .scorers import DEFAULT_SCORER, as_query_filters, check_scorer, score_rows, scorer_label
from .sharing import note_shared_read, share_positions
from .validation import FLOAT_DTYPES, INT32_MAX, check_config, check_int

# Slots added at a time while the cache fills, as KVCache grows.
GROWTH_STEP = 256
# The longest block a linked cache attends to as single steps would
# (docs/spec.md §8): speculative decoding's verify blocks, num_draft + 1.
EXACT_BLOCK = 16
# The most draft tokens whose verify block is exact: the commands, the
# server and the caches themselves refuse more (a longer block would
# attend as a block).
MAX_DRAFT_TOKENS = EXACT_BLOCK - 1


@functools.cache
def _verify_step_codes() -> frozenset:
    """The code of the function through which mlx-lm's
    ``speculative_generate_step`` runs the target model on a verify block
    (its nested ``_step``; the prompt goes through ``_prefill``)."""
    # The module, which mlx_lm's package shadows with its function generate.
    outer = importlib.import_module("mlx_lm.generate").speculative_generate_step.__code__
    return frozenset(c for c in outer.co_consts if isinstance(c, types.CodeType) and c.co_name == "_step")


def refuse_long_verify_block(steps: int, kept: int, budget: int) -> None:
    """Raise ``ValueError`` naming ``num_draft_tokens`` when a block of
    ``steps`` rows on ``kept`` kept rows would attend as one block (longer
    than ``EXACT_BLOCK``, a one-token-at-a-time cache evicting inside it)
    and is a verify block of mlx-lm's speculative decoding (called from its
    ``_step``): its tokens would then differ from ordinary decoding's
    (docs/spec.md §8, exact small blocks). A prefill chunk is served."""
    if steps <= EXACT_BLOCK or kept + steps <= budget + 1:
        return
    codes = _verify_step_codes()
    frame = sys._getframe(1)
    while frame is not None and frame.f_code not in codes:
        frame = frame.f_back
    if frame is None:
        return
    drafts = frame.f_locals.get("n_predict", steps) - 1
    raise ValueError(
        f"mlx_knorm: num_draft_tokens must be at most {MAX_DRAFT_TOKENS} with eviction caches, got {drafts}: "
        f"a verify block of more than {EXACT_BLOCK} tokens past the budget attends as one block, not as "
        "decoding its tokens one at a time, so speculative decoding would give other tokens "
        "(docs/spec.md §8, exact small blocks); the cache is unchanged"
    )


class MaskPlan:
    """What the linked caches of one prompt cache agreed with the model for
    its next block: ``block = (offset, S, kept)`` when the mask that the
    model got from one of them shows each query its own segment, else None.
    The model builds one mask and gives it to every layer, so every layer
    must return the rows that mask describes.

    ``caches`` is how many caches ``link_prompt_cache`` linked, ``holders``
    how many hold this plan. A deep copy of the whole prompt cache copies
    the plan once for all its layers; a layer deep-copied on its own gets a
    plan no other copy holds, which plans no block (``linked``): the model
    gives its mask to layers whose plans it never saw."""

    def __init__(self, caches: int = 0) -> None:
        self.block: tuple[int, int, int] | None = None
        self.caches = caches
        self.holders = caches

    @property
    def linked(self) -> bool:
        """Whether every cache this plan linked holds it."""
        return self.holders == self.caches

    def __deepcopy__(self, memo) -> "MaskPlan":
        # The copied caches count themselves in (L2NormCacheBase.__deepcopy__).
        copied = MaskPlan(self.caches)
        copied.holders = 0
        copied.block = self.block
        return copied


def segment_lengths(kept: int, steps: int, budget: int) -> list[int]:
    """Rows of each query's segment in an exact small block: the kept rows
    after single steps ``0 .. j-1``, plus new row ``j``."""
    return [min(kept + j, budget) + 1 for j in range(steps)]


def segment_mask(lengths: list[int]) -> mx.array:
    """bool ``[S, sum(lengths)]``: query ``j`` sees segment ``j`` only."""
    ends = mx.cumsum(mx.array(lengths, mx.int32))
    starts = ends - mx.array(lengths, mx.int32)
    column = mx.arange(sum(lengths), dtype=mx.int32)
    return (column >= starts[:, None]) & (column < ends[:, None])


def step_capacity(needed: int, current: int, budget: int) -> int:
    """Slots for a step's output buffers (docs/spec.md §8): the current ones
    when they fit and are not larger than a decode step at the budget needs
    (then the step can run in place), else ``needed`` rounded up to
    ``GROWTH_STEP``, capped there."""
    most = max(needed, budget + 1)
    if needed <= current <= most:
        return current
    return min(-(-needed // GROWTH_STEP) * GROWTH_STEP, most)


def order_tree_argument(layout: str, budget: int, recent: int, tree: mx.array | None,
                        backend: str | None = None):
    """evict_and_fill's ``tree`` for a cache's next step: the previous
    step's tree, or True to build one, where the configuration keeps one
    (``defaults.uses_order_tree``: on the CPU) and the step runs no Metal
    kernel (the emulator's, like a GPU's, builds the tree and never reads
    it); else False. ``backend``: the step's, as ``backend.resolve`` gave
    it (None: the current choice)."""
    if backend is None:
        backend = current_backend()
    if backend == "metal-emulator" or not uses_order_tree(layout, budget, recent):
        return False
    return True if tree is None else tree


# dtype -> its name, for the floating dtypes a block may have.
_FLOAT_NAMES = {dtype: name for name, dtype in FLOAT_DTYPES.items()}


def _block_signature(keys, values) -> tuple | None:
    """What ``check_block`` reads of a block: its shapes and dtypes, the
    floating ones by name (a cache is copied with ``copy.deepcopy``, which
    cannot copy an ``mx.Dtype``); None for anything but two arrays, which
    ``check_block`` refuses."""
    if type(keys) is not mx.array or type(values) is not mx.array:
        return None
    return keys.shape, values.shape, _FLOAT_NAMES.get(keys.dtype), _FLOAT_NAMES.get(values.dtype)


def _storage_dtype(keys: mx.array, values: mx.array) -> mx.Dtype:
    """The model's own dtype, as ``KVCache`` stores it (a float32 model's
    attention then runs on float32 rows, not on a mixed-dtype pair); keys and
    values of different dtypes share the one that holds both exactly."""
    return mx.result_type(keys.dtype, values.dtype)


def _each(f, rows):
    """``f`` of one array, or of each array of a tuple (a quantized cache's
    keys and values are ``(packed, scales, biases)``)."""
    return tuple(f(r) for r in rows) if isinstance(rows, tuple) else f(rows)


def _arrays(rows) -> list:
    return list(rows) if isinstance(rows, tuple) else [rows]


def _first(rows) -> mx.array:
    return rows[0] if isinstance(rows, tuple) else rows


class UnsavableScorer:
    """A user's scorer as a state field: what a file cannot hold. Its repr
    is the message mlx-lm's ``save_prompt_cache`` raises with."""

    def __init__(self, scorer):
        self.scorer = scorer

    def __repr__(self) -> str:
        return (f"a user's scorer ({scorer_label(self.scorer)}): a cache that ranks by one has no state a "
                "file can hold; save caches of a built-in scorer")


class L2NormCacheBase(_BaseCache):
    """What ``L2NormKVCache`` and ``QuantizedL2NormKVCache`` share: the
    configuration, the slot buffers and their step, trim, masks, state and
    accounting. The two differ in how a row is stored (``_new_rows``,
    ``_no_rows``, ``_widths``) and in their state's extra fields."""

    quantized = False
    # Set by _load; here too for a cache that skipped it (unpickled from an
    # older version of this class).
    _tree = None
    _checked_block = None
    _last_block = None

    def _extra(self) -> tuple:
        """The state's and meta_state's fields after the float cache's."""
        return ()

    def _scorer_fields(self) -> tuple:
        """The state's scorer fields (docs/spec.md §8): none for knorm, else
        the scorer's name and its array (keydiff's running sum, qfilter's
        filters). A user's scorer has none that a file could hold: its
        fields are the scorer, which no file can store (so
        ``save_prompt_cache`` refuses it, saying why), and its state, so
        that mlx-lm's ``mx.eval(cache.state)`` evaluates what it holds."""
        if callable(self.scorer):
            return (UnsavableScorer(self.scorer), self._score_sum)
        if self.scorer == "knorm":
            return ()
        return (self.scorer, {"keydiff": self._score_sum, "qfilter": self._filters}.get(self.scorer))

    def __deepcopy__(self, memo) -> "L2NormCacheBase":
        """Every field deep-copied but the scorer (the same callable, so the
        copy batches with the original), the mask plan through ``memo`` (one
        copy for all the layers copied together, MaskPlan)."""
        copied = deep_copy_sharing_scorer(self, memo)
        plan = getattr(copied, "_mask_plan", None)
        if plan is not None:
            plan.holders += 1
        return copied

    def _load(self, checked) -> None:
        """Take a state that passed ``check_state``: the only way anything
        but a step (or a trim) changes the cache."""
        self.budget, self.n_sink, self.recent, self.keep = checked.config
        self.layout = checked.layout
        if checked.quantization is not None:
            self.group_size, self.bits = checked.quantization
        self.keys = None
        self.values = None
        self.norms: mx.array | None = None
        self.slot_positions: mx.array | None = None
        self._tree = None
        # The last block check_block passed (_block_signature), while the
        # stored widths stay: a block of the same signature passes again.
        self._checked_block = None
        self.filled = 0
        self.offset = checked.offset
        if checked.rows is not None:
            self._set_buffers(checked.rows)
            self.filled = checked.rows[3].shape[2]
        self.scorer, array = checked.scorer
        self._filters = array if self.scorer == "qfilter" else None
        # keydiff's running sum, or a user's scorer's state.
        self._score_sum = array if callable(self.scorer) or self.scorer == "keydiff" else None
        # A loaded state's history is unknown unless nothing was ever evicted;
        # a quantized keydiff cache's running sum may come from float rows
        # before a conversion, which its rows cannot rebuild.
        rebuildable = not (self.quantized and self.scorer == "keydiff")
        self._trimmable = self.offset if self.filled == self.offset and rebuildable else 0
        self._score_anchor = None if self._trimmable == self.offset else self._score_sum
        self._last_block = None
        self._forget_block()

    def _buffers(self) -> list:
        return [self.keys, self.values, self.norms, self.slot_positions]

    def _set_buffers(self, buffers, tree=None) -> None:
        """The slot buffers and, where a step just made it, their order
        tree (docs/spec.md §4 step 4); any other change drops the tree, and
        the next step builds one again."""
        self.keys, self.values, self.norms, self.slot_positions = buffers
        self._tree = tree

    @property
    def order_tree(self) -> mx.array | None:
        """The order tree of the buffers (docs/spec.md §4 step 4), int32
        ``[B, H, 2, capacity + 1]``, which the next decode step evicts
        through; None where the next step builds it."""
        return self._tree

    def _dims(self) -> tuple[int, int, int, int] | None:
        """``(B, H, D_k, D_v)`` of the rows stored (None when empty)."""
        if self.keys is None:
            return None
        batch, heads = self.norms.shape[:2]
        return (batch, heads, *self._widths())

    @all_or_nothing
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Absorb ``[B, H, S, D]`` keys/values; return the kept rows and the new rows.

        The returned arrays are views of the occupied slots: what this step
        attends to (nothing of it is evicted yet). The eviction that the new
        rows cause is applied by the next step. A block that does not fit
        raises naming the argument and changes nothing, on the first call
        as on later ones (cache_state.check_block).
        """
        previous = self._buffers()
        block = _block_signature(keys, values)
        # A block of the last passed block's signature passes again but for
        # the offset's bound: the stored B, H and widths are that block's
        # while only steps, _load and trim change the buffers (a buffer
        # reassigned with another shape is the op's to refuse).
        if block is None or block != self._checked_block or self.offset + block[0][2] > INT32_MAX:
            check_block(keys, values, self._dims(), self.offset, getattr(self, "group_size", None))
        batch, heads, steps, key_dim = keys.shape
        kept = min(self.filled, self.budget)
        refuse_long_verify_block(steps, kept, self.budget)
        exact = self._planned_block(steps, kept)
        if self.keys is None:
            dtype = _storage_dtype(keys, values)
            buffers = [
                *self._no_rows(batch, heads, key_dim, values.shape[-1], dtype),
                mx.zeros((batch, heads, 0), mx.float32),
                mx.zeros((batch, heads, 0), mx.int32),
            ]
        else:
            buffers = previous
            dtype = self._storage_dtype()
        capacity = self._capacity(kept + steps, buffers[2].shape[2])
        new_keys, new_values, new_norms = self._new_rows(keys, values, dtype)
        score_sum = self._score_sum
        if self.scorer != "knorm":
            new_norms, score_sum = score_rows(self.scorer, *self._as_stored(new_keys, new_values), self._score_sum,
                                              offset=self.offset, filters=self._filters)
        # Resolved once for the step and its order tree: both ask the current backend.
        backend = resolve(None, key_dim=key_dim if new_norms is None else None)
        previous_tree = self._tree
        tree = order_tree_argument(self.layout, self.budget, self.recent, previous_tree, backend)
        # The op writes in place only if it holds the buffers' last reference.
        self._set_buffers([None] * 4)
        try:
            out = self._step(buffers, new_keys, new_values, new_norms, self.filled, self.offset,
                             capacity, tree=tree, backend=backend)
            segments = self._segments(out, new_keys, new_values, new_norms, kept, self.offset) if exact else None
        except BaseException:
            self._set_buffers(previous, previous_tree)
            raise
        evicted = self.filled > self.budget
        self._set_buffers(out[:4], out[4] if tree is not False else None)
        if evicted:
            # What trim rebuilds the running sum from (docs/spec.md §8).
            self._score_anchor = self._score_sum
        self._score_sum = score_sum
        self._trimmable = steps + (0 if evicted else self._trimmable)
        self._last_block = (steps, kept if exact else None)
        self.filled = kept + steps
        self.offset += steps
        self._checked_block = block
        if segments is not None:
            return segments
        return self._occupied(self.keys), self._occupied(self.values)

    def _step(self, buffers, new_keys, new_values, new_norms, filled: int, offset: int, capacity: int,
              tree=False, backend: str | None = None):
        """One §4 step on ``buffers`` under the cache's configuration (with
        ``tree``, the order tree a fifth output) on ``backend`` (None: the
        one ``backend.resolve`` picks)."""
        return evict_and_fill_unchecked(
            *buffers, new_keys, new_values,
            filled=filled, offset=offset, capacity=capacity,
            budget=self.budget, n_sink=self.n_sink, recent=self.recent, keep=self.keep,
            layout=self.layout, new_norms=new_norms, tree=tree, backend=backend,
        )

    def _planned_block(self, steps: int, kept: int) -> bool:
        """Whether the model's mask for this block shows each query its own
        segment (the plan one of the linked caches made in ``make_mask``)."""
        plan = getattr(self, "_mask_plan", None)
        if plan is None or plan.block is None or plan.block[:2] != (self.offset, steps):
            return False
        if plan.block[2] != kept:
            raise ValueError(
                f"mlx_knorm: {type(self).__name__} holds {kept} rows, but the model's mask for this "
                f"{steps}-token block was made by a linked cache holding {plan.block[2]}: the "
                "layers of this prompt cache are out of step (were some fed other blocks?)"
            )
        return True

    def _segments(self, out, new_keys, new_values, new_norms, kept: int, offset: int):
        """Keys and values of an exact small block at ``offset``: for each
        query ``j`` the rows a one-token-at-a-time cache attends to there,
        one segment after the other (docs/spec.md §8). Segment 0 is the
        step's own first ``kept + 1`` rows; each later one is a single step,
        out of place, from the one before."""
        steps = _first(new_keys).shape[2]
        lengths = segment_lengths(kept, steps, self.budget)
        first = lengths[0]
        segments = [(_each(lambda b: b[:, :, :first], out[0]), _each(lambda b: b[:, :, :first], out[1]))]
        previous = out[:4]
        for j in range(1, steps):
            row = lambda b, j=j: b[:, :, j : j + 1]
            previous = self._step(
                previous, _each(row, new_keys), _each(row, new_values),
                None if new_norms is None else row(new_norms),
                lengths[j - 1], offset + j, lengths[j],
            )
            segments.append(previous[:2])

        def joined(which: int):
            parts = [segment[which] for segment in segments]
            if isinstance(parts[0], tuple):
                return tuple(mx.concatenate([p[i] for p in parts], axis=2) for i in range(len(parts[0])))
            return mx.concatenate(parts, axis=2)

        return joined(0), joined(1)

    def _capacity(self, needed: int, current: int) -> int:
        return step_capacity(needed, current, self.budget)

    def _occupied(self, rows):
        """Slots ``[0, filled)`` of ``[B, H, capacity, D]`` buffers (views)."""
        if type(rows) is mx.array:  # the float cache, on every step
            return rows if rows.shape[2] == self.filled else rows[..., : self.filled, :]
        return _each(lambda b: b if b.shape[2] == self.filled else b[..., : self.filled, :], rows)

    def _kept_rows(self, config=None) -> tuple | None:
        """The kept rows once the pending eviction is applied, under
        ``config`` (``(budget, n_sink, recent, keep)``, the cache's own by
        default), in temporal order: keys, values, norms, positions
        ``[B, H, kept, ...]``. Computed out of place; the buffers are not
        touched."""
        if self.keys is None:
            return None
        budget, n_sink, recent, keep = config or (self.budget, self.n_sink, self.recent, self.keep)
        kept = min(self.filled, budget)
        buffers = self._buffers()
        if kept < self.filled:
            no_rows = [_each(lambda b: mx.zeros((*b.shape[:2], 0, b.shape[3]), b.dtype), r) for r in buffers[:2]]
            rows = evict_and_fill_unchecked(
                *buffers, *no_rows, filled=self.filled, offset=self.offset, capacity=kept,
                budget=budget, n_sink=n_sink, recent=recent, keep=keep, layout="temporal",
                new_norms=mx.zeros((*buffers[2].shape[:2], 0), mx.float32),
            )
        else:
            rows = [_each(lambda b: b[:, :, :kept], r) for r in buffers]
        if self.layout == "slots":
            order = mx.argsort(rows[3], axis=2)
            rows = [
                _each(lambda b: mx.take_along_axis(b, order if b.ndim == 3 else order[..., None], axis=2), r)
                for r in rows
            ]
        return tuple(rows)

    @property
    def positions(self) -> mx.array | None:
        """int32 absolute token positions ``[B, H, kept]`` of the kept rows,
        increasing (None when empty)."""
        kept = self._kept_rows()
        return None if kept is None else kept[3]

    def keys_and_values(self):
        """The keys and values the last step's attention read, in the order
        its mask assumes, as mlx-lm 0.32.2's ``KVCache.keys_and_values``:
        what the last ``update_and_fetch`` returned (docs/spec.md §8, KV
        sharing). That is slots ``[0, filled)``: the kept rows, then the
        last block's rows (its eviction is still pending); after an exact
        small block, that block's segments again, recomputed from the
        buffers (holding them would keep ``budget`` times a block's rows
        alive between steps). After a trim or a load, slots ``[0, filled)``.
        ``(None, None)`` when empty. Models whose later layers reuse an
        earlier layer's cache (gemma3n, afm7) read its rows here."""
        if self.keys is None:
            return None, None
        block = self._last_block
        if block is None or block[1] is None:
            keys, values = self._occupied(self.keys), self._occupied(self.values)
        else:
            steps, kept = block
            buffers = self._buffers()
            new = lambda b: b[:, :, kept : kept + steps]
            keys, values = self._segments(buffers, _each(new, buffers[0]), _each(new, buffers[1]),
                                          new(buffers[2]), kept, self.offset - steps)
        if block is not None:
            note_shared_read(_first(keys), self.offset - block[0])
        return keys, values

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ):
        """The mask for ``N`` new queries against the kept rows ++ new rows.

        Every kept row precedes every query, so the right mask is KVCache's
        causal mask with the kept row count as its offset: all kept rows
        visible, causal among the new rows (which the step writes behind the
        kept rows, in order). Before any eviction that count equals
        ``offset`` and the mask is exactly KVCache's. For an exact small
        block of linked caches, the segment mask that every linked layer's
        step then follows (docs/spec.md §8).
        """
        stored = self.size()
        refuse_long_verify_block(N, stored, self.budget)
        plan = getattr(self, "_mask_plan", None)
        if plan is not None:
            plan.block = None
            if plan.linked and window_size is None and 1 < N <= EXACT_BLOCK and stored + N > self.budget + 1:
                plan.block = (self.offset, N, stored)
                return segment_mask(segment_lengths(stored, N, self.budget))
        if window_size is not None and stored < self.offset:
            # Kept rows sit at different positions in different heads, so a
            # position window has no single [N, stored + N] mask.
            raise ValueError(
                f"mlx_knorm: {type(self).__name__} cannot serve a sliding-window layer "
                f"(window_size={window_size}) once it has evicted rows; leave that "
                "layer to the model's own cache (make_knorm_cache does so for "
                "RotatingKVCache layers)"
            )
        return create_attention_mask(
            N, offset=stored, return_array=return_array, window_size=window_size
        )

    def is_trimmable(self) -> bool:
        """True: ``trim`` is supported. mlx-lm asks this before speculative
        decoding and before each ``trim_prompt_cache``; whether a given
        count can be trimmed is ``trimmable()``'s answer."""
        return True

    def trimmable(self) -> int:
        """The number of newest tokens ``trim`` removes exactly: those of the
        updates since the last step that evicted a row (docs/spec.md §8)."""
        return self._trimmable

    @all_or_nothing
    def trim(self, n: int) -> int:
        """Remove the ``n`` newest tokens, or as many of them as
        ``trimmable()`` allows: the cache is then the cache that never saw
        the tokens removed. Returns how many it removed, as mlx-lm's
        ``KVCache`` and ``RotatingKVCache`` do (past ``trimmable()`` an
        older row may already have been evicted in favour of a newer one,
        and nothing brings it back)."""
        n = check_int(n, "n")
        if n < 0:
            raise ValueError(f"mlx_knorm: {type(self).__name__}.trim: n must be >= 0, got {n}")
        n = min(n, self._trimmable)
        if n == 0:
            return 0
        self.filled -= n
        self.offset -= n
        self._trimmable -= n
        self._tree = None
        self._last_block = None
        if self.offset == 0:
            # Back to the start: the empty cache, which takes any shape.
            self._set_buffers([None] * 4)
            self._checked_block = None
            self._score_sum = None
        elif self.scorer != "knorm" and self._score_sum is not None:
            self._score_sum = self._rebuilt_score_sum()
        self._forget_block()
        return n

    def _rebuilt_score_sum(self):
        """A stateful scorer's state after a trim: from its anchor (the state
        at ``offset - trimmable()``, before the rows no eviction has ranked
        yet) over those rows, which sit in the last ``trimmable()`` occupied
        slots in position order (new rows go to the slots after the kept
        ones, and none has moved since): the state of the cache that never
        saw the rows trimmed (docs/spec.md §8). A stateless scorer's stays."""
        tail = self._trimmable
        if tail == 0:
            return self._score_anchor
        rows = [_each(lambda b: b[:, :, self.filled - tail : self.filled], r) for r in (self.keys, self.values)]
        _, total = score_rows(self.scorer, *self._as_stored(*rows), self._score_anchor,
                              offset=self.offset - tail, filters=self._filters)
        return total

    def _forget_block(self) -> None:
        plan = getattr(self, "_mask_plan", None)
        if plan is not None:
            plan.block = None

    def empty(self) -> bool:
        return self.keys is None

    def size(self) -> int:
        """Rows kept per head (at most ``budget``), as RotatingKVCache reports its window."""
        return min(self.filled, self.budget)

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers: keys, values, norms and positions, every
        slot, the order tree, and a scorer's arrays (keydiff's running sum,
        qfilter's filters)."""
        if self.keys is None:
            return 0
        extra = [a for a in (self._tree, self._score_sum, self._filters) if isinstance(a, mx.array)]
        return sum(a.nbytes for rows in self._buffers() for a in _arrays(rows)) + sum(a.nbytes for a in extra)

    @property
    def state(self):
        """Everything needed to rebuild the cache, configuration included,
        because mlx-lm 0.32's ``load_prompt_cache`` calls ``from_state(state)``
        with no separate meta state: ``(keys, values, norms, positions,
        offset, budget, n_sink, recent, keep, layout)`` (the quantized cache:
        then ``group_size, bits``), the kept rows in temporal order
        (``state[:2]`` is what the reference's cache stores)."""
        kept = self._kept_rows() or (None, None, None, None)
        return (*kept, self.offset, self.budget, self.n_sink, self.recent, self.keep, self.layout,
                *self._extra(), *self._scorer_fields())

    @state.setter
    @all_or_nothing
    def state(self, v) -> None:
        """Load a saved state after checking every field against the others
        and the configuration (cache_state.check_state); nothing changes if
        a check fails."""
        self._load(check_state(v, quantized=self.quantized))

    @property
    def meta_state(self) -> tuple[str, ...]:
        """The configuration as strings, for tools using the older two-part
        (``state`` + ``meta_state``) mlx-lm protocol."""
        return (str(self.budget), str(self.n_sink), str(self.recent), self.keep, self.layout,
                *(str(x) for x in self._extra()))

    @meta_state.setter
    @all_or_nothing
    def meta_state(self, v) -> None:
        """A new configuration and layout for the stored rows
        (docs/spec.md §8): the rows are evicted under the new configuration
        and stored in temporal order, a state that must pass the load
        check. One the rows cannot satisfy raises naming the field, and
        nothing changes. A quantized cache's ``group_size`` and ``bits``
        cannot change."""
        budget, n_sink, recent, keep, layout, *extra = parse_meta_state(v, self.quantized)
        config = check_config(budget, n_sink, recent, keep)
        layout = check_layout(layout)
        if "offset" not in vars(self):
            # Made by from_state's cls.__new__ with no state set yet: empty.
            self._load(check_state((None, None, None, None, 0, *config, layout, *extra), quantized=self.quantized))
            return
        for field, new, held in zip(("group_size", "bits"), extra, self._extra()):
            if new != held:
                raise ValueError(
                    f"mlx_knorm: {type(self).__name__} meta_state field '{field}': the stored rows "
                    f"are quantized with {field}={held}, and cannot take {new}"
                )
        if (config, layout) == ((self.budget, self.n_sink, self.recent, self.keep), self.layout):
            return
        if callable(self.scorer):
            raise ValueError(f"mlx_knorm: {type(self).__name__} meta_state: a cache that ranks by a user's "
                             f"scorer ({scorer_label(self.scorer)}) cannot check its rows under a new "
                             "configuration; the cache is unchanged")
        scorer_fields = self._scorer_fields()
        rows = self._kept_rows(config) or (None,) * 4
        try:
            checked = check_state((*rows, self.offset, *config, layout, *self._extra(), *scorer_fields),
                                  self.quantized)
        except StateError as err:
            setting = err.setting or err.field
            value = dict(zip(("budget", "n_sink", "recent"), config)).get(setting, "this value")
            raise ValueError(
                f"mlx_knorm: {type(self).__name__} meta_state field '{setting}': the stored rows "
                f"cannot satisfy {setting}={value} ({err}); the cache is unchanged"
            ) from err
        self._load(checked)

    def _fp16_bytes(self, tokens: int) -> int:
        # The reference's accounting: K + V at 2 bytes per element, all B*H
        # heads; keys and values may differ in width (multi-head latent attention).
        batch, heads, key_dim, value_dim = self._dims()
        return batch * heads * tokens * (key_dim + value_dim) * 2

    @property
    def knorm_kept_bytes(self) -> int:
        """float16-equivalent bytes of the kept K + V rows across all heads."""
        return 0 if self.keys is None else self._fp16_bytes(self.size())

    @property
    def full_seq_bytes(self) -> int:
        """float16-equivalent K + V bytes had every token seen been kept."""
        return 0 if self.keys is None else self._fp16_bytes(self.offset)

    @property
    def compression_ratio(self) -> float:
        """full_seq_bytes / knorm_kept_bytes; above 1 means memory saved."""
        kept = self.knorm_kept_bytes
        return 1.0 if kept == 0 else self.full_seq_bytes / kept

    @property
    def tokens_seen(self) -> int:
        """Token positions absorbed, summed over all B*H heads."""
        if self.keys is None:
            return 0
        batch, heads = self._dims()[:2]
        return batch * heads * self.offset

    @property
    def tokens_kept(self) -> int:
        """Rows kept per head (every head keeps the same count)."""
        return self.size()


def _scorer_state(scorer, filters) -> tuple:
    """A new cache's scorer fields (docs/spec.md §8): none for knorm (and a
    user's scorer, set on the cache after its state), the name and its
    array otherwise (keydiff's running sum starts as None)."""
    scorer = check_scorer(scorer)
    if scorer == "qfilter":
        if filters is None:
            raise ValueError("mlx_knorm: the qfilter scorer needs filters, this layer's [H, D] query filters "
                             "(make_knorm_cache takes a `mlx-knorm calibrate` file)")
        if not isinstance(filters, mx.array):
            raise TypeError(f"mlx_knorm: filters must be an mlx.core.array, this layer's [H, D] float32 query "
                            f"filters, got {type(filters).__name__}")
        if filters.dtype != mx.float32 or filters.ndim != 2 or not mx.all(mx.isfinite(filters)).item():
            raise ValueError(f"mlx_knorm: filters must be finite float32 [H, D], this layer's query filters, "
                             f"got {filters.dtype} {list(filters.shape)}")
        return ("qfilter", filters)
    if filters is not None:
        raise ValueError(f"mlx_knorm: filters are for the qfilter scorer, not {scorer_label(scorer)}")
    if callable(scorer) or scorer == "knorm":
        return ()
    return (scorer, None)


def _pick_config(config, budget, n_sink, recent, keep) -> tuple:
    """The constructor's configuration: keyword arguments over the
    reference's config object (``knorm_budget``, ...) over the defaults."""

    def pick(value, field, default):
        return value if value is not None else getattr(config, field, default)

    return (
        pick(budget, "knorm_budget", DEFAULT_BUDGET),
        pick(n_sink, "knorm_n_sink", DEFAULT_N_SINK),
        pick(recent, "knorm_recent", DEFAULT_RECENT),
        pick(keep, "knorm_keep", DEFAULT_KEEP),
    )


# Perplexity over the full cache's at 1/8 of a 1024-token context on
# SmolLM2-135M with no recent window (docs/quality.md, docs/scorers.md).
_ALONE_COST_AT_ONE_EIGHTH = {"knorm": "47x", "vnorm": "53x", "keydiff": "16x", "qfilter": "4.5x"}


def _no_window_warning(scorer) -> str:
    rule = "the paper's rule alone" if scorer == "knorm" else f"the {scorer_label(scorer)} scores alone"
    cost = _ALONE_COST_AT_ONE_EIGHTH.get(scorer) if isinstance(scorer, str) else None
    measured = (f", which cost {cost} the full cache's perplexity at 1/8 of the context on SmolLM2-135M "
                "where make_knorm_cache's default window of half the budget cost 1.36x (docs/quality.md, "
                "docs/scorers.md)") if cost else ", which costs far more perplexity than a window"
    return (f"mlx_knorm: L2NormKVCache built without recent keeps no recent window (recent=0, {rule})"
            f"{measured}. Build a model's caches with make_knorm_cache(model, budget), or pass "
            "recent=default_recent(budget, n_sink) (mlx_knorm.defaults) for that window, or recent=0 "
            "for this rule without this warning.")


class L2NormKVCache(L2NormCacheBase):
    """One layer's KV cache with L2-norm eviction, for ``mlx_lm`` models.

    Construct with the reference's config object (fields ``knorm_budget``,
    ``knorm_n_sink``, ``knorm_recent``, ``knorm_keep``; missing fields take
    the defaults 512, 4, 0, "low") and/or keyword arguments ``budget``,
    ``n_sink``, ``recent``, ``keep``, which take precedence over the config,
    and ``layout`` (``"slots"``, the default, or ``"temporal"``), and
    ``scorer`` (docs/spec.md §2a, ``mlx_knorm.scorers``: ``"knorm"``, the
    default, ``"keydiff"``, ``"vnorm"``, ``"qfilter"`` with ``filters``, this
    layer's ``[H, D]`` query filters, or a callable). Invalid settings raise
    ``ValueError``/``TypeError`` naming the argument.

    ``make_knorm_cache(model, budget)`` is the way to build a model's caches:
    it keeps half the budget as a recent window (docs/quality.md). Built
    here without ``recent`` (neither the argument nor the config's
    ``knorm_recent``), the cache takes the reference's 0, the paper's rule
    alone, and warns (``UserWarning``) that this costs far more perplexity;
    ``recent=0`` asks for that rule without the warning,
    ``recent=default_recent(budget, n_sink)`` (``mlx_knorm.defaults``) for
    ``make_knorm_cache``'s window.

    Storage, as ``KVCache``'s with its spare slots: ``keys``
    ``[B, H, capacity, D_k]`` and ``values [B, H, capacity, D_v]`` in the
    storage dtype (the inputs' dtype, as ``KVCache``'s), ``norms``
    (each key's float32 norm, taken once from the stored key) and
    ``slot_positions`` (int32 absolute positions) ``[B, H, capacity]``;
    slots ``[0, filled)`` are occupied, in storage order. ``state`` and
    ``positions`` give the kept rows in temporal order. ``trim`` removes the
    newest tokens exactly, as many as ``trimmable()`` allows; ``to_quantized``
    gives the quantized cache that mlx-lm's ``kv_bits`` asks for;
    ``merge`` gives the batch cache that mlx-lm's ``BatchGenerator`` asks
    for.
    """

    def __init__(
        self,
        config: Any = None,
        *,
        budget: int | None = None,
        n_sink: int | None = None,
        recent: int | None = None,
        keep: str | None = None,
        layout: str = DEFAULT_LAYOUT,
        scorer=DEFAULT_SCORER,
        filters: mx.array | None = None,
    ) -> None:
        # An empty state, through the one check every change takes.
        self.state = (None, None, None, None, 0, *_pick_config(config, budget, n_sink, recent, keep), layout,
                      *_scorer_state(scorer, filters))
        if callable(scorer):
            self.scorer = scorer
        if recent is None and getattr(config, "knorm_recent", None) is None:
            warnings.warn(_no_window_warning(scorer), UserWarning, stacklevel=2)

    def _widths(self) -> tuple[int, int]:
        return self.keys.shape[3], self.values.shape[3]

    def _storage_dtype(self) -> mx.Dtype:
        return self.keys.dtype

    def _no_rows(self, batch, heads, key_dim, value_dim, dtype):
        return mx.zeros((batch, heads, 0, key_dim), dtype), mx.zeros((batch, heads, 0, value_dim), dtype)

    def _new_rows(self, keys, values, dtype):
        # The step takes the norms from the stored keys itself (docs/spec.md §4).
        return keys.astype(dtype), values.astype(dtype), None

    def _as_stored(self, keys, values):
        """Rows as the cache holds them, which a scorer other than knorm scores."""
        return keys, values

    @classmethod
    def merge(cls, caches) -> "BatchL2NormKVCache":
        """One ``BatchL2NormKVCache`` of single-sequence caches of one
        configuration (docs/spec.md §8, batches): what mlx-lm's
        ``BatchGenerator`` and server call to batch a layer."""
        from .batch_cache import BatchL2NormKVCache

        return BatchL2NormKVCache.merge(caches)

    @all_or_nothing
    def to_quantized(self, group_size: int = DEFAULT_KV_GROUP_SIZE, bits: int = 4) -> "QuantizedL2NormKVCache":
        """This cache with its stored rows in MLX's affine quantization, as
        mlx-lm's ``maybe_quantize_kv_cache`` asks of ``KVCache``
        (docs/spec.md §8): the same kept rows, norms, positions, offset and
        trim count, each stored key and value row ``mx.quantize``d; later
        rows are quantized as they come. This cache is left as it was."""
        quantized = QuantizedL2NormKVCache(
            budget=self.budget, n_sink=self.n_sink, recent=self.recent, keep=self.keep,
            layout=self.layout, group_size=group_size, bits=bits, scorer=self.scorer, filters=self._filters,
        )
        if self.keys is not None:
            for name, width in (("keys", self.keys.shape[3]), ("values", self.values.shape[3])):
                if width % quantized.group_size:
                    raise ValueError(
                        f"mlx_knorm: to_quantized: group_size {quantized.group_size} must divide "
                        f"the {name} width {width}"
                    )
            quantized._set_buffers([
                quantized._quantize(self._occupied(self.keys)),
                quantized._quantize(self._occupied(self.values)),
                self.norms[:, :, : self.filled],
                self.slot_positions[:, :, : self.filled],
            ])
            quantized.filled = self.filled
            quantized.offset = self.offset
        quantized._trimmable = self._trimmable
        quantized._last_block = self._last_block
        quantized._score_sum, quantized._score_anchor = self._score_sum, self._score_anchor
        if self.keys is not None and (self.scorer == "keydiff" or callable(self.scorer)):
            # Its state would be rebuilt from the quantized rows, which it did
            # not score: no trim goes back past the conversion.
            quantized._trimmable, quantized._score_anchor = 0, self._score_sum
        if getattr(self, "_mask_plan", None) is not None:
            quantized._mask_plan = self._mask_plan
        return quantized


class QuantizedL2NormKVCache(L2NormCacheBase):
    """``L2NormKVCache`` with every stored row in MLX's affine quantization
    (docs/spec.md §8), as mlx-lm's ``QuantizedKVCache`` stores its rows:
    ``keys`` and ``values`` are ``(packed, scales, biases)`` buffers, and
    with ``bits`` and ``group_size`` mlx-lm's models attend through their
    quantized path. Each new key's norm is taken before quantization, from
    the row the float cache would store, so both caches keep the same
    positions. Made by ``L2NormKVCache.to_quantized`` (mlx-lm's ``kv_bits``)
    or directly: the float cache's arguments, then ``group_size`` (32, 64,
    128) and ``bits`` (1-6, 8)."""

    quantized = True

    def __init__(
        self,
        config: Any = None,
        *,
        budget: int | None = None,
        n_sink: int | None = None,
        recent: int | None = None,
        keep: str | None = None,
        layout: str = DEFAULT_LAYOUT,
        group_size: int = DEFAULT_KV_GROUP_SIZE,
        bits: int = 4,
        scorer=DEFAULT_SCORER,
        filters: mx.array | None = None,
    ) -> None:
        self.state = (None, None, None, None, 0, *_pick_config(config, budget, n_sink, recent, keep),
                      layout, group_size, bits, *_scorer_state(scorer, filters))
        if callable(scorer):
            self.scorer = scorer

    def _extra(self) -> tuple:
        return self.group_size, self.bits

    @classmethod
    def merge(cls, caches):
        """Refused: there is no quantized batch cache. Defined so that
        mlx-lm's ``BatchGenerator`` reports this instead of falling back."""
        raise ValueError(
            "mlx_knorm: QuantizedL2NormKVCache cannot be batched (no quantized batch cache); "
            "batch L2NormKVCache caches (no kv_bits) or generate one sequence at a time"
        )

    def _widths(self) -> tuple[int, int]:
        return (self.keys[1].shape[3] * self.group_size, self.values[1].shape[3] * self.group_size)

    def _storage_dtype(self) -> mx.Dtype:
        return self.keys[1].dtype

    def _quantize(self, rows: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        return tuple(mx.quantize(rows, group_size=self.group_size, bits=self.bits))

    def _no_rows(self, batch, heads, key_dim, value_dim, dtype):
        return tuple(self._quantize(mx.zeros((batch, heads, 0, width), dtype)) for width in (key_dim, value_dim))

    def _new_rows(self, keys, values, dtype):
        keys, values = keys.astype(dtype), values.astype(dtype)
        # Norms of the rows the float cache would store, before quantization
        # (another scorer scores the quantized rows, _as_stored).
        norms = key_norms_unchecked(keys) if self.scorer == "knorm" else None
        return self._quantize(keys), self._quantize(values), norms

    def _as_stored(self, keys, values):
        """Rows as the cache holds them, dequantized: what a scorer other
        than knorm scores, so that a trim rebuilds keydiff's running sum
        from them exactly (docs/spec.md §8)."""
        return tuple(mx.dequantize(*rows, group_size=self.group_size, bits=self.bits) for rows in (keys, values))


def _model_cache(model: nn.Module) -> list:
    """The cache mlx-lm would build: ``model.make_cache()``, else a KVCache per layer."""
    if hasattr(model, "make_cache"):
        return list(model.make_cache())
    return [KVCache() for _ in model.layers]


def model_family(model: nn.Module) -> str:
    """The model's mlx-lm family: its ``model_type``, else its module's name."""
    family = getattr(model, "model_type", None) or getattr(getattr(model, "args", None), "model_type", None)
    return family if isinstance(family, str) else type(model).__module__.rsplit(".", 1)[-1]


def layer_caches(prompt_cache) -> list:
    """Every cache of ``prompt_cache``, each ``CacheList``'s members in its
    place (a layer whose attention keeps its rows beside other state)."""
    caches = []
    for cache in prompt_cache:
        if isinstance(cache, CacheList):
            caches.extend(layer_caches(cache.caches))
        else:
            caches.append(cache)
    return caches


# Families whose layers keep one CacheList of several KVCaches, each the
# rows of its own attention (longcat_flash runs two attentions a layer).
INDEPENDENT_CACHE_LISTS = frozenset({"longcat_flash", "longcat_flash_ngram"})


def _replaceable(cache, family: str) -> bool:
    """Whether a layer's model cache is, or holds, KVCaches that eviction
    caches replace: a ``KVCache``, or a ``CacheList`` with one ``KVCache``
    among recurrent or windowed state (falcon_h1, baichuan_m1), or of
    independent attentions' ``KVCache``s (``INDEPENDENT_CACHE_LISTS``).
    Any other ``CacheList`` of several ``KVCache``s is kept: their rows are
    read together (deepseek_v32's indexer keys pick rows of its attention's)."""
    if type(cache) is KVCache:
        return True
    if not isinstance(cache, CacheList):
        return False
    kinds = [type(c) for c in cache.caches]
    nested = any(isinstance(c, (CacheList, mlx_lm_cache.QuantizedKVCache)) for c in cache.caches)
    independent = kinds.count(KVCache) == 1 or family in INDEPENDENT_CACHE_LISTS
    return KVCache in kinds and independent and not nested


def _replaced(cache, make):
    """``cache`` with each KVCache replaced by ``make()`` (``_replaceable``)."""
    if type(cache) is KVCache:
        return make()
    return CacheList(*(make() if type(c) is KVCache else c for c in cache.caches))


def check_family(model: nn.Module, caches: list) -> list[tuple[int, bool, int | None]]:
    """Refuse a model the eviction cache cannot serve, naming its family
    and what the cache needs (docs/spec.md §8, model families); else the
    masks the model asks its plain KVCache layers for (``mask_requests``)."""
    family = model_family(model)
    if any(_replaceable(cache, family) for cache in caches):
        try:
            requests = mask_requests(model)
        except Exception as err:
            raise ValueError(
                f"mlx_knorm: make_knorm_cache cannot serve this {family} model here: a 2-token "
                f"forward pass with its own cache fails ({type(err).__name__}: {err}); the cache "
                "needs a model that runs on this device"
            ) from err
        windows = [(layer, window) for layer, _, window in requests if window is not None]
        if windows:
            layer, window = windows[0]
            raise ValueError(
                f"mlx_knorm: make_knorm_cache cannot serve this {family} model: it asks the KVCache "
                f"of layer {layer} for a sliding-window mask (window_size={window}) and gives it to "
                "its sliding-window layers, which keep KVCaches (the model defines no make_cache "
                "giving them window caches). Once it evicts, an eviction cache holds rows at "
                "different positions in different heads, so no one window mask fits it; the "
                "cache needs the model's sliding-window layers in window caches (RotatingKVCache, "
                "which make_knorm_cache keeps). Use the model's own cache (model.make_cache())."
            )
        return requests
    shared = [c for c in caches if isinstance(c, CacheList) and any(type(m) is KVCache for m in c.caches)]
    if shared:
        members = ", ".join(type(m).__name__ for m in shared[0].caches)
        raise ValueError(
            f"mlx_knorm: make_knorm_cache cannot serve this {family} model: each of its "
            f"attention layers keeps a CacheList({members}) whose KVCaches the model reads "
            "together (an indexer's keys choose rows of the attention's), and evicting "
            "each by its own key norms would break that; the eviction cache needs a layer "
            "whose KVCache holds one attention's rows alone. Use the model's own cache "
            "(model.make_cache())."
        )
    kinds = sorted({type(cache).__name__ for cache in layer_caches(caches)})
    raise ValueError(
        f"mlx_knorm: make_knorm_cache cannot serve this {family} model: none of its "
        f"layers keeps an mlx-lm KVCache (its caches: {', '.join(kinds) or 'none'}), "
        "and the eviction cache replaces a full-attention layer's KVCache; there is "
        "nothing for it to bound. Use the model's own cache (model.make_cache())."
    )


def mask_requests(model: nn.Module, probe: list | None = None) -> list[tuple[int, bool, int | None]]:
    """``(layer, return_array, window_size)`` of every mask the model asks
    the plain ``KVCache`` layers of its cache for, in the order asked.

    Found by building, never evaluating, one 2-token forward pass over
    ``probe`` (the model's own cache when None, a throwaway), whose plain
    ``KVCache`` layers record the requests.
    """
    asked = []
    probe = _model_cache(model) if probe is None else probe
    for index, cache in enumerate(probe):
        if type(cache) is KVCache:

            def make_mask(N, return_array=False, window_size=None, _index=index, _cache=cache):
                asked.append((_index, return_array, window_size))
                return KVCache.make_mask(_cache, N, return_array=return_array, window_size=window_size)

            cache.make_mask = make_mask
    model(mx.zeros((1, 2), mx.int32), cache=probe)
    return asked


def _key_heads_and_widths(model: nn.Module) -> dict[int, tuple[int, int]]:
    """``{layer: (heads, key width)}`` of the model's plain ``KVCache``
    layers, from the keys one 2-token forward pass, built and never
    evaluated, gives a throwaway cache."""
    probe = _model_cache(model)
    mask_requests(model, probe)
    return {index: (cache.keys.shape[1], cache.keys.shape[3]) for index, cache in enumerate(probe)
            if type(cache) is KVCache and cache.keys is not None}


def make_knorm_cache(
    model: nn.Module,
    budget: int = DEFAULT_BUDGET,
    n_sink: int = DEFAULT_N_SINK,
    recent: int | None = None,
    keep: str = DEFAULT_KEEP,
    skip_layers: Iterable[int] = DEFAULT_SKIP_LAYERS,
    layout: str = DEFAULT_LAYOUT,
    scorer=DEFAULT_SCORER,
    filters=None,
) -> list:
    """A prompt cache for ``model`` with an ``L2NormKVCache`` per attention layer.

    Starts from the cache mlx-lm would build (``model.make_cache()`` where the
    model defines it, else one ``KVCache`` per layer) and replaces each plain
    ``KVCache`` by an ``L2NormKVCache``, also inside a ``CacheList`` that
    holds one beside recurrent or window state, or several independent
    attentions' (docs/spec.md §8, model families). ``recent`` (rows) defaults to
    ``default_recent(budget, n_sink)``: ``DEFAULT_RECENT_SHARE`` of the budget
    (docs/quality.md has the evidence); ``recent=0`` is the paper's pure
    keep-low and the reference's default. Layers listed in ``skip_layers`` keep
    their model cache: the paper leaves layers 0 and 1 uncompressed
    (``skip_layers=(0, 1)``), since their key norms do not predict attention.
    Layers whose model cache is something else (sliding-window
    ``RotatingKVCache``, recurrent state, ``CacheList``s of caches read
    together) keep that cache. ``layout`` is each ``L2NormKVCache``'s
    storage order (``"slots"`` or ``"temporal"``). ``scorer`` is what the
    caches rank rows by (docs/spec.md §2a, ``mlx_knorm.scorers``):
    ``"knorm"`` (the default, the paper's key norm), ``"keydiff"``,
    ``"vnorm"``, ``"qfilter"`` (with ``filters``, the model's query filters:
    a ``mlx-knorm calibrate`` file or ``QueryFilters``, one ``[H, D]`` per
    layer it compresses), or a callable ``scorer(keys, values, state) ->
    (scores, state)``.

    A model it cannot serve raises ``ValueError`` naming the family and
    what the cache needs: no layer to replace (recurrent models), only
    ``CacheList``s read together (deepseek_v32's indexer), or a
    sliding-window mask asked of a plain ``KVCache`` layer. To tell, it
    builds a 2-token forward pass over a throwaway cache that records the
    masks asked for; the pass is never evaluated, so nothing runs and no
    process of a distributed group communicates. Layers that attend to an
    earlier layer's rows (gemma3n, afm7, gemma4) read exactly that layer's
    kept rows; afm7's, which take their queries' position from the row
    count, are given the cache's (``mlx_knorm.sharing.share_positions``).

    Without a plain ``KVCache`` left (no ``skip_layers``), the
    ``L2NormKVCache``s are linked by one ``MaskPlan``, so that short blocks
    attend exactly as single steps would (docs/spec.md §8): speculative
    decoding then gives the tokens of ordinary decoding. The caches of a
    model split by ``pipeline()`` are not linked: a rank cannot tell
    whether another rank holds a ``KVCache`` layer.

    ``skip_layers`` needs a model that gives each layer a mask fitting its own
    row count. A model that builds one array mask from one layer's cache and
    shares it across layers (in mlx-lm 0.32 gemma2 and deepseek_v3, among
    others) would apply it to layers holding another number of rows once
    eviction starts, so for such a model ``skip_layers`` raises
    ``ValueError`` (the same recorded masks tell).

    After mlx-lm's ``pipeline()``, ``model.layers`` is the rank's own share
    of the layers, so ``skip_layers`` counts from the rank's first layer
    (``model.model.start_idx`` of the whole model).

    tests/test_model_families.py runs it on a tiny model of every mlx-lm
    0.32.2 model file, docs/models.md lists what each family's layers get;
    tests/test_distributed.py splits llama and deepseek_v2 over
    ``mx.distributed`` by ``shard()`` and ``pipeline()``.
    """
    if recent is None:
        budget, n_sink, _, keep = check_config(budget, n_sink, 0, keep)
        recent = default_recent(budget, n_sink)
    budget, n_sink, recent, keep = check_config(budget, n_sink, recent, keep)
    layout = check_layout(layout)
    scorer = check_scorer(scorer)
    filters = as_query_filters(filters)
    if (scorer == "qfilter") != (filters is not None):
        raise ValueError("mlx_knorm: the qfilter scorer needs filters, the model's query filters (run `mlx-knorm "
                         "calibrate --model M`), and only it takes them" if scorer == "qfilter" else
                         f"mlx_knorm: filters are for the qfilter scorer, not {scorer_label(scorer)}")
    caches = _model_cache(model)
    family = model_family(model)
    requests = check_family(model, caches)
    skipped = set()
    for layer in skip_layers:
        layer = check_int(layer, "skip_layers entry")
        if not 0 <= layer < len(caches):
            raise ValueError(
                f"mlx_knorm: skip_layers entry {layer} is out of range for a model "
                f"with {len(caches)} layers"
            )
        skipped.add(layer)
    compress = [_replaceable(cache, family) and index not in skipped for index, cache in enumerate(caches)]
    if any(compress) and any(_replaceable(caches[index], family) for index in skipped):
        # A "causal" mask adapts to each layer's own row count; an array mask
        # (return_array, or any window) has the row count of the cache it came from.
        sources = sorted({layer for layer, return_array, window in requests
                          if return_array or window is not None})
        if sources:
            raise ValueError(
                f"mlx_knorm: skip_layers={sorted(skipped)} cannot work with this "
                f"{type(model).__module__} model: it builds one array attention mask "
                f"from the cache of layer {sources[0]} and shares it across layers, and "
                "once eviction starts a skipped layer holds every token while the others "
                f"hold at most budget={budget} rows, so the mask fits only one of them. "
                "Use skip_layers=() with this model."
            )
    if filters is not None:
        # The filters against the model (its layers, their heads and widths)
        # before any cache exists: a forward pass would update the layers
        # before the one that does not fit.
        filters.check_model(model)

    def make(index: int):
        return lambda: L2NormKVCache(budget=budget, n_sink=n_sink, recent=recent, keep=keep, layout=layout,
                                     scorer=scorer, filters=None if filters is None else filters.of_layer(index))

    caches = [_replaced(cache, make(index)) if replace else cache
              for index, (replace, cache) in enumerate(zip(compress, caches))]
    if any(compress):
        share_positions(model)
    # A pipeline rank sees only its own layers' caches: another rank may hold
    # a KVCache layer, which would leave the whole model unlinked (§8).
    if getattr(getattr(model, "model", None), "pipeline_size", 1) == 1:
        link_prompt_cache(caches)
    return caches


def link_prompt_cache(prompt_cache: list) -> bool:
    """Link the eviction caches of one prompt cache (one ``MaskPlan``), so
    that short blocks attend exactly as single steps would (docs/spec.md
    §8); returns whether it did. ``make_knorm_cache`` links the caches it
    makes; a prompt cache loaded from a file (``load_prompt_cache``) needs
    this call to be linked again. The model builds one mask and gives it to
    its full-attention layers, so caches are linked only where no mlx-lm
    ``KVCache`` or ``QuantizedKVCache`` layer (``skip_layers``) could
    receive a segment mask."""
    caches = layer_caches(prompt_cache)
    if any(type(c) in (KVCache, mlx_lm_cache.QuantizedKVCache) for c in caches):
        return False
    # Each cache once, however many layers read it.
    ours = list({id(c): c for c in caches if isinstance(c, L2NormCacheBase)}.values())
    plan = MaskPlan(len(ours))
    for cache in ours:
        cache._mask_plan = plan
    return True


def _register_with_mlx_lm(classes) -> None:
    """Make ``load_prompt_cache`` find ``classes`` by their saved class names."""
    for cls in classes:
        existing = getattr(mlx_lm_cache, cls.__name__, None)
        if existing is not None and existing.__module__ != cls.__module__:
            raise ImportError(
                f"mlx_knorm: mlx_lm.models.cache already defines {cls.__name__} "
                f"(from {existing.__module__}); refusing to shadow it"
            )
        setattr(mlx_lm_cache, cls.__name__, cls)


_register_with_mlx_lm((L2NormKVCache, QuantizedL2NormKVCache))
# A file may hold the batch cache too, which registers itself as it loads
# (it builds on the classes above).
from . import batch_cache  # noqa: E402,F401

__all__ = ["L2NormCacheBase", "L2NormKVCache", "QuantizedL2NormKVCache", "layer_caches", "link_prompt_cache",
           "make_knorm_cache", "model_family"]
