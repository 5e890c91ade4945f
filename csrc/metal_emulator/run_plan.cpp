#include "metal_emulator/run_plan.h"

#include <cstdint>

#include "common/dtype.h"
#include "metal_emulator/dispatch.h"

namespace mlx_knorm {

namespace mx = mlx::core;

namespace {

// Binds plan slots to the emulator's buffer table: [[buffer(i)]] is
// buffers[i], the array's data or the constant, with what the emulator
// checks against the kernel's signature.
struct EmulatorBinder {
  std::vector<EmulatedBuffer> buffers;
  // Constants need stable addresses for the duration of the dispatch.
  std::vector<uint32_t> constants;

  explicit EmulatorBinder(size_t n_slots) : buffers(n_slots), constants(n_slots) {}

  void input(int idx, const mx::array& a) {
    buffers[idx] = {const_cast<void*>(static_cast<const void*>(a.data<char>())), a.nbytes(),
                    dtype_name(a.dtype()), EmulatedBuffer::Access::Read};
  }
  void output(int idx, mx::array& a) {
    buffers[idx] = {a.data<char>(), a.nbytes(), dtype_name(a.dtype()),
                    EmulatedBuffer::Access::Write};
  }
  void constant(int idx, uint32_t value) {
    constants[idx] = value;
    buffers[idx] = {&constants[idx], sizeof(uint32_t), dtype_name(mx::uint32),
                    EmulatedBuffer::Access::Constant};
  }
};

} // namespace

void run_emulated_plan(
    const LaunchPlan& plan,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  EmulatorBinder binder(plan.buffers.size());
  bind_slots(plan, inputs, outputs, binder);
  run_emulated_kernel(plan.kernel, plan.groups, plan.group_size, binder.buffers);
}

} // namespace mlx_knorm
