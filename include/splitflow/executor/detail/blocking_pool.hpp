// The runtime's blocking threads: where the bodies of blocking stages (StageOptions::blocking)
// run, so that a body that waits (a read from a slow file system, a blocking client's call)
// holds one of these and never an arena thread. Started on demand up to
// RuntimeConfig::blocking_threads; a task waits for a free one beyond that. Internal.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace splitflow::detail {

/// A move-only task (the item and its Completion travel in it).
class BlockingTask {
 public:
  template <class Fn>
  explicit BlockingTask(Fn fn) : p_(std::make_unique<Impl<Fn>>(std::move(fn))) {}
  void operator()() { p_->run(); }

 private:
  struct Base {
    virtual ~Base() = default;
    virtual void run() = 0;
  };
  template <class Fn>
  struct Impl final : Base {
    explicit Impl(Fn f) : fn(std::move(f)) {}
    void run() override { fn(); }
    Fn fn;
  };
  std::unique_ptr<Base> p_;
};

class BlockingPool {
 public:
  explicit BlockingPool(std::size_t max_threads) : max_threads_(max_threads ? max_threads : 1) {}
  /// Joins the threads once their current tasks return; tasks still queued are dropped
  /// (their Completions then fail their items, which a cancelled run has withdrawn already).
  ~BlockingPool();
  BlockingPool(const BlockingPool&) = delete;
  BlockingPool& operator=(const BlockingPool&) = delete;

  /// Runs `t` on a blocking thread (a new one if none is idle and there are fewer than the
  /// cap). Throws std::system_error if no thread could be started and none exists.
  void post(BlockingTask t);
  /// Threads started so far, and the cap.
  std::size_t threads() const;
  std::size_t max_threads() const noexcept { return max_threads_; }

 private:
  void loop();
  const std::size_t max_threads_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<BlockingTask> tasks_;
  std::vector<std::thread> threads_;
  std::size_t idle_ = 0;
  bool stop_ = false;
};

}  // namespace splitflow::detail
