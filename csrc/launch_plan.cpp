#include "launch_plan.h"

#include <limits>
#include <stdexcept>

#include "selection.h"

namespace mlx_knorm {

namespace {

// One SIMD group per row; four rows per threadgroup keep the groups small
// enough for many to be resident.
constexpr uint32_t kNormRowsPerGroup = 4;
// Must equal kGatherGroupSize in metal/protected_topk_gather.metal.
constexpr uint32_t kGatherGroupSize = 256;

const char* type_name(ElemType t) {
  switch (t) {
    case ElemType::Float16:
      return "float16";
    case ElemType::BFloat16:
      return "bfloat16";
    case ElemType::Float32:
      return "float32";
  }
  return "";
}

constexpr int64_t kUintMax = std::numeric_limits<uint32_t>::max();

} // namespace

void check_metal_key_norms_shape(int64_t rows, int64_t dim) {
  if (dim > kMetalMaxDim) {
    throw std::invalid_argument(
        "mlx_knorm: the Metal key-norm kernel supports D <= 512, got D = " +
        std::to_string(dim));
  }
  if (rows > kUintMax) {
    throw std::invalid_argument(
        "mlx_knorm: the Metal key-norm kernel supports < 2^32 rows");
  }
}

void check_metal_gather_shape(int64_t n_rows, int64_t n_prior, int64_t n_new) {
  if (n_rows > kUintMax || n_prior + n_new > kUintMax) {
    throw std::invalid_argument(
        "mlx_knorm: the Metal gather kernel supports < 2^32 rows and tokens");
  }
}

LaunchPlan key_norms_plan(ElemType keys, int64_t rows, int64_t dim) {
  check_metal_key_norms_shape(rows, dim);
  LaunchPlan plan;
  plan.source = "key_norms";
  plan.kernel = std::string("knorm_key_norms_") + type_name(keys);
  plan.group_size = kNormRowsPerGroup * 32;
  // D = 0 still launches: the kernel reduces an all-padding row to sqrt(0).
  plan.groups =
      static_cast<uint32_t>((rows + kNormRowsPerGroup - 1) / kNormRowsPerGroup);
  plan.buffers = {
      BufferSlot::input(0),
      BufferSlot::output(0),
      BufferSlot::constant(static_cast<uint32_t>(dim)),
      BufferSlot::constant(static_cast<uint32_t>(rows)),
      BufferSlot::constant(kNormRowsPerGroup)};
  return plan;
}

LaunchPlan protected_topk_gather_plan(
    ElemType keys,
    ElemType values,
    int64_t n_rows,
    int64_t n_prior,
    int64_t n_new,
    int64_t key_dim,
    int64_t value_dim,
    int budget,
    int n_sink,
    int recent,
    Keep keep) {
  check_metal_gather_shape(n_rows, n_prior, n_new);
  const RowSelection sel(n_prior + n_new, budget, n_sink, recent);
  LaunchPlan plan;
  plan.source = "protected_topk_gather";
  plan.kernel = std::string("knorm_protected_topk_gather_") + type_name(keys) +
      "_" + type_name(values);
  plan.group_size = kGatherGroupSize;
  plan.groups = sel.kept == 0 ? 0 : static_cast<uint32_t>(n_rows);
  // Without eviction every row is protected and nothing is selected.
  const int64_t sink_end = sel.evicts ? sel.n_sink : sel.n_total;
  const int64_t mid_end = sel.evicts ? sel.mid_end : sel.n_total;
  const int64_t mid_keep = sel.evicts ? sel.mid_keep : 0;
  auto u32 = [](int64_t v) { return static_cast<uint32_t>(v); };
  plan.buffers = {
      BufferSlot::input(0),
      BufferSlot::input(1),
      BufferSlot::input(2),
      BufferSlot::input(3),
      BufferSlot::input(4),
      BufferSlot::input(5),
      BufferSlot::output(0),
      BufferSlot::output(1),
      BufferSlot::output(2),
      BufferSlot::output(3),
      BufferSlot::constant(u32(n_prior)),
      BufferSlot::constant(u32(n_new)),
      BufferSlot::constant(u32(key_dim)),
      BufferSlot::constant(u32(value_dim)),
      BufferSlot::constant(u32(sel.kept)),
      BufferSlot::constant(u32(sink_end)),
      BufferSlot::constant(u32(mid_end)),
      BufferSlot::constant(u32(mid_keep)),
      BufferSlot::constant(keep == Keep::High ? 1u : 0u)};
  return plan;
}

} // namespace mlx_knorm
