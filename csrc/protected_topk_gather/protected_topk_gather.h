// ProtectedTopKGather: one eviction step of docs/spec.md §3 for N heads.
// Keeps the protected rows plus the best-scoring middle rows of the virtual
// concatenation prior ++ new, and gathers them in temporal order.
//
//   protected_topk_gather.cpp  the op, the primitive, its input checks,
//                              eval_cpu (CPU kernel or emulator, donation)
//   cpu.cpp                    the CPU kernel
//   plan.cpp                   the launch plans of the Metal kernels
//                              (metal/protected_topk_gather.h, instantiated
//                              in metal/protected_topk_gather.metal)
//   metal.cpp                  eval_gpu, where MLX has Metal
//   emulated.cpp               the Metal kernel run through the emulator
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "common/cpu_dispatch.h"
#include "common/executor.h"
#include "common/launch_plan.h"
#include "common/primitive.h"
#include "common/selection.h"

namespace mlx_knorm {

namespace mx = mlx::core;

class LentSiblingInputs;  // common/multi_output.h

// The primitive's inputs, in its input order: a prior state [N, n_prior, *]
// and a new block [N, S, *] of keys, values and float32 norms.
struct GatherInputs {
  mx::array prior_keys;
  mx::array prior_values;
  mx::array prior_norms;
  mx::array new_keys;
  mx::array new_values;
  mx::array new_norms;

  // From and to the primitive's input vector (six arrays in this order).
  static GatherInputs from(const std::vector<mx::array>& inputs);
  std::vector<mx::array> to_vector() const;

  int n_heads() const {
    return prior_keys.shape(0);
  }
  int n_prior() const {
    return prior_keys.shape(1);
  }
  int n_new() const {
    return new_keys.shape(1);
  }
  int key_dim() const {
    return prior_keys.shape(2);
  }
  int value_dim() const {
    return prior_values.shape(2);
  }
};

// Returns {keys [N, kept, D_k], values [N, kept, D_v], norms [N, kept]
// float32, indices [N, kept] uint32}, kept = min(n_prior + S, budget).
std::vector<mx::array> protected_topk_gather(
    const GatherInputs& inputs,
    SelectionConfig config,
    Executor executor = Executor::Native,
    mx::StreamOrDevice s = {});

class ProtectedTopKGather : public ConfiguredPrimitive<SelectionConfig> {
 public:
  using ConfiguredPrimitive::ConfiguredPrimitive;

  void eval_cpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  void eval_gpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "ProtectedTopKGather";
  }
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

  // Every relation between the inputs' shapes and dtypes that the kernels
  // rely on, and the configuration (docs/spec.md §6); throws
  // std::invalid_argument or dtype_error. Run when the op is built, when MLX
  // asks for output shapes (shapeless compile) and before any kernel touches
  // memory.
  void check_inputs(const GatherInputs& inputs);

 private:
  // What eval_cpu and eval_gpu do before their kernels: the checks again (a
  // replayed compiled graph reaches eval without the op), and a buffer for
  // each output, its prior's where donation allows: one rule for the CPU
  // kernel, the emulator and the GPU. The caller keep()s the result once
  // nothing can raise (common/multi_output.h).
  [[nodiscard]] LentSiblingInputs prepare_eval(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs);
};

// The kernels, on row-contiguous inputs and allocated outputs (keys, values
// and norms possibly the prior's buffers, docs/spec.md §7): the CPU
// kernel (cpu.cpp), whole or as the task eval_cpu queues
// (common/cpu_dispatch.h), and the Metal kernel through the emulator
// (emulated.cpp, in builds with the emulator).
void protected_topk_gather_cpu(
    const GatherInputs& inputs,
    std::vector<mx::array>& outputs,
    const SelectionConfig& config);
CpuTask protected_topk_gather_cpu_task(
    const GatherInputs& inputs,
    std::vector<mx::array>& outputs,
    const SelectionConfig& config);
void protected_topk_gather_emulated(
    const GatherInputs& inputs,
    std::vector<mx::array>& outputs,
    const SelectionConfig& config);

// plan.cpp: the launch plans of the Metal kernels, for outputs allocated
// as protected_topk_gather describes (their addresses choose how rows
// move): the selection, and with few heads and many rows a second dispatch
// that copies the rows. Scratch buffers stay within max_buffer_bytes
// (launch_plan.h's scratch_fits).
LaunchPlans protected_topk_gather_plan(
    const GatherInputs& inputs,
    const std::vector<mx::array>& outputs,
    const SelectionConfig& config,
    uint64_t max_buffer_bytes);

} // namespace mlx_knorm
