// The Metal kernels of metal/ compiled as C++ against the emulator of the
// Metal execution model and launched through the same launch plans as
// eval_gpu. Slow; for testing the kernels on machines without an Apple GPU.
#pragma once

#include <vector>

#include "mlx/array.h"

#include "protected_topk_gather.h"

namespace mlx_knorm {

void key_norms_metal_emulated(const mlx::core::array& keys, mlx::core::array& out);

void protected_topk_gather_metal_emulated(
    const std::vector<mlx::core::array>& inputs,
    std::vector<mlx::core::array>& outputs,
    const GatherConfig& config);

} // namespace mlx_knorm
