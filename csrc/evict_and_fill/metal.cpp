// EvictAndFill on Apple GPUs.
#include "evict_and_fill/evict_and_fill.h"

#include <stdexcept>

namespace mlx_knorm {

void EvictAndFill::eval_gpu(
    const std::vector<mx::array>&,
    std::vector<mx::array>&) {
  throw std::runtime_error(
      "mlx_knorm: EvictAndFill has no GPU kernel in this build; "
      "use the fallback backend for GPU streams");
}

} // namespace mlx_knorm
