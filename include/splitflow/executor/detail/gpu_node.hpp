// The GPU stage node. An invocation pops one item, leases a stream from the runtime's pool
// (waiting as data, not as a thread, when none is free), runs the body to enqueue work on it,
// and returns its thread. When the stream's work completes the lease goes back to the pool and
// the node's finish runs as a new arena task: emission, then the next claims.
#pragma once

#include <optional>
#include <type_traits>
#include <variant>

#include "splitflow/device/detail/gpu.hpp"
#include "splitflow/executor/detail/nodes.hpp"
#include "splitflow/device/device.hpp"

namespace splitflow::detail {

/// The runtime's device, initialised on first use. Throws Error when the configured backend is
/// unavailable. (lib/executor/gpu_node.cpp)
std::shared_ptr<DeviceRuntime> device_of(GraphCore& graph);
/// The graph's GPU accounting (created with the graph's first GPU stage).
GpuAccount* gpu_account(GraphCore& graph);
/// The bytes an automatic input ring of GPU stage `stage` is allocated with for this run: what
/// the last run of a graph of this name decided for it, else the first size
/// (GpuStageOptions::ring_bytes).
std::size_t auto_ring_bytes(GraphCore& graph, const std::string& stage, std::size_t item_bytes);
/// At a run's end: the depth of that ring for the next run (autotune::ring_depth, from the
/// run's figures), remembered for the next run of a graph of this name; its decision, if it
/// changes, appended to `out`.
void retune_ring(GraphCore& graph, const std::string& stage, const PinnedRing& ring, const StageStats& st,
                 std::int64_t wall_ns, std::vector<autotune::TuneEvent>& out);

template <class In, class Out, class F>
class GpuStageNode final : public Emitter<Out> {
  // A stage taking DeviceTensor may be fed host tensors through a pinned ring (port 1).
  static constexpr bool kRing = std::is_same_v<In, DeviceTensor>;
  using Entry = std::conditional_t<kRing, std::variant<DeviceTensor, HostTensor>, In>;

 public:
  GpuStageNode(GraphCore& g, std::string name, F f, const GpuStageOptions& o)
      : Emitter<Out>(g, std::move(name), StageKind::gpu_stage,
                     StageOptions{o.concurrency, o.order, o.capacity, o.on_error}, kRing ? 2 : 1),
        opts_(o),
        f_(std::move(f)),
        in_(*this, 0),
        host_in_(*this) {
    this->max_claim_ = 1;  // one item per kernel burst
    notifier_ = std::make_shared<SpaceNotifier>();
    GpuStageNode* self = this;
    // Tensors free ring space from any thread, possibly under another node's lock: the wake-up
    // runs later as an arena task, and only while a run is live (nobody waits otherwise).
    notifier_->fn = [self] {
      self->graph().post_if_running([self](WorkList& w) { self->wake(w); });
    };
  }
  ~GpuStageNode() override { notifier_->detach(); }

  Receiver<In>& input() noexcept { return in_; }
  Receiver<HostTensor>& host_input() noexcept { return host_in_; }

  void prepare() override {
    dev_ = device_of(this->graph());
    account_ = gpu_account(this->graph());
    if constexpr (kRing) {
      if (this->predecessors(1) > 0) {
        const bool automatic = opts_.ring_bytes == GpuStageOptions::automatic;
        const std::size_t bytes =
            automatic ? auto_ring_bytes(this->graph(), this->name(), opts_.ring_item_bytes) : opts_.ring_bytes;
        // An automatic ring resized at the end of the last run is made anew once it is empty
        // (tensors of the last run keep the old one alive until they go).
        if (ring_ && automatic && ring_->capacity() != bytes && ring_->bytes_in_use() == 0 &&
            ring_->budgets() == 0)
          ring_.reset();
        if (!ring_) {
          ring_ = std::make_shared<PinnedRing>(dev_, this->name(), bytes, opts_.ring_item_bytes);
          ring_->set_notifier(notifier_);
        }
        ring_->reset_figures();  // the run's figures are its own
      }
    }
    if (opts_.out_ring_bytes > 0 && !out_ring_) {
      out_ring_ = std::make_shared<PinnedRing>(dev_, this->name(), opts_.out_ring_bytes,
                                               opts_.out_ring_item_bytes,
                                               PinnedRing::Side::output);
      out_ring_->set_notifier(notifier_);
    }
    if (out_ring_) out_ring_->reset_figures();
  }

  void retune_at_end(const StageStats& st, std::int64_t wall_ns,
                     std::vector<autotune::TuneEvent>& out) override {
    if constexpr (kRing)
      if (ring_ && opts_.ring_bytes == GpuStageOptions::automatic)
        retune_ring(this->graph(), this->name(), *ring_, st, wall_ns, out);
  }

  void add_stats_locked(StageStats& s) const override {
    for (const auto* ring : {ring_.get(), out_ring_.get()}) {
      if (!ring) continue;
      s.ring_capacity += ring->capacity();
      if (ring == ring_.get()) {
        s.ring_item_bytes = ring->item_bytes();
        s.ring_automatic = opts_.ring_bytes == GpuStageOptions::automatic;
      }
      s.ring_in_use += ring->bytes_in_use();
      s.ring_budgets += ring->budgets();
      s.ring_wraps += ring->wraps();
      const PinnedRing::Figures f = ring->figures();
      s.ring_max_in_use += f.max_in_use;
      s.ring_mean_in_use += f.mean_in_use;
      s.ring_refusals += f.refusals;
      s.ring_wait_ns += f.wait_ns;
    }
  }

  /// Takes one item; the claim waits for a stream (as data, not as a thread), begins when it
  /// is granted (start) and ends when the burst's work has completed (finish).
  void run_claim(WorkList& w, std::size_t k) override {
    Invocation* inv = nullptr;
    this->claim(
        w, k,
        [&](Ticks) {
          if (queue_.empty()) {  // dropped by a cancel
            if (out_ring_) out_ring_->release(1);
            return Taken{.abandon = true};
          }
          inv = new Invocation(*this);
          inv->priority = this->graph().options().priority;
          inv->entry.emplace(std::move(queue_.front().entry));
          inv->seq = queue_.front().seq;
          inv->arrived = queue_.front().arrived;
          Taken t{.items = 1, .tickets = 1, .announced = 1, .first = inv->seq};
          t.popped[queue_.front().port] = 1;
          queue_.pop_front();
          inv->ticket = this->next_ticket_;  // (the claim's ticket: claim() takes it next)
          return t;
        },
        [&](const ClaimInfo&, Ticks) {
          this->graph().add_unit();  // the invocation keeps the run open until it finishes
          inv->owner = this;
          inv->since_ns = steady_ns();
          // A request whose deadline passed is answered now, before it takes a stream.
          if (ItemTracker* t = this->graph().tracker(); t && t->expired(inv->seq)) {
            {
              std::lock_guard lk(this->mu_);
              ++this->expired_;
            }
            t->item_expired(inv->seq, this->name());
            this->dropped(inv->seq);
            inv->entry.reset();
            finish(inv, w);  // not begun: an empty slot, its resources returned
          } else if (Lease* lease = lease_or_wait(*dev_, *inv)) {
            start(inv, lease);
          }
          return ClaimResult{.deferred = true};  // begins in start(), ends in finish()
        },
        Begins::after_wait);
  }

  std::size_t clear_queues_locked() override {
    const std::size_t n = queue_.size();
    queue_.clear();
    return n;
  }
  void drop_queued(WorkList& w) override {
    Emitter<Out>::drop_queued(w);
    withdraw_waiters(*dev_, this);  // invocations waiting for a stream finish empty-handed
  }

 protected:
  std::size_t ready_locked() const override { return queue_.size(); }
  std::size_t admit_locked(std::size_t want) override {
    return out_ring_ ? out_ring_->try_reserve(want) : want;
  }
  void unadmit_locked(std::size_t n, WorkList&) override {
    if (out_ring_) out_ring_->release(n);
  }
  std::size_t reserve_extra_locked(int port, std::size_t want) override {
    return port == 1 && ring_ ? ring_->try_reserve(want) : want;
  }
  void release_extra(int port, std::size_t n) override {
    if (port == 1 && ring_) ring_->release(n);
  }

 private:
  struct Queued {
    Entry entry;
    std::uint64_t seq;
    int port;
    Ticks arrived;
  };

  struct Invocation final : LeaseWaiter {
    explicit Invocation(GpuStageNode& n) : node(&n) {}
    void grant(Lease* lease) override {
      GpuStageNode* n = node;
      Invocation* self = this;
      n->graph().post([n, self, lease](WorkList& w) {
        if (lease) {
          n->start(self, lease);
        } else {
          n->finish(self, w);
        }
      });
    }
    GpuStageNode* node;
    std::optional<Entry> entry;
    std::uint64_t seq = 0;
    std::uint64_t ticket = 0;
    Ticks arrived = 0;
    Ticks t0 = 0;
    Ticks done = 0;  // its work completed (for a service's latency split)
    bool began = false;
    bool failed = false;  // its body, its device work or its output's staging failed (OnError applied once)
    std::vector<std::uint64_t> ids;  // a batch's, for its error (ids_for_errors)
    std::optional<Burst> burst;
    std::optional<Out> out;
  };

  class Port final : public Receiver<In> {
   public:
    Port(GpuStageNode& n, int port) : Receiver<In>(n, port), node_(&n) {}
    void push(std::vector<Envelope<In>>& items, WorkList& w, Ticks produced, const NodeBase&) override {
      const std::size_t bytes = this->sample_bytes(items);
      std::lock_guard lk(node_->mu_);
      if (node_->graph().stopping()) {
        node_->rejected_locked(this->port_, items.size(), w);
        return;
      }
      if (bytes) node_->sampled_bytes_locked(bytes);
      const Ticks now = node_->stamps() ? (produced ? produced : now_ticks()) : 0;
      for (auto& e : items) node_->queue_.push_back({Entry(std::move(e.value)), e.seq, 0, now});
      node_->arrived_locked(this->port_, items.size(), w, now);
    }

   private:
    GpuStageNode* node_;
  };

  // Host tensors into the pinned ring (an edge HostTensor -> DeviceTensor).
  class HostPort final : public Receiver<HostTensor> {
   public:
    explicit HostPort(GpuStageNode& n) : Receiver<HostTensor>(n, 1), node_(&n) {}
    PinnedRing* ring() const noexcept override { return node_->ring_.get(); }
    void push(std::vector<Envelope<HostTensor>>& items, WorkList& w, Ticks produced,
              const NodeBase& from) override {
      if constexpr (kRing) {
        // Items come in ring memory (written there by the producer) or are copied there now;
        // either way their budget turns into a counted block.
        std::vector<Envelope<HostTensor>> in_ring;
        in_ring.reserve(items.size());
        std::size_t failed = 0;
        for (auto& e : items) {
          bool staged = false;
          // (What the ring refuses is the producer's item: a stage producer checked it in
          // its body's scope, under its OnError; others fail the run here, naming it.)
          const bool ok = guarded(from, e.seq, [&] {
            in_ring.push_back(
                {node_->ring_->push(std::move(e.value), staged, from.name(), e.seq), e.seq});
          });
          if (!ok) ++failed;
          if (staged) account_staged(node_->account_);
        }
        if (failed) node_->ring_->release(failed);
        std::lock_guard lk(node_->mu_);
        if (failed) node_->rejected_locked(1, failed, w);
        if (node_->graph().stopping()) {
          node_->rejected_locked(1, in_ring.size(), w);
          return;  // the tensors (and their ring blocks) go after the lock is released
        }
        const Ticks now = node_->stamps() ? (produced ? produced : now_ticks()) : 0;
        for (auto& e : in_ring) node_->queue_.push_back({Entry(std::move(e.value)), e.seq, 1, now});
        node_->arrived_locked(1, in_ring.size(), w, now);
      } else {
        (void)items;
        (void)w;
        (void)produced;
        (void)from;
      }
    }

   private:
    GpuStageNode* node_;
  };

  // Ring space freed or budgets returned: producers blocked on the ring, and this node if its
  // output ring was full, try again.
  void wake(WorkList& w) {
    {
      std::lock_guard lk(this->mu_);
      this->take_waiters_locked(w);
    }
    w.pokes.push_back(this);
  }

  void start(Invocation* inv, Lease* lease) {
    inv->t0 = this->begin_waited_claim(
        inv->seq, ring_ ? static_cast<std::int64_t>(ring_->bytes_in_use()) : -1);
    inv->began = true;
    account_waited(account_, steady_ns() - inv->since_ns);
    if (ItemTracker* t = this->graph().tracker(); t && inv->arrived != 0)
      t->waited(inv->seq, ticks_to_ns(inv->t0 - inv->arrived));  // its queue and lease wait
    inv->burst.emplace(*dev_, lease, account_,
                       BurstObservers{&this->graph().name(), &this->graph().observers()},
                       this->name(), inv->seq);
    Burst& burst = *inv->burst;
    burst.set_output_ring(out_ring_.get());
    set_current_stage(&this->name());
    if constexpr (!kRing) inv->ids = ids_for_errors(*this, *inv->entry);
    try {
      burst.begin();
      DeviceContext ctx(burst);
      if constexpr (kRing) {
        DeviceTensor input = std::visit(
            [&](auto& v) -> DeviceTensor {
              if constexpr (std::is_same_v<std::decay_t<decltype(v)>, HostTensor>) {
                return ctx.to_device(std::move(v));  // the ring block returns after the copy
              } else {
                return std::move(v);
              }
            },
            *inv->entry);
        inv->entry.reset();
        inv->out.emplace(std::invoke(f_, std::move(input), ctx));
      } else {
        In input = std::move(*inv->entry);
        inv->entry.reset();
        inv->out.emplace(std::invoke(f_, std::move(input), ctx));
      }
    } catch (...) {
      // By the stage's OnError (its enqueued work still runs before the lease returns).
      inv->failed = true;
      this->absorb_item_error(inv->seq, inv->ids, std::current_exception(), inv->out);
    }
    set_current_stage(nullptr);
    // Even after an error, the lease returns only once what was enqueued has run.
    GpuStageNode* n = this;
    burst.end([n, inv] {
      inv->done = now_ticks();
      n->graph().post([n, inv](WorkList& w) { n->finish(inv, w); });
    }, inv->failed);
  }

  void finish(Invocation* inv, WorkList& w) {
    if (ItemTracker* t = this->graph().tracker(); t && inv->began && inv->done != 0)
      t->on_device(inv->seq, ticks_to_ns(inv->done - inv->t0));
    if (inv->burst) {
      inv->burst->settle();
      if (auto e = inv->burst->device_error(); e && !inv->failed) {
        inv->failed = true;
        this->absorb_item_error(inv->seq, inv->ids, e, inv->out);
      }
    }
    Scratch<Envelope<Out>> out;
    if constexpr (std::is_same_v<Out, HostTensor>) {
      // An output the body did not make in the output ring (a heap tensor) is copied there: one
      // it refuses (too large, not contiguous) is this item's error, under the stage's OnError
      // (it failed the run whatever the policy). A substitute goes out as it is.
      if (inv->out && out_ring_) {
        bool pushed = false;
        if (!inv->failed) {
          try {
            bool staged = false;
            inv->out.emplace(out_ring_->push(std::move(*inv->out), staged, this->name(), inv->seq));
            pushed = true;
          } catch (...) {
            inv->failed = true;
            this->absorb_item_error(inv->seq, inv->ids, std::current_exception(), inv->out);
          }
        }
        if (!pushed && inv->out) out_ring_->release(1);  // a substitute: no push took its budget
      }
    }
    if (inv->out) {
      out->push_back(Envelope<Out>{std::move(*inv->out), inv->seq});
    } else {
      this->graph().retire_items(1, w);  // failed, or withdrawn before it ran
      if (out_ring_) out_ring_->release(1);
    }
    inv->out.reset();
    inv->entry.reset();
    const std::size_t emitted = this->emit(inv->ticket, 1, *out, w);
    if (inv->began) {
      const std::vector<Arrivals> arrived{{1, inv->arrived}};
      this->end_invocation(inv->t0, 0, 1, emitted, w, &arrived, inv->seq);  // burst to now
    } else {
      this->end_unbegun(w);  // withdrawn while it waited for a stream, or expired
    }
    delete inv;
    this->graph().release_unit();
  }

  static std::int64_t steady_ns() noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  GpuStageOptions opts_;
  F f_;
  Port in_;
  HostPort host_in_;
  std::deque<Queued> queue_;  // under mu_
  std::shared_ptr<DeviceRuntime> dev_;
  GpuAccount* account_ = nullptr;
  std::shared_ptr<PinnedRing> ring_, out_ring_;
  std::shared_ptr<SpaceNotifier> notifier_;
};

}  // namespace splitflow::detail
