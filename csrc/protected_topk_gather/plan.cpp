// The launch plans of ProtectedTopKGather's Metal kernels
// (metal/protected_topk_gather.h): what eval_gpu (metal.cpp) dispatches
// and the emulator runs (emulated.cpp). Built everywhere.
#include "protected_topk_gather/protected_topk_gather.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/dtype.h"
#include "metal/knorm_defines.h"

namespace mlx_knorm {

LaunchPlans protected_topk_gather_plan(
    const GatherInputs& inputs,
    const std::vector<mx::array>& outputs,
    const SelectionConfig& config,
    uint64_t max_buffer_bytes) {
  // check_inputs keeps n_prior + S below 2^31 (docs/spec.md §5), so every
  // count below fits the kernels' uint32 constants.
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
  // Keys or values in place with few heads and more than kSplitRows kept:
  // their prior rows that move are staged in a scratch buffer over many
  // threadgroups (knorm_stage_prior_rows), then written with the rest
  // (knorm_gather_rows), rather than compacted by one threadgroup a head.
  // The scratch then holds the kept K/V of the outputs in place (one
  // layer's); past what its offsets can address or the device allocate,
  // the selection compacts them. Rows of no bytes (D = 0, whose empty buffers count as in place)
  // have nothing to stage.
  const uint64_t head_rows = static_cast<uint64_t>(inputs.n_heads()) * sel.kept;
  const uint64_t key_row_bytes = inputs.key_dim() * inputs.prior_keys.itemsize();
  const uint64_t value_row_bytes = inputs.value_dim() * inputs.prior_values.itemsize();
  const uint32_t with_rows = (key_row_bytes > 0 ? 1u : 0u) | (value_row_bytes > 0 ? 2u : 0u);
  uint32_t staged = split_blocks(inputs.n_heads(), sel.kept) != 0 ? in_place & with_rows : 0u;
  uint64_t units = 0;
  uint64_t staged_key_units = 0;
  uint64_t staged_value_units = 0;
  if (staged & 1u) {
    staged_key_units = units;
    units += scratch_units(head_rows * key_row_bytes);
  }
  if (staged & 2u) {
    staged_value_units = units;
    units += scratch_units(head_rows * value_row_bytes);
  }
  if (!scratch_fits(units, max_buffer_bytes)) {
    staged = 0;
  }
  // Outputs in place hold their kept prior rows after the selection's
  // compaction, so of them only the new rows, at most min(S, kept) at the
  // end, are copied.
  const bool kv_in_place = (in_place & 3u) == 3u && staged == 0;
  const int64_t first_row =
      kv_in_place ? sel.kept - std::min<int64_t>(inputs.n_new(), sel.kept) : 0;
  const uint32_t groups_per_head = split_blocks(inputs.n_heads(), sel.kept - first_row);
  const bool split = groups_per_head != 0;
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
  KnormGatherParams params{};
  params.n_prior = static_cast<uint32_t>(inputs.n_prior());
  params.n_new = static_cast<uint32_t>(inputs.n_new());
  params.key_dim = static_cast<uint32_t>(inputs.key_dim());
  params.value_dim = static_cast<uint32_t>(inputs.value_dim());
  params.kept = static_cast<uint32_t>(sel.kept);
  params.sink_end = static_cast<uint32_t>(sink_end);
  params.mid_end = static_cast<uint32_t>(mid_end);
  params.mid_keep = static_cast<uint32_t>(mid_keep);
  params.keep_high = config.keep == Keep::High ? 1 : 0;
  params.in_place = in_place;
  params.key_unit = key_unit;
  params.value_unit = value_unit;
  params.copy_rows = split ? 0 : 1;
  params.first_row = static_cast<uint32_t>(first_row);
  params.groups_per_head = groups_per_head;
  const int64_t n_total = sel.n_total;
  params.cache_norms = mid_keep > 0 && n_total <= kGatherCachedNorms ? 1 : 0;
  params.stage_prior = staged;
  params.staged_key_units = staged != 0 ? static_cast<uint32_t>(staged_key_units) : 0;
  params.staged_value_units = staged != 0 ? static_cast<uint32_t>(staged_value_units) : 0;
  select.buffers = array_slots(arrays, outputs);
  select.buffers.push_back(BufferSlot::block(params));
  // [[threadgroup(0)]]: the cached norms; [[threadgroup(1)]]: a chunk's
  // sources, used only by an output the selection compacts in place.
  select.threadgroup_bytes = {
      threadgroup_length(params.cache_norms != 0 ? n_total * sizeof(float) : 0),
      threadgroup_length((in_place & ~staged) != 0 ? kGatherGroupSize * sizeof(uint32_t) : 0)};
  if (!split) {
    return {select};
  }

  using Kind = BufferSlot::Kind;
  LaunchPlans plans = {select};
  if (staged != 0) {
    plans[0].scratch = {units * kRowUnitWide};
    LaunchPlan stage;
    stage.source = "protected_topk_gather";
    stage.kernel = "knorm_stage_prior_rows_" + types;
    stage.group_size = kGatherGroupSize;
    stage.groups = static_cast<uint32_t>(inputs.n_heads()) * groups_per_head;
    stage.buffers = {
        BufferSlot::of(Kind::Input, arrays, 0),  // prior keys
        BufferSlot::of(Kind::Input, arrays, 1),  // prior values
        BufferSlot::of(Kind::EarlierOutput, outputs, 3),  // indices
        BufferSlot::scratch(0),
        BufferSlot::block(params)};
    plans.push_back(std::move(stage));
  }
  LaunchPlan copy;
  copy.source = "protected_topk_gather";
  copy.kernel = "knorm_gather_rows_" + types;
  copy.group_size = kGatherGroupSize;
  copy.groups = static_cast<uint32_t>(inputs.n_heads()) * groups_per_head;
  copy.buffers = {
      BufferSlot::of(Kind::Input, arrays, 0),  // prior keys
      BufferSlot::of(Kind::Input, arrays, 1),  // prior values
      BufferSlot::of(Kind::Input, arrays, 3),  // new keys
      BufferSlot::of(Kind::Input, arrays, 4),  // new values
      BufferSlot::of(Kind::EarlierOutput, outputs, 3),  // indices
      BufferSlot::of(Kind::Output, outputs, 0),
      BufferSlot::of(Kind::Output, outputs, 1),
      BufferSlot::block(params),
      staged != 0 ? BufferSlot::scratch(0) : BufferSlot::unused(Kind::Output, mx::uint8)};
  plans.push_back(std::move(copy));
  return plans;
}

} // namespace mlx_knorm
