// Jobs as separate processes sharing one device through the cross-process arbiter
// (DeviceConfig::arbiter; docs/sharing.md; issue 19), on the host backend:
//
// SPLITFLOW_BENCH_BACKEND=cuda runs the jobs on the GPU (scripts/gpu-check.sh, with and without
// MPS); the default is the host backend.
//
//   BM_SharedDevice/processes/N   N training-style job processes (load on the CPU, then a kernel),
//                                 each first alone on its own device (dedicated, measured in the
//                                 same benchmark), then all N in one arbiter (4 bursts leased at
//                                 once, one compute slot: one kernel at a time on the modelled
//                                 device, across the processes). Counters: busy_vs_demand (the
//                                 device's busy fraction over the jobs' summed dedicated duty),
//                                 min_throughput_ratio (slowest job's items/s over its dedicated
//                                 items/s), held_over_busy (device held / busy, both from the
//                                 segment: time with a lease out / time with a kernel running).
//                                 Each job's load waits (reading) then spins (decoding): in all,
//                                 about 0.7 of a core, so that the jobs' CPU work fits this
//                                 2-core machine and the device is what they share.
//   BM_Priority/without, /with    a latency-critical inference process beside a greedy batch
//                                 process on one modelled device, against each alone: the
//                                 inference p99 over its dedicated p99 (p99_ratio) and the batch
//                                 throughput over its dedicated (batch_throughput_ratio), without
//                                 and with priority 10 for the inference graph.
//   BM_LeaseCost                  one process, a GPU stage with an empty burst: time per item
//                                 with the in-process pool and through an arbiter, interleaved;
//                                 the median difference is the arbitration cost per lease
//                                 (arbiter_cost_ns; one lease per item).
//
// The job processes are this binary run as `bench_shared_device --job ...`.
#include <benchmark/benchmark.h>

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <splitflow/device/arbiter.hpp>
#include <splitflow/ops/ops.hpp>
#include <splitflow/splitflow.hpp>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// ---- the job process --------------------------------------------------------------------------

struct JobResult {
  double rate = 0;
  std::int64_t start_ns = 0, end_ns = 0, busy_ns = 0, held_ns = 0;
  long items = 0;
  double p99_us = 0;  // per-item latency from its arrival (scheduled time) to the sink
  bool ok = false;
};

// --job ITEMS WAIT_US SPIN_US MODEL_US ARBITER(- for none) CAPACITY [PRIORITY INTERVAL_US SECONDS]
//   INTERVAL_US > 0: items arrive open-loop, one every INTERVAL_US (else as fast as taken);
//   SECONDS > 0: the source stops after that long (else after ITEMS items).
int job_main(int argc, char** argv) {
  if (argc < 8) return 2;
  const long items = std::atol(argv[2]);
  const auto wait = std::chrono::microseconds(std::atol(argv[3]));
  const auto spin = std::chrono::microseconds(std::atol(argv[4]));
  const auto model = std::chrono::microseconds(std::atol(argv[5]));
  const std::string arbiter = argv[6];
  const int priority = argc > 8 ? std::atoi(argv[8]) : 0;
  const auto interval = std::chrono::microseconds(argc > 9 ? std::atol(argv[9]) : 0);
  const double seconds = argc > 10 ? std::atof(argv[10]) : 0;
  splitflow::RuntimeConfig rc;
  rc.threads = 2;
  // SPLITFLOW_BENCH_BACKEND=cuda (scripts/gpu-check.sh): the jobs on the GPU.
  const char* backend = std::getenv("SPLITFLOW_BENCH_BACKEND");
  rc.device.backend = backend && std::string(backend) == "cuda" ? splitflow::BackendKind::cuda
                                                                : splitflow::BackendKind::host;
  rc.device.streams = 2;
  rc.device.host_compute_slots = 1;
  if (arbiter != "-") {
    rc.device.arbiter.name = arbiter;
    rc.device.arbiter.capacity = std::strtoul(argv[7], nullptr, 10);
    rc.device.arbiter.label = "job";
  }
  splitflow::Runtime rt(rc);
  splitflow::GraphOptions go;
  go.priority = priority;
  splitflow::Graph g(rt, "job", go);
  std::vector<std::int64_t> arrived(static_cast<std::size_t>(items), 0);
  std::vector<std::int64_t> latency;
  latency.reserve(static_cast<std::size_t>(items));
  const std::int64_t t0 = now_ns();
  auto src = g.source("items", [&, i = 0L]() mutable -> std::optional<long> {
    if (i >= items) return std::nullopt;
    if (seconds > 0 && static_cast<double>(now_ns() - t0) * 1e-9 >= seconds) return std::nullopt;
    if (interval.count() > 0) {
      const auto due = Clock::time_point(std::chrono::nanoseconds(t0)) + interval * i;
      std::this_thread::sleep_until(due);
      arrived[static_cast<std::size_t>(i)] = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                 due.time_since_epoch()).count();
    } else {
      arrived[static_cast<std::size_t>(i)] = now_ns();
    }
    return i++;
  });
  auto ld = g.stage("load", [wait, spin](long i) {
    if (wait.count() > 0) std::this_thread::sleep_for(wait);  // reading (I/O)
    const auto end = Clock::now() + spin;  // decoding (CPU)
    volatile unsigned x = 1;
    while (Clock::now() < end) x = x * 1664525u + 1013904223u;
    splitflow::HostTensor t = splitflow::HostTensor::empty(splitflow::DType::i64, {1});
    *t.data<std::int64_t>() = i;
    return t;
  }, {.capacity = 4});
  splitflow::GpuStageOptions o;
  o.concurrency = 2;
  auto mdl = g.gpu_stage("model", [model](splitflow::DeviceTensor t, splitflow::DeviceContext& ctx) {
    splitflow::ops::busy_kernel(ctx, model);
    return ctx.to_host(t);
  }, o);
  long done = 0;
  auto step = g.sink("step", [&](splitflow::HostTensor h) {
    latency.push_back(now_ns() - arrived[static_cast<std::size_t>(*h.data<std::int64_t>())]);
    ++done;
  });
  src >> ld >> mdl >> step;
  auto run = g.run();
  const bool ok = run.wait() == splitflow::RunStatus::succeeded;
  const std::int64_t t1 = now_ns();
  const auto d = *rt.device_stats();
  std::sort(latency.begin(), latency.end());
  const double p99 = latency.empty() ? 0.0
                                     : static_cast<double>(latency[latency.size() * 99 / 100]) * 1e-3;
  std::printf("%d %ld %lld %lld %lld %lld %.1f\n", ok ? 1 : 0, done, static_cast<long long>(t0),
              static_cast<long long>(t1), static_cast<long long>(d.busy_ns),
              static_cast<long long>(d.held_ns), p99);
  std::fflush(stdout);
  return ok ? 0 : 1;
}

// ---- the parent: spawning jobs ------------------------------------------------------------------

struct Child {
  pid_t pid = -1;
  int out = -1;
};

Child spawn_job(const std::vector<std::string>& args) {
  int p[2];
  if (::pipe(p) != 0) std::abort();
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, p[1], 1);
  posix_spawn_file_actions_addclose(&fa, p[0]);
  std::vector<std::string> all = {"/proc/self/exe", "--job"};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  Child c;
  if (posix_spawn(&c.pid, "/proc/self/exe", &fa, nullptr, argv.data(), environ) != 0) std::abort();
  posix_spawn_file_actions_destroy(&fa);
  ::close(p[1]);
  c.out = p[0];
  return c;
}

JobResult finish(Child c) {
  std::string s;
  char b[512];
  for (ssize_t n; (n = ::read(c.out, b, sizeof b)) > 0;) s.append(b, static_cast<std::size_t>(n));
  ::close(c.out);
  int st = 0;
  ::waitpid(c.pid, &st, 0);
  JobResult r;
  int ok = 0;
  long long t0 = 0, t1 = 0, busy = 0, held = 0;
  if (std::sscanf(s.c_str(), "%d %ld %lld %lld %lld %lld %lf", &ok, &r.items, &t0, &t1, &busy,
                  &held, &r.p99_us) == 7) {
    r.ok = ok == 1 && WIFEXITED(st) && WEXITSTATUS(st) == 0;
    r.start_ns = t0;
    r.end_ns = t1;
    r.busy_ns = busy;
    r.held_ns = held;
    r.rate = static_cast<double>(r.items) / (static_cast<double>(t1 - t0) * 1e-9);
  }
  return r;
}

struct Workload {
  long items;
  long wait_us, spin_us;  // the load: I/O wait, then CPU work
  long model_us;
};

std::vector<std::string> job_args(const Workload& w, const std::string& arbiter, int capacity) {
  return {std::to_string(w.items), std::to_string(w.wait_us), std::to_string(w.spin_us),
          std::to_string(w.model_us), arbiter, std::to_string(capacity)};
}

void BM_SharedDevice(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  // Each job's dedicated duty is about model / load; N of them fit one device (about 0.8), and
  // their CPU work fits this 2-core machine (about 0.7 of a core in all).
  const Workload w = n == 2 ? Workload{300, 1300, 700, 800} : Workload{300, 3650, 350, 800};
  double min_ratio = 1e9, busy_vs_demand = 0, held = 0, busy = 0;
  bool ok = true;
  const std::string name = "bench-" + std::to_string(::getpid());
  for (auto _ : state) {
    // Dedicated: each job alone on its own device (no arbiter), one after another.
    std::vector<JobResult> alone;
    for (int k = 0; k < n; ++k) alone.push_back(finish(spawn_job(job_args(w, "-", 1))));
    double demand = 0;
    for (const auto& a : alone) {
      ok &= a.ok;
      demand += static_cast<double>(a.busy_ns) / static_cast<double>(a.end_ns - a.start_ns);
    }
    // Shared: all N at once in one arbiter: 4 bursts leased at once, one compute slot (the one
    // modelled device: one kernel at a time across the processes).
    splitflow::remove_arbiter(name);
    std::vector<Child> kids;
    for (int k = 0; k < n; ++k) kids.push_back(spawn_job(job_args(w, name, 4)));
    std::vector<JobResult> shared;
    for (auto& c : kids) shared.push_back(finish(c));
    const splitflow::ArbiterView v = splitflow::read_arbiter(name);
    splitflow::remove_arbiter(name);
    std::int64_t t0 = shared[0].start_ns, t1 = shared[0].end_ns;
    for (int k = 0; k < n; ++k) {
      ok &= shared[k].ok;
      t0 = std::min(t0, shared[k].start_ns);
      t1 = std::max(t1, shared[k].end_ns);
      min_ratio = std::min(min_ratio, shared[k].rate / alone[k].rate);
    }
    // Host backend: the segment's own busy time; CUDA: what the processes published (summed).
    const double dev_busy = v.device_busy_ns > 0 ? static_cast<double>(v.device_busy_ns)
                                                 : static_cast<double>(v.busy_ns());
    const double fraction = dev_busy / static_cast<double>(t1 - t0);
    busy_vs_demand += fraction / demand;
    held += static_cast<double>(v.held_ns);
    busy += dev_busy;
    if (v.max_compute_in_use > 1) ok = false;  // one compute slot: one kernel at a time
  }
  if (!ok) state.SkipWithError("a job failed, or the arbiter let two kernels run at once");
  state.counters["devices_used"] = 1;
  state.counters["processes"] = n;
  state.counters["busy_vs_demand"] = busy_vs_demand / static_cast<double>(state.iterations());
  state.counters["min_throughput_ratio"] = min_ratio;
  state.counters["held_over_busy"] = held / busy;
}

// ---- a latency-critical process beside a greedy one ---------------------------------------------

// An inference process (500 open-loop requests, one every 4 ms, a 400 us kernel each) and a batch
// process (back-to-back 300 us kernels, two bursts in flight) on one modelled device (one compute
// slot shared through the arbiter), against each alone on its own device. Arg 1: the inference
// graph has priority 10 (its leases and its kernels go first); Arg 0: both priority 0.
void BM_Priority(benchmark::State& state) {
  const bool prioritised = state.range(0) != 0;
  const std::string name = "bench-prio-" + std::to_string(::getpid());
  auto inference = [&](const std::string& arb) {
    return std::vector<std::string>{"500", "0", "0", "400", arb, "4", prioritised ? "10" : "0",
                                    "4000", "0"};
  };
  auto batch = [](const std::string& arb) {
    return std::vector<std::string>{"1000000", "0", "0", "300", arb, "4", "0", "0", "2.4"};
  };
  double p99_ratio = 0, batch_ratio = 0, p99_alone = 0, p99_shared = 0;
  bool ok = true;
  for (auto _ : state) {
    const JobResult inf_alone = finish(spawn_job(inference("-")));
    const JobResult batch_alone = finish(spawn_job(batch("-")));
    splitflow::remove_arbiter(name);
    Child b = spawn_job(batch(name));
    Child i = spawn_job(inference(name));
    const JobResult inf_shared = finish(i);
    const JobResult batch_shared = finish(b);
    splitflow::remove_arbiter(name);
    ok &= inf_alone.ok && batch_alone.ok && inf_shared.ok && batch_shared.ok;
    p99_alone += inf_alone.p99_us;
    p99_shared += inf_shared.p99_us;
    p99_ratio += inf_shared.p99_us / inf_alone.p99_us;
    batch_ratio += batch_shared.rate / batch_alone.rate;
  }
  if (!ok) state.SkipWithError("a job failed");
  const double n = static_cast<double>(state.iterations());
  state.counters["inference_p99_alone_us"] = p99_alone / n;
  state.counters["inference_p99_shared_us"] = p99_shared / n;
  state.counters["p99_ratio"] = p99_ratio / n;
  state.counters["batch_throughput_ratio"] = batch_ratio / n;
}

// ---- the cost of a lease through the arbiter ---------------------------------------------------

/// ns per item of a graph whose GPU stage's bursts are empty, with or without an arbiter.
double lease_run(bool arbitrated, const std::string& name) {
  constexpr long kItems = 4000;
  splitflow::RuntimeConfig rc;
  rc.threads = 2;
  rc.device.backend = splitflow::BackendKind::host;
  rc.device.streams = 2;
  if (arbitrated) {
    splitflow::remove_arbiter(name);
    rc.device.arbiter.name = name;
    rc.device.arbiter.capacity = 2;
  }
  double ns = 0;
  {
    splitflow::Runtime rt(rc);
    splitflow::Graph g(rt, "cost");
    auto src = g.source("items", [i = 0L]() mutable -> std::optional<long> {
      return i < kItems ? std::optional<long>(i++) : std::nullopt;
    });
    auto mk = g.stage("make", [](long) { return splitflow::HostTensor::empty(splitflow::DType::u8, {8}); });
    auto gpu = g.gpu_stage("empty", [](splitflow::DeviceTensor t, splitflow::DeviceContext&) { return t; });
    auto sink = g.sink("sink", [](splitflow::DeviceTensor) {});
    src >> mk >> gpu >> sink;
    const auto t0 = Clock::now();
    g.run().wait();
    ns = std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / kItems;
  }
  if (arbitrated) splitflow::remove_arbiter(name);
  return ns;
}

// Each iteration runs both, in alternating order (interleaved in one run): the counters are the
// medians of the per-item times and of their per-iteration differences.
void BM_LeaseCost(benchmark::State& state) {
  const std::string name = "bench-cost-" + std::to_string(::getpid());
  std::vector<double> pool, arb, diff;
  bool arbiter_first = false;
  for (auto _ : state) {
    double p, a;
    if (arbiter_first) {
      a = lease_run(true, name);
      p = lease_run(false, name);
    } else {
      p = lease_run(false, name);
      a = lease_run(true, name);
    }
    arbiter_first = !arbiter_first;
    pool.push_back(p);
    arb.push_back(a);
    diff.push_back(a - p);
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };
  state.counters["pool_ns_per_item"] = median(pool);
  state.counters["arbiter_ns_per_item"] = median(arb);
  state.counters["arbiter_cost_ns"] = median(diff);
}

}  // namespace

BENCHMARK(BM_SharedDevice)->Name("BM_SharedDevice/processes")->Arg(2)->Arg(4)->Iterations(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Priority)->Name("BM_Priority/without")->Arg(0)->Iterations(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Priority)->Name("BM_Priority/with")->Arg(1)->Iterations(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LeaseCost)->Name("BM_LeaseCost")->Iterations(12)->UseRealTime()->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--job") return job_main(argc, argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
