// EvictAndFill: one step of the cache's slot buffers (docs/spec.md §4) for
// N heads. Evicts down to the budget by the eviction rank, compacts the kept
// rows into the first slots (slot or temporal layout), and writes the new
// rows after them with their key norms and positions. In place when the
// buffers are donated (docs/spec.md §7).
//
//   evict_and_fill.cpp  the op, the primitive, its input checks, eval_cpu
//                       (CPU kernel or emulator, donation)
//   cpu.cpp             the CPU kernel
//   plan.cpp            the launch plans of the Metal kernels
//                       (metal/evict_and_fill.h, instantiated in
//                       metal/evict_and_fill.metal)
//   metal.cpp           eval_gpu, where MLX has Metal
//   emulated.cpp        the Metal kernel run through the emulator
#pragma once

#include <cstdint>

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "common/executor.h"
#include "common/launch_plan.h"
#include "common/selection.h"

namespace mlx_knorm {

namespace mx = mlx::core;

class LentSiblingInputs;  // common/multi_output.h

enum class Layout { Slots, Temporal };

Layout parse_layout(const std::string& layout);

// The primitive's inputs, in its input order: the buffers [..., C, *] and
// the new rows [..., S, *]. The heads are the axes before C and S ([N], or
// [B, H] as a model's cache holds them), the same in every array.
struct EvictAndFillInputs {
  mx::array keys;
  mx::array values;
  mx::array norms;
  mx::array positions;
  mx::array new_keys;
  mx::array new_values;

  // From and to the primitive's input vector (six arrays in this order).
  static EvictAndFillInputs from(const std::vector<mx::array>& inputs);
  std::vector<mx::array> to_vector() const;

  // How many leading axes the heads take.
  int head_axes() const {
    return static_cast<int>(keys.ndim()) - 2;
  }
  int64_t n_heads() const {
    int64_t n = 1;
    for (int i = 0; i < head_axes(); ++i) {
      n *= keys.shape(i);
    }
    return n;
  }
  int capacity() const {
    return keys.shape(-2);
  }
  int n_new() const {
    return new_keys.shape(-2);
  }
  int key_dim() const {
    return keys.shape(-1);
  }
  int value_dim() const {
    return values.shape(-1);
  }
};

// What one step does besides the eviction configuration: slots [0, filled)
// are occupied, the new rows take positions offset, offset + 1, ..., and the
// outputs have out_capacity slots.
struct EvictAndFillConfig {
  SelectionConfig selection;
  int64_t filled;
  int64_t offset;
  int64_t out_capacity;
  Layout layout;

  bool operator==(const EvictAndFillConfig&) const = default;

  int64_t kept() const {
    return std::min<int64_t>(filled, selection.budget);
  }
  EvictionRank rank() const {
    return {selection.n_sink,
            static_cast<int32_t>(offset - selection.recent),
            selection.keep};
  }
};

// Returns {keys [..., C_out, D_k], values [..., C_out, D_v], norms
// [..., C_out] float32, positions [..., C_out] int32}, with the inputs' head
// axes; slots [0, kept + S) defined.
std::vector<mx::array> evict_and_fill(
    const EvictAndFillInputs& inputs,
    EvictAndFillConfig config,
    Executor executor = Executor::Native,
    mx::StreamOrDevice s = {});

class EvictAndFill : public mx::Primitive {
 public:
  EvictAndFill(mx::Stream stream, EvictAndFillConfig config, Executor executor)
      : mx::Primitive(stream), config_(config), executor_(executor) {}

  void eval_cpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  void eval_gpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "EvictAndFill";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

  // Every relation between the inputs' shapes and dtypes and the step's
  // configuration that the kernels rely on (docs/spec.md §6); throws
  // std::invalid_argument or dtype_error. Run when the op is built, when MLX
  // asks for output shapes (shapeless compile) and before any kernel touches
  // memory.
  void check_inputs(const EvictAndFillInputs& inputs);

 private:
  // What eval_cpu and eval_gpu do before their kernels: the checks again (a
  // replayed compiled graph reaches eval without the op), and a buffer for
  // each output, its input's where donation allows (docs/spec.md §7): one
  // rule for the CPU kernel, the emulator and the GPU. The caller keep()s
  // the result once nothing can raise (common/multi_output.h).
  [[nodiscard]] LentSiblingInputs prepare_eval(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs);

  EvictAndFillConfig config_;
  Executor executor_;
};

// The kernels, on row-contiguous inputs and allocated outputs. An output
// whose data is its input's (a donated buffer) is updated in place: only the
// rows that move are written. The CPU kernel (cpu.cpp) and the Metal kernel
// through the emulator (emulated.cpp, in builds with the emulator).
void evict_and_fill_cpu(
    const EvictAndFillInputs& inputs,
    std::vector<mx::array>& outputs,
    const EvictAndFillConfig& config);
void evict_and_fill_emulated(
    const EvictAndFillInputs& inputs,
    std::vector<mx::array>& outputs,
    const EvictAndFillConfig& config);

// plan.cpp: the launch plans of the Metal kernels: steps 1-3, or, with few
// heads and many new rows, steps 1-2 (unless they have nothing to do) and
// then the new rows over many threadgroups. Outputs that share their
// input's buffer are updated in place.
LaunchPlans evict_and_fill_plan(
    const EvictAndFillInputs& inputs,
    const std::vector<mx::array>& outputs,
    const EvictAndFillConfig& config);

} // namespace mlx_knorm
