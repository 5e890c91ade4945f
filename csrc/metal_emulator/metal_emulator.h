// Header-only emulation of the part of the Metal execution model that the
// kernels in metal/ use, so that the very same .metal files compile as C++
// and run on a CPU. Every thread of a threadgroup is a real thread and
// every barrier is a real barrier: a kernel that misses a barrier, or whose
// barrier orders too little, reads stale data or races here as it may on a
// GPU, and ThreadSanitizer reports it (memory ordering, below).
//
// Modelled: the kernel signature (each parameter's [[buffer(i)]],
// [[threadgroup(i)]] or thread attribute, through KNORM_BUFFER,
// KNORM_THREADGROUP_BUFFER and KNORM_ATTRIBUTE), half and bfloat with
// bit-exact conversions, threadgroup memory (declared in kernel scope only
// or given as [[threadgroup(i)]] arguments of the lengths the launch sets,
// filled with garbage so that reads of unwritten memory show, and made
// visible to other threads only by the barriers that order it, below),
// threadgroup_barrier and its mem_flags, SIMD groups of width 32
// (simd_shuffle, simd_shuffle_down, simd_prefix_inclusive_sum, simd_ballot),
// relaxed threadgroup atomics, uint2 and uint4 for moving raw bits
// (alignment checked), as_type, ctz, popcount, precise::sqrt. Threadgroups
// of a grid run one after another, reusing the same threads.
//
// Memory ordering. A threadgroup_barrier orders threadgroup memory only with
// mem_threadgroup and device memory only with mem_device:
//   - threadgroup memory: each thread works on a view of its own, and its
//     writes reach the other threads only through a barrier that orders
//     threadgroup memory. A read that a weaker barrier (or none) leaves
//     unordered sees stale data, so the results differ, and two threads that
//     change the same byte between two such barriers are a reported race.
//     Atomics act on the shared memory at once, as on a GPU.
//   - under ThreadSanitizer, threadgroup memory is shared instead and each
//     barrier that orders it erases its access history; only barriers that
//     order device memory order device memory; the threadgroups of a grid are
//     unordered; and the emulator's own synchronisation is hidden. So
//     ThreadSanitizer reports every pair of accesses, to either space, that
//     no barrier for that space orders. Without it, device memory is ordered
//     by every barrier.
//
// The binding is checked before a dispatch: the launch must bind exactly the
// [[buffer(i)]] the kernel declares, each with the access (input, output or
// constant) and element type of its parameter, and set a length (a nonzero
// multiple of 16 bytes) for exactly its [[threadgroup(i)]]. Each argument is
// followed by guard bytes: a thread that writes past the length set fails
// the dispatch, at its next barrier ordering threadgroup memory or when it
// leaves the kernel (a write that skips the guards is not seen).
//
// The parts, one header each:
//   tsan.h                the ThreadSanitizer hooks
//   barrier.h             the barrier threads meet at; the bits of mem_flags
//   errors.h              how a dispatch fails
//   threadgroup_memory.h  threadgroup memory and its views
//   threads.h             threadgroup and thread state, threadgroup_barrier
//   thread_pool.h         the threads dispatches run on
//   signature.h           kernel signatures and the registry of instances
//   binding.h             the check of a launch's buffers against a signature
//   grid.h                a dispatch: the grid's threadgroups and threads
//   language.h            the Metal language surface (namespace metal)
// This header includes them all and then defines the qualifier macros.
//
// Include this header, then the .metal files, in a translation unit that
// includes nothing else: the qualifier macros below would break other code.
#pragma once

#include "metal_emulator/barrier.h"
#include "metal_emulator/binding.h"
#include "metal_emulator/errors.h"
#include "metal_emulator/grid.h"
#include "metal_emulator/language.h"
#include "metal_emulator/signature.h"
#include "metal_emulator/thread_pool.h"
#include "metal_emulator/threadgroup_memory.h"
#include "metal_emulator/threads.h"
#include "metal_emulator/tsan.h"

// Tells metal/knorm_defines.h that the kernels compile against this
// emulator.
#define KNORM_METAL_EMULATOR 1

// Address spaces. Device and constant memory are the host's memory;
// threadgroup pointers are volatile ones (the one qualifier C++ has to
// spare), so that threadgroup memory passed where a device pointer is
// expected fails to compile, as in Metal. The reverse conversion, an
// unqualified pointer and a program-scope variable outside constant compile
// here; tests/msl/check.py rejects them (docs/backends.md).
// Kernel attributes become empty entries of their attribute list: the
// grid's launch, not the attribute, sets the threads a threadgroup has.
#define kernel
#define max_total_threads_per_threadgroup(threads)
#define thread
#define device
#define constant const
#define threadgroup volatile

// MSL's half and bfloat are keywords: as macros for the emulator's types, a
// declaration that uses either as a name does not compile, as in Metal.
#define half ::metal::emulated_half
#define bfloat ::metal::emulated_bfloat

// Project macros that metal/knorm_defines.h defines differently for the
// Metal compiler. The signature macros add the tag parameters that the
// registration reads (metal_emu::Signature).
#define KNORM_BUFFER(index) , ::metal_emu::buffer_index<index>
#define KNORM_ATTRIBUTE(name) \
  , ::metal_emu::thread_attribute<::metal_emu::ThreadAttribute::name>
#define KNORM_THREADGROUP_BUFFER(index) , ::metal_emu::threadgroup_index<index>
#define KNORM_THREADGROUP_ARRAY(type, name, count) \
  threadgroup type* name = ::metal_emu::threadgroup_array<type>(count, __func__)
#define KNORM_CONCAT_(a, b) a##b
#define KNORM_CONCAT(a, b) KNORM_CONCAT_(a, b)
#define KNORM_KERNEL_INSTANCE(host_name, ...)                      \
  static const ::metal_emu::KernelRegistration KNORM_CONCAT(      \
      knorm_kernel_registration_, __COUNTER__)(host_name, #__VA_ARGS__, &__VA_ARGS__);
