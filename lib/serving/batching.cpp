// BatchClock::steady(): steady_clock and one timer thread for the process.
#include "splitflow/serving/batching.hpp"

#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

namespace splitflow {

namespace {

class SteadyClock final : public BatchClock {
 public:
  SteadyClock() : thread_([this] { loop(); }) {}
  ~SteadyClock() override {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  time_point now() override { return std::chrono::steady_clock::now(); }
  void call_at(time_point t, std::function<void()> fn) override {
    {
      std::lock_guard lk(mu_);
      timers_.emplace(t, std::move(fn));
    }
    cv_.notify_all();
  }

 private:
  void loop() {
    std::unique_lock lk(mu_);
    while (!stop_) {
      if (timers_.empty()) {
        cv_.wait(lk);
        continue;
      }
      const time_point t = timers_.begin()->first;
      if (std::chrono::steady_clock::now() < t) {
        cv_.wait_until(lk, t);
        continue;
      }
      auto fn = std::move(timers_.begin()->second);
      timers_.erase(timers_.begin());
      lk.unlock();
      fn();  // a timer reaches its node through a token: safe after the node is gone
      lk.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::multimap<time_point, std::function<void()>> timers_;
  bool stop_ = false;
  std::thread thread_;  // last: started once the rest exists
};

}  // namespace

std::shared_ptr<BatchClock> BatchClock::steady() {
  // Created on first use, never destroyed: timers may be armed until the process exits.
  static std::shared_ptr<BatchClock>* clock = new std::shared_ptr<BatchClock>(std::make_shared<SteadyClock>());
  return *clock;
}

}  // namespace splitflow
