#include <oneapi/tbb/global_control.h>
#include <oneapi/tbb/info.h>

#include <algorithm>
#include <memory>
#include <mutex>

#include <string>

#include "device/device_runtime.hpp"
#include "executor/run_state.hpp"
#include "executor/runtime_core.hpp"
#include "splitflow/core/error.hpp"
#include "splitflow/executor/runtime.hpp"

namespace splitflow {
namespace detail {
namespace {

// oneTBB's worker threads are one pool for the process, capped at (cores - 1) unless told
// otherwise, and every arena takes its threads from it. An arena whose threads are all workers
// would get fewer than it asked for; and with several runtimes alive, one whose threads all
// wait (a stage body waiting for a graph on another runtime) would leave the other none, which
// hung such a wait (a new user's trial: 2 runtimes of 2 and 1 threads, a pool of 2). So the cap
// is raised to the threads of every live runtime at once, plus the caller's; it only ever grows.
std::mutex g_pool_mu;
int g_live_threads = 0;  // the threads of the runtimes alive now

void ensure_parallelism(int threads) {
  static int current = 0;
  static std::unique_ptr<tbb::global_control> control;
  std::lock_guard lk(g_pool_mu);
  g_live_threads += threads;
  const int wanted = std::max(g_live_threads + 1, tbb::info::default_concurrency());
  if (wanted <= current) return;
  control.reset();  // the most restrictive active control wins, so drop the old one first
  control = std::make_unique<tbb::global_control>(
      tbb::global_control::max_allowed_parallelism, static_cast<std::size_t>(wanted));
  current = wanted;
}

void release_parallelism(int threads) noexcept {
  std::lock_guard lk(g_pool_mu);
  g_live_threads -= threads;
}

int resolve_threads(const RuntimeConfig& c) {
  if (c.threads < 0) throw GraphError("splitflow::Runtime: threads must be >= 0 (0 = all cores)");
  return c.threads > 0 ? c.threads : tbb::info::default_concurrency();
}

}  // namespace

thread_local RuntimeCore* RuntimeCore::t_current = nullptr;
thread_local const RuntimeCore* RuntimeCore::t_arena = nullptr;
thread_local int RuntimeCore::t_slot = -1;
thread_local bool RuntimeCore::t_draining = false;
thread_local Ticks RuntimeCore::t_slice_start = 0;

void RuntimeCore::spawn_urgent(std::function<void()> f) {
  {
    std::lock_guard lk(urgent_mu_);
    urgent_.push_back(std::move(f));
    urgent_pending_.fetch_add(1, std::memory_order_release);
  }
  // For when no thread is between claims: one drain per item (a drain that finds the lane
  // empty, because a thread took the work first, costs one lock).
  spawn([this] { drain_urgent(); }, /*fair=*/true);
}

void RuntimeCore::drain_urgent() {
  if (t_draining) return;
  t_draining = true;
  RuntimeCore* const outer = std::exchange(t_current, this);
  for (;;) {
    std::function<void()> f;
    {
      std::lock_guard lk(urgent_mu_);
      if (urgent_.empty()) break;
      f = std::move(urgent_.front());
      urgent_.pop_front();
      urgent_pending_.fetch_sub(1, std::memory_order_release);
    }
    f();
  }
  t_current = outer;
  t_draining = false;
}

RuntimeCore::RuntimeCore(RuntimeConfig config)
    : config_(config),
      threads_(resolve_threads(config)),
      // No slot reserved for outside threads: callers never join the arena, they only enqueue.
      arena_((ensure_parallelism(threads_), threads_), 0),
      slice_ticks_(static_cast<Ticks>(static_cast<double>(kSliceNs) / ns_per_tick())) {
  arena_.initialize();
}

RuntimeCore::~RuntimeCore() {
  shutdown();
  release_parallelism(threads_);
}

void RuntimeCore::register_run(const std::shared_ptr<RunState>& run) {
  std::lock_guard lk(mu_);
  if (shut_down_)
    throw GraphError("splitflow: the graph's Runtime has been destroyed; it cannot run again");
  active_.push_back(run);
}

void RuntimeCore::unregister_run(const RunState* run) noexcept {
  std::lock_guard lk(mu_);
  std::erase_if(active_, [run](const auto& r) { return r.get() == run; });
}

void RuntimeCore::shutdown() noexcept {
  std::vector<std::shared_ptr<RunState>> runs;
  {
    std::lock_guard lk(mu_);
    shut_down_ = true;
    runs = active_;
  }
  for (auto& r : runs) r->cancel(GraphCore::CancelCause::runtime_end);
  for (auto& r : runs) {
    try {
      r->wait();
    } catch (...) {  // a failed run is its owner's business
    }
  }
  // Tasks may still be returning after the last run published its end.
  arena_.execute([this] { group_.wait(); });
  std::lock_guard lk(device_mu_);
  device_.reset();  // tensors still alive keep it until they go
}

std::shared_ptr<DeviceRuntime> RuntimeCore::device() {
  std::lock_guard lk(device_mu_);
  if (device_) return device_;
  const DeviceConfig& c = config_.device;
  std::unique_ptr<DeviceBackend> backend;
  const CudaBackendEntry* cuda = cuda_backend();
  switch (c.backend) {
    case BackendKind::automatic:
      if (cuda && cuda->device_count() > 0) {
        backend = cuda->make(c.ordinal);
        break;
      }
      backend = make_host_backend(c.host_compute_slots, c.device_pool_bytes);
      break;
    case BackendKind::cuda:
      if (!cuda)
        throw Error("splitflow: DeviceConfig::backend is cuda but splitflow was built without "
                    "CUDA, or the program links splitflow::core without splitflow::cuda "
                    "(SPLITFLOW_WITH_CUDA=OFF, or no nvcc when it was built; link "
                    "splitflow::splitflow)");
      if (cuda->device_count() == 0)
        throw Error("splitflow: DeviceConfig::backend is cuda but no CUDA device is usable "
                    "(no GPU or no driver); use BackendKind::automatic or host");
      backend = cuda->make(c.ordinal);
      break;
    case BackendKind::host:
      backend = make_host_backend(c.host_compute_slots, c.device_pool_bytes);
      break;
  }
  device_ = std::make_shared<DeviceRuntime>(std::move(backend), c);
  return device_;
}

std::shared_ptr<DeviceRuntime> RuntimeCore::device_if_created() const {
  std::lock_guard lk(device_mu_);
  return device_;
}

}  // namespace detail

namespace {
RuntimeConfig validated(RuntimeConfig c) {
  if (c.threads < 0 || c.threads > RuntimeConfig::kMaxThreads)
    throw Error("splitflow::Runtime: threads must be 0 (one per core) to " +
                std::to_string(RuntimeConfig::kMaxThreads) + ", not " + std::to_string(c.threads));
  if (c.device.streams < 1 || c.device.streams > 1024)
    throw Error("splitflow::Runtime: DeviceConfig::streams must be 1 to 1024, not " +
                std::to_string(c.device.streams));
  if (c.device.host_compute_slots < 1 || c.device.host_compute_slots > 1024)
    throw Error("splitflow::Runtime: DeviceConfig::host_compute_slots must be 1 to 1024, not " +
                std::to_string(c.device.host_compute_slots));
  if (c.blocking_threads < 1 || c.blocking_threads > 4096)
    throw Error("splitflow::Runtime: blocking_threads must be 1 to 4096, not " +
                std::to_string(c.blocking_threads));
  return c;
}
}  // namespace

Runtime::Runtime(RuntimeConfig config)
    : core_(std::make_shared<detail::RuntimeCore>(validated(std::move(config)))) {}
Runtime::~Runtime() { core_->shutdown(); }
int Runtime::threads() const noexcept { return core_->threads(); }
std::optional<DeviceStats> Runtime::device_stats() const {
  auto dev = core_->device_if_created();
  if (!dev) return std::nullopt;
  return dev->stats();
}
const RuntimeConfig& Runtime::config() const noexcept { return core_->config(); }

}  // namespace splitflow
