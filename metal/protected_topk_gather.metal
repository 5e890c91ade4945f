// ProtectedTopKGather on the GPU: one eviction step of docs/spec.md
// section 3 for every head in one dispatch, one threadgroup of
// kGatherGroupSize threads per head:
//   knorm_select     radix select of the threshold among the middle rows;
//   knorm_compact    the kept rows' indices and norms, in temporal order;
//   knorm_copy_rows  their key and value rows.
// Rows are read straight from prior or new: the concatenation is never
// built. All offsets into K/V buffers are 64-bit.
//
// Launched by csrc/protected_topk_gather/metal.cpp. Compiles as Metal
// Shading Language and, through csrc/metal_emulator/metal_emulator.h, as C++.
#include "knorm_defines.h"

constant constexpr uint kGatherSimdGroups = kGatherGroupSize / kSimdWidth;
// Radix select in four passes of 8 bits: one histogram bin per thread.
constant constexpr uint kRadixBins = 256;
static_assert(kRadixBins == kGatherGroupSize, "one radix bin per thread");

// score -> uint32 with a < b iff key(a) < key(b); -0 == +0; NaN after +inf.
// keep="high" ranks by -norm, a flip of the sign bit.
inline uint knorm_score_key(float norm, bool keep_high) {
  if (isnan(norm)) {
    return 0xFFFFFFFFu;
  }
  uint bits = as_type<uint>(norm);
  if (keep_high) {
    bits ^= 0x80000000u;
  }
  if ((bits & 0x7FFFFFFFu) == 0) {
    bits = 0;
  }
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

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
  device const float* prior_norms;  // this head's rows
  device const float* new_norms;
};

inline float knorm_norm_at(KnormHead head, uint j) {
  return j < head.n_prior ? head.prior_norms[j] : head.new_norms[j - head.n_prior];
}

struct KnormScan {
  uint exclusive;  // sum of v over the threads before this one
  uint total;      // sum of v over the threadgroup
};

// Exclusive prefix sum of one uint per thread across the threadgroup, in
// thread order. Ends with a barrier so that simd_totals can be reused.
inline KnormScan knorm_block_scan(
    uint v,
    threadgroup uint* simd_totals,
    uint lane,
    uint simd_group) {
  const uint inclusive = simd_prefix_inclusive_sum(v);
  if (lane == kSimdWidth - 1) {
    simd_totals[simd_group] = inclusive;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint before = 0;
  uint total = 0;
  for (uint s = 0; s < kGatherSimdGroups; ++s) {
    const uint t = simd_totals[s];
    before += s < simd_group ? t : 0;
    total += t;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  KnormScan out = {before + inclusive - v, total};
  return out;
}

// What the selection keeps of the middle rows: every row whose order key is
// below `key`, and the first `take_equal` rows with exactly that key (ties
// go to the earliest rows).
struct KnormThreshold {
  uint key;
  uint take_equal;
};

// Radix select over the order keys of the middle rows, most significant 8
// bits first: after the four passes `prefix` is the key of the mid_keep-th
// smallest middle key and `rank` how many middle rows with that key are
// kept. Needs mid_keep > 0.
inline KnormThreshold knorm_select(
    KnormHead head,
    threadgroup atomic_uint* histogram,
    threadgroup uint* simd_totals,
    threadgroup uint* picked,
    uint tid,
    uint lane,
    uint simd_group) {
  uint prefix = 0;
  uint mask = 0;
  uint rank = head.mid_keep;  // 1-based rank among the rows matching prefix
  for (int shift = 24; shift >= 0; shift -= 8) {
    atomic_store_explicit(&histogram[tid], 0u, memory_order_relaxed);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint j = head.sink_end + tid; j < head.mid_end; j += kGatherGroupSize) {
      const uint key = knorm_score_key(knorm_norm_at(head, j), head.keep_high);
      if ((key & mask) == prefix) {
        atomic_fetch_add_explicit(
            &histogram[(key >> shift) & 0xFFu], 1u, memory_order_relaxed);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const uint count =
        atomic_load_explicit(&histogram[tid], memory_order_relaxed);
    const KnormScan bins = knorm_block_scan(count, simd_totals, lane, simd_group);
    if (bins.exclusive < rank && rank <= bins.exclusive + count) {
      picked[0] = tid;
      picked[1] = bins.exclusive;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    prefix |= picked[0] << shift;
    mask |= 0xFFu << shift;
    rank -= picked[1];
  }
  KnormThreshold out = {prefix, rank};
  return out;
}

// Stable compaction in temporal order, kGatherGroupSize rows at a time: two
// threadgroup prefix sums give each row its rank among the middle rows at
// the threshold key and its output position. Kept rows write their index
// and norm.
inline void knorm_compact(
    KnormHead head,
    KnormThreshold cut,
    device uint* row_indices,
    device float* row_norms,
    threadgroup uint* simd_totals,
    uint tid,
    uint lane,
    uint simd_group) {
  const uint n_total = head.n_prior + head.n_new;
  uint equal_before = 0;
  uint kept_before = 0;
  for (uint base = 0; base < n_total; base += kGatherGroupSize) {
    const uint j = base + tid;
    const bool valid = j < n_total;
    const float norm = valid ? knorm_norm_at(head, j) : 0.0f;
    const bool protect = j < head.sink_end || j >= head.mid_end;
    const uint key = knorm_score_key(norm, head.keep_high);
    const bool equal = valid && !protect && key == cut.key;
    const KnormScan eq =
        knorm_block_scan(equal ? 1u : 0u, simd_totals, lane, simd_group);
    const bool keep = valid &&
        (protect || key < cut.key ||
         (equal && equal_before + eq.exclusive < cut.take_equal));
    const KnormScan pos =
        knorm_block_scan(keep ? 1u : 0u, simd_totals, lane, simd_group);
    if (keep) {
      row_indices[kept_before + pos.exclusive] = j;
      row_norms[kept_before + pos.exclusive] = norm;
    }
    equal_before += eq.total;
    kept_before += pos.total;
  }
}

// Copies the kept rows of keys or values (which may differ in width): one
// SIMD group per output row, lanes on consecutive elements so that loads and
// stores coalesce; the bits move as they are.
template <typename T>
inline void knorm_copy_rows(
    KnormHead head,
    device const uint* row_indices,
    device const T* prior,
    device const T* fresh,
    device T* out,
    uint dim,
    uint lane,
    uint simd_group) {
  for (uint p = simd_group; p < head.kept; p += kGatherSimdGroups) {
    const uint j = row_indices[p];
    const bool from_prior = j < head.n_prior;
    const ulong src_row = from_prior ? ulong(head.index) * head.n_prior + j
                                     : ulong(head.index) * head.n_new + (j - head.n_prior);
    device const T* src = (from_prior ? prior : fresh) + src_row * dim;
    device T* dst = out + (ulong(head.index) * head.kept + p) * dim;
    for (uint d = lane; d < dim; d += kSimdWidth) {
      dst[d] = src[d];
    }
  }
}

template <typename K, typename V>
[[kernel]] void knorm_protected_topk_gather(
    device const K* prior_keys [[buffer(0)]],
    device const V* prior_values [[buffer(1)]],
    device const float* prior_norms [[buffer(2)]],
    device const K* new_keys [[buffer(3)]],
    device const V* new_values [[buffer(4)]],
    device const float* new_norms [[buffer(5)]],
    device K* out_keys [[buffer(6)]],
    device V* out_values [[buffer(7)]],
    device float* out_norms [[buffer(8)]],
    device uint* out_indices [[buffer(9)]],
    constant uint& n_prior [[buffer(10)]],
    constant uint& n_new [[buffer(11)]],
    constant uint& key_dim [[buffer(12)]],
    constant uint& value_dim [[buffer(13)]],
    constant uint& kept [[buffer(14)]],
    constant uint& sink_end [[buffer(15)]],
    constant uint& mid_end [[buffer(16)]],
    constant uint& mid_keep [[buffer(17)]],
    constant uint& keep_high [[buffer(18)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint simd_group [[simdgroup_index_in_threadgroup]]) {
  KNORM_THREADGROUP_ARRAY(atomic_uint, histogram, kRadixBins);
  KNORM_THREADGROUP_ARRAY(uint, simd_totals, kGatherSimdGroups);
  KNORM_THREADGROUP_ARRAY(uint, picked, 2);

  const KnormHead head = {
      row, n_prior, n_new, kept, sink_end, mid_end, mid_keep, keep_high != 0,
      prior_norms + ulong(row) * n_prior, new_norms + ulong(row) * n_new};
  KnormThreshold cut = {0u, 0u};
  if (mid_keep > 0) {
    cut = knorm_select(head, histogram, simd_totals, picked, tid, lane, simd_group);
  }
  device uint* row_indices = out_indices + ulong(row) * kept;
  knorm_compact(head, cut, row_indices, out_norms + ulong(row) * kept,
                simd_totals, tid, lane, simd_group);
  // The copies read indices written by other threads of the group.
  threadgroup_barrier(mem_flags::mem_device);
  knorm_copy_rows(head, row_indices, prior_keys, new_keys, out_keys, key_dim,
                  lane, simd_group);
  knorm_copy_rows(head, row_indices, prior_values, new_values, out_values,
                  value_dim, lane, simd_group);
}

#define KNORM_GATHER_INSTANCE(kname, ktype, vname, vtype)                  \
  KNORM_KERNEL_INSTANCE(                                                   \
      "knorm_protected_topk_gather_" #kname "_" #vname,                    \
      knorm_protected_topk_gather<ktype, vtype>)
#define KNORM_GATHER_INSTANCES(kname, ktype)             \
  KNORM_GATHER_INSTANCE(kname, ktype, float16, half)     \
  KNORM_GATHER_INSTANCE(kname, ktype, bfloat16, bfloat)  \
  KNORM_GATHER_INSTANCE(kname, ktype, float32, float)

KNORM_GATHER_INSTANCES(float16, half)
KNORM_GATHER_INSTANCES(bfloat16, bfloat)
KNORM_GATHER_INSTANCES(float32, float)
