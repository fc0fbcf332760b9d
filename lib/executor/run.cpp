#include "executor/run_state.hpp"
#include "executor/runtime_core.hpp"
#include "telemetry/tracer.hpp"
#include "splitflow/executor/detail/graph_core.hpp"
#include "splitflow/core/error.hpp"
#include "splitflow/executor/run.hpp"

namespace splitflow {
namespace detail {

void RunState::record_error(const std::string& graph, const std::string& stage,
                            std::uint64_t item, std::exception_ptr error) {
  std::lock_guard lk(mu_);
  if (error_) return;
  error_ = std::move(error);
  error_graph_ = graph;
  error_stage_ = stage;
  error_item_ = item;
}

void RunState::throw_error() const {
  std::string what = "unknown exception";
  try {
    std::rethrow_exception(error_);
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
  }
  try {
    std::rethrow_exception(error_);
  } catch (...) {
    std::throw_with_nested(StageError(error_graph_, error_stage_, error_item_, what));
  }
}

void RunState::rethrow_if_failed() const {
  std::lock_guard lk(mu_);
  if (error_) throw_error();
}

void RunState::publish(RunStatus status, RunStats stats) {
  std::lock_guard lk(mu_);
  final_ = std::move(stats);
  final_.status = status;
  status_ = status;
  done_ = true;
  graph_ = nullptr;
  cv_.notify_all();  // under the lock: a waiter may destroy the graph as soon as it wakes
}

bool RunState::wait_until(std::chrono::steady_clock::time_point deadline) {
  std::unique_lock lk(mu_);
  for (;;) {
    // One nudge per GraphCore::kNudgeAfter for the run, whoever waits and in whatever slices
    // (Python's run.wait() waits 50 ms at a time).
    const auto due = last_nudge_ + GraphCore::kNudgeAfter;
    if (cv_.wait_until(lk, std::min(deadline, due), [&] { return done_; })) return true;
    const auto now = std::chrono::steady_clock::now();
    if (now >= due) {
      // Nothing for a while: the run's arena advertises its work again (RuntimeCore::nudge).
      // While not done the graph is alive: its destructor waits for done, and a start() that
      // threw registered no state.
      graph_->runtime_core()->nudge();
      last_nudge_ = now;
    }
    if (now >= deadline) return false;
  }
}

RunStatus RunState::wait() {
  wait_until(std::chrono::steady_clock::time_point::max());
  std::lock_guard lk(mu_);
  if (status_ == RunStatus::failed && error_) throw_error();
  return status_;
}

bool RunState::wait_for(std::chrono::nanoseconds timeout) {
  const auto now = std::chrono::steady_clock::now();
  const auto left = std::chrono::steady_clock::time_point::max() - now;
  return wait_until(timeout >= left ? std::chrono::steady_clock::time_point::max()
                                    : now + std::chrono::duration_cast<std::chrono::steady_clock::duration>(timeout));
}

void RunState::cancel(GraphCore::CancelCause why) {
  GraphCore* g = nullptr;
  {
    // While not done, the graph is alive (its destructor waits for done), and a unit keeps
    // the run from ending while we cancel it.
    std::lock_guard lk(mu_);
    if (done_ || !graph_->try_acquire_unit()) return;
    g = graph_;
  }
  g->cancel_holding_unit(why);
  g->release_unit();
}

RunStatus RunState::status() const {
  std::lock_guard lk(mu_);
  return status_;
}

RunStats RunState::stats() const {
  std::lock_guard lk(mu_);
  if (!done_) return graph_->snapshot();
  RunStats s = final_;
  for (const auto& [index, late] : late_) {  // pull sinks' readers go on after the run ended
    if (index >= s.stages.size()) continue;
    std::lock_guard lk(late->mu);
    s.stages[index].items_out += late->items;
    s.stages[index].latency.merge(late->latency);
  }
  return s;
}

std::string RunState::trace_json() const {
  if (tracer_) return tracer_->json();
  static constexpr const char* kOff = "off: GraphOptions::trace (Python: trace=True) records a run's events";
  return std::string(R"({"displayTimeUnit":"ms","metadata":{"tracing":")") + kOff +
         R"("},"traceEvents":[]})";
}

}  // namespace detail

namespace {
detail::RunState& need(const std::shared_ptr<detail::RunState>& s) {
  if (!s) throw GraphError("splitflow::Run: empty handle (default-constructed)");
  return *s;
}
}  // namespace

RunStatus Run::wait() const { return need(state_).wait(); }
bool Run::wait_for(std::chrono::nanoseconds timeout) const { return need(state_).wait_for(timeout); }
void Run::cancel() const { need(state_).cancel(); }
RunStatus Run::status() const { return need(state_).status(); }
RunStats Run::stats() const { return need(state_).stats(); }
std::string Run::trace_json() const { return need(state_).trace_json(); }

}  // namespace splitflow
