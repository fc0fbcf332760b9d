// Per item-stage overhead of a 4-stage chain of trivial bodies: serial source, two parallel
// stages, an in-order serial sink. Three executors, same bodies, same token bound, same
// threads, in one run:
//   BM_ChainHop/splitflow                splitflow (telemetry on, the default)
//   BM_ChainHop/splitflow_notelemetry    splitflow with telemetry off
//   BM_ChainHop/splitflow_trace          splitflow recording a Chrome trace
//   BM_ChainHop/tbb_parallel_pipeline    tbb::parallel_pipeline
//   BM_ChainHop/tbb_flow_graph           tbb::flow graph (input, 2 function nodes, sequencer)
// Counter ns_per_item_stage = wall time / (items * 4).
#include <benchmark/benchmark.h>
#include <oneapi/tbb/flow_graph.h>
#include <oneapi/tbb/info.h>
#include <oneapi/tbb/parallel_pipeline.h>
#include <oneapi/tbb/task_arena.h>

#include <atomic>
#include <splitflow/splitflow.hpp>

namespace {

constexpr long kItems = 100000;
constexpr std::size_t kTokens = 64;
const int kThreads = tbb::info::default_concurrency();

// The same trivial bodies everywhere; the sink checks order.
inline long stage_a(long x) { return x * 3 + 1; }
inline long stage_b(long x) { return x ^ 0x5555; }
struct Sink {
  long expect = 0;
  long sum = 0;
  bool ordered = true;
  void operator()(long seq, long v) {
    ordered &= seq == expect++;
    sum += v;
  }
};

void report(benchmark::State& state, const Sink& sink) {
  if (!sink.ordered) state.SkipWithError("sink saw items out of order");
  state.SetItemsProcessed(state.iterations() * kItems);
  state.counters["ns_per_item_stage"] = benchmark::Counter(
      static_cast<double>(state.iterations() * kItems * 4),
      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

void splitflow_chain(benchmark::State& state, bool telemetry, bool trace = false) {
  splitflow::Runtime rt({.threads = kThreads, .telemetry = telemetry});
  splitflow::Graph g(rt, "chain", {.max_in_flight = kTokens, .trace = trace});
  Sink sink;
  auto src = g.source("src", [i = 0L]() mutable -> std::optional<std::pair<long, long>> {
    if (i == kItems) return std::nullopt;
    const long v = i++;
    return std::pair{v, v};
  });
  using P = std::pair<long, long>;
  auto a = g.stage("a", [](P p) { return P{p.first, stage_a(p.second)}; },
                   {.concurrency = splitflow::Concurrency::unlimited});
  auto b = g.stage("b", [](P p) { return P{p.first, stage_b(p.second)}; },
                   {.concurrency = splitflow::Concurrency::unlimited});
  auto s = g.sink("sink", [&](P p) { sink(p.first, p.second); });
  src >> a >> b >> s;
  for (auto _ : state) {
    sink.expect = 0;
    g.run().wait();
  }
  report(state, sink);
}

void BM_splitflow(benchmark::State& state) { splitflow_chain(state, true); }
void BM_splitflow_notelemetry(benchmark::State& state) { splitflow_chain(state, false); }
void BM_splitflow_trace(benchmark::State& state) { splitflow_chain(state, true, true); }

void BM_tbb_parallel_pipeline(benchmark::State& state) {
  tbb::task_arena arena(kThreads);
  Sink sink;
  using P = std::pair<long, long>;
  for (auto _ : state) {
    sink.expect = 0;
    arena.execute([&] {
      long i = 0;
      tbb::parallel_pipeline(
          kTokens,
          tbb::make_filter<void, P>(tbb::filter_mode::serial_in_order,
                                    [&](tbb::flow_control& fc) -> P {
                                      if (i == kItems) {
                                        fc.stop();
                                        return {};
                                      }
                                      const long v = i++;
                                      return {v, v};
                                    }) &
              tbb::make_filter<P, P>(tbb::filter_mode::parallel,
                                     [](P p) { return P{p.first, stage_a(p.second)}; }) &
              tbb::make_filter<P, P>(tbb::filter_mode::parallel,
                                     [](P p) { return P{p.first, stage_b(p.second)}; }) &
              tbb::make_filter<P, void>(tbb::filter_mode::serial_in_order,
                                        [&](P p) { sink(p.first, p.second); }));
    });
  }
  report(state, sink);
}

void BM_tbb_flow_graph(benchmark::State& state) {
  namespace flow = tbb::flow;
  tbb::task_arena arena(kThreads);
  Sink sink;
  using P = std::pair<long, long>;
  for (auto _ : state) {
    sink.expect = 0;
    arena.execute([&] {
      flow::graph g;
      long i = 0;
      flow::input_node<P> src(g, [&](tbb::flow_control& fc) -> P {
        if (i == kItems) {
          fc.stop();
          return {};
        }
        const long v = i++;
        return {v, v};
      });
      flow::limiter_node<P> limit(g, kTokens);
      flow::function_node<P, P> a(g, flow::unlimited, [](P p) { return P{p.first, stage_a(p.second)}; });
      flow::function_node<P, P> b(g, flow::unlimited, [](P p) { return P{p.first, stage_b(p.second)}; });
      flow::sequencer_node<P> order(g, [](const P& p) { return static_cast<std::size_t>(p.first); });
      flow::function_node<P, flow::continue_msg> out(g, flow::serial, [&](P p) {
        sink(p.first, p.second);
        return flow::continue_msg();
      });
      flow::make_edge(src, limit);
      flow::make_edge(limit, a);
      flow::make_edge(a, b);
      flow::make_edge(b, order);
      flow::make_edge(order, out);
      flow::make_edge(out, limit.decrementer());
      src.activate();
      g.wait_for_all();
    });
  }
  report(state, sink);
}

}  // namespace

BENCHMARK(BM_splitflow)->Name("BM_ChainHop/splitflow")->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_splitflow_notelemetry)->Name("BM_ChainHop/splitflow_notelemetry")->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_splitflow_trace)->Name("BM_ChainHop/splitflow_trace")->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_tbb_parallel_pipeline)->Name("BM_ChainHop/tbb_parallel_pipeline")->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_tbb_flow_graph)->Name("BM_ChainHop/tbb_flow_graph")->UseRealTime()->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
