#include "validate.h"

#include <cstdint>
#include <sstream>

namespace mlx_knorm {

namespace mx = mlx::core;

namespace {

std::string shape_str(const mx::array& a) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < a.ndim(); ++i) {
    os << (i ? ", " : "") << a.shape(i);
  }
  os << "]";
  return os.str();
}

std::string dtype_str(mx::Dtype t) {
  switch (t) {
    case mx::bool_: return "bool";
    case mx::uint8: return "uint8";
    case mx::uint16: return "uint16";
    case mx::uint32: return "uint32";
    case mx::uint64: return "uint64";
    case mx::int8: return "int8";
    case mx::int16: return "int16";
    case mx::int32: return "int32";
    case mx::int64: return "int64";
    case mx::float16: return "float16";
    case mx::bfloat16: return "bfloat16";
    case mx::float32: return "float32";
    case mx::float64: return "float64";
    case mx::complex64: return "complex64";
  }
  return "unknown";
}

void check_floating(const mx::array& a, const char* name) {
  if (a.dtype() != mx::float16 && a.dtype() != mx::bfloat16 &&
      a.dtype() != mx::float32) {
    throw dtype_error(
        std::string("mlx_knorm: ") + name +
        " must be float16, bfloat16 or float32, got " + dtype_str(a.dtype()));
  }
}

void check_rank(const mx::array& a, int ndim, const char* name) {
  if (a.ndim() != static_cast<size_t>(ndim)) {
    throw std::invalid_argument(
        std::string("mlx_knorm: ") + name + " must have rank " +
        std::to_string(ndim) + ", got shape " + shape_str(a));
  }
}

[[noreturn]] void mismatch(
    const char* what,
    const char* a_name,
    const mx::array& a,
    const char* b_name,
    const mx::array& b) {
  throw std::invalid_argument(
      std::string("mlx_knorm: ") + what + ": " + a_name + " " + shape_str(a) +
      " vs " + b_name + " " + shape_str(b));
}

} // namespace

Keep parse_keep(const std::string& keep) {
  if (keep == "low") {
    return Keep::Low;
  }
  if (keep == "high") {
    return Keep::High;
  }
  throw std::invalid_argument(
      "mlx_knorm: keep must be 'low' or 'high', got '" + keep + "'");
}

const char* keep_name(Keep keep) {
  return keep == Keep::Low ? "low" : "high";
}

void check_key_norms_args(const mx::array& keys) {
  check_floating(keys, "keys");
  if (keys.ndim() < 1) {
    throw std::invalid_argument(
        "mlx_knorm: keys must have at least one axis [..., D], got a scalar");
  }
}

void check_protected_topk_gather_args(
    const mx::array& prior_keys,
    const mx::array& prior_values,
    const mx::array& prior_norms,
    const mx::array& new_keys,
    const mx::array& new_values,
    const mx::array& new_norms,
    int budget,
    int n_sink,
    int recent) {
  check_rank(prior_keys, 3, "prior_keys");
  check_rank(prior_values, 3, "prior_values");
  check_rank(prior_norms, 2, "prior_norms");
  check_rank(new_keys, 3, "new_keys");
  check_rank(new_values, 3, "new_values");
  check_rank(new_norms, 2, "new_norms");
  check_floating(prior_keys, "prior_keys");
  check_floating(prior_values, "prior_values");
  check_floating(new_keys, "new_keys");
  check_floating(new_values, "new_values");
  if (prior_norms.dtype() != mx::float32) {
    throw dtype_error(
        "mlx_knorm: prior_norms must be float32, got " +
        dtype_str(prior_norms.dtype()));
  }
  if (new_norms.dtype() != mx::float32) {
    throw dtype_error(
        "mlx_knorm: new_norms must be float32, got " +
        dtype_str(new_norms.dtype()));
  }
  if (prior_keys.dtype() != new_keys.dtype()) {
    throw dtype_error(
        "mlx_knorm: new_keys dtype " + dtype_str(new_keys.dtype()) +
        " must equal prior_keys dtype " + dtype_str(prior_keys.dtype()));
  }
  if (prior_values.dtype() != new_values.dtype()) {
    throw dtype_error(
        "mlx_knorm: new_values dtype " + dtype_str(new_values.dtype()) +
        " must equal prior_values dtype " + dtype_str(prior_values.dtype()));
  }
  // Keys and values may differ in width (D_k != D_v, as in multi-head latent
  // attention) but not in heads or rows.
  if (prior_keys.shape(0) != prior_values.shape(0) ||
      prior_keys.shape(1) != prior_values.shape(1)) {
    mismatch("keys/values mismatch in N or rows", "prior_keys", prior_keys,
             "prior_values", prior_values);
  }
  if (new_keys.shape(0) != new_values.shape(0) ||
      new_keys.shape(1) != new_values.shape(1)) {
    mismatch("keys/values mismatch in N or rows", "new_keys", new_keys,
             "new_values", new_values);
  }
  if (prior_keys.shape(0) != new_keys.shape(0) ||
      prior_keys.shape(2) != new_keys.shape(2)) {
    mismatch("prior vs new mismatch in N or D", "prior_keys", prior_keys,
             "new_keys", new_keys);
  }
  if (prior_values.shape(2) != new_values.shape(2)) {
    mismatch("prior vs new mismatch in N or D", "prior_values", prior_values,
             "new_values", new_values);
  }
  if (prior_norms.shape(0) != prior_keys.shape(0) ||
      prior_norms.shape(1) != prior_keys.shape(1)) {
    mismatch("prior_norms must be [N, n_prior]", "prior_norms", prior_norms,
             "prior_keys", prior_keys);
  }
  if (new_norms.shape(0) != new_keys.shape(0) ||
      new_norms.shape(1) != new_keys.shape(1)) {
    mismatch("new_norms must be [N, S]", "new_norms", new_norms, "new_keys",
             new_keys);
  }
  if (static_cast<int64_t>(prior_keys.shape(1)) + new_keys.shape(1) >
      static_cast<int64_t>(UINT32_MAX)) {
    throw std::invalid_argument(
        "mlx_knorm: n_prior + S must fit in uint32 row indices");
  }
  if (budget < 1) {
    throw std::invalid_argument(
        "mlx_knorm: budget must be >= 1, got " + std::to_string(budget));
  }
  if (n_sink < 0) {
    throw std::invalid_argument(
        "mlx_knorm: n_sink must be >= 0, got " + std::to_string(n_sink));
  }
  if (recent < 0) {
    throw std::invalid_argument(
        "mlx_knorm: recent must be >= 0, got " + std::to_string(recent));
  }
  if (static_cast<long long>(n_sink) + recent >= budget) {
    throw std::invalid_argument(
        "mlx_knorm: n_sink (" + std::to_string(n_sink) + ") + recent (" +
        std::to_string(recent) + ") must be < budget (" +
        std::to_string(budget) + "): no evictable positions remain");
  }
}

} // namespace mlx_knorm
