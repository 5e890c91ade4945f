#include "protected_topk_gather.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "launch_plan.h"

namespace mlx_knorm {

std::vector<mx::array> protected_topk_gather(
    const mx::array& prior_keys,
    const mx::array& prior_values,
    const mx::array& prior_norms,
    const mx::array& new_keys,
    const mx::array& new_values,
    const mx::array& new_norms,
    GatherConfig config,
    Executor executor,
    mx::StreamOrDevice s) {
  check_executor(executor);
  auto stream = mx::to_stream(s);
  auto primitive =
      std::make_shared<ProtectedTopKGather>(stream, config, executor);
  primitive->check_inputs(
      {prior_keys, prior_values, prior_norms, new_keys, new_values, new_norms});
  auto inputs = std::vector<mx::array>{
      row_contiguous(prior_keys, stream),
      row_contiguous(prior_values, stream),
      row_contiguous(prior_norms, stream),
      row_contiguous(new_keys, stream),
      row_contiguous(new_values, stream),
      row_contiguous(new_norms, stream)};
  auto shapes = primitive->output_shapes(inputs);
  return mx::array::make_arrays(
      std::move(shapes),
      {prior_keys.dtype(), prior_values.dtype(), mx::float32, mx::uint32},
      primitive,
      inputs);
}

void ProtectedTopKGather::check_inputs(
    const std::vector<mx::array>& inputs) {
  check_protected_topk_gather_args(
      inputs[0], inputs[1], inputs[2], inputs[3], inputs[4], inputs[5],
      config_.budget, config_.n_sink, config_.recent);
  if (executor_ == Executor::MetalEmulator ||
      stream().device == mx::Device::gpu) {
    check_metal_gather_shape(
        inputs[0].shape(0), inputs[0].shape(1), inputs[3].shape(1));
  }
}

bool ProtectedTopKGather::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const ProtectedTopKGather&>(other);
  return config_ == o.config_ && executor_ == o.executor_;
}

// Also called by mx.compile(shapeless=True) for every new input shape,
// without the op's argument checks having run: the shape relations the
// kernels rely on are checked again here.
std::vector<mx::Shape> ProtectedTopKGather::output_shapes(
    const std::vector<mx::array>& inputs) {
  check_inputs(inputs);
  const int n_rows = inputs[0].shape(0);
  const int64_t n_total =
      static_cast<int64_t>(inputs[0].shape(1)) + inputs[3].shape(1);
  const int kept = static_cast<int>(std::min<int64_t>(n_total, config_.budget));
  return {
      {n_rows, kept, inputs[0].shape(2)},
      {n_rows, kept, inputs[1].shape(2)},
      {n_rows, kept},
      {n_rows, kept}};
}

#ifndef MLX_KNORM_METAL
// With Metal, eval_gpu is in metal_kernels.cpp.
void ProtectedTopKGather::eval_gpu(
    const std::vector<mx::array>&,
    std::vector<mx::array>&) {
  throw std::runtime_error(
      "mlx_knorm: ProtectedTopKGather has no GPU kernel in this build; "
      "use the fallback backend for GPU streams");
}
#endif

} // namespace mlx_knorm
