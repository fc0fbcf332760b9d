// What GPU-stage nodes (executor/detail/gpu_node.hpp) need from their graph: the runtime's
// device and the graph's GPU accounting. Here, in the executor, so that the device layer knows
// no graphs.
#include "device/device_runtime.hpp"
#include "splitflow/executor/detail/gpu_node.hpp"
#include "splitflow/executor/detail/graph_core.hpp"

#include <algorithm>

#include "runtime_core.hpp"
#include "saturating.hpp"
#include "splitflow/executor/autotune.hpp"

namespace splitflow::detail {

std::shared_ptr<DeviceRuntime> device_of(GraphCore& graph) { return graph.device(); }
GpuAccount* gpu_account(GraphCore& graph) { return graph.gpu_account(); }

namespace {
// An automatic ring's bounds: one budget at the least; at most kMaxAutoRingBytes, or half the
// memory budget, and a quarter of the pinned pool (the rings of several stages share it).
std::size_t ring_floor(std::size_t item_bytes) { return autotune::sat_mul(2, item_bytes); }
std::size_t ring_ceiling(GraphCore& g, std::size_t item_bytes) {
  const RuntimeConfig& c = g.runtime_core()->config();
  const std::size_t most = c.host_memory_budget > 0 ? c.host_memory_budget / 2 : GpuStageOptions::kMaxAutoRingBytes;
  return std::max(ring_floor(item_bytes), std::min(most, c.device.pinned_pool_bytes / 4));
}
}  // namespace

std::size_t auto_ring_bytes(GraphCore& g, const std::string& stage, std::size_t item_bytes) {
  const std::size_t floor = ring_floor(item_bytes), ceiling = ring_ceiling(g, item_bytes);
  if (const std::size_t last = g.runtime_core()->tuning_board().recall_stage(g.name(), stage, "ring_bytes"))
    return std::clamp(last, floor, ceiling);
  const std::size_t budget = g.runtime_core()->config().host_memory_budget;
  const std::size_t first = budget > 0 ? std::min(budget / 4, GpuStageOptions::kDefaultRingBytes)
                                       : GpuStageOptions::kDefaultRingBytes;
  return std::clamp(first, floor, ceiling);
}

void retune_ring(GraphCore& g, const std::string& stage, const PinnedRing& ring, const StageStats& st,
                 std::int64_t wall_ns, std::vector<autotune::TuneEvent>& out) {
  const PinnedRing::Figures f = ring.figures();
  if (f.max_committed == 0) return;  // nothing went through it: nothing learnt
  const autotune::RingInput in{.stage = stage,
                               .capacity = ring.capacity(),
                               .item_bytes = ring.item_bytes(),
                               .max_committed = f.max_committed,
                               .refusals = f.refusals,
                               .wait_ns = f.wait_ns,
                               .starved_ns = st.starved_ns,
                               .wall_ns = wall_ns,
                               .ceiling = ring_ceiling(g, ring.item_bytes())};
  std::optional<autotune::TuneEvent> e = autotune::ring_depth(in, steady_now_ns());
  g.runtime_core()->tuning_board().remember_stage(g.name(), stage, "ring_bytes",
                                                  e ? e->to : ring.capacity());
  if (e) out.push_back(std::move(*e));
}

}  // namespace splitflow::detail
