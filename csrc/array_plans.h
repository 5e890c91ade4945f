// The launch plans of a primitive's own arrays: what eval_gpu dispatches and
// what the emulator runs, built in one place so that both launch alike.
#pragma once

#include <stdexcept>
#include <vector>

#include "mlx/array.h"

#include "launch_plan.h"
#include "protected_topk_gather.h"

namespace mlx_knorm {

inline ElemType elem_type(mlx::core::Dtype t) {
  if (t == mlx::core::float16) {
    return ElemType::Float16;
  }
  if (t == mlx::core::bfloat16) {
    return ElemType::BFloat16;
  }
  if (t == mlx::core::float32) {
    return ElemType::Float32;
  }
  throw std::invalid_argument("mlx_knorm: the Metal kernels take float16, bfloat16 or float32");
}

inline LaunchPlan key_norms_plan(const mlx::core::array& keys, const mlx::core::array& norms) {
  return key_norms_plan(
      elem_type(keys.dtype()), static_cast<int64_t>(norms.size()), keys.shape(-1));
}

inline LaunchPlan protected_topk_gather_plan(
    const std::vector<mlx::core::array>& inputs,
    const GatherConfig& config) {
  return protected_topk_gather_plan(
      elem_type(inputs[0].dtype()),
      elem_type(inputs[1].dtype()),
      inputs[0].shape(0),
      inputs[0].shape(1),
      inputs[3].shape(1),
      inputs[0].shape(2),
      inputs[1].shape(2),
      config.budget,
      config.n_sink,
      config.recent,
      config.keep);
}

} // namespace mlx_knorm
