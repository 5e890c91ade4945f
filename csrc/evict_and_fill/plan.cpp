// The launch plans of EvictAndFill's Metal kernels
// (metal/evict_and_fill.h): what eval_gpu (metal.cpp) dispatches and the
// emulator runs (emulated.cpp). Built everywhere.
#include "evict_and_fill/evict_and_fill.h"

#include <string>
#include <utility>

#include "common/dtype.h"
#include "metal/knorm_defines.h"

namespace mlx_knorm {

namespace {

using Kind = BufferSlot::Kind;

// Payload slot i of a kernel (kEvictMaxPayloads of them): array index + i of
// `arrays` as raw bytes, or a placeholder past the step's payloads.
BufferSlot payload_slot(Kind kind, const std::vector<mx::array>& arrays, int index, int i, int m) {
  return i < m ? BufferSlot::bytes_of(kind, arrays, index + i)
               : BufferSlot::unused(kind, mx::uint8);
}

} // namespace

LaunchPlans evict_and_fill_plan(
    const EvictAndFillInputs& inputs,
    const std::vector<mx::array>& outputs,
    const EvictAndFillConfig& config,
    uint64_t max_buffer_bytes) {
  // check_inputs keeps every slot count, offset + S and the capacity below
  // 2^31, so each fits the kernel's uint constants, and at most
  // kEvictMaxPayloads payloads.
  const std::vector<mx::array> arrays = inputs.to_vector();
  const int m = inputs.payloads();
  // Input indices (EvictAndFillInputs): payloads, norms, positions, new
  // payload rows, then new_norms, valid and the tree where present (the
  // tree is rebuilt here, never read).
  const int norms_index = m;
  const int new_rows_index = m + 2;
  const int new_norms_index = 2 * m + 2;
  const int valid_index = new_norms_index + (config.norms_given ? 1 : 0);
  const int64_t kept = config.kept();
  // The temporal layout's decode step (one row leaves) with few heads: the
  // payload rows past the evicted one shift over many threadgroups
  // (knorm_shift_kept_rows), not one per head.
  const uint32_t shift_groups_per_head =
      config.layout == Layout::Temporal && config.filled == kept + 1 && m > 0
      ? split_blocks(inputs.n_heads(), kept)
      : 0;
  // The temporal layout's step with several rows leaving, few heads and
  // more than kSplitRows kept: the payload rows move over many threadgroups
  // too (knorm_compact_kept_rows), those moving in place staged in the
  // scratch buffer first (knorm_stage_compaction), so that no block reads a
  // slot another writes. The scratch then holds each head's kept slots of
  // the payloads in place (one layer's K/V), with room for each row, as
  // which rows move is known only on the GPU; past what its offsets can
  // address or the device allocate, one threadgroup per head. Rows of no
  // bytes (whose empty buffers count as in place) have nothing to stage.
  const bool evicts_many = config.filled > kept + 1;
  const uint32_t all_buffers = (1u << (m + 2)) - 1u;
  const uint32_t in_place = in_place_mask(arrays, outputs, m + 2);
  // Its scratch layout (knorm_compaction_sources): the sources, then each
  // staged payload's rows, offsets in kRowUnitWide-byte units.
  uint32_t staged_payloads = 0;
  const uint64_t head_slots = static_cast<uint64_t>(inputs.n_heads()) * kept;
  uint64_t compact_scratch_units = scratch_units(head_slots * sizeof(uint32_t));
  uint64_t compact_staged_at[kEvictMaxPayloads] = {};
  for (int i = 0; i < m; ++i) {
    if (((in_place >> i) & 1u) && inputs.row_bytes(i) > 0) {
      staged_payloads |= 1u << i;
      compact_staged_at[i] = compact_scratch_units;
      compact_scratch_units += scratch_units(head_slots * inputs.row_bytes(i));
    }
  }
  const uint32_t compact_groups_per_head =
      config.layout == Layout::Temporal && evicts_many && m > 0 &&
          scratch_fits(compact_scratch_units, max_buffer_bytes)
      ? split_blocks(inputs.n_heads(), kept)
      : 0;
  // The new rows go to slots kept + j whatever steps 1-2 do, so a second
  // dispatch can write them over many threadgroups; after a wide shift or
  // compaction, which read slots from kept on, always.
  const uint32_t split_new = split_blocks(inputs.n_heads(), inputs.n_new());
  const bool moves_wide = shift_groups_per_head != 0 || compact_groups_per_head != 0;
  const uint32_t groups_per_head = moves_wide && split_new == 0 ? 1 : split_new;
  // Steps 1-2 have nothing to do without stored rows, nor when none leaves
  // and every output is its input's buffer (a prompt in chunks).
  // Slots [0, kept) of the outputs not in place start as a copy of the
  // input's in the slot layout (and in the temporal one when nothing
  // leaves): with few heads, over many threadgroups in a dispatch of its
  // own. The temporal compaction of an evicting step writes each kept row
  // itself.
  const bool copies_kept = in_place != all_buffers && kept > 0 &&
      (config.layout == Layout::Slots || kept == config.filled);
  const uint32_t copy_groups_per_head = copies_kept ? split_blocks(inputs.n_heads(), kept) : 0;

  KnormEvictParams params{};
  params.slots = static_cast<uint32_t>(inputs.capacity());
  params.out_slots = static_cast<uint32_t>(config.out_capacity);
  params.n_new = static_cast<uint32_t>(inputs.n_new());
  params.filled = static_cast<uint32_t>(config.filled);
  params.kept = static_cast<uint32_t>(kept);
  params.offset = static_cast<uint32_t>(config.offset);
  params.n_sink = static_cast<uint32_t>(config.selection.n_sink);
  params.recent = static_cast<uint32_t>(config.selection.recent);
  params.keep_high = config.selection.keep == Keep::High ? 1 : 0;
  params.temporal = config.layout == Layout::Temporal ? 1 : 0;
  params.in_place = in_place;
  params.payloads = static_cast<uint32_t>(m);
  params.norms_given = config.norms_given ? 1 : 0;
  params.has_valid = config.has_valid ? 1 : 0;
  params.fill_new = groups_per_head == 0 ? 1 : 0;
  params.groups_per_head = groups_per_head;
  params.kept_copied = copy_groups_per_head != 0 ? 1 : 0;
  params.copy_groups_per_head = copy_groups_per_head;
  // Several rows leave: the radix select reads every rank eight times and
  // the compaction again, from threadgroup memory where they fit.
  params.cache_ranks = evicts_many && config.filled <= kEvictCachedRanks ? 1 : 0;
  params.shift_groups_per_head = shift_groups_per_head;
  params.compact_groups_per_head = compact_groups_per_head;
  for (int i = 0; i < m; ++i) {
    params.row_bytes[i] = static_cast<uint32_t>(inputs.row_bytes(i));
    params.row_unit[i] = row_unit_bytes(
        {&inputs.rows[i], &inputs.new_rows[i], &outputs[i]},
        static_cast<int64_t>(inputs.row_bytes(i)));
  }
  // The new rows' norms: given, or computed from the first payload's keys.
  // Computed norms take the key-norm kernel's squares per lane for D.
  const std::string norms_from = config.norms_given
      ? std::string("given")
      : dtype_name(inputs.rows[0].dtype()) + "_" +
          std::to_string(squares_per_lane(inputs.rows[0].shape(-1)));
  // The scratch buffer, in kRowUnitWide-byte units (every offset fits a
  // uint32: scratch_buffers refuses more than kMaxScratchUnits). The wide
  // shift's (metal/evict_and_fill.h, knorm_shift_boundary): the evicted
  // slots, then each payload's block boundaries. The wide compaction's:
  // laid out above.
  uint64_t units = 0;
  if (shift_groups_per_head != 0) {
    const uint64_t blocks = static_cast<uint64_t>(inputs.n_heads()) * shift_groups_per_head;
    units = scratch_units(static_cast<uint64_t>(inputs.n_heads()) * sizeof(uint32_t));
    for (int i = 0; i < m; ++i) {
      params.scratch_units[i] = static_cast<uint32_t>(units);
      units += scratch_units(blocks * inputs.row_bytes(i));
    }
  } else if (compact_groups_per_head != 0) {
    units = compact_scratch_units;
    for (int i = 0; i < m; ++i) {
      params.scratch_units[i] = static_cast<uint32_t>(compact_staged_at[i]);
    }
  }
  const uint64_t scratch = units * kRowUnitWide;
  const bool stages_compaction = compact_groups_per_head != 0 && staged_payloads != 0;
  LaunchPlans plans;

  if (copy_groups_per_head != 0) {
    LaunchPlan copy;
    copy.source = "evict_and_fill";
    copy.kernel = "knorm_copy_kept_rows";
    copy.group_size = kEvictGroupSize;
    copy.groups = static_cast<uint32_t>(inputs.n_heads()) * copy_groups_per_head;
    for (int i = 0; i < static_cast<int>(kEvictMaxPayloads); ++i) {
      copy.buffers.push_back(payload_slot(Kind::Input, arrays, 0, i, m));
    }
    copy.buffers.push_back(BufferSlot::of(Kind::Input, arrays, norms_index));
    copy.buffers.push_back(BufferSlot::of(Kind::Input, arrays, norms_index + 1));
    for (int i = 0; i < static_cast<int>(kEvictMaxPayloads); ++i) {
      copy.buffers.push_back(payload_slot(Kind::Output, outputs, 0, i, m));
    }
    copy.buffers.push_back(BufferSlot::of(Kind::Output, outputs, m));
    copy.buffers.push_back(BufferSlot::of(Kind::Output, outputs, m + 1));
    copy.buffers.push_back(BufferSlot::block(params));
    plans.push_back(std::move(copy));
  }
  // After that copy, a step where nothing leaves has nothing left for
  // steps 1-2.
  const bool steps_1_2 = config.filled > 0 &&
      (kept < config.filled || (in_place != all_buffers && copy_groups_per_head == 0));
  if (steps_1_2 || groups_per_head == 0) {
    LaunchPlan evict;
    evict.source = "evict_and_fill";
    evict.kernel = "knorm_evict_and_fill_" + norms_from;
    evict.group_size = kEvictGroupSize;
    // Nothing stored or new, nothing to do; the plan is still bound (and
    // checked by the emulator).
    evict.groups = kept + inputs.n_new() == 0 ? 0 : static_cast<uint32_t>(inputs.n_heads());
    for (int i = 0; i < static_cast<int>(kEvictMaxPayloads); ++i) {
      evict.buffers.push_back(payload_slot(Kind::Input, arrays, 0, i, m));
    }
    evict.buffers.push_back(BufferSlot::of(Kind::Input, arrays, norms_index));
    evict.buffers.push_back(BufferSlot::of(Kind::Input, arrays, norms_index + 1));
    for (int i = 0; i < static_cast<int>(kEvictMaxPayloads); ++i) {
      evict.buffers.push_back(payload_slot(Kind::Input, arrays, new_rows_index, i, m));
    }
    evict.buffers.push_back(config.norms_given
                                ? BufferSlot::of(Kind::Input, arrays, new_norms_index)
                                : BufferSlot::unused(Kind::Input, mx::float32));
    evict.buffers.push_back(config.has_valid ? BufferSlot::of(Kind::Input, arrays, valid_index)
                                             : BufferSlot::unused(Kind::Input, mx::int32));
    for (int i = 0; i < static_cast<int>(kEvictMaxPayloads); ++i) {
      evict.buffers.push_back(payload_slot(Kind::Output, outputs, 0, i, m));
    }
    evict.buffers.push_back(BufferSlot::of(Kind::Output, outputs, m));
    evict.buffers.push_back(BufferSlot::of(Kind::Output, outputs, m + 1));
    evict.buffers.push_back(BufferSlot::block(params));
    if (scratch != 0) {
      evict.buffers.push_back(BufferSlot::scratch(0));
      evict.scratch = {scratch};
    } else {
      evict.buffers.push_back(BufferSlot::unused(Kind::Output, mx::uint8));
    }
    // [[threadgroup(0)]]: the cached ranks; [[threadgroup(1)]]: the slot
    // layout's two queues when several rows leave, or the temporal
    // compaction's chunk of kept slots (which runs unless the copy of the
    // kept rows was the whole of it).
    const bool temporal_compaction = config.layout == Layout::Temporal &&
        copy_groups_per_head == 0 && config.filled > 0;
    const uint64_t list_entries = config.layout == Layout::Slots
        ? (evicts_many ? 2 * kEvictQueue : 0)
        : (temporal_compaction ? kEvictGroupSize : 0);
    evict.threadgroup_bytes = {
        threadgroup_length(params.cache_ranks != 0 ? config.filled * sizeof(uint64_t) : 0),
        threadgroup_length(list_entries * sizeof(uint32_t))};
    plans.push_back(std::move(evict));
  }
  if (shift_groups_per_head != 0) {
    LaunchPlan shift;
    shift.source = "evict_and_fill";
    shift.kernel = "knorm_shift_kept_rows";
    shift.group_size = kEvictGroupSize;
    shift.groups = static_cast<uint32_t>(inputs.n_heads()) * shift_groups_per_head;
    for (int i = 0; i < static_cast<int>(kEvictMaxPayloads); ++i) {
      shift.buffers.push_back(payload_slot(Kind::Input, arrays, 0, i, m));
    }
    for (int i = 0; i < static_cast<int>(kEvictMaxPayloads); ++i) {
      shift.buffers.push_back(payload_slot(Kind::Output, outputs, 0, i, m));
    }
    shift.buffers.push_back(BufferSlot::scratch(0));
    shift.buffers.push_back(BufferSlot::block(params));
    plans.push_back(std::move(shift));
  }
  if (stages_compaction) {
    LaunchPlan stage;
    stage.source = "evict_and_fill";
    stage.kernel = "knorm_stage_compaction";
    stage.group_size = kEvictGroupSize;
    stage.groups = static_cast<uint32_t>(inputs.n_heads()) * compact_groups_per_head;
    for (int i = 0; i < static_cast<int>(kEvictMaxPayloads); ++i) {
      stage.buffers.push_back(payload_slot(Kind::Input, arrays, 0, i, m));
    }
    stage.buffers.push_back(BufferSlot::scratch(0));
    stage.buffers.push_back(BufferSlot::block(params));
    plans.push_back(std::move(stage));
  }
  if (compact_groups_per_head != 0) {
    LaunchPlan compact;
    compact.source = "evict_and_fill";
    compact.kernel = "knorm_compact_kept_rows";
    compact.group_size = kEvictGroupSize;
    compact.groups = static_cast<uint32_t>(inputs.n_heads()) * compact_groups_per_head;
    for (int i = 0; i < static_cast<int>(kEvictMaxPayloads); ++i) {
      compact.buffers.push_back(payload_slot(Kind::Input, arrays, 0, i, m));
    }
    for (int i = 0; i < static_cast<int>(kEvictMaxPayloads); ++i) {
      compact.buffers.push_back(payload_slot(Kind::Output, outputs, 0, i, m));
    }
    compact.buffers.push_back(BufferSlot::scratch(0));
    compact.buffers.push_back(BufferSlot::block(params));
    plans.push_back(std::move(compact));
  }
  if (groups_per_head != 0) {
    LaunchPlan fill;
    fill.source = "evict_and_fill";
    fill.kernel = "knorm_fill_new_rows_" + norms_from;
    fill.group_size = kEvictGroupSize;
    fill.groups = static_cast<uint32_t>(inputs.n_heads()) * groups_per_head;
    for (int i = 0; i < static_cast<int>(kEvictMaxPayloads); ++i) {
      fill.buffers.push_back(payload_slot(Kind::Input, arrays, new_rows_index, i, m));
    }
    fill.buffers.push_back(config.norms_given
                               ? BufferSlot::of(Kind::Input, arrays, new_norms_index)
                               : BufferSlot::unused(Kind::Input, mx::float32));
    for (int i = 0; i < static_cast<int>(kEvictMaxPayloads); ++i) {
      fill.buffers.push_back(payload_slot(Kind::Output, outputs, 0, i, m));
    }
    fill.buffers.push_back(BufferSlot::of(Kind::Output, outputs, m));
    fill.buffers.push_back(BufferSlot::of(Kind::Output, outputs, m + 1));
    fill.buffers.push_back(BufferSlot::block(params));
    plans.push_back(std::move(fill));
  }
  if (config.order_tree) {
    // Over the output's rows, once the dispatches above wrote them; with no
    // row the norms and positions are never read.
    const bool rows_written = kept + inputs.n_new() > 0;
    LaunchPlan tree;
    tree.source = "evict_and_fill";
    tree.kernel = "knorm_build_order_tree";
    tree.group_size = kEvictGroupSize;
    tree.groups = static_cast<uint32_t>(inputs.n_heads());
    tree.buffers.push_back(rows_written ? BufferSlot::of(Kind::EarlierOutput, outputs, m)
                                        : BufferSlot::unused(Kind::Input, mx::float32));
    tree.buffers.push_back(rows_written ? BufferSlot::of(Kind::EarlierOutput, outputs, m + 1)
                                        : BufferSlot::unused(Kind::Input, mx::int32));
    tree.buffers.push_back(config.has_valid ? BufferSlot::of(Kind::Input, arrays, valid_index)
                                            : BufferSlot::unused(Kind::Input, mx::int32));
    tree.buffers.push_back(BufferSlot::of(Kind::Output, outputs, m + 2));
    tree.buffers.push_back(BufferSlot::block(params));
    plans.push_back(std::move(tree));
  }
  return plans;
}

} // namespace mlx_knorm
