// KeyNorms on the GPU: the float32 L2 norm of each key row, reduced in the
// pinned order of docs/spec.md section 2 (zero-pad to P, the next power of
// two >= D, then halving adds) so that it agrees bit for bit with the CPU
// kernel.
//
// One SIMD group of 32 lanes per row (knorm_row_norm, shared with the
// evict-and-fill kernel).
//
// Launched by csrc/key_norms/metal.cpp. Compiles as Metal Shading Language
// and, through csrc/metal_emulator/metal_emulator.h, as C++.
#include "knorm_kernels.h"

template <typename T>
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
  const float norm = knorm_row_norm(keys + ulong(row) * dim, dim, lane);
  if (lane == 0) {
    norms[row] = norm;
  }
}

KNORM_KERNEL_INSTANCE("knorm_key_norms_float16", knorm_key_norms<half>)
KNORM_KERNEL_INSTANCE("knorm_key_norms_bfloat16", knorm_key_norms<bfloat>)
KNORM_KERNEL_INSTANCE("knorm_key_norms_float32", knorm_key_norms<float>)
