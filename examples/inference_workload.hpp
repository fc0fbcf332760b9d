// The model server of examples/inference_server.cpp and benchmarks/bench_inference.cpp: a graph
// with a service (a future per request), optionally a dynamic batch, and a GPU stage whose
// device time grows with the batch, a + b * size (busy_kernel: a timer on a host compute slot,
// a clock spin on CUDA).
#pragma once

#include <splitflow/serving/batching.hpp>
#include <splitflow/ops/ops.hpp>
#include <splitflow/serving/service.hpp>
#include <splitflow/splitflow.hpp>

#include <chrono>
#include <cstddef>
#include <utility>
#include <vector>

namespace inference {

struct Model {
  const char* name;
  int priority = 0;           ///< GraphOptions::priority (stream leases)
  std::size_t max_batch = 0;  ///< 0: no batching, one kernel per request
  std::chrono::microseconds max_delay{0};
  std::chrono::microseconds a{0}, b{0};  ///< device time per kernel: a + b * requests in it
};

/// A request: some features; the reply: a score.
using Request = std::vector<float>;
inline float answer_of(const Request& r) {
  return r.empty() ? 0.f : r[0] * 0.5f;
}

struct Server {
  splitflow::Graph graph;
  splitflow::Service<Request, float> svc;
  splitflow::Run run;

  Server(splitflow::Runtime& rt, const Model& m, std::size_t max_pending = 512)
      : graph(rt, m.name, {.max_in_flight = 4096, .default_capacity = 256, .priority = m.priority}),
        svc(graph.service<Request, float>(
            "requests",
            {.max_pending = max_pending, .admission = splitflow::Admission::fail_fast})) {
    // The model's input queue holds one batch beside the one running: while the device is busy,
    // requests keep gathering in the batcher, so batches grow with the load (as a serving system
    // forms a batch when a model instance frees up) instead of queueing small ones.
    splitflow::GpuStageOptions o;
    o.concurrency = 2;
    o.capacity = 1;
    if (m.max_batch == 0) {
      auto model = graph.gpu_stage(
          "model",
          [m](Request r, splitflow::DeviceContext& ctx) {
            splitflow::ops::busy_kernel(ctx, m.a + m.b);  // the forward pass
            return answer_of(r);
          },
          o);
      svc.source() >> model >> svc.sink();
    } else {
      auto gather = graph.dynamic_batch<Request>(
          "gather", {.max_batch = m.max_batch, .max_delay = m.max_delay});
      auto model = graph.gpu_stage(
          "model",
          [m](splitflow::Batch<Request> batch, splitflow::DeviceContext& ctx) {
            splitflow::ops::busy_kernel(ctx, m.a + m.b * static_cast<long>(batch.size()));
            std::vector<float> scores;
            scores.reserve(batch.size());
            for (const Request& r : batch.items) scores.push_back(answer_of(r));
            return std::move(batch).with(std::move(scores));
          },
          o);
      auto split = graph.unbatch<float>("split", m.max_batch);
      svc.source() >> gather >> model >> split >> svc.sink();
    }
    run = graph.run();
  }

  /// Requests per kernel so far (1 without batching).
  double mean_batch() const {
    const splitflow::RunStats st = run.stats();
    const splitflow::StageStats* gather = st.find("gather");
    if (!gather) return 1.0;
    return gather->items_out ? static_cast<double>(gather->items_in) / gather->items_out : 0.0;
  }
};

}  // namespace inference
