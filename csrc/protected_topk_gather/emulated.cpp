// ProtectedTopKGather's Metal kernel run through the emulator, launched with
// the plan that eval_gpu uses (plan.cpp). Built with MLX_KNORM_EMULATOR.
#include "metal_emulator/run_plan.h"
#include "protected_topk_gather/protected_topk_gather.h"

namespace mlx_knorm {

void protected_topk_gather_emulated(
    const GatherInputs& inputs,
    std::vector<mx::array>& outputs,
    const SelectionConfig& config) {
  run_emulated_plan(
      protected_topk_gather_plan(inputs, outputs, config, emulator_debug().max_buffer_bytes),
      inputs.to_vector(), outputs);
}

} // namespace mlx_knorm
