// Blocking stages (StageOptions::blocking): a body that waits runs on the runtime's blocking
// threads, not the arena's. Checks that more bodies wait at once than the runtime has threads
// (a rendezvous that only that many at once can pass), order, the cap of blocking threads, the
// error policies, a cancel with bodies waiting, the CPU charged to the stage (call_ns), that
// the tuner takes an automatic one past the cores when it waits and not when it computes, and
// that nothing leaks. Checks docs/autotune.md, "I/O stages", and StageOptions::blocking.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <regex>
#include <splitflow/splitflow.hpp>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "helpers.hpp"

using namespace splitflow;
using namespace std::chrono_literals;
using testing_helpers::counter;
using testing_helpers::raise_max;
using testing_helpers::Rendezvous;
using testing_helpers::spin_us;
using testing_helpers::Tracked;


// "Stages that wait rather than compute get concurrency beyond the core count": eight bodies
// of a blocking stage wait at once on a runtime of two threads, and the outputs keep the order.
TEST(BlockingStage, MoreBodiesWaitAtOnceThanTheRuntimeHasThreadsInOrder) {
  Runtime rt({.threads = 2});
  Graph g(rt, "reads");
  Rendezvous eight(8);
  auto read = g.stage("read", [&](long x) {
    eight.enter();
    std::this_thread::sleep_for(200us);
    eight.leave();
    return x * 10;
  }, {.concurrency = 8, .blocking = true});
  std::vector<long> got;
  auto sink = g.sink("s", [&](long v) { got.push_back(v); });
  g.source("n", counter(500)) >> read >> sink;
  auto run = g.run();
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  EXPECT_TRUE(eight.met) << "eight bodies never waited at once (most: " << eight.max_seen << ")";
  EXPECT_EQ(eight.max_seen, 8) << "the stage's concurrency bounds its bodies at once";
  ASSERT_EQ(got.size(), 500u);
  for (long i = 0; i < 500; ++i) EXPECT_EQ(got[static_cast<std::size_t>(i)], i * 10) << i;
  const RunStats st = run.stats();
  const StageStats& r = *st.find("read");
  EXPECT_EQ(r.items_out, 500u);
  EXPECT_EQ(r.max_concurrency, 8u);
  // Its CPU, measured on the blocking threads, is a small part of its time (it sleeps).
  ASSERT_GE(r.call_ns, 0);
  EXPECT_LT(r.call_ns, r.work_ns / 2) << "call " << r.call_ns << " work " << r.work_ns;
}

// RuntimeConfig::blocking_threads caps the bodies waiting at once, across the stages.
TEST(BlockingStage, TheRuntimesBlockingThreadsCapTheBodiesAtOnce) {
  Runtime rt({.threads = 2, .blocking_threads = 3});
  Graph g(rt, "capped");
  std::atomic<long> inside{0}, most{0};
  auto body = [&](long x) {
    raise_max(most, ++inside);
    std::this_thread::sleep_for(300us);
    --inside;
    return x;
  };
  auto a = g.stage("a", body, {.concurrency = 8, .blocking = true});
  auto b = g.stage("b", body, {.concurrency = 8, .blocking = true});
  long n = 0, next = 0;
  bool ordered = true;
  auto sink = g.sink("s", [&](long v) { ordered &= v == next++; ++n; });
  g.source("n", counter(400)) >> a >> b >> sink;
  auto run = g.run();
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  EXPECT_EQ(n, 400);
  EXPECT_TRUE(ordered);
  EXPECT_LE(most.load(), 3) << "at most the runtime's 3 blocking threads";
  EXPECT_GE(most.load(), 2);
}

// Errors as for any stage: a failure names the graph, the stage and the item; skip drops the
// item alone; the body's CPU is charged either way.
TEST(BlockingStage, ErrorsFollowTheStagesPolicy) {
  Runtime rt({.threads = 2});
  {
    Graph g(rt, "failing");
    auto read = g.stage("read", [](long x) {
      if (x == 37) throw std::runtime_error("no such file");
      return x;
    }, {.concurrency = 4, .blocking = true});
    g.source("n", counter(100)) >> read >> g.sink("s", [](long) {});
    auto run = g.run();
    try {
      run.wait();
      ADD_FAILURE() << "no error";
    } catch (const StageError& e) {
      EXPECT_EQ(e.stage(), "read");
      EXPECT_EQ(e.item(), 37u);
      EXPECT_NE(std::string(e.what()).find("no such file"), std::string::npos) << e.what();
      EXPECT_EQ(e.graph(), "failing");
    }
    EXPECT_EQ(run.status(), RunStatus::failed);
  }
  Graph g(rt, "skipping");
  auto read = g.stage("read", [](long x) {
    if (x % 10 == 3) throw std::runtime_error("corrupt");
    return x;
  }, {.concurrency = 4, .on_error = OnError::skip, .blocking = true});
  std::vector<long> got;
  g.source("n", counter(100)) >> read >> g.sink("s", [&](long v) { got.push_back(v); });
  auto run = g.run();
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  std::vector<long> want;
  for (long i = 0; i < 100; ++i)
    if (i % 10 != 3) want.push_back(i);
  EXPECT_EQ(got, want);
  EXPECT_EQ(run.stats().find("read")->items_skipped, 10u);
}

// A cancel with bodies waiting: the run ends once they returned ("bodies already executing
// finish; wait() then returns RunStatus::cancelled", as on the arena's threads; it used to end
// without waiting for them), the items not begun are not run, no item is lost track of
// (nothing leaks), and the graph runs again.
TEST(BlockingStage, ACancelWithBodiesWaitingEndsTheRunOnceTheyReturnedAndTheGraphRunsAgain) {
  Tracked::live = 0;
  std::atomic<bool> release{false};
  std::atomic<long> entered{0}, inside{0};
  {
    Runtime rt({.threads = 2});
    Graph g(rt, "cancelled");
    auto read = g.stage("read", [&](Tracked t) {
      ++entered;
      ++inside;
      while (!release.load()) std::this_thread::sleep_for(1ms);
      --inside;
      return t;
    }, {.concurrency = 4, .blocking = true});
    long seen = 0;
    auto src = g.source("n", [i = 0]() mutable -> std::optional<Tracked> {
      if (i == 50) return std::nullopt;
      return Tracked(i++);
    });
    src >> read >> g.sink("s", [&](Tracked) { ++seen; });
    auto run = g.run();
    while (entered.load() < 4) std::this_thread::yield();
    run.cancel();
    release = true;
    EXPECT_EQ(run.wait(), RunStatus::cancelled);
    EXPECT_EQ(inside.load(), 0) << "the run ended with bodies still executing";
    EXPECT_EQ(entered.load(), 4) << "a body began after the cancel";
    // Again, to the end.
    auto again = g.run();
    EXPECT_EQ(again.wait(), RunStatus::succeeded);
    EXPECT_EQ(again.stats().find("s")->items_out, 50u);
  }
  EXPECT_EQ(Tracked::live.load(), 0) << "every item freed, those withdrawn by the cancel too";
}

// The tuner: an automatic blocking stage that waits goes past the runtime's threads; one that
// computes (its CPU, charged from the blocking threads, is its whole time) stays within them.
TEST(BlockingStage, TheTunerTakesAWaitingOnePastTheCoresAndNotAComputingOne) {
  auto tuned = [](bool waits) {
    Runtime rt({.threads = 2});
    GraphOptions o;
    o.autotune_window = 10ms;
    Graph g(rt, waits ? "waits" : "computes", o);
    auto read = g.stage("read", [waits](long x) {
      if (waits) std::this_thread::sleep_for(2ms);
      else spin_us(500);
      return x;
    }, {.concurrency = Concurrency::automatic, .blocking = true});
    auto parse = g.stage("parse", [](long x) { spin_us(100); return x + 1; },
                         {.concurrency = Concurrency::automatic});
    long next = 1;
    bool ordered = true;
    g.source("n", counter(waits ? 3000 : 1500)) >> read >> parse >>
        g.sink("s", [&](long v) { ordered &= v == next++; });
    auto run = g.run();
    EXPECT_EQ(run.wait(), RunStatus::succeeded);
    EXPECT_TRUE(ordered);
    return run.stats();
  };
  const std::regex raised(R"(^read (\d+) -> (\d+): .+)");
  auto most = [&](const RunStats& st) {
    std::size_t m = 1;
    for (const std::string& e : st.autotune) {
      std::smatch x;
      if (std::regex_match(e, x, raised)) m = std::max<std::size_t>(m, std::stoul(x[2]));
    }
    return m;
  };
  auto text = [](const RunStats& st) {
    std::string all;
    for (const std::string& e : st.autotune) all += "\n  " + e;
    return all;
  };
  const RunStats w = tuned(true);
  EXPECT_GT(most(w), 2u) << "a waiting body goes past the 2 threads:" << text(w);
  EXPECT_NE(text(w).find("read "), std::string::npos);
  const RunStats c = tuned(false);
  EXPECT_LE(most(c), 2u) << "a computing body stays within the cores:" << text(c);
  EXPECT_LE(c.find("read")->concurrency_limit, 2u);
  // Its CPU is charged from the blocking threads: about its 500 us of spinning per item.
  const StageStats& r = *c.find("read");
  EXPECT_GT(r.call_ns, static_cast<std::int64_t>(r.items_out) * 300'000) << r.call_ns;
}

// A new C++ user's trial: with RuntimeConfig::blocking_threads = 4 the tuner took a waiting
// blocking stage to 158 bodies at once, of which 4 could run (the rest queued for a blocking
// thread, holding their items). Its concurrency stays within the blocking threads now.
TEST(BlockingStage, TheTunerKeepsABlockingStageWithinTheBlockingThreads) {
  Runtime rt({.threads = 2, .blocking_threads = 4});
  GraphOptions o;
  o.autotune_window = 10ms;
  Graph g(rt, "few-blocking-threads", o);
  auto read = g.stage("read", [](long x) {
    std::this_thread::sleep_for(2ms);
    return x;
  }, {.concurrency = Concurrency::automatic, .blocking = true});
  long next = 0;
  bool ordered = true;
  g.source("n", counter(3000)) >> read >> g.sink("s", [&](long v) { ordered &= v == next++; });
  auto run = g.run();
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
  EXPECT_TRUE(ordered);
  const RunStats st = run.stats();
  const std::regex raised(R"(^read (\d+) -> (\d+): .+)");
  std::size_t most = 1;
  std::string all;
  for (const std::string& e : st.autotune) {
    all += "\n  " + e;
    std::smatch x;
    if (std::regex_match(e, x, raised)) most = std::max<std::size_t>(most, std::stoul(x[2]));
  }
  EXPECT_GT(most, 2u) << "it waits: past the 2 arena threads" << all;
  EXPECT_LE(most, 4u) << "within the 4 blocking threads" << all;
  EXPECT_LE(st.find("read")->concurrency_limit, 4u);
}

namespace {
bool said(const RunStats& st, const std::string& text) {
  return std::any_of(st.autotune.begin(), st.autotune.end(),
                     [&](const std::string& e) { return e.find(text) != std::string::npos; });
}
std::string decisions(const RunStats& st) {
  std::string all;
  for (const std::string& e : st.autotune) all += "\n  " + e;
  return all;
}
}  // namespace

// Without StageOptions::blocking: an automatic stage whose bodies wait (sampled: at most a claim a
// millisecond measured with the thread's CPU clock) holds the arena's threads, so its run's end moves it to
// the blocking threads for the next graph of its name, which goes past the threads; when its
// bodies compute again, a run's end moves it back. Order and counts hold in every run.
TEST(BlockingStage, AnAutomaticStageWhoseBodiesWaitRunsOnTheBlockingThreadsInTheNextGraphOfItsName) {
  Runtime rt({.threads = 2});
  std::atomic<bool> waits{true};
  auto epoch = [&](long items) {
    GraphOptions o;
    o.autotune_window = 10ms;
    Graph g(rt, "io", o);
    auto read = g.stage("read", [&waits](long x) {
      if (waits.load()) std::this_thread::sleep_for(2ms);
      else spin_us(300);
      return x;
    }, {.concurrency = Concurrency::automatic});
    long next = 0;
    bool ordered = true;
    g.source("n", counter(items)) >> read >> g.sink("s", [&](long v) { ordered &= v == next++; });
    auto run = g.run();
    EXPECT_EQ(run.wait(), RunStatus::succeeded);
    EXPECT_TRUE(ordered);
    EXPECT_EQ(next, items);
    return run.stats();
  };
  // On the arena: a synchronous stage's (no call_ns), within the 2 threads; its end moves it.
  const RunStats a = epoch(400);
  EXPECT_EQ(a.find("read")->call_ns, -1);
  EXPECT_LE(a.find("read")->max_concurrency, 2u);
  EXPECT_TRUE(said(a, "read to the blocking threads: its bodies waited ")) << decisions(a);
  // Built anew: on the blocking threads (an async stage's call_ns), said at the start, and past
  // the threads.
  const RunStats b = epoch(1000);
  EXPECT_GE(b.find("read")->call_ns, 0);
  EXPECT_TRUE(said(b, "read on the blocking threads: the last run of graph 'io' found its bodies "
                      "waiting (warm start)")) << decisions(b);
  EXPECT_GT(b.find("read")->max_concurrency, 2u) << decisions(b);
  EXPECT_FALSE(said(b, "read back to")) << decisions(b);
  // Its bodies compute now: the run's end moves it back, and the next graph runs it on the arena.
  waits = false;
  const RunStats c = epoch(400);
  EXPECT_TRUE(said(c, "read back to the arena's threads: its bodies computed more than they "
                      "waited")) << decisions(c);
  const RunStats d = epoch(400);
  EXPECT_EQ(d.find("read")->call_ns, -1);
  EXPECT_LE(d.find("read")->max_concurrency, 2u);
  EXPECT_FALSE(said(d, "blocking threads")) << decisions(d);
}

// An automatic stage that computes stays on the arena, and so does one whose user set its
// concurrency whatever its bodies do (it is not measured).
TEST(BlockingStage, AComputingAutomaticStageAndAUsersNumberStayOnTheArena) {
  Runtime rt({.threads = 2});
  for (int epoch = 0; epoch < 2; ++epoch) {
    GraphOptions o;
    o.autotune_window = 10ms;
    Graph g(rt, "mixed", o);
    auto fetch = g.stage("fetch", [](long x) { std::this_thread::sleep_for(1ms); return x; },
                         {.concurrency = 2});
    auto parse = g.stage("parse", [](long x) { spin_us(200); return x + 1; },
                         {.concurrency = Concurrency::automatic});
    long sum = 0;
    g.source("n", counter(300)) >> fetch >> parse >> g.sink("s", [&](long v) { sum += v; });
    auto run = g.run();
    ASSERT_EQ(run.wait(), RunStatus::succeeded);
    EXPECT_EQ(sum, 300 * 301 / 2);
    const RunStats st = run.stats();
    EXPECT_FALSE(said(st, "blocking threads")) << "epoch " << epoch << decisions(st);
    EXPECT_EQ(st.find("fetch")->call_ns, -1);
    EXPECT_EQ(st.find("parse")->call_ns, -1);
  }
}

// StageOptions::blocking is for Graph::stage: elsewhere it is refused, naming the node.
TEST(BlockingStage, OnlyAStageTakesBlocking) {
  Runtime rt({.threads = 1});
  Graph g(rt, "misused");
  try {
    g.sink("s", [](long) {}, {.blocking = true});
    ADD_FAILURE() << "a blocking sink was accepted";
  } catch (const GraphError& e) {
    EXPECT_NE(std::string(e.what()).find("sink('s')"), std::string::npos) << e.what();
  }
  EXPECT_THROW((g.async_stage<long, long>("a", [](long x, Completion<long> c) { c.done(x); },
                                          {.blocking = true})),
               GraphError);
  try {
    Runtime none({.threads = 1, .blocking_threads = 0});
    ADD_FAILURE() << "no blocking threads accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("blocking_threads must be 1 to 4096, not 0"), std::string::npos)
        << e.what();
  }
}

// A new C++ user's trial (a Taskflow subflow's pattern): a stage body that ran an inner graph on
// the same runtime and waited for it hung for ever once the bodies waiting so held every arena
// thread (2 threads, concurrency 2: 0 of 19800, and cancel() did not end it). A run of a graph
// of the runtime started from a task of that runtime (and a wait there for one) is refused now,
// with the fix, whatever the threads; the same body as a blocking stage (its bodies on the
// blocking threads) runs, as does a body running a graph on another runtime (which hung too:
// the two runtimes' 3 threads shared oneTBB's pool of 2 workers, both held by the waiting bodies).
TEST(BlockingStage, AWaitForAGraphOfTheSameRuntimeFromItsOwnTaskIsRefusedWithTheFix) {
  Runtime rt({.threads = 2});
  Runtime other({.threads = 1});
  for (int mode = 0; mode < 4; ++mode) {  // 0, 1: arena (Run::wait, PullSink::next); 2: blocking; 3: other runtime
    SCOPED_TRACE(mode);
    Graph outer(rt, "outer");
    auto s = outer.source("s", [i = 0]() mutable -> std::optional<int> {
      return i < 4 ? std::optional<int>(i++) : std::nullopt;
    });
    auto st = outer.stage("st", [&, mode](int x) {
      Graph inner(mode == 3 ? other : rt, "inner" + std::to_string(x));
      long sum = 0;
      auto is = inner.source("is", [i = 0]() mutable -> std::optional<int> {
        return i < 100 ? std::optional<int>(i++) : std::nullopt;
      });
      if (mode == 1) {
        auto ik = inner.pull_sink<int>("ik");
        is >> ik;
        inner.run();
        for (int y : ik) sum += y;
      } else {
        auto ik = inner.sink("ik", [&](int y) { sum += y; });
        is >> ik;
        inner.run().wait();
      }
      return sum;
    }, {.concurrency = 2, .blocking = mode == 2});
    std::atomic<long> total{0};
    auto k = outer.sink("k", [&](long v) { total += v; });
    s >> st >> k;
    splitflow::Run r = outer.run();
    if (mode >= 2) {
      EXPECT_EQ(r.wait(), RunStatus::succeeded);
      EXPECT_EQ(total.load(), 4 * 4950);
      continue;
    }
    try {
      r.wait();
      ADD_FAILURE() << "the run succeeded";
    } catch (const StageError& e) {
      EXPECT_EQ(e.stage(), "st");
      std::string cause;
      try {
        std::rethrow_if_nested(e);
      } catch (const GraphError& g) {
        cause = g.what();
      }
      EXPECT_EQ(cause.substr(0, cause.find(" for graph 'inner")), "splitflow: Graph::run()") << cause;
      EXPECT_NE(cause.find("was called from a task of the same Runtime (a stage body, a source or "
                           "a sink of one of its graphs): waiting for it there would hold one of "
                           "the runtime's 2 threads while the graph needs them"),
                std::string::npos) << cause;
      EXPECT_NE(cause.find("give the stage StageOptions::blocking = true"), std::string::npos) << cause;
    }
  }
}

// "Bodies already executing finish; wait() then returns RunStatus::cancelled": a blocking
// stage's body runs on the runtime's blocking threads, and a cancel's end of the run did not
// wait for it (its item withdrawn as an async stage's is): wait() returned, the Graph's
// destructor too, while the body still ran (a new user's trial: the next run went past the
// stage's concurrency, and state the body used was freed under it, ASan). Deterministic: the
// body blocks until the cancelled run is left with nothing but what waits for it (white-box:
// GraphCore::units() is 1, the blocked body's hold) or has ended (the bug); only then is it let
// go.
TEST(BlockingStage, ACancelledRunEndsOnlyOnceItsExecutingBodiesReturned) {
  Runtime rt({.threads = 2, .blocking_threads = 1});
  Graph g(rt, "cancel-blocking");
  std::mutex mu;
  std::condition_variable cv;
  bool entered = false, release = false;
  std::atomic<int> in_body{0}, began{0};
  std::atomic<bool> ended_while_in_body{false};
  auto src = g.source("n", counter(20));
  auto st = g.stage("read", [&](long x) {
    ++began;
    ++in_body;
    if (x == 0) {
      std::unique_lock lk(mu);
      entered = true;
      cv.notify_all();
      cv.wait(lk, [&] { return release; });
    }
    --in_body;
    return x;
  }, {.blocking = true});  // serial: the blocked body's task is the only one out
  src >> st >> g.sink("s", [](long) {});
  detail::GraphCore& core = st.out_port().graph();
  auto run = g.run();
  {
    std::unique_lock lk(mu);
    cv.wait(lk, [&] { return entered; });
  }
  run.cancel();
  // Until the run has ended (the bug) or waits for the blocked body alone.
  while (core.running() && core.units() > 1) std::this_thread::yield();
  ended_while_in_body = !core.running() && in_body.load() > 0;
  EXPECT_FALSE(ended_while_in_body.load()) << "the run ended while a blocking body ran";
  {
    std::lock_guard lk(mu);
    release = true;
  }
  cv.notify_all();
  EXPECT_EQ(run.wait(), RunStatus::cancelled);
  EXPECT_EQ(in_body.load(), 0);
  EXPECT_EQ(began.load(), 1);
  // The graph runs again, whole.
  long n = 0;
  Graph h(rt, "again");
  h.source("n", counter(20)) >> h.stage("read", [](long x) { return x; }, {.blocking = true}) >>
      h.sink("s", [&](long) { ++n; });
  EXPECT_EQ(h.run().wait(), RunStatus::succeeded);
  EXPECT_EQ(n, 20);
}

// splitflow::current_item() in a blocking stage's body: its item's number, as in a stage's on
// the arena (it was never set on the blocking threads: the Python module's random crops of
// plain arrays drew every item from 0 there, where an automatic op stage that waited goes).
TEST(BlockingStage, CurrentItemIsTheItemsNumberInItsBody) {
  Runtime rt({.threads = 2});
  Graph g(rt, "current-blocking");
  std::vector<std::pair<long, std::int64_t>> got;
  g.source("n", counter(50)) >>
      g.stage("tag", [](long x) {
        return std::pair<long, std::int64_t>(
            x, static_cast<std::int64_t>(splitflow::current_item().value_or(~0ULL)));
      }, {.concurrency = 4, .blocking = true}) >>
      g.sink("s", [&](std::pair<long, std::int64_t> p) { got.push_back(p); });
  EXPECT_EQ(g.run().wait(), RunStatus::succeeded);
  ASSERT_EQ(got.size(), 50u);
  for (long i = 0; i < 50; ++i) EXPECT_EQ(got[i], std::make_pair(i, std::int64_t{i}));
}
