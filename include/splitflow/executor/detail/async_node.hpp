// The asynchronous stage node: an external completion, as oneTBB's async_node. An invocation
// pops one item, hands it to the body together with a Completion, and returns its thread; the
// item's work runs elsewhere (a worker process, a remote service, an I/O engine) and whoever
// holds the Completion answers it from any thread. The answer is emitted (in order, when the
// stage is in order) as a new arena task. The invocation counts against the stage's
// concurrency until it is answered, so concurrency bounds the items out at once.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <optional>
#include <unordered_set>
#include <utility>
#include <vector>

#include "splitflow/core/error.hpp"
#include "splitflow/executor/detail/nodes.hpp"

namespace splitflow {

namespace detail {
/// What a Completion answers: the node's in-flight invocation.
class AsyncAnswer {
 public:
  /// Returns whether this was the item's answer (false: it was answered already).
  virtual bool answer(std::exception_ptr error, void* value) noexcept = 0;
  /// CPU time the item's work cost where it ran, in ns (Completion::charge_cpu).
  virtual void charge_cpu(std::int64_t ns) noexcept = 0;
  /// Time the item's work waited where it ran (slept, read), in ns (Completion::charge_wait).
  virtual void charge_wait(std::int64_t ns) noexcept = 0;
  /// Whether the item was answered, or withdrawn by its run's cancel (Completion::withdrawn).
  virtual bool settled() const noexcept = 0;

 protected:
  ~AsyncAnswer() = default;
};
}  // namespace detail

/// The answer to one item of an async_stage: call exactly one of done() or fail(), from any
/// thread, once (a later call, or one after the body threw and so failed the item, does nothing
/// and returns false). A Completion dropped
/// unanswered fails its item ("dropped without an answer"), so an item is never lost.
///
///     auto s = g.async_stage<int, int>("remote", [&](int x, splitflow::Completion<int> c) {
///       pool.post([x, c = std::move(c)]() mutable { c.done(x * 2); });
///     }, {.concurrency = 8});
template <class Out>
class Completion {
 public:
  Completion() = default;
  explicit Completion(detail::AsyncAnswer* to) noexcept : to_(to) {}
  Completion(Completion&& o) noexcept : to_(std::exchange(o.to_, nullptr)) {}
  Completion& operator=(Completion&& o) noexcept {
    if (this != &o) {
      drop();
      to_ = std::exchange(o.to_, nullptr);
    }
    return *this;
  }
  Completion(const Completion&) = delete;
  Completion& operator=(const Completion&) = delete;
  ~Completion() { drop(); }

  /// The item's result. Returns false if it was already answered.
  bool done(Out value) noexcept {
    detail::AsyncAnswer* to = std::exchange(to_, nullptr);
    if (!to) return false;
    return to->answer(nullptr, &value);
  }
  /// The item failed with `error`: the stage's on_error applies (fail the run, skip the item,
  /// or substitute), as for an exception from a synchronous body.
  bool fail(std::exception_ptr error) noexcept {
    detail::AsyncAnswer* to = std::exchange(to_, nullptr);
    if (!to) return false;
    if (!error) error = std::make_exception_ptr(Error("failed with no error given"));
    return to->answer(std::move(error), nullptr);
  }
  /// The CPU time the item's work cost where it ran (a pool's thread, measured with its thread
  /// CPU clock): added to the stage's StageStats::call_ns, which the tuner takes as the stage's
  /// CPU (an I/O stage's work is mostly waiting). Call before done() or fail(); later it does
  /// nothing. Blocking stages (StageOptions::blocking) charge their bodies' CPU this way.
  void charge_cpu(std::chrono::nanoseconds cpu) noexcept {
    if (to_) to_->charge_cpu(cpu.count());
  }
  /// The time the item's work waited where it ran (slept, read, blocked: its wall time less its
  /// CPU time and its time runnable waiting for a CPU): StageStats::wait_ns. With it the tuner
  /// tells a stage that waits (whose concurrency may go past the cores) from one that computes
  /// and only seems slow on a busy machine. Call before done() or fail(); later it does nothing.
  void charge_wait(std::chrono::nanoseconds waited) noexcept {
    if (to_) to_->charge_wait(waited.count());
  }
  /// Whether it still waits for its answer.
  explicit operator bool() const noexcept { return to_ != nullptr; }
  /// Whether its item no longer waits for an answer though this Completion was not used: its
  /// run was cancelled or failed, which withdrew it (an answer now does nothing). Work not yet
  /// begun for it may be skipped; a blocking stage's queued body is.
  bool withdrawn() const noexcept { return to_ != nullptr && to_->settled(); }

 private:
  void drop() noexcept {
    if (to_)
      fail(std::make_exception_ptr(Error(
          "its Completion was dropped without an answer; call done() or fail() exactly once")));
  }
  detail::AsyncAnswer* to_ = nullptr;
};

namespace detail {

template <class In, class Out, class F>
class AsyncStageNode final : public Emitter<Out> {
 public:
  AsyncStageNode(GraphCore& g, std::string name, F f, const StageOptions& o)
      : Emitter<Out>(g, std::move(name), StageKind::stage, o, 1), f_(std::move(f)), in_(*this, 0) {
    this->max_claim_ = 1;  // one item per invocation: each waits for its own answer
  }

  Receiver<In>& input() noexcept { return in_; }

  /// Hands one item to the body with its Completion; the claim ends when it is answered
  /// (finish).
  void run_claim(WorkList& w, std::size_t k) override {
    Invocation* inv = nullptr;
    Scratch<Envelope<In>> in;
    Scratch<Arrivals> arrivals;
    this->claim(
        w, k,
        [&](Ticks t0) {
          const std::size_t n = in_.pop(*in, *arrivals, k);
          if (n == 0) return Taken{.abandon = true};  // dropped by a cancel
          inv = new Invocation(*this);
          inv->t0 = t0;
          inv->ticket = this->next_ticket_;  // (the claim's first ticket: claim() takes it next)
          inv->seq = in->front().seq;
          inv->arrived = arrivals->front().ticks;
          inv->ids = ids_for_errors(*this, in->front().value);
          // From here a cancel may withdraw it (its finish then runs on another thread): every
          // field finish reads is set above.
          out_.insert(inv);
          this->graph().add_unit();  // the invocation keeps the run open until it is answered
          return Taken{.items = 1, .popped = {1, 0}, .tickets = 1, .announced = 1,
                       .first = inv->seq};
        },
        [&](const ClaimInfo&, Ticks t0) {
          report_waits(this->graph(), *in, *arrivals, t0);
          In item = std::move(in->front().value);
          in->clear();
          // splitflow::current_item() in the body (a blocking stage's task takes it to its
          // thread).
          CurrentItem current(inv->seq);
          try {
            std::invoke(f_, std::move(item), Completion<Out>(inv));
            called(t0);
          } catch (...) {
            called(t0);
            // The body threw before handing its Completion on (whose drop then answered it with
            // its own error) or after: the item fails with what was thrown, if it is not
            // answered yet.
            inv->answer_once(std::current_exception(), nullptr);
          }
          inv->release();
          return ClaimResult{.deferred = true};  // finish() ends it
        });
  }

  std::size_t clear_queues_locked() override { return in_.clear(); }

  bool asynchronous() const noexcept override { return true; }

  /// Built on the blocking threads (a blocking stage's submit) because the last run of a graph
  /// of its name found its automatic bodies waiting: each run's end decides again.
  void placed_automatically() noexcept { auto_placed_ = true; }
  bool auto_placed() const noexcept override { return auto_placed_; }
  void retune_at_end(const StageStats& st, std::int64_t, std::vector<autotune::TuneEvent>& out) override {
    if (!auto_placed_ || st.wait_ns < 0) return;  // (no answer charged a wait)
    const std::int64_t cpu = charged_ns_.load(std::memory_order_relaxed);
    retune_placement(this->graph(), this->name(),
                     {.blocking = true, .samples = st.items_out, .wall_ns = cpu + st.wait_ns,
                      .cpu_ns = cpu, .wait_ns = st.wait_ns},
                     out);
  }

  void reset(Ticks start, bool telemetry, std::size_t parallelism) override {
    Emitter<Out>::reset(start, telemetry, parallelism);
    call_ticks_.store(0, std::memory_order_relaxed);
    charged_ns_.store(0, std::memory_order_relaxed);
    waited_ns_.store(0, std::memory_order_relaxed);
    told_wait_.store(false, std::memory_order_relaxed);
  }

  void add_stats_locked(StageStats& s) const override {
    s.call_ns = ticks_to_ns(call_ticks_.load(std::memory_order_relaxed)) +
                charged_ns_.load(std::memory_order_relaxed);
    if (told_wait_.load(std::memory_order_relaxed)) s.wait_ns = waited_ns_.load(std::memory_order_relaxed);
  }

  /// A cancel (or a failure) withdraws the items out at once: the run need not wait for their
  /// answers, which then find them answered (done() and fail() return false).
  void drop_queued(WorkList& w) override {
    Emitter<Out>::drop_queued(w);
    std::vector<Invocation*> out;
    {
      std::lock_guard lk(this->mu_);
      for (Invocation* inv : out_) {
        inv->holders.fetch_add(1, std::memory_order_relaxed);  // alive while we withdraw it
        out.push_back(inv);
      }
    }
    for (Invocation* inv : out) {
      inv->answer_once(nullptr, nullptr);
      inv->release();
    }
  }

 protected:
  std::size_t ready_locked() const override { return in_.size(); }

 private:
  // Owned by three holders: the claim (until run_claim returns), the Completion (until it is
  // answered or dropped) and the finish (posted by the first answer); the last release deletes
  // it. So a body that answers synchronously, or throws after handing its Completion on, is
  // safe.
  struct Invocation final : AsyncAnswer {
    explicit Invocation(AsyncStageNode& n) : node(&n) {}
    bool answer(std::exception_ptr error, void* value) noexcept override {
      const bool first = answer_once(std::move(error), value);
      release();  // the Completion's hold
      return first;
    }
    bool answer_once(std::exception_ptr error, void* value) noexcept {
      if (answered.exchange(true, std::memory_order_acq_rel)) return false;
      try {
        if (value) {
          out.emplace(std::move(*static_cast<Out*>(value)));
        } else if (error) {
          this->error = std::move(error);
        }  // neither: withdrawn by a cancel
      } catch (...) {  // moving the result threw
        this->error = std::current_exception();
      }
      AsyncStageNode* n = node;
      Invocation* self = this;
      n->graph().post([n, self](WorkList& w) { n->finish(self, w); });
      return true;
    }
    void charge_cpu(std::int64_t ns) noexcept override {
      if (ns > 0) charged.fetch_add(ns, std::memory_order_relaxed);
    }
    void charge_wait(std::int64_t ns) noexcept override {
      waited.fetch_add(ns > 0 ? ns : 0, std::memory_order_relaxed);
      told_wait.store(true, std::memory_order_relaxed);
    }
    bool settled() const noexcept override { return answered.load(std::memory_order_acquire); }
    void release() noexcept {
      if (holders.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
    }
    AsyncStageNode* node;
    std::atomic<bool> answered{false};
    std::atomic<std::int64_t> charged{0};  // Completion::charge_cpu (read by finish)
    std::atomic<std::int64_t> waited{0};   // Completion::charge_wait (read by finish)
    std::atomic<bool> told_wait{false};
    std::atomic<int> holders{3};
    std::uint64_t seq = 0;
    std::uint64_t ticket = 0;
    Ticks arrived = 0;
    Ticks t0 = 0;
    std::vector<std::uint64_t> ids;  // a batch's, for its error (ids_for_errors)
    std::exception_ptr error;
    std::optional<Out> out;
  };

  void finish(Invocation* inv, WorkList& w) {
    {
      std::lock_guard lk(this->mu_);
      out_.erase(inv);
    }
    if (this->telemetry()) {
      charged_ns_.fetch_add(inv->charged.load(std::memory_order_relaxed), std::memory_order_relaxed);
      if (inv->told_wait.load(std::memory_order_relaxed)) {
        waited_ns_.fetch_add(inv->waited.load(std::memory_order_relaxed), std::memory_order_relaxed);
        told_wait_.store(true, std::memory_order_relaxed);
      }
    }
    if constexpr (std::is_same_v<Out, HostTensor>) {
      // An answer the pinned ring after this stage would refuse (too large, not contiguous)
      // is this stage's failing item, under its OnError, as a stage body's is (StageNode).
      if (!inv->error && inv->out)
        if (PinnedRing* ring = this->output_ring()) {
          try {
            check_ring_item(*ring, *inv->out, this->name(), inv->seq);
          } catch (...) {
            inv->error = std::current_exception();
          }
        }
    }
    if (inv->error) {
      std::optional<Out> replacement;
      inv->out.reset();
      if (this->absorb_item_error(inv->seq, inv->ids, inv->error, replacement) && replacement)
        inv->out = std::move(replacement);
      inv->error = nullptr;
    }
    const Ticks body_end = now_ticks();
    Scratch<Envelope<Out>> out;
    if (inv->out) {
      out->push_back(Envelope<Out>{std::move(*inv->out), inv->seq});
      inv->out.reset();
    } else {
      this->graph().retire_items(1, w);  // failed or skipped: it leaves the graph here
    }
    const std::size_t emitted = this->emit(inv->ticket, 1, *out, w, body_end);
    const std::vector<Arrivals> arrived{{1, inv->arrived}};
    const Ticks t0 = inv->t0;
    const std::uint64_t seq = inv->seq;
    inv->release();
    this->end_invocation(t0, body_end, 1, emitted, w, &arrived, seq);
    this->graph().release_unit();
  }

  /// The body's call, begun at t0, returned (or threw): its time is the stage's CPU part, what
  /// the tuner tells an I/O stage by (an answer may come before the call returns: finish()
  /// cannot measure it).
  void called(Ticks t0) noexcept {
    if (this->telemetry())
      call_ticks_.fetch_add(now_ticks() - t0, std::memory_order_relaxed);
  }

  F f_;
  InputPort<In> in_;
  std::atomic<Ticks> call_ticks_{0};  // summed time of the bodies' calls (StageStats::call_ns)
  std::atomic<std::int64_t> charged_ns_{0};  // CPU the answerers charged (Completion::charge_cpu)
  std::atomic<std::int64_t> waited_ns_{0};   // waits they charged (Completion::charge_wait)
  std::atomic<bool> told_wait_{false};       // some answer charged a wait: StageStats::wait_ns
  std::unordered_set<Invocation*> out_;  // under mu_: items out, not yet finished
  bool auto_placed_ = false;             // placed_automatically()
};

}  // namespace detail
}  // namespace splitflow
