// RowScores on the GPU: the float32 score of each new row (docs/spec.md
// section 2a), in the pinned order of that section so that it agrees bit for
// bit with the CPU kernel and the fallback.
//
//   knorm_row_scores     scorers without a statistic (knorm, vnorm,
//                        qfilter): one SIMD group of 32 lanes per row,
//                        kKeyNormsRowsPerGroup rows a threadgroup;
//   knorm_keydiff_scores keydiff: one SIMD group per head, which takes the
//                        head's rows in order, the running sum of its unit
//                        keys in registers, and writes the sum it ends with.
//
// Each lane holds kPerLane elements of a row (knorm_lanes_sum's layout); the
// launch plan picks kPerLane = P / 32 as for the key norms, P the next power
// of two >= D, and the host name ends in it.
//
// Instantiated in row_scores.metal; launched by the plan of
// csrc/row_scores/plan.cpp.
#ifndef MLX_KNORM_METAL_ROW_SCORES_H
#define MLX_KNORM_METAL_ROW_SCORES_H

#include "knorm_kernels.h"

// Whether new row j of a head is a token of its sequence (docs/spec.md
// section 4 step 0): its position offset + j inside the head's valid range.
inline bool knorm_score_row_real(constant KnormScoreParams& params, device const int* valid, uint head,
                                 uint j) {
  if (params.has_valid == 0) {
    return true;
  }
  const long p = long(params.offset) + long(j);
  return p >= long(valid[2 * ulong(head)]) && p < long(valid[2 * ulong(head) + 1]);
}

// knorm: the key's norm; vnorm: the key's norm over the value's; qfilter:
// minus the key's projection on its head's filter (state[head]).
template <typename T, uint kPerLane, uint kScorer>
[[kernel, max_total_threads_per_threadgroup(kKeyNormsRowsPerGroup * kSimdWidth)]] void knorm_row_scores(
    device const T* keys KNORM_BUFFER(0),
    device const T* values KNORM_BUFFER(1),
    device const float* state KNORM_BUFFER(2),
    device const int* valid KNORM_BUFFER(3),
    device float* scores KNORM_BUFFER(4),
    constant KnormScoreParams& params KNORM_BUFFER(5),
    uint group KNORM_ATTRIBUTE(threadgroup_position_in_grid),
    uint lane KNORM_ATTRIBUTE(thread_index_in_simdgroup),
    uint simd_group KNORM_ATTRIBUTE(simdgroup_index_in_threadgroup)) {
  const uint row = group * kKeyNormsRowsPerGroup + simd_group;
  // The whole SIMD group leaves together, so the shuffles below always run
  // with all 32 lanes.
  if (row >= params.heads * params.rows) {
    return;
  }
  const uint head = row / params.rows;
  float k[kPerLane];
  knorm_lane_elements<kPerLane>(keys + ulong(row) * params.key_dim, params.key_dim, lane, k);
  float score = 0.0f;
  if (kScorer == kScorerKeyNorm) {
    score = knorm_lanes_norm<kPerLane>(k);
  } else if (kScorer == kScorerValueNorm) {
    float v[kPerLane];
    knorm_lane_elements<kPerLane>(values + ulong(row) * params.value_dim, params.value_dim, lane, v);
    score = knorm_canonical(
        knorm_flushed(precise::divide(knorm_lanes_norm<kPerLane>(k), knorm_lanes_norm<kPerLane>(v))));
  } else {
    float f[kPerLane];
    knorm_lane_elements<kPerLane>(state + ulong(head) * params.key_dim, params.key_dim, lane, f);
    score = knorm_canonical(knorm_flushed(-knorm_lanes_dot<kPerLane>(k, f)));
  }
  if (!knorm_score_row_real(params, valid, head, row % params.rows)) {
    score = 0.0f;
  }
  if (lane == 0) {
    scores[row] = score;
  }
}

// keydiff: each row's cosine similarity to the sum of the unit keys before
// it in its head (the state on entry, then the head's earlier new rows),
// which the real rows with a finite nonzero norm then join. The SIMD group
// of a head holds the sum in registers from the first row to the last.
template <typename T, uint kPerLane>
[[kernel, max_total_threads_per_threadgroup(kKeyNormsRowsPerGroup * kSimdWidth)]] void knorm_keydiff_scores(
    device const T* keys KNORM_BUFFER(0),
    device const float* state KNORM_BUFFER(1),
    device const int* valid KNORM_BUFFER(2),
    device float* scores KNORM_BUFFER(3),
    device float* state_out KNORM_BUFFER(4),
    constant KnormScoreParams& params KNORM_BUFFER(5),
    uint group KNORM_ATTRIBUTE(threadgroup_position_in_grid),
    uint lane KNORM_ATTRIBUTE(thread_index_in_simdgroup),
    uint simd_group KNORM_ATTRIBUTE(simdgroup_index_in_threadgroup)) {
  const uint head = group * kKeyNormsRowsPerGroup + simd_group;
  if (head >= params.heads) {
    return;
  }
  const uint dim = params.key_dim;
  float sum[kPerLane];
  knorm_lane_elements<kPerLane>(state + ulong(head) * dim, dim, lane, sum);
  for (uint j = 0; j < params.rows; ++j) {
    const ulong row = ulong(head) * params.rows + j;
    float k[kPerLane];
    knorm_lane_elements<kPerLane>(keys + row * dim, dim, lane, k);
    const float norm = knorm_lanes_norm<kPerLane>(k);
    float score = 0.0f;
    const bool real = knorm_score_row_real(params, valid, head, j);
    if (real && (isnan(norm) || isinf(norm))) {
      score = as_type<float>(0x7FC00000u);
    } else if (real) {
      const float denominator = knorm_flushed(norm * knorm_lanes_norm<kPerLane>(sum));
      const float projection = knorm_lanes_dot<kPerLane>(k, sum);
      if (denominator != 0.0f) {
        score = knorm_canonical(knorm_flushed(precise::divide(projection, denominator)));
      }
      if (norm != 0.0f) {
        for (uint c = 0; c < kPerLane; ++c) {
          sum[c] = knorm_flushed(sum[c] + knorm_flushed(precise::divide(k[c], norm)));
        }
      }
    }
    if (lane == 0) {
      scores[row] = score;
    }
  }
  for (uint c = 0; c < kPerLane; ++c) {
    const uint i = lane + kSimdWidth * c;
    if (i < dim) {
      state_out[ulong(head) * dim + i] = sum[c];
    }
  }
}

#endif // MLX_KNORM_METAL_ROW_SCORES_H
