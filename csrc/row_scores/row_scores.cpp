#include "row_scores/row_scores.h"

#include <stdexcept>
#include <string>

#include "common/cpu_dispatch.h"
#include "common/multi_output.h"
#include "common/validation.h"

namespace mlx_knorm {

Scorer parse_scorer(const std::string& name) {
  for (Scorer s : {Scorer::KeyNorm, Scorer::ValueNorm, Scorer::QueryFilter, Scorer::KeyDiff}) {
    if (name == scorer_name(s)) {
      return s;
    }
  }
  throw std::invalid_argument(
      "mlx_knorm: scorer must be 'knorm', 'vnorm', 'qfilter' or 'keydiff', got '" + name + "'");
}

const char* scorer_name(Scorer scorer) {
  switch (scorer) {
    case Scorer::KeyNorm: return "knorm";
    case Scorer::ValueNorm: return "vnorm";
    case Scorer::QueryFilter: return "qfilter";
    case Scorer::KeyDiff: return "keydiff";
  }
  return "?";
}

RowScoresInputs RowScoresInputs::from(const std::vector<mx::array>& inputs, const RowScoresConfig& config) {
  const size_t expected = 1 + config.uses_values() + config.uses_state() + config.has_valid;
  if (inputs.size() != expected) {
    throw std::invalid_argument("mlx_knorm: RowScores (" + std::string(scorer_name(config.scorer)) +
                                ") takes " + std::to_string(expected) + " inputs, got " +
                                std::to_string(inputs.size()));
  }
  RowScoresInputs in{inputs[0], std::nullopt, std::nullopt, std::nullopt};
  size_t next = 1;
  if (config.uses_values()) {
    in.values = inputs[next++];
  }
  if (config.uses_state()) {
    in.state = inputs[next++];
  }
  if (config.has_valid) {
    in.valid = inputs[next++];
  }
  return in;
}

std::vector<mx::array> RowScoresInputs::to_vector() const {
  std::vector<mx::array> out{keys};
  for (const auto& a : {values, state, valid}) {
    if (a) {
      out.push_back(*a);
    }
  }
  return out;
}

int64_t RowScoresInputs::heads() const {
  int64_t n = 1;
  for (size_t i = 0; i + 2 < keys.ndim(); ++i) {
    n *= keys.shape(i);
  }
  return n;
}

std::vector<mx::array> row_scores(
    const RowScoresInputs& inputs,
    RowScoresConfig config,
    Executor executor,
    mx::StreamOrDevice s) {
  check_executor(executor);
  auto stream = mx::to_stream(s);
  auto primitive = std::make_shared<RowScores>(stream, config, executor);
  std::vector<mx::Dtype> dtypes{mx::float32};
  if (config.returns_state()) {
    dtypes.push_back(mx::float32);
  }
  return make_outputs(primitive, inputs.to_vector(), dtypes, stream);
}

namespace {

// `a`'s axes are `keys`' leading ones, then `last` (a width or 2).
void check_per_head(const mx::array& a, const char* name, const mx::array& keys, int last,
                    const char* what) {
  const size_t lead = keys.ndim() - 2;
  bool same = a.ndim() == lead + 1 && a.shape(-1) == last;
  for (size_t i = 0; same && i < lead; ++i) {
    same = a.shape(i) == keys.shape(i);
  }
  if (!same) {
    shape_mismatch(what, name, a, "keys", keys);
  }
}

} // namespace

void RowScores::check_inputs(const RowScoresInputs& in) {
  check_floating(in.keys, "keys");
  if (in.keys.ndim() < 2) {
    throw std::invalid_argument("mlx_knorm: keys must be [..., S, D], got " +
                                std::to_string(in.keys.ndim()) + " axes");
  }
  if (config_.uses_values()) {
    check_same_dtype(*in.values, "values", in.keys, "keys");
    if (in.values->ndim() != in.keys.ndim()) {
      shape_mismatch("values must be [..., S, D_v] with the keys' heads and rows", "values",
                     *in.values, "keys", in.keys);
    }
    check_leading_axes("values must be [..., S, D_v] with the keys' heads and rows", "values",
                       *in.values, "keys", in.keys, static_cast<int>(in.keys.ndim()) - 1);
    check_row_bytes(*in.values, "values");
  }
  if (config_.uses_state()) {
    check_float32(*in.state, "state");
    check_per_head(*in.state, "state", in.keys, in.key_dim(), "state must be [..., D] per head of keys");
  }
  if (config_.has_valid) {
    check_int32(*in.valid, "valid");
    check_per_head(*in.valid, "valid", in.keys, 2, "valid must be [..., 2] per head of keys");
  }
  if (config_.offset < 0 || config_.offset + in.rows() > kMaxHeadRows) {
    throw std::invalid_argument("mlx_knorm: offset (" + std::to_string(config_.offset) +
                                ") must be >= 0 with offset + S < 2**31");
  }
  check_row_bytes(in.keys, "keys");
  if (executor_ == Executor::MetalEmulator || stream().device == mx::Device::gpu) {
    check_metal_row_scores_shape(in);
  }
}

// Also called by mx.compile(shapeless=True) for every new input shape,
// without the op's argument checks having run.
std::vector<mx::Shape> RowScores::output_shapes(const std::vector<mx::array>& inputs) {
  const auto in = RowScoresInputs::from(inputs, config_);
  check_inputs(in);
  std::vector<mx::Shape> shapes{mx::Shape(in.keys.shape().begin(), in.keys.shape().end() - 1)};
  if (config_.returns_state()) {
    shapes.push_back(in.state->shape());
  }
  return shapes;
}

void RowScores::prepare_eval(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  check_inputs(RowScoresInputs::from(inputs, config_));
  check_row_contiguous(inputs, name());
  for (mx::array& out : outputs) {
    allocate_output(out);
  }
}

void RowScores::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  prepare_eval(inputs, outputs);
  run_on_cpu(
      stream(), executor_,
      [&] { return row_scores_cpu_task(RowScoresInputs::from(inputs, config_), outputs, config_); },
      [&, emulated = KNORM_EMULATED_KERNEL(row_scores_emulated)] {
        emulated(RowScoresInputs::from(inputs, config_), outputs, config_);
      });
}

} // namespace mlx_knorm
