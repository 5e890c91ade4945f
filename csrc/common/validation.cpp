#include "common/validation.h"

#include <sstream>

#include "common/dtype.h"

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

} // namespace

void check_floating(const mx::array& a, const char* name) {
  if (a.dtype() != mx::float16 && a.dtype() != mx::bfloat16 &&
      a.dtype() != mx::float32) {
    throw dtype_error(
        std::string("mlx_knorm: ") + name +
        " must be float16, bfloat16 or float32, got " + dtype_name(a.dtype()));
  }
}

void check_float32(const mx::array& a, const char* name) {
  if (a.dtype() != mx::float32) {
    throw dtype_error(
        std::string("mlx_knorm: ") + name + " must be float32, got " +
        dtype_name(a.dtype()));
  }
}

void check_int32(const mx::array& a, const char* name) {
  if (a.dtype() != mx::int32) {
    throw dtype_error(
        std::string("mlx_knorm: ") + name + " must be int32, got " +
        dtype_name(a.dtype()));
  }
}

void check_rank(const mx::array& a, int ndim, const char* name) {
  if (a.ndim() != static_cast<size_t>(ndim)) {
    throw std::invalid_argument(
        std::string("mlx_knorm: ") + name + " must have rank " +
        std::to_string(ndim) + ", got shape " + shape_str(a));
  }
}

void check_row_bytes(const mx::array& a, const char* name) {
  const int64_t bytes = static_cast<int64_t>(a.shape(-1)) * static_cast<int64_t>(a.itemsize());
  if (bytes > kMaxRowBytes) {
    throw std::invalid_argument(
        std::string("mlx_knorm: ") + name + " has rows of " + std::to_string(bytes) +
        " bytes; rows must be < 2**31 bytes, got shape " + shape_str(a));
  }
}

void check_same_dtype(
    const mx::array& a,
    const char* a_name,
    const mx::array& b,
    const char* b_name) {
  if (a.dtype() != b.dtype()) {
    throw dtype_error(
        std::string("mlx_knorm: ") + a_name + " dtype " + dtype_name(a.dtype()) +
        " must equal " + b_name + " dtype " + dtype_name(b.dtype()));
  }
}

void shape_mismatch(
    const char* what,
    const char* a_name,
    const mx::array& a,
    const char* b_name,
    const mx::array& b) {
  throw std::invalid_argument(
      std::string("mlx_knorm: ") + what + ": " + a_name + " " + shape_str(a) +
      " vs " + b_name + " " + shape_str(b));
}

void check_leading_axes(
    const char* what,
    const char* a_name,
    const mx::array& a,
    const char* b_name,
    const mx::array& b,
    int axes) {
  for (int i = 0; i < axes; ++i) {
    if (a.shape(i) != b.shape(i)) {
      shape_mismatch(what, a_name, a, b_name, b);
    }
  }
}

void check_selection_config(const SelectionConfig& config) {
  if (config.budget < 1) {
    throw std::invalid_argument(
        "mlx_knorm: budget must be >= 1, got " + std::to_string(config.budget));
  }
  if (config.n_sink < 0) {
    throw std::invalid_argument(
        "mlx_knorm: n_sink must be >= 0, got " + std::to_string(config.n_sink));
  }
  if (config.recent < 0) {
    throw std::invalid_argument(
        "mlx_knorm: recent must be >= 0, got " + std::to_string(config.recent));
  }
  if (static_cast<long long>(config.n_sink) + config.recent >= config.budget) {
    throw std::invalid_argument(
        "mlx_knorm: n_sink (" + std::to_string(config.n_sink) + ") + recent (" +
        std::to_string(config.recent) + ") must be < budget (" +
        std::to_string(config.budget) + "): no evictable positions remain");
  }
}

} // namespace mlx_knorm
