// The pinned ring (PinnedRing: a GPU stage's host input ring, and its output ring for
// DeviceContext::to_host), seen through GPU stages on the host backend: item budgets reserved
// with queue slots bound what lies between the producer and the GPU stage, a full ring holds
// its producer back, and the D2H direction is symmetric. Checks docs/architecture.md, "Pinned
// rings". (The round trip through the rings, wrap-around and staging copies:
// test_gpu_stage.cpp.)
#include <gtest/gtest.h>

#include <atomic>
#include <splitflow/ops/ops.hpp>
#include <splitflow/splitflow.hpp>

#include "helpers.hpp"

using namespace splitflow;
using namespace std::chrono_literals;
using testing_helpers::counter;
using testing_helpers::expect_returned;
using testing_helpers::host_device;
using testing_helpers::spin_us;

// Backpressure through the ring: a slow GPU stage fills its small ring and the producer waits
// (blocked, not parked); the ring never holds more than its capacity.
TEST(PinnedRing, AFullRingHoldsTheProducerBack) {
  Runtime rt(host_device(2, 2));
  Graph g(rt, "ring-backpressure");
  std::atomic<long> produced{0}, consumed{0};
  std::atomic<long> max_gap{0};
  auto src = g.source("n", counter(60));
  auto make = g.stage("make", [&](long, HostAllocator& a) {
    testing_helpers::raise_max(max_gap, ++produced - consumed);
    return a.empty(DType::u8, {16 * 1024});
  }, {.capacity = 64});
  GpuStageOptions o;
  o.concurrency = 1;
  o.capacity = 64;
  o.ring_bytes = 64 * 1024;  // 16 KiB items: budget for (64 - 16) / 16 = 3 items
  o.ring_item_bytes = 16 * 1024;
  auto gpu = g.gpu_stage("slow", [&](DeviceTensor t, DeviceContext& ctx) {
    ops::busy_kernel(ctx, 1ms);
    return t;
  }, o);
  auto sink = g.sink("s", [&](DeviceTensor) { ++consumed; });
  src >> make >> gpu >> sink;
  auto run = g.run();
  run.wait();
  const RunStats st = run.stats();
  EXPECT_EQ(consumed.load(), 60);
  // Budgets (3) bound the items between the producer and the GPU stage, whatever the item
  // capacity (64) allows; +1 in the GPU stage's burst, +1 between it and the sink.
  EXPECT_LE(max_gap.load(), 3 + 2);
  EXPECT_GT(st.find("make")->blocked_ns, 0);
  EXPECT_GT(st.find("slow")->ring_wraps, 5u);
  expect_returned(rt, st);
}

// The D2H direction: to_host() writes into the GPU stage's output ring, the consumer gets the
// ring tensor, and a slow consumer holds the GPU stage back through the ring's budget.
TEST(PinnedRing, OutputRingCarriesDeviceToHostAndBackpressures) {
  Runtime rt(host_device(2, 4));
  Graph g(rt, "out-ring");
  std::atomic<long> started{0}, consumed{0}, max_gap{0};
  auto src = g.source("n", counter(80));
  auto make = g.stage("make", [](long i) {
    HostTensor t = HostTensor::empty(DType::i32, {1024});
    for (int k = 0; k < 1024; ++k) t.data<std::int32_t>()[k] = static_cast<std::int32_t>(i * k);
    return t;
  });
  GpuStageOptions o;
  o.concurrency = 4;
  o.capacity = 64;
  o.out_ring_bytes = 5 * 4096;  // 4 KiB items: (20 - 4) / 4 = 4 budgets
  o.out_ring_item_bytes = 4096;
  auto gpu = g.gpu_stage("d2h", [&](DeviceTensor t, DeviceContext& ctx) {
    testing_helpers::raise_max(max_gap, ++started - consumed);
    return ctx.to_host(t);
  }, o);
  long bad = 0, n = 0;
  std::size_t in_ring = 0;
  auto sink = g.sink("slow", [&](HostTensor h) {
    in_ring += h.memory() == Memory::pinned;
    for (int k = 0; k < 1024; ++k) bad += h.data<std::int32_t>()[k] != n * k;
    spin_us(300);
    ++n;
    ++consumed;
  }, {.capacity = 64});
  src >> make >> gpu >> sink;
  auto run = g.run();
  run.wait();
  EXPECT_EQ(n, 80);
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(in_ring, 80u);
  // At most 4 outputs live in the ring (its budgets), whatever the queue capacities allow.
  EXPECT_LE(max_gap.load(), 4 + 1);
  EXPECT_GT(run.stats().find("d2h")->blocked_ns, 0) << "the full output ring never held it back";
  expect_returned(rt, run.stats());
  EXPECT_EQ(run.stats().find("d2h")->ring_capacity, (std::size_t{64} << 20) + 5 * 4096)
      << "the input ring (default size) and the output ring";
}
