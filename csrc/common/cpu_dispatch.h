// Runs a primitive's kernel after the work queued on its CPU stream: the
// shared tail of every eval_cpu (run_on_cpu), as dispatch_on_gpu
// (common/metal_dispatch.h) is of every eval_gpu. The kernel is the op's CPU
// kernel (csrc/<op>/cpu.cpp), run on the stream's thread, or, with
// Executor::MetalEmulator, its Metal kernel through the emulator
// (csrc/<op>/emulated.cpp), run on the evaluating thread so that its
// failures raise from eval_cpu (docs/spec.md §8 "A failed evaluation").
#pragma once

#include <utility>
#include <vector>

#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/stream.h"

#include "common/executor.h"

// The address of an op's emulated kernel where the emulator is built, a null
// pointer of its type elsewhere (where check_executor refuses
// Executor::MetalEmulator when the op is built): for cpu_kernel below.
#ifdef MLX_KNORM_EMULATOR
#define KNORM_EMULATED_KERNEL(kernel) (&kernel)
#else
#define KNORM_EMULATED_KERNEL(kernel) static_cast<decltype(&kernel)>(nullptr)
#endif

namespace mlx_knorm {

// The kernel eval_cpu runs for `executor`.
template <typename Kernel>
Kernel* cpu_kernel(Executor executor, Kernel* cpu, Kernel* emulated) {
  return executor == Executor::MetalEmulator ? emulated : cpu;
}

// Runs kernel(inputs, outputs) on the CPU stream, after the work already
// queued there, on the evaluated inputs and allocated outputs.
template <typename Kernel>
void dispatch_on_cpu(
    mlx::core::Stream stream,
    const std::vector<mlx::core::array>& inputs,
    std::vector<mlx::core::array>& outputs,
    Kernel kernel) {
  auto& encoder = mlx::core::cpu::get_command_encoder(stream);
  std::vector<mlx::core::array> in_refs;
  std::vector<mlx::core::array> out_refs;
  in_refs.reserve(inputs.size());
  out_refs.reserve(outputs.size());
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
    in_refs.push_back(mlx::core::array::unsafe_weak_copy(in));
  }
  for (auto& out : outputs) {
    encoder.set_output_array(out);
    out_refs.push_back(mlx::core::array::unsafe_weak_copy(out));
  }
  encoder.dispatch([kernel = std::move(kernel),
                    in_refs = std::move(in_refs),
                    out_refs = std::move(out_refs)]() mutable {
    kernel(in_refs, out_refs);
  });
}

// Runs kernel(inputs, outputs) after the work already queued on the CPU
// stream. The CPU kernels go onto the stream's thread. The Metal emulator,
// which can fail (its threads may not start; its dispatches run on staged
// copies and reach the buffers only when all have run, run_plan.cpp), runs
// on the evaluating thread once the stream has drained: its failures then
// raise from eval_cpu, where MLX keeps the graph to run again. Test-only,
// so the wait costs nothing that matters.
template <typename Kernel>
void run_on_cpu(
    mlx::core::Stream stream,
    Executor executor,
    const std::vector<mlx::core::array>& inputs,
    std::vector<mlx::core::array>& outputs,
    Kernel kernel) {
  if (executor == Executor::MetalEmulator) {
    mlx::core::synchronize(stream);
    kernel(inputs, outputs);
    return;
  }
  dispatch_on_cpu(stream, inputs, outputs, std::move(kernel));
}

} // namespace mlx_knorm
