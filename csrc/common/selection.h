// The eviction configuration and the selection rules of docs/spec.md §3 and
// §4, shared by every host-side kernel (the CPU kernels and the launch plans
// of the Metal kernels).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <limits>
#include <string>

#include "metal/knorm_defines.h"

namespace mlx_knorm {

enum class Keep { Low, High };

inline Keep parse_keep(const std::string& keep) {
  if (keep == "low") {
    return Keep::Low;
  }
  if (keep == "high") {
    return Keep::High;
  }
  throw std::invalid_argument(
      "mlx_knorm: keep must be 'low' or 'high', got '" + keep + "'");
}

// budget, n_sink, recent and keep of docs/spec.md §1, checked by
// check_selection_config (common/validation.h).
struct SelectionConfig {
  int budget;
  int n_sink;
  int recent;
  Keep keep;

  bool operator==(const SelectionConfig&) const = default;
};

// Order-preserving map of a score to uint32: a < b as floats iff
// key(a) < key(b); -0 and +0 map together; every NaN maps after +inf, to
// kNanScoreKey. No score maps to 0 or to kPaddingScoreKey
// (metal/knorm_defines.h).
inline uint32_t score_order_key(float score) {
  if (std::isnan(score)) {
    return kNanScoreKey;
  }
  uint32_t bits;
  std::memcpy(&bits, &score, sizeof(bits));
  if ((bits & 0x7FFFFFFFu) == 0) {
    bits = 0;
  }
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

inline uint32_t norm_order_key(float norm, Keep keep) {
  return score_order_key(keep == Keep::Low ? norm : -norm);
}

// The strict total order of docs/spec.md §3 as one unique 64-bit key: score
// first, then row index.
inline uint64_t rank_key(float norm, Keep keep, uint32_t row) {
  return (static_cast<uint64_t>(norm_order_key(norm, keep)) << 32) | row;
}

// int32 positions as uint32 in the same order.
inline uint32_t position_order_key(int32_t position) {
  return static_cast<uint32_t>(position) ^ 0x80000000u;
}

// The rank of a stored row of one head in docs/spec.md §4 step 1, as one
// 64-bit key: the score key, 0 for a protected row (no score key is 0, so
// protected rows come first) or kPaddingScoreKey for a padding row (every
// score key is below it), then the position. Equal keys (equal positions)
// rank by slot, lower first.
struct EvictionRank {
  int32_t first_real;    // real rows: first_real <= p <= last_real
  int32_t last_real;
  int32_t sink_end;      // real positions below are protected
  int32_t protect_from;  // real positions at or above are protected
  Keep keep;

  // The head's rank: without a valid range every row is real, the sinks
  // are the positions below n_sink and the window starts at offset -
  // recent; with (lo, hi) the real rows are [lo, hi), the sinks [lo, lo +
  // n_sink) and the window starts at min(offset, hi) - recent. Bounds past
  // int32 are clamped, which changes no real row's protection (real
  // positions are below hi <= 2^31 - 1).
  static EvictionRank of(
      const SelectionConfig& config,
      int64_t offset,
      const int32_t* valid) {
    constexpr int32_t kMin = std::numeric_limits<int32_t>::min();
    constexpr int32_t kMax = std::numeric_limits<int32_t>::max();
    auto clamp = [](int64_t v) {
      return static_cast<int32_t>(std::clamp<int64_t>(v, std::numeric_limits<int32_t>::min(),
                                                      std::numeric_limits<int32_t>::max()));
    };
    if (valid == nullptr) {
      return EvictionRank{kMin, kMax, config.n_sink, clamp(offset - config.recent), config.keep};
    }
    const int64_t lo = valid[0];
    const int64_t hi = valid[1];
    // No real row when hi <= lo.
    return EvictionRank{hi > lo ? static_cast<int32_t>(lo) : kMax,
                        hi > lo ? static_cast<int32_t>(hi - 1) : kMin,
                        clamp(lo + config.n_sink), clamp(std::min(offset, hi) - config.recent),
                        config.keep};
  }

  bool real(int32_t position) const {
    return first_real <= position && position <= last_real;
  }

  uint64_t operator()(float norm, int32_t position) const {
    uint64_t score = kPaddingScoreKey;
    if (real(position)) {
      const bool protect = position < sink_end || position >= protect_from;
      score = protect ? 0 : norm_order_key(norm, keep);
    }
    return (score << 32) | position_order_key(position);
  }
};

// Protected ranges and the number of middle rows to keep for one row of
// n_total tokens (all rows of a call share it).
struct RowSelection {
  int64_t n_total;
  int64_t kept;      // min(n_total, budget)
  int64_t n_sink;    // ns: rows [0, ns) always kept
  int64_t mid_end;   // rows [mid_end, n_total) always kept
  int64_t mid_keep;  // m: middle rows kept when evicting
  bool evicts;       // n_total > budget

  RowSelection(int64_t n_total_, const SelectionConfig& config)
      : n_total(n_total_),
        kept(std::min<int64_t>(n_total_, config.budget)),
        n_sink(std::min<int64_t>(config.n_sink, n_total_)),
        evicts(n_total_ > config.budget) {
    const int64_t r = std::min<int64_t>(config.recent, n_total - n_sink);
    mid_end = n_total - r;
    mid_keep = config.budget - n_sink - r;
  }
};

} // namespace mlx_knorm
