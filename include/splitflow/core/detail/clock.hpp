// A cheap monotonic tick counter for per-invocation timing: the TSC on x86-64 when it is
// invariant (about 3x cheaper than steady_clock here), steady_clock nanoseconds otherwise.
#pragma once

#include <chrono>
#include <cstdint>
#if defined(__x86_64__)
#include <x86intrin.h>
#endif

namespace splitflow::detail {

using Ticks = std::int64_t;

extern const bool g_tsc_clock;  // decided once at load time

inline Ticks now_ticks() noexcept {
#if defined(__x86_64__)
  if (g_tsc_clock) return static_cast<Ticks>(__rdtsc());
#endif
  return std::chrono::steady_clock::now().time_since_epoch().count();
}

/// Nanoseconds per tick (1.0 when ticks are steady_clock nanoseconds). Calibrated once.
double ns_per_tick() noexcept;

inline std::int64_t ticks_to_ns(Ticks t) noexcept {
  return g_tsc_clock ? static_cast<std::int64_t>(static_cast<double>(t) * ns_per_tick()) : t;
}

/// The steady_clock time (nanoseconds since its epoch) of a tick reading: one timeline for
/// stage events and device events in traces.
std::int64_t steady_ns_of(Ticks t) noexcept;
/// The calling thread's CPU time (CLOCK_THREAD_CPUTIME_ID), in ns: a system call, not a tick.
std::int64_t thread_cpu_ns() noexcept;
/// The calling thread's CPU time and CPU demand, read together (one CPU clock read).
struct ThreadCpu {
  std::int64_t cpu_ns = 0;     ///< thread_cpu_ns()
  std::int64_t demand_ns = 0;  ///< cpu_ns plus the time it was runnable, waiting for a CPU
  /// The thread's voluntary context switches so far (getrusage: it blocked: slept, read, waited
  /// on a lock). A body between two readings that made none did not wait, whatever its wall
  /// time: on this project's VM the runnable time (schedstat) missed most of a spinning
  /// thread's wait for a CPU when threads outnumbered the cores.
  std::int64_t blocked = 0;
  /// What the thread has waited so far for a lock that computing threads hold (add_contended_ns).
  std::int64_t contended_ns = 0;
};
/// What a body measured from `at0` to `at1` over `wall_ns` waited: its wall time less its CPU
/// demand and its waits for contended locks, and none when it never blocked
/// (ThreadCpu::blocked).
inline std::int64_t waited_ns(const ThreadCpu& at0, const ThreadCpu& at1, std::int64_t wall_ns) noexcept {
  const std::int64_t busy = (at1.demand_ns - at0.demand_ns) + (at1.contended_ns - at0.contended_ns);
  return at1.blocked > at0.blocked && wall_ns > busy ? wall_ns - busy : 0;
}
/// The calling thread waited `ns` for a lock that computing threads hold (an interpreter's
/// GIL, taken by a Python stage's body): not a wait with nothing to compute (a read, a sleep)
/// but contention for others' CPU work, which more threads would not make faster; waited_ns
/// leaves it out, so the tuner does not move a Python stage that computes past the cores
/// (autotune::body_placement). Added by whoever takes such a lock (the Python module).
void add_contended_ns(std::int64_t ns) noexcept;
/// The calling thread held a lock that every body of the process shares (an interpreter's
/// GIL, taken by a Python stage's body) for `ns` of CPU demand: its time on a CPU and runnable
/// with the lock taken (a wait for I/O with the lock released, a sleep, is not counted). The
/// stages' summed holds bound a graph's rate, however many threads run them (autotune's
/// StageModel::serial_s). Added by whoever takes such a lock (the Python module).
void add_serial_ns(std::int64_t ns) noexcept;
/// What the calling thread has held the shared lock (add_serial_ns) and waited for it
/// (add_contended_ns) so far: read around a claim, the figures of its bodies.
struct SerialFigures {
  std::int64_t held_ns = 0;
  std::int64_t waited_ns = 0;
};
SerialFigures serial_figures() noexcept;
/// What all threads of the process have held the shared lock so far (add_serial_ns's sum):
/// read around a tuner's window, less its graph's stages' holds, the lock's time the graph's
/// model does not have (other graphs' Python bodies, its own stages it does not tune).
std::int64_t process_serial_ns() noexcept;
/// The calling thread's CPU demand so far (ThreadCpu::demand_ns, without the other readings).
std::int64_t thread_demand_ns() noexcept;
/// The calling thread's CPU time and its CPU demand in ns: its time on a CPU plus its time
/// runnable but waiting for one (/proc/thread-self/schedstat; demand = CPU time where that
/// cannot be read). Measured around a body, the demand tells a body that waits (sleeps, reads)
/// from one that computes on a busy machine, whose CPU time alone falls behind its wall time.
ThreadCpu thread_cpu() noexcept;

}  // namespace splitflow::detail
