// The launch plans' element type of an MLX dtype.
#pragma once

#include <stdexcept>

#include "mlx/dtype.h"

#include "launch_plan.h"

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

} // namespace mlx_knorm
