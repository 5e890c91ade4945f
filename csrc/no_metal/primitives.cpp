// eval_gpu of every primitive in builds without Metal (MLX_BUILD_METAL off),
// in one place as MLX keeps its own (mlx/backend/no_gpu/primitives.cpp);
// builds with Metal compile each op's csrc/<op>/metal.cpp instead. The
// Python layer sends GPU streams to the fallback in such builds, so only a
// direct call of the extension reaches these.
#include <stdexcept>
#include <string>

#include "evict_and_fill/evict_and_fill.h"
#include "key_norms/key_norms.h"
#include "protected_topk_gather/protected_topk_gather.h"
#include "row_scores/row_scores.h"

namespace mlx_knorm {

namespace {

[[noreturn]] void no_gpu_kernel(const char* primitive) {
  throw std::runtime_error(
      std::string("mlx_knorm: ") + primitive +
      " has no GPU kernel in this build; use the fallback backend for GPU streams");
}

} // namespace

#define KNORM_NO_METAL(primitive)                                        \
  void primitive::eval_gpu(const std::vector<mx::array>&, mx::array&) { \
    no_gpu_kernel(#primitive);                                           \
  }

#define KNORM_NO_METAL_MULTI(primitive) \
  void primitive::eval_gpu(             \
      const std::vector<mx::array>&,    \
      std::vector<mx::array>&) {        \
    no_gpu_kernel(#primitive);          \
  }

KNORM_NO_METAL(KeyNorms)
KNORM_NO_METAL_MULTI(ProtectedTopKGather)
KNORM_NO_METAL_MULTI(EvictAndFill)
KNORM_NO_METAL_MULTI(RowScores)

} // namespace mlx_knorm
