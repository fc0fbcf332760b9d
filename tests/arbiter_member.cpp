// One process of the cross-process arbiter tests (tests/test_arbiter.cpp), in one of two modes.
//
//   arbiter_member script NAME CAPACITY SHARE LIVENESS_MS [GROUP]
//       Joins arbiter NAME as a bare member (the device layer's Arbiter, white-box) and obeys
//       commands on stdin, one per line, answering on stdout:
//         acquire P   -> "granted" | "queued T" | "full"
//         release     -> "released", then "delivered T" for each of its tickets it granted
//         cancel T    -> "cancelled 1" (withdrawn) | "cancelled 0" (it had been granted)
//         enter P     -> "entered P" once it holds a compute slot (asked at priority P)
//         leave       -> "left" (gives its compute slot back)
//         holdlock    -> "locked" (takes the segment's lock and keeps it: to be killed)
//         liveness    -> "reclaimed N"
//         quit        -> "bye" (leaves the arbiter and exits 0)
//       Tickets granted by other processes arrive as "delivered T" lines, from its pump thread.
//       It starts with "ready SLOT CAP CAPACITY", or "error MESSAGE" and exit 1.
//
//   arbiter_member run NAME CAPACITY SHARE PRIORITY ITEMS KERNEL_US CPU_US [LABEL]
//       A training-style job: a Runtime on the host backend in arbiter NAME, a graph
//       source -> CPU work (CPU_US of spinning) -> GPU stage (a KERNEL_US kernel) -> sink over
//       ITEMS items. Prints one JSON line of what the process measured itself.
#include <splitflow/ops/ops.hpp>
#include <splitflow/splitflow.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <unistd.h>

#include "device/arbiter.hpp"

namespace {

std::mutex g_out;
void say(const std::string& s) {
  std::lock_guard lk(g_out);
  std::fputs((s + "\n").c_str(), stdout);
  std::fflush(stdout);
}

int script(int argc, char** argv) {
  if (argc < 6) return 2;
  splitflow::ArbiterConfig c;
  c.name = argv[2];
  c.capacity = std::strtoul(argv[3], nullptr, 10);
  c.share = std::atof(argv[4]);
  c.liveness = std::chrono::milliseconds(std::atoi(argv[5]));
  c.label = "member";
  if (argc > 6) c.group = argv[6];
  std::unique_ptr<splitflow::detail::Arbiter> arb;
  try {
    arb = std::make_unique<splitflow::detail::Arbiter>(
        c, 8, 1,
        [](const std::vector<std::uint64_t>& tickets) {
          for (auto t : tickets) say("delivered " + std::to_string(t));
        },
        [] { return std::int64_t{0}; });
  } catch (const std::exception& e) {
    say(std::string("error ") + e.what());
    return 1;
  }
  say("ready " + std::to_string(arb->slot()) + " " + std::to_string(arb->cap()) + " " +
      std::to_string(arb->capacity()));
  std::string cmd;
  while (std::cin >> cmd) {
    try {
      if (cmd == "acquire") {
        int p = 0;
        std::cin >> p;
        std::uint64_t t = 0;
        switch (arb->acquire(p, t)) {
          case splitflow::detail::Arbiter::Take::granted: say("granted"); break;
          case splitflow::detail::Arbiter::Take::queued: say("queued " + std::to_string(t)); break;
          case splitflow::detail::Arbiter::Take::full: say("full"); break;
        }
      } else if (cmd == "release") {
        auto mine = arb->release();
        say("released");
        for (auto t : mine) say("delivered " + std::to_string(t));
      } else if (cmd == "cancel") {
        std::uint64_t t = 0;
        std::cin >> t;
        say(std::string("cancelled ") + (arb->cancel(t) ? "1" : "0"));
      } else if (cmd == "enter") {
        int p = 0;
        std::cin >> p;
        // enter() blocks until a compute slot is granted: on a thread of its own.
        std::thread([a = arb.get(), p] {
          a->enter(p);
          say("entered " + std::to_string(p));
        }).detach();
      } else if (cmd == "leave") {
        arb->leave(0, 0);
        say("left");
      } else if (cmd == "holdlock") {
        arb->hold_lock_for_test();
        say("locked");
      } else if (cmd == "liveness") {
        say("reclaimed " + std::to_string(arb->check_liveness()));
      } else if (cmd == "quit") {
        arb.reset();
        say("bye");
        return 0;
      } else {
        say("unknown " + cmd);
      }
    } catch (const std::exception& e) {
      say(std::string("error ") + e.what());
    }
  }
  return 0;
}

int run(int argc, char** argv) {
  if (argc < 9) return 2;
  using namespace splitflow;
  RuntimeConfig rc;
  rc.threads = 2;
  rc.device.backend = BackendKind::host;
  rc.device.streams = 4;
  rc.device.host_compute_slots = 1;
  rc.device.arbiter.name = argv[2];
  rc.device.arbiter.capacity = std::strtoul(argv[3], nullptr, 10);
  rc.device.arbiter.share = std::atof(argv[4]);
  rc.device.arbiter.label = argc > 9 ? argv[9] : "job";
  const int priority = std::atoi(argv[5]);
  const long items = std::atol(argv[6]);
  const auto kernel = std::chrono::microseconds(std::atol(argv[7]));
  const auto cpu = std::chrono::microseconds(std::atol(argv[8]));
  Runtime rt(rc);
  GraphOptions go;
  go.priority = priority;
  Graph g(rt, "job", go);
  long next = 0, sum = 0, count = 0;
  auto src = g.source("items", [&]() -> std::optional<long> {
    if (next >= items) return std::nullopt;
    return next++;
  });
  StageOptions so;
  so.concurrency = 2;
  auto work = g.stage("cpu", [cpu](long i) {
    const auto until = std::chrono::steady_clock::now() + cpu;
    while (std::chrono::steady_clock::now() < until) {
    }
    HostTensor t = HostTensor::empty(DType::i64, {1});
    *t.data<std::int64_t>() = i;
    return t;
  }, so);
  auto gpu = g.gpu_stage("kernel", [kernel](DeviceTensor t, DeviceContext& ctx) {
    ops::busy_kernel(ctx, kernel);
    return ctx.to_host(t);
  });
  auto sink = g.sink("sink", [&](HostTensor h) {
    sum += *h.data<std::int64_t>();
    ++count;
  });
  src >> work >> gpu >> sink;
  const auto t0 = std::chrono::steady_clock::now();
  auto r = g.run();
  const RunStatus st = r.wait();
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const DeviceStats d = rt.device_stats().value();
  const GpuStats gs = r.stats().gpu;
  std::printf("{\"pid\": %d, \"status\": \"%s\", \"items\": %ld, \"sum\": %ld, \"leases\": %llu, "
              "\"busy_ns\": %lld, \"held_ns\": %lld, \"wall_s\": %.6f, \"rate\": %.3f, "
              "\"graph_bursts\": %llu, \"graph_held_ns\": %lld, \"graph_busy_ns\": %lld}\n",
              static_cast<int>(::getpid()), to_string(st), count, sum,
              static_cast<unsigned long long>(d.leases), static_cast<long long>(d.busy_ns),
              static_cast<long long>(d.held_ns), wall, static_cast<double>(count) / wall,
              static_cast<unsigned long long>(gs.bursts), static_cast<long long>(gs.held_ns),
              static_cast<long long>(gs.busy_ns));
  std::fflush(stdout);
  return st == RunStatus::succeeded ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "script") return script(argc, argv);
  if (mode == "run") return run(argc, argv);
  std::fprintf(stderr, "usage: arbiter_member script|run ... (see the file's header)\n");
  return 2;
}
