// splitflow-top: the machine's shared devices as the arbiter segments see them (docs/sharing.md).
//
//   splitflow-top                  live view of every arbiter, refreshed each second (Ctrl-C ends)
//   splitflow-top --once [NAME..]  one view and exit
//   splitflow-top --json [NAME..]  one JSON document: {"arbiters": [...]}
//   splitflow-top --prometheus     one scrape in Prometheus text format (for a node exporter's
//                                  textfile collector, or behind a tiny HTTP server)
//   splitflow-top --remove NAME    removes a segment no process uses any more (refused,
//                                  naming them, while processes use it; --force anyway)
//
// Per device: bursts at once (capacity), leases out and queued, time held (at least one lease
// out) and the busy time the processes published. Per process: its cap, leases held and
// queued, priority, time held, time busy, waste (held minus busy) and time queued; and per
// graph of each process (its current or last run): priority, bursts, held, busy, waste, wait.
#include <splitflow/device/arbiter.hpp>
#include <splitflow/core/error.hpp>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

namespace {

void usage(std::FILE* to) {
  std::fputs(
      "usage: splitflow-top [--once | --interval SECONDS | --json | --prometheus] [NAME ...]\n"
      "       splitflow-top --remove NAME [--force]\n"
      "Shows the splitflow processes sharing each device through an arbiter\n"
      "(DeviceConfig::arbiter): held, busy and waste per process, leases out and queued.\n",
      to);
}

std::vector<splitflow::ArbiterView> read_all(const std::vector<std::string>& wanted,
                                             std::vector<std::string>& errors) {
  std::vector<std::string> names = wanted.empty() ? splitflow::list_arbiters() : wanted;
  std::vector<splitflow::ArbiterView> views;
  for (const auto& n : names) {
    try {
      views.push_back(splitflow::read_arbiter(n));
    } catch (const std::exception& e) {
      errors.push_back(e.what());
    }
  }
  return views;
}

double sec(std::int64_t ns) { return static_cast<double>(ns) * 1e-9; }
double pct(std::int64_t part, std::int64_t whole) {
  return whole > 0 ? 100.0 * static_cast<double>(part) / static_cast<double>(whole) : 0.0;
}

void print_table(const std::vector<splitflow::ArbiterView>& views, bool named) {
  // (Names asked for that cannot be read are the errors printed after the table.)
  if (views.empty() && !named)
    std::printf("no splitflow arbiter on this machine (/dev/shm/splitflow-arb-*)\n");
  for (const auto& v : views) {
    std::printf("arbiter %s  capacity %zu  in use %zu  waiting %zu  leases %llu  age %.1f s\n",
                v.name.c_str(), v.capacity, v.in_use, v.waiting,
                static_cast<unsigned long long>(v.leases), sec(v.age_ns));
    std::printf("  held %.3f s (%.1f%% of its age)  busy %.3f s (summed over processes)  waste %.3f s\n",
                sec(v.held_ns), pct(v.held_ns, v.age_ns), sec(v.busy_ns()),
                sec(v.held_ns - v.busy_ns()));
    std::printf("  compute slots %zu (at most %zu in use)  device busy %.3f s (%.1f%%; host backend)",
                v.compute_slots, v.max_compute_in_use, sec(v.device_busy_ns),
                pct(v.device_busy_ns, v.age_ns));
    if (v.reclaimed_processes)
      std::printf("  reclaimed: %llu processes, %llu leases",
                  static_cast<unsigned long long>(v.reclaimed_processes),
                  static_cast<unsigned long long>(v.reclaimed_leases));
    std::printf("\n  %7s %-20s %-9s %3s %4s %4s %4s %9s %9s %9s %9s %9s\n", "PID", "LABEL",
                "STATE", "CAP", "HELD", "WAIT", "PRIO", "LEASES", "HELD_S", "BUSY_S", "WASTE_S",
                "WAIT_S");
    for (const auto& p : v.processes) {
      std::printf("  %7d %-20.20s %-9s %3zu %4zu %4zu %4d %9llu %9.3f %9.3f %9.3f %9.3f\n", p.pid,
                  p.label.c_str(), p.state.c_str(), p.cap, p.held, p.waiting, p.priority,
                  static_cast<unsigned long long>(p.leases), sec(p.held_ns), sec(p.busy_ns),
                  sec(p.waste_ns()), sec(p.wait_ns));
      for (const auto& g : p.graphs)  // its graphs: bursts in the LEASES column
        std::printf("  %7s   graph %-14.14s %-9s %3s %4s %4s %4d %9llu %9.3f %9.3f %9.3f %9.3f\n", "",
                    g.name.c_str(), "", "", "", "", g.priority,
                    static_cast<unsigned long long>(g.bursts), sec(g.held_ns), sec(g.busy_ns),
                    sec(g.waste_ns()), sec(g.wait_ns));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  enum class Mode { live, once, json, prometheus } mode = Mode::live;
  double interval = 1.0;
  std::vector<std::string> names;
  bool force = false, remove = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--force") == 0) force = true;
    if (std::strcmp(argv[i], "--remove") == 0) remove = true;
  }
  if (force && !remove) {
    std::fprintf(stderr, "splitflow-top: --force goes with --remove NAME\n");
    usage(stderr);
    return 2;
  }
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if ((a == "--interval" || a == "--remove") &&
        (i + 1 >= argc || (argv[i + 1][0] == '-' && a == "--remove"))) {
      std::fprintf(stderr, "splitflow-top: %s needs a value (%s)\n", a.c_str(),
                   a == "--remove" ? "the arbiter's NAME" : "SECONDS");
      usage(stderr);
      return 2;
    }
    if (a == "--once") mode = Mode::once;
    else if (a == "--json") mode = Mode::json;
    else if (a == "--prometheus") mode = Mode::prometheus;
    else if (a == "--force") continue;
    else if (a == "--interval") interval = std::atof(argv[++i]);
    else if (a == "--remove") {
      const std::string n = argv[++i];
      try {
        if (!splitflow::remove_arbiter(n, force)) {
          std::fprintf(stderr, "splitflow-top: there is no arbiter '%s'\n", n.c_str());
          return 1;
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "splitflow-top: %s\n", e.what());
        return 2;
      }
      std::printf("removed arbiter '%s'\n", n.c_str());
      return 0;
    } else if (a == "-h" || a == "--help") {
      usage(stdout);
      return 0;
    } else if (!a.empty() && a[0] == '-') {
      std::fprintf(stderr, "splitflow-top: unknown option '%s'\n", a.c_str());
      usage(stderr);
      return 2;
    } else {
      names.push_back(a);
    }
  }
  if (!(interval > 0)) {
    std::fprintf(stderr, "splitflow-top: --interval must be a positive number of seconds\n");
    return 2;
  }
  for (;;) {
    std::vector<std::string> errors;
    const auto views = read_all(names, errors);
    if (mode == Mode::json) std::fputs(splitflow::arbiters_json(views).c_str(), stdout);
    else if (mode == Mode::prometheus) std::fputs(splitflow::arbiters_prometheus(views).c_str(), stdout);
    else {
      if (mode == Mode::live) std::fputs("\033[H\033[2J", stdout);
      print_table(views, !names.empty());
    }
    for (const auto& e : errors) std::fprintf(stderr, "splitflow-top: %s\n", e.c_str());
    std::fflush(stdout);
    if (mode != Mode::live) return errors.empty() ? 0 : 1;
    std::this_thread::sleep_for(std::chrono::duration<double>(interval));
  }
}
