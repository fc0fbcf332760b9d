// Asynchronous stages (Graph::async_stage): an item is handed on with a Completion and answered
// later from another thread, as oneTBB's async_node. Checks order, the concurrency bound (items
// out at once), that no arena thread waits for an answer, the error policies on a failed
// answer, a Completion dropped unanswered, a cancel with items out, and that nothing leaks.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <random>
#include <splitflow/splitflow.hpp>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "helpers.hpp"

using namespace splitflow;
using testing_helpers::counter;
using testing_helpers::iota_vector;
using testing_helpers::Tracked;
using testing_helpers::tracked_source;

namespace {

// An outside worker (not an arena thread) that holds the answers it is given and answers them
// when told: all at once, in a shuffled order, or as soon as `hold` of them are out.
class Answerer {
 public:
  explicit Answerer(std::size_t hold = 1, unsigned seed = 1) : hold_(hold), rng_(seed) {
    thread_ = std::thread([this] { loop(); });
  }
  ~Answerer() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void post(std::function<void()> answer) {
    std::lock_guard lk(mu_);
    pending_.push_back(std::move(answer));
    ++posted_;
    max_out_ = std::max(max_out_, pending_.size());
    cv_.notify_all();
  }
  /// The input ended: answer what is held even below `hold`.
  void flush() {
    std::lock_guard lk(mu_);
    flush_ = true;
    cv_.notify_all();
  }
  std::size_t max_out() {
    std::lock_guard lk(mu_);
    return max_out_;
  }
  std::size_t posted() {
    std::lock_guard lk(mu_);
    return posted_;
  }

 private:
  void loop() {
    std::unique_lock lk(mu_);
    for (;;) {
      cv_.wait(lk, [&] { return stop_ || pending_.size() >= hold_ || (flush_ && !pending_.empty()); });
      if (pending_.empty() && stop_) return;
      std::vector<std::function<void()>> batch(std::make_move_iterator(pending_.begin()),
                                               std::make_move_iterator(pending_.end()));
      pending_.clear();
      std::shuffle(batch.begin(), batch.end(), rng_);  // answered out of order
      lk.unlock();
      for (auto& a : batch) a();
      lk.lock();
    }
  }
  const std::size_t hold_;
  std::mt19937 rng_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> pending_;
  std::size_t max_out_ = 0;
  std::size_t posted_ = 0;
  bool flush_ = false;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace

// "outputs leave in order when order is in_order", answered in shuffled order by an outside
// thread; every item once, values right.
TEST(AsyncStage, AnswersOutOfOrderLeaveInSourceOrder) {
  Runtime rt({.threads = 2});
  Answerer worker(4, 7);
  Graph g(rt, "async");
  auto src = g.source("n", counter(500));
  auto twice = g.async_stage<long, long>(
      "twice",
      [&](long x, Completion<long> c) {
        if (x == 499) worker.flush();
        worker.post([x, c = std::make_shared<Completion<long>>(std::move(c))] { c->done(2 * x); });
      },
      {.concurrency = 4});
  auto out = g.pull_sink<long>("out");
  src >> twice >> out;
  auto run = g.run();
  std::vector<long> got;
  for (long v : out) got.push_back(v);
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  std::vector<long> want = iota_vector(500);
  for (long& v : want) v *= 2;
  EXPECT_EQ(got, want);
  const RunStats stats = run.stats();
  const StageStats* s = stats.find("twice");
  EXPECT_EQ(s->items_in, 500u);
  EXPECT_EQ(s->items_out, 500u);
  EXPECT_EQ(s->invocations, 500u);
}

// "concurrency bounds the items out at once; no arena thread waits for an answer": on ONE arena
// thread, a worker that answers only once 4 items are out sees exactly 4 out (a body that
// waited for its answer would hold the only thread with one item out, and the run would never
// end), and never more than the concurrency.
TEST(AsyncStage, ItemsOutAtOnceReachTheConcurrencyOnOneThread) {
  Runtime rt({.threads = 1});
  Answerer worker(4);
  Graph g(rt, "bound");
  auto src = g.source("n", counter(40));
  auto s = g.async_stage<long, long>(
      "remote",
      [&](long x, Completion<long> c) {
        worker.post([x, c = std::make_shared<Completion<long>>(std::move(c))] { c->done(x + 1); });
      },
      {.concurrency = 4});
  long sum = 0;
  auto sink = g.sink("sum", [&](long x) { sum += x; });
  src >> s >> sink;
  ASSERT_EQ(g.run().wait(), RunStatus::succeeded);
  EXPECT_EQ(sum, 40 * 41 / 2);
  EXPECT_EQ(worker.max_out(), 4u);
}

// "on_error applies to a failed answer": skip drops the item (counted, message kept), in order;
// substitute replaces it; fail fails the run with a StageError naming stage and item.
TEST(AsyncStage, FailedAnswersFollowTheStagesErrorPolicy) {
  Runtime rt({.threads = 2});
  Answerer worker(3, 3);
  auto body = [&](long x, Completion<long> c) {
    auto held = std::make_shared<Completion<long>>(std::move(c));
    if (x == 99) worker.flush();
    worker.post([x, held] {
      if (x % 10 == 4)
        held->fail(std::make_exception_ptr(std::runtime_error("remote refused " + std::to_string(x))));
      else
        held->done(x);
    });
  };
  {
    Graph g(rt, "skip");
    auto src = g.source("n", counter(100));
    auto s = g.async_stage<long, long>("remote", body, {.concurrency = 3, .on_error = OnError::skip});
    auto out = g.pull_sink<long>("out");
    src >> s >> out;
    auto run = g.run();
    std::vector<long> got;
    for (long v : out) got.push_back(v);
    ASSERT_EQ(run.wait(), RunStatus::succeeded);
    std::vector<long> want;
    for (long i = 0; i < 100; ++i)
      if (i % 10 != 4) want.push_back(i);
    EXPECT_EQ(got, want);
    const RunStats stats = run.stats();
    const StageStats* st = stats.find("remote");
    EXPECT_EQ(st->items_skipped, 10u);
    ASSERT_FALSE(st->errors.empty());
    for (const ItemError& e : st->errors) EXPECT_EQ(e.message, "remote refused " + std::to_string(e.item));
  }
  {
    Graph g(rt, "subst");
    auto src = g.source("n", counter(100));
    auto s = g.async_stage<long, long>("remote", body, {.concurrency = 3});
    s.substitute_on_error(-1L);
    auto out = g.pull_sink<long>("out");
    src >> s >> out;
    auto run = g.run();
    std::vector<long> got;
    for (long v : out) got.push_back(v);
    ASSERT_EQ(run.wait(), RunStatus::succeeded);
    std::vector<long> want = iota_vector(100);
    for (long& v : want)
      if (v % 10 == 4) v = -1;
    EXPECT_EQ(got, want);
    EXPECT_EQ(run.stats().find("remote")->items_substituted, 10u);
  }
  {
    Graph g(rt, "fails");
    auto src = g.source("n", counter(100));
    auto s = g.async_stage<long, long>("remote", body, {.concurrency = 3});
    auto sink = g.sink("drop", [](long) {});
    src >> s >> sink;
    try {
      g.run().wait();
      FAIL() << "expected StageError";
    } catch (const StageError& e) {
      EXPECT_EQ(e.graph(), "fails");
      EXPECT_EQ(e.stage(), "remote");
      EXPECT_EQ(e.item() % 10, 4u);
      EXPECT_EQ(e.message(), "remote refused " + std::to_string(e.item()));
    }
  }
}

// "a Completion dropped unanswered fails its item"; a body that answers at once works; a body
// that throws fails its item with what it threw, and the Completion it handed on then finds its
// item answered (done() returns false).
TEST(AsyncStage, DroppedThrownAndSynchronousAnswers) {
  Runtime rt({.threads = 2});
  std::vector<std::shared_ptr<Completion<long>>> kept;
  std::mutex mu;
  Graph g(rt, "edge");
  auto src = g.source("n", counter(30));
  auto s = g.async_stage<long, long>(
      "remote",
      [&](long x, Completion<long> c) {
        if (x % 3 == 0) {
          EXPECT_TRUE(c.done(x * 10));  // answered before the body returns
          EXPECT_FALSE(c.done(0));      // once only
          return;
        }
        if (x % 3 == 1) return;  // dropped unanswered
        std::lock_guard lk(mu);
        kept.push_back(std::make_shared<Completion<long>>(std::move(c)));
        throw std::invalid_argument("thrown after handing it on");
      },
      {.concurrency = 2, .on_error = OnError::skip});
  auto out = g.pull_sink<long>("out");
  src >> s >> out;
  auto run = g.run();
  std::vector<long> got;
  for (long v : out) got.push_back(v);
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  std::vector<long> want;
  for (long i = 0; i < 30; i += 3) want.push_back(i * 10);
  EXPECT_EQ(got, want);
  const RunStats stats = run.stats();
  const StageStats* st = stats.find("remote");
  EXPECT_EQ(st->items_skipped, 20u);
  for (const ItemError& e : st->errors) {
    if (e.item % 3 == 1)
      EXPECT_NE(e.message.find("dropped without an answer"), std::string::npos) << e.message;
    else
      EXPECT_EQ(e.message, "thrown after handing it on");
  }
  ASSERT_EQ(kept.size(), 10u);
  for (auto& c : kept) EXPECT_FALSE(c->done(1));  // its item was already answered (failed)
}

// "a cancel withdraws the items out at once": with 6 items out that nobody answers, the run
// still ends; their answers come after it and find them answered (done() returns false);
// nothing leaks.
TEST(AsyncStage, CancelWithdrawsTheItemsOutAndLateAnswersAreRefused) {
  Tracked::reset_counts();
  {
    Runtime rt({.threads = 2});
    Answerer worker(1);  // answers at once
    std::mutex mu;
    std::condition_variable cv;
    std::vector<std::pair<Tracked, std::shared_ptr<Completion<Tracked>>>> stash;  // never answered
    Graph g(rt, "cancel");
    auto src = g.source("n", tracked_source(-1));  // endless
    auto s = g.async_stage<Tracked, Tracked>(
        "remote",
        [&](Tracked t, Completion<Tracked> c) {
          auto held = std::make_shared<Completion<Tracked>>(std::move(c));
          if (t.value >= 120) {
            std::lock_guard lk(mu);
            stash.emplace_back(std::move(t), std::move(held));
            cv.notify_all();
            return;
          }
          worker.post([t = std::move(t), held]() mutable { EXPECT_TRUE(held->done(std::move(t))); });
        },
        {.concurrency = 6});
    auto out = g.pull_sink<Tracked>("out");
    src >> s >> out;
    auto run = g.run();
    for (long i = 0; i < 120; ++i) {  // (not a loop over `out`: leaving one cancels the run)
      std::optional<Tracked> t = out.next();
      ASSERT_TRUE(t.has_value());
      EXPECT_EQ(t->value, i);
    }
    {
      std::unique_lock lk(mu);
      ASSERT_TRUE(cv.wait_for(lk, std::chrono::seconds(20), [&] { return stash.size() == 6; }));
    }
    run.cancel();
    EXPECT_EQ(run.wait(), RunStatus::cancelled);  // without the 6 answers
    std::lock_guard lk(mu);
    for (auto& [t, c] : stash) EXPECT_FALSE(c->done(std::move(t)));
    stash.clear();
  }
  EXPECT_EQ(Tracked::live.load(), 0);
}

// A body with the wrong signature is refused at compile time (tests/compile_fail covers the
// other stage kinds); here, that move-only outputs travel.
TEST(AsyncStage, MoveOnlyOutputs) {
  Runtime rt({.threads = 2});
  Graph g(rt, "moves");
  auto src = g.source("n", counter(20));
  auto s = g.async_stage<long, std::unique_ptr<long>>(
      "box", [](long x, Completion<std::unique_ptr<long>> c) { c.done(std::make_unique<long>(x)); },
      {.concurrency = 2});
  auto out = g.pull_sink<std::unique_ptr<long>>("out");
  src >> s >> out;
  auto run = g.run();
  long i = 0;
  for (auto& p : out) EXPECT_EQ(*p, i++);
  EXPECT_EQ(i, 20);
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
}
