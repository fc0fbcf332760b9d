// Per-thread reusable vectors for the items of one claim, so that a batched claim does not
// allocate. Nesting-safe (a body that runs TBB work may run another claim on the same thread):
// each Scratch takes its own vector from a small per-thread free list.
#pragma once

#include <vector>

namespace splitflow::detail {

template <class T>
class Scratch {
 public:
  Scratch() {
    auto& pool = free_list();
    if (!pool.empty()) {
      v_ = std::move(pool.back());
      pool.pop_back();
    }
  }
  ~Scratch() {
    v_.clear();
    auto& pool = free_list();
    if (pool.size() < kKeep) pool.push_back(std::move(v_));
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  std::vector<T>& operator*() noexcept { return v_; }
  std::vector<T>* operator->() noexcept { return &v_; }

 private:
  static constexpr std::size_t kKeep = 4;
  static std::vector<std::vector<T>>& free_list() {
    thread_local std::vector<std::vector<T>> pool;
    return pool;
  }
  std::vector<T> v_;
};

}  // namespace splitflow::detail
