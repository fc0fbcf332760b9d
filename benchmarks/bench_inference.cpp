// Inference under open-loop load: client threads send requests at Poisson arrival times (they
// do not wait for answers, as real users do not), to a model whose device time per kernel is
// a + b * batch (examples/inference_workload.hpp). A request's latency is from its submit() to
// its answer (ServiceStats::latency).
//
//   BM_InferenceAtTarget/unbatched  one kernel per request
//   BM_InferenceAtTarget/dynamic    dynamic batching (max_batch 32, max_delay 2 ms)
//     Each finds the highest arrival rate whose p99 latency stays within kTarget (doubling,
//     then bisecting; a trial fails on a p99 over the target, a rejected request or a wrong
//     answer). Counters: rate_at_target (requests/s), p99_ms there, mean_batch, trials.
//   BM_TwoModels/dedicated  a latency-critical ranker and a batch embedder, each on its own
//                           device, at their production loads
//   BM_TwoModels/shared     both on one device (the ranker with priority)
//     Counters: throughput (both models' answered requests/s), per-model p99_ms and whether it
//     met its target, the ranker's mean latency split, devices_used, device_busy.
// summary.py compares dynamic with unbatched and shared with dedicated, from the same run.
// Host backend here (kernels hold one compute slot on a timer); CUDA where a device exists.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "inference_workload.hpp"

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using inference::Model;
using inference::Server;

constexpr auto kTarget = 50ms;  // p99 target of the single-model searches
constexpr double kTrialSeconds = 1.0;
constexpr int kClientsPerModel = 2;

// The model of the searches: 2 ms of fixed cost per kernel (launch, weights) + 0.1 ms per request.
const Model kUnbatched{"model", 0, 0, 0us, 2000us, 100us};
const Model kDynamic{"model", 0, 32, 2000us, 2000us, 100us};

// Two models and their loads (requests/s) for the sharing benchmark. Alone, each keeps its
// device about half busy: the waste that sharing one device removes.
const Model kRanker{"ranker", 1, 16, 1000us, 1000us, 50us};
const Model kEmbedder{"embedder", 0, 64, 5000us, 3000us, 40us};
constexpr double kRankerLoad = 500, kEmbedderLoad = 1200;
constexpr auto kRankerTarget = 20ms, kEmbedderTarget = 50ms;

splitflow::RuntimeConfig device_config() {
  splitflow::RuntimeConfig c{.threads = 2};
  c.device.streams = 4;
  return c;
}

struct Load {
  Server* server;
  double rate;  // requests/s
};

struct Outcome {
  splitflow::ServiceStats stats;
  double seconds = 0;     // of arrivals
  long wrong = 0;         // wrong answers or errors
  double mean_batch = 0;  // requests per kernel
  double throughput() const { return stats.answered / seconds; }
  double p99_ms() const { return stats.latency.percentile(99) / 1e6; }
};

// Sends Poisson arrivals at each load's rate for `seconds` (kClientsPerModel threads per model,
// each at rate / kClientsPerModel), then closes the services and waits for every answer.
std::vector<Outcome> drive(const std::vector<Load>& loads, double seconds) {
  std::vector<std::vector<std::future<float>>> futures(loads.size() * kClientsPerModel);
  std::vector<std::vector<float>> wants(futures.size());
  std::vector<std::thread> clients;
  const auto start = Clock::now() + 5ms;
  const auto end =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  for (std::size_t k = 0; k < loads.size(); ++k)
    for (int c = 0; c < kClientsPerModel; ++c)
      clients.emplace_back([&, k, c] {
        const std::size_t slot = k * kClientsPerModel + c;
        std::mt19937_64 gen(1234 + slot);
        std::exponential_distribution<double> gap(loads[k].rate / kClientsPerModel);
        std::uniform_real_distribution<float> u(0.f, 1.f);
        auto next = start;
        while (true) {
          next +=
              std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap(gen)));
          if (next >= end) break;
          std::this_thread::sleep_until(next);
          inference::Request r(16);
          for (float& f : r) f = u(gen);
          wants[slot].push_back(inference::answer_of(r));
          try {
            futures[slot].push_back(loads[k].server->svc.submit(std::move(r)));
          } catch (const splitflow::OverloadedError&) {
            wants[slot].pop_back();  // counted as rejected by the service
          }
        }
      });
  for (auto& t : clients) t.join();
  std::vector<Outcome> out(loads.size());
  for (std::size_t k = 0; k < loads.size(); ++k) {
    Server& s = *loads[k].server;
    s.svc.close();
    s.run.wait();
    out[k].stats = s.svc.stats();
    out[k].seconds = seconds;
    out[k].mean_batch = s.mean_batch();
    for (int c = 0; c < kClientsPerModel; ++c) {
      const std::size_t slot = k * kClientsPerModel + c;
      for (std::size_t i = 0; i < futures[slot].size(); ++i) {
        try {
          if (futures[slot][i].get() != wants[slot][i]) ++out[k].wrong;
        } catch (const splitflow::Error&) {
          ++out[k].wrong;
        }
      }
    }
  }
  return out;
}

bool met(const Outcome& o, std::chrono::nanoseconds target) {
  return o.wrong == 0 && o.stats.rejected == 0 && o.stats.answered > 0 &&
         o.stats.latency.percentile(99) <= static_cast<std::uint64_t>(target.count());
}

Outcome trial(const Model& m, double rate) {
  splitflow::Runtime rt(device_config());
  Server server(rt, m, 1 << 14);
  return drive({{&server, rate}}, kTrialSeconds)[0];
}

// The highest rate (within 1/16) whose p99 stays within the target.
void search(benchmark::State& state, const Model& m, double start_rate) {
  Outcome best;
  double best_rate = 0;
  int trials = 0;
  for (auto _ : state) {
    double lo = 0, hi = 0, rate = start_rate;
    while (hi == 0 && rate < 1e6) {  // double until a rate misses the target
      const Outcome o = trial(m, rate);
      ++trials;
      if (met(o, kTarget)) {
        lo = rate, best = o, best_rate = rate;
        rate *= 2;
      } else {
        hi = rate;
      }
    }
    for (int i = 0; i < 4 && lo > 0 && hi > 0; ++i) {
      const double mid = (lo + hi) / 2;
      const Outcome o = trial(m, mid);
      ++trials;
      if (met(o, kTarget)) {
        lo = mid, best = o, best_rate = mid;
      } else {
        hi = mid;
      }
    }
  }
  state.counters["rate_at_target"] = best_rate;
  state.counters["throughput"] = best_rate > 0 ? best.throughput() : 0;
  state.counters["p99_ms"] = best.p99_ms();
  state.counters["target_ms"] = std::chrono::duration<double, std::milli>(kTarget).count();
  state.counters["mean_batch"] = best.mean_batch;
  state.counters["trials"] = trials;
}

void BM_unbatched(benchmark::State& state) {
  search(state, kUnbatched, 100);
}
void BM_dynamic(benchmark::State& state) {
  search(state, kDynamic, 100);
}

void report_two(benchmark::State& state, const std::vector<Outcome>& o, int devices, double busy) {
  state.counters["throughput"] = o[0].throughput() + o[1].throughput();
  state.counters["ranker_p99_ms"] = o[0].p99_ms();
  state.counters["embedder_p99_ms"] = o[1].p99_ms();
  state.counters["targets_met"] = met(o[0], kRankerTarget) && met(o[1], kEmbedderTarget);
  // Where the ranker's time went (means: they add up to its mean latency).
  state.counters["ranker_mean_ms"] = o[0].stats.latency.mean() / 1e6;
  state.counters["ranker_gpu_ms"] = o[0].stats.gpu.mean() / 1e6;
  state.counters["ranker_queueing_ms"] = o[0].stats.queueing.mean() / 1e6;
  state.counters["ranker_batching_ms"] = o[0].stats.batching.mean() / 1e6;
  state.counters["ranker_batch"] = o[0].mean_batch;
  state.counters["embedder_batch"] = o[1].mean_batch;
  state.counters["devices_used"] = devices;
  state.counters["device_busy"] = busy;  // mean over the devices used
}

void BM_dedicated(benchmark::State& state) {
  std::vector<Outcome> o;
  double busy = 0;
  for (auto _ : state) {
    splitflow::Runtime rt_a(device_config()), rt_b(device_config());  // a device each
    Server ranker(rt_a, kRanker, 1 << 14), embedder(rt_b, kEmbedder, 1 << 14);
    o = drive({{&ranker, kRankerLoad}, {&embedder, kEmbedderLoad}}, 2 * kTrialSeconds);
    busy = (rt_a.device_stats()->busy_fraction() + rt_b.device_stats()->busy_fraction()) / 2;
  }
  report_two(state, o, 2, busy);
}

void BM_shared(benchmark::State& state) {
  std::vector<Outcome> o;
  double busy = 0;
  for (auto _ : state) {
    splitflow::Runtime rt(device_config());  // one device, one stream pool
    Server ranker(rt, kRanker, 1 << 14), embedder(rt, kEmbedder, 1 << 14);
    o = drive({{&ranker, kRankerLoad}, {&embedder, kEmbedderLoad}}, 2 * kTrialSeconds);
    busy = rt.device_stats()->busy_fraction();
  }
  report_two(state, o, 1, busy);
}

}  // namespace

BENCHMARK(BM_unbatched)
    ->Name("BM_InferenceAtTarget/unbatched")
    ->Iterations(1)
    ->UseRealTime()
    ->Unit(benchmark::kSecond);
BENCHMARK(BM_dynamic)
    ->Name("BM_InferenceAtTarget/dynamic")
    ->Iterations(1)
    ->UseRealTime()
    ->Unit(benchmark::kSecond);
BENCHMARK(BM_dedicated)
    ->Name("BM_TwoModels/dedicated")
    ->Iterations(1)
    ->UseRealTime()
    ->Unit(benchmark::kSecond);
BENCHMARK(BM_shared)
    ->Name("BM_TwoModels/shared")
    ->Iterations(1)
    ->UseRealTime()
    ->Unit(benchmark::kSecond);

BENCHMARK_MAIN();
