// Kernel library: mlx_knorm.metallib beside this extension when the Metal
// toolchain was available at build time; otherwise the .metal sources
// installed in mlx_knorm/metal/ are compiled at first use through MLX's
// device library API (safe math, as in the metallib build), with the shared
// header inlined (common/kernel_source.h).
#include "common/metal_dispatch.h"

#include <dlfcn.h>

#include <filesystem>
#include <stdexcept>

#include "mlx/backend/metal/device.h"

#include "common/kernel_source.h"

namespace mlx_knorm {

namespace mx = mlx::core;
namespace fs = std::filesystem;

namespace {

// The directory of this extension module (not of libmlx).
fs::path extension_dir() {
  Dl_info info;
  if (!dladdr(reinterpret_cast<void*>(&extension_dir), &info)) {
    throw std::runtime_error("mlx_knorm: cannot locate the extension module");
  }
  return fs::path(info.dli_fname).parent_path();
}

MTL::Library* kernel_library(mx::metal::Device& d, const std::string& source) {
  const fs::path dir = extension_dir();
  if (fs::exists(dir / "mlx_knorm.metallib")) {
    return d.get_library("mlx_knorm", dir.string());
  }
  const fs::path metal_dir = dir / "metal";
  return d.get_library("mlx_knorm_" + source, [metal_dir, source] {
    return metal_kernel_source(metal_dir, source);
  });
}

// Binds plan slots to MLX's Metal command encoder.
struct EncoderBinder {
  mx::metal::CommandEncoder& encoder;

  void input(int idx, const mx::array& a) {
    encoder.set_input_array(a, idx);
  }
  void output(int idx, mx::array& a) {
    encoder.set_output_array(a, idx);
  }
  void constant(int idx, uint32_t value) {
    encoder.set_bytes(value, idx);
  }
  // An empty array has no MTL::Buffer: four zero bytes stand in, as MLX's
  // own kernels bind placeholders where there is nothing to bind.
  void placeholder(int idx, const mx::array&) {
    encoder.set_bytes(uint32_t{0}, idx);
  }
};

} // namespace

void dispatch_on_gpu(
    const LaunchPlan& plan,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs,
    const mx::Stream& s) {
  if (plan.groups == 0) {
    return;
  }
  auto& d = mx::metal::device(s.device);
  auto* kernel = d.get_kernel(plan.kernel, kernel_library(d, plan.source));
  auto& encoder = mx::metal::get_command_encoder(s);
  encoder.set_compute_pipeline_state(kernel);
  EncoderBinder binder{encoder};
  bind_slots(plan, inputs, outputs, binder);
  encoder.dispatch_threadgroups(
      MTL::Size(plan.groups, 1, 1), MTL::Size(plan.group_size, 1, 1));
}

} // namespace mlx_knorm
