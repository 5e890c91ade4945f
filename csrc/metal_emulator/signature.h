// A kernel's signature as the emulator reads it (each parameter's
// [[buffer(i)]], [[threadgroup(i)]] or thread attribute, through the tags
// that KNORM_BUFFER, KNORM_THREADGROUP_BUFFER and KNORM_ATTRIBUTE add), how a call binds buffers and thread positions to
// the parameters, and the registry of instantiations by host name
// (KNORM_KERNEL_INSTANCE).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "metal_emulator/dispatch.h"
#include "metal_emulator/threads.h"

namespace metal {
struct emulated_half;
struct emulated_bfloat;
} // namespace metal

namespace metal_emu {

// What KNORM_BUFFER(i) and KNORM_ATTRIBUTE(name) (metal_emulator.h) add after
// each kernel parameter: an unnamed parameter whose type says what the
// parameter is bound to.
template <uint32_t I>
struct buffer_index {};

// What KNORM_THREADGROUP_BUFFER(i) adds: [[threadgroup(i)]].
template <uint32_t I>
struct threadgroup_index {};

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
template <uint32_t I>
struct is_signature_tag<threadgroup_index<I>> : std::true_type {};
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

// MLX's names (common/dtype.h) of the element types a buffer may hold;
// uint8 for raw bytes (uchar). A struct of uint32 fields (a block of
// constants, such as KnormEvictParams) is named uint32[n], as the host binds
// it (run_plan.cpp).
template <typename T>
std::string element_name() {
  if constexpr (std::is_same_v<T, metal::emulated_half>) {
    return "float16";
  } else if constexpr (std::is_same_v<T, metal::emulated_bfloat>) {
    return "bfloat16";
  } else if constexpr (std::is_same_v<T, float>) {
    return "float32";
  } else if constexpr (std::is_same_v<T, uint32_t>) {
    return "uint32";
  } else if constexpr (std::is_same_v<T, int32_t>) {
    return "int32";
  } else if constexpr (std::is_same_v<T, uint8_t>) {
    return "uint8";
  } else if constexpr (std::is_class_v<T>) {
    static_assert(std::is_trivially_copyable_v<T> && sizeof(T) % sizeof(uint32_t) == 0,
                  "a struct bound at a [[buffer(i)]] is a block of uint32 constants");
    return "uint32[" + std::to_string(sizeof(T) / sizeof(uint32_t)) + "]";
  } else {
    static_assert(!std::is_same_v<T, T>, "no MLX dtype for this buffer element type");
  }
}

// A kernel parameter declared [[threadgroup(index)]].
struct ThreadgroupParameter {
  uint32_t index;
};

// A kernel parameter declared [[buffer(index)]].
struct BufferParameter {
  uint32_t index;
  std::string dtype;
  bool writable;      // device T*, not const
  bool by_reference;  // constant T&

  std::string describe() const {
    const std::string element = std::string(writable ? "" : "const ") + dtype;
    return by_reference ? (writable ? "device " : "constant ") + dtype + "&"
                        : "device " + element + "*";
  }
};

template <typename Param, uint32_t I>
BufferParameter buffer_parameter(buffer_index<I>) {
  static_assert(std::is_pointer_v<Param> || std::is_reference_v<Param>,
                "a [[buffer(i)]] parameter is a pointer or a reference");
  using Pointee = std::conditional_t<
      std::is_pointer_v<Param>, std::remove_pointer_t<Param>, std::remove_reference_t<Param>>;
  using Element = std::remove_cv_t<Pointee>;
  return {I, element_name<Element>(), !std::is_const_v<Pointee>, std::is_reference_v<Param>};
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

  // Tags as numbers: buffer indices, thread attributes from 1 << 16,
  // threadgroup indices from 2 << 16.
  template <uint32_t I>
  static constexpr uint32_t tag_number(buffer_index<I>) {
    return I;
  }
  template <uint32_t I>
  static constexpr uint32_t tag_number(threadgroup_index<I>) {
    return (2u << 16) + I;
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
  template <typename P, uint32_t I>
  static void add_buffer(std::vector<BufferParameter>&, threadgroup_index<I>) {}

  template <size_t... K>
  static std::vector<ThreadgroupParameter> threadgroups(std::index_sequence<K...>) {
    std::vector<ThreadgroupParameter> out;
    (add_threadgroup<Param<K>>(out, Tag<K>{}), ...);
    return out;
  }

  template <typename P, typename Tag>
  static void add_threadgroup(std::vector<ThreadgroupParameter>&, Tag) {}
  template <typename P, uint32_t I>
  static void add_threadgroup(std::vector<ThreadgroupParameter>& out, threadgroup_index<I>) {
    static_assert(std::is_pointer_v<P> && std::is_volatile_v<std::remove_pointer_t<P>>,
                  "a [[threadgroup(i)]] parameter is a threadgroup pointer");
    static_assert(I < kMaxThreadgroupArguments, "more [[threadgroup(i)]] than the emulator holds");
    // Arguments start at multiples of 16 bytes (grid.h's layout).
    static_assert(alignof(std::remove_cv_t<std::remove_pointer_t<P>>) <= 16,
                  "[[threadgroup(i)]] elements aligned to at most 16 bytes");
    out.push_back({I});
  }
};

template <typename Param, uint32_t I>
Param bind_argument(buffer_index<I>, const std::vector<mlx_knorm::EmulatedBuffer>& buffers, const ThreadPosition&) {
  if constexpr (std::is_pointer_v<Param>) {
    return static_cast<Param>(buffers[I].data);
  } else {
    return *static_cast<std::remove_reference_t<Param>*>(buffers[I].data);
  }
}

// This thread's storage of the argument, which the dispatch declared
// (grid.h) before the kernel runs.
template <typename Param, uint32_t I>
Param bind_argument(threadgroup_index<I>, const std::vector<mlx_knorm::EmulatedBuffer>&, const ThreadPosition&) {
  return reinterpret_cast<Param>(current_thread()->threadgroup_arguments[I]);
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
  std::vector<ThreadgroupParameter> threadgroups;  // its [[threadgroup(i)]]
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
                  "two kernel parameters take the same [[buffer(i)]], [[threadgroup(i)]] or thread attribute");
    std::string function(instance);
    function = function.substr(0, function.find_first_of("< "));
    kernel_registry()[host_name] = RegisteredKernel{
        function, S::buffers(params), S::threadgroups(params),
        [fn](const std::vector<mlx_knorm::EmulatedBuffer>& buffers, const ThreadPosition& position) {
          call_kernel(fn, buffers, position, std::make_index_sequence<sizeof...(Args)>());
        }};
  }
};

} // namespace metal_emu
