#include "evict_and_fill/evict_and_fill.h"

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include "common/cpu_dispatch.h"
#include "common/multi_output.h"
#include "common/validation.h"
#include "key_norms/key_norms.h"

namespace mlx_knorm {

namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

} // namespace

Layout parse_layout(const std::string& layout) {
  if (layout == "slots") {
    return Layout::Slots;
  }
  if (layout == "temporal") {
    return Layout::Temporal;
  }
  throw std::invalid_argument(
      "mlx_knorm: layout must be 'slots' or 'temporal', got '" + layout + "'");
}

EvictAndFillInputs EvictAndFillInputs::from(const std::vector<mx::array>& inputs) {
  if (inputs.size() != 6) {
    throw std::invalid_argument(
        "mlx_knorm: EvictAndFill takes 6 inputs, got " +
        std::to_string(inputs.size()));
  }
  return {inputs[0], inputs[1], inputs[2], inputs[3], inputs[4], inputs[5]};
}

std::vector<mx::array> EvictAndFillInputs::to_vector() const {
  return {keys, values, norms, positions, new_keys, new_values};
}

std::vector<mx::array> evict_and_fill(
    const EvictAndFillInputs& inputs,
    EvictAndFillConfig config,
    Executor executor,
    mx::StreamOrDevice s) {
  check_executor(executor);
  auto stream = mx::to_stream(s);
  auto primitive = std::make_shared<EvictAndFill>(stream, config, executor);
  primitive->check_inputs(inputs);
  return make_outputs(
      primitive,
      inputs.to_vector(),
      {inputs.keys.dtype(), inputs.values.dtype(), mx::float32, mx::int32},
      stream);
}

void EvictAndFill::check_inputs(const EvictAndFillInputs& in) {
  if (in.keys.ndim() < 3) {
    throw std::invalid_argument(
        "mlx_knorm: keys must be [..., C, D_k] with at least one head axis, got rank " +
        std::to_string(in.keys.ndim()));
  }
  // Every array has the keys' head axes; then one axis of slots or new
  // rows, and one of width for keys and values.
  const int heads = in.head_axes();
  check_rank(in.values, heads + 2, "values");
  check_rank(in.norms, heads + 1, "norms");
  check_rank(in.positions, heads + 1, "positions");
  check_rank(in.new_keys, heads + 2, "new_keys");
  check_rank(in.new_values, heads + 2, "new_values");
  check_floating(in.keys, "keys");
  check_floating(in.values, "values");
  check_floating(in.new_keys, "new_keys");
  check_floating(in.new_values, "new_values");
  check_float32(in.norms, "norms");
  check_int32(in.positions, "positions");
  check_same_dtype(in.new_keys, "new_keys", in.keys, "keys");
  check_same_dtype(in.new_values, "new_values", in.values, "values");
  check_leading_axes("keys/values mismatch in N or rows", "keys", in.keys,
                     "values", in.values, heads + 1);
  check_leading_axes("keys/values mismatch in N or rows", "new_keys",
                     in.new_keys, "new_values", in.new_values, heads + 1);
  check_leading_axes("buffers vs new rows mismatch in N or D", "keys", in.keys,
                     "new_keys", in.new_keys, heads);
  if (in.keys.shape(-1) != in.new_keys.shape(-1)) {
    shape_mismatch("buffers vs new rows mismatch in N or D", "keys", in.keys,
                   "new_keys", in.new_keys);
  }
  if (in.values.shape(-1) != in.new_values.shape(-1)) {
    shape_mismatch("buffers vs new rows mismatch in N or D", "values", in.values,
                   "new_values", in.new_values);
  }
  check_leading_axes("norms must be [N, C]", "norms", in.norms, "keys", in.keys, heads + 1);
  check_leading_axes("positions must be [N, C]", "positions", in.positions,
                     "keys", in.keys, heads + 1);
  check_selection_config(config_.selection);
  const int64_t filled = config_.filled;
  if (filled < 0) {
    throw std::invalid_argument(
        "mlx_knorm: filled must be >= 0, got " + std::to_string(filled));
  }
  if (filled > in.capacity()) {
    throw std::invalid_argument(
        "mlx_knorm: filled (" + std::to_string(filled) +
        ") must be <= C, the buffers' slots (" + std::to_string(in.capacity()) + ")");
  }
  if (config_.offset < 0) {
    throw std::invalid_argument(
        "mlx_knorm: offset must be >= 0, got " + std::to_string(config_.offset));
  }
  if (config_.offset + in.n_new() > kInt32Max) {
    throw std::invalid_argument(
        "mlx_knorm: offset + S (" + std::to_string(config_.offset + in.n_new()) +
        ") must be < 2**31: positions are int32");
  }
  const int64_t needed = config_.kept() + in.n_new();
  if (config_.out_capacity < needed) {
    throw std::invalid_argument(
        "mlx_knorm: capacity (" + std::to_string(config_.out_capacity) +
        ") must be >= kept + S (" + std::to_string(needed) + ")");
  }
  if (config_.out_capacity > kInt32Max) {
    throw std::invalid_argument(
        "mlx_knorm: capacity must be < 2**31, got " +
        std::to_string(config_.out_capacity));
  }
  if (executor_ == Executor::MetalEmulator ||
      stream().device == mx::Device::gpu) {
    // The Metal kernel takes the new rows' norms with the key-norm kernel's
    // code.
    check_metal_key_norms_shape(in.new_keys, "new_keys");
  }
}

bool EvictAndFill::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const EvictAndFill&>(other);
  return config_ == o.config_ && executor_ == o.executor_;
}

// Also called by mx.compile(shapeless=True) for every new input shape,
// without the op's argument checks having run: the shape relations the
// kernels rely on are checked again here.
std::vector<mx::Shape> EvictAndFill::output_shapes(
    const std::vector<mx::array>& inputs) {
  const auto in = EvictAndFillInputs::from(inputs);
  check_inputs(in);
  mx::Shape slots(in.keys.shape().begin(), in.keys.shape().end() - 1);
  slots.back() = static_cast<int>(config_.out_capacity);
  mx::Shape keys = slots;
  keys.push_back(in.key_dim());
  mx::Shape values = slots;
  values.push_back(in.value_dim());
  return {keys, values, slots, slots};
}

LentSiblingInputs EvictAndFill::prepare_eval(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  check_inputs(EvictAndFillInputs::from(inputs));
  check_row_contiguous(inputs, name());
  // Every output may take over its input's buffer; the kernels then write
  // only the rows that move.
  return take_over_or_allocate(inputs, outputs, [](size_t) { return true; });
}

void EvictAndFill::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto lent = prepare_eval(inputs, outputs);
  auto kernel = cpu_kernel(executor_, &evict_and_fill_cpu,
                           KNORM_EMULATED_KERNEL(evict_and_fill_emulated));
  run_on_cpu(stream(), executor_, inputs, outputs, [kernel, config = config_](
      const std::vector<mx::array>& in, std::vector<mx::array>& out) {
    kernel(EvictAndFillInputs::from(in), out, config);
  });
  lent.keep();
}

} // namespace mlx_knorm
