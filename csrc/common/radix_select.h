// Radix select over unsigned order keys, the O(n) selection of the CPU
// kernels (the Metal kernels use the same method): the rank-th smallest key
// and how many keys equal to it fall within the first rank. Shared by
// protected_topk_gather (32-bit score keys) and evict_and_fill (64-bit rank
// keys).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace mlx_knorm {

template <typename Key>
struct Threshold {
  Key key;             // the key of the rank-th smallest
  int64_t take_equal;  // how many keys equal to it are within the first rank
};

// Digits of at most 11 bits, most significant first: a 2048-bin histogram
// stays in L1 and 32-bit keys take three passes, 64-bit keys six.
template <typename Key>
struct RadixDigits;

template <>
struct RadixDigits<uint32_t> {
  static constexpr int count = 3;
  static constexpr int bits[count] = {11, 11, 10};
};

template <>
struct RadixDigits<uint64_t> {
  static constexpr int count = 6;
  static constexpr int bits[count] = {11, 11, 11, 11, 10, 10};
};

// Buffers reused across calls (one per thread).
template <typename Key>
struct RadixScratch {
  std::vector<uint32_t> histogram = std::vector<uint32_t>(size_t(1) << 11);
  std::vector<Key> survivors;
};

// The rank-th smallest (1-based, 1 <= rank <= n) of keys[0, n), and how many
// of the keys equal to it fall within the first rank: keeping every key
// below it and the first take_equal keys equal to it in index order keeps
// exactly rank keys, ties going to the lowest indices. The first pass counts
// every key; the second also gathers the keys that match the chosen digit,
// and later passes read only those.
template <typename Key>
Threshold<Key> radix_select(
    const Key* keys,
    int64_t n,
    int64_t rank,
    RadixScratch<Key>& scratch) {
  static_assert(std::is_unsigned_v<Key>, "order keys are unsigned");
  auto& histogram = scratch.histogram;
  auto& survivors = scratch.survivors;
  Key prefix = 0;
  Key mask = 0;
  int shift = static_cast<int>(8 * sizeof(Key));
  int64_t n_survivors = 0;
  for (int pass = 0; pass < RadixDigits<Key>::count; ++pass) {
    const int bits = RadixDigits<Key>::bits[pass];
    shift -= bits;
    const Key digits = (Key(1) << bits) - 1;
    std::fill(histogram.begin(), histogram.begin() + digits + 1, 0u);
    if (pass == 0) {
      for (int64_t i = 0; i < n; ++i) {
        ++histogram[(keys[i] >> shift) & digits];
      }
    } else if (pass == 1) {
      survivors.resize(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        const Key key = keys[i];
        if ((key & mask) == prefix) {
          survivors[n_survivors++] = key;
          ++histogram[(key >> shift) & digits];
        }
      }
    } else {
      int64_t kept = 0;
      for (int64_t i = 0; i < n_survivors; ++i) {
        const Key key = survivors[i];
        if ((key & mask) == prefix) {
          survivors[kept++] = key;
          ++histogram[(key >> shift) & digits];
        }
      }
      n_survivors = kept;
    }
    Key digit = 0;
    while (rank > histogram[digit]) {
      rank -= histogram[digit];
      ++digit;
    }
    prefix |= digit << shift;
    mask |= digits << shift;
  }
  return {prefix, rank};
}

} // namespace mlx_knorm
