// Runs a launch plan (common/launch_plan.h) through the emulator: the
// kernels of metal/ compiled as C++, with the same slots bound to the same
// arrays and constants as eval_gpu binds them. Slow; for testing the kernels
// on machines without an Apple GPU.
#pragma once

#include <vector>

#include "mlx/array.h"

#include "common/launch_plan.h"

namespace mlx_knorm {

void run_emulated_plan(
    const LaunchPlan& plan,
    const std::vector<mlx::core::array>& inputs,
    std::vector<mlx::core::array>& outputs);
void run_emulated_plan(
    const LaunchPlans& plans,
    const std::vector<mlx::core::array>& inputs,
    std::vector<mlx::core::array>& outputs);

} // namespace mlx_knorm
