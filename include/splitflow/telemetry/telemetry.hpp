// Telemetry types: latency histograms and the events an Observer receives. The figures are in
// telemetry/stats.hpp; reports, JSON and Prometheus text in telemetry/export.hpp.
//
//     auto run = g.run();
//     run.wait();
//     std::puts(splitflow::report(run.stats(), rt.device_stats()).c_str());  // with a diagnosis
//     std::ofstream("run.json") << splitflow::to_json(run.stats(), rt.device_stats());
//     std::ofstream("trace.json") << run.trace_json();   // GraphOptions::trace = true
#pragma once

#include <array>
#include <bit>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "splitflow/core/config.hpp"

namespace splitflow {

namespace detail {
class ShardedHistogram;
}

/// Latencies in a fixed 4 KiB, whatever the run's length: log-linear buckets (8 per power of
/// two, so a reported percentile is within 12.5% above the true value).
class LatencyHistogram {
 public:
  static constexpr int kSubBits = 3;
  static constexpr int kBuckets = 64 << kSubBits;

  /// Records `count` values of `v` units (nanoseconds unless set_unit() says otherwise).
  void record(std::uint64_t v, std::uint64_t count = 1) noexcept;
  void merge(const LatencyHistogram& other) noexcept;
  std::uint64_t count() const noexcept { return count_; }
  /// Figures in nanoseconds (exact, unlike the percentiles).
  std::uint64_t max() const noexcept { return to_ns(max_); }
  std::uint64_t min() const noexcept { return count_ ? to_ns(min_) : 0; }
  /// Upper bound of the bucket holding the p-th percentile (p in [0, 100]); 0 when empty.
  std::uint64_t percentile(double p) const noexcept;
  double mean() const noexcept {
    return count_ ? static_cast<double>(sum_) / static_cast<double>(count_) * unit_ns_ : 0.0;
  }
  /// Nanoseconds per recorded unit (the runtime records clock ticks and converts on reading).
  void set_unit(double ns_per_unit) noexcept { unit_ns_ = ns_per_unit; }

 private:
  friend class detail::ShardedHistogram;  // records into its shards without a lock
  // Bucket b covers values whose top bit is at position e = b >> kSubBits (values below 8 have
  // their own buckets) and whose next kSubBits bits are b & 7: eight buckets per power of two.
  static int bucket(std::uint64_t v) noexcept {
    if (v < (1u << kSubBits)) return static_cast<int>(v);
    const int e = 63 - std::countl_zero(v);  // >= kSubBits
    const int sub = static_cast<int>((v >> (e - kSubBits)) & ((1u << kSubBits) - 1));
    return ((e - kSubBits + 1) << kSubBits) + sub;
  }
  static std::uint64_t upper(int bucket) noexcept;
  std::uint64_t to_ns(std::uint64_t v) const noexcept {
    return static_cast<std::uint64_t>(static_cast<double>(v) * unit_ns_);
  }
  std::array<std::uint64_t, kBuckets> buckets_{};
  std::uint64_t count_ = 0, max_ = 0, sum_ = 0, min_ = ~std::uint64_t{0};
  double unit_ns_ = 1.0;
};

/// One invocation of a stage (a claim: its body ran on `items` items in a row).
struct InvocationEvent {
  const std::string* graph;
  const std::string* stage;
  std::uint64_t first_item;  ///< sequence number of its first item
  std::size_t items;
  std::int64_t begin_ns;     ///< steady_clock nanoseconds
  std::int64_t end_ns;       ///< 0 in on_stage_begin
  std::size_t queued;        ///< items left in the stage's input queue(s) at begin
  std::int64_t ring_bytes = -1;  ///< GPU stages fed through a pinned ring: its bytes in use
};

/// A GPU stage invocation's stream lease.
struct LeaseEvent {
  const std::string* graph;
  const std::string* stage;
  std::uint64_t item;
  int stream;                ///< index in the device's pool
  std::int64_t t_ns;
};

/// A kernel or copy executing on the device, for a GPU stage invocation.
struct DeviceOpEvent {
  const std::string* graph;
  const std::string* stage;
  std::uint64_t item;
  int stream;
  enum Kind { kernel, h2d, d2h } kind;
  std::size_t bytes;          ///< copies
  std::int64_t begin_ns, end_ns;
};

/// A decision of the autotuner for a graph's stages with Concurrency::automatic
/// (docs/autotune.md), as it is made: the same decisions, in the same order, as
/// RunStats::autotune.
struct TuningEvent {
  const std::string* graph;
  const std::string* stage;   ///< empty for the graph as a whole (the model, a kept change)
  const std::string* knob;    ///< "concurrency", "capacity", "max_in_flight" (the graph), "ring_bytes", or empty
  std::size_t from, to;       ///< the knob's value before and after (0 when there is no knob)
  const std::string* reason;  ///< why ("'heavy' busy 98% ...")
  const std::string* text;    ///< the decision as RunStats::autotune words it
  std::int64_t t_ns;          ///< steady_clock nanoseconds, at the end of the window
};

/// Receives a graph's events as they happen (GraphOptions::observer). Called on arena threads
/// and device threads, concurrently: implementations must be thread-safe, cheap, and must not
/// block or throw.
class Observer {
 public:
  virtual ~Observer() = default;
  virtual void on_stage_begin(const InvocationEvent&) {}
  virtual void on_stage_end(const InvocationEvent&) {}
  virtual void on_lease_acquire(const LeaseEvent&) {}
  virtual void on_lease_release(const LeaseEvent&) {}
  virtual void on_device_op(const DeviceOpEvent&) {}
  /// From the run's tuner thread (only with stages of Concurrency::automatic).
  virtual void on_tune(const TuningEvent&) {}
};

}  // namespace splitflow
