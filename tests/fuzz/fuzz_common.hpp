// What the fuzz targets share (docs/reliability.md, "Fuzzing"): a check that aborts (libFuzzer
// then saves the input), the rule that every error names the file it is about, and a heap
// meter for the decoders' allocation bound.
#pragma once

#include <sanitizer/allocator_interface.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "splitflow/core/error.hpp"

namespace fuzz {

[[noreturn]] inline void fail(const char* what, const char* file, int line) {
  std::fprintf(stderr, "fuzz check failed: %s (%s:%d)\n", what, file, line);
  std::abort();
}
#define FUZZ_CHECK(cond) ((cond) ? (void)0 : ::fuzz::fail(#cond, __FILE__, __LINE__))

/// The name the targets give their input; every splitflow::Error about it must contain it.
inline constexpr const char* kName = "fuzz-input.jpg";

inline void check_names(const splitflow::Error& e, const char* name = kName) {
  if (!std::strstr(e.what(), name)) {
    std::fprintf(stderr, "fuzz check failed: an error does not name '%s': %s\n", name, e.what());
    std::abort();
  }
}

inline bool verbose() {
  static const bool v = std::getenv("FUZZ_VERBOSE") != nullptr;
  return v;
}

// ---- heap meter: the live heap bytes, and the most seen since reset() ----------------------------
// Counted by ASan's malloc/free hooks (every allocation, libjpeg's included).
namespace heap {
inline std::atomic<std::int64_t> live{0};
inline std::atomic<std::int64_t> peak{0};
inline void on_malloc(const volatile void*, std::size_t size) {
  const std::int64_t now = live.fetch_add(static_cast<std::int64_t>(size)) + static_cast<std::int64_t>(size);
  std::int64_t p = peak.load(std::memory_order_relaxed);
  while (now > p && !peak.compare_exchange_weak(p, now)) {
  }
}
inline void on_free(const volatile void* ptr) {
  if (ptr) live.fetch_sub(static_cast<std::int64_t>(__sanitizer_get_allocated_size(ptr)));
}
inline void install() {
  static const bool done = (__sanitizer_install_malloc_and_free_hooks(on_malloc, on_free), true);
  (void)done;
}
/// Starts a measurement; the result is peak_since() bytes above the live heap at this point.
inline std::int64_t reset() {
  const std::int64_t now = live.load();
  peak.store(now);
  return now;
}
inline std::int64_t peak_since(std::int64_t base) { return peak.load() - base; }
}  // namespace heap

}  // namespace fuzz
