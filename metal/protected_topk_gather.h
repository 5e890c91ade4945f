// ProtectedTopKGather on the GPU: one eviction step of docs/spec.md
// section 3 for every head, one threadgroup of kGatherGroupSize threads per
// head:
//   knorm_radix_select  the threshold among the middle rows (knorm_kernels.h);
//   knorm_compact       the kept rows' indices and norms, in temporal order;
//   knorm_copy_rows     their key and value rows.
// Rows are read straight from prior or new: the concatenation is never
// built. An output bound to its prior's buffer (a bit of in_place; then
// n_prior == kept) is compacted in place: its kept prior rows move down in
// the waves of knorm_move_rows (knorm_compact_in_place), rows already where
// they belong are not written, and the new rows follow. A head that evicts
// reads its norms five times (four radix passes and the compaction): from
// threadgroup memory when they fit there. All offsets into K/V buffers are
// 64-bit.
//
// With few heads and many rows to copy, one threadgroup per head would leave
// most of a GPU idle while the rows move, so the launch plan splits the step
// in two dispatches: knorm_protected_topk_gather with copy_rows = 0 selects
// (and compacts in place), then knorm_gather_rows copies the rows from the
// indices, kSplitRows output rows per threadgroup. Keys or values in place
// then move in three (stage_prior): the selection leaves them,
// knorm_stage_prior_rows copies their prior rows that move to a scratch
// buffer, and knorm_gather_rows writes them from there, since a block's
// sources may lie in any later block's rows.
//
// Instantiated in protected_topk_gather.metal; launched by the plans of
// csrc/protected_topk_gather/plan.cpp. Compiles as Metal Shading Language
// and, through csrc/metal_emulator/metal_emulator.h, as C++.
#ifndef MLX_KNORM_METAL_PROTECTED_TOPK_GATHER_H
#define MLX_KNORM_METAL_PROTECTED_TOPK_GATHER_H

#include "knorm_kernels.h"

constant constexpr uint kGatherSimdGroups = kGatherGroupSize / kSimdWidth;

// One head: where its rows are and the plan's selection constants, computed
// on the host from the shapes. Rows [0, sink_end) and [mid_end, n_total)
// are protected, and mid_keep middle rows are kept; without eviction the
// plan protects every row and sets mid_keep = 0.
struct KnormHead {
  uint index;  // n, the head's position in the batch
  uint n_prior;
  uint n_new;
  uint kept;
  uint sink_end;
  uint mid_end;
  uint mid_keep;
  bool keep_high;
  // This head's norms, as float32 bits (docs/spec.md section 5).
  device const uint* prior_norms;
  device const uint* new_norms;
  bool cached;  // the norms of rows [0, n_prior + n_new) are in cached_norms
  threadgroup const uint* cached_norms;
};

inline uint knorm_norm_bits_at(KnormHead head, uint j) {
  if (head.cached) {
    return head.cached_norms[j];
  }
  return j < head.n_prior ? head.prior_norms[j] : head.new_norms[j - head.n_prior];
}

// The order keys of a head's rows, for knorm_radix_select.
struct KnormGatherKeys {
  KnormHead head;

  uint operator()(uint j) const thread {
    return knorm_score_key(knorm_norm_bits_at(head, j), head.keep_high);
  }
};

// Stable compaction in temporal order, kGatherGroupSize rows at a time: a
// threadgroup prefix sum gives each row its output position and, where the
// cut keeps only some of the middle rows with its key (take_equal < equal),
// another one its rank among them. Kept rows write their index, and their
// norm unless the norms are compacted in place (other threads may still
// read the norm a write would replace).
inline void knorm_compact(
    KnormHead head,
    KnormCut<uint> cut,
    device uint* row_indices,
    device uint* row_norms,
    bool norms_in_place,
    threadgroup uint* simd_totals,
    uint tid,
    uint lane,
    uint simd_group) {
  const uint n_total = head.n_prior + head.n_new;
  // The same in every thread: the scan below runs in all or none.
  const bool every_equal_kept = cut.take_equal == cut.equal;
  uint equal_before = 0;
  uint kept_before = 0;
  for (uint base = 0; base < n_total; base += kGatherGroupSize) {
    const uint j = base + tid;
    const bool valid = j < n_total;
    const uint norm = valid ? knorm_norm_bits_at(head, j) : 0u;
    const bool protect = j < head.sink_end || j >= head.mid_end;
    const uint key = knorm_score_key(norm, head.keep_high);
    bool keep = valid && (protect || key <= cut.key);
    if (!every_equal_kept) {
      const bool equal = valid && !protect && key == cut.key;
      const KnormScan eq =
          knorm_block_scan<kGatherGroupSize>(equal ? 1u : 0u, simd_totals, lane, simd_group);
      keep = valid &&
          (protect || key < cut.key || (equal && equal_before + eq.exclusive < cut.take_equal));
      equal_before += eq.total;
    }
    const KnormScan pos =
        knorm_block_scan<kGatherGroupSize>(keep ? 1u : 0u, simd_totals, lane, simd_group);
    if (keep) {
      row_indices[kept_before + pos.exclusive] = j;
      if (!norms_in_place) {
        row_norms[kept_before + pos.exclusive] = norm;
      }
    }
    kept_before += pos.total;
  }
}

// Copies the output rows [begin, end) of one head's keys or values (which
// may differ in width) from the rows their indices name: the SIMD groups
// take output rows in turn, each several at once where rows are narrower
// than its lanes (knorm_row_lanes), lanes on consecutive units of `unit`
// bytes (knorm_copy_bits) so that loads and stores coalesce; the bits move
// as they are. With skip_prior (the output is its prior's buffer,
// compacted in place) rows from the prior are already there and only new
// rows are written, unless `staged` is given (stage_prior): then the prior
// rows that move come from there, at their output rows, and only those
// already where they belong are not written.
template <typename T>
inline void knorm_copy_rows(
    uint head_index,
    uint n_prior,
    uint n_new,
    uint kept,
    device const uint* row_indices,
    device const T* prior,
    device const T* fresh,
    device T* out,
    uint begin,
    uint end,
    bool skip_prior,
    device const T* staged,
    uint dim,
    uint unit,
    uint lane,
    uint simd_group) {
  device const T* prior_rows = prior + ulong(head_index) * n_prior * dim;
  device const T* new_rows = fresh + ulong(head_index) * n_new * dim;
  device T* head_rows = out + ulong(head_index) * kept * dim;
  const KnormRowLanes lanes = knorm_row_lanes(dim * uint(sizeof(T)) / unit, lane);
  if (lanes.row >= lanes.rows) {
    return;
  }
  // end < 2^31 (docs/spec.md section 5): p never wraps.
  const uint stride = kGatherSimdGroups * lanes.rows;
  for (uint p = begin + simd_group * lanes.rows + lanes.row; p < end; p += stride) {
    const uint j = row_indices[p];
    device const T* src = j < n_prior ? prior_rows + ulong(j) * dim
                                      : new_rows + ulong(j - n_prior) * dim;
    if (j < n_prior && skip_prior) {
      if (staged == nullptr || j == p) {
        continue;
      }
      src = staged + (ulong(head_index) * kept + p) * dim;
    }
    knorm_copy_bits(src, head_rows + ulong(p) * dim, dim, unit, lanes.first, lanes.stride);
  }
}

// Before knorm_gather_rows with stage_prior: the prior rows of output rows
// [begin, end) of one head that move (indices below n_prior other than
// their output row), to the same rows of `staged`, as knorm_copy_rows
// copies.
template <typename T>
inline void knorm_stage_rows(
    uint head_index,
    uint n_prior,
    uint kept,
    device const uint* row_indices,
    device const T* prior,
    device T* staged,
    uint begin,
    uint end,
    uint dim,
    uint unit,
    uint lane,
    uint simd_group) {
  device const T* prior_rows = prior + ulong(head_index) * n_prior * dim;
  device T* staged_rows = staged + ulong(head_index) * kept * dim;
  const KnormRowLanes lanes = knorm_row_lanes(dim * uint(sizeof(T)) / unit, lane);
  if (lanes.row >= lanes.rows) {
    return;
  }
  const uint stride = kGatherSimdGroups * lanes.rows;
  for (uint p = begin + simd_group * lanes.rows + lanes.row; p < end; p += stride) {
    const uint j = row_indices[p];
    if (j < n_prior && j != p) {
      knorm_copy_bits(prior_rows + ulong(j) * dim, staged_rows + ulong(p) * dim, dim, unit,
                      lanes.first, lanes.stride);
    }
  }
}

// The output rows [begin, end) of head `head` that threadgroup `group` of a
// split gather's row dispatches takes: kSplitRows of them from
// first_row + b * kSplitRows, b = group % groups_per_head.
struct KnormGatherBlock {
  uint head;
  uint begin;
  uint end;
};

inline KnormGatherBlock knorm_gather_block(constant KnormGatherParams& params, uint group) {
  KnormGatherBlock block;
  block.head = group / params.groups_per_head;
  block.begin = params.first_row + (group % params.groups_per_head) * kSplitRows;
  // begin < kept; begin + kSplitRows may not fit in a uint.
  block.end = params.kept - block.begin > kSplitRows ? block.begin + kSplitRows : params.kept;
  return block;
}

// The staged keys and values of a gather with stage_prior, in the scratch
// buffer (csrc/protected_topk_gather/plan.cpp lays it out).
template <typename T>
inline device T* knorm_staged(device uchar* scratch, uint units) {
  return (device T*)(scratch + ulong(units) * kRowUnitWide);
}

// One head's outputs, with the bits of in_place: keys 1, values 2, norms 4
// (output i is prior input i's buffer).
template <typename K, typename V>
struct KnormGatherOutputs {
  device K* keys;
  device V* values;
  device uint* norms;  // float32 bits
  uint key_dim;
  uint value_dim;
  uint key_unit;  // bytes of the units K and V rows move in (knorm_copy_bits)
  uint value_unit;
  uint in_place;
};

// The kept prior rows of the outputs in place, kGatherGroupSize output rows
// at a time. They are the first outputs (rows keep temporal order), with
// sources increasing and at or past them, as knorm_move_rows needs; a
// chunk whose last such row is where it belongs moves nothing, as then no
// row before it moves either. src holds a chunk's sources. Returns how many
// prior rows are kept.
template <typename K, typename V>
inline uint knorm_compact_in_place(
    KnormHead head,
    device const uint* row_indices,
    KnormGatherOutputs<K, V> out,
    threadgroup uint* src,
    threadgroup uint* simd_totals,
    uint tid,
    uint lane,
    uint simd_group) {
  uint prior_kept = 0;
  for (uint base = 0; base < head.kept; base += kGatherGroupSize) {
    const uint p = base + tid;
    const uint j = p < head.kept ? row_indices[p] : head.n_prior;
    if (j < head.n_prior) {
      src[tid] = j;
    }
    // Its barriers also make the list visible to the whole group.
    const uint n = knorm_block_scan<kGatherGroupSize>(
        j < head.n_prior ? 1u : 0u, simd_totals, lane, simd_group).total;
    if (n == 0) {
      break;
    }
    // msl-uniform: every thread reads the one entry src[n - 1], after the
    // scan's barriers.
    if (src[n - 1] != base + n - 1) {
      if ((out.in_place & 1u) != 0) {
        knorm_move_kv_rows<kGatherGroupSize>(out.keys, out.keys, true, src, base, n,
                                             out.key_dim, out.key_unit, tid);
      }
      if ((out.in_place & 2u) != 0) {
        knorm_move_kv_rows<kGatherGroupSize>(out.values, out.values, true, src, base, n,
                                             out.value_dim, out.value_unit, tid);
      }
      if ((out.in_place & 4u) != 0) {
        knorm_move_rows<kGatherGroupSize>(out.norms, out.norms, true, src, base, n, 1u, tid);
      }
    }
    prior_kept += n;
    // The list is read before the next chunk writes it.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  return prior_kept;
}

// cached_norms and sources are sized by the launch plan for this dispatch:
// the norms of rows [0, n_prior + n_new) where cache_norms is set, and a
// chunk's sources (kGatherGroupSize) where an output is in place.
template <typename K, typename V>
[[kernel, max_total_threads_per_threadgroup(kGatherGroupSize)]] void knorm_protected_topk_gather(
    device const K* prior_keys KNORM_BUFFER(0),
    device const V* prior_values KNORM_BUFFER(1),
    device const float* prior_norms KNORM_BUFFER(2),
    device const K* new_keys KNORM_BUFFER(3),
    device const V* new_values KNORM_BUFFER(4),
    device const float* new_norms KNORM_BUFFER(5),
    device K* out_keys KNORM_BUFFER(6),
    device V* out_values KNORM_BUFFER(7),
    device float* out_norms KNORM_BUFFER(8),
    device uint* out_indices KNORM_BUFFER(9),
    constant KnormGatherParams& params KNORM_BUFFER(10),
    threadgroup uint* cached_norms KNORM_THREADGROUP_BUFFER(0),
    threadgroup uint* sources KNORM_THREADGROUP_BUFFER(1),
    uint row KNORM_ATTRIBUTE(threadgroup_position_in_grid),
    uint tid KNORM_ATTRIBUTE(thread_position_in_threadgroup),
    uint lane KNORM_ATTRIBUTE(thread_index_in_simdgroup),
    uint simd_group KNORM_ATTRIBUTE(simdgroup_index_in_threadgroup)) {
  const uint n_prior = params.n_prior;
  const uint n_new = params.n_new;
  const uint key_dim = params.key_dim;
  const uint value_dim = params.value_dim;
  const uint kept = params.kept;
  const uint sink_end = params.sink_end;
  const uint mid_end = params.mid_end;
  const uint mid_keep = params.mid_keep;
  const uint in_place = params.in_place;
  const uint key_unit = params.key_unit;
  const uint value_unit = params.value_unit;
  KNORM_THREADGROUP_ARRAY(atomic_uint, histogram, kRadixBins);
  KNORM_THREADGROUP_ARRAY(uint, simd_totals, kGatherSimdGroups);
  KNORM_THREADGROUP_ARRAY(uint, picked, 3);

  const uint n_total = n_prior + n_new;
  // Norms in place (then n_prior = kept) are read through the output's
  // pointer: the compiler may take a `device const` argument for read-only
  // memory that the dispatch does not write.
  const bool norms_in_place = (in_place & 4u) != 0;
  device uint* row_norms = (device uint*)out_norms + ulong(row) * kept;
  KnormHead head = {
      row, n_prior, n_new, kept, sink_end, mid_end, mid_keep, params.keep_high != 0,
      norms_in_place ? row_norms : (device const uint*)prior_norms + ulong(row) * n_prior,
      (device const uint*)new_norms + ulong(row) * n_new,
      false, cached_norms};
  // Radix select of the mid_keep-th smallest middle key.
  KnormCut<uint> cut = {0u, 0u, 0u};
  if (mid_keep > 0) {
    if (params.cache_norms != 0) {
      for (uint j = tid; j < n_total; j += kGatherGroupSize) {
        cached_norms[j] = knorm_norm_bits_at(head, j);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      head.cached = true;
    }
    KnormGatherKeys keys = {head};
    cut = knorm_radix_select<uint, kGatherGroupSize>(
        keys, sink_end, mid_end, mid_keep, histogram, simd_totals, picked, tid,
        lane, simd_group);
  }
  device uint* row_indices = out_indices + ulong(row) * kept;
  knorm_compact(head, cut, row_indices, row_norms, norms_in_place,
                simd_totals, tid, lane, simd_group);
  // The copies read indices written by other threads of the group, and the
  // moves in place overwrite norms the compaction read.
  threadgroup_barrier(mem_flags::mem_device);
  uint prior_kept = 0;
  // The outputs in place but staged move in later dispatches.
  const uint moved_here = in_place & ~params.stage_prior;
  if (moved_here != 0) {
    const KnormGatherOutputs<K, V> out = {
        out_keys + ulong(row) * kept * key_dim, out_values + ulong(row) * kept * value_dim,
        row_norms, key_dim, value_dim, key_unit, value_unit, moved_here};
    // Each wave of knorm_move_rows ends with a barrier on device memory: the
    // prior rows are read before the new rows below replace them.
    prior_kept = knorm_compact_in_place(head, row_indices, out, sources, simd_totals, tid,
                                        lane, simd_group);
  }
  // The rows an output in place still lacks are the new ones.
  if (params.copy_rows != 0) {
    knorm_copy_rows(row, n_prior, n_new, kept, row_indices, prior_keys, new_keys, out_keys,
                    (in_place & 1u) != 0 ? prior_kept : 0u, kept, false,
                    (device const K*)nullptr, key_dim, key_unit, lane, simd_group);
    knorm_copy_rows(row, n_prior, n_new, kept, row_indices, prior_values, new_values,
                    out_values, (in_place & 2u) != 0 ? prior_kept : 0u, kept, false,
                    (device const V*)nullptr, value_dim, value_unit, lane, simd_group);
  }
  if (norms_in_place) {
    for (uint p = prior_kept + tid; p < kept; p += kGatherGroupSize) {
      row_norms[p] = head.new_norms[row_indices[p] - n_prior];
    }
  }
}

// The prior rows that move of a gather's keys and values in place, with
// stage_prior, after the selection wrote the indices: threadgroup g copies
// those of its block of output rows (knorm_gather_block; first_row is 0) to
// the scratch buffer. It writes no output, so its blocks read the prior
// rows as they were.
template <typename K, typename V>
[[kernel, max_total_threads_per_threadgroup(kGatherGroupSize)]] void knorm_stage_prior_rows(
    device const K* prior_keys KNORM_BUFFER(0),
    device const V* prior_values KNORM_BUFFER(1),
    device const uint* indices KNORM_BUFFER(2),
    device uchar* scratch KNORM_BUFFER(3),
    constant KnormGatherParams& params KNORM_BUFFER(4),
    uint group KNORM_ATTRIBUTE(threadgroup_position_in_grid),
    uint lane KNORM_ATTRIBUTE(thread_index_in_simdgroup),
    uint simd_group KNORM_ATTRIBUTE(simdgroup_index_in_threadgroup)) {
  const uint kept = params.kept;
  const KnormGatherBlock block = knorm_gather_block(params, group);
  device const uint* row_indices = indices + ulong(block.head) * kept;
  if ((params.stage_prior & 1u) != 0) {
    knorm_stage_rows(block.head, params.n_prior, kept, row_indices, prior_keys,
                     knorm_staged<K>(scratch, params.staged_key_units), block.begin, block.end,
                     params.key_dim, params.key_unit, lane, simd_group);
  }
  if ((params.stage_prior & 2u) != 0) {
    knorm_stage_rows(block.head, params.n_prior, kept, row_indices, prior_values,
                     knorm_staged<V>(scratch, params.staged_value_units), block.begin,
                     block.end, params.value_dim, params.value_unit, lane, simd_group);
  }
}

// The key and value rows of a gather whose selection ran before
// (knorm_protected_topk_gather with copy_rows = 0 wrote the indices, and
// compacted the outputs that are in place unless stage_prior, whose moving
// rows knorm_stage_prior_rows staged): threadgroup g copies its block of
// output rows (knorm_gather_block). Rows below first_row are kept prior
// rows of outputs in place, which are already compacted.
template <typename K, typename V>
[[kernel, max_total_threads_per_threadgroup(kGatherGroupSize)]] void knorm_gather_rows(
    device const K* prior_keys KNORM_BUFFER(0),
    device const V* prior_values KNORM_BUFFER(1),
    device const K* new_keys KNORM_BUFFER(2),
    device const V* new_values KNORM_BUFFER(3),
    device const uint* indices KNORM_BUFFER(4),
    device K* out_keys KNORM_BUFFER(5),
    device V* out_values KNORM_BUFFER(6),
    constant KnormGatherParams& params KNORM_BUFFER(7),
    device uchar* scratch KNORM_BUFFER(8),
    uint group KNORM_ATTRIBUTE(threadgroup_position_in_grid),
    uint lane KNORM_ATTRIBUTE(thread_index_in_simdgroup),
    uint simd_group KNORM_ATTRIBUTE(simdgroup_index_in_threadgroup)) {
  const uint n_prior = params.n_prior;
  const uint n_new = params.n_new;
  const uint key_dim = params.key_dim;
  const uint value_dim = params.value_dim;
  const uint kept = params.kept;
  const uint in_place = params.in_place;
  const uint key_unit = params.key_unit;
  const uint value_unit = params.value_unit;
  const KnormGatherBlock block = knorm_gather_block(params, group);
  const uint head = block.head;
  const uint begin = block.begin;
  const uint end = block.end;
  device const uint* row_indices = indices + ulong(head) * kept;
  const uint staged = params.stage_prior;
  knorm_copy_rows(head, n_prior, n_new, kept, row_indices, prior_keys, new_keys, out_keys,
                  begin, end, (in_place & 1u) != 0,
                  (staged & 1u) != 0
                      ? (device const K*)knorm_staged<K>(scratch, params.staged_key_units)
                      : (device const K*)nullptr,
                  key_dim, key_unit, lane, simd_group);
  knorm_copy_rows(head, n_prior, n_new, kept, row_indices, prior_values, new_values,
                  out_values, begin, end, (in_place & 2u) != 0,
                  (staged & 2u) != 0
                      ? (device const V*)knorm_staged<V>(scratch, params.staged_value_units)
                      : (device const V*)nullptr,
                  value_dim, value_unit, lane, simd_group);
}

#endif // MLX_KNORM_METAL_PROTECTED_TOPK_GATHER_H
