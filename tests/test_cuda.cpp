// GPU stages on the CUDA backend, on a real device. Every test skips with "no CUDA device" where
// there is none (or without a CUDA build); scripts/gpu-check.sh runs them on a GPU machine.
// Checks docs/architecture.md, "Backends" (CUDA) and "Accounting". The same node kind on the
// host backend: test_gpu_stage.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <splitflow/ops/ops.hpp>
#include <splitflow/splitflow.hpp>

#include "helpers.hpp"

#if SPLITFLOW_TEST_CUDART
#include <cuda_runtime.h>  // the native stream's priority
#endif

using namespace splitflow;
using namespace std::chrono_literals;
using testing_helpers::counter;

namespace {

RuntimeConfig cuda_config(std::size_t streams = 4) {
  RuntimeConfig c{.threads = 2};
  c.device.backend = BackendKind::cuda;
  c.device.streams = streams;
  return c;
}

#define SKIP_WITHOUT_CUDA()                                                    \
  do {                                                                         \
    if (!built_with_cuda()) GTEST_SKIP() << "no CUDA device (built without CUDA)"; \
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";            \
  } while (0)

}  // namespace

TEST(Cuda, RoundTripPreservesDataAndHeldCoversBusy) {
  SKIP_WITHOUT_CUDA();
  Runtime rt(cuda_config());
  Graph g(rt, "cuda-round-trip");
  auto src = g.source("n", counter(200));
  auto make = g.stage("make", [](long i, HostAllocator& a) {
    HostTensor t = a.empty(DType::i64, {1024});
    for (int k = 0; k < 1024; ++k) t.data<std::int64_t>()[k] = i * 1024 + k;
    return t;
  });
  auto gpu = g.gpu_stage("copy", [](DeviceTensor t, DeviceContext& ctx) {
    EXPECT_NE(ctx.native_stream(), nullptr);
    return ctx.to_host(t);
  });
  long bad = 0, n = 0;
  auto sink = g.sink("check", [&](HostTensor h) {
    for (int k = 0; k < 1024; ++k) bad += h.data<std::int64_t>()[k] != n * 1024 + k;
    ++n;
  });
  src >> make >> gpu >> sink;
  auto run = g.run();
  run.wait();
  const RunStats st = run.stats();
  EXPECT_EQ(n, 200);
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(st.gpu.staging_copies, 0u);
  EXPECT_GE(st.gpu.held_ns, st.gpu.busy_ns);
  EXPECT_EQ(rt.device_stats()->backend, BackendKind::cuda);
  EXPECT_EQ(rt.device_stats()->leases_in_use, 0u);
}

TEST(Cuda, NormalizeEqualsTheCpuReference) {
  SKIP_WITHOUT_CUDA();
  Runtime rt(cuda_config());
  Graph g(rt, "cuda-normalize");
  const std::vector<float> mean{0.485f, 0.456f, 0.406f}, stddev{0.229f, 0.224f, 0.225f};
  HostTensor in = HostTensor::empty(DType::u8, {8, 64, 48, 3});
  std::mt19937 rng(7);
  for (std::int64_t i = 0; i < in.numel(); ++i) in.data<std::uint8_t>()[i] = rng() & 0xff;
  auto src = g.source("batch", std::vector<HostTensor>{in});
  auto norm = g.gpu_stage("normalize", [&](DeviceTensor t, DeviceContext& ctx) {
    return ctx.to_host(ops::normalize(ctx, t, mean, stddev));
  });
  HostTensor out;
  auto sink = g.sink("keep", [&](HostTensor h) { out = h; });
  src >> norm >> sink;
  g.run().wait();
  HostTensor want = ops::normalize_reference(in, mean, stddev);
  double worst = 0;
  for (std::int64_t i = 0; i < want.numel(); ++i)
    worst = std::max(worst, std::abs(double(out.data<float>()[i]) - want.data<float>()[i]));
  EXPECT_LE(worst, 1e-6);
}

TEST(Cuda, BusyKernelOccupiesTheDeviceForItsDuration) {
  SKIP_WITHOUT_CUDA();
  Runtime rt(cuda_config(2));
  Graph g(rt, "cuda-busy");
  auto src = g.source("n", counter(20));
  auto make = g.stage("make", [](long) { return HostTensor::empty(DType::u8, {16}); });
  GpuStageOptions o;
  o.concurrency = 1;
  auto gpu = g.gpu_stage("spin", [](DeviceTensor t, DeviceContext& ctx) {
    ops::busy_kernel(ctx, 5ms);
    return t;
  }, o);
  auto sink = g.sink("s", [](DeviceTensor) {});
  src >> make >> gpu >> sink;
  auto run = g.run();
  run.wait();
  const GpuStats s = run.stats().gpu;
  EXPECT_GE(s.busy_ns, 20 * 5'000'000);
  EXPECT_LE(s.held_over_busy(), 1.3);
}

TEST(Cuda, ErrorsNameTheCallTheStageAndTheDevice) {
  SKIP_WITHOUT_CUDA();
  RuntimeConfig c = cuda_config();
  c.device.device_pool_bytes = std::size_t{1} << 62;  // let the allocation reach the driver
  Runtime rt(c);
  Graph g(rt, "cuda-error");
  auto src = g.source("n", counter(1));
  auto make = g.stage("make", [](long) { return HostTensor::empty(DType::u8, {16}); });
  auto gpu = g.gpu_stage("huge", [](DeviceTensor, DeviceContext& ctx) {
    return ctx.alloc(DType::u8, {std::int64_t{1} << 50});  // 1 PiB
  });
  auto sink = g.sink("s", [](DeviceTensor) {});
  src >> make >> gpu >> sink;
  try {
    g.run().wait();
    FAIL();
  } catch (const StageError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("cudaMallocFromPoolAsync"), std::string::npos) << what;
    EXPECT_NE(what.find("stage 'huge'"), std::string::npos) << what;
    EXPECT_NE(what.find("on device 0"), std::string::npos) << what;
  }
  EXPECT_EQ(rt.device_stats()->leases_in_use, 0u);
}

#if SPLITFLOW_TEST_CUDART
// docs/sharing.md, "Kernel priorities": a graph's priority reaches the stream its bursts enqueue
// on (the device's least priority for 0, one level higher per step, up to the device's
// greatest); one pooled stream leased in turn by graphs of two priorities moves between them,
// and the work of each burst still runs in order (the round trip's bytes).
TEST(Cuda, APriorityGraphsBurstsRunOnAStreamOfItsPriority) {
  SKIP_WITHOUT_CUDA();
  int least = 0, greatest = 0;
  ASSERT_EQ(cudaDeviceGetStreamPriorityRange(&least, &greatest), cudaSuccess);
  Runtime rt(cuda_config(/*streams=*/1));
  const auto run_graph = [&](const char* name, int priority, std::vector<int>& seen) {
    Graph g(rt, name, {.priority = priority});
    auto src = g.source("n", counter(20));
    auto make = g.stage("make", [](long i, HostAllocator& a) {
      HostTensor t = a.empty(DType::i64, {256});
      for (int k = 0; k < 256; ++k) t.data<std::int64_t>()[k] = i * 256 + k;
      return t;
    });
    auto gpu = g.gpu_stage("copy", [&seen](DeviceTensor t, DeviceContext& ctx) {
      int p = 1;
      EXPECT_EQ(cudaStreamGetPriority(static_cast<cudaStream_t>(ctx.native_stream()), &p), cudaSuccess);
      seen.push_back(p);  // (concurrency 1: one body at a time)
      return ctx.to_host(t);
    }, {.concurrency = 1});
    long bad = 0, n = 0;
    auto sink = g.sink("check", [&](HostTensor h) {
      for (int k = 0; k < 256; ++k) bad += h.data<std::int64_t>()[k] != n * 256 + k;
      ++n;
    });
    src >> make >> gpu >> sink;
    g.run().wait();
    EXPECT_EQ(n, 20);
    EXPECT_EQ(bad, 0) << name;
  };
  std::vector<int> urgent, batch, urgent_again;
  run_graph("urgent", 3, urgent);
  run_graph("batch", 0, batch);
  run_graph("urgent-again", 3, urgent_again);
  const int want_urgent = std::max(least - 3, greatest);
  EXPECT_EQ(urgent, std::vector<int>(20, want_urgent));
  EXPECT_EQ(batch, std::vector<int>(20, least));
  EXPECT_EQ(urgent_again, std::vector<int>(20, want_urgent));
  EXPECT_EQ(rt.device_stats()->leases_in_use, 0u);
}
#endif
