// Header-only emulation of the part of the Metal execution model that the
// kernels in metal/ use, so that the very same .metal files compile as C++
// and run on a CPU. Every thread of a threadgroup is a real std::thread and
// every barrier is a real barrier: a kernel that misses a barrier races here
// exactly as it would on a GPU, and ThreadSanitizer sees it.
//
// Modelled: address-space qualifiers (as no-ops), half and bfloat with
// bit-exact conversions, threadgroup memory (a per-threadgroup arena filled
// with garbage so that reads of unwritten memory show), threadgroup_barrier,
// SIMD groups of width 32 (simd_shuffle, simd_shuffle_down,
// simd_prefix_inclusive_sum, simd_ballot), relaxed threadgroup atomics,
// uint2 and uint4 for moving raw bits (alignment checked), as_type, ctz,
// popcount, precise::sqrt. Threadgroups of a
// grid run one after another, reusing the same threads.
//
// Include this header, then the .metal files, in a translation unit that
// includes nothing else: the qualifier macros below would break other code.
#pragma once

#include <cfloat>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace metal_emu {

// ---------------------------------------------------------------- barrier --

// Generation-counting barrier for a fixed set of threads. A thread that
// returns from the kernel leaves the set; if others are already waiting, the
// kernel reached a barrier in divergent control flow (undefined behaviour in
// Metal), which is recorded and reported instead of deadlocking.
class Barrier {
 public:
  void reset(uint32_t participants) {
    std::lock_guard<std::mutex> lock(mutex_);
    expected_ = participants;
    arrived_ = 0;
    diverged_ = false;
    abandoned_ = false;
  }

  // False when the barrier was abandoned before all participants arrived.
  bool arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t generation = generation_;
    if (abandoned_) {
      return false;
    }
    if (++arrived_ == expected_) {
      release();
    } else {
      cv_.wait(lock, [&] { return generation_ != generation || abandoned_; });
    }
    return generation_ != generation;
  }

  // Wakes the waiting threads, and fails every later wait, without a release:
  // for participants that will never arrive.
  void abandon() {
    std::lock_guard<std::mutex> lock(mutex_);
    abandoned_ = true;
    cv_.notify_all();
  }

  void leave() {
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
    std::lock_guard<std::mutex> lock(mutex_);
    return diverged_;
  }

 private:
  void release() {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  uint32_t expected_ = 0;
  uint32_t arrived_ = 0;
  uint64_t generation_ = 0;
  bool diverged_ = false;
  bool abandoned_ = false;
};

constexpr uint32_t kSimdWidth = 32;
// Apple GPUs give a threadgroup at most 32 KiB of threadgroup memory.
constexpr size_t kThreadgroupMemoryBytes = 32 * 1024;

struct SimdGroupState {
  Barrier barrier;
  // One exchange slot per lane, wide enough for any scalar a kernel shuffles.
  alignas(16) unsigned char slots[kSimdWidth][16];
};

struct ThreadgroupState {
  Barrier barrier;
  std::vector<std::unique_ptr<SimdGroupState>> simd_groups;
  alignas(64) unsigned char memory[kThreadgroupMemoryBytes];
};

struct ThreadContext {
  ThreadgroupState* group = nullptr;
  uint32_t lane = 0;
  uint32_t simd_group = 0;
  size_t memory_offset = 0;    // bump pointer into group->memory
  // Threadgroup barriers passed in the current threadgroup. SIMD groups may
  // leave together early (e.g. past the last row), so only threadgroup
  // barriers must match across the whole group.
  uint64_t barriers_passed = 0;
};

inline ThreadContext*& current_thread() {
  thread_local ThreadContext* context = nullptr;
  return context;
}

[[noreturn]] inline void fatal(const char* what) {
  std::fprintf(stderr, "metal emulator: %s\n", what);
  std::abort();
}

// Storage of one threadgroup-memory declaration. Every thread of the group
// executes the same declarations in the same order, so a per-thread bump
// offset hands all of them the same address.
template <typename T>
T* threadgroup_array(size_t count) {
  ThreadContext* t = current_thread();
  size_t offset = (t->memory_offset + alignof(T) - 1) / alignof(T) * alignof(T);
  if (offset + count * sizeof(T) > kThreadgroupMemoryBytes) {
    fatal("threadgroup memory exceeds 32 KiB");
  }
  t->memory_offset = offset + count * sizeof(T);
  return reinterpret_cast<T*>(t->group->memory + offset);
}

// -------------------------------------------------------- kernel registry --

// A kernel's arguments are its buffers in [[buffer(i)]] order followed by four
// uint thread attributes, in this order: threadgroup_position_in_grid,
// thread_position_in_threadgroup, thread_index_in_simdgroup,
// simdgroup_index_in_threadgroup.
using Invoker = std::function<void(
    const std::vector<void*>& buffers,
    uint32_t group,
    uint32_t thread,
    uint32_t lane,
    uint32_t simd_group)>;

struct RegisteredKernel {
  size_t n_buffers;
  Invoker invoke;
};

inline std::map<std::string, RegisteredKernel>& kernel_registry() {
  static std::map<std::string, RegisteredKernel> registry;
  return registry;
}

template <typename A>
A bind_buffer(void* p) {
  if constexpr (std::is_pointer_v<A>) {
    return static_cast<A>(p);
  } else {
    static_assert(std::is_reference_v<A>, "buffer arguments are pointers or references");
    return *static_cast<std::remove_reference_t<A>*>(p);
  }
}

template <typename... Args, size_t... I>
void call_kernel(
    void (*fn)(Args...),
    const std::vector<void*>& buffers,
    uint32_t group,
    uint32_t thread,
    uint32_t lane,
    uint32_t simd_group,
    std::index_sequence<I...>) {
  using ArgTuple = std::tuple<Args...>;
  fn(bind_buffer<std::tuple_element_t<I, ArgTuple>>(buffers[I])...,
     group, thread, lane, simd_group);
}

struct KernelRegistration {
  template <typename... Args>
  KernelRegistration(const char* host_name, void (*fn)(Args...)) {
    constexpr size_t n_buffers = sizeof...(Args) - 4;
    kernel_registry()[host_name] = RegisteredKernel{
        n_buffers,
        [fn](const std::vector<void*>& buffers, uint32_t group, uint32_t thread,
             uint32_t lane, uint32_t simd_group) {
          call_kernel(fn, buffers, group, thread, lane, simd_group,
                      std::make_index_sequence<n_buffers>());
        }};
  }
};

// ------------------------------------------------------------------ grid --

// Runs n_groups threadgroups of group_size threads, one threadgroup at a
// time, all threads of a group concurrently. Throws on an unknown kernel, a
// buffer count that does not match the kernel's signature, divergent
// barriers, or threads that cannot be started (after joining those that
// were).
inline void dispatch(
    const std::string& kernel,
    uint32_t n_groups,
    uint32_t group_size,
    const std::vector<void*>& buffers) {
  auto it = kernel_registry().find(kernel);
  if (it == kernel_registry().end()) {
    throw std::runtime_error("metal emulator: no kernel named " + kernel);
  }
  const RegisteredKernel& k = it->second;
  if (k.n_buffers != buffers.size()) {
    throw std::runtime_error(
        "metal emulator: " + kernel + " takes " + std::to_string(k.n_buffers) +
        " buffers, the launch binds " + std::to_string(buffers.size()));
  }
  if (group_size == 0 || group_size % kSimdWidth != 0 || group_size > 1024) {
    throw std::runtime_error(
        "metal emulator: threadgroup size must be a multiple of 32 up to 1024");
  }
  if (n_groups == 0) {
    return;
  }
  const uint32_t n_simd = group_size / kSimdWidth;
  auto group = std::make_unique<ThreadgroupState>();
  for (uint32_t s = 0; s < n_simd; ++s) {
    group->simd_groups.push_back(std::make_unique<SimdGroupState>());
  }
  // Separates threadgroups; never left early. No thread enters the kernel
  // before all group_size threads have reached it, so when one cannot be
  // started, abandoning it releases every thread that was.
  Barrier launch;
  launch.reset(group_size);
  std::vector<uint64_t> barrier_counts(group_size);
  std::string error;

  auto worker = [&](uint32_t thread) {
    ThreadContext context;
    context.group = group.get();
    context.lane = thread % kSimdWidth;
    context.simd_group = thread / kSimdWidth;
    current_thread() = &context;
    for (uint32_t g = 0; g < n_groups; ++g) {
      if (thread == 0) {
        // Threadgroup memory starts undefined on a GPU: fill it with a
        // pattern that is a NaN as float and huge as uint.
        std::memset(group->memory, 0xFF, sizeof(group->memory));
        group->barrier.reset(group_size);
        for (auto& s : group->simd_groups) {
          s->barrier.reset(kSimdWidth);
        }
      }
      if (!launch.arrive_and_wait()) {
        break;
      }
      context.memory_offset = 0;
      context.barriers_passed = 0;
      k.invoke(buffers, g, thread, context.lane, context.simd_group);
      barrier_counts[thread] = context.barriers_passed;
      group->simd_groups[context.simd_group]->barrier.leave();
      group->barrier.leave();
      launch.arrive_and_wait();
      if (thread == 0 && error.empty()) {
        bool diverged = group->barrier.diverged();
        for (auto& s : group->simd_groups) {
          diverged = diverged || s->barrier.diverged();
        }
        for (uint32_t t = 1; t < group_size; ++t) {
          diverged = diverged || barrier_counts[t] != barrier_counts[0];
        }
        if (diverged) {
          error = "metal emulator: " + kernel + " threadgroup " +
              std::to_string(g) +
              ": threads reached barriers in divergent control flow";
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
  if (!error.empty()) {
    throw std::runtime_error(error);
  }
}

} // namespace metal_emu

// ------------------------------------------------- Metal language surface --

namespace metal {

using uint = uint32_t;
using ushort = uint16_t;
using ulong = uint64_t;

// IEEE binary16, stored as its bits; conversions are exact (to float) and
// round to nearest even (from float), like the GPU's.
struct half {
  uint16_t bits;

  half() = default;
  explicit half(float f) : bits(from_float(f)) {}
  operator float() const {
    const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
    const uint32_t exp = (bits >> 10) & 0x1Fu;
    const uint32_t man = bits & 0x3FFu;
    uint32_t out;
    if (exp == 0x1F) {
      out = sign | 0x7F800000u | (man << 13);  // inf, NaN keeps its payload
    } else if (exp != 0) {
      out = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
      out = sign;
    } else {  // subnormal: normalise
      int e = -1;
      uint32_t m = man;
      do {
        ++e;
        m <<= 1;
      } while ((m & 0x400u) == 0);
      out = sign | ((112 - e) << 23) | ((m & 0x3FFu) << 13);
    }
    float f;
    std::memcpy(&f, &out, sizeof(f));
    return f;
  }

 private:
  static uint16_t from_float(float f) {
    uint32_t x;
    std::memcpy(&x, &f, sizeof(x));
    const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
    const uint32_t abs = x & 0x7FFFFFFFu;
    if (abs > 0x7F800000u) {  // NaN: keep the top payload bits, stay quiet
      return sign | 0x7E00u | static_cast<uint16_t>((abs >> 13) & 0x3FFu);
    }
    if (abs >= 0x477FF000u) {  // rounds to >= 65520: infinity
      return sign | 0x7C00u;
    }
    if (abs < 0x38800000u) {  // below the smallest normal half
      // Scale so that the half's subnormal ulp (2^-24) becomes 1, then round
      // to nearest even in integer arithmetic.
      const uint32_t exp = abs >> 23;
      if (exp < 102) {
        return sign;  // below half the smallest subnormal
      }
      const uint32_t man = (abs & 0x7FFFFFu) | 0x800000u;
      const uint32_t shift = 126 - exp;
      uint32_t q = man >> shift;
      const uint32_t rem = man & ((1u << shift) - 1);
      const uint32_t halfway = 1u << (shift - 1);
      if (rem > halfway || (rem == halfway && (q & 1u))) {
        ++q;
      }
      return sign | static_cast<uint16_t>(q);
    }
    uint32_t rounded = abs + 0xFFFu + ((abs >> 13) & 1u);
    return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);
  }
};

// bfloat16: the top half of a binary32.
struct bfloat {
  uint16_t bits;

  bfloat() = default;
  explicit bfloat(float f) {
    uint32_t x;
    std::memcpy(&x, &f, sizeof(x));
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) {
      bits = static_cast<uint16_t>((x >> 16) | 0x40u);
    } else {
      bits = static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
    }
  }
  operator float() const {
    const uint32_t x = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &x, sizeof(f));
    return f;
  }
};

template <typename To, typename From>
To as_type(From v) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs equal sizes");
  To out;
  std::memcpy(&out, &v, sizeof(out));
  return out;
}

template <typename T>
T min(T a, T b) {
  return b < a ? b : a;
}

inline bool isnan(float x) {
  return std::isnan(x);
}

namespace precise {
// std::sqrt is correctly rounded, as precise::sqrt is.
inline float sqrt(float x) {
  return std::sqrt(x);
}
} // namespace precise

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2 };

inline mem_flags operator|(mem_flags a, mem_flags b) {
  return static_cast<mem_flags>(static_cast<int>(a) | static_cast<int>(b));
}

// A real barrier over the whole threadgroup: it orders device and
// threadgroup memory alike, which is at least what every mem_flags asks.
inline void threadgroup_barrier(mem_flags) {
  metal_emu::ThreadContext* t = metal_emu::current_thread();
  t->group->barrier.arrive_and_wait();
  ++t->barriers_passed;
}

namespace detail {

// Each lane publishes v, all 32 lanes meet, read what they need, and meet
// again so that the slots can be reused by the next SIMD function.
template <typename T, typename F>
T simd_exchange(T v, F&& read) {
  static_assert(sizeof(T) <= 16, "SIMD exchange slots hold 16 bytes");
  metal_emu::ThreadContext* t = metal_emu::current_thread();
  metal_emu::SimdGroupState& s = *t->group->simd_groups[t->simd_group];
  std::memcpy(s.slots[t->lane], &v, sizeof(T));
  s.barrier.arrive_and_wait();
  auto lane_value = [&](uint32_t lane) {
    T out;
    std::memcpy(&out, s.slots[lane], sizeof(T));
    return out;
  };
  T result = read(t->lane, lane_value);
  s.barrier.arrive_and_wait();
  return result;
}

} // namespace detail

// Lanes whose source lane would be past the SIMD group keep their own value.
template <typename T>
T simd_shuffle_down(T v, ushort delta) {
  return detail::simd_exchange(v, [&](uint32_t lane, auto lane_value) {
    return lane + delta < metal_emu::kSimdWidth ? lane_value(lane + delta) : v;
  });
}

template <typename T>
T simd_prefix_inclusive_sum(T v) {
  static_assert(std::is_integral_v<T>, "only integer prefix sums are emulated");
  return detail::simd_exchange(v, [&](uint32_t lane, auto lane_value) {
    T sum = 0;
    for (uint32_t l = 0; l <= lane; ++l) {
      sum += lane_value(l);
    }
    return sum;
  });
}

template <typename T>
T simd_shuffle(T v, ushort lane) {
  return detail::simd_exchange(v, [&](uint32_t, auto lane_value) {
    return lane_value(lane);
  });
}

// Bit i: lane i's expr.
struct simd_vote {
  using vote_t = uint64_t;
  explicit simd_vote(vote_t bits = 0) : bits_(bits) {}
  explicit operator vote_t() const {
    return bits_;
  }

 private:
  vote_t bits_;
};

inline simd_vote simd_ballot(bool expr) {
  return detail::simd_exchange(simd_vote(expr ? 1u : 0u), [](uint32_t, auto lane_value) {
    simd_vote::vote_t bits = 0;
    for (uint32_t l = 0; l < metal_emu::kSimdWidth; ++l) {
      bits |= static_cast<simd_vote::vote_t>(lane_value(l)) << l;
    }
    return simd_vote(bits);
  });
}

inline uint ctz(uint x) {
  return x == 0 ? 32u : static_cast<uint>(__builtin_ctz(x));
}

inline uint popcount(uint x) {
  return static_cast<uint>(__builtin_popcount(x));
}

// uint2 and uint4, for the kernels' moves of raw bits. A GPU loads and
// stores them at naturally aligned addresses only; here a copy from or to a
// misaligned one aborts, which checks the launch plans' choice of unit.
template <size_t N>
struct alignas(sizeof(uint) * N) uint_vector {
  uint v[N];

  uint_vector() = default;
  uint_vector(const uint_vector& other) {
    check_aligned(&other);
    std::memcpy(v, other.v, sizeof(v));
  }
  uint_vector& operator=(const uint_vector& other) {
    check_aligned(this);
    check_aligned(&other);
    std::memcpy(v, other.v, sizeof(v));
    return *this;
  }

 private:
  static void check_aligned(const void* p) {
    auto address = reinterpret_cast<std::uintptr_t>(p);
    // Hides the address from the optimiser, which may assume the type's
    // alignment and drop the test.
    asm("" : "+r"(address));
    if (address % sizeof(uint_vector) != 0) {
      metal_emu::fatal("misaligned vector load or store");
    }
  }
};
using uint2 = uint_vector<2>;
using uint4 = uint_vector<4>;

// Threadgroup atomics. Only relaxed ordering is used by the kernels; the
// barriers around them provide the ordering.
struct atomic_uint {
  uint v;
};

enum memory_order { memory_order_relaxed };

inline void atomic_store_explicit(atomic_uint* a, uint value, memory_order) {
  __atomic_store_n(&a->v, value, __ATOMIC_RELAXED);
}

inline uint atomic_load_explicit(atomic_uint* a, memory_order) {
  return __atomic_load_n(&a->v, __ATOMIC_RELAXED);
}

inline uint atomic_fetch_add_explicit(atomic_uint* a, uint value, memory_order) {
  return __atomic_fetch_add(&a->v, value, __ATOMIC_RELAXED);
}

} // namespace metal

// Tells metal/knorm_defines.h that the kernels compile against this
// emulator.
#define KNORM_METAL_EMULATOR 1

// Address spaces are one flat memory here.
#define kernel
#define device
#define constant const
#define threadgroup

// Project macros that metal/knorm_defines.h defines differently for the
// Metal compiler.
#define KNORM_THREADGROUP_ARRAY(type, name, count) \
  type* name = ::metal_emu::threadgroup_array<type>(count)
#define KNORM_CONCAT_(a, b) a##b
#define KNORM_CONCAT(a, b) KNORM_CONCAT_(a, b)
#define KNORM_KERNEL_INSTANCE(host_name, ...)                      \
  static const ::metal_emu::KernelRegistration KNORM_CONCAT(      \
      knorm_kernel_registration_, __COUNTER__)(host_name, &__VA_ARGS__);
