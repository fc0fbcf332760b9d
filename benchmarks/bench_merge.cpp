// A merge: W sources into one stage, then a sink, at the default input capacity. The cost per
// item should not grow with W (each blocked producer is woken only when it can make progress).
//   BM_Merge/W                 W sources of kItems / W items each into one stage
// Counter ns_per_item = wall time / items. The figure of merit is the ratio of W = 128 to W = 2
// in the same run (benchmarks/summary.py).
#include <benchmark/benchmark.h>
#include <oneapi/tbb/info.h>

#include <atomic>
#include <splitflow/splitflow.hpp>
#include <string>

namespace {

constexpr long kItems = 128'000;
const int kThreads = tbb::info::default_concurrency();

void BM_Merge(benchmark::State& state) {
  const long w = state.range(0);
  splitflow::Runtime rt({.threads = kThreads});
  splitflow::Graph g(rt, "merge", {.max_in_flight = 1024});
  auto merge = g.stage("merge", [](long x) { return x ^ 0x5555; },
                       {.concurrency = splitflow::Concurrency::unlimited,
                        .order = splitflow::Order::out_of_order});
  long sum = 0, n = 0;
  auto sink = g.sink("sink", [&](long x) {
    sum += x;
    ++n;
  });
  for (long k = 0; k < w; ++k) {
    auto src = g.source("s" + std::to_string(k), [i = 0L, each = kItems / w]() mutable -> std::optional<long> {
      if (i == each) return std::nullopt;
      return i++;
    });
    src >> merge;
  }
  merge >> sink;
  for (auto _ : state) {
    n = 0;
    g.run().wait();
    if (n != kItems / w * w) state.SkipWithError("items lost");
  }
  benchmark::DoNotOptimize(sum);
  state.SetItemsProcessed(state.iterations() * kItems);
  state.counters["ns_per_item"] = benchmark::Counter(
      static_cast<double>(state.iterations() * kItems),
      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

}  // namespace

BENCHMARK(BM_Merge)->Name("BM_Merge")->Arg(2)->Arg(8)->Arg(32)->Arg(128)->UseRealTime()->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
