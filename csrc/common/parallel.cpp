#include "common/parallel.h"

namespace mlx_knorm {

int64_t row_worker_count() {
  static const int64_t count =
      std::max<int64_t>(1, std::thread::hardware_concurrency()) - 1;
  return count;
}

ThreadPool& row_workers() {
  static ThreadPool pool(static_cast<size_t>(row_worker_count()));
  return pool;
}

} // namespace mlx_knorm
