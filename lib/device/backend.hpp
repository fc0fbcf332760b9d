// The backend-neutral device interface: streams, work enqueued in stream order, completion
// callbacks, timing, memory. Implemented by the host backend (host_backend.cpp) and the CUDA
// backend (cuda_backend.cu). Internal to the library.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "splitflow/core/config.hpp"

namespace splitflow::detail {

/// Receives the execution intervals of a burst's work on the device, in steady_clock
/// nanoseconds. The host backend reports every kernel and copy as it runs; the CUDA backend
/// reports the burst's [start, end] from its events when it completes.
class ExecutionSink {
 public:
  virtual ~ExecutionSink() = default;
  virtual void exec_begin(std::int64_t t_ns) = 0;
  virtual void exec_end(std::int64_t t_ns) = 0;
  /// An execution interval reported after the fact (CUDA events), possibly out of order.
  virtual void exec_interval(std::int64_t t0_ns, std::int64_t t1_ns) = 0;
  /// A copy ran: direction (true: host to device), bytes, its execution time (0: unknown).
  virtual void copied(bool h2d, std::size_t bytes, std::int64_t ns) = 0;
  /// An op ran from t0 to t1 (for traces): 0 kernel, 1 H2D copy, 2 D2H copy. The host backend
  /// reports every op; CUDA reports each burst's event interval as one kernel.
  virtual void op_done(int kind, std::size_t bytes, std::int64_t t0, std::int64_t t1) = 0;
};

struct Stream;  // a backend's stream

/// Where a backend's kernels take their place on a device shared with other processes (the
/// arbiter's compute slots, DeviceConfig::arbiter): enter() blocks the backend thread until the
/// kernel may run, leave() gives the place back with the kernel's execution interval [t0, t1]
/// (steady ns), which the shared device's busy time counts.
class ComputeGate {
 public:
  virtual ~ComputeGate() = default;
  virtual void enter(int priority) = 0;
  virtual void leave(std::int64_t t0, std::int64_t t1) noexcept = 0;
};

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  virtual BackendKind kind() const noexcept = 0;
  virtual std::string name() const = 0;
  virtual int ordinal() const noexcept = 0;

  virtual Stream* create_stream() = 0;
  virtual void destroy_stream(Stream* s) noexcept = 0;
  /// cudaStream_t on CUDA, nullptr on host.
  virtual void* native(Stream* s) const noexcept = 0;
  /// The priority of the graph whose burst has the stream now (GraphOptions::priority): the
  /// host backend runs ready kernels of higher priority first; CUDA enqueues the burst on a
  /// stream of the device's matching priority (taken at burst_begin). Called under the pool's
  /// lock, possibly inside a device callback: it must not call the device runtime.
  virtual void set_priority(Stream*, int) noexcept {}
  /// Host backend: kernels take a place through `gate` (null: none) before they run. Set before
  /// any work is enqueued and cleared after all of it has completed. CUDA: ignored.
  virtual void set_compute_gate(ComputeGate*) noexcept {}

  // Work, in stream order. `sink` (may be null) is told when it executes.
  virtual void copy(Stream* s, void* dst, const void* src, std::size_t bytes, bool h2d,
                    ExecutionSink* sink) = 0;
  /// Host backend: runs fn on a compute slot. CUDA: throws.
  virtual void host_kernel(Stream* s, std::function<void()> fn, ExecutionSink* sink) = 0;
  /// Occupies a compute slot (host: a timer wait, no CPU burnt) or the whole device (CUDA: a
  /// globaltimer spin on every SM) for `d`.
  virtual void timed_kernel(Stream* s, std::chrono::nanoseconds d, ExecutionSink* sink) = 0;
  /// Calls fn (on a backend thread; it must not block or call the device) once all work
  /// enqueued on s before it has completed.
  virtual void callback(Stream* s, std::function<void()> fn) = 0;
  /// Marks the start of a burst on s. Returns a timer handle (CUDA: timing events; host:
  /// nullptr, executions are reported per op as they run).
  virtual void* burst_begin(Stream* s) = 0;
  /// Marks its end: `done` is called on a backend thread (it must not call the device) when all
  /// the burst's work has completed.
  virtual void burst_end(Stream* s, void* timer, std::function<void()> done) = 0;
  /// After `done`, on an ordinary thread: reports the burst's execution interval to `sink`
  /// (CUDA: from its events) and frees the timer.
  virtual void settle(void* timer, ExecutionSink* sink) noexcept = 0;

  // Memory. Device allocations are stream-ordered; frees may be called from any thread (but
  // not from a device callback). `users`: native streams of other libraries that used the
  // memory; the free is ordered after the work enqueued on them so far.
  virtual void* device_alloc(std::size_t bytes, Stream* s) = 0;
  virtual void device_free(void* p, std::size_t bytes, const std::vector<void*>& users) noexcept = 0;
  virtual void* pinned_alloc(std::size_t bytes) = 0;
  virtual void pinned_free(void* p) noexcept = 0;

  /// Time at least one kernel or copy was executing, since the backend started (steady ns).
  virtual std::int64_t busy_ns() const = 0;
};

/// Host backend: compute slots and one copy engine per direction, each served by host threads.
/// Freed device memory is kept for reuse (like a CUDA memory pool), up to `cache_bytes`.
std::unique_ptr<DeviceBackend> make_host_backend(int compute_slots, std::size_t cache_bytes);

/// The CUDA backend, a target of its own (splitflow::cuda, cuda_backend.cu) that registers
/// itself when the program starts; the core never links the CUDA runtime. The umbrella target
/// splitflow::splitflow links it whole, so that its registration is kept.
struct CudaBackendEntry {
  /// The backend on device `ordinal`. Throws Error if there is no usable device.
  std::unique_ptr<DeviceBackend> (*make)(int ordinal);
  /// Number of CUDA devices (0 when there is no driver or device); counts as a CUDA call.
  int (*device_count)() noexcept;
};
/// The registered CUDA backend, or nullptr when the program did not link it.
const CudaBackendEntry* cuda_backend() noexcept;
/// Called once by the CUDA target as the program starts; returns true (for a static's value).
bool register_cuda_backend(const CudaBackendEntry* entry) noexcept;

/// CUDA runtime calls made by this process through splitflow (tests check that a CPU-only
/// graph makes none).
std::uint64_t cuda_runtime_calls() noexcept;

/// True on a thread running a device completion callback: it must not call the CUDA runtime,
/// so frees made there are deferred (DeviceRuntime drains them on arena threads).
bool in_device_callback() noexcept;
/// Sets in_device_callback() for the scope (backends wrap their callbacks with it).
class DeviceCallbackScope {
 public:
  DeviceCallbackScope() noexcept;
  ~DeviceCallbackScope();
  DeviceCallbackScope(const DeviceCallbackScope&) = delete;
  DeviceCallbackScope& operator=(const DeviceCallbackScope&) = delete;
 private:
  bool outer_;
};

inline std::int64_t steady_now_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace splitflow::detail
