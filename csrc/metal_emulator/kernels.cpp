// The kernels of metal/ compiled as C++ against the emulator. Nothing but the
// emulator may be included before them: its qualifier macros (device,
// constant, kernel, threadgroup) would rewrite other headers.
#include "metal_emulator/metal_emulator.h"

namespace mlx_knorm_metal {
#include "metal/evict_and_fill.metal"
#include "metal/key_norms.metal"
#include "metal/protected_topk_gather.metal"
#include "metal/row_scores.metal"
} // namespace mlx_knorm_metal

#undef kernel
#undef thread
#undef max_total_threads_per_threadgroup
#undef device
#undef constant
#undef threadgroup
#undef half
#undef bfloat

namespace mlx_knorm {

size_t run_emulated_kernel(
    const std::string& kernel,
    uint32_t groups,
    uint32_t group_size,
    const std::vector<EmulatedBuffer>& buffers,
    const std::vector<uint32_t>& threadgroup_bytes,
    bool reverse_groups,
    bool fresh_threads) {
  return metal_emu::dispatch(kernel, groups, group_size, buffers, threadgroup_bytes,
                             reverse_groups, fresh_threads);
}

} // namespace mlx_knorm
