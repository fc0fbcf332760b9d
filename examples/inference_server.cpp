// An in-process inference server: client threads send requests to two models that share one
// device. Each model is a graph with a service (a future per request), dynamic batching and a
// GPU stage whose kernel time grows with the batch (a + b * batch, busy_kernel). The "ranker"
// is latency-critical (priority 1, small batches, short max_delay); the "embedder" is a
// throughput job. Prints each model's throughput and p50 / p99 latency, the device's busy
// fraction and held/busy.
//
//     inference_server [SECONDS]
#include <splitflow/batching.hpp>
#include <splitflow/ops.hpp>
#include <splitflow/service.hpp>
#include <splitflow/splitflow.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>
#include <vector>

using namespace splitflow;
using namespace std::chrono_literals;

namespace {

struct Model {
  const char* name;
  int priority;
  std::size_t max_batch;
  std::chrono::microseconds max_delay;
  std::chrono::microseconds a, b;  // device time per batch: a + b * size
  int clients;                     // closed-loop client threads
};

// A request: some features; the reply: a score. The model step runs on the device.
struct Server {
  Graph graph;
  Service<std::vector<float>, float> svc;
  Run run;

  Server(Runtime& rt, const Model& m)
      : graph(rt, m.name, {.max_in_flight = 1024, .default_capacity = 256, .priority = m.priority}),
        svc(graph.service<std::vector<float>, float>("requests", {.max_pending = 512})) {
    auto gather = graph.dynamic_batch<std::vector<float>>("gather", {.max_batch = m.max_batch, .max_delay = m.max_delay});
    GpuStageOptions o;
    o.concurrency = 2;
    auto model = graph.gpu_stage("model", [m](Batch<std::vector<float>> batch, DeviceContext& ctx) {
      ops::busy_kernel(ctx, m.a + m.b * static_cast<long>(batch.size()));  // the forward pass
      std::vector<float> scores;
      for (const auto& x : batch.items) scores.push_back(x.empty() ? 0.f : x[0] * 0.5f);
      return std::move(batch).with(std::move(scores));
    }, o);
    auto split = graph.unbatch<float>("split", m.max_batch);
    svc.source() >> gather >> model >> split >> svc.sink();
    run = graph.run();
  }
};

}  // namespace

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? std::atof(argv[1]) : 3.0;
  const Model models[] = {
      {"ranker", 1, 8, 500us, 300us, 20us, 4},
      {"embedder", 0, 64, 5000us, 1000us, 30us, 8},
  };
  RuntimeConfig cfg{.threads = 2};
  cfg.device.streams = 4;
  Runtime rt(cfg);  // one device (CUDA when present, else the host backend), shared
  std::vector<std::unique_ptr<Server>> servers;
  for (const Model& m : models) servers.push_back(std::make_unique<Server>(rt, m));

  std::printf("inference server: 2 models on one device (%s), %.1f s of closed-loop clients\n",
              cuda_device_count() > 0 ? "CUDA" : "host backend", seconds);
  std::atomic<bool> stop{false};
  std::vector<std::thread> clients;
  std::atomic<long> errors{0};
  for (std::size_t k = 0; k < servers.size(); ++k)
    for (int c = 0; c < models[k].clients; ++c)
      clients.emplace_back([&, k, c] {
        std::mt19937 gen(static_cast<unsigned>(k * 100 + c));
        std::uniform_real_distribution<float> u(0.f, 1.f);
        while (!stop.load(std::memory_order_relaxed)) {
          std::vector<float> features(16);
          for (float& f : features) f = u(gen);
          try {
            const float want = features[0] * 0.5f;
            if (servers[k]->svc.submit(std::move(features)).get() != want) ++errors;
          } catch (const Error&) {
            ++errors;
          }
        }
      });
  const auto t0 = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));  // the demo's duration
  stop = true;
  for (auto& t : clients) t.join();
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  std::printf("\n%-9s %8s %12s %10s %10s %12s\n", "model", "priority", "requests/s", "p50 ms", "p99 ms",
              "mean batch");
  for (std::size_t k = 0; k < servers.size(); ++k) {
    servers[k]->svc.close();
    servers[k]->run.wait();
    const ServiceStats s = servers[k]->svc.stats();
    const RunStats st = servers[k]->run.stats();
    const StageStats* gather = st.find("gather");
    const double mean_batch = gather->items_out ? static_cast<double>(gather->items_in) / gather->items_out : 0;
    std::printf("%-9s %8d %12.0f %10.2f %10.2f %12.1f\n", models[k].name, models[k].priority,
                s.answered / wall, s.latency.percentile(50) / 1e6, s.latency.percentile(99) / 1e6, mean_batch);
  }
  const auto dev = rt.device_stats();
  std::printf("\ndevice: %s, busy %.0f%%, held/busy %.2f; %ld wrong or failed answers\n", dev->name.c_str(),
              100 * dev->busy_fraction(), dev->held_over_busy(), errors.load());
  return errors.load() == 0 ? 0 : 1;
}
