#include "executor/run_state.hpp"
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

RunStatus RunState::wait() {
  std::unique_lock lk(mu_);
  cv_.wait(lk, [&] { return done_; });
  if (status_ == RunStatus::failed && error_) throw_error();
  return status_;
}

bool RunState::wait_for(std::chrono::nanoseconds timeout) {
  std::unique_lock lk(mu_);
  return cv_.wait_for(lk, timeout, [&] { return done_; });
}

void RunState::cancel() {
  GraphCore* g = nullptr;
  {
    // While not done, the graph is alive (its destructor waits for done), and a unit keeps
    // the run from ending while we cancel it.
    std::lock_guard lk(mu_);
    if (done_ || !graph_->try_acquire_unit()) return;
    g = graph_;
  }
  g->cancel_holding_unit();
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
