// The Metal source that the JIT path compiles for metal/<name>.metal.
// MLX's Device::get_library(name, builder) compiles one string with no
// include path, so each line including a header of metal/ (the op's
// kernels, then the shared ones, installed beside the sources) is replaced
// by the header's text, itself inlined the same way. Plain C++, built on
// every platform so that tests can check it.
#pragma once

#include <filesystem>
#include <string>

namespace mlx_knorm {

// Reads metal_dir/<name>.metal and the headers it includes; throws
// std::runtime_error when a file is missing or the source does not reach
// knorm_defines.h.
std::string metal_kernel_source(
    const std::filesystem::path& metal_dir,
    const std::string& name);

} // namespace mlx_knorm
