// Policies for runtimes, graphs and stages, in one place (the DALI way: small enums, one Config).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>

namespace splitflow {

class Observer;

/// How many invocations of one stage may run at the same time. 0 means unlimited, as in Python.
struct Concurrency {
  static constexpr std::size_t serial = 1;
  static constexpr std::size_t unlimited = std::numeric_limits<std::size_t>::max();
  /// Set by the graph's tuner while it runs (docs/autotune.md): CPU stages (Graph::stage) and
  /// GPU stages (Graph::gpu_stage's bursts in flight, from the graph's device time; at most
  /// the device's streams). The stage starts at 1; every GraphOptions::autotune_window the tuner measures the
  /// stages and moves the concurrencies toward the rate its model says the cores allow.
  /// \code
  ///   auto decode = g.stage("decode", decode_fn, {.concurrency = splitflow::Concurrency::automatic});
  /// \endcode
  static constexpr std::size_t automatic = std::numeric_limits<std::size_t>::max() - 1;
};

/// Whether a stage's outputs leave it in the order its inputs arrived.
enum class Order {
  in_order,      ///< output order equals input order, even with concurrency > 1
  out_of_order,  ///< outputs leave as invocations finish (no reorder buffer)
};

/// What a stage does when its body throws on an item.
enum class OnError {
  fail,        ///< fail the run with a StageError naming the stage and the item (default)
  skip,        ///< drop the item, count it and keep its message in the stats; the run goes on
  substitute,  ///< emit the stage's substitute value instead (Stage::substitute_on_error)
};

/// Per-stage policy. `capacity` bounds the stage's input queue in items, counting items queued
/// and slots reserved by producers whose bodies are still running; 0 means the graph's default
/// (times the number of producers, for a stage that merges several).
struct StageOptions {
  std::size_t concurrency = Concurrency::serial;
  Order order = Order::in_order;
  std::size_t capacity = 0;
  OnError on_error = OnError::fail;
  /// Graph::stage only: the body waits rather than computes (a read from a slow file system or
  /// an object store, a blocking client's call). It runs on the runtime's blocking threads
  /// (RuntimeConfig::blocking_threads), not on the arena's, so `concurrency` may go past the
  /// cores (with Concurrency::automatic the tuner takes it there when the body's measured CPU
  /// is a small part of its time) and no arena thread is held while it waits. Its CPU time is
  /// measured (StageStats::call_ns). Order, errors, skips and cancels as for any stage: a
  /// cancelled run ends once its bodies executing returned (one not begun is not run). An automatic
  /// stage without it whose bodies a run found waiting runs there in the next graph of its
  /// graph's name (docs/autotune.md, "Placement"); set it where the body always waits.
  /// \code
  ///   auto read = g.stage("read", [](std::string path) { return slurp(path); },
  ///                       {.concurrency = splitflow::Concurrency::automatic, .blocking = true});
  /// \endcode
  bool blocking = false;
};

/// Per-batch-node policy (Graph::batch).
struct BatchOptions {
  /// A last batch smaller than the batch size (at the end of the input) is dropped rather than
  /// emitted; its items count as consumed.
  bool drop_last = false;
  /// Input queue capacity in items; raised to the batch size if smaller. 0: the larger of the
  /// graph's default and the batch size.
  std::size_t capacity = 0;
};

/// The longest GraphOptions::autotune_window a Graph takes.
inline constexpr std::chrono::milliseconds kMaxAutotuneWindow = std::chrono::hours(1);

/// Per-graph policy.
struct GraphOptions {
  /// Items admitted by the sources and not yet consumed by a sink (like oneTBB's
  /// max_number_of_live_tokens). A fan-out copy counts as one more item, from when it is made:
  /// the sources admit again only once the count is back under the limit, but the copies of
  /// items already admitted are made and counted past it, so behind a fan-out to k consumers up
  /// to k times max_in_flight items may be alive (while a fan-out copies, the item and its
  /// copies are alive at once: one object more than counted); a batch formed of
  /// items counts as one from then on (its items are not counted apart: behind a batch of n,
  /// up to about n times as many source items may be alive: docs/autotune.md, "Memory").
  std::size_t max_in_flight = 256;
  /// Input queue capacity of stages that do not set their own, in source items: a queue of
  /// batches of n holds default_capacity / n of them (a queue of 64-image batches, 2 rather than
  /// 32 batches, so that memory does not grow with the item size), times its producers for a
  /// merge, and never fewer than the claims its producers can have out (at least 2; at most
  /// what the default gives without batches).
  std::size_t default_capacity = 32;
  /// Receives every invocation, lease, device op and tuner decision of the graph's runs
  /// (see telemetry.hpp).
  std::shared_ptr<Observer> observer = nullptr;
  /// Stream-lease priority of the graph's GPU stages: waiting invocations of a higher priority
  /// are granted a stream before lower ones (first come, first served within a priority), so a
  /// latency-critical model's bursts do not queue behind a batch job's.
  int priority = 0;
  /// Record a Chrome trace of each run (Run::trace_json()). Memory is bounded by
  /// trace_max_events: past it, invocations are sampled (the trace states the rate).
  bool trace = false;
  std::size_t trace_max_events = std::size_t{1} << 18;
  /// Stages with Concurrency::automatic: how often the tuner measures and decides (1 ms to
  /// kMaxAutotuneWindow), and the cores their bodies may hold at once (0: the runtime's
  /// threads; finite, not negative; the tuner counts whole cores, at least one: 0.5 is 1, 2.4
  /// is 2). The Graph refuses others, naming them.
  std::chrono::milliseconds autotune_window{250};
  double autotune_cores = 0;
  /// The tuner sizes the input queues of automatic CPU stages whose capacity is not set (fed
  /// by 1:1 producers, batches or dynamic batches), between 1 and max_in_flight; false: they
  /// keep default_capacity. (Under RuntimeConfig::host_memory_budget a tuned graph's one pull
  /// sink whose capacity is not set is sized by bytes whatever this says: docs/autotune.md.)
  bool autotune_queues = true;
};

/// What submit() does when max_pending requests are already waiting for answers.
enum class Admission {
  wait,       ///< block until one is answered (a request with a deadline: until its deadline, then DeadlineError)
  fail_fast,  ///< throw OverloadedError at once
};

struct ServiceOptions {
  /// Requests admitted and not yet answered, at most (the service's bound on memory and
  /// queueing delay).
  std::size_t max_pending = 64;
  Admission admission = Admission::wait;
};

/// Which device backend GPU stages use (to_string: "automatic", "cuda", "host").
enum class BackendKind {
  automatic,  ///< CUDA when built with it and a device is present, otherwise host
  cuda,       ///< CUDA; fails (at the first GPU stage's run) if there is no device
  host,       ///< GPU-stage work on host threads in stream order (always available)
};
const char* to_string(BackendKind k) noexcept;

/// Faults injected into the device layer's work, for soaks and fault-tolerance tests (off by
/// default). Each is drawn per event with its probability from a generator seeded by `seed`, on
/// any backend: an allocation failure makes DeviceContext::alloc throw; a failed burst fails
/// its item as a kernel error would (the stage's on_error applies); a slow kernel adds `slow_by`
/// of device time to a burst; a stall holds the burst's stream for `stall_for`. The counts are
/// in DeviceStats::injected.
/// \code
///   splitflow::RuntimeConfig c;
///   c.device.backend = splitflow::BackendKind::host;
///   c.device.faults = {.burst_failure = 0.01, .slow_kernel = 0.05};
///   splitflow::Runtime rt(c);
/// \endcode
struct DeviceFaults {
  double alloc_failure = 0;  ///< probability per device allocation
  double burst_failure = 0;  ///< probability per burst
  double slow_kernel = 0;    ///< probability per burst
  std::chrono::nanoseconds slow_by = std::chrono::milliseconds(5);
  double stall = 0;          ///< probability per burst
  std::chrono::nanoseconds stall_for = std::chrono::milliseconds(100);
  std::uint64_t seed = 1;
  bool any() const noexcept {
    return alloc_failure > 0 || burst_failure > 0 || slow_kernel > 0 || stall > 0;
  }
};

/// Sharing one device between processes (docs/sharing.md): every splitflow process on the
/// machine whose runtime names the same arbiter takes its stream leases (one per kernel burst)
/// through one shared-memory segment, /dev/shm/splitflow-arb-NAME: at most `capacity` bursts on
/// the device at once across the processes, served first come, first served within a priority
/// (GraphOptions::priority, highest first), each process at most `share` of the capacity.
/// A process that dies holding leases has them reclaimed within `liveness` (plus the time to
/// read the process table). Off by default (empty name): nothing changes for one process.
/// \code
///   splitflow::RuntimeConfig c;
///   c.device.arbiter = {.name = "gpu0", .capacity = 4, .share = 0.5};
///   splitflow::Runtime rt(c);   // joins (or creates) /dev/shm/splitflow-arb-gpu0 at the first GPU run
/// \endcode
struct ArbiterConfig {
  /// Letters, digits, '_', '-', '.' (at most 64); empty: no arbiter.
  std::string name;
  /// Bursts on the device at once, across processes (1..64). Set by the process that creates
  /// the segment; 0 in a joining process means "whatever it is", any other value must match.
  /// 0 in the creator means DeviceConfig::streams.
  std::size_t capacity = 0;
  /// This process's cap, as a share of `capacity` (at least one burst, at most its own streams).
  double share = 1.0;
  /// Empty: the segment is private to the user who created it (mode 0600), and a process of
  /// another user is refused. A group name: mode 0660 and owned by that group, so its members'
  /// processes may join.
  std::string group;
  /// How often a process checks that the others are alive (and reclaims the leases of the dead).
  std::chrono::milliseconds liveness{50};
  /// This process's name in the meter (splitflow-top); empty: the program's name.
  std::string label;
  bool enabled() const noexcept { return !name.empty(); }
};

/// The device a runtime's GPU stages share. Nothing here touches the CUDA runtime until a graph
/// with a GPU stage first runs (a CPU-only process never initialises CUDA).
struct DeviceConfig {
  BackendKind backend = BackendKind::automatic;
  int ordinal = 0;                                   ///< CUDA device index
  std::size_t streams = 8;                           ///< StreamPool size, shared by all graphs
  std::size_t device_pool_bytes = std::size_t{2} << 30;  ///< cap of device allocations
  std::size_t pinned_pool_bytes = std::size_t{1} << 30;  ///< cap of pinned host memory (rings too)
  int host_compute_slots = 1;  ///< host backend: kernels running at once (like one full-size kernel)
  DeviceFaults faults{};       ///< injected faults (none by default)
  ArbiterConfig arbiter{};     ///< sharing the device with other processes (off by default)
};

/// Per-runtime policy.
struct RuntimeConfig {
  /// Threads of the runtime's task arena; 0 means one per core. At most kMaxThreads.
  int threads = 0;
  static constexpr int kMaxThreads = 1024;
  /// Per-stage timing (busy / starved / blocked, work time). Item counters are always kept.
  bool telemetry = true;
  /// Host bytes the items of this runtime's tuned graphs (those with Concurrency::automatic
  /// stages) may hold at once: queued, in bodies, in pinned rings. 0: no budget. The tuner
  /// keeps the queues it sizes (GraphOptions::autotune_queues), and the concurrencies it sets,
  /// within it, from what each queue's items hold (StageStats::item_bytes, sampled); what the
  /// stages it does not tune hold (a capacity or concurrency their user set, rings) is taken
  /// off first. Graphs tuned at once share it by demand and priority, as they share the threads.
  /// Needs telemetry (the item sizes are sampled with it).
  /// \code
  ///   splitflow::RuntimeConfig c;
  ///   c.host_memory_budget = std::size_t{2} << 30;   // the tuned graphs' items: 2 GiB at most
  ///   splitflow::Runtime rt(c);
  /// \endcode
  std::size_t host_memory_budget = 0;
  /// Threads for blocking stages (StageOptions::blocking), started as they are needed: at most
  /// this many bodies of blocking stages wait at once; more wait for one of them.
  std::size_t blocking_threads = 64;
  DeviceConfig device{};
};

/// Per-GPU-stage policy. Each invocation holds one pooled stream for its kernel burst only.
struct GpuStageOptions {
  /// For ring_bytes: sized by the runtime (the default).
  static constexpr std::size_t automatic = Concurrency::automatic;
  /// An automatic ring's first size, and the most it grows to without a memory budget.
  static constexpr std::size_t kDefaultRingBytes = std::size_t{64} << 20;
  static constexpr std::size_t kMaxAutoRingBytes = std::size_t{256} << 20;
  /// Bursts of this stage in flight at once (each holds a stream while it runs);
  /// Concurrency::automatic: set by the graph's tuner.
  std::size_t concurrency = 2;
  Order order = Order::in_order;
  /// Input queue capacity in items; 0 means the graph's default.
  std::size_t capacity = 0;
  /// What the stage does when its body throws, or its burst's device work fails, on an item
  /// (as for CPU stages; OnError::substitute needs GpuStage::substitute_on_error).
  OnError on_error = OnError::fail;
  /// Pinned ring between a CPU producer of HostTensor and this stage (input DeviceTensor): total
  /// bytes, and the largest item. The H2D copy runs on this stage's leased stream.
  /// GpuStageOptions::automatic (the default): the runtime sizes it. The first run of a graph of
  /// this name allocates kDefaultRingBytes (under RuntimeConfig::host_memory_budget a quarter of
  /// the budget, within [2 x ring_item_bytes, kDefaultRingBytes]); at the end of each run the
  /// ring's depth is decided from what the run reserved in it (docs/autotune.md "Ring depths")
  /// and the next run allocates that, within [2 x ring_item_bytes, kMaxAutoRingBytes] (under a
  /// budget: half of it at most; never over a quarter of DeviceConfig::pinned_pool_bytes). A
  /// number set here is the ring's size, always.
  /// \code
  ///   splitflow::GpuStageOptions o;                   // ring_bytes: automatic
  ///   o.ring_item_bytes = 1 << 20;                     // items of up to 1 MiB
  ///   auto model = g.gpu_stage("model", model_fn, o);  // run 1: 64 MiB; after it, what it needed
  /// \endcode
  std::size_t ring_bytes = automatic;
  std::size_t ring_item_bytes = std::size_t{16} << 20;
  /// Pinned ring for DeviceContext::to_host() (D2H); 0 = allocate from the pinned pool instead.
  /// A HostTensor output made elsewhere is copied into it; one over out_ring_item_bytes is the
  /// stage's failing item, under its OnError.
  std::size_t out_ring_bytes = 0;
  std::size_t out_ring_item_bytes = 0;
};

}  // namespace splitflow
