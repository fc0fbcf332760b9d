// Autotune's policy (issue 17): a function of measurements to an allocation. From what a graph's
// stages did over a window (items, body time, CPU time, GPU time, waits, queue occupancy) it
// estimates each stage's cost per item, computes the rate the graph can reach under a core and a
// memory budget, sets concurrency, queue capacities, ring depth and items in flight from that
// model, and then improves them online by a hill climb whose every step is an event with its
// reason. Nothing here runs a graph: the executor (or autotune_sim.hpp's simulator) feeds it
// samples and applies what it returns. docs/autotune.md describes the model.
//
//     splitflow::autotune::Autotuner tuner({}, {.cores = 16, .memory_bytes = 1 << 30});
//     for (;;) {                                   // once per window (about a second)
//       auto d = tuner.observe(sample_of_last_window());
//       if (d.changed) apply(d.allocation);       // concurrency, capacities, ring, in flight
//       for (auto& e : d.events) log(e.text());   // "decode 2 -> 3: 'model' waited 41% ..."
//     }
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace splitflow::autotune {

/// No ceiling (a concurrency or capacity the stage itself does not bound).
inline constexpr std::size_t kUnlimited = std::numeric_limits<std::size_t>::max();

/// What a stage's time per item goes to, as estimated from its figures.
enum class Resource {
  cpu,  ///< computes: each invocation in flight holds a core for its whole body
  io,   ///< waits (a read from a slow file system, an object store): latency without CPU
  gpu,  ///< a GPU stage: bursts on a device shared with the other stages on it
};
const char* to_string(Resource r) noexcept;

/// What the tuner may use. Several graphs sharing one runtime get a share each (split_budget).
struct Budget {
  /// CPU cores (the runtime's arena threads) the graph's bodies may hold at once.
  double cores = 1;
  /// Host bytes the graph's items may hold: queued, in flight, and in pinned rings.
  std::size_t memory_bytes = std::numeric_limits<std::size_t>::max();
  /// The cores are a pool that enforces itself (the graph's runtime threads, the simulator's
  /// cores): an invocation beyond them waits for a free one, so the concurrencies may add up
  /// to more than the cores as long as the CPU the rate needs fits (rate x CPU per item <=
  /// cores, and no stage more slots than cores). 100 us >> 300 us on 2 cores: (1, 2) reaches
  /// 5,000 items/s where charging each slot a core allows (1, 1) and 3,333. false (a share of
  /// a pool that others use too): each slot is charged cores_per_slot.
  bool pool = false;
};

/// One stage over one measurement window: differences of its StageStats (and GPU figures)
/// between the window's start and end, and the settings the window ran with.
struct StageSample {
  std::string name{};
  bool gpu = false;      ///< a GPU stage (its device time is gpu_busy_ns)
  int device = 0;        ///< GPU stages: the device; stages on one device share its time
  /// Indices (into Sample::stages) of the stages feeding this one; empty: fed by a source.
  std::vector<std::size_t> producers{};
  /// Items through this stage per item delivered, when the graph's shape says it (a chain: 1;
  /// after a batch of 64: 1/64). 0: measured, items over delivered, which the filling of the
  /// queues biases in the first windows.
  double visits = 0;
  std::uint64_t items = 0;       ///< items its bodies finished in the window
  /// Summed body wall time, I/O waits included (a GPU stage: the host time of its bodies,
  /// which enqueue the bursts; the device's time is gpu_busy_ns).
  std::int64_t work_ns = 0;
  std::int64_t cpu_ns = -1;      ///< summed body CPU time; -1: unknown (work_ns is taken as CPU)
  std::int64_t gpu_busy_ns = 0;  ///< GPU stages: time the device executed its kernels and copies
  /// Stages whose bodies take the lock all bodies of the process share (a Python body's GIL):
  /// the CPU demand they held it with, and their waits to take it (in work_ns; contention,
  /// not cost: left out of the cost per item). 0 for the others.
  std::int64_t serial_ns = 0;
  std::int64_t serial_wait_ns = 0;
  std::int64_t busy_ns = 0;      ///< time with at least one body executing
  std::int64_t starved_ns = 0;   ///< time without input (or without a thread): its input wait
  std::int64_t blocked_ns = 0;   ///< time with input but a full consumer queue
  double mean_queue = 0;         ///< items queued at its input, averaged over the window
  std::size_t item_bytes = 0;    ///< host bytes one input item holds (0: negligible)
  std::size_t concurrency = 1;   ///< the concurrency the window ran with
  std::size_t capacity = 1;      ///< its input queue's capacity during the window
  /// A number the user set: kept as it is, the rest is tuned around it.
  std::optional<std::size_t> fixed_concurrency{};
  std::optional<std::size_t> fixed_capacity{};
  /// A ceiling the stage itself has (a GPU stage: the device's streams; a store's request
  /// limit). CPU stages are also held to the core budget.
  std::size_t max_concurrency = kUnlimited;
  /// What feeds it and what it feeds outside the model, for the texts ("source 'files'", "pull
  /// sink 'out' (its reader)", "'b' (not tuned)"); empty where a modelled stage or nothing is.
  std::string fed_by{};
  std::string feeds{};
  /// What it feeds is the graph's consumer: a sink, or a pull sink (its reader). Held back by
  /// it half of the window or more, the graph asks for the cores its delivered rate needs, not
  /// its model's (Autotuner::demand).
  bool feeds_consumer = false;
};

/// One window of one graph.
struct Sample {
  std::int64_t end_ns = 0;      ///< when the window ended (clock of the caller's choice)
  std::int64_t window_ns = 0;   ///< its length
  std::uint64_t delivered = 0;  ///< items consumed by the graph's sinks in the window
  /// The shared lock's holds (StageSample::serial_ns) in the window by bodies outside these
  /// stages: other graphs' Python stages, the graph's own that are not tuned. What is left of
  /// the window is the lock's time these stages can have. (May be negative in a window whose
  /// ends split a body's hold from its stage's: the estimator sums the windows.)
  std::int64_t serial_others_ns = 0;
  std::vector<StageSample> stages{};
};

/// A stage's estimated costs: what the model and the solver work with.
struct StageModel {
  std::string name{};
  Resource resource = Resource::cpu;
  double visits = 1;   ///< items through this stage per item delivered (a batch of 64: 1/64)
  double cpu_s = 0;    ///< CPU seconds per item
  double wall_s = 0;   ///< body seconds per item (>= cpu_s; a GPU stage: enqueue + device)
  double gpu_s = 0;    ///< device seconds per item (GPU stages)
  /// Seconds per item it holds the lock all stages' bodies share (a Python body's GIL;
  /// <= wall_s): one body at a time holds it, so the summed visits x serial_s of the stages
  /// bound the rate, whatever their concurrency. 0: takes no such lock.
  double serial_s = 0;
  /// The share of the lock's time left to the modelled stages (bodies outside them hold the
  /// rest: Sample::serial_others_ns); the lock bounds them at serial_share over their holds.
  double serial_share = 1;
  int device = 0;
  std::size_t item_bytes = 0;
  std::size_t max_concurrency = kUnlimited;
  std::optional<std::size_t> fixed_concurrency{}, fixed_capacity{};
  std::vector<std::size_t> producers{};
  /// Cores one invocation in flight holds on average (1 for a CPU stage).
  double cores_per_slot() const noexcept {
    // (Nothing measured yet: a CPU stage's slot is a core; a GPU stage's bursts hold none.)
    return wall_s > 0 ? cpu_s / wall_s : resource == Resource::gpu ? 0.0 : 1.0;
  }
};

/// One stage's settings.
struct StageSetting {
  std::size_t concurrency = 1;  ///< invocations (GPU stages: bursts) in flight at once
  std::size_t capacity = 1;     ///< input queue capacity, in items
  std::size_t ring_items = 0;   ///< GPU stages: pinned ring depth in items (x the ring item bytes)
};

/// What the tuner sets for one graph, with the figures it was judged by.
struct Allocation {
  std::vector<StageSetting> stages{};  ///< one per stage, in the Sample's order
  std::size_t max_in_flight = 0;     ///< the graph's GraphOptions::max_in_flight
  /// Cores charged: sum of concurrency x cores_per_slot (with a Budget::pool it may exceed the
  /// pool's cores: invocations beyond them wait for one; the CPU the rate needs fits).
  double cores = 0;
  /// Host bytes the items can hold at most: capacity x item bytes, summed, plus what an
  /// invocation's input holds beyond its output's (reserved) slot.
  std::size_t bytes = 0;
  double rate = 0;        ///< items per second the model predicts
};

/// What bounds a graph's rate.
enum class Limit {
  none,     ///< no stage measured yet
  cores,    ///< the core budget over the summed CPU cost per item
  stage,    ///< a stage at its concurrency ceiling (serial, user-fixed, a request limit)
  gpu,      ///< a device's time per item
  memory,   ///< the memory budget (queues of one item already)
};
const char* to_string(Limit l) noexcept;

/// The rate a graph can reach and what bounds it.
struct Bound {
  double rate = 0;         ///< items per second delivered, at best (integer concurrency)
  double fluid_rate = 0;   ///< the same without rounding: min(cores / sum cost, stages, GPUs)
  Limit limit = Limit::none;
  std::size_t stage = 0;   ///< Limit::stage or gpu: the (first) stage at fault
  std::string why{};         ///< "cores: 126 / 0.380 s of core time per item"
};

/// Charged cores of `k` invocations of `m` in flight.
double cores_of(const StageModel& m, std::size_t k) noexcept;
/// Items per second stage `m` sustains with concurrency `k` (its device, and the lock its bodies
/// share with other stages' (StageModel::serial_s), not shared).
double stage_rate(const StageModel& m, std::size_t k) noexcept;
/// Concurrency stage `m` needs to sustain `rate` items delivered per second (at least 1).
std::size_t slots_for(const StageModel& m, double rate) noexcept;
/// The model's rate of an allocation: the slowest stage, device or core share.
double predicted_rate(const std::vector<StageModel>& models, const Allocation& a);
/// Recomputes a.cores, a.bytes and a.rate from its settings.
void account(const std::vector<StageModel>& models, Allocation& a);

/// The best rate under `budget` and what bounds it. The integer concurrencies that reach it
/// are allocate()'s (with the fewest cores).
Bound rate_bound(const std::vector<StageModel>& models, const Budget& budget);

/// The policy's constants.
struct PolicyOptions {
  /// A change is kept when the rate improves by more than this fraction (or the noise seen
  /// between windows of one allocation, if larger); otherwise it is reverted.
  double min_gain = 0.01;
  /// A stage's cost per item that moves by more than this fraction (two windows running)
  /// re-tunes the graph from its new model.
  double drift = 0.2;
  /// GPU-limited graphs keep each limiting device at least this busy with the fewest cores
  /// (and graphs the GIL bounds, StageModel::serial_s, the GIL).
  double gpu_busy_target = 0.95;
  /// Windows skipped after a change before the rate is judged (queues refill).
  int settle_windows = 1;
  /// Queue capacity at least (unless memory forbids), beyond the producers' reserved slots.
  std::size_t min_capacity = 2;
  /// Items per stage an estimate needs to be firm. The first allocation comes from the first
  /// window in which every stage finished an item; it is computed again, once, when every
  /// stage has finished this many (after a drift too).
  std::uint64_t min_items = 32;
};

/// The initial allocation: the integer concurrencies that reach the bound with the fewest
/// cores (CPU-bound: all cores, split in proportion to cost, rounded optimally; GPU-limited:
/// the fewest that keep the device gpu_busy_target busy), then queue capacities, ring depths and
/// max_in_flight within the memory left.
Allocation allocate(const std::vector<StageModel>& models, const Budget& budget,
                    const PolicyOptions& options = {});

/// Sets capacities (the slots producers' invocations reserve, plus a buffer of min_capacity or
/// half this stage's concurrency), ring depths and max_in_flight, halving the buffer of the
/// queue holding the most bytes until the allocation fits the memory budget.
void size_buffers(const std::vector<StageModel>& models, Allocation& a, const Budget& budget,
                  const PolicyOptions& options = {});

/// What one graph asks of a shared budget.
struct GraphDemand {
  /// Cores it uses at its bound with no core limit (CPU-bound graphs: kUnlimited as a double),
  /// one more when its hill climb wanted a core its share did not have.
  double cores = 0;
  std::size_t memory_bytes = 0;  ///< bytes it would hold at that allocation
  int priority = 0;              ///< GraphOptions::priority: weight 1 + p (p >= 0), 1/(1 - p)
};
/// Splits `total` between graphs: each gets its demand when that is below its weighted fair
/// share, the rest is shared by weight (water-filling; what is left when every demand is met
/// goes to all by weight), cores rounded to whole cores, one at least for each graph that asks
/// for any while the total has one for each.
std::vector<Budget> split_budget(const std::vector<GraphDemand>& demands, const Budget& total);

/// What a tuner event did.
enum class Action {
  initial,    ///< the first allocation, from the model
  retune,     ///< a new allocation from a changed model (a cost drifted) or budget
  probe,      ///< a change under trial
  keep,       ///< a trial kept: the rate improved (or held, for a release)
  revert,     ///< a trial undone: the rate did not improve
  release,    ///< cores given back: the GPU (or another non-core limit) binds
  converged,  ///< no move left improves the rate
};
const char* to_string(Action a) noexcept;

/// One decision, with its reason.
struct TuneEvent {
  std::int64_t at_ns = 0;  ///< end of the window it was decided on
  Action action = Action::initial;
  std::string stage{};       ///< "" for the graph as a whole
  std::string knob{};        ///< "concurrency", "capacity", "max_in_flight", "ring_bytes" (bytes), "blocking", or ""
  std::size_t from = 0, to = 0;
  std::string reason{};      ///< "'model' waited 41% of the last 1.0 s for input; decode busy 98%"
  /// "decode 2 -> 3: 'model' waited 41% ..." (stage and knob changes), or the reason.
  std::string text() const;
};

/// What bounds the items a graph lets in at once under a memory budget (its admission limit,
/// GraphCore's, at most GraphOptions::max_in_flight). Every item alive in a graph counts
/// against it (a batch as one, the items a batch holds while it fills each as one), so the
/// items it lets in hold at most the limit times the largest item: a bound on the graph's
/// memory whatever capacities its user set.
struct AdmissionInput {
  std::size_t current = 0;      ///< the limit now
  std::size_t memory = 0;       ///< the graph's share of the budget, in bytes (kUnlimited: none)
  std::size_t fixed_bytes = 0;  ///< what it holds whatever its items: GPU stages' pinned rings
  /// What its pull sink's queue may hold (its items are outside the limit: pull_sink_capacity).
  std::size_t sink_bytes = 0;
  /// What one item alive holds at most: the largest of its stages' input items (0: none
  /// measured yet), at `widest`'s input.
  std::size_t unit_bytes = 0;
  std::string widest{};
  std::size_t floor = 1;        ///< the least it can go on with: its batches' held items + 1
  std::size_t ceiling = 1;      ///< GraphOptions::max_in_flight
  /// Whether a decision said already that the budget holds fewer items than `floor` (the
  /// caller keeps it: set by a decision taken while over_budget(), cleared once the budget has
  /// held the items for two windows).
  bool told_over = false;
};
/// Whether the memory `in` leaves holds fewer items than the graph goes on with (its floor):
/// it then runs over the budget at the floor.
bool over_budget(const AdmissionInput& in) noexcept;
/// The admission limit for `in`: the items that fit the memory left after the fixed bytes,
/// within [floor, ceiling]. A cut is made at once; a raise only by an eighth of the current
/// limit or more, and where items an eighth larger would fit more than the limit now (item
/// sizes vary from window to window). Returns the decision
/// (knob "max_in_flight", from, to, its reason) if the limit changes, or once (unless
/// `told_over`) where the budget holds fewer items than the floor ("max_in_flight stays 16:
/// ... over the budget (a smaller batch or a larger RuntimeConfig::host_memory_budget fits
/// it)"); none otherwise (or without a budget, or before an item was measured).
///
///   autotune::AdmissionInput in{.current = 1, .memory = 12 << 20, .unit_bytes = 1 << 20,
///                               .widest = "work", .floor = 1, .ceiling = 256};
///   auto e = autotune::admission_limit(in, 0);
///   // e->to == 12; e->text(): "max_in_flight 1 -> 12: items of up to 1 MiB (at 'work'):
///   //   12 of them hold 12 MiB, within the graph's 12 MiB of the memory budget"
std::optional<TuneEvent> admission_limit(const AdmissionInput& in, std::int64_t at_ns);

/// A pull sink's queue under a memory budget. Its items count as consumed when they arrive
/// (its reader may hold them past the run), so they are outside the admission limit: what it
/// may hold is its capacity times its items. A graph's one pull sink whose capacity its user
/// did not set is sized to a quarter of the graph's share of the budget (the items its reader
/// has ready, as a DataLoader's prefetch), raised to its producers' claims and one more where
/// that fits half the share (each claim of a producer reserves a slot in it: fewer slots than
/// claims would hold the producer back); within [1, `ceiling`]. What it may hold then is taken
/// off the admission limit's memory (AdmissionInput::sink_bytes).
struct SinkQueueInput {
  std::size_t current = 0;     ///< its capacity now
  std::size_t memory = 0;      ///< the graph's share of the budget, in bytes (kUnlimited: none)
  std::size_t item_bytes = 0;  ///< its items (0: none measured yet)
  std::size_t claims = 0;      ///< its producers' claims at once (their concurrency)
  std::size_t ceiling = 1;     ///< its capacity as sized (GraphOptions::default_capacity)
};
/// The capacity for `in` (knob "capacity" of stage `sink`): a cut at once, a raise only when
/// it fits items an eighth larger than measured (item sizes vary from window to window), or
/// none (no budget, no item measured, no change).
///
///   autotune::SinkQueueInput in{.current = 32, .memory = 64 << 20, .item_bytes = 8 << 20,
///                               .claims = 2, .ceiling = 32};
///   auto e = autotune::pull_sink_capacity(in, "out", 0);
///   // e->to == 3: a quarter (16 MiB) holds 2 items of 8 MiB; 2 claims and one more fit half
std::optional<TuneEvent> pull_sink_capacity(const SinkQueueInput& in, const std::string& sink,
                                            std::int64_t at_ns);

/// What decides an automatic pinned ring's depth (GpuStageOptions::ring_bytes = automatic) at
/// the end of a run: what the run reserved in it, and whether the ring held the GPU stage back.
struct RingInput {
  std::string stage{};            ///< the GPU stage the ring feeds
  std::size_t capacity = 0;       ///< the ring's bytes in the run
  std::size_t item_bytes = 0;     ///< GpuStageOptions::ring_item_bytes (a producer's budget)
  std::size_t max_committed = 0;  ///< PinnedRing::Figures::max_committed over the run
  std::uint64_t refusals = 0;     ///< reservations the ring refused in the run
  std::int64_t wait_ns = 0;       ///< time producers waited for room
  std::int64_t starved_ns = 0;    ///< time the GPU stage waited for input (StageStats::starved_ns)
  std::int64_t wall_ns = 0;       ///< the run's length
  std::size_t ceiling = 0;        ///< the most it may hold (kMaxAutoRingBytes, or half the budget)
};
/// The ring's bytes for the next run, within [2 x item_bytes, ceiling] (the least a ring can
/// work with: one budget): doubled when the ring held the stage back (producers refused and
/// waiting at least 2% of the run while the GPU stage waited for input at least 5% of it),
/// otherwise cut to what the run committed at most plus a quarter, plus the item_bytes of room
/// a ring keeps (rounded up to a MiB) when that is at most three quarters of it. Returns the
/// decision (stage, knob "ring_bytes", from, to in bytes, its reason), none when it stays (or
/// nothing went through the ring).
///
///   autotune::RingInput in{.stage = "model", .capacity = 64 << 20, .item_bytes = 1 << 20,
///                          .max_committed = 3 << 20, .wall_ns = 1'000'000'000, .ceiling = 256 << 20};
///   auto e = autotune::ring_depth(in, 0);
///   // e->to == 5 << 20; e->text(): "model ring_bytes 64 MiB -> 5 MiB: the last run committed
///   //   at most 3 MiB of it (items of up to 1 MiB); no producer waited for room"
std::optional<TuneEvent> ring_depth(const RingInput& in, std::int64_t at_ns);

/// Where an automatic synchronous stage's bodies (Graph::stage with Concurrency::automatic, a
/// body Out(In)) run in the next graph of its name, decided at the end of a run from its
/// bodies' sampled times (at most a claim a millisecond measured with the thread's CPU clock and
/// /proc/thread-self/schedstat, as a blocking stage's bodies are): on the arena's threads, a
/// body that waits (reads, sleeps) holds one of them, so its concurrency stops at the cores; on
/// the runtime's blocking threads (StageOptions::blocking) it may go past them.
struct PlacementInput {
  std::string stage{};
  std::string graph{};
  bool blocking = false;      ///< its bodies ran on the runtime's blocking threads this run
  std::uint64_t samples = 0;  ///< bodies' claims measured (on blocking threads: items)
  std::int64_t wall_ns = 0;   ///< their wall time
  std::int64_t cpu_ns = 0;    ///< their CPU time
  std::int64_t wait_ns = 0;   ///< their time neither on a CPU nor runnable (wall less demand)
};
/// The fewest measured claims a placement is decided on.
inline constexpr std::uint64_t kMinPlacementSamples = 8;
/// Moves a stage on the arena to the blocking threads when its bodies waited at least twice as
/// long as they computed and at least half their time (at least kMinPlacementSamples claims
/// measured); moves one there back when they waited less than they computed (between the two
/// it stays: a body that waits and computes alike is not moved back and forth). Returns the
/// decision (knob "blocking", from and to 0 (arena) or 1 (blocking threads), its reason), none
/// when it stays.
///
///   autotune::PlacementInput in{.stage = "read", .graph = "io", .samples = 40,
///                               .wall_ns = 80'000'000, .cpu_ns = 2'000'000, .wait_ns = 77'000'000};
///   auto e = autotune::body_placement(in, 0);
///   // e->to == 1; e->text(): "read to the blocking threads: its bodies waited 96% of their
///   //   time without a CPU (40 claims measured: 2 ms CPU, 77 ms waiting), holding the arena's
///   //   threads; the next graph 'io' built runs them on the runtime's blocking threads, where
///   //   its concurrency may go past the cores (StageOptions::blocking sets it for good)"
std::optional<TuneEvent> body_placement(const PlacementInput& in, std::int64_t at_ns);

/// The result of one observe().
struct Decision {
  bool changed = false;          ///< the allocation differs from the one the window ran with
  Allocation allocation{};       ///< the settings to run the next window with
  std::vector<TuneEvent> events; ///< decided on this window
};

/// Per-window estimates of stage costs: sums over the windows since the last reset, and a drift
/// test of the last window against them.
class CostEstimator {
 public:
  explicit CostEstimator(double drift = 0.2) : drift_(drift) {}
  /// Adds a window. Returns the stages whose cost per item drifted (two windows running).
  std::vector<std::size_t> add(const Sample& s);
  /// True once every stage has finished an item.
  bool ready() const noexcept;
  /// The fewest items a stage finished in the windows the estimates are from.
  std::uint64_t min_items() const noexcept;
  /// The current estimates (visits from the items each stage processed per item delivered).
  std::vector<StageModel> models() const;
  /// Forgets all windows but the last two (after a drift: they measured the new cost).
  void restart();
  /// What the last add() found drifted, one per stage it returned: the cost per item of the
  /// older windows and of the last two (seconds), and what cost it is (a GPU stage's device
  /// time, a stage holding the shared lock most of its time: its holds; else its time).
  struct Drift {
    std::size_t stage = 0;
    double from_s = 0, to_s = 0;
    bool gpu = false, serial = false;
  };
  const std::vector<Drift>& drifts() const noexcept { return drifts_; }

 private:
  struct Raw {
    double items = 0, work = 0, cpu = 0, gpu = 0;  // cpu < 0: unknown
    double serial = 0;  // the shared lock's holds (at most the window, all stages together)
    // Windows it ran with concurrency 1 in: its work and items there (a stage holding the
    // shared lock: its bodies' time per item without their waits for each other's holds).
    double solo_work = 0, solo_items = 0;
    // Windows whose holds added up to more than the window (scaled down to it): the lock was
    // busy throughout at most, a bound rather than a measure of a stage's holds.
    double saturated = 0;
    // Windows in which this stage's own holds passed the window by a tenth: its bodies held
    // "it" at once, so they release it (numpy, torch): no bound of the lock's on it.
    double released = 0;
    /// Windows summed: every figure adds up; the CPU time stays unknown if one was.
    Raw& operator+=(const Raw& o) noexcept;
  };
  struct Window {
    double delivered = 0;
    double length = 0, serial_others = 0;  // ns
    std::vector<Raw> stages;
  };
  double drift_;
  std::vector<StageSample> shape_;  // names, kinds and limits of the last sample
  std::vector<Window> history_;     // the windows since the last restart (30 at most)
  std::vector<int> drifting_;
  std::vector<Drift> drifts_;
};

/// The online tuner of one graph: observe() once per window with what the window measured;
/// apply the returned allocation. Deterministic: the same samples give the same decisions.
class Autotuner {
 public:
  explicit Autotuner(PolicyOptions options = {}, Budget budget = {});

  /// Takes one window's figures and returns what to run the next window with.
  Decision observe(const Sample& sample);
  /// A new share of a shared budget (split_budget); the next observe() re-tunes if it changed.
  void set_budget(const Budget& budget);
  const Budget& budget() const noexcept { return budget_; }
  /// Every event so far, in order.
  const std::vector<TuneEvent>& events() const noexcept { return events_; }
  /// The allocation in force (empty until the first observe() with every stage measured).
  const Allocation& allocation() const noexcept { return alloc_; }
  /// The current cost model (empty until measured).
  const std::vector<StageModel>& models() const noexcept { return models_; }
  /// The bound of the current model and budget.
  const Bound& bound() const noexcept { return bound_; }
  /// What this graph asks of a shared budget (split_budget), with `priority`: the cores its
  /// model's allocation holds, or, while its consumer (a pull sink's reader, a sink) held its
  /// stages back half of each of the last two windows or more, the CPU the rates it delivered
  /// need (the higher, a quarter more): a graph whose reader stalls asks for none. (Without the
  /// cores of the stages the tuner does not model: the runtime adds those.)
  GraphDemand demand(int priority = 0) const;
  /// True when the hill climb has no move left (until a drift, a budget change or a rate drop).
  bool converged() const noexcept { return phase_ == Phase::converged; }

 private:
  enum class Phase { warmup, settle, baseline, trial, converged };
  struct Move {
    std::string key;       // tabu key
    bool release = false;  // judged by "held", not "improved"
    double min_gain = 0;   // the gain it needs at least (beyond the noise)
    std::vector<TuneEvent> changes;
  };
  void retune(const Sample& s, Action action, std::string reason, Decision& d);
  std::optional<Move> propose(const Sample& s);
  void apply(const Move& m);
  void emit(Decision& d, TuneEvent e);
  double gpu_busy(const Sample& s) const;
  double noise() const;

  PolicyOptions opt_;
  Budget budget_;
  bool budget_changed_ = false;
  bool refined_ = false;  // the model is from min_items per stage
  bool short_of_cores_ = false;  // the last climb step wanted a core the budget lacked
  double paced_cores_ = -1;  // the CPU the last two windows' rates need, when their consumer paced both (-1: not)
  double paced_last_ = -1;   // the last window's (-1: its consumer did not pace it)
  Budget old_budget_;
  CostEstimator est_;
  std::vector<StageModel> models_;
  Bound bound_;
  Allocation alloc_, base_;
  Phase phase_ = Phase::warmup;
  int settle_left_ = 0;
  double base_rate_ = 0, base_busy_ = 0;
  double converged_rate_ = 0;
  double noise_ewma_ = 0;
  double prev_rate_ = -1;  // the previous window's rate, same allocation
  int low_windows_ = 0;
  std::optional<Move> trial_;
  std::vector<std::string> tabu_;
  std::vector<TuneEvent> events_;
};

}  // namespace splitflow::autotune
