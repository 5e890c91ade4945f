// KeyNorms: float32 L2 norm of each key row, reduced in the pinned order of
// SPEC section 2 so that every backend agrees bit for bit.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "backend.h"

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
  Executor executor_;
};

// The CPU kernel on raw contiguous buffers: rows x D keys -> rows norms.
void key_norms_cpu(const mx::array& keys, mx::array& out);

} // namespace mlx_knorm
