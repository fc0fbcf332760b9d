// RuntimeCore: the task arena and the registry of active runs. Internal to the library.
#pragma once

#include <oneapi/tbb/task_arena.h>
#include <oneapi/tbb/task_group.h>

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "splitflow/core/config.hpp"
#include "splitflow/core/detail/clock.hpp"
#include "splitflow/executor/detail/blocking_pool.hpp"
#include "tuning_board.hpp"

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
  /// The tuned runs on this runtime, which share its threads as cores (RunTuner).
  TuningBoard& tuning_board() noexcept { return tuning_board_; }
  /// The threads of blocking stages (StageOptions::blocking).
  BlockingPool& blocking_pool() noexcept { return blocking_pool_; }
  const RuntimeConfig& config() const noexcept { return config_; }
  /// The calling thread's slot in the arena of `runtime` while it runs one of that runtime's
  /// tasks, else -1. Read once per task (TaskScope), so a claim pays a thread-local read, not
  /// tbb::this_task_arena::current_thread_index()'s pthread_getspecific (the largest part of
  /// telemetry's instructions per claim).
  static int arena_slot(const void* runtime) noexcept {
    return t_arena == runtime && runtime ? t_slot : -1;
  }

  /// Runs f on an arena thread. From an arena thread and unless `fair`, f goes to the local
  /// deque (cheap, LIFO, cache-warm). Otherwise it is enqueued FIFO into the arena, which is how
  /// graphs take turns. A thread takes FIFO work only when its local deque is empty, so local
  /// spawns are limited to a time slice: once a thread has run local work for kSliceNs since
  /// it last took FIFO work, its spawns go FIFO too (its deque drains, and the graphs waiting
  /// in the FIFO get their turn; an endless graph once kept a thread to itself).
  template <class F>
  void spawn(F&& f, bool fair) {
    if (!fair && t_current == this && !slice_expired()) {
      group_.run([this, fn = std::forward<F>(f)] {
        TaskScope scope(this);
        fn();
      });
    } else {
      arena_.enqueue(group_.defer([this, fn = std::forward<F>(f)] {
        // Marks the thread as running this runtime's task, so that its own spawns go local,
        // and starts its slice.
        TaskScope scope(this);
        t_slice_start = now_ticks();
        fn();
      }));
    }
  }
  /// Enqueues an empty task: the arena advertises work again. For a waiter that saw no progress
  /// for a while (RunState::wait): oneTBB 2021.8 (Debian 12's) once left a run's first task
  /// enqueued in an idle arena with its workers asleep, while a task of another runtime's arena
  /// waited for that run (1 in some hundreds to thousands of runs under ASan and load); an
  /// enqueue wakes them.
  void nudge() noexcept {
    nudges_.fetch_add(1, std::memory_order_relaxed);
    try {
      arena_.enqueue([] {});
    } catch (...) {  // no memory for the task: the next nudge tries again
    }
  }
  std::uint64_t nudges() const noexcept { return nudges_.load(std::memory_order_relaxed); }
  /// Whether this thread's slice of local work is used up (then continue through spawn()).
  bool slice_expired() const noexcept { return now_ticks() - t_slice_start > slice_ticks_; }
  static constexpr std::int64_t kSliceNs = 2'000'000;

  /// Runs f on an arena thread ahead of the claims waiting there: for device completions, which
  /// free streams, ring space and device memory and let the next bursts start. A FIFO task
  /// would wait behind every CPU claim the threads keep spawning locally (a saturated decode
  /// stage once held a GPU stage's completions back for a second). Every runtime thread runs
  /// this lane between claims (run_urgent), and a fair task drains it when they are idle.
  void spawn_urgent(std::function<void()> f);
  /// Runs the urgent work queued now. Cheap when there is none; does nothing when called from
  /// inside urgent work (no nesting).
  void run_urgent() {
    if (urgent_pending_.load(std::memory_order_acquire) != 0) drain_urgent();
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
  static thread_local const RuntimeCore* t_arena;  // whose task the thread runs (TaskScope)
  static thread_local int t_slot;                  // its slot in that runtime's arena
  // A task of this runtime runs on the thread (its spawns go local; its arena slot is known),
  // until the scope ends; the outer task's, if any, is restored.
  struct TaskScope {
    explicit TaskScope(RuntimeCore* rt) noexcept
        : current(std::exchange(t_current, rt)),
          arena(std::exchange(t_arena, rt)),
          slot(std::exchange(t_slot, tbb::this_task_arena::current_thread_index())) {}
    ~TaskScope() {
      t_current = current;
      t_arena = arena;
      t_slot = slot;
    }
    TaskScope(const TaskScope&) = delete;
    TaskScope& operator=(const TaskScope&) = delete;
    RuntimeCore* current;
    const RuntimeCore* arena;
    int slot;
  };
  static thread_local bool t_draining;
  static thread_local Ticks t_slice_start;
  void drain_urgent();

  RuntimeConfig config_;
  int threads_;
  TuningBoard tuning_board_{static_cast<double>(threads_), config_.host_memory_budget};
  tbb::task_arena arena_;
  tbb::task_group group_;
  Ticks slice_ticks_;
  std::mutex mu_;
  bool shut_down_ = false;
  std::vector<std::shared_ptr<RunState>> active_;
  mutable std::mutex device_mu_;
  std::shared_ptr<DeviceRuntime> device_;
  std::mutex urgent_mu_;
  std::deque<std::function<void()>> urgent_;  // under urgent_mu_
  std::atomic<std::size_t> urgent_pending_{0};
  std::atomic<std::uint64_t> nudges_{0};  // nudge() calls (white-box tests)
  // Last: destroyed first, joining its threads before the arena goes (a cancelled run's
  // blocking bodies may still be running; their answers find their items withdrawn).
  BlockingPool blocking_pool_{config_.blocking_threads};
};

}  // namespace splitflow::detail
