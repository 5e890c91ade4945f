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

std::string PayloadGroups::name(int i, bool new_rows) const {
  const bool key = i < keys;
  std::string name = new_rows ? "new_" : "";
  name += key ? "keys" : "values";
  if (key ? keys_listed : values_listed) {
    name += "[";
    name += std::to_string(key ? i : i - keys);
    name += "]";
  }
  return name;
}

EvictAndFillInputs EvictAndFillInputs::from(
    const std::vector<mx::array>& inputs,
    const EvictAndFillConfig& config) {
  const int m = config.payloads.count();
  const size_t expected = 2 * static_cast<size_t>(m) + 2 + config.norms_given + config.has_valid +
      config.tree_given;
  if (m < 1 || inputs.size() != expected) {
    throw std::invalid_argument(
        "mlx_knorm: EvictAndFill with " + std::to_string(m) + " payloads takes " +
        std::to_string(expected) + " inputs, got " + std::to_string(inputs.size()));
  }
  auto at = inputs.begin();
  EvictAndFillInputs in{
      {at, at + m}, inputs[m], inputs[m + 1], {at + m + 2, at + 2 * m + 2}, {}, {}, {}};
  size_t next = 2 * static_cast<size_t>(m) + 2;
  if (config.norms_given) {
    in.new_norms = inputs[next++];
  }
  if (config.has_valid) {
    in.valid = inputs[next++];
  }
  if (config.tree_given) {
    in.tree = inputs[next];
  }
  return in;
}

std::vector<mx::array> EvictAndFillInputs::to_vector() const {
  std::vector<mx::array> out;
  out.reserve(rows.size() + new_rows.size() + 5);
  out.insert(out.end(), rows.begin(), rows.end());
  out.push_back(norms);
  out.push_back(positions);
  out.insert(out.end(), new_rows.begin(), new_rows.end());
  if (new_norms) {
    out.push_back(*new_norms);
  }
  if (valid) {
    out.push_back(*valid);
  }
  if (tree) {
    out.push_back(*tree);
  }
  return out;
}

std::vector<mx::array> evict_and_fill(
    const EvictAndFillInputs& inputs,
    EvictAndFillConfig config,
    Executor executor,
    mx::StreamOrDevice s) {
  check_executor(executor);
  if (config.norms_given != inputs.new_norms.has_value() ||
      config.has_valid != inputs.valid.has_value() ||
      config.tree_given != inputs.tree.has_value()) {
    throw std::invalid_argument(
        "mlx_knorm: EvictAndFillConfig's norms_given, has_valid and tree_given must say "
        "whether new_norms, valid and tree are given");
  }
  // A given tree is updated into the output's.
  config.order_tree = config.order_tree || config.tree_given;
  auto stream = mx::to_stream(s);
  auto primitive = std::make_shared<EvictAndFill>(stream, config, executor);
  // make_outputs asks the primitive for the output shapes, which checks
  // the inputs (output_shapes) before any output exists.
  std::vector<mx::Dtype> dtypes;
  dtypes.reserve(inputs.rows.size() + 2);
  for (const mx::array& r : inputs.rows) {
    dtypes.push_back(r.dtype());
  }
  dtypes.push_back(mx::float32);
  dtypes.push_back(mx::int32);
  if (config.order_tree) {
    dtypes.push_back(mx::int32);
  }
  return make_outputs(primitive, inputs.to_vector(), std::move(dtypes), stream);
}

void EvictAndFill::check_inputs(const EvictAndFillInputs& in) {
  const PayloadGroups& groups = config_.payloads;
  const int m = in.payloads();
  if (groups.keys < 1 || groups.values < 0 || groups.count() != m ||
      static_cast<int>(in.new_rows.size()) != m) {
    throw std::invalid_argument(
        "mlx_knorm: EvictAndFill's payload groups (" + std::to_string(groups.keys) + " keys, " +
        std::to_string(groups.values) + " values) do not match its " + std::to_string(m) +
        " payloads and " + std::to_string(in.new_rows.size()) + " new payloads");
  }
  if (m > static_cast<int>(kEvictMaxPayloads)) {
    throw std::invalid_argument(
        "mlx_knorm: keys and values take at most " + std::to_string(kEvictMaxPayloads) +
        " payload arrays together, got " + std::to_string(m));
  }
  // The checks below test their condition first and name the arguments
  // (strings) only to report a failure: this runs three times per step.
  auto name = [&](int i) { return groups.name(i); };
  auto new_name = [&](int i) { return groups.name(i, true); };
  auto leading_equal = [](const mx::array& a, const mx::array& b, int axes) {
    for (int i = 0; i < axes; ++i) {
      if (a.shape(i) != b.shape(i)) {
        return false;
      }
    }
    return true;
  };
  auto floating = [](const mx::array& a) {
    return a.dtype() == mx::float16 || a.dtype() == mx::bfloat16 || a.dtype() == mx::float32;
  };
  const mx::array& keys = in.rows[0];
  const mx::array& new_keys = in.new_rows[0];
  if (keys.ndim() < 3) {
    throw std::invalid_argument(
        "mlx_knorm: " + name(0) + " must be [..., C, D_k] with at least one head axis, got rank " +
        std::to_string(keys.ndim()));
  }
  // Every array has the first payload's head axes; then one axis of slots
  // or new rows, and one of width for the payloads.
  const int heads = static_cast<int>(keys.ndim()) - 2;
  const size_t payload_rank = static_cast<size_t>(heads) + 2;
  for (int i = 0; i < m; ++i) {
    if (in.rows[i].ndim() != payload_rank) {
      check_rank(in.rows[i], heads + 2, name(i).c_str());
    }
  }
  check_rank(in.norms, heads + 1, "norms");
  check_rank(in.positions, heads + 1, "positions");
  for (int i = 0; i < m; ++i) {
    if (in.new_rows[i].ndim() != payload_rank) {
      check_rank(in.new_rows[i], heads + 2, new_name(i).c_str());
    }
  }
  if (in.new_norms) {
    check_rank(*in.new_norms, heads + 1, "new_norms");
  }
  if (in.valid) {
    check_rank(*in.valid, heads + 1, "valid");
  }
  if (!config_.norms_given) {
    // The new rows' norms come from the first payload (docs/spec.md §2),
    // which must then be the keys as one floating array.
    if (groups.keys_listed) {
      throw dtype_error(
          "mlx_knorm: new_norms is required when keys is a tuple: the norms are computed "
          "from new_keys only when it is one float16, bfloat16 or float32 array");
    }
    if (!floating(keys)) {
      check_floating(keys, name(0).c_str());
    }
    if (!floating(new_keys)) {
      check_floating(new_keys, new_name(0).c_str());
    }
  }
  check_float32(in.norms, "norms");
  check_int32(in.positions, "positions");
  for (int i = 0; i < m; ++i) {
    if (in.new_rows[i].dtype() != in.rows[i].dtype()) {
      check_same_dtype(in.new_rows[i], new_name(i).c_str(), in.rows[i], name(i).c_str());
    }
  }
  if (in.new_norms) {
    check_float32(*in.new_norms, "new_norms");
  }
  if (in.valid) {
    check_int32(*in.valid, "valid");
  }
  for (int i = 0; i < m; ++i) {
    if (in.row_bytes(i) > static_cast<size_t>(kMaxRowBytes)) {
      check_row_bytes(in.rows[i], name(i).c_str());
    }
  }
  for (int i = 1; i < m; ++i) {
    const bool rows_agree = leading_equal(keys, in.rows[i], heads + 1);
    if (!rows_agree || !leading_equal(new_keys, in.new_rows[i], heads + 1)) {
      const std::string what = name(0) + "/" + name(i) + " mismatch in N or rows";
      if (!rows_agree) {
        shape_mismatch(what.c_str(), name(0).c_str(), keys, name(i).c_str(), in.rows[i]);
      }
      shape_mismatch(what.c_str(), new_name(0).c_str(), new_keys, new_name(i).c_str(),
                     in.new_rows[i]);
    }
  }
  for (int i = 0; i < m; ++i) {
    if (!leading_equal(in.rows[i], in.new_rows[i], heads) ||
        in.rows[i].shape(-1) != in.new_rows[i].shape(-1)) {
      shape_mismatch("buffers vs new rows mismatch in N or D", name(i).c_str(), in.rows[i],
                     new_name(i).c_str(), in.new_rows[i]);
    }
  }
  if (!leading_equal(in.norms, keys, heads + 1)) {
    shape_mismatch("norms must be [N, C]", "norms", in.norms, name(0).c_str(), keys);
  }
  if (!leading_equal(in.positions, keys, heads + 1)) {
    shape_mismatch("positions must be [N, C]", "positions", in.positions, name(0).c_str(), keys);
  }
  if (in.new_norms && !leading_equal(*in.new_norms, new_keys, heads + 1)) {
    shape_mismatch("new_norms must be [N, S]", "new_norms", *in.new_norms, new_name(0).c_str(),
                   new_keys);
  }
  if (in.valid && (!leading_equal(*in.valid, keys, heads) || in.valid->shape(-1) != 2)) {
    shape_mismatch("valid must be [N, 2]", "valid", *in.valid, name(0).c_str(), keys);
  }
  if (in.tree) {
    check_rank(*in.tree, heads + 2, "tree");
    check_int32(*in.tree, "tree");
    if (!leading_equal(*in.tree, keys, heads) || in.tree->shape(-2) != 2 ||
        in.tree->shape(-1) != in.capacity() + 1) {
      shape_mismatch("tree must be [N, 2, C + 1]", "tree", *in.tree, name(0).c_str(), keys);
    }
  }
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
  if (!config_.norms_given &&
      (executor_ == Executor::MetalEmulator || stream().device == mx::Device::gpu)) {
    // The Metal kernel takes the new rows' norms with the key-norm kernel's
    // code.
    check_metal_key_norms_shape(in.new_rows[0], groups.name(0, true).c_str());
  }
}

// Also called by mx.compile(shapeless=True) for every new input shape,
// without the op's argument checks having run: the shape relations the
// kernels rely on are checked again here.
std::vector<mx::Shape> EvictAndFill::output_shapes(
    const std::vector<mx::array>& inputs) {
  const auto in = EvictAndFillInputs::from(inputs, config_);
  check_inputs(in);
  mx::Shape slots = in.norms.shape();
  slots.back() = static_cast<int>(config_.out_capacity);
  std::vector<mx::Shape> shapes;
  shapes.reserve(in.rows.size() + 2);
  for (const mx::array& r : in.rows) {
    mx::Shape payload = slots;
    payload.push_back(r.shape(-1));
    shapes.push_back(std::move(payload));
  }
  shapes.push_back(slots);
  shapes.push_back(slots);
  if (config_.order_tree) {
    mx::Shape tree = slots;
    tree.back() = 2;
    tree.push_back(static_cast<int>(config_.out_capacity) + 1);
    shapes.push_back(std::move(tree));
  }
  return shapes;
}

LentSiblingInputs EvictAndFill::prepare_eval(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  check_inputs(EvictAndFillInputs::from(inputs, config_));
  check_row_contiguous(inputs, name());
  // Every output may take over its input's buffer (the order tree the
  // given tree's, the last input); the kernels then write only the rows
  // that move.
  const size_t rows = outputs.size() - config_.order_tree;
  const bool tree_given = config_.tree_given;
  return take_over_or_allocate(inputs, outputs, [&](size_t i) -> std::optional<size_t> {
    if (i < rows) {
      return i;
    }
    if (tree_given) {
      return inputs.size() - 1;
    }
    return std::nullopt;
  });
}

void EvictAndFill::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto lent = prepare_eval(inputs, outputs);
  run_on_cpu(
      stream(), executor_,
      [&] { return evict_and_fill_cpu_task(EvictAndFillInputs::from(inputs, config_), outputs, config_); },
      [&, emulated = KNORM_EMULATED_KERNEL(evict_and_fill_emulated)] {
        emulated(EvictAndFillInputs::from(inputs, config_), outputs, config_);
      });
  lent.keep();
}

} // namespace mlx_knorm
