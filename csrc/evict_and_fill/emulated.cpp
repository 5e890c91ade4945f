// EvictAndFill's Metal kernel run through the emulator, launched with the
// plan that eval_gpu uses (plan.cpp). Built with MLX_KNORM_EMULATOR.
#include "evict_and_fill/evict_and_fill.h"
#include "metal_emulator/run_plan.h"

namespace mlx_knorm {

void evict_and_fill_emulated(
    const EvictAndFillInputs& inputs,
    std::vector<mx::array>& outputs,
    const EvictAndFillConfig& config) {
  run_emulated_plan(
      evict_and_fill_plan(inputs, outputs, config, emulator_debug().max_buffer_bytes),
      inputs.to_vector(), outputs);
}

} // namespace mlx_knorm
