// Latency histograms that threads write without the node's lock. Recording into one shared
// 4 KiB histogram under the node lock made telemetry cost 13-35% of BM_ChainHop on 2 cores: the
// bucket lines ping-ponged between cores inside the critical section. Each thread writes the
// shard of its slot instead (its lines stay in its cache); readers merge the shards.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>

#include "splitflow/core/detail/spin_lock.hpp"
#include "splitflow/telemetry/telemetry.hpp"

namespace splitflow::detail {

/// The calling thread's slot in the task arena of `owner` (a runtime) while it runs one of that
/// runtime's tasks (0 .. threads-1), or -1 (any other thread, or another runtime's task).
int this_arena_slot(const void* owner) noexcept;

class ShardedHistogram {
 public:
  static constexpr std::size_t kMaxShards = 17;  // 17 x 4 KiB per stage at most

  /// Empties it and sizes it for the arena of `owner` with `threads` slots (not concurrently
  /// with record or read): a shard per arena slot, and one that other threads share. With a
  /// shard for each slot, a slot's shard has one writer, its thread, which records without a
  /// lock (readers load its fields atomically); past kMaxShards slots share shards, locked.
  void reset(std::size_t threads, const void* owner) {
    const std::size_t n = std::clamp<std::size_t>(threads + 1, 2, kMaxShards);
    if (n != n_) {
      shards_ = std::make_unique<Shard[]>(n);
      n_ = n;
    } else {
      for (std::size_t i = 0; i < n_; ++i) shards_[i].h = LatencyHistogram{};
    }
    exclusive_ = threads + 1 <= kMaxShards;
    owner_ = owner;
  }
  void record(std::uint64_t v, std::uint64_t count = 1) noexcept {
    const std::pair<std::uint64_t, std::uint64_t> one[] = {{v, count}};
    record_runs(one, [](const auto& r) { return r.first; }, [](const auto& r) { return r.second; });
  }
  /// Records, for each element r of `runs`, count_of(r) values of value_of(r) into this
  /// thread's shard: one slot lookup (and, in a shared shard, one lock) for them all. Per run
  /// only its bucket is written; the count, sum, min and max once.
  template <class Runs, class Value, class Count>
  void record_runs(const Runs& runs, Value value_of, Count count_of) noexcept {
    const int slot = this_arena_slot(owner_);
    if (exclusive_ && slot >= 0 && static_cast<std::size_t>(slot) < n_ - 1) {
      // Only this thread writes its slot's shard: stores, no lock, no read-modify-write.
      add_runs<Stores>(shards_[static_cast<std::size_t>(slot)].h, runs, value_of, count_of);
      return;
    }
    Shard& s = shards_[exclusive_ || slot < 0 ? n_ - 1 : static_cast<std::size_t>(slot) % (n_ - 1)];
    std::lock_guard lk(s.mu);
    add_runs<Plain>(s.h, runs, value_of, count_of);
  }
  LatencyHistogram merged() const {
    LatencyHistogram out;
    for (std::size_t i = 0; i < n_; ++i) {
      if (exclusive_ && i < n_ - 1) {
        add_loaded(out, shards_[i].h);
      } else {
        std::lock_guard lk(shards_[i].mu);
        out.merge(shards_[i].h);
      }
    }
    return out;
  }

 private:
  struct alignas(64) Shard {
    mutable SpinLock mu;
    LatencyHistogram h;
  };
  // One writer (the shard's thread) stores; readers load: relaxed atomics on plain fields, no
  // read-modify-write. A reader may see a record half done (count before its bucket): live
  // figures only; the final ones are read once the run's work is over.
  static void store(std::uint64_t& x, std::uint64_t v) noexcept {
    std::atomic_ref<std::uint64_t>(x).store(v, std::memory_order_relaxed);
  }
  static std::uint64_t load(const std::uint64_t& x) noexcept {
    return std::atomic_ref<std::uint64_t>(const_cast<std::uint64_t&>(x)).load(std::memory_order_relaxed);
  }
  struct Plain {  // a locked shard
    static void set(std::uint64_t& x, std::uint64_t v) noexcept { x = v; }
  };
  struct Stores {  // an exclusive shard
    static void set(std::uint64_t& x, std::uint64_t v) noexcept { store(x, v); }
  };
  template <class Write, class Runs, class Value, class Count>
  static void add_runs(LatencyHistogram& h, const Runs& runs, Value& value_of,
                       Count& count_of) noexcept {
    std::uint64_t count = 0, sum = 0, lo = ~std::uint64_t{0}, hi = 0;
    for (const auto& r : runs) {
      const std::uint64_t v = value_of(r), c = count_of(r);
      if (c == 0) continue;
      std::uint64_t& b = h.buckets_[static_cast<std::size_t>(LatencyHistogram::bucket(v))];
      Write::set(b, b + c);
      count += c;
      sum += v * c;
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    if (count == 0) return;
    Write::set(h.count_, h.count_ + count);
    Write::set(h.sum_, h.sum_ + sum);
    if (hi > h.max_) Write::set(h.max_, hi);
    if (lo < h.min_) Write::set(h.min_, lo);
  }
  static void add_loaded(LatencyHistogram& out, const LatencyHistogram& h) noexcept {
    LatencyHistogram copy;
    for (std::size_t i = 0; i < copy.buckets_.size(); ++i) copy.buckets_[i] = load(h.buckets_[i]);
    copy.count_ = load(h.count_);
    copy.sum_ = load(h.sum_);
    copy.max_ = load(h.max_);
    copy.min_ = load(h.min_);
    out.merge(copy);
  }

  std::unique_ptr<Shard[]> shards_ = std::make_unique<Shard[]>(2);
  std::size_t n_ = 2;
  bool exclusive_ = true;
  const void* owner_ = nullptr;
};

}  // namespace splitflow::detail
