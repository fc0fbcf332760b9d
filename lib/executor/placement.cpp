// Where an automatic synchronous stage's bodies run (executor/detail/nodes.hpp's
// retune_placement): the decision of a run's end, remembered on the runtime's TuningBoard by
// graph and stage name for the next graph of that name (Graph::stage reads it).
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "device/backend.hpp"
#include "runtime_core.hpp"
#include "splitflow/executor/detail/nodes.hpp"

namespace splitflow::detail {

namespace {
constexpr const char* kKnob = "blocking";
}

bool placed_on_blocking_threads(GraphCore& graph, const std::string& stage) {
  return graph.runtime_core()->tuning_board().recall_stage(graph.name(), stage, kKnob) != 0;
}

void retune_placement(GraphCore& graph, const std::string& stage, autotune::PlacementInput in,
                      std::vector<autotune::TuneEvent>& out) {
  in.graph = graph.name();
  in.stage = stage;
  std::optional<autotune::TuneEvent> e = autotune::body_placement(in, steady_now_ns());
  if (!e) return;
  graph.runtime_core()->tuning_board().remember_stage(graph.name(), e->stage, kKnob, e->to);
  out.push_back(std::move(*e));
}

}  // namespace splitflow::detail
