// What the Metal kernels in this folder and the host code that launches them
// must agree on, and the preamble every kernel source needs. One file, read
// four ways:
//   - by the Metal compiler, reached from metal/*.metal (the metallib build);
//   - as text inlined into each kernel source by the JIT loader
//     (csrc/common/kernel_source.cpp);
//   - as C++ by the emulator (csrc/metal_emulator/kernels.cpp includes
//     metal_emulator.h, then the .metal files);
//   - by the host C++ (the launch plans), for the constants alone.
// An include guard rather than #pragma once: in the JIT build this text is
// part of the main file, where #pragma once draws a warning. This file and
// the kernel sources stay ASCII (hence "docs/spec.md section N" in their
// comments): MLX hands the JIT source to Metal as an ASCII string.
#ifndef MLX_KNORM_METAL_KNORM_DEFINES_H
#define MLX_KNORM_METAL_KNORM_DEFINES_H

#if defined(__METAL_VERSION__)
#include <metal_stdlib>
// No fused multiply-add: each square and each add is rounded on its own
// (docs/spec.md section 2).
#pragma clang fp contract(off)
using namespace metal;
#define KNORM_CONSTANT static constant constexpr
// threadgroup qualifies both declarations and pointers; only the declaration
// form needs a macro for the emulator's C++ build.
#define KNORM_THREADGROUP_ARRAY(type, name, count) threadgroup type name[count]
// Kernel-signature attributes, as macros so that the emulator's C++ build
// reads them too: KNORM_BUFFER(i) is [[buffer(i)]], KNORM_ATTRIBUTE(name) a
// thread attribute such as [[thread_position_in_threadgroup]].
#define KNORM_BUFFER(index) [[buffer(index)]]
#define KNORM_ATTRIBUTE(name) [[name]]
// KNORM_THREADGROUP_BUFFER(i) is [[threadgroup(i)]]: threadgroup memory whose
// length the launch plan sets per dispatch (setThreadgroupMemoryLength).
#define KNORM_THREADGROUP_BUFFER(index) [[threadgroup(index)]]
// Instantiates a kernel template under the host name its launch plan uses.
#define KNORM_KERNEL_INSTANCE(name, ...) \
  template [[host_name(name)]] [[kernel]] decltype(__VA_ARGS__) __VA_ARGS__;
#elif defined(KNORM_METAL_EMULATOR)
// metal_emulator.h defines the Metal language surface, the address-space
// qualifiers, and its own KNORM_BUFFER, KNORM_ATTRIBUTE,
// KNORM_THREADGROUP_BUFFER, KNORM_THREADGROUP_ARRAY and
// KNORM_KERNEL_INSTANCE.
using namespace metal;
#define KNORM_CONSTANT static constant constexpr
#else
#include <cstdint>
#define KNORM_CONSTANT inline constexpr
namespace mlx_knorm {
#endif

// Lanes of an Apple GPU SIMD group.
KNORM_CONSTANT uint32_t kSimdWidth = 32;

// Largest D the key-norm kernel takes: each lane keeps kKeyNormsMaxDim / 32
// squares in registers. auto sends larger rows on a GPU to the fallback.
KNORM_CONSTANT uint32_t kKeyNormsMaxDim = 512;
// Rows per threadgroup of the key-norm kernel, one SIMD group each: small
// groups, so that many are resident.
KNORM_CONSTANT uint32_t kKeyNormsRowsPerGroup = 4;

// K/V rows move as raw bits in units of kRowUnitWide bytes (one uint4) or
// kRowUnitNarrow (one uint2) where the row width and every row start are
// multiples of the unit, else one element at a time; the launch plans
// choose, the kernels take the unit in bytes (knorm_copy_bits in
// knorm_kernels.h).
KNORM_CONSTANT uint32_t kRowUnitWide = 16;
KNORM_CONSTANT uint32_t kRowUnitNarrow = 8;

// Threads per threadgroup of the gather kernels (the selection: one
// threadgroup per head).
KNORM_CONSTANT uint32_t kGatherGroupSize = 256;
// Rows of a head whose norms the selection keeps in threadgroup memory
// (28 KiB, within the 32 KiB a threadgroup may have with the kernel's other
// threadgroup memory), when it evicts: it reads them five times (four radix
// passes and the compaction).
KNORM_CONSTANT uint32_t kGatherCachedNorms = 7168;

// Metal sets threadgroup memory lengths in multiples of this many bytes
// (setThreadgroupMemoryLength); a launch plan rounds each up, and binds
// this much to a [[threadgroup(i)]] its dispatch never touches.
KNORM_CONSTANT uint32_t kThreadgroupLengthUnit = 16;

// An op whose heads each have more than kSplitRows rows to copy, with fewer
// than kSplitHeads heads, leaves the copy to a dispatch of its own, in
// blocks of kSplitRows rows per threadgroup (launch_plan.h's split_blocks),
// after the one that selects and compacts (one threadgroup per head). One
// threadgroup per head would leave most of a GPU's cores idle while the rows
// move. Not tuned on hardware: 256 heads give each core of the largest Apple
// GPUs (80 cores) three threadgroups.
KNORM_CONSTANT uint32_t kSplitRows = 128;
KNORM_CONSTANT uint32_t kSplitHeads = 256;

// Threads per threadgroup of the evict-and-fill kernel (one threadgroup per
// head).
KNORM_CONSTANT uint32_t kEvictGroupSize = 256;
// Entries of each queue of the slot layout's pairing: a chunk is scanned
// only while fewer than kEvictGroupSize wait, so a queue never holds more.
KNORM_CONSTANT uint32_t kEvictQueue = 2 * kEvictGroupSize;
// Slots of a head whose ranks are kept in threadgroup memory when several
// rows leave (the radix select reads them in eight passes, the compaction
// again): 24 KiB, with the kernel's other threadgroup memory within the
// 32 KiB a threadgroup may have.
KNORM_CONSTANT uint32_t kEvictCachedRanks = 3072;

// Order keys of docs/spec.md section 4's rank (the high 32 bits of a row's
// 64-bit rank; the position's order key is the low 32): 0 for a protected
// row, a score's key (common/selection.h, knorm_kernels.h) for an
// evictable one, kNanScoreKey for a NaN score, kPaddingScoreKey for a
// padding row. Every other score key lies in [0x007FFFFF, 0xFF800000].
KNORM_CONSTANT uint32_t kNanScoreKey = 0xFFFFFFFEu;
KNORM_CONSTANT uint32_t kPaddingScoreKey = 0xFFFFFFFFu;

// Payload buffers an evict-and-fill step moves (docs/spec.md section 4):
// a quantized cache's packed keys, scales and biases and the same for the
// values. Each takes three fixed [[buffer(i)]] (stored rows, new rows,
// output), which keeps the kernel within Metal's 31 buffer arguments with
// room to spare.
KNORM_CONSTANT uint32_t kEvictMaxPayloads = 6;

// The scorers of docs/spec.md section 2a, as the row-score kernels take them
// (a template argument) and the host names them (csrc/row_scores).
KNORM_CONSTANT uint32_t kScorerKeyNorm = 0;    // knorm
KNORM_CONSTANT uint32_t kScorerValueNorm = 1;  // vnorm
KNORM_CONSTANT uint32_t kScorerQueryFilter = 2;  // qfilter
KNORM_CONSTANT uint32_t kScorerKeyDiff = 3;    // keydiff

// The constants of the row-score kernels, bound as one block at their last
// [[buffer(i)]] (csrc/row_scores/plan.cpp fills it).
struct KnormScoreParams {
  uint32_t heads;  // N
  uint32_t rows;   // S, new rows per head
  uint32_t key_dim;
  uint32_t value_dim;
  // The position of new row 0 (the same in every head); with has_valid, a
  // row is real when its position lies in its head's [lo, hi).
  uint32_t offset;
  uint32_t has_valid;
};

// The constants of the evict-and-fill kernels, bound as one block at their
// last [[buffer(i)]] (csrc/evict_and_fill/plan.cpp fills it). Signed
// values (protect_from, lo and hi of the ranges) travel as their bits.
struct KnormEvictParams {
  uint32_t slots;      // C: slots of the stored buffers
  uint32_t out_slots;  // C_out
  uint32_t n_new;      // S
  uint32_t filled;
  uint32_t kept;
  uint32_t offset;
  uint32_t n_sink;
  uint32_t recent;
  uint32_t keep_high;
  uint32_t temporal;
  // Bit i: output i (payloads, then norms, then positions) is input i's
  // buffer.
  uint32_t in_place;
  uint32_t payloads;  // M
  uint32_t norms_given;  // new_norms is bound (else the norms are computed)
  uint32_t has_valid;    // valid is bound (else every row is real)
  // 1: knorm_evict_and_fill writes the new rows; 0: knorm_fill_new_rows
  // does, over groups_per_head threadgroups per head.
  uint32_t fill_new;
  uint32_t groups_per_head;
  // 1: knorm_copy_kept_rows copied slots [0, kept) of every output not in
  // place, over copy_groups_per_head threadgroups per head, before
  // knorm_evict_and_fill runs; 0: knorm_evict_and_fill copies them.
  uint32_t kept_copied;
  uint32_t copy_groups_per_head;
  // 1: several rows leave and the ranks of slots [0, filled) fit the
  // threadgroup buffer the plan sized for them (at most kEvictCachedRanks).
  uint32_t cache_ranks;
  // The temporal layout's decode step with few heads: nonzero, the
  // payloads' rows shift over that many threadgroups per head of
  // knorm_shift_kept_rows (kSplitRows rows each), after
  // knorm_evict_and_fill found the evicted slot and kept what the shift
  // needs in the scratch buffer (knorm_shift_boundary); 0: knorm_evict_and_fill
  // moves them.
  uint32_t shift_groups_per_head;
  // The temporal layout's step with several rows leaving, few heads and
  // more than kSplitRows kept: nonzero, the payloads' rows move over that
  // many threadgroups per head (kSplitRows slots each) of
  // knorm_stage_compaction (the rows of payloads in place, to the scratch
  // buffer) and knorm_compact_kept_rows, after knorm_evict_and_fill noted
  // each kept slot's source in the scratch buffer
  // (knorm_compaction_sources); 0: knorm_evict_and_fill moves them.
  uint32_t compact_groups_per_head;
  uint32_t row_bytes[kEvictMaxPayloads];  // bytes of one row of payload i
  // Bytes of the units payload i's rows move in (knorm_copy_bytes).
  uint32_t row_unit[kEvictMaxPayloads];
  // Where payload i's region of the scratch buffer starts, in
  // kRowUnitWide-byte units: with shift_groups_per_head its block
  // boundaries (the heads' evicted slots start at 0), with
  // compact_groups_per_head its staged rows (the sources start at 0).
  uint32_t scratch_units[kEvictMaxPayloads];
};

// The constants of the gather kernels, bound as one block at their last
// [[buffer(i)]] (csrc/protected_topk_gather/plan.cpp fills it): one
// setBytes instead of one per constant.
struct KnormGatherParams {
  uint32_t n_prior;
  uint32_t n_new;
  uint32_t key_dim;
  uint32_t value_dim;
  uint32_t kept;
  // Rows [0, sink_end) and [mid_end, n_prior + n_new) are protected, and
  // mid_keep rows between them are kept.
  uint32_t sink_end;
  uint32_t mid_end;
  uint32_t mid_keep;
  uint32_t keep_high;
  // Bits: output i is prior input i's buffer (keys 1, values 2, norms 4).
  uint32_t in_place;
  // Bytes of the units K and V rows move in (knorm_copy_bits).
  uint32_t key_unit;
  uint32_t value_unit;
  // 1: knorm_protected_topk_gather copies the K/V rows; 0: knorm_gather_rows
  // does, over groups_per_head threadgroups per head, from output row
  // first_row on (the rows before it are compacted in place).
  uint32_t copy_rows;
  uint32_t first_row;
  uint32_t groups_per_head;
  // 1: the selection evicts and the norms of all n_prior + n_new rows fit
  // the threadgroup buffer the plan sized for them (at most
  // kGatherCachedNorms).
  uint32_t cache_norms;
  // Bits (keys 1, values 2) of the outputs in place compacted over
  // groups_per_head threadgroups per head, not by the selection:
  // knorm_stage_prior_rows copies their prior rows that move to the scratch
  // buffer, at their output rows, and knorm_gather_rows writes them from
  // there.
  uint32_t stage_prior;
  // Where the staged keys and values start in the scratch buffer, in
  // kRowUnitWide-byte units (kept rows a head, head-major).
  uint32_t staged_key_units;
  uint32_t staged_value_units;
};

#if !defined(__METAL_VERSION__) && !defined(KNORM_METAL_EMULATOR)
} // namespace mlx_knorm
#endif

#endif // MLX_KNORM_METAL_KNORM_DEFINES_H
