// A dispatch: the grid's threadgroups one after another, each thread of a
// group a real std::thread, with the binding checked first and divergent
// barriers and conflicting threadgroup writes reported after.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "metal_emulator/barrier.h"
#include "metal_emulator/binding.h"
#include "metal_emulator/dispatch.h"
#include "metal_emulator/errors.h"
#include "metal_emulator/signature.h"
#include "metal_emulator/threads.h"
#include "metal_emulator/tsan.h"

namespace metal_emu {

// Runs n_groups threadgroups of group_size threads, one threadgroup at a
// time, all threads of a group concurrently. Throws on an unknown kernel, a
// binding that does not match the kernel's signature, divergent barriers,
// conflicting threadgroup writes, or threads that cannot be started (after
// joining those that were).
inline void dispatch(
    const std::string& kernel,
    uint32_t n_groups,
    uint32_t group_size,
    const std::vector<mlx_knorm::EmulatedBuffer>& buffers) {
  auto it = kernel_registry().find(kernel);
  if (it == kernel_registry().end()) {
    throw std::runtime_error("metal emulator: no kernel named " + kernel);
  }
  const RegisteredKernel& k = it->second;
  check_binding(kernel, k, buffers);
  if (group_size == 0 || group_size % kSimdWidth != 0 || group_size > 1024) {
    throw std::runtime_error(
        "metal emulator: threadgroup size must be a multiple of 32 up to 1024");
  }
  if (n_groups == 0) {
    return;
  }
  auto group = std::make_unique<ThreadgroupState>(group_size);
  // Separates threadgroups; never left early. No thread enters the kernel
  // before all group_size threads have reached it, so when one cannot be
  // started, abandoning it releases every thread that was.
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
    for (uint32_t g = 0; g < n_groups; ++g) {
      if (thread == 0) {
        HiddenFromTsan hidden;
        group->memory.start_group();
        group->barrier.reset(group_size);
        for (auto& s : group->simd_groups) {
          s->barrier.reset(kSimdWidth);
        }
      }
      if (!launch.arrive_and_wait()) {
        break;
      }
      context.group_index = g;
      context.memory_offset = 0;
      context.barriers_passed = 0;
      context.device_order = &device_order[g];
      k.invoke(buffers, ThreadPosition{g, thread, context.lane, context.simd_group});
      {
        HiddenFromTsan hidden;
        barrier_counts[thread] = context.barriers_passed;
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
  std::vector<std::thread> threads;
  threads.reserve(group_size);
  try {
    for (uint32_t t = 0; t < group_size; ++t) {
      threads.emplace_back(worker, t);
    }
  } catch (const std::exception& e) {
    // Out of threads or of address space for their stacks.
    launch.abandon();
    for (auto& t : threads) {
      t.join();
    }
    throw std::runtime_error(
        "metal emulator: " + kernel + ": started " + std::to_string(threads.size()) +
        " of a threadgroup's " + std::to_string(group_size) + " threads (" + e.what() + ")");
  }
  for (auto& t : threads) {
    t.join();
  }
  if (!errors.first().empty()) {
    throw std::runtime_error(errors.first());
  }
}

} // namespace metal_emu
