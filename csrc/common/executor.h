// Which implementation a primitive runs. Native: the CPU kernel on a CPU
// stream, the Metal kernel on a GPU stream. MetalEmulator: the Metal kernels
// compiled as C++ and run on the CPU stream through the emulator
// (csrc/metal_emulator/).
#pragma once

#include <stdexcept>

namespace mlx_knorm {

enum class Executor { Native, MetalEmulator };

// The emulator is a build option (MLX_KNORM_EMULATOR, on by default off
// Apple platforms); asking for it in a build without it fails when the op is
// built rather than inside eval.
inline void check_executor(Executor executor) {
#ifndef MLX_KNORM_EMULATOR
  if (executor == Executor::MetalEmulator) {
    throw std::invalid_argument(
        "mlx_knorm: this build has no Metal emulator "
        "(configure with -DMLX_KNORM_EMULATOR=ON)");
  }
#else
  (void)executor;
#endif
}

} // namespace mlx_knorm
