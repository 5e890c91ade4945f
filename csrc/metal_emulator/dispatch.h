// Entry point into the emulated kernels, free of the emulator's Metal
// qualifier macros so that code using MLX headers can call it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mlx_knorm {

// Runs the kernel registered under host name `kernel` over `groups`
// threadgroups of `group_size` threads; buffers[i] is [[buffer(i)]].
void run_emulated_kernel(
    const std::string& kernel,
    uint32_t groups,
    uint32_t group_size,
    const std::vector<void*>& buffers);

} // namespace mlx_knorm
