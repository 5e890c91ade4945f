// Runs a launch plan (common/launch_plan.h) through the emulator: the
// kernels of metal/ compiled as C++, with the same slots bound to the same
// arrays and constants as eval_gpu binds them. Slow; for testing the kernels
// on machines without an Apple GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "mlx/array.h"

#include "common/launch_plan.h"

namespace mlx_knorm {

void run_emulated_plan(
    const LaunchPlan& plan,
    const std::vector<mlx::core::array>& inputs,
    std::vector<mlx::core::array>& outputs);
void run_emulated_plan(
    const LaunchPlans& plans,
    const std::vector<mlx::core::array>& inputs,
    std::vector<mlx::core::array>& outputs);

// A dispatch the emulator ran: its plan's launch, the threadgroup memory
// each threadgroup had (the plan's lengths and what the kernel declares) and
// the bytes of the scratch buffers the plan allocates.
struct EmulatedDispatch {
  std::string kernel;
  uint32_t groups;
  uint32_t group_size;
  std::vector<uint32_t> threadgroup_bytes;
  size_t threadgroup_memory;
  std::vector<uint64_t> scratch;
};

// Debugging knobs of run_emulated_plan, for tests and
// bench/launch_plans.py (not thread-safe: set them around single-threaded
// evaluations): `record` appends each dispatch to `log`; `first_group_only`
// runs one threadgroup of each dispatch (the outputs are then wrong: for
// reading the plans of large shapes); `threadgroup_shortfall` takes that
// many bytes off each [[threadgroup(i)]] length above it (a broken plan,
// which the emulator must catch); `reverse_groups` runs each dispatch's
// threadgroups last to first (blocks that read what other blocks of their
// dispatch write then read it already written); `fresh_threads` starts each
// dispatch's threads for it alone (a failure to start them is then possible
// on any dispatch, not only on one that needs more threads than ran before);
// `max_buffer_bytes` is the emulated device's maxBufferLength, which bounds
// the scratch of the plans (launch_plan.h's scratch_fits).
struct EmulatorDebug {
  bool record = false;
  bool first_group_only = false;
  bool reverse_groups = false;
  bool fresh_threads = false;
  uint32_t threadgroup_shortfall = 0;
  uint64_t max_buffer_bytes = kEmulatedMaxBufferBytes;
  std::vector<EmulatedDispatch> log;
};

EmulatorDebug& emulator_debug();

} // namespace mlx_knorm
