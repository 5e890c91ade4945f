// The instantiations of ProtectedTopKGather's kernels
// (protected_topk_gather.h), one per key and value dtype, under the host
// names that csrc/protected_topk_gather/plan.cpp launches. The metallib
// build and the JIT path compile this file; the emulator includes it
// (csrc/metal_emulator/kernels.cpp).
#include "protected_topk_gather.h"

#define KNORM_GATHER_INSTANCE(kname, ktype, vname, vtype)                  \
  KNORM_KERNEL_INSTANCE(                                                   \
      "knorm_protected_topk_gather_" #kname "_" #vname,                    \
      knorm_protected_topk_gather<ktype, vtype>)                           \
  KNORM_KERNEL_INSTANCE(                                                   \
      "knorm_gather_rows_" #kname "_" #vname,                              \
      knorm_gather_rows<ktype, vtype>)                                     \
  KNORM_KERNEL_INSTANCE(                                                   \
      "knorm_stage_prior_rows_" #kname "_" #vname,                         \
      knorm_stage_prior_rows<ktype, vtype>)
#define KNORM_GATHER_INSTANCES(kname, ktype)             \
  KNORM_GATHER_INSTANCE(kname, ktype, float16, half)     \
  KNORM_GATHER_INSTANCE(kname, ktype, bfloat16, bfloat)  \
  KNORM_GATHER_INSTANCE(kname, ktype, float32, float)

KNORM_GATHER_INSTANCES(float16, half)
KNORM_GATHER_INSTANCES(bfloat16, bfloat)
KNORM_GATHER_INSTANCES(float32, float)
