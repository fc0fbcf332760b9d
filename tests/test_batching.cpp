// The dynamic batch and unbatch nodes (Graph::dynamic_batch, Graph::unbatch;
// splitflow/serving/batching.hpp) inside a service: batch bounds, the max_delay timer on an
// injected clock (no sleeps), results back to the right requests, errors per batch and per
// item, deadlines. Checks docs/architecture.md, "How an item flows" (9. Dynamic batching), and
// docs/api.md, "Objects and options" (dynamic batching). Each test quotes the requirement it
// checks. (The fixed-size batch node, Graph::batch: test_batch.cpp.)
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <numeric>
#include <splitflow/serving/batching.hpp>
#include <splitflow/serving/testing.hpp>
#include <splitflow/serving/service.hpp>
#include <splitflow/splitflow.hpp>
#include <stdexcept>
#include <thread>
#include <vector>

#include "helpers.hpp"

using namespace splitflow;
using namespace std::chrono_literals;
using testing_helpers::fails_in_stage;
using testing_helpers::fails_with;

namespace {

// svc -> gather -> model (x -> 10x, recording batch sizes) -> split -> svc
struct Pipeline {
  Runtime rt{RuntimeConfig{.threads = 3}};
  Graph g{rt, "infer"};
  Service<long, long> svc;
  std::mutex mu;
  std::vector<std::size_t> sizes;
  std::vector<BatchClock::time_point> formed;

  Pipeline(DynamicBatchOptions o, std::function<void(Batch<long>&)> check = nullptr,
           OnError on_error = OnError::fail)
      : svc(g.service<long, long>("requests", {.max_pending = 256})) {
    auto clock = o.clock;
    const std::size_t max_batch = o.max_batch;
    auto gather = g.dynamic_batch<long>("gather", std::move(o));
    auto model = g.stage("model",
                         [this, check, clock](Batch<long> b) {
                           {
                             std::lock_guard lk(mu);
                             sizes.push_back(b.size());
                             if (clock) formed.push_back(clock->now());
                           }
                           if (check) check(b);
                           std::vector<long> out;
                           for (long x : b.items) out.push_back(10 * x);
                           return std::move(b).with(std::move(out));
                         },
                         {.on_error = on_error});
    auto split = g.unbatch<long>("split", max_batch);
    svc.source() >> gather >> model >> split >> svc.sink();
  }
};

// Waits until the batcher has received n items in all (it reads the clock as they arrive, and
// only then is the test's clock move meaningful). A wait on a condition, not a sleep.
void wait_arrived(const Run& run, std::uint64_t n) {
  const auto give_up = std::chrono::steady_clock::now() + 60s;
  while (run.stats().find("gather")->items_in < n) {
    ASSERT_LT(std::chrono::steady_clock::now(), give_up) << "items never reached the batcher";
    std::this_thread::yield();
  }
}

}  // namespace

// "gathers items into a batch until it reaches max_batch ... hands the batch to the next stage,
// and splits the batch's results back to each request's future"
TEST(DynamicBatch, ABatchGoesWhenFull) {
  auto clock = std::make_shared<splitflow::testing::ManualClock>();  // never advanced: only full batches can go
  Pipeline p({.max_batch = 4, .max_delay = 1h, .clock = clock});
  auto run = p.g.run();
  std::vector<std::future<long>> fs;
  for (long i = 0; i < 8; ++i) fs.push_back(p.svc.submit(i));
  for (long i = 0; i < 8; ++i) EXPECT_EQ(fs[i].get(), 10 * i);
  EXPECT_EQ(p.sizes, (std::vector<std::size_t>{4, 4}));
  p.svc.close();
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
}

// "... or the oldest item has waited max_delay, whichever comes first"; "no item waits past
// max_delay plus a bounded slack before its batch is formed (checked with an injectable clock)"
TEST(DynamicBatch, APartialBatchGoesWhenItsOldestItemWaitedMaxDelay) {
  auto clock = std::make_shared<splitflow::testing::ManualClock>();
  Pipeline p({.max_batch = 8, .max_delay = 5ms, .clock = clock});
  auto run = p.g.run();
  const auto t0 = clock->now();  // now() call 1
  std::vector<std::future<long>> fs;
  for (long i = 0; i < 3; ++i) fs.push_back(p.svc.submit(i));
  wait_arrived(run, 3);
  clock->advance(5ms - 1ns);
  for (auto& f : fs) EXPECT_EQ(f.wait_for(0s), std::future_status::timeout) << "a batch went early";
  clock->advance(1ns);  // the oldest item has waited exactly max_delay: its timer fires
  for (long i = 0; i < 3; ++i) EXPECT_EQ(fs[i].get(), 10 * i);
  ASSERT_EQ(p.sizes, (std::vector<std::size_t>{3}));
  EXPECT_EQ(p.formed.front() - t0, 5ms) << "formed when its oldest item had waited max_delay";
  // The next batch's clock starts with its own oldest item.
  auto late = p.svc.submit(7);
  wait_arrived(run, 4);
  clock->advance(4ms);
  EXPECT_EQ(late.wait_for(0s), std::future_status::timeout);
  clock->advance(1ms);
  EXPECT_EQ(late.get(), 70);
  p.svc.close();
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
}

// "batch sizes never exceed max_batch"; "results return to the right requests under
// concurrency" (the real clock and its timer thread)
TEST(DynamicBatch, BatchesNeverExceedMaxBatchUnderConcurrency) {
  Pipeline p({.max_batch = 8, .max_delay = 1ms});
  auto run = p.g.run();
  std::atomic<int> wrong{0};
  std::vector<std::thread> clients;
  for (int t = 0; t < 4; ++t)
    clients.emplace_back([&, t] {
      std::vector<std::pair<long, std::future<long>>> mine;
      for (long i = 0; i < 200; ++i) {
        const long x = t * 1000 + i;
        mine.emplace_back(x, p.svc.submit(x));
        if (i % 16 == 15)
          for (auto& [v, f] : mine)
            if (f.valid() && f.get() != 10 * v) ++wrong;
      }
      for (auto& [v, f] : mine)
        if (f.valid() && f.get() != 10 * v) ++wrong;
    });
  for (auto& c : clients) c.join();
  p.svc.close();
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_LE(*std::max_element(p.sizes.begin(), p.sizes.end()), 8u);
  EXPECT_EQ(std::accumulate(p.sizes.begin(), p.sizes.end(), std::size_t{0}), 800u);
  EXPECT_EQ(p.svc.stats().answered, 800u);
}

// "Errors in a batch reach every request in it; one bad request can be rejected without
// failing its batch-mates where the stage says so"
TEST(DynamicBatch, ABatchErrorReachesItsRequestsAndOneItemCanFailAlone) {
  auto clock = std::make_shared<splitflow::testing::ManualClock>();
  Pipeline p(
      {.max_batch = 4, .max_delay = 1h, .clock = clock},
      [](Batch<long>& b) {
        for (std::size_t i = 0; i < b.size(); ++i) {
          if (b.items[i] == 6) throw std::runtime_error("batch with 6 failed");
          if (b.items[i] == 1)
            b.fail(i, std::make_exception_ptr(std::invalid_argument("1 is invalid")));
        }
      },
      OnError::skip);
  auto run = p.g.run();
  std::vector<std::future<long>> fs;
  // Errors read here are kept until the run ended (testing_helpers::fails_with says why).
  std::vector<std::exception_ptr> held;
  for (long i = 0; i < 8; ++i) fs.push_back(p.svc.submit(i));  // batches {0..3}, {4..7}
  for (long i = 0; i < 8; ++i) {
    if (i == 1) {
      // failed alone inside its batch (Batch::fail): named at the unbatch that took it out
      EXPECT_TRUE(fails_in_stage<std::invalid_argument>(fs[i], "split", 1, "1 is invalid", held));
    } else if (i >= 4) {
      EXPECT_TRUE(fails_in_stage<std::runtime_error>(fs[i], "model", i, "batch with 6 failed", held))
          << "request " << i;
    } else {
      EXPECT_EQ(fs[i].get(), 10 * i);
    }
  }
  p.svc.close();
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
  const ServiceStats s = p.svc.stats();
  EXPECT_EQ(s.answered, 3u);
  EXPECT_EQ(s.failed, 5u);
}

// Under OnError::fail too: "an error on a batch reaches every id in it" (docs/architecture.md,
// 9.), and the run fails. Before: only the batch's first request got the error, its batch-mates
// the run's end ("the run was cancelled or failed before request N was answered").
TEST(DynamicBatch, UnderFailEveryRequestOfTheFailingBatchGetsItsError) {
  auto clock = std::make_shared<splitflow::testing::ManualClock>();
  Pipeline p({.max_batch = 4, .max_delay = 1h, .clock = clock}, [](Batch<long>& b) {
    if (b.items.front() == 0) throw std::runtime_error("the model failed on this batch");
  });
  auto run = p.g.run();
  std::vector<std::future<long>> fs;
  std::vector<std::exception_ptr> held;  // see ABatchErrorReachesItsRequests... above
  for (long i = 0; i < 4; ++i) fs.push_back(p.svc.submit(i));  // one full batch
  for (long i = 0; i < 4; ++i) {
    EXPECT_TRUE(fails_in_stage<std::runtime_error>(fs[i], "model", i, "the model failed on this batch",
                                                   held))
        << "request " << i;
  }
  EXPECT_THROW(run.wait(), StageError);
  EXPECT_EQ(p.svc.stats().failed, 4u);
}

// A StopRequest from the batch's body, under skip: it ends the run, and every request of the
// batch gets it as its cause (its first change answered only the first so; the others got the
// run's end, "cancelled or failed before request N was answered").
TEST(DynamicBatch, AStopRequestEndsTheRunAndEveryRequestOfTheBatchGetsIt) {
  auto clock = std::make_shared<splitflow::testing::ManualClock>();
  Pipeline p({.max_batch = 4, .max_delay = 1h, .clock = clock}, [](Batch<long>& b) {
    if (b.items.front() == 0) throw StopRequest("shutting down");
  }, OnError::skip);
  auto run = p.g.run();
  std::vector<std::future<long>> fs;
  std::vector<std::exception_ptr> held;
  for (long i = 0; i < 4; ++i) fs.push_back(p.svc.submit(i));  // one full batch
  for (long i = 0; i < 4; ++i)
    EXPECT_TRUE(fails_in_stage<StopRequest>(fs[i], "model", i, "shutting down", held)) << "request " << i;
  EXPECT_THROW(run.wait(), StageError);
  EXPECT_EQ(run.stats().find("model")->items_skipped, 0u);
}

// A batch's substitute answers its requests only when it carries their ids (a body's own
// replacement, b.with(...)); the stage's fixed substitute does not, so each request of that
// batch fails with the error at once (before: the first request failed, the other three
// waited for the service's close, "the run ended before request N was answered"; with a
// substitute that carries them, every request of the batch is answered from it).
TEST(DynamicBatch, ASubstitutedBatchAnswersItsRequestsOrFailsEachOfThem) {
  for (const bool carries : {false, true}) {
    SCOPED_TRACE(carries ? "a substitute with the batch's ids" : "the stage's fixed substitute");
    Runtime rt{RuntimeConfig{.threads = 3}};
    Graph g{rt, "infer"};
    auto svc = g.service<long, long>("requests", {.max_pending = 64});
    auto clock = std::make_shared<splitflow::testing::ManualClock>();
    auto gather = g.dynamic_batch<long>("gather", {.max_batch = 4, .max_delay = 1h, .clock = clock});
    auto model = g.stage("model", [carries](Batch<long> b) {
      std::vector<long> out;
      for (long x : b.items) out.push_back(10 * x);
      if (b.items.front() == 4) {
        if (!carries) throw std::runtime_error("the model failed on this batch");
        std::vector<long> minus(b.size(), -1);
        throw detail::SubstituteWith<Batch<long>>{std::move(b).with(std::move(minus)),
                                                  std::make_exception_ptr(std::runtime_error("replaced"))};
      }
      return std::move(b).with(std::move(out));
    });
    model.substitute_on_error(Batch<long>{});
    auto split = g.unbatch<long>("split", 4);
    svc.source() >> gather >> model >> split >> svc.sink();
    auto run = g.run();
    std::vector<std::future<long>> fs;
    std::vector<std::exception_ptr> held;  // see ABatchErrorReachesItsRequests... above
    for (long i = 0; i < 8; ++i) fs.push_back(svc.submit(i));  // batches {0..3}, {4..7}
    for (long i = 0; i < 8; ++i) {
      ASSERT_EQ(fs[i].wait_for(60s), std::future_status::ready)
          << "request " << i << " waits for the service's close";
      if (i < 4) {
        EXPECT_EQ(fs[i].get(), 10 * i);
      } else if (carries) {
        EXPECT_EQ(fs[i].get(), -1) << "request " << i;
      } else {
        EXPECT_TRUE(fails_in_stage<std::runtime_error>(fs[i], "model", i,
                                                       "the model failed on this batch", held))
            << "request " << i;
      }
    }
    svc.close();
    EXPECT_EQ(run.wait(), RunStatus::succeeded);
    const ServiceStats s = svc.stats();
    EXPECT_EQ(s.answered, carries ? 8u : 4u);
    EXPECT_EQ(s.failed, carries ? 0u : 4u);
    const RunStats st = run.stats();
    const StageStats* m = st.find("model");
    EXPECT_EQ(m->items_substituted, carries ? 1u : 0u);
    EXPECT_EQ(m->items_skipped, carries ? 0u : 1u);
  }
}

// "an expired request is dropped before its GPU work": the batch forms without it
TEST(DynamicBatch, ExpiredRequestsAreDroppedWhenTheBatchForms) {
  auto clock = std::make_shared<splitflow::testing::ManualClock>();
  Pipeline p({.max_batch = 4, .max_delay = 1h, .clock = clock});
  auto run = p.g.run();
  const auto past = std::chrono::steady_clock::now() - 1s;
  auto a = p.svc.submit(1);
  auto b = p.svc.submit(2, past);
  auto c = p.svc.submit(3);
  auto d = p.svc.submit(4, past);
  EXPECT_EQ(a.get(), 10);
  EXPECT_EQ(c.get(), 30);
  EXPECT_THROW(b.get(), DeadlineError);
  EXPECT_THROW(d.get(), DeadlineError);
  EXPECT_EQ(p.sizes, (std::vector<std::size_t>{2}));
  p.svc.close();
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
  EXPECT_EQ(run.stats().find("gather")->items_expired, 2u);
  EXPECT_EQ(p.svc.stats().expired, 2u);
}

// An unbatch whose consumer cannot hold a whole batch could never emit one: said at run().
TEST(DynamicBatch, AnUnbatchIntoASmallerQueueIsAGraphError) {
  Runtime rt({.threads = 2});
  Graph g(rt, "small");
  auto svc = g.service<long, long>("requests");
  auto gather = g.dynamic_batch<long>("gather", {.max_batch = 16});
  auto model = g.stage("model", [](Batch<long> b) { return b; });
  auto split = g.unbatch<long>("split", 16);
  // A queue its user sized below a batch (one the user did not size holds a batch: below).
  auto after = g.stage("after", [](long x) { return x; }, {.capacity = 4});
  svc.source() >> gather >> model >> split >> after >> svc.sink();
  try {
    g.run();
    FAIL();
  } catch (const GraphError& e) {
    EXPECT_NE(std::string(e.what()).find("holds 4 items, less than a batch of 16"),
              std::string::npos)
        << e.what();
  }
}

// A queue after an unbatch that its user did not size holds a batch, whatever the graph's
// default: a service's answers after batches of 64 (its answer sink, which has no capacity
// of its own to raise) ran only with GraphOptions::default_capacity raised to 64 (a new C++
// user's trial: run() said "its consumer 'requests.answer' holds 32 items, less than a batch
// of 64; raise that stage's capacity").
TEST(DynamicBatch, TheQueueAfterAnUnbatchHoldsABatchWhateverTheDefault) {
  Runtime rt({.threads = 2});
  Graph g(rt, "wide");  // default_capacity 32
  auto svc = g.service<long, long>("requests", {.max_pending = 512});
  auto gather = g.dynamic_batch<long>("gather", {.max_batch = 64, .max_delay = 1ms});
  auto model = g.stage("model", [](Batch<long> b) {
    std::vector<long> out;
    for (long x : b.items) out.push_back(3 * x);
    return std::move(b).with(std::move(out));
  });
  auto split = g.unbatch<long>("split", 64);
  svc.source() >> gather >> model >> split >> svc.sink();
  auto run = g.run();
  std::vector<std::future<long>> fs;
  for (long i = 0; i < 300; ++i) fs.push_back(svc.submit(i));
  for (long i = 0; i < 300; ++i) EXPECT_EQ(fs[static_cast<std::size_t>(i)].get(), 3 * i);
  svc.close();
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
  EXPECT_EQ(run.stats().find("requests.answer")->capacity, 64u);
}

// "full batches only": max_delay = nanoseconds::max() sets no timer (at + max_delay
// overflowed, and the partial batch went at once: a new C++ user's trial, UBSan's "signed
// integer overflow"). The last partial batch goes at the end of the input.
TEST(DynamicBatch, AnEndlessMaxDelayFormsOnlyFullBatchesUntilTheInputEnds) {
  auto clock = std::make_shared<splitflow::testing::ManualClock>();
  clock->advance(1s);  // (from the clock's epoch, at + max_delay would not overflow)
  Pipeline p({.max_batch = 4, .max_delay = std::chrono::nanoseconds::max(), .clock = clock});
  auto run = p.g.run();
  std::vector<std::future<long>> fs;
  for (long i = 0; i < 6; ++i) fs.push_back(p.svc.submit(i));
  for (long i = 0; i < 4; ++i) EXPECT_EQ(fs[static_cast<std::size_t>(i)].get(), 10 * i);
  wait_arrived(run, 6);
  EXPECT_EQ(clock->timers(), 0u) << "a timer was set for an endless max_delay";
  clock->advance(std::chrono::hours(24 * 365));
  for (std::size_t i = 4; i < 6; ++i)
    EXPECT_EQ(fs[i].wait_for(0s), std::future_status::timeout) << "a partial batch went before the end";
  p.svc.close();
  for (long i = 4; i < 6; ++i) EXPECT_EQ(fs[static_cast<std::size_t>(i)].get(), 10 * i);
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
  std::lock_guard lk(p.mu);
  EXPECT_EQ(p.sizes, (std::vector<std::size_t>{4, 2}));
}

// A body that builds its results' Batch itself, without the ids: its requests cannot be
// answered, and the run fails saying so. Before, the unbatch answered the batch's first
// request with every item and left the others waiting until close() (a new C++ user's trial).
TEST(DynamicBatch, ABatchWhoseResultsLostTheirIdsFailsTheRunSayingSo) {
  Runtime rt({.threads = 2});
  Graph g(rt, "lost");
  auto svc = g.service<long, long>("requests");
  auto gather = g.dynamic_batch<long>("gather", {.max_batch = 4, .max_delay = 1h});
  auto model = g.stage("model", [](Batch<long> b) {
    std::vector<long> out(b.items.begin(), b.items.end());
    return Batch<long>{std::move(out), {}, {}};  // the ids dropped
  });
  auto split = g.unbatch<long>("split", 4);
  svc.source() >> gather >> model >> split >> svc.sink();
  auto run = g.run();
  std::vector<std::future<long>> fs;
  for (long i = 0; i < 4; ++i) fs.push_back(svc.submit(i));
  const std::string said = "unbatch 'split': a batch of 4 results carries 0 request ids";
  for (auto& f : fs) {
    try {
      f.get();
      ADD_FAILURE() << "a request was answered";
    } catch (const Error&) {  // the run's end, as every request of a failed run
    }
  }
  try {
    run.wait();
    ADD_FAILURE() << "the run did not fail";
  } catch (const StageError& e) {
    EXPECT_EQ(e.stage(), "split");
    EXPECT_NE(std::string(e.what()).find(said), std::string::npos) << e.what();
  }
}

// "Move-only items (inside standard containers too) are moved, never copied"
// (docs/architecture.md): a Batch of move-only requests, too. It did not compile: a Batch of
// unique_ptr declares its vectors' copy constructor, and the emitter took it as copyable.
TEST(DynamicBatch, BatchesOfMoveOnlyRequestsAreMoved) {
  Runtime rt({.threads = 2});
  Graph g(rt, "moved");
  auto svc = g.service<std::unique_ptr<int>, std::unique_ptr<long>>("requests");
  auto gather = g.dynamic_batch<std::unique_ptr<int>>("gather", {.max_batch = 4, .max_delay = 1ms});
  auto model = g.stage("model", [](Batch<std::unique_ptr<int>> b) {
    std::vector<std::unique_ptr<long>> out;
    for (auto& p : b.items) out.push_back(std::make_unique<long>(*p * 3L));
    return std::move(b).with(std::move(out));
  });
  auto split = g.unbatch<std::unique_ptr<long>>("split", 4);
  svc.source() >> gather >> model >> split >> svc.sink();
  auto run = g.run();
  std::vector<std::future<std::unique_ptr<long>>> fs;
  for (int i = 0; i < 10; ++i) fs.push_back(svc.submit(std::make_unique<int>(i)));
  for (int i = 0; i < 10; ++i) EXPECT_EQ(*fs[static_cast<std::size_t>(i)].get(), 3L * i);
  svc.close();
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
}

// "unbatch's max_batch must hold the largest batch its dynamic batch forms": said at run(),
// not at the first large batch.
TEST(DynamicBatch, AnUnbatchSmallerThanItsDynamicBatchIsAGraphError) {
  Runtime rt({.threads = 2});
  Graph g(rt, "mismatch");
  auto svc = g.service<long, long>("requests");
  auto gather = g.dynamic_batch<long>("gather", {.max_batch = 32});
  auto model = g.stage("model", [](Batch<long> b) { return b; });
  auto split = g.unbatch<long>("split", 16);
  svc.source() >> gather >> model >> split >> svc.sink();
  const std::string m = testing_helpers::refusal(g);
  EXPECT_NE(m.find("unbatch 'split' takes batches of at most 16 items, but dynamic batch 'gather' "
                   "forms batches of up to 32; give the unbatch a max_batch of at least 32"),
            std::string::npos)
      << m;
}

// "Per-request latency histograms (... batching wait ...)": each request in a batch counts
// the time from its arrival in the batcher to the batch's forming, and only that, as batching.
TEST(DynamicBatch, EachRequestCountsItsBatchingWait) {
  auto clock = std::make_shared<splitflow::testing::ManualClock>();
  Pipeline p({.max_batch = 8, .max_delay = 5ms, .clock = clock});
  auto run = p.g.run();
  std::vector<std::future<long>> fs;
  for (long i = 0; i < 3; ++i) fs.push_back(p.svc.submit(i));
  wait_arrived(run, 3);
  const auto arrived = std::chrono::steady_clock::now();  // all three are in the batcher
  for (auto& f : fs) ASSERT_EQ(f.wait_for(0s), std::future_status::timeout);
  // The batch waits for the (manual) clock, not for this pause: it only makes the wait long
  // against a claim's own time, so that a latency leaving the wait out falls below it.
  std::this_thread::sleep_for(20ms);
  const std::int64_t in_batcher =  // each of the three waited at least this long in it
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                           arrived)
          .count();
  clock->advance(5ms);
  for (long i = 0; i < 3; ++i) EXPECT_EQ(fs[i].get(), 10 * i);
  p.svc.close();
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
  const ServiceStats s = p.svc.stats();
  // The batch node's own latency ("from its arrival in the input queue to the end of the
  // invocation", docs/telemetry.md) counts the wait for the batch too: it counted only the
  // claim's emission before (17 us against requests of 50 ms, a new user's trial).
  const RunStats st = run.stats();
  const StageStats* gather = st.find("gather");
  ASSERT_EQ(gather->latency.count(), 3u);
  EXPECT_GE(gather->latency.min(), static_cast<std::uint64_t>(in_batcher));
  EXPECT_GE(gather->latency.max(), s.batching.max());  // from the same arrival, to a later end
  ASSERT_EQ(s.batching.count(), 3u);
  EXPECT_GE(s.batching.min(), static_cast<std::uint64_t>(in_batcher));
  EXPECT_GT(s.batching.min(), 0u);
  EXPECT_LE(s.batching.max(), s.latency.max());
  EXPECT_EQ(s.gpu.max(), 0u) << "no GPU stage in this graph";
  const double parts = s.queueing.mean() + s.batching.mean() + s.gpu.mean() + s.other.mean();
  EXPECT_NEAR(parts, s.latency.mean(), 1000.0 + 0.001 * s.latency.mean());
}

// A formed batch carries its first request's number: that request's deadline passing later
// must not drop the whole batch at a GPU stage (its deadline was checked as the batch formed).
TEST(DynamicBatch, AFormedBatchIsNotDroppedForItsFirstRequestsDeadline) {
  auto clock = std::make_shared<splitflow::testing::ManualClock>();
  RuntimeConfig cfg{.threads = 3};
  cfg.device.backend = BackendKind::host;
  Runtime rt(cfg);
  Graph g(rt, "late");
  auto svc = g.service<long, long>("requests");
  auto gather = g.dynamic_batch<long>("gather", {.max_batch = 3, .max_delay = 1h, .clock = clock});
  std::mutex mu;
  std::condition_variable cv;
  bool in_hold = false, open = false;
  auto hold = g.stage("hold", [&](Batch<long> b) {
    std::unique_lock lk(mu);
    in_hold = true;
    cv.notify_all();
    cv.wait(lk, [&] { return open; });
    return b;
  });
  auto model = g.gpu_stage("model", [](Batch<long> b, DeviceContext&) {
    for (long& x : b.items) x = -x;
    return b;
  });
  auto split = g.unbatch<long>("split", 3);
  svc.source() >> gather >> hold >> model >> split >> svc.sink();
  auto run = g.run();
  const auto deadline = std::chrono::steady_clock::now() + 300ms;
  auto a = svc.submit(1, deadline);  // the batch's first request
  auto b = svc.submit(2);
  auto c = svc.submit(3);
  {
    std::unique_lock lk(mu);
    cv.wait(lk, [&] { return in_hold; });  // the batch formed (all three were in time)
  }
  std::this_thread::sleep_until(deadline + 1ms);  // the subject: a deadline passing, not a sync
  {
    std::lock_guard lk(mu);
    open = true;
    cv.notify_all();
  }
  EXPECT_EQ(a.get(), -1);
  EXPECT_EQ(b.get(), -2);
  EXPECT_EQ(c.get(), -3);
  svc.close();
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
  EXPECT_EQ(svc.stats().expired, 0u);
}
