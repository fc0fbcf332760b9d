// The graph (Graph, connect / >> / fan_out, Graph::run): topology (fan-out, merge), sources
// (a generator, an iterator range), callback sinks, move-only and copied items, and the
// validation of run() and connect() (every port connected, acyclic, unique names, edges within
// one graph, a copyable type for a second consumer). Checks docs/architecture.md, "Objects"
// (Graph, what run() validates) and "How an item flows" (10. Fan-out, merge, zip), and
// docs/api.md, "Objects and options" (a source, sinks, edges).
// CPU stages: test_stage.cpp; zip: test_zip.cpp; pull sinks: test_pull_sink.cpp.
#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <memory>
#include <optional>
#include <splitflow/splitflow.hpp>
#include <string>
#include <vector>

#include "helpers.hpp"

using namespace splitflow;
using testing_helpers::counter;
using testing_helpers::iota_vec;
using testing_helpers::MoveOnly;
using testing_helpers::Tracked;

// "fan-out (one output feeding several stages, each getting every item)"
TEST(Topology, FanOutGivesEveryConsumerEveryItem) {
  Runtime rt({.threads = 4});
  Graph g(rt, "fan-out");
  auto src = g.source("n", counter(1000));
  auto twice = g.stage("twice", [](long x) { return 2 * x; }, {.concurrency = 3});
  auto plus = g.stage("plus", [](long x) { return x + 5000; },
                      {.concurrency = 2, .order = Order::out_of_order});
  std::vector<long> from_twice, from_plus;
  auto s1 = g.sink("s1", [&](long x) { from_twice.push_back(x); });
  auto s2 = g.sink("s2", [&](long x) { from_plus.push_back(x); });
  fan_out(src, twice, plus);
  twice >> s1;
  plus >> s2;
  g.run().wait();
  std::vector<long> want_twice, want_plus;
  for (long i = 0; i < 1000; ++i) {
    want_twice.push_back(2 * i);
    want_plus.push_back(i + 5000);
  }
  EXPECT_EQ(from_twice, want_twice);  // in order
  std::sort(from_plus.begin(), from_plus.end());
  EXPECT_EQ(from_plus, want_plus);
}

// "merge (several inputs of one type into one stage)"
TEST(Topology, MergeTakesEveryItemOfEveryProducer) {
  Runtime rt({.threads = 4});
  Graph g(rt, "merge");
  auto low = g.source("low", counter(700));
  auto high = g.source("high", std::vector<long>(iota_vec(500)));
  auto shift = g.stage("shift", [](long x) { return x + 10000; });
  auto mix = g.stage("mix", [](long x) { return x; }, {.concurrency = 2});
  std::vector<long> got;
  auto sink = g.sink("collect", [&](long x) { got.push_back(x); });
  high >> shift;
  connect(low, mix);
  connect(shift, mix);
  mix >> sink;
  g.run().wait();
  std::vector<long> want = iota_vec(700);
  for (long i = 0; i < 500; ++i) want.push_back(i + 10000);
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, want);
  // Each producer's own items keep their order through an in-order merge stage.
}

// "sources (from a generator callable, or from an iterator range)"
TEST(Sources, IteratorRangeAndGeneratorRestartOnEveryRun) {
  Runtime rt({.threads = 2});
  Graph g(rt, "sources");
  const std::vector<std::string> words{"a", "bb", "ccc"};
  auto w = g.source("words", words.begin(), words.end());
  auto len = g.stage("len", [](std::string s) { return static_cast<long>(s.size()); });
  auto out = g.pull_sink<long>("out");
  w >> len >> out;
  for (int round = 0; round < 3; ++round) {
    auto run = g.run();
    std::vector<long> got;
    for (long v : out) got.push_back(v);
    EXPECT_EQ(run.wait(), RunStatus::succeeded);
    EXPECT_EQ(got, (std::vector<long>{1, 2, 3})) << "round " << round;
  }
}

// A run's copy of its generator, and what it holds (a file, a socket, a remote pass), is
// released when the run ends, however it ends: it was kept until the next run started (a Dask
// pass left early kept its splits on the workers and its figures ageing, a new user's trial).
TEST(Sources, ARunsCopyOfTheGeneratorIsReleasedWhenTheRunEnds) {
  Runtime rt({.threads = 2});
  Graph g(rt, "released");
  auto token = std::make_shared<int>(0);
  long next = 0;
  auto src = g.source("n", [token, &next]() -> std::optional<long> {
    if (next == 1000) return std::nullopt;
    return next++;
  });
  auto out = g.pull_sink<long>("out", 2);
  src >> out;
  ASSERT_EQ(token.use_count(), 2);  // the test's and the graph's prototype
  for (const bool cancel : {true, false, true}) {
    next = 0;
    auto run = g.run();
    long taken = 0;
    for (long v : out) {
      EXPECT_EQ(v, taken);
      if (++taken == 5 && cancel) break;  // leaves the run early; the cancel below ends it
    }
    if (cancel) run.cancel();
    EXPECT_EQ(run.wait(), cancel ? RunStatus::cancelled : RunStatus::succeeded);
    EXPECT_EQ(taken, cancel ? 5 : 1000);
    EXPECT_EQ(token.use_count(), 2) << (cancel ? "after a cancelled run" : "after a run");
  }
}

// Graph::running(): true from run() until that run has ended, whatever the way it ends.
TEST(Runs, RunningIsTrueFromRunUntilTheRunHasEnded) {
  Runtime rt({.threads = 2});
  Graph g(rt, "running");
  auto src = g.source("n", counter(5));
  auto out = g.pull_sink<long>("out", 1);
  src >> out;
  EXPECT_FALSE(g.running());
  for (const bool cancel : {false, true}) {
    auto run = g.run();
    EXPECT_TRUE(g.running());  // the pull sink holds the items: the run cannot end yet
    if (cancel) {
      run.cancel();
    } else {
      long n = 0;
      for (long v : out) n += v;
      EXPECT_EQ(n, 0 + 1 + 2 + 3 + 4);
    }
    EXPECT_EQ(run.wait(), cancel ? RunStatus::cancelled : RunStatus::succeeded);
    EXPECT_FALSE(g.running()) << (cancel ? "after a cancel" : "after a run");
  }
}

// "Movable-only item types work ... no item is copied by the runtime outside fan-out"
TEST(Items, MoveOnlyItemsFlowWithZeroCopies) {
  Tracked::reset_counts();
  {
    Runtime rt({.threads = 4});
    Graph g(rt, "move-only");
    auto src = g.source("make", [i = 0]() mutable -> std::optional<MoveOnly> {
      if (i == 500) return std::nullopt;
      return MoveOnly(i++);
    });
    auto boxed = g.stage("box", [](MoveOnly m) { return std::make_unique<int>(m.t.value * 2); },
                         {.concurrency = 3});
    auto unbox = g.stage("unbox", [](std::unique_ptr<int> p) { return MoveOnly(*p + 1); },
                         {.concurrency = 2, .order = Order::out_of_order});
    auto out = g.pull_sink<MoveOnly>("out", 4);
    src >> boxed >> unbox >> out;
    auto run = g.run();
    std::vector<int> got;
    while (auto m = out.next()) got.push_back(m->t.value);
    run.wait();
    std::sort(got.begin(), got.end());
    ASSERT_EQ(got.size(), 500u);
    for (int i = 0; i < 500; ++i) ASSERT_EQ(got[i], 2 * i + 1);
  }
  EXPECT_EQ(Tracked::copies.load(), 0) << "the runtime copied items";
  EXPECT_EQ(Tracked::live.load(), 0) << "items leaked";
}

// A new C++ user's trial: move-only items inside standard containers did not compile
// (std::vector<std::unique_ptr<int>> from a stage, g.batch<std::unique_ptr<int>>):
// std::is_copy_constructible is true for such a vector, so the fan-out copy was instantiated.
// Now they flow (moved, never copied), and a second consumer of them is refused as for any
// move-only item.
TEST(Items, MoveOnlyItemsInsideContainersFlow) {
  Tracked::reset_counts();
  {
    Runtime rt({.threads = 2});
    Graph g(rt, "containers");
    auto src = g.source("make", [i = 0]() mutable -> std::optional<MoveOnly> {
      if (i == 100) return std::nullopt;
      return MoveOnly(i++);
    });
    auto boxed = g.stage("box", [](MoveOnly m) { return std::make_unique<int>(m.t.value); });
    auto batch = g.batch<std::unique_ptr<int>>("batch", 8);
    auto keyed = g.stage("key", [](std::vector<std::unique_ptr<int>> v) {
      std::map<int, std::vector<std::unique_ptr<int>>> by_parity;
      for (auto& p : v) by_parity[*p % 2].push_back(std::move(p));
      return by_parity;
    });
    long sum = 0, items = 0;
    auto sink = g.sink("sink", [&](std::map<int, std::vector<std::unique_ptr<int>>> m) {
      for (auto& [parity, v] : m)
        for (auto& p : v) {
          EXPECT_EQ(*p % 2, parity);
          sum += *p;
          ++items;
        }
    });
    src >> boxed >> batch >> keyed >> sink;
    EXPECT_EQ(g.run().wait(), RunStatus::succeeded);
    EXPECT_EQ(items, 100);
    EXPECT_EQ(sum, 99 * 100 / 2);
    auto second = g.sink("second", [](std::map<int, std::vector<std::unique_ptr<int>>>) {});
    try {
      keyed >> second;
      ADD_FAILURE() << "a second consumer of move-only containers was accepted";
    } catch (const GraphError& e) {
      EXPECT_NE(std::string(e.what()).find("needs a copyable type"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(Tracked::copies.load(), 0) << "the runtime copied items";
  EXPECT_EQ(Tracked::live.load(), 0) << "items leaked";
}

// The same edge twice was accepted and acted as a merge of a producer with itself: each item
// delivered twice (a new user's trial, 2026-12-05). Two different producers into one consumer,
// and one producer into both inputs of a zip, stay edges of their own.
TEST(Graph, TheSameEdgeTwiceIsRefused) {
  Runtime rt({.threads = 2});
  Graph g(rt, "twice");
  auto a = g.source("a", counter(3));
  auto b = g.source("b", counter(3));
  auto out = g.pull_sink<long>("out");
  a >> out;
  try {
    a >> out;
    ADD_FAILURE() << "the same edge was accepted twice";
  } catch (const GraphError& e) {
    EXPECT_EQ(std::string(e.what()),
              "splitflow::connect: 'a' is already connected to 'out' in graph 'twice'; connect "
              "them once (the same edge twice would deliver each item twice)");
  }
  b >> out;
  auto z = g.zip<long, long>("z");
  auto zout = g.pull_sink<std::pair<long, long>>("zout");
  auto c = g.source("c", counter(3));
  c >> z.first();
  c >> z.second();
  z >> zout;
  auto run = g.run();
  std::vector<long> got;
  for (long v : out) got.push_back(v);
  std::vector<std::pair<long, long>> pairs;
  for (auto& p : zout) pairs.push_back(p);
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, (std::vector<long>{0, 0, 1, 1, 2, 2}));
  EXPECT_EQ(pairs, (std::vector<std::pair<long, long>>{{0, 0}, {1, 1}, {2, 2}}));
}

// A type that is its own value_type (nlohmann::json) is copyable as it says, and fans out (the
// container check looked into it for ever: a review of that change).
TEST(Items, JsonItemsFanOut) {
  Runtime rt({.threads = 2});
  Graph g(rt, "json");
  auto src = g.source("n", [i = 0]() mutable -> std::optional<nlohmann::json> {
    if (i == 10) return std::nullopt;
    return nlohmann::json{{"i", i++}};
  });
  long a = 0, b = 0;
  auto sa = g.sink("a", [&](nlohmann::json j) { a += j["i"].get<long>(); });
  auto sb = g.sink("b", [&](nlohmann::json j) { b += j["i"].get<long>(); });
  fan_out(src, sa, sb);
  EXPECT_EQ(g.run().wait(), RunStatus::succeeded);
  EXPECT_EQ(a, 45);
  EXPECT_EQ(b, 45);
}

// Copyable items are not copied either (moves only), except by fan-out: one copy per extra
// consumer per item.
TEST(Items, CopyableItemsAreCopiedOnlyByFanOut) {
  Tracked::reset_counts();
  {
    Runtime rt({.threads = 3});
    Graph g(rt, "copies");
    auto src = g.source("make", [i = 0]() mutable -> std::optional<Tracked> {
      if (i == 300) return std::nullopt;
      return Tracked(i++);
    });
    auto id = g.stage("id", [](Tracked t) { return t; }, {.concurrency = 2});
    long sum1 = 0, sum2 = 0;
    auto s1 = g.sink("s1", [&](Tracked t) { sum1 += t.value; });
    auto s2 = g.sink("s2", [&](Tracked t) { sum2 += t.value; });
    src >> id;
    fan_out(id, s1, s2);
    g.run().wait();
    EXPECT_EQ(sum1, 299 * 300 / 2);
    EXPECT_EQ(sum2, 299 * 300 / 2);
  }
  EXPECT_EQ(Tracked::copies.load(), 300);
  EXPECT_EQ(Tracked::live.load(), 0);
}

// An item type that is copy-constructible but not copy-assignable (move-constructible and
// move-assignable, as docs/architecture.md asks) goes through a fan-out: the copies are
// constructed. It did not compile, even in a plain chain (the fan-out's copy assigned them):
// a new C++ user's trial.
namespace {
struct NoCopyAssign {
  long v = 0;
  explicit NoCopyAssign(long x) : v(x) {}
  NoCopyAssign(const NoCopyAssign&) = default;
  NoCopyAssign(NoCopyAssign&&) = default;
  NoCopyAssign& operator=(NoCopyAssign&&) = default;
  NoCopyAssign& operator=(const NoCopyAssign&) = delete;
};
}  // namespace

TEST(Items, AnItemTypeWithoutCopyAssignmentFansOut) {
  Runtime rt({.threads = 2});
  Graph g(rt, "no-copy-assign");
  auto src = g.source("make", [i = 0L]() mutable -> std::optional<NoCopyAssign> {
    if (i == 100) return std::nullopt;
    return NoCopyAssign(i++);
  });
  long sum1 = 0, sum2 = 0;
  auto s1 = g.sink("s1", [&](NoCopyAssign x) { sum1 += x.v; });
  auto s2 = g.sink("s2", [&](NoCopyAssign x) { sum2 += x.v; });
  fan_out(src, s1, s2);
  EXPECT_EQ(g.run().wait(), RunStatus::succeeded);
  EXPECT_EQ(sum1, 99 * 100 / 2);
  EXPECT_EQ(sum2, 99 * 100 / 2);
}

TEST(Validation, MalformedGraphsAreRejectedWithTheStageNamed) {
  Runtime rt({.threads = 2});
  auto message_of = [](Graph& g) {
    try {
      g.run().wait();
    } catch (const GraphError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  {
    Graph g(rt, "dangling-output");
    auto src = g.source("n", counter(3));
    auto st = g.stage("orphan", [](long x) { return x; });
    src >> st;
    // the graph named too (a new user's trial)
    EXPECT_NE(message_of(g).find("graph 'dangling-output': stage 'orphan': its output is not connected"),
              std::string::npos);
  }
  {
    Graph g(rt, "dangling-input");
    auto src = g.source("n", counter(3));
    auto st = g.sink("lonely", [](long) {});
    auto st2 = g.sink("fed", [](long) {});
    src >> st2;
    (void)st;
    EXPECT_NE(message_of(g).find("sink 'lonely': its input is not connected"), std::string::npos);
  }
  {
    Graph g(rt, "half-zip");
    auto src = g.source("n", counter(3));
    auto z = g.zip<long, long>("z");
    auto sink = g.sink("s", [](std::pair<long, long>) {});
    connect(src, z.first());
    z >> sink;
    EXPECT_NE(message_of(g).find("zip 'z': its second input is not connected"),
              std::string::npos);
  }
  {
    Graph g(rt, "cycle");
    auto src = g.source("n", counter(3));
    auto a = g.stage("a", [](long x) { return x; });
    auto b = g.stage("b", [](long x) { return x; });
    auto sink = g.sink("s", [](long) {});
    src >> a >> b >> sink;
    connect(b, a);
    // Only the nodes on the cycle, in its order ('s' lies downstream of it, not on it).
    EXPECT_NE(message_of(g).find("it has a cycle: 'a' -> 'b' -> 'a' (graphs must be acyclic)"),
              std::string::npos)
        << message_of(g);
  }
  {
    Graph g(rt, "longer-cycle");
    auto src = g.source("n", counter(3));
    auto a = g.stage("a", [](long x) { return x; });
    auto b = g.stage("b", [](long x) { return x; });
    auto c = g.stage("c", [](long x) { return x; });
    auto d = g.stage("d", [](long x) { return x; });
    auto sink = g.sink("s", [](long) {});
    src >> a >> b >> c >> d >> sink;
    connect(d, b);
    EXPECT_NE(message_of(g).find("it has a cycle: 'b' -> 'c' -> 'd' -> 'b' (graphs"),
              std::string::npos)
        << message_of(g);
  }
  {
    Graph g(rt, "no-source");
    auto s = g.stage("a", [](long x) { return x; });
    (void)s;
    EXPECT_NE(message_of(g).find("it has no source"), std::string::npos);
  }
  {
    Graph g(rt, "parallel-ordered-sink");
    auto src = g.source("n", counter(3));
    auto sink = g.sink("s", [](long) {}, {.concurrency = 2});
    src >> sink;
    EXPECT_NE(message_of(g).find("sink 's': a sink with concurrency > 1 cannot run in order"),
              std::string::npos);
  }
  Graph g(rt, "names");
  g.source("x", counter(1));
  EXPECT_THROW(g.stage("x", [](long v) { return v; }), GraphError);
}

// Fan-out of a move-only type through connect() is refused at the second edge, with advice.
TEST(Validation, SecondConsumerOfMoveOnlyItemsIsRefused) {
  Runtime rt({.threads = 1});
  Graph g(rt, "move-only-fan-out");
  auto src = g.source("make", []() -> std::optional<std::unique_ptr<int>> { return {}; });
  auto s1 = g.sink("s1", [](std::unique_ptr<int>) {});
  auto s2 = g.sink("s2", [](std::unique_ptr<int>) {});
  src >> s1;
  try {
    src >> s2;
    FAIL() << "expected GraphError";
  } catch (const GraphError& e) {
    EXPECT_NE(std::string(e.what()).find("needs a copyable type"), std::string::npos);
  }
}

TEST(Validation, ConnectingAcrossGraphsIsRefused) {
  Runtime rt({.threads = 1});
  Graph g1(rt, "one"), g2(rt, "two");
  auto a = g1.source("a", counter(1));
  auto b = g2.sink("b", [](long) {});
  EXPECT_THROW(a >> b, GraphError);
}

namespace {
// What `call` throws as GraphError, or "no error".
template <class F>
std::string says(F&& call) {
  try {
    call();
  } catch (const GraphError& e) {
    return std::string(e.what());
  }
  return std::string("no error");
}
}  // namespace

// A C++ embedding trial (2026-12-05): every member of a Graph moved from dereferenced its
// null core (a segfault); an empty stage name was taken, and its errors and report read
// "stage ''". A moved-from graph now names the mistake, and is not running; the graph it was
// moved into runs.
TEST(Validation, AMovedFromGraphSaysSoAndItsSuccessorRuns) {
  Runtime rt({.threads = 2});
  Graph a(rt, "first");
  auto src = a.source("n", counter(3));
  std::vector<long> got;
  auto sink = a.sink("out", [&](long x) { got.push_back(x); });
  src >> sink;
  Graph b = std::move(a);
  const std::string moved = "splitflow::Graph: this graph was moved from; use the Graph it was "
                            "moved into";
  EXPECT_EQ(says([&] { a.run(); }), moved);  // NOLINT(bugprone-use-after-move): on purpose
  EXPECT_EQ(says([&] { (void)a.name(); }), moved);
  EXPECT_EQ(says([&] { a.source("m", counter(1)); }), moved);
  EXPECT_EQ(says([&] { a.stage("s", [](long x) { return x; }); }), moved);
  EXPECT_EQ(says([&] { a.stage("s", [](long x) { return x; }, {.blocking = true}); }), moved);
  EXPECT_EQ(says([&] { a.batch<long>("b", 2); }), moved);
  EXPECT_EQ(says([&] { a.pull_sink<long>("p"); }), moved);
  EXPECT_FALSE(a.running());
  EXPECT_EQ(b.name(), "first");
  EXPECT_EQ(b.run().wait(), RunStatus::succeeded);
  EXPECT_EQ(got, (std::vector<long>{0, 1, 2}));
  a = std::move(b);  // assigning to a moved-from graph makes it whole again
  got.clear();
  EXPECT_EQ(a.run().wait(), RunStatus::succeeded);
  EXPECT_EQ(got, (std::vector<long>{0, 1, 2}));
}

TEST(Validation, AnEmptyStageNameIsRefused) {
  Runtime rt({.threads = 2});
  Graph g(rt, "unnamed");
  const std::string empty = "splitflow::Graph 'unnamed': a stage's name is empty (errors, the "
                            "report and the tuner name stages: give it one, unique within the "
                            "graph)";
  EXPECT_EQ(says([&] { g.source("", counter(1)); }), empty);
  EXPECT_EQ(says([&] { g.stage("", [](long x) { return x; }); }), empty);
  EXPECT_EQ(says([&] { g.sink("", [](long) {}); }), empty);
  EXPECT_EQ(says([&] { g.pull_sink<long>(""); }), empty);
  EXPECT_EQ(says([&] { g.zip<long, long>(""); }), empty);
}
