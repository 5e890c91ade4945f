// The kernels of metal/ compiled as C++ against the emulator. Nothing but the
// emulator may be included before them: its qualifier macros (device,
// constant, kernel, threadgroup) would rewrite other headers.
#include "metal_emulator/metal_emulator.h"

// Metal attributes such as [[buffer(0)]] mean nothing to a C++ compiler.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wattributes"
namespace mlx_knorm_metal {
#include "metal/evict_and_fill.metal"
#include "metal/key_norms.metal"
#include "metal/protected_topk_gather.metal"
} // namespace mlx_knorm_metal
#pragma GCC diagnostic pop

#undef kernel
#undef device
#undef constant
#undef threadgroup

#include "metal_emulator/dispatch.h"

namespace mlx_knorm {

void run_emulated_kernel(
    const std::string& kernel,
    uint32_t groups,
    uint32_t group_size,
    const std::vector<void*>& buffers) {
  metal_emu::dispatch(kernel, groups, group_size, buffers);
}

} // namespace mlx_knorm
