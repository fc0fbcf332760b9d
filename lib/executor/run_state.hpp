// RunState: what a Run handle shares with the graph that runs it. Internal to the library.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "splitflow/executor/detail/graph_core.hpp"
#include "splitflow/executor/detail/node.hpp"
#include "splitflow/telemetry/stats.hpp"

namespace splitflow::detail {

class GraphCore;
class Tracer;

class RunState {
 public:
  explicit RunState(GraphCore* graph) : graph_(graph) {}

  /// The first error of the run; later ones are ignored.
  void record_error(const std::string& graph, const std::string& stage, std::uint64_t item,
                    std::exception_ptr error);
  void rethrow_if_failed() const;

  /// The run ended: the graph is no longer touched through this state.
  void publish(RunStatus status, RunStats stats);

  RunStatus wait();
  bool wait_for(std::chrono::nanoseconds timeout);
  /// Until done or `deadline`; every GraphCore::kNudgeAfter without the end (for the run,
  /// whoever waits), the run's arena is nudged (RuntimeCore::nudge).
  bool wait_until(std::chrono::steady_clock::time_point deadline);
  void cancel(GraphCore::CancelCause why = GraphCore::CancelCause::call);
  RunStatus status() const;
  RunStats stats() const;
  /// The run's trace (GraphOptions::trace), or an empty one saying that tracing was off.
  void set_tracer(std::shared_ptr<Tracer> t) { tracer_ = std::move(t); }
  /// Stage `index` is a pull sink whose reader may go on taking items after the run ended:
  /// the final stats add what it took then. Set before the run starts.
  void track_late_takes(std::size_t index, std::shared_ptr<const LateTakes> late) {
    late_.emplace_back(index, std::move(late));
  }
  std::string trace_json() const;

 private:
  [[noreturn]] void throw_error() const;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  GraphCore* graph_;  // valid while !done_
  bool done_ = false;
  RunStatus status_ = RunStatus::running;
  // The last nudge of the run's arena (wait_until), from the start.
  std::chrono::steady_clock::time_point last_nudge_ = std::chrono::steady_clock::now();
  RunStats final_;
  std::exception_ptr error_;
  std::string error_graph_, error_stage_;
  std::uint64_t error_item_ = 0;
  std::shared_ptr<Tracer> tracer_;  // set before the run starts
  std::vector<std::pair<std::size_t, std::shared_ptr<const LateTakes>>> late_;
};

}  // namespace splitflow::detail
