// Runs (Graph::run, Run, Runtime): failure, cancellation, reruns, several graphs on one runtime,
// runtime shutdown. Every test also checks that nothing leaks: items (live instance counts)
// return to zero. Checks docs/architecture.md, "Run lifecycle" and "Objects" (Runtime, Run), and
// docs/api.md, "Errors: one hierarchy" (StageError, GraphError).
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <splitflow/splitflow.hpp>
#include <stdexcept>
#include <thread>

#include "helpers.hpp"

using namespace splitflow;
using testing_helpers::counter;
using testing_helpers::spin_us;
using testing_helpers::Tracked;
using testing_helpers::tracked_source;

namespace {

// Blocks a test thread until a counter reaches a value (condition variable, no polling).
class Gauge {
 public:
  void add(long n = 1) {
    std::lock_guard lk(mu_);
    value_ += n;
    cv_.notify_all();
  }
  bool wait_at_least(long n, std::chrono::seconds timeout = std::chrono::seconds(30)) {
    std::unique_lock lk(mu_);
    return cv_.wait_for(lk, timeout, [&] { return value_ >= n; });
  }
  long value() {
    std::lock_guard lk(mu_);
    return value_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  long value_ = 0;
};


}  // namespace

// "wait() rethrows an error that names the stage and the item's sequence number and carries
// the original message"; "Nothing leaks (items, queue slots, tokens)"
TEST(Errors, StageExceptionNamesStageAndItemAndNestsTheOriginal) {
  Tracked::reset_counts();
  {
    Runtime rt({.threads = 4});
    Graph g(rt, "parser");
    auto src = g.source("lines", tracked_source(10000));
    auto parse = g.stage("parse", [](Tracked t) {
      if (t.value == 37) throw std::invalid_argument("bad digit 'x'");
      return t;
    }, {.concurrency = 3});
    auto sink = g.sink("keep", [](Tracked) { spin_us(2); });
    src >> parse >> sink;
    auto run = g.run();
    try {
      run.wait();
      FAIL() << "wait() did not throw";
    } catch (const StageError& e) {
      EXPECT_EQ(e.graph(), "parser");
      EXPECT_EQ(e.stage(), "parse");
      EXPECT_EQ(e.item(), 37u);
      EXPECT_EQ(e.message(), "bad digit 'x'");
      EXPECT_STREQ(e.what(),
                   "splitflow: graph 'parser': stage 'parse' failed on item 37: bad digit 'x'");
      try {
        std::rethrow_if_nested(e);
        FAIL() << "no nested exception";
      } catch (const std::invalid_argument& original) {
        EXPECT_STREQ(original.what(), "bad digit 'x'");
      }
    }
    EXPECT_EQ(run.status(), RunStatus::failed);
    EXPECT_LT(run.stats().find("keep")->items_out, 10000u) << "the failure did not stop the run";
  }
  EXPECT_EQ(Tracked::live.load(), 0) << "items leaked after a failure";
}

// A StopRequest (the Python module's KeyboardInterrupt or SystemExit raised in a body) ends the
// run whatever the stage's on_error: under skip or substitute it was taken for one bad item,
// dropped or replaced, and the run went on (a new user's Ctrl-C in a skipping stage was lost).
// A type derived from it is one too; a plain error is still skipped beside it.
struct Shutdown : StopRequest {
  using StopRequest::StopRequest;
};

class StopRequests : public ::testing::TestWithParam<std::tuple<OnError, bool>> {};

TEST_P(StopRequests, EndTheRunWhateverTheStagesOnError) {
  const auto [policy, in_sink] = GetParam();
  Tracked::reset_counts();
  {
    Runtime rt({.threads = 2});
    Graph g(rt, "stopping");
    std::atomic<long> consumed{0};
    auto body = [](Tracked t) {
      if (t.value == 11) throw std::invalid_argument("one bad item");
      if (t.value == 37) throw Shutdown("shutting down");
      return t;
    };
    auto src = g.source("lines", tracked_source(10000));
    if (in_sink) {
      auto sink = g.sink("keep", [&](Tracked t) { body(std::move(t)); ++consumed; },
                         {.on_error = policy});
      src >> sink;
    } else {
      auto parse = g.stage("parse", body, {.on_error = policy});  // serial: 11 before 37
      if (policy == OnError::substitute) parse.substitute_on_error(Tracked(-1));
      auto sink = g.sink("keep", [&](Tracked) { ++consumed; });
      src >> parse >> sink;
    }
    auto run = g.run();
    try {
      run.wait();
      FAIL() << "the run went on past the stop request";
    } catch (const StageError& e) {
      EXPECT_EQ(e.stage(), in_sink ? "keep" : "parse");
      EXPECT_EQ(e.item(), 37u);
      EXPECT_EQ(e.message(), "shutting down");
      try {
        std::rethrow_if_nested(e);
        FAIL() << "no nested exception";
      } catch (const Shutdown&) {
      } catch (...) {
        FAIL() << "the nested exception is not the body's StopRequest";
      }
    }
    EXPECT_EQ(run.status(), RunStatus::failed);
    const RunStats stats = run.stats();
    const StageStats& st = *stats.find(in_sink ? "keep" : "parse");
    EXPECT_EQ(st.items_skipped + st.items_substituted, 1u) << "only item 11 is the item's error";
    ASSERT_EQ(st.errors.size(), 1u);
    EXPECT_EQ(st.errors[0].item, 11u);
    EXPECT_LT(consumed.load(), 10000) << "the stop request did not stop the run";
  }
  EXPECT_EQ(Tracked::live.load(), 0) << "items leaked after a stop request";
}

INSTANTIATE_TEST_SUITE_P(Errors, StopRequests,
                         ::testing::Values(std::tuple{OnError::skip, false},
                                           std::tuple{OnError::substitute, false},
                                           std::tuple{OnError::skip, true}));

TEST(Errors, GeneratorExceptionNamesTheSource) {
  Runtime rt({.threads = 2});
  Graph g(rt, "gen");
  auto src = g.source("reader", [i = 0]() mutable -> std::optional<int> {
    if (i == 5) throw std::runtime_error("disk gone");
    return i++;
  });
  auto sink = g.sink("s", [](int) {});
  src >> sink;
  try {
    g.run().wait();
    FAIL();
  } catch (const StageError& e) {
    EXPECT_EQ(e.stage(), "reader");
    EXPECT_EQ(e.item(), 5u);
    EXPECT_EQ(e.message(), "disk gone");
  }
}

TEST(Errors, PullSinkRethrowsTheRunsError) {
  Runtime rt({.threads = 2});
  Graph g(rt, "pull-error");
  auto src = g.source("n", counter(100));
  auto st = g.stage("check", [](long x) {
    if (x == 50) throw std::runtime_error("nope");
    return x;
  });
  auto out = g.pull_sink<long>("out");
  src >> st >> out;
  auto run = g.run();
  long seen = 0;
  try {
    for (long v : out) {
      EXPECT_EQ(v, seen);
      ++seen;
    }
    FAIL() << "iteration ended without the error";
  } catch (const StageError& e) {
    EXPECT_EQ(e.stage(), "check");
    EXPECT_EQ(e.item(), 50u);
  }
  EXPECT_LE(seen, 50);
  EXPECT_THROW(run.wait(), StageError);
}

// "Other graphs on the same runtime are unaffected."
TEST(Errors, AFailingGraphLeavesOtherGraphsRunning) {
  Runtime rt({.threads = 3});
  Graph bad(rt, "bad"), good(rt, "good");
  auto bs = bad.source("n", counter(-1));
  auto bst = bad.stage("explode", [](long x) {
    if (x == 100) throw std::runtime_error("boom");
    return x;
  });
  auto bsink = bad.sink("s", [](long) {});
  bs >> bst >> bsink;
  long sum = 0;
  auto gs = good.source("n", counter(20000));
  auto gst = good.stage("inc", [](long x) { return x + 1; }, {.concurrency = 2});
  auto gsink = good.sink("sum", [&](long x) { sum += x; });
  gs >> gst >> gsink;
  auto good_run = good.run();
  auto bad_run = bad.run();
  EXPECT_THROW(bad_run.wait(), StageError);
  EXPECT_EQ(good_run.wait(), RunStatus::succeeded);
  EXPECT_EQ(sum, 20000L * 20001 / 2);
}

// "cancel mid-run from another thread"; "cancel() stops sources at once, drops queued items,
// lets running bodies finish, and wait() returns within a bounded time"
TEST(Cancel, FromAnotherThreadMidRunStopsPromptlyAndLeaksNothing) {
  Tracked::reset_counts();
  {
    Runtime rt({.threads = 4});
    Graph g(rt, "endless");
    Gauge consumed;
    std::atomic<bool> body_running_after_wait{false};
    std::atomic<int> in_body{0};
    auto src = g.source("forever", tracked_source(-1));
    auto st = g.stage("work", [&](Tracked t) {
      ++in_body;
      spin_us(50);
      --in_body;
      return t;
    }, {.concurrency = 3});
    auto sink = g.sink("sink", [&](Tracked) { consumed.add(); });
    src >> st >> sink;
    auto run = g.run();
    ASSERT_TRUE(consumed.wait_at_least(200));
    std::thread canceller([run] { run.cancel(); });
    canceller.join();
    ASSERT_TRUE(run.wait_for(std::chrono::seconds(10))) << "cancel did not end the run";
    EXPECT_EQ(run.wait(), RunStatus::cancelled);
    body_running_after_wait = in_body.load() != 0;
    EXPECT_FALSE(body_running_after_wait) << "a body was still running after wait()";
    const RunStats st_after = run.stats();
    EXPECT_EQ(st_after.status, RunStatus::cancelled);
    // Nothing flows after the end: the counts are final.
    EXPECT_EQ(consumed.value(), static_cast<long>(st_after.find("sink")->items_out));
  }
  EXPECT_EQ(Tracked::live.load(), 0) << "items leaked after cancel";
}

// "Run::cancel(): ... bodies already executing finish": and no body, sink callback or
// generator starts on another item after the cancel, even within a claim of many items.
TEST(Cancel, NoBodyStartsAfterTheCancel) {
  Runtime rt({.threads = 2});
  for (int where = 0; where < 3; ++where) {  // the generator, a stage, a sink cancels
    Graph g(rt, "stop-between-items");
    std::atomic<splitflow::Run*> handle{nullptr};
    std::atomic<bool> cancelled{false};
    std::atomic<long> after{0};
    auto at = [&](int who, long x) {
      if (cancelled) ++after;
      if (who == where && x == 3000) {
        splitflow::Run* r;
        while ((r = handle.load()) == nullptr) std::this_thread::yield();
        r->cancel();
        cancelled = true;
      }
    };
    auto src = g.source("n", [&, i = 0L]() mutable -> std::optional<long> {
      at(0, i);
      return i++;
    });
    auto st = g.stage("st", [&](long x) {
      at(1, x);
      return x;
    });
    auto sink = g.sink("sink", [&](long x) { at(2, x); });
    src >> st >> sink;
    splitflow::Run run = g.run();
    handle = &run;
    ASSERT_TRUE(run.wait_for(std::chrono::seconds(30)));
    EXPECT_EQ(run.status(), RunStatus::cancelled);
    EXPECT_TRUE(cancelled.load());
    // Cheap bodies run in claims of up to 64 items: each node is serial, and the node that
    // cancelled checks for the stop before its next item. Only the one call of each other node
    // that was executing at that moment may still count.
    EXPECT_LE(after.load(), 2) << "node " << where;
  }
}

// Cancel while producers are blocked on a pull sink that nobody reads.
TEST(Cancel, WhileBlockedOnAFullPullSink) {
  Tracked::reset_counts();
  {
    Runtime rt({.threads = 2});
    Graph g(rt, "blocked");
    auto src = g.source("n", tracked_source(-1));
    auto st = g.stage("st", [](Tracked t) { return t; }, {.concurrency = 2});
    auto out = g.pull_sink<Tracked>("out", 2);
    src >> st >> out;
    auto run = g.run();
    ASSERT_TRUE(out.next().has_value());
    run.cancel();
    ASSERT_TRUE(run.wait_for(std::chrono::seconds(10)));
    EXPECT_EQ(run.status(), RunStatus::cancelled);
    // Cancel drops what waits in the pull sink, and its reader is told that its stream was
    // cut short (a reader that stops reading itself calls close(): PullSink.CloseCancels...).
    EXPECT_THROW(out.next(), CancelledError);
  }
  EXPECT_EQ(Tracked::live.load(), 0);
}

// "A graph can run again after it finished, failed or was cancelled."
TEST(Rerun, AfterFailureAfterCancelAndAfterSuccess) {
  Runtime rt({.threads = 3});
  Graph g(rt, "again");
  std::atomic<bool> fail{true};
  std::atomic<bool> hold{false};  // bodies wait while set: the cancelled run cannot end first
  long sum = 0;
  auto src = g.source("n", counter(1000));
  auto st = g.stage("maybe", [&](long x) {
    if (fail && x == 10) throw std::runtime_error("first time");
    while (hold.load()) std::this_thread::yield();
    return x;
  }, {.concurrency = 2});
  auto sink = g.sink("sum", [&](long x) { sum += x; });
  src >> st >> sink;

  EXPECT_THROW(g.run().wait(), StageError);
  fail = false;
  sum = 0;
  auto ok = g.run();
  EXPECT_EQ(ok.wait(), RunStatus::succeeded);
  EXPECT_EQ(sum, 999L * 1000 / 2);
  EXPECT_EQ(ok.stats().find("sum")->items_in, 1000u) << "stats start from zero on every run";

  // (Without the hold, a run of 1000 items could end before cancel() came: it did once under
  // ASan, with the cancelling thread descheduled on a 2-core machine.)
  hold = true;
  auto cancelled = g.run();
  cancelled.cancel();
  hold = false;
  EXPECT_EQ(cancelled.wait(), RunStatus::cancelled);

  sum = 0;
  EXPECT_EQ(g.run().wait(), RunStatus::succeeded);
  EXPECT_EQ(sum, 999L * 1000 / 2);
}

TEST(Rerun, RunningTwiceAtOnceIsRefused) {
  Runtime rt({.threads = 2});
  Graph g(rt, "twice");
  auto src = g.source("n", counter(-1));
  auto sink = g.sink("s", [](long) {});
  src >> sink;
  auto run = g.run();
  EXPECT_THROW(g.run(), GraphError);
  EXPECT_THROW(g.sink("late", [](long) {}), GraphError) << "the graph changed while running";
  run.cancel();
  run.wait();
}

// "2 and 8 graphs at once on one runtime with correct per-graph results"
class ManyGraphs : public ::testing::TestWithParam<int> {};

TEST_P(ManyGraphs, RunAtOnceWithCorrectPerGraphResults) {
  const int n = GetParam();
  Runtime rt({.threads = 4});
  std::vector<std::unique_ptr<Graph>> graphs;
  std::vector<std::vector<long>> results(n);
  std::vector<splitflow::Run> runs;
  for (int k = 0; k < n; ++k) {
    auto g = std::make_unique<Graph>(rt, std::string("g").append(std::to_string(k)));
    const long items = 2000 + 100 * k;
    auto src = g->source("n", counter(items));
    auto mul = g->stage("mul", [k](long x) { return x * (k + 1); }, {.concurrency = 3});
    auto add = g->stage("add", [k](long x) { spin_us(x % 3); return x + k; },
                        {.concurrency = 2});
    auto sink = g->sink("keep", [&out = results[k]](long x) { out.push_back(x); });
    src >> mul >> add >> sink;
    graphs.push_back(std::move(g));
  }
  for (auto& g : graphs) runs.push_back(g->run());
  for (int k = 0; k < n; ++k) {
    EXPECT_EQ(runs[k].wait(), RunStatus::succeeded);
    const long items = 2000 + 100 * k;
    ASSERT_EQ(static_cast<long>(results[k].size()), items);
    for (long i = 0; i < items; ++i) ASSERT_EQ(results[k][i], i * (k + 1) + k);
  }
}

INSTANTIATE_TEST_SUITE_P(Graphs, ManyGraphs, ::testing::Values(2, 8));

// "Destroying it with runs in flight waits or cancels them, documented": it cancels them.
TEST(Runtime, DestroyingTheRuntimeCancelsRunsInFlight) {
  Tracked::reset_counts();
  auto rt = std::make_unique<Runtime>(RuntimeConfig{.threads = 2});
  Graph g(*rt, "orphaned");
  Gauge seen;
  auto src = g.source("n", tracked_source(-1));
  auto sink = g.sink("s", [&](Tracked) { seen.add(); });
  src >> sink;
  auto run = g.run();
  ASSERT_TRUE(seen.wait_at_least(10));
  rt.reset();
  EXPECT_EQ(run.status(), RunStatus::cancelled);
  EXPECT_THROW(g.run(), GraphError);
  EXPECT_EQ(Tracked::live.load(), 0);
}

// Destroying a graph with an active run cancels and waits for it.
TEST(Runtime, DestroyingAGraphCancelsItsRun) {
  Runtime rt({.threads = 2});
  splitflow::Run run;
  {
    Graph g(rt, "short-lived");
    auto src = g.source("n", counter(-1));
    auto sink = g.sink("s", [](long) {});
    src >> sink;
    run = g.run();
  }
  EXPECT_EQ(run.status(), RunStatus::cancelled);
  EXPECT_EQ(run.stats().graph, "short-lived") << "final stats outlive the graph";
}
