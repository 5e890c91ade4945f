// The launch plan of RowScores' Metal kernels (metal/row_scores.h): what
// eval_gpu (metal.cpp) dispatches and the emulator runs (emulated.cpp).
// Built everywhere.
#include "row_scores/row_scores.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/dtype.h"
#include "common/validation.h"
#include "metal/knorm_defines.h"

namespace mlx_knorm {

void check_metal_row_scores_shape(const RowScoresInputs& inputs) {
  for (const auto& [name, dim] : {std::pair<const char*, int64_t>{"keys", inputs.key_dim()},
                                  std::pair<const char*, int64_t>{"values", inputs.value_dim()}}) {
    if (dim > kKeyNormsMaxDim) {
      throw std::invalid_argument(
          std::string("mlx_knorm: ") + name + ": the Metal row-score kernels support D <= " +
          std::to_string(kKeyNormsMaxDim) + ", got D = " + std::to_string(dim));
    }
  }
  if (inputs.heads() * inputs.rows() > kMaxRows) {
    throw std::invalid_argument("mlx_knorm: keys: the Metal row-score kernels support < 2^32 rows");
  }
}

LaunchPlan row_scores_plan(
    const RowScoresInputs& inputs,
    const std::vector<mx::array>& outputs,
    const RowScoresConfig& config) {
  check_metal_row_scores_shape(inputs);
  using Kind = BufferSlot::Kind;
  const std::vector<mx::array> arrays = inputs.to_vector();
  const int64_t heads = inputs.heads();
  KnormScoreParams params{};
  params.heads = static_cast<uint32_t>(heads);
  params.rows = static_cast<uint32_t>(inputs.rows());
  params.key_dim = static_cast<uint32_t>(inputs.key_dim());
  params.value_dim = static_cast<uint32_t>(inputs.value_dim());
  params.offset = static_cast<uint32_t>(config.offset);
  params.has_valid = config.has_valid ? 1 : 0;
  // The keys' and the values' elements, one per lane and register: the
  // wider of the two sets the count.
  const uint32_t per_lane = squares_per_lane(std::max(inputs.key_dim(), inputs.value_dim()));
  const std::string type = dtype_name(inputs.keys.dtype());
  // The inputs after the keys, in to_vector's order.
  int next = 1;
  const auto input_or_unused = [&](bool given, mx::Dtype element) {
    return given ? BufferSlot::of(Kind::Input, arrays, next++) : BufferSlot::unused(Kind::Input, element);
  };
  LaunchPlan plan;
  plan.source = "row_scores";
  plan.group_size = kKeyNormsRowsPerGroup * kSimdWidth;
  plan.buffers.push_back(BufferSlot::of(Kind::Input, arrays, 0));
  if (config.scorer == Scorer::KeyDiff) {
    // One SIMD group per head, its rows in order.
    plan.kernel = "knorm_keydiff_scores_" + type + "_" + std::to_string(per_lane);
    plan.groups = static_cast<uint32_t>((heads + kKeyNormsRowsPerGroup - 1) / kKeyNormsRowsPerGroup);
    plan.buffers.push_back(input_or_unused(true, mx::float32));
    plan.buffers.push_back(input_or_unused(config.has_valid, mx::int32));
    plan.buffers.push_back(BufferSlot::of(Kind::Output, outputs, 0));
    plan.buffers.push_back(BufferSlot::of(Kind::Output, outputs, 1));
  } else {
    // One SIMD group per row.
    const int64_t rows = heads * inputs.rows();
    plan.kernel = std::string("knorm_row_scores_") + scorer_name(config.scorer) + "_" + type + "_" +
        std::to_string(per_lane);
    plan.groups = static_cast<uint32_t>((rows + kKeyNormsRowsPerGroup - 1) / kKeyNormsRowsPerGroup);
    plan.buffers.push_back(input_or_unused(config.uses_values(), inputs.keys.dtype()));
    plan.buffers.push_back(input_or_unused(config.uses_state(), mx::float32));
    plan.buffers.push_back(input_or_unused(config.has_valid, mx::int32));
    plan.buffers.push_back(BufferSlot::of(Kind::Output, outputs, 0));
  }
  plan.buffers.push_back(BufferSlot::block(params));
  return plan;
}

} // namespace mlx_knorm
