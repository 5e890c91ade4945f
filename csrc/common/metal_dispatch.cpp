// Kernel library: mlx_knorm.metallib beside this extension when a working
// Metal compiler was found at build time; otherwise the .metal sources
// installed in mlx_knorm/metal/ are compiled at first use through MLX's
// device library API (safe math, as in the metallib build), with the headers
// they include inlined (common/kernel_source.h). MLX's Device keeps each library
// and pipeline once built, by name.
#include "common/metal_dispatch.h"

#include <dlfcn.h>

#include <filesystem>
#include <stdexcept>
#include <string>

#include "mlx/backend/metal/device.h"

#include "common/kernel_source.h"

namespace mlx_knorm {

namespace mx = mlx::core;
namespace fs = std::filesystem;

namespace {

constexpr const char* kMetallibName = "mlx_knorm.metallib";

// The directory of this extension module (not of libmlx).
fs::path extension_dir() {
  Dl_info info;
  if (!dladdr(reinterpret_cast<void*>(&extension_dir), &info)) {
    throw std::runtime_error("mlx_knorm: cannot locate the extension module");
  }
  return fs::path(info.dli_fname).parent_path();
}

MTL::Library* kernel_library(mx::metal::Device& d, const std::string& source) {
  const MetalKernelLibrary& location = metal_kernel_library();
  if (location.prebuilt) {
    return d.get_library("mlx_knorm", location.path.string());
  }
  return d.get_library("mlx_knorm_" + source, [metal_dir = location.path, source] {
    return metal_kernel_source(metal_dir, source);
  });
}

// Binds plan slots to MLX's Metal command encoder. Metal binds buffers
// untyped: the element names serve the emulator's check alone.
struct EncoderBinder {
  mx::metal::CommandEncoder& encoder;

  void input(int idx, const mx::array& a, const std::string&) {
    encoder.set_input_array(a, idx);
  }
  void output(int idx, mx::array& a, const std::string&) {
    encoder.set_output_array(a, idx);
  }
  // As an input, the encoder orders this dispatch after the one that wrote it.
  void earlier_output(int idx, const mx::array& a, const std::string&) {
    encoder.set_input_array(a, idx);
  }
  void constant(int idx, uint32_t value) {
    encoder.set_bytes(value, idx);
  }
  void block(int idx, const std::vector<uint32_t>& words) {
    encoder.set_vector_bytes(words, idx);
  }
  // An empty array (or none) has no MTL::Buffer: four zero bytes stand in,
  // as MLX's own kernels bind placeholders where there is nothing to bind.
  void placeholder(int idx, BufferSlot::Kind, const mx::array*, const std::string&) {
    encoder.set_bytes(uint32_t{0}, idx);
  }
};

} // namespace

// Looked up once per process (a local static, initialised thread-safely):
// the extension's folder and what it holds do not change while it is loaded.
const MetalKernelLibrary& metal_kernel_library() {
  static const MetalKernelLibrary location = [] {
    const fs::path dir = extension_dir();
    const fs::path metallib = dir / kMetallibName;
    if (fs::exists(metallib)) {
      return MetalKernelLibrary{true, metallib};
    }
    return MetalKernelLibrary{false, dir / "metal"};
  }();
  return location;
}

uint64_t max_buffer_bytes(const mx::Stream& s) {
  return mx::metal::device(s.device).mtl_device()->maxBufferLength();
}

void dispatch_on_gpu(
    const LaunchPlan& plan,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs,
    const mx::Stream& s) {
  dispatch_on_gpu(LaunchPlans{plan}, inputs, outputs, s);
}

void dispatch_on_gpu(
    const LaunchPlans& plans,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs,
    const mx::Stream& s) {
  auto& d = mx::metal::device(s.device);
  // Every pipeline is built and checked before the first dispatch is
  // encoded, so a refused one leaves nothing half done.
  std::vector<MTL::ComputePipelineState*> kernels(plans.size(), nullptr);
  for (size_t i = 0; i < plans.size(); ++i) {
    if (plans[i].groups > 0) {
      kernels[i] = d.get_kernel(plans[i].kernel, kernel_library(d, plans[i].source));
      check_pipeline(plans[i], {kernels[i]->maxTotalThreadsPerThreadgroup(),
                                kernels[i]->threadExecutionWidth()});
    }
  }
  auto& encoder = mx::metal::get_command_encoder(s);
  std::vector<mx::array> scratch = scratch_buffers(plans);
  bool encoded = false;
  for (size_t i = 0; i < plans.size(); ++i) {
    const LaunchPlan& plan = plans[i];
    if (plan.groups == 0) {
      continue;
    }
    // A later dispatch reads or overwrites what an earlier one wrote (the
    // rows a split step's second dispatch copies, the slots its first
    // compacted). MLX's encoder would insert this barrier itself, as the
    // later dispatch binds a buffer that the earlier one bound as an output
    // (CommandEncoder::set_input_array in MLX 0.32); the plans do not rely
    // on that bookkeeping.
    if (encoded) {
      encoder.barrier();
    }
    encoder.set_compute_pipeline_state(kernels[i]);
    EncoderBinder binder{encoder};
    bind_slots(plan, inputs, outputs, scratch, binder);
    for (size_t t = 0; t < plan.threadgroup_bytes.size(); ++t) {
      encoder.set_threadgroup_memory_length(plan.threadgroup_bytes[t], static_cast<int>(t));
    }
    encoder.dispatch_threadgroups(
        MTL::Size(plan.groups, 1, 1), MTL::Size(plan.group_size, 1, 1));
    encoded = true;
  }
  // Held until the command buffer completes.
  encoder.add_temporaries(std::move(scratch));
}

} // namespace mlx_knorm
