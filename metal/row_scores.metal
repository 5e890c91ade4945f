// The instantiations of RowScores' kernels (row_scores.h), one per scorer,
// key dtype and squares-per-lane count, under the host names that
// csrc/row_scores/plan.cpp launches. The metallib build and the JIT path
// compile this file; the emulator includes it
// (csrc/metal_emulator/kernels.cpp).
#include "row_scores.h"

// One instantiation per squares-per-lane count 1, 2, 4, ..., up to
// kKeyNormsMaxDim / 32, as the key-norm kernel's (key_norms.metal).
static_assert(kKeyNormsMaxDim == 16 * kSimdWidth, "instantiate every count up to 16");
#define KNORM_ROW_SCORES_INSTANCE(scorer, kind, name, type, per_lane) \
  KNORM_KERNEL_INSTANCE(                                              \
      "knorm_row_scores_" #scorer "_" #name "_" #per_lane,            \
      knorm_row_scores<type, per_lane, kind>)
#define KNORM_KEYDIFF_INSTANCE(name, type, per_lane) \
  KNORM_KERNEL_INSTANCE(                             \
      "knorm_keydiff_scores_" #name "_" #per_lane,   \
      knorm_keydiff_scores<type, per_lane>)
#define KNORM_SCORE_INSTANCES(name, type)                                  \
  KNORM_ROW_SCORES_INSTANCE(knorm, kScorerKeyNorm, name, type, 1)          \
  KNORM_ROW_SCORES_INSTANCE(knorm, kScorerKeyNorm, name, type, 2)          \
  KNORM_ROW_SCORES_INSTANCE(knorm, kScorerKeyNorm, name, type, 4)          \
  KNORM_ROW_SCORES_INSTANCE(knorm, kScorerKeyNorm, name, type, 8)          \
  KNORM_ROW_SCORES_INSTANCE(knorm, kScorerKeyNorm, name, type, 16)         \
  KNORM_ROW_SCORES_INSTANCE(vnorm, kScorerValueNorm, name, type, 1)        \
  KNORM_ROW_SCORES_INSTANCE(vnorm, kScorerValueNorm, name, type, 2)        \
  KNORM_ROW_SCORES_INSTANCE(vnorm, kScorerValueNorm, name, type, 4)        \
  KNORM_ROW_SCORES_INSTANCE(vnorm, kScorerValueNorm, name, type, 8)        \
  KNORM_ROW_SCORES_INSTANCE(vnorm, kScorerValueNorm, name, type, 16)       \
  KNORM_ROW_SCORES_INSTANCE(qfilter, kScorerQueryFilter, name, type, 1)    \
  KNORM_ROW_SCORES_INSTANCE(qfilter, kScorerQueryFilter, name, type, 2)    \
  KNORM_ROW_SCORES_INSTANCE(qfilter, kScorerQueryFilter, name, type, 4)    \
  KNORM_ROW_SCORES_INSTANCE(qfilter, kScorerQueryFilter, name, type, 8)    \
  KNORM_ROW_SCORES_INSTANCE(qfilter, kScorerQueryFilter, name, type, 16)   \
  KNORM_KEYDIFF_INSTANCE(name, type, 1)                                    \
  KNORM_KEYDIFF_INSTANCE(name, type, 2)                                    \
  KNORM_KEYDIFF_INSTANCE(name, type, 4)                                    \
  KNORM_KEYDIFF_INSTANCE(name, type, 8)                                    \
  KNORM_KEYDIFF_INSTANCE(name, type, 16)

KNORM_SCORE_INSTANCES(float16, half)
KNORM_SCORE_INSTANCES(bfloat16, bfloat)
KNORM_SCORE_INSTANCES(float32, float)
