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

``offset`` is the true absolute position (RoPE stays right after eviction);
``size()`` is the number of rows kept. ``keys`` and ``values`` are the
buffers, as ``KVCache``'s are (mlx-lm's pipeline-parallel models chain a
dependency onto ``cache.keys``); ``state`` and ``positions`` present the
kept rows in temporal order whatever the storage order, computed when asked.

Limits: mlx-lm models build one attention mask from one layer's cache and
share it across layers. Every ``L2NormKVCache`` of a model holds the same
row count, so they agree; a model that asks for an array mask
(``return_array=True``, e.g. gemma2, deepseek_v3) would apply it to a
``skip_layers`` layer, whose row count differs once eviction starts, so
``make_knorm_cache`` refuses ``skip_layers`` for such models. There is no
``merge``, so mlx-lm's ``BatchGenerator`` (and ``mlx_lm.server`` batching)
does not batch these caches; batches built by the caller (``[B, S]``
inputs) are supported.

Importing this module registers ``L2NormKVCache`` in
``mlx_lm.models.cache``, because ``mlx_lm.models.cache.load_prompt_cache``
resolves the class names of a saved cache in that module's namespace.
"""

from __future__ import annotations

from typing import Any, Iterable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as mlx_lm_cache
from mlx_lm.models.cache import KVCache, _BaseCache, create_attention_mask

from .cache_state import check_state
from .defaults import (DEFAULT_BUDGET, DEFAULT_KEEP, DEFAULT_LAYOUT, DEFAULT_N_SINK, DEFAULT_RECENT,
                       DEFAULT_SKIP_LAYERS, default_recent)
from .ops.evict_and_fill import check_layout, evict_and_fill_unchecked
from .validation import INT32_MAX, check_config, check_int

# Slots added at a time while the cache fills, as KVCache grows.
GROWTH_STEP = 256


def _storage_dtype(keys: mx.array, values: mx.array) -> mx.Dtype:
    """bfloat16 models keep bfloat16 (no range loss); everything else is stored as float16."""
    if keys.dtype == values.dtype == mx.bfloat16:
        return mx.bfloat16
    return mx.float16


class L2NormKVCache(_BaseCache):
    """One layer's KV cache with L2-norm eviction, for ``mlx_lm`` models.

    Construct with the reference's config object (fields ``knorm_budget``,
    ``knorm_n_sink``, ``knorm_recent``, ``knorm_keep``; missing fields take
    the defaults 512, 4, 0, "low") and/or keyword arguments ``budget``,
    ``n_sink``, ``recent``, ``keep``, which take precedence over the config,
    and ``layout`` (``"slots"``, the default, or ``"temporal"``). Invalid
    settings raise ``ValueError``/``TypeError`` naming the argument.

    Storage, as ``KVCache``'s with its spare slots: ``keys``
    ``[B, H, capacity, D_k]`` and ``values [B, H, capacity, D_v]`` in the
    storage dtype (bfloat16 for bfloat16 inputs, else float16), ``norms``
    (each key's float32 norm, taken once from the stored key) and
    ``slot_positions`` (int32 absolute positions) ``[B, H, capacity]``;
    slots ``[0, filled)`` are occupied, in storage order. ``state`` and
    ``positions`` give the kept rows in temporal order. Not trimmable, not mergeable into mlx-lm's
    batch caches and not converted by ``kv_bits`` quantization: it defines
    no ``trim``, ``merge`` or ``to_quantized``, so mlx-lm leaves it alone on
    those paths.
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
    ) -> None:
        def pick(value, field, default):
            return value if value is not None else getattr(config, field, default)

        self.budget, self.n_sink, self.recent, self.keep = check_config(
            pick(budget, "knorm_budget", DEFAULT_BUDGET),
            pick(n_sink, "knorm_n_sink", DEFAULT_N_SINK),
            pick(recent, "knorm_recent", DEFAULT_RECENT),
            pick(keep, "knorm_keep", DEFAULT_KEEP),
        )
        self.layout = check_layout(layout)
        self._clear()

    def _clear(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.norms: mx.array | None = None
        self.slot_positions: mx.array | None = None
        self.filled = 0
        self.offset = 0

    def _buffers(self) -> list:
        return [self.keys, self.values, self.norms, self.slot_positions]

    def _set_buffers(self, buffers) -> None:
        self.keys, self.values, self.norms, self.slot_positions = buffers

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Absorb ``[B, H, S, D]`` keys/values; return the kept rows and the new rows.

        The returned arrays are views of the occupied slots: what this step
        attends to (nothing of it is evicted yet). The eviction that the new
        rows cause is applied by the next step.
        """
        batch, heads, steps, key_dim = keys.shape
        previous = self._buffers()
        if self.keys is None:
            dtype = _storage_dtype(keys, values)
            buffers = [
                mx.zeros((batch, heads, 0, key_dim), dtype),
                mx.zeros((batch, heads, 0, values.shape[-1]), dtype),
                mx.zeros((batch, heads, 0), mx.float32),
                mx.zeros((batch, heads, 0), mx.int32),
            ]
        else:
            self._check_block(keys, values)
            buffers = previous
        if self.offset + steps > INT32_MAX:
            raise ValueError(
                f"mlx_knorm: L2NormKVCache positions are int32: offset {self.offset} + "
                f"{steps} new tokens must be < 2**31"
            )
        kept = self.size()
        capacity = self._capacity(kept + steps, buffers[0].shape[2])
        # The op writes in place only if it holds the buffers' last reference.
        self._set_buffers([None] * 4)
        try:
            out = evict_and_fill_unchecked(
                *buffers,
                keys.astype(buffers[0].dtype),
                values.astype(buffers[1].dtype),
                filled=self.filled, offset=self.offset, capacity=capacity,
                budget=self.budget, n_sink=self.n_sink, recent=self.recent, keep=self.keep,
                layout=self.layout,
            )
        except BaseException:
            self._set_buffers(previous)
            raise
        self._set_buffers(out)
        self.filled = kept + steps
        self.offset += steps
        return self._occupied(self.keys), self._occupied(self.values)

    def _check_block(self, keys: mx.array, values: mx.array) -> None:
        batch, heads, _, key_dim = self.keys.shape
        value_dim = self.values.shape[-1]
        if keys.shape[:2] != (batch, heads) or keys.shape[-1] != key_dim or values.shape != (
            *keys.shape[:3], value_dim
        ):
            raise ValueError(
                f"mlx_knorm: L2NormKVCache holds [B, H, rows, D] = [{batch}, {heads}, rows, "
                f"{key_dim}] keys and [..., {value_dim}] values; got keys {list(keys.shape)} "
                f"and values {list(values.shape)}"
            )

    def _capacity(self, needed: int, current: int) -> int:
        """Slots for the next buffers: the current ones when they fit and are
        not larger than a decode step at the budget needs (then the step can
        run in place), else ``needed`` rounded up to ``GROWTH_STEP``, capped
        there."""
        most = max(needed, self.budget + 1)
        if needed <= current <= most:
            return current
        return min(-(-needed // GROWTH_STEP) * GROWTH_STEP, most)

    def _occupied(self, buffer: mx.array) -> mx.array:
        """Slots ``[0, filled)`` of a ``[B, H, capacity, D]`` buffer (a view)."""
        return buffer if buffer.shape[2] == self.filled else buffer[..., : self.filled, :]

    def _kept_rows(self) -> tuple[mx.array, mx.array, mx.array, mx.array] | None:
        """The kept rows once the pending eviction is applied, in temporal
        order: keys, values, norms, positions ``[B, H, kept, ...]``.
        Computed out of place; the buffers are not touched."""
        if self.keys is None:
            return None
        kept = self.size()
        buffers = self._buffers()
        if kept < self.filled:
            no_rows = [mx.zeros((*b.shape[:2], 0, b.shape[3]), b.dtype) for b in buffers[:2]]
            rows = evict_and_fill_unchecked(
                *buffers, *no_rows, filled=self.filled, offset=self.offset, capacity=kept,
                budget=self.budget, n_sink=self.n_sink, recent=self.recent, keep=self.keep,
                layout="temporal",
            )
        else:
            rows = [b[:, :, :kept] for b in buffers]
        if self.layout == "slots":
            order = mx.argsort(rows[3], axis=2)
            rows = [mx.take_along_axis(r, order if r.ndim == 3 else order[..., None], axis=2) for r in rows]
        return tuple(rows)

    @property
    def positions(self) -> mx.array | None:
        """int32 absolute token positions ``[B, H, kept]`` of the kept rows,
        increasing (None when empty)."""
        kept = self._kept_rows()
        return None if kept is None else kept[3]

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ):
        """The mask for ``N`` new queries against the kept rows ++ new rows.

        Every kept row precedes every query, so the right mask is KVCache's
        causal mask with the kept row count as its offset: all kept rows
        visible, causal among the new rows (which the step writes behind the
        kept rows, in order). Before any eviction that count equals
        ``offset`` and the mask is exactly KVCache's.
        """
        stored = self.size()
        if window_size is not None and stored < self.offset:
            # Kept rows sit at different positions in different heads, so a
            # position window has no single [N, stored + N] mask.
            raise ValueError(
                "mlx_knorm: L2NormKVCache cannot serve a sliding-window layer "
                f"(window_size={window_size}) once it has evicted rows; leave that "
                "layer to the model's own cache (make_knorm_cache does so for "
                "RotatingKVCache layers)"
            )
        return create_attention_mask(
            N, offset=stored, return_array=return_array, window_size=window_size
        )

    def is_trimmable(self) -> bool:
        """False: evicted rows cannot be restored, so the cache cannot roll back."""
        return False

    def empty(self) -> bool:
        return self.keys is None

    def size(self) -> int:
        """Rows kept per head (at most ``budget``), as RotatingKVCache reports its window."""
        return min(self.filled, self.budget)

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers: keys, values, norms and positions, every slot."""
        return 0 if self.keys is None else sum(b.nbytes for b in self._buffers())

    @property
    def state(self):
        """Everything needed to rebuild the cache, configuration included,
        because mlx-lm 0.32's ``load_prompt_cache`` calls ``from_state(state)``
        with no separate meta state: ``(keys, values, norms, positions,
        offset, budget, n_sink, recent, keep, layout)``, the kept rows in
        temporal order (``state[:2]`` is what the reference's cache stores)."""
        kept = self._kept_rows() or (None, None, None, None)
        return (*kept, self.offset, self.budget, self.n_sink, self.recent, self.keep, self.layout)

    @state.setter
    def state(self, v) -> None:
        """Load a saved state after checking every field against the others
        and the configuration (cache_state.check_state); nothing changes if
        a check fails."""
        checked = check_state(v)
        self.budget, self.n_sink, self.recent, self.keep = checked.config
        self.layout = checked.layout
        self._clear()
        self.offset = checked.offset
        if checked.rows is not None:
            self._set_buffers(checked.rows)
            self.filled = checked.rows[0].shape[2]

    @property
    def meta_state(self) -> tuple[str, ...]:
        """The configuration as strings, for tools using the older two-part
        (``state`` + ``meta_state``) mlx-lm protocol."""
        return str(self.budget), str(self.n_sink), str(self.recent), self.keep, self.layout

    @meta_state.setter
    def meta_state(self, v) -> None:
        budget, n_sink, recent, keep, layout = v
        config = check_config(int(budget), int(n_sink), int(recent), keep)
        self.layout = check_layout(layout)
        self.budget, self.n_sink, self.recent, self.keep = config

    def _fp16_bytes(self, tokens: int) -> int:
        # The reference's accounting: K + V at 2 bytes per element, all B*H
        # heads; keys and values may differ in width (multi-head latent attention).
        batch, heads, _, key_dim = self.keys.shape
        return batch * heads * tokens * (key_dim + self.values.shape[-1]) * 2

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
        batch, heads = self.keys.shape[:2]
        return batch * heads * self.offset

    @property
    def tokens_kept(self) -> int:
        """Rows kept per head (every head keeps the same count)."""
        return self.size()


def _model_cache(model: nn.Module) -> list:
    """The cache mlx-lm would build: ``model.make_cache()``, else a KVCache per layer."""
    if hasattr(model, "make_cache"):
        return list(model.make_cache())
    return [KVCache() for _ in model.layers]


def _array_mask_sources(model: nn.Module) -> list[int]:
    """The layers whose plain KVCache the model asks for an array mask.

    mlx-lm models build a mask from one layer's cache and hand it to every
    layer. A ``"causal"`` mask adapts to each layer's own row count; an array
    mask (``return_array=True``, or any ``window_size``) has the row count of
    the cache it came from. Found by building, never evaluating, one 2-token
    forward pass over a throwaway cache that records the requests.
    """
    asked = set()
    probe = _model_cache(model)
    for index, cache in enumerate(probe):
        if type(cache) is KVCache:

            def make_mask(N, return_array=False, window_size=None, _index=index, _cache=cache):
                if return_array or window_size is not None:
                    asked.add(_index)
                return KVCache.make_mask(_cache, N, return_array=return_array, window_size=window_size)

            cache.make_mask = make_mask
    model(mx.zeros((1, 2), mx.int32), cache=probe)
    return sorted(asked)


def make_knorm_cache(
    model: nn.Module,
    budget: int = DEFAULT_BUDGET,
    n_sink: int = DEFAULT_N_SINK,
    recent: int | None = None,
    keep: str = DEFAULT_KEEP,
    skip_layers: Iterable[int] = DEFAULT_SKIP_LAYERS,
    layout: str = DEFAULT_LAYOUT,
) -> list:
    """A prompt cache for ``model`` with an ``L2NormKVCache`` per attention layer.

    Starts from the cache mlx-lm would build (``model.make_cache()`` where the
    model defines it, else one ``KVCache`` per layer) and replaces each plain
    ``KVCache`` by an ``L2NormKVCache``. ``recent`` (rows) defaults to
    ``default_recent(budget, n_sink)``: ``DEFAULT_RECENT_SHARE`` of the budget
    (docs/quality.md has the evidence); ``recent=0`` is the paper's pure
    keep-low and the reference's default. Layers listed in ``skip_layers`` keep
    a plain ``KVCache``: the paper leaves layers 0 and 1 uncompressed
    (``skip_layers=(0, 1)``), since their key norms do not predict attention.
    Layers whose model cache is something else (sliding-window
    ``RotatingKVCache``, recurrent state) keep that cache. ``layout`` is
    each ``L2NormKVCache``'s storage order (``"slots"`` or ``"temporal"``).

    ``skip_layers`` needs a model that gives each layer a mask fitting its own
    row count. A model that builds one array mask from one layer's cache and
    shares it across layers (in mlx-lm 0.32 gemma2 and deepseek_v3, among
    others) would apply it to layers holding another number of rows once
    eviction starts, so for such a model ``skip_layers`` raises
    ``ValueError``. To tell, ``make_knorm_cache`` builds a 2-token forward
    pass that records the masks asked for, only when ``skip_layers`` names a
    layer; the pass is never evaluated, so nothing runs and no process of a
    distributed group communicates.

    After mlx-lm's ``pipeline()``, ``model.layers`` is the rank's own share
    of the layers, so ``skip_layers`` counts from the rank's first layer
    (``model.model.start_idx`` of the whole model).

    Tried on tiny random mlx-lm models: llama (also with ``skip_layers``, and
    split over ``mx.distributed`` by ``shard()``), qwen2 (also with
    ``skip_layers``), deepseek_v2 (keys 24 wide, values 16; also with
    ``skip_layers``, and split by ``pipeline()``), gemma2 and deepseek_v3
    (which refuse ``skip_layers``).
    """
    if recent is None:
        budget, n_sink, _, keep = check_config(budget, n_sink, 0, keep)
        recent = default_recent(budget, n_sink)
    budget, n_sink, recent, keep = check_config(budget, n_sink, recent, keep)
    layout = check_layout(layout)
    caches = _model_cache(model)
    skipped = set()
    for layer in skip_layers:
        layer = check_int(layer, "skip_layers entry")
        if not 0 <= layer < len(caches):
            raise ValueError(
                f"mlx_knorm: skip_layers entry {layer} is out of range for a model "
                f"with {len(caches)} layers"
            )
        skipped.add(layer)
    compress = [type(cache) is KVCache and index not in skipped for index, cache in enumerate(caches)]
    if any(compress) and any(type(caches[index]) is KVCache for index in skipped):
        sources = _array_mask_sources(model)
        if sources:
            raise ValueError(
                f"mlx_knorm: skip_layers={sorted(skipped)} cannot work with this "
                f"{type(model).__module__} model: it builds one array attention mask "
                f"from the cache of layer {sources[0]} and shares it across layers, and "
                "once eviction starts a skipped layer holds every token while the others "
                f"hold at most budget={budget} rows, so the mask fits only one of them. "
                "Use skip_layers=() with this model."
            )
    return [
        L2NormKVCache(budget=budget, n_sink=n_sink, recent=recent, keep=keep, layout=layout)
        if replace
        else cache
        for replace, cache in zip(compress, caches)
    ]


def _register_with_mlx_lm() -> None:
    """Make ``load_prompt_cache`` find ``L2NormKVCache`` by its saved class name."""
    existing = getattr(mlx_lm_cache, L2NormKVCache.__name__, None)
    if existing is not None and existing.__module__ != L2NormKVCache.__module__:
        raise ImportError(
            f"mlx_knorm: mlx_lm.models.cache already defines {L2NormKVCache.__name__} "
            f"(from {existing.__module__}); refusing to shadow it"
        )
    setattr(mlx_lm_cache, L2NormKVCache.__name__, L2NormKVCache)


_register_with_mlx_lm()

__all__ = ["L2NormKVCache", "make_knorm_cache"]
