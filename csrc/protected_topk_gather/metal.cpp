// ProtectedTopKGather on Apple GPUs: the launch plan of
// metal/protected_topk_gather.metal, which the emulator runs too
// (emulated.cpp), and eval_gpu, which dispatches it in builds where MLX has
// Metal.
#include "protected_topk_gather/protected_topk_gather.h"

#include <stdexcept>

#include "common/dtype.h"
#include "common/validation.h"
#include "metal/knorm_defines.h"
#ifdef MLX_KNORM_METAL
#include "common/metal_dispatch.h"
#endif

namespace mlx_knorm {

LaunchPlan protected_topk_gather_plan(
    const GatherInputs& inputs,
    const std::vector<mx::array>& outputs,
    const SelectionConfig& config) {
  // check_inputs keeps n_prior + S within uint32, as the kernel's row
  // indices need.
  const RowSelection sel(static_cast<int64_t>(inputs.n_prior()) + inputs.n_new(), config);
  LaunchPlan plan;
  plan.source = "protected_topk_gather";
  plan.kernel = "knorm_protected_topk_gather_" +
      dtype_name(inputs.prior_keys.dtype()) + "_" +
      dtype_name(inputs.prior_values.dtype());
  plan.group_size = kGatherGroupSize;
  plan.groups = sel.kept == 0 ? 0 : static_cast<uint32_t>(inputs.n_heads());
  // Without eviction every row is protected and nothing is selected.
  const int64_t sink_end = sel.evicts ? sel.n_sink : sel.n_total;
  const int64_t mid_end = sel.evicts ? sel.mid_end : sel.n_total;
  const int64_t mid_keep = sel.evicts ? sel.mid_keep : 0;
  // Outputs 0-2 may take over the prior keys, values and norms.
  const std::vector<mx::array> arrays = inputs.to_vector();
  auto u32 = [](int64_t v) { return BufferSlot::constant(static_cast<uint32_t>(v)); };
  plan.buffers = array_slots(arrays, outputs);
  plan.buffers.insert(plan.buffers.end(), {
      u32(inputs.n_prior()),
      u32(inputs.n_new()),
      u32(inputs.key_dim()),
      u32(inputs.value_dim()),
      u32(sel.kept),
      u32(sink_end),
      u32(mid_end),
      u32(mid_keep),
      u32(config.keep == Keep::High ? 1 : 0),
      u32(in_place_mask(arrays, outputs, 3)),
      u32(row_unit({&inputs.prior_keys, &inputs.new_keys, &outputs[0]}, inputs.key_dim())),
      u32(row_unit({&inputs.prior_values, &inputs.new_values, &outputs[1]}, inputs.value_dim()))});
  return plan;
}

#ifdef MLX_KNORM_METAL
void ProtectedTopKGather::eval_gpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  const auto in = GatherInputs::from(inputs);
  check_inputs(in);
  check_row_contiguous(inputs, name());
  allocate_outputs(inputs, outputs);
  dispatch_on_gpu(protected_topk_gather_plan(in, outputs, config_), inputs, outputs, stream());
}
#else
void ProtectedTopKGather::eval_gpu(
    const std::vector<mx::array>&,
    std::vector<mx::array>&) {
  throw std::runtime_error(
      "mlx_knorm: ProtectedTopKGather has no GPU kernel in this build; "
      "use the fallback backend for GPU streams");
}
#endif

} // namespace mlx_knorm
