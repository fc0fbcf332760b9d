// Flow control across a graph: bounded queues, GraphOptions::max_in_flight, merges of many
// producers, pull sinks nobody reads, and the rule that no arena thread ever waits for queue
// space or input. Checks docs/architecture.md, "How an item flows" (1. Slots before work,
// 2. Blocked producers wait as data, not as threads; 10. Fan-out, merge, zip: a merge's queue and
// its wake-ups), and docs/api.md, "Conventions" (Capacity). A stage's own concurrency limit and
// claims: test_stage.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <splitflow/splitflow.hpp>
#include <string>
#include <thread>
#include <vector>

#include "helpers.hpp"

using namespace splitflow;
using testing_helpers::counter;
using testing_helpers::raise_max;
using testing_helpers::spin_us;

// "bounded queues bound items in flight under a slow sink (measure the maximum)"
TEST(Backpressure, BoundedQueuesBoundItemsInFlightUnderASlowSink) {
  Runtime rt({.threads = 4});
  Graph g(rt, "slow-sink", {.max_in_flight = 1000});
  std::atomic<long> produced{0}, consumed{0}, max_in_flight{0};
  auto src = g.source("fast", [&, i = 0L]() mutable -> std::optional<long> {
    if (i == 3000) return std::nullopt;
    raise_max(max_in_flight, ++produced - consumed);
    return i++;
  });
  auto mid = g.stage("mid", [](long x) { return x; }, {.concurrency = 2, .capacity = 4});
  auto sink = g.sink("slow", [&](long) {
    spin_us(20);
    ++consumed;
  }, {.capacity = 3});
  src >> mid >> sink;
  auto run = g.run();
  run.wait();
  EXPECT_EQ(consumed.load(), 3000);
  // An item is in mid's queue or a source body (at most 4 reserved slots in mid), in a mid
  // body or the sink's queue (at most 3 slots in the sink), or in the sink's body (1).
  EXPECT_LE(max_in_flight.load(), 4 + 3 + 1);
  EXPECT_GE(max_in_flight.load(), 4) << "the slow sink should have filled the queues";
  const RunStats st = run.stats();
  EXPECT_LE(st.find("mid")->max_queue, 4u);
  EXPECT_LE(st.find("slow")->max_queue, 3u);
  EXPECT_GT(st.find("fast")->blocked_ns, 0) << "the source never waited for space";
}

// "Items in flight across the graph are bounded (like max_number_of_live_tokens)"
TEST(Backpressure, MaxInFlightBoundsItemsAcrossTheGraph) {
  Runtime rt({.threads = 4});
  Graph g(rt, "tokens", {.max_in_flight = 5, .default_capacity = 64});
  std::atomic<long> produced{0}, consumed{0}, max_in_flight{0};
  auto src = g.source("n", [&, i = 0L]() mutable -> std::optional<long> {
    if (i == 2000) return std::nullopt;
    raise_max(max_in_flight, ++produced - consumed);
    return i++;
  });
  auto a = g.stage("a", [](long x) { return x; }, {.concurrency = 4});
  auto b = g.stage("b", [](long x) { return x; }, {.concurrency = 4});
  auto sink = g.sink("slow", [&](long) {
    ++consumed;  // before the item is retired, so the gauge never undercounts
    spin_us(5);
  });
  src >> a >> b >> sink;
  g.run().wait();
  EXPECT_EQ(consumed.load(), 2000);
  EXPECT_LE(max_in_flight.load(), 5);
  EXPECT_GE(max_in_flight.load(), 3);
}

// "Items in flight are bounded ... across all of a graph's sources": sources granted claims at
// the same time share the room, they do not each see all of it.
TEST(Backpressure, MaxInFlightHoldsWithSeveralSources) {
  Runtime rt({.threads = 4});
  Graph g(rt, "four-sources", {.max_in_flight = 2, .default_capacity = 64});
  std::atomic<long> produced{0}, consumed{0}, max_in_flight{0};
  auto merge = g.stage("merge", [](long x) { return x; }, {.concurrency = 2});
  auto sink = g.sink("sink", [&](long) {
    ++consumed;  // before the item is retired, so the gauge never undercounts
    spin_us(2);
  });
  for (int k = 0; k < 4; ++k) {
    auto src = g.source("s" + std::to_string(k), [&, i = 0L]() mutable -> std::optional<long> {
      if (i == 1500) return std::nullopt;
      raise_max(max_in_flight, ++produced - consumed);
      return i++;
    });
    src >> merge;
  }
  merge >> sink;
  auto run = g.run();
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  EXPECT_EQ(consumed.load(), 6000);
  EXPECT_LE(max_in_flight.load(), 2);
}

// "a merge's default queue holds the default capacity for each producer" (config.hpp,
// StageOptions::capacity), and many producers blocked on one merge and on max_in_flight all
// finish: blocked producers are woken in runs (half the queue, half the room), never lost.
TEST(Backpressure, AMergeOfManyProducersDeliversEverythingWithinItsBounds) {
  Runtime rt({.threads = 4});
  for (std::size_t max_in_flight : {std::size_t{7}, std::size_t{256}}) {
    Graph g(rt, "wide-merge", {.max_in_flight = max_in_flight, .default_capacity = 4});
    constexpr int kSources = 64;
    constexpr long kEach = 200;
    std::atomic<long> produced{0}, consumed{0}, max_seen{0};
    auto merge = g.stage("merge", [](long x) { return x; },
                         {.concurrency = 3, .order = Order::out_of_order});
    std::vector<int> seen(kSources * kEach, 0);
    auto sink = g.sink("sink", [&](long x) {
      ++consumed;
      ++seen.at(static_cast<std::size_t>(x));
    });
    for (int k = 0; k < kSources; ++k) {
      auto src = g.source("s" + std::to_string(k), [&, k, i = 0L]() mutable -> std::optional<long> {
        if (i == kEach) return std::nullopt;
        raise_max(max_seen, ++produced - consumed);
        return k * kEach + i++;
      });
      src >> merge;
    }
    merge >> sink;
    auto run = g.run();
    ASSERT_TRUE(run.wait_for(std::chrono::seconds(60))) << "a blocked producer was never woken";
    ASSERT_EQ(run.wait(), RunStatus::succeeded);
    EXPECT_EQ(consumed.load(), kSources * kEach);
    EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), kSources * kEach) << "each item once";
    EXPECT_LE(max_seen.load(), static_cast<long>(max_in_flight));
    EXPECT_EQ(run.stats().find("merge")->capacity, 4u * kSources);
  }
}

// Sources waiting for max_in_flight still wake when batches hold most of the room: the wake-up
// threshold never exceeds what the batches leave free.
TEST(Backpressure, SourcesWakeWhenBatchesHoldMostOfTheRoom) {
  Runtime rt({.threads = 2});
  Graph g(rt, "held", {.max_in_flight = 40});
  auto a = g.source("a", counter(1000));
  auto b = g.source("b", counter(1000));
  auto merge = g.stage("merge", [](long x) { return x; });
  auto batch = g.batch<long>("batch", 39);  // holds up to 38 of the 40 while it fills
  std::atomic<long> items{0};
  auto sink = g.sink("sink", [&](std::vector<long> v) { items += static_cast<long>(v.size()); });
  a >> merge;
  b >> merge;
  merge >> batch >> sink;
  auto run = g.run();
  ASSERT_TRUE(run.wait_for(std::chrono::seconds(60))) << "the sources were never woken";
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
  EXPECT_EQ(items.load(), 2000);
}

// A pull sink nobody reads fills up and holds the graph back; reading drains it.
TEST(Backpressure, UnreadPullSinkHoldsTheGraphBack) {
  Runtime rt({.threads = 2});
  Graph g(rt, "pull");
  std::atomic<long> produced{0};
  auto src = g.source("n", [&, i = 0L]() mutable -> std::optional<long> {
    if (i == 1000) return std::nullopt;
    ++produced;
    return i++;
  });
  auto st = g.stage("st", [](long x) { return x; }, {.capacity = 2});
  auto out = g.pull_sink<long>("out", 3);
  src >> st >> out;
  auto run = g.run();
  // Take one item; once the graph cannot move it has produced a bounded number.
  ASSERT_EQ(out.next(), 0L);
  EXPECT_FALSE(run.wait_for(std::chrono::milliseconds(50)));
  // taken + the sink's 3 slots (queued, or held by st's body) + st's 2 (queued, or held by
  // the source's body)
  EXPECT_LE(produced.load(), 1 + 3 + 2);
  long expect = 1;
  while (auto v = out.next()) ASSERT_EQ(*v, expect++);
  EXPECT_EQ(expect, 1000);
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
  EXPECT_LE(run.stats().find("out")->max_queue, 3u);
}

// "No arena thread ever blocks waiting for queue space or input": on a one-thread runtime a
// thread that parked for space would deadlock; tiny queues and several graphs must finish.
TEST(Scheduling, OneThreadRuntimeWithTinyQueuesFinishesEveryGraph) {
  Runtime rt({.threads = 1});
  std::vector<std::unique_ptr<Graph>> graphs;
  std::vector<std::unique_ptr<std::atomic<long>>> sums;
  std::vector<splitflow::Run> runs;
  for (int k = 0; k < 4; ++k) {
    auto g = std::make_unique<Graph>(rt, std::string("g").append(std::to_string(k)),
                                     GraphOptions{.max_in_flight = 2, .default_capacity = 1});
    sums.push_back(std::make_unique<std::atomic<long>>(0));
    auto* sum = sums.back().get();
    auto src = g->source("n", counter(500));
    auto a = g->stage("a", [](long x) { return x + 1; }, {.concurrency = 2});
    auto b = g->stage("b", [k](long x) { return x * k; });
    auto z = g->zip<long, long>("z");
    auto s = g->sink("s", [sum](std::pair<long, long> p) { *sum += p.first + p.second; });
    fan_out(src, a, b);
    connect(a, z.first());
    connect(b, z.second());
    z >> s;
    runs.push_back(g->run());
    graphs.push_back(std::move(g));
  }
  for (int k = 0; k < 4; ++k) {
    ASSERT_TRUE(runs[k].wait_for(std::chrono::seconds(60))) << "graph " << k << " is stuck";
    EXPECT_EQ(runs[k].wait(), RunStatus::succeeded);
    EXPECT_EQ(sums[k]->load(), 500L * 501 / 2 + k * (499L * 500 / 2));
  }
}

