// The per-node lock. Critical sections are a few counter updates and a queue push or pop, so
// a contended std::mutex would mostly pay for futex system calls; this spins briefly (pause),
// then yields, so a preempted holder does not cost a whole time slice.
#pragma once

#include <atomic>
#include <thread>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace splitflow::detail {

class SpinLock {
 public:
  void lock() noexcept {
    for (int spins = 0;; ++spins) {
      if (!locked_.exchange(true, std::memory_order_acquire)) return;
      while (locked_.load(std::memory_order_relaxed)) {
        if (spins < 64) {
          pause();
          ++spins;
        } else {
          std::this_thread::yield();
        }
      }
    }
  }
  bool try_lock() noexcept {
    return !locked_.load(std::memory_order_relaxed) &&
           !locked_.exchange(true, std::memory_order_acquire);
  }
  void unlock() noexcept { locked_.store(false, std::memory_order_release); }

 private:
  static void pause() noexcept {
#if defined(__x86_64__)
    _mm_pause();
#endif
  }
  std::atomic<bool> locked_{false};
};

}  // namespace splitflow::detail
