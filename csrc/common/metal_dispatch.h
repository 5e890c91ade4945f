// Encodes a launch plan (common/launch_plan.h) on a GPU stream through MLX's
// Metal command encoder: the shared tail of every eval_gpu. Built only where
// MLX has Metal.
#pragma once

#include <filesystem>
#include <vector>

#include "mlx/array.h"
#include "mlx/stream.h"

#include "common/launch_plan.h"

namespace mlx_knorm {

// The kernel library dispatch_on_gpu uses, found once per process: the
// prebuilt mlx_knorm.metallib, or the folder of .metal sources that the JIT
// path compiles.
struct MetalKernelLibrary {
  bool prebuilt;
  std::filesystem::path path;
};
const MetalKernelLibrary& metal_kernel_library();

// The largest buffer the stream's GPU allocates (maxBufferLength), which
// bounds the scratch a plan may ask for.
uint64_t max_buffer_bytes(const mlx::core::Stream& s);

void dispatch_on_gpu(
    const LaunchPlan& plan,
    const std::vector<mlx::core::array>& inputs,
    std::vector<mlx::core::array>& outputs,
    const mlx::core::Stream& s);
void dispatch_on_gpu(
    const LaunchPlans& plans,
    const std::vector<mlx::core::array>& inputs,
    std::vector<mlx::core::array>& outputs,
    const mlx::core::Stream& s);

} // namespace mlx_knorm
