// The pull sink (Graph::pull_sink): a sink read by the caller's thread (README, "A graph in
// C++"; graph.hpp, PullSink). Leaving its loop early ends the run; its final stats count what
// the reader took. Checks docs/api.md, "Objects and options" (sinks, reading a pull sink).
#include <gtest/gtest.h>

#include <atomic>
#include <splitflow/splitflow.hpp>
#include <thread>

#include "helpers.hpp"

using namespace splitflow;
using testing_helpers::counter;
using testing_helpers::Tracked;
using testing_helpers::tracked_source;

// "leaving a loop over a pull sink early cancels the run, so run.wait() returns"
TEST(PullSink, BreakingOutOfTheLoopCancelsTheRun) {
  Tracked::reset_counts();
  {
    Runtime rt({.threads = 2});
    Graph g(rt, "break");
    auto src = g.source("n", tracked_source(-1));  // endless: only a cancel ends it
    auto st = g.stage("st", [](Tracked t) { return t; }, {.concurrency = 2});
    auto out = g.pull_sink<Tracked>("out", 4);
    src >> st >> out;
    auto run = g.run();
    int seen = 0;
    for (Tracked& t : out) {
      EXPECT_EQ(t.value, seen);
      if (++seen == 10) break;
    }
    ASSERT_TRUE(run.wait_for(std::chrono::seconds(30))) << "the run went on after the break";
    EXPECT_EQ(run.wait(), RunStatus::cancelled);
    // The graph can run again at once.
    auto again = g.run();
    EXPECT_TRUE(out.next().has_value());
    out.close();
    EXPECT_EQ(again.wait(), RunStatus::cancelled);
  }
  EXPECT_EQ(Tracked::live.load(), 0);
}

// "a loop that reads to the end of the stream leaves the run as it ended"
TEST(PullSink, ReadingToTheEndDoesNotCancel) {
  Runtime rt({.threads = 2});
  Graph g(rt, "to-the-end");
  auto src = g.source("n", counter(300));
  auto out = g.pull_sink<long>("out", 8);
  src >> out;
  auto run = g.run();
  long n = 0;
  for (long v : out) EXPECT_EQ(v, n++);
  EXPECT_EQ(n, 300);
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
}

// "close() ends the run from the reader's side; it does nothing once the run ended"
TEST(PullSink, CloseCancelsARunningRunOnly) {
  Runtime rt({.threads = 2});
  Graph g(rt, "close");
  auto src = g.source("n", counter(-1));
  auto out = g.pull_sink<long>("out", 2);
  src >> out;
  auto run = g.run();
  ASSERT_EQ(out.next(), 0L);
  out.close();
  ASSERT_TRUE(run.wait_for(std::chrono::seconds(30)));
  EXPECT_EQ(run.status(), RunStatus::cancelled);

  Graph h(rt, "short");
  auto few = h.source("n", counter(3));
  auto sink = h.pull_sink<long>("out", 8);
  few >> sink;
  auto done = h.run();
  ASSERT_EQ(done.wait(), RunStatus::succeeded);  // all three fit the sink's queue
  sink.close();
  EXPECT_EQ(done.status(), RunStatus::succeeded);
  EXPECT_EQ(sink.next(), 0L) << "close() after the end keeps what is queued";
}

// "items_out of a pull sink counts every item its reader took, also after the run ended"
TEST(PullSink, FinalStatsCountItemsTakenAfterTheRunEnded) {
  Runtime rt({.threads = 2});
  for (long total : {1L, 20L, 1000L}) {
    Graph g(rt, "late");
    auto src = g.source("n", counter(total));
    auto out = g.pull_sink<long>("out", 32);
    src >> out;
    auto run = g.run();
    long taken = 0;
    if (total > 32) {  // the run cannot end before the reader made room
      for (; taken < total - 16; ++taken) ASSERT_EQ(out.next(), taken);
    }
    ASSERT_EQ(run.wait(), RunStatus::succeeded);
    const std::uint64_t before = run.stats().find("out")->items_out;
    EXPECT_EQ(before, static_cast<std::uint64_t>(taken));
    while (auto v = out.next()) EXPECT_EQ(*v, taken++);
    EXPECT_EQ(taken, total);
    EXPECT_EQ(run.stats().find("out")->items_out, static_cast<std::uint64_t>(total)) << total;
    EXPECT_EQ(run.stats().find("out")->items_in, static_cast<std::uint64_t>(total));
  }
}
