// EvictAndFill on Apple GPUs: the launch plan of metal/evict_and_fill.metal,
// which the emulator runs too (emulated.cpp), and eval_gpu, which dispatches
// it in builds where MLX has Metal.
#include "evict_and_fill/evict_and_fill.h"

#include <stdexcept>
#include <string>
#include <utility>

#include "common/dtype.h"
#include "common/multi_output.h"
#include "common/validation.h"
#include "metal/knorm_defines.h"
#ifdef MLX_KNORM_METAL
#include "common/metal_dispatch.h"
#endif

namespace mlx_knorm {

LaunchPlans evict_and_fill_plan(
    const StepInputs& inputs,
    const std::vector<mx::array>& outputs,
    const StepConfig& config) {
  // check_inputs keeps every slot count, offset + S and the capacity below
  // 2^31, so each fits the kernel's uint constants.
  const std::vector<mx::array> arrays = inputs.to_vector();
  const int64_t kept = config.kept();
  const std::string types =
      dtype_name(inputs.keys.dtype()) + "_" + dtype_name(inputs.values.dtype());
  const uint32_t key_unit =
      row_unit({&inputs.keys, &inputs.new_keys, &outputs[0]}, inputs.key_dim());
  const uint32_t value_unit =
      row_unit({&inputs.values, &inputs.new_values, &outputs[1]}, inputs.value_dim());
  // The new rows go to slots kept + j whatever steps 1-2 do, so a second
  // dispatch can write them over many threadgroups.
  const uint32_t groups_per_head = split_blocks(inputs.n_heads(), inputs.n_new());
  auto u32 = [](int64_t v) { return BufferSlot::constant(static_cast<uint32_t>(v)); };
  LaunchPlans plans;

  // Steps 1-2 have nothing to do without stored rows, nor when none leaves
  // and every output is its input's buffer (a prompt in chunks).
  const uint32_t in_place = in_place_mask(arrays, outputs, 4);
  const bool steps_1_2 = config.filled > 0 && (kept < config.filled || in_place != 0xFu);
  if (steps_1_2 || groups_per_head == 0) {
    LaunchPlan step;
    step.source = "evict_and_fill";
    step.kernel = "knorm_evict_and_fill_" + types;
    step.group_size = kEvictGroupSize;
    // Nothing stored or new, nothing to do; the plan is still bound (and
    // checked by the emulator).
    step.groups = kept + inputs.n_new() == 0 ? 0 : static_cast<uint32_t>(inputs.n_heads());
    step.buffers = array_slots(arrays, outputs);
    step.buffers.insert(step.buffers.end(), {
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
        u32(in_place),
        u32(key_unit),
        u32(value_unit),
        u32(groups_per_head == 0 ? 1 : 0)});
    plans.push_back(std::move(step));
  }
  if (groups_per_head != 0) {
    LaunchPlan fill;
    fill.source = "evict_and_fill";
    fill.kernel = "knorm_fill_new_rows_" + types;
    fill.group_size = kEvictGroupSize;
    fill.groups = static_cast<uint32_t>(inputs.n_heads()) * groups_per_head;
    using Kind = BufferSlot::Kind;
    fill.buffers = {
        BufferSlot::of(Kind::Input, arrays, 4),  // new keys
        BufferSlot::of(Kind::Input, arrays, 5),  // new values
        BufferSlot::of(Kind::Output, outputs, 0),
        BufferSlot::of(Kind::Output, outputs, 1),
        BufferSlot::of(Kind::Output, outputs, 2),
        BufferSlot::of(Kind::Output, outputs, 3),
        u32(config.out_capacity),
        u32(inputs.n_new()),
        u32(inputs.key_dim()),
        u32(inputs.value_dim()),
        u32(kept),
        u32(config.offset),
        u32(key_unit),
        u32(value_unit),
        u32(groups_per_head)};
    plans.push_back(std::move(fill));
  }
  return plans;
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
  auto lent = take_over_or_allocate(inputs, outputs, [](size_t) { return true; });
  dispatch_on_gpu(evict_and_fill_plan(in, outputs, config_), inputs, outputs, stream());
  lent.keep();
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
