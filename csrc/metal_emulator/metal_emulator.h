// Header-only emulation of the part of the Metal execution model that the
// kernels in metal/ use, so that the very same .metal files compile as C++
// and run on a CPU. Every thread of a threadgroup is a real std::thread and
// every barrier is a real barrier: a kernel that misses a barrier, or whose
// barrier orders too little, reads stale data or races here as it may on a
// GPU, and ThreadSanitizer reports it (memory ordering, below).
//
// Modelled: the kernel signature (each parameter's [[buffer(i)]] or thread
// attribute, through KNORM_BUFFER and KNORM_ATTRIBUTE), half and bfloat with
// bit-exact conversions, threadgroup memory (declared in kernel scope only,
// filled with garbage so that reads of unwritten memory show, and made
// visible to other threads only by the barriers that order it, below),
// threadgroup_barrier and its mem_flags, SIMD groups of width 32
// (simd_shuffle, simd_shuffle_down, simd_prefix_inclusive_sum, simd_ballot),
// relaxed threadgroup atomics, uint2 and uint4 for moving raw bits
// (alignment checked), as_type, ctz, popcount, precise::sqrt. Threadgroups
// of a grid run one after another, reusing the same threads.
//
// Memory ordering. A threadgroup_barrier orders threadgroup memory only with
// mem_threadgroup and device memory only with mem_device:
//   - threadgroup memory: each thread works on a view of its own, and its
//     writes reach the other threads only through a barrier that orders
//     threadgroup memory. A read that a weaker barrier (or none) leaves
//     unordered sees stale data, so the results differ, and two threads that
//     change the same byte between two such barriers are a reported race.
//     Atomics act on the shared memory at once, as on a GPU.
//   - under ThreadSanitizer, threadgroup memory is shared instead and each
//     barrier that orders it erases its access history; only barriers that
//     order device memory order device memory; the threadgroups of a grid are
//     unordered; and the emulator's own synchronisation is hidden. So
//     ThreadSanitizer reports every pair of accesses, to either space, that
//     no barrier for that space orders. Without it, device memory is ordered
//     by every barrier.
//
// The binding is checked before a dispatch: the launch must bind exactly the
// [[buffer(i)]] the kernel declares, each with the access (input, output or
// constant) and element type of its parameter.
//
// Include this header, then the .metal files, in a translation unit that
// includes nothing else: the qualifier macros below would break other code.
#pragma once

#include <array>
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
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <sys/mman.h>

#include "metal_emulator/dispatch.h"

#if defined(__SANITIZE_THREAD__)
#define METAL_EMU_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define METAL_EMU_TSAN 1
#endif
#endif

#ifdef METAL_EMU_TSAN
// ThreadSanitizer's annotation interface (its runtime defines these).
extern "C" {
void AnnotateIgnoreSyncBegin(const char* file, int line);
void AnnotateIgnoreSyncEnd(const char* file, int line);
void __tsan_ignore_thread_begin();
void __tsan_ignore_thread_end();
void __tsan_acquire(void* address);
void __tsan_release(void* address);
}
#endif

namespace metal {
struct half;
struct bfloat;
} // namespace metal

namespace metal_emu {

#ifdef METAL_EMU_TSAN
constexpr bool kThreadSanitizer = true;
#else
constexpr bool kThreadSanitizer = false;
#endif

// ------------------------------------------------------ ThreadSanitizer --

// Hides what the emulator itself does in its scope (its locks, its
// bookkeeping) from ThreadSanitizer, so that only the kernel's barriers order
// the kernel's memory accesses. Nothing without ThreadSanitizer.
class HiddenFromTsan {
 public:
#ifdef METAL_EMU_TSAN
  HiddenFromTsan() {
    AnnotateIgnoreSyncBegin(__FILE__, __LINE__);
    __tsan_ignore_thread_begin();
  }
  ~HiddenFromTsan() {
    __tsan_ignore_thread_end();
    AnnotateIgnoreSyncEnd(__FILE__, __LINE__);
  }
#else
  // User-provided, so that a scope's unused instance draws no warning.
  HiddenFromTsan() {}
  ~HiddenFromTsan() {}
#endif
  HiddenFromTsan(const HiddenFromTsan&) = delete;
  HiddenFromTsan& operator=(const HiddenFromTsan&) = delete;
};

// Under ThreadSanitizer, a happens-before edge from every thread's release
// of `order` to every later acquire of it; nothing without.
inline void tsan_release(void* order) {
#ifdef METAL_EMU_TSAN
  __tsan_release(order);
#else
  (void)order;
#endif
}

inline void tsan_acquire(void* order) {
#ifdef METAL_EMU_TSAN
  __tsan_acquire(order);
#else
  (void)order;
#endif
}

// ---------------------------------------------------------------- barrier --

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
    abandoned_ = false;
  }

  // The last thread to arrive runs `complete` before any thread returns.
  // False when the barrier was abandoned before all participants arrived.
  template <typename Complete>
  bool arrive_and_wait(unsigned kind, Complete&& complete) {
    HiddenFromTsan hidden;
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t generation = generation_;
    if (abandoned_) {
      return false;
    }
    if (arrived_ == 0) {
      kind_ = kind;
    } else if (kind != kind_) {
      diverged_ = true;
    }
    if (++arrived_ == expected_) {
      complete();
      release();
    } else {
      cv_.wait(lock, [&] { return generation_ != generation || abandoned_; });
    }
    return generation_ != generation;
  }

  // Wakes the waiting threads, and fails every later wait, without a release:
  // for participants that will never arrive.
  void abandon() {
    HiddenFromTsan hidden;
    std::lock_guard<std::mutex> lock(mutex_);
    abandoned_ = true;
    cv_.notify_all();
  }

  bool arrive_and_wait() {
    return arrive_and_wait(0, [] {});
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
  unsigned kind_ = 0;
  bool diverged_ = false;
  bool abandoned_ = false;
};

constexpr uint32_t kSimdWidth = 32;
// Apple GPUs give a threadgroup at most 32 KiB of threadgroup memory.
constexpr size_t kThreadgroupMemoryBytes = 32 * 1024;

// The bits of metal::mem_flags.
constexpr unsigned kOrdersDevice = 1;
constexpr unsigned kOrdersThreadgroup = 2;

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

  // Read once every thread has been joined.
  const std::string& first() const {
    return error_;
  }

 private:
  const std::string kernel_;
  std::mutex mutex_;
  std::string error_;
};

// ------------------------------------------------------ threadgroup memory --

// A byte two threads changed between two barriers that order threadgroup
// memory.
struct WriteConflict {
  size_t byte;
  uint32_t other_thread;
};

// The threadgroup memory of one threadgroup, as described at the top of this
// file: the shared memory, on pages of its own. Without ThreadSanitizer
// also its state at the last barrier that ordered it (the baseline, which
// every view equals after that barrier), one view per thread, and per byte
// the last thread that published a change to it and when.
class ThreadgroupMemory {
 public:
  explicit ThreadgroupMemory(uint32_t group_size) : shared_(map_pages(nullptr)) {
    if constexpr (!kThreadSanitizer) {
      views_ = std::make_unique_for_overwrite<unsigned char[]>(
          size_t(group_size) * kThreadgroupMemoryBytes);
      writers_ = std::make_unique<uint64_t[]>(kThreadgroupMemoryBytes);
    }
  }

  ~ThreadgroupMemory() {
    munmap(shared_, kThreadgroupMemoryBytes);
  }

  ThreadgroupMemory(const ThreadgroupMemory&) = delete;
  ThreadgroupMemory& operator=(const ThreadgroupMemory&) = delete;

  // Thread 0, every other thread waiting. Threadgroup memory starts
  // undefined on a GPU: a pattern that is a NaN as float and huge as uint.
  void start_group() {
    std::memset(shared_, 0xFF, kThreadgroupMemoryBytes);
    if constexpr (kThreadSanitizer) {
      forget_accesses();
    } else {
      std::memcpy(baseline_, shared_, kThreadgroupMemoryBytes);
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
      for (size_t w = 0; w < kThreadgroupMemoryBytes; w += kWord) {
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

  // Where an atomic on `p` acts: the shared memory, for a location in
  // `thread`'s view.
  volatile void* shared_location(uint32_t thread, volatile void* p) {
    if constexpr (!kThreadSanitizer) {
      auto* byte = const_cast<unsigned char*>(static_cast<volatile unsigned char*>(p));
      unsigned char* view = view_of(thread);
      if (byte >= view && byte < view + kThreadgroupMemoryBytes) {
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
    return views_.get() + size_t(thread) * kThreadgroupMemoryBytes;
  }

  static unsigned char* map_pages(void* at) {
    void* p = mmap(at, kThreadgroupMemoryBytes, PROT_READ | PROT_WRITE,
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
    std::memcpy(baseline_, shared_, kThreadgroupMemoryBytes);
    map_pages(shared_);
    std::memcpy(shared_, baseline_, kThreadgroupMemoryBytes);
  }

  unsigned char* const shared_;
  alignas(64) unsigned char baseline_[kThreadgroupMemoryBytes];
  std::unique_ptr<unsigned char[]> views_;
  // Per byte: epoch << 16 | (thread + 1) of its last published change.
  std::unique_ptr<uint64_t[]> writers_;
  // Barriers that ordered threadgroup memory so far, from 1.
  uint64_t epoch_ = 1;
  // The word ranges [begin, end) that the last such barrier changed.
  std::vector<std::pair<size_t, size_t>> changed_;
};

// ---------------------------------------------------------------- threads --

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
  if (offset + count * sizeof(T) > kThreadgroupMemoryBytes) {
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

// ------------------------------------------------------ kernel signatures --

// What KNORM_BUFFER(i) and KNORM_ATTRIBUTE(name) (end of this file) add after
// each kernel parameter: an unnamed parameter whose type says what the
// parameter is bound to.
template <uint32_t I>
struct buffer_index {};

enum class ThreadAttribute {
  threadgroup_position_in_grid,
  thread_position_in_threadgroup,
  thread_index_in_simdgroup,
  simdgroup_index_in_threadgroup,
};

template <ThreadAttribute A>
struct thread_attribute {};

template <typename T>
struct is_signature_tag : std::false_type {};
template <uint32_t I>
struct is_signature_tag<buffer_index<I>> : std::true_type {};
template <ThreadAttribute A>
struct is_signature_tag<thread_attribute<A>> : std::true_type {};

struct ThreadPosition {
  uint32_t group;
  uint32_t thread;
  uint32_t lane;
  uint32_t simd_group;

  uint32_t operator[](ThreadAttribute a) const {
    switch (a) {
      case ThreadAttribute::threadgroup_position_in_grid:
        return group;
      case ThreadAttribute::thread_position_in_threadgroup:
        return thread;
      case ThreadAttribute::thread_index_in_simdgroup:
        return lane;
      case ThreadAttribute::simdgroup_index_in_threadgroup:
        return simd_group;
    }
    return 0;
  }
};

// MLX's names (common/dtype.h) of the element types a buffer may hold.
template <typename T>
constexpr const char* dtype_name() {
  if constexpr (std::is_same_v<T, metal::half>) {
    return "float16";
  } else if constexpr (std::is_same_v<T, metal::bfloat>) {
    return "bfloat16";
  } else if constexpr (std::is_same_v<T, float>) {
    return "float32";
  } else if constexpr (std::is_same_v<T, uint32_t>) {
    return "uint32";
  } else if constexpr (std::is_same_v<T, int32_t>) {
    return "int32";
  } else {
    static_assert(!std::is_same_v<T, T>, "no MLX dtype for this buffer element type");
  }
}

// A kernel parameter declared [[buffer(index)]].
struct BufferParameter {
  uint32_t index;
  const char* dtype;
  bool writable;      // device T*, not const
  bool by_reference;  // constant T&

  std::string describe() const {
    const std::string element = std::string(writable ? "" : "const ") + dtype;
    return by_reference ? (writable ? "device " : "constant ") + std::string(dtype) + "&"
                        : "device " + element + "*";
  }
};

template <typename Param, uint32_t I>
constexpr BufferParameter buffer_parameter(buffer_index<I>) {
  static_assert(std::is_pointer_v<Param> || std::is_reference_v<Param>,
                "a [[buffer(i)]] parameter is a pointer or a reference");
  using Pointee = std::conditional_t<
      std::is_pointer_v<Param>, std::remove_pointer_t<Param>, std::remove_reference_t<Param>>;
  using Element = std::remove_cv_t<Pointee>;
  return {I, dtype_name<Element>(), !std::is_const_v<Pointee>, std::is_reference_v<Param>};
}

// The function type of a kernel: parameter, tag, parameter, tag, ...
template <typename... Args>
struct Signature {
  static_assert(sizeof...(Args) % 2 == 0,
                "every kernel parameter takes KNORM_BUFFER(i) or KNORM_ATTRIBUTE(name)");
  using Types = std::tuple<Args...>;
  static constexpr size_t n_params = sizeof...(Args) / 2;
  template <size_t K>
  using Param = std::tuple_element_t<2 * K, Types>;
  template <size_t K>
  using Tag = std::tuple_element_t<2 * K + 1, Types>;

  template <size_t... K>
  static constexpr bool tagged(std::index_sequence<K...>) {
    return ((!is_signature_tag<Param<K>>::value && is_signature_tag<Tag<K>>::value) && ...);
  }

  // Tags as numbers: buffer indices, then thread attributes from 1 << 16.
  template <uint32_t I>
  static constexpr uint32_t tag_number(buffer_index<I>) {
    return I;
  }
  template <ThreadAttribute A>
  static constexpr uint32_t tag_number(thread_attribute<A>) {
    return (1u << 16) + static_cast<uint32_t>(A);
  }

  template <size_t... K>
  static constexpr bool distinct(std::index_sequence<K...>) {
    const std::array<uint32_t, n_params> tags = {tag_number(Tag<K>{})...};
    for (size_t i = 0; i < n_params; ++i) {
      for (size_t j = i + 1; j < n_params; ++j) {
        if (tags[i] == tags[j]) {
          return false;
        }
      }
    }
    return true;
  }

  template <size_t... K>
  static std::vector<BufferParameter> buffers(std::index_sequence<K...>) {
    std::vector<BufferParameter> out;
    (add_buffer<Param<K>>(out, Tag<K>{}), ...);
    return out;
  }

  template <typename P, uint32_t I>
  static void add_buffer(std::vector<BufferParameter>& out, buffer_index<I> tag) {
    out.push_back(buffer_parameter<P>(tag));
  }
  template <typename P, ThreadAttribute A>
  static void add_buffer(std::vector<BufferParameter>&, thread_attribute<A>) {}
};

template <typename Param, uint32_t I>
Param bind_argument(buffer_index<I>, const std::vector<mlx_knorm::EmulatedBuffer>& buffers, const ThreadPosition&) {
  if constexpr (std::is_pointer_v<Param>) {
    return static_cast<Param>(buffers[I].data);
  } else {
    return *static_cast<std::remove_reference_t<Param>*>(buffers[I].data);
  }
}

template <typename Param, ThreadAttribute A>
Param bind_argument(thread_attribute<A>, const std::vector<mlx_knorm::EmulatedBuffer>&, const ThreadPosition& position) {
  static_assert(std::is_same_v<Param, uint32_t>, "thread attributes are taken as uint");
  return position[A];
}

// Argument J of the kernel call: parameter J / 2, or its tag.
template <size_t J, typename... Args>
decltype(auto) kernel_argument(const std::vector<mlx_knorm::EmulatedBuffer>& buffers, const ThreadPosition& position) {
  using S = Signature<Args...>;
  using Tag = typename S::template Tag<J / 2>;
  if constexpr (J % 2 == 1) {
    return Tag{};
  } else {
    return bind_argument<typename S::template Param<J / 2>>(Tag{}, buffers, position);
  }
}

template <typename... Args, size_t... J>
void call_kernel(
    void (*fn)(Args...),
    const std::vector<mlx_knorm::EmulatedBuffer>& buffers,
    const ThreadPosition& position,
    std::index_sequence<J...>) {
  fn(kernel_argument<J, Args...>(buffers, position)...);
}

// -------------------------------------------------------- kernel registry --

using Invoker = std::function<void(const std::vector<mlx_knorm::EmulatedBuffer>&, const ThreadPosition&)>;

struct RegisteredKernel {
  std::string function;                  // the kernel function's name
  std::vector<BufferParameter> buffers;  // its [[buffer(i)]] parameters
  Invoker invoke;
};

inline std::map<std::string, RegisteredKernel>& kernel_registry() {
  static std::map<std::string, RegisteredKernel> registry;
  return registry;
}

struct KernelRegistration {
  // `instance` is the instantiation as written, "name<T, ...>".
  template <typename... Args>
  KernelRegistration(const char* host_name, const char* instance, void (*fn)(Args...)) {
    using S = Signature<Args...>;
    constexpr auto params = std::make_index_sequence<S::n_params>();
    static_assert(S::tagged(params),
                  "every kernel parameter takes KNORM_BUFFER(i) or KNORM_ATTRIBUTE(name)");
    static_assert(S::distinct(params),
                  "two kernel parameters take the same [[buffer(i)]] or thread attribute");
    std::string function(instance);
    function = function.substr(0, function.find_first_of("< "));
    kernel_registry()[host_name] = RegisteredKernel{
        function, S::buffers(params),
        [fn](const std::vector<mlx_knorm::EmulatedBuffer>& buffers, const ThreadPosition& position) {
          call_kernel(fn, buffers, position, std::make_index_sequence<sizeof...(Args)>());
        }};
  }
};

// ---------------------------------------------------------------- binding --

inline std::string describe(const mlx_knorm::EmulatedBuffer& b) {
  using Access = mlx_knorm::EmulatedBuffer::Access;
  switch (b.access) {
    case Access::Read:
      return "an input " + b.dtype + " array";
    case Access::Write:
      return "an output " + b.dtype + " array";
    case Access::Constant:
      return "a " + b.dtype + " constant";
  }
  return "";
}

// Whether what the launch binds fits the parameter: an input is read
// through a pointer to const, an output written through a pointer, a
// constant taken by constant reference, all of the parameter's element type.
inline bool fits(const BufferParameter& p, const mlx_knorm::EmulatedBuffer& b) {
  using Access = mlx_knorm::EmulatedBuffer::Access;
  if (b.dtype != p.dtype) {
    return false;
  }
  switch (b.access) {
    case Access::Read:
      return !p.by_reference && !p.writable;
    case Access::Write:
      return !p.by_reference && p.writable;
    case Access::Constant:
      return p.by_reference && !p.writable;
  }
  return false;
}

// Throws unless the launch binds exactly the kernel's [[buffer(i)]], each
// as its parameter takes it.
inline void check_binding(
    const std::string& kernel,
    const RegisteredKernel& k,
    const std::vector<mlx_knorm::EmulatedBuffer>& buffers) {
  const std::string prefix = "metal emulator: " + kernel + " ";
  std::vector<bool> declared(buffers.size(), false);
  for (const BufferParameter& p : k.buffers) {
    const std::string slot = "[[buffer(" + std::to_string(p.index) + ")]]";
    if (p.index >= buffers.size()) {
      throw std::runtime_error(
          prefix + "takes " + p.describe() + " at " + slot + ", which the launch does not bind");
    }
    declared[p.index] = true;
    if (!fits(p, buffers[p.index])) {
      throw std::runtime_error(
          prefix + "takes " + p.describe() + " at " + slot + ", where the launch binds " +
          describe(buffers[p.index]));
    }
  }
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (!declared[i]) {
      throw std::runtime_error(
          prefix + "declares no [[buffer(" + std::to_string(i) + ")]], where the launch binds " +
          describe(buffers[i]));
    }
  }
}

// ------------------------------------------------------------------ grid --

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

enum class mem_flags {
  mem_none = 0,
  mem_device = metal_emu::kOrdersDevice,
  mem_threadgroup = metal_emu::kOrdersThreadgroup,
};

inline mem_flags operator|(mem_flags a, mem_flags b) {
  return static_cast<mem_flags>(static_cast<int>(a) | static_cast<int>(b));
}

// A real barrier over the whole threadgroup that orders the memory its
// flags name (top of this file).
inline void threadgroup_barrier(mem_flags flags) {
  metal_emu::threadgroup_barrier(*metal_emu::current_thread(), static_cast<unsigned>(flags));
}

namespace detail {

// Each lane publishes v, all 32 lanes meet, read what they need, and meet
// again so that the slots can be reused by the next SIMD function. Orders no
// memory of the kernel's.
template <typename T, typename F>
T simd_exchange(T v, F&& read) {
  static_assert(sizeof(T) <= 16, "SIMD exchange slots hold 16 bytes");
  metal_emu::HiddenFromTsan hidden;
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

// Threadgroup atomics, on the shared threadgroup memory whatever the view of
// the calling thread. Only relaxed ordering is used by the kernels; the
// barriers around them provide the ordering.
struct atomic_uint {
  uint v;
};

enum memory_order { memory_order_relaxed };

namespace detail {

inline volatile uint* atomic_word(volatile atomic_uint* a) {
  metal_emu::ThreadContext* t = metal_emu::current_thread();
  return &static_cast<volatile atomic_uint*>(
              t->group->memory.shared_location(t->thread, a))->v;
}

} // namespace detail

inline void atomic_store_explicit(volatile atomic_uint* a, uint value, memory_order) {
  __atomic_store_n(detail::atomic_word(a), value, __ATOMIC_RELAXED);
}

inline uint atomic_load_explicit(volatile atomic_uint* a, memory_order) {
  return __atomic_load_n(detail::atomic_word(a), __ATOMIC_RELAXED);
}

inline uint atomic_fetch_add_explicit(volatile atomic_uint* a, uint value, memory_order) {
  return __atomic_fetch_add(detail::atomic_word(a), value, __ATOMIC_RELAXED);
}

} // namespace metal

// Tells metal/knorm_defines.h that the kernels compile against this
// emulator.
#define KNORM_METAL_EMULATOR 1

// Address spaces. Device and constant memory are the host's memory;
// threadgroup pointers are volatile ones (the one qualifier C++ has to
// spare), so that threadgroup memory passed where a device pointer is
// expected fails to compile, as in Metal.
#define kernel
#define device
#define constant const
#define threadgroup volatile

// Project macros that metal/knorm_defines.h defines differently for the
// Metal compiler. The signature macros add the tag parameters that the
// registration reads (metal_emu::Signature).
#define KNORM_BUFFER(index) , ::metal_emu::buffer_index<index>
#define KNORM_ATTRIBUTE(name) \
  , ::metal_emu::thread_attribute<::metal_emu::ThreadAttribute::name>
#define KNORM_THREADGROUP_ARRAY(type, name, count) \
  threadgroup type* name = ::metal_emu::threadgroup_array<type>(count, __func__)
#define KNORM_CONCAT_(a, b) a##b
#define KNORM_CONCAT(a, b) KNORM_CONCAT_(a, b)
#define KNORM_KERNEL_INSTANCE(host_name, ...)                      \
  static const ::metal_emu::KernelRegistration KNORM_CONCAT(      \
      knorm_kernel_registration_, __COUNTER__)(host_name, #__VA_ARGS__, &__VA_ARGS__);
