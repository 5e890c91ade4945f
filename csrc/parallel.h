// Splits rows over the machine's cores when the bytes moved make the thread
// start-up worth it; small calls (a decode step of a small cache) stay on the
// calling thread.
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace mlx_knorm {

template <typename F>
void parallel_for(int64_t n_rows, size_t bytes_per_row, F&& body) {
  constexpr size_t min_bytes_per_thread = size_t(1) << 20;
  const int64_t hw = std::max(1u, std::thread::hardware_concurrency());
  const int64_t by_bytes = static_cast<int64_t>(
      (static_cast<size_t>(n_rows) * bytes_per_row) / min_bytes_per_thread);
  const int64_t n_threads = std::max<int64_t>(1, std::min({hw, n_rows, by_bytes}));
  if (n_threads <= 1) {
    body(int64_t(0), n_rows);
    return;
  }
  std::vector<std::thread> workers;
  workers.reserve(n_threads - 1);
  const int64_t chunk = (n_rows + n_threads - 1) / n_threads;
  for (int64_t t = 1; t < n_threads; ++t) {
    const int64_t begin = std::min(n_rows, t * chunk);
    const int64_t end = std::min(n_rows, begin + chunk);
    workers.emplace_back([&body, begin, end] { body(begin, end); });
  }
  body(int64_t(0), std::min(n_rows, chunk));
  for (auto& w : workers) {
    w.join();
  }
}

} // namespace mlx_knorm
