// ProtectedTopKGather on the GPU: one eviction step of docs/spec.md
// section 3.
//
// One threadgroup of kGatherGroupSize threads per row n, all N rows in one
// dispatch.
// 1. Radix select (4 passes of 8 bits) over the order-preserving uint32 key
//    of the middle rows' scores finds the key `threshold` of the m-th best
//    middle row and how many middle rows with exactly that key are kept
//    (`take_equal`: ties go to the earliest rows).
// 2. A stable compaction walks the rows in temporal order, a threadgroup at
//    a time; two threadgroup prefix sums give each row its rank among equal
//    keys and its output position. Kept rows write their index and norm.
// 3. One SIMD group per output row copies the key and value rows, read
//    straight from prior or new (the concatenation is never built), lanes on
//    consecutive elements so that loads and stores coalesce.
// All indices into K/V buffers are 64-bit.
//
// Launched by csrc/protected_topk_gather/metal.cpp. Compiles as Metal
// Shading Language and, through csrc/metal_emulator/metal_emulator.h, as C++.
#include "knorm_defines.h"

constant constexpr uint kGatherSimdGroups = kGatherGroupSize / kSimdWidth;
// One radix bin per thread.
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

inline float knorm_norm_at(
    device const float* prior_norms,
    device const float* new_norms,
    uint n_prior,
    uint j) {
  return j < n_prior ? prior_norms[j] : new_norms[j - n_prior];
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
  if (lane == 31) {
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

// Row selection constants are computed on the host (the launch plan) from
// the shapes: rows [0, sink_end) and [mid_end, n_total) are protected, and
// mid_keep > 0 middle rows are kept when the row evicts. Without eviction
// the plan protects every row and sets mid_keep = 0.
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

  const uint n_total = n_prior + n_new;
  const bool high = keep_high != 0;
  device const float* row_prior_norms = prior_norms + ulong(row) * n_prior;
  device const float* row_new_norms = new_norms + ulong(row) * n_new;

  // 1. Radix select: after the four passes `prefix` is the key of the
  // mid_keep-th smallest middle key and `rank` how many middle rows with
  // that key are kept.
  uint threshold = 0;
  uint take_equal = 0;
  if (mid_keep > 0) {
    uint prefix = 0;
    uint mask = 0;
    uint rank = mid_keep;  // 1-based rank among the rows matching prefix
    for (int shift = 24; shift >= 0; shift -= 8) {
      atomic_store_explicit(&histogram[tid], 0u, memory_order_relaxed);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (uint j = sink_end + tid; j < mid_end; j += kGatherGroupSize) {
        const uint key = knorm_score_key(
            knorm_norm_at(row_prior_norms, row_new_norms, n_prior, j), high);
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
    threshold = prefix;
    take_equal = rank;
  }

  // 2. Stable compaction in temporal order.
  device uint* row_indices = out_indices + ulong(row) * kept;
  device float* row_norms = out_norms + ulong(row) * kept;
  uint equal_before = 0;
  uint kept_before = 0;
  for (uint base = 0; base < n_total; base += kGatherGroupSize) {
    const uint j = base + tid;
    const bool valid = j < n_total;
    const float norm =
        valid ? knorm_norm_at(row_prior_norms, row_new_norms, n_prior, j) : 0.0f;
    const bool protect = j < sink_end || j >= mid_end;
    const uint key = knorm_score_key(norm, high);
    const bool equal = valid && !protect && key == threshold;
    const KnormScan eq =
        knorm_block_scan(equal ? 1u : 0u, simd_totals, lane, simd_group);
    const bool keep = valid &&
        (protect || key < threshold ||
         (equal && equal_before + eq.exclusive < take_equal));
    const KnormScan pos =
        knorm_block_scan(keep ? 1u : 0u, simd_totals, lane, simd_group);
    if (keep) {
      row_indices[kept_before + pos.exclusive] = j;
      row_norms[kept_before + pos.exclusive] = norm;
    }
    equal_before += eq.total;
    kept_before += pos.total;
  }
  // The copies below read indices written by other threads of the group.
  threadgroup_barrier(mem_flags::mem_device);

  // 3. Gather the key and value rows (keys and values may differ in width).
  for (uint p = simd_group; p < kept; p += kGatherSimdGroups) {
    const uint j = row_indices[p];
    const bool from_prior = j < n_prior;
    const ulong src_row = from_prior ? ulong(row) * n_prior + j
                                     : ulong(row) * n_new + (j - n_prior);
    const ulong dst_row = ulong(row) * kept + p;
    device const K* src_keys = (from_prior ? prior_keys : new_keys) + src_row * key_dim;
    device const V* src_values =
        (from_prior ? prior_values : new_values) + src_row * value_dim;
    device K* dst_keys = out_keys + dst_row * key_dim;
    device V* dst_values = out_values + dst_row * value_dim;
    for (uint d = lane; d < key_dim; d += 32) {
      dst_keys[d] = src_keys[d];
    }
    for (uint d = lane; d < value_dim; d += 32) {
      dst_values[d] = src_values[d];
    }
  }
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
