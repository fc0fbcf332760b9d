// The consolidation demonstration on real image pipelines: several training jobs, each
//     files -> read -> decode + random-resized-crop + flip (CPU) -> batch -> collate (into the
//     model's pinned ring) -> model step: normalize + a busy_kernel "forward/backward" (GPU)
//     -> step
// run twice:
//   bundled  each job owns a device for its whole run (its own runtime, one CPU thread, one
//            stream), the way a training process holds its GPU;
//   split    all jobs share one runtime and one device; each GPU stage leases a stream per
//            kernel burst;
//   processes  each job a process of its own (this program run as `consolidation --job ...`),
//            the processes sharing one device through an arbiter (DeviceConfig::arbiter,
//            docs/sharing.md), as separate training jobs of different teams would.
// It prints devices used, device busy, GPU held / busy and each job's images/s, the arbiter's
// view of the processes (what splitflow-top shows), then the report of one split job, with its
// diagnosis. Given an output directory, it also writes each split
// job's JSON summary and Chrome trace there (scripts/plot_run.py plots them).
//
//     consolidation DATA_DIR [OUTPUT_DIR]      DATA_DIR: JPEGs (make demo makes them)
#include <splitflow/ops/image.hpp>
#include <splitflow/ops/ops.hpp>
#include <splitflow/splitflow.hpp>

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

extern char** environ;

namespace {

using namespace std::chrono_literals;

constexpr int kJobs = 2;

struct ImageJob {
  long images = 960;       // per job (each job its own seed: its own order and crops)
  int batch = 16;
  int size = 224;
  // Device time of a model step, per batch. With the normalize, a job's device demand is about
  // a third of its time, so two jobs fit one device (and a job alone leaves it mostly idle).
  std::chrono::microseconds model = 3000us;
};
const ImageJob kJob;
splitflow::image::FileList g_files;

// The images a job's run trained on: those decoded (a file that fails to decode is skipped).
double images_of(const splitflow::RunStats& st) {
  return static_cast<double>(st.find("decode+augment")->items_out);
}

// Ctrl-C during the processes mode: the job processes (same process group) stop, and this one
// removes the arbiter segment before it exits.
std::atomic<bool> g_interrupted{false};
extern "C" void on_interrupt(int) { g_interrupted.store(true); }

// One training job. `bundled`: one batch in flight and one stream, as a process owning its GPU.
void build(splitflow::Graph& g, int seed, bool bundled) {
  using namespace splitflow;
  image::FileList files = g_files;
  std::vector<std::uint64_t> order;
  for (std::uint64_t e = 0; order.size() < static_cast<std::size_t>(kJob.images); ++e) {
    auto more = files.epoch({.seed = static_cast<std::uint64_t>(seed), .epoch = e});
    order.insert(order.end(), more.begin(), more.end());
  }
  order.resize(static_cast<std::size_t>(kJob.images));
  auto src = g.source("files", files.refs(order));
  auto read = g.stage("read", image::read_file);
  auto decode = g.stage("decode+augment",
                        image::DecodeRandomResizedCrop({.size = kJob.size, .seed = static_cast<std::uint64_t>(seed)}),
                        {.concurrency = Concurrency::automatic, .on_error = OnError::skip});
  auto batch = g.batch<image::Image>("batch", static_cast<std::size_t>(kJob.batch));
  auto collate = g.stage("collate", [](std::vector<image::Image> b, HostAllocator& ring) {
    return image::collate(b, &ring);  // written straight into the GPU stage's pinned ring
  });
  const std::size_t batch_bytes = static_cast<std::size_t>(kJob.batch) * kJob.size * kJob.size * 3;
  GpuStageOptions o;
  o.concurrency = bundled ? 1 : 2;
  o.ring_bytes = 4 * batch_bytes;
  o.ring_item_bytes = batch_bytes;
  auto model = g.gpu_stage("model", [](DeviceTensor images, DeviceContext& ctx) {
    DeviceTensor x = ops::normalize(ctx, images, {0.485f, 0.456f, 0.406f}, {0.229f, 0.224f, 0.225f});
    ops::busy_kernel(ctx, kJob.model);  // the forward and backward pass
    return x;
  }, o);
  auto step = g.sink("step", [](DeviceTensor) {});
  src >> read >> decode >> batch >> collate >> model >> step;
}

splitflow::RuntimeConfig config(int threads) {
  splitflow::RuntimeConfig c{.threads = threads};
  c.device.backend = splitflow::BackendKind::automatic;
  return c;
}

struct Row {
  int devices = 0;
  double device_busy = 0;  // busy fraction of each device used
  double held = 0, busy = 0;  // the devices': time reserved vs time working
  double job_held = 0, job_busy = 0;
  std::vector<double> throughput;
  std::vector<splitflow::RunStats> stats;
  std::vector<std::string> traces;
  std::optional<splitflow::DeviceStats> device;
};

// Waits for the runs, updating one progress line.
void wait_all(std::vector<splitflow::Run>& runs, const char* what) {
  for (;;) {
    std::uint64_t decoded = 0, trained = 0;
    splitflow::Run* pending = nullptr;
    for (auto& r : runs) {
      const auto st = r.stats();
      decoded += st.find("decode+augment")->items_out;
      trained += st.find("step")->items_out * static_cast<std::uint64_t>(kJob.batch);
      if (st.status == splitflow::RunStatus::running) pending = &r;
    }
    const long total = kJob.images * static_cast<long>(runs.size());
    std::printf("\r  %-8s decoded %5llu / %ld images, trained on %5llu", what,
                static_cast<unsigned long long>(decoded), total,
                static_cast<unsigned long long>(std::min<std::uint64_t>(trained, total)));
    std::fflush(stdout);
    if (!pending) break;
    pending->wait_for(100ms);
  }
  for (auto& r : runs) r.wait();
  std::printf("\n");
}

Row bundled() {
  Row row;
  std::vector<std::unique_ptr<splitflow::Runtime>> devices;
  std::vector<std::unique_ptr<splitflow::Graph>> jobs;
  std::vector<splitflow::Run> runs;
  for (int k = 0; k < kJobs; ++k) {
    auto cfg = config(1);
    cfg.device.streams = 1;
    devices.push_back(std::make_unique<splitflow::Runtime>(cfg));
    jobs.push_back(std::make_unique<splitflow::Graph>(
        *devices.back(), "job" + std::to_string(k),
        splitflow::GraphOptions{.max_in_flight = static_cast<std::size_t>(kJob.batch)}));
    build(*jobs.back(), k, true);
  }
  for (auto& j : jobs) runs.push_back(j->run());
  wait_all(runs, "bundled");
  for (auto& r : runs) {
    const auto st = r.stats();
    row.held += st.wall_ns;  // the job owns its device for its whole run
    row.busy += st.gpu.busy_ns;
    row.device_busy += static_cast<double>(st.gpu.busy_ns) / st.wall_ns / kJobs;
    row.throughput.push_back(images_of(st) / (st.wall_ns / 1e9));
  }
  row.devices = kJobs;
  return row;
}

Row split(std::string& backend) {
  Row row;
  splitflow::Runtime rt(config(kJobs));
  std::vector<std::unique_ptr<splitflow::Graph>> jobs;
  std::vector<splitflow::Run> runs;
  for (int k = 0; k < kJobs; ++k) {
    jobs.push_back(std::make_unique<splitflow::Graph>(rt, std::string("job").append(std::to_string(k)),
                                                      splitflow::GraphOptions{.trace = true}));
    build(*jobs.back(), k, false);
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (auto& j : jobs) runs.push_back(j->run());
  wait_all(runs, "split");
  const double wall = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  for (auto& r : runs) {
    const auto st = r.stats();
    row.job_held += st.gpu.held_ns;
    row.job_busy += st.gpu.busy_ns;
    row.throughput.push_back(images_of(st) / (st.wall_ns / 1e9));
    row.stats.push_back(st);
    row.traces.push_back(r.trace_json());
  }
  const auto dev = rt.device_stats();
  row.device_busy = dev->busy_ns / wall;
  row.held = dev->held_ns;  // time some job had a stream leased
  row.busy = dev->busy_ns;
  row.devices = 1;
  row.device = dev;
  backend = dev->name;
  return row;
}

// One job in a process of its own, in arbiter `arbiter`: prints "IMAGES_PER_S".
int job_process(int k, const std::string& arbiter) {
  auto cfg = config(1);
  cfg.device.arbiter.name = arbiter;
  cfg.device.arbiter.label = "job" + std::to_string(k);
  splitflow::Runtime rt(cfg);
  splitflow::Graph g(rt, "job" + std::to_string(k));
  build(g, k, false);
  auto run = g.run();
  if (run.wait() != splitflow::RunStatus::succeeded) return 1;
  const auto st = run.stats();
  std::printf("%.3f\n", images_of(st) / (st.wall_ns / 1e9));
  return 0;
}

Row processes(const char* data_dir, splitflow::ArbiterView& view) {
  Row row;
  const std::string name = "demo-" + std::to_string(::getpid());
  splitflow::remove_arbiter(name, /*force=*/true);
  // However this ends (a job failing, Ctrl-C), the segment goes with it.
  struct RemoveSegment {
    std::string name;
    ~RemoveSegment() {
      try {
        splitflow::remove_arbiter(name, /*force=*/true);
      } catch (...) {
      }
    }
  } remove_segment{name};
  // Ctrl-C reaches the jobs too (one process group); SIGTERM to this process is passed on.
  // The previous handlers come back when this returns.
  struct Handlers {
    struct sigaction old_int {}, old_term {};
    Handlers() {
      struct sigaction sa {};
      sa.sa_handler = on_interrupt;
      ::sigaction(SIGINT, &sa, &old_int);
      ::sigaction(SIGTERM, &sa, &old_term);
    }
    ~Handlers() {
      ::sigaction(SIGINT, &old_int, nullptr);
      ::sigaction(SIGTERM, &old_term, nullptr);
    }
  } handlers;
  struct Child {
    pid_t pid;
    int out;
  };
  std::vector<Child> kids;
  // Jobs started before a later start failed are stopped and reaped before the segment goes
  // (destroyed last: declared after remove_segment).
  struct Reap {
    std::vector<Child>* kids;
    bool armed = true;
    ~Reap() {
      if (!armed) return;
      for (const Child& c : *kids) {
        ::kill(c.pid, SIGTERM);
        ::close(c.out);
        while (::waitpid(c.pid, nullptr, 0) < 0 && errno == EINTR) {
        }
      }
    }
  } reap{&kids};
  const auto t0 = std::chrono::steady_clock::now();
  for (int k = 0; k < kJobs; ++k) {
    int p[2];
    if (::pipe(p) != 0) throw std::runtime_error("pipe");
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, p[1], 1);
    posix_spawn_file_actions_addclose(&fa, p[0]);
    std::vector<std::string> args = {"/proc/self/exe", "--job", std::to_string(k), data_dir, name};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid;
    if (posix_spawn(&pid, "/proc/self/exe", &fa, nullptr, argv.data(), environ) != 0)
      throw std::runtime_error("cannot start a job process");
    posix_spawn_file_actions_destroy(&fa);
    ::close(p[1]);
    kids.push_back({pid, p[0]});
  }
  reap.armed = false;  // every job started: the loop below waits for each
  std::printf("  processes: %d job processes started, sharing arbiter '%s'\n", kJobs, name.c_str());
  int failed = 0;
  for (auto& c : kids) {  // every job to its end (a failed one does not orphan the others)
    if (g_interrupted.load()) ::kill(c.pid, SIGTERM);  // (a SIGTERM sent to this process only)
    std::string out;
    char b[256];
    for (;;) {
      const ssize_t n = ::read(c.out, b, sizeof b);
      if (n > 0) {
        out.append(b, static_cast<std::size_t>(n));
      } else if (n < 0 && errno == EINTR) {
        if (g_interrupted.load()) ::kill(c.pid, SIGTERM);
      } else {
        break;
      }
    }
    ::close(c.out);
    int st = 0;
    while (::waitpid(c.pid, &st, 0) < 0 && errno == EINTR) {
    }
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) ++failed;
    row.throughput.push_back(std::atof(out.c_str()));
  }
  if (g_interrupted.load()) throw std::runtime_error("interrupted");
  if (failed) throw std::runtime_error(std::to_string(failed) + " of the job processes failed");
  const double wall = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  view = splitflow::read_arbiter(name);
  // The host backend's device is measured in the segment; on CUDA each process publishes its own.
  const double busy = view.device_busy_ns > 0 ? static_cast<double>(view.device_busy_ns)
                                              : static_cast<double>(view.busy_ns());
  row.devices = 1;
  row.device_busy = busy / wall;
  row.held = static_cast<double>(view.held_ns);
  row.busy = busy;
  return row;
}

void print(const char* mode, const Row& r, const Row& base) {
  std::string tput, ratio;
  for (std::size_t k = 0; k < r.throughput.size(); ++k) {
    const double t = r.throughput[k];
    const double dedicated = base.throughput[k];
    tput += (tput.empty() ? "" : ", ") + std::to_string(static_cast<int>(t));
    char buf[16];
    std::snprintf(buf, sizeof buf, dedicated > 0 ? "%.2fx" : "-", t / dedicated);
    ratio += (ratio.empty() ? "" : ", ") + std::string(buf);
  }
  char held_busy[32] = "-";  // (no device work: nothing was trained)
  if (r.busy > 0) std::snprintf(held_busy, sizeof held_busy, "%.2f", r.held / r.busy);
  std::printf("%-9s %7d %12.0f%% %10s   %-20s %s\n", mode, r.devices, 100 * r.device_busy,
              held_busy, tput.c_str(), ratio.c_str());
}

}  // namespace

int demo(int argc, char** argv) {
  if (argc == 5 && std::string(argv[1]) == "--job") {  // one job process of the processes mode
    g_files = splitflow::image::FileList::directory(argv[3]);
    return job_process(std::atoi(argv[2]), argv[4]);
  }
  const bool help = argc > 1 && (std::strcmp(argv[1], "-h") == 0 || std::strcmp(argv[1], "--help") == 0);
  if (argc < 2 || argc > 3 || help || argv[1][0] == '-') {
    std::fprintf(help ? stdout : stderr, "usage: %s DATA_DIR [OUTPUT_DIR]   (DATA_DIR: JPEG files)\n", argv[0]);
    return help ? 0 : 2;
  }
  g_files = splitflow::image::FileList::directory(argv[1]);
  if (g_files.size() == 0) {
    std::fprintf(stderr, "no JPEG files under %s\n", argv[1]);
    return 1;
  }
  std::printf("splitflow consolidation demo: %d training jobs on %zu JPEGs (%s), %ld images each:\n"
              "  read -> decode + random-resized-crop %d + flip (CPU) -> batches of %d -> model step "
              "on the device:\n  normalize + %.1f ms of kernels per batch\n",
              kJobs, g_files.size(), argv[1], kJob.images, kJob.size, kJob.batch, kJob.model.count() / 1e3);
  std::printf("backend: %s\n\n",
              splitflow::cuda_device_count() > 0
                  ? "CUDA (a device is present)"
                  : "host backend (no CUDA device here: GPU-stage work runs on host threads in "
                    "stream order, one kernel at a time)");
  const Row b = bundled();
  if (std::all_of(b.throughput.begin(), b.throughput.end(), [](double t) { return t == 0; })) {
    std::fprintf(stderr, "consolidation: no file of %s could be decoded (each was skipped: see "
                         "the decode stage's errors with a single file); nothing to compare\n",
                 argv[1]);
    return 1;
  }
  std::string device;
  const Row s = split(device);
  splitflow::ArbiterView view;
  const Row p = processes(argv[1], view);
  // Each job against its own bundled run (the same job, owning a device and one CPU thread).
  std::printf("\ndevice: %s\n", device.c_str());
  std::printf("%-9s %7s %13s %10s   %-20s %s\n", "mode", "devices", "device busy", "held/busy",
              "images/s per job", "vs bundled");
  print("bundled", b, b);
  print("split", s, b);
  print("processes", p, b);
  std::printf("\nbundled holds %d devices, each idle %.0f%% of the time; split (one process) and "
              "processes (one per job) do the same work\non 1 device.\nheld/busy is the device's: time some job held it against time it "
              "worked. A split job's own\nheld/busy is %.2f: its bursts also wait, leased, behind "
              "the other job's kernels.\n\n",
              b.devices, 100 * (1 - b.device_busy), s.job_held / s.job_busy);
  std::printf("the processes as the arbiter saw them (splitflow-top; capacity %zu bursts, %zu compute "
              "slot%s):\n  %-8s %8s %8s %8s %8s %8s\n",
              view.capacity, view.compute_slots, view.compute_slots == 1 ? "" : "s", "label",
              "leases", "held s", "busy s", "waste s", "wait s");
  for (const auto& pr : view.processes)
    std::printf("  %-8s %8llu %8.2f %8.2f %8.2f %8.2f\n", pr.label.c_str(),
                static_cast<unsigned long long>(pr.leases), pr.held_ns * 1e-9, pr.busy_ns * 1e-9,
                pr.waste_ns() * 1e-9, pr.wait_ns * 1e-9);
  std::printf("  device: held %.2f s, busy %.2f s\n\n", view.held_ns * 1e-9, p.busy * 1e-9);
  std::printf("one split job:\n%s", splitflow::report(s.stats.front(), s.device).c_str());
  if (argc > 2) {
    const std::filesystem::path dir = argv[2];
    std::filesystem::create_directories(dir);
    for (std::size_t k = 0; k < s.stats.size(); ++k) {
      const auto base = dir / s.stats[k].graph;
      std::ofstream(base.string() + ".json") << splitflow::to_json(s.stats[k], s.device);
      std::ofstream(base.string() + ".trace.json") << s.traces[k];
      std::printf("\nwrote %s.json and %s.trace.json (open the trace in ui.perfetto.dev)",
                  base.c_str(), base.c_str());
    }
    std::printf("\n");
  }
  return 0;
}

int main(int argc, char** argv) {
  try {
    return demo(argc, argv);
  } catch (const std::exception& e) {  // a missing directory, a failed job, Ctrl-C
    std::fprintf(stderr, "consolidation: %s\n", e.what());
    return g_interrupted.load() ? 130 : 1;
  }
}
