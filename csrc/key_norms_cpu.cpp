// CPU kernel of KeyNorms. Compiled with -ffp-contract=off: each square and
// each add is one correctly rounded binary32 operation (SPEC section 2).
#include <cmath>
#include <vector>

#include "mlx/backend/cpu/encoder.h"

#include "key_norms.h"
#include "metal_emulated.h"

namespace mlx_knorm {

namespace {

template <typename T>
void key_norms_rows(const T* keys, float* norms, int64_t rows, int64_t dim) {
  int64_t width = 1;
  while (width < dim) {
    width <<= 1;
  }
  const int64_t half = width / 2;
  std::vector<float> partial(std::max<int64_t>(half, 1));
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = keys + r * dim;
    if (dim == 1) {
      float v = static_cast<float>(x[0]);
      norms[r] = std::sqrt(v * v);
      continue;
    }
    // First halving level straight from the squares; the zero padding past
    // dim adds +0, which leaves a square unchanged.
    for (int64_t i = 0; i < half; ++i) {
      float a = static_cast<float>(x[i]);
      float sq = a * a;
      if (i + half < dim) {
        float b = static_cast<float>(x[i + half]);
        float sq_hi = b * b;
        sq = sq + sq_hi;
      }
      partial[i] = sq;
    }
    for (int64_t h = half / 2; h >= 1; h /= 2) {
      for (int64_t i = 0; i < h; ++i) {
        partial[i] = partial[i] + partial[i + h];
      }
    }
    norms[r] = std::sqrt(partial[0]);
  }
}

} // namespace

void key_norms_cpu(const mx::array& keys, mx::array& out) {
  const int64_t dim = keys.shape(-1);
  const int64_t rows = dim == 0 ? static_cast<int64_t>(out.size())
                                : static_cast<int64_t>(keys.size()) / dim;
  float* norms = out.data<float>();
  if (dim == 0) {
    std::fill(norms, norms + rows, 0.0f);
    return;
  }
  switch (keys.dtype()) {
    case mx::float16:
      key_norms_rows(keys.data<mx::float16_t>(), norms, rows, dim);
      break;
    case mx::bfloat16:
      key_norms_rows(keys.data<mx::bfloat16_t>(), norms, rows, dim);
      break;
    case mx::float32:
      key_norms_rows(keys.data<float>(), norms, rows, dim);
      break;
    default:
      throw std::invalid_argument("mlx_knorm: unsupported key dtype");
  }
}

void KeyNorms::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& keys = inputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(keys);
  encoder.set_output_array(out);
  encoder.dispatch([keys = mx::array::unsafe_weak_copy(keys),
                    out = mx::array::unsafe_weak_copy(out),
                    executor = executor_]() mutable {
#ifdef MLX_KNORM_EMULATOR
    if (executor == Executor::MetalEmulator) {
      key_norms_metal_emulated(keys, out);
      return;
    }
#endif
    (void)executor;
    key_norms_cpu(keys, out);
  });
}

} // namespace mlx_knorm
