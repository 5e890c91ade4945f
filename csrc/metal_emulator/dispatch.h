// Entry point into the emulated kernels, free of the emulator's Metal
// qualifier macros so that code using MLX headers can call it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mlx_knorm {

// What a launch binds at one [[buffer(i)]], as eval_gpu's encoder would: the
// emulator checks it against the kernel's parameter there.
struct EmulatedBuffer {
  // An input array, an output array, or bytes the host sets (set_bytes).
  enum class Access { Read, Write, Constant };

  void* data;
  std::string dtype;  // MLX's name of the element type (common/dtype.h)
  Access access;
};

// Runs the kernel registered under host name `kernel` over `groups`
// threadgroups of `group_size` threads; buffers[i] is [[buffer(i)]] and
// threadgroup_bytes[i] the length of [[threadgroup(i)]]; the threadgroups
// run one at a time, from the last to the first with `reverse_groups`, on
// the calling thread's pool of threads, kept for later dispatches, or with
// `fresh_threads` started for this one and joined after it with any kept
// before.
// Returns the threadgroup memory a threadgroup had (those lengths and what
// the kernel declares itself), 0 for no threadgroup.
size_t run_emulated_kernel(
    const std::string& kernel,
    uint32_t groups,
    uint32_t group_size,
    const std::vector<EmulatedBuffer>& buffers,
    const std::vector<uint32_t>& threadgroup_bytes,
    bool reverse_groups,
    bool fresh_threads);

} // namespace mlx_knorm
