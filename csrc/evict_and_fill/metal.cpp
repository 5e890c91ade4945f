// EvictAndFill on Apple GPUs: eval_gpu, which dispatches the launch plans of
// plan.cpp through MLX's Metal command encoder. Built where MLX has Metal
// (csrc/no_metal/primitives.cpp stands in elsewhere).
#include "evict_and_fill/evict_and_fill.h"

#include "common/metal_dispatch.h"
#include "common/multi_output.h"
#include "common/validation.h"

namespace mlx_knorm {

void EvictAndFill::eval_gpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  const auto in = EvictAndFillInputs::from(inputs);
  check_inputs(in);
  check_row_contiguous(inputs, name());
  // As on the CPU: every output may take over its input's buffer
  // (docs/spec.md §7), and the kernel then writes only the rows that move.
  take_over_or_allocate(inputs, outputs, [](size_t) { return true; });
  dispatch_on_gpu(evict_and_fill_plan(in, outputs, config_), inputs, outputs, stream());
}

} // namespace mlx_knorm
