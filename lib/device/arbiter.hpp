// Arbiter: this process's membership of a cross-process lease arbiter (DeviceConfig::arbiter).
// Internal to the device layer; the StreamPool asks it for a token before it leases a stream.
//
// The segment (/dev/shm/splitflow-arb-NAME) holds a robust, process-shared mutex, a table of
// process slots and a table of tickets (queued requests). A token is the right to one burst on
// the device; `capacity` exist. A request takes a token at once when one is free and nobody
// eligible waits, else queues a ticket; a release hands its token to the first eligible ticket
// (highest priority, then oldest; eligible: its process is under its cap) and rings that
// process's doorbell (a futex in its slot). Each process runs a pump thread that sleeps on its
// doorbell, collects the lease tickets granted to it, checks every `liveness` that the other
// processes are alive and reclaims the tokens and tickets of dead ones. A compute ticket (the
// host backend's shared modelled device) is waited for by its backend thread itself, on the
// ticket's state word (a futex the granter wakes): one wake-up per hand-over, not two.
//
// Crash safety: the mutex is robust (a holder's death hands the next locker EOWNERDEAD, which
// recomputes every derived count from the slots' and tickets' own fields before going on); a
// process's tokens are `collected` (its own counter) plus its tickets in state granted (set by
// others in one store), so no update of two places can be torn by a death.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "backend.hpp"
#include "splitflow/core/config.hpp"

namespace splitflow::detail {

struct ArbiterSegment;  // the shared layout (arbiter.cpp)
struct ArbiterTicket;

/// One graph's figures as a process publishes them (its current or last run's).
struct PublishedGraph {
  std::string name;
  int priority = 0;
  std::uint64_t bursts = 0;
  std::int64_t held_ns = 0, busy_ns = 0, wait_ns = 0;
};

class Arbiter final : public ComputeGate {
 public:
  /// `local_streams`: this process's streams (its cap is at most that). `on_granted` is called
  /// on the pump thread with tickets granted to this process by others (or by a reclaim);
  /// `busy_ns` is read when the process publishes its figures.
  /// `compute_slots`: the modelled device's kernels at once, when this process creates the
  /// segment (the host backend's, shared through enter()/leave()).
  Arbiter(const ArbiterConfig& config, std::size_t local_streams, std::size_t compute_slots,
          std::function<void(const std::vector<std::uint64_t>&)> on_granted,
          std::function<std::int64_t()> busy_ns,
          std::function<std::vector<PublishedGraph>()> graphs = {});
  ~Arbiter();
  Arbiter(const Arbiter&) = delete;
  Arbiter& operator=(const Arbiter&) = delete;

  enum class Take { granted, queued, full };
  /// A token now (granted), or a ticket queued under `ticket` (its grant comes through
  /// on_granted or release()'s result), or `full` (the ticket table is full: try again later).
  Take acquire(int priority, std::uint64_t& ticket);
  /// Gives one of this process's tokens back. Returns this process's tickets that it granted
  /// (the caller now holds a token for each).
  std::vector<std::uint64_t> release();
  /// Withdraws a queued ticket of this process: true when withdrawn, false when it had been
  /// granted meanwhile (the caller holds that token and must use or release it).
  bool cancel(std::uint64_t ticket);
  /// ComputeGate: a compute slot of the shared modelled device, first come first served within
  /// a priority across processes (blocks the calling backend thread until granted: it waits on
  /// its ticket's state word, woken by the process that grants it).
  void enter(int priority) override;
  void leave(std::int64_t t0, std::int64_t t1) noexcept override;
  /// Stops and joins the pump thread (no more on_granted calls). Called before the owner of
  /// on_granted goes; the destructor calls it too.
  void stop();
  /// Writes this process's figures (busy time) into its slot.
  void publish();

  std::size_t capacity() const noexcept { return capacity_; }
  std::size_t cap() const noexcept { return cap_; }
  int slot() const noexcept { return slot_; }
  const std::string& path() const noexcept { return path_; }
  /// Checks the other processes now (the pump does every `liveness`); returns the processes
  /// reclaimed. Tokens it hands to this process go to on_granted.
  int check_liveness();
  /// Tests only: takes the segment's lock and keeps it (to die holding it).
  void hold_lock_for_test();

 private:
  /// Grants to this process found while the lock was held, handed out after it is let go.
  struct Mine {
    std::vector<std::uint64_t> leases;
  };
  void pump();
  Mine collect_locked();
  void hand_out_locked(Mine& mine, std::int64_t now);
  int reclaim_dead_locked(std::int64_t now);
  ArbiterTicket* queue_locked(std::uint32_t kind, int priority, std::int64_t now);
  void deliver(Mine& mine);

  ArbiterConfig config_;
  std::string path_;
  ArbiterSegment* seg_ = nullptr;
  std::size_t bytes_ = 0;
  int slot_ = -1;
  std::size_t capacity_ = 0, cap_ = 0;
  std::function<void(const std::vector<std::uint64_t>&)> on_granted_;
  std::function<std::int64_t()> busy_ns_;
  std::function<std::vector<PublishedGraph>()> graphs_;
  std::atomic<bool> stop_{false};
  std::thread pump_;
};

/// Validates an arbiter name (throws Error naming the rule).
void check_arbiter_name(const std::string& name);

}  // namespace splitflow::detail
