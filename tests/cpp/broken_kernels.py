"""Deliberately broken copies of metal/, each with what must reject it: the
emulator's binding check, its threadgroup-memory model (stale data, write
conflicts), its kernel-scope check, ThreadSanitizer, the compiler, or the
strict MSL check (tests/msl/check.py, under "msl"). .ci/sanitize writes
them, builds a sanitizer driver over each (CMakeLists.txt,
MLX_KNORM_BROKEN_KERNELS_DIR) and checks that each it builds fails as
expected, while the real kernels pass; tests/test_msl_strict.py does the
same for the strict check: a check that no longer fails its broken kernel
has lost its teeth.

usage: broken_kernels.py write DIR
       broken_kernels.py check BUILD_DIR SANITIZER [RUNNER...]
(RUNNER: a command prefix for the drivers, such as setarch's)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

METAL_DIR = Path(__file__).resolve().parents[2] / "metal"


@dataclass(frozen=True)
class BrokenKernel:
    name: str
    # (file in metal/, text, replacement), applied in order; each text must
    # occur exactly once at its turn.
    edits: tuple[tuple[str, str, str], ...]
    # "compile": the kernels must not compile; "run": the driver's fixed
    # cases must fail; "msl": only the strict MSL check rejects it (the
    # emulator, laxer than Metal, runs it).
    fails_to: str
    # Per sanitizer checked: text that must all be in the build's or the
    # run's output. Checks that do not depend on the sanitizer run in the
    # ThreadSanitizer build alone. "msl": text that must all be in the
    # findings of the strict MSL check.
    expect: dict[str, tuple[str, ...]]


TSAN_RACE = "ThreadSanitizer: data race"

BROKEN_KERNELS = (
    # The order tree's build without the barrier between levels: a node
    # reads its children while other threads still write them.
    BrokenKernel(
        "order_tree_level_race",
        (("order_tree.h",
          "      // The level above reads these nodes.\n      threadgroup_barrier(mem_flags::mem_device);\n",
          ""),),
        "run",
        {"thread": (TSAN_RACE, "knorm_build_order_tree")},
    ),
    # The barrier between a wave's reads and its writes (knorm_move_rows):
    # the in-place temporal compaction writes rows that others still read.
    BrokenKernel(
        "missing_device_barrier",
        (("knorm_kernels.h",
          "        held[k] = in[ulong(src[at.row]) * width + at.unit];\n"
          "      }\n    }\n    threadgroup_barrier(mem_flags::mem_device);\n",
          "        held[k] = in[ulong(src[at.row]) * width + at.unit];\n"
          "      }\n    }\n"),),
        "run",
        {"thread": (TSAN_RACE, "knorm_move_rows")},
    ),
    # An off-by-one [[buffer(i)]]: the plan binds rows at 3.
    BrokenKernel(
        "wrong_buffer_index",
        (("key_norms.h", "constant uint& rows KNORM_BUFFER(3)", "constant uint& rows KNORM_BUFFER(4)"),),
        "run",
        {"thread": ("knorm_key_norms_float16_4 takes constant uint32& at [[buffer(4)]], which the launch does not bind",)},
    ),
    # The decode step's barrier after each SIMD group's worst row is
    # written, without mem_threadgroup: the other groups' rows are stale.
    BrokenKernel(
        "weak_threadgroup_barrier",
        (("evict_and_fill.h",
          "    worst[3 * simd_group + 2] = slot;\n  }\n  threadgroup_barrier(mem_flags::mem_threadgroup);\n",
          "    worst[3 * simd_group + 2] = slot;\n  }\n  threadgroup_barrier(mem_flags::mem_none);\n"),),
        "run",
        {"thread": (TSAN_RACE, "knorm_worst_slot"), "address": ("MISMATCH: evict_and_fill case in place, temporal",)},
    ),
    # Two lanes of each SIMD group writing its worst row, with no barrier
    # between them.
    BrokenKernel(
        "threadgroup_write_race",
        (("evict_and_fill.h",
          "  if (lane == 0) {\n    worst[3 * simd_group] = uint(rank >> 32);\n",
          "  if (lane < 2) {\n    worst[3 * simd_group] = uint(rank >> 32);\n"),),
        "run",
        {"thread": (TSAN_RACE, "knorm_worst_slot"),
         "address": ("of threadgroup memory with no barrier ordering threadgroup memory between",)},
    ),
    # The gather's barrier before the copies read the kept rows' indices,
    # without mem_device.
    BrokenKernel(
        "weak_device_barrier",
        (("protected_topk_gather.h",
          "  // moves in place overwrite norms the compaction read.\n"
          "  threadgroup_barrier(mem_flags::mem_device);\n",
          "  // moves in place overwrite norms the compaction read.\n"
          "  threadgroup_barrier(mem_flags::mem_threadgroup);\n"),),
        "run",
        {"thread": (TSAN_RACE, "knorm_copy_rows")},
    ),
    # The row copy of a split gather without its guard at a head's last row:
    # the last block reads indices and writes rows past the head's.
    BrokenKernel(
        "unguarded_copy_tail",
        (("protected_topk_gather.h",
          "  block.end = params.kept - block.begin > kSplitRows ? block.begin + kSplitRows : params.kept;\n",
          "  block.end = block.begin + kSplitRows;\n"),),
        "run",
        {"address": ("heap-buffer-overflow", "knorm_gather_rows")},
    ),
    # The same in the new rows of a split evict-and-fill step: the last
    # block reads new rows past the last head's.
    BrokenKernel(
        "unguarded_fill_tail",
        (("evict_and_fill.h",
          "  const uint end = n_new - begin > kSplitRows ? begin + kSplitRows : n_new;\n",
          "  const uint end = begin + kSplitRows;\n"),),
        "run",
        # Past a buffer's redzone when the dispatch writes one new row (the
        # temporal decode step's fill): freed memory rather than a redzone.
        {"address": ("AddressSanitizer: heap-", "knorm_fill_new_rows")},
    ),
    # The payload loop of a row move stopping one payload short: the last
    # payload of a moved row (a quantized cache's value biases) stays behind,
    # in the decode step's one row (knorm_move_row) and in the pairs of a
    # step evicting many (knorm_move_pairs).
    BrokenKernel(
        "last_payload_skipped",
        (("evict_and_fill.h",
          "    if (i < b.payloads) {\n      const ulong bytes = b.row_bytes[i];\n"
          "      knorm_copy_bytes(",
          "    if (i + 1 < b.payloads) {\n      const ulong bytes = b.row_bytes[i];\n"
          "      knorm_copy_bytes("),),
        "run",
        {"thread": ("MISMATCH: evict_and_fill case payloads output values[2]",)},
    ),
    BrokenKernel(
        "last_payload_skipped_in_pairs",
        (("evict_and_fill.h",
          "    if (i < b.payloads) {\n      const ulong bytes = b.row_bytes[i];\n"
          "      const KnormRowLanes",
          "    if (i + 1 < b.payloads) {\n      const ulong bytes = b.row_bytes[i];\n"
          "      const KnormRowLanes"),),
        "run",
        {"thread": ("MISMATCH: evict_and_fill case payloads output values[2]",)},
    ),
    # The caller's norms of the new rows dropped for zeros.
    BrokenKernel(
        "given_norms_ignored",
        (("evict_and_fill.h", "  return ((device const uint*)given)[j];\n", "  return 0u * ((device const uint*)given)[j];\n"),),
        "run",
        {"thread": ("MISMATCH: evict_and_fill case payloads output norms",)},
    ),
    # Padding rows ranked as real ones: a batch's padding kept over its
    # sequences' tokens, and counted as sinks and recent.
    BrokenKernel(
        "padding_ranked_as_real",
        (("evict_and_fill.h",
          "  if (p >= stored.first_real && p <= stored.last_real) {\n",
          "  if (p >= stored.first_real || p <= stored.last_real) {\n"),),
        "run",
        {"thread": ("MISMATCH: evict_and_fill case padding output",)},
    ),
    # The row copy of a split gather writing the prior rows of an output in
    # place again, from its own buffer, which other threadgroups write.
    BrokenKernel(
        "copy_ignores_in_place",
        (("protected_topk_gather.h",
          "                  begin, end, (in_place & 1u) != 0,\n",
          "                  begin, end, false,\n"),),
        "run",
        {"thread": (TSAN_RACE, "knorm_gather_rows")},
    ),
    # The temporal layout's wide compaction moving the rows of a payload in
    # place from the buffer it writes rather than from their staged copies:
    # blocks (and threads of one block) overwrite rows others still read.
    BrokenKernel(
        "compaction_unstaged",
        (("evict_and_fill.h",
          "    if (b.payload_in_place(i)) {\n      const device uchar* staged",
          "    if (false) {\n      const device uchar* staged"),),
        "run",
        {"thread": (TSAN_RACE, "knorm_compact_kept_rows")},
    ),
    # The cached ranks of a step where several rows leave written two slots
    # past the filled ones: past the [[threadgroup(0)]] length its plan set.
    BrokenKernel(
        "threadgroup_buffer_overrun",
        (("evict_and_fill.h",
          "      for (uint s = tid; s < filled; s += kEvictGroupSize) {\n"
          "        cached_ranks[s] = knorm_rank_of(stored, s);\n",
          "      for (uint s = tid; s < filled + 2; s += kEvictGroupSize) {\n"
          "        cached_ranks[s] = s < filled ? knorm_rank_of(stored, s) : ulong(0);\n"),),
        "run",
        {"thread": ("wrote past the end of [[threadgroup(0)]]", "knorm_evict_and_fill"),
         "address": ("wrote past the end of [[threadgroup(0)]]",)},
    ),
    # The decode step's reduction scratch declared in its helper rather than
    # in the kernel function.
    BrokenKernel(
        "threadgroup_array_in_helper",
        (("evict_and_fill.h", "  KNORM_THREADGROUP_ARRAY(uint, worst, 3 * kEvictSimdGroups);\n", ""),
         ("evict_and_fill.h", "    KnormEvictHead stored,\n    threadgroup uint* worst,\n", "    KnormEvictHead stored,\n"),
         ("evict_and_fill.h",
          "    uint simd_group) {\n  ulong rank = 0;\n",
          "    uint simd_group) {\n  KNORM_THREADGROUP_ARRAY(uint, worst, 3 * kEvictSimdGroups);\n  ulong rank = 0;\n"),
         ("evict_and_fill.h", "knorm_worst_slot(stored, worst, tid,", "knorm_worst_slot(stored, tid,")),
        "run",
        {"thread": ("threadgroup memory declared in knorm_worst_slot(), outside the kernel function "
                    "knorm_evict_and_fill()",),
         "msl": ("evict_and_fill.h", "threadgroup memory declared outside a kernel's scope")},
    ),
    # Two parameters at [[buffer(9)]], none at 10.
    BrokenKernel(
        "duplicate_buffer_index",
        (("protected_topk_gather.h", "KnormGatherParams& params KNORM_BUFFER(10)",
          "KnormGatherParams& params KNORM_BUFFER(9)"),),
        "compile",
        {"thread": ("two kernel parameters take the same [[buffer(i)]], [[threadgroup(i)]] or thread attribute",)},
    ),
    # Threadgroup memory where the kernel's helper takes a device pointer.
    BrokenKernel(
        "threadgroup_as_device_pointer",
        (("protected_topk_gather.h", "knorm_compact(head, cut, row_indices,", "knorm_compact(head, cut, simd_totals,"),),
        "compile",
        {"thread": ("volatile metal::uint*", "knorm_compact"), "msl": ("no matching function for call to 'knorm_compact'",)},
    ),
    # keydiff's running sum takes the row in before its score: each row is
    # compared with a sum that already holds it.
    BrokenKernel(
        "keydiff_sum_before_score",
        (("row_scores.h",
          "    } else if (real) {\n      const float denominator",
          "    } else if (real) {\n      if (norm != 0.0f) {\n        for (uint c = 0; c < kPerLane; ++c) {\n"
          "          sum[c] = knorm_flushed(sum[c] + knorm_flushed(precise::divide(k[c], norm)));\n"
          "        }\n      }\n      const float denominator"),),
        "run",
        {"thread": ("MISMATCH: row scores (keydiff) case fixed output 0",)},
    ),
    # The parameter that shipped named half, an MSL keyword.
    BrokenKernel(
        "half_parameter",
        (("order_tree.h", "device const int* tree_half, uint n, uint node) {\n"
                          "  return node >= n ? int(node - n) : tree_half[node];",
          "device const int* half, uint n, uint node) {\n  return node >= n ? int(node - n) : half[node];"),),
        "compile",
        {"thread": ("order_tree.h:71", "in expansion of macro"),
         "msl": ("order_tree.h:71", "invalid parameter name: '_Float16' is a keyword")},
    ),
    # Device memory where the kernel's helper takes a threadgroup pointer:
    # the emulator's threadgroup is volatile, to which a device pointer
    # converts, so only the strict check sees it.
    BrokenKernel(
        "device_as_threadgroup_pointer",
        (("protected_topk_gather.h", "knorm_compact(head, cut, row_indices, row_norms, norms_in_place,\n"
                                     "                simd_totals,",
          "knorm_compact(head, cut, row_indices, row_norms, norms_in_place,\n                row_indices,"),),
        "msl",
        {"msl": ("no matching function for call to 'knorm_compact'",)},
    ),
    # A program-scope constant outside the constant address space.
    BrokenKernel(
        "program_scope_variable_outside_constant",
        (("knorm_kernels.h", "constant constexpr uint kRadixBins = 256;", "constexpr uint kRadixBins = 256;"),),
        "msl",
        {"msl": ("'kRadixBins' has static storage outside the constant address space",)},
    ),
    # C++17, which MSL 3.x (C++14) lacks: a static_assert without a message
    # and if constexpr.
    BrokenKernel(
        "cxx17_constructs",
        (("key_norms.metal", 'static_assert(kKeyNormsMaxDim == 16 * kSimdWidth, "instantiate every count up to 16");',
          "static_assert(kKeyNormsMaxDim == 16 * kSimdWidth);"),
         ("order_tree.h", "  if (n >= 2) {\n", "  if constexpr (kGroupSize >= 2) {\n  }\n  if (n >= 2) {\n")),
        "msl",
        {"msl": ("[msl3, key_norms.metal] 'static_assert' with no message is a C++17 extension",
                 "[msl3, evict_and_fill.metal] constexpr if is a C++17 extension")},
    ),
    # A helper that calls itself: MSL has no recursion.
    BrokenKernel(
        "recursion",
        (("order_tree.h", ": tree_half[node];", ": knorm_tree_winner(tree_half, n, 2 * node);"),),
        "msl",
        {"msl": ("recursion: knorm_tree_winner -> knorm_tree_winner",)},
    ),
    # A kernel's buffer without its address space.
    BrokenKernel(
        "unqualified_kernel_pointer",
        (("key_norms.h", "    device float* norms KNORM_BUFFER(1),", "    float* norms KNORM_BUFFER(1),"),),
        "msl",
        {"msl": ("kernel parameter 'norms' names no device, constant or threadgroup address space",)},
    ),
    # A member function whose thread reference binds to a member through
    # `this`: MSL 3 compiles it, Metal 4.1's generic `this` does not.
    BrokenKernel(
        "thread_reference_through_generic_this",
        (("order_tree.h", "struct KnormTreeKeys {\n  KnormEvictHead rows;\n  uint count;\n",
          "struct KnormTreeKeys {\n  KnormEvictHead rows;\n  uint count;\n"
          "  thread uint& counted() {\n    return count;\n  }\n"),),
        "msl",
        {"msl": ("[metal4.1, evict_and_fill.metal] binding reference of type '__private uint'",
                 "to value of type '__generic uint'")},
    ),
)


def broken_sources(kernel: BrokenKernel, metal_dir: Path = METAL_DIR) -> dict[str, str]:
    """The files of metal/ that `kernel` changes, as it has them."""
    files: dict[str, str] = {}
    for name, text, replacement in kernel.edits:
        source = files.get(name, (metal_dir / name).read_text())
        count = source.count(text)
        if count != 1:
            raise ValueError(f"{kernel.name}: {text!r} occurs {count} times in metal/{name}, not once")
        files[name] = source.replace(text, replacement)
    return files


def write(out_dir: Path) -> None:
    """The broken copies a sanitizer build checks (not those only the strict
    MSL check rejects)."""
    shutil.rmtree(out_dir, ignore_errors=True)
    for kernel in (k for k in BROKEN_KERNELS if set(k.expect) - {"msl"}):
        metal = out_dir / kernel.name / "metal"
        shutil.copytree(METAL_DIR, metal)
        for name, source in broken_sources(kernel).items():
            (metal / name).write_text(source)


def build(build_dir: Path, targets: list[str]) -> subprocess.CompletedProcess:
    jobs = os.environ.get("JOBS", "2")
    return subprocess.run(
        ["cmake", "--build", str(build_dir), "-j", jobs, "--target", *targets],
        capture_output=True, text=True)


def caught(kernel: BrokenKernel, output: str, expected: tuple[str, ...]) -> bool:
    missing = [text for text in expected if text not in output]
    if missing:
        print(output, file=sys.stderr)
        print(f"{kernel.name} failed, but without {missing}", file=sys.stderr)
        return False
    lines = output.splitlines()
    line = next((line for line in lines if line.startswith("SUMMARY:")), None) or next(
        line for line in lines if expected[0] in line)
    print(f"caught {kernel.name}: {line.strip()}")
    return True


def check(build_dir: Path, sanitizer: str, runner: list[str]) -> bool:
    kernels = [k for k in BROKEN_KERNELS if sanitizer in k.expect]
    running = [k for k in kernels if k.fails_to == "run"]
    built = build(build_dir, [f"knorm_sanitize_driver_{k.name}" for k in running])
    if built.returncode != 0:
        print(built.stdout + built.stderr, file=sys.stderr)
        print("the broken kernels meant to run did not build", file=sys.stderr)
        return False
    ok = True
    env = dict(os.environ, TSAN_OPTIONS="halt_on_error=1", ASAN_OPTIONS="detect_leaks=0:abort_on_error=1")
    for kernel in running:
        driver = build_dir / f"knorm_sanitize_driver_{kernel.name}"
        run = subprocess.run([*runner, str(driver), "0", "1"], capture_output=True, text=True, env=env)
        if run.returncode == 0:
            print(f"{kernel.name} passed: nothing rejects it any more", file=sys.stderr)
            ok = False
        else:
            ok = caught(kernel, run.stdout + run.stderr, kernel.expect[sanitizer]) and ok
    for kernel in (k for k in kernels if k.fails_to == "compile"):
        built = build(build_dir, [f"knorm_emulated_kernels_{kernel.name}"])
        if built.returncode == 0:
            print(f"{kernel.name} compiled: nothing rejects it any more", file=sys.stderr)
            ok = False
        else:
            ok = caught(kernel, built.stdout + built.stderr, kernel.expect[sanitizer]) and ok
    return ok


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "write":
        write(Path(argv[1]))
        return 0
    if len(argv) >= 3 and argv[0] == "check":
        return 0 if check(Path(argv[1]), argv[2], argv[3:]) else 1
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
