// The pinned ring (PinnedRing: a GPU stage's host input ring, and its output ring for
// DeviceContext::to_host), seen through GPU stages on the host backend: item budgets reserved
// with queue slots bound what lies between the producer and the GPU stage, a full ring holds
// its producer back, and the D2H direction is symmetric. Checks docs/architecture.md, "Pinned
// rings". (The round trip through the rings, wrap-around and staging copies:
// test_gpu_stage.cpp.)
#include <gtest/gtest.h>

#include <atomic>
#include <optional>
#include <regex>
#include <string>
#include <vector>
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

namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

// A producer of 64 KiB tensors (item i filled with i) into a GPU stage that copies them back
// for a sink that checks them, through the GPU stage's ring (items of up to `item_bytes`):
// `producers` invocations at once, each `make_us` long. Runs as often as asked.
struct RingGraph {
  struct Run {
    RunStats stats;
    std::vector<std::string> ring_events;  // the run's "ring_bytes" decisions
    std::size_t ring() const { return stats.find("model")->ring_capacity; }
  };
  Graph g;
  long items, next = 0, n = 0, bad = 0;  // next: the source's

  RingGraph(Runtime& rt, const std::string& name, long items_, std::size_t producers, double make_us,
            std::size_t item_bytes, std::size_t ring_bytes = GpuStageOptions::automatic)
      : g(rt, name), items(items_) {
    auto src = g.source("n", [this]() -> std::optional<long> {
      if (next == items) return std::nullopt;
      return next++;
    });
    auto make = g.stage("make", [make_us](long i) {
      HostTensor t = HostTensor::empty(DType::i32, {16 * 1024});
      for (int k = 0; k < 16 * 1024; ++k) t.data<std::int32_t>()[k] = static_cast<std::int32_t>(i);
      spin_us(make_us);
      return t;
    }, {.concurrency = producers});
    GpuStageOptions o;
    o.concurrency = 1;
    o.capacity = 8;
    o.ring_item_bytes = item_bytes;
    o.ring_bytes = ring_bytes;
    auto gpu = g.gpu_stage("model", [](DeviceTensor t, DeviceContext& ctx) {
      ops::busy_kernel(ctx, std::chrono::microseconds(50));
      return ctx.to_host(t);
    }, o);
    auto sink = g.sink("s", [this](HostTensor h) {
      for (int k = 0; k < 16 * 1024; ++k) bad += h.data<std::int32_t>()[k] != n;  // whole, in order
      ++n;
    });
    src >> make >> gpu >> sink;
  }

  Run run() {
    next = n = bad = 0;  // each run counts afresh
    auto r = g.run();
    EXPECT_EQ(r.wait(), RunStatus::succeeded);
    Run out{r.stats(), {}};
    EXPECT_EQ(n, items);
    EXPECT_EQ(bad, 0);
    for (const std::string& e : out.stats.autotune)
      if (e.find("ring_bytes") != std::string::npos) out.ring_events.push_back(e);
    return out;
  }
};

}  // namespace

// "automatic queue capacities, ring depth and items in flight": a ring whose producer is slow
// holds a few items at a time; the next run gets what this one needed (docs/autotune.md, "Ring
// depths"), and so does the next graph of that name. A ring's user-set size stays.
TEST(PinnedRing, AnAutomaticRingIsCutToWhatItsRunNeededAndTheNextRunStartsThere) {
  Runtime rt(host_device(2, 2));
  RingGraph rg(rt, "ring-auto", 300, 1, 100, kMiB);
  const RingGraph::Run first = rg.run();
  EXPECT_EQ(first.ring(), GpuStageOptions::kDefaultRingBytes) << "the first run's ring: 64 MiB";
  // One serial producer and a queue of 8: at most 8 + 2 budgets of 1 MiB committed at once.
  const std::regex said(R"(^model ring_bytes 64 MiB -> (\d+) MiB: the last run committed at most ([\d.]+) (MiB|KiB) of it \(items of up to 1 MiB\); no producer waited for room$)");
  ASSERT_EQ(first.ring_events.size(), 1u) << (first.stats.autotune.empty() ? "" : first.stats.autotune.back());
  std::smatch m;
  ASSERT_TRUE(std::regex_match(first.ring_events[0], m, said)) << first.ring_events[0];
  const std::size_t cut = std::stoul(m[1]) * kMiB;
  EXPECT_GE(cut, 2 * kMiB);
  EXPECT_LE(cut, 14 * kMiB) << first.ring_events[0];
  testing_helpers::expect_returned(rt, first.stats);
  // The next run allocates what the last one decided; its items come whole and in order.
  const RingGraph::Run second = rg.run();
  EXPECT_EQ(second.ring(), cut);
  EXPECT_EQ(second.stats.find("model")->ring_budgets, 0u);
  for (const std::string& e : second.ring_events) EXPECT_EQ(e.find("64 MiB"), std::string::npos) << e;
  testing_helpers::expect_returned(rt, second.stats);
  const std::size_t remembered = second.ring_events.empty() ? cut : std::stoul(
      std::regex_replace(second.ring_events[0], std::regex(R"(^model ring_bytes \d+ MiB -> (\d+) MiB.*$)"), "$1")) * kMiB;
  // A graph of that name built anew starts there; one of another name at 64 MiB.
  {
    RingGraph again(rt, "ring-auto", 50, 1, 100, kMiB);
    EXPECT_EQ(again.run().ring(), remembered);
  }
  {
    RingGraph other(rt, "ring-other", 50, 1, 100, kMiB);
    EXPECT_EQ(other.run().ring(), GpuStageOptions::kDefaultRingBytes);
  }
  // A number its user set is its size, run after run, with no decision about it.
  RingGraph fixed(rt, "ring-fixed", 300, 1, 100, kMiB, 64 * kMiB);
  for (int i = 0; i < 2; ++i) {
    const RingGraph::Run r = fixed.run();
    EXPECT_EQ(r.ring(), 64 * kMiB);
    EXPECT_TRUE(r.ring_events.empty()) << r.ring_events[0];
  }
}

// A ring of one budget (items of up to 32 MiB in 64 MiB) between two producers and the GPU
// stage: one producer waits for room while the GPU stage waits for input, so the next run's
// ring is twice as deep, and that one lets more items in at once. The producers take 4 ms an
// item: at 1 ms, on a machine loaded by other work (two CPU hogs on the 2 cores), the host
// backend's device thread took as long for each burst, the GPU stage was in flight 95% of the
// run and waited for input 3-5% (the rule's 5%: no decision, 6 runs in 12 failed); at 4 ms it
// waited 30-50% under the same load, 12 runs in 12 passed.
TEST(PinnedRing, AnAutomaticRingThatHeldTheGpuStageBackGrows) {
  Runtime rt(host_device(2, 2));
  RingGraph rg(rt, "ring-grow", 100, 2, 4000, 32 * kMiB);
  const RingGraph::Run first = rg.run();
  EXPECT_EQ(first.ring(), 64 * kMiB);
  EXPECT_GT(first.stats.find("model")->ring_refusals, 0u);
  ASSERT_EQ(first.ring_events.size(), 1u);
  const std::regex said(R"(^model ring_bytes 64 MiB -> 128 MiB: producers waited (\d+)% of the last run for room in it \((\d+) reservations refused, items of up to 32 MiB\) while 'model' waited (\d+)% of it for input$)");
  std::smatch m;
  ASSERT_TRUE(std::regex_match(first.ring_events[0], m, said)) << first.ring_events[0];
  EXPECT_EQ(std::stoul(m[2]), first.stats.find("model")->ring_refusals);
  testing_helpers::expect_returned(rt, first.stats);
  const RingGraph::Run second = rg.run();
  EXPECT_EQ(second.ring(), 128 * kMiB);
  testing_helpers::expect_returned(rt, second.stats);
}

// Under a memory budget the first ring is a quarter of it (at least two items), and no ring
// grows past half of it.
TEST(PinnedRing, AnAutomaticRingStaysWithinTheMemoryBudget) {
  RuntimeConfig c = host_device(2, 2);
  c.host_memory_budget = 96 * kMiB;
  Runtime rt(c);
  RingGraph small(rt, "ring-budget", 50, 1, 100, kMiB);
  EXPECT_EQ(small.run().ring(), 24 * kMiB);
  RingGraph wide(rt, "ring-budget-grow", 100, 2, 1000, 16 * kMiB);
  const RingGraph::Run first = wide.run();
  EXPECT_EQ(first.ring(), 32 * kMiB) << "a quarter is 24 MiB: two items of 16 MiB at the least";
  ASSERT_EQ(first.ring_events.size(), 1u);
  EXPECT_EQ(first.ring_events[0].rfind("model ring_bytes 32 MiB -> 48 MiB: producers waited", 0), 0u)
      << first.ring_events[0];
  EXPECT_NE(first.ring_events[0].find("; 48 MiB at most"), std::string::npos) << first.ring_events[0];
  EXPECT_EQ(wide.run().ring(), 48 * kMiB);
}

// A new C++ user's trial: the ring's errors gave sizes in MiB with one decimal, so an 8 KiB
// output against a 4 KiB item size read "its output (0.0 MiB of i32) exceeds the item size of
// the pinned ring into 'gs' (0.0 MiB)". Sizes under 1 MiB are in KiB or bytes now.
TEST(PinnedRing, ItsErrorsGiveSmallSizesInKiB) {
  Runtime rt(host_device(2, 2));
  {
    Graph g(rt, "ring");
    auto s = g.source("s", [i = 0]() mutable -> std::optional<int> {
      return i < 4 ? std::optional<int>(i++) : std::nullopt;
    });
    auto mk = g.stage("mk", [](int, HostAllocator& a) { return a.empty(DType::i32, {2048}); });
    GpuStageOptions o;
    o.ring_bytes = 1 << 20;
    o.ring_item_bytes = 4096;
    auto gs = g.gpu_stage("gs", [](DeviceTensor t, DeviceContext& ctx) { return ctx.to_host(t); }, o);
    auto k = g.sink("k", [](HostTensor) {});
    s >> mk >> gs >> k;
    try {
      g.run().wait();
      ADD_FAILURE() << "an 8 KiB item went into a ring of 4 KiB items";
    } catch (const StageError& e) {
      EXPECT_NE(std::string(e.what()).find("its output (8.0 KiB of i32) exceeds the item size of "
                                           "the pinned ring into 'gs' (4.0 KiB)"),
                std::string::npos) << e.what();
    }
  }
  Graph g(rt, "ring2");
  GpuStageOptions o;
  o.ring_bytes = 2048;
  o.ring_item_bytes = 4096;
  auto gs = g.gpu_stage("gs", [](DeviceTensor t, DeviceContext& ctx) { return ctx.to_host(t); }, o);
  auto s = g.source("s", [i = 0]() mutable -> std::optional<HostTensor> {
    return i++ < 1 ? std::optional<HostTensor>(HostTensor::empty(DType::u8, {16})) : std::nullopt;
  });
  auto k = g.sink("k", [](HostTensor) {});
  s >> gs >> k;
  try {
    g.run().wait();
    ADD_FAILURE() << "a 2 KiB ring took items of 4 KiB";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs at least twice its item size (2.0 KiB ring, 4.0 KiB per item)"),
              std::string::npos) << e.what();
  }
}

// A producer's heap HostTensor too large for the ring (it is copied there at delivery) is the
// producer's failing item, under the producer's OnError, and its error names the producer:
// skipped, the other items go through; under fail, the run's StageError names 'mk'. Before,
// the ring's push failed the run whatever the policies, naming the GPU stage as the stage whose
// output was too large (a new user's trial); a tensor allocated in the ring (a.empty) was
// already the producer's.
TEST(PinnedRing, AHeapTensorTooLargeForTheRingIsItsProducersItemUnderItsPolicy) {
  Runtime rt(host_device(2, 2));
  for (const OnError policy : {OnError::skip, OnError::fail}) {
    SCOPED_TRACE(policy == OnError::skip ? "skip" : "fail");
    Graph g(rt, "big");
    auto src = g.source("n", std::vector<long>{0, 1, 2, 3, 4, 5});
    auto mk = g.stage("mk", [](long i) {  // a heap tensor: copied into the ring at delivery
      return HostTensor::empty(DType::u8, {i == 2 ? 20000 : 1000 + i});
    }, {.on_error = policy});
    GpuStageOptions o;
    o.ring_bytes = 64 << 10;
    o.ring_item_bytes = 8 << 10;
    o.on_error = OnError::skip;
    auto gs = g.gpu_stage("gs", [](DeviceTensor t, DeviceContext&) { return static_cast<long>(t.nbytes()); }, o);
    std::vector<long> got;
    src >> mk >> gs >> g.sink("s", [&](long x) { got.push_back(x); });
    const std::string named =
        "stage 'mk' item 2: its output (19.5 KiB of u8) exceeds the item size of the pinned ring "
        "into 'gs' (8.0 KiB)";
    if (policy == OnError::skip) {
      auto run = g.run();
      ASSERT_EQ(run.wait(), RunStatus::succeeded);
      EXPECT_EQ(got, (std::vector<long>{1000, 1001, 1003, 1004, 1005}));
      const RunStats st = run.stats();
      EXPECT_EQ(st.find("mk")->items_skipped, 1u);
      ASSERT_EQ(st.find("mk")->errors.size(), 1u);
      EXPECT_EQ(st.find("mk")->errors[0].item, 2u);
      EXPECT_NE(st.find("mk")->errors[0].message.find(named), std::string::npos)
          << st.find("mk")->errors[0].message;
      EXPECT_EQ(st.find("gs")->items_skipped, 0u);
    } else {
      try {
        g.run().wait();
        ADD_FAILURE() << "a 19.5 KiB item went into a ring of 8 KiB items";
      } catch (const StageError& e) {
        EXPECT_NE(std::string(e.what()).find("stage 'mk' failed on item 2: " + std::string("splitflow: ") + named),
                  std::string::npos) << e.what();
      }
    }
  }
}

// The same from an async stage answering with a heap tensor: its answer too large for the
// ring is its failing item, skipped under its OnError (it failed the run at delivery).
TEST(PinnedRing, AnAsyncStagesAnswerTooLargeForTheRingIsSkippedUnderItsPolicy) {
  Runtime rt(host_device(2, 2));
  Graph g(rt, "big-async");
  auto src = g.source("n", std::vector<long>{0, 1, 2, 3});
  auto mk = g.async_stage<long, HostTensor>("mk", [](long i, Completion<HostTensor> c) {
    c.done(HostTensor::empty(DType::u8, {i == 1 ? 20000 : 1000 + i}));  // answered at once
  }, {.on_error = OnError::skip});
  GpuStageOptions o;
  o.ring_bytes = 64 << 10;
  o.ring_item_bytes = 8 << 10;
  auto gs = g.gpu_stage("gs", [](DeviceTensor t, DeviceContext&) { return static_cast<long>(t.nbytes()); }, o);
  std::vector<long> got;
  src >> mk >> gs >> g.sink("s", [&](long x) { got.push_back(x); });
  auto run = g.run();
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  EXPECT_EQ(got, (std::vector<long>{1000, 1002, 1003}));
  const RunStats st = run.stats();
  EXPECT_EQ(st.find("mk")->items_skipped, 1u);
  ASSERT_EQ(st.find("mk")->errors.size(), 1u);
  EXPECT_NE(st.find("mk")->errors[0].message.find("stage 'mk' item 1: its output (19.5 KiB of u8)"),
            std::string::npos)
      << st.find("mk")->errors[0].message;
}

// What the ring refuses at delivery from a producer without an OnError of its own (a source;
// a stage feeding the GPU stage and another consumer) fails the run naming that producer, not
// the GPU stage (it said "stage 'gs' failed on item 2: ... stage 'gs' item 2: its output").
TEST(PinnedRing, AnItemTooLargeForTheRingFromASourceFailsTheRunNamingTheSource) {
  Runtime rt(host_device(2, 2));
  Graph g(rt, "big");
  auto src = g.source("tensors", [i = 0]() mutable -> std::optional<HostTensor> {
    if (i == 4) return std::nullopt;
    return HostTensor::empty(DType::u8, {i++ == 2 ? 20000 : 1000});
  });
  GpuStageOptions o;
  o.ring_bytes = 64 << 10;
  o.ring_item_bytes = 8 << 10;
  o.on_error = OnError::skip;
  auto gs = g.gpu_stage("gs", [](DeviceTensor t, DeviceContext&) { return static_cast<long>(t.nbytes()); }, o);
  src >> gs >> g.sink("s", [](long) {});
  try {
    g.run().wait();
    ADD_FAILURE() << "a 19.5 KiB item went into a ring of 8 KiB items";
  } catch (const StageError& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "stage 'tensors' failed on item 2: splitflow: stage 'tensors' item 2: its output "
                  "(19.5 KiB of u8) exceeds the item size of the pinned ring into 'gs' (8.0 KiB)"),
              std::string::npos)
        << e.what();
  }
}

// A GPU stage's heap output too large for its output ring (copied there as it goes out) is
// the stage's failing item under its OnError, named as the output ring's: skipped, the other
// items go through; substituted, the substitute goes out as it is; under fail, the run's error
// names it. Every budget and byte comes back. Before, it failed the run whatever the policy,
// calling the output ring "the pinned ring into 'gs'" and saying to raise ring_item_bytes.
TEST(PinnedRing, AGpuStagesOutputTooLargeForItsOutputRingIsItsItemUnderItsPolicy) {
  Runtime rt(host_device(2, 2));
  const std::string named =
      "stage 'gs' item 2: its output (19.5 KiB of u8) exceeds the item size of the pinned output "
      "ring of 'gs' (8.0 KiB); raise GpuStageOptions::out_ring_item_bytes";
  for (const OnError policy : {OnError::skip, OnError::substitute, OnError::fail}) {
    SCOPED_TRACE(static_cast<int>(policy));
    Graph g(rt, "big-out");
    auto src = g.source("n", std::vector<long>{0, 1, 2, 3, 4, 5});
    GpuStageOptions o;
    o.out_ring_bytes = 64 << 10;
    o.out_ring_item_bytes = 8 << 10;
    o.on_error = policy;
    auto gs = g.gpu_stage("gs", [](long i, DeviceContext&) {  // a heap tensor: staged
      return HostTensor::empty(DType::u8, {i == 2 ? 20000 : 1000 + i});
    }, o);
    if (policy == OnError::substitute) gs.substitute_on_error(HostTensor::empty(DType::u8, {7}));
    std::vector<std::int64_t> got;
    std::vector<bool> pinned;
    src >> gs >> g.sink("s", [&](HostTensor t) {
      got.push_back(t.numel());
      pinned.push_back(t.memory() == Memory::pinned);
    });
    if (policy == OnError::fail) {
      try {
        g.run().wait();
        ADD_FAILURE() << "a 19.5 KiB output went into a ring of 8 KiB items";
      } catch (const StageError& e) {
        EXPECT_NE(std::string(e.what()).find("stage 'gs' failed on item 2: splitflow: " + named),
                  std::string::npos) << e.what();
      }
      continue;
    }
    auto run = g.run();
    ASSERT_EQ(run.wait(), RunStatus::succeeded);
    const RunStats st = run.stats();
    const StageStats& s = *st.find("gs");
    ASSERT_EQ(s.errors.size(), 1u);
    EXPECT_EQ(s.errors[0].item, 2u);
    EXPECT_NE(s.errors[0].message.find(named), std::string::npos) << s.errors[0].message;
    if (policy == OnError::skip) {
      EXPECT_EQ(got, (std::vector<std::int64_t>{1000, 1001, 1003, 1004, 1005}));
      EXPECT_EQ(pinned, std::vector<bool>(5, true));
      EXPECT_EQ(s.items_skipped, 1u);
    } else {
      EXPECT_EQ(got, (std::vector<std::int64_t>{1000, 1001, 7, 1003, 1004, 1005}));
      EXPECT_EQ(pinned, (std::vector<bool>{true, true, false, true, true, true}));
      EXPECT_EQ(s.items_substituted, 1u);
    }
    expect_returned(rt, st);
  }
}
