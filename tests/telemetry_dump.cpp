// Runs a traced CPU + GPU graph on the host backend and writes its telemetry outputs into the
// directory given: run.json, trace.json, metrics.prom, report.txt. tests/check_telemetry.py
// parses them and checks them against each other (ctest runs both).
#include <splitflow/ops/ops.hpp>
#include <splitflow/splitflow.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>

using namespace std::chrono_literals;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: telemetry_dump OUTPUT_DIR\n");
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  std::filesystem::create_directories(dir);
  splitflow::RuntimeConfig c{.threads = 2};
  c.device.backend = splitflow::BackendKind::host;
  splitflow::Runtime rt(c);
  splitflow::Graph g(rt, "dump", {.trace = true});
  auto src = g.source("items", [i = 0L]() mutable -> std::optional<long> {
    if (i == 40) return std::nullopt;
    return i++;
  });
  auto load = g.stage("load", [](long i, splitflow::HostAllocator& a) {
    splitflow::HostTensor t = a.empty(splitflow::DType::i64, {256});
    t.data<std::int64_t>()[0] = i;
    return t;
  }, {.concurrency = 2});
  splitflow::GpuStageOptions o;
  o.ring_bytes = 64 * 1024;
  o.ring_item_bytes = 4096;
  auto model = g.gpu_stage("model", [](splitflow::DeviceTensor t, splitflow::DeviceContext& ctx) {
    splitflow::ops::busy_kernel(ctx, 200us);
    return ctx.to_host(t);
  }, o);
  auto sink = g.sink("step", [](splitflow::HostTensor) {});
  src >> load >> model >> sink;
  auto run = g.run();
  run.wait();
  const auto stats = run.stats();
  const auto dev = rt.device_stats();
  std::ofstream(dir / "run.json") << splitflow::to_json(stats, dev);
  std::ofstream(dir / "trace.json") << run.trace_json();
  std::ofstream(dir / "metrics.prom") << splitflow::prometheus_text(stats, dev);
  std::ofstream(dir / "report.txt") << splitflow::report(stats, dev);
  std::printf("telemetry_dump: wrote %s\n", dir.c_str());
  return 0;
}
