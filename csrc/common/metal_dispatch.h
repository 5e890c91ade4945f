// Encodes a launch plan (common/launch_plan.h) on a GPU stream through MLX's
// Metal command encoder: the shared tail of every eval_gpu. Built only where
// MLX has Metal.
#pragma once

#include <vector>

#include "mlx/array.h"
#include "mlx/stream.h"

#include "common/launch_plan.h"

namespace mlx_knorm {

void dispatch_on_gpu(
    const LaunchPlan& plan,
    const std::vector<mlx::core::array>& inputs,
    std::vector<mlx::core::array>& outputs,
    const mlx::core::Stream& s);

} // namespace mlx_knorm
