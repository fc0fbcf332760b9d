// Telemetry (a policy of every node kind): latency histograms, queue occupancy, the diagnosis
// of planted bottlenecks, the observer interface, bounded traces, and the consistency of the
// figures. Checks docs/telemetry.md, "Figures", "JSON summary (`to_json`)", "Chrome trace
// (`Run::trace_json`, with `GraphOptions::trace`)", "Prometheus text (`prometheus_text`)",
// "Observer" and "Diagnosis (`diagnose`, the end of `report`)", and docs/architecture.md,
// "Statistics". Each test quotes the requirement it checks.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <random>
#include <regex>
#include <splitflow/ops/ops.hpp>
#include <splitflow/serving/batching.hpp>
#include <splitflow/serving/service.hpp>
#include <splitflow/splitflow.hpp>
#include <thread>

#include "helpers.hpp"

using namespace splitflow;
using namespace std::chrono_literals;
using testing_helpers::counter;
using testing_helpers::spin_us;

namespace {

RuntimeConfig host(int threads, std::size_t streams = 4, int slots = 1) {
  RuntimeConfig c{.threads = threads};
  c.device.backend = BackendKind::host;
  c.device.streams = streams;
  c.device.host_compute_slots = slots;
  return c;
}

// "For every test graph: busy + starved + blocked accounts for each stage's wall time within a
// tolerance; held >= busy per graph; device busy <= 1"
void expect_consistent(const RunStats& st, const std::optional<DeviceStats>& dev = {}) {
  for (const auto& s : st.stages) {
    EXPECT_NEAR(static_cast<double>(s.busy_ns + s.starved_ns + s.blocked_ns),
                static_cast<double>(st.wall_ns), 1e-3 * static_cast<double>(st.wall_ns) + 1000.0)
        << s.name;
    EXPECT_LE(s.latency.count(), s.items_in + s.items_out) << s.name;
  }
  EXPECT_GE(st.gpu.held_ns, st.gpu.busy_ns);
  if (dev) {
    EXPECT_LE(dev->busy_fraction(), 1.0);
    EXPECT_GE(dev->busy_fraction(), 0.0);
  }
}

bool contains(const std::vector<std::string>& lines, const std::string& text) {
  for (const auto& l : lines)
    if (l.find(text) != std::string::npos) return true;
  return false;
}

std::string join(const std::vector<std::string>& lines) {
  std::string out;
  for (const auto& l : lines) out += l + "\n";
  return out;
}

// A producer of `items` tensors of `item` bytes in ring space (`spin` us each) into a GPU stage
// of 4 bursts of 100 us kernels through a ring of `ring_bytes` (automatic or set) with
// `item` bytes per item; the source starts again at each run.
void small_ring_graph(Graph& g, long items, std::int64_t item, std::size_t ring_bytes, double spin) {
  auto src = g.source("files", [items, i = 0L]() mutable -> std::optional<long> {
    if (i == items) {
      i = 0;  // the next run reads them again
      return std::nullopt;
    }
    return i++;
  });
  auto load = g.stage("load", [item, spin](long, HostAllocator& a) {
    HostTensor t = a.empty(DType::u8, {item});
    spin_us(spin);  // producing it
    return t;
  });
  GpuStageOptions o;
  o.concurrency = 4;
  o.ring_bytes = ring_bytes;
  o.ring_item_bytes = static_cast<std::size_t>(item);
  auto model = g.gpu_stage("model", [](DeviceTensor t, DeviceContext& ctx) {
    ops::busy_kernel(ctx, 100us);
    return t;
  }, o);
  auto sink = g.sink("step", [](DeviceTensor) {});
  src >> load >> model >> sink;
}

}  // namespace

// "per-item latency p50/p95/p99 (an HDR-style or log-bucket histogram, fixed memory)"
TEST(Histogram, PercentilesAreWithinABucketOfTheTruthInFixedMemory) {
  static_assert(sizeof(LatencyHistogram) < 5 * 1024, "fixed memory, whatever the run length");
  LatencyHistogram h;
  std::mt19937_64 rng(1);
  std::vector<std::uint64_t> values;
  for (int i = 0; i < 100000; ++i) {
    const auto v = static_cast<std::uint64_t>(std::exp(std::uniform_real_distribution<double>(0, 20)(rng)));
    values.push_back(v);
    h.record(v);
  }
  std::sort(values.begin(), values.end());
  for (double p : {50.0, 95.0, 99.0}) {
    const double truth = static_cast<double>(values[static_cast<std::size_t>(p / 100 * (values.size() - 1))]);
    const double got = static_cast<double>(h.percentile(p));
    EXPECT_GE(got, truth * 0.999) << "p" << p;
    EXPECT_LE(got, truth * 1.13 + 1) << "p" << p;  // 8 buckets per power of two: <= 12.5% above
  }
  EXPECT_EQ(h.count(), 100000u);
  EXPECT_EQ(h.max(), values.back());
  LatencyHistogram twice = h;
  twice.merge(h);
  EXPECT_EQ(twice.count(), 200000u);
  EXPECT_EQ(twice.percentile(50), h.percentile(50));
  EXPECT_EQ(LatencyHistogram{}.percentile(99), 0u);
}

// Latencies are recorded per thread (no shared histogram under the stage lock) and merged on
// reading: with parallel claims on every arena thread and a pull sink read from outside the
// arena, each stage still counts every item exactly once, in the snapshot and the final stats.
TEST(Figures, LatencyCountsEveryItemOnceAcrossThreads) {
  Runtime rt({.threads = 4});
  Graph g(rt, "shards", {.max_in_flight = 256});
  constexpr long kItems = 20000;
  auto src = g.source("n", counter(kItems));
  auto a = g.stage("a", [](long x) { return x + 1; }, {.concurrency = Concurrency::unlimited});
  auto b = g.stage("b", [](long x) { return x * 2; },
                   {.concurrency = Concurrency::unlimited, .order = Order::out_of_order});
  auto out = g.pull_sink<long>("out");
  src >> a >> b >> out;
  auto run = g.run();
  long got = 0;
  while (auto v = out.next()) {
    if (++got == kItems / 2) {
      const RunStats mid = run.stats();  // merging shards while they are written
      EXPECT_LE(mid.find("a")->latency.count(), static_cast<std::uint64_t>(kItems));
    }
  }
  run.wait();
  EXPECT_EQ(got, kItems);
  const RunStats st = run.stats();
  for (const char* name : {"a", "b"})
    EXPECT_EQ(st.find(name)->latency.count(), static_cast<std::uint64_t>(kItems)) << name;
  // The run completed when the last item reached the pull sink's queue; its final figures
  // also count the items taken after the run's end, latencies included.
  const StageStats& o = *st.find("out");
  EXPECT_EQ(o.items_in, static_cast<std::uint64_t>(kItems));
  EXPECT_EQ(o.items_out, static_cast<std::uint64_t>(kItems));
  EXPECT_EQ(o.latency.count(), o.items_out);
  expect_consistent(st);
}

// Per stage: latency of known work, and queue occupancy averaged over time.
TEST(Figures, LatencyAndMeanQueueReflectTheWork) {
  Runtime rt({.threads = 2});
  Graph g(rt, "figures");
  auto src = g.source("n", counter(200));
  auto slow = g.stage("slow", [](long x) { spin_us(300); return x; }, {.capacity = 8});
  auto sink = g.sink("s", [](long) {});
  src >> slow >> sink;
  auto run = g.run();
  run.wait();
  const RunStats st = run.stats();
  const StageStats& s = *st.find("slow");
  EXPECT_EQ(s.latency.count(), 200u);
  EXPECT_GE(s.latency.percentile(50), 300'000u) << "an item spends at least its 300 us body";
  // The fast source keeps the slow stage's queue well filled: 8 slots, one taken per claim.
  // (Refills wait their turn in the arena's FIFO once a thread's time slice is used up: under
  // TSan the mean came to 3.96.)
  EXPECT_GT(s.mean_queue, 3.0);
  EXPECT_LE(s.mean_queue, 8.0);
  // The fast sink's queue holds less than the slow stage's (near empty on a quiet machine; a
  // ctest -j2 run beside other suites measured 1.89 against the slow stage's 3-8).
  EXPECT_LT(st.find("s")->mean_queue, s.mean_queue) << "the fast sink's queue fills as the slow stage's";
  // A serial stage never runs two bodies at once: at most 1, exactly. How near 1 it comes
  // depends on the machine's load (0.949 under ASan beside other suites, where 0.05 was
  // allowed): busy most of the run is what is asserted, not a timing.
  EXPECT_LE(s.mean_concurrency(), 1.0 + 1e-9);
  EXPECT_GT(s.mean_concurrency(), 0.5);
  EXPECT_GT(st.throughput(), 0.0);
  EXPECT_EQ(st.items_delivered(), 200u);
  expect_consistent(st);
}

// A new C++ user's trial: a sink that skipped half its items (OnError::skip) counted them as
// delivered (items_delivered() summed the sinks' items_in: 100 of which 50 failed), and so did
// throughput(), the JSON summary and the report. A sink delivers what its body took; a pull
// sink what reached its reader's queue.
TEST(Stats, ItemsDeliveredLeavesOutTheItemsASinkSkipped) {
  Runtime rt({.threads = 2});
  Graph g(rt, "sink-skips");
  auto src = g.source("n", [i = 0]() mutable -> std::optional<int> {
    return i < 100 ? std::optional<int>(i++) : std::nullopt;
  });
  auto fork = g.stage("fork", [](int x) { return x; });
  auto sink = g.sink("odd-fails", [](int x) { if (x % 2) throw std::runtime_error("odd"); },
                     {.on_error = OnError::skip});
  auto pull = g.pull_sink<int>("pull", 128);
  src >> fork;
  fan_out(fork, sink, pull);
  auto run = g.run();
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
  const RunStats st = run.stats();
  EXPECT_EQ(st.find("odd-fails")->items_in, 100u);
  EXPECT_EQ(st.find("odd-fails")->items_skipped, 50u);
  EXPECT_EQ(st.items_delivered(), 50u + 100u) << "the sink's 50 bodies that succeeded, the pull sink's 100";
  EXPECT_NE(to_json(st).find("\"items_delivered\":150"), std::string::npos) << to_json(st);
  EXPECT_NE(report(st).find("150 items delivered"), std::string::npos) << report(st);
  // The items skipped are said in the report, not only in the figures (a new user's trial).
  EXPECT_NE(report(st).find("'odd-fails' skipped 50 items whose bodies threw (its "
                            "errors name the first 64: StageStats::errors"),
            std::string::npos) << report(st);
  EXPECT_EQ(report(st).find("'fork' skipped"), std::string::npos) << report(st);
}

// One of a thing is not "1 items" (a new user's trial read "(1 items delivered)" and "skipped 1
// items").
TEST(Stats, TheReportCountsOneItemInTheSingular) {
  Runtime rt({.threads = 2});
  Graph g(rt, "one-each");
  auto src = g.source("n", [i = 0]() mutable -> std::optional<int> {
    return i < 2 ? std::optional<int>(i++) : std::nullopt;
  });
  auto sink = g.sink("first-fails", [](int x) { if (x == 0) throw std::runtime_error("zero"); },
                     {.on_error = OnError::skip});
  src >> sink;
  auto run = g.run();
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
  const std::string text = report(run.stats());
  EXPECT_NE(text.find("(1 item delivered)"), std::string::npos) << text;
  EXPECT_NE(text.find("'first-fails' skipped 1 item whose body threw"), std::string::npos) << text;
  EXPECT_EQ(text.find("replaced 0"), std::string::npos) << text;
  // (A count of one, not the end of a figure: "667.1 items/s" made this fail on a CI run.)
  EXPECT_FALSE(std::regex_search(text, std::regex("(^|[^0-9.])1 items"))) << text;
}

// A stage that replaced items says that alone ("skipped 0 items and replaced 2" read as if it
// had skipped some: a re-read of the report); one that skipped, that alone.
TEST(Stats, TheReportSaysWhatAStageDidWithTheItemsWhoseBodiesThrew) {
  Runtime rt({.threads = 2});
  Graph g(rt, "replaced");
  auto src = g.source("n", [i = 0]() mutable -> std::optional<int> {
    return i < 6 ? std::optional<int>(i++) : std::nullopt;
  });
  auto sub = g.stage("sub", [](int x) { if (x < 2) throw std::runtime_error("small"); return x; },
                     {.on_error = OnError::substitute});
  sub.substitute_on_error(-1);
  auto both = g.sink("both", [](int x) { if (x == 5) throw std::runtime_error("five"); },
                     {.on_error = OnError::skip});
  src >> sub >> both;
  auto run = g.run();
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
  const std::string text = report(run.stats());
  EXPECT_NE(text.find("'sub' replaced 2 items whose bodies threw (its errors"), std::string::npos)
      << text;
  EXPECT_NE(text.find("'both' skipped 1 item whose body threw"), std::string::npos) << text;
  EXPECT_EQ(text.find("skipped 0"), std::string::npos) << text;
}

// Planted bottleneck 1: a slow CPU stage starves the GPU. "the report names it"
TEST(Diagnosis, ASlowCpuStageIsNamedAndItsConcurrencyRaised) {
  Runtime rt(host(2));
  Graph g(rt, "slow-cpu");
  auto src = g.source("files", counter(60));
  auto decode = g.stage("decode", [](long) {
    spin_us(2000);
    return HostTensor::empty(DType::u8, {1024});
  });
  GpuStageOptions o;
  o.concurrency = 2;
  auto model = g.gpu_stage("model", [](DeviceTensor t, DeviceContext& ctx) {
    ops::busy_kernel(ctx, 300us);
    return t;
  }, o);
  auto sink = g.sink("step", [](DeviceTensor) {});
  src >> decode >> model >> sink;
  auto run = g.run();
  run.wait();
  const RunStats st = run.stats();
  const Diagnosis d = diagnose(st, rt.device_stats());
  EXPECT_EQ(d.bottleneck, "decode") << join(d.findings);
  EXPECT_TRUE(contains(d.findings, "GPU stage 'model' waited for input")) << join(d.findings);
  EXPECT_TRUE(contains(d.findings, "'decode' is the bottleneck")) << join(d.findings);
  EXPECT_TRUE(contains(d.suggestions, "raise the concurrency of stage 'decode' from 1 to"))
      << join(d.suggestions);
  const std::string text = report(st, rt.device_stats());
  EXPECT_NE(text.find("diagnosis: bottleneck 'decode'"), std::string::npos) << text;
  expect_consistent(st, rt.device_stats());
}

// Planted bottleneck 2: a slow GPU stage; its producer is blocked behind it.
TEST(Diagnosis, ASlowGpuStageIsNamedAndItsProducerBlockedBehindIt) {
  Runtime rt(host(2));
  Graph g(rt, "slow-gpu");
  auto src = g.source("files", counter(40));
  auto prep = g.stage("prep", [](long) { return HostTensor::empty(DType::u8, {1024}); },
                      {.capacity = 4});
  GpuStageOptions o;
  o.concurrency = 1;
  o.capacity = 4;
  auto model = g.gpu_stage("model", [](DeviceTensor t, DeviceContext& ctx) {
    ops::busy_kernel(ctx, 3ms);
    return t;
  }, o);
  auto sink = g.sink("step", [](DeviceTensor) {});
  src >> prep >> model >> sink;
  auto run = g.run();
  run.wait();
  const RunStats st = run.stats();
  const Diagnosis d = diagnose(st, rt.device_stats());
  EXPECT_EQ(d.bottleneck, "model") << join(d.findings);
  EXPECT_TRUE(contains(d.findings, "GPU stage 'model' is the bottleneck")) << join(d.findings);
  EXPECT_TRUE(contains(d.findings, "stage 'prep' is blocked")) << join(d.findings);
  EXPECT_FALSE(d.suggestions.empty());
  expect_consistent(st, rt.device_stats());
}

// Planted bottleneck 3: a ring too small to overlap production with the copies. Each 4 MiB
// item holds the only ring budget until its H2D copy ran, so the producer cannot prepare the
// next one meanwhile; the GPU stage (short kernels) waits for input.
TEST(Diagnosis, ATooSmallRingIsNamedAndEnlarged) {
  Runtime rt(host(2, 4, 4));
  Graph g(rt, "small-ring");
  constexpr std::int64_t kItem = 4 << 20;
  small_ring_graph(g, 30, kItem, 2 * kItem, 500);  // budget for a single item
  auto run = g.run();
  run.wait();
  const RunStats st = run.stats();
  EXPECT_GT(st.find("model")->ring_refusals, 0u);
  EXPECT_GT(st.find("model")->ring_wait_ns, 0);
  EXPECT_LE(st.find("model")->ring_max_in_use, static_cast<std::size_t>(2 * kItem));
  const Diagnosis d = diagnose(st, rt.device_stats());
  EXPECT_EQ(d.bottleneck, "model") << report(st, rt.device_stats());
  EXPECT_TRUE(contains(d.findings, "the pinned ring into GPU stage 'model' is full"))
      << report(st, rt.device_stats());
  EXPECT_TRUE(contains(d.suggestions, "enlarge the ring of 'model'")) << join(d.suggestions);
  expect_consistent(st, rt.device_stats());
}

// The same with the ring left automatic (64 MiB, items of 32 MiB: one budget): named the same
// way; the suggestion says that the runtime deepens it for the next run (the decision made at
// the run's end), and it does.
TEST(Diagnosis, ATooSmallAutomaticRingIsNamedAndDeepenedForTheNextRun) {
  Runtime rt(host(2, 4, 4));
  Graph g(rt, "small-auto-ring");
  small_ring_graph(g, 20, 32 << 20, GpuStageOptions::automatic, 3000);
  auto run = g.run();
  run.wait();
  const RunStats st = run.stats();
  EXPECT_TRUE(st.find("model")->ring_automatic);
  EXPECT_EQ(st.find("model")->ring_capacity, std::size_t{64} << 20);
  const Diagnosis d = diagnose(st, rt.device_stats());
  EXPECT_EQ(d.bottleneck, "model") << report(st, rt.device_stats());
  EXPECT_TRUE(contains(d.findings, "the pinned ring into GPU stage 'model' is full")) << join(d.findings);
  // The run's end decided the next run's ring (here: producers waited for room while 'model'
  // waited for input; under TSan, whose copies are 10x slower, 'model' may not have waited 5%
  // of the run, and then the ring stays: the suggestion is the plain one).
  std::string raise;
  for (const std::string& e : st.autotune)
    if (e.rfind("model ring_bytes 64 MiB -> 128 MiB: producers waited", 0) == 0) raise = e;
  if (!raise.empty()) {
    EXPECT_TRUE(contains(d.suggestions, "the ring of 'model' is automatic: the next run of graph "
                                        "'small-auto-ring' gets a deeper one (" + raise + ")"))
        << join(d.suggestions);
    EXPECT_FALSE(contains(d.suggestions, "enlarge the ring")) << join(d.suggestions);
  } else {
    EXPECT_TRUE(contains(d.suggestions, "enlarge the ring of 'model'")) << join(d.suggestions) << join(st.autotune);
  }
  bool in_json = false;
  const nlohmann::json summary = nlohmann::json::parse(to_json(st));
  for (const auto& stage : summary["stages"])
    if (stage["name"] == "model") in_json = stage["ring"]["automatic"].get<bool>();
  EXPECT_TRUE(in_json) << to_json(st);
  auto again = g.run();
  again.wait();
  EXPECT_EQ(again.stats().items_delivered(), 20u);
  EXPECT_EQ(again.stats().find("model")->ring_capacity, std::size_t(raise.empty() ? 64u : 128u) << 20)
      << join(st.autotune);
  expect_consistent(again.stats(), rt.device_stats());
}

// Planted bottleneck 4: the stream pool. The modelled device runs 4 kernels at once, but the
// pool has one stream, so the GPU stage's 4 invocations queue for it.
TEST(Diagnosis, ASmallStreamPoolIsNamedAsTheLimit) {
  Runtime rt(host(2, /*streams=*/1, /*slots=*/4));
  Graph g(rt, "small-pool");
  auto src = g.source("files", counter(120));
  auto prep = g.stage("prep", [](long) { return HostTensor::empty(DType::u8, {256}); });
  GpuStageOptions o;
  o.concurrency = 4;
  auto model = g.gpu_stage("model", [](DeviceTensor t, DeviceContext& ctx) {
    ops::busy_kernel(ctx, 1ms);
    return t;
  }, o);
  auto sink = g.sink("step", [](DeviceTensor) {});
  src >> prep >> model >> sink;
  auto run = g.run();
  run.wait();
  const RunStats st = run.stats();
  const auto dev = rt.device_stats();
  ASSERT_TRUE(dev);
  EXPECT_EQ(dev->max_leases_in_use, 1u);
  EXPECT_GT(st.gpu.lease_wait_ns, st.wall_ns / 10) << "4 invocations share one stream";
  const Diagnosis d = diagnose(st, dev);
  EXPECT_EQ(d.bottleneck, "model") << report(st, dev);
  EXPECT_TRUE(contains(d.suggestions, "the stream pool is the limit")) << report(st, dev);
  EXPECT_TRUE(contains(d.suggestions, "raise DeviceConfig::streams")) << join(d.suggestions);
  expect_consistent(st, dev);
}

namespace {
// A run's figures, written by hand, for the diagnosis alone (docs/telemetry.md, "Diagnosis"):
// a producer 'load' into GPU stage 'model' (4 in flight), 1 s of wall time.
RunStats planted_gpu_run() {
  RunStats st;
  st.graph = "planted";
  st.wall_ns = 1'000'000'000;
  StageStats load;
  load.name = "load";
  load.kind = StageKind::stage;
  load.concurrency_limit = 1;
  load.consumers = {"model"};
  load.items_out = 1000;
  load.busy_ns = 400'000'000;
  load.work_ns = 400'000'000;
  load.blocked_ns = 500'000'000;
  StageStats model;
  model.name = "model";
  model.kind = StageKind::gpu_stage;
  model.concurrency_limit = 4;
  model.items_in = model.items_out = 1000;
  st.stages = {load, model};
  st.gpu.bursts = 1000;
  return st;
}
}  // namespace

// A GPU stage with an output ring only (ring_item_bytes 0: no input ring), full: the results
// a reader keeps hold its room (docs/architecture.md). The diagnosis names the output ring and
// says what to do; the producer is blocked behind the GPU stage. It said "blocked by the pinned
// ring into 'model'" (which has none) with no advice, and the report's ring line "ring into
// 'model' ... producers waited" (a new C++ user's trial).
TEST(Diagnosis, AFullOutputRingIsNamedAsTheOutputRingWithWhatToDo) {
  RunStats st = planted_gpu_run();
  StageStats& model = st.stages[1];
  model.busy_ns = 950'000'000;
  model.ring_capacity = 4 << 20;
  model.ring_item_bytes = 0;
  model.ring_max_in_use = 4 << 20;
  model.ring_refusals = 40;
  model.ring_wait_ns = 900'000'000;
  const Diagnosis d = diagnose(st, std::nullopt);
  EXPECT_EQ(d.bottleneck, "model") << join(d.findings);
  EXPECT_TRUE(contains(d.findings, "the pinned output ring of GPU stage 'model' is full: its bursts "
                                   "waited 900.0 ms (90% of the run, 40 refusals) for room (at "
                                   "most 4.0 MiB of its 4.0 MiB in use)"))
      << join(d.findings);
  EXPECT_TRUE(contains(d.findings, "stage 'load' is blocked 50% of the run behind GPU stage "
                                   "'model', whose pinned output ring is full"))
      << join(d.findings);
  EXPECT_FALSE(contains(d.findings, "ring into")) << join(d.findings);
  EXPECT_TRUE(contains(d.suggestions, "or leave GpuStageOptions::out_ring_bytes of 'model' at 0"))
      << join(d.suggestions);
  const std::string text = report(st);
  EXPECT_NE(text.find("output ring of 'model': 4.0 MiB capacity"), std::string::npos) << text;
  EXPECT_NE(text.find("40 refusals, its bursts waited 900.0 ms"), std::string::npos) << text;
  // With an input ring the same figures are the input ring's, named so.
  model.ring_item_bytes = 4096;
  const std::string with_input = report(st);
  EXPECT_NE(with_input.find("ring into 'model'"), std::string::npos) << with_input;
  EXPECT_NE(with_input.find("producers waited 900.0 ms"), std::string::npos) << with_input;
}

// A CPU chain under backpressure: src >> cheap (2 at once) >> slow (serial, busy 99.5%) >>
// pull sink. The source is blocked behind 'cheap' and 'cheap' behind 'slow': the bottleneck is
// 'slow', the last stage of the chain not blocked itself, with the suggestion to raise its
// concurrency. (It named 'cheap', the first consumer of a blocked stage, and suggested nothing:
// the new-user trial of 2026-12-05.)
TEST(Diagnosis, AChainIsHeldBackByItsLastStageNotBlockedItself) {
  RunStats st;
  st.graph = "chain";
  st.wall_ns = 1'000'000'000;
  auto stage = [](std::string name, StageKind kind, std::size_t limit, std::int64_t work,
                  std::int64_t blocked, std::vector<std::string> consumers) {
    return testing_helpers::stage_stats(std::move(name), kind, std::move(consumers),
                                        {.limit = limit, .items = 200, .work = work, .blocked = blocked});
  };
  st.stages = {stage("src", StageKind::source, 1, 10'000'000, 790'000'000, {"cheap"}),
               stage("cheap", StageKind::stage, 2, 20'000'000, 900'000'000, {"slow"}),
               stage("slow", StageKind::stage, 1, 995'000'000, 0, {"out"}),
               stage("out", StageKind::pull_sink, 1, 0, 0, {})};
  const Diagnosis d = diagnose(st, std::nullopt);
  EXPECT_EQ(d.bottleneck, "slow") << join(d.findings);
  EXPECT_TRUE(contains(d.findings, "stage 'src' is blocked 79% of the run behind 'cheap'")) << join(d.findings);
  EXPECT_TRUE(contains(d.findings, "stage 'cheap' is blocked 90% of the run behind 'slow'")) << join(d.findings);
  EXPECT_TRUE(contains(d.findings, "behind 'slow', which was busy ")) << join(d.findings);
  EXPECT_EQ(d.suggestions, std::vector<std::string>{"raise the concurrency of stage 'slow' from 1 to 2"});
  // 'slow' blocked too, behind the pull sink: the reader of the sink holds the chain back,
  // and no stage's concurrency is to be raised.
  st.stages[2].blocked_ns = 600'000'000;
  st.stages[2].work_ns = st.stages[2].busy_ns = 300'000'000;
  const Diagnosis d2 = diagnose(st, std::nullopt);
  EXPECT_EQ(d2.bottleneck, "out") << join(d2.findings);
  EXPECT_TRUE(d2.suggestions.empty()) << join(d2.suggestions);
  // A fan-out: src feeds 'x' (blocked behind a slow 'z') and 'y' (half busy, not blocked).
  // Of the consumers not blocked themselves ('y', 'z'), the most saturated holds the graph back,
  // whatever the stages' order.
  st.stages = {stage("src", StageKind::source, 1, 10'000'000, 800'000'000, {"x", "y"}),
               stage("y", StageKind::stage, 1, 500'000'000, 0, {"out"}),
               stage("x", StageKind::stage, 1, 100'000'000, 800'000'000, {"z"}),
               stage("z", StageKind::stage, 1, 990'000'000, 0, {"out"}),
               stage("out", StageKind::pull_sink, 1, 0, 0, {})};
  const Diagnosis d3 = diagnose(st, std::nullopt);
  EXPECT_EQ(d3.bottleneck, "z") << join(d3.findings);
  EXPECT_EQ(d3.suggestions, std::vector<std::string>{"raise the concurrency of stage 'z' from 1 to 2"});
}

// A new user's trial (2026-12-06): with an unlimited decode holding both of the runtime's
// threads, the reader before it "starved" 91% with 22.7 items queued on average (it waited for
// a thread), and the report named the reader the bottleneck. The cores are the limit; the
// stage doing most of the work is named.
TEST(Diagnosis, AStageWaitingForAThreadWithItsQueueFullIsNotTheBottleneck) {
  RunStats st;
  st.graph = "diag";
  st.status = RunStatus::succeeded;
  st.wall_ns = 1'000'000'000;
  st.threads = 2;
  auto stage = [](std::string name, StageKind kind, std::size_t limit, std::int64_t work,
                  std::int64_t starved, std::int64_t blocked, double queue,
                  std::vector<std::string> consumers) {
    return testing_helpers::stage_stats(std::move(name), kind, std::move(consumers),
                                        {.limit = limit, .items = 2400, .work = work, .starved = starved,
                                         .blocked = blocked, .queue = queue});
  };
  st.stages = {stage("idx", StageKind::source, 1, 5'000'000, 0, 860'000'000, 0, {"read"}),
               stage("read", StageKind::stage, 1, 86'000'000, 914'000'000, 0, 22.7, {"decode"}),
               stage("decode", StageKind::stage, Concurrency::unlimited, 1'952'000'000, 24'000'000, 0, 0.4, {"out"}),
               stage("out", StageKind::sink, 1, 10'000'000, 0, 0, 0, {})};
  Diagnosis d = diagnose(st, std::nullopt);
  EXPECT_EQ(d.bottleneck, "decode") << join(d.findings);
  EXPECT_TRUE(contains(d.findings, "stage 'read' waited 91% of the run with 22.7 items queued on "
                                   "average: for a thread, not for input; the runtime's 2 threads "
                                   "ran bodies 2.0 of them on average, 'decode' 2.0"))
      << join(d.findings);
  EXPECT_EQ(d.suggestions, std::vector<std::string>{
                               "the cores are the limit: stage 'decode' does most of the work (2.0 "
                               "of the 2 threads): a cheaper body, its work on the GPU, or more "
                               "cores (RuntimeConfig::threads); Python bodies waiting for the GIL "
                               "read as work too: the GIL is then the limit (processes=)"});
  // An automatic stage's number is the tuner's: the advice says so, not "raise it from 1 to
  // 2" (a trial's run shorter than the tuner's first window was told to set a number).
  st.stages = {stage("src", StageKind::source, 1, 1'000'000, 0, 900'000'000, 0, {"decode"}),
               stage("decode", StageKind::stage, 1, 990'000'000, 0, 0, 3.0, {"out"}),
               stage("out", StageKind::sink, 1, 1'000'000, 0, 0, 0, {})};
  st.threads = 4;
  st.stages[1].concurrency_automatic = true;
  d = diagnose(st, std::nullopt);
  EXPECT_EQ(d.bottleneck, "decode") << join(d.findings);
  EXPECT_EQ(d.suggestions, std::vector<std::string>{
                               "stage 'decode' runs on automatic concurrency (1 now): the tuner "
                               "raises it while that raises the rate; it decided nothing in this "
                               "run (shorter than GraphOptions::autotune_window, or too few "
                               "items): a longer run gives it time"});
  st.autotune = {"decode 1 -> 2: ..."};
  d = diagnose(st, std::nullopt);
  EXPECT_EQ(d.suggestions.size(), 1u);
  EXPECT_NE(d.suggestions[0].find("(1 now): the tuner raises it while that raises the rate; its "
                                  "decisions are listed under autotune"),
            std::string::npos) << d.suggestions[0];
  st.stages[1].concurrency_automatic = false;
  d = diagnose(st, std::nullopt);
  EXPECT_EQ(d.suggestions, std::vector<std::string>{"raise the concurrency of stage 'decode' from 1 to 2"});
  st.stages = {stage("idx", StageKind::source, 1, 5'000'000, 0, 860'000'000, 0, {"read"}),
               stage("read", StageKind::stage, 1, 86'000'000, 914'000'000, 0, 22.7, {"decode"}),
               stage("decode", StageKind::stage, Concurrency::unlimited, 1'952'000'000, 24'000'000, 0, 0.4, {"out"}),
               stage("out", StageKind::sink, 1, 10'000'000, 0, 0, 0, {})};
  st.threads = 2;
  st.autotune.clear();
  // A stage that did more work than the one named would be: not "the stage doing most of it".
  st.stages[1].work_ns = 1'960'000'000;
  d = diagnose(st, std::nullopt);
  EXPECT_EQ(d.bottleneck, "read") << join(d.findings);
  st.stages[1].work_ns = 86'000'000;
  // The same reader waiting for input (an empty queue): it is the bottleneck, as before.
  st.stages[1].mean_queue = 0.2;
  d = diagnose(st, std::nullopt);
  EXPECT_EQ(d.bottleneck, "read") << join(d.findings);
  // Queued but with threads to spare (the bodies ran 1.1 of 2): not the cores either.
  st.stages[1].mean_queue = 22.7;
  st.stages[2].work_ns = 1'000'000'000;
  d = diagnose(st, std::nullopt);
  EXPECT_EQ(d.bottleneck, "read") << join(d.findings);
}

// A new-user trial (2026-12-05): the diagnosis told a user to raise a CPU stage's concurrency
// past the runtime's threads (4 -> 8 on a runtime of 4: bodies that hold arena threads cannot
// run more at once than there are), and diagnosed a run that failed on its third item as if
// its figures described a pipeline's steady state.
TEST(Diagnosis, ASuggestedConcurrencyStaysWithinTheRuntimesThreads) {
  RunStats st;
  st.graph = "cpu";
  st.status = RunStatus::succeeded;
  st.wall_ns = 1'000'000'000;
  st.threads = 4;
  auto stage = [](std::string name, StageKind kind, std::size_t limit, std::int64_t work) {
    return testing_helpers::stage_stats(std::move(name), kind, {},
                                        {.limit = limit, .items = 100, .work = work});
  };
  st.stages = {stage("src", StageKind::source, 1, 1'000'000),
               stage("decode", StageKind::stage, 4, 3'960'000'000),
               stage("out", StageKind::sink, 1, 1'000'000)};
  Diagnosis d = diagnose(st, std::nullopt);
  EXPECT_EQ(d.bottleneck, "decode") << join(d.findings);
  EXPECT_EQ(d.suggestions, std::vector<std::string>{
                               "stage 'decode' already runs on all 4 of the runtime's threads: it "
                               "takes more cores (RuntimeConfig::threads), a cheaper body, or its "
                               "work on the GPU"});
  // At 3 of 4: raised to the threads, not doubled past them.
  st.stages[1].concurrency_limit = 3;
  st.stages[1].work_ns = 2'970'000'000;
  d = diagnose(st, std::nullopt);
  EXPECT_EQ(d.suggestions,
            std::vector<std::string>{
                "raise the concurrency of stage 'decode' from 3 to 4, the runtime's threads; past "
                "them it takes more cores (RuntimeConfig::threads), a cheaper body, or its work "
                "on the GPU"});
  // Within the threads: doubled, as before.
  st.threads = 16;
  d = diagnose(st, std::nullopt);
  EXPECT_EQ(d.suggestions,
            std::vector<std::string>{"raise the concurrency of stage 'decode' from 3 to 6"});
  // A sink's bodies hold arena threads too.
  st.threads = 4;
  st.stages[1].kind = StageKind::sink;
  d = diagnose(st, std::nullopt);
  ASSERT_EQ(d.suggestions.size(), 1u);
  EXPECT_EQ(d.suggestions[0].rfind("raise the concurrency of stage 'decode' from 3 to 4, the "
                                   "runtime's threads; past them",
                                   0),
            0u)
      << d.suggestions[0];
  // An async stage's items out hold no thread: not capped.
  st.stages[1].kind = StageKind::stage;
  st.stages[1].call_ns = 10'000'000;
  d = diagnose(st, std::nullopt);
  EXPECT_EQ(d.suggestions,
            std::vector<std::string>{"raise the concurrency of stage 'decode' from 3 to 6"});
  // The figure comes from the runtime, in a live run's stats and the JSON.
  Runtime rt({.threads = 3});
  Graph g(rt, "live");
  g.source("n", counter(2)) >> g.sink("s", [](long) {});
  auto run = g.run();
  run.wait();
  EXPECT_EQ(run.stats().threads, 3u);
  EXPECT_EQ(nlohmann::json::parse(to_json(run.stats()))["threads"], 3);
}

TEST(Diagnosis, AFailedRunIsNotDiagnosed) {
  Runtime rt({.threads = 2});
  Graph g(rt, "fails");
  auto src = g.source("n", counter(1000));
  auto slow = g.stage("slow", [](long x) {
    if (x == 2) throw std::runtime_error("bad item");
    spin_us(2000);
    return x;
  });
  src >> slow >> g.sink("out", [](long) {});
  auto run = g.run();
  EXPECT_THROW(run.wait(), StageError);
  const RunStats st = run.stats();
  ASSERT_EQ(st.status, RunStatus::failed);
  const Diagnosis d = diagnose(st, std::nullopt);
  EXPECT_EQ(d.bottleneck, "");
  EXPECT_TRUE(d.findings.empty()) << join(d.findings);
  EXPECT_TRUE(d.suggestions.empty()) << join(d.suggestions);
  const std::string text = report(st);
  EXPECT_NE(text.find("diagnosis: none: the run failed (its error says where); the figures above "
                      "cover the part before the failure"),
            std::string::npos)
      << text;
}

// "a ring full of reservations, not data, is not fixed by a larger ring": with the default
// ring_item_bytes (16 MiB) a 64 MiB ring takes 3 items in flight however small they are.
TEST(Diagnosis, ARingFullOfItemBudgetsSuggestsASmallerItemBudget) {
  RunStats st = planted_gpu_run();
  StageStats& m = st.stages[1];
  m.starved_ns = 500'000'000;
  m.busy_ns = m.work_ns = 500'000'000;
  m.ring_capacity = 64u << 20;
  m.ring_item_bytes = 16u << 20;
  m.ring_max_in_use = 17 * 1024;
  m.ring_mean_in_use = 9 * 1024;
  m.ring_refusals = 900;
  m.ring_wait_ns = 400'000'000;
  Diagnosis d = diagnose(st, std::nullopt);
  EXPECT_EQ(d.bottleneck, "model") << join(d.findings);
  EXPECT_TRUE(contains(d.suggestions, "lower GpuStageOptions::ring_item_bytes of 'model' from "
                                      "16.0 MiB toward its largest item"))
      << join(d.suggestions);
  EXPECT_TRUE(contains(d.suggestions, "only 3 items fit the 64.0 MiB ring")) << join(d.suggestions);
  EXPECT_FALSE(contains(d.suggestions, "enlarge the ring")) << join(d.suggestions);
  // A ring that was full of data is enlarged.
  m.ring_max_in_use = 60u << 20;
  d = diagnose(st, std::nullopt);
  EXPECT_TRUE(contains(d.suggestions, "enlarge the ring of 'model'")) << join(d.suggestions);
}

// "the device figures the diagnosis reads are the run's, not the device's lifetime": a pool
// saturated during the run is named even when the device idled long before it.
TEST(Diagnosis, ThePoolIsJudgedOverTheRunNotTheDevicesLifetime) {
  RunStats st = planted_gpu_run();
  StageStats& m = st.stages[1];
  m.busy_ns = m.work_ns = 950'000'000;  // in flight 95% of the run
  st.gpu.busy_ns = 900'000'000;
  st.gpu.held_ns = 950'000'000;
  st.gpu.lease_wait_ns = 2'000'000'000;  // 4 invocations queued for 2 streams
  st.gpu.device_wall_ns = 1'000'000'000;
  st.gpu.device_busy_ns = 600'000'000;  // the modelled device runs more at once than 2 streams
  st.gpu.device_streams = 2;
  st.gpu.device_max_leases = 2;
  st.gpu.device_mean_leases = 1.95;
  DeviceStats lifetime;  // an hour of an idle device before this run
  lifetime.wall_ns = 3'600'000'000'000;
  lifetime.busy_ns = 600'000'000;
  lifetime.streams = 2;
  lifetime.max_leases_in_use = 2;
  lifetime.lease_time_ns = {3'599'000'000'000, 50'000'000, 950'000'000};
  const Diagnosis d = diagnose(st, lifetime);
  EXPECT_EQ(d.bottleneck, "model") << join(d.findings);
  EXPECT_TRUE(contains(d.suggestions, "the stream pool is the limit (1.9 of 2 streams")) << join(d.suggestions);
  EXPECT_FALSE(contains(d.suggestions, "raise the concurrency of GPU stage")) << join(d.suggestions);
  EXPECT_TRUE(contains(d.findings, "(device busy 60%)")) << join(d.findings);
}

// A slow source feeding the GPU (a Python generator, a Dask Remote): the advice is to move its
// work into a stage, not to raise a concurrency no source has (a new user's trial: "raise the
// concurrency of stage 'remote' from 1 to 2", which g.source refuses).
TEST(Diagnosis, ASlowSourceIsToldToMoveItsWorkNotToRaiseItsConcurrency) {
  RunStats st = planted_gpu_run();
  st.stages[0].name = "remote";
  st.stages[0].kind = StageKind::source;
  st.stages[0].busy_ns = st.stages[0].work_ns = 990'000'000;
  st.stages[0].blocked_ns = 0;
  st.stages[1].starved_ns = 900'000'000;
  st.gpu.busy_ns = 50'000'000;
  const Diagnosis d = diagnose(st, std::nullopt);
  EXPECT_EQ(d.bottleneck, "remote") << join(d.findings);
  EXPECT_FALSE(contains(d.suggestions, "raise the concurrency")) << join(d.suggestions);
  EXPECT_TRUE(contains(d.suggestions, "source 'remote' yields one item at a time")) << join(d.suggestions);
  EXPECT_TRUE(contains(d.suggestions, "move its work into a stage after it")) << join(d.suggestions);
  // A CPU-only graph whose source is its most saturated node: the same.
  RunStats cpu;
  cpu.graph = "cpu";
  cpu.wall_ns = 1'000'000'000;
  StageStats src;
  src.name = "gen";
  src.kind = StageKind::source;
  src.concurrency_limit = 1;
  src.items_out = 100;
  src.busy_ns = src.work_ns = 950'000'000;
  src.consumers = {"out"};
  StageStats out;
  out.name = "out";
  out.kind = StageKind::pull_sink;
  out.items_in = 100;
  cpu.stages = {src, out};
  const Diagnosis c = diagnose(cpu, std::nullopt);
  EXPECT_EQ(c.bottleneck, "gen") << join(c.findings);
  EXPECT_TRUE(contains(c.suggestions, "source 'gen' yields one item at a time")) << join(c.suggestions);
  // A source another system feeds (Node::fed_by: splitflow.dask's remote pass, whose workers
  // make its items): that system is the limit; moving the source's work into a stage is no
  // advice for it (a new user's trial was told so of a GraphDataset(remote=...)).
  st.stages[0].fed_by = "the remote pass 'remote' on Dask workers";
  const Diagnosis f = diagnose(st, std::nullopt);
  EXPECT_EQ(f.bottleneck, "remote") << join(f.findings);
  EXPECT_TRUE(contains(f.suggestions, "source 'remote' is fed by the remote pass 'remote' on Dask "
                                      "workers"))
      << join(f.suggestions);
  EXPECT_TRUE(contains(f.suggestions, ": its producer is the limit, not the graph")) << join(f.suggestions);
  EXPECT_FALSE(contains(f.suggestions, "move its work into a stage")) << join(f.suggestions);
}

// Node::fed_by reaches the source's figures (StageStats::fed_by) and the JSON summary.
TEST(Diagnosis, ASourcesProducerReachesItsFiguresAndTheJson) {
  Runtime rt({.threads = 2});
  Graph g(rt, "fed");
  std::vector<int> got;
  auto src = g.source("remote", std::vector<int>{1, 2, 3});
  src.fed_by("a queue that a service fills");
  auto sink = g.sink("s", [&](int x) { got.push_back(x); });
  src >> sink;
  auto run = g.run();
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  EXPECT_EQ(got, (std::vector<int>{1, 2, 3}));
  const RunStats st = run.stats();
  EXPECT_EQ(st.find("remote")->fed_by, "a queue that a service fills");
  EXPECT_EQ(st.find("s")->fed_by, "");
  const nlohmann::json j = nlohmann::json::parse(to_json(st));
  bool found = false;
  for (const auto& x : j["stages"]) {
    if (x["name"] == "remote") found = x.value("fed_by", "") == "a queue that a service fills";
    if (x["name"] == "s") EXPECT_FALSE(x.contains("fed_by")) << x;
  }
  EXPECT_TRUE(found) << j;
}

// A Python body that holds the GIL gains nothing from another thread: a new user's trial was
// told "raise the concurrency of stage 'spin' from 1 to 2" for a pure-Python loop (462 items/s
// at 1, 479 at 4). Its bodies' holds (StageStats::serial_ns) say so; the advice is processes.
TEST(Diagnosis, AStageHoldingTheGilIsToldToRunInProcessesNotToRaiseItsConcurrency) {
  RunStats st;
  st.graph = "py";
  st.wall_ns = 1'000'000'000;
  auto stage = [](std::string name, StageKind kind, std::int64_t work, std::int64_t blocked,
                  std::vector<std::string> consumers) {
    return testing_helpers::stage_stats(std::move(name), kind, std::move(consumers),
                                        {.limit = 1, .items = 400, .work = work, .blocked = blocked});
  };
  st.stages = {stage("src", StageKind::source, 10'000'000, 900'000'000, {"spin"}),
               stage("spin", StageKind::stage, 990'000'000, 0, {"out"}),
               stage("out", StageKind::pull_sink, 0, 0, {})};
  st.stages[1].serial_ns = 930'000'000;  // of 990 ms, 20 of them waits to take it
  st.stages[1].serial_wait_ns = 20'000'000;
  const Diagnosis d = diagnose(st, std::nullopt);
  EXPECT_EQ(d.bottleneck, "spin") << join(d.findings);
  // One thread: its holds count what numpy or torch compute with the GIL released too, so
  // either may be: both fixes said.
  EXPECT_EQ(d.suggestions,
            std::vector<std::string>{
                "the bodies of stage 'spin' held the GIL, or computed with it released, 96% of "
                "their time: Python code that holds it gains nothing from more threads (run it in "
                "processes, Python: processes=N, or move its work into a C++ op, splitflow.ops); "
                "numpy or torch code, which releases it, does: raise the concurrency of stage "
                "'spin' from 1 to 2"})
      << join(d.suggestions);
  // Two threads that waited for each other's holds: the GIL, said so.
  st.stages[1].concurrency_limit = 2;
  st.stages[1].work_ns = 1'900'000'000;
  st.stages[1].serial_wait_ns = 900'000'000;
  EXPECT_EQ(diagnose(st, std::nullopt).suggestions,
            std::vector<std::string>{
                "the bodies of stage 'spin' held the GIL 93% of their time and waited for it "
                "900.0 ms more: its threads wait for each other's; run it in processes (Python: "
                "processes=N) or move its work into a C++ op (splitflow.ops)"});
  // Holds past the run's length: its bodies held it at once, so they release it (numpy):
  // more threads, as for any stage.
  st.stages[1].serial_ns = 1'500'000'000;
  st.stages[1].serial_wait_ns = 0;
  EXPECT_EQ(diagnose(st, std::nullopt).suggestions,
            std::vector<std::string>{"raise the concurrency of stage 'spin' from 2 to 4"});
  // A body that holds it a small part of its time (a read): more threads, as before.
  st.stages[1].concurrency_limit = 1;
  st.stages[1].work_ns = 990'000'000;
  st.stages[1].serial_ns = 300'000'000;
  EXPECT_EQ(diagnose(st, std::nullopt).suggestions,
            std::vector<std::string>{"raise the concurrency of stage 'spin' from 1 to 2"});
  // On automatic concurrency and held by the GIL: not "the tuner raises it", which its own
  // decision (the GIL bounds the rate) contradicted (a new user's trial). One thread: pure Python
  // or numpy, both said, and that the tuner decided nothing (no autotune lines).
  st.stages[1].concurrency_automatic = true;
  st.stages[1].serial_ns = 930'000'000;
  st.stages[1].serial_wait_ns = 20'000'000;
  EXPECT_EQ(diagnose(st, std::nullopt).suggestions,
            std::vector<std::string>{
                "the bodies of stage 'spin' (automatic concurrency, 1 now) held the GIL, or "
                "computed with it released, 96% of their time: Python code that holds it is bound "
                "by it whatever its threads (run it in processes, Python: processes=N instead of "
                "concurrency='auto', or move its work into a C++ op, splitflow.ops); numpy or "
                "torch code, which releases it, the tuner raises while that raises the rate; it "
                "decided nothing in this run (shorter than GraphOptions::autotune_window, or too "
                "few items)"})
      << join(diagnose(st, std::nullopt).suggestions);
  // Two threads that waited for each other's holds: the GIL, said so.
  st.stages[1].concurrency_limit = 2;
  st.stages[1].work_ns = 1'900'000'000;
  st.stages[1].serial_wait_ns = 900'000'000;
  st.autotune = {"spin 1 -> 2: ..."};
  EXPECT_EQ(diagnose(st, std::nullopt).suggestions,
            std::vector<std::string>{
                "the bodies of stage 'spin' (automatic concurrency, 2 now) held the GIL 93% of "
                "their time and waited for it 900.0 ms more: its threads wait for each other's, "
                "and the tuner keeps it within the GIL's bound; run it in processes (Python: "
                "processes=N instead of concurrency='auto') or move its work into a C++ op "
                "(splitflow.ops)"})
      << join(diagnose(st, std::nullopt).suggestions);
  st.stages[1].concurrency_limit = 1;
  st.stages[1].work_ns = 990'000'000;
  st.stages[1].serial_wait_ns = 20'000'000;
  st.autotune.clear();
  // Automatic, not held by the GIL: the tuner's, as before.
  st.stages[1].serial_ns = 0;
  ASSERT_EQ(diagnose(st, std::nullopt).suggestions.size(), 1u);
  EXPECT_EQ(diagnose(st, std::nullopt).suggestions[0].rfind("stage 'spin' runs on automatic concurrency (1 now)", 0), 0u)
      << diagnose(st, std::nullopt).suggestions[0];
}

// Stage names are quoted once: "stage 'decode'", never "'decode''s".
TEST(Diagnosis, NamesAreQuotedOnce) {
  RunStats st = planted_gpu_run();
  st.stages[0].busy_ns = st.stages[0].work_ns = 990'000'000;
  st.stages[0].blocked_ns = 0;
  st.stages[1].starved_ns = 900'000'000;
  st.gpu.busy_ns = 50'000'000;
  const Diagnosis d = diagnose(st, std::nullopt);
  ASSERT_FALSE(d.suggestions.empty()) << join(d.findings);
  for (const auto& line : d.suggestions) EXPECT_EQ(line.find("''"), std::string::npos) << line;
  for (const auto& line : d.findings) EXPECT_EQ(line.find("''"), std::string::npos) << line;
}

// "An observer interface (on stage begin/end, on lease acquire/release)"
TEST(Observer, SeesEveryInvocationLeaseAndDeviceOp) {
  struct Counting : Observer {
    std::atomic<long> begins{0}, ends{0}, acquires{0}, releases{0}, ops{0}, items{0};
    std::atomic<bool> ordered{true};
    void on_stage_begin(const InvocationEvent& e) override {
      ++begins;
      ordered = ordered && e.end_ns == 0;
    }
    void on_stage_end(const InvocationEvent& e) override {
      ++ends;
      items += static_cast<long>(e.items);
      ordered = ordered && e.end_ns >= e.begin_ns;
    }
    void on_lease_acquire(const LeaseEvent&) override { ++acquires; }
    void on_lease_release(const LeaseEvent&) override { ++releases; }
    void on_device_op(const DeviceOpEvent& e) override {
      ++ops;
      ordered = ordered && e.end_ns >= e.begin_ns;
    }
  };
  auto obs = std::make_shared<Counting>();
  Runtime rt(host(2));
  Graph g(rt, "observed", {.observer = obs});
  auto src = g.source("n", counter(30));
  auto make = g.stage("make", [](long) { return HostTensor::empty(DType::u8, {256}); });
  auto gpu = g.gpu_stage("copy", [](DeviceTensor t, DeviceContext& ctx) { return ctx.to_host(t); });
  auto sink = g.sink("s", [](HostTensor) {});
  src >> make >> gpu >> sink;
  auto run = g.run();
  run.wait();
  const RunStats st = run.stats();
  std::uint64_t invocations = 0;
  for (const auto& s : st.stages) invocations += s.invocations;
  EXPECT_EQ(obs->begins.load(), static_cast<long>(invocations));
  EXPECT_EQ(obs->ends.load(), static_cast<long>(invocations));
  EXPECT_EQ(obs->acquires.load(), 30);
  EXPECT_EQ(obs->releases.load(), 30);
  EXPECT_EQ(obs->ops.load(), 60) << "one H2D and one D2H copy per burst";
  EXPECT_TRUE(obs->ordered.load());
}

// docs/architecture.md, "How an item flows": every node kind runs the one claim lifecycle, so
// the observers see each of its claims begin once and end once, after its begin, with the items
// it processed, and the queue it left; the figures agree with the stage's stats. Every kind is
// here: a source, stages, an asynchronous stage, a zip, a batch, a GPU stage and a sink in a
// batch job; a service's source, a dynamic batch, an unbatch and the answer sink in a service.
TEST(Observer, EveryNodeKindsClaimsBeginAndEndOnceWithTheirItems) {
  struct PerStage {
    long begins = 0, ends = 0, items = 0, open = 0, min_open = 0;
    std::size_t max_queued = 0;
    bool ordered = true;
  };
  struct Lifecycle : Observer {
    std::mutex mu;
    std::map<std::string, PerStage> stages;
    void on_stage_begin(const InvocationEvent& e) override {
      std::lock_guard lk(mu);
      PerStage& s = stages[*e.stage];
      ++s.begins;
      ++s.open;
      s.max_queued = std::max(s.max_queued, e.queued);
      s.ordered = s.ordered && e.end_ns == 0;
    }
    void on_stage_end(const InvocationEvent& e) override {
      std::lock_guard lk(mu);
      PerStage& s = stages[*e.stage];
      ++s.ends;
      s.min_open = std::min(s.min_open, --s.open);  // an end never comes before its begin
      s.items += static_cast<long>(e.items);
      s.ordered = s.ordered && e.begin_ns > 0 && e.end_ns >= e.begin_ns;
    }
  };
  const auto check = [](Lifecycle& obs, const RunStats& st,
                        const std::map<std::string, long>& items) {
    std::lock_guard lk(obs.mu);
    for (const auto& [name, want] : items) {
      SCOPED_TRACE(name);
      const StageStats* s = st.find(name);
      ASSERT_NE(s, nullptr);
      const PerStage& o = obs.stages[name];
      EXPECT_GT(o.begins, 0);
      EXPECT_EQ(o.begins, static_cast<long>(s->invocations));
      EXPECT_EQ(o.ends, o.begins);
      EXPECT_EQ(o.min_open, 0);
      EXPECT_TRUE(o.ordered);
      EXPECT_EQ(o.items, want);
      EXPECT_LE(o.max_queued, 2 * s->max_queue);  // (a zip's two inputs)
    }
  };

  auto job = std::make_shared<Lifecycle>();
  Runtime rt(host(3));
  {
    Graph g(rt, "job", {.observer = job});
    auto src = g.source("n", counter(200));
    auto twice = g.stage("twice", [](long x) { return 2 * x; }, {.concurrency = 2});
    auto remote = g.async_stage<long, long>(
        "remote", [](long x, Completion<long> done) { done.done(x + 1); }, {.concurrency = 3});
    auto pair = g.zip<long, long>("pair");
    auto sum = g.stage("sum", [](std::pair<long, long> p) { return p.first + p.second; });
    auto batch = g.batch<long>("batch", 8);
    auto pack = g.stage("pack", [](std::vector<long> v) {
      HostTensor t = HostTensor::empty(DType::i64, {static_cast<std::int64_t>(v.size())});
      std::copy(v.begin(), v.end(), t.data<std::int64_t>());
      return t;
    });
    auto copy = g.gpu_stage("copy", [](DeviceTensor t, DeviceContext& ctx) { return ctx.to_host(t); });
    long total = 0;
    auto sink = g.sink("sink", [&](HostTensor h) {
      for (std::int64_t i = 0; i < h.shape()[0]; ++i) total += h.data<std::int64_t>()[i];
    });
    fan_out(src, twice, remote);
    connect(twice, pair.first());
    connect(remote, pair.second());
    pair >> sum >> batch >> pack >> copy >> sink;
    auto run = g.run();
    ASSERT_EQ(run.wait(), RunStatus::succeeded);
    EXPECT_EQ(total, 3 * (199 * 200 / 2) + 200);  // every item once: 2x + (x + 1)
    check(*job, run.stats(),
          {{"n", 200}, {"twice", 200}, {"remote", 200}, {"pair", 200}, {"sum", 200},
           {"batch", 200}, {"pack", 25}, {"copy", 25}, {"sink", 25}});
  }

  auto served = std::make_shared<Lifecycle>();
  {
    Graph g(rt, "served", {.observer = served});
    auto svc = g.service<long, long>("requests", {.max_pending = 64});
    auto gather = g.dynamic_batch<long>("gather", {.max_batch = 4, .max_delay = 1ms});
    auto model = g.stage("model", [](Batch<long> b) {
      std::vector<long> out;
      for (long x : b.items) out.push_back(x * x);
      return std::move(b).with(std::move(out));
    });
    auto split = g.unbatch<long>("split", 4);
    svc.source() >> gather >> model >> split >> svc.sink();
    auto run = g.run();
    std::vector<std::future<long>> answers;
    for (long i = 0; i < 40; ++i) answers.push_back(svc.submit(i));
    for (long i = 0; i < 40; ++i) EXPECT_EQ(answers[i].get(), i * i);
    svc.close();
    ASSERT_EQ(run.wait(), RunStatus::succeeded);
    const RunStats st = run.stats();
    const long batches = static_cast<long>(st.find("model")->items_in);
    EXPECT_GE(batches, 10);
    check(*served, st,
          {{"requests", 40}, {"gather", 40}, {"model", batches}, {"split", batches},
           {"requests.answer", 40}});
  }
}

// "Memory for telemetry is bounded regardless of run length": the trace samples past its cap.
TEST(Trace, StaysWithinItsEventCapAndStatesTheSamplingRate) {
  Runtime rt({.threads = 2});
  Graph g(rt, "long", {.trace = true, .trace_max_events = 64});
  auto src = g.source("n", counter(3000));
  auto st = g.stage("work", [](long x) { spin_us(5); return x; });
  auto sink = g.sink("s", [](long) {});
  src >> st >> sink;
  auto run = g.run();
  run.wait();
  const std::string trace = run.trace_json();
  std::size_t events = 0;
  for (std::size_t at = 0; (at = trace.find("\"ph\":\"X\"", at)) != std::string::npos; ++at) ++events;
  EXPECT_LE(events, 64u);
  EXPECT_GT(events, 8u);
  EXPECT_EQ(trace.find("\"sample_every\":1,"), std::string::npos) << "it should have sampled";
}

// docs/telemetry.md, "JSON": the summary and the trace are valid JSON whatever the names hold
// (quotes, backslashes, control characters, bytes that are not UTF-8: written as U+FFFD).
TEST(Json, SummaryAndTraceParseWhateverTheNamesHold) {
  const std::string quoted = "say \"hi\"\\ \x01\t", broken = "bad \xff\xfe utf-8";
  Runtime rt({.threads = 2});
  Graph g(rt, "names " + broken, {.trace = true});
  auto src = g.source(quoted, counter(20));
  auto st = g.stage(broken, [](long x) { return x; });
  auto sink = g.sink("s", [](long) {});
  src >> st >> sink;
  auto run = g.run();
  run.wait();
  nlohmann::json summary, trace;
  ASSERT_NO_THROW(summary = nlohmann::json::parse(to_json(run.stats()))) << to_json(run.stats());
  ASSERT_NO_THROW(trace = nlohmann::json::parse(run.trace_json()));
  ASSERT_EQ(summary["stages"].size(), 3u);
  EXPECT_EQ(summary["stages"][0]["name"], quoted);
  EXPECT_EQ(summary["stages"][1]["name"], "bad \xEF\xBF\xBD\xEF\xBF\xBD utf-8");
  EXPECT_EQ(summary["stages"][1]["items_out"], 20);
  std::size_t work_events = 0;
  for (const auto& e : trace["traceEvents"])
    if (e.value("ph", "") == "X" && e.value("name", "") == quoted) ++work_events;
  EXPECT_GT(work_events, 0u);
}

// Without tracing, a trace without events that says why (it was "": a reader parsing it failed
// with a JSON error that named nothing; a new user's trial).
TEST(Trace, IsEmptyWithoutTracingAndSaysSo) {
  Runtime rt({.threads = 1});
  Graph g(rt, "untraced");
  auto src = g.source("n", counter(3));
  auto sink = g.sink("s", [](long) {});
  src >> sink;
  auto run = g.run();
  run.wait();
  const auto trace = nlohmann::json::parse(run.trace_json());
  EXPECT_TRUE(trace["traceEvents"].empty());
  EXPECT_EQ(trace["metadata"]["tracing"],
            "off: GraphOptions::trace (Python: trace=True) records a run's events");
}

// "Readable while a run is in progress (a snapshot call that does not stop the run)"
TEST(Figures, ALiveReportDoesNotStopTheRun) {
  Runtime rt({.threads = 2});
  Graph g(rt, "live-report");
  auto src = g.source("n", counter(-1));
  auto st = g.stage("st", [](long x) { spin_us(20); return x; });
  auto out = g.pull_sink<long>("out", 4);
  src >> st >> out;
  auto run = g.run();
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(out.next());
  const std::string live = report(run.stats());
  EXPECT_NE(live.find("running"), std::string::npos);
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(out.next()) << "the run stopped after the report";
  run.cancel();
  run.wait();
}

// The Prometheus text is well-formed: every sample follows its TYPE line, labels are quoted.
TEST(Prometheus, ExpositionTextIsWellFormed) {
  Runtime rt({.threads = 1});
  Graph g(rt, "prom \"q\"");
  auto src = g.source("n", counter(10));
  auto sink = g.sink("s", [](long) {});
  src >> sink;
  auto run = g.run();
  run.wait();
  const std::string text = prometheus_text(run.stats());
  EXPECT_NE(text.find("# TYPE splitflow_stage_items_total counter"), std::string::npos);
  EXPECT_NE(text.find(R"(splitflow_stage_items_total{graph="prom \"q\"",stage="s",direction="in"} 10)"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("splitflow_stage_latency_seconds{"), std::string::npos);
}

// Label values are UTF-8 whatever bytes a name holds, as in the JSON summary: each ill-formed
// part becomes one U+FFFD, the same parts as the JSON's (a graph named "\xff\xfe" made the whole
// text unreadable as UTF-8: a new C++ user's trial); well-formed multi-byte names stay as they
// are.
TEST(Prometheus, LabelValuesAreUtf8WhateverBytesANameHolds) {
  Runtime rt({.threads = 1});
  // Two bytes that begin nothing; a well-formed e-acute; a truncated 3-byte sequence (one
  // part); an overlong '/' (two); a surrogate (three); a 4-byte sequence cut by the end (one).
  Graph g(rt, "bad\xff\xfe|caf\xc3\xa9|\xe2\x82|\xc0\xaf|\xed\xa0\x80|\xf0\x9f\x98");
  auto src = g.source("n", counter(3));
  auto sink = g.sink("s\x80", [](long) {});
  src >> sink;
  auto run = g.run();
  run.wait();
  const std::string text = prometheus_text(run.stats());
  const std::string r = "\xef\xbf\xbd";
  const std::string graph = "bad" + r + r + "|caf\xc3\xa9|" + r + "|" + r + r + "|" + r + r + r + "|" + r;
  EXPECT_NE(text.find("splitflow_stage_items_total{graph=\"" + graph + "\",stage=\"s" + r +
                      "\",direction=\"in\"} 3"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find('\xff'), std::string::npos);
  // The JSON summary writes the same name.
  EXPECT_NE(to_json(run.stats()).find("\"graph\":\"" + graph + "\""), std::string::npos)
      << to_json(run.stats());
}
