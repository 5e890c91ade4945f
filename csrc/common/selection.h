// The eviction configuration and the selection rules of docs/spec.md §3 and
// §4, shared by every host-side kernel (the CPU kernels and the launch plans
// of the Metal kernels).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

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
// key(a) < key(b); -0 and +0 map together; every NaN maps after +inf.
inline uint32_t score_order_key(float score) {
  if (std::isnan(score)) {
    return 0xFFFFFFFFu;
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

// The rank of a stored row in docs/spec.md §4 step 1, as one 64-bit key:
// the score key, or 0 for a protected row (no score key is 0, so protected
// rows come first), then the position. Equal keys (equal positions) rank by
// slot, lower first.
struct EvictionRank {
  int32_t n_sink;        // positions below are protected
  int32_t protect_from;  // offset - recent: positions at or above are protected
  Keep keep;

  uint64_t operator()(float norm, int32_t position) const {
    const bool protect = position < n_sink || position >= protect_from;
    const uint64_t score = protect ? 0 : norm_order_key(norm, keep);
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
