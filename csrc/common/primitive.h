// What the multi-output primitives (ProtectedTopKGather, EvictAndFill,
// RowScores) share: their stream, the op's configuration and executor, and
// equivalence by both. Each op declares and defines the rest in its own
// files: eval_cpu (csrc/<op>/<op>.cpp), eval_gpu (metal.cpp), its name,
// output shapes and checks.
#pragma once

#include "mlx/primitives.h"

#include "common/executor.h"

namespace mlx_knorm {

template <typename Config>
class ConfiguredPrimitive : public mlx::core::Primitive {
 public:
  ConfiguredPrimitive(mlx::core::Stream stream, Config config, Executor executor)
      : mlx::core::Primitive(stream), config_(config), executor_(executor) {}

  // Another instance of the same op (MLX compares primitives of one type).
  bool is_equivalent(const mlx::core::Primitive& other) const override {
    const auto& o = static_cast<const ConfiguredPrimitive&>(other);
    return config_ == o.config_ && executor_ == o.executor_;
  }

 protected:
  Config config_;
  Executor executor_;
};

} // namespace mlx_knorm
