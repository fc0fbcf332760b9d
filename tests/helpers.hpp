// Test helpers: CPU work that does not sleep, and types that count their own copies and lives.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <utility>

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

}  // namespace testing_helpers
