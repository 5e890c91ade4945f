// Launch plans of the Metal kernels in metal/: everything a dispatch needs,
// computed from shapes (and, for how rows move, the arrays' offsets) and
// free of Metal types. Each op builds its plan in its plan.cpp; eval_gpu
// (common/metal_dispatch.cpp) and the emulator (metal_emulator/run_plan.cpp)
// both bind it through bind_slots below, so the kernels are launched
// identically on a GPU and in the emulator.
#pragma once

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"

#include "common/dtype.h"
#include "metal/knorm_defines.h"

namespace mlx_knorm {

// What is bound at [[buffer(i)]]: a primitive input, a primitive output, a
// primitive output that an earlier dispatch of the same evaluation wrote and
// this one reads (EarlierOutput), scratch memory the evaluation's dispatches
// share (Scratch: `array` indexes the plans' scratch buffers, LaunchPlan::
// scratch), a uint constant, or a block of constants
// (a struct of uint32 fields, such as metal/knorm_defines.h's
// KnormEvictParams). An array without elements has no Metal buffer (MLX's
// allocator returns none for zero bytes), and a kernel argument left without
// a binding fails Metal's API validation, so an empty array's slot is marked
// and bound to a placeholder instead; the kernel reads no element of it. So
// is a slot the kernel declares but this launch has no array for (an unused
// payload, absent optional inputs).
struct BufferSlot {
  enum class Kind { Input, Output, EarlierOutput, Scratch, Constant, Block };
  Kind kind = Kind::Constant;
  int array = -1;      // index into inputs or outputs; -1 for an unused slot
  uint32_t value = 0;  // for Kind::Constant
  bool empty = false;  // for array slots: the array has no elements, or there is none
  // The kernel reads and writes the array as raw bytes (uchar): a payload of
  // any dtype, moved as its bits.
  bool raw = false;
  // The element type the kernel declares at an unused slot.
  mlx::core::Dtype unused_element = mlx::core::uint8;
  std::vector<uint32_t> words;  // for Kind::Block

  static BufferSlot constant(uint32_t v) {
    BufferSlot slot;
    slot.value = v;
    return slot;
  }
  // Array `i` of `arrays` (the primitive's inputs or outputs, as `kind` says).
  static BufferSlot of(Kind kind, const std::vector<mlx::core::array>& arrays, int i) {
    BufferSlot slot;
    slot.kind = kind;
    slot.array = i;
    slot.empty = arrays.at(i).size() == 0;
    return slot;
  }
  // Scratch buffer `k` of the evaluation, read and written as raw bytes.
  static BufferSlot scratch(int k) {
    BufferSlot slot;
    slot.kind = Kind::Scratch;
    slot.array = k;
    slot.raw = true;
    return slot;
  }
  // The same, read or written as raw bytes.
  static BufferSlot bytes_of(Kind kind, const std::vector<mlx::core::array>& arrays, int i) {
    BufferSlot slot = of(kind, arrays, i);
    slot.raw = true;
    return slot;
  }
  // A slot of `kind` with no array, whose parameter has elements of
  // `element` (uint8 for raw bytes).
  static BufferSlot unused(Kind kind, mlx::core::Dtype element) {
    BufferSlot slot;
    slot.kind = kind;
    slot.empty = true;
    slot.unused_element = element;
    return slot;
  }
  template <typename Params>
  static BufferSlot block(const Params& params) {
    static_assert(std::is_trivially_copyable_v<Params> && sizeof(Params) % sizeof(uint32_t) == 0,
                  "a block of constants is a struct of uint32 fields");
    BufferSlot slot;
    slot.kind = Kind::Block;
    slot.words.resize(sizeof(Params) / sizeof(uint32_t));
    std::memcpy(slot.words.data(), &params, sizeof(Params));
    return slot;
  }
};

// MLX's name (common/dtype.h) of the elements a kernel's parameter at an
// array slot has: the array's dtype, or uint8 for raw bytes.
inline std::string slot_element(const BufferSlot& slot, const mlx::core::array* a) {
  if (slot.raw) {
    return dtype_name(mlx::core::uint8);
  }
  return dtype_name(a != nullptr ? a->dtype() : slot.unused_element);
}

// Bit i set: output i shares input i's buffer, for i < count (it took over
// a donated input; the kernel then moves only the rows that change).
inline uint32_t in_place_mask(
    const std::vector<mlx::core::array>& inputs,
    const std::vector<mlx::core::array>& outputs,
    int count) {
  uint32_t mask = 0;
  for (int i = 0; i < count; ++i) {
    if (outputs[i].data<char>() == inputs[i].data<char>()) {
      mask |= 1u << i;
    }
  }
  return mask;
}

// The slots of a kernel that takes the primitive's inputs, then its outputs,
// as its first buffers; constants follow.
inline std::vector<BufferSlot> array_slots(
    const std::vector<mlx::core::array>& inputs,
    const std::vector<mlx::core::array>& outputs) {
  std::vector<BufferSlot> slots;
  for (size_t i = 0; i < inputs.size(); ++i) {
    slots.push_back(BufferSlot::of(BufferSlot::Kind::Input, inputs, static_cast<int>(i)));
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    slots.push_back(BufferSlot::of(BufferSlot::Kind::Output, outputs, static_cast<int>(i)));
  }
  return slots;
}

// The unit, in bytes, in which a kernel moves rows of `row_bytes` bytes
// between `arrays`: the largest of kRowUnitWide, kRowUnitNarrow, 4 and 2
// (metal/knorm_defines.h) that divides the row width and every array's
// offset, else 1. A kernel sees an array at the start of its MLX buffer,
// which a GPU aligns to more than 16 bytes, plus the array's offset (the
// emulator binds it the same way). Empty arrays are never read.
inline uint32_t row_unit_bytes(
    std::initializer_list<const mlx::core::array*> arrays,
    int64_t row_bytes) {
  for (const uint32_t unit : {kRowUnitWide, kRowUnitNarrow, 4u, 2u}) {
    bool fits = row_bytes % unit == 0;
    for (const mlx::core::array* a : arrays) {
      fits = fits && (a->size() == 0 || a->offset() % unit == 0);
    }
    if (fits) {
      return unit;
    }
  }
  return 1;
}

// row_unit_bytes for rows of `row_elements` elements of `arrays` (one
// dtype).
inline uint32_t row_unit(
    std::initializer_list<const mlx::core::array*> arrays,
    int64_t row_elements) {
  return row_unit_bytes(arrays, row_elements * static_cast<int64_t>((*arrays.begin())->itemsize()));
}

// Threadgroups per head of the second dispatch of a split step, each
// copying kSplitRows of a head's `rows` (metal/knorm_defines.h); 0 when the
// step runs in one dispatch, and without heads (nothing to split, and no
// scratch for a split to share).
inline uint32_t split_blocks(int64_t n_heads, int64_t rows) {
  const int64_t blocks = (rows + kSplitRows - 1) / kSplitRows;
  const bool split = n_heads > 0 && n_heads < kSplitHeads && rows > kSplitRows &&
      n_heads * blocks <= std::numeric_limits<uint32_t>::max();
  return split ? static_cast<uint32_t>(blocks) : 0;
}

// Squares each lane holds in knorm_row_norm (metal/knorm_kernels.h) for
// rows of `dim` elements: P / 32 for P, the next power of two >= D, and 1
// for D <= 32; a kernel that computes norms is instantiated per count and
// its host name ends in it.
inline uint32_t squares_per_lane(int64_t dim) {
  uint32_t width = 1;
  while (width < dim) {
    width <<= 1;
  }
  return width > kSimdWidth ? width / kSimdWidth : 1;
}

// The length to set for a [[threadgroup(i)]] argument whose dispatch uses
// `bytes` of it: rounded up to Metal's unit, and one unit where the
// dispatch uses none (the argument is declared all the same).
inline uint32_t threadgroup_length(uint64_t bytes) {
  const uint64_t units = (bytes + kThreadgroupLengthUnit - 1) / kThreadgroupLengthUnit;
  return static_cast<uint32_t>((units == 0 ? 1 : units) * kThreadgroupLengthUnit);
}

struct LaunchPlan {
  std::string source;       // metal/<source>.metal instantiates the kernel
  std::string kernel;       // host name of the instantiation
  uint32_t groups;          // threadgroups along x; nothing to do when 0
  uint32_t group_size;      // threads per threadgroup along x
  std::vector<BufferSlot> buffers;  // slot i is [[buffer(i)]]
  // Entry i: the bytes of [[threadgroup(i)]] (threadgroup_length), which
  // eval_gpu sets with setThreadgroupMemoryLength and the emulator gives
  // the kernel, no more.
  std::vector<uint32_t> threadgroup_bytes;
  // Bytes of the scratch buffers this dispatch and later ones of the
  // evaluation use, each a multiple of kRowUnitWide: device memory no output
  // holds, allocated before the first dispatch and released after the
  // last (scratch_buffers). Kind::Scratch slot k binds the k-th entry of
  // the plans' lists in order.
  std::vector<uint64_t> scratch;
};

// What a GPU reports of the pipeline compiled from a plan's kernel
// (MTL::ComputePipelineState), and what the emulator models.
struct PipelineLimits {
  uint64_t max_threads;      // maxTotalThreadsPerThreadgroup()
  uint64_t execution_width;  // threadExecutionWidth(): lanes of a SIMD group
};

// The pipeline the emulator models for every kernel: an Apple GPU's.
inline constexpr PipelineLimits kEmulatedPipeline = {1024, kSimdWidth};

// The kernels index threads by the plan's fixed group size, and their scans,
// ballots and shuffles assume SIMD groups of kSimdWidth lanes (a ballot's
// lanes are the bits of one uint; a SIMD group's leader is lane 31): a
// pipeline that runs fewer threads per threadgroup, or SIMD groups of
// another width, would give wrong results, so it is refused before anything
// is encoded.
inline void check_pipeline(const LaunchPlan& plan, const PipelineLimits& limits) {
  if (limits.execution_width != kSimdWidth) {
    throw std::runtime_error(
        "mlx_knorm: the Metal kernel " + plan.kernel + " needs SIMD groups of " +
        std::to_string(kSimdWidth) + " lanes; this GPU runs it with " +
        std::to_string(limits.execution_width) + " (threadExecutionWidth; use the fallback backend)");
  }
  if (plan.group_size > limits.max_threads) {
    throw std::runtime_error(
        "mlx_knorm: the Metal kernel " + plan.kernel + " needs threadgroups of " +
        std::to_string(plan.group_size) + " threads; this GPU runs it with at most " +
        std::to_string(limits.max_threads) + " (use the fallback backend)");
  }
}

// The dispatches of one evaluation, in order: each sees what the ones
// before it wrote (MLX's encoder puts a memory barrier before a dispatch
// that binds a buffer an earlier one wrote, or writes one it read; the
// emulator runs them one after the other).
using LaunchPlans = std::vector<LaunchPlan>;

// Scratch memory is laid out in kRowUnitWide-byte units, at most
// kMaxScratchUnits of them in one buffer (an int32 row count of
// scratch_buffers' array, so every offset in units fits a uint32).
constexpr uint64_t kMaxScratchUnits = static_cast<uint64_t>(std::numeric_limits<int32_t>::max());

inline uint64_t scratch_units(uint64_t bytes) {
  return (bytes + kRowUnitWide - 1) / kRowUnitWide;
}

// The largest buffer the device allocates (MTLDevice.maxBufferLength on a
// GPU): a plan takes a path that needs scratch only where the scratch fits
// it, and otherwise the path that needs none (one threadgroup per head). The
// emulator's stands for a large Apple GPU's; tests lower it
// (_emulator_debug).
constexpr uint64_t kEmulatedMaxBufferBytes = uint64_t(32) << 30;

inline bool scratch_fits(uint64_t units, uint64_t max_buffer_bytes) {
  return units <= kMaxScratchUnits && units <= max_buffer_bytes / kRowUnitWide;
}

// The scratch buffers of `plans`, uninitialised, as uint8 arrays of
// kRowUnitWide columns (their bytes need not fit an int32 shape).
inline std::vector<mlx::core::array> scratch_buffers(const std::vector<LaunchPlan>& plans) {
  std::vector<mlx::core::array> buffers;
  for (const LaunchPlan& plan : plans) {
    for (const uint64_t bytes : plan.scratch) {
      if (bytes == 0 || bytes % kRowUnitWide != 0 || bytes / kRowUnitWide > kMaxScratchUnits) {
        throw std::logic_error("mlx_knorm: the launch plan of " + plan.kernel +
                               " asks for scratch of " + std::to_string(bytes) + " bytes");
      }
      mlx::core::array a({static_cast<int32_t>(bytes / kRowUnitWide), static_cast<int32_t>(kRowUnitWide)},
                         mlx::core::uint8, nullptr, {});
      a.set_data(mlx::core::allocator::malloc(a.nbytes()));
      buffers.push_back(std::move(a));
    }
  }
  return buffers;
}

// Binds slot i of the plan as [[buffer(i)]] through `bind`, which has
// input(i, const array&, element), output(i, array&, element) (also for
// scratch buffer k, scratch[k]),
// earlier_output(i, const array&, element), constant(i, uint32_t),
// block(i, const std::vector<uint32_t>&) and placeholder(i,
// BufferSlot::Kind, const array*, element) for an array slot marked empty
// (the array, or null for an unused slot); `element` is slot_element's
// name of the kernel parameter's elements.
template <typename Binder>
void bind_slots(
    const LaunchPlan& plan,
    const std::vector<mlx::core::array>& inputs,
    std::vector<mlx::core::array>& outputs,
    std::vector<mlx::core::array>& scratch,
    Binder& bind) {
  for (size_t i = 0; i < plan.buffers.size(); ++i) {
    const BufferSlot& slot = plan.buffers[i];
    const int idx = static_cast<int>(i);
    // Read and written by the dispatches, as an output is.
    if (slot.kind == BufferSlot::Kind::Scratch) {
      mlx::core::array& a = scratch.at(slot.array);
      bind.output(idx, a, slot_element(slot, &a));
      continue;
    }
    if (slot.kind == BufferSlot::Kind::Constant) {
      bind.constant(idx, slot.value);
      continue;
    }
    if (slot.kind == BufferSlot::Kind::Block) {
      bind.block(idx, slot.words);
      continue;
    }
    const bool input = slot.kind == BufferSlot::Kind::Input;
    const std::vector<mlx::core::array>& arrays = input ? inputs : outputs;
    const mlx::core::array* a = slot.array < 0 ? nullptr : &arrays.at(slot.array);
    const std::string element = slot_element(slot, a);
    if (slot.empty) {
      bind.placeholder(idx, slot.kind, a, element);
      continue;
    }
    switch (slot.kind) {
      case BufferSlot::Kind::Input:
        bind.input(idx, *a, element);
        break;
      case BufferSlot::Kind::Output:
        bind.output(idx, outputs.at(slot.array), element);
        break;
      case BufferSlot::Kind::EarlierOutput:
        bind.earlier_output(idx, *a, element);
        break;
      default:
        break;
    }
  }
}

} // namespace mlx_knorm
