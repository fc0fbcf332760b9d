// Hand-off bandwidth from a CPU stage to a GPU stage through the pinned ring, against a plain
// memcpy of the same bytes, in one run:
//   BM_RingHandoff/splitflow/<bytes>  items written in ring space by a CPU stage, copied H2D on
//                                     the GPU stage's leased stream, ring space returned when
//                                     the copy ran (the whole splitflow path per item)
//   BM_RingHandoff/splitflow_deep/<bytes>  the same with 16 bursts in flight and 4 arena threads
//   BM_RingHandoff/memcpy/<bytes>     memcpy of the same bytes with the same access pattern,
//                                     one thread: sources rotate through a buffer of the ring's
//                                     size, destinations through 4 item buffers (the device pool
//                                     recycles about as many)
// bytes_per_second is the figure; the goal is splitflow >= 0.8x memcpy at 1 MiB. The host
// backend's copies are memcpys by an engine thread, so this measures the ring's overhead.
//   BM_RingDepth                      an automatic ring (GpuStageOptions::ring_bytes) against a
//                                     64 MiB one, runs interleaved: the rate at its depth (below)
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <splitflow/ops/ops.hpp>
#include <splitflow/splitflow.hpp>
#include <vector>

namespace {

constexpr std::size_t kRingBytes = std::size_t{64} << 20;

long items_for(std::size_t bytes) {
  return static_cast<long>(std::max<std::size_t>(64, (std::size_t{256} << 20) / bytes));
}

// `in_flight`: the GPU stage's concurrency (bursts in flight); `threads`: arena threads.
void ring_handoff(benchmark::State& state, int in_flight, int threads) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  const long items = items_for(bytes);
  splitflow::RuntimeConfig c;
  c.threads = threads;
  c.device.streams = std::max<std::size_t>(c.device.streams, static_cast<std::size_t>(in_flight));
  // SPLITFLOW_BENCH_BACKEND=cuda (scripts/gpu-check.sh) measures real H2D copies.
  const char* want = std::getenv("SPLITFLOW_BENCH_BACKEND");
  c.device.backend = want && std::string(want) == "cuda" ? splitflow::BackendKind::cuda
                                                         : splitflow::BackendKind::host;
  splitflow::Runtime rt(c);
  splitflow::Graph g(rt, "ring");
  auto src = g.source("n", [i = 0L, items]() mutable -> std::optional<long> {
    if (i == items) return std::nullopt;
    return i++;
  });
  // The producer owns its bytes in ring space; writing them is the producer's work, not the
  // hand-off's, so it touches one byte.
  auto make = g.stage("produce", [bytes](long i, splitflow::HostAllocator& a) {
    splitflow::HostTensor t = a.empty(splitflow::DType::u8, {static_cast<std::int64_t>(bytes)});
    t.data<std::uint8_t>()[0] = static_cast<std::uint8_t>(i);
    return t;
  });
  splitflow::GpuStageOptions o;
  o.concurrency = in_flight;
  o.ring_bytes = kRingBytes;
  o.ring_item_bytes = bytes;
  auto gpu = g.gpu_stage("h2d", [](splitflow::DeviceTensor t, splitflow::DeviceContext&) {
    return t;  // the H2D copy is the stage's work
  }, o);
  std::uint64_t seen = 0;
  auto sink = g.sink("done", [&](splitflow::DeviceTensor) { ++seen; });
  src >> make >> gpu >> sink;
  g.run().wait();  // warm: ring allocated, device pool filled
  const auto busy0 = rt.device_stats()->busy_ns;
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) g.run().wait();
  const double wall = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  // The copy engine's busy fraction: near 1 means the ring keeps it fed.
  state.counters["engine_busy"] = (rt.device_stats()->busy_ns - busy0) / wall;
  if (seen != static_cast<std::uint64_t>(items) * (state.iterations() + 1))
    state.SkipWithError("items were lost");
  state.SetBytesProcessed(state.iterations() * items * static_cast<std::int64_t>(bytes));
}

// One arena thread: on the host backend the copy engine is a host thread doing the memcpy,
// and on 2 cores it needs the other core (a GPU's copy engine takes no host core).
void BM_splitflow(benchmark::State& state) { ring_handoff(state, 4, 1); }
// Deeper: 16 bursts in flight, 4 arena threads. On a GPU, whether small items are bound by a
// burst's round trip (this goes faster) or by per-item work (it does not).
void BM_splitflow_deep(benchmark::State& state) { ring_handoff(state, 16, 4); }

void BM_memcpy(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  const long items = items_for(bytes);
  std::vector<unsigned char> src(kRingBytes, 1), dst(4 * bytes, 0);
  for (auto _ : state) {
    std::size_t at = 0;
    for (long i = 0; i < items; ++i) {
      if (at + bytes > kRingBytes) at = 0;
      std::memcpy(dst.data() + (i % 4) * bytes, src.data() + at, bytes);
      at += (bytes + 255) / 256 * 256;
    }
    benchmark::DoNotOptimize(dst.data());
  }
  state.SetBytesProcessed(state.iterations() * items * static_cast<std::int64_t>(bytes));
}

// ---- BM_RingDepth: an automatic ring against the 64 MiB one a user would set -----------------
// A decode-like producer (150 us of work, 256 KiB written into ring space) feeding a GPU stage
// (two bursts of 100 us kernels), items of up to 1 MiB (ring_item_bytes), 2 arena threads: the
// same graph with ring_bytes = 64 MiB (the old default) and ring_bytes = automatic, on one
// runtime, their runs interleaved (fixed, automatic, automatic, fixed, ...), each graph run once before
// (the automatic ring's first run decides its depth). Counters: rate_ratio (the automatic
// ring's items/s over the fixed one's), ring_bytes_ratio (its bytes over 64 MiB), and each
// ring's bytes and the most it held.
struct DepthGraph {
  splitflow::Graph g;
  long items, next = 0;
  std::uint64_t seen = 0;
  DepthGraph(splitflow::Runtime& rt, const std::string& name, std::size_t ring_bytes, long n)
      : g(rt, name), items(n) {
    auto src = g.source("n", [this]() -> std::optional<long> {
      if (next == items) return std::nullopt;
      return next++;
    });
    auto make = g.stage("decode", [](long i, splitflow::HostAllocator& a) {
      splitflow::HostTensor t = a.empty(splitflow::DType::u8, {256 << 10});
      std::memset(t.raw(), static_cast<int>(i & 0xff), t.nbytes());
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(150);
      while (std::chrono::steady_clock::now() < until) {
      }
      return t;
    });
    splitflow::GpuStageOptions o;
    o.concurrency = 2;
    o.ring_bytes = ring_bytes;
    o.ring_item_bytes = 1 << 20;
    auto gpu = g.gpu_stage("model", [](splitflow::DeviceTensor t, splitflow::DeviceContext& ctx) {
      splitflow::ops::busy_kernel(ctx, std::chrono::microseconds(100));
      return t;
    }, o);
    auto sink = g.sink("s", [this](splitflow::DeviceTensor) { ++seen; });
    src >> make >> gpu >> sink;
  }
  // One run; its seconds.
  double run(splitflow::StageStats* model) {
    next = 0;
    const auto t0 = std::chrono::steady_clock::now();
    auto r = g.run();
    r.wait();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (model) *model = *r.stats().find("model");
    return s;
  }
};

void BM_RingDepth(benchmark::State& state) {
  constexpr long kItems = 2000;
  splitflow::Runtime rt(splitflow::RuntimeConfig{.threads = 2, .device = {.backend = splitflow::BackendKind::host}});
  DepthGraph fixed(rt, "fixed", kRingBytes, kItems), automatic(rt, "automatic", splitflow::GpuStageOptions::automatic, kItems);
  fixed.run(nullptr);
  automatic.run(nullptr);  // its first run: 64 MiB, and the depth it decides for the next
  double t_fixed = 0, t_auto = 0;
  splitflow::StageStats f{}, a{};
  long runs = 0;
  for (auto _ : state) {  // which goes first alternates
    if (runs % 2 == 0) {
      t_fixed += fixed.run(&f);
      t_auto += automatic.run(&a);
    } else {
      t_auto += automatic.run(&a);
      t_fixed += fixed.run(&f);
    }
    ++runs;
  }
  if (fixed.seen != static_cast<std::uint64_t>(kItems) * (runs + 1) || automatic.seen != fixed.seen)
    state.SkipWithError("items were lost");
  state.counters["rate_ratio"] = t_auto > 0 ? t_fixed / t_auto : 0;
  state.counters["fixed_items_per_s"] = static_cast<double>(kItems * runs) / t_fixed;
  state.counters["auto_items_per_s"] = static_cast<double>(kItems * runs) / t_auto;
  state.counters["auto_ring_MiB"] = static_cast<double>(a.ring_capacity) / (1 << 20);
  state.counters["fixed_ring_MiB"] = static_cast<double>(f.ring_capacity) / (1 << 20);
  state.counters["ring_bytes_ratio"] = static_cast<double>(a.ring_capacity) / static_cast<double>(f.ring_capacity);
  state.counters["auto_ring_max_in_use_MiB"] = static_cast<double>(a.ring_max_in_use) / (1 << 20);
  state.counters["fixed_ring_max_in_use_MiB"] = static_cast<double>(f.ring_max_in_use) / (1 << 20);
  // The last runs' refusals (a producer found no room) and the share of the run producers
  // waited for room.
  state.counters["auto_ring_refusals"] = static_cast<double>(a.ring_refusals);
  state.counters["fixed_ring_refusals"] = static_cast<double>(f.ring_refusals);
  state.counters["auto_ring_wait"] = static_cast<double>(a.ring_wait_ns) * 1e-9 * runs / t_auto;
}

}  // namespace

BENCHMARK(BM_RingDepth)->Iterations(12)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_splitflow)->Name("BM_RingHandoff/splitflow")->RangeMultiplier(4)->Range(64 << 10, 4 << 20)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_splitflow_deep)->Name("BM_RingHandoff/splitflow_deep")->RangeMultiplier(4)->Range(64 << 10, 1 << 20)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_memcpy)->Name("BM_RingHandoff/memcpy")->RangeMultiplier(4)->Range(64 << 10, 4 << 20)->UseRealTime()->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
