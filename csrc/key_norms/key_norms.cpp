#include "key_norms/key_norms.h"

#include "common/cpu_dispatch.h"
#include "common/multi_output.h"
#include "common/validation.h"

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
  const auto& keys = inputs.at(0);
  check_floating(keys, "keys");
  if (keys.ndim() < 1) {
    throw std::invalid_argument(
        "mlx_knorm: keys must have at least one axis [..., D], got a scalar");
  }
  if (executor_ == Executor::MetalEmulator ||
      stream().device == mx::Device::gpu) {
    check_metal_key_norms_shape(keys, "keys");
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

void KeyNorms::prepare_eval(const std::vector<mx::array>& inputs, mx::array& out) {
  check_inputs(inputs);
  check_row_contiguous(inputs, name());
  allocate_output(out);
}

void KeyNorms::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  prepare_eval(inputs, out);
  run_on_cpu(
      stream(), executor_, [&] { return key_norms_cpu_task(inputs[0], out); },
      [&, emulated = KNORM_EMULATED_KERNEL(key_norms_emulated)] { emulated(inputs[0], out); });
}

} // namespace mlx_knorm
