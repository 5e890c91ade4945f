// Large fresh outputs come straight from mmap (MLX's CPU allocator keeps no
// cache on Linux and glibc maps big blocks afresh), so every call faults its
// output in 4 KiB at a time; on the decode sizes of the benchmark the faults
// cost more than writing the bytes. Asking for transparent huge pages on the
// 2 MiB-aligned interior cuts the faults 512-fold. Advice only: without THP
// (or off Linux) nothing changes.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace mlx_knorm {

inline void prefer_huge_pages(void* data, size_t nbytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t huge_page = uintptr_t(2) << 20;
  const uintptr_t start = reinterpret_cast<uintptr_t>(data);
  const uintptr_t begin = (start + huge_page - 1) & ~(huge_page - 1);
  const uintptr_t end = (start + nbytes) & ~(huge_page - 1);
  if (end > begin) {
    madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
  }
#else
  (void)data;
  (void)nbytes;
#endif
}

} // namespace mlx_knorm
