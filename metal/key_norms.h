// KeyNorms on the GPU: the float32 L2 norm of each key row, reduced in the
// pinned order of docs/spec.md section 2 (zero-pad to P, the next power of
// two >= D, then halving adds) so that it agrees bit for bit with the CPU
// kernel.
//
// One SIMD group of 32 lanes per row (knorm_row_norm, shared with the
// evict-and-fill kernel), each lane holding kPerLane squares in registers.
// The launch plan picks the instantiation with kPerLane = P / 32 (1 for
// D <= 32); the host name ends in kPerLane.
//
// Instantiated in key_norms.metal; launched by the plan of
// csrc/key_norms/plan.cpp. Compiles as Metal Shading Language and, through
// csrc/metal_emulator/metal_emulator.h, as C++.
#ifndef MLX_KNORM_METAL_KEY_NORMS_H
#define MLX_KNORM_METAL_KEY_NORMS_H

#include "knorm_kernels.h"

template <typename T, uint kPerLane>
[[kernel, max_total_threads_per_threadgroup(kKeyNormsRowsPerGroup * kSimdWidth)]] void knorm_key_norms(
    device const T* keys KNORM_BUFFER(0),
    device float* norms KNORM_BUFFER(1),
    constant uint& dim KNORM_BUFFER(2),
    constant uint& rows KNORM_BUFFER(3),
    uint group KNORM_ATTRIBUTE(threadgroup_position_in_grid),
    uint lane KNORM_ATTRIBUTE(thread_index_in_simdgroup),
    uint simd_group KNORM_ATTRIBUTE(simdgroup_index_in_threadgroup)) {
  const uint row = group * kKeyNormsRowsPerGroup + simd_group;
  // The whole SIMD group leaves together, so the shuffles below always run
  // with all 32 lanes.
  if (row >= rows) {
    return;
  }
  const float norm = knorm_row_norm<kPerLane>(keys + ulong(row) * dim, dim, lane);
  if (lane == 0) {
    norms[row] = norm;
  }
}

#endif // MLX_KNORM_METAL_KEY_NORMS_H
