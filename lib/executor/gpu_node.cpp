// What GPU-stage nodes (executor/detail/gpu_node.hpp) need from their graph: the runtime's
// device and the graph's GPU accounting. Here, in the executor, so that the device layer knows
// no graphs.
#include "device/device_runtime.hpp"
#include "splitflow/executor/detail/gpu_node.hpp"
#include "splitflow/executor/detail/graph_core.hpp"

namespace splitflow::detail {

std::shared_ptr<DeviceRuntime> device_of(GraphCore& graph) { return graph.device(); }
GpuAccount* gpu_account(GraphCore& graph) { return graph.gpu_account(); }

}  // namespace splitflow::detail
