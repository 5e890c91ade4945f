#include "protected_topk_gather/protected_topk_gather.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>

#include "common/cpu_dispatch.h"
#include "common/multi_output.h"
#include "common/validation.h"

namespace mlx_knorm {

GatherInputs GatherInputs::from(const std::vector<mx::array>& inputs) {
  if (inputs.size() != 6) {
    throw std::invalid_argument(
        "mlx_knorm: ProtectedTopKGather takes 6 inputs, got " +
        std::to_string(inputs.size()));
  }
  return {inputs[0], inputs[1], inputs[2], inputs[3], inputs[4], inputs[5]};
}

std::vector<mx::array> GatherInputs::to_vector() const {
  return {prior_keys, prior_values, prior_norms, new_keys, new_values, new_norms};
}

std::vector<mx::array> protected_topk_gather(
    const GatherInputs& inputs,
    SelectionConfig config,
    Executor executor,
    mx::StreamOrDevice s) {
  check_executor(executor);
  auto stream = mx::to_stream(s);
  auto primitive =
      std::make_shared<ProtectedTopKGather>(stream, config, executor);
  // make_outputs asks the primitive for the output shapes, which checks
  // the inputs (output_shapes) before any output exists.
  return make_outputs(
      primitive,
      inputs.to_vector(),
      {inputs.prior_keys.dtype(), inputs.prior_values.dtype(), mx::float32, mx::uint32},
      stream);
}

void ProtectedTopKGather::check_inputs(const GatherInputs& in) {
  check_rank(in.prior_keys, 3, "prior_keys");
  check_rank(in.prior_values, 3, "prior_values");
  check_rank(in.prior_norms, 2, "prior_norms");
  check_rank(in.new_keys, 3, "new_keys");
  check_rank(in.new_values, 3, "new_values");
  check_rank(in.new_norms, 2, "new_norms");
  check_floating(in.prior_keys, "prior_keys");
  check_floating(in.prior_values, "prior_values");
  check_floating(in.new_keys, "new_keys");
  check_floating(in.new_values, "new_values");
  check_float32(in.prior_norms, "prior_norms");
  check_float32(in.new_norms, "new_norms");
  check_same_dtype(in.new_keys, "new_keys", in.prior_keys, "prior_keys");
  check_same_dtype(in.new_values, "new_values", in.prior_values, "prior_values");
  // Keys and values may differ in width (D_k != D_v, as in multi-head latent
  // attention) but not in heads or rows.
  check_leading_axes("keys/values mismatch in N or rows", "prior_keys",
                     in.prior_keys, "prior_values", in.prior_values, 2);
  check_leading_axes("keys/values mismatch in N or rows", "new_keys",
                     in.new_keys, "new_values", in.new_values, 2);
  if (in.prior_keys.shape(0) != in.new_keys.shape(0) ||
      in.prior_keys.shape(2) != in.new_keys.shape(2)) {
    shape_mismatch("prior vs new mismatch in N or D", "prior_keys", in.prior_keys,
                   "new_keys", in.new_keys);
  }
  if (in.prior_values.shape(2) != in.new_values.shape(2)) {
    shape_mismatch("prior vs new mismatch in N or D", "prior_values", in.prior_values,
                   "new_values", in.new_values);
  }
  check_leading_axes("prior_norms must be [N, n_prior]", "prior_norms",
                     in.prior_norms, "prior_keys", in.prior_keys, 2);
  check_leading_axes("new_norms must be [N, S]", "new_norms", in.new_norms,
                     "new_keys", in.new_keys, 2);
  if (static_cast<int64_t>(in.n_prior()) + in.n_new() > kMaxHeadRows) {
    throw std::invalid_argument(
        "mlx_knorm: n_prior + S (" + std::to_string(static_cast<int64_t>(in.n_prior()) + in.n_new()) +
        ") must be < 2**31");
  }
  check_row_bytes(in.prior_keys, "prior_keys");
  check_row_bytes(in.prior_values, "prior_values");
  check_selection_config(config_);
}

// Also called by mx.compile(shapeless=True) for every new input shape,
// without the op's argument checks having run: the shape relations the
// kernels rely on are checked again here.
std::vector<mx::Shape> ProtectedTopKGather::output_shapes(
    const std::vector<mx::array>& inputs) {
  const auto in = GatherInputs::from(inputs);
  check_inputs(in);
  const int n_heads = in.n_heads();
  const int64_t n_total = static_cast<int64_t>(in.n_prior()) + in.n_new();
  const int kept = static_cast<int>(std::min<int64_t>(n_total, config_.budget));
  return {
      {n_heads, kept, in.key_dim()},
      {n_heads, kept, in.value_dim()},
      {n_heads, kept},
      {n_heads, kept}};
}

LentSiblingInputs ProtectedTopKGather::prepare_eval(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  check_inputs(GatherInputs::from(inputs));
  check_row_contiguous(inputs, name());
  // keys, values and norms (outputs 0-2) may take over the prior's buffer
  // (inputs 0-2) when nothing else holds it and the shape is unchanged (a
  // step from a full cache): the kernels then move only the rows after the
  // first evicted one (docs/spec.md §7).
  return take_over_or_allocate(
      inputs, outputs, [](size_t i) { return i < 3 ? std::optional<size_t>(i) : std::nullopt; });
}

void ProtectedTopKGather::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto lent = prepare_eval(inputs, outputs);
  run_on_cpu(
      stream(), executor_,
      [&] { return protected_topk_gather_cpu_task(GatherInputs::from(inputs), outputs, config_); },
      [&, emulated = KNORM_EMULATED_KERNEL(protected_topk_gather_emulated)] {
        emulated(GatherInputs::from(inputs), outputs, config_);
      });
  lent.keep();
}

} // namespace mlx_knorm
