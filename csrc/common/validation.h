// Argument checks shared by the ops (docs/spec.md §6). They run when an op is
// built, before any work is scheduled, and again when MLX asks for output
// shapes and before eval touches memory. std::invalid_argument is Python's
// ValueError, dtype_error its TypeError.
#pragma once

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/ops.h"

#include "common/selection.h"

namespace mlx_knorm {

struct dtype_error : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// Rows of one head are indexed by uint32 (docs/spec.md §5).
inline constexpr int64_t kMaxRows = std::numeric_limits<uint32_t>::max();
// Rows of one head of a selection (n_prior + S, slots), and bytes of one
// key, value or payload row: below 2^31 (docs/spec.md §5), so that a Metal
// kernel's uint32 counters over them, which step past the end by at most a
// threadgroup's width, never wrap.
inline constexpr int64_t kMaxHeadRows = std::numeric_limits<int32_t>::max();
inline constexpr int64_t kMaxRowBytes = std::numeric_limits<int32_t>::max();
// Rows of `a` ([..., rows, W]) of at most kMaxRowBytes bytes.
void check_row_bytes(const mlx::core::array& a, const char* name);

// Keys and values: float16, bfloat16 or float32.
void check_floating(const mlx::core::array& a, const char* name);
// Norms: float32.
void check_float32(const mlx::core::array& a, const char* name);
// Token positions: int32.
void check_int32(const mlx::core::array& a, const char* name);
void check_rank(const mlx::core::array& a, int ndim, const char* name);
// `a` (a new block) must have the dtype of `b` (the prior state it joins).
void check_same_dtype(
    const mlx::core::array& a,
    const char* a_name,
    const mlx::core::array& b,
    const char* b_name);
// Throws "mlx_knorm: <what>: a_name [shape] vs b_name [shape]".
[[noreturn]] void shape_mismatch(
    const char* what,
    const char* a_name,
    const mlx::core::array& a,
    const char* b_name,
    const mlx::core::array& b);
// a and b agree in their first `axes` axes (heads, then rows), else
// shape_mismatch(what, ...).
void check_leading_axes(
    const char* what,
    const char* a_name,
    const mlx::core::array& a,
    const char* b_name,
    const mlx::core::array& b,
    int axes);
void check_selection_config(const SelectionConfig& config);

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

// Checked again at evaluation, before any memory is touched, because a
// replayed compiled graph reaches eval_cpu and eval_gpu without passing
// through the op builders.
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

} // namespace mlx_knorm
