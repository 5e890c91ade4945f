// KeyNorms on Apple GPUs: eval_gpu, which dispatches the launch plan of
// plan.cpp through MLX's Metal command encoder. Built where MLX has Metal
// (csrc/no_metal/primitives.cpp stands in elsewhere).
#include "key_norms/key_norms.h"

#include "common/metal_dispatch.h"

namespace mlx_knorm {

void KeyNorms::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  prepare_eval(inputs, out);
  std::vector<mx::array> outputs{out};
  dispatch_on_gpu(key_norms_plan(inputs[0], out), inputs, outputs, stream());
}

} // namespace mlx_knorm
