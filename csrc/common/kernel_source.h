// The Metal source that the JIT path compiles for metal/<name>.metal.
// MLX's Device::get_library(name, builder) compiles one string with no
// include path, so the source's line including the shared header
// (metal/knorm_defines.h, installed beside it) is replaced by the header's
// text. Plain C++, built on every platform so that tests can check it.
#pragma once

#include <filesystem>
#include <string>

namespace mlx_knorm {

// Reads metal_dir/<name>.metal and metal_dir/knorm_defines.h; throws
// std::runtime_error when either is missing or the source does not include
// the header.
std::string metal_kernel_source(
    const std::filesystem::path& metal_dir,
    const std::string& name);

} // namespace mlx_knorm
