// What the primitives share around their kernels' outputs: building the
// outputs of the multi-output ones (protected_topk_gather, evict_and_fill),
// letting an output take over a donated input's buffer (docs/spec.md §7),
// and allocating the rest (allocate_output, key_norms' too).
//
// Failures (docs/spec.md §8 "A failed evaluation"): MLX 0.32 keeps an array
// and its inputs for another evaluation when eval_cpu/eval_gpu raises, but
// not when a kernel raises on the stream's thread (the array is already
// marked evaluated and its inputs dropped). So everything here that can fail
// does so on the evaluating thread, before the first write, and leaves the
// graph as MLX gave it.
#pragma once

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
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
  dense.reserve(inputs.size());
  for (const auto& x : inputs) {
    dense.push_back(row_contiguous(x, stream));
  }
  auto shapes = primitive->output_shapes(dense);
  return mlx::core::array::make_arrays(
      std::move(shapes), std::move(dtypes), primitive, dense);
}

// A fresh buffer for `out`. MLX's CPU allocator returns no memory when
// malloc fails (its own ops then write through a null pointer): raise
// instead, before anything is written.
inline void allocate_output(mlx::core::array& out) {
  const size_t bytes = out.nbytes();
  auto data = mlx::core::allocator::malloc(bytes);
  if (bytes > 0 && data.buffer().ptr() == nullptr) {
    throw std::runtime_error(
        "mlx_knorm: cannot allocate " + std::to_string(bytes) + " bytes for an output");
  }
  out.set_data(std::move(data));
  prefer_huge_pages(out.data<void>(), bytes);
}

// Every sibling output holds its own copy of the input list until MLX
// detaches them right after eval; with several outputs no input would ever
// look donatable. Dropping the siblings' copies (never for tracers, whose
// graph is still needed) leaves is_donatable() counting only real outside
// references: the caller's arrays, other consumers. If evaluation raises
// before keep(), the copies are put back, so that MLX, which keeps the
// graph for another evaluation, can run any of the siblings again.
class LentSiblingInputs {
 public:
  LentSiblingInputs(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs)
      : inputs_(inputs), outputs_(&outputs), lent_(outputs.size(), false) {
    for (size_t i = 0; i < outputs.size(); ++i) {
      auto& out = outputs[i];
      if (&out.inputs() != &inputs && !out.is_tracer()) {
        out.inputs().clear();
        lent_[i] = true;
      }
    }
  }
  LentSiblingInputs(LentSiblingInputs&& other) noexcept
      : inputs_(other.inputs_),
        outputs_(std::exchange(other.outputs_, nullptr)),
        lent_(std::move(other.lent_)) {}
  LentSiblingInputs(const LentSiblingInputs&) = delete;
  LentSiblingInputs& operator=(const LentSiblingInputs&) = delete;
  LentSiblingInputs& operator=(LentSiblingInputs&&) = delete;

  // Nothing after this raises: MLX detaches the outputs itself.
  void keep() {
    outputs_ = nullptr;
  }

  ~LentSiblingInputs() {
    if (outputs_ == nullptr) {
      return;
    }
    for (size_t i = 0; i < outputs_->size(); ++i) {
      if (lent_[i]) {
        (*outputs_)[i].inputs() = inputs_;
      }
    }
  }

 private:
  const std::vector<mlx::core::array>& inputs_;
  std::vector<mlx::core::array>* outputs_;
  std::vector<bool> lent_;
};

// Output i shares the buffer of input source(i) (an optional index) when
// nothing else holds that buffer, the shapes and dtypes agree and the buffer
// holds exactly the array (row-contiguous, no broadcast); otherwise it gets
// a fresh buffer. The fresh buffers are allocated first, so a failed
// allocation leaves every input as it was. The caller keep()s the result
// once nothing can raise.
template <typename Source>
[[nodiscard]] LentSiblingInputs take_over_or_allocate(
    const std::vector<mlx::core::array>& inputs,
    std::vector<mlx::core::array>& outputs,
    Source source) {
  LentSiblingInputs lent(inputs, outputs);
  std::vector<std::optional<size_t>> take_over(outputs.size());
  for (size_t i = 0; i < outputs.size(); ++i) {
    const auto& out = outputs[i];
    const std::optional<size_t> from = source(i);
    if (from && *from < inputs.size()) {
      const auto& in = inputs[*from];
      if (in.is_donatable() && in.shape() == out.shape() && in.dtype() == out.dtype() &&
          in.data_size() == in.size()) {
        take_over[i] = from;
      }
    }
    if (!take_over[i]) {
      allocate_output(outputs[i]);
    }
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (take_over[i]) {
      outputs[i].copy_shared_buffer(inputs[*take_over[i]]);
    }
  }
  return lent;
}

} // namespace mlx_knorm
