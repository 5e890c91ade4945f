// The order tree of docs/spec.md section 4 step 4 on the GPU: after a
// step's other dispatches, knorm_build_order_tree builds each head's two
// halves over the output's rows, one threadgroup of kEvictGroupSize threads
// per head, level by level from the deepest (a node's children are the
// level below, or slots), with a device-memory barrier between levels. The
// comparisons are those of csrc/evict_and_fill/order_tree.h: a node holds a
// slot, keys are read from the output's norms and positions when two slots
// meet, and a slot outside [0, count) is compared by its index alone.
//
// Instantiated in evict_and_fill.metal; launched by the plan of
// csrc/evict_and_fill/plan.cpp.
#ifndef MLX_KNORM_METAL_ORDER_TREE_H
#define MLX_KNORM_METAL_ORDER_TREE_H

#include "evict_and_fill.h"

// One head's output rows, their count and the next step's rank rule.
struct KnormTreeKeys {
  KnormEvictHead rows;
  uint count;
};

inline bool knorm_tree_occupied(KnormTreeKeys k, int s) {
  return uint(s) < k.count;
}

// Half 0: later in the eviction rank wins (unoccupied slots lose), ties by
// slot, the higher winning.
inline bool knorm_evicts_before(KnormTreeKeys k, int a, int b) {
  const bool in_a = knorm_tree_occupied(k, a);
  if (in_a != knorm_tree_occupied(k, b)) {
    return in_a;
  }
  if (in_a) {
    const ulong ra = knorm_rank_of(k.rows, uint(a));
    const ulong rb = knorm_rank_of(k.rows, uint(b));
    if (ra != rb) {
      return ra > rb;
    }
  }
  return a > b;
}

// A real row protected as one of the latest `recent`.
inline bool knorm_in_window(KnormTreeKeys k, int s) {
  if (!knorm_tree_occupied(k, s)) {
    return false;
  }
  const int p = k.rows.positions[s];
  return p >= k.rows.first_real && p <= k.rows.last_real && p >= k.rows.protect_from;
}

// Half 1: a row of the window wins over any other slot, the earlier position
// first, ties by slot, the lower winning.
inline bool knorm_leaves_window_before(KnormTreeKeys k, int a, int b) {
  const bool in_a = knorm_in_window(k, a);
  if (in_a != knorm_in_window(k, b)) {
    return in_a;
  }
  if (in_a) {
    const int pa = k.rows.positions[a];
    const int pb = k.rows.positions[b];
    if (pa != pb) {
      return pa < pb;
    }
  }
  return a < b;
}

// The slot that wins node `node` of a half with n leaves.
inline int knorm_tree_winner(device const int* tree_half, uint n, uint node) {
  return node >= n ? int(node - n) : tree_half[node];
}

// Threadgroup h builds head h's tree: int [2, out_slots + 1] per head.
// Norms and positions are the step's outputs, written by the dispatches
// before (or bound to placeholders when the output holds no row).
template <uint kGroupSize>
[[kernel, max_total_threads_per_threadgroup(kGroupSize)]] void knorm_build_order_tree(
    device const float* norms KNORM_BUFFER(0),
    device const int* positions KNORM_BUFFER(1),
    device const int* valid KNORM_BUFFER(2),
    device int* tree KNORM_BUFFER(3),
    constant KnormEvictParams& params KNORM_BUFFER(4),
    uint head KNORM_ATTRIBUTE(threadgroup_position_in_grid),
    uint tid KNORM_ATTRIBUTE(thread_position_in_threadgroup)) {
  const uint n = params.out_slots;
  const ulong row = ulong(head) * n;
  const long next_offset = long(params.offset) + long(params.n_new);
  const KnormTreeKeys keys = {
      knorm_evict_head(params, valid, head, norms + row, positions + row, nullptr, next_offset),
      params.kept + params.n_new};
  device int* eviction = tree + ulong(head) * 2 * (ulong(n) + 1);
  device int* window = eviction + n + 1;
  if (n >= 2) {
    // The deepest level of nodes: floor(log2(n - 1)); n < 2^31.
    uint depth = 0;
    while ((2u << depth) <= n - 1) {
      ++depth;
    }
    for (uint depth_left = depth + 1; depth_left-- > 0;) {
      const uint first = 1u << depth_left;
      const uint end = (first << 1) < n ? (first << 1) : n;
      // node < n < 2^31: neither node + kGroupSize nor 2 * node + 1 wraps.
      for (uint node = first + tid; node < end; node += kGroupSize) {
        int a = knorm_tree_winner(eviction, n, 2 * node);
        int b = knorm_tree_winner(eviction, n, 2 * node + 1);
        eviction[node] = knorm_evicts_before(keys, a, b) ? a : b;
        a = knorm_tree_winner(window, n, 2 * node);
        b = knorm_tree_winner(window, n, 2 * node + 1);
        window[node] = knorm_leaves_window_before(keys, a, b) ? a : b;
      }
      // The level above reads these nodes.
      threadgroup_barrier(mem_flags::mem_device);
    }
  }
  if (tid == 0) {
    eviction[0] = int(keys.count);
    window[0] = int(next_offset);
    if (n >= 1) {
      eviction[n] = n >= 2 ? eviction[1] : 0;
      window[n] = n >= 2 ? window[1] : 0;
    }
  }
}

#endif // MLX_KNORM_METAL_ORDER_TREE_H
