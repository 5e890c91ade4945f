// How the emulator fails: at once for what no kernel may do (fatal), or
// through one dispatch's first error, thrown once its threads are done.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

#include "metal_emulator/tsan.h"

namespace metal_emu {

[[noreturn]] inline void fatal(const std::string& what) {
  std::fprintf(stderr, "metal emulator: %s\n", what.c_str());
  std::abort();
}

// What one dispatch's threads report; the first error wins.
class DispatchErrors {
 public:
  explicit DispatchErrors(const std::string& kernel) : kernel_(kernel) {}

  void fail(uint32_t group, const std::string& what) {
    HiddenFromTsan hidden;
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_.empty()) {
      error_ = "metal emulator: " + kernel_ + " threadgroup " + std::to_string(group) + ": " + what;
    }
  }

  // Read once every thread is done with the dispatch.
  const std::string& first() const {
    return error_;
  }

 private:
  const std::string kernel_;
  std::mutex mutex_;
  std::string error_;
};

} // namespace metal_emu
