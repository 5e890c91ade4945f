// The barrier the emulator's threadgroups and SIMD groups meet at, and the
// bits of metal::mem_flags that say what a threadgroup barrier orders.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <thread>

#include "metal_emulator/tsan.h"

namespace metal_emu {

// The bits of metal::mem_flags.
constexpr unsigned kOrdersDevice = 1;
constexpr unsigned kOrdersThreadgroup = 2;

// Generation-counting barrier for a fixed set of threads. A thread that
// returns from the kernel leaves the set; if others are already waiting, the
// kernel reached a barrier in divergent control flow (undefined behaviour in
// Metal), which is recorded and reported instead of deadlocking. So are
// threads that meet at one barrier with different `kind`s (a threadgroup
// barrier's mem_flags): they called different barriers.
class Barrier {
 public:
  void reset(uint32_t participants) {
    HiddenFromTsan hidden;
    std::lock_guard<std::mutex> lock(mutex_);
    expected_ = participants;
    arrived_ = 0;
    diverged_ = false;
  }

  // The last thread to arrive runs `complete` before any thread returns.
  template <typename Complete>
  void arrive_and_wait(unsigned kind, Complete&& complete) {
    HiddenFromTsan hidden;
    std::unique_lock<std::mutex> lock(mutex_);
    if (arrived_ == 0) {
      kind_ = kind;
    } else if (kind != kind_) {
      diverged_ = true;
    }
    if (++arrived_ == expected_) {
      complete();
      release();
      return;
    }
    // Wait on the wake word outside the lock: a released thread returns
    // without taking the mutex again, which with hundreds of threads on a
    // few cores would wake each of them twice.
    const uint32_t wake = wake_.load(std::memory_order_relaxed);
    lock.unlock();
    while (wake_.load(std::memory_order_acquire) == wake) {
      sleep_while(wake);
    }
  }

  void arrive_and_wait() {
    arrive_and_wait(0, [] {});
  }

  void leave() {
    HiddenFromTsan hidden;
    std::lock_guard<std::mutex> lock(mutex_);
    --expected_;
    if (arrived_ > 0) {
      diverged_ = true;
      if (arrived_ == expected_) {
        release();
      }
    }
  }

  bool diverged() {
    HiddenFromTsan hidden;
    std::lock_guard<std::mutex> lock(mutex_);
    return diverged_;
  }

 private:
  static constexpr int kYieldsBeforeSleep = 128;

  // Waits until wake_ may differ from `seen`. It yields the core first:
  // with hundreds of threads on a few cores the others reach the barrier
  // within some rounds of the scheduler, cheaper than a sleep and a wake-up
  // (about 4x over the standard library's wait alone, which yields a few
  // times only).
  void sleep_while(uint32_t seen) {
    for (int i = 0; i < kYieldsBeforeSleep; ++i) {
      std::this_thread::yield();
      if (wake_.load(std::memory_order_acquire) != seen) {
        return;
      }
    }
    wake_.wait(seen, std::memory_order_acquire);
  }

  void release() {
    arrived_ = 0;
    wake_.fetch_add(1, std::memory_order_release);
    wake_.notify_all();
  }

  std::mutex mutex_;
  // Changes on every release; waiters sleep on it.
  std::atomic<uint32_t> wake_{0};
  uint32_t expected_ = 0;
  uint32_t arrived_ = 0;
  unsigned kind_ = 0;
  bool diverged_ = false;
};

} // namespace metal_emu
