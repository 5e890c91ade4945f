// The check before a dispatch that the launch binds exactly the
// [[buffer(i)]] the kernel declares, each with the access and element type
// of its parameter.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "metal_emulator/dispatch.h"
#include "metal_emulator/signature.h"

namespace metal_emu {

inline std::string describe(const mlx_knorm::EmulatedBuffer& b) {
  using Access = mlx_knorm::EmulatedBuffer::Access;
  switch (b.access) {
    case Access::Read:
      return "an input " + b.dtype + " array";
    case Access::Write:
      return "an output " + b.dtype + " array";
    case Access::Constant:
      return "a " + b.dtype + " constant";
  }
  return "";
}

// Whether what the launch binds fits the parameter: an input is read
// through a pointer to const, an output written through a pointer, a
// constant taken by constant reference, all of the parameter's element type.
inline bool fits(const BufferParameter& p, const mlx_knorm::EmulatedBuffer& b) {
  using Access = mlx_knorm::EmulatedBuffer::Access;
  if (b.dtype != p.dtype) {
    return false;
  }
  switch (b.access) {
    case Access::Read:
      return !p.by_reference && !p.writable;
    case Access::Write:
      return !p.by_reference && p.writable;
    case Access::Constant:
      return p.by_reference && !p.writable;
  }
  return false;
}

// Throws unless the launch binds exactly the kernel's [[buffer(i)]], each
// as its parameter takes it.
inline void check_binding(
    const std::string& kernel,
    const RegisteredKernel& k,
    const std::vector<mlx_knorm::EmulatedBuffer>& buffers) {
  const std::string prefix = "metal emulator: " + kernel + " ";
  std::vector<bool> declared(buffers.size(), false);
  for (const BufferParameter& p : k.buffers) {
    const std::string slot = "[[buffer(" + std::to_string(p.index) + ")]]";
    if (p.index >= buffers.size()) {
      throw std::runtime_error(
          prefix + "takes " + p.describe() + " at " + slot + ", which the launch does not bind");
    }
    declared[p.index] = true;
    if (!fits(p, buffers[p.index])) {
      throw std::runtime_error(
          prefix + "takes " + p.describe() + " at " + slot + ", where the launch binds " +
          describe(buffers[p.index]));
    }
  }
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (!declared[i]) {
      throw std::runtime_error(
          prefix + "declares no [[buffer(" + std::to_string(i) + ")]], where the launch binds " +
          describe(buffers[i]));
    }
  }
}

} // namespace metal_emu
