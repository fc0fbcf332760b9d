// The outputs whose names docs/ cites, from real runs on the host backend, for
// tests/check_docs.py names (ctest docs.names): writes into the directory given
//   run.json, trace.json, metrics.prom   a traced graph with every kind of figure: a tuned CPU
//                                        stage that skips items (skipped, errors, the tuner's
//                                        decisions), an async stage, a pinned ring into
//                                        a GPU stage (ring, copy H2D), to_host (copy D2H), a
//                                        kernel, a sink; the device's figures
//   service.json, service.prom           a service with a dynamic batch and a GPU stage
// Unlike telemetry_dump (telemetry.check's consistency checks) it aims at coverage: every key
// the docs document should appear at least once.
#include <splitflow/splitflow.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <vector>

using namespace std::chrono_literals;
namespace sf = splitflow;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: docs_dump OUTPUT_DIR\n");
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  std::filesystem::create_directories(dir);
  sf::RuntimeConfig c{.threads = 2};
  c.device.backend = sf::BackendKind::host;
  sf::Runtime rt(c);
  {
    // 'check' is tuned (Concurrency::automatic, a 5 ms window over a run of about 24 ms), so the
    // trace has the tuner's decisions too.
    sf::Graph g(rt, "docs", {.trace = true, .autotune_window = 5ms});
    auto src = g.source("items", [i = 0L]() mutable -> std::optional<long> {
      if (i == 24) return std::nullopt;
      return i++;
    });
    src.fed_by("a counter (Node::fed_by: the JSON's \"fed_by\")");
    auto check = g.stage("check", [](long i) {
      const auto until = std::chrono::steady_clock::now() + 1ms;  // work, for the tuner to see
      while (std::chrono::steady_clock::now() < until) {
      }
      if (i % 8 == 7) throw std::runtime_error("item " + std::to_string(i) + " is bad");
      return i;
    }, {.concurrency = sf::Concurrency::automatic, .on_error = sf::OnError::skip});
    // An async stage (its call_ns), answered at once.
    auto fetch = g.async_stage<long, long>("fetch", [](long i, sf::Completion<long> c) { c.done(i); },
                                           {.concurrency = 2});
    // A blocking stage (its call_ns and wait_ns): a short wait on the blocking threads.
    auto wait = g.stage("wait", [](long i) { std::this_thread::sleep_for(50us); return i; },
                        {.concurrency = 4, .blocking = true});
    auto load = g.stage("load", [](long i, sf::HostAllocator& a) {
      sf::HostTensor t = a.empty(sf::DType::i64, {256});
      t.data<std::int64_t>()[0] = i;
      return t;
    }, {.concurrency = 2});
    sf::GpuStageOptions o;
    o.ring_bytes = 64 * 1024;
    o.ring_item_bytes = 4096;
    auto model = g.gpu_stage("model", [](sf::DeviceTensor t, sf::DeviceContext& ctx) {
      sf::ops::busy_kernel(ctx, 100us);
      return ctx.to_host(t);
    }, o);
    auto sink = g.sink("step", [](sf::HostTensor) {});
    src >> check >> fetch >> wait >> load >> model >> sink;
    auto run = g.run();
    run.wait();
    const auto stats = run.stats();
    const auto dev = rt.device_stats();
    std::ofstream(dir / "run.json") << sf::to_json(stats, dev);
    std::ofstream(dir / "trace.json") << run.trace_json();
    std::ofstream(dir / "metrics.prom") << sf::prometheus_text(stats, dev);
  }
  {
    sf::Graph g(rt, "classifier", {.priority = 1});
    auto svc = g.service<float, float>("requests", {.max_pending = 64});
    auto gather = g.dynamic_batch<float>("gather", {.max_batch = 4, .max_delay = 1ms});
    auto model = g.gpu_stage("model", [](sf::Batch<float> b, sf::DeviceContext& ctx) {
      sf::ops::busy_kernel(ctx, 100us);
      std::vector<float> out(b.items.begin(), b.items.end());
      for (float& x : out) x *= 2;
      return std::move(b).with(std::move(out));
    });
    svc.source() >> gather >> model >> g.unbatch<float>("split", 4) >> svc.sink();
    auto run = g.run();
    std::vector<std::future<float>> answers;
    for (int i = 0; i < 16; ++i) answers.push_back(svc.submit(float(i)));
    for (int i = 0; i < 16; ++i)
      if (answers[i].get() != 2.0f * i) throw std::logic_error("docs_dump: a wrong answer");
    svc.close();
    run.wait();
    std::ofstream(dir / "service.json") << sf::to_json(svc.stats());
    std::ofstream(dir / "service.prom") << sf::prometheus_text(svc.stats());
  }
  std::printf("docs_dump: wrote %s\n", dir.c_str());
  return 0;
}
