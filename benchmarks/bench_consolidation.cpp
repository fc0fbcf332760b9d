// Consolidation: N training-style graphs, each `CPU stage (real CPU work) -> busy_kernel ->
// CPU sink`, sized so that their total CPU demand fits the cores and their total GPU demand
// fits one device. Two modes in one run:
//   BM_Consolidation/bundled/N  each graph owns a device and a stream for its whole run and
//                               does load-then-compute in sequence (the usual training loop):
//                               N devices, each held for the whole run
//   BM_Consolidation/split/N    all graphs share one device through the stream pool
// Counters: devices_used, device_busy (busy fraction of each device used), held_over_busy,
// busy_vs_demand (split: device busy fraction / the graphs' summed GPU duty), and
// min_throughput_ratio (the slowest graph's items/s over a graph's dedicated items/s, the
// dedicated run measured in the same process before the timed loop).
// SPLITFLOW_BENCH_SPLIT_STREAMS=k: the split runtime's stream pool has k streams (default: the
// DeviceConfig default).
// Host backend: kernels wait on a timer on one compute slot, like one full-size kernel at a
// time on a GPU. scripts/gpu-check.sh runs the CUDA equivalent on a GPU.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <splitflow/splitflow.hpp>
#include <vector>

#include "consolidation_workload.hpp"

namespace {

using namespace std::chrono_literals;

const consolidation::Job kJob{120, 2000us, 1500us, 4096};

struct Dedicated {
  double items_per_s;
  double duty;  // GPU busy / wall
};

// A graph alone on its own device, load-then-compute: the baseline every mode is compared to.
Dedicated dedicated() {
  splitflow::Runtime rt(consolidation::config(1));
  splitflow::Graph g(rt, "dedicated", {.max_in_flight = 1});
  consolidation::build(g, kJob, true);
  auto run = g.run();
  run.wait();
  const auto st = run.stats();
  return {kJob.items / (st.wall_ns / 1e9), static_cast<double>(st.gpu.busy_ns) / st.wall_ns};
}

void BM_bundled(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  const Dedicated base = dedicated();
  double min_ratio = 1e9, held = 0, busy = 0, device_busy = 0;
  for (auto _ : state) {
    std::vector<std::unique_ptr<splitflow::Runtime>> devices;  // one device per graph
    std::vector<std::unique_ptr<splitflow::Graph>> graphs;
    std::vector<splitflow::Run> runs;
    for (int k = 0; k < n; ++k) {
      devices.push_back(std::make_unique<splitflow::Runtime>(consolidation::config(1)));
      graphs.push_back(std::make_unique<splitflow::Graph>(*devices.back(), "job",
                                                          splitflow::GraphOptions{.max_in_flight = 1}));
      consolidation::build(*graphs.back(), kJob, true);
    }
    for (auto& g : graphs) runs.push_back(g->run());
    for (auto& r : runs) {
      r.wait();
      const auto st = r.stats();
      // The job owns its device for its whole run: held is its wall time.
      held += static_cast<double>(st.wall_ns);
      busy += static_cast<double>(st.gpu.busy_ns);
      device_busy += static_cast<double>(st.gpu.busy_ns) / st.wall_ns;
      min_ratio = std::min(min_ratio, kJob.items / (st.wall_ns / 1e9) / base.items_per_s);
    }
  }
  state.counters["devices_used"] = n;
  state.counters["device_busy"] = device_busy / (n * state.iterations());
  state.counters["held_over_busy"] = held / busy;  // each device held by its job throughout
  state.counters["min_throughput_ratio"] = min_ratio;
  state.counters["dedicated_duty"] = base.duty;
}

void BM_split(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  const Dedicated base = dedicated();
  double min_ratio = 1e9, held = 0, busy = 0, device_busy = 0, device_held = 0, device_work = 0;
  for (auto _ : state) {
    // One device, its stream pool shared by every graph. SPLITFLOW_BENCH_SPLIT_STREAMS=k cuts
    // the pool to k streams (1: one per host compute slot; docs/benchmarks.md).
    splitflow::RuntimeConfig c = consolidation::config(n);
    if (const char* k = std::getenv("SPLITFLOW_BENCH_SPLIT_STREAMS"); k && std::atoi(k) > 0)
      c.device.streams = static_cast<std::size_t>(std::atoi(k));
    splitflow::Runtime rt(c);
    std::vector<std::unique_ptr<splitflow::Graph>> graphs;
    std::vector<splitflow::Run> runs;
    for (int k = 0; k < n; ++k) {
      graphs.push_back(std::make_unique<splitflow::Graph>(rt, "job" + std::to_string(k)));
      consolidation::build(*graphs.back(), kJob, false);
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (auto& g : graphs) runs.push_back(g->run());
    for (auto& r : runs) {
      r.wait();
      const auto st = r.stats();
      held += static_cast<double>(st.gpu.held_ns);
      busy += static_cast<double>(st.gpu.busy_ns);
      min_ratio = std::min(min_ratio, kJob.items / (st.wall_ns / 1e9) / base.items_per_s);
    }
    const double wall = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
    const auto dev = *rt.device_stats();
    device_busy += static_cast<double>(dev.busy_ns) / wall;
    device_held += static_cast<double>(dev.held_ns);
    device_work += static_cast<double>(dev.busy_ns);
  }
  const double fraction = device_busy / state.iterations();
  state.counters["devices_used"] = 1;
  state.counters["device_busy"] = fraction;
  // The device: time some graph held a stream against time it worked.
  state.counters["held_over_busy"] = device_held / device_work;
  // Each graph's own: also counts its bursts queued behind the other graphs' kernels.
  state.counters["graph_held_over_busy"] = held / busy;
  state.counters["busy_vs_demand"] = fraction / (n * base.duty);
  state.counters["min_throughput_ratio"] = min_ratio;
  state.counters["dedicated_duty"] = base.duty;
}

}  // namespace

BENCHMARK(BM_bundled)->Name("BM_Consolidation/bundled")->Arg(2)->Iterations(3)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_split)->Name("BM_Consolidation/split")->Arg(2)->Iterations(3)->UseRealTime()->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
