"""The strict MSL check's mutation suite: changes to the real sources under
metal/ that Apple's Metal compiler rejects (or that are GPU undefined
behaviour), each named with the rule it breaks, and legal changes it must
accept. tests/test_msl_strict.py applies each (with
tests/cpp/broken_kernels.py's broken_sources, whose edit format this shares:
(file in metal/, text that occurs once, replacement)) and runs the check;
tests/cpp/broken_kernels.py's kernels with an "msl" expectation count too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    rule: str  # the MSL rule it breaks (Metal Shading Language Specification section)
    edits: tuple[tuple[str, str, str], ...]
    expect: tuple[str, ...]  # text that must all be in the check's findings


@dataclass(frozen=True)
class Control:
    name: str
    why: str  # why Apple's compiler accepts it
    edits: tuple[tuple[str, str, str], ...]


# Anchors in the real sources.
KN_BODY = "  const uint row = group * kKeyNormsRowsPerGroup + simd_group;\n"
KN_ROWS = "    constant uint& rows KNORM_BUFFER(3),\n"
KN_LANE = "    uint lane KNORM_ATTRIBUTE(thread_index_in_simdgroup),\n"
KN_GROUP = "    uint group KNORM_ATTRIBUTE(threadgroup_position_in_grid),\n"
KN_STORE = "    norms[row] = norm;\n"
KN_TEMPLATE = "template <typename T, uint kPerLane>\n[[kernel"
GATHER_SOURCES = "    threadgroup uint* sources KNORM_THREADGROUP_BUFFER(1),\n"
GATHER_BARRIER = ("  // moves in place overwrite norms the compaction read.\n"
                  "  threadgroup_barrier(mem_flags::mem_device);\n")
GATHER_CHUNK_BARRIER = ("    prior_kept += n;\n    // The list is read before the next chunk writes it.\n"
                        "    threadgroup_barrier(mem_flags::mem_threadgroup);\n")
KN = "key_norms.h"
GATHER = "protected_topk_gather.h"

MUTANTS = (
    # Scalar types (section 2.1: bool, char, short, int, long, half, bfloat, float).
    Mutant("double_local", "2.1: MSL has no double",
           ((KN, "  const float norm = knorm_row_norm", "  const double norm = knorm_row_norm"),),
           ("[msl3, key_norms.metal] 'double': MSL has no double",)),
    Mutant("long_double_local", "2.1: MSL has no long double",
           ((KN, KN_BODY, KN_BODY + "  const long double scale = 1.0f;\n  (void)scale;\n"),),
           ("[msl3, key_norms.metal] 'double': MSL has no long double",)),
    Mutant("long_long_local", "2.1: MSL has no long long",
           ((KN, KN_BODY, "  const long long row = group * kKeyNormsRowsPerGroup + simd_group;\n"),),
           ("[msl3, key_norms.metal] 'long': MSL has no long long",)),
    Mutant("long_long_literal", "2.1: MSL has no long long",
           ((KN, "keys + ulong(row) * dim,", "keys + ulong(row) * dim * 1ULL,"),),
           ("[msl3, key_norms.metal] '1ULL': MSL has no long long literal",)),
    Mutant("implicit_float_to_bfloat", "2.1, 2.13: a conversion to bfloat is explicit",
           ((KN, KN_STORE, "    const bfloat rounded = norm;\n    norms[row] = rounded;\n"),),
           ("[msl3, key_norms.metal] cannot initialize a variable of type 'const knorm_msl_bfloat' with an lvalue "
            "of type 'const float'",)),
    # Attributes and the types they take (section 5.2).
    Mutant("buffer_index_past_30", "5.2.1: buffer indices are 0-30",
           ((KN, KN_ROWS, "    constant uint& rows KNORM_BUFFER(31),\n"),),
           ("[msl3, key_norms.metal] [[buffer(31)]] of 'rows': buffer indices are 0-30",)),
    Mutant("buffer_index_twice", "5.2.1: one buffer index per kernel argument",
           ((KN, KN_ROWS, "    constant uint& rows KNORM_BUFFER(2),\n"),),
           ("[[buffer(2)]] of 'rows' is also 'dim''s",)),
    Mutant("threadgroup_index_past_30", "5.2.1: threadgroup indices are 0-30",
           ((GATHER, GATHER_SOURCES, "    threadgroup uint* sources KNORM_THREADGROUP_BUFFER(31),\n"),),
           ("[[threadgroup(31)]] of 'sources': threadgroup indices are 0-30",)),
    Mutant("buffer_on_threadgroup_pointer", "5.2.1: [[buffer]] takes device or constant memory",
           ((GATHER, GATHER_SOURCES, "    threadgroup uint* sources KNORM_BUFFER(11),\n"),),
           ("[[buffer(11)]] takes a pointer or reference to device or constant memory",)),
    Mutant("simd_lane_as_float", "5.2.3.6: [[thread_index_in_simdgroup]] is ushort or uint",
           ((KN, KN_LANE, "    float lane KNORM_ATTRIBUTE(thread_index_in_simdgroup),\n"),),
           ("[[thread_index_in_simdgroup]] takes ushort or uint, not 'float'",)),
    Mutant("simd_width_as_float", "5.2.3.6: [[threads_per_simdgroup]] is ushort or uint",
           ((KN, KN_LANE, KN_LANE + "    float width KNORM_ATTRIBUTE(threads_per_simdgroup),\n"),),
           ("[[threads_per_simdgroup]] takes ushort or uint, not 'float'",)),
    Mutant("scalar_and_vector_positions", "5.2.3.6: a kernel's positions have one width",
           ((KN, KN_GROUP, KN_GROUP + "    uint2 grid KNORM_ATTRIBUTE(threads_per_grid),\n"),),
           ("kernel 'knorm_key_norms' mixes positions of [1, 2] components",)),
    Mutant("position_of_four_components", "5.2.3.6: a position has at most 3 components",
           ((KN, KN_GROUP, "    uint4 group4 KNORM_ATTRIBUTE(threadgroup_position_in_grid),\n"),
            (KN, KN_BODY, "  const uint group = group4.x;\n" + KN_BODY)),
           ("[[threadgroup_position_in_grid]] takes ushort or uint, or a 2- or 3-vector of them, not 'uint4'",)),
    Mutant("kernel_argument_without_attribute", "5.2.1: a kernel argument is a resource or a thread attribute",
           ((KN, KN_ROWS, KN_ROWS + "    uint stride,\n"),),
           ("kernel parameter 'stride' needs exactly one MSL attribute",)),
    Mutant("thread_attribute_on_helper", "5.2.3.6: thread attributes are a kernel's",
           (("row_scores.h", "device const int* valid, uint head,\n",
             "device const int* valid, uint head KNORM_ATTRIBUTE(threadgroup_position_in_grid),\n"),),
           ("[[threadgroup_position_in_grid]] on 'head' of 'knorm_score_row_real', which is not a kernel",)),
    # C++ that MSL 3.x does not have (section 1.4.1), each rejected by the msl3 mode itself.
    Mutant("virtual_function", "1.4.1: no virtual functions",
           ((KN, KN_TEMPLATE, "struct KnormShape {\n  virtual uint count() const thread {\n    return 0;\n  }\n};\n\n"
                              + KN_TEMPLATE),),
           ("[msl3, key_norms.metal] 'virtual': MSL has no virtual functions",)),
    Mutant("throw", "1.4.1: no exceptions",
           ((KN, KN_BODY, KN_BODY + "  if (dim == 0) {\n    throw 0;\n  }\n"),),
           ("[msl3, key_norms.metal] cannot use 'throw' with exceptions disabled",)),
    Mutant("new_and_delete", "1.4.1: no new or delete operators",
           ((KN, KN_BODY, KN_BODY + "  thread float* scratch = new float[4];\n  delete[] scratch;\n"),),
           ("[msl3, key_norms.metal] 'new': MSL has no new operator",
            "[msl3, key_norms.metal] 'delete': MSL has no delete operator")),
    Mutant("thread_local", "1.4.1: no thread_local storage",
           ((KN, KN_BODY, KN_BODY + "  static thread_local uint seen = 0;\n  seen = row;\n"),),
           ("[msl3, key_norms.metal] 'thread_local': MSL has no thread_local storage",)),
    Mutant("goto", "1.4.1: no goto",
           ((KN, "  if (row >= rows) {\n    return;\n  }\n", "  if (row >= rows) {\n    goto done;\n  }\ndone:\n"),),
           ("[msl3, key_norms.metal] 'goto': MSL has no goto",)),
    Mutant("typeid", "1.4.1: no run-time type identification",
           ((KN, KN_BODY, KN_BODY + "  (void)typeid(row);\n"),),
           ("[msl3, key_norms.metal] 'typeid': MSL has no run-time type identification",)),
    Mutant("wide_character", "2.1: MSL has no wchar_t",
           ((KN, KN_BODY, KN_BODY + "  const wchar_t mark = L'k';\n  (void)mark;\n"),),
           ("[msl3, key_norms.metal] 'wchar_t': MSL has no wide characters",)),
    Mutant("write_through_constant", "4.2: the constant address space is read-only",
           ((KN, KN_BODY, "  dim = 0;\n" + KN_BODY),),
           ("[msl3, key_norms.metal] cannot assign to variable 'dim' with const-qualified type",)),
    Mutant("uninitialized_program_scope_constant", "4.2: a program-scope constant is initialized",
           ((KN, KN_TEMPLATE, "constant uint kUnset;\n\n" + KN_TEMPLATE),),
           ("[msl3, key_norms.metal] default initialization of an object of const type",)),
    Mutant("host_header", "1.4.1: no C++ standard library (Metal's own headers only)",
           ((KN, '#include "knorm_kernels.h"\n', '#include "knorm_kernels.h"\n#include <cmath>\n'),),
           ("[msl3, key_norms.metal] 'cmath' file not found", "[metal4.1, key_norms.metal] 'cmath' file not found")),
    # Metal 4.1's -Wmetal-addr-spaces (ml-explore/mlx#3963); MSL 3 rejects the call outright.
    Mutant("unqualified_member_through_device", "4.1 (Metal 4.1): member functions called through device "
                                                 "memory carry its address space",
           ((KN, KN_TEMPLATE, "struct KnormPair {\n  float first;\n  float get() const {\n    return first;\n  }\n};\n\n"
                              + KN_TEMPLATE),
            (KN, KN_STORE, "    norms[row] = ((device const KnormPair*)keys)->get() + norm;\n")),
           ("[metal4.1, key_norms.metal] 'get' has no address-space qualifier and is called through device memory",
            "[msl3, key_norms.metal] 'this' argument to member function 'get' has type 'device KnormPair const'")),
    # Barriers (section 6.9.1: every thread of the threadgroup or none).
    Mutant("barrier_in_thread_branch", "6.9.1: a threadgroup barrier in thread-dependent control flow",
           ((GATHER, GATHER_CHUNK_BARRIER,
             "    prior_kept += n;\n    if (tid < n) {\n"
             "      threadgroup_barrier(mem_flags::mem_threadgroup);\n    }\n"),),
           ("threadgroup_barrier under varying control flow (the condition at protected_topk_gather.h:",)),
    Mutant("barrier_after_thread_return", "6.9.1: a threadgroup barrier after some threads returned",
           ((GATHER, GATHER_BARRIER, "  if (lane == 0 && kept == 0) {\n    return;\n  }\n" + GATHER_BARRIER),),
           ("threadgroup_barrier under varying control flow (a return at protected_topk_gather.h:",)),
    Mutant("barrier_in_thread_counted_loop", "6.9.1: a threadgroup barrier in a loop each thread runs its own "
                                              "number of times",
           ((GATHER, "  for (uint base = 0; base < head.kept; base += kGatherGroupSize) {\n    const uint p = base + tid;\n",
             "  for (uint base = tid; base < head.kept; base += kGatherGroupSize) {\n    const uint p = base;\n"),),
           ("runs a varying number of times",)),
    Mutant("barrier_after_thread_break", "6.9.1: a threadgroup barrier in a loop some threads left",
           ((GATHER, "    if (n == 0) {\n      break;\n    }\n", "    if (src[0] == tid) {\n      break;\n    }\n"),),
           ("threadgroup_barrier under varying control flow (a break at protected_topk_gather.h:",)),
    Mutant("barrier_call_in_thread_branch", "6.9.1: a call reaching a threadgroup barrier in thread-dependent "
                                             "control flow",
           ((GATHER, "  knorm_compact(head, cut, row_indices, row_norms, norms_in_place,\n"
                     "                simd_totals, tid, lane, simd_group);\n",
             "  if (lane < 16) {\n    knorm_compact(head, cut, row_indices, row_norms, norms_in_place,\n"
             "                  simd_totals, tid, lane, simd_group);\n  }\n"),),
           ("call to 'knorm_compact', which reaches a threadgroup_barrier, under varying control flow",)),
    Mutant("barrier_under_threadgroup_data", "6.9.1: a threadgroup barrier under a condition on threadgroup "
                                              "memory, not proven uniform",
           ((GATHER, GATHER_BARRIER, "  if (picked[0] != 0u) {\n  " + GATHER_BARRIER + "  }\n"),),
           ("threadgroup_barrier under varying control flow (the condition at protected_topk_gather.h:",)),
)

CONTROLS = (
    Control("local_named_vec", "vec is a template of the Metal library, not a keyword: a local may take "
                               "the name", ((KN, "  if (lane == 0) {\n" + KN_STORE,
                                             "  const uint vec = lane;\n  if (vec == 0) {\n" + KN_STORE),)),
    Control("const_constant_reference", "MLX's `const constant T&` idiom: constant and const together",
            ((KN, KN_ROWS, "    const constant uint& rows KNORM_BUFFER(3),\n"),)),
    Control("ushort_simd_lane", "MLX's `ushort simd_lane_id [[thread_index_in_simdgroup]]`",
            ((KN, KN_LANE, "    ushort lane KNORM_ATTRIBUTE(thread_index_in_simdgroup),\n"),)),
    Control("vector_position", "MLX's `uint3 tid [[threadgroup_position_in_grid]]`",
            ((KN, KN_GROUP, "    uint3 group3 KNORM_ATTRIBUTE(threadgroup_position_in_grid),\n"),
             (KN, KN_BODY, "  const uint group = group3.x;\n" + KN_BODY))),
    Control("thread_execution_width", "a thread attribute of section 5.2.3.6",
            ((KN, KN_LANE, KN_LANE + "    ushort width KNORM_ATTRIBUTE(thread_execution_width),\n"),)),
    Control("explicit_bfloat", "a conversion to bfloat written out, and bfloat widened to float implicitly",
            ((KN, KN_STORE, "    const bfloat rounded = bfloat(norm);\n    norms[row] = rounded;\n"),)),
    Control("always_inline_helper", "MLX's METAL_FUNC: inline __attribute__((always_inline))",
            (("row_scores.h", "inline bool knorm_score_row_real(",
              "inline __attribute__((always_inline)) bool knorm_score_row_real("),)),
    Control("barrier_under_constant_condition", "a condition on constant memory is the same in every thread",
            ((GATHER, GATHER_BARRIER, "  if (kept > 0u) {\n  " + GATHER_BARRIER + "  }\n"),)),
    Control("barrier_in_uniform_loop", "a loop every thread runs the same number of times",
            ((GATHER, GATHER_BARRIER, "  for (uint pass = 0; pass < 2u; ++pass) {\n  " + GATHER_BARRIER + "  }\n"),)),
    Control("marked_uniform_condition", "a condition the source vouches for with msl-uniform",
            ((GATHER, GATHER_BARRIER, "  if (picked[0] != 0u) {  // msl-uniform: read after the select's barrier\n  "
              + GATHER_BARRIER + "  }\n"),)),
)
