// KeyNorms on the GPU: the float32 L2 norm of each key row, reduced in the
// pinned order of docs/spec.md section 2 (zero-pad to P, the next power of
// two >= D, then halving adds) so that it agrees bit for bit with the CPU
// kernel.
//
// One SIMD group of 32 lanes per row. For P > 32, lane i holds the squares
// s[i + 32k], k < P/32; the first log2(P/32) halving levels pair registers of
// the same lane (s[i + 32k] + s[i + 32k + P/2] ...). The last five levels
// (16, 8, 4, 2, 1 apart) are simd_shuffle_down adds, lane 0 ending with s[0].
// Rows of D <= 32 start at the level P/2 instead.
//
// Launched by csrc/key_norms/metal.cpp. Compiles as Metal Shading Language
// and, through csrc/metal_emulator/metal_emulator.h, as C++.
#include "knorm_defines.h"

template <typename T>
[[kernel]] void knorm_key_norms(
    device const T* keys [[buffer(0)]],
    device float* norms [[buffer(1)]],
    constant uint& dim [[buffer(2)]],
    constant uint& rows [[buffer(3)]],
    uint group [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint simd_group [[simdgroup_index_in_threadgroup]]) {
  (void)tid;  // every kernel takes the same four thread attributes
  const uint row = group * kKeyNormsRowsPerGroup + simd_group;
  // The whole SIMD group leaves together, so the shuffles below always run
  // with all 32 lanes.
  if (row >= rows) {
    return;
  }
  device const T* x = keys + ulong(row) * dim;

  uint width = 1;
  while (width < dim) {
    width <<= 1;
  }
  const uint per_lane = width > kSimdWidth ? width / kSimdWidth : 1;

  // Zero padding past D: adding +0 leaves a square (>= +0 or NaN) unchanged,
  // exactly as the pinned order's padded adds do.
  float s[kKeyNormsMaxDim / kSimdWidth];
  for (uint k = 0; k < per_lane; ++k) {
    const uint i = lane + kSimdWidth * k;
    float square = 0.0f;
    if (i < dim) {
      const float a = float(x[i]);
      square = a * a;
      // docs/spec.md section 2 step 2: squares below the smallest normal
      // float are +0 whether or not this GPU flushes subnormals (NaN
      // compares false).
      if (square < FLT_MIN) {
        square = 0.0f;
      }
    }
    s[k] = square;
  }
  for (uint c = per_lane / 2; c >= 1; c /= 2) {
    for (uint k = 0; k < c; ++k) {
      s[k] = s[k] + s[k + c];
    }
  }
  float acc = s[0];
  for (uint delta = min(width / 2, kSimdWidth / 2); delta >= 1; delta /= 2) {
    const float other = simd_shuffle_down(acc, ushort(delta));
    acc = acc + other;
  }
  if (lane == 0) {
    const float norm = precise::sqrt(acc);
    // docs/spec.md section 2 step 6: one NaN bit pattern on every GPU.
    norms[row] = isnan(norm) ? as_type<float>(0x7FC00000u) : norm;
  }
}

KNORM_KERNEL_INSTANCE("knorm_key_norms_float16", knorm_key_norms<half>)
KNORM_KERNEL_INSTANCE("knorm_key_norms_bfloat16", knorm_key_norms<bfloat>)
KNORM_KERNEL_INSTANCE("knorm_key_norms_float32", knorm_key_norms<float>)
