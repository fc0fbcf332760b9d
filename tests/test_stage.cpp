// CPU stages (Graph::stage, and the sinks and sources that share their options): order, the
// concurrency limit and how items are claimed, and the per-stage error policies
// (StageOptions::on_error: fail, skip, substitute). Checks docs/architecture.md, "How an item
// flows" (3. Claims, 5. Order, 7. Errors per stage), and docs/api.md, "Conventions"
// (Concurrency, Errors policy, Order). Each test quotes the requirement it checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <set>
#include <splitflow/splitflow.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "helpers.hpp"

using namespace splitflow;
using testing_helpers::counter;
using testing_helpers::flatten;
using testing_helpers::iota_vec;
using testing_helpers::iota_vector;
using testing_helpers::raise_max;
using testing_helpers::Rendezvous;
using testing_helpers::spin_us;
using testing_helpers::Tracked;
using testing_helpers::tracked_source;
using testing_helpers::work_for;


// "ordering: in-order: output order equals input order even when parallel"
TEST(Ordering, InOrderParallelStagesPreserveSourceOrder) {
  Runtime rt({.threads = 4});
  Graph g(rt, "ordered");
  auto src = g.source("n", counter(3000));
  auto a = g.stage("a", [](long x) { spin_us(work_for(x)); return x * 3; }, {.concurrency = 4});
  auto b = g.stage("b", [](long x) { spin_us(work_for(x + 7)); return x + 1; },
                   {.concurrency = Concurrency::unlimited});
  std::vector<long> got;
  auto sink = g.sink("collect", [&](long x) { got.push_back(x); });
  src >> a >> b >> sink;
  EXPECT_EQ(g.run().wait(), RunStatus::succeeded);
  ASSERT_EQ(got.size(), 3000u);
  for (long i = 0; i < 3000; ++i) ASSERT_EQ(got[i], i * 3 + 1) << "at position " << i;
}

// "out-of-order" delivers every item exactly once; with random work the order does change.
TEST(Ordering, OutOfOrderDeliversEveryItemOnce) {
  Runtime rt({.threads = 4});
  Graph g(rt, "unordered");
  auto src = g.source("n", counter(2000));
  auto a = g.stage("a", [](long x) { spin_us(work_for(x)); return x; },
                   {.concurrency = 4, .order = Order::out_of_order});
  std::vector<long> got;
  auto sink = g.sink("collect", [&](long x) { got.push_back(x); });
  src >> a >> sink;
  g.run().wait();
  std::vector<long> sorted = got;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, iota_vec(2000));
}

// "observed max concurrency equals the limit (never more)"
TEST(Concurrency, ObservedMaximumEqualsTheLimit) {
  for (std::size_t limit : {1u, 3u, 5u}) {
    Runtime rt({.threads = 8});
    Graph g(rt, "limit");
    Rendezvous rv(static_cast<long>(limit));
    auto src = g.source("n", counter(400));
    auto work = g.stage("work", [&](long x) {
      rv.enter();
      spin_us(20);
      rv.leave();
      return x;
    }, {.concurrency = limit, .order = Order::out_of_order});
    long n = 0;
    auto sink = g.sink("count", [&](long) { ++n; });
    src >> work >> sink;
    auto run = g.run();
    run.wait();
    EXPECT_TRUE(rv.met) << "limit " << limit << " never reached";
    EXPECT_EQ(rv.max_seen, static_cast<long>(limit));
    EXPECT_EQ(run.stats().find("work")->max_concurrency, limit);
    EXPECT_EQ(n, 400);
  }
}

// Concurrency::unlimited is bounded by the consumer's capacity (each invocation holds a slot).
TEST(Concurrency, UnlimitedIsBoundedByTheConsumersCapacity) {
  Runtime rt({.threads = 8});
  Graph g(rt, "unlimited");
  std::atomic<long> now{0}, max{0};
  auto src = g.source("n", counter(300));
  auto st = g.stage("st", [&](long x) {
    raise_max(max, ++now);
    spin_us(200);
    --now;
    return x;
  }, {.concurrency = Concurrency::unlimited, .order = Order::out_of_order, .capacity = 16});
  auto sink = g.sink("s", [](long) {}, {.capacity = 3});
  src >> st >> sink;
  g.run().wait();
  EXPECT_LE(max.load(), 3);
  EXPECT_GE(max.load(), 2);
}

// docs/api.md, "Concurrency": 0 means unlimited, in C++ as in Python.
TEST(Validation, ConcurrencyZeroMeansUnlimited) {
  Runtime rt({.threads = 2});
  Graph g(rt, "zero");
  auto src = g.source("n", counter(100));
  auto st = g.stage("any", [](long v) { return v; }, {.concurrency = 0});
  long n = 0;
  auto sink = g.sink("s", [&](long) { ++n; });
  src >> st >> sink;
  auto run = g.run();
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  EXPECT_EQ(n, 100);
  EXPECT_EQ(run.stats().find("any")->concurrency_limit, Concurrency::unlimited);
}

// Claims carry about 20 us of work: cheap bodies share invocations, expensive ones run one item
// per invocation and a backlog of them spreads over the stage's concurrency. (Behind a
// bottleneck slots free one at a time, so claims there hold one item: batches only form from
// backlogs, never by waiting.)
TEST(Claims, CheapBodiesShareInvocations) {
  Runtime rt({.threads = 4});
  Graph g(rt, "cheap");
  auto src = g.source("n", counter(20000));
  auto cheap = g.stage("cheap", [](long x) { return x + 1; }, {.concurrency = 4});
  long sum = 0;
  auto sink = g.sink("s", [&](long x) { sum += x; });
  src >> cheap >> sink;
  auto run = g.run();
  run.wait();
  const RunStats st = run.stats();
  EXPECT_EQ(sum, 20000L * 20001 / 2);
  EXPECT_LT(st.find("n")->invocations, 20000u / 4) << "cheap items were not batched";
  EXPECT_LT(st.find("cheap")->invocations, 20000u / 4) << "cheap items were not batched";
}

TEST(Claims, ExpensiveBodiesRunOneItemPerInvocationAcrossTheConcurrency) {
  Runtime rt({.threads = 4});
  Graph g(rt, "dear");
  auto src = g.source("n", counter(600));
  auto dear = g.stage("dear", [](long x) { spin_us(100); return x; },
                      {.concurrency = 3, .order = Order::out_of_order});
  long n = 0;
  auto sink = g.sink("s", [&](long) { ++n; });
  src >> dear >> sink;
  auto run = g.run();
  run.wait();
  const RunStats st = run.stats();
  EXPECT_EQ(n, 600);
  EXPECT_EQ(st.find("dear")->invocations, 600u) << "100 us items should run one per claim";
  // Never above the limit, and really parallel. (Reaching exactly the limit depends on when
  // the OS wakes workers; Concurrency.ObservedMaximumEqualsTheLimit proves it deterministically.)
  EXPECT_LE(st.find("dear")->max_concurrency, 3u);
  EXPECT_GE(st.find("dear")->max_concurrency, 2u);
}

// "skip: drop the item, count it and keep its message; the run goes on" (in order, 4 threads)
TEST(ErrorPolicy, SkipDropsTheFailingItemsAndTheRunSucceeds) {
  Tracked::reset_counts();
  {
    Runtime rt({.threads = 4});
    Graph g(rt, "skippy");
    auto src = g.source("n", tracked_source(1000));
    auto check = g.stage(
        "check",
        [](Tracked t) {
          if (t.value % 7 == 3) throw std::runtime_error("bad value " + std::to_string(t.value));
          return t;
        },
        {.concurrency = 4, .on_error = OnError::skip});
    auto out = g.pull_sink<Tracked>("out");
    src >> check >> out;
    auto run = g.run();
    std::vector<int> got;
    for (auto& t : out) got.push_back(t.value);
    ASSERT_EQ(run.wait(), RunStatus::succeeded);
    const RunStats st = run.stats();
    std::vector<int> want;
    for (int i = 0; i < 1000; ++i)
      if (i % 7 != 3) want.push_back(i);
    EXPECT_EQ(got, want);  // in order, holes closed
    const StageStats* s = st.find("check");
    EXPECT_EQ(s->items_skipped, 143u);
    EXPECT_EQ(s->items_substituted, 0u);
    EXPECT_EQ(s->items_out, 857u);
    ASSERT_EQ(s->errors.size(), StageStats::kMaxItemErrors);
    for (const ItemError& e : s->errors) {
      EXPECT_EQ(e.item % 7, 3u);
      EXPECT_EQ(e.message, "bad value " + std::to_string(e.item));
    }
  }
  EXPECT_EQ(Tracked::live.load(), 0);
}

// "substitute: emit the stage's substitute value instead", counted; a skipping stage still
// lets a batch downstream see the end of its input
TEST(ErrorPolicy, SubstituteReplacesTheFailingItemsInPlace) {
  Runtime rt({.threads = 3});
  Graph g(rt, "subst");
  auto src = g.source("n", counter(100));
  auto parse = g.stage("parse",
                       [](long x) {
                         if (x % 10 == 0) throw std::invalid_argument("zero digit");
                         return x;
                       },
                       {.concurrency = 3});
  parse.substitute_on_error(-1L);
  auto batch = g.batch<long>("batch", 40);
  auto out = g.pull_sink<std::vector<long>>("out");
  src >> parse >> batch >> out;
  auto run = g.run();
  std::vector<std::vector<long>> got;
  for (auto& b : out) got.push_back(std::move(b));
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  const RunStats st = run.stats();
  std::vector<long> want = iota_vector(100);
  for (long& v : want)
    if (v % 10 == 0) v = -1;
  EXPECT_EQ(flatten(got), want);
  EXPECT_EQ(got.size(), 3u);
  EXPECT_EQ(st.find("parse")->items_substituted, 10u);
  std::set<std::uint64_t> failed;  // recorded as they happened, on 3 threads: any order
  for (const ItemError& e : st.find("parse")->errors) {
    EXPECT_EQ(e.message, "zero digit");
    failed.insert(e.item);
  }
  EXPECT_EQ(failed, (std::set<std::uint64_t>{0, 10, 20, 30, 40, 50, 60, 70, 80, 90}));
}

// "fail (default): the first error fails the run"; a skipping sink keeps consuming
TEST(ErrorPolicy, FailIsTheDefaultAndSinksCanSkip) {
  Runtime rt({.threads = 2});
  Graph g(rt, "sinks");
  auto src = g.source("n", counter(50));
  long sum = 0;
  auto sink = g.sink("sum",
                     [&](long x) {
                       if (x == 20) throw std::runtime_error("twenty");
                       sum += x;
                     },
                     {.on_error = OnError::skip});
  src >> sink;
  auto run = g.run();
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
  const RunStats st = run.stats();
  EXPECT_EQ(sum, 50 * 49 / 2 - 20);
  EXPECT_EQ(st.find("sum")->items_skipped, 1u);

  Graph f(rt, "fails");
  auto s2 = f.source("n", counter(50));
  auto st2 = f.stage("boom", [](long x) {
    if (x == 20) throw std::runtime_error("twenty");
    return x;
  });
  auto drop = f.sink("drop", [](long) {});
  s2 >> st2 >> drop;
  try {
    f.run().wait();
    FAIL() << "expected StageError";
  } catch (const StageError& e) {
    EXPECT_EQ(e.stage(), "boom");
    EXPECT_EQ(e.item(), 20u);
  }
}

// A body wrapper may replace the failed item itself (detail::SubstituteWith: the Python
// module's field= stages keep a sample's other fields so): under substitute its value is
// emitted, the error counted and named is its cause; under skip and fail, the cause alone.
TEST(ErrorPolicy, AWrappersOwnReplacementIsEmittedAndItsCauseReported) {
  using Pair = std::pair<long, long>;  // (value, label)
  auto body = [](Pair p) {
    if (p.first % 4 == 2) {
      std::exception_ptr cause;
      try {
        throw std::invalid_argument("even, not a multiple of 4");
      } catch (...) {
        cause = std::current_exception();
      }
      throw detail::SubstituteWith<Pair>{Pair{-1, p.second}, cause};
    }
    return Pair{p.first * 10, p.second};
  };
  auto pairs = [] {
    return [i = 0L]() mutable -> std::optional<Pair> {
      if (i == 12) return std::nullopt;
      const long v = i++;
      return Pair{v, 100 + v};
    };
  };
  for (OnError policy : {OnError::substitute, OnError::skip, OnError::fail}) {
    Runtime rt({.threads = 2});
    Graph g(rt, "wrapped");
    auto src = g.source("n", pairs());
    // (Serial under fail: the first item to fail is then item 2, whatever the threads do.)
    auto st = g.stage("st", body, {.concurrency = policy == OnError::fail ? 1u : 2u, .on_error = policy});
    if (policy == OnError::substitute) st.substitute_on_error(Pair{-9, -9});
    auto out = g.pull_sink<Pair>("out");
    src >> st >> out;
    auto run = g.run();
    std::vector<Pair> got;
    if (policy == OnError::fail) {
      try {
        for (auto& p : out) got.push_back(p);
        run.wait();
        ADD_FAILURE() << "the run did not fail";
      } catch (const StageError& e) {
        EXPECT_NE(std::string(e.what()).find("even, not a multiple of 4"), std::string::npos) << e.what();
        EXPECT_EQ(e.item(), 2u);
      }
      continue;
    }
    for (auto& p : out) got.push_back(p);
    ASSERT_EQ(run.wait(), RunStatus::succeeded);
    std::vector<Pair> want;
    for (long v = 0; v < 12; ++v) {
      if (v % 4 != 2) want.emplace_back(v * 10, 100 + v);
      else if (policy == OnError::substitute) want.emplace_back(-1, 100 + v);  // not {-9, -9}
    }
    EXPECT_EQ(got, want);
    const RunStats stats = run.stats();
    const StageStats* s = stats.find("st");
    EXPECT_EQ(s->items_substituted, policy == OnError::substitute ? 3u : 0u);
    EXPECT_EQ(s->items_skipped, policy == OnError::skip ? 3u : 0u);
    ASSERT_EQ(s->errors.size(), 3u);
    for (const ItemError& e : s->errors) EXPECT_EQ(e.message, "even, not a multiple of 4");
  }
}

// "substitute needs a value, and an output"
TEST(ErrorPolicy, SubstituteWithoutAValueOrOnASinkIsAGraphError) {
  Runtime rt({.threads = 2});
  Graph g(rt, "novalue");
  auto src = g.source("n", counter(5));
  auto st = g.stage("s", [](long x) { return x; }, {.on_error = OnError::substitute});
  auto sink = g.sink("sink", [](long) {});
  src >> st >> sink;
  try {
    g.run();
    FAIL() << "expected GraphError";
  } catch (const GraphError& e) {
    EXPECT_NE(std::string(e.what()).find("give one with substitute_on_error(value)"), std::string::npos)
        << e.what();
  }
  Graph h(rt, "sink");
  auto s2 = h.source("n", counter(5));
  auto k = h.sink("sink", [](long) {}, {.on_error = OnError::substitute});
  s2 >> k;
  EXPECT_THROW(h.run(), GraphError);
}

// splitflow::current_item(): within a stage's body, its item's number in the run (the one its
// errors name: the source's order, whatever the concurrency and order); nullopt outside a body
// (a source's generator, a sink, the caller's thread). What the Python module's crops draw from
// for a plain array (they drew every item from 0).
TEST(CurrentItem, IsTheItemsNumberInItsStagesBodyAndNothingOutside) {
  Runtime rt(RuntimeConfig{.threads = 2});
  Graph g(rt, "current");
  std::atomic<long> in_source{0}, in_sink{0};
  auto src = g.source("n", [i = 0L, &in_source]() mutable -> std::optional<long> {
    if (splitflow::current_item()) ++in_source;
    if (i == 200) return std::nullopt;
    return 10 * i++;
  });
  auto tag = g.stage("tag", [](long x) {
    spin_us(static_cast<double>(x % 7));
    return std::pair<long, std::int64_t>(x, static_cast<std::int64_t>(splitflow::current_item().value_or(~0ULL)));
  }, {.concurrency = 4, .order = Order::out_of_order});
  std::vector<std::pair<long, std::int64_t>> got;
  auto sink = g.sink("s", [&](std::pair<long, std::int64_t> p) {
    if (splitflow::current_item()) ++in_sink;
    got.push_back(p);
  });
  src >> tag >> sink;
  EXPECT_FALSE(splitflow::current_item().has_value());
  g.run().wait();
  EXPECT_FALSE(splitflow::current_item().has_value());
  ASSERT_EQ(got.size(), 200u);
  std::sort(got.begin(), got.end());
  for (long i = 0; i < 200; ++i) {
    EXPECT_EQ(got[i].first, 10 * i);
    EXPECT_EQ(got[i].second, i) << "item " << i;
  }
  EXPECT_EQ(in_source.load(), 0);
  EXPECT_EQ(in_sink.load(), 0);
}

// OnError::substitute without a value is refused by run(), naming the graph as well as the
// stage (its message named the stage alone: a new C++ user's trial).
TEST(Stage, ASubstitutePolicyWithoutAValueIsRefusedNamingGraphAndStage) {
  Runtime rt({.threads = 2});
  Graph g(rt, "sub2");
  auto st = g.stage("f", [](long x) { return x; }, {.on_error = OnError::substitute});
  g.source("n", counter(20)) >> st >> g.sink("s", [](long) {});
  const std::string why = testing_helpers::refusal(g);
  EXPECT_NE(why.find("splitflow::Graph 'sub2': stage 'f': on_error is OnError::substitute but it has no "
                     "substitute value; give one with substitute_on_error(value)"),
            std::string::npos)
      << why;
}
