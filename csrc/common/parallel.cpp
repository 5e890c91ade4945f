#include "common/parallel.h"

#include <mutex>
#include <stdexcept>

#include <pthread.h>

namespace mlx_knorm {

namespace {

// A forked child inherits the pool object but none of its threads: it must
// neither wait for them (handing them rows, or joining them at exit) nor touch
// the pool's locks, which a parent thread may have held at the fork. So the
// pool lives on the heap and is never destroyed (idle workers end with the
// process, as MLX's own stream threads do), and a child drops its parent's
// pool and starts its own on first use.
std::mutex pool_mutex;
ThreadPool* pool = nullptr;

// Holding pool_mutex across fork() means the child never sees it held by a
// thread it does not have.
void lock_pool_before_fork() {
  pool_mutex.lock();
}

void unlock_pool_in_parent() {
  pool_mutex.unlock();
}

void forget_parent_pool_in_child() {
  pool = nullptr;  // left allocated: destroying it would join absent threads
  pool_mutex.unlock();
}

} // namespace

int64_t row_worker_count() {
  static const int64_t count =
      std::max<int64_t>(1, std::thread::hardware_concurrency()) - 1;
  return count;
}

ThreadPool& row_workers() {
  static const bool fork_handlers_registered = [] {
    if (pthread_atfork(lock_pool_before_fork, unlock_pool_in_parent,
                       forget_parent_pool_in_child) != 0) {
      throw std::runtime_error("mlx_knorm: cannot register the row workers' fork handlers");
    }
    return true;
  }();
  (void)fork_handlers_registered;
  std::lock_guard<std::mutex> lock(pool_mutex);
  if (pool == nullptr) {
    pool = new ThreadPool(static_cast<size_t>(row_worker_count()));
  }
  return *pool;
}

} // namespace mlx_knorm
