// EvictAndFill on the GPU: one cache step of docs/spec.md section 4 for
// every head, one threadgroup of kEvictGroupSize threads per head:
//   rank        per head from its valid range (padding rows last) or, without
//               ranges, every row real (knorm_evict_head);
//   selection   nothing leaves (filled <= budget); one row leaves (a decode
//               step): SIMD-group and threadgroup reductions of the 64-bit
//               rank; several leave: the radix select of knorm_kernels.h,
//               on ranks kept in threadgroup memory where they fit;
//   compaction  slot layout: the kept rows at or past `kept` fill the holes
//               below it, both in slot order; temporal layout: a stable
//               compaction, chunk by chunk; every payload, the norms and
//               the positions alike;
//   fill        the new rows with their norms (given, or knorm_row_norm of
//               the first payload) and positions.
// With few heads and many new rows, the launch plan leaves the fill to a
// second dispatch, knorm_fill_new_rows, which spreads the new rows of each
// head over threadgroups of kSplitRows rows (fill_new = 0 here), and drops
// this one where it would do nothing: no stored rows, or none leaving with
// every output in place. Likewise, with few heads and many kept rows, the
// slot layout's copy of slots [0, kept) into outputs not updated in place
// runs before, in knorm_copy_kept_rows over threadgroups of kSplitRows
// rows (kept_copied = 1 here).
// Payloads are raw bytes (uchar), up to kEvictMaxPayloads of them at fixed
// [[buffer(i)]], each moving in the units of knorm_copy_bytes that the
// launch plan chose for it (KnormEvictParams); slots of payloads past the
// step's count are bound to placeholders and never read. An output bound to
// its input's buffer (a bit of in_place) is updated in place: only the rows
// that move are written. The temporal compaction then moves rows in waves
// (every thread reads its share of a wave into registers, a barrier, then
// all write), so that no row is overwritten before it is read. All offsets
// into payload buffers are 64-bit.
//
// Instantiated in evict_and_fill.metal, once per source of the new rows'
// norms (the first payload's float type, or KnormGivenNorms); launched by
// the plans of csrc/evict_and_fill/plan.cpp. Compiles as Metal Shading
// Language and, through csrc/metal_emulator/metal_emulator.h, as C++.
#ifndef MLX_KNORM_METAL_EVICT_AND_FILL_H
#define MLX_KNORM_METAL_EVICT_AND_FILL_H

#include "knorm_kernels.h"

constant constexpr uint kEvictSimdGroups = kEvictGroupSize / kSimdWidth;

// How many rows leave.
constant constexpr uint kKeepAll = 0;
constant constexpr uint kEvictOne = 1;
constant constexpr uint kEvictMany = 2;

// One head's stored rows and its rank rule (docs/spec.md section 4 steps
// 0-1).
struct KnormEvictHead {
  uint filled;
  uint kept;
  int first_real;    // real rows: first_real <= p <= last_real
  int last_real;
  int sink_end;      // real positions below are protected
  int protect_from;  // real positions at or above are protected
  bool keep_high;
  device const uint* norms;  // float32 bits
  device const int* positions;
  bool cached;  // the ranks of slots [0, filled) are in cached_ranks
  threadgroup const ulong* cached_ranks;
};

inline int knorm_clamp_to_int(long v) {
  const long lowest = long(as_type<int>(0x80000000u));
  const long highest = long(0x7FFFFFFF);
  return int(v < lowest ? lowest : (v > highest ? highest : v));
}

// The rank rule of one head, as EvictionRank::of of common/selection.h:
// without valid ranges every row is real, the sinks are the positions below
// n_sink and the window starts at offset - recent; with (lo, hi) the real
// rows are [lo, hi), the sinks [lo, lo + n_sink) and the window starts at
// min(offset, hi) - recent. Bounds past int are clamped, which changes no
// real row's protection. `offset`: the step's (params.offset), or the next
// step's for the order tree.
inline KnormEvictHead knorm_evict_head(
    constant KnormEvictParams& params,
    device const int* valid,
    uint head,
    device const float* norms,
    device const int* positions,
    threadgroup const ulong* cached_ranks,
    long offset) {
  KnormEvictHead h;
  h.filled = params.filled;
  h.kept = params.kept;
  h.keep_high = params.keep_high != 0;
  h.norms = (device const uint*)norms;
  h.positions = positions;
  h.cached = false;
  h.cached_ranks = cached_ranks;
  const long recent = long(params.recent);
  if (params.has_valid == 0) {
    h.first_real = as_type<int>(0x80000000u);
    h.last_real = 0x7FFFFFFF;
    h.sink_end = int(params.n_sink);
    h.protect_from = knorm_clamp_to_int(offset - recent);
    return h;
  }
  const long lo = long(valid[2 * ulong(head)]);
  const long hi = long(valid[2 * ulong(head) + 1]);
  // No real row when hi <= lo.
  h.first_real = hi > lo ? int(lo) : 0x7FFFFFFF;
  h.last_real = hi > lo ? int(hi - 1) : as_type<int>(0x80000000u);
  h.sink_end = knorm_clamp_to_int(lo + long(params.n_sink));
  h.protect_from = knorm_clamp_to_int((offset < hi ? offset : hi) - recent);
  return h;
}

// docs/spec.md section 4 step 1 as one 64-bit key: the score key, 0 for a
// protected row (no score key is 0) or kPaddingScoreKey for a padding row
// (every score key is below it), then the position. Equal keys rank by
// slot, lower first.
inline ulong knorm_rank_of(KnormEvictHead stored, uint s) {
  const int p = stored.positions[s];
  uint score = kPaddingScoreKey;
  if (p >= stored.first_real && p <= stored.last_real) {
    const bool protect = p < stored.sink_end || p >= stored.protect_from;
    score = protect ? 0u : knorm_score_key(stored.norms[s], stored.keep_high);
  }
  return (ulong(score) << 32) | ulong(as_type<uint>(p) ^ 0x80000000u);
}

inline ulong knorm_eviction_rank(KnormEvictHead stored, uint s) {
  return stored.cached ? stored.cached_ranks[s] : knorm_rank_of(stored, s);
}

// The ranks of a head's rows, for knorm_radix_select.
struct KnormEvictRanks {
  KnormEvictHead stored;

  ulong operator()(uint s) const thread {
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
// msl-uniform: every thread reduces the same leaders' rows, read after the
// barrier.
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

// One head's rows of the stored buffers and of the outputs: the payloads
// (raw bytes), norms and positions. Bit i of in_place: output i (payload i,
// then the norms at bit `payloads`, the positions after) is input i's
// buffer.
struct KnormEvictBuffers {
  device const uchar* rows[kEvictMaxPayloads];
  device uchar* out_rows[kEvictMaxPayloads];
  device const float* norms;
  device const int* positions;
  device float* out_norms;
  device int* out_positions;
  uint payloads;
  uint row_bytes[kEvictMaxPayloads];
  uint row_unit[kEvictMaxPayloads];
  uint in_place;

  bool payload_in_place(uint i) const thread {
    return ((in_place >> i) & 1u) != 0;
  }
  bool norms_in_place() const thread {
    return ((in_place >> payloads) & 1u) != 0;
  }
  bool positions_in_place() const thread {
    return ((in_place >> (payloads + 1)) & 1u) != 0;
  }
  bool all_in_place() const thread {
    return in_place == (1u << (payloads + 2)) - 1u;
  }
};

// Slots [begin, end) of every input whose output is not updated in place,
// to the same slots of its output, by the kEvictGroupSize threads of a
// threadgroup; the bits move as they are.
inline void knorm_copy_kept_slots(KnormEvictBuffers b, uint begin, uint end, uint tid) {
  const ulong rows = end - begin;
  for (uint i = 0; i < kEvictMaxPayloads; ++i) {
    if (i < b.payloads && !b.payload_in_place(i)) {
      const ulong bytes = b.row_bytes[i];
      knorm_copy_bytes(b.rows[i] + begin * bytes, b.out_rows[i] + begin * bytes, rows * bytes,
                       b.row_unit[i], tid, kEvictGroupSize);
    }
  }
  if (!b.norms_in_place()) {
    knorm_copy_bits(b.norms + begin, b.out_norms + begin, rows, uint(sizeof(float)), tid,
                    kEvictGroupSize);
  }
  if (!b.positions_in_place()) {
    knorm_copy_bits(b.positions + begin, b.out_positions + begin, rows, uint(sizeof(int)), tid,
                    kEvictGroupSize);
  }
}

// Slot src's norm and position to slot dst of the outputs, by one thread.
// Norms move as bits (docs/spec.md section 5): a signalling NaN stays one.
inline void knorm_move_norm_and_position(KnormEvictBuffers b, uint src, uint dst) {
  ((device uint*)b.out_norms)[dst] = ((device const uint*)b.norms)[src];
  b.out_positions[dst] = b.positions[src];
}

// Row src of every input to row dst of its output, by the lanes of one SIMD
// group; the bits move as they are.
inline void knorm_move_row(KnormEvictBuffers b, uint src, uint dst, uint lane) {
  for (uint i = 0; i < kEvictMaxPayloads; ++i) {
    if (i < b.payloads) {
      const ulong bytes = b.row_bytes[i];
      knorm_copy_bytes(b.rows[i] + src * bytes, b.out_rows[i] + dst * bytes, b.row_bytes[i],
                       b.row_unit[i], lane, kSimdWidth);
    }
  }
  if (lane == 0) {
    knorm_move_norm_and_position(b, src, dst);
  }
}

// Rows movers[m] -> holes[h] of every input to its output, for the `pairs`
// queue entries from mover_head and hole_head on, by the whole threadgroup:
// the SIMD groups take pairs in turn, each payload's rows several at once
// where they are narrower than the lanes (knorm_row_lanes); norms and
// positions one pair a thread. Holes and movers are distinct slots, so the
// pairs move in any order; the bits move as they are.
inline void knorm_move_pairs(
    KnormEvictBuffers b,
    threadgroup const uint* movers,
    uint mover_head,
    threadgroup const uint* holes,
    uint hole_head,
    uint pairs,
    uint tid,
    uint lane,
    uint simd_group) {
  for (uint i = 0; i < kEvictMaxPayloads; ++i) {
    if (i < b.payloads) {
      const ulong bytes = b.row_bytes[i];
      const KnormRowLanes lanes = knorm_row_lanes(b.row_bytes[i] / b.row_unit[i], lane);
      const uint stride = kEvictSimdGroups * lanes.rows;
      for (uint p = simd_group * lanes.rows + lanes.row; lanes.row < lanes.rows && p < pairs;
           p += stride) {
        const uint src = movers[(mover_head + p) % kEvictQueue];
        const uint dst = holes[(hole_head + p) % kEvictQueue];
        knorm_copy_bytes(b.rows[i] + src * bytes, b.out_rows[i] + dst * bytes, b.row_bytes[i],
                         b.row_unit[i], lanes.first, lanes.stride);
      }
    }
  }
  for (uint p = tid; p < pairs; p += kEvictGroupSize) {
    const uint src = movers[(mover_head + p) % kEvictQueue];
    const uint dst = holes[(hole_head + p) % kEvictQueue];
    knorm_move_norm_and_position(b, src, dst);
  }
}

// A step's payload buffers as kernel parameters name_0 .. name_5 of `type`
// at the [[buffer(i)]] given (written out: the attribute takes a literal),
// and as the initialiser of the arrays of KnormEvictBuffers and
// KnormFillBuffers.
#define KNORM_PAYLOAD_PARAMETERS(type, name, i0, i1, i2, i3, i4, i5) \
  type name##_0 KNORM_BUFFER(i0), type name##_1 KNORM_BUFFER(i1),    \
      type name##_2 KNORM_BUFFER(i2), type name##_3 KNORM_BUFFER(i3), \
      type name##_4 KNORM_BUFFER(i4), type name##_5 KNORM_BUFFER(i5)
#define KNORM_PAYLOADS(name) {name##_0, name##_1, name##_2, name##_3, name##_4, name##_5}
static_assert(kEvictMaxPayloads == 6, "KNORM_PAYLOAD_PARAMETERS names six payloads");

// The buffers of head `head`, from those of the whole batch (`batch`: the
// bindings, as bound) and the step's constants. An input updated in place
// is read through its output's pointer: the compiler may take a `device
// const` argument for read-only memory that the dispatch does not write.
// The same for the payloads alone (a kernel that binds no norms or
// positions, or no output rows, leaves them null).
inline KnormEvictBuffers knorm_evict_payloads_of_head(
    constant KnormEvictParams& params,
    uint head,
    KnormEvictBuffers batch) {
  const ulong in_row = ulong(head) * params.slots;
  const ulong out_row = ulong(head) * params.out_slots;
  KnormEvictBuffers b = batch;
  b.payloads = params.payloads;
  b.in_place = params.in_place;
  for (uint i = 0; i < kEvictMaxPayloads; ++i) {
    b.row_bytes[i] = params.row_bytes[i];
    b.row_unit[i] = params.row_unit[i];
    if (i < params.payloads) {
      b.rows[i] += in_row * params.row_bytes[i];
      if (b.out_rows[i] != nullptr) {
        b.out_rows[i] += out_row * params.row_bytes[i];
        if (b.payload_in_place(i)) {
          b.rows[i] = b.out_rows[i];
        }
      }
    }
  }
  return b;
}

inline KnormEvictBuffers knorm_evict_buffers_of_head(
    constant KnormEvictParams& params,
    uint head,
    KnormEvictBuffers batch) {
  const ulong in_row = ulong(head) * params.slots;
  const ulong out_row = ulong(head) * params.out_slots;
  KnormEvictBuffers b = knorm_evict_payloads_of_head(params, head, batch);
  b.out_norms = batch.out_norms + out_row;
  b.out_positions = batch.out_positions + out_row;
  b.norms = b.norms_in_place() ? b.out_norms : batch.norms + in_row;
  b.positions = b.positions_in_place() ? b.out_positions : batch.positions + in_row;
  return b;
}

// The temporal layout: kept slots, in slot order, to [0, kept), one chunk
// of kEvictGroupSize slots at a time. src holds a chunk's kept slots, which
// go to kept_before onwards. Unless null, `sources` (kept entries) gets
// each output slot's source slot, for the payloads' wide compaction.
inline void knorm_compact_temporal(
    KnormEvictHead stored,
    KnormEviction ev,
    KnormEvictBuffers b,
    bool move_payloads,
    device uint* sources,
    threadgroup uint* src,
    threadgroup uint* simd_totals,
    uint tid,
    uint lane,
    uint simd_group) {
  // With every output it writes in place, rows before the one evicted slot
  // stay: a decode step starts at its chunk.
  uint base = 0;
  const bool written_in_place = move_payloads
      ? b.all_in_place()
      : b.norms_in_place() && b.positions_in_place();
  if (ev.mode == kEvictOne && written_in_place) {
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
      if (sources != nullptr) {
        sources[kept_before + at.exclusive] = s;
      }
    }
    // Its barriers also make the list visible to the whole group.
    const bool moves = keep && kept_before + at.exclusive != s;
    const bool any_moves = knorm_block_scan<kEvictGroupSize>(
        moves ? 1u : 0u, simd_totals, lane, simd_group).total != 0;
    const uint n = at.total;
    for (uint i = 0; i < kEvictMaxPayloads; ++i) {
      if (move_payloads && i < b.payloads && (!b.payload_in_place(i) || any_moves)) {
        knorm_move_byte_rows<kEvictGroupSize>(b.rows[i], b.out_rows[i], b.payload_in_place(i), src,
                                              kept_before, n, b.row_bytes[i], b.row_unit[i], tid);
      }
    }
    if (!b.norms_in_place() || any_moves) {
      knorm_move_rows<kEvictGroupSize>((device const uint*)b.norms, (device uint*)b.out_norms,
                                       b.norms_in_place(), src, kept_before, n, 1u, tid);
    }
    if (!b.positions_in_place() || any_moves) {
      knorm_move_rows<kEvictGroupSize>(b.positions, b.out_positions, b.positions_in_place(), src,
                                       kept_before, n, 1u, tid);
    }
    kept_before += n;
    // The list is read before the next chunk writes it.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

// The scratch buffer of the temporal layout's wide compaction
// (compact_groups_per_head != 0), as csrc/evict_and_fill/plan.cpp lays it
// out: each head's kept source slots (N x kept uints), then from
// scratch_units[i] on, for payload i when it is compacted in place, a
// staged copy of its rows that move, at their destination slots (N x kept
// rows).
inline device uint* knorm_compaction_sources(
    constant KnormEvictParams& params,
    device uchar* scratch,
    uint head) {
  return (device uint*)scratch + ulong(head) * params.kept;
}

inline device uchar* knorm_compaction_staged(
    constant KnormEvictParams& params,
    device uchar* scratch,
    uint payload,
    uint head) {
  return scratch + ulong(params.scratch_units[payload]) * kRowUnitWide +
      ulong(head) * params.kept * params.row_bytes[payload];
}

// The slots [begin, end) below kept of head `head` that threadgroup
// `group` of a dispatch over groups_per_head threadgroups per head takes
// (knorm_copy_kept_rows, knorm_shift_kept_rows, knorm_compact_kept_rows):
// kSplitRows of them from b kSplitRows, b = group % groups_per_head.
struct KnormKeptBlock {
  uint head;
  uint begin;
  uint end;
};

inline KnormKeptBlock knorm_kept_block(uint kept, uint group, uint groups_per_head) {
  KnormKeptBlock block;
  block.head = group / groups_per_head;
  block.begin = (group % groups_per_head) * kSplitRows;
  // begin < kept; begin + kSplitRows may not fit in a uint.
  block.end = kept - block.begin > kSplitRows ? block.begin + kSplitRows : kept;
  return block;
}

// A block of the wide compaction: output slots [begin, end) of its head,
// their sources in src, and `first`, the first of them that moves. Sources
// increase and lie at or past their slots, so the slots that stay form a
// prefix of [0, kept) (they are the same in every block of a head).
struct KnormCompactionBlock {
  uint head;
  uint begin;
  uint end;
  uint first;
};

// Reads the sources of threadgroup `group`'s block into src (kSplitRows
// entries) and finds its first slot that moves. Every thread calls it.
template <uint kGroupSize>
inline KnormCompactionBlock knorm_compaction_block(
    constant KnormEvictParams& params,
    device uchar* scratch,
    threadgroup uint* src,
    threadgroup uint* simd_totals,
    uint group,
    uint tid,
    uint lane,
    uint simd_group) {
  const KnormKeptBlock slots =
      knorm_kept_block(params.kept, group, params.compact_groups_per_head);
  KnormCompactionBlock block = {slots.head, slots.begin, slots.end, 0u};
  const device uint* sources = knorm_compaction_sources(params, scratch, block.head);
  const uint n = block.end - block.begin;
  bool stays = false;
  if (tid < n) {
    src[tid] = sources[block.begin + tid];
    stays = src[tid] == block.begin + tid;
  }
  // Its barriers also make src visible to the whole group.
  block.first = block.begin +
      knorm_block_scan<kGroupSize>(stays ? 1u : 0u, simd_totals, lane, simd_group).total;
  return block;
}

// The scratch buffer of the temporal layout's wide decode step
// (shift_groups_per_head != 0), as csrc/evict_and_fill/plan.cpp lays it
// out: the evicted slot of each head (N uints), then from
// scratch_units[i] on the rows of payload i that a block of
// knorm_shift_kept_rows reads past its own, head-major: block g of a head
// moves slots [g kSplitRows, (g + 1) kSplitRows), and its last row's
// source, slot (g + 1) kSplitRows, is the next block's first destination,
// which that block may overwrite first.
// The row in the scratch buffer of payload i's block g of head `head`.
inline device uchar* knorm_shift_boundary(
    constant KnormEvictParams& params,
    device uchar* scratch,
    uint payload,
    uint head,
    uint g) {
  const ulong block = ulong(head) * params.shift_groups_per_head + g;
  return scratch + ulong(params.scratch_units[payload]) * kRowUnitWide +
      block * params.row_bytes[payload];
}

// Before the wide shift: the evicted slot, and the rows the blocks past it
// read from the scratch buffer (those of the payloads shifted in place).
inline void knorm_stage_shift(
    constant KnormEvictParams& params,
    KnormEvictBuffers b,
    device uchar* scratch,
    uint head,
    uint evicted,
    uint tid) {
  if (tid == 0) {
    ((device uint*)scratch)[head] = evicted;
  }
  for (uint i = 0; i < kEvictMaxPayloads; ++i) {
    if (i >= b.payloads || !b.payload_in_place(i)) {
      continue;
    }
    // Block g's boundary slot (g + 1) kSplitRows, when it lies past the
    // evicted slot and below kept: g from evicted / kSplitRows on.
    for (uint g = evicted / kSplitRows; g + 1 < params.shift_groups_per_head; ++g) {
      const uint boundary = (g + 1) * kSplitRows;
      knorm_copy_bytes(b.rows[i] + ulong(boundary) * b.row_bytes[i],
                       knorm_shift_boundary(params, scratch, i, head, g), b.row_bytes[i],
                       b.row_unit[i], tid, kEvictGroupSize);
    }
  }
}

// The slot layout with several rows leaving: the holes (evicted slots below
// kept) and the movers (kept slots at or past kept) are found chunk by
// chunk in slot order, each into a ring queue, and the i-th mover moves
// into the i-th hole. Holes are written only after every scan has passed
// them, and movers are never written, so the scans read the rows as they
// were. The loop's bound is uniform: each round scans a chunk of holes or
// movers, or empties a queue that a later round refills, so it ends within
// twice the chunks plus two; a slip in that argument makes a wrong result
// the tests see, not a hang.
inline void knorm_fill_holes(
    KnormEvictHead stored,
    KnormEviction ev,
    KnormEvictBuffers b,
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
  const uint chunks = (stored.kept + kEvictGroupSize - 1) / kEvictGroupSize +
      (stored.filled - stored.kept + kEvictGroupSize - 1) / kEvictGroupSize;
  for (uint pass = 0; pass < 2 * chunks + 2; ++pass) {
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
    knorm_move_pairs(b, movers, mover_head, holes, hole_head, pairs, tid, lane, simd_group);
    hole_head += pairs;
    mover_head += pairs;
    // The entries are read before they are reused.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

// The new rows' norms come from the first payload, read as K (float16,
// bfloat16 or float32: knorm_row_norm), or are given: KnormGivenNorms.
struct KnormGivenNorms {};

// A new row's norm as float32 bits: computed from its key with kPerLane
// squares per lane (the launch plan's count for D, as the key-norm
// kernel's), or given (moved as bits, docs/spec.md section 5).
template <typename K, uint kPerLane>
struct KnormNewNorm {
  static uint of(device const uchar* key, uint key_bytes, device const float*, uint, uint lane) {
    return as_type<uint>(knorm_row_norm<kPerLane>(
        reinterpret_cast<device const K*>(key), key_bytes / uint(sizeof(K)), lane));
  }
};

template <uint kPerLane>
struct KnormNewNorm<KnormGivenNorms, kPerLane> {
  static uint of(device const uchar*, uint, device const float* given, uint j, uint) {
    return ((device const uint*)given)[j];
  }
};

// One head's new rows and where they go: the outputs start at the head's
// slots, new_rows and new_norms at its new rows.
struct KnormFillBuffers {
  device const uchar* new_rows[kEvictMaxPayloads];
  device const float* new_norms;
  device uchar* out_rows[kEvictMaxPayloads];
  device float* out_norms;
  device int* out_positions;
};

// Step 3 for new rows [begin, end) of one head: one SIMD group per row, its
// payloads' bits, its norm and its position; row j goes to slot kept + j.
template <typename K, uint kPerLane>
inline void knorm_fill_rows(
    constant KnormEvictParams& params,
    KnormFillBuffers f,
    uint begin,
    uint end,
    uint lane,
    uint simd_group) {
  for (uint j = begin + simd_group; j < end; j += kEvictSimdGroups) {
    const uint dst = params.kept + j;
    for (uint i = 0; i < kEvictMaxPayloads; ++i) {
      if (i < params.payloads) {
        const ulong bytes = params.row_bytes[i];
        knorm_copy_bytes(f.new_rows[i] + j * bytes, f.out_rows[i] + dst * bytes,
                         params.row_bytes[i], params.row_unit[i], lane, kSimdWidth);
      }
    }
    const uint norm = KnormNewNorm<K, kPerLane>::of(
        f.new_rows[0] + j * ulong(params.row_bytes[0]), params.row_bytes[0], f.new_norms, j, lane);
    if (lane == 0) {
      ((device uint*)f.out_norms)[dst] = norm;
      f.out_positions[dst] = int(params.offset + j);
    }
  }
}

// The fill's buffers of one head: `base` at the start of each buffer, the
// head's new rows starting at row new_row, its output slots at out_row.
inline KnormFillBuffers knorm_fill_buffers_at(
    constant KnormEvictParams& params,
    KnormFillBuffers base,
    ulong new_row,
    ulong out_row) {
  KnormFillBuffers f = base;
  for (uint i = 0; i < kEvictMaxPayloads; ++i) {
    if (i < params.payloads) {
      f.new_rows[i] = base.new_rows[i] + new_row * params.row_bytes[i];
      f.out_rows[i] = base.out_rows[i] + out_row * params.row_bytes[i];
    }
  }
  if (params.norms_given != 0) {
    f.new_norms = base.new_norms + new_row;
  }
  f.out_norms = base.out_norms + out_row;
  f.out_positions = base.out_positions + out_row;
  return f;
}

// The new rows' norms from K with kPerLane squares per lane (1 for given
// norms). cached_ranks and lists are sized by the launch plan for this
// dispatch: the ranks of slots [0, filled) where cache_ranks is set, and
// the queues of the slot layout's pairing (2 kEvictQueue entries) when
// several rows leave, or a temporal chunk's kept slots (kEvictGroupSize).
template <typename K, uint kPerLane>
[[kernel, max_total_threads_per_threadgroup(kEvictGroupSize)]] void knorm_evict_and_fill(
    KNORM_PAYLOAD_PARAMETERS(device const uchar*, rows, 0, 1, 2, 3, 4, 5),
    device const float* norms KNORM_BUFFER(6),
    device const int* positions KNORM_BUFFER(7),
    KNORM_PAYLOAD_PARAMETERS(device const uchar*, new_rows, 8, 9, 10, 11, 12, 13),
    device const float* new_norms KNORM_BUFFER(14),
    device const int* valid KNORM_BUFFER(15),
    KNORM_PAYLOAD_PARAMETERS(device uchar*, out_rows, 16, 17, 18, 19, 20, 21),
    device float* out_norms KNORM_BUFFER(22),
    device int* out_positions KNORM_BUFFER(23),
    constant KnormEvictParams& params KNORM_BUFFER(24),
    device uchar* scratch KNORM_BUFFER(25),
    threadgroup ulong* cached_ranks KNORM_THREADGROUP_BUFFER(0),
    threadgroup uint* lists KNORM_THREADGROUP_BUFFER(1),
    uint head KNORM_ATTRIBUTE(threadgroup_position_in_grid),
    uint tid KNORM_ATTRIBUTE(thread_position_in_threadgroup),
    uint lane KNORM_ATTRIBUTE(thread_index_in_simdgroup),
    uint simd_group KNORM_ATTRIBUTE(simdgroup_index_in_threadgroup)) {
  KNORM_THREADGROUP_ARRAY(atomic_uint, histogram, kRadixBins);
  KNORM_THREADGROUP_ARRAY(uint, simd_totals, kEvictSimdGroups);
  KNORM_THREADGROUP_ARRAY(uint, picked, 3);
  KNORM_THREADGROUP_ARRAY(uint, worst, 3 * kEvictSimdGroups);

  const uint filled = params.filled;
  const uint kept = params.kept;
  const ulong out_row = ulong(head) * params.out_slots;
  const KnormEvictBuffers batch = {
      KNORM_PAYLOADS(rows),
      KNORM_PAYLOADS(out_rows),
      norms, positions, out_norms, out_positions, 0u, {}, {}, 0u};
  const KnormEvictBuffers b = knorm_evict_buffers_of_head(params, head, batch);
  KnormEvictHead stored = knorm_evict_head(
      params, valid, head, b.norms, b.positions, cached_ranks, long(params.offset));

  // docs/spec.md section 4 step 1.
  KnormEviction ev = {kKeepAll, 0u, {ulong(0), 0u, 0u}};
  if (filled == kept + 1) {
    ev.mode = kEvictOne;
    ev.evicted = knorm_worst_slot(stored, worst, tid, lane, simd_group);
  } else if (filled > kept) {
    ev.mode = kEvictMany;
    // Read before any row moves, so the scans below see the ranks as they
    // were even where the outputs are the inputs.
    if (params.cache_ranks != 0) {
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
  if (params.temporal != 0) {
    // With kept_copied nothing leaves, and the copy was the whole compaction.
    // With shift_groups_per_head, knorm_shift_kept_rows moves the payloads.
    // With compact_groups_per_head, knorm_stage_compaction and
    // knorm_compact_kept_rows move them, from the sources noted here.
    const bool shifts_wide = params.shift_groups_per_head != 0;
    const bool compacts_wide = params.compact_groups_per_head != 0;
    if (shifts_wide) {
      knorm_stage_shift(params, b, scratch, head, ev.evicted, tid);
    }
    if (params.kept_copied == 0) {
      device uint* sources = compacts_wide ? knorm_compaction_sources(params, scratch, head)
                                           : nullptr;
      knorm_compact_temporal(stored, ev, b, !shifts_wide && !compacts_wide, sources, lists,
                             simd_totals, tid, lane, simd_group);
    }
  } else {
    // Outputs not updated in place start as a copy of the rows below kept,
    // unless knorm_copy_kept_rows made it.
    if (params.kept_copied == 0) {
      knorm_copy_kept_slots(b, 0u, kept, tid);
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
      // The holes' queue, then the movers'.
      knorm_fill_holes(stored, ev, b, lists, lists + kEvictQueue, simd_totals, tid, lane,
                       simd_group);
    }
  }
  // The new rows may overwrite the sources of moved rows (in place).
  threadgroup_barrier(mem_flags::mem_device);

  // Step 3, unless knorm_fill_new_rows does it.
  if (params.fill_new != 0) {
    const KnormFillBuffers base = {
        KNORM_PAYLOADS(new_rows),
        new_norms,
        KNORM_PAYLOADS(out_rows),
        out_norms,
        out_positions};
    knorm_fill_rows<K, kPerLane>(
        params, knorm_fill_buffers_at(params, base, ulong(head) * params.n_new, out_row), 0u,
        params.n_new, lane, simd_group);
  }
}

// Slots [0, kept) of every output not updated in place, from its input, in
// a dispatch of its own before knorm_evict_and_fill (kept_copied = 1):
// threadgroup g copies slots [b * kSplitRows, + kSplitRows) of head
// g / copy_groups_per_head, b = g % copy_groups_per_head. A step whose
// outputs are fresh buffers (not donated, or of another capacity) then
// moves its bulk over many threadgroups, not one per head. A template, on
// the group size, only so that it instantiates like the others.
template <uint kGroupSize>
[[kernel, max_total_threads_per_threadgroup(kGroupSize)]] void knorm_copy_kept_rows(
    KNORM_PAYLOAD_PARAMETERS(device const uchar*, rows, 0, 1, 2, 3, 4, 5),
    device const float* norms KNORM_BUFFER(6),
    device const int* positions KNORM_BUFFER(7),
    KNORM_PAYLOAD_PARAMETERS(device uchar*, out_rows, 8, 9, 10, 11, 12, 13),
    device float* out_norms KNORM_BUFFER(14),
    device int* out_positions KNORM_BUFFER(15),
    constant KnormEvictParams& params KNORM_BUFFER(16),
    uint group KNORM_ATTRIBUTE(threadgroup_position_in_grid),
    uint tid KNORM_ATTRIBUTE(thread_position_in_threadgroup)) {
  static_assert(kGroupSize == kEvictGroupSize, "knorm_copy_kept_slots copies with kEvictGroupSize threads");
  const KnormKeptBlock block = knorm_kept_block(params.kept, group, params.copy_groups_per_head);
  const KnormEvictBuffers batch = {
      KNORM_PAYLOADS(rows),
      KNORM_PAYLOADS(out_rows),
      norms, positions, out_norms, out_positions, 0u, {}, {}, 0u};
  knorm_copy_kept_slots(knorm_evict_buffers_of_head(params, block.head, batch), block.begin,
                        block.end, tid);
}

// The payloads of the temporal layout's decode step, after
// knorm_evict_and_fill (shift_groups_per_head != 0) found the evicted slot
// e and kept the block boundaries in the scratch buffer: threadgroup g
// moves slots [b kSplitRows, + kSplitRows) below kept of head
// g / shift_groups_per_head, b = g % shift_groups_per_head, each from
// the slot one past it from e on. Into a separate output every slot of
// the block is written; in place only those from e on, the block's own
// rows in waves (knorm_move_rows) and its last from the scratch buffer
// (or from slot kept, which no block writes). A block then reads no slot
// another block writes, so the blocks run in any order.
template <uint kGroupSize>
[[kernel, max_total_threads_per_threadgroup(kGroupSize)]] void knorm_shift_kept_rows(
    KNORM_PAYLOAD_PARAMETERS(device const uchar*, rows, 0, 1, 2, 3, 4, 5),
    KNORM_PAYLOAD_PARAMETERS(device uchar*, out_rows, 6, 7, 8, 9, 10, 11),
    device uchar* scratch KNORM_BUFFER(12),
    constant KnormEvictParams& params KNORM_BUFFER(13),
    uint group KNORM_ATTRIBUTE(threadgroup_position_in_grid),
    uint tid KNORM_ATTRIBUTE(thread_position_in_threadgroup)) {
  static_assert(kGroupSize == kEvictGroupSize, "knorm_move_byte_rows runs with kEvictGroupSize threads");
  KNORM_THREADGROUP_ARRAY(uint, src, kSplitRows);
  const uint kept = params.kept;
  const KnormKeptBlock slots = knorm_kept_block(kept, group, params.shift_groups_per_head);
  const uint head = slots.head;
  const uint block = slots.begin / kSplitRows;
  const uint begin = slots.begin;
  const uint end = slots.end;
  const uint evicted = ((device const uint*)scratch)[head];
  const KnormEvictBuffers batch = {
      KNORM_PAYLOADS(rows),
      KNORM_PAYLOADS(out_rows),
      nullptr, nullptr, nullptr, nullptr, 0u, {}, {}, 0u};
  const KnormEvictBuffers b = knorm_evict_payloads_of_head(params, head, batch);
  for (uint i = 0; i < kEvictMaxPayloads; ++i) {
    if (i >= b.payloads) {
      continue;
    }
    const uint row_bytes = b.row_bytes[i];
    const uint unit = b.row_unit[i];
    const bool in_place = b.payload_in_place(i);
    // In place the rows below e stay, and the block's last row comes from
    // the scratch buffer unless its source is slot kept.
    const uint first = in_place && evicted > begin ? evicted : begin;
    if (first >= end) {
      continue;
    }
    const bool last_staged = in_place && end < kept;
    const uint moved = end - first - (last_staged ? 1u : 0u);
    for (uint p = tid; p < moved; p += kGroupSize) {
      const uint slot = first + p;
      src[p] = slot < evicted ? slot : slot + 1;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    knorm_move_byte_rows<kGroupSize>(b.rows[i], b.out_rows[i], in_place, src, first, moved,
                                     row_bytes, unit, tid);
    if (last_staged) {
      // After every read of the row it overwrites (the waves end with a
      // barrier on device memory).
      knorm_copy_bytes(knorm_shift_boundary(params, scratch, i, head, block),
                       b.out_rows[i] + ulong(end - 1) * row_bytes, row_bytes, unit, tid,
                       kGroupSize);
    }
    // The list is read before the next payload writes it.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

// The temporal layout's step with several rows leaving and few heads
// (compact_groups_per_head != 0), after knorm_evict_and_fill noted each
// head's sources (knorm_compaction_sources) and before
// knorm_compact_kept_rows: threadgroup g copies, of every payload
// compacted in place, the rows that move into slots [b kSplitRows, +
// kSplitRows) below kept of head g / compact_groups_per_head, b = g %
// compact_groups_per_head, to the scratch buffer. It writes no output, so
// its blocks read the rows as they were, in any order.
template <uint kGroupSize>
[[kernel, max_total_threads_per_threadgroup(kGroupSize)]] void knorm_stage_compaction(
    KNORM_PAYLOAD_PARAMETERS(device const uchar*, rows, 0, 1, 2, 3, 4, 5),
    device uchar* scratch KNORM_BUFFER(6),
    constant KnormEvictParams& params KNORM_BUFFER(7),
    uint group KNORM_ATTRIBUTE(threadgroup_position_in_grid),
    uint tid KNORM_ATTRIBUTE(thread_position_in_threadgroup),
    uint lane KNORM_ATTRIBUTE(thread_index_in_simdgroup),
    uint simd_group KNORM_ATTRIBUTE(simdgroup_index_in_threadgroup)) {
  static_assert(kGroupSize == kEvictGroupSize, "knorm_move_byte_rows runs with kEvictGroupSize threads");
  static_assert(kSplitRows <= kGroupSize, "a thread reads one source of a block");
  KNORM_THREADGROUP_ARRAY(uint, src, kSplitRows);
  KNORM_THREADGROUP_ARRAY(uint, simd_totals, kEvictSimdGroups);
  const KnormCompactionBlock block = knorm_compaction_block<kGroupSize>(
      params, scratch, src, simd_totals, group, tid, lane, simd_group);
  const KnormEvictBuffers batch = {
      KNORM_PAYLOADS(rows),
      {},
      nullptr, nullptr, nullptr, nullptr, 0u, {}, {}, 0u};
  const KnormEvictBuffers b = knorm_evict_payloads_of_head(params, block.head, batch);
  for (uint i = 0; i < kEvictMaxPayloads; ++i) {
    if (i < b.payloads && b.payload_in_place(i)) {
      knorm_move_byte_rows<kGroupSize>(
          b.rows[i], knorm_compaction_staged(params, scratch, i, block.head), false,
          src + (block.first - block.begin), block.first, block.end - block.first,
          b.row_bytes[i], b.row_unit[i], tid);
    }
  }
}

// The payloads of the temporal layout's step with several rows leaving and
// few heads, after knorm_stage_compaction: threadgroup g writes slots
// [b kSplitRows, + kSplitRows) below kept of head
// g / compact_groups_per_head, b = g % compact_groups_per_head, of every
// payload: in place its rows that move, from the scratch buffer; into a
// separate output every slot, from its source.
template <uint kGroupSize>
[[kernel, max_total_threads_per_threadgroup(kGroupSize)]] void knorm_compact_kept_rows(
    KNORM_PAYLOAD_PARAMETERS(device const uchar*, rows, 0, 1, 2, 3, 4, 5),
    KNORM_PAYLOAD_PARAMETERS(device uchar*, out_rows, 6, 7, 8, 9, 10, 11),
    device uchar* scratch KNORM_BUFFER(12),
    constant KnormEvictParams& params KNORM_BUFFER(13),
    uint group KNORM_ATTRIBUTE(threadgroup_position_in_grid),
    uint tid KNORM_ATTRIBUTE(thread_position_in_threadgroup),
    uint lane KNORM_ATTRIBUTE(thread_index_in_simdgroup),
    uint simd_group KNORM_ATTRIBUTE(simdgroup_index_in_threadgroup)) {
  static_assert(kGroupSize == kEvictGroupSize, "knorm_move_byte_rows runs with kEvictGroupSize threads");
  static_assert(kSplitRows <= kGroupSize, "a thread reads one source of a block");
  KNORM_THREADGROUP_ARRAY(uint, src, kSplitRows);
  KNORM_THREADGROUP_ARRAY(uint, simd_totals, kEvictSimdGroups);
  const KnormCompactionBlock block = knorm_compaction_block<kGroupSize>(
      params, scratch, src, simd_totals, group, tid, lane, simd_group);
  const KnormEvictBuffers batch = {
      KNORM_PAYLOADS(rows),
      KNORM_PAYLOADS(out_rows),
      nullptr, nullptr, nullptr, nullptr, 0u, {}, {}, 0u};
  const KnormEvictBuffers b = knorm_evict_payloads_of_head(params, block.head, batch);
  for (uint i = 0; i < kEvictMaxPayloads; ++i) {
    if (i >= b.payloads) {
      continue;
    }
    const ulong bytes = b.row_bytes[i];
    if (b.payload_in_place(i)) {
      const device uchar* staged = knorm_compaction_staged(params, scratch, i, block.head);
      knorm_copy_bytes(staged + block.first * bytes, b.out_rows[i] + block.first * bytes,
                       (block.end - block.first) * bytes, b.row_unit[i], tid, kGroupSize);
    } else {
      knorm_move_byte_rows<kGroupSize>(b.rows[i], b.out_rows[i], false, src, block.begin,
                                       block.end - block.begin, b.row_bytes[i], b.row_unit[i],
                                       tid);
    }
  }
}

// Step 3 of a cache step whose steps 1-2 ran before (knorm_evict_and_fill
// with fill_new = 0): threadgroup g writes new rows [b * kSplitRows, +
// kSplitRows) of head g / groups_per_head, b = g % groups_per_head.
template <typename K, uint kPerLane>
[[kernel, max_total_threads_per_threadgroup(kEvictGroupSize)]] void knorm_fill_new_rows(
    KNORM_PAYLOAD_PARAMETERS(device const uchar*, new_rows, 0, 1, 2, 3, 4, 5),
    device const float* new_norms KNORM_BUFFER(6),
    KNORM_PAYLOAD_PARAMETERS(device uchar*, out_rows, 7, 8, 9, 10, 11, 12),
    device float* out_norms KNORM_BUFFER(13),
    device int* out_positions KNORM_BUFFER(14),
    constant KnormEvictParams& params KNORM_BUFFER(15),
    uint group KNORM_ATTRIBUTE(threadgroup_position_in_grid),
    uint lane KNORM_ATTRIBUTE(thread_index_in_simdgroup),
    uint simd_group KNORM_ATTRIBUTE(simdgroup_index_in_threadgroup)) {
  const uint n_new = params.n_new;
  const uint head = group / params.groups_per_head;
  const uint begin = (group % params.groups_per_head) * kSplitRows;
  // begin < n_new; begin + kSplitRows may not fit in a uint.
  const uint end = n_new - begin > kSplitRows ? begin + kSplitRows : n_new;
  const KnormFillBuffers base = {
      KNORM_PAYLOADS(new_rows),
      new_norms,
      KNORM_PAYLOADS(out_rows),
      out_norms,
      out_positions};
  knorm_fill_rows<K, kPerLane>(
      params,
      knorm_fill_buffers_at(params, base, ulong(head) * n_new, ulong(head) * params.out_slots),
      begin, end, lane, simd_group);
}

#endif // MLX_KNORM_METAL_EVICT_AND_FILL_H
