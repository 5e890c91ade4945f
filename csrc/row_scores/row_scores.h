// RowScores: the float32 score of each new row under a scorer (docs/spec.md
// §2a), in the pinned order of that section so that every backend agrees bit
// for bit: knorm (the key's norm), vnorm (the key's norm over the value's),
// qfilter (minus the key's projection on its head's filter) and keydiff (the
// key's cosine similarity to the sum of the unit keys before it, a running
// statistic per head that the op takes and returns).
//
//   row_scores.cpp  the op, the primitive, eval_cpu (CPU kernel or emulator)
//   cpu.cpp         the CPU kernel
//   plan.cpp        the launch plan of the Metal kernels (metal/row_scores.h,
//                   instantiated in metal/row_scores.metal)
//   metal.cpp       eval_gpu, where MLX has Metal
//   emulated.cpp    the Metal kernels run through the emulator
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "common/cpu_dispatch.h"
#include "common/executor.h"
#include "common/launch_plan.h"
#include "common/primitive.h"
#include "common/multi_output.h"

namespace mlx_knorm {

namespace mx = mlx::core;

// The scorers, numbered as the Metal kernels take them (kScorer* in
// metal/knorm_defines.h).
enum class Scorer : uint32_t {
  KeyNorm = kScorerKeyNorm,
  ValueNorm = kScorerValueNorm,
  QueryFilter = kScorerQueryFilter,
  KeyDiff = kScorerKeyDiff,
};

// "knorm", "vnorm", "qfilter", "keydiff"; anything else raises naming `scorer`.
Scorer parse_scorer(const std::string& name);
const char* scorer_name(Scorer scorer);

struct RowScoresConfig {
  Scorer scorer;
  // The position of new row 0; with valid ranges, a row is real when its
  // position lies in its head's [lo, hi) (docs/spec.md §4 step 0).
  int64_t offset;
  bool has_valid;

  bool uses_values() const {
    return scorer == Scorer::ValueNorm;
  }
  bool uses_state() const {
    return scorer == Scorer::QueryFilter || scorer == Scorer::KeyDiff;
  }
  bool returns_state() const {
    return scorer == Scorer::KeyDiff;
  }
  bool operator==(const RowScoresConfig& o) const {
    return scorer == o.scorer && offset == o.offset && has_valid == o.has_valid;
  }
};

// The op's arrays: keys [..., S, D_k] (float16, bfloat16, float32), the
// leading axes the heads; values [..., S, D_v] of the keys' dtype (vnorm);
// state [..., D_k] float32 (qfilter's filters, keydiff's running sums);
// valid [..., 2] int32 (with has_valid).
struct RowScoresInputs {
  mx::array keys;
  std::optional<mx::array> values;
  std::optional<mx::array> state;
  std::optional<mx::array> valid;

  // In the primitive's order: keys, then values, state and valid where given.
  static RowScoresInputs from(const std::vector<mx::array>& inputs, const RowScoresConfig& config);
  std::vector<mx::array> to_vector() const;

  int64_t heads() const;
  int64_t rows() const {
    return keys.shape(-2);
  }
  int64_t key_dim() const {
    return keys.shape(-1);
  }
  int64_t value_dim() const {
    return values ? values->shape(-1) : 0;
  }
};

// Returns {scores [..., S] float32} and, for keydiff, the running sums
// after the block, {scores, state [..., D_k] float32}.
std::vector<mx::array> row_scores(
    const RowScoresInputs& inputs,
    RowScoresConfig config,
    Executor executor = Executor::Native,
    mx::StreamOrDevice s = {});

class RowScores : public ConfiguredPrimitive<RowScoresConfig> {
 public:
  using ConfiguredPrimitive::ConfiguredPrimitive;

  void eval_cpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  void eval_gpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "RowScores";
  }
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

  // What the kernels rely on (docs/spec.md §6); throws std::invalid_argument
  // or dtype_error naming the argument.
  void check_inputs(const RowScoresInputs& inputs);

 private:
  // The checks again (a replayed compiled graph reaches eval without the
  // op) and fresh outputs: the state is read whole before it is written, by
  // one SIMD group per head on the GPU, so it is never updated in place.
  void prepare_eval(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs);
};

// The kernels, on row-contiguous inputs and allocated outputs: the CPU
// kernel (cpu.cpp), whole or as the task eval_cpu queues, and the Metal
// kernels through the emulator (emulated.cpp, in builds with the emulator).
CpuTask row_scores_cpu_task(
    const RowScoresInputs& inputs,
    std::vector<mx::array>& outputs,
    const RowScoresConfig& config);
void row_scores_cpu(
    const RowScoresInputs& inputs,
    std::vector<mx::array>& outputs,
    const RowScoresConfig& config);
void row_scores_emulated(
    const RowScoresInputs& inputs,
    std::vector<mx::array>& outputs,
    const RowScoresConfig& config);

// plan.cpp: the launch plan of the Metal kernel for this scorer; its
// widths must be at most kKeyNormsMaxDim (checked when the op is built for
// a GPU or the emulator: check_metal_row_scores_shape).
void check_metal_row_scores_shape(const RowScoresInputs& inputs);
LaunchPlan row_scores_plan(
    const RowScoresInputs& inputs,
    const std::vector<mx::array>& outputs,
    const RowScoresConfig& config);

} // namespace mlx_knorm
