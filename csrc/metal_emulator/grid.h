// A dispatch: the grid's threadgroups one after another, each thread of a
// group a real thread (of the evaluating thread's pool, thread_pool.h),
// with the binding and the threadgroup memory lengths checked first, and
// divergent barriers, conflicting threadgroup writes and writes past a
// [[threadgroup(i)]] argument reported after.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "metal_emulator/barrier.h"
#include "metal_emulator/binding.h"
#include "metal_emulator/dispatch.h"
#include "metal_emulator/errors.h"
#include "metal_emulator/signature.h"
#include "metal_emulator/thread_pool.h"
#include "metal_emulator/threads.h"
#include "metal_emulator/tsan.h"

namespace metal_emu {

// Throws unless the launch sets a length for exactly the kernel's
// [[threadgroup(i)]], each a multiple of 16 bytes (as Metal requires) and
// none zero; returns the guards after them, laid out from offset 0 in
// index order (so each argument starts at a multiple of 16 bytes), and
// sets each argument's offset and where the layout ends.
inline std::vector<Guard> threadgroup_layout(
    const std::string& kernel,
    const RegisteredKernel& k,
    const std::vector<uint32_t>& lengths,
    std::vector<size_t>& offsets,
    size_t& end) {
  const std::string prefix = "metal emulator: " + kernel + " ";
  std::vector<bool> declared(lengths.size(), false);
  for (const ThreadgroupParameter& p : k.threadgroups) {
    if (p.index >= lengths.size()) {
      throw std::runtime_error(prefix + "takes [[threadgroup(" + std::to_string(p.index) +
                               ")]], whose length the launch does not set");
    }
    declared[p.index] = true;
  }
  offsets.assign(lengths.size(), 0);
  std::vector<Guard> guards;
  size_t offset = 0;
  size_t counted = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    const std::string slot = "[[threadgroup(" + std::to_string(i) + ")]]";
    if (!declared[i]) {
      throw std::runtime_error(prefix + "declares no " + slot + ", whose length the launch sets");
    }
    if (lengths[i] == 0 || lengths[i] % 16 != 0) {
      throw std::runtime_error(prefix + "gets " + std::to_string(lengths[i]) + " bytes at " +
                               slot + ": Metal takes threadgroup memory lengths in nonzero multiples of 16 bytes");
    }
    offsets[i] = offset;
    offset += lengths[i];
    counted += lengths[i];
    guards.push_back({offset, static_cast<uint32_t>(i)});
    offset += kGuardBytes;
  }
  if (counted > kThreadgroupMemoryBytes) {
    throw std::runtime_error(prefix + "gets " + std::to_string(counted) +
                             " bytes of threadgroup memory, past the 32 KiB a threadgroup may have");
  }
  end = offset;
  return guards;
}

// Runs n_groups threadgroups of group_size threads, one threadgroup at a
// time (first to last, or last to first with reverse_groups: a GPU runs
// them in any order), all threads of a group concurrently. Throws on an unknown kernel, a
// binding that does not match the kernel's signature, divergent barriers,
// conflicting threadgroup writes, or threads that cannot be started (none
// having run); with `fresh_threads` the threads are started for this
// dispatch and joined after it, with any the pool kept before.
// Returns the threadgroup memory the kernel had: the lengths set, and what
// it declared in kernel scope.
inline size_t dispatch(
    const std::string& kernel,
    uint32_t n_groups,
    uint32_t group_size,
    const std::vector<mlx_knorm::EmulatedBuffer>& buffers,
    const std::vector<uint32_t>& threadgroup_lengths,
    bool reverse_groups = false,
    bool fresh_threads = false) {
  auto it = kernel_registry().find(kernel);
  if (it == kernel_registry().end()) {
    throw std::runtime_error("metal emulator: no kernel named " + kernel);
  }
  const RegisteredKernel& k = it->second;
  check_binding(kernel, k, buffers);
  std::vector<size_t> argument_offsets;
  size_t arguments_end = 0;
  std::vector<Guard> guards =
      threadgroup_layout(kernel, k, threadgroup_lengths, argument_offsets, arguments_end);
  const size_t guard_bytes = guards.size() * kGuardBytes;
  if (group_size == 0 || group_size % kSimdWidth != 0 || group_size > 1024) {
    throw std::runtime_error(
        "metal emulator: threadgroup size must be a multiple of 32 up to 1024");
  }
  if (n_groups == 0) {
    return 0;
  }
  auto group = std::make_unique<ThreadgroupState>(group_size);
  group->memory.set_guards(std::move(guards));
  // Thread 0's extent of the last group, guards taken off.
  size_t memory_used = 0;
  // Separates threadgroups; never left early.
  Barrier launch;
  launch.reset(group_size);
  std::vector<uint64_t> barrier_counts(group_size);
  // One ThreadSanitizer synchronisation address per threadgroup: no barrier
  // orders memory across threadgroups.
  std::vector<char> device_order(n_groups);
  DispatchErrors errors(kernel);

  auto worker = [&](uint32_t thread) {
    ThreadContext context;
    context.kernel_function = k.function.c_str();
    context.errors = &errors;
    context.group = group.get();
    context.thread = thread;
    context.lane = thread % kSimdWidth;
    context.simd_group = thread / kSimdWidth;
    current_thread() = &context;
    for (uint32_t turn = 0; turn < n_groups; ++turn) {
      const uint32_t g = reverse_groups ? n_groups - 1 - turn : turn;
      if (thread == 0) {
        HiddenFromTsan hidden;
        group->memory.start_group();
        group->barrier.reset(group_size);
        for (auto& s : group->simd_groups) {
          s->barrier.reset(kSimdWidth);
        }
      }
      launch.arrive_and_wait();
      context.group_index = g;
      context.barriers_passed = 0;
      context.device_order = &device_order[g];
      for (size_t i = 0; i < threadgroup_lengths.size(); ++i) {
        context.threadgroup_arguments[i] = group->memory.declare(
            thread, argument_offsets[i], threadgroup_lengths[i] + kGuardBytes);
      }
      context.memory_offset = arguments_end;
      context.guard_bytes = guard_bytes;
      k.invoke(buffers, ThreadPosition{g, thread, context.lane, context.simd_group});
      check_threadgroup_arguments(context);
      {
        HiddenFromTsan hidden;
        barrier_counts[thread] = context.barriers_passed;
        if (thread == 0) {
          memory_used = context.memory_offset - context.guard_bytes;
        }
      }
      group->simd_groups[context.simd_group]->barrier.leave();
      group->barrier.leave();
      launch.arrive_and_wait();
      if (thread == 0) {
        HiddenFromTsan hidden;
        bool diverged = group->barrier.diverged();
        for (auto& s : group->simd_groups) {
          diverged = diverged || s->barrier.diverged();
        }
        for (uint32_t t = 1; t < group_size; ++t) {
          diverged = diverged || barrier_counts[t] != barrier_counts[0];
        }
        if (diverged) {
          errors.fail(g, "threads reached barriers in divergent control flow");
        }
      }
    }
    current_thread() = nullptr;
  };
  try {
    ThreadPool::of_thread().run(group_size, worker, !fresh_threads);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error("metal emulator: " + kernel + ": " + e.what());
  }
  if (!errors.first().empty()) {
    throw std::runtime_error(errors.first());
  }
  return memory_used;
}

} // namespace metal_emu
