// CPU kernel of KeyNorms. Compiled with -ffp-contract=off: each square and
// each add is one correctly rounded binary32 operation (SPEC section 2).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "mlx/backend/cpu/encoder.h"

#include "key_norms.h"
#include "metal_emulated.h"
#include "parallel.h"

namespace mlx_knorm {

namespace {

float float_from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

uint32_t bits_from_float(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

// Exact binary16 -> binary32, the branch-free form of the conversion MLX's
// float16_t uses (Maratyszcza's FP16), so that it vectorises; NaN payloads
// come out as MLX's do.
struct Float16Format {
  using Bits = uint16_t;
  static float to_float(uint16_t h) {
    const uint32_t w = static_cast<uint32_t>(h) << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normal = float_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float subnormal = float_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t magnitude =
        two_w < (1u << 27) ? bits_from_float(subnormal) : bits_from_float(normal);
    return float_from_bits(magnitude | sign);
  }
};

struct BFloat16Format {
  using Bits = uint16_t;
  static float to_float(uint16_t h) {
    return float_from_bits(static_cast<uint32_t>(h) << 16);
  }
};

struct Float32Format {
  using Bits = float;
  static float to_float(float x) {
    return x;
  }
};

// SPEC section 2 for each row: squares, +0 padding to the power-of-two
// width, then the halving adds in the pinned order. The loops carry no
// dependence across i, so they vectorise without reordering any add.
template <typename Format>
inline void norm_rows(
    const typename Format::Bits* __restrict keys,
    float* __restrict norms,
    int64_t rows,
    int64_t dim,
    int64_t width,
    float* __restrict squares) {
  for (int64_t i = dim; i < width; ++i) {
    squares[i] = 0.0f;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const typename Format::Bits* x = keys + r * dim;
    for (int64_t i = 0; i < dim; ++i) {
      const float v = Format::to_float(x[i]);
      squares[i] = v * v;
    }
    for (int64_t h = width / 2; h >= 1; h /= 2) {
      for (int64_t i = 0; i < h; ++i) {
        squares[i] = squares[i] + squares[i + h];
      }
    }
    norms[r] = std::sqrt(squares[0]);
  }
}

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
// Wheels target baseline x86-64; an AVX2 clone of each row loop, picked at
// load time, gives the conversion and the adds 8-wide lanes.
#define KNORM_AVX2_CLONE __attribute__((target_clones("avx2", "default")))
#define KNORM_HAVE_F16C_PATH 1
#else
#define KNORM_AVX2_CLONE
#define KNORM_HAVE_F16C_PATH 0
#endif

KNORM_AVX2_CLONE void norm_rows_float16(
    const uint16_t* keys, float* norms, int64_t rows, int64_t dim, int64_t width,
    float* squares) {
  norm_rows<Float16Format>(keys, norms, rows, dim, width, squares);
}

KNORM_AVX2_CLONE void norm_rows_bfloat16(
    const uint16_t* keys, float* norms, int64_t rows, int64_t dim, int64_t width,
    float* squares) {
  norm_rows<BFloat16Format>(keys, norms, rows, dim, width, squares);
}

KNORM_AVX2_CLONE void norm_rows_float32(
    const float* keys, float* norms, int64_t rows, int64_t dim, int64_t width,
    float* squares) {
  norm_rows<Float32Format>(keys, norms, rows, dim, width, squares);
}

#if KNORM_HAVE_F16C_PATH
// float16 keys (the default dtype) with the F16C converter: the portable
// conversion above does not vectorise. vcvtph2ps is exact and quiets NaNs
// as the portable conversion does, and squaring quiets them anyway.
__attribute__((target("avx2,f16c"))) void norm_rows_float16_f16c(
    const uint16_t* __restrict keys,
    float* __restrict norms,
    int64_t rows,
    int64_t dim,
    int64_t width,
    float* __restrict squares) {
  for (int64_t i = dim; i < width; ++i) {
    squares[i] = 0.0f;
  }
  const int64_t wide_end = dim - dim % 8;
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* x = keys + r * dim;
    for (int64_t i = 0; i < wide_end; i += 8) {
      const __m256 v = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
      _mm256_storeu_ps(squares + i, _mm256_mul_ps(v, v));
    }
    for (int64_t i = wide_end; i < dim; ++i) {
      const float v = Float16Format::to_float(x[i]);
      squares[i] = v * v;
    }
    for (int64_t h = width / 2; h >= 1; h /= 2) {
      for (int64_t i = 0; i < h; ++i) {
        squares[i] = squares[i] + squares[i + h];
      }
    }
    norms[r] = std::sqrt(squares[0]);
  }
}

bool cpu_has_f16c() {
  static const bool has =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
}
#endif

void norm_rows_float16_best(
    const uint16_t* keys, float* norms, int64_t rows, int64_t dim, int64_t width,
    float* squares) {
#if KNORM_HAVE_F16C_PATH
  if (cpu_has_f16c()) {
    norm_rows_float16_f16c(keys, norms, rows, dim, width, squares);
    return;
  }
#endif
  norm_rows_float16(keys, norms, rows, dim, width, squares);
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
  int64_t width = 1;
  while (width < dim) {
    width <<= 1;
  }
  const auto dtype = keys.dtype();
  if (dtype != mx::float16 && dtype != mx::bfloat16 && dtype != mx::float32) {
    throw std::invalid_argument("mlx_knorm: unsupported key dtype");
  }
  const char* bytes = keys.data<char>();
  const size_t row_bytes = static_cast<size_t>(dim) * keys.itemsize();
  parallel_for(rows, row_bytes, [&](int64_t begin, int64_t end) {
    // One scratch row per thread, reused for every row of its range.
    std::vector<float> squares(width);
    const char* first = bytes + begin * row_bytes;
    const int64_t count = end - begin;
    if (dtype == mx::float16) {
      norm_rows_float16_best(reinterpret_cast<const uint16_t*>(first), norms + begin,
                        count, dim, width, squares.data());
    } else if (dtype == mx::bfloat16) {
      norm_rows_bfloat16(reinterpret_cast<const uint16_t*>(first), norms + begin,
                         count, dim, width, squares.data());
    } else {
      norm_rows_float32(reinterpret_cast<const float*>(first), norms + begin,
                        count, dim, width, squares.data());
    }
  });
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
