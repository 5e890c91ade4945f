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
// Launched by the plan of csrc/key_norms/plan.cpp. Compiles as Metal
// Shading Language and, through csrc/metal_emulator/metal_emulator.h, as C++.
#include "knorm_kernels.h"

template <typename T, uint kPerLane>
[[kernel]] void knorm_key_norms(
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

// One instantiation per squares-per-lane count 1, 2, 4, ..., up to
// kKeyNormsMaxDim / 32.
static_assert(kKeyNormsMaxDim == 16 * kSimdWidth, "instantiate every count up to 16");
#define KNORM_KEY_NORMS_INSTANCE(name, type, per_lane) \
  KNORM_KERNEL_INSTANCE(                               \
      "knorm_key_norms_" #name "_" #per_lane, knorm_key_norms<type, per_lane>)
#define KNORM_KEY_NORMS_INSTANCES(name, type)  \
  KNORM_KEY_NORMS_INSTANCE(name, type, 1)      \
  KNORM_KEY_NORMS_INSTANCE(name, type, 2)      \
  KNORM_KEY_NORMS_INSTANCE(name, type, 4)      \
  KNORM_KEY_NORMS_INSTANCE(name, type, 8)      \
  KNORM_KEY_NORMS_INSTANCE(name, type, 16)

KNORM_KEY_NORMS_INSTANCES(float16, half)
KNORM_KEY_NORMS_INSTANCES(bfloat16, bfloat)
KNORM_KEY_NORMS_INSTANCES(float32, float)
