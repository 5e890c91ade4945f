// RowScores' Metal kernels run through the emulator, launched with the plan
// that eval_gpu uses (plan.cpp). Built with MLX_KNORM_EMULATOR.
#include "metal_emulator/run_plan.h"
#include "row_scores/row_scores.h"

namespace mlx_knorm {

void row_scores_emulated(
    const RowScoresInputs& inputs,
    std::vector<mx::array>& outputs,
    const RowScoresConfig& config) {
  run_emulated_plan(row_scores_plan(inputs, outputs, config), inputs.to_vector(), outputs);
}

} // namespace mlx_knorm
