// A vector that keeps its first N elements inline: the executor's per-task work lists are
// short and hot, and must not allocate.
#pragma once

#include <array>
#include <cstddef>
#include <vector>

namespace splitflow::detail {

template <class T, std::size_t N>
class SmallVector {
 public:
  void push_back(const T& v) {
    if (size_ < N) {
      inline_[size_] = v;
    } else {
      spill_.push_back(v);
    }
    ++size_;
  }
  T& operator[](std::size_t i) { return i < N ? inline_[i] : spill_[i - N]; }
  std::size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  T pop_back() {
    --size_;
    if (size_ < N) return inline_[size_];
    T v = spill_.back();
    spill_.pop_back();
    return v;
  }
  void clear() noexcept {
    size_ = 0;
    spill_.clear();
  }

 private:
  std::array<T, N> inline_{};
  std::vector<T> spill_;
  std::size_t size_ = 0;
};

}  // namespace splitflow::detail
