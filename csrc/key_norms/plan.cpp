// The launch plan of KeyNorms' Metal kernel (metal/key_norms.h): what
// eval_gpu (metal.cpp) dispatches and the emulator runs (emulated.cpp).
// Built everywhere.
#include "key_norms/key_norms.h"

#include <stdexcept>
#include <string>

#include "common/dtype.h"
#include "common/validation.h"
#include "metal/knorm_defines.h"

namespace mlx_knorm {

namespace {

// Rows of keys [..., D]: the product of the leading axes (also for D = 0).
int64_t key_rows(const mx::array& keys) {
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < keys.ndim(); ++i) {
    rows *= keys.shape(i);
  }
  return rows;
}

} // namespace

void check_metal_key_norms_shape(const mx::array& keys, const char* name) {
  const int64_t dim = keys.shape(-1);
  if (dim > kKeyNormsMaxDim) {
    throw std::invalid_argument(
        std::string("mlx_knorm: ") + name + ": the Metal key-norm kernel supports D <= " +
        std::to_string(kKeyNormsMaxDim) + ", got D = " + std::to_string(dim));
  }
  if (key_rows(keys) > kMaxRows) {
    throw std::invalid_argument(
        std::string("mlx_knorm: ") + name + ": the Metal key-norm kernel supports < 2^32 rows");
  }
}

LaunchPlan key_norms_plan(const mx::array& keys, const mx::array& norms) {
  check_metal_key_norms_shape(keys, "keys");
  const int64_t rows = static_cast<int64_t>(norms.size());
  LaunchPlan plan;
  plan.source = "key_norms";
  plan.kernel = "knorm_key_norms_" + dtype_name(keys.dtype()) + "_" +
      std::to_string(squares_per_lane(keys.shape(-1)));
  plan.group_size = kKeyNormsRowsPerGroup * kSimdWidth;
  // D = 0 still launches, keys bound to a placeholder: the kernel reduces
  // an all-padding row to sqrt(0).
  plan.groups = static_cast<uint32_t>(
      (rows + kKeyNormsRowsPerGroup - 1) / kKeyNormsRowsPerGroup);
  plan.buffers = array_slots({keys}, {norms});
  plan.buffers.insert(plan.buffers.end(), {
      BufferSlot::constant(static_cast<uint32_t>(keys.shape(-1))),
      BufferSlot::constant(static_cast<uint32_t>(rows))});
  return plan;
}

} // namespace mlx_knorm
