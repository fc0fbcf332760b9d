// The batch node (Graph::batch): full batches in arrival order and a short (or dropped) last
// one, the end of input reaching it through every kind of node, the graph checks of batch sizes
// against max_in_flight, backpressure and cancel. Checks docs/architecture.md, "How an item
// flows" (6. End of input; 10. Fan-out, merge, zip: a fan-out copy counts in flight), and
// docs/api.md, "Objects and options" (batching). Each test quotes the requirement it checks.
#include <gtest/gtest.h>

#include <atomic>
#include <splitflow/splitflow.hpp>
#include <string>
#include <vector>

#include "helpers.hpp"

using namespace splitflow;
using testing_helpers::counter;
using testing_helpers::flatten;
using testing_helpers::iota_vector;
using testing_helpers::spin_us;
using testing_helpers::Tracked;
using testing_helpers::tracked_source;

// "batches of `size`, in arrival order; the last batch of a run may be shorter"
TEST(Batch, FullBatchesInOrderThenTheShortRest) {
  Runtime rt({.threads = 4});
  Graph g(rt, "batches");
  auto src = g.source("n", counter(1000));
  auto work = g.stage("work", [](long x) { return x; }, {.concurrency = 4});
  auto batch = g.batch<long>("batch", 64);
  auto out = g.pull_sink<std::vector<long>>("out");
  src >> work >> batch >> out;
  auto run = g.run();
  std::vector<std::vector<long>> got;
  for (auto& b : out) got.push_back(std::move(b));
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
  ASSERT_EQ(got.size(), 16u);  // 15 x 64 + 40
  for (std::size_t i = 0; i + 1 < got.size(); ++i) EXPECT_EQ(got[i].size(), 64u) << "batch " << i;
  EXPECT_EQ(got.back().size(), 1000u - 15 * 64);
  EXPECT_EQ(flatten(got), iota_vector(1000));
  const RunStats st = run.stats();
  const StageStats* s = st.find("batch");
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->items_in, 1000u);
  EXPECT_EQ(s->items_out, 16u);
}

// "drop_last: a last batch smaller than the batch size is dropped; its items count as consumed"
TEST(Batch, DropLastDropsTheShortRestAndLeaksNothing) {
  Tracked::reset_counts();
  {
    Runtime rt({.threads = 2});
    Graph g(rt, "drop");
    auto src = g.source("n", tracked_source(100));
    auto batch = g.batch<Tracked>("batch", 30, {.drop_last = true});
    std::vector<std::size_t> sizes;
    std::vector<int> firsts;
    auto sink = g.sink("sink", [&](std::vector<Tracked> b) {
      sizes.push_back(b.size());
      firsts.push_back(b.front().value);
    });
    src >> batch >> sink;
    EXPECT_EQ(g.run().wait(), RunStatus::succeeded);
    EXPECT_EQ(sizes, (std::vector<std::size_t>{30, 30, 30}));
    EXPECT_EQ(firsts, (std::vector<int>{0, 30, 60}));
    // Runs again: the end of input is per run.
    sizes.clear();
    firsts.clear();
    EXPECT_EQ(g.run().wait(), RunStatus::succeeded);
    EXPECT_EQ(sizes.size(), 3u);
  }
  EXPECT_EQ(Tracked::live.load(), 0);
}

// "the end of input reaches a batch through a zip, a fan-out and a GPU stage, and an empty
// source makes no batch"
TEST(Batch, EndOfInputPropagatesThroughEveryNodeKind) {
  Runtime rt({.threads = 4, .device = {.backend = BackendKind::host}});
  Graph g(rt, "shapes");
  auto src = g.source("n", counter(203));
  auto a = g.stage("a", [](long x) { return x; });
  auto b = g.stage("b", [](long x) { return 2 * x; }, {.concurrency = 3});
  auto z = g.zip<long, long>("zip");
  fan_out(src, a, b);
  a >> z.first();
  b >> z.second();
  auto gpu = g.gpu_stage(
      "gpu", [](std::pair<long, long> p, DeviceContext&) { return p.first + p.second; });
  auto batch = g.batch<long>("batch", 50);
  auto out = g.pull_sink<std::vector<long>>("out");
  z >> gpu >> batch >> out;
  auto run = g.run();
  std::vector<std::vector<long>> got;
  for (auto& v : out) got.push_back(std::move(v));
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  ASSERT_EQ(got.size(), 5u);
  EXPECT_EQ(got.back().size(), 3u);
  std::vector<long> want;
  for (long i = 0; i < 203; ++i) want.push_back(3 * i);
  EXPECT_EQ(flatten(got), want);

  Graph empty(rt, "empty");
  auto none = empty.source("none", counter(0));
  auto eb = empty.batch<long>("batch", 8);
  long batches = 0;
  auto count = empty.sink("count", [&](std::vector<long>) { ++batches; });
  none >> eb >> count;
  EXPECT_EQ(empty.run().wait(), RunStatus::succeeded);
  EXPECT_EQ(batches, 0);
}

// "a batch larger than max_in_flight could never fill: the graph says so"; "batch size >= 1"
TEST(Batch, ImpossibleBatchSizesAreRejectedWithTheFix) {
  Runtime rt({.threads = 2});
  Graph g(rt, "big", {.max_in_flight = 16});
  auto src = g.source("n", counter(100));
  auto batch = g.batch<long>("batch", 32);
  auto sink = g.sink("sink", [](std::vector<long>) {});
  src >> batch >> sink;
  try {
    g.run();
    FAIL() << "expected GraphError";
  } catch (const GraphError& e) {
    EXPECT_NE(std::string(e.what()).find("batch 'batch': its batch size 32 exceeds the graph's "
                                         "max_in_flight (16)"),
              std::string::npos)
        << e.what();
  }
  Graph h(rt, "zero");
  EXPECT_THROW(h.batch<long>("batch", 0), GraphError);
}

// "a fan-out copy counts as one more item in flight": two batches fed by one source fill only
// if max_in_flight covers both; below that the graph is refused, at it the run completes.
TEST(Batch, BatchesThatCouldStallEachOtherAreRefusedWithTheFix) {
  Runtime rt({.threads = 2});
  Graph g(rt, "two-batches", {.max_in_flight = 8});
  auto src = g.source("n", counter(100));
  auto left = g.batch<long>("left", 8);
  auto right = g.batch<long>("right", 8);
  auto ls = g.sink("ls", [](std::vector<long>) {});
  auto rs = g.sink("rs", [](std::vector<long>) {});
  fan_out(src, left, right);
  left >> ls;
  right >> rs;
  const std::string m = testing_helpers::refusal(g);
  EXPECT_NE(m.find("its batches 'left' (8), 'right' (8) can hold 14 items between them while "
                   "they fill"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("raise GraphOptions::max_in_flight (Python: max_in_flight= of splitflow.Graph or "
                   "GraphDataset) to at least 15"), std::string::npos) << m;

  Graph h(rt, "two-batches-fit", {.max_in_flight = 15});
  auto src2 = h.source("n", counter(100));
  auto l2 = h.batch<long>("left", 8);
  auto r2 = h.batch<long>("right", 8);
  std::atomic<long> items{0};
  auto ls2 = h.sink("ls", [&](std::vector<long> v) { items += static_cast<long>(v.size()); });
  auto rs2 = h.sink("rs", [&](std::vector<long> v) { items += static_cast<long>(v.size()); });
  fan_out(src2, l2, r2);
  l2 >> ls2;
  r2 >> rs2;
  auto run = h.run();
  ASSERT_TRUE(run.wait_for(std::chrono::seconds(60))) << "the batches stalled";
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
  EXPECT_EQ(items.load(), 200);
}

// "a slow consumer of batches holds the graph back: queues stay within their capacity"
TEST(Batch, BackpressureBoundsWhatWaitsBehindASlowConsumer) {
  Runtime rt({.threads = 4});
  Graph g(rt, "slow", {.max_in_flight = 64, .default_capacity = 4});
  auto src = g.source("n", counter(400));
  auto batch = g.batch<long>("batch", 16);
  auto sink = g.sink("slow", [](std::vector<long>) { spin_us(200); });
  src >> batch >> sink;
  auto run = g.run();
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  const RunStats st = run.stats();
  const StageStats* b = st.find("batch");
  EXPECT_LE(b->max_queue, 16u);  // capacity: the larger of the default (4) and one batch
  EXPECT_LE(st.find("slow")->max_queue, 4u);
  EXPECT_EQ(st.find("slow")->items_in, 25u);
}

// "a cancel during batching drops the partial batch; nothing leaks"
TEST(Batch, CancelLeaksNothing) {
  Tracked::reset_counts();
  {
    Runtime rt({.threads = 2});
    Graph g(rt, "cancel");
    auto src = g.source("endless", [i = 0]() mutable -> std::optional<Tracked> {
      return Tracked(i++);
    });
    auto batch = g.batch<Tracked>("batch", 7);
    auto out = g.pull_sink<std::vector<Tracked>>("out");
    src >> batch >> out;
    auto run = g.run();
    for (int i = 0; i < 5; ++i) {
      auto b = out.next();
      ASSERT_TRUE(b);
      EXPECT_EQ(b->size(), 7u);
      EXPECT_EQ(b->front().value, 7 * i);
    }
    run.cancel();
    EXPECT_EQ(run.wait(), RunStatus::cancelled);
  }
  EXPECT_EQ(Tracked::live.load(), 0);
}

// config.hpp, GraphOptions::default_capacity: "in source items: a queue of batches of n holds
// default_capacity / n of them ... never fewer than the claims its producers can have out (at
// least 2)"; a capacity the user sets is kept, and a merge's default still grows with its
// producers. (A queue of 32 batches of 64 float images held 1.2 GB.)
TEST(Batch, DefaultQueuesAfterABatchCountSourceItems) {
  Runtime rt({.threads = 4});
  Graph g(rt, "queues");  // default_capacity 32
  auto src = g.source("n", counter(1000));
  auto batch = g.batch<long>("batch", 64);
  auto wide = g.stage("wide", [](std::vector<long> v) { return v; }, {.concurrency = 3});
  auto next = g.stage("next", [](std::vector<long> v) { return v; });
  auto kept = g.stage("kept", [](std::vector<long> v) { return v; }, {.capacity = 10});
  auto by8 = g.batch<std::vector<long>>("by8", 8);
  auto small = g.stage("small", [](std::vector<std::vector<long>> v) { return v.size(); });
  long items = 0;
  auto sink = g.sink("sink", [&](std::size_t n) { items += static_cast<long>(n); });
  src >> batch >> wide >> next >> kept >> by8 >> small >> sink;
  auto run = g.run();
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  EXPECT_EQ(items, 16);  // every batch once (15 of 64 and the rest)
  const RunStats st = run.stats();
  EXPECT_EQ(st.find("batch")->capacity, 64u);  // a batch's own queue holds a whole batch
  EXPECT_EQ(st.find("wide")->capacity, 2u);    // 32 / 64 rounds to 1; at least 2
  EXPECT_EQ(st.find("next")->capacity, 3u);    // 'wide' can have 3 claims out
  EXPECT_EQ(st.find("kept")->capacity, 10u);   // set by the user
  EXPECT_EQ(st.find("small")->capacity, 2u);   // batches of 8 x 64 source items
  EXPECT_EQ(st.find("sink")->capacity, 2u);
}

// The same rule leaves a graph without batches as it was: the default, times a merge's
// producers.
TEST(Batch, DefaultQueuesWithoutBatchesAreTheGraphsDefault) {
  Runtime rt({.threads = 2});
  Graph g(rt, "plain", {.default_capacity = 16});
  auto a = g.source("a", counter(100));
  auto b = g.source("b", counter(100));
  auto work = g.stage("work", [](long x) { return x; });
  long n = 0;
  auto sink = g.sink("sink", [&](long) { ++n; });
  a >> work;
  b >> work;
  work >> sink;
  auto run = g.run();
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  EXPECT_EQ(n, 200);
  EXPECT_EQ(run.stats().find("work")->capacity, 32u);  // 16 per producer
  EXPECT_EQ(run.stats().find("sink")->capacity, 16u);
}
