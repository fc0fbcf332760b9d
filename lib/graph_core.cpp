#include "splitflow/detail/graph_core.hpp"

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "device/device_runtime.hpp"
#include "run_state.hpp"
#include "runtime_core.hpp"
#include "telemetry/tracer.hpp"
#include "splitflow/error.hpp"
#include "splitflow/graph.hpp"

namespace splitflow {
namespace detail {

GraphCore::GraphCore(std::shared_ptr<RuntimeCore> runtime, std::string name, GraphOptions opts)
    : runtime_(std::move(runtime)), name_(std::move(name)), opts_(opts) {
  if (opts_.max_in_flight == 0 || opts_.default_capacity == 0)
    throw GraphError("splitflow::Graph '" + name_ +
                     "': max_in_flight and default_capacity must be at least 1");
}

GraphCore::~GraphCore() {
  std::shared_ptr<RunState> run;
  {
    std::lock_guard lk(mu_);
    run = current_;
  }
  if (!run) return;
  run->cancel();
  try {
    run->wait();
  } catch (...) {  // the run's failure belongs to whoever holds its Run handle
  }
}

std::shared_ptr<DeviceRuntime> GraphCore::device() { return runtime_->device(); }

GpuAccount* GraphCore::gpu_account() {
  if (!gpu_) gpu_ = std::make_unique<GpuAccount>();  // before the run starts (prepare)
  return gpu_.get();
}

bool GraphCore::post_if_running(std::function<void(WorkList&)> fn) {
  if (!try_acquire_unit()) return false;
  post(std::move(fn));
  release_unit();  // post took its own
  return true;
}

void GraphCore::post(std::function<void(WorkList&)> fn) {
  pending_.fetch_add(1, std::memory_order_relaxed);
  runtime_->spawn_urgent([this, fn = std::move(fn)] {
    try {
      WorkList w;
      fn(w);
      execute(w);
    } catch (...) {
      fail(*nodes_.front(), 0, std::current_exception());
    }
    release_unit();
  });
}

NodeBase& GraphCore::adopt(std::unique_ptr<NodeBase> node) {
  check_mutable();
  for (const auto& n : nodes_)
    if (n->name() == node->name())
      throw GraphError("splitflow::Graph '" + name_ + "': a stage named '" + node->name() +
                       "' already exists (stage names are unique within a graph)");
  if (node->kind() == StageKind::source) sources_.push_back(node.get());
  nodes_.push_back(std::move(node));
  return *nodes_.back();
}

void GraphCore::check_mutable() const {
  std::lock_guard lk(mu_);
  if (active_)
    throw GraphError("splitflow::Graph '" + name_ + "': cannot change the graph while it runs");
}

void GraphCore::validate() {
  if (sources_.empty()) throw GraphError("splitflow::Graph '" + name_ + "': it has no source");
  if (tracker_ && sources_.size() > 1)
    throw GraphError("splitflow::Graph '" + name_ +
                     "': a graph with a service has no other source (its items are requests)");
  for (const auto& n : nodes_) n->validate();
  // Kahn's algorithm: the per-node lock order relies on the graph being acyclic.
  std::unordered_map<const NodeBase*, std::size_t> indegree;
  for (const auto& n : nodes_)
    for (const Edge& e : n->successors()) ++indegree[e.node];
  std::vector<NodeBase*> ready, order;
  for (const auto& n : nodes_)
    if (indegree[n.get()] == 0) ready.push_back(n.get());
  while (!ready.empty()) {
    NodeBase* n = ready.back();
    ready.pop_back();
    order.push_back(n);
    for (const Edge& e : n->successors())
      if (--indegree[e.node] == 0) ready.push_back(e.node);
  }
  if (order.size() != nodes_.size()) {
    std::string names;
    for (const auto& n : nodes_)
      if (indegree[n.get()] > 0) names += (names.empty() ? "'" : ", '") + n->name() + "'";
    throw GraphError("splitflow::Graph '" + name_ + "': it has a cycle through " + names +
                     " (graphs must be acyclic)");
  }
  topo_ = std::move(order);
}

std::shared_ptr<RunState> GraphCore::start() {
  std::shared_ptr<RunState> run;
  {
    std::lock_guard lk(mu_);
    if (active_)
      throw GraphError("splitflow::Graph '" + name_ +
                       "': it is already running; wait for its run or cancel it first");
    validate();
    for (auto& n : nodes_) n->prepare();  // may throw: nothing is registered yet
    run = std::make_shared<RunState>(this);
    runtime_->register_run(run);
    telemetry_ = runtime_->config().telemetry;
    start_ = now_ticks();
    for (auto& n : nodes_) n->reset(start_, telemetry_, runtime_->threads());
    if (gpu_) gpu_->reset();
    observers_.clear();
    if (opts_.observer) observers_.push_back(opts_.observer.get());
    if (opts_.trace) {
      std::vector<std::string> names;
      for (const auto& n : nodes_) names.push_back(n->name());
      auto tracer = std::make_shared<Tracer>(name_, std::move(names), opts_.trace_max_events,
                                             steady_ns_of(start_));
      observers_.push_back(tracer.get());
      run->set_tracer(std::move(tracer));
    }
    stop_.store(false, std::memory_order_relaxed);
    stop_reason_.store(StopReason::none, std::memory_order_relaxed);
    {
      std::lock_guard tl(token_mu_);
      token_waiters_.clear();
      token_waiting_.store(false);
    }
    // One unit per source (released when it is exhausted) and one for the starting task.
    pending_.store(sources_.size() + 1, std::memory_order_release);
    current_ = run;
    active_ = true;
  }
  runtime_->spawn([this] { run_task({nullptr, 0}); }, /*fair=*/true);
  return run;
}

void GraphCore::run_task(Claim first) noexcept {
  try {
    WorkList w;
    if (first.node) {
      first.node->run_claim(w, first.items);
    } else {
      for (NodeBase* s : sources_) s->poke(w);
    }
    execute(w);
  } catch (...) {
    // Only the runtime's own failures get here (bodies are guarded): fail the run.
    fail(first.node ? *first.node : *nodes_.front(), 0, std::current_exception());
  }
  release_unit();
}

void GraphCore::execute(WorkList& w) {
  for (;;) {
    while (!w.pokes.empty()) w.pokes.pop_back()->poke(w);
    if (w.claims.empty()) return;
    // Continue with the first claim (the items just produced, downstream: cache-warm) and
    // hand the rest to other threads.
    runtime_->run_urgent();  // device completions first: they unblock the GPU
    if (runtime_->slice_expired()) {  // this thread's turn is over: the rest waits in line
      for (std::size_t i = 0; i < w.claims.size(); ++i) spawn(w.claims[i]);
      w.claims.clear();
      return;
    }
    const Claim next = w.claims[0];
    for (std::size_t i = 1; i < w.claims.size(); ++i) spawn(w.claims[i]);
    w.claims.clear();
    next.node->run_claim(w, next.items);
  }
}

void GraphCore::spawn(Claim c) {
  pending_.fetch_add(1, std::memory_order_relaxed);
  runtime_->spawn([this, c] { run_task(c); }, /*fair=*/false);
}

void GraphCore::dispatch_external(WorkList& w) {
  while (!w.pokes.empty()) w.pokes.pop_back()->poke(w);
  for (std::size_t i = 0; i < w.claims.size(); ++i) spawn(w.claims[i]);
  w.claims.clear();
}

void GraphCore::retire_items(std::uint64_t n, WorkList& w) noexcept {
  pending_.fetch_sub(n << kItemShift, std::memory_order_seq_cst);
  // Dekker with try_admit(): either we see the waiter's flag or it sees our decrement.
  if (token_waiting_.load(std::memory_order_seq_cst)) {
    std::lock_guard lk(token_mu_);
    for (NodeBase* s : token_waiters_) w.pokes.push_back(s);
    token_waiters_.clear();
    token_waiting_.store(false, std::memory_order_relaxed);
  }
}

std::size_t GraphCore::try_admit(NodeBase& source, std::size_t want) {
  const auto room = [this] {
    const std::uint64_t items = pending_.load(std::memory_order_seq_cst) >> kItemShift;
    return items < opts_.max_in_flight ? static_cast<std::size_t>(opts_.max_in_flight - items) : 0;
  };
  if (const std::size_t r = room()) return std::min(want, r);
  {
    std::lock_guard lk(token_mu_);
    if (std::find(token_waiters_.begin(), token_waiters_.end(), &source) == token_waiters_.end())
      token_waiters_.push_back(&source);
    token_waiting_.store(true, std::memory_order_seq_cst);
  }
  return std::min(want, room());
}

bool GraphCore::try_acquire_unit() noexcept {
  std::uint64_t v = pending_.load(std::memory_order_acquire);
  while (v != 0)
    if (pending_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) return true;
  return false;
}

void GraphCore::release_unit() noexcept {
  if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) complete();
}

void GraphCore::cancel() noexcept {
  if (!try_acquire_unit()) return;
  cancel_holding_unit();
  release_unit();
}

void GraphCore::cancel_holding_unit() noexcept { stop(StopReason::cancelled); }

void GraphCore::fail(const NodeBase& node, std::uint64_t seq, std::exception_ptr error) noexcept {
  StopReason expected = StopReason::none;
  if (!stop_reason_.compare_exchange_strong(expected, StopReason::failed)) return;
  std::shared_ptr<RunState> run;
  {
    std::lock_guard lk(mu_);
    run = current_;
  }
  run->record_error(name_, node.name(), seq, std::move(error));
  stop(StopReason::failed);
}

void GraphCore::stop(StopReason why) noexcept {
  StopReason expected = StopReason::none;
  stop_reason_.compare_exchange_strong(expected, why);
  stop_.store(true, std::memory_order_release);
  WorkList w;
  for (auto& n : nodes_) n->drop_queued(w);
  // Pokes would grant nothing now that the run is stopping.
}

void GraphCore::rethrow_if_failed() const {
  std::shared_ptr<RunState> run;
  {
    std::lock_guard lk(mu_);
    run = current_;
  }
  if (run) run->rethrow_if_failed();
}

RunStats GraphCore::collect_stats(bool final) const {
  // Hold every node's lock, taken in topological order (the global lock order), so that all
  // stages are read at the same instant and each one's states add up to the wall time.
  std::vector<std::unique_lock<SpinLock>> locks;
  locks.reserve(topo_.size());
  for (NodeBase* n : topo_) locks.emplace_back(n->mutex());
  const Ticks now = now_ticks();
  RunStats st;
  st.graph = name_;
  st.status = RunStatus::running;
  st.wall_ns = ticks_to_ns(now - start_);
  st.stages.reserve(nodes_.size());
  for (const auto& n : nodes_) {
    if (final) n->finalize_locked(now);
    st.stages.push_back(n->snapshot_locked(now));
  }
  if (gpu_) st.gpu = gpu_->snapshot(steady_now_ns());
  return st;
}

RunStats GraphCore::snapshot() const { return collect_stats(false); }

void GraphCore::complete() noexcept {
  std::shared_ptr<RunState> run;
  {
    std::lock_guard lk(mu_);
    run = current_;
  }
  RunStats st = collect_stats(true);
  const StopReason why = stop_reason_.load();
  const RunStatus status = why == StopReason::failed      ? RunStatus::failed
                           : why == StopReason::cancelled ? RunStatus::cancelled
                                                          : RunStatus::succeeded;
  runtime_->unregister_run(run.get());
  {
    // Together, so that a new run cannot start between them and have its pull sinks ended.
    std::lock_guard lk(mu_);
    for (auto& n : nodes_) n->end_of_stream();
    active_ = false;
  }
  run->publish(status, std::move(st));
}

}  // namespace detail

Graph::Graph(Runtime& runtime, std::string name, GraphOptions options)
    : core_(std::make_unique<detail::GraphCore>(runtime.core(), std::move(name), options)) {}
Graph::~Graph() = default;
Graph::Graph(Graph&&) noexcept = default;
Graph& Graph::operator=(Graph&&) noexcept = default;

Run Graph::run() { return Run(core_->start()); }

}  // namespace splitflow
