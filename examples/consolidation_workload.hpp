// The job the consolidation demo (examples/consolidation.cpp) and BM_Consolidation
// (benchmarks/bench_consolidation.cpp) both run: a training-style graph
//     items -> load (real CPU work, output written in pinned ring space)
//           -> model (busy_kernel on the device) -> step
#pragma once

#include <splitflow/ops/ops.hpp>
#include <splitflow/splitflow.hpp>

#include <chrono>
#include <optional>

namespace consolidation {

struct Job {
  long items;
  std::chrono::microseconds load;   // CPU work per item (decode, augment)
  std::chrono::microseconds model;  // device time per item (the model step)
  std::int64_t item_bytes = 224 * 224 * 3;
};

/// Real CPU work for `d` (not a sleep: the CPU is what the job competes for).
inline void cpu_work(std::chrono::microseconds d) {
  const auto end = std::chrono::steady_clock::now() + d;
  volatile unsigned x = 1;
  while (std::chrono::steady_clock::now() < end) x = x * 1664525u + 1013904223u;
}

/// `sequential`: load then compute, one item at a time, GPU stage concurrency 1 (a training
/// loop without a separate loader; give the graph max_in_flight 1 too).
inline void build(splitflow::Graph& g, const Job& job, bool sequential) {
  auto src = g.source("items", [i = 0L, n = job.items]() mutable -> std::optional<long> {
    if (i == n) return std::nullopt;
    return i++;
  });
  auto load = g.stage("load", [job](long, splitflow::HostAllocator& a) {
    cpu_work(job.load);
    return a.empty(splitflow::DType::u8, {job.item_bytes});
  }, {.capacity = 4});
  splitflow::GpuStageOptions o;
  o.concurrency = sequential ? 1 : 2;
  o.ring_bytes = 16 * static_cast<std::size_t>(job.item_bytes);
  o.ring_item_bytes = static_cast<std::size_t>(job.item_bytes);
  auto model = g.gpu_stage("model", [job](splitflow::DeviceTensor t, splitflow::DeviceContext& ctx) {
    splitflow::ops::busy_kernel(ctx, job.model);
    return t;
  }, o);
  auto step = g.sink("step", [](splitflow::DeviceTensor) {});
  src >> load >> model >> step;
}

/// CUDA when a device is present, else the host backend.
inline splitflow::RuntimeConfig config(int threads) {
  splitflow::RuntimeConfig c{.threads = threads};
  c.device.backend = splitflow::BackendKind::automatic;
  return c;
}

}  // namespace consolidation
