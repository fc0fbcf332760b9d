#include "tuning_board.hpp"

#include <algorithm>

namespace splitflow::detail {

void TuningBoard::join(const void* who, int priority) {
  std::lock_guard lk(mu_);
  autotune::GraphDemand d;
  d.cores = static_cast<double>(autotune::kUnlimited);  // not measured yet: everything
  d.memory_bytes = autotune::kUnlimited;
  d.priority = priority;
  entries_.push_back({who, d});
}

void TuningBoard::leave(const void* who) noexcept {
  std::lock_guard lk(mu_);
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                [&](const Entry& e) { return e.who == who; }),
                 entries_.end());
}

autotune::Budget TuningBoard::share(const void* who, autotune::GraphDemand demand, bool* alone) {
  std::lock_guard lk(mu_);
  std::vector<autotune::GraphDemand> demands;
  std::size_t mine = entries_.size();
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    if (entries_[i].who == who) {
      demand.priority = entries_[i].demand.priority;
      entries_[i].demand = demand;
      mine = i;
    }
    demands.push_back(entries_[i].demand);
  }
  if (alone) *alone = entries_.size() <= 1;
  if (mine == entries_.size() || entries_.size() == 1) return {.cores = cores_, .memory_bytes = memory_};
  const std::vector<autotune::Budget> shares =
      autotune::split_budget(demands, {.cores = cores_, .memory_bytes = memory_});
  return {.cores = shares[mine].cores,
          .memory_bytes = memory_ == autotune::kUnlimited ? memory_ : shares[mine].memory_bytes};
}

void TuningBoard::remember(const std::string& graph,
                           std::vector<std::pair<std::string, std::size_t>> stages) {
  std::lock_guard lk(mu_);
  const auto it = std::find_if(remembered_.begin(), remembered_.end(),
                               [&](const Remembered& r) { return r.graph == graph; });
  if (it != remembered_.end()) remembered_.erase(it);
  if (remembered_.size() == kRemembered) remembered_.pop_front();
  remembered_.push_back({graph, std::move(stages)});
}

std::vector<std::pair<std::string, std::size_t>> TuningBoard::recall(const std::string& graph) const {
  std::lock_guard lk(mu_);
  for (const Remembered& r : remembered_)
    if (r.graph == graph) return r.stages;
  return {};
}

void TuningBoard::remember_stage(const std::string& graph, const std::string& stage,
                                 const std::string& knob, std::size_t value) {
  std::lock_guard lk(mu_);
  const auto it = std::find_if(stage_notes_.begin(), stage_notes_.end(), [&](const StageNote& n) {
    return n.graph == graph && n.stage == stage && n.knob == knob;
  });
  if (it != stage_notes_.end()) stage_notes_.erase(it);
  if (stage_notes_.size() == kRememberedStages) stage_notes_.pop_front();
  stage_notes_.push_back({graph, stage, knob, value});
}

std::size_t TuningBoard::recall_stage(const std::string& graph, const std::string& stage,
                                      const std::string& knob) const {
  std::lock_guard lk(mu_);
  for (const StageNote& n : stage_notes_)
    if (n.graph == graph && n.stage == stage && n.knob == knob) return n.value;
  return 0;
}

std::size_t TuningBoard::size() const {
  std::lock_guard lk(mu_);
  return entries_.size();
}

}  // namespace splitflow::detail
