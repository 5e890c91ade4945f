// The emulator's ThreadSanitizer hooks (metal_emulator.h says how barriers
// order memory under it): whether it is on, a scope that hides the
// emulator's own synchronisation from it, and the happens-before edges of
// the barriers that order device memory. Without ThreadSanitizer they do
// nothing.
#pragma once

#if defined(__SANITIZE_THREAD__)
#define METAL_EMU_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define METAL_EMU_TSAN 1
#endif
#endif

#ifdef METAL_EMU_TSAN
// ThreadSanitizer's annotation interface (its runtime defines these).
extern "C" {
void AnnotateIgnoreSyncBegin(const char* file, int line);
void AnnotateIgnoreSyncEnd(const char* file, int line);
void __tsan_ignore_thread_begin();
void __tsan_ignore_thread_end();
void __tsan_acquire(void* address);
void __tsan_release(void* address);
}
#endif

namespace metal_emu {

#ifdef METAL_EMU_TSAN
constexpr bool kThreadSanitizer = true;
#else
constexpr bool kThreadSanitizer = false;
#endif

// Hides what the emulator itself does in its scope (its locks, its
// bookkeeping) from ThreadSanitizer, so that only the kernel's barriers order
// the kernel's memory accesses. Nothing without ThreadSanitizer.
class HiddenFromTsan {
 public:
#ifdef METAL_EMU_TSAN
  HiddenFromTsan() {
    AnnotateIgnoreSyncBegin(__FILE__, __LINE__);
    __tsan_ignore_thread_begin();
  }
  ~HiddenFromTsan() {
    __tsan_ignore_thread_end();
    AnnotateIgnoreSyncEnd(__FILE__, __LINE__);
  }
#else
  // User-provided, so that a scope's unused instance draws no warning.
  HiddenFromTsan() {}
  ~HiddenFromTsan() {}
#endif
  HiddenFromTsan(const HiddenFromTsan&) = delete;
  HiddenFromTsan& operator=(const HiddenFromTsan&) = delete;
};

// Under ThreadSanitizer, a happens-before edge from every thread's release
// of `order` to every later acquire of it; nothing without.
inline void tsan_release(void* order) {
#ifdef METAL_EMU_TSAN
  __tsan_release(order);
#else
  (void)order;
#endif
}

inline void tsan_acquire(void* order) {
#ifdef METAL_EMU_TSAN
  __tsan_acquire(order);
#else
  (void)order;
#endif
}

} // namespace metal_emu
