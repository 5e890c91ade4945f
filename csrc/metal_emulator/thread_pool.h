// The threads dispatches run on, started once and kept: starting a
// threadgroup's 256 threads takes about 15 ms here (about 240 ms under
// ThreadSanitizer), more than most emulated kernels run.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <pthread.h>

namespace metal_emu {

// Counts the forks this process comes from: a pool started before the last
// one has none of its threads here.
inline std::atomic<uint64_t>& fork_generation() {
  static std::atomic<uint64_t> generation{0};
  return generation;
}

// Whether forks are counted: registered when the library loads, not on a
// first use that a fork on another thread could catch halfway (its child
// would wait forever for the initialisation to finish).
inline const bool forks_counted =
    pthread_atfork(nullptr, nullptr, [] { fork_generation().fetch_add(1); }) == 0;

// Throws unless forks are counted: checked before any pool exists.
inline void count_forks() {
  if (!forks_counted) {
    throw std::runtime_error("cannot register the thread pool's fork handler");
  }
}

// A pool whose run(n, body) calls body(t) for every t in [0, n), each on a
// thread of its own and all at once (the threads of a threadgroup wait for
// each other at barriers). Each evaluating thread has a pool of its own
// (of_thread), so that dispatches from different threads neither wait for
// each other nor look ordered to ThreadSanitizer: like starting and joining
// threads for each dispatch, a run orders what its caller did before it
// before every call, and every call before what its caller does after it,
// and no call against another call of the same run.
class ThreadPool {
 public:
  // The calling thread's pool, joined when the thread ends; a forked child
  // starts a new one and drops the one it inherited unjoined (its threads
  // are the parent's).
  static ThreadPool& of_thread() {
    struct Held {
      std::unique_ptr<ThreadPool> pool;
      uint64_t generation = 0;
      ~Held() {
        if (generation != fork_generation().load()) {
          (void)pool.release();  // inherited: never joined
        }
      }
    };
    count_forks();
    thread_local Held held;
    const uint64_t generation = fork_generation().load();
    if (held.pool == nullptr || held.generation != generation) {
      (void)held.pool.release();  // inherited, or none
      held.pool.reset(new ThreadPool());
      held.generation = generation;
    }
    return *held.pool;
  }

  ~ThreadPool() {
    stop_from(0);
  }

  // Throws, with nothing run and the threads it started joined, when the
  // threads cannot all be started. With `keep` false every thread of the
  // pool is joined before it returns, so that the next run starts its own
  // (the tests of a failure to start them).
  void run(uint32_t n, const std::function<void(uint32_t)>& body, bool keep) {
    try {
      start(n);
    } catch (...) {
      if (!keep) {
        stop_from(0);
      }
      throw;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      body_ = &body;
      running_ = n;
      for (uint32_t t = 0; t < n; ++t) {
        workers_[t]->runs += 1;
      }
    }
    for (uint32_t t = 0; t < n; ++t) {
      workers_[t]->wake.notify_one();
    }
    {
      std::unique_lock<std::mutex> lock(mutex_);
      done_.wait(lock, [&] { return running_ == 0; });
      body_ = nullptr;
    }
    if (!keep) {
      stop_from(0);
    }
  }

 private:
  struct Worker {
    uint32_t index = 0;
    uint64_t runs = 0;  // runs asked of it, under mutex_
    bool stop = false;  // under mutex_
    std::condition_variable wake;
    std::thread thread;
  };

  ThreadPool() = default;

  void start(uint32_t n) {
    const size_t kept = workers_.size();
    while (workers_.size() < n) {
      const size_t started = workers_.size();
      try {
        workers_.push_back(std::make_unique<Worker>());
        Worker* w = workers_.back().get();
        w->index = static_cast<uint32_t>(started);
        try {
          w->thread = std::thread([this, w] { serve(*w); });
        } catch (...) {
          workers_.pop_back();
          throw;
        }
      } catch (const std::exception& e) {
        // Out of threads, or of memory or address space for their stacks:
        // the threads this call started hold what the caller lacks.
        stop_from(kept);
        throw std::runtime_error("started " + std::to_string(started) + " of a threadgroup's " +
                                 std::to_string(n) + " threads (" + e.what() + ")");
      }
    }
  }

  // Joins the workers from `first` on.
  void stop_from(size_t first) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (size_t i = first; i < workers_.size(); ++i) {
        workers_[i]->stop = true;
      }
    }
    for (size_t i = first; i < workers_.size(); ++i) {
      workers_[i]->wake.notify_one();
      workers_[i]->thread.join();
    }
    workers_.resize(first);
  }

  void serve(Worker& w) {
    uint64_t served = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      w.wake.wait(lock, [&] { return w.stop || w.runs != served; });
      if (w.stop) {
        return;
      }
      served = w.runs;
      const std::function<void(uint32_t)>* body = body_;
      lock.unlock();
      (*body)(w.index);
      lock.lock();
      if (--running_ == 0) {
        done_.notify_one();
      }
    }
  }

  std::mutex mutex_;  // what follows, and each worker's runs and stop
  std::condition_variable done_;
  const std::function<void(uint32_t)>* body_ = nullptr;
  uint32_t running_ = 0;
  std::vector<std::unique_ptr<Worker>> workers_;  // changed by the owning thread only
};

} // namespace metal_emu
