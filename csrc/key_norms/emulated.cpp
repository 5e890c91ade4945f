// KeyNorms' Metal kernel run through the emulator, launched with the plan
// that eval_gpu uses (plan.cpp). Built with MLX_KNORM_EMULATOR.
#include "key_norms/key_norms.h"
#include "metal_emulator/run_plan.h"

namespace mlx_knorm {

void key_norms_emulated(const mx::array& keys, mx::array& norms) {
  std::vector<mx::array> outputs{norms};
  run_emulated_plan(key_norms_plan(keys, norms), {keys}, outputs);
}

} // namespace mlx_knorm
