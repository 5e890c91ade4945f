// Runs the Metal kernels through the emulator with the launch plans that
// eval_gpu uses, binding the same arrays and constants to the same slots.
#include "metal_emulated.h"

#include <cstdint>

#include "array_plans.h"
#include "launch_plan.h"
#include "metal_emulator/dispatch.h"

namespace mlx_knorm {

namespace {

void run_plan(
    const LaunchPlan& plan,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  // Constants need stable addresses for the duration of the dispatch.
  std::vector<uint32_t> constants(plan.buffers.size());
  std::vector<void*> buffers;
  for (size_t i = 0; i < plan.buffers.size(); ++i) {
    const BufferSlot& slot = plan.buffers[i];
    switch (slot.kind) {
      case BufferSlot::Kind::Input:
        buffers.push_back(const_cast<void*>(
            static_cast<const void*>(inputs[slot.array].data<char>())));
        break;
      case BufferSlot::Kind::Output:
        buffers.push_back(outputs[slot.array].data<char>());
        break;
      case BufferSlot::Kind::Constant:
        constants[i] = slot.value;
        buffers.push_back(&constants[i]);
        break;
    }
  }
  run_emulated_kernel(plan.kernel, plan.groups, plan.group_size, buffers);
}

} // namespace

void key_norms_metal_emulated(const mx::array& keys, mx::array& out) {
  const auto plan = key_norms_plan(keys, out);
  std::vector<mx::array> outputs{out};
  run_plan(plan, {keys}, outputs);
}

void protected_topk_gather_metal_emulated(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs,
    const GatherConfig& config) {
  const auto plan = protected_topk_gather_plan(inputs, config);
  run_plan(plan, inputs, outputs);
}

} // namespace mlx_knorm
