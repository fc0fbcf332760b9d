// Per-stage statistics (a policy of every node kind): counts, the busy / starved / blocked
// partition of wall time, and what they show for a planted bottleneck. Checks
// docs/architecture.md, "Statistics", and docs/telemetry.md, "Per stage (`StageStats`)".
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <thread>
#include <splitflow/splitflow.hpp>

#include "helpers.hpp"

using namespace splitflow;
using testing_helpers::counter;
using testing_helpers::spin_us;

namespace {

void expect_partition(const RunStats& st) {
  for (const StageStats& s : st.stages) {
    const std::int64_t sum = s.busy_ns + s.starved_ns + s.blocked_ns;
    EXPECT_NEAR(static_cast<double>(sum), static_cast<double>(st.wall_ns),
                1e-3 * static_cast<double>(st.wall_ns) + 1000.0)
        << s.name << ": busy + starved + blocked != wall";
    EXPECT_GE(s.busy_ns, 0);
    EXPECT_GE(s.starved_ns, 0);
    EXPECT_GE(s.blocked_ns, 0);
  }
}

}  // namespace

// "Stats per stage: items in/out, busy time, time starved, time blocked, max queue occupancy"
TEST(Stats, CountsAndTheStatePartitionOfWallTime) {
  Runtime rt({.threads = 4});
  Graph g(rt, "counted");
  auto src = g.source("n", counter(5000));
  auto even = g.stage("square", [](long x) { spin_us(1); return x * x; }, {.concurrency = 2});
  auto sink = g.sink("s", [](long) { spin_us(2); }, {.capacity = 8});
  src >> even >> sink;
  auto run = g.run();
  run.wait();
  const RunStats st = run.stats();
  EXPECT_EQ(st.status, RunStatus::succeeded);
  EXPECT_GT(st.wall_ns, 0);
  ASSERT_EQ(st.stages.size(), 3u);
  EXPECT_EQ(st.stages[0].name, "n");
  EXPECT_EQ(st.stages[0].items_out, 5000u);
  EXPECT_EQ(st.stages[1].items_in, 5000u);
  EXPECT_EQ(st.stages[1].items_out, 5000u);
  EXPECT_EQ(st.stages[2].items_in, 5000u);
  EXPECT_EQ(st.stages[2].items_out, 5000u);
  EXPECT_LE(st.stages[2].max_queue, 8u);
  EXPECT_GE(st.stages[2].max_queue, 1u);
  EXPECT_LE(st.stages[1].max_concurrency, 2u);
  // work is the sum of body times: at least the spin it contains
  EXPECT_GE(st.stages[2].work_ns, 5000 * 2000);
  expect_partition(st);
}

// A slow middle stage: it is busy nearly all the time, its producer is blocked behind it and
// its consumer starves.
TEST(Stats, APlantedSlowStageIsBusyItsProducerBlockedItsConsumerStarved) {
  Runtime rt({.threads = 4});
  Graph g(rt, "bottleneck");
  auto src = g.source("read", counter(400));
  // The slow stage models waiting work (I/O-like), so that the shape of the figures does not
  // depend on how much CPU other processes leave to this test.
  auto slow = g.stage("slow", [](long x) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    return x;
  }, {.capacity = 4});
  auto sink = g.sink("write", [](long) {});
  src >> slow >> sink;
  auto run = g.run();
  run.wait();
  const RunStats st = run.stats();
  const double wall = static_cast<double>(st.wall_ns);
  // Loose fractions: other processes may take the cores, but the shape must show.
  const StageStats& slow_s = *st.find("slow");
  const StageStats& read_s = *st.find("read");
  const StageStats& write_s = *st.find("write");
  EXPECT_GT(slow_s.busy_ns / wall, 0.5);
  EXPECT_GT(read_s.blocked_ns, 4 * read_s.busy_ns);
  EXPECT_GT(write_s.starved_ns / wall, 0.5);
  EXPECT_GT(write_s.starved_ns, 4 * write_s.busy_ns);
  expect_partition(st);
  const std::string table = format_table(st);
  EXPECT_NE(table.find("slow"), std::string::npos);
  EXPECT_NE(table.find("succeeded"), std::string::npos);
}

// Live snapshots while the run is in progress partition the elapsed time too.
TEST(Stats, LiveSnapshotDuringTheRun) {
  Runtime rt({.threads = 2});
  Graph g(rt, "live");
  auto src = g.source("n", counter(-1));
  auto st = g.stage("st", [](long x) { spin_us(5); return x; });
  auto out = g.pull_sink<long>("out", 4);
  src >> st >> out;
  auto run = g.run();
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(out.next());
  const RunStats live = run.stats();
  EXPECT_EQ(live.status, RunStatus::running);
  EXPECT_GE(live.find("out")->items_out, 100u);
  expect_partition(live);
  run.cancel();
  run.wait();
}

TEST(Stats, TelemetryOffKeepsCountsAndSkipsTimes) {
  Runtime rt({.threads = 2, .telemetry = false});
  Graph g(rt, "quiet");
  auto src = g.source("n", counter(100));
  auto sink = g.sink("s", [](long) {});
  src >> sink;
  auto run = g.run();
  run.wait();
  const RunStats st = run.stats();
  EXPECT_EQ(st.find("s")->items_in, 100u);
  EXPECT_EQ(st.find("s")->busy_ns, 0);
  EXPECT_EQ(st.find("s")->work_ns, 0);
  EXPECT_GT(st.wall_ns, 0);
}
