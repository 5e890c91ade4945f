"""Deliberately broken copies of metal/, each with what must reject it: the
emulator's binding check, its threadgroup-memory model (stale data, write
conflicts), its kernel-scope check, ThreadSanitizer, or the compiler. .ci/sanitize writes them, builds a
sanitizer driver over each (CMakeLists.txt, MLX_KNORM_BROKEN_KERNELS_DIR)
and checks that each fails as expected, while the real kernels pass: a check
that no longer fails its broken kernel has lost its teeth.

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
    # cases must fail.
    fails_to: str
    # Per sanitizer checked: text that must all be in the build's or the
    # run's output. Checks that do not depend on the sanitizer run in the
    # ThreadSanitizer build alone.
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
                    "knorm_evict_and_fill()",)},
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
        {"thread": ("volatile metal::uint*", "knorm_compact")},
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
    shutil.rmtree(out_dir, ignore_errors=True)
    for kernel in BROKEN_KERNELS:
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
