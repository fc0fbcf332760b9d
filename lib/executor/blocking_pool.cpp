#include "splitflow/executor/detail/blocking_pool.hpp"

#include <system_error>

namespace splitflow::detail {

BlockingPool::~BlockingPool() {
  std::vector<std::thread> threads;
  std::deque<BlockingTask> dropped;
  {
    std::lock_guard lk(mu_);
    stop_ = true;
    threads.swap(threads_);
    dropped.swap(tasks_);
  }
  cv_.notify_all();
  for (std::thread& t : threads) t.join();
  // (`dropped` goes here, with no lock held: its Completions answer their items.)
}

void BlockingPool::post(BlockingTask t) {
  std::unique_lock lk(mu_);
  tasks_.push_back(std::move(t));
  // A thread for it: an idle one, or a new one below the cap.
  if (idle_ >= tasks_.size() || threads_.size() >= max_threads_) {
    lk.unlock();
    cv_.notify_one();
    return;
  }
  try {
    threads_.emplace_back([this] { loop(); });
  } catch (const std::system_error&) {
    if (threads_.empty()) {  // nothing would ever run it
      tasks_.pop_back();
      throw;
    }
    // The threads there are take it in turn.
  }
}

std::size_t BlockingPool::threads() const {
  std::lock_guard lk(mu_);
  return threads_.size();
}

void BlockingPool::loop() {
  std::unique_lock lk(mu_);
  for (;;) {
    ++idle_;
    cv_.wait(lk, [&] { return stop_ || !tasks_.empty(); });
    --idle_;
    if (stop_) return;
    BlockingTask t = std::move(tasks_.front());
    tasks_.pop_front();
    lk.unlock();
    t();  // (the task catches what its body throws)
    { BlockingTask gone = std::move(t); }
    lk.lock();
  }
}

}  // namespace splitflow::detail
