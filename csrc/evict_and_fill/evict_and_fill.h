// EvictAndFill: one step of the cache's slot buffers (docs/spec.md §4) for
// N heads. Evicts down to the budget by the eviction rank (padding rows
// last where heads have valid ranges), compacts the kept rows into the
// first slots (slot or temporal layout), and writes the new rows after them
// with their norms (computed from the first payload or given) and
// positions. Payloads are any row-aligned arrays, moved as raw bits. In
// place when the buffers are donated (docs/spec.md §7).
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
#include <optional>
#include <string>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/small_vector.h"

#include "common/cpu_dispatch.h"
#include "common/executor.h"
#include "common/launch_plan.h"
#include "common/primitive.h"
#include "common/selection.h"

namespace mlx_knorm {

namespace mx = mlx::core;

class LentSiblingInputs;  // common/multi_output.h

enum class Layout { Slots, Temporal };

Layout parse_layout(const std::string& layout);

// How many payloads the keys and the values are, and whether each was
// given as a list (Python's tuple form, whose elements are named keys[i]):
// for error messages, and for the Python layer's structure of the outputs.
struct PayloadGroups {
  int keys = 1;
  int values = 1;
  bool keys_listed = false;
  bool values_listed = false;

  bool operator==(const PayloadGroups&) const = default;

  int count() const {
    return keys + values;
  }
  // "keys", "keys[1]", "new_values[0]", ...: payload i as the caller named it.
  std::string name(int i, bool new_rows = false) const;
};

// What one step does besides the eviction configuration: slots [0, filled)
// are occupied, the new rows take positions offset, offset + 1, ..., the
// outputs have out_capacity slots; the payloads' grouping, whether the new
// rows' norms are given (else computed from the first payload, docs/spec.md
// §2) and whether each head has a valid range.
struct EvictAndFillConfig {
  SelectionConfig selection;
  int64_t filled;
  int64_t offset;
  int64_t out_capacity;
  Layout layout;
  PayloadGroups payloads = {};
  bool norms_given = false;
  bool has_valid = false;
  // Outputs the order tree (docs/spec.md §4 step 4); tree_given: the
  // previous step's is an input.
  bool order_tree = false;
  bool tree_given = false;

  bool operator==(const EvictAndFillConfig&) const = default;

  int64_t kept() const {
    return std::min<int64_t>(filled, selection.budget);
  }
};

// The primitive's inputs, in its input order: the payload buffers r_i
// [..., C, W_i] (the keys' then the values'), the norms and positions
// [..., C], the new payload rows q_i [..., S, W_i], then new_norms [..., S]
// float32, valid [..., 2] int32 and the order tree [..., 2, C + 1] int32
// where the configuration has them. The heads are the axes before C and S
// ([N], or [B, H] as a model's cache holds them), the same in every array.
// Outputs: the payloads, norms and positions with C_out slots, output i in
// place of input i, then the order tree [..., 2, C_out + 1] where asked
// for, in place of the given one.
// Payload arrays held inline: a step builds and checks its inputs several
// times, with no allocation for them.
using PayloadArrays = mx::SmallVector<mx::array, kEvictMaxPayloads>;

struct EvictAndFillInputs {
  PayloadArrays rows;
  mx::array norms;
  mx::array positions;
  PayloadArrays new_rows;
  std::optional<mx::array> new_norms;
  std::optional<mx::array> valid;
  std::optional<mx::array> tree;

  // From and to the primitive's input vector (the order above).
  static EvictAndFillInputs from(
      const std::vector<mx::array>& inputs,
      const EvictAndFillConfig& config);
  std::vector<mx::array> to_vector() const;

  int payloads() const {
    return static_cast<int>(rows.size());
  }
  // How many leading axes the heads take.
  int head_axes() const {
    return static_cast<int>(norms.ndim()) - 1;
  }
  int64_t n_heads() const {
    int64_t n = 1;
    for (int i = 0; i < head_axes(); ++i) {
      n *= norms.shape(i);
    }
    return n;
  }
  int capacity() const {
    return norms.shape(-1);
  }
  int n_new() const {
    return new_rows.at(0).shape(-2);
  }
  // Bytes of one row of payload i.
  size_t row_bytes(int i) const {
    return static_cast<size_t>(rows.at(i).shape(-1)) * rows.at(i).itemsize();
  }
};

// Returns the payload buffers [..., C_out, W_i] in their dtypes, norms
// [..., C_out] float32 and positions [..., C_out] int32, with the inputs'
// head axes; slots [0, kept + S) defined; then, with config.order_tree, the
// order tree [..., 2, C_out + 1] int32. config.norms_given, has_valid and
// tree_given must say whether inputs has new_norms, valid and tree, and
// config.payloads how its rows group into keys and values.
std::vector<mx::array> evict_and_fill(
    const EvictAndFillInputs& inputs,
    EvictAndFillConfig config,
    Executor executor = Executor::Native,
    mx::StreamOrDevice s = {});

class EvictAndFill : public ConfiguredPrimitive<EvictAndFillConfig> {
 public:
  using ConfiguredPrimitive::ConfiguredPrimitive;

  void eval_cpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  void eval_gpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "EvictAndFill";
  }
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
};

// The kernels, on row-contiguous inputs and allocated outputs. An output
// whose data is its input's (a donated buffer) is updated in place: only the
// rows that move are written. The CPU kernel (cpu.cpp), whole or as the task
// eval_cpu queues (common/cpu_dispatch.h), and the Metal kernel through the
// emulator (emulated.cpp, in builds with the emulator).
void evict_and_fill_cpu(
    const EvictAndFillInputs& inputs,
    std::vector<mx::array>& outputs,
    const EvictAndFillConfig& config);
CpuTask evict_and_fill_cpu_task(
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
// input's buffer are updated in place. Scratch buffers stay within
// max_buffer_bytes (launch_plan.h's scratch_fits).
LaunchPlans evict_and_fill_plan(
    const EvictAndFillInputs& inputs,
    const std::vector<mx::array>& outputs,
    const EvictAndFillConfig& config,
    uint64_t max_buffer_bytes);

} // namespace mlx_knorm
