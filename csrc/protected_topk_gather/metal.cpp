// ProtectedTopKGather on Apple GPUs: eval_gpu, which dispatches the launch
// plans of plan.cpp through MLX's Metal command encoder. Built where MLX has
// Metal (csrc/no_metal/primitives.cpp stands in elsewhere).
#include "protected_topk_gather/protected_topk_gather.h"

#include "common/metal_dispatch.h"
#include "common/validation.h"

namespace mlx_knorm {

void ProtectedTopKGather::eval_gpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  const auto in = GatherInputs::from(inputs);
  check_inputs(in);
  check_row_contiguous(inputs, name());
  allocate_outputs(inputs, outputs);
  dispatch_on_gpu(protected_topk_gather_plan(in, outputs, config_), inputs, outputs, stream());
}

} // namespace mlx_knorm
