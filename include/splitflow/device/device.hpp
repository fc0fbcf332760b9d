// The device side of a GPU stage: what its body gets (DeviceContext), what a CPU stage feeding
// it may write into (HostAllocator), and the figures the runtime keeps (held vs busy).
//
//     auto norm = g.gpu_stage("normalize", [mean, stddev](splitflow::DeviceTensor in,
//                                                         splitflow::DeviceContext& ctx) {
//       return splitflow::ops::normalize(ctx, in, mean, stddev);   // enqueued on ctx's stream
//     });
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "splitflow/core/config.hpp"
#include "splitflow/core/tensor.hpp"
#include "splitflow/telemetry/stats.hpp"

namespace splitflow {

class DeviceContext;
class HostAllocator;

namespace detail {
class Burst;
class PinnedRing;
/// The burst behind a DeviceContext, for the library's ops (not part of the public API).
Burst& burst_of(const DeviceContext& ctx) noexcept;
/// A HostAllocator writing into `ring` (null: the heap), for the stage nodes.
HostAllocator host_allocator(PinnedRing* ring, const std::string* stage, std::uint64_t item) noexcept;
/// Throws the error pushing `t` into `ring` would raise (PinnedRing::check_item), naming the
/// producing `stage`: called by a producer in its body's scope, so that its OnError applies.
void check_ring_item(const PinnedRing& ring, const HostTensor& t, const std::string& stage,
                     std::uint64_t item);
}  // namespace detail

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


 private:
  friend detail::Burst& detail::burst_of(const DeviceContext& ctx) noexcept;
  detail::Burst* burst_;
};

/// Passed to a CPU stage body declared as `HostTensor(In, HostAllocator&)`. When the stage feeds
/// a GPU stage, empty() returns space in the pinned ring between them, so the body writes its
/// output where the H2D copy reads it (no staging copy). Otherwise it returns host memory.
class HostAllocator {
 public:
  HostAllocator() = default;
  /// One output tensor per item. Throws splitflow::Error if it exceeds the ring's item size.
  HostTensor empty(DType dtype, std::vector<std::int64_t> shape);
  bool ring_backed() const noexcept { return ring_ != nullptr; }

 private:
  friend HostAllocator detail::host_allocator(detail::PinnedRing*, const std::string*,
                                              std::uint64_t) noexcept;
  detail::PinnedRing* ring_ = nullptr;
  const std::string* stage_ = nullptr;
  std::uint64_t item_ = 0;
};

}  // namespace splitflow
