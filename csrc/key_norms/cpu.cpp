// CPU kernel of KeyNorms. Compiled with -ffp-contract=off: each square and
// each add is one correctly rounded binary32 operation (docs/spec.md §2).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "mlx/dtype_utils.h"

#include "common/parallel.h"
#include "key_norms/key_norms.h"

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

// Wheels target baseline x86-64: the AVX2/F16C kernel below is compiled
// for its target alone and chosen at run time with __builtin_cpu_supports
// (not with target_clones, whose ifunc resolvers run before a sanitizer's
// runtime starts and crash the sanitizer builds of .ci/sanitize).
#if defined(__x86_64__) && defined(__GNUC__)
#define KNORM_HAVE_F16C_PATH 1
#else
#define KNORM_HAVE_F16C_PATH 0
#endif

#if KNORM_HAVE_F16C_PATH
#define KNORM_F16C_TARGET __attribute__((target("avx2,f16c")))
#endif

// How keys of MLX element type T are read: their storage bits, to_float (an
// exact conversion of one key) and, where the AVX2/F16C kernel exists, load8
// (eight exact conversions at a time).
template <typename T>
struct KeyFormat;

// The branch-free form of the conversion MLX's float16_t uses (Maratyszcza's
// FP16), so that it vectorises; NaN payloads come out as MLX's do. F16C
// converts exactly too.
template <>
struct KeyFormat<mx::float16_t> {
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
#if KNORM_HAVE_F16C_PATH
  KNORM_F16C_TARGET static __m256 load8(const uint16_t* x) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  }
#endif
};

// bfloat16 is the top half of a binary32: a shift.
template <>
struct KeyFormat<mx::bfloat16_t> {
  using Bits = uint16_t;
  static float to_float(uint16_t h) {
    return float_from_bits(static_cast<uint32_t>(h) << 16);
  }
#if KNORM_HAVE_F16C_PATH
  KNORM_F16C_TARGET static __m256 load8(const uint16_t* x) {
    const __m256i wide = _mm256_cvtepu16_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
#endif
};

template <>
struct KeyFormat<float> {
  using Bits = float;
  static float to_float(float x) {
    return x;
  }
#if KNORM_HAVE_F16C_PATH
  KNORM_F16C_TARGET static __m256 load8(const float* x) {
    return _mm256_loadu_ps(x);
  }
#endif
};

// Squares below the smallest normal float are +0 (docs/spec.md §2 step 2);
// NaN compares false and passes through.
inline float flushed_square(float v) {
  const float square = v * v;
  return square < std::numeric_limits<float>::min() ? 0.0f : square;
}

// docs/spec.md §2 step 6: one NaN bit pattern on every backend.
inline float canonical_norm(float norm) {
  return std::isnan(norm) ? float_from_bits(0x7FC00000u) : norm;
}

// docs/spec.md §2 for each row: flushed squares, +0 padding to the
// power-of-two width, then the halving adds in the pinned order. The loops
// carry no dependence across i, so they vectorise without reordering any add.
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
      squares[i] = flushed_square(Format::to_float(x[i]));
    }
    for (int64_t h = width / 2; h >= 1; h /= 2) {
      for (int64_t i = 0; i < h; ++i) {
        squares[i] = squares[i] + squares[i + h];
      }
    }
    norms[r] = canonical_norm(std::sqrt(squares[0]));
  }
}

#if KNORM_HAVE_F16C_PATH
// Rows of D = 8k, padded width kWidth (the power of two >= D, >= 8), eight
// rows per step. Within a row the squares sit in kWidth / 8 registers, s[i]
// in register i / 8, lane i % 8: every halving level down to h = 8 adds
// register k + h/8 to register k, which is exactly s[i] + s[i + h] lane by
// lane. The last levels (h = 4, 2, 1) run after an 8x8 transpose, with one
// row per lane, so they are lane-wise adds too: no add is reordered.
template <typename Format, int kWidth>
KNORM_F16C_TARGET void norm_rows_avx2(
    const typename Format::Bits* __restrict keys,
    float* __restrict norms,
    int64_t rows,
    int64_t dim) {
  constexpr int kRegs = kWidth / 8;
  const int loaded = static_cast<int>(dim / 8);
  const int64_t blocks = rows / 8;
  const __m256 smallest_normal = _mm256_set1_ps(std::numeric_limits<float>::min());
  const __m256 canonical_nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 head[8];
    for (int r = 0; r < 8; ++r) {
      const typename Format::Bits* x = keys + (b * 8 + r) * dim;
      __m256 s[kRegs];
      for (int k = 0; k < kRegs; ++k) {
        if (k < loaded) {
          const __m256 v = Format::load8(x + 8 * k);
          const __m256 square = _mm256_mul_ps(v, v);
          // Keep lanes that are not below the smallest normal (NaN kept).
          const __m256 normal = _mm256_cmp_ps(square, smallest_normal, _CMP_NLT_UQ);
          s[k] = _mm256_and_ps(square, normal);
        } else {
          s[k] = _mm256_setzero_ps();
        }
      }
      for (int h = kRegs / 2; h >= 1; h /= 2) {
        for (int k = 0; k < h; ++k) {
          s[k] = _mm256_add_ps(s[k], s[k + h]);
        }
      }
      head[r] = s[0];
    }
    // Transpose: t[i] holds s[i] of the eight rows.
    const __m256 a0 = _mm256_unpacklo_ps(head[0], head[1]);
    const __m256 a1 = _mm256_unpackhi_ps(head[0], head[1]);
    const __m256 a2 = _mm256_unpacklo_ps(head[2], head[3]);
    const __m256 a3 = _mm256_unpackhi_ps(head[2], head[3]);
    const __m256 a4 = _mm256_unpacklo_ps(head[4], head[5]);
    const __m256 a5 = _mm256_unpackhi_ps(head[4], head[5]);
    const __m256 a6 = _mm256_unpacklo_ps(head[6], head[7]);
    const __m256 a7 = _mm256_unpackhi_ps(head[6], head[7]);
    const __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44);
    const __m256 b1 = _mm256_shuffle_ps(a0, a2, 0xEE);
    const __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44);
    const __m256 b3 = _mm256_shuffle_ps(a1, a3, 0xEE);
    const __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44);
    const __m256 b5 = _mm256_shuffle_ps(a4, a6, 0xEE);
    const __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44);
    const __m256 b7 = _mm256_shuffle_ps(a5, a7, 0xEE);
    __m256 t[8] = {
        _mm256_permute2f128_ps(b0, b4, 0x20), _mm256_permute2f128_ps(b1, b5, 0x20),
        _mm256_permute2f128_ps(b2, b6, 0x20), _mm256_permute2f128_ps(b3, b7, 0x20),
        _mm256_permute2f128_ps(b0, b4, 0x31), _mm256_permute2f128_ps(b1, b5, 0x31),
        _mm256_permute2f128_ps(b2, b6, 0x31), _mm256_permute2f128_ps(b3, b7, 0x31)};
    for (int h = 4; h >= 1; h /= 2) {
      for (int i = 0; i < h; ++i) {
        t[i] = _mm256_add_ps(t[i], t[i + h]);
      }
    }
    const __m256 norm = _mm256_sqrt_ps(t[0]);
    const __m256 is_nan = _mm256_cmp_ps(norm, norm, _CMP_UNORD_Q);
    _mm256_storeu_ps(norms + b * 8, _mm256_blendv_ps(norm, canonical_nan, is_nan));
  }
}

template <typename Format>
using WideRows = void (*)(const typename Format::Bits*, float*, int64_t, int64_t);

// The eight-rows-at-a-time kernel for these keys, or nullptr where it does
// not apply (no AVX2/F16C, D not a multiple of 8, D > 512).
template <typename Format>
WideRows<Format> wide_norm_kernel(int64_t dim, int64_t width) {
  static const bool has =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  if (!has || dim % 8 != 0) {
    return nullptr;
  }
  switch (width) {
    case 8: return norm_rows_avx2<Format, 8>;
    case 16: return norm_rows_avx2<Format, 16>;
    case 32: return norm_rows_avx2<Format, 32>;
    case 64: return norm_rows_avx2<Format, 64>;
    case 128: return norm_rows_avx2<Format, 128>;
    case 256: return norm_rows_avx2<Format, 256>;
    case 512: return norm_rows_avx2<Format, 512>;
    default: return nullptr;
  }
}
#endif

// Rows [0, rows) of keys with the best kernel: eight rows at a time where
// the wide kernel applies, the remaining rows one by one.
template <typename Format>
void norm_rows_any(
    const typename Format::Bits* keys,
    float* norms,
    int64_t rows,
    int64_t dim,
    int64_t width,
    float* squares) {
  int64_t done = 0;
#if KNORM_HAVE_F16C_PATH
  if (WideRows<Format> wide = wide_norm_kernel<Format>(dim, width)) {
    done = rows - rows % 8;
    wide(keys, norms, done, dim);
  }
#endif
  norm_rows<Format>(keys + done * dim, norms + done, rows - done, dim, width, squares);
}

} // namespace

void key_norm_rows(
    mx::Dtype dtype,
    const void* keys,
    int64_t rows,
    int64_t dim,
    float* norms) {
  if (dim == 0) {
    std::fill(norms, norms + rows, 0.0f);
    return;
  }
  int64_t width = 1;
  while (width < dim) {
    width <<= 1;
  }
  // One scratch row per thread, reused for every call on it.
  thread_local std::vector<float> squares;
  if (squares.size() < static_cast<size_t>(width)) {
    squares.resize(width);
  }
  mx::dispatch_float_types(dtype, "mlx_knorm: key_norms", [&](auto type) {
    using T = MLX_GET_TYPE(type);
    if constexpr (std::is_same_v<T, double>) {
      throw std::invalid_argument("mlx_knorm: keys must be float16, bfloat16 or float32");
    } else {
      using Format = KeyFormat<T>;
      norm_rows_any<Format>(static_cast<const typename Format::Bits*>(keys), norms,
                            rows, dim, width, squares.data());
    }
  });
}

void key_norms_cpu(const mx::array& keys, mx::array& norms) {
  const int64_t dim = keys.shape(-1);
  const int64_t rows = static_cast<int64_t>(norms.size());
  const char* bits = keys.data<char>();
  float* out = norms.data<float>();
  const size_t row_bytes = dim * keys.itemsize();
  parallel_for(rows, row_bytes, [&](int64_t begin, int64_t end) {
    key_norm_rows(keys.dtype(), bits + begin * row_bytes, end - begin, dim, out + begin);
  });
}

} // namespace mlx_knorm
