// The untyped heart of a Graph: its nodes, its run lifecycle and the per-run counters that the
// typed nodes touch on their hot path. Implemented in lib/graph_core.cpp.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "splitflow/core/config.hpp"
#include "splitflow/executor/detail/blocking_pool.hpp"
#include "splitflow/executor/detail/node.hpp"
#include "splitflow/telemetry/stats.hpp"
#include "splitflow/telemetry/telemetry.hpp"

namespace splitflow {
struct DeviceStats;
}

namespace splitflow::detail {

class RuntimeCore;
class RunState;
class DeviceRuntime;
class GpuAccount;

/// The item whose stage body runs on this thread (splitflow::current_item()), set by a stage
/// around each body call: `seq` for the call, the previous value (a body may run another
/// graph's work inline) restored when the scope ends.
class CurrentItem {
 public:
  static constexpr std::uint64_t kNone = ~std::uint64_t{0};
  CurrentItem() noexcept : previous_(exchange(kNone)) {}
  explicit CurrentItem(std::uint64_t seq) noexcept : previous_(exchange(seq)) {}
  ~CurrentItem() { exchange(previous_); }
  CurrentItem(const CurrentItem&) = delete;
  CurrentItem& operator=(const CurrentItem&) = delete;
  void set(std::uint64_t seq) noexcept { exchange(seq); }
  /// Sets this thread's item, returning the one before.
  static std::uint64_t exchange(std::uint64_t seq) noexcept;

 private:
  std::uint64_t previous_;
};

/// Follows items by sequence number for a graph that answers requests (Graph::service): told
/// when a stage drops an item on error, asked whether an item's deadline passed.
class ItemTracker {
 public:
  virtual ~ItemTracker() = default;
  /// A stage's body threw on item `seq` and the item was dropped or replaced (OnError).
  /// `stage`: the stage that found it (for a request failed inside a dynamic batch, by
  /// Batch::fail, the unbatch that took it out).
  virtual void item_failed(std::uint64_t seq, const std::string& stage,
                           std::exception_ptr error) noexcept = 0;
  /// Whether item `seq`'s deadline has passed (a GPU stage then drops it before its work).
  virtual bool expired(std::uint64_t seq) noexcept = 0;
  /// A GPU stage dropped item `seq` because its deadline passed.
  virtual void item_expired(std::uint64_t seq, const std::string& stage) noexcept = 0;

  // Where an item's time went (a service's per-request latency split). Durations in ns.
  /// Item `seq` waited `ns` in an input queue or for a stream lease.
  virtual void waited(std::uint64_t /*seq*/, std::int64_t /*ns*/) noexcept {}
  /// A dynamic batch formed as item `seq` from the items `ids`, which waited `waits` in it.
  /// Until unbatched(seq), what is reported for `seq` applies to each of them.
  virtual void batched(std::uint64_t /*seq*/, const std::vector<std::uint64_t>& /*ids*/,
                       const std::vector<std::int64_t>& /*waits*/) noexcept {}
  virtual void unbatched(std::uint64_t /*seq*/) noexcept {}
  /// Item `seq`'s GPU burst held a stream for `ns`, from the lease to its work's completion.
  virtual void on_device(std::uint64_t /*seq*/, std::int64_t /*ns*/) noexcept {}
};

class RunTuner;  // lib/executor/run_tuner.hpp

class GraphCore {
 public:
  GraphCore(std::shared_ptr<RuntimeCore> runtime, std::string name, GraphOptions opts);
  /// Cancels an active run and waits for it.
  ~GraphCore();
  GraphCore(const GraphCore&) = delete;
  GraphCore& operator=(const GraphCore&) = delete;

  const std::string& name() const noexcept { return name_; }
  const GraphOptions& options() const noexcept { return opts_; }

  // ---- building ------------------------------------------------------------------------------
  /// Takes ownership of a new node; throws GraphError on a duplicate name or while running.
  NodeBase& adopt(std::unique_ptr<NodeBase> node);
  /// Throws GraphError if a run is active (the structure is frozen while running).
  void check_mutable() const;
  /// True from start() until the run has ended.
  bool running() const;

  // ---- running -------------------------------------------------------------------------------
  std::shared_ptr<RunState> start();
  /// Stops the active run, if any: sources stop, queued items are dropped, running bodies
  /// finish, and the run ends as cancelled (unless it already failed).
  void cancel() noexcept;
  /// Takes a unit of pending work if the run is not over (so it cannot end meanwhile).
  bool try_acquire_unit() noexcept;
  /// Who cancels a run: what a pull sink's reader is told stopped it (cancel_note).
  enum class CancelCause : int { call, runtime_end, graph_destroyed };
  /// cancel() for a caller that holds a unit.
  void cancel_holding_unit(CancelCause why = CancelCause::call) noexcept;
  /// cancel() by the reader of pull sink `sink` (PullSink::close()): that reader is not told
  /// of the cancel (cancel_note), the readers of other pull sinks are.
  void close_from(const NodeBase& sink) noexcept;
  /// Called as the run ends (end_of_stream): "" unless the run was cancelled by something
  /// other than `reader`'s own close(); else what a reader of it, given `given` items, is told
  /// (CancelledError).
  std::string cancel_note(const NodeBase& reader, std::uint64_t given) const;
  /// Live figures of the active run.
  RunStats snapshot() const;

  // ---- hot path, called by nodes --------------------------------------------------------------
  bool stopping() const noexcept { return stop_.load(std::memory_order_acquire); }
  /// Whether the destruction of the graph's Runtime ended its last run (a service's refusal
  /// then says that running it again cannot serve again).
  bool ended_by_runtime() const noexcept {
    return stop_reason_.load() == StopReason::cancelled && cancel_cause_.load() == CancelCause::runtime_end;
  }
  void add_items(std::uint64_t n) noexcept {
    pending_.fetch_add(n << kItemShift, std::memory_order_relaxed);
  }
  /// Items left the graph (consumed or dropped). Sources waiting for max_in_flight are poked.
  void retire_items(std::uint64_t n, WorkList& w) noexcept;
  /// For a source holding its own lock: how many of `want` items may it admit under
  /// max_in_flight (and, paired by a zip with another source, within pace_lead() items of it)?
  /// Zero registers it to be poked when items retire (or its partner's admitted items start).
  /// What it reserves it then counts with admitted(); what it does not, it gives back with
  /// retire_items().
  std::size_t try_admit(NodeBase& source, std::size_t want);
  /// The `n` items try_admit() let a source make start (their outputs were reserved; what it
  /// did not reserve it gave back with retire_items): a source a zip pairs with another counts
  /// them now, and the partners waiting for it are poked. Counted at try_admit(), items given
  /// back a moment later widened a partner's room meanwhile: it then ran past pace_lead(), its
  /// items waiting at the zips took all of max_in_flight, and the run hung (5 zips, 1 in 1,000).
  void admitted(NodeBase& source, std::size_t n, WorkList& w) noexcept;
  /// A source's generator ended after `items` items: the sources a zip pairs with it are no
  /// longer paced by it, and those zips drop the other input's items past its end at once.
  void source_ended(NodeBase& source, std::uint64_t items, WorkList& w) noexcept;
  /// How far a source paired by a zip with another may run ahead of it, in items (0: no zip
  /// pairs two sources). Without it the items of the faster could take all of max_in_flight
  /// while the zip waits for the slower's, and the run would hang.
  std::size_t pace_lead() const noexcept { return pace_lead_; }
  /// The items the run lets in at once now: GraphOptions::max_in_flight, or lower under the
  /// runtime's memory budget (set_admit_limit).
  std::size_t admit_limit() const noexcept { return admit_limit_.load(std::memory_order_relaxed); }
  /// The least admit limit the run can go on with: what its batches hold while they fill, and
  /// one more (validate).
  std::size_t admit_floor() const noexcept { return admit_floor_; }
  /// Whether the tuner may lower the admit limit: one source, or several whose items wait for
  /// nothing of the others': no zip (one source's items could take all the room while the zip
  /// waits for the other's: pace_lead is a share of max_in_flight) and at most one pull sink
  /// (items of one source filling a sink its consumer does not read yet would keep out those
  /// of the sink it reads).
  bool admit_limit_tunable() const noexcept;
  /// Sets the admit limit, within [admit_floor(), max_in_flight] (the tuner, on the arena);
  /// a raise wakes the sources waiting for room.
  void set_admit_limit(std::size_t n, WorkList& w) noexcept;
  /// A unit of pending work (a task, an active source, a canceller) ended.
  void release_unit() noexcept;
  /// Takes one more unit, for work outside any task (a GPU invocation in flight). Only while
  /// the caller itself holds one.
  void add_unit() noexcept { pending_.fetch_add(1, std::memory_order_relaxed); }
  /// The units keeping the run open now (white-box tests: what a cancelled run still waits for).
  std::uint64_t units() const noexcept {
    return pending_.load(std::memory_order_acquire) & ((std::uint64_t{1} << kItemShift) - 1);
  }
  /// The items admitted and not yet retired (white-box tests, with units()).
  std::uint64_t items_in_flight() const noexcept {
    return pending_.load(std::memory_order_acquire) >> kItemShift;
  }
  /// A waiter (a run's, a pull sink's reader) that saw nothing happen for kNudgeAfter makes the
  /// runtime's arena advertise its work again (RuntimeCore::nudge: oneTBB 2021.8 once left a
  /// run's first task unserved in an idle arena).
  void nudge_runtime() noexcept;
  static constexpr std::chrono::milliseconds kNudgeAfter{100};
  /// The nudges of this graph's runtime so far (white-box tests).
  std::uint64_t runtime_nudges() const noexcept;
  /// White-box tests only: dispatch_external calls `hook` with the number of claims it found,
  /// between finding them and spawning them (a test ends the run there).
  void set_dispatch_hook(std::function<void(std::size_t)> hook) { dispatch_hook_ = std::move(hook); }
  /// Runs fn on an arena thread (from any thread, e.g. a device callback), then the work it
  /// found, ahead of queued claims (RuntimeCore::spawn_urgent). Holds a unit meanwhile. The
  /// caller must hold a unit (the run is live).
  void post(std::function<void(WorkList&)> fn);
  /// post() for a caller that may not hold a unit: does nothing (returns false) if the run has
  /// ended, otherwise the posted task keeps the run, and so the graph, alive until it ran.
  bool post_if_running(std::function<void(WorkList&)> fn);
  /// Runs `t` on the runtime's blocking threads (a blocking stage's body: StageOptions::blocking).
  void post_blocking(BlockingTask t);
  /// Whether the run has observers (GraphOptions::observer, the tracer); cheap.
  bool observed() const noexcept { return !observers_.empty(); }
  const std::vector<Observer*>& observers() const noexcept { return observers_; }
  template <class F>
  void for_each_observer(F&& f) const {
    for (Observer* o : observers_) f(*o);
  }
  /// The runtime's device (created on first use) and this graph's GPU accounting.
  std::shared_ptr<DeviceRuntime> device();
  /// Whether the calling thread runs a task of `runtime` (runtime_core()): a stage body, a
  /// source, a sink, a service's completion callback. Compares pointers only: `runtime` may be
  /// gone.
  static bool in_task_of(const RuntimeCore* runtime) noexcept;
  /// The runtime it runs on (an identity for its arena's threads: ShardedHistogram).
  const RuntimeCore* runtime_core() const noexcept { return runtime_.get(); }
  RuntimeCore* runtime_core() noexcept { return runtime_.get(); }
  GpuAccount* gpu_account();
  /// The graph's request tracker (a service's), or null. Set while building.
  ItemTracker* tracker() const noexcept { return tracker_; }
  void set_tracker(ItemTracker* t) { check_mutable(); tracker_ = t; }
  /// Records the first error of the run and stops it.
  void fail(const NodeBase& node, std::uint64_t seq, std::exception_ptr error) noexcept;
  /// Runs pokes and spawns claims found by a thread that is not a runtime task, under a unit of
  /// the run; once the run is over (a reader's late take) they are dropped.
  void dispatch_external(WorkList& w);
  /// Throws the run's StageError if the current (or last) run failed.
  void rethrow_if_failed() const;

  /// Task body: run one claim (none: start the run) and everything it leads to.
  void run_task(Claim first) noexcept;

 private:
  static constexpr int kItemShift = 32;
  enum class StopReason : int { none, cancelled, failed };
  void spawn(Claim c);
  void execute(WorkList& w);
  void stop(StopReason why) noexcept;
  /// cancel() and close_from(): `sink` (null for cancel()) is recorded as the closer if the
  /// run was not stopping yet.
  void cancel_by(const NodeBase* sink) noexcept;
  void complete() noexcept;
  void retune_at_end(RunStats& st) noexcept;
  void validate();
  /// Sizes the queues whose capacity the user did not set (NodeBase::size_default_queue).
  void size_queues(const std::vector<NodeBase*>& order);
  void check_batching(const std::vector<NodeBase*>& order);
  void check_zips(const std::vector<NodeBase*>& order);
  RunStats collect_stats(bool final) const;

  std::shared_ptr<RuntimeCore> runtime_;
  std::string name_;
  GraphOptions opts_;
  std::vector<std::unique_ptr<NodeBase>> nodes_;
  std::vector<NodeBase*> sources_;
  std::vector<NodeBase*> topo_;  // topological order, set by validate()

  mutable std::mutex mu_;              // guards active_ and current_
  bool active_ = false;
  std::shared_ptr<RunState> current_;  // the active or last run

  // Per run. pending_ = items << 32 | units (tasks, active sources, cancellers): the run is
  // complete when it drops to zero, and item count gates sources against max_in_flight.
  std::atomic<std::uint64_t> pending_{0};
  std::function<void(std::size_t)> dispatch_hook_;  // white-box tests (set_dispatch_hook)
  std::atomic<bool> stop_{false};
  std::atomic<StopReason> stop_reason_{StopReason::none};
  std::atomic<const NodeBase*> closed_by_{nullptr};  // the pull sink whose reader cancelled
  std::atomic<CancelCause> cancel_cause_{CancelCause::call};  // who cancelled the run
  std::atomic<bool> token_waiting_{false};
  // The admit limit (max_in_flight, or the tuner's lower one) and the room that wakes sources
  // waiting for it (wake_room_for).
  std::atomic<std::size_t> admit_limit_{1};
  std::atomic<std::size_t> wake_room_{1};
  std::size_t admit_floor_ = 1;   // batches' held items + 1 (validate)
  std::size_t wake_room_for(std::size_t limit) const noexcept;
  std::mutex token_mu_;
  std::vector<NodeBase*> token_waiters_;
  // Sources that a zip pairs with another source (check_zips), paced against each other.
  struct Paced {
    NodeBase* source = nullptr;
    std::vector<std::size_t> partners;                    // indices in paced_
    std::vector<std::pair<DropListener*, int>> numbers;   // the zip inputs it numbers
    std::atomic<std::uint64_t> admitted{0};               // items started this run (admitted())
    std::atomic<bool> ended{false};
    std::atomic<bool> waiting{false};                     // for a partner's items to start, or its end
  };
  std::vector<std::unique_ptr<Paced>> paced_;
  std::size_t pace_lead_ = 0;
  Paced* paced_of(const NodeBase& source) const noexcept;
  std::size_t pace_room(const Paced& p) const noexcept;
  std::size_t admit_within_limit(NodeBase& source, std::size_t want);
  void poke_paced(const Paced& p, WorkList& w) noexcept;
  bool telemetry_ = true;
  Ticks start_ = 0;
  std::unique_ptr<GpuAccount> gpu_;  // with the first GPU stage's run
  std::shared_ptr<DeviceRuntime> run_device_;     // the device of the runs' GPU stages
  std::unique_ptr<DeviceStats> device_at_start_;  // its figures as the run started
  std::vector<Observer*> observers_;  // this run's: the user's, the tracer
  ItemTracker* tracker_ = nullptr;
  std::unique_ptr<RunTuner> tuner_;  // this run's, when a stage has Concurrency::automatic
};

}  // namespace splitflow::detail
