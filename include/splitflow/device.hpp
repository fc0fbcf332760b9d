// The device side of a GPU stage: what its body gets (DeviceContext), what a CPU stage feeding
// it may write into (HostAllocator), and the figures the runtime keeps (held vs busy).
//
//     auto norm = g.gpu_stage("normalize", [](splitflow::DeviceTensor in, splitflow::DeviceContext& ctx) {
//       return splitflow::ops::normalize(ctx, in, mean, stddev);   // enqueued on ctx's stream
//     });
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "splitflow/config.hpp"
#include "splitflow/tensor.hpp"

namespace splitflow {

namespace detail {
class Burst;
class PinnedRing;
}  // namespace detail

const char* to_string(BackendKind k) noexcept;

/// Whether this build has the CUDA backend (SPLITFLOW_WITH_CUDA resolved to ON).
bool built_with_cuda() noexcept;
/// CUDA devices usable by this process: 0 without a CUDA build, a driver or a GPU. This call
/// initialises the CUDA runtime (do not call it before forking data-loader workers).
int cuda_device_count() noexcept;
/// CUDA runtime calls splitflow made in this process: 0 while only CPU graphs ran (the device
/// is created lazily), which is what makes forked data-loader workers safe.
std::uint64_t cuda_runtime_calls() noexcept;

/// Given to a GPU stage body for one invocation: the stream it leased for this kernel burst,
/// the device allocator and copies. Everything is enqueued on the stream; the stage's output is
/// emitted when the stream's work completes, and the stream goes back to the pool then.
/// Valid only during the body.
class DeviceContext {
 public:
  explicit DeviceContext(detail::Burst& burst) noexcept : burst_(&burst) {}

  BackendKind backend() const noexcept;
  int device() const noexcept;
  /// The leased stream: a cudaStream_t on the CUDA backend, nullptr on the host backend.
  void* native_stream() const noexcept;
  const std::string& stage() const noexcept;
  std::uint64_t item() const noexcept;

  /// Device memory from the runtime's capped pool, freed in stream order with the tensor.
  /// Throws splitflow::Error (naming the stage and item) when the pool cap would be exceeded.
  DeviceTensor alloc(DType dtype, std::vector<std::int64_t> shape);
  /// Asynchronous host-to-device copy of `src` into new device memory; `src` is kept alive
  /// until the copy has run.
  DeviceTensor to_device(const HostTensor& src);
  /// Asynchronous device-to-host copy into pinned memory (the stage's output ring, or the
  /// pinned pool). The result is complete when the stage emits it.
  HostTensor to_host(const DeviceTensor& src);
  /// Copies between existing tensors of equal byte size, asynchronously.
  void copy(DeviceTensor& dst, const HostTensor& src);
  void copy(HostTensor& dst, const DeviceTensor& src);
  /// Host backend: runs `kernel` on a compute slot in stream order. (On CUDA, launch kernels on
  /// native_stream() instead; this throws there.)
  void host_kernel(std::function<void()> kernel);

  detail::Burst& burst() const noexcept { return *burst_; }

 private:
  detail::Burst* burst_;
};

/// Passed to a CPU stage body declared as `HostTensor(In, HostAllocator&)`. When the stage feeds
/// a GPU stage, empty() returns space in the pinned ring between them, so the body writes its
/// output where the H2D copy reads it (no staging copy). Otherwise it returns host memory.
class HostAllocator {
 public:
  HostAllocator() = default;
  explicit HostAllocator(detail::PinnedRing* ring, const std::string* stage, std::uint64_t item)
      : ring_(ring), stage_(stage), item_(item) {}
  /// One output tensor per item. Throws splitflow::Error if it exceeds the ring's item size.
  HostTensor empty(DType dtype, std::vector<std::int64_t> shape);
  bool ring_backed() const noexcept { return ring_ != nullptr; }

 private:
  detail::PinnedRing* ring_ = nullptr;
  const std::string* stage_ = nullptr;
  std::uint64_t item_ = 0;
};

/// GPU figures of one graph's run.
struct GpuStats {
  std::int64_t held_ns = 0;   ///< union of the graph's stream-lease intervals
  std::int64_t busy_ns = 0;   ///< union of its kernels' and copies' execution on the device
  std::uint64_t bursts = 0;   ///< GPU-stage invocations (one lease each)
  std::int64_t lease_wait_ns = 0;  ///< summed time its invocations waited for a stream
  std::int64_t max_lease_wait_ns = 0;  ///< longest single wait
  std::uint64_t h2d_bytes = 0, d2h_bytes = 0;
  std::int64_t h2d_ns = 0, d2h_ns = 0;  ///< summed execution time of those copies
  std::uint64_t staging_copies = 0;     ///< host tensors copied into a ring (not written there)
  /// The device as a whole (every graph's work) during this run, not over its lifetime:
  /// DeviceStats' figures between the run's start and its end (or the snapshot).
  std::int64_t device_wall_ns = 0, device_busy_ns = 0;
  double device_mean_leases = 0;      ///< streams leased, averaged over the run
  std::size_t device_max_leases = 0;  ///< most streams leased at once during the run
  std::size_t device_streams = 0;
  /// held / busy: 1.0 means the GPU was held only while it worked.
  double held_over_busy() const noexcept {
    return busy_ns > 0 ? static_cast<double>(held_ns) / static_cast<double>(busy_ns) : 0.0;
  }
};

/// The runtime's device, shared by all its graphs.
struct DeviceStats {
  std::string name;
  BackendKind backend = BackendKind::host;
  std::int64_t wall_ns = 0;          ///< since the device was initialised
  std::int64_t busy_ns = 0;          ///< time with at least one kernel or copy executing
  std::int64_t held_ns = 0;          ///< time with at least one stream leased (by any graph)
  std::size_t streams = 0;
  std::size_t leases_in_use = 0;
  std::size_t max_leases_in_use = 0;
  std::size_t lease_waiters = 0;
  std::uint64_t leases = 0;
  std::int64_t lease_ns = 0;         ///< summed lease durations
  std::size_t device_bytes_in_use = 0, device_bytes_cap = 0;
  std::size_t pinned_bytes_in_use = 0, pinned_bytes_cap = 0;
  /// lease_time_ns[k]: time with exactly k streams leased (k = 0 .. streams).
  std::vector<std::int64_t> lease_time_ns;
  /// Streams leased, averaged over the time since the device was created.
  double mean_leases() const noexcept {
    std::int64_t total = 0;
    double sum = 0;
    for (std::size_t k = 0; k < lease_time_ns.size(); ++k) {
      total += lease_time_ns[k];
      sum += static_cast<double>(k) * static_cast<double>(lease_time_ns[k]);
    }
    return total > 0 ? sum / static_cast<double>(total) : 0.0;
  }
  double busy_fraction() const noexcept {
    return wall_ns > 0 ? static_cast<double>(busy_ns) / static_cast<double>(wall_ns) : 0.0;
  }
  /// The figures that accumulate (times, leases, lease_time_ns) between `earlier` and these:
  /// the device over that window. The gauges (in use now, at most) stay as they are.
  DeviceStats since(const DeviceStats& earlier) const {
    DeviceStats d = *this;
    d.wall_ns -= earlier.wall_ns;
    d.busy_ns -= earlier.busy_ns;
    d.held_ns -= earlier.held_ns;
    d.leases -= earlier.leases;
    d.lease_ns -= earlier.lease_ns;
    for (std::size_t k = 0; k < d.lease_time_ns.size() && k < earlier.lease_time_ns.size(); ++k)
      d.lease_time_ns[k] -= earlier.lease_time_ns[k];
    return d;
  }
  /// held / busy of the device as a whole: time it was reserved by some graph against time
  /// it worked. (A graph's own held/busy also counts its bursts queued behind other graphs'.)
  double held_over_busy() const noexcept {
    return busy_ns > 0 ? static_cast<double>(held_ns) / static_cast<double>(busy_ns) : 0.0;
  }
};

}  // namespace splitflow
