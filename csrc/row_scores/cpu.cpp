// CPU kernel of RowScores. Compiled with -ffp-contract=off: each product,
// add, division and square root is one correctly rounded binary32 operation
// (docs/spec.md §2a). Heads run in parallel; keydiff takes each head's rows
// in order.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "mlx/dtype_utils.h"

#include "common/parallel.h"
#include "key_norms/key_norms.h"
#include "row_scores/row_scores.h"

namespace mlx_knorm {

namespace {

// docs/spec.md §2a: a result below the smallest normal float becomes +0
// (-0 too); NaN passes.
inline float flushed(float x) {
  return std::fabs(x) < std::numeric_limits<float>::min() ? 0.0f : x;
}

inline float canonical(float x) {
  if (std::isnan(x)) {
    const uint32_t bits = 0x7FC00000u;
    std::memcpy(&x, &bits, sizeof(x));
  }
  return x;
}

// The pinned sum of t[0, width): halving adds, each flushed (width a power
// of two; the terms past D are +0).
inline float pinned_sum(float* t, int64_t width) {
  for (int64_t h = width / 2; h >= 1; h /= 2) {
    for (int64_t i = 0; i < h; ++i) {
      t[i] = flushed(t[i] + t[i + h]);
    }
  }
  return t[0];
}

// A head's rows as float32 and the scratch the sums need: the width is the
// power of two >= D.
struct Terms {
  int64_t dim;
  int64_t width;
  std::vector<float> t;

  explicit Terms(int64_t d) : dim(d), width(1), t() {
    while (width < dim) {
      width <<= 1;
    }
    t.assign(width, 0.0f);
  }
  float norm(const float* x) {
    for (int64_t i = 0; i < dim; ++i) {
      t[i] = flushed(x[i] * x[i]);
    }
    std::fill(t.begin() + dim, t.end(), 0.0f);
    return canonical(std::sqrt(pinned_sum(t.data(), width)));
  }
  float dot(const float* x, const float* y) {
    for (int64_t i = 0; i < dim; ++i) {
      t[i] = flushed(x[i] * y[i]);
    }
    std::fill(t.begin() + dim, t.end(), 0.0f);
    return pinned_sum(t.data(), width);
  }
};

template <typename T>
void to_float(const T* x, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = static_cast<float>(x[i]);
  }
}

struct Views {
  const void* keys;
  const void* values;
  const float* state;
  const int32_t* valid;
  float* scores;
  float* state_out;
};

bool real_row(const RowScoresConfig& config, const int32_t* valid, int64_t head, int64_t j) {
  if (!config.has_valid) {
    return true;
  }
  const int64_t p = config.offset + j;
  return p >= valid[2 * head] && p < valid[2 * head + 1];
}

// Heads [begin, end) of one scorer other than knorm.
template <typename T>
void score_heads(const Views& v, const RowScoresConfig& config, int64_t rows, int64_t key_dim,
                 int64_t value_dim, int64_t begin, int64_t end) {
  const T* keys = static_cast<const T*>(v.keys);
  const T* values = static_cast<const T*>(v.values);
  Terms key_terms(key_dim);
  Terms value_terms(value_dim);
  std::vector<float> k(key_dim);
  std::vector<float> w(std::max(value_dim, key_dim));
  for (int64_t h = begin; h < end; ++h) {
    float* sum = config.scorer == Scorer::KeyDiff ? v.state_out + h * key_dim : nullptr;
    if (sum != nullptr) {
      std::copy(v.state + h * key_dim, v.state + (h + 1) * key_dim, sum);
    }
    for (int64_t j = 0; j < rows; ++j) {
      const int64_t row = h * rows + j;
      to_float(keys + row * key_dim, key_dim, k.data());
      float score = 0.0f;
      const bool real = real_row(config, v.valid, h, j);
      switch (config.scorer) {
        case Scorer::ValueNorm:
          to_float(values + row * value_dim, value_dim, w.data());
          score = canonical(flushed(key_terms.norm(k.data()) / value_terms.norm(w.data())));
          break;
        case Scorer::QueryFilter:
          score = canonical(flushed(-key_terms.dot(k.data(), v.state + h * key_dim)));
          break;
        case Scorer::KeyDiff: {
          if (!real) {
            break;
          }
          const float norm = key_terms.norm(k.data());
          if (!std::isfinite(norm)) {
            score = canonical(std::numeric_limits<float>::quiet_NaN());
            break;
          }
          const float denominator = flushed(norm * key_terms.norm(sum));
          const float projection = key_terms.dot(k.data(), sum);
          if (denominator != 0.0f) {
            score = canonical(flushed(projection / denominator));
          }
          if (norm != 0.0f) {
            for (int64_t i = 0; i < key_dim; ++i) {
              sum[i] = flushed(sum[i] + flushed(k[i] / norm));
            }
          }
          break;
        }
        case Scorer::KeyNorm:
          break;
      }
      v.scores[row] = real ? score : 0.0f;
    }
  }
}

} // namespace

CpuTask row_scores_cpu_task(
    const RowScoresInputs& inputs,
    std::vector<mx::array>& outputs,
    const RowScoresConfig& config) {
  const Views views{
      inputs.keys.data<void>(),
      inputs.values ? inputs.values->data<void>() : nullptr,
      inputs.state ? inputs.state->data<float>() : nullptr,
      inputs.valid ? inputs.valid->data<int32_t>() : nullptr,
      outputs[0].data<float>(),
      config.returns_state() ? outputs[1].data<float>() : nullptr};
  const int64_t heads = inputs.heads();
  const int64_t rows = inputs.rows();
  const int64_t key_dim = inputs.key_dim();
  const int64_t value_dim = inputs.value_dim();
  const mx::Dtype dtype = inputs.keys.dtype();
  const size_t head_bytes = rows * (key_dim + value_dim) * inputs.keys.itemsize();
  return [=] {
    if (config.scorer == Scorer::KeyNorm) {
      // The key norms' own kernel (docs/spec.md §2), then padding rows to +0.
      const size_t row_bytes = key_dim * mx::size_of(dtype);
      parallel_for(heads * rows, row_bytes, [&](int64_t begin, int64_t end) {
        key_norm_rows(dtype, static_cast<const char*>(views.keys) + begin * row_bytes, end - begin,
                      key_dim, views.scores + begin);
        for (int64_t r = begin; r < end; ++r) {
          if (!real_row(config, views.valid, r / rows, r % rows)) {
            views.scores[r] = 0.0f;
          }
        }
      });
      return;
    }
    parallel_for(heads, head_bytes, [&](int64_t begin, int64_t end) {
      mx::dispatch_float_types(dtype, "mlx_knorm: row_scores", [&](auto type) {
        using T = MLX_GET_TYPE(type);
        if constexpr (std::is_same_v<T, double>) {
          throw std::invalid_argument("mlx_knorm: keys must be float16, bfloat16 or float32");
        } else {
          score_heads<T>(views, config, rows, key_dim, value_dim, begin, end);
        }
      });
    });
  };
}

void row_scores_cpu(
    const RowScoresInputs& inputs,
    std::vector<mx::array>& outputs,
    const RowScoresConfig& config) {
  row_scores_cpu_task(inputs, outputs, config)();
}

} // namespace mlx_knorm
