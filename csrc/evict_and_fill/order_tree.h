// The order tree of docs/spec.md §4 step 4 on the CPU: one head's two
// halves, each `n + 1` int32 entries (the stamp, the n - 1 nodes in heap
// order, the winner). A node holds a slot; the keys are read from the
// norms and positions when two slots meet, so a slot outside [0, count)
// (unoccupied, or any int32 a wrong tree holds) is compared by its index
// alone and never read.
#pragma once

#include <cstdint>

#include "common/selection.h"

namespace mlx_knorm {

// What the comparisons of one head's tree read: its slots' norms and
// positions, how many are occupied, and the rank the tree is for.
struct OrderTreeKeys {
  const float* norms;
  const int32_t* positions;
  int64_t count;
  EvictionRank rank;

  bool occupied(int32_t s) const {
    return static_cast<uint32_t>(s) < static_cast<uint64_t>(count);
  }
  // Half 0: later in the eviction rank wins (unoccupied slots lose), ties
  // by slot, the higher winning.
  bool evicts_before(int32_t a, int32_t b) const {
    const bool in_a = occupied(a);
    if (in_a != occupied(b)) {
      return in_a;
    }
    if (in_a) {
      const uint64_t ra = rank(norms[a], positions[a]);
      const uint64_t rb = rank(norms[b], positions[b]);
      if (ra != rb) {
        return ra > rb;
      }
    }
    return a > b;
  }
  // A real row protected as one of the latest `recent`.
  bool in_window(int32_t s) const {
    if (!occupied(s)) {
      return false;
    }
    const int32_t p = positions[s];
    return rank.real(p) && p >= rank.protect_from;
  }
  // Half 1: a row of the window wins over any other slot, the earlier
  // position first, ties by slot, the lower winning.
  bool leaves_window_before(int32_t a, int32_t b, bool in_a, bool in_b) const {
    if (in_a != in_b) {
      return in_a;
    }
    if (in_a && positions[a] != positions[b]) {
      return positions[a] < positions[b];
    }
    return a < b;
  }
};

// The slot that wins node `node` of a half with n leaves.
inline int32_t tree_winner(const int32_t* half, int64_t n, int64_t node) {
  return node >= n ? static_cast<int32_t>(node - n) : half[node];
}

// Recomputes node `node` from its children; `beats(a, b)`: a wins over b.
template <typename Beats>
inline void tree_play(int32_t* half, int64_t n, int64_t node, const Beats& beats) {
  const int32_t a = tree_winner(half, n, 2 * node);
  const int32_t b = tree_winner(half, n, 2 * node + 1);
  half[node] = beats(a, b) ? a : b;
}

inline void tree_set_winner(int32_t* half, int64_t n) {
  if (n >= 1) {
    half[n] = n >= 2 ? half[1] : 0;
  }
}

// Every node, children before parents.
template <typename Beats>
inline void tree_build(int32_t* half, int64_t n, const Beats& beats) {
  for (int64_t node = n - 1; node >= 1; --node) {
    tree_play(half, n, node, beats);
  }
  tree_set_winner(half, n);
}

// The nodes above slot s, after its key changed.
template <typename Beats>
inline void tree_update(int32_t* half, int64_t n, int64_t s, const Beats& beats) {
  for (int64_t node = (n + s) / 2; node >= 1; node /= 2) {
    tree_play(half, n, node, beats);
  }
  tree_set_winner(half, n);
}

// Asks for the nodes an update above slot s reads that are not on its
// path (the other children), so that their misses overlap with each other
// and with whatever the caller does before the update.
inline void tree_prefetch_path(const int32_t* half, int64_t n, int64_t s) {
  for (int64_t child = n + s; child > 1; child /= 2) {
    if ((child ^ 1) < n) {
      __builtin_prefetch(half + (child ^ 1));
    }
  }
}

// Both halves of one head for the rank and rows of `keys`.
inline void order_tree_build(
    int32_t* eviction,
    int32_t* window,
    int64_t n,
    const OrderTreeKeys& keys,
    int64_t next_offset) {
  tree_build(eviction, n, [&](int32_t a, int32_t b) { return keys.evicts_before(a, b); });
  tree_build(window, n, [&](int32_t a, int32_t b) {
    return keys.leaves_window_before(a, b, keys.in_window(a), keys.in_window(b));
  });
  eviction[0] = static_cast<int32_t>(keys.count);
  window[0] = static_cast<int32_t>(next_offset);
}

} // namespace mlx_knorm
