// Runs a primitive's kernel after the work queued on its CPU stream: the
// shared tail of every eval_cpu (run_on_cpu), as dispatch_on_gpu
// (common/metal_dispatch.h) is of every eval_gpu. The kernel is the op's CPU
// kernel (csrc/<op>/cpu.cpp), run on the stream's thread, or, with
// Executor::MetalEmulator, its Metal kernel through the emulator
// (csrc/<op>/emulated.cpp), run on the evaluating thread so that its
// failures raise from eval_cpu (docs/spec.md §8 "A failed evaluation").
#pragma once

#include <functional>
#include <utility>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/stream.h"

#include "common/executor.h"

// The address of an op's emulated kernel where the emulator is built, a null
// pointer of its type elsewhere (where check_executor refuses
// Executor::MetalEmulator when the op is built): for run_on_cpu below.
#ifdef MLX_KNORM_EMULATOR
#define KNORM_EMULATED_KERNEL(kernel) (&kernel)
#else
#define KNORM_EMULATED_KERNEL(kernel) static_cast<decltype(&kernel)>(nullptr)
#endif

namespace mlx_knorm {

// A CPU kernel's work on one evaluation: made on the evaluating thread from
// the arrays (their data pointers and sizes), run on the stream's thread.
// It holds no array: MLX keeps every input's and output's buffer alive until
// the stream has run what eval_cpu queued (cpu::eval queues a task holding
// them right after), which its own kernels rely on too. Made here, it spares
// a weak copy of each array on every call, a dozen small allocations freed
// on another thread for a decode step of evict_and_fill.
using CpuTask = std::function<void()>;

// With Executor::Native, make_task() (a CpuTask) runs after the work already
// queued on the CPU stream. The Metal emulator, which can fail (its threads
// may not start; its dispatches run on staged copies and reach the buffers
// only when all have run, run_plan.cpp), runs as emulated() on the
// evaluating thread once the stream has drained: its failures then raise
// from eval_cpu, where MLX keeps the graph to run again. Test-only, so the
// wait costs nothing that matters.
template <typename MakeTask, typename Emulated>
void run_on_cpu(mlx::core::Stream stream, Executor executor, MakeTask make_task, Emulated emulated) {
  if (executor == Executor::MetalEmulator) {
    mlx::core::synchronize(stream);
    emulated();
    return;
  }
  mlx::core::cpu::get_command_encoder(stream).dispatch(CpuTask(make_task()));
}

} // namespace mlx_knorm
