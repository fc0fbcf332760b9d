#include "splitflow/core/detail/clock.hpp"

#include <fcntl.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <cstdlib>

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

// Both clocks read at one instant: the tick reading between two steady_clock readings, the
// pair taken from the tightest of a few tries. A thread preempted between two plain reads
// would put the preemption (milliseconds on a loaded machine) into the calibration below,
// skewing every tick-based duration by its share of the 20 ms window.
struct Origin {
  Ticks ticks;
  std::int64_t ns;
};

Origin read_both() noexcept {
  if (!g_tsc_clock) return {0, steady_ns()};
  Origin best{0, 0};
  std::int64_t best_width = -1;
  for (int i = 0; i < 64; ++i) {
    const std::int64_t before = steady_ns();
    const Ticks t = now_ticks();
    const std::int64_t after = steady_ns();
    if (best_width < 0 || after - before < best_width) {
      best_width = after - before;
      best = {t, before + (after - before) / 2};
    }
    if (best_width < 2'000) break;  // within 2 us: good enough for a 20 ms window
  }
  return best;
}

// Read when the library loads (after g_tsc_clock: same file, defined above).
const Origin g_origin = read_both();

}  // namespace

double ns_per_tick() noexcept {
  static std::atomic<double> cached{0.0};
  double v = cached.load(std::memory_order_relaxed);
  if (v > 0) return v;
  if (!g_tsc_clock) return 1.0;
  // Measure over at least 20 ms since the library loaded (spinning only if asked sooner).
  Origin end;
  do {
    end = read_both();
  } while (end.ns - g_origin.ns < 20'000'000);
  v = static_cast<double>(end.ns - g_origin.ns) / static_cast<double>(end.ticks - g_origin.ticks);
  cached.store(v, std::memory_order_relaxed);
  return v;
}

std::int64_t steady_ns_of(Ticks t) noexcept {
  if (!g_tsc_clock) return t;
  return g_origin.ns + ticks_to_ns(t - g_origin.ticks);
}

std::int64_t thread_cpu_ns() noexcept {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return std::int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

namespace {
std::int64_t voluntary_switches() noexcept {
  rusage u{};
  return getrusage(RUSAGE_THREAD, &u) == 0 ? static_cast<std::int64_t>(u.ru_nvcsw) : 0;
}
}  // namespace

namespace {
thread_local std::int64_t t_contended_ns = 0;
}  // namespace

void add_contended_ns(std::int64_t ns) noexcept { t_contended_ns += ns > 0 ? ns : 0; }

namespace {
thread_local std::int64_t t_serial_ns = 0;

// The thread's time runnable, waiting for a CPU, from /proc/thread-self/schedstat ("<ns on a
// CPU> <ns runnable, waiting for one> <timeslices>"), read through a descriptor the thread
// keeps open; -1 where it cannot be read. (The first field lags for a thread that is running:
// its current slice is added at the next tick or switch; the CPU clock is exact. The wait is
// final once it runs.)
std::int64_t runnable_wait_ns() noexcept {
  struct Stat {
    int fd = ::open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
    ~Stat() {
      if (fd >= 0) ::close(fd);
    }
  };
  thread_local Stat stat;  // (closed when the thread ends)
  if (stat.fd < 0) return -1;
  char buf[96];
  const ssize_t n = ::pread(stat.fd, buf, sizeof buf - 1, 0);
  if (n <= 0) return -1;
  buf[n] = '\0';
  char* end = nullptr;
  (void)std::strtoll(buf, &end, 10);
  const long long waited = end ? std::strtoll(end, nullptr, 10) : 0;
  return waited > 0 ? static_cast<std::int64_t>(waited) : 0;
}
}  // namespace

namespace {
std::atomic<std::int64_t> g_serial_ns{0};  // (added to about once a millisecond per Python stage)
}  // namespace

void add_serial_ns(std::int64_t ns) noexcept {
  if (ns <= 0) return;
  t_serial_ns += ns;
  g_serial_ns.fetch_add(ns, std::memory_order_relaxed);
}

SerialFigures serial_figures() noexcept { return {t_serial_ns, t_contended_ns}; }

std::int64_t process_serial_ns() noexcept { return g_serial_ns.load(std::memory_order_relaxed); }

std::int64_t thread_demand_ns() noexcept {
  const std::int64_t waited = runnable_wait_ns();
  return thread_cpu_ns() + (waited > 0 ? waited : 0);
}

ThreadCpu thread_cpu() noexcept {
  // The CPU clock and the time runnable (schedstat): its demand.
  const std::int64_t waited = runnable_wait_ns();
  const std::int64_t cpu = thread_cpu_ns();
  return {cpu, cpu + (waited > 0 ? waited : 0), voluntary_switches(), t_contended_ns};
}

}  // namespace splitflow::detail
