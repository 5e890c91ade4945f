// CPU kernel of KeyNorms. Compiled with -ffp-contract=off: each square and
// each add is one correctly rounded binary32 operation (docs/spec.md §2).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
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

// The vector kernel below is written once against GCC/Clang vector
// extensions, kLanes floats to a vector: 8 (one AVX2 register) on x86, 4
// (one NEON register) on AArch64. Wheels target baseline x86-64, so on x86
// it is compiled for AVX2/F16C alone and chosen at run time with
// __builtin_cpu_supports (not with target_clones, whose ifunc resolvers run
// before a sanitizer's runtime starts and crash the sanitizer builds of
// .ci/sanitize); on AArch64 NEON is the baseline. Other targets take the
// scalar loop.
#if defined(__GNUC__) && defined(__x86_64__)
#define KNORM_HAVE_VECTOR_PATH 1
#define KNORM_VECTOR_TARGET __attribute__((target("avx2,f16c")))
constexpr int kLanes = 8;
#elif defined(__GNUC__) && defined(__aarch64__)
#define KNORM_HAVE_VECTOR_PATH 1
#define KNORM_VECTOR_TARGET
constexpr int kLanes = 4;
#else
#define KNORM_HAVE_VECTOR_PATH 0
#endif

#if KNORM_HAVE_VECTOR_PATH
// The kernel's helpers, inlined into it whatever the inliner's size limits.
#define KNORM_VECTOR_INLINE KNORM_VECTOR_TARGET inline __attribute__((always_inline))

typedef float Floats __attribute__((vector_size(4 * kLanes)));
typedef uint32_t Words __attribute__((vector_size(4 * kLanes)));
typedef uint16_t Halves __attribute__((vector_size(2 * kLanes)));

// A vector from the (unaligned) bytes at x.
template <typename Vector, typename T>
KNORM_VECTOR_INLINE Vector load_vector(const T* x) {
  Vector v;
  std::memcpy(&v, x, sizeof(v));
  return v;
}
#endif

// How keys of MLX element type T are read: their storage bits, to_float (an
// exact conversion of one key) and, where the vector kernel exists, load
// (kLanes exact conversions at a time).
template <typename T>
struct KeyFormat;

// The branch-free form of the conversion MLX's float16_t uses (Maratyszcza's
// FP16), so that it vectorises; NaN payloads come out as MLX's do. F16C on
// x86 and FCVTL (vcvt) on AArch64 convert exactly too.
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
#if KNORM_HAVE_VECTOR_PATH && defined(__x86_64__)
  KNORM_VECTOR_INLINE static Floats load(const uint16_t* x) {
    return (Floats)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  }
#elif KNORM_HAVE_VECTOR_PATH
  KNORM_VECTOR_INLINE static Floats load(const uint16_t* x) {
    const float32x4_t v = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(x)));
    return load_vector<Floats>(&v);
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
#if KNORM_HAVE_VECTOR_PATH
  KNORM_VECTOR_INLINE static Floats load(const uint16_t* x) {
    return (Floats)(__builtin_convertvector(load_vector<Halves>(x), Words) << 16);
  }
#endif
};

template <>
struct KeyFormat<float> {
  using Bits = float;
  static float to_float(float x) {
    return x;
  }
#if KNORM_HAVE_VECTOR_PATH
  KNORM_VECTOR_INLINE static Floats load(const float* x) {
    return load_vector<Floats>(x);
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

#if KNORM_HAVE_VECTOR_PATH
// Lanes of a and b (b's numbered from kLanes) in the given order.
#if defined(__clang__) || __GNUC__ >= 12
#define KNORM_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int32_t Lanes __attribute__((vector_size(4 * kLanes)));
#define KNORM_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, Lanes{__VA_ARGS__})
#endif

// Lane k of the pairing of a and b below: their lanes come in blocks of
// 2h, and block j of the result is the low halves of a's and b's blocks j
// (or their high halves).
constexpr int paired_lane(int k, int h, bool high) {
  const int block = k / (2 * h) * (2 * h);
  const int q = k % (2 * h);
  return (q < h ? block + q : kLanes + block + q - h) + (high ? h : 0);
}

// One halving level of the rows in a and b at once: a block of 2h lanes
// holding s[0, 2h) of a row becomes h lanes holding s[i] + s[i + h].
template <int h, size_t... K>
KNORM_VECTOR_INLINE Floats add_halves(Floats a, Floats b, std::index_sequence<K...>) {
  return KNORM_SHUFFLE(a, b, paired_lane(K, h, false)...) +
      KNORM_SHUFFLE(a, b, paired_lane(K, h, true)...);
}

// The last log2(kLanes) halving levels of kLanes rows, v[r] holding
// s[0, kLanes) of row slot r: v[0] ends with lane k holding s[0] of slot
// reversed_bits(k).
template <int h>
KNORM_VECTOR_INLINE void add_halves_of_rows(Floats* v) {
  for (int i = 0; i < h; ++i) {
    v[i] = add_halves<h>(v[2 * i], v[2 * i + 1], std::make_index_sequence<kLanes>());
  }
  if constexpr (h > 1) {
    add_halves_of_rows<h / 2>(v);
  }
}

// i with its log2(kLanes) bits in reverse order.
constexpr int reversed_bits(int i) {
  int out = 0;
  for (int bit = 1; bit < kLanes; bit <<= 1) {
    out = (out << 1) | ((i & bit) != 0);
  }
  return out;
}

// Correctly rounded square roots, lane by lane.
KNORM_VECTOR_INLINE Floats sqrt_lanes(Floats v) {
#if defined(__x86_64__)
  return (Floats)_mm256_sqrt_ps((__m256)v);
#else
  const float32x4_t root = vsqrtq_f32(load_vector<float32x4_t>(&v));
  return load_vector<Floats>(&root);
#endif
}

// Rows of D = kLanes * n, padded width kWidth (the power of two >= D, >=
// kLanes), kLanes rows per step. Within a row the squares sit in
// kWidth / kLanes vectors, s[i] in vector i / kLanes, lane i % kLanes:
// every halving level down to h = kLanes adds vector k + h / kLanes to
// vector k, which is exactly s[i] + s[i + h] lane by lane. The last levels
// (h < kLanes) pair the lanes of two rows at a time (add_halves_of_rows),
// lane-wise adds of s[i] and s[i + h] of one row too: no add is reordered.
// Rows go to slots in bit-reversed order, so that lane k of the result is
// row k; they are read in order (reading them in bit-reversed order was
// five times slower on the AMD EPYC it was measured on).
template <typename Format, int kWidth>
KNORM_VECTOR_TARGET void norm_rows_vector(
    const typename Format::Bits* __restrict keys,
    float* __restrict norms,
    int64_t rows,
    int64_t dim) {
  constexpr int kVectors = kWidth / kLanes;
  const int loaded = static_cast<int>(dim / kLanes);
  const int64_t blocks = rows / kLanes;
  const Floats smallest_normal = Floats{} + std::numeric_limits<float>::min();
  const Words canonical_nan = Words{} + 0x7FC00000u;
  for (int64_t b = 0; b < blocks; ++b) {
    Floats head[kLanes];
    for (int r = 0; r < kLanes; ++r) {
      const typename Format::Bits* x = keys + (b * kLanes + r) * dim;
      Floats s[kVectors];
      for (int k = 0; k < kVectors; ++k) {
        if (k < loaded) {
          const Floats v = Format::load(x + kLanes * k);
          const Floats square = v * v;
          // Lanes below the smallest normal become +0 (NaN compares false).
          s[k] = (Floats)((Words)square & ~(Words)(square < smallest_normal));
        } else {
          s[k] = Floats{};
        }
      }
      for (int h = kVectors / 2; h >= 1; h /= 2) {
        for (int k = 0; k < h; ++k) {
          s[k] = s[k] + s[k + h];
        }
      }
      head[reversed_bits(r)] = s[0];
    }
    add_halves_of_rows<kLanes / 2>(head);
    const Floats norm = sqrt_lanes(head[0]);
    const Words is_nan = (Words)(norm != norm);
    const Words out = ((Words)norm & ~is_nan) | (canonical_nan & is_nan);
    std::memcpy(norms + b * kLanes, &out, sizeof(out));
  }
}

template <typename Format>
using WideRows = void (*)(const typename Format::Bits*, float*, int64_t, int64_t);

template <typename Format, int kWidth>
WideRows<Format> vector_kernel_of_width() {
  if constexpr (kWidth < kLanes) {
    return nullptr;
  } else {
    return norm_rows_vector<Format, kWidth>;
  }
}

// The kLanes-rows-at-a-time kernel for these keys, or nullptr where it
// does not apply (an x86 CPU without AVX2/F16C, D not a multiple of kLanes,
// D > 512).
template <typename Format>
WideRows<Format> wide_norm_kernel(int64_t dim, int64_t width) {
#if defined(__x86_64__)
  static const bool has =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
  constexpr bool has = true;
#endif
  if (!has || dim % kLanes != 0) {
    return nullptr;
  }
  switch (width) {
    case 4: return vector_kernel_of_width<Format, 4>();
    case 8: return vector_kernel_of_width<Format, 8>();
    case 16: return vector_kernel_of_width<Format, 16>();
    case 32: return vector_kernel_of_width<Format, 32>();
    case 64: return vector_kernel_of_width<Format, 64>();
    case 128: return vector_kernel_of_width<Format, 128>();
    case 256: return vector_kernel_of_width<Format, 256>();
    case 512: return vector_kernel_of_width<Format, 512>();
    default: return nullptr;
  }
}
#endif

// Rows [0, rows) of keys with the best kernel: kLanes rows at a time where
// the vector kernel applies, the remaining rows one by one.
template <typename Format>
void norm_rows_any(
    const typename Format::Bits* keys,
    float* norms,
    int64_t rows,
    int64_t dim,
    int64_t width,
    float* squares) {
  int64_t done = 0;
#if KNORM_HAVE_VECTOR_PATH
  if (WideRows<Format> wide = wide_norm_kernel<Format>(dim, width)) {
    done = rows - rows % kLanes;
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

CpuTask key_norms_cpu_task(const mx::array& keys, mx::array& norms) {
  const int64_t dim = keys.shape(-1);
  const int64_t rows = static_cast<int64_t>(norms.size());
  const char* bits = keys.data<char>();
  float* out = norms.data<float>();
  const size_t row_bytes = dim * keys.itemsize();
  return [dtype = keys.dtype(), dim, rows, bits, out, row_bytes] {
    parallel_for(rows, row_bytes, [&](int64_t begin, int64_t end) {
      key_norm_rows(dtype, bits + begin * row_bytes, end - begin, dim, out + begin);
    });
  };
}

void key_norms_cpu(const mx::array& keys, mx::array& norms) {
  key_norms_cpu_task(keys, norms)();
}

} // namespace mlx_knorm
