// RunTuner: runs autotune's policy (splitflow/executor/autotune.hpp) on a live run. A thread of
// its own (not an arena thread: it only waits and reads) measures the run every window
// (GraphCore::snapshot, differenced), asks the policy, and posts the concurrencies it returns
// for the stages with Concurrency::automatic to the arena, where they take effect at once.
// Internal to the library.
#pragma once

#include <chrono>
#include <cstdint>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "splitflow/executor/autotune.hpp"
#include "splitflow/telemetry/stats.hpp"
#include "tuning_board.hpp"

namespace splitflow::detail {

class GraphCore;
class NodeBase;

class RunTuner {
 public:
  /// For `graph`'s active run; `nodes` in the order of RunStats::stages.
  /// `cores`: the graph's budget (GraphOptions::autotune_cores, or the runtime's threads);
  /// `pool`: they are the runtime's threads, which enforce themselves (autotune::Budget::pool),
  /// while no other run on the runtime is tuned. `board`: the runtime's tuned runs, which share
  /// its threads by demand and `priority` (null: none).
  RunTuner(GraphCore& graph, std::vector<NodeBase*> nodes, std::chrono::milliseconds window,
           double cores, bool pool, TuningBoard* board = nullptr, int priority = 0);
  /// Starts measuring (once the graph holds this tuner: its snapshots read it).
  void start();
  /// Stops (and joins) the thread.
  ~RunTuner();
  RunTuner(const RunTuner&) = delete;
  RunTuner& operator=(const RunTuner&) = delete;

  /// Stops measuring; idempotent. Call before the run's final figures are taken.
  void stop() noexcept;
  /// The decisions so far, as text ("decode 1 -> 2: ...").
  std::vector<std::string> events() const;

  /// The policy's view of one window, from two snapshots of the run: the stages with automatic
  /// concurrency (`tuned[i]`, by stats index) and the GPU stages whose concurrency the user set
  /// (at that number: StageSample::fixed_concurrency), their indices to `modelled`; and the
  /// cores the other stages with bodies used meanwhile (`fixed_cores`: off the tuned ones' budget).
  /// `tuned_capacity` (by stats index, if given): the ceiling of each input queue the tuner
  /// sizes (NodeBase::auto_capacity), 0 for the queues it keeps (their capacity is fixed).
  /// Each modelled stage's item_bytes is the mean its input's sampled items held in the window
  /// (StageStats::item_bytes; the run's mean if none was sampled in it). `fixed_bytes`: what
  /// the others can hold (their queues' capacity and bodies' items at their item bytes, a pull
  /// sink's queue, GPU stages' pinned rings), off the memory budget of the modelled ones.
  static autotune::Sample sample_of(const RunStats& before, const RunStats& now,
                                    const std::vector<bool>& tuned, double cores,
                                    std::vector<std::size_t>* modelled, double* fixed_cores,
                                    const std::vector<std::size_t>* tuned_capacity = nullptr,
                                    std::size_t* fixed_bytes = nullptr,
                                    std::size_t blocking_threads = autotune::kUnlimited);
  /// The mean bytes of the input items `b` sampled since `a` (its run's mean if none was).
  static std::size_t window_item_bytes(const StageStats& a, const StageStats& b) noexcept;

 private:
  void loop();
  /// What this graph asks of the runtime's board: its tuner's demand with the cores of the
  /// stages the tuner does not model (`fixed`, the last window's).
  autotune::GraphDemand demand_of(double fixed) const;
  /// Starts the automatic stages where the last tuned run of a graph of this name ended them.
  void warm_start();
  /// A stage's new settings (0: unchanged).
  struct Change {
    NodeBase* node;
    std::size_t concurrency = 0;
    std::size_t capacity = 0;
  };
  /// Applies them on the graph's arena (NodeBase::set_concurrency, set_capacity).
  void post(std::vector<Change> changes);

  GraphCore& graph_;
  std::vector<NodeBase*> nodes_;
  std::vector<bool> tuned_;
  std::vector<double> shape_visits_;  // per node: items through it per item delivered; 0: measured
  std::vector<std::size_t> max_capacity_;  // per node: its queue's ceiling if tuned, else 0
  std::chrono::milliseconds window_;
  double cores_;
  bool pool_;
  std::size_t memory_left_ = autotune::kUnlimited;  // the memory budget posted to the policy
  TuningBoard* board_;
  int priority_;
  bool joined_ = false;
  autotune::Autotuner tuner_;
  std::size_t admit_limit_;  // the graph's admit limit as this tuner last set it (or found it)
  bool told_over_budget_ = false;  // a decision said the memory budget holds fewer items than the graph needs
  int within_budget_windows_ = 0;  // windows in a row since the budget last held too few
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  static constexpr std::size_t kMaxEvents = 256, kKeptFirst = 32;
  std::vector<std::string> events_;  // at most kMaxEvents
  std::uint64_t omitted_ = 0;        // decisions between the first and the latest, not kept
  std::thread thread_;  // last: started once the rest is set
};

}  // namespace splitflow::detail
