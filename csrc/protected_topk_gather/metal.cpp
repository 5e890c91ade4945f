// ProtectedTopKGather on Apple GPUs: eval_gpu, which dispatches the launch
// plans of plan.cpp through MLX's Metal command encoder. Built where MLX has
// Metal (csrc/no_metal/primitives.cpp stands in elsewhere).
#include "protected_topk_gather/protected_topk_gather.h"

#include "common/metal_dispatch.h"
#include "common/multi_output.h"

namespace mlx_knorm {

void ProtectedTopKGather::eval_gpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto lent = prepare_eval(inputs, outputs);
  dispatch_on_gpu(
      protected_topk_gather_plan(GatherInputs::from(inputs), outputs, config_,
                                 max_buffer_bytes(stream())),
      inputs, outputs, stream());
  lent.keep();
}

} // namespace mlx_knorm
