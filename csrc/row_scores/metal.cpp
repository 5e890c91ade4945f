// RowScores on Apple GPUs: eval_gpu, which dispatches the launch plan of
// plan.cpp through MLX's Metal command encoder. Built where MLX has Metal
// (csrc/no_metal/primitives.cpp stands in elsewhere).
#include "row_scores/row_scores.h"

#include "common/metal_dispatch.h"

namespace mlx_knorm {

void RowScores::eval_gpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  prepare_eval(inputs, outputs);
  dispatch_on_gpu(
      row_scores_plan(RowScoresInputs::from(inputs, config_), outputs, config_), inputs, outputs,
      stream());
}

} // namespace mlx_knorm
