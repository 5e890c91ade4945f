// Device code the kernels in this folder share: the order key of a score,
// the threadgroup prefix sum, the radix select, the norm of one key row
// (docs/spec.md section 2) and the moves of K/V rows, in place too.
// Compiles as Metal Shading Language and, through
// csrc/metal_emulator/metal_emulator.h, as C++; the JIT loader inlines it
// like knorm_defines.h (csrc/common/kernel_source.cpp).
#ifndef MLX_KNORM_METAL_KNORM_KERNELS_H
#define MLX_KNORM_METAL_KNORM_KERNELS_H

#include "knorm_defines.h"

// A float32 score's bits -> uint32 with a < b iff key(a) < key(b); -0 ==
// +0; NaN after +inf, as kNanScoreKey. keep="high" ranks by -score, a flip
// of the sign bit. No score maps to 0 or to kPaddingScoreKey
// (knorm_defines.h). Scores travel as bits, never as floats, so that no
// load or store can quiet a signalling NaN (docs/spec.md section 5).
inline uint knorm_score_key(uint bits, bool keep_high) {
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
    return kNanScoreKey;
  }
  if (keep_high) {
    bits ^= 0x80000000u;
  }
  if ((bits & 0x7FFFFFFFu) == 0) {
    bits = 0;
  }
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

struct KnormScan {
  uint exclusive;  // sum of v over the threads before this one
  // msl-uniform: the sum over the threadgroup, which every thread reads
  // after knorm_block_scan's barrier.
  uint total;      // sum of v over the threadgroup
};

// Exclusive prefix sum of one uint per thread across a threadgroup of
// kGroupSize threads, in thread order. Ends with a barrier so that
// simd_totals (kGroupSize / 32 entries) can be reused.
template <uint kGroupSize>
inline KnormScan knorm_block_scan(
    uint v,
    threadgroup uint* simd_totals,
    uint lane,
    uint simd_group) {
  const uint inclusive = simd_prefix_inclusive_sum(v);
  if (lane == kSimdWidth - 1) {
    simd_totals[simd_group] = inclusive;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint before = 0;
  uint total = 0;
  for (uint s = 0; s < kGroupSize / kSimdWidth; ++s) {
    const uint t = simd_totals[s];
    before += s < simd_group ? t : 0;
    total += t;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  KnormScan out = {before + inclusive - v, total};
  return out;
}

// Radix select in passes of 8 bits: one histogram bin per thread.
constant constexpr uint kRadixBins = 256;

// What a selection keeps: every row whose order key is below `key`, and
// the first `take_equal` of the `equal` rows with exactly that key (ties go
// to the earliest rows). take_equal == equal keeps every row whose key is at
// or below `key`; after a select that stopped at a whole bin, `equal`
// counts that bin's rows, most of them below `key`.
template <typename Key>
struct KnormCut {
  Key key;
  uint take_equal;
  uint equal;
};

// How many bins a SIMD group adds to with one atomic for all of its lanes
// that share them, per step over the rows (knorm_histogram_add).
constant constexpr uint kHistogramMerges = 2;

// histogram[bin] += 1 for every lane with `counted`, by the 32 lanes of a
// SIMD group (all of them must call it). Keys of one magnitude share one or
// two bins of the top byte, and 32 lanes adding to one threadgroup atomic
// wait on each other: so the lanes that share the bin of the first lane
// still counting add with one atomic, up to kHistogramMerges times, and the
// lanes left over (bins spread out) add one each.
inline void knorm_histogram_add(
    threadgroup atomic_uint* histogram,
    uint bin,
    bool counted,
    uint lane) {
  bool pending = counted;
  for (uint m = 0; m < kHistogramMerges; ++m) {
    const uint waiting = uint(static_cast<simd_vote::vote_t>(simd_ballot(pending)));
    // The same ballot in every lane: the group leaves together.
    if (waiting == 0) {
      break;
    }
    const uint leader = ctz(waiting);
    const uint leader_bin = simd_shuffle(bin, ushort(leader));
    const bool same = pending && bin == leader_bin;
    const uint merged = uint(static_cast<simd_vote::vote_t>(simd_ballot(same)));
    if (lane == leader) {
      atomic_fetch_add_explicit(
          &histogram[leader_bin], popcount(merged), memory_order_relaxed);
    }
    pending = pending && !same;
  }
  if (pending) {
    atomic_fetch_add_explicit(&histogram[bin], 1u, memory_order_relaxed);
  }
}

// Radix select over the order keys keys(j) of rows [begin, end), most
// significant 8 bits first (up to 4 passes for uint keys, 8 for ulong): the
// cut that keeps the `rank` smallest. histogram has kRadixBins entries, one
// per thread. Needs rank >= 1. Every thread runs the same number of steps
// over the rows, so that each SIMD group counts its 32 rows together.
// Once the chosen bin holds exactly the rows still to keep, every row of it
// is kept and the later passes would only split it: the select stops there,
// with the bin's largest key as the cut and take_equal == equal (every key
// equal to the cut kept, as after a last pass whose bin is kept whole).
template <typename Key, uint kGroupSize, typename Keys>
inline KnormCut<Key> knorm_radix_select(
    Keys keys,
    uint begin,
    uint end,
    uint rank,
    threadgroup atomic_uint* histogram,
    threadgroup uint* simd_totals,
    // msl-uniform: one thread writes picked, every thread reads it after a barrier.
    threadgroup uint* picked,
    uint tid,
    uint lane,
    uint simd_group) {
  static_assert(kGroupSize == kRadixBins, "one radix bin per thread");
  Key prefix = 0;
  Key mask = 0;
  uint equal = 0;
  for (int shift = int(sizeof(Key)) * 8 - 8; shift >= 0; shift -= 8) {
    atomic_store_explicit(&histogram[tid], 0u, memory_order_relaxed);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint base = begin; base < end; base += kGroupSize) {
      const uint j = base + tid;
      const bool valid = j < end;
      const Key key = valid ? keys(j) : Key(0);
      knorm_histogram_add(
          histogram, uint(key >> shift) & 0xFFu, valid && (key & mask) == prefix, lane);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const uint count =
        atomic_load_explicit(&histogram[tid], memory_order_relaxed);
    const KnormScan bins = knorm_block_scan<kGroupSize>(count, simd_totals, lane, simd_group);
    if (bins.exclusive < rank && rank <= bins.exclusive + count) {
      picked[0] = tid;
      picked[1] = bins.exclusive;
      picked[2] = count;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    prefix |= Key(picked[0]) << shift;
    mask |= Key(0xFFu) << shift;
    rank -= picked[1];
    equal = picked[2];
    // The same values in every thread (read after the barrier): the whole
    // group leaves together.
    if (equal == rank) {
      KnormCut<Key> whole_bin = {prefix | ~mask, equal, equal};
      return whole_bin;
    }
  }
  KnormCut<Key> out = {prefix, rank, equal};
  return out;
}

// Rows move as raw bits (docs/spec.md section 5), never through float
// arithmetic: in units of 16 bytes (uint4), 8 (uint2), 4, 2 or 1, as the
// launch plan chose (`unit`, in bytes; row_unit_bytes of
// common/launch_plan.h) so that the row width and every row start are
// multiples of the unit.
static_assert(sizeof(uint4) == kRowUnitWide && sizeof(uint2) == kRowUnitNarrow,
              "row units are one uint4 or one uint2");

// Units first, first + stride, ... below count.
template <typename U, typename Index>
inline void knorm_copy_units(
    device const U* src,
    device U* dst,
    Index count,
    uint first,
    uint stride) {
  for (Index u = first; u < count; u += stride) {
    dst[u] = src[u];
  }
}

// The `bytes` bytes (whole rows) at src to dst in `unit`-byte units,
// shared by `stride` threads, this one being number `first`.
template <typename Index>
inline void knorm_copy_bytes(
    device const uchar* src,
    device uchar* dst,
    Index bytes,
    uint unit,
    uint first,
    uint stride) {
  if (unit == kRowUnitWide) {
    knorm_copy_units(reinterpret_cast<device const uint4*>(src), reinterpret_cast<device uint4*>(dst),
                     bytes / Index(kRowUnitWide), first, stride);
  } else if (unit == kRowUnitNarrow) {
    knorm_copy_units(reinterpret_cast<device const uint2*>(src), reinterpret_cast<device uint2*>(dst),
                     bytes / Index(kRowUnitNarrow), first, stride);
  } else if (unit == 4) {
    knorm_copy_units(reinterpret_cast<device const uint*>(src), reinterpret_cast<device uint*>(dst),
                     bytes / Index(4), first, stride);
  } else if (unit == 2) {
    knorm_copy_units(reinterpret_cast<device const ushort*>(src),
                     reinterpret_cast<device ushort*>(dst), bytes / Index(2), first, stride);
  } else {
    knorm_copy_units(src, dst, bytes, first, stride);
  }
}

// The `count` elements (whole rows) at src to dst, as knorm_copy_bytes.
template <typename T, typename Index>
inline void knorm_copy_bits(
    device const T* src,
    device T* dst,
    Index count,
    uint unit,
    uint first,
    uint stride) {
  knorm_copy_bytes(reinterpret_cast<device const uchar*>(src), reinterpret_cast<device uchar*>(dst),
                   count * Index(sizeof(T)), unit, first, stride);
}

// How the lanes of one SIMD group share rows of `units` units
// (knorm_copy_bytes): a row of fewer than kSimdWidth units takes only as
// many lanes, and the group copies kSimdWidth / units such rows at once (at
// D = 128 float16 rows are 16 16-byte units: two rows, no lane idle); a
// longer row takes the whole group. A lane with row >= rows idles. The
// division runs once a call, not once a row.
struct KnormRowLanes {
  uint rows;    // rows the SIMD group copies at once, >= 1
  uint row;     // this lane's row among them
  uint first;   // this lane's first unit of its row
  uint stride;  // lanes on one row
};

inline KnormRowLanes knorm_row_lanes(uint units, uint lane) {
  const uint per_row = units == 0 || units > kSimdWidth ? kSimdWidth : units;
  KnormRowLanes lanes = {kSimdWidth / per_row, lane / per_row, lane % per_row, per_row};
  return lanes;
}

// Bytes each thread holds in one wave of an in-place compaction
// (knorm_move_rows).
constant constexpr uint kWaveBytes = 64;

// A unit of a run of rows `width` units wide: row and unit in the row, for
// the linear index row * width + unit. knorm_move_rows steps each thread's
// index by a fixed stride by adding the stride's rows and units
// (knorm_advance), so no unit costs a division: Apple GPUs have no integer
// divider, and 64-bit integer arithmetic runs at a fraction of 32-bit's.
// Every count is 32-bit: rows and row widths are below 2^31 (docs/spec.md
// section 5), so unit + units < 2 width never wraps.
struct KnormRowUnit {
  uint row;
  uint unit;
};

// A stride of the linear index, as whole rows and the units left over.
inline KnormRowUnit knorm_row_unit(uint index, uint width) {
  KnormRowUnit at = {index / width, index % width};
  return at;
}

inline KnormRowUnit knorm_advance(KnormRowUnit at, KnormRowUnit stride, uint width) {
  at.row += stride.row;
  at.unit += stride.unit;
  if (at.unit >= width) {
    at.unit -= width;
    at.row += 1;
  }
  return at;
}

// Rows src[p] -> dst_begin + p of one buffer, p < n, rows of `width` units
// U, by the whole threadgroup of kGroupSize threads; src increases with p
// and src[p] >= dst_begin + p. Thread tid takes the units tid,
// tid + kGroupSize, ... of the rows' linear order. Into a separate output,
// unit by unit. In place (`overlapping`), rows already where they belong
// are skipped and the others move in waves over their units in order: every
// thread reads its units of the wave, a barrier, then writes them. A later
// wave's sources lie at or past its own destinations, hence past every
// earlier wave's, so no unit is overwritten before it is read. The
// divisions below run once a call, not once a unit.
template <uint kGroupSize, typename U>
inline void knorm_move_rows(
    device const U* in,
    device U* out,
    bool overlapping,
    threadgroup const uint* src,
    uint dst_begin,
    uint n,
    uint width,
    uint tid) {
  if (width == 0) {
    return;
  }
  const KnormRowUnit stride = knorm_row_unit(kGroupSize, width);
  const KnormRowUnit first = knorm_row_unit(tid, width);
  if (!overlapping) {
    for (KnormRowUnit at = first; at.row < n; at = knorm_advance(at, stride, width)) {
      out[ulong(dst_begin + at.row) * width + at.unit] = in[ulong(src[at.row]) * width + at.unit];
    }
    return;
  }
  constexpr uint kWaveUnits = kWaveBytes / sizeof(U);
  const KnormRowUnit wave_step = knorm_row_unit(kGroupSize * kWaveUnits, width);
  // The wave's first unit (thread 0's first), the same in every thread, and
  // this thread's first.
  KnormRowUnit wave = {0u, 0u};
  KnormRowUnit mine = first;
  for (; wave.row < n; wave = knorm_advance(wave, wave_step, width),
                       mine = knorm_advance(mine, wave_step, width)) {
    U held[kWaveUnits];
    KnormRowUnit at = mine;
    for (uint k = 0; k < kWaveUnits; ++k, at = knorm_advance(at, stride, width)) {
      if (at.row < n && src[at.row] != dst_begin + at.row) {
        held[k] = in[ulong(src[at.row]) * width + at.unit];
      }
    }
    threadgroup_barrier(mem_flags::mem_device);
    at = mine;
    for (uint k = 0; k < kWaveUnits; ++k, at = knorm_advance(at, stride, width)) {
      if (at.row < n && src[at.row] != dst_begin + at.row) {
        out[ulong(dst_begin + at.row) * width + at.unit] = held[k];
      }
    }
    threadgroup_barrier(mem_flags::mem_device);
  }
}

// knorm_move_rows for rows of `row_bytes` bytes, in `unit`-byte units
// (knorm_copy_bytes).
template <uint kGroupSize>
inline void knorm_move_byte_rows(
    device const uchar* in,
    device uchar* out,
    bool overlapping,
    threadgroup const uint* src,
    uint dst_begin,
    uint n,
    uint row_bytes,
    uint unit,
    uint tid) {
  if (unit == kRowUnitWide) {
    knorm_move_rows<kGroupSize>(
        reinterpret_cast<device const uint4*>(in), reinterpret_cast<device uint4*>(out),
        overlapping, src, dst_begin, n, row_bytes / kRowUnitWide, tid);
  } else if (unit == kRowUnitNarrow) {
    knorm_move_rows<kGroupSize>(
        reinterpret_cast<device const uint2*>(in), reinterpret_cast<device uint2*>(out),
        overlapping, src, dst_begin, n, row_bytes / kRowUnitNarrow, tid);
  } else if (unit == 4) {
    knorm_move_rows<kGroupSize>(
        reinterpret_cast<device const uint*>(in), reinterpret_cast<device uint*>(out),
        overlapping, src, dst_begin, n, row_bytes / 4, tid);
  } else if (unit == 2) {
    knorm_move_rows<kGroupSize>(
        reinterpret_cast<device const ushort*>(in), reinterpret_cast<device ushort*>(out),
        overlapping, src, dst_begin, n, row_bytes / 2, tid);
  } else {
    knorm_move_rows<kGroupSize>(in, out, overlapping, src, dst_begin, n, row_bytes, tid);
  }
}

// knorm_move_byte_rows for K or V rows of `dim` elements.
template <uint kGroupSize, typename T>
inline void knorm_move_kv_rows(
    device const T* in,
    device T* out,
    bool overlapping,
    threadgroup const uint* src,
    uint dst_begin,
    uint n,
    uint dim,
    uint unit,
    uint tid) {
  knorm_move_byte_rows<kGroupSize>(
      reinterpret_cast<device const uchar*>(in), reinterpret_cast<device uchar*>(out), overlapping,
      src, dst_begin, n, dim * uint(sizeof(T)), unit, tid);
}

// A result below the smallest normal float becomes +0 (docs/spec.md
// section 2a), whether or not this GPU flushes subnormals (NaN compares
// false and passes); -0 becomes +0.
inline float knorm_flushed(float x) {
  return (x < FLT_MIN && x > -FLT_MIN) ? 0.0f : x;
}

// docs/spec.md section 2 step 6: one NaN bit pattern on every GPU.
inline float knorm_canonical(float x) {
  return isnan(x) ? as_type<float>(0x7FC00000u) : x;
}

// The pinned sum of docs/spec.md sections 2 and 2a of 32 kPerLane terms,
// lane i holding t[i + 32k], k < kPerLane, in registers (kPerLane is a
// compile-time count so that t is never indexed at run time, which would
// put it in stack memory), by the 32 lanes of one SIMD group (all of them
// must call it). The first log2(kPerLane) halving levels pair registers of
// the same lane (t[i + 32k] + t[i + 32k + 16 kPerLane] ...); the last five
// (16, 8, 4, 2, 1 apart) are simd_shuffle_down adds. Every lane returns the
// sum (lane 0's, broadcast).
//
// The terms are padded with +0 to 32 kPerLane >= P (P, the next power of
// two >= D) rather than to P. That is the same sum bit for bit: flushed
// terms are never -0, so x + (+0) == x for each of them, and the levels
// above P/2 return the first P terms unchanged. kPerLane = P / 32 (1 for
// D <= 32) does the least work.
template <uint kPerLane>
inline float knorm_lanes_sum(thread float (&t)[kPerLane]) {
  for (uint c = kPerLane / 2; c >= 1; c /= 2) {
    for (uint k = 0; k < c; ++k) {
      t[k] = knorm_flushed(t[k] + t[k + c]);
    }
  }
  float acc = t[0];
  for (ushort delta = kSimdWidth / 2; delta >= 1; delta /= 2) {
    const float other = simd_shuffle_down(acc, delta);
    acc = knorm_flushed(acc + other);
  }
  return simd_shuffle(acc, ushort(0));
}

// Element i = lane + 32k of the row of `dim` elements at x, as float (+0
// past the row).
template <uint kPerLane, typename T>
inline void knorm_lane_elements(device const T* x, uint dim, uint lane, thread float (&a)[kPerLane]) {
  for (uint k = 0; k < kPerLane; ++k) {
    const uint i = lane + kSimdWidth * k;
    a[k] = i < dim ? float(x[i]) : 0.0f;
  }
}

// docs/spec.md section 2 of the elements a lane holds (knorm_lanes_sum's
// layout): flushed squares, the pinned sum, the square root.
template <uint kPerLane>
inline float knorm_lanes_norm(thread const float (&a)[kPerLane]) {
  float t[kPerLane];
  for (uint k = 0; k < kPerLane; ++k) {
    t[k] = knorm_flushed(a[k] * a[k]);
  }
  return knorm_canonical(precise::sqrt(knorm_lanes_sum<kPerLane>(t)));
}

// docs/spec.md section 2a's dot product of the elements two lanes hold:
// flushed products, the pinned sum.
template <uint kPerLane>
inline float knorm_lanes_dot(thread const float (&a)[kPerLane], thread const float (&b)[kPerLane]) {
  float t[kPerLane];
  for (uint k = 0; k < kPerLane; ++k) {
    t[k] = knorm_flushed(a[k] * b[k]);
  }
  return knorm_lanes_sum<kPerLane>(t);
}

// docs/spec.md section 2 for the row of `dim` elements at x, by the 32
// lanes of one SIMD group (all of them must call it); every lane returns
// the norm.
template <uint kPerLane, typename T>
inline float knorm_row_norm(device const T* x, uint dim, uint lane) {
  float a[kPerLane];
  knorm_lane_elements<kPerLane>(x, dim, lane, a);
  return knorm_lanes_norm<kPerLane>(a);
}

#endif // MLX_KNORM_METAL_KNORM_KERNELS_H
