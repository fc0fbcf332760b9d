// A discrete-event simulator of pipelines on a core pool and GPU devices, running autotune's
// policy online (issue 17): the policy sees only the per-window figures the simulator measures,
// as the runtime would give them, and its allocation is applied at each window's end. Seeded
// and deterministic; sizes this machine does not have (128 cores, 8 GPUs) in milliseconds.
//
//     using namespace splitflow::autotune;
//     SimPipeline p{.name = "jpeg", .stages = {{.name = "decode", .cpu_s = 0.17},
//                                              {.name = "augment", .cpu_s = 0.21}}};
//     SimResult r = simulate({p}, {.cores = 126, .duration_s = 40});
//     r.final_allocation[0].stages[0].concurrency;   // 57 (and 70 for augment: the optimum 56/70)
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "splitflow/executor/autotune.hpp"

namespace splitflow::autotune {

/// One simulated stage. An invocation holds one item: it takes a core for cpu_s, then waits
/// io_s without one, then (a GPU stage) runs gpu_s on its device, one burst at a time in FIFO
/// order. Each time is drawn as cost x uniform[1 - jitter, 1 + jitter].
struct SimStage {
  std::string name{};
  double cpu_s = 0;   ///< CPU seconds per item
  double io_s = 0;    ///< latency per item without a core
  double gpu_s = 0;   ///< device seconds per item (GPU stages)
  int device = -1;    ///< >= 0: a GPU stage on that device (shared by stages and pipelines)
  std::size_t item_bytes = 0;                 ///< host bytes of one input item
  std::size_t max_concurrency = kUnlimited;   ///< the stage's own ceiling (a GPU: its streams)
  std::optional<std::size_t> fixed_concurrency{};  ///< the user's number: the tuner keeps it
  std::optional<std::size_t> fixed_capacity{};
  std::size_t concurrency = 1;  ///< the starting setting (kUnlimited: no limit)
  std::size_t capacity = 1;     ///< the starting input queue capacity
};

/// A chain fed by a free, endless source: source -> stages[0] -> ... -> stages[n-1] -> sink.
struct SimPipeline {
  std::string name = "pipeline";
  std::vector<SimStage> stages{};
  std::size_t max_in_flight = kUnlimited;  ///< the starting setting
  int priority = 0;                         ///< its weight in a shared budget
};

/// Multiplies a stage's costs by `factor` from `at_s` on (a slower disk, bigger images).
struct CostChange {
  std::size_t pipeline = 0, stage = 0;
  double at_s = 0;
  double factor = 2;
};

struct SimOptions {
  double cores = 8;  ///< the core pool (and the budget the pipelines share)
  std::size_t memory_bytes = kUnlimited;
  double window_s = 1.0;     ///< measurement window: the policy runs at each one's end
  double duration_s = 60;
  double jitter = 0.2;
  std::uint64_t seed = 1;
  bool tune = true;          ///< false: run the starting settings throughout
  bool report_cpu_time = true;  ///< StageSample::cpu_ns measured (false: -1, as without a CPU clock)
  PolicyOptions policy{};
  std::vector<CostChange> changes{};
};

/// What one pipeline did in one window.
struct SimWindow {
  double end_s = 0;
  double rate = 0;               ///< items delivered per second
  Allocation allocation{};       ///< the settings the window ran with
  double cores_in_use_max = 0;   ///< most cores its bodies held at once
  std::size_t bytes_max = 0;     ///< most host bytes its items held at once
  std::vector<double> device_busy{};  ///< per device (index = SimStage::device), this pipeline's share
  Sample sample{};               ///< what the policy was given
};

struct SimResult {
  std::vector<std::vector<SimWindow>> windows;   ///< per pipeline
  std::vector<std::vector<TuneEvent>> events;    ///< per pipeline, the tuner's
  std::vector<Allocation> final_allocation;      ///< per pipeline
  std::vector<Bound> final_bound;                ///< per pipeline, the tuner's last
  std::vector<Budget> final_budget;              ///< per pipeline, its last share
  double cores_in_use_max = 0;                   ///< over all pipelines, the whole run
  std::uint64_t events_simulated = 0;
  /// Mean rate of pipeline `p` over its last `n` windows.
  double steady_rate(std::size_t p, std::size_t n) const;
  /// Mean busy fraction of device `d` over the last `n` windows (all pipelines).
  double steady_busy(int d, std::size_t n) const;
};

/// Runs the pipelines on one core pool for options.duration_s of simulated time, each with its
/// own Autotuner (sharing options.cores and memory_bytes through split_budget).
SimResult simulate(const std::vector<SimPipeline>& pipelines, const SimOptions& options);

}  // namespace splitflow::autotune
