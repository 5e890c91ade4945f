// KeyNorms: the float32 L2 norm of each key row, reduced in the pinned order
// of docs/spec.md §2 so that every backend agrees bit for bit.
//
//   key_norms.cpp  the op, the primitive, eval_cpu (CPU kernel or emulator)
//   cpu.cpp        the CPU kernel
//   plan.cpp       the launch plan of the Metal kernel (metal/key_norms.h,
//                  instantiated in metal/key_norms.metal)
//   metal.cpp      eval_gpu, where MLX has Metal
//   emulated.cpp   the Metal kernel run through the emulator
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "common/cpu_dispatch.h"
#include "common/executor.h"
#include "common/launch_plan.h"

namespace mlx_knorm {

namespace mx = mlx::core;

// keys [..., D] (float16, bfloat16, float32) -> float32 [...].
mx::array key_norms(
    const mx::array& keys,
    Executor executor = Executor::Native,
    mx::StreamOrDevice s = {});

class KeyNorms : public mx::UnaryPrimitive {
 public:
  KeyNorms(mx::Stream stream, Executor executor)
      : mx::UnaryPrimitive(stream), executor_(executor) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "KeyNorms";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

  // What the kernels rely on (see ProtectedTopKGather::check_inputs).
  void check_inputs(const std::vector<mx::array>& inputs);

 private:
  // What eval_cpu and eval_gpu do before their kernel: the checks again (a
  // replayed compiled graph reaches eval without the op), and a fresh
  // buffer for the norms.
  void prepare_eval(const std::vector<mx::array>& inputs, mx::array& out);

  Executor executor_;
};

// The kernels, on a row-contiguous keys [rows, D] and an allocated norms
// [rows]: the CPU kernel (cpu.cpp), whole or as the task eval_cpu queues
// (common/cpu_dispatch.h), and the Metal kernel through the emulator
// (emulated.cpp, in builds with the emulator).
void key_norms_cpu(const mx::array& keys, mx::array& norms);
CpuTask key_norms_cpu_task(const mx::array& keys, mx::array& norms);

// The CPU kernel on `rows` contiguous rows of width dim at `keys` (float16,
// bfloat16 or float32 bits), on the calling thread: norms[0, rows). For
// primitives that store norms beside other data (evict_and_fill).
void key_norm_rows(
    mx::Dtype dtype,
    const void* keys,
    int64_t rows,
    int64_t dim,
    float* norms);
void key_norms_emulated(const mx::array& keys, mx::array& norms);

// plan.cpp: the shapes the Metal kernel takes (throws std::invalid_argument
// naming the argument `name` otherwise; checked when the op is built) and
// its launch plan.
void check_metal_key_norms_shape(const mx::array& keys, const char* name);
LaunchPlan key_norms_plan(const mx::array& keys, const mx::array& norms);

} // namespace mlx_knorm
