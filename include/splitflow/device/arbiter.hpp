// The cross-process lease arbiter, seen from outside (docs/sharing.md): what the meter
// (splitflow-top) reads from the machine's arbiter segments. A Runtime joins an arbiter through
// DeviceConfig::arbiter; nothing here is needed to use one.
//
//     for (const auto& name : splitflow::list_arbiters()) {
//       splitflow::ArbiterView v = splitflow::read_arbiter(name);
//       std::cout << v.name << ": " << v.in_use << " of " << v.capacity << " bursts\n";
//     }
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace splitflow {

/// One graph of a process (its current or last run), as the process last published it.
struct ArbiterGraph {
  std::string name;
  int priority = 0;            ///< GraphOptions::priority
  std::uint64_t bursts = 0;    ///< its bursts (one lease each)
  std::int64_t held_ns = 0;    ///< time with at least one of its leases out
  std::int64_t busy_ns = 0;    ///< its kernels and copies executing
  std::int64_t wait_ns = 0;    ///< summed time its bursts waited for a lease
  std::int64_t waste_ns() const noexcept { return held_ns - busy_ns; }
};

/// One process's figures in an arbiter (exact once it has left; live figures are read under the
/// segment's lock).
struct ArbiterProcess {
  int pid = 0;
  std::string label;
  /// "live", "exited" (detached cleanly), "dead" (died; its leases not yet taken back: the
  /// next member to look reclaims them) or "reclaimed" (died; its leases were taken back).
  std::string state;
  std::size_t cap = 0;       ///< bursts it may hold at once (ArbiterConfig::share of capacity)
  std::size_t held = 0;      ///< bursts it holds now (granted, in use)
  std::size_t waiting = 0;   ///< its bursts queued for the device now
  int priority = 0;          ///< the priority of its latest request
  std::uint64_t leases = 0;  ///< leases granted to it
  std::int64_t held_ns = 0;  ///< time with at least one lease of it out
  std::int64_t busy_ns = 0;  ///< its device's busy time, as it last published it
  std::int64_t wait_ns = 0;  ///< summed time its requests queued
  /// Its graphs (at most 8: those that held the device longest), published with busy_ns.
  std::vector<ArbiterGraph> graphs;
  std::int64_t waste_ns() const noexcept { return held_ns - busy_ns; }
};

/// One arbiter segment (one shared device).
struct ArbiterView {
  std::string name;
  std::string path;            ///< /dev/shm/splitflow-arb-NAME
  std::size_t capacity = 0;    ///< bursts at once across processes
  std::size_t in_use = 0;      ///< leases out now
  std::size_t max_in_use = 0;  ///< the most ever out at once (never above capacity)
  std::size_t waiting = 0;     ///< requests queued now
  std::uint64_t leases = 0;    ///< granted since the segment was created
  std::int64_t age_ns = 0;     ///< since the segment was created
  std::int64_t held_ns = 0;    ///< time with at least one lease out (any process)
  std::uint64_t reclaimed_processes = 0, reclaimed_leases = 0;
  /// The modelled device's compute slots (host backend: kernels at once across processes), in
  /// use now and at most, and the time at least one kernel ran across processes: the union of
  /// the kernels' execution intervals as they end (exact with one compute slot; with more, a
  /// kernel that ends after a later-starting one is counted from that one's end: a lower bound).
  std::size_t compute_slots = 0, compute_in_use = 0, max_compute_in_use = 0, compute_waiting = 0;
  std::int64_t device_busy_ns = 0;
  std::vector<ArbiterProcess> processes;  ///< live and recently ended ones
  /// Summed busy time the processes published (the device's busy time when their kernels do
  /// not overlap, as with capacity 1; an upper bound otherwise).
  std::int64_t busy_ns() const noexcept {
    std::int64_t b = 0;
    for (const auto& p : processes) b += p.busy_ns;
    return b;
  }
};

/// Names of the arbiter segments on this machine (/dev/shm/splitflow-arb-*), sorted.
std::vector<std::string> list_arbiters();
/// Reads one; throws splitflow::Error when it is missing, foreign, corrupt or of another version.
ArbiterView read_arbiter(const std::string& name);
/// One JSON object for each view: {"arbiters": [...]}.
std::string arbiters_json(const std::vector<ArbiterView>& views);
/// Prometheus text exposition (one scrape, every process of every arbiter).
std::string arbiters_prometheus(const std::vector<ArbiterView>& views);
/// Removes a segment once no process uses it. Throws splitflow::Error, naming them, while live
/// processes use it (removed, the next joiner would make a new segment and share the device
/// with them past its capacity), or when it cannot be read; `force` removes it anyway.
/// Returns false when there was none.
bool remove_arbiter(const std::string& name, bool force = false);

}  // namespace splitflow
