// Typed nodes: input queues, bodies and emission. The scheduling logic they share is in
// NodeBase (lib/node.cpp); what is here is only what needs the item types.
#pragma once

#include <algorithm>
#include <atomic>
#include <cassert>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "splitflow/executor/autotune.hpp"
#include "splitflow/executor/detail/graph_core.hpp"
#include "splitflow/executor/detail/node.hpp"
#include "splitflow/core/detail/gate.hpp"
#include "splitflow/core/detail/scratch.hpp"
#include "splitflow/device/device.hpp"
#include "splitflow/core/error.hpp"

namespace splitflow::detail {

/// A node's input queue of T on one port. The queue is guarded by the node's lock, and its
/// length never exceeds the capacity because every push fills reserved slots.
template <class T>
class InputPort final : public Receiver<T> {
 public:
  using value_type = T;
  using Receiver<T>::Receiver;

  void push(std::vector<Envelope<T>>& items, WorkList& w, Ticks produced, const NodeBase&) override {
    // The items' arrival time, for their latency: when the producer made them, or read now,
    // before locking to keep the lock short.
    const Ticks now = this->node_->stamps() ? (produced ? produced : now_ticks()) : 0;
    const std::size_t bytes = this->sample_bytes(items);
    std::lock_guard lk(this->node_->mutex());
    if (this->node_->graph().stopping()) {
      this->node_->rejected_locked(this->port_, items.size(), w);
      return;
    }
    if (bytes) this->node_->sampled_bytes_locked(bytes);
    for (auto& e : items) queue_.push_back(std::move(e));
    if (!arrivals_.empty() && arrivals_.back().ticks == now) {
      arrivals_.back().count += items.size();
    } else {
      arrivals_.push_back({items.size(), now});
    }
    this->node_->arrived_locked(this->port_, items.size(), w, now);
  }
  // Under the node's lock:
  std::size_t size() const noexcept { return queue_.size(); }
  /// Moves up to k items from the front into `out`, and the runs of their arrival times into
  /// `arrivals`; returns how many.
  std::size_t pop(std::vector<Envelope<T>>& out, std::vector<Arrivals>& arrivals, std::size_t k) {
    const std::size_t n = std::min(k, queue_.size());
    for (std::size_t i = 0; i < n; ++i) {
      out.push_back(std::move(queue_.front()));
      queue_.pop_front();
    }
    for (std::size_t left = n; left > 0;) {
      Arrivals& a = arrivals_.front();
      const std::size_t take = std::min(left, a.count);
      arrivals.push_back({take, a.ticks});
      left -= take;
      if ((a.count -= take) == 0) arrivals_.pop_front();
    }
    return n;
  }
  std::size_t clear() noexcept {
    const std::size_t n = queue_.size();
    queue_.clear();
    arrivals_.clear();
    return n;
  }

 private:
  std::deque<Envelope<T>> queue_;
  std::deque<Arrivals> arrivals_;  // runs, covering queue_ in order
};

/// Tells a service's tracker how long the popped `items` waited in their input queue, from
/// their arrival (`arrivals`, runs in order) to `t0`. Call without the node's lock.
template <class T>
void report_waits(GraphCore& g, const std::vector<Envelope<T>>& items,
                  const std::vector<Arrivals>& arrivals, Ticks t0) noexcept {
  ItemTracker* t = g.tracker();
  if (!t) return;
  std::size_t i = 0;
  for (const Arrivals& a : arrivals)
    for (std::size_t j = 0; j < a.count && i < items.size(); ++j, ++i)
      t->waited(items[i].seq, ticks_to_ns(t0 - a.ticks));
}

template <class Queue, class Hook>
void NodeBase::run_input_claim(Queue& port, WorkList& w, std::size_t k, Hook&& hook) {
  using Item = typename Queue::value_type;
  Scratch<Envelope<Item>> in;
  Scratch<Arrivals> arrivals;
  std::size_t n = 0;
  claim(
      w, k,
      [&](Ticks) {
        n = port.pop(*in, *arrivals, k);
        return Taken{.items = n, .popped = {n, 0}, .tickets = n, .announced = n,
                     .first = n ? in->front().seq : 0};
      },
      [&](const ClaimInfo& c, Ticks t0) {
        report_waits(*graph_, *in, *arrivals, t0);
        ClaimResult r = hook(*in, c);
        r.items = n;
        r.arrivals = &*arrivals;
        in->clear();
        return r;
      });
}

/// A node kind with one input port of `In`, on `Base` (NodeBase, or Emitter<Out> for one with
/// an output). The claim lifecycle is NodeBase::run_input_claim's; the kind supplies only its
/// hook, `ClaimResult process(std::vector<Envelope<In>>& items, const ClaimInfo&, WorkList&)`.
template <class Derived, class Base, class In>
class OneInputNode : public Base {
 public:
  template <class... Args>
  explicit OneInputNode(Args&&... args) : Base(std::forward<Args>(args)...), in_(*this, 0) {}

  Receiver<In>& input() noexcept { return in_; }

  void run_claim(WorkList& w, std::size_t k) final {
    this->run_input_claim(in_, w, k, [&](std::vector<Envelope<In>>& items, const ClaimInfo& c) {
      return static_cast<Derived&>(*this).process(items, c, w);
    });
  }

  std::size_t clear_queues_locked() final { return in_.clear(); }

 protected:
  std::size_t ready_locked() const override { return in_.size(); }

  InputPort<In> in_;
};

/// Items that carry the ids of several items (Batch<T>): an error on one reaches all of them.
template <class T>
concept CarriesIds = requires(const T& t) {
  { t.ids } -> std::convertible_to<const std::vector<std::uint64_t>&>;
};

/// The ids `item` carries when it holds several items: a batch's (`Batch<T>::ids`), or what an
/// item type that may hold a batch (a type-erased one: the Python module's Value) says through
/// an `item_ids(item)` found by argument-dependent lookup; null otherwise.
template <class T>
const std::vector<std::uint64_t>* carried_ids(const T& item) {
  if constexpr (CarriesIds<T>) {
    return &item.ids;
  } else if constexpr (requires { { item_ids(item) } -> std::convertible_to<const std::vector<std::uint64_t>*>; }) {
    return item_ids(item);
  } else {
    (void)item;
    return nullptr;
  }
}

/// The ids an error on `item` must reach besides its own number: a batch's items, when a
/// service follows the requests (whatever the stage's OnError: under fail, every request of
/// the failing batch gets the error, the others the run's end). Read before the body.
template <class In>
std::vector<std::uint64_t> ids_for_errors(const NodeBase& node, const In& item) {
  if (!node.graph().tracker()) return {};
  const std::vector<std::uint64_t>* ids = carried_ids(item);
  return ids ? *ids : std::vector<std::uint64_t>{};
}

/// Whether `item` carries exactly `ids` (a batch's substitute answering that batch's requests).
template <class T>
bool carries_ids(const T& item, const std::vector<std::uint64_t>& ids) {
  const std::vector<std::uint64_t>* mine = carried_ids(item);
  return mine && *mine == ids;
}

/// Thrown by a body wrapper under OnError::substitute to emit `value` in place of the stage's
/// fixed substitute: the item with only its failed part replaced (the Python module's field=
/// stages keep a sample's other fields so). `cause` is the body's own error: the one counted,
/// named in the stats and reported. Under another OnError it stands for its cause.
template <class T>
struct SubstituteWith {
  T value;
  std::exception_ptr cause;
};

/// Base of nodes with an output of type Out: fan-out to consumers and in-order emission.
template <class Out>
class Emitter : public NodeBase {
 public:
  using NodeBase::NodeBase;

  void add_target(Receiver<Out>& r) {
    add_successor(r.node(), r.port());
    targets_.push_back(&r);
  }
  std::size_t fan_out() const noexcept { return targets_.size(); }
  bool feeds(const Receiver<Out>& r) const noexcept {
    return std::find(targets_.begin(), targets_.end(), &r) != targets_.end();
  }
  /// OnError::substitute: the value emitted in place of an item whose body threw.
  void set_substitute(Out value) {
    static_assert(copyable_v<Out>,
                  "splitflow: substitute_on_error copies its value for each failing item, so the "
                  "output type must be copyable");
    this->graph().check_mutable();
    substitute_ = std::make_shared<const Out>(std::move(value));
    this->on_error_ = OnError::substitute;
  }
  void validate() const override {
    NodeBase::validate();
    if (this->on_error_ == OnError::substitute && !substitute_)
      throw GraphError("splitflow::Graph '" + this->graph().name() + "': stage '" + this->name() +
                       "': on_error is OnError::substitute but it has no substitute value; "
                       "give one with substitute_on_error(value)");
  }
  /// A body threw on item `seq` (a batch of `ids`, see ids_for_errors): applies the stage's
  /// OnError. Returns false when the run fails; otherwise true, with `out` holding the
  /// substitute (OnError::substitute) or empty (skip). A skipped item's request, and each of
  /// a skipped batch's, fails with the error; a substituted item's request is answered with
  /// the substitute, as any other item. A batch's substitute must carry the batch's ids (a
  /// wrapper's SubstituteWith keeps them): one that does not (the stage's fixed value, whose
  /// ids are not this batch's) would answer none of its requests, so the batch is skipped.
  bool absorb_item_error(std::uint64_t seq, const std::vector<std::uint64_t>& ids,
                         std::exception_ptr error, std::optional<Out>& out) noexcept {
    const bool substitute = this->on_error_ == OnError::substitute;
    out.reset();
    // A wrapper's own replacement of the item (SubstituteWith): emitted under substitute; the
    // error counted and reported is its cause, whatever the OnError.
    try {
      std::rethrow_exception(error);
    } catch (SubstituteWith<Out>& s) {
      if (substitute) out.emplace(std::move(s.value));
      error = s.cause;
    } catch (...) {
    }
    const bool stop = is_stop_request(error);  // not the item's error: the run ends
    if constexpr (copyable_v<Out>) {
      if (substitute && !stop && !out && substitute_) {
        try {
          out.emplace(*substitute_);
        } catch (...) {  // the copy itself failed: the item is dropped
        }
      }
    }
    if (stop || (out && !ids.empty() && !carries_ids(*out, ids))) out.reset();
    // Under fail, absorb_error fails seq's request and the run; the rest of a batch's requests
    // fail here (the others with the run's end).
    if (ItemTracker* t = this->graph().tracker(); t && !out)
      for (std::uint64_t id : ids)
        if (id != seq) t->item_failed(id, this->name(), error);
    return this->absorb_error(seq, std::move(error), out.has_value());
  }

  /// The pinned ring this node's outputs go into (its only consumer is a GPU stage fed
  /// through one), or nullptr.
  PinnedRing* output_ring() const noexcept {
    return targets_.size() == 1 ? targets_[0]->ring() : nullptr;
  }

  void reset(Ticks start, bool telemetry, std::size_t parallelism) override {
    NodeBase::reset(start, telemetry, parallelism);
    reorder_.clear();
    if (sequenced()) {
      // Every popped ticket not yet emitted (running, or finished and waiting here for an
      // earlier one) holds a reserved slot in each consumer, so the tickets in flight span at
      // most the smallest consumer capacity. (Not the concurrency: waiting outputs no longer
      // count against it.)
      std::size_t span = std::numeric_limits<std::size_t>::max();
      // (A queue the tuner sizes may grow to its max_capacity during the run.)
      for (const Edge& e : successors_) span = std::min(span, e.node->max_capacity());
      reorder_.resize(std::max<std::size_t>(span, 1));
    }
    next_emit_ = 0;
  }

 protected:
  /// Emits the outputs of a claim that popped tickets [ticket, ticket + slots): `out` holds the
  /// outputs of the first out.size() of them (fewer than `slots` only when a body failed).
  /// Returns how many of `out` count as emitted (none once the run is stopping).
  /// `produced`: when the claim made them (its body_end), their consumers' arrival time; 0:
  /// read by the consumers if they stamp arrivals.
  std::size_t emit(std::uint64_t ticket, std::size_t slots, std::vector<Envelope<Out>>& out,
                   WorkList& w, Ticks produced = 0) {
    const std::size_t emitted = graph().stopping() ? 0 : out.size();
    if (!sequenced()) {
      release_successors(slots - out.size(), w);
      deliver(out, w, produced);
      return emitted;
    }
    std::lock_guard lk(mu_);
    for (std::size_t i = 0; i < slots; ++i) {
      Slot& s = reorder_[(ticket + i) % reorder_.size()];
      assert(!s.full && "reorder ring overrun");
      if (i < out.size()) s.value.emplace(std::move(out[i]));
      s.full = true;
    }
    out.clear();
    // Deliver the run of consecutive finished tickets, if ours completed it.
    for (;;) {
      Slot& s = reorder_[next_emit_ % reorder_.size()];
      if (!s.full) break;
      if (s.value) {
        out.push_back(std::move(*s.value));
        s.value.reset();
      } else {
        release_successors(1, w);
      }
      s.full = false;
      ++next_emit_;
    }
    deliver(out, w, produced);  // consumers are downstream: pushing under our lock is in order
    return emitted;
  }

 private:
  /// Pushes `out` (one reserved slot per item in every consumer) to every consumer: copies for
  /// all but the last.
  void deliver(std::vector<Envelope<Out>>& out, WorkList& w, Ticks produced) {
    const std::size_t n = out.size();
    if (n == 0) return;
    if (graph().stopping()) {
      release_successors(n, w);
      graph().retire_items(n, w);
      out.clear();
      return;
    }
    const std::size_t consumers = targets_.size();
    if constexpr (copyable_v<Out>) {
      if (consumers > 1) {
        graph().add_items(n * (consumers - 1));
        Scratch<Envelope<Out>> copy;
        for (std::size_t i = 0; i + 1 < consumers; ++i) {
          // Copy-constructed one by one: an item type need not be copy-assignable (assign()
          // needed it: a type with a deleted copy assignment did not compile, even without a
          // fan-out, a new C++ user's trial).
          for (const auto& e : out) copy->push_back(e);
          targets_[i]->push(*copy, w, produced, *this);
          copy->clear();
        }
      }
    }
    targets_[consumers - 1]->push(out, w, produced, *this);
    out.clear();
  }

  struct Slot {
    std::optional<Envelope<Out>> value;
    bool full = false;
  };
  std::vector<Receiver<Out>*> targets_;
  std::vector<Slot> reorder_;  // under mu_

 protected:
  std::shared_ptr<const Out> substitute_;  // set while building, read while running
  std::uint64_t next_emit_ = 0;
};

/// Runs `f` and, if it throws, fails the run naming the node and the item.
template <class F>
bool guarded(const NodeBase& node, std::uint64_t seq, F&& f) noexcept {
  try {
    f();
    return true;
  } catch (...) {
    node.graph().fail(node, seq, std::current_exception());
    return false;
  }
}

/// A source: a generator `std::optional<T>()` called serially until it returns nullopt.
/// A copyable generator is copied afresh for every run, so each run starts from the start;
/// the copy is dropped when its run ends (end_run).
template <class T, class Gen>
class SourceNode final : public Emitter<T> {
 public:
  SourceNode(GraphCore& g, std::string name, Gen gen)
      : Emitter<T>(g, std::move(name), StageKind::source, StageOptions{}, 0),
        prototype_(std::move(gen)) {}

  void reset(Ticks start, bool telemetry, std::size_t parallelism) override {
    Emitter<T>::reset(start, telemetry, parallelism);
    if constexpr (std::is_copy_constructible_v<Gen>) {
      gen_.emplace(prototype_);
    } else if (!gen_) {
      gen_.emplace(std::move(prototype_));
    }
    exhausted_ = false;
    holds_unit_ = true;
    next_seq_ = 0;
  }

  /// Calls the generator for the k admitted items, stopping between items on a cancel.
  void run_claim(WorkList& w, std::size_t k) override {
    const std::uint64_t first = next_seq_;
    this->claim(
        w, k,
        [&](Ticks) {
          if (exhausted_ || this->graph().stopping()) {
            this->graph().retire_items(k, w);  // admitted, never made
            return Taken{.abandon = true};
          }
          return Taken{.items = k, .tickets = 0, .announced = k, .first = first};
        },
        [&](const ClaimInfo&, Ticks) {
          Scratch<Envelope<T>> out;
          bool done = false;
          for (std::size_t i = 0; i < k && !done; ++i) {
            if (this->graph().stopping()) break;  // a cancel stops the claim between items
            std::optional<T> v;
            if (!guarded(*this, next_seq_, [&] { v = std::invoke(*gen_); }) || !v) {
              done = true;
            } else {
              out->push_back(Envelope<T>{std::move(*v), next_seq_++});
            }
          }
          const Ticks body_end = now_ticks();
          const std::size_t made = out->size();
          if (made < k) this->graph().retire_items(k - made, w);  // admitted, not made
          const std::size_t emitted = this->emit(0, k, *out, w, body_end);
          if (done) {
            this->graph().source_ended(*this, next_seq_, w);  // (zips pairing it with another)
            finish();
          }
          return ClaimResult{.emitted = emitted, .body_end = body_end, .items = made};
        });
  }

  void drop_queued(WorkList& w) override {
    Emitter<T>::drop_queued(w);
    finish();
  }

  /// The run's copy of the generator goes with its run (a generator of one that is not
  /// copyable is the graph's, kept for the next run).
  void end_run() noexcept override {
    if constexpr (std::is_copy_constructible_v<Gen>) gen_.reset();
  }

 protected:
  std::size_t ready_locked() const override {
    return exhausted_ ? 0 : std::numeric_limits<std::size_t>::max() / 2;
  }
  bool inputs_done_locked() const override { return exhausted_; }
  std::size_t admit_locked(std::size_t want) override {
    return this->graph().try_admit(*this, want);
  }
  void unadmit_locked(std::size_t n, WorkList& w) override { this->graph().retire_items(n, w); }
  void admitted_locked(std::size_t n, WorkList& w) override { this->graph().admitted(*this, n, w); }

 private:
  // The source's unit of pending work ends once, whoever sees the end first.
  void finish() noexcept {
    bool release = false;
    {
      std::lock_guard lk(this->mu_);
      exhausted_ = true;
      release = std::exchange(holds_unit_, false);
    }
    if (release) this->graph().release_unit();
  }

  Gen prototype_;
  std::optional<Gen> gen_;
  bool exhausted_ = true;       // under mu_
  bool holds_unit_ = false;     // under mu_
  std::uint64_t next_seq_ = 0;  // only the (serial) running claim touches it
};

/// The sampled times of an automatic synchronous stage's bodies (autotune::body_placement): at
/// most a claim a millisecond (kPeriodNs) is measured, with the thread's CPU clock and its CPU
/// demand (thread_cpu: two system calls and a read, too dear for every claim of a 20 us
/// target), from its first body to its last.
class BodySample {
 public:
  static constexpr std::int64_t kPeriodNs = 1'000'000;
  struct Figures {
    std::uint64_t claims = 0;
    std::int64_t wall_ns = 0, cpu_ns = 0, wait_ns = 0;
  };
  /// At a run's start: measured (`on`) or not, from zero.
  void reset(bool on) noexcept {
    on_.store(on, std::memory_order_relaxed);
    period_ = static_cast<Ticks>(static_cast<double>(kPeriodNs) / ns_per_tick());
    next_.store(0, std::memory_order_relaxed);
    claims_.store(0, std::memory_order_relaxed);
    wall_.store(0, std::memory_order_relaxed);
    cpu_.store(0, std::memory_order_relaxed);
    wait_.store(0, std::memory_order_relaxed);
  }
  /// Whether the claim starting now is measured (the first a period after the last): its start
  /// time if it is, else 0.
  Ticks due() noexcept {
    if (!on_.load(std::memory_order_relaxed)) return 0;
    const Ticks now = now_ticks();
    Ticks next = next_.load(std::memory_order_relaxed);
    return now >= next && next_.compare_exchange_strong(next, now + period_, std::memory_order_relaxed)
               ? std::max<Ticks>(now, 1)
               : 0;
  }
  /// A measured claim: its bodies took `wall_ns` from `at0` to `at1` (thread_cpu).
  void add(std::int64_t wall_ns, const ThreadCpu& at0, const ThreadCpu& at1) noexcept {
    claims_.fetch_add(1, std::memory_order_relaxed);
    wall_.fetch_add(wall_ns, std::memory_order_relaxed);
    cpu_.fetch_add(at1.cpu_ns - at0.cpu_ns, std::memory_order_relaxed);
    wait_.fetch_add(waited_ns(at0, at1, wall_ns), std::memory_order_relaxed);
  }
  Figures figures() const noexcept {
    return {claims_.load(std::memory_order_relaxed), wall_.load(std::memory_order_relaxed),
            cpu_.load(std::memory_order_relaxed), wait_.load(std::memory_order_relaxed)};
  }

 private:
  std::atomic<bool> on_{false};
  Ticks period_ = 0;  // kPeriodNs in ticks (set at reset, before the run's claims)
  std::atomic<Ticks> next_{0};
  std::atomic<std::uint64_t> claims_{0};
  std::atomic<std::int64_t> wall_{0}, cpu_{0}, wait_{0};
};

/// Whether the last run of a graph of `graph`'s name moved its automatic stage `stage` to the
/// runtime's blocking threads (autotune::body_placement; lib/executor/placement.cpp).
bool placed_on_blocking_threads(GraphCore& graph, const std::string& stage);
/// At a run's end: where the automatic stage `stage`'s bodies run in the next graph of its name
/// (`in`: what they measured; graph and stage are filled in), remembered on the runtime and
/// appended to `out` when it changes.
void retune_placement(GraphCore& graph, const std::string& stage, autotune::PlacementInput in,
                      std::vector<autotune::TuneEvent>& out);

/// A stage: `Out(In)` (or `Out(In, HostAllocator&)`), any concurrency, in or out of order.
template <class In, class Out, class F>
class StageNode final : public OneInputNode<StageNode<In, Out, F>, Emitter<Out>, In> {
  static constexpr bool kAllocates = std::is_invocable_v<F&, In&&, HostAllocator&>;

 public:
  StageNode(GraphCore& g, std::string name, F f, const StageOptions& o)
      : StageNode::OneInputNode(g, std::move(name), StageKind::stage, o, 1), f_(std::move(f)) {}

  void reset(Ticks start, bool telemetry, std::size_t parallelism) override {
    StageNode::OneInputNode::reset(start, telemetry, parallelism);
    // An automatic stage's bodies are sampled: the next graph of its name may run them on the
    // blocking threads (one taking a HostAllocator cannot go there).
    sample_.reset(!kAllocates && this->auto_concurrency());
    serial_ns_.store(0, std::memory_order_relaxed);
    serial_wait_ns_.store(0, std::memory_order_relaxed);
  }

  void add_stats_locked(StageStats& s) const override {
    s.serial_ns = serial_ns_.load(std::memory_order_relaxed);
    s.serial_wait_ns = serial_wait_ns_.load(std::memory_order_relaxed);
  }

  void retune_at_end(const StageStats&, std::int64_t, std::vector<autotune::TuneEvent>& out) override {
    const BodySample::Figures f = sample_.figures();
    if (f.claims == 0) return;
    retune_placement(this->graph(), this->name(),
                     {.samples = f.claims, .wall_ns = f.wall_ns, .cpu_ns = f.cpu_ns, .wait_ns = f.wait_ns},
                     out);
  }

  /// Calls the body on each item, stopping between items on a cancel; applies on_error to an
  /// item whose body threw; emits in ticket order (a skipped item's ticket leaves empty).
  ClaimResult process(std::vector<Envelope<In>>& in, const ClaimInfo& claim, WorkList& w) {
    const Ticks sample_t0 = sample_.due();
    const bool sampled = sample_t0 != 0;
    const ThreadCpu sample_at0 = sampled ? thread_cpu() : ThreadCpu{};
    const SerialFigures serial0 = serial_figures();  // (a Python body's GIL: thread-locals)
    const std::uint64_t ticket = claim.ticket;
    Scratch<Envelope<Out>> out;
    // The pinned ring its outputs go into: where a body allocating with a HostAllocator
    // writes, and what a HostTensor output must fit (checked here, in the body's scope).
    PinnedRing* ring = nullptr;
    if constexpr (kAllocates || std::is_same_v<Out, HostTensor>) ring = this->output_ring();
    const std::size_t n = in.size();
    std::size_t emitted = 0;
    std::uint64_t next = ticket;  // the first ticket not yet handed to emit()
    CurrentItem current;          // splitflow::current_item() in the bodies
    for (std::size_t i = 0; i < n; ++i) {
      if (this->graph().stopping()) {  // a cancel stops the claim between items
        this->graph().retire_items(n - i, w);
        break;
      }
      auto& item = in[i];
      const std::uint64_t seq = item.seq;
      current.set(seq);
      const std::vector<std::uint64_t> ids = ids_for_errors(*this, item.value);
      try {
        if constexpr (std::is_same_v<Out, HostTensor>) {
          // A tensor the ring cannot take (too large, not contiguous) fails here, as this
          // stage's item under its OnError (it failed the run from the ring's push, naming
          // the GPU stage, whatever the policies).
          Out made = [&] {
            if constexpr (kAllocates) {
              HostAllocator alloc = host_allocator(ring, &this->name(), seq);
              return std::invoke(f_, std::move(item.value), alloc);
            } else {
              return std::invoke(f_, std::move(item.value));
            }
          }();
          if (ring) check_ring_item(*ring, made, this->name(), seq);
          out->push_back(Envelope<Out>{std::move(made), seq});
        } else if constexpr (kAllocates) {
          HostAllocator alloc = host_allocator(ring, &this->name(), seq);
          out->push_back(Envelope<Out>{std::invoke(f_, std::move(item.value), alloc), seq});
        } else {
          out->push_back(Envelope<Out>{std::invoke(f_, std::move(item.value)), seq});
        }
        continue;
      } catch (...) {
        std::optional<Out> replacement;
        if (!this->absorb_item_error(seq, ids, std::current_exception(), replacement)) {
          this->graph().retire_items(n - i, w);  // this item and the rest
          break;
        }
        if (replacement) {
          out->push_back(Envelope<Out>{std::move(*replacement), seq});
          continue;
        }
      }
      // Skipped: what came before it goes out, then its slot, empty.
      this->graph().retire_items(1, w);
      const std::size_t made = out->size();
      emitted += this->emit(next, made + 1, *out, w);
      next += made + 1;
    }
    const Ticks body_end = now_ticks();
    if (sampled) {
      sample_.add(ticks_to_ns(body_end - sample_t0), sample_at0, thread_cpu());
    }
    if (const SerialFigures serial1 = serial_figures();
        serial1.held_ns != serial0.held_ns || serial1.waited_ns != serial0.waited_ns) {
      serial_ns_.fetch_add(serial1.held_ns - serial0.held_ns, std::memory_order_relaxed);
      serial_wait_ns_.fetch_add(serial1.waited_ns - serial0.waited_ns, std::memory_order_relaxed);
    }
    emitted += this->emit(next, ticket + n - next, *out, w, body_end);  // then empty slots
    return {emitted, body_end};
  }

 private:
  F f_;
  BodySample sample_;
  // Its bodies' holds of the lock all bodies share, and waits for it (StageStats::serial_ns).
  std::atomic<std::int64_t> serial_ns_{0}, serial_wait_ns_{0};
};

/// A callback sink: `void(In)`.
template <class In, class F>
class SinkNode final : public OneInputNode<SinkNode<In, F>, NodeBase, In> {
 public:
  SinkNode(GraphCore& g, std::string name, F f, const StageOptions& o)
      : SinkNode::OneInputNode(g, std::move(name), StageKind::sink, o, 1), f_(std::move(f)) {}

  ClaimResult process(std::vector<Envelope<In>>& in, const ClaimInfo&, WorkList& w) {
    std::size_t done = 0;
    for (auto& item : in) {
      if (this->graph().stopping()) break;  // a cancel stops the claim between items
      try {
        std::invoke(f_, std::move(item.value));
        ++done;
      } catch (...) {
        if (!this->absorb_error(item.seq, std::current_exception(), false)) break;
      }
    }
    this->graph().retire_items(in.size(), w);
    return {done, 0};  // (no emission: the work is up to now)
  }

 private:
  F f_;
};

/// Pairs the items of its two inputs that came from the same upstream item (the same
/// sequence number: the same source item, or the i-th item of each of two sources), whatever
/// order they arrive in. An item whose partner was dropped on the other branch (a stage
/// skipped it, its deadline passed) is dropped too, and counted in items_skipped. The run
/// checks that each input is fed by one path from one source (GraphCore::check_zips).
template <class A, class B>
class ZipNode final : public Emitter<std::pair<A, B>>, public DropListener {
  using Out = std::pair<A, B>;
  // Items dropped here, and the node where each drop began (what zips downstream are told).
  using Lost = std::vector<std::pair<std::uint64_t, const NodeBase*>>;

 public:
  ZipNode(GraphCore& g, std::string name, std::size_t capacity)
      : Emitter<Out>(g, std::move(name), StageKind::zip,
                     StageOptions{Concurrency::serial, Order::in_order, capacity}, 2),
        a_(*this, 0),
        b_(*this, 1) {}

  Receiver<A>& first() noexcept { return a_; }
  Receiver<B>& second() noexcept { return b_; }

  /// Pops up to k items of its two inputs and pairs them under the lock (each popped item
  /// completes at most one pair: k items fill at most the k slots reserved); emits the pairs,
  /// in the order they formed.
  void run_claim(WorkList& w, std::size_t k) override {
    Scratch<Envelope<A>> as;
    Scratch<Envelope<B>> bs;
    Scratch<Arrivals> arrived_a, arrived_b;
    Scratch<Envelope<Out>> out;
    Scratch<Arrivals> pairs;  // a pair's latency starts when its second half arrived
    Lost lost;  // items whose partner was dropped upstream, and where each drop began
    this->claim(
        w, k,
        [&](Ticks) {
          std::size_t na = std::min(a_.size(), (k + 1) / 2);
          const std::size_t nb = std::min(b_.size(), k - na);
          na = std::min(a_.size(), k - nb);
          a_.pop(*as, *arrived_a, na);
          b_.pop(*bs, *arrived_b, nb);
          const std::size_t popped = as->size() + bs->size();
          Taken t{.items = std::min(k, popped), .popped = {as->size(), bs->size()},
                  .tickets = 0, .announced = popped};
          match(*as, *arrived_a, wait_a_, dead_b_, 1, wait_b_, *out, *pairs, lost,
                [](auto& mine, auto& other) { return Out{std::move(mine), std::move(other)}; });
          match(*bs, *arrived_b, wait_b_, dead_a_, 0, wait_a_, *out, *pairs, lost,
                [](auto& mine, auto& other) { return Out{std::move(other), std::move(mine)}; });
          // The end of both inputs: an item still waiting has no partner to come.
          if (this->inputs_done_locked() && a_.size() + b_.size() == 0) take_leftovers_locked(lost);
          this->skipped_ += lost.size();
          t.first = out->empty() ? 0 : out->front().seq;
          return t;
        },
        [&](const ClaimInfo&, Ticks) {
          for (const auto& [seq, origin] : lost) this->dropped(seq, *origin);
          const std::size_t n = out->size();
          const Ticks body_end = now_ticks();
          this->graph().retire_items(n + lost.size(), w);  // two items became one; lost ones left
          const std::size_t emitted = this->emit(0, k, *out, w, body_end);
          return ClaimResult{.emitted = emitted, .body_end = body_end, .items = n,
                             .arrivals = &*pairs};
        });
  }

  DropListener* drop_listener() noexcept override { return this; }

  /// The source numbering input `port` (another than the other input's: GraphCore::check_zips)
  /// ended after `items`: the other input's items from `items` on, waiting or to come, are
  /// dropped at once, not held until that input ends too (they could take all of
  /// max_in_flight and keep their own source from ending).
  void numbering_source_ended(int port, std::uint64_t items, const NodeBase& source,
                              WorkList& w) noexcept override {
    Lost lost, gone;  // items dropped now; pairs lost whole (no item held: passed on only)
    {
      std::lock_guard lk(this->mu_);
      end_[port] = items;
      ender_[port] = &source;
      if (port == 0) {
        erase_past(wait_b_, items, [&](std::uint64_t seq, auto&) { return take_past_end(seq, port, lost); });
      } else {
        erase_past(wait_a_, items, [&](std::uint64_t seq, auto&) { return take_past_end(seq, port, lost); });
      }
      this->skipped_ += lost.size();
      // Notes of drops past its end: the other input's half was dropped and this input's never
      // comes, so nothing of the pair is left (zips downstream hear of it, as for a drop of
      // both halves); this input's half dropped past it (none should be) is moot.
      erase_past(port == 0 ? dead_b_ : dead_a_, items, [&](std::uint64_t seq, const NodeBase* by) {
        try {
          gone.push_back({seq, by});
        } catch (...) {
        }
        return true;
      });
      erase_past(port == 0 ? dead_a_ : dead_b_, items, [](std::uint64_t, const NodeBase*) { return true; });
    }
    for (const auto& [seq, origin] : gone) this->dropped(seq, *origin);
    if (lost.empty()) return;
    for (const auto& [seq, origin] : lost) this->dropped(seq, *origin);
    this->graph().retire_items(lost.size(), w);
  }

  /// An upstream node of input `port` dropped item `seq`: its partner on the other input will
  /// never be paired.
  void item_dropped(int port, std::uint64_t seq, const NodeBase& by) noexcept override {
    // Begun upstream of the other input too (passed on by a zip there): neither half comes.
    if (up_[1 - port].count(&by)) return;
    Loss what;
    {
      std::lock_guard lk(this->mu_);
      // Past the end of either input's source: the other half never comes, or is dropped
      // as it arrives (match).
      if (seq >= end_[1 - port] || seq >= end_[port]) what = Loss::both;
      else what = port == 0 ? partner_lost(seq, by, wait_b_, dead_b_, dead_a_)
                            : partner_lost(seq, by, wait_a_, dead_a_, dead_b_);
      if (what == Loss::partner) {
        ++this->skipped_;
        note_locked(seq, "its partner on the " + std::string(port == 0 ? "first" : "second") +
                             " input was dropped by '" + by.name() + "'");
      }
    }
    // No pair for `seq` will leave: zips downstream drop their halves of it (where it began
    // tells them whether their other half comes).
    if (what != Loss::later) this->dropped(seq, by);
    if (what != Loss::partner) return;
    WorkList w;
    this->graph().retire_items(1, w);
    this->graph().dispatch_external(w);
  }

  void set_upstream(std::unordered_set<const NodeBase*> first,
                    std::unordered_set<const NodeBase*> second) override {
    up_[0] = std::move(first);
    up_[1] = std::move(second);
  }

  /// Items waiting for a partner, and notes of partners to drop on arrival (white-box tests:
  /// nothing is left once a run ended).
  std::size_t held_for_partners() const {
    std::lock_guard lk(this->mu_);
    return wait_a_.size() + wait_b_.size() + dead_a_.size() + dead_b_.size();
  }

  void reset(Ticks start, bool telemetry, std::size_t parallelism) override {
    Emitter<Out>::reset(start, telemetry, parallelism);
    wait_a_.clear();
    wait_b_.clear();
    dead_a_.clear();
    dead_b_.clear();
    end_[0] = end_[1] = kNoEnd;
    ender_[0] = ender_[1] = nullptr;
  }

  std::size_t clear_queues_locked() override {
    const std::size_t held = wait_a_.size() + wait_b_.size();
    wait_a_.clear();
    wait_b_.clear();
    return a_.clear() + b_.clear() + held;
  }

 protected:
  std::size_t ready_locked() const override {
    const std::size_t q = a_.size() + b_.size();
    // At the end of both inputs, items still waiting for a partner are dropped by a claim.
    if (q == 0 && this->inputs_done_locked() && !(wait_a_.empty() && wait_b_.empty())) return 1;
    return q;
  }

 private:
  template <class T>
  struct Waiting {
    T value;
    Ticks arrived;
  };
  template <class T>
  using WaitMap = std::unordered_map<std::uint64_t, Waiting<T>>;
  using DeadMap = std::unordered_map<std::uint64_t, const NodeBase*>;

  // Pairs each popped item with its waiting partner, or keeps it waiting for it, or drops it
  // when its partner was dropped upstream (`other_dead`). Under mu_.
  // Past the end of the other input's source (numbering_source_ended): dropped at once.
  template <class Mine, class Other, class Make>
  void match(std::vector<Envelope<Mine>>& items, const std::vector<Arrivals>& arrivals,
             WaitMap<Mine>& mine, DeadMap& other_dead, int other_port,
             WaitMap<Other>& other, std::vector<Envelope<Out>>& out,
             std::vector<Arrivals>& pairs, Lost& lost, Make make) {
    const char* other_input = other_port == 0 ? "first" : "second";
    std::size_t i = 0;
    for (const Arrivals& a : arrivals) {
      for (std::size_t j = 0; j < a.count; ++j, ++i) {
        Envelope<Mine>& e = items[i];
        if (e.seq >= end_[other_port]) {
          other_dead.erase(e.seq);  // (a note of its partner's drop, made before the end)
          lost.push_back({e.seq, ender_[other_port]});
          note_locked(e.seq, past_end(other_port));
        } else if (auto it = other.find(e.seq); it != other.end()) {
          out.push_back(Envelope<Out>{make(e.value, it->second.value), e.seq});
          pairs.push_back({1, std::max(a.ticks, it->second.arrived)});
          other.erase(it);
        } else if (auto d = other_dead.find(e.seq); d != other_dead.end()) {
          lost.push_back({e.seq, d->second});
          note_locked(e.seq, std::string("its partner on the ") + other_input +
                                 " input was dropped by '" + d->second->name() + "'");
          other_dead.erase(d);
        } else {
          mine.insert_or_assign(e.seq, Waiting<Mine>{std::move(e.value), a.ticks});
        }
      }
    }
    items.clear();
  }

  enum class Loss { later, partner, both };
  // One half of item `seq` was dropped upstream. Its partner, if waiting, is dropped now
  // (Loss::partner); if still to come, it is remembered in `mine_dead` and dropped on arrival
  // (Loss::later), unless the partner was itself dropped (`partner_dead`): then nothing is left
  // of the pair (Loss::both).
  template <class T>
  static Loss partner_lost(std::uint64_t seq, const NodeBase& by, WaitMap<T>& partner_wait,
                           DeadMap& partner_dead, DeadMap& mine_dead) noexcept {
    if (partner_wait.erase(seq)) return Loss::partner;
    if (partner_dead.erase(seq)) return Loss::both;
    try {
      mine_dead.emplace(seq, &by);
    } catch (...) {  // out of memory: the partner will wait until the end of the input
    }
    return Loss::later;
  }

  void take_leftovers_locked(Lost& lost) {
    for (const auto& [seq, v] : wait_a_) lost.push_back({seq, this});
    for (const auto& [seq, v] : wait_b_) lost.push_back({seq, this});
    for (std::size_t i = lost.size() - wait_a_.size() - wait_b_.size(); i < lost.size(); ++i)
      note_locked(lost[i].first, "no partner arrived on the other input");
    wait_a_.clear();
    wait_b_.clear();
  }

  void note_locked(std::uint64_t seq, std::string why) noexcept {
    if (this->errors_.size() >= StageStats::kMaxItemErrors) return;
    try {
      this->errors_.push_back({seq, std::move(why)});
    } catch (...) {
    }
  }

  // Erases the entries of `map` from item `items` on for which take(seq, value) says so.
  template <class Map, class Take>
  static void erase_past(Map& map, std::uint64_t items, Take take) {
    for (auto it = map.begin(); it != map.end();)
      it = it->first >= items && take(it->first, it->second) ? map.erase(it) : std::next(it);
  }

  // An item waiting past the end of input `ended_port`'s source: dropped, with its note (false,
  // kept waiting for the end of the input, when there is no memory to record it).
  bool take_past_end(std::uint64_t seq, int ended_port, Lost& lost) noexcept {
    try {
      lost.push_back({seq, ender_[ended_port]});
    } catch (...) {
      return false;
    }
    note_locked(seq, past_end(ended_port));
    return true;
  }

  std::string past_end(int ended_port) const {
    return "no partner: the " + std::string(ended_port == 0 ? "first" : "second") +
           " input's source '" + ender_[ended_port]->name() + "' ended after " +
           std::to_string(end_[ended_port]) + " items";
  }

  static constexpr std::uint64_t kNoEnd = std::numeric_limits<std::uint64_t>::max();
  // The nodes upstream of each input (set_upstream; read-only while a run goes on).
  std::unordered_set<const NodeBase*> up_[2];
  InputPort<A> a_;
  InputPort<B> b_;
  // Under mu_: where each input's numbering source ended, if it is another than the other
  // input's (numbering_source_ended), and which source it was.
  std::uint64_t end_[2] = {kNoEnd, kNoEnd};
  const NodeBase* ender_[2] = {nullptr, nullptr};
  // Under mu_: items waiting for their partner (bounded by max_in_flight; for two sources by
  // GraphCore::pace_lead, and reordering), and items whose partner was dropped upstream before
  // they arrived.
  WaitMap<A> wait_a_;
  WaitMap<B> wait_b_;
  DeadMap dead_a_, dead_b_;  // item -> the node that dropped that half
};

/// Gathers items into batches of `size`, in arrival order: one std::vector<T> per batch. The
/// last batch of a run may be shorter (its producers ended), or dropped (drop_last).
template <class T>
class BatchNode final : public OneInputNode<BatchNode<T>, Emitter<std::vector<T>>, T> {
  using Out = std::vector<T>;

 public:
  BatchNode(GraphCore& g, std::string name, std::size_t size, const BatchOptions& o)
      : BatchNode::OneInputNode(
            g, std::move(name), StageKind::stage,
            StageOptions{Concurrency::serial, Order::in_order,
                         std::max(size, o.capacity ? o.capacity : g.options().default_capacity)},
            1),
        size_(size),
        drop_last_(o.drop_last) {
    if (size_ == 0)
      throw GraphError("splitflow: batch '" + this->name() +
                       "': the batch size must be at least 1");
  }

  std::size_t holds_while_filling() const noexcept override { return size_ - 1; }
  double items_per_output() const noexcept override { return static_cast<double>(size_); }

  void validate() const override {
    Emitter<Out>::validate();
    // Its batch is a std::vector without the requests' ids: the answer sink would take it for
    // its first request's answer and leave the others pending (a new C++ user's trial). (A
    // batch on a branch that does not reach the answers, a metrics fan-out, is fine.)
    if (this->graph().tracker() && this->reaches_answers())
      throw GraphError("splitflow: batch '" + this->name() + "' of graph '" +
                       this->graph().name() + "', which answers requests (a service): its "
                       "batches carry no request ids, so only each batch's first request "
                       "would be answered (with the batch's result) and the others never; "
                       "batch requests with a dynamic batch (C++ Graph::dynamic_batch, whose "
                       "Batch<T> keeps each request's id; Python g.dynamic_batch) and unbatch "
                       "before the service's sink");
    if (size_ > this->graph().options().max_in_flight)
      throw GraphError("splitflow: batch '" + this->name() + "': its batch size " +
                       std::to_string(size_) + " exceeds the graph's max_in_flight (" +
                       std::to_string(this->graph().options().max_in_flight) +
                       "), so no batch could ever fill; raise GraphOptions::max_in_flight");
  }

  ClaimResult process(std::vector<Envelope<T>>& in, const ClaimInfo& claim, WorkList& w) {
    const std::size_t n = in.size();
    Scratch<Envelope<Out>> out;
    if (n == size_ || (n > 0 && !drop_last_)) {
      Out batch;
      batch.reserve(n);
      for (auto& e : in) batch.push_back(std::move(e.value));
      out->push_back(Envelope<Out>{std::move(batch), claim.first});
      this->graph().retire_items(n - 1, w);  // n items became one
    } else {
      this->graph().retire_items(n, w);
    }
    const Ticks body_end = now_ticks();
    return {this->emit(0, n > 0 ? 1 : 0, *out, w, body_end), body_end};
  }

 protected:
  // Full batches; at the end of the input, what is left.
  std::size_t ready_locked() const override {
    const std::size_t q = this->in_.size();
    if (q >= size_) return q - q % size_;
    return this->inputs_done_locked() ? q : 0;
  }
  std::size_t claim_size_locked(std::size_t available) const override {
    return std::min(available, size_);
  }
  std::size_t outputs_for_locked(std::size_t) const override { return 1; }

 private:
  std::size_t size_;
  bool drop_last_;
};

/// A sink whose items the caller's own thread takes with next(). Its queue is bounded like any
/// other, so a slow consumer holds the graph back. Items count as consumed when they arrive.
template <class T>
class PullSinkNode final : public NodeBase {
 public:
  PullSinkNode(GraphCore& g, std::string name, std::size_t capacity)
      : NodeBase(g, std::move(name), StageKind::pull_sink,
                 StageOptions{0, Order::in_order, capacity}, 1),
        in_(*this),
        readers_(std::make_shared<Readers>()) {
    readers_->what = "graph '" + g.name() + "': pull sink '" + this->name() + "'";
  }

  /// The readers' gate, which the PullSink handles hold: each read passes it; the graph, going,
  /// closes it once its run has ended, and waits for the readers in next() (woken by the end
  /// of the run) to leave (close_readers). `what` names the sink for a read after that.
  struct Readers {
    Gate gate;
    std::string what;
  };
  const std::shared_ptr<Readers>& readers() const noexcept { return readers_; }
  void close_readers() noexcept override {
    readers_->gate.close();
    {
      // No run is going (it ended, or its start failed after the reset): the stream is over
      // for a reader still waiting.
      std::lock_guard lk(this->mu_);
      eos_ = true;
      cv_.notify_all();
    }
    readers_->gate.wait_empty();
  }

  Receiver<T>& input() noexcept { return in_; }

  /// Blocks until an item arrives or the run ends; nullopt at the end of the stream.
  /// Rethrows the run's StageError when it failed.
  std::optional<T> next() {
    bool timed_out = false;
    return take(std::nullopt, timed_out, nullptr);
  }
  /// Like next(), but gives up after `timeout` (then nullopt with `timed_out` set), so that a
  /// caller can check for interrupts (Python's Ctrl-C) while it waits. `item` (if given): the
  /// number of the item returned in its run (its source item's, as errors name it).
  std::optional<T> next_for(std::chrono::nanoseconds timeout, bool& timed_out,
                            std::uint64_t* item = nullptr) {
    return take(timeout, timed_out, item);
  }

  void run_claim(WorkList&, std::size_t) override {}  // never granted: concurrency is 0

  void reset(Ticks start, bool telemetry, std::size_t parallelism) override {
    NodeBase::reset(start, telemetry, parallelism);
    // Under the lock take() reads them with: a reader may call next() while run() starts.
    std::lock_guard lk(this->mu_);
    queue_.clear();  // leftovers of an earlier run
    eos_ = false;
    ran_ = true;
    cancelled_.clear();
    late_ = std::make_shared<LateTakes>();  // the last run's stays with it
    finalized_ = false;
    waiting_ = false;
  }
  std::shared_ptr<const LateTakes> late_takes() const override { return late_; }
  void finalized_locked() override { finalized_ = true; }
  /// The reader is done with this run: cancel it if it is still going (its producers may be
  /// waiting for queue space that nobody will free).
  void close() { this->graph().close_from(*this); }
  std::size_t clear_queues_locked() override {
    queue_.clear();
    return 0;  // retired when they arrived
  }
  void end_of_stream() override {
    std::lock_guard lk(this->mu_);
    eos_ = true;
    cancelled_ = this->graph().cancel_note(*this, this->items_out_ + queue_.size());
    cv_.notify_all();
  }

 private:
  std::optional<T> take(std::optional<std::chrono::nanoseconds> timeout, bool& timed_out,
                        std::uint64_t* item) {
    std::optional<T> v;
    WorkList w;
    timed_out = false;
    {
      std::unique_lock lk(this->mu_);
      const auto ready = [&] { return !queue_.empty() || eos_; };
      // A reader waiting in vain nudges the runtime every kNudgeAfter since it began to wait
      // (or its last nudge), whatever the slices it waits in (Python's next_for: a fraction of
      // that), as a run's waiter does (RunState::wait_until). (The clock is read only when it
      // waits.)
      if (!ready()) {
        using Clock = std::chrono::steady_clock;
        const auto start = Clock::now();
        const auto deadline = timeout && *timeout < Clock::time_point::max() - start
                                  ? start + *timeout
                                  : Clock::time_point::max();
        if (!waiting_) {
          waiting_ = true;
          last_nudge_ = start;
        }
        while (!ready()) {
          const auto due = last_nudge_ + GraphCore::kNudgeAfter;
          if (cv_.wait_until(lk, std::min(deadline, due), ready)) break;
          const auto now = Clock::now();
          if (now >= due) {
            last_nudge_ = now;
            lk.unlock();  // (an enqueue: an allocation, maybe a wake; not under the node's lock)
            this->graph().nudge_runtime();
            lk.lock();
          }
          if (now >= deadline && !ready()) {
            timed_out = true;
            return v;
          }
        }
      }
      waiting_ = false;
      if (queue_.empty()) {
        if (!ran_)  // (an empty loop here, and a run started later filling a queue nobody reads)
          throw GraphError("splitflow: " + readers_->what +
                           " was read before its graph's first run: call run() first, then "
                           "read");
        std::string cancelled = cancelled_;
        lk.unlock();
        this->graph().rethrow_if_failed();
        if (!cancelled.empty()) throw CancelledError(std::move(cancelled));
        return std::nullopt;
      }
      v.emplace(std::move(queue_.front().value));
      if (item) *item = queue_.front().seq;
      const auto waited =
          static_cast<std::uint64_t>(std::max<Ticks>(now_ticks() - queue_.front().at, 0));
      if (finalized_) {  // after the run's final figures: the run's stats add these
        std::lock_guard late(late_->mu);
        ++late_->items;
        if (this->telemetry()) late_->latency.record(waited);
      } else if (this->telemetry()) {
        this->latency_.record(waited);
      }
      queue_.pop_front();
      this->popped_locked(0, 1, w);
      ++this->items_out_;
      this->refresh_state_locked();
    }
    if (!w.pokes.empty()) this->graph().dispatch_external(w);
    return v;
  }

  class Port final : public Receiver<T> {
   public:
    explicit Port(PullSinkNode& n) : Receiver<T>(n, 0), sink_(&n) {}
    void push(std::vector<Envelope<T>>& items, WorkList& w, Ticks, const NodeBase&) override {
      const std::size_t n = items.size();
      const std::size_t bytes = this->sample_bytes(items);
      {
        std::lock_guard lk(sink_->mu_);
        if (sink_->graph().stopping()) {
          sink_->rejected_locked(0, n, w);
          return;
        }
        if (bytes) sink_->sampled_bytes_locked(bytes);
        const Ticks now = sink_->telemetry() ? now_ticks() : 0;
        for (auto& e : items) sink_->queue_.push_back(Queued{std::move(e.value), now, e.seq});
        sink_->arrived_locked(0, n, w, now);  // grants no claim (concurrency 0): next() pops
        sink_->cv_.notify_one();
      }
      sink_->graph().retire_items(n, w);
    }

   private:
    PullSinkNode* sink_;
  };

  Port in_;
  std::shared_ptr<Readers> readers_;
  struct Queued {
    T value;
    Ticks at;           // its arrival
    std::uint64_t seq;  // its number in the run
  };
  std::deque<Queued> queue_;
  std::condition_variable_any cv_;
  bool eos_ = true;
  bool ran_ = false;  // a run started: before, a read is the caller's mistake
  std::string cancelled_;  // set at the end of a run cancelled by others: CancelledError's text
  std::shared_ptr<LateTakes> late_ = std::make_shared<LateTakes>();  // under mu_
  bool finalized_ = false;  // the run's final figures were read
  // take(), under mu_: whether the reader has waited since its last item (in one call or
  // several), and since when or its last nudge of the runtime.
  bool waiting_ = false;
  std::chrono::steady_clock::time_point last_nudge_{};
};

}  // namespace splitflow::detail
