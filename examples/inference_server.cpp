// An in-process inference server: client threads send requests to two models that share one
// device. Each model is a graph with a service (a future per request), dynamic batching and a
// GPU stage whose kernel time grows with the batch (a + b * batch, busy_kernel). The "ranker"
// is latency-critical (priority 1, small batches, short max_delay); the "embedder" is a
// throughput job. Prints each model's throughput, p50 / p99 latency and where it went (queueing,
// batching, GPU, other), the device's busy fraction and held/busy.
//
//     inference_server [SECONDS]
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "inference_workload.hpp"

using namespace splitflow;
using namespace std::chrono_literals;
using inference::Model;
using inference::Server;

int main(int argc, char** argv) {
  // [SECONDS] of closed-loop clients (default 3): a positive number, at most an hour.
  char* end = nullptr;
  const double seconds = argc > 1 ? std::strtod(argv[1], &end) : 3.0;
  if (argc > 2 || (argc > 1 && (end == argv[1] || *end != '\0' || !(seconds > 0 && seconds <= 3600)))) {
    const bool help = argc > 1 && (std::strcmp(argv[1], "-h") == 0 || std::strcmp(argv[1], "--help") == 0);
    std::fprintf(help ? stdout : stderr,
                 "usage: %s [SECONDS]   (of closed-loop clients, default 3; more than 0, at most 3600)\n",
                 argv[0]);
    return help ? 0 : 2;
  }
  const Model models[] = {
      {"ranker", 1, 8, 500us, 300us, 20us},
      {"embedder", 0, 64, 5000us, 1000us, 30us},
  };
  const int clients_of[] = {4, 8};  // closed-loop client threads per model
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
    for (int c = 0; c < clients_of[k]; ++c)
      clients.emplace_back([&, k, c] {
        std::mt19937 gen(static_cast<unsigned>(k * 100 + c));
        std::uniform_real_distribution<float> u(0.f, 1.f);
        while (!stop.load(std::memory_order_relaxed)) {
          inference::Request features(16);
          for (float& f : features) f = u(gen);
          try {
            const float want = inference::answer_of(features);
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

  std::printf("\n%-9s %8s %12s %10s %10s %12s\n", "model", "priority", "requests/s", "p50 ms",
              "p99 ms", "mean batch");
  for (std::size_t k = 0; k < servers.size(); ++k) {
    servers[k]->svc.close();
    servers[k]->run.wait();
    const ServiceStats s = servers[k]->svc.stats();
    const double mean_batch = servers[k]->mean_batch();
    std::printf("%-9s %8d %12.0f %10.2f %10.2f %12.1f\n", models[k].name, models[k].priority,
                s.answered / wall, s.latency.percentile(50) / 1e6, s.latency.percentile(99) / 1e6,
                mean_batch);
  }
  // Where a request's time went (ServiceStats: the parts add up to the total, request by request).
  std::printf("\n%-9s %-5s %10s %10s %10s %10s %10s\n", "model", "ms", "queueing", "batching",
              "gpu", "other", "total");
  for (std::size_t k = 0; k < servers.size(); ++k) {
    const ServiceStats s = servers[k]->svc.stats();
    const LatencyHistogram* parts[] = {&s.queueing, &s.batching, &s.gpu, &s.other, &s.latency};
    std::printf("%-9s %-5s", models[k].name, "mean");
    for (const auto* h : parts) std::printf(" %10.2f", h->mean() / 1e6);
    std::printf("\n%-9s %-5s", "", "p99");
    for (const auto* h : parts) std::printf(" %10.2f", h->percentile(99) / 1e6);
    std::printf("\n");
  }
  const auto dev = rt.device_stats();
  std::printf("\ndevice: %s, busy %.0f%%, held/busy %.2f; %ld wrong or failed answers\n",
              dev->name.c_str(), 100 * dev->busy_fraction(), dev->held_over_busy(), errors.load());
  return errors.load() == 0 ? 0 : 1;
}
