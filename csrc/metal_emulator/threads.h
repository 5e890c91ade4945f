// The emulator's threads: the state a threadgroup and its SIMD groups
// share, each thread's context, threadgroup-memory declarations and
// threadgroup_barrier.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "metal_emulator/barrier.h"
#include "metal_emulator/errors.h"
#include "metal_emulator/threadgroup_memory.h"
#include "metal_emulator/tsan.h"

namespace metal_emu {

constexpr uint32_t kSimdWidth = 32;

struct SimdGroupState {
  Barrier barrier;
  // One exchange slot per lane, wide enough for any scalar a kernel shuffles.
  alignas(16) unsigned char slots[kSimdWidth][16];
};

struct ThreadgroupState {
  explicit ThreadgroupState(uint32_t group_size) : memory(group_size) {
    for (uint32_t s = 0; s < group_size / kSimdWidth; ++s) {
      simd_groups.push_back(std::make_unique<SimdGroupState>());
    }
  }

  Barrier barrier;
  std::vector<std::unique_ptr<SimdGroupState>> simd_groups;
  ThreadgroupMemory memory;
};

struct ThreadContext {
  const char* kernel_function = nullptr;  // for the scope of declarations
  DispatchErrors* errors = nullptr;
  ThreadgroupState* group = nullptr;
  uint32_t group_index = 0;
  uint32_t thread = 0;
  uint32_t lane = 0;
  uint32_t simd_group = 0;
  size_t memory_offset = 0;    // bump pointer into the threadgroup memory
  size_t guard_bytes = 0;      // of it, guards (not counted against 32 KiB)
  // This thread's storage of each [[threadgroup(i)]] argument.
  volatile unsigned char* threadgroup_arguments[kMaxThreadgroupArguments] = {};
  // Threadgroup barriers passed in the current threadgroup. SIMD groups may
  // leave together early (e.g. past the last row), so only threadgroup
  // barriers must match across the whole group.
  uint64_t barriers_passed = 0;
  // Under ThreadSanitizer, what the current threadgroup's barriers that
  // order device memory release and acquire.
  void* device_order = nullptr;
};

inline ThreadContext*& current_thread() {
  thread_local ThreadContext* context = nullptr;
  return context;
}

// A write past a [[threadgroup(i)]] argument's length, found in `t`'s
// storage: reported as the dispatch's error.
inline void check_threadgroup_arguments(ThreadContext& t) {
  if (const auto overrun = t.group->memory.overrun(t.thread)) {
    t.errors->fail(
        t.group_index,
        "thread " + std::to_string(t.thread) + " wrote past the end of [[threadgroup(" +
        std::to_string(overrun->first) + ")]] (byte " + std::to_string(overrun->second) +
        " after the length the launch set)");
  }
}

// Storage of one threadgroup-memory declaration, made in `function`. Every
// thread of the group executes the same declarations in the same order, so
// a per-thread bump offset hands all of them the same bytes. Metal allows
// such declarations in the kernel function itself only.
template <typename T>
volatile T* threadgroup_array(size_t count, const char* function) {
  ThreadContext* t = current_thread();
  if (std::strcmp(function, t->kernel_function) != 0) {
    fatal(std::string("threadgroup memory declared in ") + function +
          "(), outside the kernel function " + t->kernel_function +
          "(): Metal allows threadgroup declarations in kernel scope only");
  }
  size_t offset = (t->memory_offset + alignof(T) - 1) / alignof(T) * alignof(T);
  if (offset + count * sizeof(T) - t->guard_bytes > kThreadgroupMemoryBytes) {
    fatal("threadgroup memory exceeds 32 KiB");
  }
  t->memory_offset = offset + count * sizeof(T);
  return reinterpret_cast<volatile T*>(
      t->group->memory.declare(t->thread, offset, count * sizeof(T)));
}

inline void threadgroup_barrier(ThreadContext& t, unsigned flags) {
  const bool orders_threadgroup = (flags & kOrdersThreadgroup) != 0;
  const bool orders_device = (flags & kOrdersDevice) != 0;
  ThreadgroupMemory& memory = t.group->memory;
  if (orders_threadgroup) {
    check_threadgroup_arguments(t);
    if (const auto conflict = memory.publish(t.thread, t.memory_offset)) {
      t.errors->fail(
          t.group_index,
          "threads " + std::to_string(conflict->other_thread) + " and " + std::to_string(t.thread) +
          " both wrote byte " + std::to_string(conflict->byte) +
          " of threadgroup memory with no barrier ordering threadgroup memory between");
    }
  }
  if (orders_device) {
    tsan_release(t.device_order);
  }
  t.group->barrier.arrive_and_wait(flags, [&] {
    if (orders_threadgroup) {
      memory.complete_barrier();
    }
  });
  if (orders_device) {
    tsan_acquire(t.device_order);
  }
  if (orders_threadgroup) {
    memory.refresh(t.thread);
  }
  ++t.barriers_passed;
}

} // namespace metal_emu
