// The executor's node protocol. Every stage is a NodeBase; the typed parts (queues, bodies,
// emission) live in nodes.hpp. docs/architecture.md ("How an item flows") explains it.
//
// Slot protocol: a producer may start a claim of k items only after it has reserved k slots in
// the input queue of each consumer (`try_reserve`). The slots are later filled (`push`) or given
// back (`release_reservation`). A producer that cannot reserve registers itself as a waiter on
// the full consumer and returns; the consumer pokes it when slots free. So outputs never wait
// for space, queues never exceed their capacity, and no thread parks.
//
// Claims: a claim is one invocation slot (it counts against the stage's concurrency) that runs
// the body on k items one after another. k adapts to the measured body time so that a claim
// holds about kClaimTargetNs of work: trivial bodies amortise the scheduling cost over many
// items, expensive ones run one item per claim.
//
// Locking: one spin lock per node. A thread holding node A's lock may lock a consumer of A (and
// transitively its consumers), never a producer. Graphs are acyclic, so this order is global and
// deadlock-free. Wake-ups that go upstream (pokes) run with no lock held.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <set>
#include <unordered_set>
#include <utility>
#include <vector>

#include "splitflow/core/bytes.hpp"
#include "splitflow/core/config.hpp"
#include "splitflow/core/detail/clock.hpp"
#include "splitflow/telemetry/detail/sharded_histogram.hpp"
#include "splitflow/core/detail/small_vector.hpp"
#include "splitflow/core/detail/spin_lock.hpp"
#include "splitflow/telemetry/stats.hpp"
#include "splitflow/telemetry/telemetry.hpp"

namespace splitflow::autotune {
struct TuneEvent;
}  // namespace splitflow::autotune

namespace splitflow::detail {

class NodeBase;
class GraphCore;
class PinnedRing;

/// Whether items of type T can be copied (fan-out, a substitute): std::is_copy_constructible,
/// looking inside the standard containers (anything with a value_type and an allocator_type),
/// pairs, tuples, optionals and arrays,
/// whose copy constructors are declared whatever their elements: a
/// std::vector<std::unique_ptr<int>> claims to be copyable and fails to compile when copied.
template <class T, class = void>
struct copyable : std::is_copy_constructible<T> {};
template <class T>
struct copyable<T, std::void_t<typename T::value_type, typename T::allocator_type>>
    : std::conjunction<std::is_copy_constructible<T>,
                       // (a type that is its own value_type, as nlohmann::json: not looked into)
                       std::disjunction<std::is_same<std::remove_const_t<typename T::value_type>, T>,
                                        copyable<std::remove_const_t<typename T::value_type>>>> {};
template <class A, class B>
struct copyable<std::pair<A, B>> : std::conjunction<copyable<std::remove_const_t<A>>, copyable<B>> {};
template <class... T>
struct copyable<std::tuple<T...>> : std::conjunction<copyable<T>...> {};
template <class T>
struct copyable<std::optional<T>> : copyable<T> {};
template <class T, std::size_t N>
struct copyable<std::array<T, N>> : copyable<T> {};
template <class T>
inline constexpr bool copyable_v = copyable<T>::value;

/// The largest item type a graph carries by value: items travel through claims on the worker
/// threads' stacks (oneTBB's: a few MiB), a few copies of an item at once; a 1 MiB struct
/// overflowed one in a -O1 build (a new C++ user's trial). Larger data goes behind a pointer.
inline constexpr std::size_t kMaxItemBytes = std::size_t{256} << 10;

/// An item travelling through a graph, with the sequence number errors report.
template <class T>
struct Envelope {
  static_assert(sizeof(T) <= kMaxItemBytes,
                "splitflow: an item type over 256 KiB would travel by value on the worker threads' "
                "stacks (a few copies at once); hold its data through std::unique_ptr<T>, a "
                "std::vector, or a HostTensor");
  // (A struct with a const or reference member is neither: gcc's error came from inside the
  // nodes, a new C++ user's trial.)
  // (A move-only one is moved into place, never assigned, between stages.)
  static_assert(!copyable_v<T> || std::is_move_assignable_v<T>,
                "splitflow: an item type must be move-constructible and move-assignable (queues, "
                "rings and optionals move items in and out): drop the const of a const member "
                "(or hold a reference member as a pointer), or carry the item as a "
                "std::shared_ptr<const T>");
  T value;
  std::uint64_t seq;
};

/// What a node kind's take hook took for a claim, under the node's lock (NodeBase::claim).
struct Taken {
  std::size_t items = 0;           // of the k granted, those the claim got (fewer: a cancel)
  std::size_t popped[2] = {0, 0};  // items that left each input port's queue
  std::size_t tickets = 0;         // places it takes in the node's emission order
  std::size_t announced = 0;       // items the observers are told the claim works on
  std::uint64_t first = 0;         // the first item's number (0 when none)
  bool abandon = false;            // nothing to run (a cancel took it, the source ended)
};

/// What a node kind's claim hook is told (see NodeBase::claim).
struct ClaimInfo {
  std::uint64_t first = 0;   // the first item's number (0 when the claim got none)
  std::uint64_t ticket = 0;  // the first item's place in the node's emission order
};

struct Arrivals;

/// What a node kind's claim hook reports (see NodeBase::claim).
struct ClaimResult {
  std::size_t emitted = 0;  // items handed to consumers (0 when the run was stopping)
  Ticks body_end = 0;       // the end of the work that sizes claims (0: up to the claim's end)
  std::size_t items = 0;    // items the claim processed (their latencies are recorded)
  const std::vector<Arrivals>* arrivals = nullptr;  // their arrival runs (null: the claim's time)
  bool deferred = false;    // the claim ends later (an answer, a burst): end_invocation then
};

/// When a claim begins executing: as it takes its items, or once an outside resource it waits
/// for (a stream) is granted (begin_waited_claim).
enum class Begins { now, after_wait };

/// `count` items that arrived at `ticks` (items pushed together share their arrival time, so
/// a claim's items are a few runs, not one record each).
struct Arrivals {
  std::size_t count;
  Ticks ticks;
};

/// Items a pull sink's reader took after its run's final figures were collected: the run's
/// stats add them to the sink's (the reader may go on after the run ended).
struct LateTakes {
  mutable SpinLock mu;
  std::uint64_t items = 0;
  LatencyHistogram latency;  // in clock ticks, as the node's
};

/// A granted claim: `items` queued items of `node` that one invocation will process.
struct Claim {
  NodeBase* node;
  std::size_t items;
};

/// What running one claim turned up: claims to run next (the executor continues with the
/// first on the same thread and spawns the others) and nodes to poke.
struct WorkList {
  SmallVector<Claim, 4> claims;
  SmallVector<NodeBase*, 4> pokes;
};

struct Edge {
  NodeBase* node;
  int port;
};

/// Hears of the items a node upstream dropped on its input `port` (a stage skipped it on error,
/// its deadline passed): a zip then drops the other half of the pair.
class DropListener {
 public:
  virtual void item_dropped(int port, std::uint64_t seq, const NodeBase& by) noexcept = 0;
  /// The source that numbers the items of input `port` ended after `items` items: an item of
  /// the other input numbered `items` or more has no partner to come.
  virtual void numbering_source_ended(int port, std::uint64_t items, const NodeBase& source,
                                      WorkList& w) noexcept = 0;
  /// The nodes upstream of each input (set while validating): a drop passed on from a node
  /// upstream of the other input too needs nothing here (that input will not get the item).
  virtual void set_upstream(std::unordered_set<const NodeBase*> first,
                            std::unordered_set<const NodeBase*> second) = 0;

 protected:
  ~DropListener() = default;
};

/// The typed entry of a node: fills slots the producer reserved, moving the items out of
/// `items` (which the caller then clears).
template <class T>
class Receiver {
 public:
  Receiver(NodeBase& node, int port) : node_(&node), port_(port) {}
  virtual ~Receiver() = default;
  /// Pushes `items` into reserved slots. `produced`: when the producer made them (its claim's
  /// end, read anyway), their arrival time for latencies; 0: read the clock here if stamping.
  /// `from`: the producer (named in an error of the entry's own, a pinned ring's).
  virtual void push(std::vector<Envelope<T>>& items, WorkList& w, Ticks produced,
                    const NodeBase& from) = 0;
  /// The pinned ring behind this entry, if it is a CPU-to-GPU edge (producers write into it).
  virtual PinnedRing* ring() const noexcept { return nullptr; }
  NodeBase& node() const noexcept { return *node_; }
  int port() const noexcept { return port_; }

 protected:
  /// Call before locking the node: every 8th delivery (telemetry on), the host bytes its first
  /// item holds (bytes_of, at least 1), for NodeBase::sampled_bytes_locked; 0 for the others.
  std::size_t sample_bytes(const std::vector<Envelope<T>>& items) noexcept;

  NodeBase* node_;
  int port_;
  std::atomic<std::uint32_t> deliveries_{0};  // (producers deliver from several threads)
};

class NodeBase {
 public:
  static constexpr int kMaxPorts = 2;
  /// Work per claim the adaptive claim size aims at.
  static constexpr std::int64_t kClaimTargetNs = 20'000;

  NodeBase(GraphCore& graph, std::string name, StageKind kind, const StageOptions& opts, int ports);
  virtual ~NodeBase();
  NodeBase(const NodeBase&) = delete;
  NodeBase& operator=(const NodeBase&) = delete;

  const std::string& name() const noexcept { return name_; }
  /// A source's producer outside the graph (Node::fed_by, which sets it while the graph is not
  /// running), for the diagnosis; empty: none.
  const std::string& fed_by() const noexcept { return fed_by_; }
  void set_fed_by(std::string what) { fed_by_ = std::move(what); }
  StageKind kind() const noexcept { return kind_; }
  GraphCore& graph() const noexcept { return *graph_; }
  SpinLock& mutex() const noexcept { return mu_; }
  std::size_t concurrency() const noexcept { return concurrency_; }
  /// Whether the tuner sets the concurrency (Concurrency::automatic).
  bool auto_concurrency() const noexcept { return auto_; }
  /// Whether the input queue's capacity is the graph's default (its user did not set one).
  bool default_capacity() const noexcept { return default_capacity_; }
  /// An async stage: its invocations wait for answers without holding a thread, so its
  /// concurrency is not bounded by the cores.
  virtual bool asynchronous() const noexcept { return false; }
  /// An automatic stage the graph built on the runtime's blocking threads because the last run
  /// of a graph of its name found its bodies waiting (autotune::body_placement).
  virtual bool auto_placed() const noexcept { return false; }
  /// The tuner's new concurrency (at least 1): claims start at once if it rose.
  void set_concurrency(std::size_t n, WorkList& w);
  Order order() const noexcept { return order_; }
  int ports() const noexcept { return nports_; }
  bool telemetry() const noexcept { return telemetry_; }
  /// Whether items get arrival times: for telemetry, or for a service's latency split.
  bool stamps() const noexcept { return stamps_; }
  /// Input queue capacity of every port, in items.
  std::size_t capacity() const noexcept { return capacity_; }
  /// Whether the tuner sets the input queue's capacity (an automatic CPU stage whose capacity
  /// its user did not set, fed by 1:1 producers; GraphCore::size_queues decides per run).
  bool auto_capacity() const noexcept { return auto_capacity_; }
  /// The most the capacity can be this run: the tuner's ceiling for a tuned queue, else the
  /// capacity (what a producer's reorder ring is sized by).
  std::size_t max_capacity() const noexcept { return auto_capacity_ ? max_capacity_ : capacity_; }
  /// Lets the tuner set the input queue's capacity this run, within [1, `max`] (set before the
  /// run starts; off: the capacity stays as sized). `start` (if not 0): the capacity the run
  /// starts with, when smaller (a memory budget: the tuner raises it once it knows the items).
  void tune_capacity(bool on, std::size_t max, std::size_t start = 0) noexcept {
    auto_capacity_ = on;
    max_capacity_ = std::max(max, capacity_);
    if (on && start > 0) capacity_ = std::min(capacity_, start);
  }
  /// The tuner's new capacity (clamped to [1, max_capacity()]): a raise wakes the producers
  /// waiting for room; a cut stops new reservations until the queue drains below it.
  void set_capacity(std::size_t n, WorkList& w);
  OnError on_error() const noexcept { return on_error_; }

  /// A body threw on item `seq`. Under OnError::fail this fails the run and returns false;
  /// otherwise it counts the item (skipped or substituted), keeps its message and returns true:
  /// the caller drops or replaces the item and goes on.
  bool absorb_error(std::uint64_t seq, std::exception_ptr error, bool substituted) noexcept;

  // ---- executor ---------------------------------------------------------------------------
  /// Runs a claim granted by collect_claims_locked(): pop up to k items, run the body on each,
  /// emit, finish.
  virtual void run_claim(WorkList& w, std::size_t k) = 0;
  /// Capacity or tokens may have become free: grant what claims can be granted. (A source
  /// is poked as its run's first task.)
  virtual void poke(WorkList& w);

  // ---- structure (build time) ---------------------------------------------------------------
  void add_successor(NodeBase& consumer, int port);
  const std::vector<Edge>& successors() const noexcept { return successors_; }
  std::size_t predecessors(int port) const noexcept { return npred_[port]; }
  /// Throws GraphError when the node's own settings or edges are invalid.
  virtual void validate() const;
  /// The same for what depends on the queues' sizes (GraphCore::size_queues, after validate).
  virtual void validate_sized() const {}
  /// A node that pairs items from two branches hears of drops upstream through this (a zip).
  virtual DropListener* drop_listener() noexcept { return nullptr; }
  /// Registers `l` (input `port`) to hear of the items this node drops; set while validating.
  void add_drop_listener(DropListener& l, int port) { drop_listeners_.push_back({&l, port}); }
  void clear_drop_listeners() noexcept { drop_listeners_.clear(); }
  /// This node dropped item `seq` (skipped, expired, unpaired): its listeners hear of it.
  void dropped(std::uint64_t seq) noexcept { dropped(seq, *this); }
  /// The same for a drop that began at `origin` (a zip passing on the drop that lost it a
  /// partner, or the end of the source numbering its other input).
  void dropped(std::uint64_t seq, const NodeBase& origin) noexcept {
    for (const auto& [l, port] : drop_listeners_) l->item_dropped(port, seq, origin);
  }
  /// Items a batch node may hold while it waits to fill (a batch of n: n - 1); 0 for others.
  virtual std::size_t holds_while_filling() const noexcept { return 0; }
  /// A dynamic batch's max_batch (0: not one).
  virtual std::size_t forms_batches_of() const noexcept { return 0; }
  /// An unbatch's max_batch (0: not one).
  virtual std::size_t splits_batches_of() const noexcept { return 0; }
  /// Source items an output of this node stands for, per input item's: a batch of n, n; a
  /// dynamic batch, its max_batch; an unbatch, 1 / max_batch; others 1.
  virtual double items_per_output() const noexcept { return 1.0; }
  /// Sizes a queue whose capacity the user did not set (GraphCore::size_queues): the graph's
  /// default counts source items, so after a batch of n it holds default / n of its items,
  /// times its producers (a merge), and never fewer than `floor` (what its producers' claims
  /// need to run at their concurrency) unless the unscaled default is smaller. `items` is what
  /// one of its input items stands for. `room`: at least this many, whatever the default (the
  /// consumer of an automatic async stage: the graph's max_in_flight).
  void size_default_queue(double items, std::size_t floor, std::size_t room = 0);

  // ---- consumer side of the slot protocol ----------------------------------------------------
  /// Called by a producer holding its own lock: reserve up to `want` slots on `port` (with
  /// all_or_none, `want` or nothing); returns how many. Zero registers the producer as a waiter.
  std::size_t try_reserve(int port, NodeBase& producer, std::size_t want, bool all_or_none = false);
  /// `n` reserved slots will not be filled. Called with no lock of this node held. `keep`: a
  /// producer not to wake (one rolling back its own reservations: it registered as a waiter on
  /// the consumer that refused it; waking it here, when that consumer is this node through its
  /// other input, retried the claim forever: one producer into both inputs of a zip).
  void release_reservation(int port, std::size_t n, WorkList& w, const NodeBase* keep = nullptr);
  /// One producer delivered everything it will deliver this run (end of input). Called by the
  /// producer holding its own lock (we are downstream: in lock order).
  void producer_closed(WorkList& w);
  /// Called with mu_ held, after `n` items were stored in the port's queue at time `now`.
  void arrived_locked(int port, std::size_t n, WorkList& w, Ticks now = 0);
  /// Called with mu_ held when `n` items for reserved slots were dropped (the run is stopping).
  void rejected_locked(int port, std::size_t n, WorkList& w);
  /// Called with mu_ held: an item delivered to this node's input held `bytes` (bytes_of,
  /// sampled by the typed input ports; StageStats::item_bytes).
  void sampled_bytes_locked(std::size_t bytes) noexcept {
    bytes_sum_ += static_cast<double>(bytes);
    ++bytes_samples_;
    max_item_bytes_ = std::max(max_item_bytes_, bytes);
  }

  // ---- run lifecycle (GraphCore) ------------------------------------------------------------
  /// Before a run, after validation: acquire what the run needs (a device, rings). May throw.
  virtual void prepare() {}
  virtual void reset(Ticks start, bool telemetry, std::size_t parallelism);
  /// The run is set up (its units counted): items pushed from outside may go in now. (Under
  /// the graph's lock, after every node's reset.)
  virtual void begin_run() {}
  /// Cancel: drop queued items (they are retired) and wake producers.
  virtual void drop_queued(WorkList& w);
  /// Empties the typed queues; returns how many items must be retired.
  virtual std::size_t clear_queues_locked() { return 0; }
  /// The run is over: let consumers of a pull sink see the end of the stream.
  virtual void end_of_stream() {}
  /// The run's figures are in and no body of it runs: drop what only this run used (a
  /// source's copy of its generator, and what that holds: a file, a remote pass), so that it
  /// is released when the run ends, not when the next one starts. On the completing thread,
  /// no lock held, before the run is published: what it destroys must not wait for this run
  /// (its wait(), its graph's destruction) or start the graph again.
  virtual void end_run() noexcept {}
  /// Whether it answers a service's requests by their ids (a service's sink).
  virtual bool answers_requests() const noexcept { return false; }
  /// Whether its outputs reach a node that answers requests.
  bool reaches_answers() const {
    std::vector<const NodeBase*> todo{this};
    std::unordered_set<const NodeBase*> seen{this};
    while (!todo.empty()) {
      const NodeBase* n = todo.back();
      todo.pop_back();
      if (n->answers_requests()) return true;
      for (const Edge& e : n->successors())
        if (seen.insert(e.node).second) todo.push_back(e.node);
    }
    return false;
  }
  /// Whether a dynamic batch this node makes reaches a node that answers requests still a
  /// batch: on a way where the unbatches do not split every dynamic batch formed since (one
  /// each, innermost first: a batch of batches needs two).
  bool reaches_answers_batched() const {
    using At = std::pair<const NodeBase*, std::size_t>;  // a node, the batches unsplit there
    std::vector<At> todo{{this, 1}};
    std::set<At> seen{{this, 1}};
    while (!todo.empty()) {
      const auto [n, depth] = todo.back();
      todo.pop_back();
      if (n->answers_requests()) return true;
      for (const Edge& e : n->successors()) {
        const std::size_t d =
            depth + (e.node->forms_batches_of() != 0) - (e.node->splits_batches_of() != 0);
        if (d > 0 && seen.insert({e.node, d}).second) todo.push_back({e.node, d});  // (0: all split)
      }
    }
    return false;
  }
  /// The graph is going and its run has ended: wait for the threads still reading this node
  /// from outside the run (a pull sink's readers) to leave it.
  virtual void close_readers() noexcept {}
  /// The run's final figures are in (`st`: this node's; `wall_ns`: the run's): what the node
  /// sizes from them for the next run (a GPU stage's automatic ring) is decided here, its
  /// decisions appended to `out`. Runs on the completing thread, with no node lock held.
  virtual void retune_at_end(const StageStats& /*st*/, std::int64_t /*wall_ns*/,
                             std::vector<autotune::TuneEvent>& /*out*/) {}
  /// A pull sink's record of the items its reader took after the run's final figures were
  /// collected (the run's stats add them); null for other nodes.
  virtual std::shared_ptr<const LateTakes> late_takes() const { return nullptr; }
  // With mu_ held (GraphCore holds every node's lock for a consistent snapshot).
  void finalize_locked(Ticks end);
  /// The run's final figures were read (under mu_); later changes are not in them.
  virtual void finalized_locked() {}
  StageStats snapshot_locked(Ticks now) const;
  /// Adds figures of resources the node owns (a GPU stage's pinned ring).
  virtual void add_stats_locked(StageStats&) const {}

 protected:
  // All *_locked members run with mu_ held.
  /// Items queued (on every port) that a claim can pop, owned by a granted claim or not.
  virtual std::size_t ready_locked() const;
  /// How many of `available` items the next claim takes (default: the adaptive claim size).
  virtual std::size_t claim_size_locked(std::size_t available) const;
  /// Outputs a claim of k items produces: the slots it reserves in each consumer (1:1 nodes: k;
  /// a batch node: one). A claim whose outputs cannot all be reserved does not start, unless
  /// the node is 1:1, whose claim then shrinks to the slots granted.
  virtual std::size_t outputs_for_locked(std::size_t k) const { return k; }
  /// Whether this node will get no more input this run (sources: the generator ended).
  virtual bool inputs_done_locked() const { return open_inputs_ == 0; }
  /// Once the node has no input left to come, nothing queued and nothing running, it tells its
  /// consumers their input from it ended (what lets a batch node emit its last, short batch).
  void maybe_close_locked(WorkList& w);
  /// Extra admission (sources: the graph's max_in_flight; a GPU stage: its output ring): how
  /// many of `want` may start. It pokes no one: a partner's room moves only once items start
  /// (admitted_locked), and a refusal is answered by whoever frees room.
  virtual std::size_t admit_locked(std::size_t want) { return want; }
  /// `n` admitted items will not start after all (a consumer had fewer slots): give them back.
  virtual void unadmit_locked(std::size_t /*n*/, WorkList& /*w*/) {}
  /// `n` admitted items start: their outputs were reserved (a source paired by a zip counts
  /// them only now, so that no partner's room ever includes items it gives back).
  virtual void admitted_locked(std::size_t /*n*/, WorkList& /*w*/) {}
  /// Extra capacity of an input port beyond its item slots (a pinned ring's byte budget): how
  /// many of `want` slots it can back. Called with mu_ held; 0 makes the producer wait.
  virtual std::size_t reserve_extra_locked(int /*port*/, std::size_t want) { return want; }
  /// Reserved slots given back: return their extra capacity too.
  virtual void release_extra(int /*port*/, std::size_t /*n*/) {}
  void collect_claims_locked(WorkList& w);
  /// Items left port's queue at `now` (0: read the clock): account them and wake producers
  /// blocked on the space.
  void popped_locked(int port, std::size_t n, WorkList& w, Ticks now = 0);
  /// A claim starts executing at `t0` (read under the lock, so that claim sizing does not
  /// count a wait for the lock as the body's work).
  void begin_invocation_locked(Ticks t0);
  /// A claim popped `n` items of the `k` it was granted (fewer after a cancel): account it and
  /// give back the output slots of the items it did not get (outputs_for_locked).
  void took_locked(std::size_t k, std::size_t n, WorkList& w);
  /// The claim lifecycle, written once for every node kind. Under mu_: read the start time (a
  /// wait for the lock is not the body's work), `take(t0)` (the kind takes its items: pops its
  /// queues, or makes room for a source's), account them (items granted and got, queues
  /// popped, emission tickets), begin the invocation (or, Begins::after_wait, wait for an
  /// outside resource); a claim that got nothing ends here. Without the lock: tell the
  /// observers the claim began; `process(ClaimInfo, t0)`, the kind's work (call the bodies, apply
  /// the stage's error policy, retire what left the graph, emit); end_invocation, unless the
  /// claim ends later (ClaimResult::deferred: an answer or a burst completes it).
  template <class Take, class Process>
  void claim(WorkList& w, std::size_t k, Take&& take, Process&& process,
             Begins begins = Begins::now) {
    Taken t;
    ClaimInfo c;
    Ticks t0;
    std::size_t queued;
    {
      std::lock_guard lk(mu_);
      t0 = now_ticks();
      t = take(t0);
      took_locked(k, t.items, w);
      if (t.abandon) {
        end_unbegun_locked(w, false);
        return;
      }
      if (begins == Begins::now) {
        begin_invocation_locked(t0);
      } else {
        ++waiting_;
        refresh_state_locked(t0);
      }
      for (int p = 0; p < nports_; ++p)
        if (t.popped[p] > 0) popped_locked(p, t.popped[p], w, t0);
      c.first = t.first;
      c.ticket = next_ticket_;
      next_ticket_ += t.tickets;
      queued = queued_total_locked();
    }
    if (begins == Begins::now) notify_begin(t0, t.first, t.announced, queued);
    const ClaimResult r = process(c, t0);
    if (!r.deferred) end_invocation(t0, r.body_end, r.items, r.emitted, w, r.arrivals, t.first);
  }
  /// The claim lifecycle of a node with one input port (OneInputNode): claim() taking the `k`
  /// granted items of `port` (their arrival runs kept for latencies); `hook(items, ClaimInfo)`
  /// processes them once a service's tracker has heard how long they queued. Defined in
  /// nodes.hpp.
  template <class Queue, class Hook>
  void run_input_claim(Queue& port, WorkList& w, std::size_t k, Hook&& hook);
  /// A claim that waited (Begins::after_wait) was granted its resource: it begins now, told to
  /// the observers with the item it works on. Returns its start time.
  Ticks begin_waited_claim(std::uint64_t first, std::int64_t ring_bytes = -1);
  /// A claim that waited (Begins::after_wait) ends without having begun: withdrawn by a
  /// cancel, or answered before its work (an expired request).
  void end_unbegun(WorkList& w) {
    std::lock_guard lk(mu_);
    end_unbegun_locked(w, true);
  }
  /// The claim processed `n` items (the first numbered `first`) and emitted `emitted`: release
  /// it, record the items' latencies (from `arrivals`, runs of arrival times, when given; else
  /// the claim's time per item), notify observers, grant new claims. Its work (what sizes the
  /// next claims) is [t0, body_end): the bodies, not the emission into consumers, whose locks
  /// may be contended (0: up to now).
  void end_invocation(Ticks t0, Ticks body_end, std::size_t n, std::size_t emitted, WorkList& w,
                      const std::vector<Arrivals>* arrivals = nullptr, std::uint64_t first = 0);
  /// Tells the graph's observers a claim began (call without mu_; cheap when none).
  void notify_begin(Ticks t0, std::uint64_t first, std::size_t n, std::size_t queued,
                    std::int64_t ring_bytes = -1);
  std::size_t queued_total_locked() const noexcept {
    std::size_t q = 0;
    for (int p = 0; p < nports_; ++p) q += ports_[p].queued;
    return q;
  }
  /// A claim ends unbegun (`waited`: it was waiting for a resource): release it, grant new
  /// claims, close the output if that was the last work.
  void end_unbegun_locked(WorkList& w, bool waited);
  void release_successors(std::size_t n, WorkList& w);
  /// Pokes the producers waiting for room, but `keep`, which stays registered.
  void take_waiters_locked(WorkList& w, const NodeBase* keep = nullptr);
  void refresh_state_locked(Ticks now = 0);
  /// Integrates queue occupancy up to `now` (before the queue changes).
  void account_queue_locked(Ticks now) noexcept {
    if (!telemetry_) return;
    if (now == 0) now = now_ticks();
    // A time read before the lock may precede the last update by another thread.
    now = std::max(now, queue_since_);
    queue_area_ += static_cast<double>(queued_total_locked()) * static_cast<double>(now - queue_since_);
    queue_since_ = now;
  }
  bool sequenced() const noexcept { return sequenced_; }
  std::size_t queued_locked(int port) const noexcept { return ports_[port].queued; }

  GraphCore* graph_;
  std::string name_;
  std::string fed_by_;
  StageKind kind_;
  bool auto_;  // Concurrency::automatic: concurrency_ is the tuner's (under mu_)
  std::size_t concurrency_;
  Order order_;
  std::size_t capacity_;  // under mu_ while a run is on (the tuner may change it)
  bool default_capacity_;  // the graph's default, times the producers of a merge
  bool auto_capacity_ = false;    // the tuner sets capacity_ (under mu_) this run
  std::size_t max_capacity_ = 0;  // its ceiling then
  OnError on_error_;
  std::size_t max_claim_ = 64;  // items per claim at most
  int nports_;
  std::vector<Edge> successors_;
  std::vector<std::pair<DropListener*, int>> drop_listeners_;  // set by GraphCore::validate
  std::size_t npred_[kMaxPorts] = {0, 0};

  mutable SpinLock mu_;
  struct Port {
    std::size_t queued = 0;
    std::size_t reserved = 0;
  };
  Port ports_[kMaxPorts];
  std::size_t running_ = 0;    // granted claims not yet finished
  std::size_t unpopped_ = 0;   // items owned by granted claims that have not popped them yet
  std::size_t executing_ = 0;  // claims executing now
  std::size_t waiting_ = 0;    // claims waiting for an outside resource (a stream)
  bool blocked_ = false;       // has input and free concurrency, but a consumer is full
  bool telemetry_ = true;
  bool stamps_ = true;
  bool sequenced_ = false;  // in-order with concurrency > 1: outputs go through a reorder ring
  std::uint64_t next_ticket_ = 0;
  std::size_t parallelism_ = 1;     // runtime threads: how many claims a backlog is split into
  std::size_t claim_ = 1;           // adaptive items per claim
  double item_ticks_ = 0;           // smoothed body time per item
  double target_ticks_ = 0;         // kClaimTargetNs in ticks
  std::vector<NodeBase*> waiters_;  // producers blocked on our capacity
  std::size_t open_inputs_ = 0;     // producers that have not closed their output this run
  bool closed_ = false;             // we told our consumers that our output ended

  // statistics (under mu_)
  enum State : int { kStarved = 0, kBusy = 1, kBlocked = 2 };
  int state_ = kStarved;
  Ticks state_since_ = 0;
  Ticks state_ticks_[3] = {0, 0, 0};
  Ticks work_ticks_ = 0;
  std::uint64_t items_in_ = 0;
  std::uint64_t items_out_ = 0;
  std::uint64_t invocations_ = 0;
  std::uint64_t skipped_ = 0;
  std::uint64_t substituted_ = 0;
  std::uint64_t expired_ = 0;      // dropped before their GPU work: their deadline passed
  std::vector<ItemError> errors_;  // the first StageStats::kMaxItemErrors
  std::size_t max_executing_ = 0;
  std::size_t max_queue_ = 0;
  double bytes_sum_ = 0;              // sampled input items' bytes, summed
  std::uint64_t bytes_samples_ = 0;
  std::size_t max_item_bytes_ = 0;
  Ticks start_ = 0;        // the run's
  double queue_area_ = 0;  // queued items x ticks
  Ticks queue_since_ = 0;
  ShardedHistogram latency_;  // (its own locks: recorded outside mu_)
};

template <class T>
std::size_t Receiver<T>::sample_bytes(const std::vector<Envelope<T>>& items) noexcept {
  if (items.empty() || !node_->telemetry()) return 0;
  if ((deliveries_.fetch_add(1, std::memory_order_relaxed) & 7u) != 0) return 0;
  try {
    return std::max<std::size_t>(bytes_of(items.front().value), 1);
  } catch (...) {  // a user's host_bytes that throws: not sampled
    return 0;
  }
}

}  // namespace splitflow::detail
