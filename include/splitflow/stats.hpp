// Per-stage and per-run statistics, readable while a run is in progress and after it ends.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "splitflow/device.hpp"
#include "splitflow/telemetry.hpp"

namespace splitflow {

enum class RunStatus { running, succeeded, failed, cancelled };
const char* to_string(RunStatus s) noexcept;

enum class StageKind { source, stage, sink, pull_sink, zip, gpu_stage };
const char* to_string(StageKind k) noexcept;

/// What one stage did during a run. Times are in nanoseconds of the run's wall time.
/// At every instant a stage is in exactly one state, so busy + starved + blocked == the run's
/// wall time (up to the moment of a live snapshot):
///  - busy:    at least one invocation of its body is executing;
///  - blocked: it has input and free concurrency but a consumer's queue is full (or, for a
///             source, the graph's max_in_flight is reached);
///  - starved: otherwise (no input, or waiting for a thread). A pull sink counts as busy while
///             items wait for the consumer.
/// An item a stage skipped or substituted (StageOptions::on_error), with its error's message.
struct ItemError {
  std::uint64_t item;   ///< the item's sequence number at its source
  std::string message;  ///< what the body threw (ops name the file or value at fault)
};

struct StageStats {
  std::string name;
  StageKind kind = StageKind::stage;
  std::size_t concurrency_limit = 1;
  std::size_t capacity = 0;          ///< input queue capacity (0 for sources)
  std::uint64_t items_in = 0;        ///< items that arrived in its input queue(s)
  std::uint64_t items_out = 0;       ///< items emitted (sources, stages) or consumed (sinks)
  /// Invocations (claims). One runs the body on one or more items in a row: splitflow sizes
  /// them from the measured body time, about 20 us of work each, so that cheap bodies do not
  /// pay the scheduling cost per item.
  std::uint64_t invocations = 0;
  /// Items whose body threw and that were dropped (OnError::skip) or replaced
  /// (OnError::substitute). The run goes on; `errors` keeps the first kMaxItemErrors of them.
  std::uint64_t items_skipped = 0;
  std::uint64_t items_substituted = 0;
  /// GPU stages: requests dropped before their GPU work because their deadline had passed.
  std::uint64_t items_expired = 0;
  static constexpr std::size_t kMaxItemErrors = 64;
  std::vector<ItemError> errors;
  std::int64_t busy_ns = 0;
  std::int64_t starved_ns = 0;
  std::int64_t blocked_ns = 0;
  std::int64_t work_ns = 0;          ///< sum of body durations (exceeds busy with concurrency)
  std::size_t max_concurrency = 0;   ///< most bodies seen executing at once
  std::size_t max_queue = 0;         ///< most items seen queued at its input
  double mean_queue = 0;             ///< items queued at its input, averaged over wall time
  /// Time an item spent in the stage: from its arrival in the input queue to the end of the
  /// invocation that processed it (GPU stages: to its device work's completion; pull sinks: to
  /// the consumer's next(); sources: the generator's time per item).
  LatencyHistogram latency;
  /// The stages this one feeds (the graph's edges, for the diagnosis and the reports).
  std::vector<std::string> consumers;
  /// Mean bodies executing while busy (work / busy): how much of its concurrency it used.
  double mean_concurrency() const noexcept {
    return busy_ns > 0 ? static_cast<double>(work_ns) / static_cast<double>(busy_ns) : 0.0;
  }
  /// GPU stages: their pinned rings (input and output, together), in bytes; 0 without.
  std::size_t ring_capacity = 0;
  std::size_t ring_item_bytes = 0;   ///< the budget a producer reserves per item in flight
  std::size_t ring_in_use = 0;       ///< bytes now (0 once every tensor from it is gone)
  std::size_t ring_budgets = 0;      ///< item budgets reserved by producers now
  std::uint64_t ring_wraps = 0;      ///< times the ring's head went past its end
  std::size_t ring_max_in_use = 0;
  double ring_mean_in_use = 0;       ///< bytes, averaged over the time since the ring was made
  std::uint64_t ring_refusals = 0;   ///< reservations refused because the ring was full
  std::int64_t ring_wait_ns = 0;     ///< time producers waited for ring space
};

struct RunStats {
  std::string graph;
  RunStatus status = RunStatus::running;
  std::int64_t wall_ns = 0;
  std::vector<StageStats> stages;  ///< in the order the stages were added to the graph
  /// GPU figures (all zero for a graph without GPU stages).
  GpuStats gpu;
  /// Items consumed by the graph's sinks.
  std::uint64_t items_delivered() const noexcept;
  /// items_delivered per second of wall time.
  double throughput() const noexcept;

  /// The stage called `name`, or nullptr.
  const StageStats* find(std::string_view name) const noexcept;
};

/// A fixed-width text table of the stats, one row per stage.
std::string format_table(const RunStats& stats);

}  // namespace splitflow
