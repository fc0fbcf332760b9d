// RuntimeCore: the task arena and the registry of active runs. Internal to the library.
#pragma once

#include <oneapi/tbb/task_arena.h>
#include <oneapi/tbb/task_group.h>

#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "splitflow/config.hpp"

namespace splitflow::detail {

class RunState;
class DeviceRuntime;

class RuntimeCore {
 public:
  explicit RuntimeCore(RuntimeConfig config);
  ~RuntimeCore();
  RuntimeCore(const RuntimeCore&) = delete;
  RuntimeCore& operator=(const RuntimeCore&) = delete;

  int threads() const noexcept { return threads_; }
  const RuntimeConfig& config() const noexcept { return config_; }

  /// Runs f on an arena thread. From an arena thread and unless `fair`, f goes to the local
  /// deque (cheap, LIFO, cache-warm). Otherwise it is enqueued FIFO into the arena, which is how
  /// graphs take turns: every source item enters the arena this way.
  template <class F>
  void spawn(F&& f, bool fair) {
    auto task = [this, fn = std::forward<F>(f)] {
      // Marks the thread as running this runtime's task, so that its own spawns go local.
      RuntimeCore* const outer = std::exchange(t_current, this);
      fn();
      t_current = outer;
    };
    if (!fair && t_current == this) {
      group_.run(std::move(task));
    } else {
      arena_.enqueue(group_.defer(std::move(task)));
    }
  }

  /// Throws GraphError once shut down.
  void register_run(const std::shared_ptr<RunState>& run);
  void unregister_run(const RunState* run) noexcept;
  /// Cancels the active runs, waits for them and for every task. Idempotent.
  void shutdown() noexcept;

  /// The device, created on first call (the first run of a graph with a GPU stage): until
  /// then nothing touches the CUDA runtime. Throws Error if the configured backend is missing.
  std::shared_ptr<DeviceRuntime> device();
  /// The device if it was created, else null.
  std::shared_ptr<DeviceRuntime> device_if_created() const;

 private:
  static thread_local RuntimeCore* t_current;

  RuntimeConfig config_;
  int threads_;
  tbb::task_arena arena_;
  tbb::task_group group_;
  std::mutex mu_;
  bool shut_down_ = false;
  std::vector<std::shared_ptr<RunState>> active_;
  mutable std::mutex device_mu_;
  std::shared_ptr<DeviceRuntime> device_;
};

}  // namespace splitflow::detail
