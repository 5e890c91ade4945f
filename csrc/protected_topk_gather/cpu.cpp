// CPU kernel of ProtectedTopKGather (docs/spec.md §3). Per head: one pass
// builds the order keys of the evictable middle, a radix select finds the
// threshold key and how many rows at it are kept (O(n), the Metal kernel's
// method), and one pass copies the kept rows in temporal order as contiguous
// runs read straight from prior and new: the concatenation is never
// materialised. When one row leaves (a decode step) a single scan finds it.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/parallel.h"
#include "common/radix_select.h"
#include "protected_topk_gather/protected_topk_gather.h"

namespace mlx_knorm {

namespace {

struct GatherBuffers {
  const char* prior_keys;
  const char* prior_values;
  const float* prior_norms;
  const char* new_keys;
  const char* new_values;
  const float* new_norms;
  char* keys;
  char* values;
  float* norms;
  uint32_t* indices;
  int64_t n_prior;
  int64_t n_new;
  int64_t kept;
  size_t key_row_bytes;
  size_t value_row_bytes;
};

// Copies rows [begin, end) of the virtual concatenation of row n to output
// position out_pos onwards, split at the prior/new boundary. An output that
// took over its prior input's buffer (donation) is compacted in place: runs
// are visited in temporal order and land at or before their source, so
// memmove never clobbers a row still to be read, and a run already in place
// is not touched at all.
void copy_run(
    const GatherBuffers& b,
    int64_t n,
    int64_t begin,
    int64_t end,
    int64_t out_pos) {
  const int64_t out_row = n * b.kept + out_pos;
  for (int64_t j = begin; j < end; ++j) {
    b.indices[out_row + (j - begin)] = static_cast<uint32_t>(j);
  }
  auto copy_part = [&](int64_t src_begin, int64_t src_end, int64_t dst_row,
                       const char* keys, const char* values, const float* norms,
                       int64_t src_rows) {
    if (src_end <= src_begin) {
      return;
    }
    const int64_t count = src_end - src_begin;
    const int64_t src_row = n * src_rows + src_begin;
    auto move = [count](void* dst, const void* src, size_t row_bytes) {
      if (dst != src) {
        std::memmove(dst, src, count * row_bytes);
      }
    };
    move(b.keys + dst_row * b.key_row_bytes, keys + src_row * b.key_row_bytes,
         b.key_row_bytes);
    move(b.values + dst_row * b.value_row_bytes,
         values + src_row * b.value_row_bytes, b.value_row_bytes);
    move(b.norms + dst_row, norms + src_row, sizeof(float));
  };
  const int64_t split = std::clamp(b.n_prior, begin, end);
  copy_part(begin, split, out_row, b.prior_keys, b.prior_values, b.prior_norms,
            b.n_prior);
  copy_part(split - b.n_prior, end - b.n_prior, out_row + (split - begin),
            b.new_keys, b.new_values, b.new_norms, b.n_new);
}

struct Run {
  int64_t begin;
  int64_t end;
};

// Starts loading the first row of a run: kept rows of a prefill are short
// runs scattered over the block, so each copy would otherwise wait for
// memory. A few runs ahead hides that latency.
void prefetch_run(const GatherBuffers& b, int64_t n, const Run& run) {
  constexpr size_t line = 64;
  const bool prior = run.begin < b.n_prior;
  const int64_t src_row = prior ? n * b.n_prior + run.begin
                                : n * b.n_new + (run.begin - b.n_prior);
  const char* keys = (prior ? b.prior_keys : b.new_keys) + src_row * b.key_row_bytes;
  const char* values =
      (prior ? b.prior_values : b.new_values) + src_row * b.value_row_bytes;
  for (size_t off = 0; off < b.key_row_bytes; off += line) {
    __builtin_prefetch(keys + off);
  }
  for (size_t off = 0; off < b.value_row_bytes; off += line) {
    __builtin_prefetch(values + off);
  }
}

void copy_runs(const GatherBuffers& b, int64_t n, const std::vector<Run>& runs) {
  constexpr size_t ahead = 8;
  for (size_t r = 0; r < std::min(ahead, runs.size()); ++r) {
    prefetch_run(b, n, runs[r]);
  }
  int64_t out_pos = 0;
  for (size_t r = 0; r < runs.size(); ++r) {
    if (r + ahead < runs.size()) {
      prefetch_run(b, n, runs[r + ahead]);
    }
    copy_run(b, n, runs[r].begin, runs[r].end, out_pos);
    out_pos += runs[r].end - runs[r].begin;
  }
}

void gather_rows(
    const GatherBuffers& b,
    const SelectionConfig& config,
    int64_t row_begin,
    int64_t row_end) {
  // No heads (parallel_for runs the body once even then): nothing to select,
  // and the keys below would take 4 bytes a row, up to 8 GB at the row limit.
  if (row_begin >= row_end) {
    return;
  }
  const RowSelection sel(b.n_prior + b.n_new, config);
  if (!sel.evicts) {
    for (int64_t n = row_begin; n < row_end; ++n) {
      copy_run(b, n, 0, sel.n_total, 0);
    }
    return;
  }
  auto norm_at = [&](int64_t n, int64_t j) {
    return j < b.n_prior ? b.prior_norms[n * b.n_prior + j]
                         : b.new_norms[n * b.n_new + (j - b.n_prior)];
  };
  auto rank_at = [&](int64_t n, int64_t j) {
    return rank_key(norm_at(n, j), config.keep, static_cast<uint32_t>(j));
  };
  if (sel.mid_end - sel.n_sink - sel.mid_keep == 1) {
    // One row leaves (a decode step from a full cache): it is the last in
    // rank order, found in one scan; the output is the two runs around it.
    for (int64_t n = row_begin; n < row_end; ++n) {
      int64_t evicted = sel.n_sink;
      uint64_t worst = rank_at(n, evicted);
      for (int64_t j = sel.n_sink + 1; j < sel.mid_end; ++j) {
        const uint64_t rank = rank_at(n, j);
        if (rank > worst) {
          worst = rank;
          evicted = j;
        }
      }
      copy_run(b, n, 0, evicted, 0);
      copy_run(b, n, evicted + 1, sel.n_total, evicted);
    }
    return;
  }
  std::vector<uint32_t> keys(sel.mid_end - sel.n_sink);
  RadixScratch<uint32_t> scratch;
  std::vector<Run> runs;
  runs.reserve(sel.kept);
  for (int64_t n = row_begin; n < row_end; ++n) {
    for (int64_t j = sel.n_sink; j < sel.mid_end; ++j) {
      keys[j - sel.n_sink] = norm_order_key(norm_at(n, j), config.keep);
    }
    const Threshold<uint32_t> cut =
        radix_select(keys.data(), static_cast<int64_t>(keys.size()), sel.mid_keep, scratch);

    // Stable compaction: every middle row below the threshold key, and the
    // first take_equal rows at it (ties go to the earlier row), as maximal
    // runs in temporal order.
    runs.clear();
    int64_t run_begin = 0;
    int64_t equal_left = cut.take_equal;
    for (int64_t j = sel.n_sink; j < sel.mid_end; ++j) {
      const uint32_t key = keys[j - sel.n_sink];
      const bool kept = key < cut.key || (key == cut.key && equal_left-- > 0);
      if (!kept) {
        if (j > run_begin) {
          runs.push_back({run_begin, j});
        }
        run_begin = j + 1;
      }
    }
    runs.push_back({run_begin, sel.n_total});
    copy_runs(b, n, runs);
  }
}

} // namespace

CpuTask protected_topk_gather_cpu_task(
    const GatherInputs& in,
    std::vector<mx::array>& outputs,
    const SelectionConfig& config) {
  const GatherBuffers b{
      in.prior_keys.data<char>(),
      in.prior_values.data<char>(),
      in.prior_norms.data<float>(),
      in.new_keys.data<char>(),
      in.new_values.data<char>(),
      in.new_norms.data<float>(),
      outputs[0].data<char>(),
      outputs[1].data<char>(),
      outputs[2].data<float>(),
      outputs[3].data<uint32_t>(),
      in.n_prior(),
      in.n_new(),
      outputs[0].shape(1),
      static_cast<size_t>(in.key_dim()) * in.prior_keys.itemsize(),
      static_cast<size_t>(in.value_dim()) * in.prior_values.itemsize()};
  return [b, config, n_heads = in.n_heads()] {
    const size_t bytes_per_row = b.kept * (b.key_row_bytes + b.value_row_bytes + 8);
    parallel_for(n_heads, bytes_per_row, [&](int64_t begin, int64_t end) {
      gather_rows(b, config, begin, end);
    });
  };
}

void protected_topk_gather_cpu(
    const GatherInputs& in,
    std::vector<mx::array>& outputs,
    const SelectionConfig& config) {
  protected_topk_gather_cpu_task(in, outputs, config)();
}

} // namespace mlx_knorm
