// Per-stage and per-run statistics, readable while a run is in progress and after it ends.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "splitflow/core/config.hpp"
#include "splitflow/telemetry/telemetry.hpp"

namespace splitflow {

/// GPU figures of one graph's run.
struct GpuStats {
  std::int64_t held_ns = 0;   ///< union of the graph's stream-lease intervals
  std::int64_t busy_ns = 0;   ///< union of its kernels' and copies' execution on the device
  std::uint64_t bursts = 0;   ///< GPU-stage invocations (one lease each)
  std::int64_t lease_wait_ns = 0;  ///< summed time its invocations waited for a stream
  std::int64_t max_lease_wait_ns = 0;  ///< longest single wait
  std::uint64_t h2d_bytes = 0, d2h_bytes = 0;
  std::int64_t h2d_ns = 0, d2h_ns = 0;  ///< summed execution time of those copies
  std::uint64_t staging_copies = 0;     ///< host tensors copied into a ring (not written there)
  /// The device as a whole (every graph's work) during this run, not over its lifetime:
  /// DeviceStats' figures between the run's start and its end (or the snapshot).
  std::int64_t device_wall_ns = 0, device_busy_ns = 0;
  double device_mean_leases = 0;      ///< streams leased, averaged over the run
  std::size_t device_max_leases = 0;  ///< most streams leased at once during the run
  std::size_t device_streams = 0;
  /// held / busy: 1.0 means the GPU was held only while it worked.
  double held_over_busy() const noexcept {
    return busy_ns > 0 ? static_cast<double>(held_ns) / static_cast<double>(busy_ns) : 0.0;
  }
};

/// The runtime's device, shared by all its graphs.
struct DeviceStats {
  std::string name;
  BackendKind backend = BackendKind::host;
  std::int64_t wall_ns = 0;          ///< since the device was initialised
  std::int64_t busy_ns = 0;          ///< time with at least one kernel or copy executing
  std::int64_t held_ns = 0;          ///< time with at least one stream leased (by any graph)
  std::size_t streams = 0;
  std::size_t leases_in_use = 0;
  std::size_t max_leases_in_use = 0;
  std::size_t lease_waiters = 0;
  std::uint64_t leases = 0;
  std::int64_t lease_ns = 0;         ///< summed lease durations
  std::size_t device_bytes_in_use = 0, device_bytes_cap = 0;
  std::size_t pinned_bytes_in_use = 0, pinned_bytes_cap = 0;
  /// lease_time_ns[k]: time with exactly k streams leased (k = 0 .. streams).
  std::vector<std::int64_t> lease_time_ns;
  /// Faults injected by DeviceConfig::faults so far, by kind (all zero unless it is set).
  struct Injected {
    std::uint64_t alloc_failures = 0, burst_failures = 0, slow_kernels = 0, stalls = 0;
    std::uint64_t total() const noexcept {
      return alloc_failures + burst_failures + slow_kernels + stalls;
    }
  } injected;
  /// Streams leased, averaged over the time since the device was created.
  double mean_leases() const noexcept {
    std::int64_t total = 0;
    double sum = 0;
    for (std::size_t k = 0; k < lease_time_ns.size(); ++k) {
      total += lease_time_ns[k];
      sum += static_cast<double>(k) * static_cast<double>(lease_time_ns[k]);
    }
    return total > 0 ? sum / static_cast<double>(total) : 0.0;
  }
  double busy_fraction() const noexcept {
    return wall_ns > 0 ? static_cast<double>(busy_ns) / static_cast<double>(wall_ns) : 0.0;
  }
  /// The figures that accumulate (times, leases, lease_time_ns) between `earlier` and these:
  /// the device over that window. The gauges (in use now, at most) stay as they are.
  DeviceStats since(const DeviceStats& earlier) const {
    DeviceStats d = *this;
    d.wall_ns -= earlier.wall_ns;
    d.busy_ns -= earlier.busy_ns;
    d.held_ns -= earlier.held_ns;
    d.leases -= earlier.leases;
    d.lease_ns -= earlier.lease_ns;
    for (std::size_t k = 0; k < d.lease_time_ns.size() && k < earlier.lease_time_ns.size(); ++k)
      d.lease_time_ns[k] -= earlier.lease_time_ns[k];
    return d;
  }
  /// held / busy of the device as a whole: time it was reserved by some graph against time
  /// it worked. (A graph's own held/busy also counts its bursts queued behind other graphs'.)
  double held_over_busy() const noexcept {
    return busy_ns > 0 ? static_cast<double>(held_ns) / static_cast<double>(busy_ns) : 0.0;
  }
};

/// A service's request counters (since the graph was built) and where its answered requests'
/// time went. For each answered request, queueing + batching + gpu + other == latency.
struct ServiceStats {
  std::string graph, service;   ///< names
  std::uint64_t submitted = 0;  ///< admitted
  std::uint64_t answered = 0;   ///< completed with a result
  std::uint64_t failed = 0;     ///< completed with a stage's error or the run's end
  std::uint64_t expired = 0;    ///< completed with DeadlineError
  std::uint64_t rejected = 0;   ///< submit() threw: fail_fast admission full, its deadline passed waiting for room, or not accepting
  std::size_t pending = 0;      ///< admitted, not yet completed
  /// submit() to the answer, of answered requests, in nanoseconds.
  LatencyHistogram latency;
  /// Waiting for something other than a batch: admitted but not yet taken into the graph, in
  /// stage input queues, and for a stream lease.
  LatencyHistogram queueing;
  /// Waiting in a dynamic batch until its batch formed (0 for a graph without one).
  LatencyHistogram batching;
  /// GPU stages' bursts carrying it (its batch): from the stream lease to the completion of
  /// the work, including the body's enqueueing and the copies.
  LatencyHistogram gpu;
  /// The rest: CPU stage bodies (its own and its claim-mates' before it) and the hand-offs.
  LatencyHistogram other;
};

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
  /// Concurrency::automatic: the tuner sets concurrency_limit (the diagnosis then says so
  /// rather than advise a number).
  bool concurrency_automatic = false;
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
  /// Async stages (Graph::async_stage): the time their bodies' calls took to hand the items on,
  /// summed: their CPU part (work_ns runs to each item's answer, the wait included). -1 for
  /// other kinds.
  std::int64_t call_ns = -1;
  /// Blocking stages (StageOptions::blocking; an async stage whose answerers call
  /// Completion::charge_wait): the time their bodies waited (slept, read, blocked), summed:
  /// their wall time less their CPU time and their time runnable waiting for a CPU. -1 for the
  /// others. The tuner lets such a stage past the cores only while it waits more than it computes.
  std::int64_t wait_ns = -1;
  /// Stages whose bodies take the lock every body of the process shares (a Python body's
  /// GIL): the CPU demand their bodies held it with (sampled: a body about every millisecond,
  /// charged for the bodies since the last one), and their waits to take it (in work_ns:
  /// contention, not cost), summed. 0 for the others. The tuner's bound on such stages: their
  /// holds add up to at most the wall time, whatever their threads.
  std::int64_t serial_ns = 0;
  std::int64_t serial_wait_ns = 0;
  std::size_t max_concurrency = 0;   ///< most bodies seen executing at once
  std::size_t max_queue = 0;         ///< most items seen queued at its input
  double mean_queue = 0;             ///< items queued at its input, averaged over wall time
  /// Host bytes one item arriving at its input holds (splitflow::bytes_of, core/bytes.hpp):
  /// the mean of those sampled (the first item of every 8th delivery; with telemetry on), the
  /// largest, and how many were sampled (0: none, the two are 0). What the tuner's memory
  /// budget (RuntimeConfig::host_memory_budget) counts per queued item.
  std::size_t item_bytes = 0;
  std::size_t max_item_bytes = 0;
  std::uint64_t item_bytes_samples = 0;
  /// Time an item spent in the stage: from its arrival in the input queue to the end of the
  /// invocation that processed it (GPU stages: to its device work's completion; pull sinks: to
  /// the consumer's next(); sources: the generator's time per item).
  LatencyHistogram latency;
  /// The stages this one feeds (the graph's edges, for the diagnosis and the reports).
  std::vector<std::string> consumers;
  /// A source whose items another system produces (Node::fed_by: splitflow.dask's remote
  /// pass, its workers): what that is, for the diagnosis. Empty for the others.
  std::string fed_by;
  /// Mean bodies executing while busy (work / busy): how much of its concurrency it used.
  double mean_concurrency() const noexcept {
    return busy_ns > 0 ? static_cast<double>(work_ns) / static_cast<double>(busy_ns) : 0.0;
  }
  /// GPU stages: their pinned rings (input and output, together), in bytes; 0 without.
  std::size_t ring_capacity = 0;
  std::size_t ring_item_bytes = 0;   ///< the budget a producer reserves per item in flight
  bool ring_automatic = false;       ///< sized by the runtime (GpuStageOptions::ring_bytes = automatic)
  std::size_t ring_in_use = 0;       ///< bytes now (0 once every tensor from it is gone)
  std::size_t ring_budgets = 0;      ///< item budgets reserved by producers now
  std::uint64_t ring_wraps = 0;      ///< times the ring's head went past its end
  std::size_t ring_max_in_use = 0;
  double ring_mean_in_use = 0;       ///< bytes, averaged over the run (ring figures are each run's own)
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
  /// The tuner's decisions so far, in order (stages with Concurrency::automatic; empty
  /// without), each with its reason: "decode 1 -> 2: ...". Bounded: past 256, the first 32 and
  /// the latest are kept, with a line between them saying how many are not.
  std::vector<std::string> autotune;
  /// The items the graph let in at once when the figures were taken: GraphOptions::max_in_flight,
  /// or the tuner's lower limit under the runtime's memory budget (RuntimeConfig::
  /// host_memory_budget: docs/autotune.md, "Memory").
  std::size_t max_in_flight = 0;
  /// The threads of the runtime's task arena (RuntimeConfig::threads), which the graph's
  /// synchronous stages share: the diagnosis suggests no concurrency past them. 0: not known.
  std::size_t threads = 0;
  /// Items consumed by the graph's sinks: those a sink's body took (not those it skipped) and
  /// those that reached a pull sink's queue.
  std::uint64_t items_delivered() const noexcept;
  /// items_delivered per second of wall time.
  double throughput() const noexcept;

  /// The stage called `name`, or nullptr: a pointer into this RunStats, valid while it lives
  /// (keep the stats: `RunStats st = run.stats(); if (auto* s = st.find("decode")) ...`).
  const StageStats* find(std::string_view name) const& noexcept;
  /// On a temporary (`run.stats().find("decode")->items_out`): a copy of the stage's stats, or
  /// nullopt. A pointer into the temporary would dangle once the expression ends (a new user's
  /// trial kept `run.stats().find("t")` and read freed memory): `auto* s = run.stats().find(..)`
  /// does not compile.
  std::optional<StageStats> find(std::string_view name) &&;
  std::optional<StageStats> find(std::string_view name) const&&;
};

/// A fixed-width text table of the stats, one row per stage.
std::string format_table(const RunStats& stats);

}  // namespace splitflow
