// A gate that counts the threads inside a section until it is closed, then lets none in and
// waits for those inside to leave: what a thing that is going (a graph, an interpreter) uses to
// wait for the threads still using it, without a lock on their path. Internal.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>

namespace splitflow::detail {

class Gate {
 public:
  /// Counts the caller in; false (not counted) once the gate is closed.
  bool enter() noexcept {
    inside_.fetch_add(1);  // before looking at closed_ (close() sets it before it counts):
    if (!closed_.load()) return true;  // a thread that found it open is counted
    leave();
    return false;
  }
  void leave() noexcept {
    if (inside_.fetch_sub(1) == 1 && closed_.load()) {
      std::lock_guard lk(mu_);
      left_.notify_all();
    }
  }
  bool open() const noexcept { return !closed_.load(); }
  void close() noexcept { closed_.store(true); }
  /// After close(): waits for the threads inside to leave, at most `limit`; false if it passed.
  bool wait_empty(std::chrono::nanoseconds limit = std::chrono::nanoseconds::max()) noexcept {
    std::unique_lock lk(mu_);
    const auto empty = [&] { return inside_.load() == 0; };
    if (limit == std::chrono::nanoseconds::max()) {
      left_.wait(lk, empty);
      return true;
    }
    return left_.wait_for(lk, limit, empty);
  }

 private:
  std::atomic<int> inside_{0};
  std::atomic<bool> closed_{false};
  std::mutex mu_;
  std::condition_variable left_;
};

/// enter() for a scope: true when counted in; leaves as the scope ends.
class GateScope {
 public:
  explicit GateScope(Gate& g) noexcept : gate_(g.enter() ? &g : nullptr) {}
  ~GateScope() {
    if (gate_) gate_->leave();
  }
  explicit operator bool() const noexcept { return gate_ != nullptr; }
  GateScope(const GateScope&) = delete;
  GateScope& operator=(const GateScope&) = delete;

 private:
  Gate* gate_;
};

}  // namespace splitflow::detail
