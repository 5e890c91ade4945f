// Dtype names as MLX prints them ("float16", "bfloat16", "float32"): used in
// error messages and in the host names of the Metal kernel instantiations.
// MLX's own dtype_to_string (mlx/dtype_utils.h) is not exported from libmlx,
// and Metal's type_to_name (mlx/backend/metal/utils.h) exists only in Metal
// builds, while the launch plans also serve the emulator on Linux; MLX's
// exported operator<< prints the names of dtype_to_string.
#pragma once

#include <sstream>
#include <string>

#include "mlx/dtype.h"
#include "mlx/utils.h"

namespace mlx_knorm {

inline std::string dtype_name(mlx::core::Dtype dtype) {
  std::ostringstream name;
  name << dtype;
  return name.str();
}

} // namespace mlx_knorm
