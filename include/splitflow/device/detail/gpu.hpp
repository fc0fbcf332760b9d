// What a GPU-stage node needs from the device layer (implemented in lib/device/): stream
// leases, bursts, pinned rings. Kept free of CUDA and oneTBB headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "splitflow/core/config.hpp"
#include "splitflow/core/tensor.hpp"
#include "splitflow/telemetry/telemetry.hpp"

namespace splitflow::detail {

class DeviceRuntime;
class GpuAccount;
class ExecutionSink;
class PinnedRing;
struct Lease;
struct Stream;

/// Something waiting for a stream. The pool calls grant() once: with a lease when one frees
/// (first come, first served across every graph of the runtime), or with nullptr when the wait
/// is withdrawn (the run was cancelled). grant() runs on whatever thread freed the stream: it
/// must only hand the work to the arena.
class LeaseWaiter {
 public:
  virtual ~LeaseWaiter() = default;
  virtual void grant(Lease* lease) = 0;
  const void* owner = nullptr;  ///< for withdraw(): the node that waits
  int priority = 0;             ///< its graph's GraphOptions::priority (served highest first)
  std::int64_t since_ns = 0;
};

/// Who hears a burst's lease and device-op events: its graph's name and observers (the
/// executor's; the device layer only reads them).
struct BurstObservers {
  const std::string* graph = nullptr;
  const std::vector<Observer*>* observers = nullptr;
  bool any() const noexcept { return observers && !observers->empty(); }
  template <class F>
  void each(F&& f) const {
    for (Observer* o : *observers) f(*o);
  }
};

/// One GPU-stage invocation: a lease held for one kernel burst. The body enqueues work through
/// a DeviceContext on it; end() hands the completion to `done`.
class Burst {
 public:
  /// `observers` receive the lease and device-op events (none: BurstObservers{}).
  Burst(DeviceRuntime& dev, Lease* lease, GpuAccount* account, BurstObservers observers,
        const std::string& stage, std::uint64_t item);
  ~Burst();
  Burst(const Burst&) = delete;
  Burst& operator=(const Burst&) = delete;

  DeviceRuntime& device() const noexcept { return *dev_; }
  Stream* stream() const noexcept;
  const std::string& stage() const noexcept { return *stage_; }
  std::uint64_t item() const noexcept { return item_; }
  GpuAccount* account() const noexcept { return account_; }

  /// Marks the start of the work (called before the body).
  void begin();
  /// Marks the end; when the stream's work is done the lease returns to the pool and `done`
  /// runs (on a backend thread: it must only hand work to the arena). `body_failed`: the body
  /// threw (its item failed already: no fault is injected into its burst).
  void end(std::function<void()> done, bool body_failed = false);
  /// After done, on an arena thread: accounts the burst's execution time.
  void settle() noexcept;
  /// An error raised by work that ran on the device for this burst (host kernels), if any.
  std::exception_ptr device_error() const;
  void set_device_error(std::exception_ptr e);
  /// Keeps `keep` alive until the burst's work completed (sources of async copies).
  void keep_alive(std::shared_ptr<void> keep);
  /// The stage's output ring: one to_host() per invocation is placed there.
  void set_output_ring(PinnedRing* ring) noexcept { out_ring_ = ring; }
  PinnedRing* take_output_ring() noexcept { return std::exchange(out_ring_, nullptr); }
  /// Where the backend reports this burst's executions (lib-internal type).
  ExecutionSink* exec_sink() const noexcept;

  class Sink;  // the burst's ExecutionSink (lib)

 private:
  DeviceRuntime* dev_;
  Lease* lease_;
  GpuAccount* account_;
  BurstObservers observers_;
  const std::string* stage_;
  std::uint64_t item_;
  void* timer_ = nullptr;
  std::unique_ptr<Sink> sink_;
  mutable std::mutex mu_;
  std::exception_ptr device_error_;
  std::vector<std::shared_ptr<void>> keep_;
  PinnedRing* out_ring_ = nullptr;
};

/// Wakes a node when ring space frees; outlives the node safely (the node detaches itself).
/// notify() may run anywhere (a device callback, a thread destroying a tensor while holding a
/// node's lock): `fn` must only hand the wake-up to the arena, never lock a node itself.
struct SpaceNotifier {
  std::mutex mu;
  std::function<void()> fn;  // empty once detached
  void notify() {
    std::lock_guard lk(mu);
    if (fn) fn();
  }
  void detach() {
    std::lock_guard lk(mu);
    fn = nullptr;
  }
};

/// A bounded region of pinned host memory between a CPU producer and a GPU consumer (or a GPU
/// stage and its CPU consumers). Items are contiguous blocks of variable size; the ring wraps
/// around. A producer reserves a budget of `item_bytes` per item before its body runs (the slot
/// protocol does it), so its body's allocation always fits: with C bytes of counted blocks
/// (pushed, or freed before being pushed, and not yet reclaimed) and B budgets, reservations
/// keep C + B * item_bytes <= capacity - item_bytes, which leaves a contiguous item_bytes even
/// when the free space is split at the wrap point. A block returns when its last tensor is gone
/// (after the H2D copy ran, or when the consumer dropped it) and the tail passes it. Tensors keep
/// the ring alive.
class PinnedRing : public std::enable_shared_from_this<PinnedRing> {
 public:
  /// Which side of its GPU stage `owner` the ring is on: its input ring (host to device:
  /// GpuStageOptions::ring_bytes) or its output ring (device to host: out_ring_bytes). Only
  /// the errors' words differ: what they name and the option they say to raise.
  enum class Side { input, output };
  PinnedRing(std::shared_ptr<DeviceRuntime> dev, std::string owner, std::size_t bytes,
             std::size_t item_bytes, Side side = Side::input);
  ~PinnedRing();
  PinnedRing(const PinnedRing&) = delete;
  PinnedRing& operator=(const PinnedRing&) = delete;

  /// Budgets for up to `want` items; returns how many (0 when full: the notifier fires when
  /// space frees).
  std::size_t try_reserve(std::size_t want);
  /// Budgets given back (no item was pushed for them).
  void release(std::size_t n);
  /// A tensor in the ring, for an item holding a budget. Throws Error (naming stage and item)
  /// if it is larger than item_bytes.
  HostTensor allocate(DType dtype, std::vector<std::int64_t> shape, const std::string& stage,
                      std::uint64_t item);
  /// The item holding a budget is pushed: returns it in ring memory (copying it there if it
  /// was not allocated from this ring; `staged` tells) and releases the budget.
  HostTensor push(HostTensor t, bool& staged, const std::string& stage, std::uint64_t item);
  /// Throws the Error push() would for `t` (a non-contiguous tensor, one larger than
  /// item_bytes), naming `stage` (its producer) and the item: producers call it in their body's
  /// scope, so that their OnError applies to it (a tensor of this ring always passes).
  void check_item(const HostTensor& t, const std::string& stage, std::uint64_t item) const;
  void set_notifier(std::shared_ptr<SpaceNotifier> n);

  std::size_t capacity() const noexcept { return capacity_; }
  std::size_t item_bytes() const noexcept { return item_bytes_; }
  /// Bytes between tail and head: live blocks, freed blocks not yet reclaimed, the wrap waste.
  std::size_t bytes_in_use() const;
  std::size_t budgets() const;
  std::uint64_t wraps() const;
  /// Occupancy figures since the ring was made or reset_figures() (time-weighted mean in bytes,
  /// maximum), reservations refused for lack of space, the time producers waited for space,
  /// and the most bytes committed at once (blocks counted plus budgets x item_bytes: the room
  /// a ring needs, less item_bytes, so as to refuse none of those reservations).
  struct Figures {
    std::size_t max_in_use;
    double mean_in_use;
    std::uint64_t refusals;
    std::int64_t wait_ns;
    std::size_t max_committed = 0;
  };
  Figures figures() const;
  /// Starts the figures afresh (a run starts: its figures are its own).
  void reset_figures();

  struct Block;
  /// Called when the last tensor of a block is gone.
  void free_block(Block* b) noexcept;

 private:
  std::size_t alloc_offset_locked(std::size_t size);
  void notify_if_waiting_locked(std::shared_ptr<SpaceNotifier>& out);

  std::shared_ptr<DeviceRuntime> dev_;
  std::string owner_;
  Side side_;
  std::size_t capacity_;
  std::size_t item_bytes_;
  unsigned char* base_ = nullptr;
  mutable std::mutex mu_;
  std::size_t head_ = 0, tail_ = 0;  // next allocation at head; oldest live block at tail
  std::size_t used_ = 0;             // bytes between tail and head
  std::size_t counted_ = 0;          // see the class comment
  std::size_t budget_items_ = 0;
  std::uint64_t wraps_ = 0;
  std::size_t max_used_ = 0;
  std::size_t max_committed_ = 0;
  void committed_changed_locked() noexcept;  // call after counted_ or budget_items_ grew
  double used_area_ = 0;  // bytes x ns
  std::int64_t created_ns_ = 0, used_since_ = 0, waiting_since_ = 0, wait_ns_ = 0;
  std::uint64_t refusals_ = 0;
  void used_changed_locked() noexcept;  // call before used_ changes
  std::deque<Block*> blocks_;                        // in allocation order
  std::unordered_map<const void*, Block*> unpushed_;  // allocated, not pushed yet
  bool waiting_ = false;
  std::shared_ptr<SpaceNotifier> notifier_;
};

/// Names the GPU stage the current thread works for (CUDA errors mention it).
void set_current_stage(const std::string* stage) noexcept;
/// A stream now, or nullptr: then `w` is granted one later (or withdrawn).
Lease* lease_or_wait(DeviceRuntime& dev, LeaseWaiter& w);
/// Withdraws every waiter of `owner` (each is granted nullptr).
void withdraw_waiters(DeviceRuntime& dev, const void* owner);
BackendKind backend_of(const DeviceRuntime& dev) noexcept;
/// An invocation waited `ns` for its stream.
void account_waited(GpuAccount* a, std::int64_t ns) noexcept;
/// A host tensor was copied into a ring because it was not written there.
void account_staged(GpuAccount* a) noexcept;

}  // namespace splitflow::detail
