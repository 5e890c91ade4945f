// The instantiations of KeyNorms' kernel (key_norms.h), one per key dtype
// and squares-per-lane count, under the host names that
// csrc/key_norms/plan.cpp launches. The metallib build and the JIT path
// compile this file; the emulator includes it
// (csrc/metal_emulator/kernels.cpp).
#include "key_norms.h"

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
