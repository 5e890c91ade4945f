// ProtectedTopKGather: one eviction step of SPEC section 3 for N rows. Keeps
// the protected rows plus the best-scoring middle rows of the virtual
// concatenation prior ++ new, and gathers them in temporal order.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "backend.h"
#include "validate.h"

namespace mlx_knorm {

namespace mx = mlx::core;

struct GatherConfig {
  int budget;
  int n_sink;
  int recent;
  Keep keep;

  bool operator==(const GatherConfig& o) const {
    return budget == o.budget && n_sink == o.n_sink && recent == o.recent &&
        keep == o.keep;
  }
};

// Returns {keys [N, kept, D], values [N, kept, D], norms [N, kept] float32,
// indices [N, kept] uint32}, kept = min(n_prior + S, budget).
std::vector<mx::array> protected_topk_gather(
    const mx::array& prior_keys,
    const mx::array& prior_values,
    const mx::array& prior_norms,
    const mx::array& new_keys,
    const mx::array& new_values,
    const mx::array& new_norms,
    GatherConfig config,
    Executor executor = Executor::Native,
    mx::StreamOrDevice s = {});

class ProtectedTopKGather : public mx::Primitive {
 public:
  ProtectedTopKGather(mx::Stream stream, GatherConfig config, Executor executor)
      : mx::Primitive(stream), config_(config), executor_(executor) {}

  void eval_cpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  void eval_gpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "ProtectedTopKGather";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

  // Every relation between the inputs' shapes and dtypes that the kernels
  // rely on; throws std::invalid_argument (or dtype_error). Run when the op
  // is built, when MLX asks for output shapes (shapeless compile) and before
  // any kernel touches memory.
  void check_inputs(const std::vector<mx::array>& inputs);

 private:
  GatherConfig config_;
  Executor executor_;
};

// The CPU kernel on contiguous inputs and allocated outputs.
void protected_topk_gather_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs,
    const GatherConfig& config);

} // namespace mlx_knorm
