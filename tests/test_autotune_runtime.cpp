// Autotune on live runs (Concurrency::automatic, GraphOptions::autotune_window): the tuner's
// thread measures the run each window and sets the automatic stages' concurrency; its decisions
// are in RunStats::autotune, the report and the JSON. Checks docs/autotune.md, "In the
// runtime". The policy itself, against the simulator: test_autotune.cpp. No assertion here
// depends on timing: what the tuner decides depends on this machine's speed; that it decides,
// explains, keeps within the cores, keeps a user's number and leaves items whole does not.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <nlohmann/json.hpp>
#include <regex>
#include <splitflow/splitflow.hpp>
#include <string>
#include <thread>
#include <vector>

#include "executor/run_tuner.hpp"
#include "executor/tuning_board.hpp"
#include "helpers.hpp"

using namespace splitflow;
using namespace std::chrono_literals;
using testing_helpers::counter;
using testing_helpers::spin_us;

namespace {

GraphOptions tuned(std::chrono::milliseconds window = 10ms) {
  GraphOptions o;
  o.autotune_window = window;
  return o;
}

// The run's tuner decisions, one a line, for failure messages.
std::string decisions_text(const RunStats& st) {
  std::string all;
  for (const std::string& e : st.autotune) all += "\n  " + e;
  return all;
}

}  // namespace

// "concurrency = auto for any stage ... every decision is an event with its reason"
TEST(AutotuneRuntime, AutomaticStagesAreTunedWithReasonsWithinTheCores) {
  // 4 threads (the budget: 4 cores), costs 1:4: the model's allocation gives 'heavy' more than
  // the 1 both start at (with 2 threads, 1 and 1 would already be the best, and nothing moves).
  Runtime rt({.threads = 4});
  Graph g(rt, "tuned", tuned());
  auto src = g.source("n", counter(6000));
  auto light = g.stage("light", [](long x) { spin_us(20); return x; },
                       {.concurrency = Concurrency::automatic});
  auto heavy = g.stage("heavy", [](long x) { spin_us(80); return x + 1; },
                       {.concurrency = Concurrency::automatic});
  std::vector<long> got;
  auto sink = g.sink("s", [&](long x) { got.push_back(x); });
  src >> light >> heavy >> sink;
  auto run = g.run();
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  // Every item, in order (the automatic stages keep their order whatever their concurrency).
  ASSERT_EQ(got.size(), 6000u);
  for (long i = 0; i < 6000; ++i) ASSERT_EQ(got[static_cast<std::size_t>(i)], i + 1);
  const RunStats st = run.stats();
  ASSERT_FALSE(st.autotune.empty()) << "the tuner decided nothing in a run of many windows";
  // The first decision is the model's allocation; each stage change names its stage and says why.
  EXPECT_EQ(st.autotune.front().rfind("model per item: ", 0), 0u) << st.autotune.front();
  // A change reads "<stage> <from> -> <to>: <reason>" (or "<stage> <knob> <from> -> <to>: ...").
  const std::regex change(R"(^(\S+) (?:capacity )?(\d+|unlimited) -> (\d+|unlimited): .+)");
  std::size_t changes = 0;
  for (const std::string& e : st.autotune) {
    std::smatch m;
    if (!std::regex_match(e, m, change)) continue;  // a graph-level event (model, keep, ...)
    ++changes;
    EXPECT_TRUE(m[1] == "light" || m[1] == "heavy") << "a change of a stage not tuned: " << e;
  }
  const std::string all = decisions_text(st);
  EXPECT_GT(changes, 0u) << "no stage was changed from its start at 1; the decisions:" << all;
  for (const char* name : {"light", "heavy"}) {
    const StageStats* s = st.find(name);
    EXPECT_GE(s->concurrency_limit, 1u) << name;
    EXPECT_LE(s->concurrency_limit, 4u) << name << ": more than the runtime's 4 threads";
    EXPECT_LE(s->max_concurrency, 4u) << name;
  }
  EXPECT_NE(report(st).find("autotune (what the runtime sized: automatic stages, max_in_flight, rings):"), std::string::npos);
  EXPECT_NE(to_json(st).find("\"autotune\":[\""), std::string::npos);
}

// "every decision is an event with its reason ... in the trace and the observer interface": an
// observer hears each decision as it is made, the same ones in the same order as
// RunStats::autotune, and the trace has one "tune" instant event for each.
TEST(AutotuneRuntime, TheDecisionsReachTheObserversAndTheTrace) {
  struct Decisions : Observer {
    std::mutex mu;
    std::vector<std::string> texts;
    bool named = true;
    void on_tune(const TuningEvent& e) override {
      std::lock_guard lk(mu);
      texts.push_back(*e.text);
      named = named && *e.graph == "observed" &&
              (e.stage->empty() || *e.stage == "light" || *e.stage == "heavy") &&
              !e.reason->empty() && e.t_ns > 0;
    }
  };
  auto obs = std::make_shared<Decisions>();
  Runtime rt({.threads = 4});
  GraphOptions o = tuned();
  o.observer = obs;
  o.trace = true;
  Graph g(rt, "observed", o);
  auto src = g.source("n", counter(4000));
  auto light = g.stage("light", [](long x) { spin_us(20); return x; },
                       {.concurrency = Concurrency::automatic});
  auto heavy = g.stage("heavy", [](long x) { spin_us(80); return x + 1; },
                       {.concurrency = Concurrency::automatic});
  auto sink = g.sink("s", [](long) {});
  src >> light >> heavy >> sink;
  auto run = g.run();
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  const RunStats st = run.stats();
  ASSERT_FALSE(st.autotune.empty());
  {
    std::lock_guard lk(obs->mu);
    EXPECT_EQ(obs->texts, st.autotune);
    EXPECT_TRUE(obs->named);
  }
  const auto trace = nlohmann::json::parse(run.trace_json());
  std::vector<std::string> traced;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "i" && e["name"] == "tune") traced.push_back(e["args"]["decision"]);
  EXPECT_EQ(traced, st.autotune);
  EXPECT_EQ(trace["metadata"]["tune_events"], st.autotune.size());
}

// "a number a user sets is respected (autotune works around it)"
// GraphOptions::autotune_window and autotune_cores out of range are refused by the Graph,
// naming the option and its value (a window of 0 or less ran as 1 ms, "converged at 0 items/s";
// a negative or NaN core budget ran as the runtime's threads: silently, a new user's trial).
TEST(AutotuneRuntime, AnAutotuneWindowOrCoreBudgetOutOfRangeIsRefused) {
  Runtime rt(RuntimeConfig{.threads = 2});
  const auto refused = [&](GraphOptions o, const std::string& what) {
    try {
      Graph g(rt, "bad", o);
      ADD_FAILURE() << "taken: " << what;
    } catch (const GraphError& e) {
      EXPECT_NE(std::string(e.what()).find("splitflow::Graph 'bad': GraphOptions::" + what),
                std::string::npos)
          << e.what();
    }
  };
  refused({.autotune_window = 0ms}, "autotune_window is 0 ms; it must be from 1 ms to 1 hour");
  refused({.autotune_window = -5ms}, "autotune_window is -5 ms");
  refused({.autotune_window = std::chrono::hours(2)}, "autotune_window is 7200000 ms");
  refused({.autotune_cores = -1}, "autotune_cores is -1.000000; it must be a finite number");
  refused({.autotune_cores = std::numeric_limits<double>::quiet_NaN()}, "autotune_cores is nan");
  refused({.autotune_cores = std::numeric_limits<double>::infinity()}, "autotune_cores is inf");
  // The edges are taken: 1 ms, an hour, 0 cores (the runtime's threads), a fraction of one.
  EXPECT_NO_THROW(Graph(rt, "ok", {.autotune_window = 1ms}));
  EXPECT_NO_THROW(Graph(rt, "ok", {.autotune_window = std::chrono::hours(1)}));
  EXPECT_NO_THROW(Graph(rt, "ok", {.autotune_cores = 0}));
  EXPECT_NO_THROW(Graph(rt, "ok", {.autotune_cores = 0.25}));
}

TEST(AutotuneRuntime, AUserSetConcurrencyIsKept) {
  Runtime rt({.threads = 2});
  Graph g(rt, "mixed", tuned());
  auto src = g.source("n", counter(4000));
  auto tuned_stage = g.stage("auto", [](long x) { spin_us(30); return x; },
                             {.concurrency = Concurrency::automatic});
  auto fixed = g.stage("fixed", [](long x) { spin_us(30); return x; }, {.concurrency = 1});
  std::atomic<long> n{0};
  auto sink = g.sink("s", [&](long) { ++n; });
  src >> tuned_stage >> fixed >> sink;
  auto run = g.run();
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  EXPECT_EQ(n.load(), 4000);
  const RunStats st = run.stats();
  EXPECT_EQ(st.find("fixed")->concurrency_limit, 1u);
  EXPECT_EQ(st.find("fixed")->max_concurrency, 1u);
  for (const std::string& e : st.autotune) EXPECT_NE(e.rfind("fixed ", 0), 0u) << e;
  EXPECT_LE(st.find("auto")->concurrency_limit, 2u);
}

// A window in which the graph delivered too few items to measure its rate is joined to the
// next: a new user's trial at 20 ms windows read "converged at 0 items/s, 0.00 of the bound
// 1474" and "rate fell from 943.5 to 0 items/s: climbing again", its run in order behind one
// 8-megapixel photo. Here every 400th item takes 45 ms of wall time (4-5 windows of 10 ms; a
// join goes to 8 windows, 80 ms at least) and holds the in-order delivery behind it: no window
// of the tuner's reads a rate of 0. (Before: 3 runs of 3 read "converged at 0 items/s"; with
// 25 ms, or 50 ms against 20 ms windows, the old tuner's texts happened not to show it.)
TEST(AutotuneRuntime, AWindowThatDeliveredTooFewItemsIsJoinedToTheNext) {
  Runtime rt({.threads = 2});
  Graph g(rt, "stalls", tuned());
  auto src = g.source("n", counter(3000));
  auto work = g.stage("work", [](long x) { spin_us(x % 400 == 399 ? 45'000 : 40); return x; },
                      {.concurrency = Concurrency::automatic, .order = Order::in_order});
  std::vector<long> got;
  auto sink = g.sink("s", [&](long x) { got.push_back(x); });
  src >> work >> sink;
  auto run = g.run();
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  ASSERT_EQ(got.size(), 3000u);
  for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], static_cast<long>(i));
  const RunStats st = run.stats();
  ASSERT_FALSE(st.autotune.empty());
  const std::regex zero_rate(R"((^|[^\d.])0 items/s)");
  for (const std::string& e : st.autotune)
    EXPECT_FALSE(std::regex_search(e, zero_rate)) << e << decisions_text(st);
}

// Only CPU stages take Concurrency::automatic; anything else is refused when the run starts.
// "GPU-aware objective: keep GPU stages fed": a GPU stage given Concurrency::automatic (bursts in
// flight) is modelled from the graph's device time, not its bursts' wall time as CPU: the model
// names its device time, the device bounds the rate, and the tuner gives it at least the 2
// bursts (one enqueues while one runs) and at most the device's streams.
TEST(AutotuneRuntime, AnAutomaticGpuStageIsModelledByItsDeviceTime) {
  RuntimeConfig c{.threads = 2};
  c.device.backend = BackendKind::host;
  c.device.host_compute_slots = 1;
  c.device.streams = 4;
  Runtime rt(c);
  Graph g(rt, "gpu-tuned", tuned(20ms));
  auto src = g.source("n", counter(400));
  auto prep = g.stage("prep", [](long x) {
    spin_us(50);
    HostTensor t = HostTensor::empty(DType::i64, {1});
    t.data<std::int64_t>()[0] = x;
    return t;
  }, {.concurrency = Concurrency::automatic});
  auto model = g.gpu_stage("model", [](DeviceTensor t, DeviceContext& ctx) {
    ops::busy_kernel(ctx, 1ms);  // 400 ms of device time at least: many windows
    return ctx.to_host(t);
  }, {.concurrency = Concurrency::automatic});
  std::vector<std::int64_t> got;
  auto sink = g.sink("s", [&](HostTensor t) { got.push_back(t.data<std::int64_t>()[0]); });
  src >> prep >> model >> sink;
  auto run = g.run();
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  ASSERT_EQ(got.size(), 400u);
  for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], static_cast<std::int64_t>(i));
  const RunStats st = run.stats();
  const std::string all = decisions_text(st);
  ASSERT_FALSE(st.autotune.empty());
  const std::string& first = st.autotune.front();
  EXPECT_NE(first.find(" GPU; bound "), std::string::npos) << all;   // "model 1.1 ms GPU"
  // The device binds, in a model of a later window if not of the first. (Under TSan on a loaded
  // machine prep's first items measured 1.6 ms, not 50 us, and the cores bound that first
  // estimate; the next windows' models name the device: CI of the 2026-12-05 tree.)
  const bool device_binds = std::any_of(st.autotune.begin(), st.autotune.end(), [](const std::string& e) {
    return e.find("model per item") != std::string::npos && e.find("(GPU 0 ('model'") != std::string::npos;
  });
  EXPECT_TRUE(device_binds) << all;
  bool raised = false;
  const std::regex change(R"(^model (\d+) -> (\d+): .+)");
  for (const std::string& e : st.autotune) {
    std::smatch m;
    if (!std::regex_match(e, m, change)) continue;
    raised |= m[1] == "1";
    EXPECT_LE(std::stoul(m[2]), 4u) << "more bursts than the device's streams: " << e;
  }
  EXPECT_TRUE(raised) << "the GPU stage was not raised from its start at 1:" << all;
  const StageStats* m = st.find("model");
  EXPECT_GE(m->concurrency_limit, 2u) << all;
  EXPECT_LE(m->concurrency_limit, 4u) << all;
}

// Items through a stage per item delivered come from the graph's shape where it is a chain
// to one sink: before a Graph::batch of 8, exactly 8 (measured, the first windows read x2.43
// for a plain chain's stage whose queues were filling, and x14.7 to x26.7 for a batch of 16:
// a trial). The decisions mark it "x8".
TEST(AutotuneRuntime, AStageBeforeABatchVisitsAsManyTimesAsTheBatchHolds) {
  Runtime rt({.threads = 2});
  Graph g(rt, "batched", tuned(20ms));
  auto src = g.source("n", counter(3000));
  auto a = g.stage("a", [](long x) { spin_us(30); return x; }, {.concurrency = Concurrency::automatic});
  auto b = g.stage("b", [](std::vector<long> v) { spin_us(60); return static_cast<long>(v.size()); },
                   {.concurrency = Concurrency::automatic});
  long items = 0;
  auto sink = g.sink("s", [&](long n) { items += n; });
  src >> a >> g.batch<long>("batch", 8) >> b >> sink;
  auto run = g.run();
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  EXPECT_EQ(items, 3000);
  const RunStats st = run.stats();
  const std::string all = decisions_text(st);
  ASSERT_FALSE(st.autotune.empty());
  const std::string& first = st.autotune.front();
  EXPECT_NE(first.find("model per item: a "), std::string::npos) << all;
  EXPECT_NE(first.find(" cpu x8, b "), std::string::npos) << all;
  EXPECT_EQ(first.find(" cpu x8."), std::string::npos) << all;
}

// White-box: what the tuner is told of a window with GPU stages. A GPU stage's work time is its
// bursts' (lease to completion), so it is no CPU (cpu_ns 0, and a fixed GPU stage takes no cores
// off the budget); the graph's device time goes to the GPU stages in proportion to their bursts'
// time; bursts in flight are capped at the device's streams. A GPU stage whose concurrency its
// user set is in the model at that number (a user's unlimited one: the device's streams), so
// that the bound knows the rate it allows.
TEST(AutotuneRuntime, AGpuStagesSampleIsItsShareOfTheDeviceTimeAndNoCpu) {
  auto stage = [](std::string name, StageKind kind, std::vector<std::string> consumers) {
    return testing_helpers::stage_stats(std::move(name), kind, std::move(consumers), {.capacity = 8});
  };
  RunStats before;
  before.wall_ns = 1'000'000'000;
  before.stages = {stage("n", StageKind::source, {"prep"}), stage("prep", StageKind::stage, {"a"}),
                   stage("a", StageKind::gpu_stage, {"b"}), stage("b", StageKind::gpu_stage, {"s"}),
                   stage("s", StageKind::sink, {})};
  RunStats now = before;
  now.wall_ns = 2'000'000'000;  // a window of 1 s
  now.stages[1].items_out = 100, now.stages[1].work_ns = 400'000'000;
  now.stages[2].items_out = 100, now.stages[2].work_ns = 300'000'000;
  now.stages[3].items_out = 100, now.stages[3].work_ns = 100'000'000;
  now.stages[4].items_in = 100, now.stages[4].items_out = 100;  // the sink consumed them
  now.gpu.busy_ns = 200'000'000;
  now.gpu.device_streams = 6;
  std::vector<std::size_t> modelled;
  double fixed = -1;
  const autotune::Sample s = detail::RunTuner::sample_of(
      before, now, {false, true, true, false, false}, 4, &modelled, &fixed);
  EXPECT_EQ(modelled, (std::vector<std::size_t>{1, 2, 3}));  // the automatic ones and 'b'
  ASSERT_EQ(s.stages.size(), 3u);
  EXPECT_EQ(s.delivered, 100u);
  EXPECT_DOUBLE_EQ(fixed, 0.0);  // 'b' is fixed, but a GPU stage: no cores
  const autotune::StageSample& prep = s.stages[0];
  EXPECT_FALSE(prep.gpu);
  EXPECT_EQ(prep.cpu_ns, -1);  // unknown: its work is taken as CPU
  EXPECT_EQ(prep.max_concurrency, 4u);
  EXPECT_FALSE(prep.fixed_concurrency);
  const autotune::StageSample& a = s.stages[1];
  EXPECT_TRUE(a.gpu);
  EXPECT_EQ(a.cpu_ns, 0);
  EXPECT_EQ(a.gpu_busy_ns, 150'000'000);  // 200 ms x 300 / (300 + 100)
  EXPECT_EQ(a.max_concurrency, 6u);
  EXPECT_EQ(a.producers, (std::vector<std::size_t>{0}));
  EXPECT_FALSE(a.fixed_concurrency);
  const autotune::StageSample& b = s.stages[2];
  EXPECT_TRUE(b.gpu);
  EXPECT_EQ(b.cpu_ns, 0);
  EXPECT_EQ(b.gpu_busy_ns, 50'000'000);
  EXPECT_EQ(b.fixed_concurrency, std::optional<std::size_t>(1));
  EXPECT_EQ(b.producers, (std::vector<std::size_t>{1}));
  // A user's unlimited GPU stage: as many bursts as the device has streams.
  now.stages[3].concurrency_limit = Concurrency::unlimited;
  const autotune::Sample u = detail::RunTuner::sample_of(
      before, now, {false, true, true, false, false}, 4, nullptr, nullptr);
  ASSERT_EQ(u.stages.size(), 3u);
  EXPECT_EQ(u.stages[2].fixed_concurrency, std::optional<std::size_t>(6));
}

// "a number a user sets is respected (autotune works around it)" and "GPU-aware": a GPU stage
// whose concurrency its user set to 1 limits the graph's rate, and the bound the decisions state
// is that stage's (before, it was out of the model: a trial read "converged at 768 items/s, 0.00
// of the bound 3.29e+05 (cores: ...)"). Its number is kept.
TEST(AutotuneRuntime, AGpuStageWhoseConcurrencyItsUserSetIsTheBoundItLimits) {
  RuntimeConfig c{.threads = 2};
  c.device.backend = BackendKind::host;
  c.device.host_compute_slots = 2;
  c.device.streams = 4;
  Runtime rt(c);
  Graph g(rt, "gpu-fixed", tuned(20ms));
  auto src = g.source("n", counter(300));
  auto prep = g.stage("prep", [](long x) {
    spin_us(20);
    HostTensor t = HostTensor::empty(DType::i64, {1});
    t.data<std::int64_t>()[0] = x;
    return t;
  }, {.concurrency = Concurrency::automatic});
  auto model = g.gpu_stage("model", [](DeviceTensor t, DeviceContext& ctx) {
    ops::busy_kernel(ctx, 2ms);  // 600 ms of device time: many windows
    return ctx.to_host(t);
  }, {.concurrency = 1});
  std::vector<std::int64_t> got;
  auto sink = g.sink("s", [&](HostTensor t) { got.push_back(t.data<std::int64_t>()[0]); });
  src >> prep >> model >> sink;
  auto run = g.run();
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  ASSERT_EQ(got.size(), 300u);
  for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], static_cast<std::int64_t>(i));
  const RunStats st = run.stats();
  const std::string all = decisions_text(st);
  ASSERT_FALSE(st.autotune.empty());
  // The bound names 'model' (its one burst at a time, or the device's time it uses), in a
  // later window's model if not in the first (a loaded machine can make prep's first items
  // slow, and the cores bind that first estimate).
  const bool model_binds = std::any_of(st.autotune.begin(), st.autotune.end(), [](const std::string& e) {
    return e.find("'model' at concurrency 1") != std::string::npos ||
           e.find("(GPU 0 ('model'") != std::string::npos;
  });
  EXPECT_TRUE(model_binds) << all;
  const std::regex change(R"(^model (\d+) -> (\d+): .+)");
  for (const std::string& e : st.autotune)
    EXPECT_FALSE(std::regex_match(e, change)) << "a decision changed the user's GPU stage: " << e;
  EXPECT_EQ(st.find("model")->concurrency_limit, 1u) << all;
  // GPU-aware: one slot of prep (20 us an item) keeps a 2 ms burst fed; the rest is released
  // (before, the cores bound the model and prep went to 2).
  EXPECT_EQ(st.find("prep")->concurrency_limit, 1u) << all;
}

// "several graphs on one runtime share the budget, split by their measured demand and their
// priority": the board's shares (white-box) never add up to more than the cores; a graph that
// asks for less than its fair share gets what it asks, the rest goes to the others by weight;
// one that leaves gives its cores back.
TEST(AutotuneRuntime, TheRuntimesTunedRunsShareItsCoresByDemandAndPriority) {
  detail::TuningBoard board(8);
  int a = 0, b = 0, c = 0;  // three runs' identities
  bool alone = false;
  board.join(&a, 0);
  EXPECT_EQ(board.share(&a, {.cores = 1e18}, &alone).cores, 8);
  EXPECT_TRUE(alone);
  board.join(&b, 0);
  // b has not posted yet: it asks for everything, and they split evenly.
  EXPECT_EQ(board.share(&a, {.cores = 1e18}, &alone).cores, 4);
  EXPECT_FALSE(alone);
  // A GPU-limited b needs 2.3 cores: it gets 3, a the other 5.
  EXPECT_EQ(board.share(&b, {.cores = 2.3}, &alone).cores, 3);
  EXPECT_EQ(board.share(&a, {.cores = 1e18}).cores, 5);
  // c with priority 1 (weight 2): the fair shares are 2, 2 and 4; b's 2.3 is above its 2 now,
  // so all three share by weight.
  board.join(&c, 1);
  const double sa = board.share(&a, {.cores = 1e18}).cores;
  const double sb = board.share(&b, {.cores = 2.3}).cores;
  const double sc = board.share(&c, {.cores = 1e18}).cores;
  EXPECT_EQ(sa, 2);
  EXPECT_EQ(sb, 2);
  EXPECT_EQ(sc, 4);
  // b asking for 1.5 (below its fair share) gets 2 (whole cores); the others share the 6 left.
  EXPECT_EQ(board.share(&b, {.cores = 1.5}).cores, 2);
  EXPECT_LE(board.share(&a, {.cores = 1e18}).cores + 2 + board.share(&c, {.cores = 1e18}).cores, 8);
  board.leave(&c);
  board.leave(&b);
  EXPECT_EQ(board.size(), 1u);
  EXPECT_EQ(board.share(&a, {.cores = 1e18}, &alone).cores, 8);
  EXPECT_TRUE(alone);
}

// The same on live runs: two CPU-bound tuned graphs running at once on 4 threads each get a
// share (a budget event "budget 4 -> 2 cores (a share of a pool)"), and neither runs more
// invocations of a stage than the threads. Their sources hold their first items until both
// runs have started, so the runs overlap for many windows whatever this machine's speed.
TEST(AutotuneRuntime, TwoTunedGraphsOnOneRuntimeShareItsThreads) {
  Runtime rt({.threads = 4});
  std::atomic<int> started{0};
  auto build = [&](Graph& g, std::atomic<long>& seen) {
    long i = 0;
    auto src = g.source("n", [&started, i]() mutable -> std::optional<long> {
      if (i == 0) {
        started.fetch_add(1);
        while (started.load() < 2) std::this_thread::yield();  // both runs are live
      }
      if (i == 20000) return std::nullopt;
      return i++;
    });
    auto work = g.stage("work", [](long x) { spin_us(40); return x; },
                        {.concurrency = Concurrency::automatic});
    auto sink = g.sink("s", [&seen](long) { seen.fetch_add(1); });
    src >> work >> sink;
  };
  Graph g1(rt, "one", tuned()), g2(rt, "two", tuned());
  std::atomic<long> seen1{0}, seen2{0};
  build(g1, seen1);
  build(g2, seen2);
  auto r1 = g1.run();
  auto r2 = g2.run();
  ASSERT_EQ(r1.wait(), RunStatus::succeeded);
  ASSERT_EQ(r2.wait(), RunStatus::succeeded);
  EXPECT_EQ(seen1.load(), 20000);
  EXPECT_EQ(seen2.load(), 20000);
  for (const splitflow::Run* r : {&r1, &r2}) {
    const RunStats st = r->stats();
    std::string all;
    bool shared = false;
    for (const std::string& e : st.autotune) {
      all += "\n  " + e;
      shared |= e.find("budget 4 -> 2 cores (a share of a pool)") != std::string::npos;
    }
    EXPECT_TRUE(shared) << st.graph << ": no share of the runtime's 4 threads; the decisions:" << all;
    EXPECT_LE(st.find("work")->max_concurrency, 4u) << st.graph;
  }
}

TEST(AutotuneRuntime, OnlyCpuAndGpuStagesTakeAutomatic) {
  Runtime rt({.threads = 1});
  Graph g(rt, "bad");
  auto src = g.source("n", counter(3));
  auto sink = g.sink("s", [](long) {}, {.concurrency = Concurrency::automatic,
                                        .order = Order::out_of_order});
  src >> sink;
  try {
    g.run().wait();
    FAIL() << "an automatic sink was accepted";
  } catch (const GraphError& e) {
    EXPECT_NE(std::string(e.what()).find("sink 's': Concurrency::automatic is for CPU stages"),
              std::string::npos)
        << e.what();
  }
}

// The tuner's thread ends with the run: a cancel ends the run, and the graph runs again with a
// fresh tuner.
TEST(AutotuneRuntime, ACancelledTunedRunEndsAndTheGraphRunsAgain) {
  Runtime rt({.threads = 2});
  Graph g(rt, "again", tuned(5ms));
  std::atomic<long> seen{0};
  auto src = g.source("n", counter(-1));
  auto st1 = g.stage("work", [](long x) { spin_us(20); return x; },
                     {.concurrency = Concurrency::automatic});
  auto sink = g.sink("s", [&](long) { seen.fetch_add(1); });
  src >> st1 >> sink;
  auto run = g.run();
  while (seen.load() < 500) std::this_thread::yield();  // (an endless source: wait for items)
  run.cancel();
  ASSERT_TRUE(run.wait_for(10s));
  EXPECT_EQ(run.status(), RunStatus::cancelled);
  EXPECT_FALSE(g.running());
  // Again, with an end this time.
  Graph h(rt, "bounded", tuned(5ms));
  long m = 0;
  auto s2 = h.source("n", counter(2000));
  auto w2 = h.stage("work", [](long x) { spin_us(20); return x; },
                    {.concurrency = Concurrency::automatic});
  auto k2 = h.sink("s", [&](long) { ++m; });
  s2 >> w2 >> k2;
  for (int round = 0; round < 2; ++round) {
    m = 0;
    EXPECT_EQ(h.run().wait(), RunStatus::succeeded);
    EXPECT_EQ(m, 2000) << "round " << round;
  }
}

// A graph built anew for each epoch (as GraphDataset and the image benchmark do) starts its
// automatic stages where the last tuned run of a graph of its name ended them, not at 1: the
// runtime remembers (TuningBoard::remember, at most kRemembered graphs). A graph of another
// name starts at 1.
TEST(AutotuneRuntime, AGraphBuiltAnewStartsWhereTheLastRunOfItsNameEnded) {
  Runtime rt({.threads = 4});
  auto build_and_run = [&](const std::string& name) {
    Graph g(rt, name, tuned());
    auto src = g.source("n", counter(6000));
    auto light = g.stage("light", [](long x) { spin_us(20); return x; },
                         {.concurrency = Concurrency::automatic});
    auto heavy = g.stage("heavy", [](long x) { spin_us(80); return x + 1; },
                         {.concurrency = Concurrency::automatic});
    long sum = 0, n = 0;
    auto sink = g.sink("s", [&](long x) { sum += x; ++n; });
    src >> light >> heavy >> sink;
    auto run = g.run();
    EXPECT_EQ(run.wait(), RunStatus::succeeded);
    EXPECT_EQ(n, 6000);
    EXPECT_EQ(sum, 6000L * 6001 / 2);  // every item once
    return run.stats();
  };
  const RunStats first = build_and_run("epoch");
  const std::size_t heavy_end = first.find("heavy")->concurrency_limit;
  const std::size_t light_end = first.find("light")->concurrency_limit;
  ASSERT_GT(std::max(heavy_end, light_end), 1u)
      << "the first run left both stages at 1 (the test needs the tuner to have raised one)";
  const RunStats second = build_and_run("epoch");
  std::vector<std::string> warm;
  for (const std::string& e : second.autotune)
    if (e.find("(warm start)") != std::string::npos) warm.push_back(e);
  // Each stage the first run ended above 1 starts there, and says so, before the model speaks.
  std::vector<std::string> want;
  for (const auto& [name, end] : {std::pair<const char*, std::size_t>{"light", light_end}, {"heavy", heavy_end}})
    if (end > 1)
      want.push_back(std::string(name) + " 1 -> " + std::to_string(end) +
                     ": where the last run of graph 'epoch' ended (warm start)");
  EXPECT_EQ(warm, want);
  ASSERT_FALSE(second.autotune.empty());
  EXPECT_EQ(second.autotune.front(), want.front());
  // Its stages ran at least that wide at once at some point: the start took effect.
  EXPECT_GE(second.find("heavy")->max_concurrency, heavy_end > 1 ? 2u : 1u);
  // Another name: no memory of it.
  const RunStats other = build_and_run("another");
  for (const std::string& e : other.autotune) EXPECT_EQ(e.find("(warm start)"), std::string::npos) << e;
  // The memory is bounded: the board keeps the latest kRemembered graphs.
  detail::TuningBoard board(4);
  for (std::size_t i = 0; i < detail::TuningBoard::kRemembered + 5; ++i)
    board.remember("g" + std::to_string(i), {{"s", i + 1}});
  EXPECT_TRUE(board.recall("g0").empty()) << "the oldest was dropped";
  EXPECT_TRUE(board.recall("g4").empty());
  const auto kept = board.recall("g5");
  ASSERT_EQ(kept.size(), 1u);
  EXPECT_EQ(kept[0].second, 6u);
  board.remember("g5", {{"s", 9}});  // remembered again: replaced, and now the newest
  EXPECT_EQ(board.recall("g5")[0].second, 9u);
}

// "Stages that wait rather than compute (reads from a slow file system or object store: latency
// without CPU) get concurrency beyond the core count where that raises the rate": an async
// stage (Graph::async_stage) whose answers come 2 ms later from a timer thread (the I/O: no CPU,
// no arena thread) is measured as an I/O stage (its bodies' calls are its CPU) and given more
// items out at once than the runtime has threads, at most the slots of its consumer's queue.
TEST(AutotuneRuntime, AnAsyncIoStageGoesBeyondTheThreadsUpToItsConsumersQueue) {
  Runtime rt({.threads = 2});
  Graph g(rt, "io", tuned(20ms));
  constexpr long kItems = 3000;
  auto clock = BatchClock::steady();
  std::atomic<int> out{0}, most{0};
  auto src = g.source("n", counter(kItems));
  auto read = g.async_stage<long, long>("read", [&](long x, Completion<long> c) {
    const int now = out.fetch_add(1) + 1;
    for (int m = most.load(); now > m && !most.compare_exchange_weak(m, now);) {
    }
    auto held = std::make_shared<Completion<long>>(std::move(c));
    clock->call_at(clock->now() + 2ms, [held, x, &out] {
      out.fetch_sub(1);
      held->done(x * 2);
    });
  }, {.concurrency = Concurrency::automatic});
  auto work = g.stage("work", [](long x) { spin_us(20); return x + 1; },
                      {.concurrency = Concurrency::automatic});
  std::vector<long> got;
  auto sink = g.sink("s", [&](long x) { got.push_back(x); });
  src >> read >> work >> sink;
  auto run = g.run();
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  ASSERT_EQ(got.size(), static_cast<std::size_t>(kItems));
  for (long i = 0; i < kItems; ++i) ASSERT_EQ(got[static_cast<std::size_t>(i)], 2 * i + 1) << i;
  const RunStats st = run.stats();
  const std::string all = decisions_text(st);
  const StageStats* r = st.find("read");
  const StageStats* w = st.find("work");
  // Its calls are measured apart from its items' time (which includes the 2 ms wait).
  ASSERT_GE(r->call_ns, 0);
  EXPECT_LT(r->call_ns, r->work_ns / 2);
  EXPECT_GE(r->work_ns, static_cast<std::int64_t>(kItems) * 2'000'000) << "each item waited 2 ms";
  EXPECT_EQ(w->call_ns, -1) << "a synchronous stage has no separate call time";
  // The model calls it I/O: "read 1 -> N: 2.xx ms per item (y us CPU), ...".
  const std::regex raise(R"(^read 1 -> (\d+): \S+ ms per item \(\S+ \S+ CPU\), .+)");
  std::size_t first = 0;
  for (const std::string& e : st.autotune) {
    std::smatch m;
    if (std::regex_match(e, m, raise)) {
      first = std::stoul(m[1]);
      break;
    }
  }
  EXPECT_GT(first, 2u) << "the model's raise of 'read' past the 2 threads is not among:" << all;
  // Beyond the threads at once, never beyond the slots of its consumer's queue.
  EXPECT_GT(most.load(), 2) << all;
  EXPECT_GT(r->max_concurrency, 2u);
  // (The tuner sizes 'work''s queue too: from 1 up to max_in_flight, its ceiling; at the end it
  // has the slots 'read''s items out reserve.)
  EXPECT_LE(r->concurrency_limit, w->capacity) << all;
  EXPECT_LE(static_cast<std::size_t>(most.load()), GraphOptions{}.max_in_flight);
  // The CPU stage stays within the threads.
  EXPECT_LE(w->concurrency_limit, 2u);
}

// White-box: what the tuner is told of an async stage's window: its calls' time as its CPU, the
// smallest of its consumers' queue capacities as its ceiling; a synchronous stage's ceiling is
// the cores and its CPU unknown.
TEST(AutotuneRuntime, AnAsyncStagesSampleIsItsCallsCpuAndItsConsumersSlots) {
  RunStats before, now;
  before.wall_ns = 0;
  now.wall_ns = 1'000'000'000;
  auto stage = [](const char* name, StageKind kind, std::int64_t work, std::int64_t call,
                  std::size_t capacity, std::vector<std::string> consumers) {
    return testing_helpers::stage_stats(name, kind, std::move(consumers),
                                        {.limit = 3, .items = 100, .work = work, .capacity = capacity, .call = call});
  };
  before.stages = {stage("src", StageKind::source, 0, -1, 0, {"read"}),
                   stage("read", StageKind::stage, 0, 0, 32, {"a", "b"}),
                   stage("a", StageKind::stage, 0, -1, 24, {"s"}),
                   stage("b", StageKind::stage, 0, -1, 40, {"s"}),
                   stage("s", StageKind::sink, 0, -1, 32, {})};
  now.stages = before.stages;
  for (StageStats& s : now.stages) s.items_out = 200;
  now.stages[1].work_ns = 200'000'000;  // 100 items of 2 ms out
  now.stages[1].call_ns = 500'000;      // their calls: 5 us each
  now.stages[2].work_ns = 10'000'000;
  const std::vector<bool> tuned = {false, true, true, false, false};
  std::vector<std::size_t> modelled;
  const autotune::Sample s = detail::RunTuner::sample_of(before, now, tuned, 2, &modelled, nullptr);
  ASSERT_EQ(modelled, (std::vector<std::size_t>{1, 2}));
  ASSERT_EQ(s.stages.size(), 2u);
  EXPECT_EQ(s.stages[0].name, "read");
  EXPECT_EQ(s.stages[0].cpu_ns, 500'000);
  EXPECT_EQ(s.stages[0].work_ns, 200'000'000);
  EXPECT_EQ(s.stages[0].max_concurrency, 24u) << "the smaller of its consumers' queues";
  EXPECT_EQ(s.stages[1].cpu_ns, -1) << "a synchronous stage's CPU is not measured";
  EXPECT_EQ(s.stages[1].max_concurrency, 2u) << "the cores";
  // What feeds them and what they feed outside the model, for the texts.
  EXPECT_EQ(s.stages[0].fed_by, "source 'src'");
  EXPECT_EQ(s.stages[0].feeds, "'b' (not tuned)");
  EXPECT_EQ(s.stages[1].fed_by, "");
  EXPECT_EQ(s.stages[1].feeds, "sink 's'");
  EXPECT_FALSE(s.stages[0].feeds_consumer) << "'b' is a stage of the graph, not its consumer";
  EXPECT_TRUE(s.stages[1].feeds_consumer);
  // The model: 'read' is an I/O stage (5 us of CPU in 2 ms).
  autotune::CostEstimator est;
  est.add(s);
  const auto models = est.models();
  ASSERT_EQ(models.size(), 2u);
  EXPECT_EQ(models[0].resource, autotune::Resource::io);
  EXPECT_EQ(models[1].resource, autotune::Resource::cpu);
}

// "automatic queue capacities": the input queues of automatic CPU stages whose capacity the
// user did not set are sized by the tuner (its capacity decisions reach the nodes); a capacity
// the user set is kept, a queue after a batch stays within its ceiling in batches (the next
// tests), and GraphOptions::autotune_queues = false keeps every queue as sized.
TEST(AutotuneRuntime, TheTunerSizesTheQueuesOfAutomaticStagesItsUserDidNotSize) {
  auto build_and_run = [](bool queues) {
    Runtime rt({.threads = 2});
    GraphOptions o = tuned(10ms);
    o.autotune_queues = queues;
    Graph g(rt, "queues", o);
    constexpr long kItems = 6000;
    auto src = g.source("n", counter(kItems));
    auto a = g.stage("a", [](long x) { spin_us(20); return x; },
                     {.concurrency = Concurrency::automatic});
    auto b = g.stage("b", [](long x) { spin_us(60); return x + 1; },
                     {.concurrency = Concurrency::automatic});
    auto c = g.stage("c", [](long x) { spin_us(5); return x; },
                     {.concurrency = Concurrency::automatic, .capacity = 5});
    auto batch = g.batch<long>("batch", 4);
    auto d = g.stage("d", [](std::vector<long> v) { spin_us(5); return v; },
                     {.concurrency = Concurrency::automatic});
    std::vector<long> got;
    auto sink = g.sink("s", [&](std::vector<long> v) { got.insert(got.end(), v.begin(), v.end()); });
    src >> a >> b >> c >> batch >> d >> sink;
    auto run = g.run();
    EXPECT_EQ(run.wait(), RunStatus::succeeded);
    EXPECT_EQ(got.size(), static_cast<std::size_t>(kItems));
    for (long i = 0; i < kItems && i < static_cast<long>(got.size()); ++i)
      EXPECT_EQ(got[static_cast<std::size_t>(i)], i + 1) << i;
    return run.stats();
  };
  const std::regex cap(R"(^(\S+) capacity (\d+) -> (\d+): .+)");
  auto last_capacity = [&](const RunStats& st) {
    std::map<std::string, std::size_t> last;
    for (const std::string& e : st.autotune) {
      std::smatch m;
      if (std::regex_match(e, m, cap)) last[m[1]] = std::stoul(m[3]);
    }
    return last;
  };
  const RunStats on = build_and_run(true);
  const std::string all = decisions_text(on);
  const auto last = last_capacity(on);
  ASSERT_TRUE(last.count("a") && last.count("b")) << "no capacity decision for a or b:" << all;
  // The last decision reached each queue (within its ceiling, max_in_flight).
  for (const char* name : {"a", "b"}) {
    const std::size_t want = std::min(last.at(name), GraphOptions{}.max_in_flight);
    EXPECT_EQ(on.find(name)->capacity, want) << name << all;
  }
  EXPECT_FALSE(last.count("c")) << "c's capacity is its user's";
  EXPECT_EQ(on.find("c")->capacity, 5u);
  // A queue after a batch is the tuner's too (a batch reserves a slot a claim: the next test),
  // in batches, within its ceiling: max_in_flight source items, 256 / 4 = 64 batches of 4.
  EXPECT_LE(on.find("d")->capacity, 64u) << all;
  if (last.count("d")) EXPECT_EQ(on.find("d")->capacity, std::min<std::size_t>(last.at("d"), 64)) << all;
  // Off: no capacity decisions; the queues as sized (the default 32).
  const RunStats off = build_and_run(false);
  EXPECT_TRUE(last_capacity(off).empty());
  EXPECT_EQ(off.find("a")->capacity, 32u);
  EXPECT_EQ(off.find("b")->capacity, 32u);
}

// A dynamic batch reserves one slot a batch, as a fixed batch does: the queue after it is
// tuned. An unbatch reserves a batch's slots all or none, so the queue after it keeps its size
// (a cut below its batch would never grant them: the run would stall). Under a memory budget a
// tuned queue starts with room for its producers' claims and one more, and the tuner raises it
// once it has measured the items: so a tuned queue shows a decision whatever the machine's speed.
TEST(AutotuneRuntime, TheQueueAfterADynamicBatchIsTunedAndTheOneAfterAnUnbatchKept) {
  Runtime rt({.threads = 2, .host_memory_budget = std::size_t{64} << 20});
  Graph g(rt, "batches", tuned(10ms));
  constexpr long kItems = 12000;  // about 0.2 s here: a score of the tuner's 10 ms windows
  auto src = g.source("n", counter(kItems));
  auto gather = g.dynamic_batch<long>("gather", {.max_batch = 4});
  auto e = g.stage("e", [](Batch<long> b) { spin_us(40); for (long& x : b.items) x *= 2; return b; },
                   {.concurrency = Concurrency::automatic});
  auto split = g.unbatch<long>("split", 4);
  auto f = g.stage("f", [](long x) { spin_us(5); return x + 1; }, {.concurrency = Concurrency::automatic});
  std::vector<long> got;
  auto sink = g.sink("s", [&](long x) { got.push_back(x); });
  src >> gather >> e >> split >> f >> sink;
  auto run = g.run();
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  ASSERT_EQ(got.size(), static_cast<std::size_t>(kItems));
  for (long i = 0; i < kItems; ++i) ASSERT_EQ(got[static_cast<std::size_t>(i)], 2 * i + 1) << i;
  const RunStats st = run.stats();
  std::string all;
  bool e_sized = false, f_sized = false;
  for (const std::string& d : st.autotune) {
    all += "\n  " + d;
    if (d.rfind("e capacity ", 0) == 0) e_sized = true;
    if (d.rfind("f capacity ", 0) == 0) f_sized = true;
  }
  EXPECT_TRUE(e_sized) << "no capacity decision for e, fed by a dynamic batch:" << all;
  EXPECT_FALSE(f_sized) << "f is fed by an unbatch:" << all;
  EXPECT_LE(st.find("e")->capacity, GraphOptions{}.max_in_flight / 4) << all;
}

namespace {
// An item of 1 MiB whose buffers are counted while they live: the most alive at once is what
// the run's items held at most.
struct Counted {
  static constexpr std::size_t kBytes = std::size_t{1} << 20;
  static inline std::atomic<long> live{0}, peak{0};
  // (Not written: what it costs to make is the allocation's, not 1 MiB of page faults.)
  std::unique_ptr<std::uint8_t[]> data{new std::uint8_t[kBytes]};
  Counted() {
    const long n = live.fetch_add(1) + 1;
    for (long p = peak.load(); n > p && !peak.compare_exchange_weak(p, n);) {
    }
  }
  ~Counted() { live.fetch_sub(1); }
  Counted(const Counted&) = delete;
};
struct Blob {
  std::unique_ptr<Counted> buf;
  long n = 0;
};
std::size_t host_bytes(const Blob& b) { return sizeof b + (b.buf ? Counted::kBytes : 0); }

// source 'n' (a counter) >> 'make' (automatic: a Blob of 1 MiB) >> 'work' >> sink 's', on 2
// threads under a memory budget (0: none). Work's first item waits (1 s at most) until `fill`
// items are alive, so that the queues in front of it fill to what they may hold whatever this
// machine's speed (a sanitizer's make is slower): without a bound they let `fill` in; with one
// the wait ends at it. Checks that every item arrived, in order, and was freed; returns the
// run's stats and the most items alive at once. With `second_source`, a source 'm' of as many
// items merges into 'make' too (every item of each arrives, each source's in its order).
struct BlobRun {
  std::size_t budget = 0;
  long items = 0;
  int make_us = 0, work_us = 0;
  long fill = 0;
  StageOptions work{}, sink{};
  bool second_source = false;
};
std::pair<RunStats, long> run_blobs(const BlobRun& r) {
  Counted::peak = 0;
  Runtime rt({.threads = 2, .host_memory_budget = r.budget});
  Graph g(rt, "blobs", tuned(10ms));
  auto src = g.source("n", counter(r.items));
  auto make = g.stage("make", [&r](long x) { spin_us(r.make_us); return Blob{std::make_unique<Counted>(), x}; },
                      {.concurrency = Concurrency::automatic});
  std::atomic<bool> first{true};
  auto work = g.stage("work", [&first, &r](Blob b) {
    if (first.exchange(false)) {
      const auto until = std::chrono::steady_clock::now() + 1s;
      while (Counted::live.load() < r.fill && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(1ms);
    }
    spin_us(r.work_us);
    return b;
  }, r.work);
  // The second source's items count from -1 down, so that each source's order is checked.
  long seen = 0, next = 0, next_m = -1;
  bool ordered = true;
  auto sink = g.sink("s", [&](Blob b) { ordered &= b.n >= 0 ? b.n == next++ : b.n == next_m--; ++seen; }, r.sink);
  src >> make >> work >> sink;
  if (r.second_source)
    g.source("m", [i = 0L, n = r.items]() mutable -> std::optional<long> {
      if (i == n) return std::nullopt;
      return -(++i);
    }) >> make;
  auto run = g.run();
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
  EXPECT_EQ(seen, r.second_source ? 2 * r.items : r.items);
  EXPECT_TRUE(ordered);
  EXPECT_EQ(Counted::live.load(), 0) << "every item freed";
  return std::pair{run.stats(), Counted::peak.load()};
}
}  // namespace

// "Budgets on the Runtime: ... the host memory (pinned rings, queues, in-flight items) they may
// hold. The tuner never exceeds either": items of 1 MiB, a budget of 12 MiB. Without the budget
// the same graph holds more (its queues are sized for the rate, not the bytes).
TEST(AutotuneRuntime, TheTunedQueuesHoldTheirItemsWithinTheRuntimesMemoryBudget) {
  constexpr std::size_t kBudget = 12 * Counted::kBytes;
  // Both stages automatic, work the slower; the sink's queue is its user's 2.
  auto build_and_run = [](std::size_t budget) {
    return run_blobs({.budget = budget, .items = 3000, .make_us = 50, .work_us = 300, .fill = 13,
                      .work = {.concurrency = Concurrency::automatic}, .sink = {.capacity = 2}});
  };
  const auto [with, peak] = build_and_run(kBudget);
  const std::string all = decisions_text(with);
  const StageStats& work = *with.find("work");
  EXPECT_EQ(work.item_bytes, sizeof(Blob) + Counted::kBytes) << "its items, as sampled";
  EXPECT_LE(static_cast<std::size_t>(peak) * Counted::kBytes, kBudget)
      << peak << " items of 1 MiB alive at once; work's queue " << work.capacity << all;
  // The capacity decisions say the budget: the 12 MiB less what the sink can hold (3 items).
  const std::regex said(R"(^work capacity \d+ -> \d+: .*items of 1 MiB, the tuned queues' ([0-9.]+) MiB within the ([0-9.]+) MiB the memory budget leaves them$)");
  bool told = false;
  for (const std::string& e : with.autotune) {
    std::smatch m;
    if (!std::regex_match(e, m, said)) continue;
    told = true;
    EXPECT_LE(std::stod(m[1]), std::stod(m[2])) << e;
    EXPECT_LE(std::stod(m[2]), 9.0) << e;
    EXPECT_GE(std::stod(m[2]), 8.0) << e;
  }
  EXPECT_TRUE(told) << "no capacity decision for work names the budget:" << all;
  // The sink's queue (its user's 2) and body are taken off first: the tuned queue holds the rest.
  EXPECT_LE((work.capacity + work.concurrency_limit) * work.item_bytes, kBudget - 3 * work.item_bytes) << all;
  const auto [without, unbounded_peak] = build_and_run(0);
  EXPECT_GT(static_cast<std::size_t>(unbounded_peak) * Counted::kBytes, kBudget)
      << "without a budget the same graph holds more than 12 MiB (" << unbounded_peak << " items)";
}

// The budget holds whatever capacities a user set: a serial stage whose queue its user sized
// for 64 items, items of 1 MiB, a 12 MiB budget. Its queue alone could hold 64 MiB (the tuner
// does not change a user's number); the items the graph lets in at once (its admission limit,
// RunStats::max_in_flight) keep the whole graph within the budget.
TEST(AutotuneRuntime, TheAdmissionLimitHoldsAUsersQueueWithinTheMemoryBudget) {
  constexpr std::size_t kBudget = 12 * Counted::kBytes;
  auto build_and_run = [](std::size_t budget) {
    return run_blobs({.budget = budget, .items = 2000, .make_us = 20, .work_us = 200, .fill = 40,
                      .work = {.concurrency = 1, .capacity = 64}});
  };
  const auto [with, peak] = build_and_run(kBudget);
  const std::string all = decisions_text(with);
  EXPECT_EQ(with.find("work")->capacity, 64u) << "its user's capacity is kept";
  EXPECT_EQ(with.find("work")->concurrency_limit, 1u);
  // 12 MiB / (1 MiB and the Blob) = 11 items, told once with its reason; the run started at the
  // least it can go on with (1: no batch), before any item was measured.
  EXPECT_EQ(with.max_in_flight, 11u) << all;
  EXPECT_LE(static_cast<std::size_t>(peak) * Counted::kBytes, kBudget) << peak << " items of 1 MiB alive at once" << all;
  const std::regex said(R"(^max_in_flight (\d+) -> (\d+): items of up to 1 MiB \(at 'work'\): (\d+) of them hold (\d+) MiB, within the graph's 12 MiB of the memory budget$)");
  int told = 0;
  for (const std::string& e : with.autotune) {
    std::smatch m;
    if (!std::regex_match(e, m, said)) continue;
    ++told;
    EXPECT_EQ(m[1], "1") << e;
    EXPECT_EQ(m[2], "11") << e;
  }
  EXPECT_EQ(told, 1) << "one admission decision, from 1 to 11:" << all;
  // Without a budget: max_in_flight as set (the default 256), no such decision, and the user's
  // queue holds more than the 12 MiB.
  const auto [without, unbounded_peak] = build_and_run(0);
  EXPECT_EQ(without.max_in_flight, GraphOptions{}.max_in_flight);
  for (const std::string& e : without.autotune) EXPECT_EQ(e.find("max_in_flight"), std::string::npos) << e;
  EXPECT_GE(unbounded_peak, 40) << "without a budget the user's queue lets 40 items of 1 MiB in";
}

// The same with two sources merging into 'make': they share the admission limit (their items
// wait for nothing of each other's: no zip, one sink), so the budget holds as with one. Before,
// a graph of several sources kept max_in_flight (70 items of 1 MiB alive under 12 MiB).
TEST(AutotuneRuntime, TheAdmissionLimitHoldsTwoMergedSourcesWithinTheMemoryBudget) {
  constexpr std::size_t kBudget = 12 * Counted::kBytes;
  const auto [with, peak] = run_blobs({.budget = kBudget, .items = 1000, .make_us = 20, .work_us = 200,
                                       .fill = 40, .work = {.concurrency = 1, .capacity = 64},
                                       .second_source = true});
  const std::string all = decisions_text(with);
  EXPECT_EQ(with.max_in_flight, 11u) << all;
  EXPECT_LE(static_cast<std::size_t>(peak) * Counted::kBytes, kBudget) << peak << " items of 1 MiB alive at once" << all;
  // The user's queue (64 MiB) holds more than the budget: the model bounds the rate at its
  // stages' least, not at 0 items/s (before: "bound 0 items/s (memory: 0 bytes)").
  EXPECT_EQ(all.find("bound 0 items/s"), std::string::npos) << all;
  EXPECT_EQ(with.find("n")->items_out, 1000u);
  EXPECT_EQ(with.find("m")->items_out, 1000u);
}

// A pull sink's items are outside the admission limit (they count as consumed when they
// arrive), so under a budget its queue is sized by bytes too: a quarter of the graph's share
// (autotune::pull_sink_capacity), the rest for the admission limit. Before, a new user's trial
// found a GraphDataset-like graph (a C++ op making 8 MiB arrays into a default pull sink, a
// 64 MiB budget) holding 265 MiB: the sink's 32 items on top of the 7 the limit let in.
TEST(AutotuneRuntime, APullSinksQueueIsHeldWithinTheMemoryBudget) {
  constexpr std::size_t kBudget = 12 * Counted::kBytes;
  static constexpr long kItems = 300;
  auto build_and_run = [](std::size_t budget) {
    Counted::peak = 0;
    Runtime rt({.threads = 2, .host_memory_budget = budget});
    Graph g(rt, "pulled", tuned(10ms));
    auto src = g.source("n", counter(kItems));
    auto make = g.stage("make", [](long x) { spin_us(50); return Blob{std::make_unique<Counted>(), x}; },
                        {.concurrency = Concurrency::automatic});
    auto out = g.pull_sink<Blob>("out");  // its capacity: the graph's default (32)
    src >> make >> out;
    auto run = g.run();
    // The reader starts once 10 items are alive (1 s at most): whatever this machine's speed,
    // the sink's queue and the items let in fill to what they may hold before it reads.
    const auto until = std::chrono::steady_clock::now() + 1s;
    while (Counted::live.load() < 10 && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(1ms);
    long next = 0;
    while (auto b = out.next()) {
      EXPECT_EQ(b->n, next);
      ++next;
    }
    EXPECT_EQ(next, kItems);
    EXPECT_EQ(run.wait(), RunStatus::succeeded);
    EXPECT_EQ(Counted::live.load(), 0) << "every item freed";
    return std::pair{run.stats(), Counted::peak.load()};
  };
  const auto [with, peak] = build_and_run(kBudget);
  const std::string all = decisions_text(with);
  // 12 MiB: the sink's queue a quarter (2 items of 1 MiB and a Blob) or, where they fit half,
  // a slot for each of make's claims (at most 2 on 2 threads) and one more; the items let in
  // at once the rest; and the one in the reader's hand.
  const StageStats& sink = *with.find("out");
  EXPECT_LE(static_cast<std::size_t>(peak) * Counted::kBytes, kBudget) << peak << " items of 1 MiB alive at once" << all;
  EXPECT_GE(sink.capacity, 2u) << all;
  EXPECT_LE(sink.capacity, 3u) << all;
  EXPECT_LE((sink.capacity + with.max_in_flight) * sink.item_bytes, kBudget) << all;
  const std::regex said(R"(^out capacity \d+ -> \d+: items of 1 MiB: \d+ of them hold .+ the graph's 12 MiB of the memory budget .+$)");
  for (const std::string& e : with.autotune)
    if (e.rfind("out capacity", 0) == 0) EXPECT_TRUE(std::regex_match(e, said)) << e;
  const std::regex admitted(R"(^max_in_flight \d+ -> (\d+): .+, less ([23]) MiB its pull sink's queue may hold$)");
  bool told = false;
  for (const std::string& e : with.autotune) {
    std::smatch m;
    if (!std::regex_match(e, m, admitted)) continue;
    told = true;
    EXPECT_LE(std::stoul(m[1]) + std::stoul(m[2]), 12u) << e;
  }
  EXPECT_TRUE(told) << "no admission decision takes the sink's queue off:" << all;
  // Without the budget the sink's queue holds its default 32 (and the graph lets in more).
  const auto [without, unbounded_peak] = build_and_run(0);
  EXPECT_EQ(without.find("out")->capacity, 32u);
  EXPECT_GT(static_cast<std::size_t>(unbounded_peak) * Counted::kBytes, kBudget)
      << "without a budget the same graph holds more than 12 MiB (" << unbounded_peak << " items)";
}

// A zip's two sources keep max_in_flight under a budget (GraphCore::admit_limit_tunable):
// their pace (pace_lead) is a share of it, and a lowered limit could leave the zip waiting for
// the slower's items with the faster's holding all the room.
TEST(AutotuneRuntime, AZipsSourcesKeepMaxInFlightUnderAMemoryBudget) {
  Runtime rt({.threads = 2, .host_memory_budget = 4 * Counted::kBytes});
  Graph g(rt, "zipped", tuned(10ms));
  constexpr long kItems = 1000;
  auto a = g.source("a", counter(kItems));
  auto b = g.source("b", counter(kItems));
  auto fast = g.stage("fast", [](long x) { return x; }, {.concurrency = Concurrency::automatic});
  auto slow = g.stage("slow", [](long x) { spin_us(100); return x; }, {.concurrency = Concurrency::automatic});
  auto z = g.zip<long, long>("pair");
  long pairs = 0;
  bool matched = true;
  auto sink = g.sink("s", [&](std::pair<long, long> p) { matched &= p.first == p.second && p.first == pairs; ++pairs; });
  a >> fast >> z.first();
  b >> slow >> z.second();
  z >> sink;
  auto run = g.run();
  ASSERT_TRUE(run.wait_for(60s)) << "the zip's sources stalled";
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  EXPECT_EQ(pairs, kItems);
  EXPECT_TRUE(matched);
  const RunStats st = run.stats();
  EXPECT_EQ(st.max_in_flight, GraphOptions{}.max_in_flight);
  for (const std::string& e : st.autotune) EXPECT_EQ(e.find("max_in_flight"), std::string::npos) << e;
}

// docs/autotune.md, "Queues": a tuned queue's ceiling is max_in_flight in source items. After a
// batch of 64 and a 1:1 stage, each item stands for 64 source items: 256 / 64 = 4 of them, what
// the graph lets in at once, however deep the policy would make the queue.
TEST(AutotuneRuntime, ATunedQueuesCeilingIsMaxInFlightInSourceItems) {
  Runtime rt({.threads = 2});
  Graph g(rt, "ceiling", tuned(10ms));
  constexpr long kItems = 64 * 120;
  auto src = g.source("n", counter(kItems));
  auto batch = g.batch<long>("batch", 64);
  auto collate = g.stage("collate", [](std::vector<long> v) { spin_us(100); return v; },
                         {.concurrency = Concurrency::automatic});
  auto norm = g.stage("norm", [](std::vector<long> v) { spin_us(400); return v; },
                      {.concurrency = Concurrency::automatic});
  long next = 0;
  bool ordered = true;
  auto sink = g.sink("s", [&](std::vector<long> v) {
    for (long x : v) ordered &= x == next++;
  });
  src >> batch >> collate >> norm >> sink;
  auto run = g.run();
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  EXPECT_EQ(next, kItems);
  EXPECT_TRUE(ordered);
  const RunStats st = run.stats();
  std::string all;
  std::size_t wanted = 0, last = 0;
  const std::regex cap(R"(^norm capacity \d+ -> (\d+): .+)");
  for (const std::string& e : st.autotune) {
    all += "\n  " + e;
    std::smatch m;
    if (!std::regex_match(e, m, cap)) continue;
    last = std::stoul(m[1]);
    wanted = std::max(wanted, last);
  }
  ASSERT_GT(wanted, 4u) << "the policy's buffer (8 items) is deeper than the ceiling:" << all;
  EXPECT_EQ(st.find("norm")->capacity, std::min<std::size_t>(last, 4)) << "held at 256 / 64:" << all;
  EXPECT_LE(st.find("norm")->max_queue, 4u);
}
