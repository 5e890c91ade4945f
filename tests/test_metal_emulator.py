"""Edge cases of the Metal kernels run through the emulator of the Metal
execution model; the property-based cross-checks against the fallback live
beside the kernel's own (test_key_norms.py, test_protected_topk_gather.py).

The gather and evict-and-fill kernels work through rows in chunks of 256
(their threadgroup size), both leave more than 128 rows a head to copy
(protected_topk_gather's kept rows, evict_and_fill's new rows) to a second
dispatch of 128-row blocks (metal/knorm_defines.h), the evict-and-fill
kernel pairs holes with movers through queues of 512, and the norm kernel
runs one 32-lane SIMD group per row, four rows per threadgroup: the cases
below cross those boundaries.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import textwrap

import mlx.core as mx
import numpy as np
import pytest

from conftest import assert_bitwise_equal, data_address, requires_emulator
from generators import evict_and_fill_arrays, key_norms_arrays, protected_topk_gather_arrays
from mlx_knorm import _native

pytestmark = requires_emulator


def native_and_emulated(op, *args):
    ext = _native.ext
    return getattr(ext, op)(*args, stream=mx.cpu), getattr(ext, op)(*args, emulate_metal=True, stream=mx.cpu)


def protected_topk_gather_args(n_prior, n_new, budget, n_sink, recent, palette, keep="low", dim=3, seed=0, n_heads=2):
    rng = np.random.default_rng(seed)
    arrays = protected_topk_gather_arrays(rng, n_heads, n_prior, n_new, dim, key_palette="special",
                                          norm_palette=palette)
    return (*arrays, budget, n_sink, recent, keep)


@pytest.mark.parametrize(
    "n_prior,n_new,budget,n_sink,recent",
    [
        (0, 0, 4, 1, 1),        # nothing at all
        (0, 7, 4, 1, 1),        # empty prior
        (9, 0, 4, 1, 1),        # S = 0
        (600, 40, 639, 0, 0),   # evicts one row of many chunks
        (700, 0, 300, 5, 17),   # threshold deep inside the middle
        (513, 0, 2, 1, 0),      # keeps a single middle row
        (255, 2, 256, 0, 0),    # the evicted row on a chunk boundary
        (300, 0, 128, 1, 1),    # the most rows the selecting threadgroup copies
        (200, 5, 129, 1, 1),    # rows copied by a second dispatch, the last block one row
        (250, 20, 257, 3, 9),   # three blocks of the second dispatch
        (0, 300, 200, 1, 1),    # no prior (a placeholder in both dispatches)
    ],
)
@pytest.mark.parametrize("palette", ["ties", "special", "zeros"])
@pytest.mark.parametrize("keep", ["low", "high"])
def test_protected_topk_gather_edges(n_prior, n_new, budget, n_sink, recent, palette, keep):
    args = protected_topk_gather_args(n_prior, n_new, budget, n_sink, recent, palette, keep, seed=n_prior * 31 + budget)
    for name, a, b in zip(("keys", "values", "norms", "indices"), *native_and_emulated("protected_topk_gather", *args)):
        assert_bitwise_equal(b, a, name)


@pytest.mark.parametrize("n_new", [1, 50, 300])
@pytest.mark.parametrize("donated", [(0, 1, 2), (0, 1), (0,), (1, 2), (2,)])
def test_protected_topk_gather_in_place_moves_over_many_threadgroups(n_new, donated):
    """A gather whose keys or values are compacted in place, with few heads
    and more than 128 rows kept: the prior rows that move are staged over
    blocks of 128 output rows (knorm_stage_prior_rows), then written with
    the new rows (knorm_gather_rows), not moved by one threadgroup a head;
    the threadgroups in either order, the donated prior arrays (keys,
    values, norms) in any combination, the others held."""
    heads, kept = 3, 300
    rng = np.random.default_rng(n_new + len(donated))
    arrays = protected_topk_gather_arrays(rng, heads, kept, n_new, 8, 5, key_palette="special",
                                          norm_palette="ties")
    blocks = -(-kept // 128)
    for reverse in (False, True):
        results = []
        for emulate in (False, True):
            prior = [mx.array(np.array(a)) for a in arrays[:3]]
            mx.eval(prior)
            held = {i: prior[i] for i in range(3) if i not in donated}
            addresses = [data_address(a) for a in prior]
            out = _native.ext.protected_topk_gather(*prior, *arrays[3:], kept, 2, 7, "low",
                                                    emulate_metal=emulate, stream=mx.cpu)
            del prior
            log = emulator_log(lambda: mx.eval(out), reverse_groups=reverse)
            results.append(out)
            assert [data_address(out[i]) == addresses[i] for i in range(3)] == [i in donated for i in range(3)]
            if emulate:
                staged = [("knorm_stage_prior_rows", heads * blocks)] if {0, 1} & set(donated) else []
                assert [(d["kernel"].rsplit("_float", 2)[0], d["groups"]) for d in log[1:]] == \
                    staged + [("knorm_gather_rows", heads * blocks)]
            for i, a in held.items():
                assert_bitwise_equal(a, arrays[i], f"held prior {i}")
        for name, a, b in zip(("keys", "values", "norms", "indices"), *results):
            assert_bitwise_equal(b, a, f"{name} reverse={reverse}")


def test_protected_topk_gather_all_equal_scores_keep_earliest():
    n_prior, budget = 300, 40
    args = (
        mx.zeros((1, n_prior, 4)), mx.zeros((1, n_prior, 4)), mx.ones((1, n_prior)),
        mx.zeros((1, 0, 4)), mx.zeros((1, 0, 4)), mx.zeros((1, 0)), budget, 2, 3, "high",
    )
    _, emulated = native_and_emulated("protected_topk_gather", *args)
    expected = list(range(2 + budget - 5)) + list(range(n_prior - 3, n_prior))
    assert emulated[3][0].tolist() == expected


@pytest.mark.parametrize("dim", [0, 1, 31, 32, 33, 512])
def test_key_norms_simd_boundaries(dim):
    (keys,) = key_norms_arrays(np.random.default_rng(dim), (2, 3, 5, dim), palette="special", dtype="bfloat16")
    native, emulated = native_and_emulated("key_norms", keys)
    assert_bitwise_equal(emulated, native, f"D={dim}")


def test_key_norms_rejects_dim_past_kernel_limit():
    with pytest.raises(ValueError, match="D <= 512"):
        _native.ext.key_norms(mx.zeros((1, 513)), emulate_metal=True, stream=mx.cpu)


def evict_and_fill_args(slots, n_new, positions, palette, key_dim=8, seed=0):
    rng = np.random.default_rng(seed)
    return evict_and_fill_arrays(rng, 2, slots, n_new, key_dim, 5, positions=positions,
                                 key_palette="special", norm_palette=palette)


def assert_slots_equal(emulated, native, defined: int, what: str = "") -> None:
    """The step's keys, values, norms and positions of both kernels, bit for
    bit over the slots ``[0, defined)`` (the rest is unspecified)."""
    for name, a, b in zip(("keys", "values", "norms", "positions"), native, emulated):
        assert_bitwise_equal(b[:, :defined], a[:, :defined], f"{name} {what}".strip())


def evict_and_fill_native_and_emulated(args, config, donate):
    """Both kernels from copies of ``args``; with ``donate`` the copies are
    referenced by the op alone, so outputs take over their buffers."""
    results = []
    for emulate in (False, True):
        arrays = [mx.array(np.array(a)) for a in args]
        mx.eval(arrays)
        out = _native.ext.evict_and_fill(*arrays, **config, emulate_metal=emulate, stream=mx.cpu)
        if donate:
            arrays.clear()
        mx.eval(out)
        results.append(out)
    return results


def evict_and_fill_values_held(args, config, reverse=False):
    """Both kernels from copies of ``args`` whose values the test holds (so
    they are not donated) and whose other arrays it does not: the keys,
    norms and positions in place, the values into a fresh buffer, left as
    they were. Returns both results and the emulated run's dispatches
    (threadgroups last to first with ``reverse``)."""
    results = []
    for emulate in (False, True):
        arrays = [mx.array(np.array(a)) for a in args]
        mx.eval(arrays)
        values = arrays[1]
        keys_at = data_address(arrays[0])
        out = _native.ext.evict_and_fill(*arrays, **config, emulate_metal=emulate, stream=mx.cpu)
        del arrays[:]
        log = emulator_log(lambda: mx.eval(out), reverse_groups=reverse)
        results.append(out)
        assert data_address(out[0]) == keys_at
        assert np.array_equal(np.array(values), np.array(args[1]), equal_nan=True)
    return results, log


@pytest.mark.parametrize(
    "slots, filled, budget, n_new",
    [
        (257, 257, 256, 1),     # a decode step over a chunk boundary
        (514, 513, 512, 1),
        (700, 700, 300, 3),     # more holes than a queue takes at once
        (600, 600, 2, 0),       # keeps two rows
        (300, 40, 60, 20),      # nothing leaves; new rows over several SIMD groups
        (300, 0, 400, 300),     # a prompt into an empty cache: the new rows alone, split
        (500, 400, 300, 200),   # many leave, then new rows written by a second dispatch
        (260, 131, 131, 129),   # nothing leaves; the second dispatch's last block one row
    ],
)
@pytest.mark.parametrize("positions", ["distinct", "equal"])
@pytest.mark.parametrize("layout", ["slots", "temporal"])
@pytest.mark.parametrize("donate", [False, True])
def test_evict_and_fill_edges(slots, filled, budget, n_new, positions, layout, donate):
    args = evict_and_fill_args(slots, n_new, positions, "ties", seed=slots + budget)
    config = dict(filled=filled, offset=slots, capacity=slots, budget=budget,
                  n_sink=3 if budget > 8 else 1, recent=5 if budget > 8 else 0,
                  keep="low" if positions == "distinct" else "high", layout=layout)
    native, emulated = evict_and_fill_native_and_emulated(args, config, donate)
    defined = min(filled, budget) + n_new
    assert_slots_equal(emulated, native, defined)


@pytest.mark.parametrize("donate", [False, True])
def test_protected_topk_gather_and_evict_and_fill_second_dispatch_over_three_heads(donate):
    """Both ops with rows a second dispatch copies on three heads: its
    head and block arithmetic past the second head."""
    args = protected_topk_gather_args(150, 250, 300, 2, 4, "normal", dim=16, seed=3, n_heads=3)
    for name, a, b in zip(("keys", "values", "norms", "indices"),
                          *native_and_emulated("protected_topk_gather", *args)):
        assert_bitwise_equal(b, a, name)
    arrays = evict_and_fill_arrays(np.random.default_rng(3), 3, 600, 200, 16, 8, dtypes=("float32", "float16"))
    config = dict(filled=400, offset=600, capacity=600, budget=300, n_sink=2, recent=4,
                  keep="low", layout="slots")
    native, emulated = evict_and_fill_native_and_emulated(arrays, config, donate)
    assert_slots_equal(emulated, native, 500)


@pytest.mark.parametrize("key_dim", [0, 1, 33, 512])
def test_evict_and_fill_new_row_norms_at_every_width(key_dim):
    args = evict_and_fill_args(40, 9, "distinct", "special", key_dim=key_dim)
    config = dict(filled=40, offset=40, capacity=40, budget=30, n_sink=1, recent=2, keep="low", layout="slots")
    native, emulated = evict_and_fill_native_and_emulated(args, config, donate=False)
    assert_slots_equal(emulated, native, 39)


def at_offset(a: mx.array, elements: int) -> mx.array:
    """``a`` as a row-contiguous view that starts ``elements`` elements into
    its buffer, as a slice along a leading axis would."""
    flat = mx.concatenate([mx.zeros((elements,), a.dtype), a.reshape(-1)])
    view = flat[elements:].reshape(a.shape)
    mx.eval(view)
    return view


# Rows of 16-byte multiples, of 8-byte multiples and neither; each array
# shifted by 0, 2, 4 or 8 elements: the plans move rows in 16-byte, 8-byte
# or element units, and the emulator aborts on a misaligned vector. Rows of
# 1, 3, 8 and 16 units share a SIMD group's lanes with others
# (knorm_row_lanes), 25 units leave lanes idle, 33 take lane 0 twice.
ROW_WIDTHS = [("float16", 64), ("float16", 12), ("float16", 3), ("bfloat16", 8),
              ("float32", 4), ("float32", 6), ("float32", 33), ("bfloat16", 128), ("float16", 200)]


@pytest.mark.parametrize("dtype, dim", ROW_WIDTHS)
@pytest.mark.parametrize("shift", [0, 2, 4, 8])
def test_protected_topk_gather_moves_rows_at_any_alignment(dtype, dim, shift):
    rng = np.random.default_rng(dim + shift)
    arrays = protected_topk_gather_arrays(rng, 2, 40, 9, dim, dim + 1, key_palette="special",
                                          value_palette="special", norm_palette="ties", dtypes=(dtype, dtype))
    shifts = (shift, shift // 2, 0, 1, 0, 0)
    args = (*(at_offset(a, k) if k else a for a, k in zip(arrays, shifts)), 30, 2, 3, "low")
    for name, a, b in zip(("keys", "values", "norms", "indices"), *native_and_emulated("protected_topk_gather", *args)):
        assert_bitwise_equal(b, a, name)


@pytest.mark.parametrize("dtype, dim", ROW_WIDTHS)
@pytest.mark.parametrize("shift", [0, 2, 4, 8])
@pytest.mark.parametrize("layout", ["slots", "temporal"])
def test_evict_and_fill_moves_rows_at_any_alignment(dtype, dim, shift, layout):
    rng = np.random.default_rng(dim + shift)
    arrays = evict_and_fill_arrays(rng, 2, 40, 3, dim, dim + 1, key_palette="special", value_palette="special",
                                   norm_palette="ties", dtypes=(dtype, dtype))
    shifts = (shift, shift // 2, 0, 0, 1, 0)
    args = [at_offset(a, k) if k else a for a, k in zip(arrays, shifts)]
    config = dict(filled=40, offset=40, capacity=40, budget=30, n_sink=2, recent=3,
                  keep="low", layout=layout)
    native = _native.ext.evict_and_fill(*args, **config, stream=mx.cpu)
    emulated = _native.ext.evict_and_fill(*args, **config, emulate_metal=True, stream=mx.cpu)
    assert_slots_equal(emulated, native, 33)


# Rows of 1, 3 and 16 units, enough of them that each SIMD group's lanes
# take several passes of rows (knorm_row_lanes): 300 kept rows of a gather;
# a slot-layout step evicting 300 of 600 rows, whose evicted slots below 300
# (about half of them) are holes, each filled by a mover.
PACKED_WIDTHS = [("float32", 4), ("float16", 3), ("bfloat16", 128)]


@pytest.mark.parametrize("dtype, dim", PACKED_WIDTHS)
def test_protected_topk_gather_copies_many_packed_rows(dtype, dim):
    rng = np.random.default_rng(dim)
    arrays = protected_topk_gather_arrays(rng, 2, 500, 100, dim, dim, key_palette="special",
                                          value_palette="special", norm_palette="ties", dtypes=(dtype, dtype))
    args = (*arrays, 300, 2, 3, "low")
    for name, a, b in zip(("keys", "values", "norms", "indices"), *native_and_emulated("protected_topk_gather", *args)):
        assert_bitwise_equal(b, a, name)


@pytest.mark.parametrize("dtype, dim", PACKED_WIDTHS)
def test_evict_and_fill_moves_many_packed_pairs(dtype, dim):
    rng = np.random.default_rng(dim)
    arrays = evict_and_fill_arrays(rng, 2, 600, 1, dim, dim, key_palette="special", value_palette="special",
                                   norm_palette="ties", dtypes=(dtype, dtype))
    config = dict(filled=600, offset=600, capacity=600, budget=300, n_sink=2, recent=3,
                  keep="low", layout="slots")
    native = _native.ext.evict_and_fill(*arrays, **config, stream=mx.cpu)
    emulated = _native.ext.evict_and_fill(*arrays, **config, emulate_metal=True, stream=mx.cpu)
    assert_slots_equal(emulated, native, 301)


def test_evict_and_fill_rejects_key_widths_past_the_norm_kernel():
    args = evict_and_fill_args(4, 1, "distinct", "normal", key_dim=513)
    config = dict(filled=4, offset=4, capacity=4, budget=3, n_sink=0, recent=0, keep="low", layout="slots")
    with pytest.raises(ValueError, match="D <= 512"):
        _native.ext.evict_and_fill(*args, **config, emulate_metal=True, stream=mx.cpu)


# Address space for the interpreter's own needs, far short of a threadgroup's
# thread stacks (128 of 8 MiB by default): the emulator can start only some
# of the threads of one threadgroup.
THREAD_STARVED_SCRIPT = textwrap.dedent(
    """
    import resource
    import mlx.core as mx
    import mlx_knorm

    # Threads started for each dispatch alone: a kept pool would have them
    # all from the first evaluation.
    mlx_knorm._native.ext._emulator_debug(fresh_threads=True)
    keys = mx.random.normal((8, 64), key=mx.random.key(0))
    with mlx_knorm.use_backend("metal-emulator"):
        want = mlx_knorm.key_norms(keys, stream=mx.cpu)
        mx.eval(want)
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        with open("/proc/self/status") as status:
            used = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (used + (64 << 20), hard))
        try:
            mx.eval(mlx_knorm.key_norms(keys, stream=mx.cpu))
        except RuntimeError as err:
            print("raised:", err)
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        got = mlx_knorm.key_norms(keys, stream=mx.cpu)
        print("equal after:", mx.array_equal(got, want).item())
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_threads_that_cannot_start_raise():
    """Under an address-space limit the threads of a threadgroup cannot all
    start: none runs the kernel, the call raises naming the emulator, and the
    process runs the kernel again once the limit is lifted."""
    result = subprocess.run([sys.executable, "-c", THREAD_STARVED_SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2, result.stdout + result.stderr
    assert re.fullmatch(r"raised: metal emulator: knorm_key_norms_float32_\d+: started \d+ of a threadgroup's 128 threads .*",
                        lines[0]), lines[0]
    assert lines[1] == "equal after: True"


def live_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_dispatches_run_on_threads_kept_from_earlier_ones():
    """A threadgroup's threads are started once and kept
    (metal_emulator/thread_pool.h): later dispatches start none; with
    fresh_threads each dispatch's threads are joined after it, and those
    kept before with them."""
    keys = mx.random.normal((8, 64), key=mx.random.key(0))
    mx.eval(keys)

    def key_norms(fresh_threads):
        log = emulator_log(lambda: mx.eval(_native.ext.key_norms(keys, emulate_metal=True, stream=mx.cpu)),
                           fresh_threads=fresh_threads)
        return max(d["group_size"] for d in log)

    key_norms(fresh_threads=True)
    without_pool = live_threads()
    group_size = key_norms(fresh_threads=False)
    assert live_threads() == without_pool + group_size
    key_norms(fresh_threads=False)
    assert live_threads() == without_pool + group_size
    key_norms(fresh_threads=True)
    assert live_threads() == without_pool


@pytest.mark.parametrize("width", [1, 16, 31, 64])
def test_pipelines_with_other_simd_widths_are_refused(width):
    """The scans, ballots and shuffles assume 32 lanes: eval_gpu refuses any
    other threadExecutionWidth before encoding (the emulator runs the same
    check with its own, 32)."""
    with pytest.raises(RuntimeError, match=rf"knorm_evict_and_fill_given needs SIMD groups of 32 lanes; this GPU runs it with {width} "):
        _native.ext.check_metal_pipeline("knorm_evict_and_fill_given", 256, 1024, width)


def test_pipelines_with_too_few_threads_are_refused():
    with pytest.raises(RuntimeError, match="needs threadgroups of 256 threads; this GPU runs it with at most 224"):
        _native.ext.check_metal_pipeline("knorm_protected_topk_gather_float16_float16", 256, 224, 32)
    _native.ext.check_metal_pipeline("knorm_protected_topk_gather_float16_float16", 256, 256, 32)


def two_magnitude_norms(n_heads, rows, small, seed):
    """Norms of two magnitudes far apart (their order keys differ in the top
    byte), ``small`` of them small, the rest large, shuffled: a select that
    keeps exactly ``small`` rows keeps the whole first top-byte bin."""
    rng = np.random.default_rng(seed)
    norms = np.concatenate([rng.uniform(1.0, 1.5, (n_heads, small)),
                            rng.uniform(1e30, 2e30, (n_heads, rows - small))], axis=1)
    return mx.array(rng.permuted(norms, axis=1).astype(np.float32))


@pytest.mark.parametrize("extra", [-1, 0, 1])
@pytest.mark.parametrize("keep", ["low", "high"])
def test_protected_topk_gather_cut_at_and_near_a_radix_bin_boundary(extra, keep):
    """The select stops once the chosen bin holds exactly the rows still to
    keep (extra = 0 for keep="low": after the first pass), and the
    compaction then keeps every key at or below the bin's largest without
    the equal-key scan; one row fewer or more runs every pass."""
    n_prior, small = 400, 150
    budget = small + extra
    norms = two_magnitude_norms(2, n_prior, small, seed=small + extra)
    arrays = protected_topk_gather_arrays(np.random.default_rng(5), 2, n_prior, 0, 8, dtypes=("float16", "float16"))
    arrays[2] = norms
    args = (*arrays, budget, 0, 0, keep)
    native, emulated = native_and_emulated("protected_topk_gather", *args)
    for name, a, b in zip(("keys", "values", "norms", "indices"), native, emulated):
        assert_bitwise_equal(b, a, name)


@pytest.mark.parametrize("extra", [-1, 0, 1])
@pytest.mark.parametrize("layout", ["slots", "temporal"])
def test_evict_and_fill_cut_at_and_near_a_radix_bin_boundary(extra, layout):
    """The evict-and-fill select over 64-bit ranks stops after the score's
    passes, or the first, when the bin holds exactly the rows to keep."""
    slots, small = 600, 200
    budget = small + extra
    args = evict_and_fill_args(slots, 2, "distinct", "normal", seed=budget)
    args[2] = two_magnitude_norms(2, slots, small, seed=budget)
    config = dict(filled=slots, offset=slots, capacity=slots, budget=budget,
                  n_sink=0, recent=0, keep="low", layout=layout)
    native, emulated = evict_and_fill_native_and_emulated(args, config, donate=False)
    defined = budget + 2
    assert_slots_equal(emulated, native, defined)


@pytest.mark.parametrize(
    "slots, filled, budget, n_new, capacity",
    [
        (300, 300, 200, 1, 300),   # 100 rows leave; slots [0, 200) copied in two blocks a head
        (400, 300, 300, 1, 512),   # a decode step into larger buffers: nothing leaves
        (514, 513, 512, 1, 640),   # a decode step at the budget into larger buffers
        (260, 129, 129, 0, 129),   # the last block one row
    ],
)
@pytest.mark.parametrize("layout", ["slots", "temporal"])
def test_evict_and_fill_copies_kept_slots_over_many_threadgroups(slots, filled, budget, n_new, capacity, layout):
    """Outputs that are fresh buffers (not donated, or of another capacity)
    start as a copy of slots [0, kept): with few heads a dispatch of its own
    over blocks of 128 slots per head (knorm_copy_kept_rows), on three heads
    so that the head and block arithmetic is crossed."""
    args = evict_and_fill_arrays(np.random.default_rng(slots + capacity), 3, slots, n_new, 8, 5,
                                 key_palette="special")
    config = dict(filled=filled, offset=slots, capacity=capacity, budget=budget,
                  n_sink=2, recent=3, keep="low", layout=layout)
    for donate in (False, True):
        native, emulated = evict_and_fill_native_and_emulated(args, config, donate)
        defined = min(filled, budget) + n_new
        assert_slots_equal(emulated, native, defined, f"donate={donate}")


@pytest.mark.parametrize("kept", [129, 300])
@pytest.mark.parametrize("evicted", [(0, 127, 128), (256, -1, 0)])
def test_evict_and_fill_temporal_decode_shifts_over_many_threadgroups(kept, evicted):
    """The temporal layout's decode step with few heads moves its payload
    rows over blocks of 128 slots per head (knorm_shift_kept_rows), each
    head evicting a slot of its own (a block's first or last, the last
    stored one (-1), the first): in place (donated), into fresh buffers,
    and with one payload held elsewhere (one in place, one not)."""
    heads = 3
    evicted = [kept if e == -1 else min(e, kept - 1) for e in evicted]
    slots = kept + 1
    norms = np.ones((heads, slots), np.float32)
    for h, e in enumerate(evicted):
        norms[h, e] = 9.0
    args = evict_and_fill_arrays(np.random.default_rng(kept), heads, slots, 1, 8, 5,
                                 key_palette="special", norms=mx.array(norms), layout="temporal")
    config = dict(filled=slots, offset=slots, capacity=slots, budget=kept, n_sink=0, recent=0,
                  keep="low", layout="temporal")
    blocks = -(-kept // 128)
    for donate, reverse in itertools.product((False, True), (False, True)):
        results = []
        log = emulator_log(lambda: results.extend(evict_and_fill_native_and_emulated(args, config, donate)),
                           reverse_groups=reverse)
        assert [(d["kernel"], d["groups"]) for d in log if d["kernel"] == "knorm_shift_kept_rows"] == \
            [("knorm_shift_kept_rows", heads * blocks)]
        native, emulated = results
        assert_slots_equal(emulated, native, kept + 1, f"donate={donate} reverse={reverse}")
        for h, e in enumerate(evicted):
            assert native[3][h, :kept].tolist() == [p for p in range(slots) if p != e]
    # The values held elsewhere: the keys shift in place, the values into a
    # fresh buffer.
    for reverse in (False, True):
        (native, emulated), log = evict_and_fill_values_held(args, config, reverse)
        assert ("knorm_shift_kept_rows", heads * blocks) in [(d["kernel"], d["groups"]) for d in log]
        assert_slots_equal(emulated, native, kept + 1, f"values held, reverse={reverse}")


@pytest.mark.parametrize(
    "slots, filled, budget, n_new, recent",
    [
        (700, 650, 300, 50, 0),   # a prompt chunk past the budget: 350 leave, three blocks
        (400, 260, 129, 3, 1),    # kept one past a block: the last block one slot
        (600, 600, 513, 0, 40),   # few leave, late: most blocks' slots stay
    ],
)
def test_evict_and_fill_temporal_compaction_moves_over_many_threadgroups(slots, filled, budget, n_new, recent):
    """The temporal layout's step with several rows leaving and few heads
    moves its payload rows over blocks of 128 slots per head
    (knorm_compact_kept_rows), the rows moving in place staged in the
    scratch buffer first (knorm_stage_compaction): in place, into fresh
    buffers, and with one payload held elsewhere."""
    heads = 3
    args = evict_and_fill_arrays(np.random.default_rng(slots + filled), heads, slots, n_new, 8, 5,
                                 key_palette="special", norm_palette="ties", layout="temporal")
    config = dict(filled=filled, offset=filled, capacity=slots, budget=budget, n_sink=2, recent=recent,
                  keep="low", layout="temporal")
    blocks = -(-budget // 128)
    for donate, reverse in itertools.product((False, True), (False, True)):
        results = []
        log = emulator_log(lambda: results.extend(evict_and_fill_native_and_emulated(args, config, donate)),
                           reverse_groups=reverse)
        wide = [(d["kernel"], d["groups"]) for d in log
                if d["kernel"] in ("knorm_stage_compaction", "knorm_compact_kept_rows")]
        assert wide == ([("knorm_stage_compaction", heads * blocks)] if donate else []) + \
            [("knorm_compact_kept_rows", heads * blocks)]
        native, emulated = results
        assert_slots_equal(emulated, native, budget + n_new, f"donate={donate} reverse={reverse}")
        positions = np.array(native[3][:, :budget])
        assert (np.diff(positions, axis=1) > 0).all()
    for reverse in (False, True):
        (native, emulated), log = evict_and_fill_values_held(args, config, reverse)
        assert [(d["kernel"], d["groups"]) for d in log
                if d["kernel"] in ("knorm_stage_compaction", "knorm_compact_kept_rows")] == \
            [("knorm_stage_compaction", heads * blocks), ("knorm_compact_kept_rows", heads * blocks)]
        assert_slots_equal(emulated, native, budget + n_new, f"values held, reverse={reverse}")


def test_wide_moves_keep_their_scratch_within_the_largest_buffer():
    """The wide compaction and the gather's staged moves need a scratch
    buffer: where the device's largest buffer (maxBufferLength) cannot hold
    it, the plans take the path that needs none, with the same bits."""
    heads = 3
    step_args = evict_and_fill_arrays(np.random.default_rng(7), heads, 700, 50, 8, 5, key_palette="special",
                                      norm_palette="ties", layout="temporal")
    step_config = dict(filled=650, offset=650, capacity=700, budget=300, n_sink=2, recent=0, keep="low",
                       layout="temporal")
    gather_arrays = protected_topk_gather_arrays(np.random.default_rng(8), heads, 300, 50, 8, 5,
                                                 key_palette="special", norm_palette="ties")

    def step():
        return evict_and_fill_native_and_emulated(step_args, step_config, donate=True)

    def gather():
        results = []
        for emulate in (False, True):
            prior = [mx.array(np.array(a)) for a in gather_arrays[:3]]
            out = _native.ext.protected_topk_gather(*prior, *gather_arrays[3:], 300, 2, 7, "low",
                                                    emulate_metal=emulate, stream=mx.cpu)
            del prior
            mx.eval(out)
            results.append(out)
        return results

    for run, wide in ((step, "knorm_compact_kept_rows"), (gather, "knorm_gather_rows")):
        results = []
        log = emulator_log(lambda: results.append(run()))
        scratch = [b for d in log for b in d["scratch"]]
        assert wide in [d["kernel"].split("_float")[0] for d in log] and len(scratch) == 1
        for limit, takes_wide in ((scratch[0], True), (scratch[0] - 16, False)):
            log = emulator_log(lambda: results.append(run()), max_buffer_bytes=limit)
            assert (wide in [d["kernel"].split("_float")[0] for d in log]) == takes_wide, limit
            assert all(b <= limit for d in log for b in d["scratch"])
        for native, emulated in results:
            for name, a, b in zip(("keys", "values", "norms", "positions or indices"), native, emulated):
                assert_bitwise_equal(b[:, :300], a[:, :300], name)


@pytest.mark.parametrize("hold", [None, 2, 4])
def test_evict_and_fill_temporal_decode_shifts_quantized_payloads_over_many_threadgroups(hold):
    """The wide shift of a quantized cache's six payloads (mlx-lm's packed
    rows, scales and biases for keys and values, each its own width and
    dtype) across blocks of 128 slots: in place, into fresh buffers, and
    with one payload held elsewhere (the others in place), each head
    evicting a slot of its own."""
    heads, kept = 2, 300
    slots = kept + 1
    rng = np.random.default_rng(kept if hold is None else hold)
    widths = [(mx.uint32, 16), (mx.float16, 2), (mx.float16, 2), (mx.uint32, 8), (mx.bfloat16, 1), (mx.float16, 1)]

    def payload(dtype, width, rows):
        bits = rng.integers(0, 2**32, size=(heads, rows, width), dtype=np.uint32)
        return bits if dtype == mx.uint32 else bits.astype(np.uint16)

    def as_mx(bits, dtype):
        return mx.array(bits).view(dtype)

    norms = np.ones((heads, slots), np.float32)
    evicted = [127, 290]
    for h, e in enumerate(evicted):
        norms[h, e] = 9.0
    stored = [payload(d, w, slots) for d, w in widths]
    new = [as_mx(payload(d, w, 1), d) for d, w in widths]
    positions = mx.broadcast_to(mx.arange(slots, dtype=mx.int32), (heads, slots))
    config = dict(filled=slots, offset=slots, capacity=slots, budget=kept, n_sink=0, recent=0,
                  keep="low", layout="temporal", new_norms=mx.ones((heads, 1)))
    for donate, reverse in itertools.product((False, True), (False, True)):
        results = []
        for emulate in (False, True):
            arrays = [as_mx(bits, d) for bits, (d, _) in zip(stored, widths)]
            arrays += [mx.array(norms), mx.array(np.array(positions))]
            mx.eval(arrays)
            held = arrays[hold] if hold is not None else None
            # Where the payloads' buffers are (those numpy reads: not bfloat16).
            addresses = {i: data_address(a) for i, a in enumerate(arrays[:6]) if a.dtype != mx.bfloat16}
            out = _native.ext.evict_and_fill(
                tuple(arrays[:3]), tuple(arrays[3:6]), arrays[6], arrays[7], tuple(new[:3]), tuple(new[3:]),
                **config, emulate_metal=emulate, stream=mx.cpu)
            if donate:
                del arrays[:]
            log = emulator_log(lambda: mx.eval(out), reverse_groups=reverse)
            if emulate:
                assert [(d["kernel"], d["groups"]) for d in log if d["kernel"] == "knorm_shift_kept_rows"] == \
                    [("knorm_shift_kept_rows", heads * 3)]
            results.append(out)
            for i, at in addresses.items():
                assert (data_address(out[i]) == at) == (donate and i != hold), f"payload {i} in place"
            if held is not None:
                assert np.array_equal(np.array(held.view(mx.uint8)).view(stored[hold].dtype), stored[hold])
        native, emulated = results
        for i, (a, b) in enumerate(zip(native, emulated)):
            assert_bitwise_equal(b[:, : kept + 1], a[:, : kept + 1], f"output {i} donate={donate} reverse={reverse}")
        for h, e in enumerate(evicted):
            assert native[7][h, :kept].tolist() == [p for p in range(slots) if p != e]
            for i in range(6):
                got = np.array(native[i].view(mx.uint8)).view(stored[i].dtype)[h, :kept]
                assert np.array_equal(got, np.delete(stored[i][h], e, axis=0))


def emulator_log(run, **knobs):
    """The dispatches the emulator ran in ``run()``, with its debugging
    knobs (csrc/metal_emulator/run_plan.h) set meanwhile."""
    ext = _native.ext
    ext._emulator_debug(record=True, **knobs)
    try:
        run()
    finally:
        log = ext._emulator_debug()
    return log


def rounded(n_bytes):
    """A [[threadgroup(i)]] length: 16-byte units, at least one."""
    return max(16, -(-n_bytes // 16) * 16)


def emulated_step(args, config):
    return lambda: mx.eval(_native.ext.evict_and_fill(*args, **config, emulate_metal=True, stream=mx.cpu))


@pytest.mark.parametrize(
    "filled, budget, layout, ranks, lists",
    [
        (301, 300, "slots", 0, 0),              # a decode step: neither
        (600, 300, "slots", 600 * 8, 2 * 512 * 4),  # many leave: the ranks and both queues
        (600, 300, "temporal", 600 * 8, 256 * 4),   # the temporal compaction's chunk
        (3073, 300, "slots", 0, 2 * 512 * 4),   # past kEvictCachedRanks: ranks read from the rows
    ],
)
def test_evict_and_fill_sizes_threadgroup_memory_per_dispatch(filled, budget, layout, ranks, lists):
    """The step's threadgroup buffers as the plan sizes them for what the
    dispatch uses, the rows unchanged (bit-identical to the CPU kernel)."""
    args = evict_and_fill_args(filled, 1, "distinct", "ties", seed=filled)
    config = dict(filled=filled, offset=filled, capacity=filled, budget=budget, n_sink=1, recent=2,
                  keep="low", layout=layout)
    log = emulator_log(emulated_step(args, config))
    (step,) = [d for d in log if d["kernel"].startswith("knorm_evict_and_fill_")]
    assert step["threadgroup_bytes"] == [rounded(ranks), rounded(lists)]
    assert sum(step["threadgroup_bytes"]) < step["threadgroup_memory"] <= 32 * 1024
    assert all(d["threadgroup_bytes"] == [] for d in log if d is not step)
    native, emulated = evict_and_fill_native_and_emulated(args, config, donate=False)
    defined = budget + 1
    assert_slots_equal(emulated, native, defined)


@pytest.mark.parametrize(
    "n_prior, n_new, budget, norms",
    [
        (600, 7, 300, 607 * 4),   # evicts: every row's norm cached
        (600, 7, 700, 0),         # keeps every row: nothing selected
        (7000, 169, 300, 0),      # past kGatherCachedNorms: norms read from the rows
    ],
)
def test_protected_topk_gather_sizes_threadgroup_memory_per_dispatch(n_prior, n_new, budget, norms):
    args = protected_topk_gather_args(n_prior, n_new, budget, 1, 2, "normal")
    log = emulator_log(lambda: mx.eval(
        _native.ext.protected_topk_gather(*args, emulate_metal=True, stream=mx.cpu)))
    select = log[0]
    assert select["kernel"].startswith("knorm_protected_topk_gather_")
    # The arrays stay referenced here, so no output is in place: no sources.
    assert select["threadgroup_bytes"] == [rounded(norms), 16]
    assert sum(select["threadgroup_bytes"]) < select["threadgroup_memory"] <= 32 * 1024


def test_undersized_threadgroup_buffers_are_caught():
    """A plan that sets a [[threadgroup(i)]] length short of what its kernel
    writes fails the dispatch, naming the argument, in either op."""
    step_args = evict_and_fill_args(600, 1, "distinct", "ties")
    config = dict(filled=600, offset=600, capacity=600, budget=300, n_sink=1, recent=2, keep="low",
                  layout="slots")
    gather_args = protected_topk_gather_args(600, 7, 300, 1, 2, "normal")
    runs = [emulated_step(step_args, config),
            lambda: mx.eval(_native.ext.protected_topk_gather(*gather_args, emulate_metal=True, stream=mx.cpu))]
    for run in runs:
        with pytest.raises(RuntimeError, match=r"wrote past the end of \[\[threadgroup\(0\)\]\]"):
            emulator_log(run, threadgroup_shortfall=16)
        # As Metal, lengths in 16-byte units only.
        with pytest.raises(RuntimeError, match=r"at \[\[threadgroup\(0\)\]\]: Metal takes threadgroup memory "
                                               r"lengths in nonzero multiples of 16 bytes"):
            emulator_log(run, threadgroup_shortfall=8)
        emulator_log(run)  # the plan's own lengths pass


@pytest.mark.parametrize("key_dim", [1, 32, 33, 64, 128, 512])
def test_evict_and_fill_computes_norms_with_the_key_norm_kernels_count(key_dim):
    """A step that computes its new rows' norms holds the squares per lane
    that the key-norm kernel takes for the same D (launch_plan.h's
    squares_per_lane), not the widest count for every D."""
    args = evict_and_fill_args(40, 9, "distinct", "special", key_dim=key_dim)
    config = dict(filled=40, offset=40, capacity=40, budget=30, n_sink=1, recent=2, keep="low", layout="slots")
    keys = mx.zeros((2, 9, key_dim), mx.float16)
    (norms,) = emulator_log(lambda: mx.eval(_native.ext.key_norms(keys, emulate_metal=True, stream=mx.cpu)))
    per_lane = norms["kernel"].rsplit("_", 1)[1]
    (step,) = [d for d in emulator_log(emulated_step(args, config)) if "evict_and_fill" in d["kernel"]]
    assert step["kernel"] == f"knorm_evict_and_fill_float16_{per_lane}"


def test_launch_plans_program_prints_each_dispatch(capsys):
    """bench/launch_plans.py on a small shape: one row per dispatch, with
    the threadgroup memory of its plan."""
    import runpy
    from pathlib import Path

    program = runpy.run_path(str(Path(__file__).resolve().parents[1] / "bench" / "launch_plans.py"))
    names = program["main"].__globals__
    names.update(MODELS=(("tiny", 2, 64),), BATCHES=(1,), BUDGET=64, PROMPT=128)
    names["main"]()
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny")]
    by_step = {(row[2], row[3]): row for row in rows}
    decode = by_step["evict_and_fill decode at budget", "knorm_evict_and_fill_float16_2"]
    assert decode[4:7] == ["2", "256", "16, 16"]
    first = by_step["evict_and_fill decode after prefill", "knorm_evict_and_fill_float16_2"]
    assert first[6] == f"{rounded(128 * 8)}, {2 * 512 * 4}"
    select = by_step["gather decode S=1", "knorm_protected_topk_gather_float16_float16"]
    assert select[6].startswith(f"{rounded(65 * 4)}, ")
