#include "splitflow/executor/detail/node.hpp"

#include <algorithm>
#include <cmath>

#include <oneapi/tbb/task_arena.h>

#include "splitflow/executor/detail/graph_core.hpp"
#include "executor/runtime_core.hpp"
#include "splitflow/core/error.hpp"

namespace splitflow::detail {

int this_arena_slot(const void* owner) noexcept { return RuntimeCore::arena_slot(owner); }

namespace {
const char* what_of(StageKind k) {
  switch (k) {
    case StageKind::source: return "source";
    case StageKind::sink: return "sink";
    case StageKind::pull_sink: return "pull sink";
    case StageKind::zip: return "zip";
    case StageKind::gpu_stage: return "GPU stage";
    case StageKind::stage: break;
  }
  return "stage";
}
}  // namespace

NodeBase::NodeBase(GraphCore& graph, std::string name, StageKind kind, const StageOptions& opts,
                   int ports)
    : graph_(&graph),
      name_(std::move(name)),
      kind_(kind),
      auto_(opts.concurrency == Concurrency::automatic),
      // 0 means unlimited, in C++ as in Python (docs/api.md); a pull sink has no invocations.
      // An automatic one starts at 1 (the tuner raises it).
      concurrency_(auto_ ? 1
                   : opts.concurrency == 0 && kind != StageKind::pull_sink ? Concurrency::unlimited
                                                                           : opts.concurrency),
      order_(opts.order),
      capacity_(opts.capacity ? opts.capacity : graph.options().default_capacity),
      default_capacity_(opts.capacity == 0),
      on_error_(opts.on_error),
      nports_(ports) {}

NodeBase::~NodeBase() = default;

void NodeBase::add_successor(NodeBase& consumer, int port) {
  successors_.push_back({&consumer, port});
  ++consumer.npred_[port];
  // A merge's default queue holds the default for each producer: each gets a run of slots
  // when it wakes, so the cost per item does not grow with the number of producers.
  if (consumer.default_capacity_)
    consumer.capacity_ = graph_->options().default_capacity *
                         std::max(consumer.npred_[0], consumer.npred_[1]);
}

void NodeBase::size_default_queue(double items, std::size_t floor, std::size_t room) {
  if (!default_capacity_) return;
  const double base = static_cast<double>(graph_->options().default_capacity *
                                          std::max(npred_[0], npred_[1]));
  const auto scaled = static_cast<std::size_t>(std::ceil(base / std::max(items, 1.0)));
  // The floor never goes past what the default gives without batches (a default of 1 stays 1).
  capacity_ = std::max({scaled, std::min(floor, static_cast<std::size_t>(base)), room, std::size_t{1}});
}

void NodeBase::validate() const {
  // The graph named too, as a StageError names it (a new user's trial: "stage 'x': its output
  // is not connected to any consumer" left the graph to guess).
  const std::string who =
      "graph '" + graph_->name() + "': " + std::string(what_of(kind_)) + " '" + name_ + "'";
  for (int p = 0; p < nports_; ++p) {
    if (npred_[p] != 0) continue;
    // A GPU stage's two entries (device tensors, host tensors through its ring) are one input.
    if (kind_ == StageKind::gpu_stage && npred_[0] + npred_[1] > 0) continue;
    if (kind_ == StageKind::zip)
      throw GraphError("splitflow: " + who + ": its " + (p == 0 ? "first" : "second") +
                       " input is not connected");
    throw GraphError("splitflow: " + who + ": its input is not connected to any producer");
  }
  const bool has_output = kind_ == StageKind::source || kind_ == StageKind::stage ||
                          kind_ == StageKind::zip || kind_ == StageKind::gpu_stage;
  if (has_output && successors_.empty())
    throw GraphError("splitflow: " + who + ": its output is not connected to any consumer");
  if (on_error_ == OnError::substitute && kind_ != StageKind::stage &&
      kind_ != StageKind::gpu_stage)
    throw GraphError("splitflow: " + who +
                     ": OnError::substitute needs an output to substitute; a sink can only "
                     "fail or skip");
  if (auto_ && kind_ != StageKind::stage && kind_ != StageKind::gpu_stage)
    throw GraphError("splitflow: " + who +
                     ": Concurrency::automatic is for CPU stages (Graph::stage) and GPU stages "
                     "(Graph::gpu_stage: bursts in flight); give this one a number");
  if (kind_ == StageKind::sink && concurrency_ > 1 && order_ == Order::in_order)
    throw GraphError("splitflow: " + who +
                     ": a sink with concurrency > 1 cannot run in order; give it "
                     "Order::out_of_order, or concurrency 1");
}

void NodeBase::poke(WorkList& w) {
  std::lock_guard lk(mu_);
  collect_claims_locked(w);
  refresh_state_locked();
}

std::size_t NodeBase::try_reserve(int port, NodeBase& producer, std::size_t want, bool all_or_none) {
  std::lock_guard lk(mu_);
  Port& p = ports_[port];
  const std::size_t used = p.queued + p.reserved;
  std::size_t got = used < capacity_ ? std::min(want, capacity_ - used) : 0;
  if (all_or_none && got < want) got = 0;
  if (got > 0) got = reserve_extra_locked(port, got);
  p.reserved += got;
  if (got == 0 && std::find(waiters_.begin(), waiters_.end(), &producer) == waiters_.end())
    waiters_.push_back(&producer);
  return got;
}

void NodeBase::release_reservation(int port, std::size_t n, WorkList& w, const NodeBase* keep) {
  if (n == 0) return;
  {
    std::lock_guard lk(mu_);
    ports_[port].reserved -= n;
    take_waiters_locked(w, keep);
  }
  release_extra(port, n);
}

void NodeBase::producer_closed(WorkList& w) {
  std::lock_guard lk(mu_);
  if (open_inputs_ > 0) --open_inputs_;
  collect_claims_locked(w);
  maybe_close_locked(w);
  refresh_state_locked();
}

void NodeBase::maybe_close_locked(WorkList& w) {
  if (closed_ || running_ != 0 || !inputs_done_locked() || queued_total_locked() != 0 ||
      graph_->stopping())
    return;
  closed_ = true;
  for (const Edge& e : successors_) e.node->producer_closed(w);
}

bool NodeBase::absorb_error(std::uint64_t seq, std::exception_ptr error, bool substituted) noexcept {
  // A StopRequest (the Python module's KeyboardInterrupt, SystemExit) ends the run whatever the
  // policy: a skip would have dropped a Ctrl-C as one bad item and gone on.
  if (on_error_ == OnError::fail || is_stop_request(error)) {
    // A service's request learns its own cause; the others fail with the run.
    if (ItemTracker* t = graph_->tracker()) t->item_failed(seq, name_, error);
    graph_->fail(*this, seq, std::move(error));
    return false;
  }
  std::string message;
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    message = e.what();
  } catch (...) {
    message = "unknown exception";
  }
  // A substituted item goes on and its request is answered with the substitute; a skipped
  // one's request fails with the error.
  if (ItemTracker* t = graph_->tracker(); t && !substituted) t->item_failed(seq, name_, error);
  {
    std::lock_guard lk(mu_);
    ++(substituted ? substituted_ : skipped_);
    if (errors_.size() < StageStats::kMaxItemErrors) errors_.push_back({seq, std::move(message)});
  }
  if (!substituted) dropped(seq);
  return true;
}

void NodeBase::arrived_locked(int port, std::size_t n, WorkList& w, Ticks now) {
  account_queue_locked(now);
  Port& p = ports_[port];
  p.reserved -= n;
  p.queued += n;
  items_in_ += n;
  max_queue_ = std::max(max_queue_, p.queued);
  collect_claims_locked(w);
  refresh_state_locked(now);
}

void NodeBase::rejected_locked(int port, std::size_t n, WorkList& w) {
  ports_[port].reserved -= n;
  take_waiters_locked(w);
  graph_->retire_items(n, w);
}

void NodeBase::popped_locked(int port, std::size_t n, WorkList& w, Ticks now) {
  account_queue_locked(now);
  Port& p = ports_[port];
  p.queued -= n;
  // Producers blocked on a full queue wake once it drained to half, not at every pop: with W
  // producers waiting, waking all of them for each freed slot cost O(W) per item (a merge of
  // many branches). Each wake-up then finds room for a run of items.
  if (p.queued + p.reserved <= capacity_ / 2) take_waiters_locked(w);
}

void NodeBase::begin_invocation_locked(Ticks t0) {
  ++executing_;
  max_executing_ = std::max(max_executing_, executing_);
  refresh_state_locked(t0);
}

void NodeBase::took_locked(std::size_t k, std::size_t n, WorkList& w) {
  unpopped_ -= k;
  // Fewer items than granted: a cancel dropped the rest. Give back the slots their outputs
  // reserved (consumers are downstream: locking them under our lock is in order).
  if (n < k) release_successors(outputs_for_locked(k) - (n > 0 ? outputs_for_locked(n) : 0), w);
}

void NodeBase::end_invocation(Ticks t0, Ticks body_end, std::size_t n, std::size_t emitted, WorkList& w,
                              const std::vector<Arrivals>* arrivals, std::uint64_t first) {
  const Ticks t1 = now_ticks();
  const Ticks work = (body_end != 0 ? body_end : t1) - t0;
  if (telemetry_ && n > 0) {
    // In clock ticks (scaled to ns when read), one record per run of arrivals; outside mu_.
    if (arrivals) {
      latency_.record_runs(
          *arrivals,
          [t1](const Arrivals& a) { return static_cast<std::uint64_t>(std::max<Ticks>(t1 - a.ticks, 0)); },
          [](const Arrivals& a) { return static_cast<std::uint64_t>(a.count); });
    } else {
      latency_.record(static_cast<std::uint64_t>((t1 - t0) / static_cast<Ticks>(n)), n);
    }
  }
  {
    std::lock_guard lk(mu_);
    --executing_;
    --running_;
    ++invocations_;
    items_out_ += emitted;
    work_ticks_ += work;
    if (n > 0) {
      // Smoothed time per item sets the next claims' size: about kClaimTargetNs of work each.
      const double per_item = static_cast<double>(work) / static_cast<double>(n);
      item_ticks_ = item_ticks_ == 0 ? per_item : 0.75 * item_ticks_ + 0.25 * per_item;
      const double fit = target_ticks_ / std::max(item_ticks_, 1.0);
      claim_ = static_cast<std::size_t>(std::clamp(fit, 1.0, static_cast<double>(max_claim_)));
    }
    collect_claims_locked(w);
    maybe_close_locked(w);
    refresh_state_locked(t1);
  }
  if (graph_->observed()) {
    InvocationEvent e{&graph_->name(), &name_, first, n, steady_ns_of(t0), steady_ns_of(t1), 0};
    graph_->for_each_observer([&](Observer& o) { o.on_stage_end(e); });
  }
}

void NodeBase::end_unbegun_locked(WorkList& w, bool waited) {
  if (waited) --waiting_;
  --running_;
  collect_claims_locked(w);
  maybe_close_locked(w);
  refresh_state_locked();
}

Ticks NodeBase::begin_waited_claim(std::uint64_t first, std::int64_t ring_bytes) {
  Ticks t0;
  std::size_t queued;
  {
    std::lock_guard lk(mu_);
    --waiting_;
    t0 = now_ticks();
    begin_invocation_locked(t0);
    queued = queued_total_locked();
  }
  notify_begin(t0, first, 1, queued, ring_bytes);
  return t0;
}

void NodeBase::notify_begin(Ticks t0, std::uint64_t first, std::size_t n, std::size_t queued,
                            std::int64_t ring_bytes) {
  if (!graph_->observed()) return;
  InvocationEvent e{&graph_->name(), &name_, first, n, steady_ns_of(t0), 0, queued, ring_bytes};
  graph_->for_each_observer([&](Observer& o) { o.on_stage_begin(e); });
}

void NodeBase::release_successors(std::size_t n, WorkList& w) {
  for (const Edge& e : successors_) e.node->release_reservation(e.port, n, w);
}

void NodeBase::take_waiters_locked(WorkList& w, const NodeBase* keep) {
  if (waiters_.empty()) return;
  bool kept = false;
  for (NodeBase* n : waiters_) {
    if (n == keep) kept = true;
    else w.pokes.push_back(n);
  }
  waiters_.clear();
  if (kept) waiters_.push_back(const_cast<NodeBase*>(keep));
}

std::size_t NodeBase::ready_locked() const { return 0; }

std::size_t NodeBase::claim_size_locked(std::size_t available) const {
  // About kClaimTargetNs of work per claim: a backlog larger than that becomes several claims
  // that other threads take; a smaller one is not worth splitting.
  return std::min(available, claim_);
}

void NodeBase::collect_claims_locked(WorkList& w) {
  bool blocked = false;
  if (!graph_->stopping()) {
    while (running_ < concurrency_) {
      const std::size_t ready = ready_locked();
      if (ready <= unpopped_) break;
      const std::size_t admitted = admit_locked(claim_size_locked(ready - unpopped_));
      std::size_t k = admitted;
      // Reserve the claim's outputs in every consumer, shrinking them to what the fullest one
      // grants. Zero means a consumer is full: it registered us, and will poke us when slots
      // free.
      const std::size_t want = k > 0 ? outputs_for_locked(k) : 0;
      const bool whole = want != k;  // a claim of several outputs per item gets all or none
      std::size_t outs = want;
      for (std::size_t i = 0; i < successors_.size() && outs > 0; ++i) {
        const std::size_t got = successors_[i].node->try_reserve(successors_[i].port, *this, outs, whole);
        if (got < outs)
          for (std::size_t j = 0; j < i; ++j)
            successors_[j].node->release_reservation(successors_[j].port, outs - got, w, this);
        outs = got;
      }
      if (outs < want) k = outs;  // 1:1: the claim shrinks; a batch claim waits for its slot
      if (k < admitted) unadmit_locked(admitted - k, w);
      if (k == 0) {
        blocked = true;
        break;
      }
      admitted_locked(k, w);
      ++running_;
      unpopped_ += k;
      w.claims.push_back({this, k});
    }
  }
  blocked_ = blocked;
}

void NodeBase::set_concurrency(std::size_t n, WorkList& w) {
  std::lock_guard lk(mu_);
  n = std::max<std::size_t>(n, 1);
  if (n == concurrency_) return;
  const bool raised = n > concurrency_;
  concurrency_ = n;
  if (raised) {
    collect_claims_locked(w);
    refresh_state_locked();
  }
}

void NodeBase::set_capacity(std::size_t n, WorkList& w) {
  std::lock_guard lk(mu_);
  if (!auto_capacity_) return;
  n = std::clamp<std::size_t>(n, 1, max_capacity_);
  if (n == capacity_) return;
  const bool raised = n > capacity_;
  capacity_ = n;
  if (raised) take_waiters_locked(w);  // room for the producers that found it full
}

void NodeBase::refresh_state_locked(Ticks now) {
  int s = executing_ > 0 ? kBusy : (blocked_ || waiting_ > 0 ? kBlocked : kStarved);
  if (kind_ == StageKind::pull_sink) s = ports_[0].queued > 0 ? kBusy : kStarved;
  if (s == state_) return;
  if (telemetry_) {
    if (now == 0) now = now_ticks();
    now = std::max(now, state_since_);  // (read before the lock, it may precede the last update)
    state_ticks_[state_] += now - state_since_;
    state_since_ = now;
  }
  state_ = s;
}

void NodeBase::reset(Ticks start, bool telemetry, std::size_t parallelism) {
  std::lock_guard lk(mu_);
  parallelism_ = std::max<std::size_t>(parallelism, 1);
  claim_ = 1;
  item_ticks_ = 0;
  target_ticks_ = static_cast<double>(kClaimTargetNs) / ns_per_tick();
  for (Port& p : ports_) p = Port{};
  running_ = unpopped_ = executing_ = waiting_ = 0;
  blocked_ = false;
  open_inputs_ = 0;
  for (int p = 0; p < nports_; ++p) open_inputs_ += npred_[p];
  closed_ = false;
  skipped_ = substituted_ = expired_ = 0;
  errors_.clear();
  telemetry_ = telemetry;
  stamps_ = telemetry || graph_->tracker() != nullptr;
  // (An automatic stage may go past 1 during the run: its outputs are sequenced from the start.)
  sequenced_ = order_ == Order::in_order && (concurrency_ > 1 || auto_) && !successors_.empty();
  next_ticket_ = 0;
  waiters_.clear();
  state_ = kStarved;
  state_since_ = start;
  std::fill(std::begin(state_ticks_), std::end(state_ticks_), 0);
  work_ticks_ = 0;
  items_in_ = items_out_ = invocations_ = 0;
  max_executing_ = max_queue_ = 0;
  bytes_sum_ = 0;
  bytes_samples_ = 0;
  max_item_bytes_ = 0;
  queue_area_ = 0;
  queue_since_ = start_ = start;
  latency_.reset(parallelism_, graph_->runtime_core());
}

void NodeBase::drop_queued(WorkList& w) {
  std::size_t n;
  {
    std::lock_guard lk(mu_);
    n = clear_queues_locked();
    for (Port& p : ports_) p.queued = 0;
    blocked_ = false;
    take_waiters_locked(w);
    refresh_state_locked();
  }
  if (n) graph_->retire_items(n, w);
}

void NodeBase::finalize_locked(Ticks end) {
  finalized_locked();
  if (!telemetry_) return;
  state_ticks_[state_] += end - state_since_;
  state_since_ = end;
  account_queue_locked(end);
}

StageStats NodeBase::snapshot_locked(Ticks now) const {
  StageStats s;
  s.name = name_;
  s.kind = kind_;
  s.fed_by = fed_by_;
  s.concurrency_limit = concurrency_;
  s.concurrency_automatic = auto_;
  s.capacity = kind_ == StageKind::source ? 0 : capacity_;
  s.items_in = items_in_;
  s.items_out = items_out_;
  s.invocations = invocations_;
  s.items_skipped = skipped_;
  s.items_substituted = substituted_;
  s.items_expired = expired_;
  s.errors = errors_;
  if (telemetry_) {
    Ticks t[3] = {state_ticks_[0], state_ticks_[1], state_ticks_[2]};
    if (now > state_since_) t[state_] += now - state_since_;
    s.starved_ns = ticks_to_ns(t[kStarved]);
    s.busy_ns = ticks_to_ns(t[kBusy]);
    s.blocked_ns = ticks_to_ns(t[kBlocked]);
    s.work_ns = ticks_to_ns(work_ticks_);
    const double area = queue_area_ + static_cast<double>(queued_total_locked()) *
                                          static_cast<double>(std::max<Ticks>(now - queue_since_, 0));
    const Ticks span = now - start_;
    s.mean_queue = span > 0 ? area / static_cast<double>(span) : 0.0;
    s.latency = latency_.merged();
    s.latency.set_unit(ticks_to_ns(1 << 20) / static_cast<double>(1 << 20));
  }
  for (const Edge& e : successors_) s.consumers.push_back(e.node->name());
  s.max_concurrency = max_executing_;
  s.max_queue = max_queue_;
  s.item_bytes_samples = bytes_samples_;
  if (bytes_samples_ > 0)
    s.item_bytes = static_cast<std::size_t>(std::llround(bytes_sum_ / static_cast<double>(bytes_samples_)));
  s.max_item_bytes = max_item_bytes_;
  add_stats_locked(s);
  return s;
}

}  // namespace splitflow::detail
