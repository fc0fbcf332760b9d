// TuningBoard: the runtime's tuned runs and what each asks of its cores (issue 17's "several
// graphs on one runtime share the budget, split by their measured demand and their priority").
// Each RunTuner joins when its run starts, posts its graph's demand (Autotuner::demand) every
// window and takes back its share: autotune::split_budget over the latest demand of every run
// tuned at that moment, so the shares of the runs at once never add up to more than the cores.
// A run that has not posted yet asks for everything. Internal to the library; a policy small
// enough to test alone (tests/test_autotune_runtime.cpp).
#pragma once

#include <cstddef>
#include <deque>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "splitflow/executor/autotune.hpp"

namespace splitflow::detail {

class TuningBoard {
 public:
  /// `memory`: the runtime's host memory budget (0: none).
  explicit TuningBoard(double cores, std::size_t memory = 0)
      : cores_(cores), memory_(memory ? memory : autotune::kUnlimited) {}

  /// `who` (a RunTuner) is tuned from now on, with its graph's priority.
  void join(const void* who, int priority);
  /// `who` is no longer tuned (its run ended); the others share what it had.
  void leave(const void* who) noexcept;
  /// Posts `who`'s demand (its priority kept from join) and returns its share of the cores and
  /// of the memory (autotune::kUnlimited without a budget).
  /// `alone`: no other run is tuned now (its share is then all the cores).
  autotune::Budget share(const void* who, autotune::GraphDemand demand, bool* alone = nullptr);
  /// The runs tuned now.
  std::size_t size() const;
  double cores() const noexcept { return cores_; }
  std::size_t memory() const noexcept { return memory_; }

  /// The automatic stages' concurrencies of the latest tuned run of the graph named `graph`
  /// (stage name, concurrency), kept for the next run of a graph of that name: a graph built
  /// anew each epoch (GraphDataset, the image benchmark) starts where the last epoch's tuning
  /// ended rather than at 1. At most kRemembered graphs (the least recently remembered go).
  void remember(const std::string& graph, std::vector<std::pair<std::string, std::size_t>> stages);
  std::vector<std::pair<std::string, std::size_t>> recall(const std::string& graph) const;
  static constexpr std::size_t kRemembered = 64;
  /// What a run decided of stage `stage` of a graph named `graph` for the next run of a graph
  /// of that name, by knob: "ring_bytes", an automatic pinned ring's bytes (at the end of a
  /// run: autotune::ring_depth); "blocking", 1 when an automatic stage's bodies run on the
  /// runtime's blocking threads (autotune::body_placement). 0 when none is remembered. At most
  /// kRememberedStages (the least recently remembered go).
  void remember_stage(const std::string& graph, const std::string& stage, const std::string& knob,
                      std::size_t value);
  std::size_t recall_stage(const std::string& graph, const std::string& stage,
                           const std::string& knob) const;
  static constexpr std::size_t kRememberedStages = 128;

 private:
  struct Entry {
    const void* who;
    autotune::GraphDemand demand;
  };
  const double cores_;
  const std::size_t memory_;
  mutable std::mutex mu_;
  std::vector<Entry> entries_;  // in joining order
  struct Remembered {
    std::string graph;
    std::vector<std::pair<std::string, std::size_t>> stages;
  };
  std::deque<Remembered> remembered_;  // the most recently remembered last; at most kRemembered
  struct StageNote {
    std::string graph, stage, knob;
    std::size_t value;
  };
  std::deque<StageNote> stage_notes_;  // the most recently remembered last; at most kRememberedStages
};

}  // namespace splitflow::detail
