// Temporary until the emulator lands (issue 3).
#include "metal_emulated.h"

#include <stdexcept>

namespace mlx_knorm {

void key_norms_metal_emulated(const mlx::core::array&, mlx::core::array&) {
  throw std::runtime_error("mlx_knorm: the Metal emulator is not built");
}

void protected_topk_gather_metal_emulated(
    const std::vector<mlx::core::array>&,
    std::vector<mlx::core::array>&,
    const GatherConfig&) {
  throw std::runtime_error("mlx_knorm: the Metal emulator is not built");
}

} // namespace mlx_knorm
