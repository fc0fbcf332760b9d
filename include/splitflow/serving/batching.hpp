// Dynamic batching for inference graphs: gather items into a batch until it holds max_batch or
// its oldest item has waited max_delay, hand the batch on (typically to a GPU stage), then split
// the batch's results back into items with their original ids (a service's request ids).
//
//     auto svc   = g.service<Request, Reply>("requests");
//     auto gath  = g.dynamic_batch<Request>("gather", {.max_batch = 32, .max_delay = 2ms});
//     auto model = g.gpu_stage("model", [](Batch<Request> b, DeviceContext& ctx) {
//       std::vector<Reply> out = infer(b.items, ctx);
//       return std::move(b).with(std::move(out));   // the same ids, in the same order
//     });
//     auto split = g.unbatch<Reply>("split", 32);
//     svc.source() >> gath >> model >> split >> svc.sink();
//
// A batch's error (its stage failed on it, under OnError::skip) reaches every request in it; a
// body can instead fail one item with Batch::fail(i, error): unbatch answers that request with
// the error and its batch-mates with their results.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "splitflow/core/bytes.hpp"
#include "splitflow/core/error.hpp"
#include "splitflow/executor/graph.hpp"

namespace splitflow {

/// Items with where each came from (their sequence numbers: request ids in a service).
template <class T>
struct Batch {
  std::vector<T> items;
  std::vector<std::uint64_t> ids;
  /// Per-item errors set by Batch::fail (empty: none).
  std::vector<std::exception_ptr> errors;

  std::size_t size() const noexcept { return items.size(); }
  /// Host bytes the batch holds (splitflow::bytes_of): its items' and its ids'.
  std::size_t host_bytes() const {
    return sizeof(*this) + (bytes_of(items) - sizeof(items)) + (bytes_of(ids) - sizeof(ids)) +
           (bytes_of(errors) - sizeof(errors));
  }
  /// The results of this batch's items, in the same order: a Batch<U> with the same ids.
  template <class U>
  Batch<U> with(std::vector<U> results) && {
    if (results.size() != ids.size())
      throw Error("splitflow::Batch::with: " + std::to_string(results.size()) +
                  " results for a batch of " + std::to_string(ids.size()));
    return Batch<U>{std::move(results), std::move(ids), std::move(errors)};
  }
  /// Item i failed: unbatch answers its request with `error` and not with items[i].
  void fail(std::size_t i, std::exception_ptr error) {
    if (errors.size() < items.size()) errors.resize(items.size());
    errors.at(i) = std::move(error);
  }
};

namespace detail {
/// A Batch is copied where its items can be (fan-out, a substitute): a Batch of move-only
/// items declares a copy constructor (its vectors') that cannot be instantiated.
template <class T>
struct copyable<Batch<T>> : copyable<T> {};
}  // namespace detail

/// The time a dynamic batch node goes by, and its timers. The default is steady_clock with a
/// timer thread; tests inject a ManualClock (splitflow/serving/testing.hpp).
class BatchClock {
 public:
  using time_point = std::chrono::steady_clock::time_point;
  virtual ~BatchClock() = default;
  virtual time_point now() = 0;
  /// Calls fn once, from any thread, at or after t.
  virtual void call_at(time_point t, std::function<void()> fn) = 0;
  /// steady_clock, with one timer thread for the process (started on first use).
  static std::shared_ptr<BatchClock> steady();
};

struct DynamicBatchOptions {
  std::size_t max_batch = 32;
  /// The longest the oldest item of a batch waits for batch-mates before the batch goes.
  std::chrono::nanoseconds max_delay = std::chrono::milliseconds(2);
  /// null: BatchClock::steady().
  std::shared_ptr<BatchClock> clock = nullptr;
  /// Input queue capacity; raised to max_batch if smaller (0: the larger of the graph's
  /// default and max_batch).
  std::size_t capacity = 0;
};

namespace detail {

/// Lets a timer reach its node only while the node exists.
struct FlushToken {
  std::mutex mu;
  std::function<void(std::uint64_t)> flush;  // cleared when the node goes
};

template <class T>
class DynamicBatchNode final : public Emitter<Batch<T>> {
  using Out = Batch<T>;
  using time_point = BatchClock::time_point;

 public:
  DynamicBatchNode(GraphCore& g, std::string name, DynamicBatchOptions o)
      : Emitter<Out>(g, std::move(name), StageKind::stage,
                     StageOptions{Concurrency::serial, Order::in_order,
                                  std::max(o.max_batch,
                                           o.capacity ? o.capacity : g.options().default_capacity)},
                     1),
        in_(*this),
        opts_(std::move(o)),
        token_(std::make_shared<FlushToken>()) {
    if (opts_.max_batch == 0)
      throw GraphError("splitflow: dynamic batch '" + this->name() +
                       "': max_batch must be at least 1");
    if (!opts_.clock) opts_.clock = BatchClock::steady();
    token_->flush = [this](std::uint64_t gen) { on_timer(gen); };
  }
  ~DynamicBatchNode() override {
    std::lock_guard lk(token_->mu);
    token_->flush = nullptr;
  }

  Receiver<T>& input() noexcept { return in_; }

  void validate() const override {
    Emitter<Out>::validate();
    // A batch that reaches the service's sink whole answers its first request with the whole
    // batch and leaves the others waiting until close() (a new Python user's trial: a
    // dynamic batch wired to the sink, no unbatch).
    if (this->graph().tracker() && this->reaches_answers_batched())
      throw GraphError("splitflow: dynamic batch '" + this->name() + "' of graph '" +
                       this->graph().name() + "' reaches its service's sink without an unbatch, "
                       "so its first request would be answered with the whole batch and the "
                       "others never; put an unbatch (C++ Graph::unbatch, Python g.unbatch) "
                       "between the stage that computes the batch's results and the sink");
    if (opts_.max_batch > this->graph().options().max_in_flight)
      throw GraphError("splitflow: dynamic batch '" + this->name() + "': max_batch " +
                       std::to_string(opts_.max_batch) + " exceeds the graph's max_in_flight (" +
                       std::to_string(this->graph().options().max_in_flight) + ")");
  }

  std::size_t forms_batches_of() const noexcept override { return opts_.max_batch; }
  double items_per_output() const noexcept override { return static_cast<double>(opts_.max_batch); }

  void reset(Ticks start, bool telemetry, std::size_t parallelism) override {
    Emitter<Out>::reset(start, telemetry, parallelism);
    queue_.clear();
    flush_due_ = false;
    ++timer_gen_;
    armed_ = false;
  }

  /// Takes up to k queued items as one batch (a service's requests whose deadline passed are
  /// answered instead); the next batch's clock starts with the oldest item left.
  void run_claim(WorkList& w, std::size_t k) override {
    Out batch;
    std::size_t popped = 0;
    std::vector<std::uint64_t> expired;
    std::vector<std::int64_t> waits;  // each batched item's time in the queue (a service's)
    Scratch<Arrivals> arrivals;       // each taken item's arrival, for the stage's latency
    this->claim(
        w, k,
        [&](Ticks t0) {
          const std::size_t n = std::min(k, queue_.size());
          popped = n;
          batch.items.reserve(n);
          batch.ids.reserve(n);
          ItemTracker* tracker = this->graph().tracker();
          for (std::size_t i = 0; i < n; ++i) {
            Queued& q = queue_.front();
            const std::uint64_t id = q.item.seq;
            if (!arrivals->empty() && arrivals->back().ticks == q.ticks)
              ++arrivals->back().count;
            else
              arrivals->push_back({1, q.ticks});
            if (tracker && tracker->expired(id)) {  // dropped before its (GPU) work
              expired.push_back(id);
            } else {
              batch.items.push_back(std::move(q.item.value));
              batch.ids.push_back(id);
              if (tracker) waits.push_back(ticks_to_ns(t0 - q.ticks));
            }
            queue_.pop_front();
          }
          this->expired_ += expired.size();
          flush_due_ = false;
          ++timer_gen_;
          armed_ = false;
          if (!queue_.empty()) arm_locked();
          return Taken{.items = n, .popped = {n, 0}, .tickets = 0,
                       .announced = batch.items.size(),
                       .first = batch.ids.empty() ? 0 : batch.ids.front()};
        },
        [&](const ClaimInfo& c, Ticks) {
          for (std::uint64_t id : expired) this->graph().tracker()->item_expired(id, this->name());
          const std::size_t n = batch.items.size();
          if (ItemTracker* t = this->graph().tracker(); t && n > 0) t->batched(c.first, batch.ids, waits);
          Scratch<Envelope<Out>> out;
          if (n > 0) {
            out->push_back(Envelope<Out>{std::move(batch), c.first});
            this->graph().retire_items(popped - 1, w);  // the items became one (expired ones left)
          } else {
            this->graph().retire_items(popped, w);
          }
          const Ticks body_end = now_ticks();
          const std::size_t emitted = this->emit(0, popped > 0 ? 1 : 0, *out, w, body_end);
          // Each item's latency runs from its arrival in the queue, its wait for the batch
          // included (a claim's own time is the emission's).
          return ClaimResult{.emitted = emitted, .body_end = body_end, .items = popped,
                             .arrivals = &*arrivals};
        });
  }

  std::size_t clear_queues_locked() override {
    const std::size_t n = queue_.size();
    queue_.clear();
    return n;
  }

 protected:
  std::size_t ready_locked() const override {
    const std::size_t q = queue_.size();
    if (q >= opts_.max_batch) return q;
    return q > 0 && (flush_due_ || this->inputs_done_locked()) ? q : 0;
  }
  std::size_t claim_size_locked(std::size_t available) const override {
    return std::min(available, opts_.max_batch);
  }
  std::size_t outputs_for_locked(std::size_t) const override { return 1; }

 private:
  class Port final : public Receiver<T> {
   public:
    explicit Port(DynamicBatchNode& n) : Receiver<T>(n, 0), node_(&n) {}
    void push(std::vector<Envelope<T>>& items, WorkList& w, Ticks produced, const NodeBase&) override {
      const time_point now = node_->opts_.clock->now();
      const Ticks ticks = node_->stamps() ? (produced ? produced : now_ticks()) : 0;
      std::lock_guard lk(node_->mu_);
      if (node_->graph().stopping()) {
        node_->rejected_locked(0, items.size(), w);
        return;
      }
      for (auto& e : items) node_->queue_.push_back(Queued{std::move(e), now, ticks});
      if (!node_->armed_) node_->arm_locked();
      node_->arrived_locked(0, items.size(), w);
    }

   private:
    DynamicBatchNode* node_;
  };

  // A timer for the oldest queued item's max_delay (under mu_).
  void arm_locked() {
    armed_ = true;
    const std::uint64_t gen = timer_gen_;
    std::weak_ptr<FlushToken> weak = token_;
    // A max_delay past the clock's end (nanoseconds::max(): "full batches only") sets no
    // timer: a batch goes when full or at the end of the input (at + max_delay overflowed and
    // flushed at once).
    const time_point at = queue_.front().at;
    if (opts_.max_delay > std::chrono::nanoseconds::zero() &&
        at >= time_point::max() - opts_.max_delay)  // (max less a positive delay: no overflow)
      return;
    opts_.clock->call_at(at + opts_.max_delay, [weak, gen] {
      if (auto t = weak.lock()) {
        std::lock_guard lk(t->mu);
        if (t->flush) t->flush(gen);
      }
    });
  }

  // On the timer's thread, with the token's lock held (the node exists).
  void on_timer(std::uint64_t gen) {
    this->graph().post_if_running([this, gen](WorkList& w) {
      std::lock_guard lk(this->mu_);
      if (gen != timer_gen_) return;  // that batch has gone already
      flush_due_ = true;
      this->collect_claims_locked(w);
      this->refresh_state_locked();
    });
  }

  Port in_;
  DynamicBatchOptions opts_;
  std::shared_ptr<FlushToken> token_;
  struct Queued {
    Envelope<T> item;
    time_point at;  // on the batch clock (max_delay)
    Ticks ticks;    // on the steady timeline (the latency split)
  };
  std::deque<Queued> queue_;  // under mu_
  bool flush_due_ = false;
  bool armed_ = false;
  std::uint64_t timer_gen_ = 0;
};

/// Splits a Batch<T> into its items, each with its original id; items the body failed with
/// Batch::fail are answered with their error (through the graph's service) instead.
template <class T>
class UnbatchNode final : public OneInputNode<UnbatchNode<T>, Emitter<T>, Batch<T>> {
 public:
  UnbatchNode(GraphCore& g, std::string name, std::size_t max_batch)
      : UnbatchNode::OneInputNode(g, std::move(name), StageKind::stage, StageOptions{}, 1),
        max_batch_(max_batch) {
    if (max_batch_ == 0)
      throw GraphError("splitflow: unbatch '" + this->name() + "': max_batch must be at least 1");
  }

  std::size_t splits_batches_of() const noexcept override { return max_batch_; }
  double items_per_output() const noexcept override { return 1.0 / static_cast<double>(max_batch_); }

  void validate_sized() const override {
    for (const Edge& e : this->successors_)
      if (e.node->capacity() < max_batch_)
        throw GraphError("splitflow: unbatch '" + this->name() + "': its consumer '" +
                         e.node->name() + "' holds " + std::to_string(e.node->capacity()) +
                         " items, less than a batch of " + std::to_string(max_batch_) +
                         "; raise that stage's capacity");
  }

  ClaimResult process(std::vector<Envelope<Batch<T>>>& in, const ClaimInfo& claim, WorkList& w) {
    // Queue waits were the batch's, so each of its requests'; now its requests go on alone.
    if (ItemTracker* t = this->graph().tracker())
      for (const auto& e : in) t->unbatched(e.seq);
    Scratch<Envelope<T>> out;
    std::size_t slots = 0, over = 0;
    std::optional<std::pair<std::size_t, std::size_t>> unnamed;  // a batch's items and ids
    for (auto& e : in) {
      Batch<T>& b = e.value;
      slots += max_batch_;
      // A service's requests are answered by their ids: a batch whose results lost them (a
      // body that built its own Batch) answered its first request and left the others
      // waiting until close() (a new C++ user's trial).
      if (this->graph().tracker() && b.ids.size() != b.items.size()) {
        if (!unnamed) unnamed.emplace(b.items.size(), b.ids.size());
        continue;
      }
      if (b.items.size() > max_batch_) over += b.items.size() - max_batch_;
      for (std::size_t i = 0; i < b.items.size() && i < max_batch_; ++i) {
        const std::uint64_t id = i < b.ids.size() ? b.ids[i] : e.seq;
        if (i < b.errors.size() && b.errors[i]) {  // failed in the batch: leaves the graph
          if (ItemTracker* t = this->graph().tracker()) t->item_failed(id, this->name(), b.errors[i]);
          continue;
        }
        out->push_back(Envelope<T>{std::move(b.items[i]), id});
      }
    }
    if (unnamed)
      this->graph().fail(*this, claim.first,
                         std::make_exception_ptr(Error(
                             "splitflow: unbatch '" + this->name() + "': a batch of " +
                             std::to_string(unnamed->first) + " results carries " +
                             std::to_string(unnamed->second) + " request ids, so its requests "
                             "cannot be answered; make a stage's results with "
                             "std::move(batch).with(results), which keeps the batch's ids")));
    if (over > 0)
      this->graph().fail(*this, claim.first,
                         std::make_exception_ptr(Error("splitflow: unbatch '" + this->name() +
                                                       "': a batch larger than its max_batch " +
                                                       std::to_string(max_batch_))));
    // One batch became its items (failed ones left the graph).
    const std::size_t made = out->size();
    if (made > in.size())
      this->graph().add_items(made - in.size());
    else if (made < in.size())
      this->graph().retire_items(in.size() - made, w);
    const Ticks body_end = now_ticks();
    return ClaimResult{this->emit(0, slots, *out, w, body_end), body_end};
  }

 protected:
  std::size_t claim_size_locked(std::size_t available) const override {
    return std::min<std::size_t>(available, 1);
  }
  std::size_t outputs_for_locked(std::size_t k) const override { return k * max_batch_; }

 private:
  std::size_t max_batch_;
};

}  // namespace detail

template <class T>
Stage<T, Batch<T>> Graph::dynamic_batch(std::string name, DynamicBatchOptions options) {
  auto& n = add<detail::DynamicBatchNode<T>>(std::move(name), std::move(options));
  return Stage<T, Batch<T>>(n, &n.input(), &n);
}

template <class T>
Stage<Batch<T>, T> Graph::unbatch(std::string name, std::size_t max_batch) {
  auto& n = add<detail::UnbatchNode<T>>(std::move(name), max_batch);
  return Stage<Batch<T>, T>(n, &n.input(), &n);
}

}  // namespace splitflow
