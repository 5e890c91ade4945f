#include "key_norms.h"

#include <stdexcept>

#include "launch_plan.h"
#include "validate.h"

namespace mlx_knorm {

mx::array key_norms(const mx::array& keys, Executor executor, mx::StreamOrDevice s) {
  check_key_norms_args(keys);
  auto stream = mx::to_stream(s);
  check_executor(executor);
  if (executor == Executor::MetalEmulator ||
      stream.device == mx::Device::gpu) {
    const int64_t dim = keys.shape(-1);
    check_metal_key_norms_shape(
        dim == 0 ? 0 : static_cast<int64_t>(keys.size()) / dim, dim);
  }
  mx::Shape out_shape(keys.shape().begin(), keys.shape().end() - 1);
  return mx::array(
      out_shape,
      mx::float32,
      std::make_shared<KeyNorms>(stream, executor),
      {row_contiguous(keys, stream)});
}

bool KeyNorms::is_equivalent(const mx::Primitive& other) const {
  return executor_ == static_cast<const KeyNorms&>(other).executor_;
}

std::vector<mx::Shape> KeyNorms::output_shapes(
    const std::vector<mx::array>& inputs) {
  const auto& shape = inputs[0].shape();
  return {mx::Shape(shape.begin(), shape.end() - 1)};
}

#ifndef MLX_KNORM_METAL
// With Metal, eval_gpu is in metal_kernels.cpp.
void KeyNorms::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(
      "mlx_knorm: KeyNorms has no GPU kernel in this build; "
      "use the fallback backend for GPU streams");
}
#endif

} // namespace mlx_knorm
