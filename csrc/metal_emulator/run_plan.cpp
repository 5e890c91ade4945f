#include "metal_emulator/run_plan.h"

#include <cstdint>
#include <stdexcept>
#include <string>

#include "metal_emulator/dispatch.h"

namespace mlx_knorm {

namespace mx = mlx::core;

namespace {

// Binds plan slots to the emulator's buffer table: [[buffer(i)]] is
// buffers[i], a pointer to the array's data or to the constant. Holds plans
// to the rule eval_gpu depends on (common/launch_plan.h): an array slot is
// marked empty exactly when its array has no elements, since Metal would
// see no buffer there. A placeholder is a null pointer here, so a kernel
// that touches one faults.
struct EmulatorBinder {
  const std::string& kernel;
  std::vector<void*> buffers;
  // Constants need stable addresses for the duration of the dispatch.
  std::vector<uint32_t> constants;

  EmulatorBinder(const std::string& kernel, size_t n_slots)
      : kernel(kernel), buffers(n_slots), constants(n_slots) {}

  void input(int idx, const mx::array& a) {
    check_marked(idx, a, false);
    buffers[idx] = const_cast<void*>(static_cast<const void*>(a.data<char>()));
  }
  void output(int idx, mx::array& a) {
    check_marked(idx, a, false);
    buffers[idx] = a.data<char>();
  }
  void constant(int idx, uint32_t value) {
    constants[idx] = value;
    buffers[idx] = &constants[idx];
  }
  void placeholder(int idx, const mx::array& a) {
    check_marked(idx, a, true);
    buffers[idx] = nullptr;
  }

  void check_marked(int idx, const mx::array& a, bool marked_empty) const {
    if ((a.size() == 0) != marked_empty) {
      throw std::logic_error(
          "mlx_knorm: the launch plan of " + kernel + " marks [[buffer(" +
          std::to_string(idx) + ")]] " + (marked_empty ? "empty" : "non-empty") +
          " but binds an array of " + std::to_string(a.size()) +
          " elements there");
    }
  }
};

} // namespace

void run_emulated_plan(
    const LaunchPlan& plan,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  EmulatorBinder binder(plan.kernel, plan.buffers.size());
  bind_slots(plan, inputs, outputs, binder);
  run_emulated_kernel(plan.kernel, plan.groups, plan.group_size, binder.buffers);
}

} // namespace mlx_knorm
