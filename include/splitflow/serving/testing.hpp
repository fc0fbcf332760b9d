// For tests of code that uses dynamic batching: a BatchClock that moves only when told, so
// a test decides when a batch's max_delay passes (no sleeps). Not part of splitflow.hpp.
//
//     auto clock = std::make_shared<splitflow::testing::ManualClock>();
//     auto gather = g.dynamic_batch<long>("gather", {.max_batch = 4, .max_delay = 1h, .clock = clock});
//     ...
//     clock->advance(1h);  // the partial batch goes now
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <vector>

#include "splitflow/serving/batching.hpp"

namespace splitflow::testing {

/// A clock that moves only when told: advance() runs the timers that fall due, on the calling
/// thread. now() calls are counted so a test can wait for items to have arrived.
class ManualClock final : public BatchClock {
 public:
  time_point now() override {
    std::lock_guard lk(mu_);
    ++now_calls_;
    cv_.notify_all();
    return now_;
  }
  void call_at(time_point t, std::function<void()> fn) override {
    std::lock_guard lk(mu_);
    timers_.emplace(t, std::move(fn));
    cv_.notify_all();
  }
  void advance(std::chrono::nanoseconds d) {
    std::vector<std::function<void()>> due;
    {
      std::lock_guard lk(mu_);
      now_ += d;
      while (!timers_.empty() && timers_.begin()->first <= now_) {
        due.push_back(std::move(timers_.begin()->second));
        timers_.erase(timers_.begin());
      }
    }
    for (auto& f : due) f();
  }
  /// Blocks until now() was called at least n times in all.
  void wait_for_now_calls(std::uint64_t n) {
    std::unique_lock lk(mu_);
    cv_.wait(lk, [&] { return now_calls_ >= n; });
  }
  std::size_t timers() {
    std::lock_guard lk(mu_);
    return timers_.size();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  time_point now_{};
  std::uint64_t now_calls_ = 0;
  std::multimap<time_point, std::function<void()>> timers_;
};

}  // namespace splitflow::testing
