// Launch plans of the Metal kernels in metal/: everything a dispatch needs,
// computed from shapes alone and free of Metal types. Each op builds its plan
// in its metal.cpp; eval_gpu (common/metal_dispatch.cpp) and the emulator
// (metal_emulator/run_plan.cpp) both bind it through bind_slots below, so
// the kernels are launched identically on a GPU and in the emulator.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/array.h"

namespace mlx_knorm {

// What is bound at [[buffer(i)]]: a primitive input, a primitive output, or
// a uint constant. An array without elements has no Metal buffer (MLX's
// allocator returns none for zero bytes), and a kernel argument left without
// a binding fails Metal's API validation, so an empty array's slot is marked
// and bound to a placeholder instead; the kernel reads no element of it.
struct BufferSlot {
  enum class Kind { Input, Output, Constant };
  Kind kind;
  int array;       // index into inputs or outputs
  uint32_t value;  // for Kind::Constant
  bool empty;      // for Input and Output: the array has no elements

  static BufferSlot constant(uint32_t v) {
    return {Kind::Constant, -1, v, false};
  }
};

// The slots of a kernel that takes the primitive's inputs, then its outputs,
// as its first buffers; constants follow.
inline std::vector<BufferSlot> array_slots(
    const std::vector<mlx::core::array>& inputs,
    const std::vector<mlx::core::array>& outputs) {
  std::vector<BufferSlot> slots;
  for (size_t i = 0; i < inputs.size(); ++i) {
    slots.push_back({BufferSlot::Kind::Input, static_cast<int>(i), 0, inputs[i].size() == 0});
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    slots.push_back({BufferSlot::Kind::Output, static_cast<int>(i), 0, outputs[i].size() == 0});
  }
  return slots;
}

struct LaunchPlan {
  std::string source;       // metal/<source>.metal holds the kernel
  std::string kernel;       // host name of the instantiation
  uint32_t groups;          // threadgroups along x; nothing to do when 0
  uint32_t group_size;      // threads per threadgroup along x
  std::vector<BufferSlot> buffers;  // slot i is [[buffer(i)]]
};

// Binds slot i of the plan as [[buffer(i)]] through `bind`, which has
// input(i, const array&), output(i, array&), constant(i, uint32_t) and
// placeholder(i, const array&) for an array slot marked empty.
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
          bind.placeholder(idx, inputs.at(slot.array));
        } else {
          bind.input(idx, inputs.at(slot.array));
        }
        break;
      case BufferSlot::Kind::Output:
        if (slot.empty) {
          bind.placeholder(idx, outputs.at(slot.array));
        } else {
          bind.output(idx, outputs.at(slot.array));
        }
        break;
      case BufferSlot::Kind::Constant:
        bind.constant(idx, slot.value);
        break;
    }
  }
}

} // namespace mlx_knorm
