// The stream pool (StreamPool: one per runtime's device, shared by every graph on it), seen
// through GPU stages on the host backend: a lease per burst, never more leases than streams,
// waiters served first come, first served across graphs within priority classes
// (GraphOptions::priority). Checks docs/architecture.md, "A GPU stage invocation", and
// docs/telemetry.md, "Per device (`Runtime::device_stats()`, `DeviceStats`)" (leases and
// their maximum, waiters). Each test quotes the requirement it checks.
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <splitflow/ops/ops.hpp>
#include <splitflow/splitflow.hpp>
#include <string>
#include <vector>

#include "helpers.hpp"

using namespace splitflow;
using namespace std::chrono_literals;
using testing_helpers::counter;
using testing_helpers::expect_returned;
using testing_helpers::host_device;

// "Leases never exceed the pool size"; "two graphs sharing one pool both complete with
// correct results"; "Never held across a graph's life": one lease per burst.
TEST(StreamPool, LeasesNeverExceedThePoolAndGraphsShareIt) {
  Runtime rt(host_device(4, 3, 2));
  std::vector<std::unique_ptr<Graph>> graphs;
  std::vector<std::unique_ptr<std::atomic<long>>> sums;
  std::vector<splitflow::Run> runs;
  for (int k = 0; k < 3; ++k) {
    auto g = std::make_unique<Graph>(rt, std::string("g").append(std::to_string(k)));
    sums.push_back(std::make_unique<std::atomic<long>>(0));
    auto* sum = sums.back().get();
    auto src = g->source("n", counter(60));
    auto make = g->stage("make", [k](long i) {
      HostTensor t = HostTensor::empty(DType::i64, {1});
      *t.data<std::int64_t>() = i * (k + 1);
      return t;
    });
    GpuStageOptions o;
    o.concurrency = 4;  // more than the pool: they must wait for streams
    auto gpu = g->gpu_stage("kernel", [](DeviceTensor t, DeviceContext& ctx) {
      ops::busy_kernel(ctx, 300us);
      return ctx.to_host(t);
    }, o);
    auto sink = g->sink("sum", [sum](HostTensor h) { *sum += *h.data<std::int64_t>(); });
    src >> make >> gpu >> sink;
    graphs.push_back(std::move(g));
  }
  for (auto& g : graphs) runs.push_back(g->run());
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(runs[k].wait(), RunStatus::succeeded);
    EXPECT_EQ(sums[k]->load(), 59L * 60 / 2 * (k + 1));
    EXPECT_EQ(runs[k].stats().gpu.bursts, 60u);
  }
  const auto d = rt.device_stats();
  EXPECT_LE(d->max_leases_in_use, 3u) << "more streams leased than the pool has";
  EXPECT_EQ(d->max_leases_in_use, 3u) << "12 concurrent bursts should have filled the pool";
  EXPECT_EQ(d->leases, 180u) << "one lease per burst";
  expect_returned(rt, {runs[0].stats(), runs[1].stats(), runs[2].stats()});
}

namespace {

// Both runs of a contention test: a greedy graph cancelled at the end, and the other graph.
struct Contention {
  RunStats greedy, other;
};

// A greedy graph (an endless source -> `greedy_concurrency` invocations of a `greedy_kernel`
// burst) keeps the pool saturated; once its invocations queue for streams, a second graph,
// `other`, runs 15 bursts of 100 us one at a time. Both are built on `rt`.
void run_against_greedy(Runtime& rt, std::size_t greedy_concurrency,
                        std::chrono::nanoseconds greedy_kernel, Graph& other, Contention& out) {
  std::mutex mu;  // before the graph: an early return cancels its run, whose sink uses them
  std::condition_variable cv;
  long greedy_done = 0;
  Graph greedy(rt, "greedy");
  const auto build = [](Graph& g, std::function<void()> done, std::size_t concurrency,
                        std::chrono::nanoseconds kernel, long items) {
    auto src = g.source("n", counter(items));
    auto make = g.stage("make", [](long) { return HostTensor::empty(DType::u8, {64}); });
    GpuStageOptions o;
    o.concurrency = concurrency;
    auto gpu = g.gpu_stage(
        "model",
        [kernel](DeviceTensor t, DeviceContext& ctx) {
          ops::busy_kernel(ctx, kernel);
          return t;
        },
        o);
    auto sink = g.sink("s", [done](DeviceTensor) { done(); });
    src >> make >> gpu >> sink;
  };
  build(
      greedy,
      [&] {
        std::lock_guard lk(mu);
        ++greedy_done;
        cv.notify_all();
      },
      greedy_concurrency, greedy_kernel, -1);
  build(other, [] {}, 1, 100us, 15);
  auto greedy_run = greedy.run();
  {
    // Once a few greedy bursts completed, its other invocations hold the pool and wait in it.
    std::unique_lock lk(mu);
    ASSERT_TRUE(cv.wait_for(lk, 30s, [&] { return greedy_done >= 4; }));
  }
  EXPECT_GT(rt.device_stats()->lease_waiters, 0u) << "the greedy graph should queue for streams";
  auto other_run = other.run();
  ASSERT_TRUE(other_run.wait_for(30s));
  out.other = other_run.stats();
  greedy_run.cancel();
  greedy_run.wait();
  out.greedy = greedy_run.stats();
  expect_returned(rt, {out.greedy, out.other});
}

}  // namespace

// "Waiters are served first-come-first-served across graphs, so no graph starves (a test with
// one greedy graph and one light graph bounds the light one's wait)"
TEST(StreamPool, ALightGraphsWaitIsBoundedWhileAGreedyGraphSaturatesThePool) {
  Runtime rt(host_device(4, 2, 1));
  constexpr auto kGreedyKernel = 2ms;
  constexpr std::size_t kGreedyConcurrency = 6;
  Graph light(rt, "light");
  Contention c;
  ASSERT_NO_FATAL_FAILURE(run_against_greedy(rt, kGreedyConcurrency, kGreedyKernel, light, c));
  const GpuStats& ls = c.other.gpu;
  const GpuStats& gs = c.greedy.gpu;
  // First come, first served: a light invocation waits in the same queue as the greedy ones,
  // behind at most the greedy bursts queued ahead of it, so its longest wait is within twice
  // the greedy bursts' own longest in the same run (starved, it would wait for ever). Judged
  // against the run's own waits, not a time: an absolute bound of 62 ms failed once under ASan
  // on a loaded 2-core machine (101 ms), where every wait stretched.
  EXPECT_EQ(ls.bursts, 15u);
  EXPECT_GT(gs.bursts, 10u);
  EXPECT_GT(gs.max_lease_wait_ns, 0);
  EXPECT_LE(ls.max_lease_wait_ns, 2 * gs.max_lease_wait_ns)
      << "the light graph waited " << ls.max_lease_wait_ns / 1e6 << " ms for a stream, the greedy "
      << "graph's bursts at most " << gs.max_lease_wait_ns / 1e6 << " ms";
}

// "a graph can be given a priority so a latency-critical model's leases are served before a
// batch job's": with a greedy graph keeping the pool saturated and its invocations queued, a
// priority graph's bursts wait for a stream to free, not behind the queue (compared with the
// greedy graph's own waits in the same run).
TEST(StreamPool, APriorityGraphsLeasesAreServedBeforeAGreedyGraphs) {
  Runtime rt(host_device(4, 2, 1));
  Graph urgent(rt, "urgent", {.priority = 1});
  Contention c;
  ASSERT_NO_FATAL_FAILURE(run_against_greedy(rt, 8, 2ms, urgent, c));
  const GpuStats& us = c.other.gpu;
  const GpuStats& gs = c.greedy.gpu;
  ASSERT_EQ(us.bursts, 15u);
  const double urgent_wait = static_cast<double>(us.lease_wait_ns) / us.bursts;
  const double greedy_wait = static_cast<double>(gs.lease_wait_ns) / gs.bursts;
  // FIFO would make the urgent bursts wait about as long as the greedy ones (6 queued ahead on
  // 2 streams: ~3 kernels); served first, they wait for one stream to free (under a kernel).
  EXPECT_LT(urgent_wait, greedy_wait / 2)
      << "urgent " << urgent_wait / 1e6 << " ms, greedy " << greedy_wait / 1e6 << " ms per burst";
}
