// The consolidation demonstration: several training-style jobs, each `load (CPU) -> model step
// (GPU) -> step`, run twice:
//   bundled  each job owns a device for its whole run and loads then computes in sequence,
//            the way a training script without a separate loader does;
//   split    all jobs share one device; each job's GPU stage leases a stream per kernel burst.
// It prints devices used, device busy, GPU held / busy and each job's throughput, then the
// report of one split job, with its diagnosis. Given a directory, it also writes each split
// job's JSON summary and Chrome trace there (scripts/plot_run.py plots them).
//
//     consolidation [OUTPUT_DIR]
#include <splitflow/splitflow.hpp>

#include "consolidation_workload.hpp"

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

namespace {

using namespace std::chrono_literals;

constexpr int kJobs = 2;
const consolidation::Job kJob{150, 2000us, 1500us};

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
    std::uint64_t done = 0;
    splitflow::Run* pending = nullptr;
    for (auto& r : runs) {
      const auto st = r.stats();
      done += st.find("step")->items_out;
      if (st.status == splitflow::RunStatus::running) pending = &r;
    }
    std::printf("\r  %-8s %5llu / %ld items", what, static_cast<unsigned long long>(done),
                kJob.items * static_cast<long>(runs.size()));
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
    devices.push_back(std::make_unique<splitflow::Runtime>(consolidation::config(1)));
    jobs.push_back(std::make_unique<splitflow::Graph>(*devices.back(), "job" + std::to_string(k),
                                                      splitflow::GraphOptions{.max_in_flight = 1}));
    consolidation::build(*jobs.back(), kJob, true);
  }
  for (auto& j : jobs) runs.push_back(j->run());
  wait_all(runs, "bundled");
  for (auto& r : runs) {
    const auto st = r.stats();
    row.held += st.wall_ns;  // the job owns its device for its whole run
    row.busy += st.gpu.busy_ns;
    row.device_busy += static_cast<double>(st.gpu.busy_ns) / st.wall_ns / kJobs;
    row.throughput.push_back(kJob.items / (st.wall_ns / 1e9));
  }
  row.devices = kJobs;
  return row;
}

Row split(std::string& backend) {
  Row row;
  splitflow::Runtime rt(consolidation::config(kJobs));
  std::vector<std::unique_ptr<splitflow::Graph>> jobs;
  std::vector<splitflow::Run> runs;
  for (int k = 0; k < kJobs; ++k) {
    jobs.push_back(std::make_unique<splitflow::Graph>(rt, std::string("job").append(std::to_string(k)),
                                                      splitflow::GraphOptions{.trace = true}));
    consolidation::build(*jobs.back(), kJob, false);
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (auto& j : jobs) runs.push_back(j->run());
  wait_all(runs, "split");
  const double wall = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  for (auto& r : runs) {
    const auto st = r.stats();
    row.job_held += st.gpu.held_ns;
    row.job_busy += st.gpu.busy_ns;
    row.throughput.push_back(kJob.items / (st.wall_ns / 1e9));
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

void print(const char* mode, const Row& r, double dedicated) {
  std::string tput, ratio;
  for (double t : r.throughput) {
    tput += (tput.empty() ? "" : ", ") + std::to_string(static_cast<int>(t));
    char buf[16];
    std::snprintf(buf, sizeof buf, "%.2fx", t / dedicated);
    ratio += (ratio.empty() ? "" : ", ") + std::string(buf);
  }
  std::printf("%-8s %7d %12.0f%% %10.2f   %-20s %s\n", mode, r.devices, 100 * r.device_busy,
              r.held / r.busy, tput.c_str(), ratio.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  std::printf("splitflow consolidation demo: %d jobs, each per item: load %.1f ms CPU -> model "
              "step %.1f ms on the device; %ld items each\n",
              kJobs, kJob.load.count() / 1e3, kJob.model.count() / 1e3, kJob.items);
  std::printf("backend: %s\n\n",
              splitflow::cuda_device_count() > 0
                  ? "CUDA (a device is present)"
                  : "host backend (no CUDA device here: GPU-stage work runs on host threads in "
                    "stream order, one kernel at a time)");
  const Row b = bundled();
  std::string device;
  const Row s = split(device);
  const double dedicated = b.throughput.front();
  std::printf("\ndevice: %s\n", device.c_str());
  std::printf("%-8s %7s %13s %10s   %-20s %s\n", "mode", "devices", "device busy", "held/busy",
              "items/s per job", "vs dedicated");
  print("bundled", b, dedicated);
  print("split", s, dedicated);
  std::printf("\nbundled holds %d devices, each idle %.0f%% of the time; split does the same work "
              "on 1 device.\nheld/busy is the device's: time some job held it against time it "
              "worked. A split job's own\nheld/busy is %.2f: its bursts also wait, leased, behind "
              "the other job's kernels.\n\n",
              b.devices, 100 * (1 - b.device_busy), s.job_held / s.job_busy);
  std::printf("one split job:\n%s", splitflow::report(s.stats.front(), s.device).c_str());
  if (argc > 1) {
    const std::filesystem::path dir = argv[1];
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
