// Latency histograms that threads write without the node's lock. Recording into one shared
// 4 KiB histogram under the node lock made telemetry cost 13-35% of BM_ChainHop on 2 cores: the
// bucket lines ping-ponged between cores inside the critical section. Each thread writes the
// shard of its slot instead (its lines stay in its cache); readers merge the shards.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>

#include "splitflow/core/detail/spin_lock.hpp"
#include "splitflow/telemetry/telemetry.hpp"

namespace splitflow::detail {

/// The calling thread's slot in its task arena (0 .. threads-1), or -1 outside any arena.
int this_arena_slot() noexcept;

class ShardedHistogram {
 public:
  static constexpr std::size_t kMaxShards = 17;  // 17 x 4 KiB per stage at most

  /// Empties it and sizes it for an arena of `threads` (not concurrently with record or read):
  /// a shard per arena slot, and one that threads outside the arena share.
  void reset(std::size_t threads) {
    const std::size_t n = std::clamp<std::size_t>(threads + 1, 2, kMaxShards);
    if (n != n_) {
      shards_ = std::make_unique<Shard[]>(n);
      n_ = n;
    } else {
      for (std::size_t i = 0; i < n_; ++i) shards_[i].h = LatencyHistogram{};
    }
  }
  /// Threads that share a shard (outside the arena, or beyond kMaxShards slots) are kept
  /// correct by the shard's lock.
  void record(std::uint64_t v, std::uint64_t count = 1) noexcept {
    record_each([&](LatencyHistogram& h) { h.record(v, count); });
  }
  /// Calls `f(histogram)` once, under this thread's shard's lock: several records (a claim's
  /// runs of arrivals) for one slot lookup and one lock.
  template <class F>
  void record_each(F&& f) noexcept {
    const int slot = this_arena_slot();
    const std::size_t i = slot >= 0 ? static_cast<std::size_t>(slot) % (n_ - 1) : n_ - 1;
    Shard& s = shards_[i];
    std::lock_guard lk(s.mu);
    f(s.h);
  }
  LatencyHistogram merged() const {
    LatencyHistogram out;
    for (std::size_t i = 0; i < n_; ++i) {
      std::lock_guard lk(shards_[i].mu);
      out.merge(shards_[i].h);
    }
    return out;
  }

 private:
  struct alignas(64) Shard {
    mutable SpinLock mu;
    LatencyHistogram h;
  };
  std::unique_ptr<Shard[]> shards_ = std::make_unique<Shard[]>(2);
  std::size_t n_ = 2;
};

}  // namespace splitflow::detail
