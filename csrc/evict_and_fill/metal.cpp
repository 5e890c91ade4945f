// EvictAndFill on Apple GPUs: the launch plan of metal/evict_and_fill.metal,
// which the emulator runs too (emulated.cpp), and eval_gpu, which dispatches
// it in builds where MLX has Metal.
#include "evict_and_fill/evict_and_fill.h"

#include <stdexcept>

#include "common/dtype.h"
#include "common/multi_output.h"
#include "common/validation.h"
#include "metal/knorm_defines.h"
#ifdef MLX_KNORM_METAL
#include "common/metal_dispatch.h"
#endif

namespace mlx_knorm {

LaunchPlan evict_and_fill_plan(
    const StepInputs& inputs,
    const std::vector<mx::array>& outputs,
    const StepConfig& config) {
  // check_inputs keeps every slot count, offset + S and the capacity below
  // 2^31, so each fits the kernel's uint constants.
  const std::vector<mx::array> arrays = inputs.to_vector();
  const int64_t kept = config.kept();
  LaunchPlan plan;
  plan.source = "evict_and_fill";
  plan.kernel = "knorm_evict_and_fill_" + dtype_name(inputs.keys.dtype()) + "_" +
      dtype_name(inputs.values.dtype());
  plan.group_size = kEvictGroupSize;
  plan.groups = kept + inputs.n_new() == 0 ? 0 : static_cast<uint32_t>(inputs.n_heads());
  auto u32 = [](int64_t v) { return BufferSlot::constant(static_cast<uint32_t>(v)); };
  plan.buffers = array_slots(arrays, outputs);
  plan.buffers.insert(plan.buffers.end(), {
      u32(inputs.capacity()),
      u32(config.out_capacity),
      u32(inputs.n_new()),
      u32(inputs.key_dim()),
      u32(inputs.value_dim()),
      u32(config.filled),
      u32(kept),
      u32(config.offset),
      u32(config.selection.n_sink),
      // An int32 (offset - recent may be negative), as its bits.
      u32(config.rank().protect_from),
      u32(config.selection.keep == Keep::High ? 1 : 0),
      u32(config.layout == Layout::Temporal ? 1 : 0),
      u32(in_place_mask(arrays, outputs, 4)),
      u32(row_unit({&inputs.keys, &inputs.new_keys, &outputs[0]}, inputs.key_dim())),
      u32(row_unit({&inputs.values, &inputs.new_values, &outputs[1]}, inputs.value_dim()))});
  return plan;
}

#ifdef MLX_KNORM_METAL
void EvictAndFill::eval_gpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  const auto in = StepInputs::from(inputs);
  check_inputs(in);
  check_row_contiguous(inputs, name());
  // As on the CPU: every output may take over its input's buffer
  // (docs/spec.md §7), and the kernel then writes only the rows that move.
  take_over_or_allocate(inputs, outputs, [](size_t) { return true; });
  dispatch_on_gpu(evict_and_fill_plan(in, outputs, config_), inputs, outputs, stream());
}
#else
void EvictAndFill::eval_gpu(
    const std::vector<mx::array>&,
    std::vector<mx::array>&) {
  throw std::runtime_error(
      "mlx_knorm: EvictAndFill has no GPU kernel in this build; "
      "use the fallback backend for GPU streams");
}
#endif

} // namespace mlx_knorm
