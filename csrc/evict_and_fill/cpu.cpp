// CPU kernel of EvictAndFill (docs/spec.md §4). Per head: the rows to evict
// (one scan for the worst rank when one row leaves, the radix select of
// common/radix_select.h otherwise), the compaction as a list of row moves
// applied to every buffer (the payloads, norms and positions), then the new
// rows. A buffer updated in place (donated) gets only the moves whose source
// and destination differ: a decode step in the slot layout moves one row per
// head.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common/parallel.h"
#include "common/radix_select.h"
#include "evict_and_fill/evict_and_fill.h"
#include "evict_and_fill/order_tree.h"
#include "key_norms/key_norms.h"

namespace mlx_knorm {

namespace {

// One of the buffers a step moves rows of: the input's rows and the
// output's. in == out when the output took over the input's buffer.
struct RowBuffer {
  const char* in;
  char* out;
  size_t row_bytes;

  bool in_place() const {
    return in == out;
  }
};

struct EvictAndFillBuffers {
  // The payloads, then the norms and the positions.
  std::array<RowBuffer, kEvictMaxPayloads + 2> rows;
  int payloads;       // M
  int64_t heads;      // N
  int64_t in_slots;   // C
  int64_t out_slots;  // C_out
  std::array<const char*, kEvictMaxPayloads> new_rows;
  const float* new_norms;  // given [N, S], or null: computed from new_rows[0]
  const int32_t* valid;    // [N, 2], or null: every row real
  mx::Dtype key_dtype;     // of payload 0, when the norms are computed
  int64_t key_dim;
  int64_t n_new;
  const int32_t* tree_in;  // the given order tree [N, 2, C + 1], or null
  int32_t* tree_out;       // the output's [N, 2, C_out + 1], or null

  int buffers() const {
    return payloads + 2;
  }
  const RowBuffer& norms() const {
    return rows[payloads];
  }
  const RowBuffer& positions() const {
    return rows[payloads + 1];
  }
  EvictionRank rank(const EvictAndFillConfig& config, int64_t n) const {
    return EvictionRank::of(config.selection, config.offset, valid ? valid + 2 * n : nullptr);
  }
  // The rank of the next step, the one the output tree is for.
  EvictionRank next_rank(const EvictAndFillConfig& config, int64_t n) const {
    return EvictionRank::of(config.selection, config.offset + n_new, valid ? valid + 2 * n : nullptr);
  }
  const float* out_norms(int64_t n) const {
    return reinterpret_cast<const float*>(norms().out) + n * out_slots;
  }
  const int32_t* out_positions(int64_t n) const {
    return reinterpret_cast<const int32_t*>(positions().out) + n * out_slots;
  }
};

// Moves count rows of head n from slot src on to slot dst on, in every
// buffer. Callers move runs in slot order with dst <= src when in place, so
// memmove never overwrites a row still to be read; a run already where it
// belongs is not touched.
void move_rows(const EvictAndFillBuffers& b, int64_t n, int64_t src, int64_t dst, int64_t count) {
  if (count <= 0) {
    return;
  }
  for (int i = 0; i < b.buffers(); ++i) {
    const RowBuffer& r = b.rows[i];
    if (r.in_place() && src == dst) {
      continue;
    }
    std::memmove(r.out + (n * b.out_slots + dst) * r.row_bytes,
                 r.in + (n * b.in_slots + src) * r.row_bytes, count * r.row_bytes);
  }
}

// The slot of the worst rank among [0, filled), the higher slot on ties:
// the one row a decode step evicts.
int64_t worst_slot_scalar(
    const float* norms,
    const int32_t* positions,
    int64_t filled,
    const EvictionRank& rank) {
  int64_t worst = 0;
  uint64_t worst_rank = 0;
  for (int64_t s = 0; s < filled; ++s) {
    const uint64_t r = rank(norms[s], positions[s]);
    if (r >= worst_rank) {
      worst_rank = r;
      worst = s;
    }
  }
  return worst;
}

#if defined(__x86_64__) && defined(__GNUC__)
// if_set where the 64-bit lane's mask is all ones, else if_clear (blendv_pd
// reads the sign bit of each lane).
__attribute__((target("avx2"))) inline __m256i select_lanes(
    __m256i mask,
    __m256i if_set,
    __m256i if_clear) {
  return _mm256_castpd_si256(_mm256_blendv_pd(
      _mm256_castsi256_pd(if_clear), _mm256_castsi256_pd(if_set),
      _mm256_castsi256_pd(mask)));
}

// worst_slot_scalar, eight rows at a time. The rank is built in two 32-bit
// halves and compared as a signed 64-bit integer with its top bit flipped
// (AVX2 compares signed 64-bit lanes only). Each lane keeps its worst rank
// and slot, later slots winning ties; the lanes are merged at the end.
// kRanges: the head has a valid range (padding rows rank last); without
// one every row is real. Compiled for AVX2 alone and chosen at run time, as
// the key-norm kernel's.
template <bool kKeepHigh, bool kRanges>
__attribute__((target("avx2"))) int64_t worst_slot_avx2(
    const float* norms,
    const int32_t* positions,
    int64_t filled,
    const EvictionRank& rank) {
  const __m256i sign = _mm256_set1_epi32(std::numeric_limits<int32_t>::min());
  const __m256i magnitude_mask = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256i infinity = _mm256_set1_epi32(0x7F800000);
  const __m256i zero = _mm256_setzero_si256();
  const __m256i sink_end = _mm256_set1_epi32(rank.sink_end);
  const __m256i protect_from = _mm256_set1_epi32(rank.protect_from);
  const __m256i first_real = _mm256_set1_epi32(rank.first_real);
  const __m256i last_real = _mm256_set1_epi32(rank.last_real);
  const __m256i step = _mm256_set1_epi64x(8);
  __m256i worst_a = _mm256_set1_epi64x(std::numeric_limits<int64_t>::min());
  __m256i worst_b = worst_a;
  __m256i slot_a = _mm256_set1_epi64x(-1);
  __m256i slot_b = slot_a;
  // unpacklo/unpackhi pair rows 0, 1, 4, 5 and rows 2, 3, 6, 7.
  __m256i next_a = _mm256_setr_epi64x(0, 1, 4, 5);
  __m256i next_b = _mm256_setr_epi64x(2, 3, 6, 7);
  int64_t s = 0;
  for (; s + 8 <= filled; s += 8) {
    // score_order_key of common/selection.h, lane by lane; keep="high"
    // scores by -norm, a flip of the sign bit. A NaN lane becomes all ones:
    // with ranges, then kNanScoreKey (its lowest bit cleared) below the
    // padding's key; without, it stays (no row is padding, and the tail
    // below keys NaN the same way), which spares the scan two operations.
    __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(norms + s));
    if constexpr (kKeepHigh) {
      bits = _mm256_xor_si256(bits, sign);
    }
    const __m256i magnitude = _mm256_and_si256(bits, magnitude_mask);
    bits = _mm256_andnot_si256(_mm256_cmpeq_epi32(magnitude, zero), bits);
    const __m256i negative = _mm256_srai_epi32(bits, 31);
    const __m256i is_nan = _mm256_cmpgt_epi32(magnitude, infinity);
    __m256i score =
        _mm256_or_si256(_mm256_xor_si256(bits, _mm256_or_si256(negative, sign)), is_nan);
    if constexpr (kRanges) {
      score = _mm256_xor_si256(score, _mm256_srli_epi32(is_nan, 31));
    }
    const __m256i p =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(positions + s));
    // Evictable: sink_end <= p < protect_from; protected rows score 0.
    const __m256i evictable = _mm256_andnot_si256(
        _mm256_cmpgt_epi32(sink_end, p), _mm256_cmpgt_epi32(protect_from, p));
    __m256i high = _mm256_and_si256(evictable, score);
    if constexpr (kRanges) {
      // Padding (p outside [first_real, last_real]) scores all ones:
      // kPaddingScoreKey.
      const __m256i padding = _mm256_or_si256(
          _mm256_cmpgt_epi32(first_real, p), _mm256_cmpgt_epi32(p, last_real));
      high = _mm256_or_si256(high, padding);
    }
    high = _mm256_xor_si256(high, sign);
    const __m256i low = _mm256_xor_si256(p, sign);
    const __m256i rank_a = _mm256_unpacklo_epi32(low, high);
    const __m256i rank_b = _mm256_unpackhi_epi32(low, high);
    const __m256i stay_a = _mm256_cmpgt_epi64(worst_a, rank_a);
    const __m256i stay_b = _mm256_cmpgt_epi64(worst_b, rank_b);
    worst_a = select_lanes(stay_a, worst_a, rank_a);
    worst_b = select_lanes(stay_b, worst_b, rank_b);
    slot_a = select_lanes(stay_a, slot_a, next_a);
    slot_b = select_lanes(stay_b, slot_b, next_b);
    next_a = _mm256_add_epi64(next_a, step);
    next_b = _mm256_add_epi64(next_b, step);
  }
  alignas(32) int64_t ranks[8];
  alignas(32) int64_t slots[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(ranks), worst_a);
  _mm256_store_si256(reinterpret_cast<__m256i*>(ranks + 4), worst_b);
  _mm256_store_si256(reinterpret_cast<__m256i*>(slots), slot_a);
  _mm256_store_si256(reinterpret_cast<__m256i*>(slots + 4), slot_b);
  int64_t worst_rank = std::numeric_limits<int64_t>::min();
  int64_t worst = -1;
  for (int i = 0; i < 8; ++i) {
    if (ranks[i] > worst_rank || (ranks[i] == worst_rank && slots[i] > worst)) {
      worst_rank = ranks[i];
      worst = slots[i];
    }
  }
  for (; s < filled; ++s) {
    uint64_t key = rank(norms[s], positions[s]);
    if constexpr (!kRanges) {
      // NaN keyed all ones, as in the lanes.
      if ((key >> 32) == kNanScoreKey) {
        key |= uint64_t(1) << 32;
      }
    }
    const int64_t r = static_cast<int64_t>(key ^ (uint64_t(1) << 63));
    if (r >= worst_rank) {
      worst_rank = r;
      worst = s;
    }
  }
  return worst;
}
#endif

// ranges: the head has a valid range (else every row is real, and the
// scan skips the test).
int64_t worst_slot(
    const float* norms,
    const int32_t* positions,
    int64_t filled,
    const EvictionRank& rank,
    bool ranges) {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool has_avx2 = __builtin_cpu_supports("avx2");
  if (has_avx2) {
    const bool high = rank.keep == Keep::High;
    if (ranges) {
      return high ? worst_slot_avx2<true, true>(norms, positions, filled, rank)
                  : worst_slot_avx2<false, true>(norms, positions, filled, rank);
    }
    return high ? worst_slot_avx2<true, false>(norms, positions, filled, rank)
                : worst_slot_avx2<false, false>(norms, positions, filled, rank);
  }
#else
  (void)ranges;
#endif
  return worst_slot_scalar(norms, positions, filled, rank);
}

// Per-thread buffers of the general path, reused across calls.
struct SelectionScratch {
  std::vector<uint64_t> ranks;
  std::vector<uint8_t> kept;
  RadixScratch<uint64_t> radix;
};

// kept[s] for s < filled: the budget best ranks, ties by slot (lower kept).
const std::vector<uint8_t>& kept_slots(
    const float* norms,
    const int32_t* positions,
    const EvictAndFillConfig& config,
    const EvictionRank& rank,
    SelectionScratch& scratch) {
  const int64_t filled = config.filled;
  scratch.ranks.resize(filled);
  scratch.kept.resize(filled);
  for (int64_t s = 0; s < filled; ++s) {
    scratch.ranks[s] = rank(norms[s], positions[s]);
  }
  const Threshold<uint64_t> cut =
      radix_select(scratch.ranks.data(), filled, config.kept(), scratch.radix);
  int64_t equal_left = cut.take_equal;
  for (int64_t s = 0; s < filled; ++s) {
    const uint64_t r = scratch.ranks[s];
    scratch.kept[s] = r < cut.key || (r == cut.key && equal_left-- > 0);
  }
  return scratch.kept;
}

// docs/spec.md §4 steps 1 and 2 for head n.
void compact_head(const EvictAndFillBuffers& b, const EvictAndFillConfig& config, int64_t n) {
  const int64_t filled = config.filled;
  const int64_t kept = config.kept();
  const bool slots = config.layout == Layout::Slots;
  const auto* norms = reinterpret_cast<const float*>(b.norms().in) + n * b.in_slots;
  const auto* positions = reinterpret_cast<const int32_t*>(b.positions().in) + n * b.in_slots;
  if (filled == kept) {
    move_rows(b, n, 0, 0, kept);
    return;
  }
  const EvictionRank rank = b.rank(config, n);
  if (filled - kept == 1) {
    const int64_t evicted = worst_slot(norms, positions, filled, rank, b.valid != nullptr);
    if (slots) {
      // The spare slot's row fills the hole; nothing moves when it is the
      // one evicted.
      move_rows(b, n, 0, 0, kept);
      if (evicted < kept) {
        move_rows(b, n, kept, evicted, 1);
      }
    } else {
      move_rows(b, n, 0, 0, evicted);
      move_rows(b, n, evicted + 1, evicted, filled - evicted - 1);
    }
    return;
  }
  thread_local SelectionScratch scratch;
  const std::vector<uint8_t>& keep = kept_slots(norms, positions, config, rank, scratch);
  if (slots) {
    // Kept rows below `kept` stay; the kept rows at or above it fill the
    // holes below it, both in slot order.
    move_rows(b, n, 0, 0, kept);
    int64_t mover = kept;
    for (int64_t hole = 0; hole < kept; ++hole) {
      if (!keep[hole]) {
        while (!keep[mover]) {
          ++mover;
        }
        move_rows(b, n, mover++, hole, 1);
      }
    }
    return;
  }
  // Stable compaction: the kept rows as maximal runs, in slot order.
  int64_t out = 0;
  int64_t run_begin = 0;
  for (int64_t s = 0; s <= filled; ++s) {
    if (s == filled || !keep[s]) {
      move_rows(b, n, run_begin, out, s - run_begin);
      out += s - run_begin;
      run_begin = s + 1;
    }
  }
}

// docs/spec.md §4 step 3 for head n: the new rows after the kept ones,
// with their norms (given, or computed beforehand for all of a thread's
// heads in one call: a decode step's rows then go eight at a time).
void fill_head(
    const EvictAndFillBuffers& b,
    const EvictAndFillConfig& config,
    int64_t n,
    const float* new_norms) {
  if (b.n_new == 0) {
    return;
  }
  const int64_t first = n * b.out_slots + config.kept();
  for (int i = 0; i < b.payloads; ++i) {
    const size_t row_bytes = b.rows[i].row_bytes;
    std::memcpy(b.rows[i].out + first * row_bytes, b.new_rows[i] + n * b.n_new * row_bytes,
                b.n_new * row_bytes);
  }
  std::memcpy(reinterpret_cast<float*>(b.norms().out) + first, new_norms,
              b.n_new * sizeof(float));
  auto* positions = reinterpret_cast<int32_t*>(b.positions().out) + first;
  for (int64_t j = 0; j < b.n_new; ++j) {
    positions[j] = static_cast<int32_t>(config.offset + j);
  }
}


// docs/spec.md §4 step 4: the output tree of head n, built over its output
// rows.
void build_tree(const EvictAndFillBuffers& b, const EvictAndFillConfig& config, int64_t n) {
  const int64_t slots = b.out_slots;
  int32_t* eviction = b.tree_out + n * 2 * (slots + 1);
  const OrderTreeKeys keys{b.out_norms(n), b.out_positions(n), config.kept() + b.n_new,
                           b.next_rank(config, n)};
  order_tree_build(eviction, eviction + slots + 1, slots, keys, config.offset + b.n_new);
}

// More rows than this leaving the window in one step (equal positions,
// reachable only by calling the op directly) make the head rank every row.
constexpr int kMaxLeaving = 4;

// A decode step of head n through its given tree (the caller checked S = 1,
// the slot layout, C_out = C and filled <= budget + 1): the eviction half's
// winner is evicted; the rows leaving the window are found as the window
// half's winners before any row moves; then the nodes above every slot
// whose row or rank changed are recomputed for the next step. Returns false,
// with no row moved, when the tree's stamps are not this step's or a
// half's winner is out of range: the caller ranks the rows and builds the
// tree.
bool decode_with_tree(
    const EvictAndFillBuffers& b,
    const EvictAndFillConfig& config,
    int64_t n,
    const float* new_norms) {
  const int64_t slots = b.out_slots;
  const int64_t stride = 2 * (slots + 1);
  const int32_t* given = b.tree_in + n * stride;
  int32_t* eviction = b.tree_out + n * stride;
  int32_t* window = eviction + slots + 1;
  const int64_t filled = config.filled;
  const int64_t kept = config.kept();
  if (given[0] != filled || given[slots + 1] != config.offset) {
    return false;
  }
  const bool evicts = filled > kept;
  const int32_t evicted = evicts ? given[slots] : -1;
  const int32_t oldest = given[2 * slots + 1];
  if ((evicts && (evicted < 0 || evicted >= filled)) || oldest < 0 || oldest >= slots) {
    return false;
  }
  const auto* norms = reinterpret_cast<const float*>(b.norms().in) + n * b.in_slots;
  const auto* positions = reinterpret_cast<const int32_t*>(b.positions().in) + n * b.in_slots;
  const OrderTreeKeys now{norms, positions, filled, b.rank(config, n)};
  // Without a recent window only a stored position at or past the offset
  // (a direct call's buffers) is in the window, and then the window half's
  // winner is. Otherwise no row is, nor will the new one be: every node of
  // that half holds the lowest slot below it whatever the rows, so the
  // given half is already the output's and only its stamp changes.
  const bool windowed = config.selection.recent > 0 || now.in_window(oldest);
  // The nodes updated below, while the rows move (measured 0.84-0.99x of
  // the step without at budgets 512-8192).
  for (int h = 0; h < (windowed ? 2 : 1); ++h) {
    const int32_t* half = given + h * (slots + 1);
    tree_prefetch_path(half, slots, kept);
    if (evicts && evicted < kept) {
      tree_prefetch_path(half, slots, evicted);
    }
  }
  if (given != eviction) {
    std::memcpy(eviction, given, stride * sizeof(int32_t));
  }
  const EvictionRank next = b.next_rank(config, n);
  std::array<int32_t, kMaxLeaving> leaving{};
  int n_leaving = 0;
  auto left = [&](int32_t s) {
    for (int i = 0; i < n_leaving; ++i) {
      if (leaving[i] == s) {
        return true;
      }
    }
    return false;
  };
  // The window half, with the rows found so far taken out of the window.
  auto still_in_window = [&](int32_t s) { return now.in_window(s) && !left(s); };
  while (windowed) {
    const int32_t oldest = window[slots];
    if (!still_in_window(oldest) || positions[oldest] >= next.protect_from) {
      break;
    }
    if (n_leaving == kMaxLeaving) {
      return false;
    }
    leaving[n_leaving++] = oldest;
    tree_update(window, slots, oldest, [&](int32_t a, int32_t c) {
      return now.leaves_window_before(a, c, still_in_window(a), still_in_window(c));
    });
  }
  // Steps 2 and 3: the spare slot's row fills the hole.
  move_rows(b, n, 0, 0, kept);
  if (evicts && evicted < kept) {
    move_rows(b, n, kept, evicted, 1);
  }
  fill_head(b, config, n, new_norms);
  std::array<int32_t, kMaxLeaving + 2> changed{};
  int n_changed = 0;
  auto change = [&](int32_t s) {
    for (int i = 0; i < n_changed; ++i) {
      if (changed[i] == s) {
        return;
      }
    }
    changed[n_changed++] = s;
  };
  change(static_cast<int32_t>(kept));
  if (evicts && evicted < kept) {
    change(evicted);
  }
  for (int i = 0; i < n_leaving; ++i) {
    int32_t s = leaving[i];
    if (s == evicted) {
      continue;
    }
    if (evicts && evicted < kept && s == kept) {
      s = evicted;
    }
    change(s);
  }
  const OrderTreeKeys after{b.out_norms(n), b.out_positions(n), kept + 1, next};
  for (int i = 0; i < n_changed; ++i) {
    tree_update(eviction, slots, changed[i],
                [&](int32_t a, int32_t c) { return after.evicts_before(a, c); });
    if (windowed) {
      tree_update(window, slots, changed[i], [&](int32_t a, int32_t c) {
        return after.leaves_window_before(a, c, after.in_window(a), after.in_window(c));
      });
    }
  }
  eviction[0] = static_cast<int32_t>(kept + 1);
  window[0] = static_cast<int32_t>(config.offset + 1);
  return true;
}

// docs/spec.md §4 for every head of b: the work of evict_and_fill_cpu_task.
void evict_and_fill_heads(const EvictAndFillBuffers& b, const EvictAndFillConfig& config) {
  // Threads only for heads that move enough bytes: the scan reads 8 bytes
  // a stored row; rows are copied unless in place in the slot layout.
  size_t row_bytes = 0;
  bool copies_rows = config.layout == Layout::Temporal;
  for (int i = 0; i < b.buffers(); ++i) {
    row_bytes += b.rows[i].row_bytes;
    copies_rows = copies_rows || !b.rows[i].in_place();
  }
  // A decode step through the given tree reads O(log C) of it instead.
  const bool through_tree = b.tree_in != nullptr && config.layout == Layout::Slots &&
      b.n_new == 1 && b.out_slots == b.in_slots && config.filled <= config.selection.budget + 1;
  const size_t scan_bytes = through_tree ? 256 : config.filled * 8;
  const size_t tree_bytes = b.tree_out != nullptr && !through_tree ? b.out_slots * 16 : 0;
  const size_t bytes_per_head = scan_bytes + tree_bytes + b.n_new * row_bytes +
      (copies_rows ? config.kept() * row_bytes : 0);
  parallel_for(b.heads, bytes_per_head, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> computed;
    if (b.new_norms == nullptr) {
      computed.resize((end - begin) * b.n_new);
      key_norm_rows(b.key_dtype, b.new_rows[0] + begin * b.n_new * b.rows[0].row_bytes,
                    (end - begin) * b.n_new, b.key_dim, computed.data());
    }
    for (int64_t n = begin; n < end; ++n) {
      const float* new_norms = b.new_norms != nullptr
          ? b.new_norms + n * b.n_new
          : computed.data() + (n - begin) * b.n_new;
      if (through_tree && decode_with_tree(b, config, n, new_norms)) {
        continue;
      }
      compact_head(b, config, n);
      fill_head(b, config, n, new_norms);
      if (b.tree_out != nullptr) {
        build_tree(b, config, n);
      }
    }
  });
}

} // namespace

CpuTask evict_and_fill_cpu_task(
    const EvictAndFillInputs& in,
    std::vector<mx::array>& outputs,
    const EvictAndFillConfig& config) {
  const int m = in.payloads();
  EvictAndFillBuffers b{
      .rows = {},
      .payloads = m,
      .heads = in.n_heads(),
      .in_slots = in.capacity(),
      .out_slots = config.out_capacity,
      .new_rows = {},
      .new_norms = in.new_norms ? in.new_norms->data<float>() : nullptr,
      .valid = in.valid ? in.valid->data<int32_t>() : nullptr,
      .key_dtype = in.rows[0].dtype(),
      .key_dim = in.rows[0].shape(-1),
      .n_new = in.n_new(),
      .tree_in = in.tree ? in.tree->data<int32_t>() : nullptr,
      .tree_out = config.order_tree ? outputs[m + 2].data<int32_t>() : nullptr};
  for (int i = 0; i < m; ++i) {
    b.rows[i] = {in.rows[i].data<char>(), outputs[i].data<char>(), in.row_bytes(i)};
    b.new_rows[i] = in.new_rows[i].data<char>();
  }
  b.rows[m] = {in.norms.data<char>(), outputs[m].data<char>(), sizeof(float)};
  b.rows[m + 1] = {in.positions.data<char>(), outputs[m + 1].data<char>(), sizeof(int32_t)};
  return [b, config] { evict_and_fill_heads(b, config); };
}

void evict_and_fill_cpu(
    const EvictAndFillInputs& in,
    std::vector<mx::array>& outputs,
    const EvictAndFillConfig& config) {
  evict_and_fill_cpu_task(in, outputs, config)();
}

} // namespace mlx_knorm
