"""BatchL2NormKVCache (docs/spec.md §8, batches): each sequence of a batch
keeps exactly what a single-sequence L2NormKVCache fed its tokens keeps,
bit for bit, through merges, right-padded prefills, joins and leaves; the
mask hides exactly the padding in every head; the protocol's edges."""

from __future__ import annotations

import copy
import tempfile

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

import mlx_knorm
from conftest import ALL_BACKENDS, assert_bitwise_equal
from mlx_knorm.batch_cache import BatchL2NormKVCache
from mlx_knorm.cache import L2NormKVCache, QuantizedL2NormKVCache

HEADS, KEY_DIM, VALUE_DIM = 2, 4, 3


class Sequence:
    """One sequence's token rows, drawn as they come, and its single cache."""

    def __init__(self, rng: np.random.Generator, config: dict) -> None:
        self.rng = rng
        self.single = L2NormKVCache(**config)

    def rows(self, n: int) -> tuple[mx.array, mx.array]:
        # Per-row scales spread the norms (and make ties rare but possible).
        scale = np.exp(self.rng.normal(size=(1, HEADS, n, 1)))
        keys = (self.rng.normal(size=(1, HEADS, n, KEY_DIM)) * scale).astype(np.float32)
        values = self.rng.normal(size=(1, HEADS, n, VALUE_DIM)).astype(np.float32)
        return mx.array(keys), mx.array(values)

    def feed_single(self, keys: mx.array, values: mx.array) -> None:
        if keys.shape[2]:
            self.single.update_and_fetch(keys, values)


def assert_same_state(batch: BatchL2NormKVCache, sequences: list[Sequence]) -> None:
    offsets = batch.offset.tolist()
    assert len(offsets) == len(sequences)
    for index, seq in enumerate(sequences):
        got, want = batch.extract(index).state, seq.single.state
        assert offsets[index] == want[4], f"sequence {index}: offset"
        assert got[4:] == want[4:], f"sequence {index}: offset and configuration"
        for field, a, b in zip(("keys", "values", "norms", "positions"), got[:4], want[:4]):
            if b is None:
                assert a is None, f"sequence {index}: {field}"
            else:
                assert_bitwise_equal(a, b, f"sequence {index} {field}")


def step(batch: BatchL2NormKVCache, keys: mx.array, values: mx.array) -> None:
    """One update, checking that the mask the model would get hides exactly
    the padding rows among the kept ones from every real query, in every
    head (a block of only padding queries has an unspecified mask, §8)."""
    kept = batch.size()
    mask = batch.make_mask(keys.shape[2])
    batch.update_and_fetch(keys, values)
    mx.eval(batch.keys, batch.slot_positions)
    ranges = batch.state[4]
    positions = batch.slot_positions[:, :, :kept]
    real = (positions >= ranges[:, None, 0:1]) & (positions < ranges[:, None, 1:2])
    if isinstance(mask, mx.array):
        # Query 0 sees every kept slot that is not padding.
        seen = mx.broadcast_to(mask[:, :, 0, :kept], real.shape)
    else:
        seen = mx.ones(real.shape, mx.bool_)
    start = batch.timeline - keys.shape[2]
    for b, (lo, hi) in enumerate(ranges.tolist()):
        if start < hi:
            assert mx.array_equal(seen[b], real[b]).item(), f"sequence {b}: mask {seen[b]} vs real rows {real[b]}"


def merged(rng, config, histories, blocks) -> tuple[BatchL2NormKVCache, list[Sequence]]:
    """Single caches with their own histories (fed in blocks), merged."""
    sequences = []
    for history in histories:
        seq = Sequence(rng, config)
        done = 0
        while done < history:
            n = min(blocks, history - done)
            seq.feed_single(*seq.rows(n))
            done += n
        sequences.append(seq)
    return L2NormKVCache.merge([s.single for s in sequences]), sequences


def padded_block(batch, sequences, lengths, calls: int) -> None:
    """A right-padded prefill of ``lengths`` real tokens per sequence, as
    mlx-lm's BatchGenerator feeds one (prepare, updates, finalize); split
    over ``calls`` updates."""
    width = max(lengths)
    padded = any(n < width for n in lengths)
    if padded:
        batch.prepare(lengths=lengths, right_padding=[width - n for n in lengths])
    rows = []
    for seq, n in zip(sequences, lengths):
        keys, values = seq.rows(width)  # the padding's rows are noise too
        rows.append((keys, values))
        seq.feed_single(keys[:, :, :n], values[:, :, :n])
    keys = mx.concatenate([k for k, _ in rows])
    values = mx.concatenate([v for _, v in rows])
    cuts = [0, width // 2, width] if calls == 2 and width >= 2 else [0, width]
    for a, b in zip(cuts, cuts[1:]):
        step(batch, keys[:, :, a:b], values[:, :, a:b])
    if padded:
        batch.finalize()


configs = st.builds(
    lambda budget, n_sink, recent, keep, layout: dict(budget=budget, n_sink=n_sink, recent=recent,
                                                      keep=keep, layout=layout),
    st.integers(3, 10), st.integers(0, 2), st.integers(0, 2), st.sampled_from(["low", "high"]),
    st.sampled_from(["slots", "temporal"]),
).filter(lambda c: c["n_sink"] + c["recent"] < c["budget"])

operations = st.lists(
    st.one_of(
        st.tuples(st.just("prefill"), st.lists(st.integers(0, 9), min_size=4, max_size=4), st.integers(1, 2)),
        st.tuples(st.just("decode"), st.integers(1, 6)),
        st.tuples(st.just("join"), st.lists(st.integers(0, 14), min_size=1, max_size=2)),
        st.tuples(st.just("leave"), st.integers(0, 2**16)),
        st.tuples(st.just("copy")),
        st.tuples(st.just("reload")),
        st.tuples(st.just("file")),
    ),
    min_size=1, max_size=7,
)


def saved_and_loaded(caches: list) -> list:
    """``caches`` through mlx-lm's save_prompt_cache and load_prompt_cache."""
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/cache.safetensors"
        save_prompt_cache(path, caches)
        return load_prompt_cache(path)


def run_schedule(config, histories, blocks, ops, seed):
    rng = np.random.default_rng(seed)
    batch, sequences = merged(rng, config, histories, blocks)
    assert_same_state(batch, sequences)
    for op in ops:
        kind = op[0]
        if kind == "prefill":
            lengths = (op[1] * 3)[: len(sequences)]
            if max(lengths) == 0:
                continue
            padded_block(batch, sequences, lengths, op[2])
        elif kind == "decode":
            for _ in range(op[1]):
                rows = [seq.rows(1) for seq in sequences]
                for seq, (k, v) in zip(sequences, rows):
                    seq.feed_single(k, v)
                step(batch, mx.concatenate([k for k, _ in rows]), mx.concatenate([v for _, v in rows]))
        elif kind == "join":
            other, joined = merged(rng, config, op[1], blocks)
            batch.extend(other)
            sequences += joined
        elif kind == "leave":
            if len(sequences) == 1:
                continue
            mask = op[1] % (2 ** len(sequences))
            keep = [i for i in range(len(sequences)) if mask >> i & 1] or [0]
            batch.filter(keep)
            sequences = [sequences[i] for i in keep]
        elif kind == "copy":
            batch = copy.deepcopy(batch)
        elif kind == "reload":
            state, meta = batch.state, batch.meta_state
            batch = BatchL2NormKVCache.from_state(state)
            batch.meta_state = meta
        elif kind == "file":
            [batch] = saved_and_loaded([batch])
        assert_same_state(batch, sequences)


@pytest.mark.parametrize("backend", [b for b in ALL_BACKENDS if b != "metal-emulator"])
@given(config=configs, histories=st.lists(st.integers(0, 14), min_size=1, max_size=3),
       blocks=st.integers(1, 6), ops=operations, seed=st.integers(0, 2**31))
@settings(max_examples=max(10, settings.default.max_examples // 3))
def test_each_sequence_keeps_what_it_keeps_alone(backend, config, histories, blocks, ops, seed):
    with mlx_knorm.use_backend(backend):
        run_schedule(config, histories, blocks, ops, seed)


@pytest.mark.parametrize("backend", [b for b in ALL_BACKENDS if b == "metal-emulator"])
@given(config=configs, histories=st.lists(st.integers(0, 14), min_size=1, max_size=3),
       blocks=st.integers(1, 6), ops=operations, seed=st.integers(0, 2**31))
# Each schedule is dozens of emulated dispatches (real threads): a few cases.
@settings(max_examples=max(4, settings.default.max_examples // 40))
def test_each_sequence_keeps_what_it_keeps_alone_emulator(backend, config, histories, blocks, ops, seed):
    with mlx_knorm.use_backend(backend):
        run_schedule(config, histories, blocks, ops, seed)


# -- explicit cases ----------------------------------------------------------


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_a_right_padded_prefill_after_extend(backend):
    """mlx-lm's PromptBatch extends cached-prefix prompts, then right-pads:
    a sequence whose real tokens end in the first call holds right-padding
    rows in kept slots during the second (its queries are all padding)."""
    config = dict(budget=3, n_sink=0, recent=0, keep="low", layout="slots")
    ops = [("prefill", [1, 1, 1, 1], 1), ("join", [0, 0]), ("prefill", [1, 1, 4, 1], 2), ("decode", 4)]
    with mlx_knorm.use_backend(backend):
        run_schedule(config, [0], 1, ops, 0)


def test_merge_extract_round_trips_bit_for_bit():
    rng = np.random.default_rng(0)
    config = dict(budget=6, n_sink=1, recent=1)
    batch, sequences = merged(rng, config, [0, 3, 11, 40], 5)
    for index, seq in enumerate(sequences):
        assert_same_state(L2NormKVCache.merge([batch.extract(index)]), [seq])
    assert batch.offset.dtype == mx.int32 and batch.offset.tolist() == [0, 3, 11, 40]


def test_left_padding_from_empty_is_never_a_token():
    """BatchKVCache-style use: an empty batch, left-padded prompts."""
    rng = np.random.default_rng(1)
    config = dict(budget=4, n_sink=1, recent=1)
    lengths = [2, 7, 5]
    batch = L2NormKVCache.merge([L2NormKVCache(**config) for _ in lengths])
    batch.prepare(left_padding=[7 - n for n in lengths])
    sequences = [Sequence(rng, config) for _ in lengths]
    rows = []
    for seq, n in zip(sequences, lengths):
        k, v = seq.rows(7)
        seq.feed_single(k[:, :, 7 - n :], v[:, :, 7 - n :])
        rows.append((k, v))
    step(batch, mx.concatenate([k for k, _ in rows]), mx.concatenate([v for _, v in rows]))
    assert batch.offset.tolist() == lengths
    for _ in range(6):
        rows = [seq.rows(1) for seq in sequences]
        for seq, (k, v) in zip(sequences, rows):
            seq.feed_single(k, v)
        step(batch, mx.concatenate([k for k, _ in rows]), mx.concatenate([v for _, v in rows]))
        assert_same_state(batch, sequences)
    with pytest.raises(ValueError, match="left_padding can only be added to an empty"):
        batch.prepare(left_padding=[0, 0, 0])


def test_merge_refuses_mixed_configurations_naming_the_field():
    with pytest.raises(ValueError, match=r"same budget; caches\[0\] has budget=8, caches\[1\] has budget=9"):
        L2NormKVCache.merge([L2NormKVCache(budget=8), L2NormKVCache(budget=9)])
    with pytest.raises(ValueError, match="same layout"):
        L2NormKVCache.merge([L2NormKVCache(budget=8), L2NormKVCache(budget=8, layout="temporal")])
    a, b = L2NormKVCache(budget=8), L2NormKVCache(budget=8)
    a.update_and_fetch(mx.zeros((1, 2, 3, 4)), mx.zeros((1, 2, 3, 4)))
    b.update_and_fetch(mx.zeros((1, 3, 3, 4)), mx.zeros((1, 3, 3, 4)))
    with pytest.raises(ValueError, match=r"same heads; caches\[0\] has 2, caches\[1\] has 3"):
        L2NormKVCache.merge([a, b])
    with pytest.raises(ValueError, match="same recent"):
        L2NormKVCache.merge([L2NormKVCache(budget=8)]).extend(L2NormKVCache.merge([L2NormKVCache(budget=8, recent=2)]))
    with pytest.raises(ValueError, match="QuantizedL2NormKVCache cannot be batched"):
        QuantizedL2NormKVCache.merge([QuantizedL2NormKVCache(budget=8)])
    with pytest.raises(ValueError, match=r"caches\[1\] is a KVCache"):
        L2NormKVCache.merge([L2NormKVCache(budget=8), KVCache()])


def test_state_checks_name_the_field():
    batch = L2NormKVCache.merge([L2NormKVCache(budget=8)])
    state = list(batch.state)
    state[5] = mx.array([3], mx.int32)
    with pytest.raises(ValueError, match="real_rows"):
        BatchL2NormKVCache.from_state(state)
    with pytest.raises(ValueError, match="13 fields"):
        BatchL2NormKVCache.from_state(state[:5])
    with pytest.raises(ValueError, match="meta_state"):
        batch.meta_state = ("1", "0", "9", "0", "0", "low", "slots")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("layout", ["slots", "temporal"])
def test_batch_cache_files_round_trip_and_continue_identically(layout, backend):
    """save_prompt_cache writes a batch (padding, a pending eviction, an
    empty batch beside it) that load_prompt_cache reads back field for
    field; both then step alike."""
    with mlx_knorm.use_backend(backend):
        rng = np.random.default_rng(8)
        config = dict(budget=6, n_sink=1, recent=1, layout=layout)
        batch, sequences = merged(rng, config, [9, 4, 0], 3)
        rows = [seq.rows(1) for seq in sequences]
        step(batch, mx.concatenate([k for k, _ in rows]), mx.concatenate([v for _, v in rows]))
        empty = L2NormKVCache.merge([L2NormKVCache(**config)] * 2)
        loaded, loaded_empty = saved_and_loaded([batch, empty])
        assert type(loaded) is BatchL2NormKVCache and loaded_empty.empty() and loaded_empty.batch_size == 2
        assert batch.filled == loaded.filled == 7 and loaded.meta_state == batch.meta_state
        for _ in range(3):
            rows = [seq.rows(1) for seq in sequences]
            keys, values = mx.concatenate([k for k, _ in rows]), mx.concatenate([v for _, v in rows])
            for a, b in zip(batch.update_and_fetch(keys, values), loaded.update_and_fetch(keys, values)):
                assert_bitwise_equal(a, b)
            for index in range(len(sequences)):
                for a, b in zip(batch.extract(index).state[:4], loaded.extract(index).state[:4]):
                    if a is not None:
                        assert_bitwise_equal(a, b, f"sequence {index}")


def _tampered(state, field: int, value):
    state = list(state)
    state[field] = value(state[field]) if callable(value) else value
    return state


def _set(a: mx.array, index, value) -> mx.array:
    a = mx.array(a)
    a[index] = value
    return a


BATCH_STATE_FLAWS = [
    # (what is wrong, field index, change, message)
    ("norms that are not the keys' norms", 2, lambda a: a * 2, r"sequence 0: .*field 'norms'"),
    # Sequence 1 holds 4 rows behind 2 padding slots: rows no single cache check sees.
    ("a padding row's norm", 2, lambda a: _set(a, (1, 0, 1), 9.0), r"sequence 1: field 'norms'"),
    ("a padding row off its slot", 3, lambda a: _set(a, (1, 1, 0), 1), r"sequence 1: field 'positions'"),
    ("a real row in a padding slot", 3, lambda a: _set(a, (1, 0, 1), 5), r"sequence 1: field 'positions'"),
    ("a position held twice", 3, lambda a: a * 0, r"sequence 0: .*field 'positions'"),
    ("int32 keys", 0, lambda a: a.astype(mx.int32), r"keys and values of one dtype"),
    ("a budget that is not a number", 8, "eight", r"field 'budget' must be a decimal integer"),
    ("a timeline that is not a number", 6, "x", r"field 'timeline' must be a decimal integer"),
    ("a range with lo > hi", 4, lambda a: a[:, ::-1], r"field 'ranges' must hold 0 <= lo <= hi"),
]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("flaw", BATCH_STATE_FLAWS, ids=[f[0] for f in BATCH_STATE_FLAWS])
def test_a_batch_state_a_single_cache_would_refuse_is_refused(backend, flaw):
    """Every sequence of a loaded batch state must be what extract() and the
    step take (the single cache's load check); a refused state leaves the
    cache as it was."""
    _, field, change, message = flaw
    rng = np.random.default_rng(5)
    with mlx_knorm.use_backend(backend):
        batch, sequences = merged(rng, dict(budget=6, n_sink=1, recent=1), [9, 4], 3)
        good = batch.state
        bad = _tampered(good, field, change)
        with pytest.raises(ValueError, match=message):
            BatchL2NormKVCache.from_state(bad)
        with pytest.raises(ValueError, match=message):
            batch.state = bad
        assert_same_state(batch, sequences)
        batch.state = good
        assert_same_state(batch, sequences)


def test_nbytes_counts_the_buffers_and_sliding_windows_are_refused():
    rng = np.random.default_rng(2)
    batch, _ = merged(rng, dict(budget=5), [4, 9], 3)
    tree_bytes = 0 if batch.order_tree is None else batch.order_tree.nbytes
    assert batch.nbytes == sum(b.nbytes for b in (batch.keys, batch.values, batch.norms, batch.slot_positions)) + tree_bytes
    assert L2NormKVCache.merge([L2NormKVCache()]).nbytes == 0
    with pytest.raises(ValueError, match="sliding-window"):
        batch.make_mask(1, window_size=4)
    assert not batch.is_trimmable() and batch.trim(1) == 0


def test_extend_refuses_other_shapes_and_a_pending_right_padded_prefill():
    rng = np.random.default_rng(3)
    batch, _ = merged(rng, dict(budget=5), [4], 2)
    other = L2NormKVCache(budget=5)
    other.update_and_fetch(mx.zeros((1, HEADS, 2, KEY_DIM + 1)), mx.zeros((1, HEADS, 2, VALUE_DIM)))
    with pytest.raises(ValueError, match="other holds rows of other heads, widths or dtype"):
        batch.extend(L2NormKVCache.merge([other]))
    batch.prepare(lengths=[1], right_padding=[0])
    fresh, _ = merged(rng, dict(budget=5), [2], 2)
    fresh.prepare(lengths=[1], right_padding=[1])
    with pytest.raises(ValueError, match="finalize"):
        batch.extend(fresh)
    with pytest.raises(TypeError, match="must be a BatchL2NormKVCache"):
        batch.extend(other)


@pytest.mark.usefixtures("cpu_default_device")
@pytest.mark.parametrize("layout", ["slots", "temporal"])
def test_batch_decode_steps_run_in_place(layout):
    """As the single cache's: once a step's attention has run, a decode step
    of the batch writes into its buffers (budget + 1 slots), allocating no
    second copy, with padding in the batch."""
    rng = np.random.default_rng(4)
    budget = 64
    batch, sequences = merged(rng, dict(budget=budget, n_sink=2, layout=layout), [90, 20, 0], 30)
    for _ in range(3):
        rows = [seq.rows(1) for seq in sequences]
        mx.eval(batch.update_and_fetch(mx.concatenate([k for k, _ in rows]),
                                       mx.concatenate([v for _, v in rows])))
    assert batch.keys.shape[2] == budget + 1
    buffer_bytes = batch.nbytes
    for _ in range(3):
        rows = [seq.rows(1) for seq in sequences]
        keys, values = mx.concatenate([k for k, _ in rows]), mx.concatenate([v for _, v in rows])
        mx.eval(keys, values)
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(batch.update_and_fetch(keys, values))
        assert mx.get_peak_memory() - before < buffer_bytes // 4
        assert batch.nbytes == buffer_bytes
