// Launch plans of the Metal kernels in metal/: everything a dispatch needs,
// computed from shapes alone and free of Metal types, so that eval_gpu and
// the emulator (metal_emulated.cpp) launch the kernels identically.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "validate.h"

namespace mlx_knorm {

enum class ElemType { Float16, BFloat16, Float32 };

// What is bound at [[buffer(i)]]: a primitive input, a primitive output, or
// a uint constant.
struct BufferSlot {
  enum class Kind { Input, Output, Constant };
  Kind kind;
  int array;       // index into inputs or outputs
  uint32_t value;  // for Kind::Constant

  static BufferSlot input(int i) {
    return {Kind::Input, i, 0};
  }
  static BufferSlot output(int i) {
    return {Kind::Output, i, 0};
  }
  static BufferSlot constant(uint32_t v) {
    return {Kind::Constant, -1, v};
  }
};

struct LaunchPlan {
  std::string source;       // metal/<source>.metal holds the kernel
  std::string kernel;       // host name of the instantiation
  uint32_t groups;          // threadgroups along x; nothing to do when 0
  uint32_t group_size;      // threads per threadgroup along x
  std::vector<BufferSlot> buffers;  // slot i is [[buffer(i)]]
};

// Largest D the key-norm kernel holds in registers.
constexpr int64_t kMetalMaxDim = 512;

// Throws std::invalid_argument when the Metal kernels cannot run these
// shapes; called when an op is built, so that nothing fails inside eval.
void check_metal_key_norms_shape(int64_t rows, int64_t dim);
void check_metal_gather_shape(int64_t n_rows, int64_t n_prior, int64_t n_new);

// keys [rows, dim] -> norms [rows].
LaunchPlan key_norms_plan(ElemType keys, int64_t rows, int64_t dim);

// Inputs in the primitive's order (prior_keys, prior_values, prior_norms,
// new_keys, new_values, new_norms); outputs (keys, values, norms, indices).
LaunchPlan protected_topk_gather_plan(
    ElemType keys,
    ElemType values,
    int64_t n_rows,
    int64_t n_prior,
    int64_t n_new,
    int64_t key_dim,
    int64_t value_dim,
    int budget,
    int n_sink,
    int recent,
    Keep keep);

} // namespace mlx_knorm
