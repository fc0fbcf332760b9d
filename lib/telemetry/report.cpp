// The diagnosis and the text report.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string_view>

#include "splitflow/core/config.hpp"
#include "splitflow/telemetry/stats.hpp"
#include "splitflow/telemetry/export.hpp"

namespace splitflow {

namespace {

double frac(std::int64_t part, std::int64_t whole) {
  return whole > 0 ? static_cast<double>(part) / static_cast<double>(whole) : 0.0;
}
std::string pct(double f) { return fmt::format("{:.0f}%", 100.0 * f); }
std::string mib(double b) { return fmt::format("{:.1f} MiB", b / (1 << 20)); }
std::string ms(std::int64_t ns) { return fmt::format("{:.1f} ms", static_cast<double>(ns) / 1e6); }
// "1 item", "2 items".
std::string count_of(std::uint64_t n, std::string_view noun) {
  return fmt::format("{} {}{}", n, noun, n == 1 ? "" : "s");
}
bool limited(const StageStats& s) { return s.concurrency_limit != Concurrency::unlimited; }
// Whether its bodies hold an arena thread while they run (an async or blocking stage's do not).
bool holds_threads(const StageStats& s) {
  return (s.kind == StageKind::stage || s.kind == StageKind::sink) && s.call_ns < 0;
}

// "raise the concurrency of stage 'x' from a to b", `why` after it; within the runtime's
// threads for a stage whose bodies hold them (an async or blocking stage's items out do not):
// past them the suggestion says what else it takes.
std::string raise_concurrency(const RunStats& st, const StageStats& s, std::size_t to,
                              const std::string& why = {}) {
  // A Python body that held the GIL most of its time (its holds at most the run: not bodies
  // holding it at once, which release it): its fraction held, else empty.
  const std::int64_t own = s.work_ns - s.serial_wait_ns;
  const std::string gil_held =
      s.serial_ns > 0 && own > 0 && 2 * s.serial_ns >= own &&
              static_cast<double>(s.serial_ns) <= 1.05 * static_cast<double>(st.wall_ns)
          ? pct(std::min(1.0, static_cast<double>(s.serial_ns) / static_cast<double>(own)))
          : std::string();
  // An automatic stage held by the GIL: "the tuner raises it" contradicted the tuner's own
  // decision (the GIL bounds the rate; a new user's trial). Threads that waited for each
  // other's holds: the GIL, said so; one thread: pure Python or numpy, both said.
  if (s.concurrency_automatic && !gil_held.empty()) {
    if (s.concurrency_limit != 1 && 10 * s.serial_wait_ns >= s.work_ns)
      return fmt::format(
          "the bodies of stage '{}' (automatic concurrency, {} now) held the GIL {} of their "
          "time and waited for it {} more{}: its threads wait for each other's, and the tuner "
          "keeps it within the GIL's bound; run it in processes (Python: processes=N instead of "
          "concurrency='auto') or move its work into a C++ op (splitflow.ops)",
          s.name, s.concurrency_limit, gil_held, ms(s.serial_wait_ns), why);
    return fmt::format(
        "the bodies of stage '{}' (automatic concurrency, {} now) held the GIL, or computed with "
        "it released, {} of their time{}: Python code that holds it is bound by it whatever its "
        "threads (run it in processes, Python: processes=N instead of concurrency='auto', or move "
        "its work into a C++ op, splitflow.ops); numpy or torch code, which releases it, the "
        "tuner raises while that raises the rate{}",
        s.name, s.concurrency_limit, gil_held, why,
        st.autotune.empty() ? "; it decided nothing in this run (shorter than "
                              "GraphOptions::autotune_window, or too few items)"
                            : "; its decisions are listed under autotune");
  }
  // An automatic stage's number is the tuner's: advising one of the user's own reads as "turn
  // auto off" (a new user's trial, on a run shorter than the tuner's first window).
  if (s.concurrency_automatic)
    return fmt::format(
        "stage '{}' runs on automatic concurrency ({} now){}: the tuner raises it while that "
        "raises the rate{}",
        s.name, s.concurrency_limit, why,
        st.autotune.empty()
            ? "; it decided nothing in this run (shorter than GraphOptions::autotune_window, or "
              "too few items): a longer run gives it time"
            : "; its decisions are listed under autotune");
  // A source has no concurrency to raise (a new user's trial: "raise the concurrency of stage
  // 'remote' from 1 to 2", which no source takes): its items come one at a time.
  // One whose items another system produces: that system is where the rate is (a new user's
  // trial: "move its work into a stage after it" for splitflow.dask's remote pass).
  if (s.kind == StageKind::source && !s.fed_by.empty())
    return fmt::format("source '{}' is fed by {}{}: its producer is the limit, not the graph",
                       s.name, s.fed_by, why);
  if (s.kind == StageKind::source)
    return fmt::format("source '{}' yields one item at a time{}: move its work into a stage after "
                       "it, which can run concurrently (a source of indices or paths, and a stage "
                       "that loads each)",
                       s.name, why);
  // A Python body that held the GIL most of its time: another thread of it waits for the GIL
  // (a new user's trial: "raise ... from 1 to 2" for a pure-Python loop, 462 items/s at 1, 479
  // at 4). Its holds count what it computed with the GIL released too (numpy, torch): holds
  // past the run's length say that its bodies released it; threads that waited for it a tenth
  // of their time, that they held it; one thread, either.
  if (!gil_held.empty()) {
    const std::string& held = gil_held;
    if (s.concurrency_limit != 1 && 10 * s.serial_wait_ns >= s.work_ns)
      return fmt::format(
          "the bodies of stage '{}' held the GIL {} of their time and waited for it {} more{}: "
          "its threads wait for each other's; run it in processes (Python: processes=N) or move "
          "its work into a C++ op (splitflow.ops)",
          s.name, held, ms(s.serial_wait_ns), why);
    return fmt::format(
        "the bodies of stage '{}' held the GIL, or computed with it released, {} of their time{}: "
        "Python code that holds it gains nothing from more threads (run it in processes, Python: "
        "processes=N, or move its work into a C++ op, splitflow.ops); numpy or torch code, which "
        "releases it, does: raise the concurrency of stage '{}' from {} to {}",
        s.name, held, why, s.name, s.concurrency_limit, to);
  }
  if (holds_threads(s) && st.threads > 0 && to > st.threads) {
    if (s.concurrency_limit >= st.threads)
      return fmt::format(
          "stage '{}' already runs on all {} of the runtime's threads{}: it takes more cores "
          "(RuntimeConfig::threads), a cheaper body, or its work on the GPU",
          s.name, st.threads, why);
    return fmt::format(
        "raise the concurrency of stage '{}' from {} to {}, the runtime's threads{}; past them it "
        "takes more cores (RuntimeConfig::threads), a cheaper body, or its work on the GPU",
        s.name, s.concurrency_limit, st.threads, why);
  }
  return fmt::format("raise the concurrency of stage '{}' from {} to {}{}", s.name,
                     s.concurrency_limit, to, why);
}

// Share of its capacity a stage used: work over wall x limit (for unlimited stages, its busy
// fraction: it was never the limit itself).
double saturation(const StageStats& s, std::int64_t wall) {
  if (!limited(s) || s.concurrency_limit == 0) return frac(s.busy_ns, wall);
  return frac(s.work_ns, wall) / static_cast<double>(s.concurrency_limit);
}

std::vector<const StageStats*> producers_of(const RunStats& st, const std::string& name) {
  std::vector<const StageStats*> out;
  for (const auto& s : st.stages)
    if (std::find(s.consumers.begin(), s.consumers.end(), name) != s.consumers.end())
      out.push_back(&s);
  return out;
}

// The most saturated stage upstream of `name` (what it waits for), searching producers first.
const StageStats* limiter_upstream(const RunStats& st, const std::string& name) {
  const StageStats* best = nullptr;
  double best_sat = -1;
  std::vector<const StageStats*> frontier = producers_of(st, name);
  std::vector<std::string> seen;
  while (!frontier.empty()) {
    const StageStats* s = frontier.back();
    frontier.pop_back();
    if (std::find(seen.begin(), seen.end(), s->name) != seen.end()) continue;
    seen.push_back(s->name);
    const double sat = saturation(*s, st.wall_ns);
    if (sat > best_sat) {
      best_sat = sat;
      best = s;
    }
    for (const StageStats* p : producers_of(st, s->name)) frontier.push_back(p);
  }
  return best;
}

const StageStats* find_stage(const RunStats& st, const std::string& name) { return st.find(name); }

// The largest blocked fraction among the stage's producers.
double producers_blocked(const RunStats& st, const std::string& name) {
  double most = 0;
  for (const StageStats* p : producers_of(st, name)) most = std::max(most, frac(p->blocked_ns, st.wall_ns));
  return most;
}

}  // namespace

std::uint64_t RunStats::items_delivered() const noexcept {
  std::uint64_t n = 0;
  // A sink delivers what its body consumed (items_out: not an item whose body threw, skipped
  // or failing the run); a pull sink what reached its queue (its reader takes them, after the
  // run too).
  for (const auto& s : stages)
    if (s.kind == StageKind::sink)
      n += s.items_out;
    else if (s.kind == StageKind::pull_sink)
      n += s.items_in;
  return n;
}

double RunStats::throughput() const noexcept {
  return wall_ns > 0 ? static_cast<double>(items_delivered()) * 1e9 / static_cast<double>(wall_ns) : 0;
}

namespace {
// The decision deepening GPU stage g's automatic ring for the next run ("model ring_bytes 64
// MiB -> 128 MiB: ..."), if the run's final stats hold one.
const std::string* ring_decision(const RunStats& st, const StageStats& g) {
  if (!g.ring_automatic) return nullptr;
  const std::string head = g.name + " ring_bytes ";
  for (const std::string& e : st.autotune)  // a raise says "... of the last run for room in it"
    if (e.rfind(head, 0) == 0 && e.find("of the last run for room in it") != std::string::npos) return &e;
  return nullptr;
}
}  // namespace

Diagnosis diagnose(const RunStats& st, const std::optional<DeviceStats>& device) {
  Diagnosis d;
  const std::int64_t wall = st.wall_ns;
  if (wall <= 0 || st.stages.empty()) return d;
  // A failed run stopped at its error: its rates, waits and busy times describe the part
  // before it (often nothing but a start), and a bottleneck named from them would send its user
  // tuning what did not go wrong.
  if (st.status == RunStatus::failed) return d;

  // 1. What each GPU stage waited for, and what to change. "In flight" (the stage's busy
  // state) is not the same as the device working: the graph's device time decides.
  const double device_share = frac(st.gpu.busy_ns, wall);  // this graph's work on the device
  for (const auto& g : st.stages) {
    if (g.kind != StageKind::gpu_stage) continue;
    const double starved = frac(g.starved_ns, wall);
    const double in_flight = frac(g.busy_ns, wall);
    const double used = g.mean_concurrency();
    const double ring_wait = frac(g.ring_wait_ns, wall);
    const bool ring_blocks = g.ring_capacity > 0 && g.ring_refusals > 0 && ring_wait > 0.1 &&
                             producers_blocked(st, g.name) > 0.3;
    // Only an output ring (no input ring: ring_item_bytes is the input ring's), full: its room is
    // held by results not let go of downstream (docs/architecture.md, "Results kept from an
    // output ring hold it"). It was reported as "the pinned ring into" the stage, with no
    // advice: a new C++ user's trial.
    if (g.ring_capacity > 0 && g.ring_item_bytes == 0 && g.ring_refusals > 0 && ring_wait > 0.1) {
      if (d.bottleneck.empty()) d.bottleneck = g.name;
      d.findings.push_back(fmt::format(
          "the pinned output ring of GPU stage '{}' is full: its bursts waited {} ({} of the run, "
          "{} refusals) for room (at most {} of its {} in use), held by its results downstream",
          g.name, ms(g.ring_wait_ns), pct(ring_wait), g.ring_refusals,
          mib(static_cast<double>(g.ring_max_in_use)), mib(static_cast<double>(g.ring_capacity))));
      d.suggestions.push_back(fmt::format(
          "copy the results of '{}' that are kept into memory of their own (HostTensor::empty and "
          "a memcpy; NumPy's np.array(x)), or leave GpuStageOptions::out_ring_bytes of '{}' at 0: "
          "a result from its output ring holds its room until its last copy is gone",
          g.name, g.name));
      continue;
    }
    if (ring_blocks && (starved > 0.2 || used < 0.5 * static_cast<double>(g.concurrency_limit))) {
      // The GPU stage waits for input while its producers wait for ring space: the ring is in
      // the way.
      d.bottleneck = g.name;
      d.findings.push_back(fmt::format(
          "the pinned ring into GPU stage '{}' is full: producers waited {} ({} of the run, {} "
          "refusals) for ring space while '{}' waited for input {} and used {:.1f} of its {} "
          "concurrency",
          g.name, ms(g.ring_wait_ns), pct(ring_wait), g.ring_refusals, g.name, pct(starved), used,
          g.concurrency_limit));
      // Full of budgets or full of bytes: producers reserve ring_item_bytes per item in flight,
      // so items much smaller than that fill the ring with reservations, not data.
      const std::size_t budget_items =
          g.ring_item_bytes > 0 ? g.ring_capacity / g.ring_item_bytes - 1 : 0;
      if (g.ring_item_bytes > 0 && 2 * g.ring_max_in_use < g.ring_capacity) {
        d.suggestions.push_back(fmt::format(
            "lower GpuStageOptions::ring_item_bytes of '{}' from {} toward its largest item: it "
            "reserves that much per item in flight, so only {} items fit the {} ring while at "
            "most {} of it held data",
            g.name, mib(static_cast<double>(g.ring_item_bytes)), budget_items,
            mib(static_cast<double>(g.ring_capacity)),
            mib(static_cast<double>(g.ring_max_in_use))));
      } else if (const std::string* deeper = ring_decision(st, g)) {
        // The runtime deepens an automatic ring for the next run itself (autotune::ring_depth,
        // decided at the run's end: among the final stats' decisions).
        d.suggestions.push_back(fmt::format(
            "the ring of '{}' is automatic: the next run of graph '{}' gets a deeper one ({}); to "
            "start deeper, set GpuStageOptions::ring_bytes to {} (it held {} on average, {} at most)",
            g.name, st.graph, *deeper, mib(4.0 * static_cast<double>(g.ring_capacity)),
            mib(g.ring_mean_in_use), mib(static_cast<double>(g.ring_max_in_use))));
      } else {
        d.suggestions.push_back(fmt::format(
            "enlarge the ring of '{}': GpuStageOptions::ring_bytes from {} to {} (it held {} on "
            "average, {} at most)",
            g.name, mib(static_cast<double>(g.ring_capacity)),
            mib(4.0 * static_cast<double>(g.ring_capacity)), mib(g.ring_mean_in_use),
            mib(static_cast<double>(g.ring_max_in_use))));
      }
      continue;
    }
    const StageStats* p = limiter_upstream(st, g.name);
    const bool upstream_saturated = p && saturation(*p, wall) > 0.8;
    if (starved > 0.2 || (device_share < 0.5 && upstream_saturated)) {
      if (!p) continue;
      if (d.bottleneck.empty()) d.bottleneck = p->name;
      d.findings.push_back(fmt::format(
          "GPU stage '{}' waited for input {} of the run and the device worked for it {}: '{}' "
          "is the bottleneck (busy {}, {:.1f} of its {} concurrency in use)",
          g.name, pct(starved), pct(device_share), p->name, pct(frac(p->busy_ns, wall)),
          p->mean_concurrency(),
          limited(*p) ? std::to_string(p->concurrency_limit) : std::string("unlimited")));
      // The concurrency that would let p keep up with the device's work for g.
      const double p_item = p->items_out ? static_cast<double>(p->work_ns) / p->items_out : 0;
      const double g_item = g.items_out ? static_cast<double>(st.gpu.busy_ns) / g.items_out : 0;
      if (limited(*p) && p_item > 0 && g_item > 0) {
        const auto need = static_cast<std::size_t>(std::ceil(p_item / g_item));
        if (need > p->concurrency_limit)
          d.suggestions.push_back(raise_concurrency(
              st, *p, need,
              fmt::format(" ({:.2f} ms of work per item against {:.2f} ms of device time per item)",
                          p_item / 1e6, g_item / 1e6)));
      }
    } else if (in_flight > 0.8 && (device_share >= 0.5 || producers_blocked(st, g.name) > 0.3)) {
      if (d.bottleneck.empty()) d.bottleneck = g.name;
      // The device during this run (the run's window), not over its lifetime.
      const bool window = st.gpu.device_wall_ns > 0;
      const double dev_busy = window   ? frac(st.gpu.device_busy_ns, st.gpu.device_wall_ns)
                              : device ? device->busy_fraction()
                                       : device_share;
      const std::size_t streams = window ? st.gpu.device_streams : device ? device->streams : 0;
      const std::size_t max_leased =
          window ? st.gpu.device_max_leases : device ? device->max_leases_in_use : 0;
      const double mean_leased =
          window ? st.gpu.device_mean_leases : device ? device->mean_leases() : 0.0;
      d.findings.push_back(fmt::format(
          "GPU stage '{}' is the bottleneck: it had work in flight {} of the run, the device "
          "worked for it {}{}",
          g.name, pct(in_flight), pct(device_share),
          window || device ? fmt::format(" (device busy {})", pct(dev_busy)) : std::string()));
      // The pool first: the device's busy fraction counts any work executing, so one stream
      // at a time already reads as 100% busy while the device could run more at once.
      // Every stream leased at times, most of them on average, and invocations waiting for
      // one: the gaps between bursts (a completion handed to the next waiter) keep the mean
      // below the pool size even when the pool is all the limit there is.
      if (streams > 0 && max_leased >= streams &&
          mean_leased > 0.6 * static_cast<double>(streams) && st.gpu.lease_wait_ns > wall / 10) {
        d.suggestions.push_back(fmt::format(
            "the stream pool is the limit ({:.1f} of {} streams leased on average, invocations "
            "waited {} for one): raise DeviceConfig::streams",
            mean_leased, streams, ms(st.gpu.lease_wait_ns)));
      } else if (dev_busy > 0.9) {
        d.suggestions.push_back(fmt::format(
            "the device is saturated ({} busy): a faster kernel for '{}' or another device",
            pct(dev_busy), g.name));
      } else if (g.concurrency_automatic) {
        d.suggestions.push_back(fmt::format(
            "GPU stage '{}' runs on automatic concurrency ({} now): the tuner raises it while the "
            "device has room and the rate rises", g.name, g.concurrency_limit));
      } else {
        d.suggestions.push_back(fmt::format(
            "raise the concurrency of GPU stage '{}' from {} to {}: the device has room", g.name,
            g.concurrency_limit, 2 * g.concurrency_limit));
      }
    } else if (in_flight > 0.8) {
      d.findings.push_back(fmt::format(
          "GPU stage '{}' had work in flight {} of the run but the device worked for it only "
          "{}: its bursts wait between their ops or behind other graphs' work",
          g.name, pct(in_flight), pct(device_share)));
    }
  }

  // 2. CPU stages held back by full consumers. A chain under backpressure is held back by its
  // last stage that is not blocked itself: a source blocked behind 'a', 'a' blocked behind 'b'
  // and 'b' not blocked: 'b' is the bottleneck; of several such consumers (branches), the most
  // saturated; the first consumer found only when every one is blocked.
  const StageStats* first_by = nullptr;
  const StageStats* holder = nullptr;
  for (const auto& s : st.stages) {
    const double blocked = frac(s.blocked_ns, wall);
    if (blocked < 0.3 || s.consumers.empty()) continue;
    const StageStats* by = nullptr;
    for (const auto& c : s.consumers) {
      const StageStats* cs = find_stage(st, c);
      if (cs && (!by || saturation(*cs, wall) > saturation(*by, wall))) by = cs;
    }
    if (!by) continue;
    if (by->ring_capacity > 0 && by->ring_refusals > 0 && by->ring_item_bytes == 0) {
      d.findings.push_back(fmt::format("stage '{}' is blocked {} of the run behind GPU stage '{}', "
                                       "whose pinned output ring is full",
                                       s.name, pct(blocked), by->name));
    } else if (by->ring_capacity > 0 && by->ring_refusals > 0) {
      d.findings.push_back(fmt::format("stage '{}' is blocked {} of the run by the pinned ring "
                                       "into '{}'",
                                       s.name, pct(blocked), by->name));
    } else {
      // (The busy share is the consumer's: "(busy 99%)" after it read as the blocked stage's.)
      d.findings.push_back(fmt::format("stage '{}' is blocked {} of the run behind '{}', which was "
                                       "busy {}",
                                       s.name, pct(blocked), by->name,
                                       pct(frac(by->busy_ns, wall))));
    }
    if (!first_by) first_by = by;
    if (frac(by->blocked_ns, wall) < 0.3 && (!holder || saturation(*by, wall) > saturation(*holder, wall)))
      holder = by;
  }
  if (d.bottleneck.empty() && (holder || first_by)) {
    const StageStats& b = holder ? *holder : *first_by;
    d.bottleneck = b.name;
    // It "starved" with items queued: it waited for a thread, not for input. With the
    // runtime's threads busy in other stages' bodies, the cores are the limit, and the stage
    // doing most of the work is the one to make cheaper (a trial's report named a reader busy
    // 9%, queue 22.7 on average, while an unlimited decode held both threads).
    const StageStats* hog = nullptr;
    double used = 0;
    for (const auto& s : st.stages) {
      if (!holds_threads(s)) continue;
      used += frac(s.work_ns, wall);
      if (&s != &b && (!hog || s.work_ns > hog->work_ns)) hog = &s;
    }
    // (Only a stage whose bodies take an arena thread: a pull sink or a zip "starves" for
    // other reasons; and the stage named did more work than the waiting one.)
    if (hog && holds_threads(b) && hog->work_ns > b.work_ns && st.threads > 0 &&
        b.mean_queue >= 1.0 && frac(b.starved_ns, wall) > 0.5 &&
        used >= 0.9 * static_cast<double>(st.threads)) {
      d.bottleneck = hog->name;
      d.findings.push_back(fmt::format(
          "stage '{}' waited {} of the run with {:.1f} items queued on average: for a thread, not "
          "for input; the runtime's {} threads ran bodies {:.1f} of them on average, '{}' {:.1f}",
          b.name, pct(frac(b.starved_ns, wall)), b.mean_queue, st.threads, used, hog->name,
          frac(hog->work_ns, wall)));
      d.suggestions.push_back(fmt::format(
          "the cores are the limit: stage '{}' does most of the work ({:.1f} of the {} threads): "
          "a cheaper body, its work on the GPU, or more cores (RuntimeConfig::threads); Python "
          "bodies waiting for the GIL read as work too: the GIL is then the limit (processes=)",
          hog->name, frac(hog->work_ns, wall), st.threads));
    } else if (b.kind == StageKind::stage && limited(b) && saturation(b, wall) > 0.8) {
      d.suggestions.push_back(raise_concurrency(st, b, 2 * b.concurrency_limit));
    }
  }

  // 3. A CPU-only graph: its most saturated stage.
  if (d.bottleneck.empty()) {
    const StageStats* top = nullptr;
    for (const auto& s : st.stages)
      if (s.kind != StageKind::pull_sink && (!top || saturation(s, wall) > saturation(*top, wall)))
        top = &s;
    if (top && saturation(*top, wall) > 0.8) {
      d.bottleneck = top->name;
      d.findings.push_back(fmt::format("stage '{}' is the bottleneck: {} of its capacity used",
                                       top->name, pct(saturation(*top, wall))));
      if (limited(*top))
        d.suggestions.push_back(raise_concurrency(st, *top, 2 * top->concurrency_limit));
    }
  }

  // 4. Holding the GPU without using it.
  if (st.gpu.bursts > 0 && st.gpu.busy_ns > 0 && st.gpu.held_over_busy() > 1.5) {
    d.findings.push_back(fmt::format(
        "the graph held the GPU {} for {} of work (held/busy {:.2f}): its bursts waited on the "
        "device behind other work, or between their copies and kernels",
        ms(st.gpu.held_ns), ms(st.gpu.busy_ns), st.gpu.held_over_busy()));
  }
  return d;
}

std::string report(const RunStats& st, const std::optional<DeviceStats>& device) {
  std::string out = format_table(st);
  out += fmt::format("\n{:<18} {:>9} {:>9} {:>9} {:>9} {:>10} {:>8}\n", "latency", "p50",
                     "p95", "p99", "max", "mean queue", "conc");
  const auto lat = [](std::uint64_t ns) {
    return ns >= 1'000'000 ? fmt::format("{:.2f}ms", ns / 1e6) : fmt::format("{:.1f}us", ns / 1e3);
  };
  for (const auto& s : st.stages)
    out += fmt::format("{:<18} {:>9} {:>9} {:>9} {:>9} {:>10.1f} {:>8.2f}\n", s.name,
                       lat(s.latency.percentile(50)), lat(s.latency.percentile(95)),
                       lat(s.latency.percentile(99)), lat(s.latency.max()), s.mean_queue,
                       s.mean_concurrency());
  out += fmt::format("\nthroughput {:.1f} items/s ({} delivered)\n", st.throughput(),
                     count_of(st.items_delivered(), "item"));
  // Items a run did not deliver whole: said here, not only in the figures (a new
  // user's trial: two corrupt files skipped, and the report read as if nothing was lost).
  for (const auto& s : st.stages) {
    if (s.kind == StageKind::zip && s.items_skipped > 0)
      out += fmt::format("zip '{}' dropped {} that had no partner (one input ended first, "
                         "or the partner was dropped upstream)\n",
                         s.name, count_of(s.items_skipped, "item"));
    else if (s.items_skipped + s.items_substituted > 0) {
      // What it did, each said only where it did it ("skipped 2 items and replaced 0" read as
      // if replacing were the usual: a re-read of the report).
      std::string did = s.items_skipped > 0 ? "skipped " + count_of(s.items_skipped, "item") : "";
      if (s.items_substituted > 0)
        did += (did.empty() ? "replaced " : " and replaced ") + count_of(s.items_substituted, "item");
      out += fmt::format("'{}' {} whose {} (its errors name the first {}: StageStats::errors; "
                         "Python: the stage's \"errors\")\n",
                         s.name, did,
                         s.items_skipped + s.items_substituted == 1 ? "body threw" : "bodies threw",
                         StageStats::kMaxItemErrors);
    }
    if (s.items_expired > 0)
      out += fmt::format("'{}' dropped {} whose deadline had passed\n", s.name,
                         count_of(s.items_expired, "request"));
  }
  if (st.gpu.bursts > 0) {
    const auto gbps = [](std::uint64_t b, std::int64_t ns) {
      return ns > 0 ? fmt::format("{:.2f} GB/s", static_cast<double>(b) / static_cast<double>(ns))
                    : std::string("-");
    };
    out += fmt::format(
        "GPU: held {} busy {} (held/busy {:.2f}), {} bursts, stream waits {} (max {}), H2D {} "
        "({}), D2H {} ({}), staging copies {}\n",
        ms(st.gpu.held_ns), ms(st.gpu.busy_ns), st.gpu.held_over_busy(), st.gpu.bursts,
        ms(st.gpu.lease_wait_ns), ms(st.gpu.max_lease_wait_ns),
        mib(static_cast<double>(st.gpu.h2d_bytes)), gbps(st.gpu.h2d_bytes, st.gpu.h2d_ns),
        mib(static_cast<double>(st.gpu.d2h_bytes)), gbps(st.gpu.d2h_bytes, st.gpu.d2h_ns),
        st.gpu.staging_copies);
    for (const auto& s : st.stages)
      if (s.ring_capacity > 0)
        out += fmt::format("{} '{}': {} capacity, {} mean / {} max in use, {} wraps, {} "
                           "refusals, {} waited {}\n",
                           s.ring_item_bytes == 0 ? "output ring of" : "ring into",
                           s.name, mib(static_cast<double>(s.ring_capacity)),
                           mib(s.ring_mean_in_use), mib(static_cast<double>(s.ring_max_in_use)),
                           s.ring_wraps, s.ring_refusals,
                           s.ring_item_bytes == 0 ? "its bursts" : "producers", ms(s.ring_wait_ns));
  }
  if (device)
    out += fmt::format("device: {}: busy {} of {}, held/busy {:.2f}, streams {} ({:.1f} leased "
                       "on average, {} at most)\n",
                       device->name, pct(device->busy_fraction()), ms(device->wall_ns),
                       device->held_over_busy(), device->streams, device->mean_leases(),
                       device->max_leases_in_use);
  const Diagnosis d = diagnose(st, device);
  out += "\ndiagnosis:";
  if (st.status == RunStatus::failed)
    out += " none: the run failed (its error says where); the figures above cover the part "
           "before the failure\n";
  else if (d.findings.empty()) out += " nothing stands out\n";
  else out += fmt::format(" bottleneck '{}'\n", d.bottleneck);
  for (const auto& f : d.findings) out += "  - " + f + "\n";
  for (const auto& s : d.suggestions) out += "  > " + s + "\n";
  if (!st.autotune.empty()) {
    out += "autotune (what the runtime sized: automatic stages, max_in_flight, rings):\n";
    for (const auto& e : st.autotune) out += "  - " + e + "\n";
  }
  return out;
}

}  // namespace splitflow
