#include "metal_emulator/run_plan.h"

#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>

#include "common/dtype.h"
#include "metal_emulator/dispatch.h"

namespace mlx_knorm {

namespace mx = mlx::core;

namespace {

// Buffers start at least this aligned on a GPU, and the copies below too.
constexpr size_t kBufferAlignment = 64;

struct AlignedDelete {
  void operator()(char* p) const {
    ::operator delete[](p, std::align_val_t(kBufferAlignment));
  }
};

// One array's bytes as a kernel sees them: a copy that starts offset() bytes
// past an aligned address, as Metal binds an MLX buffer at the array's
// offset. MLX's CPU allocator aligns buffers to 8 bytes only, while the
// launch plans choose how rows move from the offsets (row_unit in
// common/launch_plan.h): so the kernels run on copies and take the paths
// they take on a GPU. Each copy is a heap block that ends where the array
// ends, so AddressSanitizer sees an access past it.
struct StagedArray {
  char* data;  // the array's own bytes
  size_t bytes;
  std::unique_ptr<char[], AlignedDelete> block;
  char* bound;  // what the kernel gets
  bool output = false;
};

// The staged copies of one op's dispatches: the device memory they share.
// A later dispatch reads what an earlier one wrote there, and the outputs
// reach the arrays only once every dispatch has run, so a dispatch that
// fails (its threads cannot start) leaves every array as it was: a donated
// input still holds the rows a retried evaluation reads (docs/spec.md §8).
struct Staging {
  std::vector<StagedArray> staged;

  // An output that is its input's buffer (in place) shares the input's
  // copy. Inputs that are views of one buffer from its start but of other
  // sizes (a block sliced from the cache's rows, norms from a longer array)
  // get a copy each: they are only read. An output never aliases an array
  // of another size (the op donates whole buffers only).
  StagedArray& stage(const mx::array& a, bool output) {
    char* data = const_cast<char*>(a.data<char>());
    const size_t bytes = a.nbytes();
    for (StagedArray& s : staged) {
      if (s.data == data && bytes > 0) {
        if (s.bytes == bytes) {
          return s;
        }
        if (output || s.output) {
          throw std::logic_error("metal emulator: an output shares data with an array of another size");
        }
      }
    }
    const size_t pad = static_cast<size_t>(a.offset()) % kBufferAlignment;
    std::unique_ptr<char[], AlignedDelete> block(static_cast<char*>(
        ::operator new[](pad + bytes, std::align_val_t(kBufferAlignment))));
    char* bound = block.get() + pad;
    if (bytes > 0) {
      std::memcpy(bound, data, bytes);
    }
    staged.push_back({data, bytes, std::move(block), bound});
    return staged.back();
  }

  void copy_back() const {
    for (const StagedArray& s : staged) {
      if (s.output && s.bytes > 0) {
        std::memcpy(s.data, s.bound, s.bytes);
      }
    }
  }
};

// Binds plan slots to the emulator's buffer table: [[buffer(i)]] is
// buffers[i]: the staged copy of an array, a constant or a block of them,
// with what the emulator checks against the kernel's signature. Holds plans
// to the rule eval_gpu depends on (common/launch_plan.h): an array slot is
// marked empty exactly when its array has no elements (or there is none),
// since Metal would see no buffer there. A placeholder is bound with a null
// pointer, so a kernel that touches one faults.
struct EmulatorBinder {
  const std::string& kernel;
  Staging& staging;
  std::vector<EmulatedBuffer> buffers;
  // Constants need stable addresses for the duration of the dispatch.
  std::vector<uint32_t> constants;

  EmulatorBinder(const std::string& kernel, Staging& staging, size_t n_slots)
      : kernel(kernel), staging(staging), buffers(n_slots), constants(n_slots) {}

  void input(int idx, const mx::array& a, const std::string& element) {
    check_marked(idx, &a, false);
    buffers[idx] = {staging.stage(a, false).bound, element, EmulatedBuffer::Access::Read};
  }
  void output(int idx, mx::array& a, const std::string& element) {
    check_marked(idx, &a, false);
    StagedArray& s = staging.stage(a, true);
    s.output = true;
    buffers[idx] = {s.bound, element, EmulatedBuffer::Access::Write};
  }
  void earlier_output(int idx, const mx::array& a, const std::string& element) {
    input(idx, a, element);
  }
  void constant(int idx, uint32_t value) {
    constants[idx] = value;
    buffers[idx] = {&constants[idx], dtype_name(mx::uint32), EmulatedBuffer::Access::Constant};
  }
  // The plan's words stay where they are for the dispatch; the name is the
  // one the kernel's parameter gets (metal_emu::element_name).
  void block(int idx, const std::vector<uint32_t>& words) {
    buffers[idx] = {const_cast<uint32_t*>(words.data()),
                    "uint32[" + std::to_string(words.size()) + "]",
                    EmulatedBuffer::Access::Constant};
  }
  void placeholder(int idx, BufferSlot::Kind kind, const mx::array* a, const std::string& element) {
    check_marked(idx, a, true);
    buffers[idx] = {nullptr, element,
                    kind == BufferSlot::Kind::Output ? EmulatedBuffer::Access::Write
                                                     : EmulatedBuffer::Access::Read};
  }

  // An unused slot (no array) is always marked empty.
  void check_marked(int idx, const mx::array* a, bool marked_empty) const {
    if (a != nullptr && (a->size() == 0) != marked_empty) {
      throw std::logic_error(
          "mlx_knorm: the launch plan of " + kernel + " marks [[buffer(" +
          std::to_string(idx) + ")]] " + (marked_empty ? "empty" : "non-empty") +
          " but binds an array of " + std::to_string(a->size()) +
          " elements there");
    }
  }
};

void run_dispatch(
    const LaunchPlan& plan,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs,
    std::vector<mx::array>& scratch,
    Staging& staging) {
  EmulatorBinder binder(plan.kernel, staging, plan.buffers.size());
  bind_slots(plan, inputs, outputs, scratch, binder);
  EmulatorDebug& debug = emulator_debug();
  std::vector<uint32_t> lengths = plan.threadgroup_bytes;
  for (uint32_t& length : lengths) {
    if (length > debug.threadgroup_shortfall) {
      length -= debug.threadgroup_shortfall;
    }
  }
  const uint32_t groups = debug.first_group_only && plan.groups > 0 ? 1 : plan.groups;
  const size_t memory =
      run_emulated_kernel(plan.kernel, groups, plan.group_size, binder.buffers, lengths,
                          debug.reverse_groups, debug.fresh_threads);
  if (debug.record) {
    debug.log.push_back({plan.kernel, plan.groups, plan.group_size, lengths, memory, plan.scratch});
  }
}

} // namespace

EmulatorDebug& emulator_debug() {
  static EmulatorDebug debug;
  return debug;
}

void run_emulated_plan(
    const LaunchPlan& plan,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  run_emulated_plan(LaunchPlans{plan}, inputs, outputs);
}

// The dispatches share one staging, as a GPU's dispatches share its memory.
// An output read as an earlier one must have been bound as an output by a
// dispatch that ran before, or the kernel would read memory nothing wrote.
void run_emulated_plan(
    const LaunchPlans& plans,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  // As eval_gpu checks each pipeline before it encodes anything; a scratch
  // buffer past the device's largest is a plan the GPU could not run.
  const uint64_t max_buffer_bytes = emulator_debug().max_buffer_bytes;
  for (const LaunchPlan& plan : plans) {
    if (plan.groups > 0) {
      check_pipeline(plan, kEmulatedPipeline);
    }
    for (const uint64_t bytes : plan.scratch) {
      if (bytes > max_buffer_bytes) {
        throw std::logic_error(
            "mlx_knorm: the launch plan of " + plan.kernel + " asks for scratch of " +
            std::to_string(bytes) + " bytes, past the device's largest buffer (" +
            std::to_string(max_buffer_bytes) + " bytes)");
      }
    }
  }
  Staging staging;
  std::vector<mx::array> scratch = scratch_buffers(plans);
  std::vector<bool> written(outputs.size(), false);
  for (const LaunchPlan& plan : plans) {
    for (const BufferSlot& slot : plan.buffers) {
      if (plan.groups > 0 && slot.kind == BufferSlot::Kind::EarlierOutput && slot.array >= 0 &&
          !written.at(slot.array)) {
        throw std::logic_error(
            "mlx_knorm: the launch plan of " + plan.kernel + " reads output " +
            std::to_string(slot.array) + " before any dispatch writes it");
      }
    }
    run_dispatch(plan, inputs, outputs, scratch, staging);
    for (const BufferSlot& slot : plan.buffers) {
      if (plan.groups > 0 && slot.kind == BufferSlot::Kind::Output && slot.array >= 0) {
        written.at(slot.array) = true;
      }
    }
  }
  staging.copy_back();
}

} // namespace mlx_knorm
