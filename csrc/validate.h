// Argument checks shared by both ops. They run when an op is built, before any
// work is scheduled, so bad input from Python raises instead of reaching a
// kernel. Shape and dtype errors are ValueError and TypeError in Python.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/ops.h"

namespace mlx_knorm {

// Raised for a non-floating key or value dtype; bound to Python's TypeError.
struct dtype_error : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

enum class Keep { Low, High };

Keep parse_keep(const std::string& keep);
const char* keep_name(Keep keep);

void check_key_norms_args(const mlx::core::array& keys);

// The kernels read inputs as dense row-major buffers. An input already
// evaluated as one is used as it is, which spares a graph node per input on
// every decode step; any other goes through MLX's contiguous op (a view
// when it turns out dense, a copy otherwise).
inline mlx::core::array row_contiguous(const mlx::core::array& x, mlx::core::Stream s) {
  if (x.status() != mlx::core::array::Status::unscheduled && x.flags().row_contiguous) {
    return x;
  }
  return mlx::core::contiguous(x, false, s);
}

// The kernels index inputs as dense row-major buffers; the op builders make
// them so (row_contiguous above). Checked again at evaluation, before any
// memory is touched, because a replayed compiled graph reaches eval_cpu and
// eval_gpu without passing through the op builders.
inline void check_row_contiguous(
    const std::vector<mlx::core::array>& inputs,
    const char* primitive) {
  for (const auto& x : inputs) {
    if (!x.flags().row_contiguous) {
      throw std::invalid_argument(
          std::string("mlx_knorm: ") + primitive +
          " received an input that is not row-contiguous");
    }
  }
}

void check_protected_topk_gather_args(
    const mlx::core::array& prior_keys,
    const mlx::core::array& prior_values,
    const mlx::core::array& prior_norms,
    const mlx::core::array& new_keys,
    const mlx::core::array& new_values,
    const mlx::core::array& new_norms,
    int budget,
    int n_sink,
    int recent);

} // namespace mlx_knorm
