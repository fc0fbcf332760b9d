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

void TuningBoard::remember_ring(const std::string& graph, const std::string& stage, std::size_t bytes) {
  std::lock_guard lk(mu_);
  const auto it = std::find_if(rings_.begin(), rings_.end(),
                               [&](const Ring& r) { return r.graph == graph && r.stage == stage; });
  if (it != rings_.end()) rings_.erase(it);
  if (rings_.size() == kRemembered) rings_.pop_front();
  rings_.push_back({graph, stage, bytes});
}

std::size_t TuningBoard::recall_ring(const std::string& graph, const std::string& stage) const {
  std::lock_guard lk(mu_);
  for (const Ring& r : rings_)
    if (r.graph == graph && r.stage == stage) return r.bytes;
  return 0;
}

std::size_t TuningBoard::size() const {
  std::lock_guard lk(mu_);
  return entries_.size();
}

}  // namespace splitflow::detail
