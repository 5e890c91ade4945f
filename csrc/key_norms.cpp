#include "key_norms.h"

#include <stdexcept>

#include "launch_plan.h"
#include "validate.h"

namespace mlx_knorm {

mx::array key_norms(const mx::array& keys, Executor executor, mx::StreamOrDevice s) {
  check_executor(executor);
  auto stream = mx::to_stream(s);
  auto primitive = std::make_shared<KeyNorms>(stream, executor);
  primitive->check_inputs({keys});
  mx::Shape out_shape(keys.shape().begin(), keys.shape().end() - 1);
  return mx::array(
      out_shape, mx::float32, primitive, {row_contiguous(keys, stream)});
}

void KeyNorms::check_inputs(const std::vector<mx::array>& inputs) {
  const auto& keys = inputs[0];
  check_key_norms_args(keys);
  if (executor_ == Executor::MetalEmulator ||
      stream().device == mx::Device::gpu) {
    const int64_t dim = keys.shape(-1);
    check_metal_key_norms_shape(
        dim == 0 ? 0 : static_cast<int64_t>(keys.size()) / dim, dim);
  }
}

bool KeyNorms::is_equivalent(const mx::Primitive& other) const {
  return executor_ == static_cast<const KeyNorms&>(other).executor_;
}

// Also called by mx.compile(shapeless=True) for every new input shape,
// without the op's argument checks having run.
std::vector<mx::Shape> KeyNorms::output_shapes(
    const std::vector<mx::array>& inputs) {
  check_inputs(inputs);
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
