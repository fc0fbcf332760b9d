// DeviceRuntime: one per Runtime, created when a graph with a GPU stage first runs. Owns the
// backend, the StreamPool shared by every graph, and the capped device and pinned pools.
// GpuAccount: one graph's GPU figures (held, busy, copies). Internal to the library.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "arbiter.hpp"
#include "backend.hpp"
#include "splitflow/core/detail/splitmix.hpp"
#include "splitflow/device/detail/gpu.hpp"
#include "splitflow/device/device.hpp"

namespace splitflow::detail {

struct Lease {
  Stream* stream;
  int index;  // in the pool
  std::int64_t since_ns = 0;
  GpuAccount* account = nullptr;
};

/// The pool of streams shared by all graphs of a runtime. A lease lasts one kernel burst.
/// Waiters are served first come, first served (within a priority class, highest first), so a
/// light graph waits at most for the bursts ahead of it, whatever a greedy graph does.
class StreamPool {
 public:
  StreamPool(DeviceBackend& backend, std::size_t size);
  ~StreamPool();

  Lease* acquire_or_wait(LeaseWaiter& w);
  /// Returns the lease's stream (the burst's work is done). Hands it to the first waiter.
  void release(Lease* lease) noexcept;
  void withdraw(const void* owner) noexcept;

  /// Takes every lease through the cross-process arbiter from now on (DeviceConfig::arbiter):
  /// a lease needs one of the arbiter's tokens, and waiters queue there, across processes.
  /// Call before the first lease. `busy_ns` is what this process publishes as its busy time.
  /// `compute_slots`: the modelled device's kernels at once (host backend), if this process
  /// creates the arbiter; the host backend's kernels then take their place through it.
  void join_arbiter(const ArbiterConfig& config, std::size_t compute_slots,
                    std::function<std::int64_t()> busy_ns,
                    std::function<std::vector<PublishedGraph>()> graphs = {});
  const Arbiter* arbiter() const noexcept { return arb_.get(); }

  std::size_t size() const noexcept { return leases_.size(); }
  std::size_t in_use() const;
  std::size_t max_in_use() const;
  std::size_t waiters() const;
  std::uint64_t leases() const;
  std::int64_t lease_ns() const;
  /// Time with at least one lease out.
  std::int64_t held_ns() const;

 private:
  DeviceBackend& backend_;
  std::vector<std::unique_ptr<Lease>> leases_;
  mutable std::mutex mu_;
  std::vector<Lease*> free_;
  std::deque<LeaseWaiter*> waiting_;
  std::size_t in_use_ = 0, max_in_use_ = 0;
  std::uint64_t count_ = 0;
  std::int64_t lease_ns_ = 0;
  std::int64_t held_ns_ = 0, held_since_ = 0;
  std::vector<std::int64_t> lease_time_;  // time with k leases out
  std::int64_t changed_ns_ = 0;
  void count_time_locked(std::int64_t now) noexcept;
  // With an arbiter: waiters holding a ticket there (ticket, waiter), and the helpers that turn
  // its grants into leases. Grants collected here are handed out after mu_ is let go.
  using Grants = std::vector<std::pair<LeaseWaiter*, Lease*>>;
  Lease* take_free_locked(std::int64_t now, int priority) noexcept;
  void deliver_locked(std::vector<std::uint64_t> tickets, Grants& grants) noexcept;
  void promote_locked(Grants& grants) noexcept;
  void on_granted(const std::vector<std::uint64_t>& tickets) noexcept;
  std::vector<std::pair<std::uint64_t, LeaseWaiter*>> ticketed_;
  std::unique_ptr<Arbiter> arb_;  // last: its pump thread stops before the rest goes
 public:
  /// time_with[k]: time with exactly k leases out, up to now.
  std::vector<std::int64_t> lease_time() const;
};

/// Bytes against a cap: device memory, pinned memory.
class CappedBytes {
 public:
  CappedBytes(const char* what, std::size_t cap) : what_(what), cap_(cap) {}
  /// Throws Error naming the stage and item when the cap would be exceeded.
  void take(std::size_t n, const std::string& stage, std::uint64_t item);
  void give(std::size_t n) noexcept { used_.fetch_sub(n, std::memory_order_relaxed); }
  std::size_t used() const noexcept { return used_.load(std::memory_order_relaxed); }
  std::size_t cap() const noexcept { return cap_; }

 private:
  const char* what_;
  std::size_t cap_;
  std::atomic<std::size_t> used_{0};
};

/// DeviceConfig::faults, drawn per event from one seeded generator (any thread), with counts.
class FaultInjector {
 public:
  explicit FaultInjector(const DeviceFaults& f) : f_(f), rng_(f.seed) {}
  bool active() const noexcept { return active_; }
  /// Throws Error when an allocation failure is drawn.
  void on_alloc(std::size_t bytes, const std::string& stage, std::uint64_t item);
  /// Before the burst's end: may add a slow kernel or a stall to its stream, or fail it.
  void on_burst_end(Burst& b);
  DeviceStats::Injected counts() const noexcept;

 private:
  bool draw(double p) noexcept;
  const DeviceFaults f_;
  const bool active_ = f_.any();
  std::mutex mu_;
  SplitMix64 rng_;  // under mu_
  std::atomic<std::uint64_t> alloc_{0}, burst_{0}, slow_{0}, stall_{0};
};

class DeviceRuntime : public std::enable_shared_from_this<DeviceRuntime> {
 public:
  DeviceRuntime(std::unique_ptr<DeviceBackend> backend, const DeviceConfig& config);
  ~DeviceRuntime();

  DeviceBackend& backend() noexcept { return *backend_; }
  StreamPool& pool() noexcept { return pool_; }
  CappedBytes& device_bytes() noexcept { return device_bytes_; }
  CappedBytes& pinned_bytes() noexcept { return pinned_bytes_; }
  FaultInjector& faults() noexcept { return faults_; }

  /// Device memory in stream order on `s`, freed with the tensor.
  DeviceTensor alloc(DType dtype, std::vector<std::int64_t> shape, Stream* s,
                     const std::string& stage, std::uint64_t item);
  /// Pinned host memory from the pool.
  HostTensor alloc_pinned(DType dtype, std::vector<std::int64_t> shape, const std::string& stage,
                          std::uint64_t item);

  DeviceStats stats() const;

  /// The graphs whose figures a process publishes in its arbiter (splitflow-top): the executor
  /// tracks a graph's GpuAccount while the graph lives; an untracked graph's last figures are
  /// kept (the last 16).
  void track(const GpuAccount* account, std::string graph, int priority);
  void untrack(const GpuAccount* account) noexcept;
  std::vector<PublishedGraph> graph_figures() const;

  /// Frees device or pinned memory now, or later (on an arena thread) when called from a
  /// device callback, which must not call the CUDA runtime. Device memory that other streams
  /// used (`users`, DeviceTensor::record_stream) is freed in their order, not only ours.
  void free(void* p, std::size_t bytes, bool pinned, std::vector<void*> users = {}) noexcept;
  void drain_deferred() noexcept;

 private:
  struct Deferred {
    void* p;
    std::size_t bytes;
    bool pinned;
    std::vector<void*> users;
  };
  void free_now(const Deferred& d) noexcept;
  std::mutex deferred_mu_;
  std::vector<Deferred> deferred_;
  // (before pool_: the arbiter's pump reads them until the pool is gone)
  struct Tracked {
    const GpuAccount* account;
    std::string graph;
    int priority;
  };
  mutable std::mutex tracked_mu_;
  std::vector<Tracked> tracked_;
  std::deque<PublishedGraph> finished_;  // the last figures of untracked graphs
  std::unique_ptr<DeviceBackend> backend_;
  StreamPool pool_;
  CappedBytes device_bytes_;
  CappedBytes pinned_bytes_;
  FaultInjector faults_;
  std::int64_t start_ns_;
};

/// One graph's GPU accounting. Held is the union of its lease intervals; busy the union of the
/// execution intervals of its kernels and copies (exact on the host backend, where every op
/// reports as it runs; from burst events on CUDA).
class GpuAccount {
 public:
  void lease_begin(std::int64_t t) noexcept;
  void lease_end(std::int64_t t) noexcept;
  void exec_begin(std::int64_t t) noexcept;
  void exec_end(std::int64_t t) noexcept;
  void exec_interval(std::int64_t t0, std::int64_t t1) noexcept;
  void copied(bool h2d, std::size_t bytes, std::int64_t ns) noexcept;
  void waited(std::int64_t ns) noexcept;
  void staged() noexcept;
  void burst() noexcept;
  void reset() noexcept;
  /// Figures up to `now` (open intervals counted up to it).
  GpuStats snapshot(std::int64_t now) const;

 private:
  mutable std::mutex mu_;
  int leases_ = 0, execs_ = 0;
  std::int64_t held_since_ = 0, exec_since_ = 0, watermark_ = 0;
  GpuStats s_;
};

}  // namespace splitflow::detail
