// eval_gpu of both primitives: apply the launch plan (launch_plan.cpp)
// through MLX's Metal command encoder. Built only where MLX has Metal.
//
// Kernel library: mlx_knorm.metallib beside this extension when the Metal
// toolchain was available at build time; otherwise the .metal sources
// installed in mlx_knorm/metal/ are compiled at first use through MLX's
// device library API (safe math, as in the metallib build).
#include <dlfcn.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "mlx/backend/metal/device.h"

#include "array_plans.h"
#include "key_norms.h"
#include "launch_plan.h"
#include "protected_topk_gather.h"
#include "validate.h"

namespace mlx_knorm {

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
  const fs::path path = dir / "metal" / (source + ".metal");
  return d.get_library("mlx_knorm_" + source, [path] {
    std::ifstream in(path);
    if (!in) {
      throw std::runtime_error(
          "mlx_knorm: no mlx_knorm.metallib and no kernel source " +
          path.string());
    }
    std::ostringstream text;
    text << in.rdbuf();
    return text.str();
  });
}

void encode(
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
  for (size_t i = 0; i < plan.buffers.size(); ++i) {
    const BufferSlot& slot = plan.buffers[i];
    const int idx = static_cast<int>(i);
    switch (slot.kind) {
      case BufferSlot::Kind::Input:
        encoder.set_input_array(inputs[slot.array], idx);
        break;
      case BufferSlot::Kind::Output:
        encoder.set_output_array(outputs[slot.array], idx);
        break;
      case BufferSlot::Kind::Constant:
        encoder.set_bytes(slot.value, idx);
        break;
    }
  }
  encoder.dispatch_threadgroups(
      MTL::Size(plan.groups, 1, 1), MTL::Size(plan.group_size, 1, 1));
}

} // namespace

void KeyNorms::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  check_inputs(inputs);
  check_row_contiguous(inputs, name());
  const auto& keys = inputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const auto plan = key_norms_plan(keys, out);
  std::vector<mx::array> outputs{out};
  encode(plan, inputs, outputs, stream());
}

void ProtectedTopKGather::eval_gpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  check_inputs(inputs);
  check_row_contiguous(inputs, name());
  for (auto& out : outputs) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
  const auto plan = protected_topk_gather_plan(inputs, config_);
  encode(plan, inputs, outputs, stream());
}

} // namespace mlx_knorm
