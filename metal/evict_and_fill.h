// EvictAndFill on the GPU: one cache step of docs/spec.md section 4 for
// every head, one threadgroup of kEvictGroupSize threads per head:
//   selection   nothing leaves (filled <= budget); one row leaves (a decode
//               step): SIMD-group and threadgroup reductions of the 64-bit
//               rank; several leave: the radix select of knorm_kernels.h,
//               on ranks kept in threadgroup memory where they fit;
//   compaction  slot layout: the kept rows at or past `kept` fill the holes
//               below it, both in slot order; temporal layout: a stable
//               compaction, chunk by chunk;
//   fill        the new rows with their norms (knorm_row_norm) and
//               positions.
// With few heads and many new rows, the launch plan leaves the fill to a
// second dispatch, knorm_fill_new_rows, which spreads the new rows of each
// head over threadgroups of kSplitRows rows (fill_new = 0 here), and drops
// this one where it would do nothing: no stored rows, or none leaving with
// every output in place.
// An output bound to its input's buffer (a bit of in_place) is updated in
// place: only the rows that move are written. The temporal compaction then
// moves rows in waves (every thread reads its share of a wave into
// registers, a barrier, then all write), so that no row is overwritten
// before it is read. K/V rows move in the units of knorm_copy_bits that the
// launch plan chose. All offsets into K/V buffers are 64-bit.
//
// Instantiated in evict_and_fill.metal; launched by the plans of
// csrc/evict_and_fill/plan.cpp. Compiles as Metal Shading Language and,
// through csrc/metal_emulator/metal_emulator.h, as C++.
#ifndef MLX_KNORM_METAL_EVICT_AND_FILL_H
#define MLX_KNORM_METAL_EVICT_AND_FILL_H

#include "knorm_kernels.h"

constant constexpr uint kEvictSimdGroups = kEvictGroupSize / kSimdWidth;
// Entries of each queue of the slot layout's pairing: a chunk is scanned
// only while fewer than kEvictGroupSize wait, so a queue never holds more.
constant constexpr uint kEvictQueue = 2 * kEvictGroupSize;
// Slots of a head whose ranks are kept in threadgroup memory when several
// rows leave (the radix select reads them in eight passes, the compaction
// again): 24 KiB, with the kernel's other threadgroup arrays within the
// 32 KiB a threadgroup may have.
constant constexpr uint kEvictCachedRanks = 3072;

// How many rows leave.
constant constexpr uint kKeepAll = 0;
constant constexpr uint kEvictOne = 1;
constant constexpr uint kEvictMany = 2;

// One head's stored rows and the protection rule.
struct KnormEvictHead {
  uint filled;
  uint kept;
  int n_sink;        // positions below are protected
  int protect_from;  // offset - recent: positions at or above are protected
  bool keep_high;
  device const float* norms;
  device const int* positions;
  bool cached;  // the ranks of slots [0, filled) are in cached_ranks
  threadgroup const ulong* cached_ranks;
};

// docs/spec.md section 4 step 1 as one 64-bit key: the score key, or 0 for
// a protected row (no score key is 0), then the position. Equal keys rank
// by slot, lower first.
inline ulong knorm_rank_of(KnormEvictHead stored, uint s) {
  const int p = stored.positions[s];
  const bool protect = p < stored.n_sink || p >= stored.protect_from;
  const ulong score =
      protect ? ulong(0) : ulong(knorm_score_key(stored.norms[s], stored.keep_high));
  return (score << 32) | ulong(as_type<uint>(p) ^ 0x80000000u);
}

inline ulong knorm_eviction_rank(KnormEvictHead stored, uint s) {
  return stored.cached ? stored.cached_ranks[s] : knorm_rank_of(stored, s);
}

// The ranks of a head's rows, for knorm_radix_select.
struct KnormEvictRanks {
  KnormEvictHead stored;

  ulong operator()(uint s) const {
    return knorm_eviction_rank(stored, s);
  }
};

// What leaves: nothing, the one slot `evicted`, or what the cut rejects.
struct KnormEviction {
  uint mode;
  uint evicted;
  KnormCut<ulong> cut;
};

// The slot of the worst rank among [0, filled), the higher slot on ties:
// one scan per thread, then reductions of (rank, slot + 1) over each SIMD
// group and over the group leaders. worst holds 3 * kEvictSimdGroups.
inline uint knorm_worst_slot(
    KnormEvictHead stored,
    threadgroup uint* worst,
    uint tid,
    uint lane,
    uint simd_group) {
  ulong rank = 0;
  uint slot = 0;  // slot + 1; 0 before any row
  for (uint s = tid; s < stored.filled; s += kEvictGroupSize) {
    const ulong r = knorm_eviction_rank(stored, s);
    if (r >= rank) {
      rank = r;
      slot = s + 1;
    }
  }
  for (uint delta = kSimdWidth / 2; delta >= 1; delta /= 2) {
    const uint high = simd_shuffle_down(uint(rank >> 32), ushort(delta));
    const uint low = simd_shuffle_down(uint(rank), ushort(delta));
    const uint other_slot = simd_shuffle_down(slot, ushort(delta));
    const ulong other = (ulong(high) << 32) | ulong(low);
    if (other > rank || (other == rank && other_slot > slot)) {
      rank = other;
      slot = other_slot;
    }
  }
  if (lane == 0) {
    worst[3 * simd_group] = uint(rank >> 32);
    worst[3 * simd_group + 1] = uint(rank);
    worst[3 * simd_group + 2] = slot;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  rank = 0;
  slot = 0;
  for (uint g = 0; g < kEvictSimdGroups; ++g) {
    const ulong other = (ulong(worst[3 * g]) << 32) | ulong(worst[3 * g + 1]);
    const uint other_slot = worst[3 * g + 2];
    if (other > rank || (other == rank && other_slot > slot)) {
      rank = other;
      slot = other_slot;
    }
  }
  return slot - 1;
}

struct KnormKept {
  bool kept;
  uint equal;  // the chunk's slots with the cut's rank, when counted
};

// Whether slot s is kept, for the threads of a chunk of consecutive slots
// visited in slot order by the whole threadgroup. Of the ranks equal to the
// cut the first take_equal in slot order are kept: equal_before counts
// those in the earlier chunks of this visit, and the result the chunk's.
inline KnormKept knorm_kept(
    KnormEvictHead stored,
    KnormEviction ev,
    uint s,
    bool valid,
    uint equal_before,
    threadgroup uint* simd_totals,
    uint lane,
    uint simd_group) {
  KnormKept out = {valid, 0u};
  if (ev.mode == kEvictOne) {
    out.kept = valid && s != ev.evicted;
  } else if (ev.mode == kEvictMany) {
    const ulong r = valid ? knorm_eviction_rank(stored, s) : ulong(0);
    if (ev.cut.take_equal == ev.cut.equal) {
      // Every rank equal to the cut is kept: no order among them needed.
      out.kept = valid && r <= ev.cut.key;
    } else {
      const bool equal = valid && r == ev.cut.key;
      const KnormScan eq = knorm_block_scan<kEvictGroupSize>(
          equal ? 1u : 0u, simd_totals, lane, simd_group);
      out.kept = valid &&
          (r < ev.cut.key || (equal && equal_before + eq.exclusive < ev.cut.take_equal));
      out.equal = eq.total;
    }
  }
  return out;
}

// How many of the slots [0, end) have the cut's rank, when the kept ones
// among them must be told apart by slot; 0 otherwise.
inline uint knorm_equal_below(
    KnormEvictHead stored,
    KnormEviction ev,
    uint end,
    threadgroup uint* simd_totals,
    uint tid,
    uint lane,
    uint simd_group) {
  uint count = 0;
  if (ev.mode != kEvictMany || ev.cut.take_equal == ev.cut.equal) {
    return count;
  }
  for (uint base = 0; base < end; base += kEvictGroupSize) {
    const uint s = base + tid;
    const bool equal = s < end && knorm_eviction_rank(stored, s) == ev.cut.key;
    count += knorm_block_scan<kEvictGroupSize>(
        equal ? 1u : 0u, simd_totals, lane, simd_group).total;
  }
  return count;
}

// One head's rows of the four inputs and the four outputs. Bit i of
// in_place: output i is input i's buffer.
template <typename K, typename V>
struct KnormEvictBuffers {
  device const K* keys;
  device const V* values;
  device const float* norms;
  device const int* positions;
  device K* out_keys;
  device V* out_values;
  device float* out_norms;
  device int* out_positions;
  uint key_dim;
  uint value_dim;
  uint key_unit;  // bytes of the units K and V rows move in (knorm_copy_bits)
  uint value_unit;
  uint in_place;
};

// Row src of every input to row dst of its output, by the lanes of one SIMD
// group; the bits move as they are.
template <typename K, typename V>
inline void knorm_move_row(KnormEvictBuffers<K, V> b, uint src, uint dst, uint lane) {
  knorm_copy_bits(b.keys + ulong(src) * b.key_dim, b.out_keys + ulong(dst) * b.key_dim,
                  b.key_dim, b.key_unit, lane, kSimdWidth);
  knorm_copy_bits(b.values + ulong(src) * b.value_dim, b.out_values + ulong(dst) * b.value_dim,
                  b.value_dim, b.value_unit, lane, kSimdWidth);
  if (lane == 0) {
    b.out_norms[dst] = b.norms[src];
    b.out_positions[dst] = b.positions[src];
  }
}

// The temporal layout: kept slots, in slot order, to [0, kept), one chunk
// of kEvictGroupSize slots at a time. src holds a chunk's kept slots, which
// go to kept_before onwards.
template <typename K, typename V>
inline void knorm_compact_temporal(
    KnormEvictHead stored,
    KnormEviction ev,
    KnormEvictBuffers<K, V> b,
    threadgroup uint* src,
    threadgroup uint* simd_totals,
    uint tid,
    uint lane,
    uint simd_group) {
  // With every output in place, rows before the one evicted slot stay: a
  // decode step starts at its chunk.
  uint base = 0;
  if (ev.mode == kEvictOne && b.in_place == 0xFu) {
    base = ev.evicted / kEvictGroupSize * kEvictGroupSize;
  }
  uint kept_before = base;
  uint equal_before = 0;
  for (; base < stored.filled; base += kEvictGroupSize) {
    const uint s = base + tid;
    const KnormKept chunk = knorm_kept(
        stored, ev, s, s < stored.filled, equal_before, simd_totals, lane, simd_group);
    const bool keep = chunk.kept;
    equal_before += chunk.equal;
    const KnormScan at =
        knorm_block_scan<kEvictGroupSize>(keep ? 1u : 0u, simd_totals, lane, simd_group);
    if (keep) {
      src[at.exclusive] = s;
    }
    // Its barriers also make the list visible to the whole group.
    const bool moves = keep && kept_before + at.exclusive != s;
    const bool any_moves = knorm_block_scan<kEvictGroupSize>(
        moves ? 1u : 0u, simd_totals, lane, simd_group).total != 0;
    const uint n = at.total;
    if ((b.in_place & 1u) == 0 || any_moves) {
      knorm_move_kv_rows<kEvictGroupSize>(b.keys, b.out_keys, (b.in_place & 1u) != 0, src,
                                          kept_before, n, b.key_dim, b.key_unit, tid);
    }
    if ((b.in_place & 2u) == 0 || any_moves) {
      knorm_move_kv_rows<kEvictGroupSize>(b.values, b.out_values, (b.in_place & 2u) != 0, src,
                                          kept_before, n, b.value_dim, b.value_unit, tid);
    }
    if ((b.in_place & 4u) == 0 || any_moves) {
      knorm_move_rows<kEvictGroupSize>(b.norms, b.out_norms, (b.in_place & 4u) != 0, src,
                                       kept_before, n, 1u, tid);
    }
    if ((b.in_place & 8u) == 0 || any_moves) {
      knorm_move_rows<kEvictGroupSize>(b.positions, b.out_positions, (b.in_place & 8u) != 0, src,
                                       kept_before, n, 1u, tid);
    }
    kept_before += n;
    // The list is read before the next chunk writes it.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

// The slot layout with several rows leaving: the holes (evicted slots below
// kept) and the movers (kept slots at or past kept) are found chunk by
// chunk in slot order, each into a ring queue, and the i-th mover moves
// into the i-th hole. Holes are written only after every scan has passed
// them, and movers are never written, so the scans read the rows as they
// were.
template <typename K, typename V>
inline void knorm_fill_holes(
    KnormEvictHead stored,
    KnormEviction ev,
    KnormEvictBuffers<K, V> b,
    threadgroup uint* holes,
    threadgroup uint* movers,
    threadgroup uint* simd_totals,
    uint tid,
    uint lane,
    uint simd_group) {
  uint hole_equal = 0;
  uint mover_equal = knorm_equal_below(stored, ev, stored.kept, simd_totals, tid, lane, simd_group);
  uint hole_next = 0;
  uint mover_next = stored.kept;
  uint hole_head = 0;
  uint hole_tail = 0;
  uint mover_head = 0;
  uint mover_tail = 0;
  while (true) {
    const bool scan_holes = hole_tail - hole_head < kEvictGroupSize && hole_next < stored.kept;
    const bool scan_movers =
        mover_tail - mover_head < kEvictGroupSize && mover_next < stored.filled;
    if (scan_holes) {
      const uint s = hole_next + tid;
      const bool valid = s < stored.kept;
      const KnormKept chunk =
          knorm_kept(stored, ev, s, valid, hole_equal, simd_totals, lane, simd_group);
      const bool hole = valid && !chunk.kept;
      hole_equal += chunk.equal;
      const KnormScan at =
          knorm_block_scan<kEvictGroupSize>(hole ? 1u : 0u, simd_totals, lane, simd_group);
      if (hole) {
        holes[(hole_tail + at.exclusive) % kEvictQueue] = s;
      }
      hole_tail += at.total;
      hole_next += kEvictGroupSize;
    }
    if (scan_movers) {
      const uint s = mover_next + tid;
      const bool valid = s < stored.filled;
      const KnormKept chunk =
          knorm_kept(stored, ev, s, valid, mover_equal, simd_totals, lane, simd_group);
      const bool mover = chunk.kept;
      mover_equal += chunk.equal;
      const KnormScan at =
          knorm_block_scan<kEvictGroupSize>(mover ? 1u : 0u, simd_totals, lane, simd_group);
      if (mover) {
        movers[(mover_tail + at.exclusive) % kEvictQueue] = s;
      }
      mover_tail += at.total;
      mover_next += kEvictGroupSize;
    }
    // The queues are complete, and the scans' reads of the rows' norms and
    // positions (where the ranks are not cached) are done before the moves
    // below overwrite holes (in place).
    threadgroup_barrier(mem_flags::mem_threadgroup | mem_flags::mem_device);
    const uint pairs = min(hole_tail - hole_head, mover_tail - mover_head);
    if (pairs == 0 && !scan_holes && !scan_movers) {
      break;
    }
    for (uint p = simd_group; p < pairs; p += kEvictSimdGroups) {
      knorm_move_row(
          b, movers[(mover_head + p) % kEvictQueue], holes[(hole_head + p) % kEvictQueue], lane);
    }
    hole_head += pairs;
    mover_head += pairs;
    // The entries are read before they are reused.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

// Step 3 for new rows [begin, end) of one head (new_keys, new_values and
// the outputs start at its rows): one SIMD group per row, its bits, its
// norm (knorm_row_norm) and its position; row j goes to slot kept + j.
template <typename K, typename V>
inline void knorm_fill_rows(
    device const K* new_keys,
    device const V* new_values,
    device K* out_keys,
    device V* out_values,
    device float* out_norms,
    device int* out_positions,
    uint key_dim,
    uint value_dim,
    uint key_unit,
    uint value_unit,
    uint kept,
    uint offset,
    uint begin,
    uint end,
    uint lane,
    uint simd_group) {
  for (uint j = begin + simd_group; j < end; j += kEvictSimdGroups) {
    device const K* key = new_keys + ulong(j) * key_dim;
    device const V* value = new_values + ulong(j) * value_dim;
    const uint dst = kept + j;
    knorm_copy_bits(key, out_keys + ulong(dst) * key_dim, key_dim, key_unit, lane, kSimdWidth);
    knorm_copy_bits(value, out_values + ulong(dst) * value_dim, value_dim, value_unit, lane,
                    kSimdWidth);
    // Sized for the widest key the kernel takes: the padding past P leaves
    // the pinned sum as it is (knorm_row_norm), and a new row's norm is a
    // small part of a step.
    const float norm = knorm_row_norm<kKeyNormsMaxDim / kSimdWidth>(key, key_dim, lane);
    if (lane == 0) {
      out_norms[dst] = norm;
      out_positions[dst] = int(offset + j);
    }
  }
}

template <typename K, typename V>
[[kernel]] void knorm_evict_and_fill(
    device const K* keys KNORM_BUFFER(0),
    device const V* values KNORM_BUFFER(1),
    device const float* norms KNORM_BUFFER(2),
    device const int* positions KNORM_BUFFER(3),
    device const K* new_keys KNORM_BUFFER(4),
    device const V* new_values KNORM_BUFFER(5),
    device K* out_keys KNORM_BUFFER(6),
    device V* out_values KNORM_BUFFER(7),
    device float* out_norms KNORM_BUFFER(8),
    device int* out_positions KNORM_BUFFER(9),
    constant uint& slots KNORM_BUFFER(10),
    constant uint& out_slots KNORM_BUFFER(11),
    constant uint& n_new KNORM_BUFFER(12),
    constant uint& key_dim KNORM_BUFFER(13),
    constant uint& value_dim KNORM_BUFFER(14),
    constant uint& filled KNORM_BUFFER(15),
    constant uint& kept KNORM_BUFFER(16),
    constant uint& offset KNORM_BUFFER(17),
    constant uint& n_sink KNORM_BUFFER(18),
    constant uint& protect_from KNORM_BUFFER(19),
    constant uint& keep_high KNORM_BUFFER(20),
    constant uint& temporal KNORM_BUFFER(21),
    constant uint& in_place KNORM_BUFFER(22),
    constant uint& key_unit KNORM_BUFFER(23),
    constant uint& value_unit KNORM_BUFFER(24),
    constant uint& fill_new KNORM_BUFFER(25),
    uint head KNORM_ATTRIBUTE(threadgroup_position_in_grid),
    uint tid KNORM_ATTRIBUTE(thread_position_in_threadgroup),
    uint lane KNORM_ATTRIBUTE(thread_index_in_simdgroup),
    uint simd_group KNORM_ATTRIBUTE(simdgroup_index_in_threadgroup)) {
  KNORM_THREADGROUP_ARRAY(atomic_uint, histogram, kRadixBins);
  KNORM_THREADGROUP_ARRAY(uint, simd_totals, kEvictSimdGroups);
  KNORM_THREADGROUP_ARRAY(uint, picked, 3);
  KNORM_THREADGROUP_ARRAY(uint, worst, 3 * kEvictSimdGroups);
  // Holes and movers (slot layout), or a chunk's kept slots in first_list
  // (temporal layout).
  KNORM_THREADGROUP_ARRAY(uint, first_list, kEvictQueue);
  KNORM_THREADGROUP_ARRAY(uint, second_list, kEvictQueue);
  KNORM_THREADGROUP_ARRAY(ulong, cached_ranks, kEvictCachedRanks);

  const ulong in_row = ulong(head) * slots;
  const ulong out_row = ulong(head) * out_slots;
  KnormEvictHead stored = {
      filled, kept, int(n_sink), as_type<int>(protect_from), keep_high != 0,
      norms + in_row, positions + in_row, false, cached_ranks};
  const KnormEvictBuffers<K, V> b = {
      keys + in_row * key_dim, values + in_row * value_dim, norms + in_row,
      positions + in_row, out_keys + out_row * key_dim,
      out_values + out_row * value_dim, out_norms + out_row,
      out_positions + out_row, key_dim, value_dim, key_unit, value_unit, in_place};

  // docs/spec.md section 4 step 1.
  KnormEviction ev = {kKeepAll, 0u, {ulong(0), 0u, 0u}};
  if (filled == kept + 1) {
    ev.mode = kEvictOne;
    ev.evicted = knorm_worst_slot(stored, worst, tid, lane, simd_group);
  } else if (filled > kept) {
    ev.mode = kEvictMany;
    // Read before any row moves, so the scans below see the ranks as they
    // were even where the outputs are the inputs.
    if (filled <= kEvictCachedRanks) {
      for (uint s = tid; s < filled; s += kEvictGroupSize) {
        cached_ranks[s] = knorm_rank_of(stored, s);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      stored.cached = true;
    }
    KnormEvictRanks ranks = {stored};
    ev.cut = knorm_radix_select<ulong, kEvictGroupSize>(
        ranks, 0u, filled, kept, histogram, simd_totals, picked, tid, lane, simd_group);
  }

  // Step 2.
  if (temporal != 0) {
    knorm_compact_temporal(stored, ev, b, first_list, simd_totals, tid, lane, simd_group);
  } else {
    // Outputs not updated in place start as a copy of the rows below kept.
    if ((in_place & 1u) == 0) {
      knorm_copy_bits(b.keys, b.out_keys, ulong(kept) * key_dim, key_unit, tid, kEvictGroupSize);
    }
    if ((in_place & 2u) == 0) {
      knorm_copy_bits(b.values, b.out_values, ulong(kept) * value_dim, value_unit, tid,
                      kEvictGroupSize);
    }
    if ((in_place & 4u) == 0) {
      knorm_copy_bits(b.norms, b.out_norms, ulong(kept), uint(sizeof(float)), tid,
                      kEvictGroupSize);
    }
    if ((in_place & 8u) == 0) {
      knorm_copy_bits(b.positions, b.out_positions, ulong(kept), uint(sizeof(int)), tid,
                      kEvictGroupSize);
    }
    // The holes among those rows are overwritten below, by other threads.
    threadgroup_barrier(mem_flags::mem_device);
    if (ev.mode == kEvictOne) {
      // The spare slot's row fills the hole; nothing moves when it is the
      // one evicted.
      if (ev.evicted < kept && simd_group == 0) {
        knorm_move_row(b, kept, ev.evicted, lane);
      }
    } else if (ev.mode == kEvictMany) {
      knorm_fill_holes(stored, ev, b, first_list, second_list, simd_totals, tid, lane, simd_group);
    }
  }
  // The new rows may overwrite the sources of moved rows (in place).
  threadgroup_barrier(mem_flags::mem_device);

  // Step 3, unless knorm_fill_new_rows does it.
  if (fill_new != 0) {
    const ulong new_row = ulong(head) * n_new;
    knorm_fill_rows(new_keys + new_row * key_dim, new_values + new_row * value_dim, b.out_keys,
                    b.out_values, b.out_norms, b.out_positions, key_dim, value_dim, key_unit,
                    value_unit, kept, offset, 0u, n_new, lane, simd_group);
  }
}

// Step 3 of a cache step whose steps 1-2 ran before (knorm_evict_and_fill
// with fill_new = 0): threadgroup g writes new rows [b * kSplitRows, +
// kSplitRows) of head g / groups_per_head, b = g % groups_per_head.
template <typename K, typename V>
[[kernel]] void knorm_fill_new_rows(
    device const K* new_keys KNORM_BUFFER(0),
    device const V* new_values KNORM_BUFFER(1),
    device K* out_keys KNORM_BUFFER(2),
    device V* out_values KNORM_BUFFER(3),
    device float* out_norms KNORM_BUFFER(4),
    device int* out_positions KNORM_BUFFER(5),
    constant uint& out_slots KNORM_BUFFER(6),
    constant uint& n_new KNORM_BUFFER(7),
    constant uint& key_dim KNORM_BUFFER(8),
    constant uint& value_dim KNORM_BUFFER(9),
    constant uint& kept KNORM_BUFFER(10),
    constant uint& offset KNORM_BUFFER(11),
    constant uint& key_unit KNORM_BUFFER(12),
    constant uint& value_unit KNORM_BUFFER(13),
    constant uint& groups_per_head KNORM_BUFFER(14),
    uint group KNORM_ATTRIBUTE(threadgroup_position_in_grid),
    uint lane KNORM_ATTRIBUTE(thread_index_in_simdgroup),
    uint simd_group KNORM_ATTRIBUTE(simdgroup_index_in_threadgroup)) {
  const uint head = group / groups_per_head;
  const uint begin = (group % groups_per_head) * kSplitRows;
  // begin < n_new; begin + kSplitRows may not fit in a uint.
  const uint end = n_new - begin > kSplitRows ? begin + kSplitRows : n_new;
  const ulong new_row = ulong(head) * n_new;
  const ulong out_row = ulong(head) * out_slots;
  knorm_fill_rows(new_keys + new_row * key_dim, new_values + new_row * value_dim,
                  out_keys + out_row * key_dim, out_values + out_row * value_dim,
                  out_norms + out_row, out_positions + out_row, key_dim, value_dim, key_unit,
                  value_unit, kept, offset, begin, end, lane, simd_group);
}

#endif // MLX_KNORM_METAL_EVICT_AND_FILL_H
