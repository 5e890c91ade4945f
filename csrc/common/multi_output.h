// What the multi-output primitives (protected_topk_gather, evict_and_fill)
// share around their kernels: building their outputs, and letting an output
// take over a donated input's buffer (docs/spec.md §7).
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/primitives.h"

#include "common/huge_pages.h"
#include "common/validation.h"

namespace mlx_knorm {

// The primitive's outputs, of the given dtypes, on row-contiguous forms of
// the inputs (the kernels read dense buffers); their shapes come from the
// primitive's output_shapes, which checks the inputs.
inline std::vector<mlx::core::array> make_outputs(
    const std::shared_ptr<mlx::core::Primitive>& primitive,
    const std::vector<mlx::core::array>& inputs,
    std::vector<mlx::core::Dtype> dtypes,
    mlx::core::Stream stream) {
  std::vector<mlx::core::array> dense;
  for (const auto& x : inputs) {
    dense.push_back(row_contiguous(x, stream));
  }
  auto shapes = primitive->output_shapes(dense);
  return mlx::core::array::make_arrays(
      std::move(shapes), std::move(dtypes), primitive, dense);
}

// Every sibling output holds its own copy of the input list until MLX
// detaches them right after eval; with several outputs no input would ever
// look donatable. Dropping the siblings' copies (never for tracers, whose
// graph is still needed) leaves is_donatable() counting only real outside
// references: the caller's arrays, other consumers.
inline void release_sibling_inputs(
    const std::vector<mlx::core::array>& inputs,
    std::vector<mlx::core::array>& outputs) {
  for (auto& out : outputs) {
    if (&out.inputs() != &inputs && !out.is_tracer()) {
      out.inputs().clear();
    }
  }
}

// Output i shares input i's buffer when allowed(i) and nothing else holds
// that buffer, the shapes and dtypes agree and the buffer holds exactly the
// array (row-contiguous, no broadcast); otherwise it gets a fresh buffer.
template <typename Allowed>
void take_over_or_allocate(
    const std::vector<mlx::core::array>& inputs,
    std::vector<mlx::core::array>& outputs,
    Allowed allowed) {
  release_sibling_inputs(inputs, outputs);
  for (size_t i = 0; i < outputs.size(); ++i) {
    auto& out = outputs[i];
    const bool take_over = i < inputs.size() && allowed(i) &&
        inputs[i].is_donatable() && inputs[i].shape() == out.shape() &&
        inputs[i].dtype() == out.dtype() &&
        inputs[i].data_size() == inputs[i].size();
    if (take_over) {
      out.copy_shared_buffer(inputs[i]);
    } else {
      out.set_data(mlx::core::allocator::malloc(out.nbytes()));
      prefer_huge_pages(out.data<void>(), out.nbytes());
    }
  }
}

} // namespace mlx_knorm
