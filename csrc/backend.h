// Which implementation a primitive runs. Native: the CPU kernel on a CPU
// stream, the Metal kernel on a GPU stream. MetalEmulator: the Metal kernels
// compiled as C++ and run on the CPU stream through the emulator.
#pragma once

namespace mlx_knorm {

enum class Executor { Native, MetalEmulator };

} // namespace mlx_knorm
