// Typed nodes: input queues, bodies and emission. The scheduling logic they share is in
// NodeBase (lib/node.cpp); what is here is only what needs the item types.
#pragma once

#include <algorithm>
#include <cassert>
#include <condition_variable>
#include <limits>
#include <deque>
#include <functional>
#include <optional>
#include <type_traits>
#include <utility>

#include "splitflow/detail/graph_core.hpp"
#include "splitflow/detail/node.hpp"
#include "splitflow/error.hpp"

namespace splitflow::detail {

/// A node's input queue of T on one port. The queue is guarded by the node's mutex, and its
/// length never exceeds the port's capacity because every push fills a reserved slot.
template <class T>
class InputPort final : public Receiver<T> {
 public:
  using Receiver<T>::Receiver;

  void push(Envelope<T>&& e, WorkList& w) override {
    std::lock_guard lk(this->node_->mutex());
    if (this->node_->graph().stopping()) {
      this->node_->rejected_locked(this->port_, w);
      return;
    }
    queue_.push_back(std::move(e));
    this->node_->arrived_locked(this->port_, w);
  }
  // Under the node's mutex:
  bool empty() const noexcept { return queue_.empty(); }
  Envelope<T> pop() {
    Envelope<T> e = std::move(queue_.front());
    queue_.pop_front();
    return e;
  }
  std::size_t clear() noexcept {
    const std::size_t n = queue_.size();
    queue_.clear();
    return n;
  }

 private:
  std::deque<Envelope<T>> queue_;
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

  void reset(Ticks start, bool telemetry) override {
    NodeBase::reset(start, telemetry);
    reorder_.clear();
    if (sequenced()) {
      // Every popped ticket not yet emitted (running, or finished and waiting here for an
      // earlier one) holds a reserved slot in each consumer, so the tickets in flight span at
      // most the smallest consumer capacity. (Not the concurrency: waiting outputs no longer
      // count against it.)
      std::size_t span = std::numeric_limits<std::size_t>::max();
      for (const Edge& e : successors_) span = std::min(span, e.node->capacity());
      reorder_.resize(std::max<std::size_t>(span, 1));
    }
    next_emit_ = 0;
  }

 protected:
  /// Delivers `out` to every consumer (copies for all but the last) or, if empty, gives the
  /// reserved slots back. May run with this node's mutex held (consumers lock downstream).
  void deliver(std::optional<Envelope<Out>>& out, WorkList& w) {
    if (!out) {
      release_successors(w);
      return;
    }
    if (graph().stopping()) {
      release_successors(w);
      graph().retire_items(1, w);
      return;
    }
    const std::size_t n = targets_.size();
    if constexpr (std::is_copy_constructible_v<Out>) {
      if (n > 1) {
        graph().add_items(n - 1);
        for (std::size_t i = 0; i + 1 < n; ++i) targets_[i]->push(Envelope<Out>{*out}, w);
      }
    }
    targets_[n - 1]->push(std::move(*out), w);
    out.reset();
  }

  /// Emits the output of the invocation that popped `ticket`, after all earlier tickets.
  void emit(std::uint64_t ticket, std::optional<Envelope<Out>>& out, WorkList& w) {
    if (!sequenced()) {
      deliver(out, w);
      return;
    }
    std::lock_guard lk(mu_);
    Slot& mine = reorder_[ticket % reorder_.size()];
    assert(!mine.full && "reorder ring overrun");
    mine.value = std::move(out);
    mine.full = true;
    for (;;) {
      Slot& s = reorder_[next_emit_ % reorder_.size()];
      if (!s.full) break;
      deliver(s.value, w);
      s.full = false;
      s.value.reset();
      ++next_emit_;
    }
  }

 private:
  struct Slot {
    std::optional<Envelope<Out>> value;
    bool full = false;
  };
  std::vector<Receiver<Out>*> targets_;
  std::vector<Slot> reorder_;  // under mu_
  std::uint64_t next_emit_ = 0;
};

/// Catches what a body throws and fails the run with the node's name and the item's number.
template <class F>
bool guarded(NodeBase& node, std::uint64_t seq, F&& f) noexcept {
  try {
    f();
    return true;
  } catch (...) {
    node.graph().fail(node, seq, std::current_exception());
    return false;
  }
}

/// A source: a generator `std::optional<T>()` called serially until it returns nullopt.
/// A copyable generator is copied afresh for every run, so each run starts from the start.
template <class T, class Gen>
class SourceNode final : public Emitter<T> {
 public:
  SourceNode(GraphCore& g, std::string name, Gen gen)
      : Emitter<T>(g, std::move(name), StageKind::source, StageOptions{}, 0),
        prototype_(std::move(gen)) {}

  void reset(Ticks start, bool telemetry) override {
    Emitter<T>::reset(start, telemetry);
    if constexpr (std::is_copy_constructible_v<Gen>) {
      gen_.emplace(prototype_);
    } else if (!gen_) {
      gen_.emplace(std::move(prototype_));
    }
    exhausted_ = false;
    holds_unit_ = true;
    next_seq_ = 0;
  }

  void run_claim(WorkList& w) override {
    Ticks t0 = 0;
    {
      std::lock_guard lk(this->mu_);
      if (exhausted_ || this->graph().stopping()) {
        --this->unpopped_;
        this->abandon_claim_locked(w);
        return;
      }
      --this->unpopped_;
      t0 = this->begin_invocation_locked();
    }
    std::optional<T> v;
    const std::uint64_t seq = next_seq_;
    const bool ok = guarded(*this, seq, [&] { v = std::invoke(*gen_); });
    std::optional<Envelope<T>> out;
    if (v) {
      out.emplace(Envelope<T>{std::move(*v), next_seq_++});
      this->graph().add_items(1);
    }
    const bool emitted = out.has_value() && !this->graph().stopping();
    const bool done = !ok || !v;
    this->emit(0, out, w);
    if (done) finish();
    this->end_invocation(t0, emitted, w);
  }

  void drop_queued(WorkList& w) override {
    Emitter<T>::drop_queued(w);
    finish();
  }

 protected:
  std::size_t ready_locked() const override { return exhausted_ ? 0 : 1; }
  bool admit_locked() override { return this->graph().try_admit(*this); }

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
  bool exhausted_ = true;   // under mu_
  bool holds_unit_ = false; // under mu_
  std::uint64_t next_seq_ = 0;  // only the (serial) running claim touches it
};

/// A stage: `Out(In)`, any concurrency, in or out of order.
template <class In, class Out, class F>
class StageNode final : public Emitter<Out> {
 public:
  StageNode(GraphCore& g, std::string name, F f, const StageOptions& o)
      : Emitter<Out>(g, std::move(name), StageKind::stage, o, 1), in_(*this, 0), f_(std::move(f)) {}

  Receiver<In>& input() noexcept { return in_; }

  void run_claim(WorkList& w) override {
    std::optional<Envelope<In>> item;
    std::uint64_t ticket = 0;
    Ticks t0 = 0;
    {
      std::lock_guard lk(this->mu_);
      --this->unpopped_;
      if (in_.empty()) {  // dropped by a cancel
        this->abandon_claim_locked(w);
        return;
      }
      item.emplace(in_.pop());
      this->popped_locked(0, w);
      ticket = this->next_ticket_++;
      t0 = this->begin_invocation_locked();
    }
    std::optional<Envelope<Out>> out;
    const std::uint64_t seq = item->seq;
    if (!guarded(*this, seq, [&] {
          out.emplace(Envelope<Out>{std::invoke(f_, std::move(item->value)), seq});
        })) {
      this->graph().retire_items(1, w);
    }
    item.reset();
    const bool emitted = out.has_value() && !this->graph().stopping();
    this->emit(ticket, out, w);
    this->end_invocation(t0, emitted, w);
  }

  std::size_t clear_queues_locked() override { return in_.clear(); }

 protected:
  std::size_t ready_locked() const override { return this->queued_locked(0); }

 private:
  InputPort<In> in_;
  F f_;
};

/// A callback sink: `void(In)`.
template <class In, class F>
class SinkNode final : public NodeBase {
 public:
  SinkNode(GraphCore& g, std::string name, F f, const StageOptions& o)
      : NodeBase(g, std::move(name), StageKind::sink, o, 1), in_(*this, 0), f_(std::move(f)) {}

  Receiver<In>& input() noexcept { return in_; }

  void run_claim(WorkList& w) override {
    std::optional<Envelope<In>> item;
    Ticks t0 = 0;
    {
      std::lock_guard lk(this->mu_);
      --this->unpopped_;
      if (in_.empty()) {
        this->abandon_claim_locked(w);
        return;
      }
      item.emplace(in_.pop());
      this->popped_locked(0, w);
      t0 = this->begin_invocation_locked();
    }
    const bool ok = guarded(*this, item->seq, [&] { std::invoke(f_, std::move(item->value)); });
    item.reset();
    this->graph().retire_items(1, w);
    this->end_invocation(t0, ok, w);
  }

  std::size_t clear_queues_locked() override { return in_.clear(); }

 protected:
  std::size_t ready_locked() const override { return this->queued_locked(0); }

 private:
  InputPort<In> in_;
  F f_;
};

/// Pairs the i-th item of its first input with the i-th item of its second.
template <class A, class B>
class ZipNode final : public Emitter<std::pair<A, B>> {
  using Out = std::pair<A, B>;

 public:
  ZipNode(GraphCore& g, std::string name, std::size_t capacity)
      : Emitter<Out>(g, std::move(name), StageKind::zip,
                     StageOptions{Concurrency::serial, Order::in_order, capacity}, 2),
        a_(*this, 0),
        b_(*this, 1) {}

  Receiver<A>& first() noexcept { return a_; }
  Receiver<B>& second() noexcept { return b_; }

  void run_claim(WorkList& w) override {
    std::optional<Envelope<Out>> out;
    Ticks t0 = 0;
    {
      std::lock_guard lk(this->mu_);
      --this->unpopped_;
      if (a_.empty() || b_.empty()) {
        this->abandon_claim_locked(w);
        return;
      }
      Envelope<A> a = a_.pop();
      Envelope<B> b = b_.pop();
      this->popped_locked(0, w);
      this->popped_locked(1, w);
      t0 = this->begin_invocation_locked();
      out.emplace(Envelope<Out>{Out{std::move(a.value), std::move(b.value)}, pairs_++});
    }
    this->graph().retire_items(1, w);  // two items became one
    const bool emitted = !this->graph().stopping();
    this->emit(0, out, w);
    this->end_invocation(t0, emitted, w);
  }

  void reset(Ticks start, bool telemetry) override {
    Emitter<Out>::reset(start, telemetry);
    pairs_ = 0;
  }

  std::size_t clear_queues_locked() override { return a_.clear() + b_.clear(); }

 protected:
  std::size_t ready_locked() const override {
    return std::min(this->queued_locked(0), this->queued_locked(1));
  }

 private:
  InputPort<A> a_;
  InputPort<B> b_;
  std::uint64_t pairs_ = 0;  // under mu_
};

/// A sink whose items the caller's own thread takes with next(). Its queue is bounded like any
/// other, so a slow consumer holds the graph back. Items count as consumed when they arrive.
template <class T>
class PullSinkNode final : public NodeBase {
 public:
  PullSinkNode(GraphCore& g, std::string name, std::size_t capacity)
      : NodeBase(g, std::move(name), StageKind::pull_sink,
                 StageOptions{0, Order::in_order, capacity}, 1),
        in_(*this) {}

  Receiver<T>& input() noexcept { return in_; }

  /// Blocks until an item arrives or the run ends; nullopt at the end of the stream.
  /// Rethrows the run's StageError when it failed.
  std::optional<T> next() {
    std::optional<T> v;
    WorkList w;
    {
      std::unique_lock lk(this->mu_);
      cv_.wait(lk, [&] { return !queue_.empty() || eos_; });
      if (queue_.empty()) {
        lk.unlock();
        this->graph().rethrow_if_failed();
        return std::nullopt;
      }
      v.emplace(std::move(queue_.front()));
      queue_.pop_front();
      this->popped_locked(0, w);
      ++this->items_out_;
      this->refresh_state_locked();
    }
    if (!w.pokes.empty()) this->graph().dispatch_external(w);
    return v;
  }

  void run_claim(WorkList&) override {}  // never granted: concurrency is 0

  void reset(Ticks start, bool telemetry) override {
    NodeBase::reset(start, telemetry);
    queue_.clear();  // leftovers of an earlier run
    eos_ = false;
  }
  std::size_t clear_queues_locked() override {
    queue_.clear();
    return 0;  // retired when they arrived
  }
  void end_of_stream() override {
    std::lock_guard lk(this->mu_);
    eos_ = true;
    cv_.notify_all();
  }

 private:
  class Port final : public Receiver<T> {
   public:
    explicit Port(PullSinkNode& n) : Receiver<T>(n, 0), sink_(&n) {}
    void push(Envelope<T>&& e, WorkList& w) override {
      {
        std::lock_guard lk(sink_->mu_);
        if (sink_->graph().stopping()) {
          sink_->rejected_locked(0, w);
          return;
        }
        sink_->queue_.push_back(std::move(e.value));
        sink_->arrived_locked(0, w);  // grants no claim (concurrency 0): next() pops instead
        sink_->cv_.notify_one();
      }
      sink_->graph().retire_items(1, w);
    }

   private:
    PullSinkNode* sink_;
  };

  Port in_;
  std::deque<T> queue_;
  std::condition_variable_any cv_;
  bool eos_ = true;
};

}  // namespace splitflow::detail
