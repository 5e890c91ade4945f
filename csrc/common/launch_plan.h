// Launch plans of the Metal kernels in metal/: everything a dispatch needs,
// computed from shapes (and, for how rows move, the arrays' offsets) and
// free of Metal types. Each op builds its plan in its plan.cpp; eval_gpu
// (common/metal_dispatch.cpp) and the emulator (metal_emulator/run_plan.cpp)
// both bind it through bind_slots below, so the kernels are launched
// identically on a GPU and in the emulator.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/array.h"

#include "metal/knorm_defines.h"

namespace mlx_knorm {

// What is bound at [[buffer(i)]]: a primitive input, a primitive output, a
// primitive output that an earlier dispatch of the same evaluation wrote and
// this one reads (EarlierOutput), or a uint constant. An array without
// elements has no Metal buffer (MLX's allocator returns none for zero
// bytes), and a kernel argument left without a binding fails Metal's API
// validation, so an empty array's slot is marked and bound to a placeholder
// instead; the kernel reads no element of it.
struct BufferSlot {
  enum class Kind { Input, Output, EarlierOutput, Constant };
  Kind kind;
  int array;       // index into inputs or outputs
  uint32_t value;  // for Kind::Constant
  bool empty;      // for array slots: the array has no elements

  static BufferSlot constant(uint32_t v) {
    return {Kind::Constant, -1, v, false};
  }
  // Array `i` of `arrays` (the primitive's inputs or outputs, as `kind` says).
  static BufferSlot of(Kind kind, const std::vector<mlx::core::array>& arrays, int i) {
    return {kind, i, 0, arrays.at(i).size() == 0};
  }
};

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

// The unit, in bytes, in which a kernel moves rows of `row_elements`
// elements between `arrays` (one dtype): kRowUnitWide or kRowUnitNarrow
// (metal/knorm_defines.h) when it divides the row width and every array's
// offset, else the element's size. A kernel sees an array at the start of
// its MLX buffer, which a GPU aligns to more than 16 bytes, plus the
// array's offset (the emulator binds it the same way). Empty arrays are
// never read.
inline uint32_t row_unit(
    std::initializer_list<const mlx::core::array*> arrays,
    int64_t row_elements) {
  const size_t element = (*arrays.begin())->itemsize();
  for (const uint32_t unit : {kRowUnitWide, kRowUnitNarrow}) {
    bool fits = row_elements * element % unit == 0;
    for (const mlx::core::array* a : arrays) {
      fits = fits && (a->size() == 0 || a->offset() % unit == 0);
    }
    if (fits) {
      return unit;
    }
  }
  return static_cast<uint32_t>(element);
}

// Threadgroups per head of the second dispatch of a split step, each
// copying kSplitRows of a head's `rows` (metal/knorm_defines.h); 0 when the
// step runs in one dispatch.
inline uint32_t split_blocks(int64_t n_heads, int64_t rows) {
  const int64_t blocks = (rows + kSplitRows - 1) / kSplitRows;
  const bool split = n_heads < kSplitHeads && rows > kSplitRows &&
      n_heads * blocks <= std::numeric_limits<uint32_t>::max();
  return split ? static_cast<uint32_t>(blocks) : 0;
}

struct LaunchPlan {
  std::string source;       // metal/<source>.metal instantiates the kernel
  std::string kernel;       // host name of the instantiation
  uint32_t groups;          // threadgroups along x; nothing to do when 0
  uint32_t group_size;      // threads per threadgroup along x
  std::vector<BufferSlot> buffers;  // slot i is [[buffer(i)]]
};

// The dispatches of one evaluation, in order: each sees what the ones
// before it wrote (MLX's encoder puts a memory barrier before a dispatch
// that binds a buffer an earlier one wrote, or writes one it read; the
// emulator runs them one after the other).
using LaunchPlans = std::vector<LaunchPlan>;

// Binds slot i of the plan as [[buffer(i)]] through `bind`, which has
// input(i, const array&), output(i, array&), earlier_output(i, const
// array&), constant(i, uint32_t) and placeholder(i, BufferSlot::Kind, const
// array&) for an array slot marked empty.
template <typename Binder>
void bind_slots(
    const LaunchPlan& plan,
    const std::vector<mlx::core::array>& inputs,
    std::vector<mlx::core::array>& outputs,
    Binder& bind) {
  for (size_t i = 0; i < plan.buffers.size(); ++i) {
    const BufferSlot& slot = plan.buffers[i];
    const int idx = static_cast<int>(i);
    switch (slot.kind) {
      case BufferSlot::Kind::Input:
        if (slot.empty) {
          bind.placeholder(idx, slot.kind, inputs.at(slot.array));
        } else {
          bind.input(idx, inputs.at(slot.array));
        }
        break;
      case BufferSlot::Kind::Output:
        if (slot.empty) {
          bind.placeholder(idx, slot.kind, outputs.at(slot.array));
        } else {
          bind.output(idx, outputs.at(slot.array));
        }
        break;
      case BufferSlot::Kind::EarlierOutput:
        if (slot.empty) {
          bind.placeholder(idx, slot.kind, outputs.at(slot.array));
        } else {
          bind.earlier_output(idx, outputs.at(slot.array));
        }
        break;
      case BufferSlot::Kind::Constant:
        bind.constant(idx, slot.value);
        break;
    }
  }
}

} // namespace mlx_knorm
