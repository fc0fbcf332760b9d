// The shared test harness (like oneTBB's test/common), for every tests/test_*.cpp: CPU work that
// does not sleep, types that count their own copies and lives, item generators and expected
// sequences, and, for the device-layer suites (test_gpu_stage, test_stream_pool,
// test_pinned_ring), a host-backend runtime and the check that every lease, ring byte and pool
// byte came back (docs/architecture.md, "The device layer").
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <future>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <splitflow/splitflow.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace testing_helpers {

/// Burns CPU for about `us` microseconds (work, not synchronisation).
inline void spin_us(double us) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::nanoseconds(static_cast<std::int64_t>(us * 1000));
  while (std::chrono::steady_clock::now() < end) {
  }
}

/// Counts live instances and copies, to prove nothing leaks and nothing is copied.
struct Tracked {
  static inline std::atomic<long> live{0};
  static inline std::atomic<long> copies{0};
  static void reset_counts() {
    live = 0;
    copies = 0;
  }

  int value = 0;
  explicit Tracked(int v = 0) : value(v) { ++live; }
  Tracked(const Tracked& o) : value(o.value) {
    ++live;
    ++copies;
  }
  Tracked(Tracked&& o) noexcept : value(o.value) { ++live; }
  Tracked& operator=(const Tracked& o) {
    value = o.value;
    ++copies;
    return *this;
  }
  Tracked& operator=(Tracked&& o) noexcept {
    value = o.value;
    return *this;
  }
  ~Tracked() { --live; }
};

/// Move-only and tracked.
struct MoveOnly {
  Tracked t;
  explicit MoveOnly(int v = 0) : t(v) {}
  MoveOnly(MoveOnly&&) noexcept = default;
  MoveOnly& operator=(MoveOnly&&) noexcept = default;
  MoveOnly(const MoveOnly&) = delete;
  MoveOnly& operator=(const MoveOnly&) = delete;
};

/// Bodies that hold until `limit` of them run at once (the first time only; 20 s at most), so
/// that the observed maximum reaches the limit if and only if the runtime allows it: enter()
/// at a body's start, leave() at its end; `met`, `max_seen` under the lock once the run ended.
struct Rendezvous {
  explicit Rendezvous(long limit) : limit(limit) {}
  void enter() {
    std::unique_lock lk(mu);
    ++current;
    max_seen = std::max(max_seen, current);
    if (current >= limit) met = true;
    cv.notify_all();
    cv.wait_for(lk, std::chrono::seconds(20), [&] { return met; });
  }
  void leave() {
    std::lock_guard lk(mu);
    --current;
  }
  const long limit;
  std::mutex mu;
  std::condition_variable cv;
  long current = 0;
  long max_seen = 0;
  bool met = false;
};

/// Running maximum of a value updated concurrently.
inline void raise_max(std::atomic<long>& max, long v) {
  long m = max.load();
  while (v > m && !max.compare_exchange_weak(m, v)) {
  }
}

/// The message of the GraphError that starting `g` throws ("no error" when it starts); a run
/// that starts is waited for.
template <class G>
std::string refusal(G& g) {
  try {
    g.run().wait();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

/// A stage's figures for the white-box tests of the diagnosis and the tuner, which hand-build
/// a run's RunStats: the fields a test names; busy time is the work's, up to the window.
struct StageFigures {
  std::size_t limit = 1;         ///< concurrency_limit
  std::uint64_t items = 0;       ///< items_in and items_out
  std::int64_t work = 0;         ///< work_ns
  std::int64_t starved = 0, blocked = 0;
  double queue = 0;              ///< mean_queue
  std::size_t capacity = 0;
  std::int64_t call = -1;        ///< call_ns (an async stage's calls)
  std::int64_t window = 1'000'000'000;  ///< busy_ns is at most this
};

inline splitflow::StageStats stage_stats(std::string name, splitflow::StageKind kind,
                                         std::vector<std::string> consumers, StageFigures f = {}) {
  splitflow::StageStats s;
  s.name = std::move(name);
  s.kind = kind;
  s.consumers = std::move(consumers);
  s.concurrency_limit = f.limit;
  s.items_in = s.items_out = f.items;
  s.work_ns = f.work;
  s.busy_ns = std::min(f.work, f.window);
  s.starved_ns = f.starved;
  s.blocked_ns = f.blocked;
  s.mean_queue = f.queue;
  s.capacity = f.capacity;
  s.call_ns = f.call;
  return s;
}

/// A generator of Tracked(0), Tracked(1), ..., Tracked(n-1) (n < 0: endless).
inline auto tracked_source(long n) {
  return [i = 0L, n]() mutable -> std::optional<Tracked> {
    if (n >= 0 && i >= n) return std::nullopt;
    return Tracked(static_cast<int>(i++));
  };
}

/// A generator of 0, 1, ..., n-1 (n < 0: endless).
inline auto counter(long n) {
  return [i = 0L, n]() mutable -> std::optional<long> {
    if (n >= 0 && i >= n) return std::nullopt;
    return i++;
  };
}

/// 0, 1, ..., n-1 (two names: the tests that use them were written with both).
inline std::vector<long> iota_vec(long n) {
  std::vector<long> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), 0L);
  return v;
}
inline std::vector<long> iota_vector(long n) { return iota_vec(n); }

/// The items of a run of batches, in order.
inline std::vector<long> flatten(const std::vector<std::vector<long>>& batches) {
  std::vector<long> all;
  for (const auto& b : batches) all.insert(all.end(), b.begin(), b.end());
  return all;
}

/// Random work per item (microseconds, for spin_us), seeded by the item so that runs are
/// repeatable in what they do.
inline double work_for(long item) {
  std::mt19937 rng(static_cast<unsigned>(item) * 2654435761u);
  return std::uniform_real_distribution<double>(0.0, 30.0)(rng);
}

/// A runtime on the host backend (the modelled device): `streams` in the stream pool, `slots`
/// compute slots.
inline splitflow::RuntimeConfig host_device(int threads, std::size_t streams, int slots = 1) {
  splitflow::RuntimeConfig c{.threads = threads};
  c.device.backend = splitflow::BackendKind::host;
  c.device.streams = streams;
  c.device.host_compute_slots = slots;
  return c;
}

/// Every lease, ring byte and device pool byte back to its total (ring capacity stays
/// allocated with the graph's GPU stages; nothing in use).
/// `all` holds the stats of every graph alive on the runtime (their rings share the pool).
inline void expect_returned(const splitflow::Runtime& rt,
                            const std::vector<splitflow::RunStats>& all) {
  auto d = rt.device_stats();
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->leases_in_use, 0u) << "a stream lease was not returned";
  EXPECT_EQ(d->lease_waiters, 0u);
  EXPECT_EQ(d->device_bytes_in_use, 0u) << "device pool bytes were not returned";
  std::size_t rings = 0;
  for (const splitflow::RunStats& st : all)
    for (const auto& s : st.stages) {
      rings += s.ring_capacity;
      EXPECT_EQ(s.ring_budgets, 0u) << s.name << ": ring budgets were not returned";
      EXPECT_EQ(s.ring_in_use, 0u) << s.name << ": ring bytes were not returned";
    }
  EXPECT_EQ(d->pinned_bytes_in_use, rings) << "pinned pool bytes were not returned";
}
inline void expect_returned(const splitflow::Runtime& rt, const splitflow::RunStats& st) {
  expect_returned(rt, std::vector<splitflow::RunStats>{st});
}

/// Whether the request behind `f` failed with an `E` whose message is `what` (or contains it,
/// with `Match::contains`); another type of error propagates (the test fails with it). The
/// error is kept in `held` until the caller's run has ended: libstdc++ (not built with TSan)
/// counts an exception's references with atomics TSan cannot see, so the stage's thread
/// dropping the last one after the test read its message would be reported as a race (a false
/// positive). Held, the last reference is the test's.
enum class Match { exactly, contains };
template <class E, class T>
::testing::AssertionResult fails_with(std::future<T>& f, std::string_view what,
                                      std::vector<std::exception_ptr>& held,
                                      Match match = Match::exactly) {
  try {
    f.get();
    return ::testing::AssertionFailure() << "it was answered";
  } catch (const E& e) {
    held.push_back(std::current_exception());
    const std::string_view got = e.what();
    if (match == Match::exactly ? got == what : got.find(what) != std::string_view::npos)
      return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "it failed with \"" << got << "\", not \"" << what << "\"";
  }
}

/// Whether the request behind `f` failed with a StageError naming `stage` and request `item`,
/// whose message is `what` and whose nested exception (the body's own) is an `E`: how a service
/// fails a request that a stage failed on. Held as fails_with's.
template <class E, class T>
::testing::AssertionResult fails_in_stage(std::future<T>& f, std::string_view stage,
                                          std::uint64_t item, std::string_view what,
                                          std::vector<std::exception_ptr>& held) {
  try {
    f.get();
    return ::testing::AssertionFailure() << "it was answered";
  } catch (const splitflow::StageError& e) {
    held.push_back(std::current_exception());
    if (e.stage() != stage || e.item() != item || e.message() != what)
      return ::testing::AssertionFailure() << "it failed with \"" << e.what() << "\", not in stage '"
                                           << stage << "' on item " << item << " with \"" << what << "\"";
    try {
      std::rethrow_if_nested(e);
    } catch (const E&) {
      return ::testing::AssertionSuccess();
    } catch (...) {
      return ::testing::AssertionFailure() << "its nested exception is not of the body's type";
    }
    return ::testing::AssertionFailure() << "it nests no exception";
  } catch (const std::exception& e) {
    held.push_back(std::current_exception());
    return ::testing::AssertionFailure() << "it failed with a non-StageError: " << e.what();
  }
}

}  // namespace testing_helpers
