// Run: the handle of one execution of a graph.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "splitflow/telemetry/stats.hpp"

namespace splitflow {

namespace detail {
class RunState;
}

/// Returned by `Graph::run()`. Copies share the same run. The handle stays valid (status and
/// final stats readable) after the graph is destroyed.
class Run {
 public:
  Run() = default;
  explicit Run(std::shared_ptr<detail::RunState> state) : state_(std::move(state)) {}

  /// Blocks until the run ends and returns how it ended. If a stage failed, throws its
  /// StageError (naming the graph, the stage and the item; the original exception nested).
  RunStatus wait() const;
  /// Like wait() but gives up after `timeout`; returns false if the run is still going.
  bool wait_for(std::chrono::nanoseconds timeout) const;
  /// Stops the run: sources stop at once, items waiting in queues are dropped, bodies already
  /// executing finish (their outputs are dropped). wait() then returns RunStatus::cancelled.
  /// Does nothing if the run has ended.
  void cancel() const;
  RunStatus status() const;
  /// A live snapshot while the run is in progress, the final figures after.
  RunStats stats() const;
  /// The run's Chrome trace (chrome://tracing, ui.perfetto.dev) when GraphOptions::trace was
  /// set; otherwise a trace without events whose metadata says so ("tracing": "off: ..."), so
  /// that a reader parsing it is told rather than failing on "". Complete once the run ended.
  std::string trace_json() const;

  bool valid() const noexcept { return state_ != nullptr; }

 private:
  std::shared_ptr<detail::RunState> state_;
};

}  // namespace splitflow
