// The instantiations of EvictAndFill's kernels (evict_and_fill.h), one per
// key and value dtype, under the host names that csrc/evict_and_fill/plan.cpp
// launches. The metallib build and the JIT path compile this file; the
// emulator includes it (csrc/metal_emulator/kernels.cpp).
#include "evict_and_fill.h"

#define KNORM_EVICT_INSTANCE(kname, ktype, vname, vtype)                   \
  KNORM_KERNEL_INSTANCE(                                                  \
      "knorm_evict_and_fill_" #kname "_" #vname,                           \
      knorm_evict_and_fill<ktype, vtype>)                                  \
  KNORM_KERNEL_INSTANCE(                                                  \
      "knorm_fill_new_rows_" #kname "_" #vname,                            \
      knorm_fill_new_rows<ktype, vtype>)
#define KNORM_EVICT_INSTANCES(kname, ktype)             \
  KNORM_EVICT_INSTANCE(kname, ktype, float16, half)     \
  KNORM_EVICT_INSTANCE(kname, ktype, bfloat16, bfloat)  \
  KNORM_EVICT_INSTANCE(kname, ktype, float32, float)

KNORM_EVICT_INSTANCES(float16, half)
KNORM_EVICT_INSTANCES(bfloat16, bfloat)
KNORM_EVICT_INSTANCES(float32, float)
