// The order tree of docs/spec.md §4 step 4 on the CPU: one head's two
// halves, each `n + 1` int32 entries (the stamp, the n - 1 nodes in heap
// order, the winner). A node holds a slot; the keys are read from the
// norms and positions when two slots meet, so a slot outside [0, count)
// (unoccupied, or any int32 a wrong tree holds) is compared by its index
// alone and never read.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/selection.h"

namespace mlx_knorm {

// A slot's place in one half's order as one integer, the winner of two
// slots the one of the larger key. The slot is the key's lowest bits, so
// distinct slots never tie and a node's winner does not depend on which
// child a slot came from: an update can carry its path's winner and key up
// and read only the other child's.
using TreeKey = unsigned __int128;

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
  // by slot, the higher winning. Slots compare as int32 (a wrong tree may
  // hold any).
  TreeKey eviction_key(int32_t s) const {
    const uint32_t slot = static_cast<uint32_t>(s) ^ 0x80000000u;
    if (!occupied(s)) {
      return slot;
    }
    return (TreeKey(1) << 96) | (TreeKey(rank(norms[s], positions[s])) << 32) | slot;
  }
  bool evicts_before(int32_t a, int32_t b) const {
    return eviction_key(a) > eviction_key(b);
  }
  // A real row protected as one of the latest `recent`.
  bool in_window(int32_t s) const {
    if (!occupied(s)) {
      return false;
    }
    const int32_t p = positions[s];
    return rank.real(p) && p >= rank.protect_from;
  }
  // Half 1: a row of the window (`in`: s counts as one) wins over any other
  // slot, the earlier position first, ties by slot, the lower winning.
  TreeKey window_key(int32_t s, bool in) const {
    const uint32_t slot = ~(static_cast<uint32_t>(s) ^ 0x80000000u);
    if (!in) {
      return slot;
    }
    return (TreeKey(1) << 64) | (TreeKey(~position_order_key(positions[s])) << 32) | slot;
  }
  TreeKey window_key(int32_t s) const {
    return window_key(s, in_window(s));
  }
  bool leaves_window_before(int32_t a, int32_t b) const {
    return window_key(a) > window_key(b);
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

// The nodes above slot s, below node `stop` (an ancestor of its leaf, or 0
// for all of them), after its key changed; `key(slot)`: its TreeKey. The
// other children's winners are read and keyed before any comparison, so
// that their cache misses overlap; none of them is on the path.
template <typename Key>
inline void tree_update_below(int32_t* half, int64_t n, int64_t s, int64_t stop, const Key& key) {
  constexpr int kMaxDepth = 64;
  int32_t rival[kMaxDepth];
  TreeKey rival_key[kMaxDepth];
  int depth = 0;
  for (int64_t child = n + s; child / 2 > stop; child /= 2) {
    rival[depth++] = tree_winner(half, n, child ^ 1);
  }
  for (int i = 0; i < depth; ++i) {
    rival_key[i] = key(rival[i]);
  }
  int32_t winner = static_cast<int32_t>(s);
  TreeKey best = key(winner);
  int64_t node = n + s;
  for (int i = 0; i < depth; ++i) {
    const bool rival_wins = rival_key[i] > best;
    winner = rival_wins ? rival[i] : winner;
    best = rival_wins ? rival_key[i] : best;
    node /= 2;
    half[node] = winner;
  }
}

// The nearest common ancestor of two nodes (heap order: of two nodes at
// different depths the deeper has the larger index).
inline int64_t tree_meet(int64_t a, int64_t b) {
  while (a != b) {
    if (a > b) {
      a /= 2;
    } else {
      b /= 2;
    }
  }
  return a;
}

// The nodes above slots[0, count) after their keys changed, each
// recomputed once: a path stops below the lowest node it shares with a
// later path, which recomputes that node from its final children.
template <typename Key>
inline void tree_update(int32_t* half, int64_t n, const int32_t* slots, int count, const Key& key) {
  for (int i = 0; i < count; ++i) {
    int64_t stop = 0;
    for (int j = i + 1; j < count; ++j) {
      stop = std::max(stop, tree_meet(n + slots[i], n + slots[j]));
    }
    tree_update_below(half, n, slots[i], stop, key);
  }
  tree_set_winner(half, n);
}

// Both halves of one head for the rank and rows of `keys`.
inline void order_tree_build(
    int32_t* eviction,
    int32_t* window,
    int64_t n,
    const OrderTreeKeys& keys,
    int64_t next_offset) {
  tree_build(eviction, n, [&](int32_t a, int32_t b) { return keys.evicts_before(a, b); });
  tree_build(window, n, [&](int32_t a, int32_t b) { return keys.leaves_window_before(a, b); });
  eviction[0] = static_cast<int32_t>(keys.count);
  window[0] = static_cast<int32_t>(next_offset);
}

} // namespace mlx_knorm
