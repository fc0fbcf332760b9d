// RuntimeCore: the task arena and the registry of active runs. Internal to the library.
#pragma once

#include <oneapi/tbb/task_arena.h>
#include <oneapi/tbb/task_group.h>
#include <oneapi/tbb/task_scheduler_observer.h>

#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "splitflow/config.hpp"

namespace splitflow::detail {

class RunState;

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
    if (!fair && current() == this) {
      group_.run(std::forward<F>(f));
    } else {
      arena_.enqueue(group_.defer(std::forward<F>(f)));
    }
  }

  /// Throws GraphError once shut down.
  void register_run(const std::shared_ptr<RunState>& run);
  void unregister_run(const RunState* run) noexcept;
  /// Cancels the active runs, waits for them and for every task. Idempotent.
  void shutdown() noexcept;

 private:
  static RuntimeCore* current() noexcept;

  class Observer final : public tbb::task_scheduler_observer {
   public:
    Observer(tbb::task_arena& arena, RuntimeCore* core);
    ~Observer() override;
    void on_scheduler_entry(bool) override;
    void on_scheduler_exit(bool) override;

   private:
    RuntimeCore* core_;
  };

  RuntimeConfig config_;
  int threads_;
  tbb::task_arena arena_;
  tbb::task_group group_;
  std::unique_ptr<Observer> observer_;
  std::mutex mu_;
  bool shut_down_ = false;
  std::vector<std::shared_ptr<RunState>> active_;
};

}  // namespace splitflow::detail
