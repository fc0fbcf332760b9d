#include "splitflow/detail/clock.hpp"

#include <atomic>
#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace splitflow::detail {
namespace {

bool invariant_tsc() noexcept {
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0x80000000u, &a, &b, &c, &d) || a < 0x80000007u) return false;
  __get_cpuid(0x80000007u, &a, &b, &c, &d);
  return (d & (1u << 8)) != 0;  // "invariant TSC": constant rate, runs in every C-state
#else
  return false;
#endif
}

}  // namespace

const bool g_tsc_clock = invariant_tsc();

namespace {

std::int64_t steady_ns() noexcept {
  return std::chrono::steady_clock::now().time_since_epoch().count();
}

// Both clocks read when the library loads (after g_tsc_clock: same file, defined above).
struct Origin {
  Ticks ticks;
  std::int64_t ns;
};
const Origin g_origin{g_tsc_clock ? now_ticks() : 0, steady_ns()};

}  // namespace

double ns_per_tick() noexcept {
  static std::atomic<double> cached{0.0};
  double v = cached.load(std::memory_order_relaxed);
  if (v > 0) return v;
  if (!g_tsc_clock) return 1.0;
  // Measure over at least 20 ms since the library loaded (spinning only if asked sooner).
  Ticks t;
  std::int64_t ns;
  do {
    t = now_ticks();
    ns = steady_ns();
  } while (ns - g_origin.ns < 20'000'000);
  v = static_cast<double>(ns - g_origin.ns) / static_cast<double>(t - g_origin.ticks);
  cached.store(v, std::memory_order_relaxed);
  return v;
}

std::int64_t steady_ns_of(Ticks t) noexcept {
  if (!g_tsc_clock) return t;
  return g_origin.ns + ticks_to_ns(t - g_origin.ticks);
}

}  // namespace splitflow::detail
