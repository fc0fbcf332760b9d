// Runtime: the shared executor that every graph of a process (or of a part of it) runs on.
#pragma once

#include <memory>
#include <optional>

#include "splitflow/core/config.hpp"
#include "splitflow/device/device.hpp"

namespace splitflow {

namespace detail {
class RuntimeCore;
}

/// Owns one oneTBB task arena. Any number of graphs run on it at once; a stage body runs on one
/// of its threads, and no arena thread ever waits for queue space, input or a device.
///
/// GPU stages of all its graphs share one device (DeviceConfig): a StreamPool whose streams are
/// leased for one kernel burst at a time, first come first served across graphs.
///
/// Destroying a Runtime cancels the runs still in flight (as `Run::cancel()` does), waits for
/// their running bodies to return, and then frees the threads. Graphs built on it may outlive
/// it, but cannot run again (`Graph::run()` throws GraphError).
///
///     splitflow::Runtime rt({.threads = 8});
class Runtime {
 public:
  explicit Runtime(RuntimeConfig config = {});
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  /// Threads of the arena (config.threads, or the number of cores).
  int threads() const noexcept;
  /// The shared device's figures: busy fraction, leases, pool bytes. nullopt until a graph with
  /// a GPU stage has run (the device is created lazily, so CPU-only use never touches CUDA).
  std::optional<DeviceStats> device_stats() const;
  const RuntimeConfig& config() const noexcept;

 private:
  friend class Graph;  // a graph runs on the runtime's core
  const std::shared_ptr<detail::RuntimeCore>& core() const noexcept { return core_; }
  std::shared_ptr<detail::RuntimeCore> core_;
};

}  // namespace splitflow
