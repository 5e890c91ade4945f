// Threadgroup memory as metal_emulator.h describes it: garbage at the start
// of each threadgroup, a view per thread that only barriers ordering
// threadgroup memory publish and refresh, the write conflicts between two
// such barriers, and guard bytes after each [[threadgroup(i)]] argument.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include <sys/mman.h>

#include "metal_emulator/errors.h"
#include "metal_emulator/tsan.h"

namespace metal_emu {

// Apple GPUs give a threadgroup at most 32 KiB of threadgroup memory.
constexpr size_t kThreadgroupMemoryBytes = 32 * 1024;
// [[threadgroup(i)]] arguments a kernel may take here, and the guard bytes
// after each: they hold kGuardPattern, and a thread that changes one wrote
// past the length the launch set. Guards are not counted against the
// 32 KiB, so the memory holds them on top.
constexpr size_t kMaxThreadgroupArguments = 4;
constexpr size_t kGuardBytes = 256;
constexpr unsigned char kGuardPattern = 0xA5;
constexpr size_t kMemoryBytes =
    kThreadgroupMemoryBytes + kMaxThreadgroupArguments * (kGuardBytes + 16);

// The guard bytes [begin, begin + kGuardBytes) after argument `index`.
struct Guard {
  size_t begin;
  uint32_t index;
};

// A byte two threads changed between two barriers that order threadgroup
// memory.
struct WriteConflict {
  size_t byte;
  uint32_t other_thread;
};

// The threadgroup memory of one threadgroup, as metal_emulator.h describes
// it: the shared memory, on pages of its own. Without ThreadSanitizer
// also its state at the last barrier that ordered it (the baseline, which
// every view equals after that barrier), one view per thread, and per byte
// the last thread that published a change to it and when.
class ThreadgroupMemory {
 public:
  explicit ThreadgroupMemory(uint32_t group_size) : shared_(map_pages(nullptr)) {
    if constexpr (!kThreadSanitizer) {
      views_ = std::make_unique_for_overwrite<unsigned char[]>(
          size_t(group_size) * kMemoryBytes);
      writers_ = std::make_unique<uint64_t[]>(kMemoryBytes);
    }
  }

  ~ThreadgroupMemory() {
    munmap(shared_, kMemoryBytes);
  }

  ThreadgroupMemory(const ThreadgroupMemory&) = delete;
  ThreadgroupMemory& operator=(const ThreadgroupMemory&) = delete;

  // Before a dispatch's first threadgroup: where its guards lie.
  void set_guards(std::vector<Guard> guards) {
    guards_ = std::move(guards);
  }

  // Thread 0, every other thread waiting. Threadgroup memory starts
  // undefined on a GPU: a pattern that is a NaN as float and huge as uint.
  void start_group() {
    std::memset(shared_, 0xFF, kMemoryBytes);
    for (const Guard& g : guards_) {
      std::memset(shared_ + g.begin, kGuardPattern, kGuardBytes);
    }
    if constexpr (kThreadSanitizer) {
      forget_accesses();
    } else {
      std::memcpy(baseline_, shared_, kMemoryBytes);
    }
  }

  // Thread `thread`'s storage for the bytes [offset, offset + size) of a
  // declaration.
  volatile unsigned char* declare(uint32_t thread, size_t offset, size_t size) {
    if constexpr (kThreadSanitizer) {
      return shared_ + offset;
    } else {
      // Views are compared and copied in words: the last word is
      // initialised too.
      unsigned char* view = view_of(thread);
      std::memcpy(view + offset, baseline_ + offset, words_end(offset + size) - offset);
      return view + offset;
    }
  }

  // Before `thread` arrives at a barrier that orders threadgroup memory:
  // what it changed in its view since the last one goes to the shared
  // memory. `used` bytes are declared.
  std::optional<WriteConflict> publish(uint32_t thread, size_t used) {
    std::optional<WriteConflict> conflict;
    if constexpr (!kThreadSanitizer) {
      const unsigned char* view = view_of(thread);
      const uint64_t mine = (epoch_ << 16) | (thread + 1);
      for (size_t w = 0; w < words_end(used); w += kWord) {
        if (std::memcmp(view + w, baseline_ + w, kWord) == 0) {
          continue;
        }
        for (size_t b = w; b < w + kWord; ++b) {
          if (view[b] == baseline_[b]) {
            continue;
          }
          __atomic_store_n(&shared_[b], view[b], __ATOMIC_RELAXED);
          const uint64_t last = __atomic_exchange_n(&writers_[b], mine, __ATOMIC_RELAXED);
          if (last >> 16 == epoch_ && last != mine && !conflict) {
            conflict = WriteConflict{b, static_cast<uint32_t>(last & 0xFFFF) - 1};
          }
        }
      }
    } else {
      (void)thread;
      (void)used;
    }
    return conflict;
  }

  // By the last thread to arrive at a barrier that orders threadgroup
  // memory, all others published and waiting.
  void complete_barrier() {
    if constexpr (kThreadSanitizer) {
      forget_accesses();
    } else {
      changed_.clear();
      for (size_t w = 0; w < kMemoryBytes; w += kWord) {
        if (std::memcmp(shared_ + w, baseline_ + w, kWord) == 0) {
          continue;
        }
        std::memcpy(baseline_ + w, shared_ + w, kWord);
        if (!changed_.empty() && changed_.back().second == w) {
          changed_.back().second = w + kWord;
        } else {
          changed_.emplace_back(w, w + kWord);
        }
      }
      ++epoch_;
    }
  }

  // After that barrier: what the others published, into `thread`'s view.
  void refresh(uint32_t thread) {
    if constexpr (!kThreadSanitizer) {
      unsigned char* view = view_of(thread);
      for (const auto& [begin, end] : changed_) {
        std::memcpy(view + begin, baseline_ + begin, end - begin);
      }
    } else {
      (void)thread;
    }
  }

  // The first guard byte that `thread`'s storage (its view, or the shared
  // memory under ThreadSanitizer) no longer holds the pattern in, with the
  // argument it follows. The guards must have been declared.
  std::optional<std::pair<uint32_t, size_t>> overrun(uint32_t thread) {
    HiddenFromTsan hidden;
    const unsigned char* storage = kThreadSanitizer ? shared_ : view_of(thread);
    for (const Guard& g : guards_) {
      for (size_t b = g.begin; b < g.begin + kGuardBytes; ++b) {
        if (storage[b] != kGuardPattern) {
          return std::make_pair(g.index, b - g.begin);
        }
      }
    }
    return std::nullopt;
  }

  // Where an atomic on `p` acts: the shared memory, for a location in
  // `thread`'s view.
  volatile void* shared_location(uint32_t thread, volatile void* p) {
    if constexpr (!kThreadSanitizer) {
      auto* byte = const_cast<unsigned char*>(static_cast<volatile unsigned char*>(p));
      unsigned char* view = view_of(thread);
      if (byte >= view && byte < view + kMemoryBytes) {
        return shared_ + (byte - view);
      }
    } else {
      (void)thread;
    }
    return p;
  }

 private:
  static constexpr size_t kWord = sizeof(uint64_t);

  static size_t words_end(size_t bytes) {
    return (bytes + kWord - 1) / kWord * kWord;
  }

  unsigned char* view_of(uint32_t thread) {
    return views_.get() + size_t(thread) * kMemoryBytes;
  }

  static unsigned char* map_pages(void* at) {
    void* p = mmap(at, kMemoryBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | (at != nullptr ? MAP_FIXED : 0), -1, 0);
    if (p == MAP_FAILED) {
      fatal("cannot map threadgroup memory");
    }
    return static_cast<unsigned char*>(p);
  }

  // Makes ThreadSanitizer forget every access to the shared memory (its
  // annotation for that is a no-op): pages mapped anew over it, with
  // accesses ignored, start with no history. The baseline, unused under
  // ThreadSanitizer, keeps the contents meanwhile.
  void forget_accesses() {
    HiddenFromTsan hidden;
    std::memcpy(baseline_, shared_, kMemoryBytes);
    map_pages(shared_);
    std::memcpy(shared_, baseline_, kMemoryBytes);
  }

  unsigned char* const shared_;
  alignas(64) unsigned char baseline_[kMemoryBytes];
  std::unique_ptr<unsigned char[]> views_;
  // Per byte: epoch << 16 | (thread + 1) of its last published change.
  std::unique_ptr<uint64_t[]> writers_;
  // Barriers that ordered threadgroup memory so far, from 1.
  uint64_t epoch_ = 1;
  // The word ranges [begin, end) that the last such barrier changed.
  std::vector<std::pair<size_t, size_t>> changed_;
  std::vector<Guard> guards_;
};

} // namespace metal_emu
