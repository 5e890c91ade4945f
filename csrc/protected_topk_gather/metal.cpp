// ProtectedTopKGather on Apple GPUs: the launch plan of
// metal/protected_topk_gather.metal, which the emulator runs too
// (emulated.cpp), and eval_gpu, which dispatches it in builds where MLX has
// Metal.
#include "protected_topk_gather/protected_topk_gather.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/dtype.h"
#include "common/multi_output.h"
#include "common/validation.h"
#include "metal/knorm_defines.h"
#ifdef MLX_KNORM_METAL
#include "common/metal_dispatch.h"
#endif

namespace mlx_knorm {

LaunchPlans protected_topk_gather_plan(
    const GatherInputs& inputs,
    const std::vector<mx::array>& outputs,
    const SelectionConfig& config) {
  // check_inputs keeps n_prior + S within uint32, as the kernel's row
  // indices need.
  const RowSelection sel(static_cast<int64_t>(inputs.n_prior()) + inputs.n_new(), config);
  const std::string types =
      dtype_name(inputs.prior_keys.dtype()) + "_" + dtype_name(inputs.prior_values.dtype());
  const std::vector<mx::array> arrays = inputs.to_vector();
  // Outputs 0-2 may take over the prior keys, values and norms.
  const uint32_t in_place = in_place_mask(arrays, outputs, 3);
  const uint32_t key_unit =
      row_unit({&inputs.prior_keys, &inputs.new_keys, &outputs[0]}, inputs.key_dim());
  const uint32_t value_unit =
      row_unit({&inputs.prior_values, &inputs.new_values, &outputs[1]}, inputs.value_dim());
  // Outputs in place hold their kept prior rows after the selection's
  // compaction, so of them only the new rows, at most min(S, kept) at the
  // end, are copied.
  const bool kv_in_place = (in_place & 3u) == 3u;
  const int64_t first_row =
      kv_in_place ? sel.kept - std::min<int64_t>(inputs.n_new(), sel.kept) : 0;
  const uint32_t groups_per_head = split_blocks(inputs.n_heads(), sel.kept - first_row);
  const bool split = groups_per_head != 0;
  auto u32 = [](int64_t v) { return BufferSlot::constant(static_cast<uint32_t>(v)); };

  LaunchPlan select;
  select.source = "protected_topk_gather";
  select.kernel = "knorm_protected_topk_gather_" + types;
  select.group_size = kGatherGroupSize;
  // Nothing kept, nothing to do; the plan is still bound (and checked by
  // the emulator).
  select.groups = sel.kept == 0 ? 0 : static_cast<uint32_t>(inputs.n_heads());
  // Without eviction every row is protected and nothing is selected.
  const int64_t sink_end = sel.evicts ? sel.n_sink : sel.n_total;
  const int64_t mid_end = sel.evicts ? sel.mid_end : sel.n_total;
  const int64_t mid_keep = sel.evicts ? sel.mid_keep : 0;
  select.buffers = array_slots(arrays, outputs);
  select.buffers.insert(select.buffers.end(), {
      u32(inputs.n_prior()),
      u32(inputs.n_new()),
      u32(inputs.key_dim()),
      u32(inputs.value_dim()),
      u32(sel.kept),
      u32(sink_end),
      u32(mid_end),
      u32(mid_keep),
      u32(config.keep == Keep::High ? 1 : 0),
      u32(in_place),
      u32(key_unit),
      u32(value_unit),
      u32(split ? 0 : 1)});
  if (!split) {
    return {select};
  }

  LaunchPlan copy;
  copy.source = "protected_topk_gather";
  copy.kernel = "knorm_gather_rows_" + types;
  copy.group_size = kGatherGroupSize;
  copy.groups = static_cast<uint32_t>(inputs.n_heads()) * groups_per_head;
  using Kind = BufferSlot::Kind;
  copy.buffers = {
      BufferSlot::of(Kind::Input, arrays, 0),  // prior keys
      BufferSlot::of(Kind::Input, arrays, 1),  // prior values
      BufferSlot::of(Kind::Input, arrays, 3),  // new keys
      BufferSlot::of(Kind::Input, arrays, 4),  // new values
      BufferSlot::of(Kind::EarlierOutput, outputs, 3),  // indices
      BufferSlot::of(Kind::Output, outputs, 0),
      BufferSlot::of(Kind::Output, outputs, 1),
      u32(inputs.n_prior()),
      u32(inputs.n_new()),
      u32(inputs.key_dim()),
      u32(inputs.value_dim()),
      u32(sel.kept),
      u32(in_place),
      u32(key_unit),
      u32(value_unit),
      u32(first_row),
      u32(groups_per_head)};
  return {select, copy};
}

#ifdef MLX_KNORM_METAL
void ProtectedTopKGather::eval_gpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  const auto in = GatherInputs::from(inputs);
  check_inputs(in);
  check_row_contiguous(inputs, name());
  auto lent = allocate_outputs(inputs, outputs);
  dispatch_on_gpu(protected_topk_gather_plan(in, outputs, config_), inputs, outputs, stream());
  lent.keep();
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
