// The Metal language surface the kernels in metal/ use, in namespace metal:
// half and bfloat with bit-exact conversions (emulated_half and
// emulated_bfloat: metal_emulator.h makes half and bfloat macros for them, so
// that, as in Metal, neither can name anything else), as_type, min, isnan,
// isinf, precise::sqrt and precise::divide, mem_flags and threadgroup_barrier, the SIMD-group
// functions, ctz and popcount, uchar, uint2 and uint4 (alignment checked), and
// relaxed threadgroup atomics.
#pragma once

#include <cfloat>  // FLT_MIN, as Metal defines it
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "metal_emulator/barrier.h"
#include "metal_emulator/errors.h"
#include "metal_emulator/threads.h"
#include "metal_emulator/tsan.h"

namespace metal {

using uint = uint32_t;
using uchar = uint8_t;
using ushort = uint16_t;
using ulong = uint64_t;

// IEEE binary16, stored as its bits; conversions are exact (to float) and
// round to nearest even (from float), like the GPU's.
struct emulated_half {
  uint16_t bits;

  emulated_half() = default;
  explicit emulated_half(float f) : bits(from_float(f)) {}
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
struct emulated_bfloat {
  uint16_t bits;

  emulated_bfloat() = default;
  explicit emulated_bfloat(float f) {
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

inline bool isinf(float x) {
  return std::isinf(x);
}

namespace precise {
// std::sqrt and IEEE division are correctly rounded, as precise::sqrt and
// precise::divide are.
inline float sqrt(float x) {
  return std::sqrt(x);
}

inline float divide(float x, float y) {
  return x / y;
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
// flags name (metal_emulator.h).
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
