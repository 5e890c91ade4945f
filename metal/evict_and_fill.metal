// The instantiations of EvictAndFill's kernels (evict_and_fill.h): the step
// and its fill, one per source of the new rows' norms (the first payload as
// float16, bfloat16 or float32 keys, with each squares-per-lane count, or
// given norms), the copy of the kept slots, the temporal layout's wide
// decode step and wide compaction, and the order tree's build
// (order_tree.h); under the host names that csrc/evict_and_fill/plan.cpp
// launches. The metallib build and the JIT path
// compile this file; the emulator includes it
// (csrc/metal_emulator/kernels.cpp).
#include "evict_and_fill.h"
#include "order_tree.h"

// Computed norms: one instantiation per squares-per-lane count 1, 2, 4, ...,
// up to kKeyNormsMaxDim / 32, as the key-norm kernel's (key_norms.metal);
// the host name ends in the count. Given norms: one.
static_assert(kKeyNormsMaxDim == 16 * kSimdWidth, "instantiate every count up to 16");
#define KNORM_EVICT_INSTANCE(name, type, per_lane)                               \
  KNORM_KERNEL_INSTANCE("knorm_evict_and_fill_" #name, knorm_evict_and_fill<type, per_lane>) \
  KNORM_KERNEL_INSTANCE("knorm_fill_new_rows_" #name, knorm_fill_new_rows<type, per_lane>)
#define KNORM_EVICT_INSTANCES(name, type)       \
  KNORM_EVICT_INSTANCE(name##_1, type, 1)       \
  KNORM_EVICT_INSTANCE(name##_2, type, 2)       \
  KNORM_EVICT_INSTANCE(name##_4, type, 4)       \
  KNORM_EVICT_INSTANCE(name##_8, type, 8)       \
  KNORM_EVICT_INSTANCE(name##_16, type, 16)

KNORM_EVICT_INSTANCES(float16, half)
KNORM_EVICT_INSTANCES(bfloat16, bfloat)
KNORM_EVICT_INSTANCES(float32, float)
KNORM_EVICT_INSTANCE(given, KnormGivenNorms, 1)
KNORM_KERNEL_INSTANCE("knorm_copy_kept_rows", knorm_copy_kept_rows<kEvictGroupSize>)
KNORM_KERNEL_INSTANCE("knorm_shift_kept_rows", knorm_shift_kept_rows<kEvictGroupSize>)
KNORM_KERNEL_INSTANCE("knorm_stage_compaction", knorm_stage_compaction<kEvictGroupSize>)
KNORM_KERNEL_INSTANCE("knorm_compact_kept_rows", knorm_compact_kept_rows<kEvictGroupSize>)
KNORM_KERNEL_INSTANCE("knorm_build_order_tree", knorm_build_order_tree<kEvictGroupSize>)
