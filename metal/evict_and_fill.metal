// The instantiations of EvictAndFill's kernels (evict_and_fill.h): the step
// and its fill, one per source of the new rows' norms (the first payload as
// float16, bfloat16 or float32 keys, or given norms), the copy of the kept
// slots and the order tree's build (order_tree.h); under the host names that
// csrc/evict_and_fill/plan.cpp launches. The metallib build and the JIT path
// compile this file; the emulator includes it
// (csrc/metal_emulator/kernels.cpp).
#include "evict_and_fill.h"
#include "order_tree.h"

#define KNORM_EVICT_INSTANCE(name, type)                                       \
  KNORM_KERNEL_INSTANCE("knorm_evict_and_fill_" #name, knorm_evict_and_fill<type>) \
  KNORM_KERNEL_INSTANCE("knorm_fill_new_rows_" #name, knorm_fill_new_rows<type>)

KNORM_EVICT_INSTANCE(float16, half)
KNORM_EVICT_INSTANCE(bfloat16, bfloat)
KNORM_EVICT_INSTANCE(float32, float)
KNORM_EVICT_INSTANCE(given, KnormGivenNorms)
KNORM_KERNEL_INSTANCE("knorm_copy_kept_rows", knorm_copy_kept_rows<kEvictGroupSize>)
KNORM_KERNEL_INSTANCE("knorm_build_order_tree", knorm_build_order_tree<kEvictGroupSize>)
