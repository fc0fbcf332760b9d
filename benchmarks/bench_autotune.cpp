// Autotune on live runs (issue 17; docs/autotune.md): synthetic pipelines whose best rate can be
// computed, started from the worst configuration (every automatic stage at concurrency 1), the
// tuner's steady rate against that bound and against the best hand-set configuration of a grid
// search in the same run, and how long it took to get there.
//
//   BM_AutotuneChain/auto   source >> a (spins 100 us an item) >> b (300 us) >> sink, a and b
//                           Concurrency::automatic, on a runtime of `cores` threads (all of
//                           this machine's: 2 here), a 100 ms window, 5 s. Bound: cores / 400 us
//                           (the bodies' CPU time, no serial stage). Counters: tuned_rate (items/s
//                           over the run's last second), bound_rate, rate_over_bound,
//                           seconds_to_95 (the end of the first 0.5 s over which the rate was at
//                           least 0.95 of the grid's best; -1: never), final concurrencies;
//                           the tuner's decisions are printed to stderr; queued_items (mean
//                           items queued at a and b over the last second), and the same graph
//                           with its queues as sized (autotune_queues false) in the same run:
//                           fixed_queues_rate, rate_over_fixed_queues, fixed_queues_queued_items.
//   BM_AutotuneChain/grid   the same graph with hand-set concurrencies a, b in 1..3 each, 1.5 s
//                           each; best_rate is the best of the grid (its last second's rate),
//                           best_a / best_b where it was.
//   BM_AutotuneGpu/auto     source >> prep (spins 200 us, automatic) >> model (a GPU stage:
//                           busy_kernel 500 us on the host backend's one compute slot) >> sink:
//                           the device bounds the rate at 2,000 items/s, which 0.4 of a core of
//                           prep feeds. Counters: device_busy (over the last second), prep's
//                           cores (its work over the last second), fewest_cores (the whole cores
//                           that keep the device busy: ceil(0.4) = 1), prep_concurrency;
//                           best_grid_busy: the most the device is busy under hand-set prep 1-3
//                           x bursts 2, 4 (1.5 s each, same run), busy_over_best_grid.
//   BM_AutotuneTwoGraphs/auto  two graphs, each the chain on automatic, on one runtime of
//                           `cores` threads: their tuners share the threads (TuningBoard). The
//                           bound: cores / 400 us summed over both. Counters over the last of
//                           5 s: total_rate, bound_rate, rate_over_bound, slower_over_faster.
//   BM_AutotuneIo/auto      source >> read (an async stage whose answers come 3 ms later from a
//                           timer thread: I/O latency without CPU or an arena thread) >> parse
//                           (spins 300 us) >> sink, both automatic, `cores` threads, 5 s. Bound:
//                           cores / 300 us (the CPU per item; read's latency is hidden by 20
//                           reads out at once, which the tuner must find: past the cores).
//                           Counters: tuned_rate, bound_rate, rate_over_bound, seconds_to_95 (of
//                           the bound), read_concurrency, and threads_only_rate: the same graph
//                           with read held at the threads' count (what a stage that held a
//                           thread while it waited could reach), measured in the same run.
//   BM_AutotuneIo/blocking  the same with read a synchronous body that sleeps 3 ms, given
//                           StageOptions::blocking: it waits on the runtime's blocking threads
//                           (its CPU charged from them), which the tuner must take past the cores.
//   BM_AutotuneIo/placed    the same sleeping body on automatic without StageOptions::blocking,
//                           two epochs of graph "io" on one runtime: the first (2 s) on the
//                           arena, whose end moves read to the blocking threads
//                           (autotune::body_placement), the second (5 s) built anew. Counters as
//                           blocking's, threads_only_rate the first epoch's, placed_on_blocking.
//
// Every run's rate is sampled from Run::stats() every 50 ms by the benchmark's thread (which only
// waits and reads: the sampling is the measurement, not a synchronisation).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <optional>
#include <splitflow/ops/ops.hpp>
#include <splitflow/splitflow.hpp>
#include <thread>
#include <vector>

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
namespace sf = splitflow;

void spin(std::chrono::microseconds d) {
  const auto until = Clock::now() + d;
  while (Clock::now() < until) {
  }
}

int cores() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

struct Sample {
  double t;                         // seconds since the run started
  std::uint64_t items;              // delivered
  std::int64_t work_ns;             // of the first stage watched
  std::int64_t call_ns;             // of the first stage watched (async and blocking stages' CPU)
  std::int64_t busy_ns;             // the device's (GpuStats::busy_ns)
  std::vector<std::size_t> limits;  // the watched stages' concurrency limits
  double queue_area;                // items queued at the watched stages x seconds, so far
};

/// Runs `g` for `seconds` (its source never ends: the run is cancelled), sampling every 50 ms;
/// the tuner's decisions go to `decisions` if given.
std::vector<Sample> sample_run(sf::Graph& g, double seconds, std::vector<const char*> watch,
                               std::vector<std::string>* decisions = nullptr) {
  std::vector<Sample> out;
  auto run = g.run();
  const auto t0 = Clock::now();
  for (;;) {
    std::this_thread::sleep_for(50ms);
    const double t = std::chrono::duration<double>(Clock::now() - t0).count();
    const sf::RunStats st = run.stats();
    Sample x{t, st.items_delivered(), st.find(watch.front())->work_ns,
             st.find(watch.front())->call_ns, st.gpu.busy_ns, {}, 0};
    for (const char* name : watch) {
      x.limits.push_back(st.find(name)->concurrency_limit);
      x.queue_area += st.find(name)->mean_queue * static_cast<double>(st.wall_ns) * 1e-9;
    }
    out.push_back(std::move(x));
    if (t >= seconds) {
      if (decisions) *decisions = st.autotune;
      break;
    }
  }
  run.cancel();
  run.wait();
  return out;
}

/// Items/s between the last sample and the one `span` seconds before it (or the first).
double rate_over_last(const std::vector<Sample>& s, double span, std::size_t end) {
  std::size_t i = end;
  while (i > 0 && s[end].t - s[i].t < span) --i;
  const double dt = s[end].t - s[i].t;
  return dt > 0 ? static_cast<double>(s[end].items - s[i].items) / dt : 0;
}

/// Items queued at the watched stages, on average over the last `span` seconds.
double queued_over_last(const std::vector<Sample>& s, double span) {
  std::size_t i = s.size() - 1;
  while (i > 0 && s.back().t - s[i].t < span) --i;
  const double dt = s.back().t - s[i].t;
  return dt > 0 ? (s.back().queue_area - s[i].queue_area) / dt : 0;
}

/// The end of the first `span` seconds over which the rate reached `target` (-1: never).
double seconds_to(const std::vector<Sample>& s, double target, double span) {
  for (std::size_t k = 0; k < s.size(); ++k)
    if (s[k].t >= span && rate_over_last(s, span, k) >= target) return s[k].t;
  return -1;
}

std::optional<long> forever(long& i) { return i++; }

constexpr auto kA = 100us, kB = 300us;

/// The chain with concurrencies a and b (0: Concurrency::automatic); `queues`:
/// GraphOptions::autotune_queues.
std::vector<Sample> chain(std::size_t a, std::size_t b, double seconds, std::size_t* final_a,
                          std::size_t* final_b, std::vector<std::string>* decisions = nullptr,
                          bool queues = true) {
  sf::Runtime rt({.threads = cores()});
  sf::Graph g(rt, "chain", {.autotune_window = 100ms, .autotune_queues = queues});
  const auto conc = [](std::size_t n) { return n ? n : sf::Concurrency::automatic; };
  auto src = g.source("n", [i = 0L]() mutable { return forever(i); });
  auto sa = g.stage("a", [](long x) { spin(kA); return x; }, {.concurrency = conc(a)});
  auto sb = g.stage("b", [](long x) { spin(kB); return x; }, {.concurrency = conc(b)});
  auto sink = g.sink("s", [](long) {});
  src >> sa >> sb >> sink;
  auto s = sample_run(g, seconds, {"a", "b"}, decisions);
  if (final_a) *final_a = s.back().limits[0];
  if (final_b) *final_b = s.back().limits[1];
  return s;
}

double best_grid_rate(std::size_t* best_a, std::size_t* best_b) {
  double best = 0;
  for (std::size_t a = 1; a <= 3; ++a)
    for (std::size_t b = 1; b <= 3; ++b) {
      const auto s = chain(a, b, 1.5, nullptr, nullptr);
      const double r = rate_over_last(s, 1.0, s.size() - 1);
      if (r > best) {
        best = r;
        *best_a = a;
        *best_b = b;
      }
    }
  return best;
}

// The grid's best, measured once per process and shared by the two chain benchmarks.
double grid_best(std::size_t* a = nullptr, std::size_t* b = nullptr) {
  static std::size_t ga = 0, gb = 0;
  static const double best = best_grid_rate(&ga, &gb);
  if (a) *a = ga;
  if (b) *b = gb;
  return best;
}

void BM_AutotuneChainGrid(benchmark::State& state) {
  std::size_t a = 0, b = 0;
  double best = 0;
  for (auto _ : state) best = grid_best(&a, &b);
  state.counters["best_rate"] = best;
  state.counters["best_a"] = static_cast<double>(a);
  state.counters["best_b"] = static_cast<double>(b);
}

void BM_AutotuneChainAuto(benchmark::State& state) {
  const double best = grid_best();
  std::vector<Sample> s;
  std::size_t fa = 0, fb = 0;
  std::vector<std::string> decisions;
  std::vector<Sample> fixed;
  for (auto _ : state) {
    // The same with the queues at their sized capacity (GraphOptions::autotune_queues false).
    fixed = chain(0, 0, 5.0, nullptr, nullptr, nullptr, false);
    s = chain(0, 0, 5.0, &fa, &fb, &decisions);
  }
  for (const std::string& d : decisions) std::fprintf(stderr, "  tuner: %s\n", d.c_str());
  const double rate = rate_over_last(s, 1.0, s.size() - 1);
  const double fixed_rate = rate_over_last(fixed, 1.0, fixed.size() - 1);
  state.counters["fixed_queues_rate"] = fixed_rate;
  state.counters["rate_over_fixed_queues"] = fixed_rate > 0 ? rate / fixed_rate : 0;
  state.counters["queued_items"] = queued_over_last(s, 1.0);
  state.counters["fixed_queues_queued_items"] = queued_over_last(fixed, 1.0);
  const double bound = static_cast<double>(cores()) / std::chrono::duration<double>(kA + kB).count();
  state.counters["tuned_rate"] = rate;
  state.counters["bound_rate"] = bound;
  state.counters["rate_over_bound"] = rate / bound;
  state.counters["best_grid_rate"] = best;
  state.counters["rate_over_best_grid"] = best > 0 ? rate / best : 0;
  state.counters["seconds_to_95"] = seconds_to(s, 0.95 * best, 0.5);
  state.counters["final_a"] = static_cast<double>(fa);
  state.counters["final_b"] = static_cast<double>(fb);
}

/// The GPU-bound graph with concurrencies prep and model (0: Concurrency::automatic).
std::vector<Sample> gpu_graph(std::size_t prep_n, std::size_t model_n, double seconds,
                              std::vector<std::string>* decisions) {
  const auto conc = [](std::size_t n) { return n ? n : sf::Concurrency::automatic; };
  sf::RuntimeConfig c{.threads = cores()};
  c.device.backend = sf::BackendKind::host;
  c.device.host_compute_slots = 1;
  sf::Runtime rt(c);
  sf::Graph g(rt, "gpu-bound", {.autotune_window = 100ms});
  auto src = g.source("n", [i = 0L]() mutable { return forever(i); });
  auto prep = g.stage("prep", [](long) {
    spin(200us);
    return sf::HostTensor::empty(sf::DType::u8, {64});
  }, {.concurrency = conc(prep_n)});
  auto model = g.gpu_stage("model", [](sf::DeviceTensor t, sf::DeviceContext& ctx) {
    sf::ops::busy_kernel(ctx, 500us);
    return t;
  }, {.concurrency = conc(model_n)});
  auto sink = g.sink("s", [](sf::DeviceTensor) {});
  src >> prep >> model >> sink;
  return sample_run(g, seconds, {"prep", "model"}, decisions);
}

/// The device's busy fraction over the last `span` seconds of `s`.
double busy_over_last(const std::vector<Sample>& s, double span) {
  std::size_t i = s.size() - 1;
  while (i > 0 && s.back().t - s[i].t < span) --i;
  const double dt = s.back().t - s[i].t;
  return dt > 0 ? static_cast<double>(s.back().busy_ns - s[i].busy_ns) * 1e-9 / dt : 0;
}

void BM_AutotuneGpu(benchmark::State& state) {
  std::vector<Sample> s;
  std::vector<std::string> decisions;
  double best_busy = 0;
  for (auto _ : state) {
    // What the host backend's device reaches at best, whatever the settings: a grid of hand-set
    // concurrencies in the same run (prep 1, 2, 3 x bursts in flight 2, 4).
    for (std::size_t p = 1; p <= 3; ++p)
      for (std::size_t m : {2, 4}) best_busy = std::max(best_busy, busy_over_last(gpu_graph(p, m, 1.5, nullptr), 1.0));
    s = gpu_graph(0, 0, 5.0, &decisions);
  }
  for (const std::string& d : decisions) std::fprintf(stderr, "  tuner: %s\n", d.c_str());
  // Over the last second.
  std::size_t i = s.size() - 1;
  while (i > 0 && s.back().t - s[i].t < 1.0) --i;
  const double dt = s.back().t - s[i].t;
  state.counters["rate"] = static_cast<double>(s.back().items - s[i].items) / dt;
  state.counters["device_busy"] = busy_over_last(s, 1.0);
  state.counters["best_grid_busy"] = best_busy;
  state.counters["busy_over_best_grid"] = best_busy > 0 ? busy_over_last(s, 1.0) / best_busy : 0;
  state.counters["prep_cores"] = static_cast<double>(s.back().work_ns - s[i].work_ns) * 1e-9 / dt;
  state.counters["fewest_cores"] = std::ceil(2000.0 * 200e-6);  // the device's rate x prep's cost
  state.counters["prep_concurrency"] = static_cast<double>(s.back().limits[0]);
  state.counters["model_concurrency"] = static_cast<double>(s.back().limits[1]);
}

constexpr std::chrono::microseconds kReadLatency = 3ms, kParse = 300us;

/// How the I/O chain's read waits: an async stage answered by a timer thread; a synchronous
/// body that sleeps, given StageOptions::blocking (it holds a blocking thread while it waits);
/// or the same body without it, on automatic (placed where its bodies' measured times say).
enum class Read { async, blocking, placed };

/// The I/O chain with read's concurrency `read` (0: Concurrency::automatic), on `rt` (null: a
/// runtime of its own).
std::vector<Sample> io_chain(std::size_t read, double seconds, std::vector<std::string>* decisions,
                             Read how = Read::async, sf::Runtime* rt = nullptr) {
  std::optional<sf::Runtime> own;
  if (!rt) rt = &own.emplace(sf::RuntimeConfig{.threads = cores()});
  sf::Graph g(*rt, "io", {.autotune_window = 100ms});
  auto clock = sf::BatchClock::steady();
  auto src = g.source("n", [i = 0L]() mutable { return forever(i); });
  const std::size_t k = read ? read : sf::Concurrency::automatic;
  auto sleeper = [](long x) { std::this_thread::sleep_for(kReadLatency); return x; };
  auto rd = how != Read::async
                ? g.stage("read", sleeper, {.concurrency = k, .blocking = how == Read::blocking})
                : g.async_stage<long, long>("read", [clock](long x, sf::Completion<long> c) {
                    auto held = std::make_shared<sf::Completion<long>>(std::move(c));
                    clock->call_at(clock->now() + kReadLatency, [held, x] { held->done(x); });
                  }, {.concurrency = k});
  auto parse = g.stage("parse", [](long x) { spin(kParse); return x; },
                       {.concurrency = sf::Concurrency::automatic});
  src >> rd >> parse >> g.sink("s", [](long) {});
  return sample_run(g, seconds, {"read", "parse"}, decisions);
}

void io_bench(benchmark::State& state, Read how) {
  std::vector<Sample> s, held;
  std::vector<std::string> decisions, first;
  for (auto _ : state) {
    if (how == Read::placed) {
      // Two epochs of a graph of one name on one runtime: the first on the arena, where read's
      // sleeping bodies hold the threads (its end moves it); the second built anew.
      sf::Runtime rt({.threads = cores()});
      held = io_chain(0, 2.0, &first, how, &rt);
      s = io_chain(0, 5.0, &decisions, how, &rt);
    } else {
      held = io_chain(static_cast<std::size_t>(cores()), 2.0, nullptr, how);
      s = io_chain(0, 5.0, &decisions, how);
    }
  }
  for (const std::string& d : first) std::fprintf(stderr, "  tuner (first epoch): %s\n", d.c_str());
  for (const std::string& d : decisions) std::fprintf(stderr, "  tuner: %s\n", d.c_str());
  const double rate = rate_over_last(s, 1.0, s.size() - 1);
  const double bound = static_cast<double>(cores()) / std::chrono::duration<double>(kParse).count();
  state.counters["tuned_rate"] = rate;
  state.counters["bound_rate"] = bound;
  state.counters["rate_over_bound"] = rate / bound;
  state.counters["seconds_to_95"] = seconds_to(s, 0.95 * bound, 0.5);
  state.counters["read_concurrency"] = static_cast<double>(s.back().limits[0]);
  state.counters["parse_concurrency"] = static_cast<double>(s.back().limits[1]);
  // The read held at the threads' count; for `placed`, its first epoch, on the arena.
  state.counters["threads_only_rate"] = rate_over_last(held, 1.0, held.size() - 1);
  if (how == Read::placed)  // 1: the second epoch's read ran on the blocking threads
    state.counters["placed_on_blocking"] = s.back().call_ns >= 0 ? 1 : 0;
  // What read's bodies cost in CPU per item over the last second (its calls, and for a
  // blocking stage the thread CPU its bodies charged: waking from the sleep is not free), and
  // the bound with it counted: cores / (parse + read's CPU).
  std::size_t i = s.size() - 1;
  while (i > 0 && s.back().t - s[i].t < 1.0) --i;
  const double items = static_cast<double>(s.back().items - s[i].items);
  const double read_cpu = items > 0 && s.back().call_ns >= 0
                              ? static_cast<double>(s.back().call_ns - s[i].call_ns) * 1e-9 / items
                              : 0;
  const double cpu_bound = static_cast<double>(cores()) /
                           (std::chrono::duration<double>(kParse).count() + read_cpu);
  state.counters["read_cpu_us"] = read_cpu * 1e6;
  state.counters["rate_over_cpu_bound"] = rate / cpu_bound;
}

void BM_AutotuneIo(benchmark::State& state) { io_bench(state, Read::async); }
void BM_AutotuneIoBlocking(benchmark::State& state) { io_bench(state, Read::blocking); }
void BM_AutotuneIoPlaced(benchmark::State& state) { io_bench(state, Read::placed); }

}  // namespace

// Two graphs, each the chain on automatic, on one runtime of cores() threads: the tuners share
// the threads (TuningBoard); the bound is the cores over the CPU per item, summed over both.
void BM_AutotuneTwoGraphs(benchmark::State& state) {
  double total = 0, low = 0, high = 0;
  std::vector<std::string> d1, d2;
  for (auto _ : state) {
    sf::Runtime rt({.threads = cores()});
    std::vector<std::unique_ptr<sf::Graph>> graphs;
    std::vector<sf::Run> runs;
    for (const char* name : {"one", "two"}) {
      auto g = std::make_unique<sf::Graph>(rt, name, sf::GraphOptions{.autotune_window = 100ms});
      auto src = g->source("n", [i = 0L]() mutable { return forever(i); });
      auto sa = g->stage("a", [](long x) { spin(kA); return x; }, {.concurrency = sf::Concurrency::automatic});
      auto sb = g->stage("b", [](long x) { spin(kB); return x; }, {.concurrency = sf::Concurrency::automatic});
      src >> sa >> sb >> g->sink("s", [](long) {});
      graphs.push_back(std::move(g));
    }
    for (auto& g : graphs) runs.push_back(g->run());
    std::this_thread::sleep_for(4s);
    std::uint64_t before[2];
    for (int k = 0; k < 2; ++k) before[k] = runs[k].stats().items_delivered();
    const auto t0 = Clock::now();
    std::this_thread::sleep_for(1s);
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    double rate[2];
    for (int k = 0; k < 2; ++k) {
      const sf::RunStats st = runs[k].stats();
      rate[k] = static_cast<double>(st.items_delivered() - before[k]) / dt;
      (k == 0 ? d1 : d2) = st.autotune;
    }
    for (auto& r : runs) r.cancel();
    for (auto& r : runs) r.wait();
    total = rate[0] + rate[1];
    low = std::min(rate[0], rate[1]);
    high = std::max(rate[0], rate[1]);
  }
  for (const std::string& d : d1) std::fprintf(stderr, "  one: %s\n", d.c_str());
  for (const std::string& d : d2) std::fprintf(stderr, "  two: %s\n", d.c_str());
  const double bound = static_cast<double>(cores()) / std::chrono::duration<double>(kA + kB).count();
  state.counters["total_rate"] = total;
  state.counters["bound_rate"] = bound;
  state.counters["rate_over_bound"] = total / bound;
  state.counters["slower_over_faster"] = high > 0 ? low / high : 0;
}

BENCHMARK(BM_AutotuneChainGrid)->Name("BM_AutotuneChain/grid")->Iterations(1)->Unit(benchmark::kSecond);
BENCHMARK(BM_AutotuneChainAuto)->Name("BM_AutotuneChain/auto")->Iterations(1)->Unit(benchmark::kSecond);
BENCHMARK(BM_AutotuneGpu)->Name("BM_AutotuneGpu/auto")->Iterations(1)->Unit(benchmark::kSecond);
BENCHMARK(BM_AutotuneIo)->Name("BM_AutotuneIo/auto")->Iterations(1)->Unit(benchmark::kSecond);
BENCHMARK(BM_AutotuneIoBlocking)->Name("BM_AutotuneIo/blocking")->Iterations(1)->Unit(benchmark::kSecond);
BENCHMARK(BM_AutotuneIoPlaced)->Name("BM_AutotuneIo/placed")->Iterations(1)->Unit(benchmark::kSecond);
BENCHMARK(BM_AutotuneTwoGraphs)->Name("BM_AutotuneTwoGraphs/auto")->Iterations(1)->Unit(benchmark::kSecond);
BENCHMARK_MAIN();
