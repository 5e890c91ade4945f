// Splits rows over the machine's cores when the bytes moved make it worth it;
// smaller calls stay on the calling thread. The workers are started once and
// reused, yet waking one still costs tens of microseconds on a busy or
// virtualised machine: below about 8 MiB per thread (a decode step of a
// 512-row cache) one thread finishes first. A forked child starts workers of
// its own on first use (parallel.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <future>
#include <thread>
#include <vector>

#include "mlx/threadpool.h"

namespace mlx_knorm {

// hardware_concurrency() - 1 workers; the calling thread takes a share too.
ThreadPool& row_workers();
int64_t row_worker_count();

template <typename F>
void parallel_for(int64_t n_rows, size_t bytes_per_row, F&& body) {
  constexpr size_t min_bytes_per_thread = size_t(8) << 20;
  const int64_t by_bytes = static_cast<int64_t>(
      (static_cast<size_t>(n_rows) * bytes_per_row) / min_bytes_per_thread);
  const int64_t n_threads = std::max<int64_t>(
      1, std::min({row_worker_count() + 1, n_rows, by_bytes}));
  if (n_threads <= 1) {
    body(int64_t(0), n_rows);
    return;
  }
  const int64_t chunk = (n_rows + n_threads - 1) / n_threads;
  std::vector<std::future<void>> done;
  done.reserve(n_threads - 1);
  for (int64_t t = 1; t < n_threads; ++t) {
    const int64_t begin = std::min(n_rows, t * chunk);
    const int64_t end = std::min(n_rows, begin + chunk);
    done.push_back(row_workers().enqueue([&body, begin, end] { body(begin, end); }));
  }
  body(int64_t(0), std::min(n_rows, chunk));
  for (auto& d : done) {
    d.get();
  }
}

} // namespace mlx_knorm
