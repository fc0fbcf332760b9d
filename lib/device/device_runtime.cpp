#include "device_runtime.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>

#include <fmt/format.h>

#include "splitflow/core/error.hpp"

namespace splitflow::detail {

namespace {
thread_local bool t_in_callback = false;
std::atomic<std::uint64_t> g_cuda_calls{0};

std::size_t bytes_of(DType dtype, const std::vector<std::int64_t>& shape) {
  std::size_t n = itemsize(dtype);
  for (auto d : shape) {
    if (d < 0) throw Error("splitflow: negative tensor dimension");
    n *= static_cast<std::size_t>(d);
  }
  return n;
}

// A size in these messages: in MiB from 1 MiB up (one decimal, as sizes are configured), in KiB
// or bytes below ("0.0 MiB" said nothing of an 8 KiB output against a 4 KiB item size).
std::string mib(std::size_t b) {
  if (b >= (std::size_t{1} << 20)) return fmt::format("{:.1f} MiB", static_cast<double>(b) / (1 << 20));
  if (b >= 1024) return fmt::format("{:.1f} KiB", static_cast<double>(b) / 1024);
  return fmt::format("{} B", b);
}
}  // namespace

bool in_device_callback() noexcept { return t_in_callback; }
DeviceCallbackScope::DeviceCallbackScope() noexcept : outer_(t_in_callback) { t_in_callback = true; }
DeviceCallbackScope::~DeviceCallbackScope() { t_in_callback = outer_; }

namespace {
// Constant-initialised: registration during another file's static initialisation sees it.
std::atomic<const CudaBackendEntry*> g_cuda_backend{nullptr};
}  // namespace

const CudaBackendEntry* cuda_backend() noexcept {
  return g_cuda_backend.load(std::memory_order_acquire);
}
bool register_cuda_backend(const CudaBackendEntry* entry) noexcept {
  g_cuda_backend.store(entry, std::memory_order_release);
  return true;
}

void note_cuda_call() noexcept { g_cuda_calls.fetch_add(1, std::memory_order_relaxed); }
std::uint64_t cuda_runtime_calls() noexcept { return g_cuda_calls.load(std::memory_order_relaxed); }

}  // namespace splitflow::detail

namespace splitflow {
std::uint64_t cuda_runtime_calls() noexcept { return detail::cuda_runtime_calls(); }
bool built_with_cuda() noexcept { return detail::cuda_backend() != nullptr; }
int cuda_device_count() noexcept {
  const detail::CudaBackendEntry* cuda = detail::cuda_backend();
  return cuda ? cuda->device_count() : 0;
}
}  // namespace splitflow

namespace splitflow::detail {

// ---- StreamPool ------------------------------------------------------------------------------

StreamPool::StreamPool(DeviceBackend& backend, std::size_t size) : backend_(backend) {
  if (size == 0) throw Error("splitflow: DeviceConfig::streams must be at least 1");
  for (std::size_t i = 0; i < size; ++i) {
    leases_.push_back(
        std::make_unique<Lease>(Lease{backend_.create_stream(), static_cast<int>(i)}));
    free_.push_back(leases_.back().get());
  }
  lease_time_.assign(size + 1, 0);
  changed_ns_ = steady_now_ns();
}

void StreamPool::count_time_locked(std::int64_t now) noexcept {
  lease_time_[in_use_] += now - changed_ns_;
  changed_ns_ = now;
}

std::vector<std::int64_t> StreamPool::lease_time() const {
  std::lock_guard lk(mu_);
  std::vector<std::int64_t> t = lease_time_;
  t[in_use_] += steady_now_ns() - changed_ns_;
  return t;
}

StreamPool::~StreamPool() {
  // The streams first: destroy_stream waits until each is idle, so no backend thread is in the
  // compute gate afterwards (its grants come through the segment, not the pump). Then the gate goes, the
  // pump stops (it calls into this pool), and the arbiter is left.
  for (auto& l : leases_) backend_.destroy_stream(l->stream);
  backend_.set_compute_gate(nullptr);
  if (arb_) {
    arb_->stop();
    arb_.reset();
  }
}

void StreamPool::join_arbiter(const ArbiterConfig& config, std::size_t compute_slots,
                              std::function<std::int64_t()> busy_ns,
                              std::function<std::vector<PublishedGraph>()> graphs) {
  arb_ = std::make_unique<Arbiter>(
      config, leases_.size(), compute_slots,
      [this](const std::vector<std::uint64_t>& t) { on_granted(t); }, std::move(busy_ns),
      std::move(graphs));
  // The host backend's kernels share its modelled device with the other processes.
  if (backend_.kind() == BackendKind::host) backend_.set_compute_gate(arb_.get());
}

Lease* StreamPool::take_free_locked(std::int64_t now, int priority) noexcept {
  // The arbiter caps this process's tokens at its streams: one is free for each token.
  Lease* l = free_.back();
  free_.pop_back();
  backend_.set_priority(l->stream, priority);
  l->since_ns = now;
  count_time_locked(now);
  if (in_use_++ == 0) held_since_ = now;
  max_in_use_ = std::max(max_in_use_, in_use_);
  ++count_;
  return l;
}

void StreamPool::deliver_locked(std::vector<std::uint64_t> tickets, Grants& grants) noexcept {
  while (!tickets.empty()) {
    const std::uint64_t t = tickets.back();
    tickets.pop_back();
    auto it = std::find_if(ticketed_.begin(), ticketed_.end(),
                           [t](const auto& e) { return e.first == t; });
    if (it == ticketed_.end()) {
      // Its waiter was withdrawn meanwhile: the token goes back (perhaps to one of ours).
      try {
        auto more = arb_->release();
        tickets.insert(tickets.end(), more.begin(), more.end());
      } catch (...) {
      }
      continue;
    }
    LeaseWaiter* w = it->second;
    ticketed_.erase(it);
    if (free_.empty()) {
      // (Not expected: the arbiter caps this process at its streams.) Queue it again.
      waiting_.push_front(w);
      try {
        auto more = arb_->release();
        tickets.insert(tickets.end(), more.begin(), more.end());
      } catch (...) {
      }
      continue;
    }
    grants.emplace_back(w, take_free_locked(steady_now_ns(), w->priority));
  }
}

void StreamPool::promote_locked(Grants& grants) noexcept {
  // Waiters kept here while the arbiter's ticket table was full, in their order.
  while (!waiting_.empty()) {
    LeaseWaiter* w = waiting_.front();
    std::uint64_t ticket = 0;
    Arbiter::Take r;
    try {
      r = arb_->acquire(w->priority, ticket);
    } catch (...) {
      return;
    }
    if (r == Arbiter::Take::full) return;
    waiting_.pop_front();
    if (r == Arbiter::Take::granted)
      grants.emplace_back(w, take_free_locked(steady_now_ns(), w->priority));
    else
      ticketed_.emplace_back(ticket, w);
  }
}

void StreamPool::on_granted(const std::vector<std::uint64_t>& tickets) noexcept {
  Grants grants;
  {
    std::lock_guard lk(mu_);
    deliver_locked(tickets, grants);
    promote_locked(grants);
  }
  for (auto& [w, l] : grants) w->grant(l);  // it only hands work to the arena
}

Lease* StreamPool::acquire_or_wait(LeaseWaiter& w) {
  std::lock_guard lk(mu_);
  if (arb_) {
    const std::int64_t now = steady_now_ns();
    w.since_ns = now;
    if (waiting_.empty()) {
      std::uint64_t ticket = 0;
      switch (arb_->acquire(w.priority, ticket)) {
        case Arbiter::Take::granted:
          return take_free_locked(now, w.priority);
        case Arbiter::Take::queued:
          ticketed_.emplace_back(ticket, &w);
          return nullptr;
        case Arbiter::Take::full:
          break;
      }
    }
    auto it = waiting_.end();
    while (it != waiting_.begin() && (*(it - 1))->priority < w.priority) --it;
    waiting_.insert(it, &w);
    return nullptr;
  }
  // Someone already waiting goes first: a newcomer never overtakes (first come, first served).
  if (!free_.empty() && waiting_.empty()) {
    Lease* l = free_.back();
    free_.pop_back();
    backend_.set_priority(l->stream, w.priority);
    l->since_ns = steady_now_ns();
    count_time_locked(l->since_ns);
    if (in_use_++ == 0) held_since_ = l->since_ns;
    max_in_use_ = std::max(max_in_use_, in_use_);
    ++count_;
    return l;
  }
  w.since_ns = steady_now_ns();
  // Priority classes: behind every waiter of the same or a higher priority.
  auto it = waiting_.end();
  while (it != waiting_.begin() && (*(it - 1))->priority < w.priority) --it;
  waiting_.insert(it, &w);
  return nullptr;
}

void StreamPool::release(Lease* lease) noexcept {
  LeaseWaiter* next = nullptr;
  const std::int64_t now = steady_now_ns();
  if (arb_) {
    Grants grants;
    {
      std::lock_guard lk(mu_);
      lease_ns_ += now - lease->since_ns;
      count_time_locked(now);
      if (--in_use_ == 0) held_ns_ += now - held_since_;
      free_.push_back(lease);
      try {
        deliver_locked(arb_->release(), grants);
      } catch (...) {
      }
      promote_locked(grants);
    }
    for (auto& [w, l] : grants) w->grant(l);
    return;
  }
  {
    std::lock_guard lk(mu_);
    lease_ns_ += now - lease->since_ns;
    if (!waiting_.empty()) {
      next = waiting_.front();
      waiting_.pop_front();
      ++count_;
      lease->since_ns = now;
      backend_.set_priority(lease->stream, next->priority);
    } else {
      count_time_locked(now);
      if (--in_use_ == 0) held_ns_ += now - held_since_;
      free_.push_back(lease);
    }
  }
  if (next) next->grant(lease);  // it only hands work to the arena
}

void StreamPool::withdraw(const void* owner) noexcept {
  std::vector<LeaseWaiter*> gone;
  Grants grants;
  {
    std::lock_guard lk(mu_);
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      if ((*it)->owner == owner) {
        gone.push_back(*it);
        it = waiting_.erase(it);
      } else {
        ++it;
      }
    }
    // The owner's ticketed waiters leave first, all of them: a token given back below may be
    // delivered to another waiter of this pool (deliver_locked erases from ticketed_).
    std::vector<std::uint64_t> tickets;
    std::erase_if(ticketed_, [&](const auto& e) {
      if (e.second->owner != owner) return false;
      tickets.push_back(e.first);
      gone.push_back(e.second);
      return true;
    });
    for (const std::uint64_t ticket : tickets) {
      try {
        // Granted meanwhile: the token is this process's; give it back.
        if (!arb_->cancel(ticket)) deliver_locked(arb_->release(), grants);
      } catch (...) {
      }
    }
    if (arb_) promote_locked(grants);
  }
  for (auto& [w, l] : grants) w->grant(l);
  for (LeaseWaiter* w : gone) w->grant(nullptr);
}

std::size_t StreamPool::in_use() const {
  std::lock_guard lk(mu_);
  return in_use_;
}
std::size_t StreamPool::max_in_use() const {
  std::lock_guard lk(mu_);
  return max_in_use_;
}
std::size_t StreamPool::waiters() const {
  std::lock_guard lk(mu_);
  return waiting_.size() + ticketed_.size();
}
std::uint64_t StreamPool::leases() const {
  std::lock_guard lk(mu_);
  return count_;
}
std::int64_t StreamPool::lease_ns() const {
  std::lock_guard lk(mu_);
  return lease_ns_;
}
std::int64_t StreamPool::held_ns() const {
  std::lock_guard lk(mu_);
  return held_ns_ + (in_use_ > 0 ? steady_now_ns() - held_since_ : 0);
}

// ---- capped pools ------------------------------------------------------------------------------

void CappedBytes::take(std::size_t n, const std::string& stage, std::uint64_t item) {
  std::size_t used = used_.load(std::memory_order_relaxed);
  do {
    if (used + n > cap_)
      throw Error(fmt::format(
          "splitflow: stage '{}' item {}: the {} pool cannot give {} ({} of its {} cap in use); "
          "raise DeviceConfig::{}_pool_bytes or lower the queue capacities that hold these tensors",
          stage, item, what_, mib(n), mib(used), mib(cap_), what_));
  } while (!used_.compare_exchange_weak(used, used + n, std::memory_order_relaxed));
}

// ---- DeviceRuntime -------------------------------------------------------------------------------

DeviceRuntime::DeviceRuntime(std::unique_ptr<DeviceBackend> backend, const DeviceConfig& config)
    : backend_(std::move(backend)),
      pool_(*backend_, config.streams),
      device_bytes_("device", config.device_pool_bytes),
      pinned_bytes_("pinned", config.pinned_pool_bytes),
      faults_(config.faults),
      start_ns_(steady_now_ns()) {
  if (config.arbiter.enabled())
    pool_.join_arbiter(config.arbiter, static_cast<std::size_t>(config.host_compute_slots),
                       [b = backend_.get()] { return b->busy_ns(); },
                       [this] { return graph_figures(); });
}

DeviceRuntime::~DeviceRuntime() { drain_deferred(); }

void DeviceRuntime::free(void* p, std::size_t bytes, bool pinned,
                         std::vector<void*> users) noexcept {
  Deferred d{p, bytes, pinned, std::move(users)};
  if (in_device_callback()) {
    std::lock_guard lk(deferred_mu_);
    deferred_.push_back(std::move(d));
    return;
  }
  free_now(d);
}

void DeviceRuntime::free_now(const Deferred& d) noexcept {
  if (d.pinned) {
    backend_->pinned_free(d.p);
    pinned_bytes_.give(d.bytes);
  } else {
    backend_->device_free(d.p, d.bytes, d.users);
    device_bytes_.give(d.bytes);
  }
}

void DeviceRuntime::drain_deferred() noexcept {
  std::vector<Deferred> todo;
  {
    std::lock_guard lk(deferred_mu_);
    todo.swap(deferred_);
  }
  for (const Deferred& d : todo) free_now(d);
}

namespace {
// Owns one allocation; frees it when the last tensor referring to it goes. (Constructed in
// place: a temporary's destructor would free the memory.)
struct Allocation final : StreamOrderedMemory {
  Allocation(std::shared_ptr<DeviceRuntime> d, void* ptr, std::size_t n, bool pin)
      : dev(std::move(d)), p(ptr), bytes(n), pinned(pin) {}
  Allocation(const Allocation&) = delete;
  Allocation& operator=(const Allocation&) = delete;
  void record_stream(void* s) override {
    std::lock_guard lk(mu);
    if (std::find(users.begin(), users.end(), s) == users.end()) users.push_back(s);
  }
  std::shared_ptr<DeviceRuntime> dev;
  void* p;
  std::size_t bytes;
  bool pinned;
  std::mutex mu;
  std::vector<void*> users;  // other streams using the memory (record_stream)
  ~Allocation() { dev->free(p, bytes, pinned, std::move(users)); }
};
}  // namespace

DeviceTensor DeviceRuntime::alloc(DType dtype, std::vector<std::int64_t> shape, Stream* s,
                                  const std::string& stage, std::uint64_t item) {
  drain_deferred();
  const std::size_t n = bytes_of(dtype, shape);
  if (faults_.active()) faults_.on_alloc(n, stage, item);
  device_bytes_.take(n, stage, item);
  void* p = nullptr;
  try {
    p = backend_->device_alloc(n, s);
  } catch (...) {
    device_bytes_.give(n);
    throw;
  }
  auto owner = std::make_shared<Allocation>(shared_from_this(), p, n, false);
  Allocation* ordered = owner.get();
  DeviceTensor t = DeviceTensor::wrap(p, dtype, std::move(shape), backend_->ordinal(), std::move(owner));
  t.ordered_ = ordered;
  return t;
}

HostTensor DeviceRuntime::alloc_pinned(DType dtype, std::vector<std::int64_t> shape,
                                       const std::string& stage, std::uint64_t item) {
  drain_deferred();
  const std::size_t n = bytes_of(dtype, shape);
  pinned_bytes_.take(n, stage, item);
  void* p = nullptr;
  try {
    p = backend_->pinned_alloc(n);
  } catch (...) {
    pinned_bytes_.give(n);
    throw;
  }
  auto owner = std::make_shared<Allocation>(shared_from_this(), p, n, true);
  return HostTensor::wrap(p, dtype, std::move(shape), std::move(owner), Memory::pinned);
}

namespace {
PublishedGraph published(const GpuAccount& a, const std::string& graph, int priority) {
  const GpuStats s = a.snapshot(steady_now_ns());
  return {graph, priority, s.bursts, s.held_ns, s.busy_ns, s.lease_wait_ns};
}
}  // namespace

void DeviceRuntime::track(const GpuAccount* account, std::string graph, int priority) {
  std::lock_guard lk(tracked_mu_);
  tracked_.push_back({account, std::move(graph), priority});
}

void DeviceRuntime::untrack(const GpuAccount* account) noexcept {
  std::lock_guard lk(tracked_mu_);
  for (auto it = tracked_.begin(); it != tracked_.end(); ++it) {
    if (it->account != account) continue;
    try {
      finished_.push_back(published(*it->account, it->graph, it->priority));
      if (finished_.size() > 16) finished_.pop_front();
    } catch (...) {
    }
    tracked_.erase(it);
    return;
  }
}

std::vector<PublishedGraph> DeviceRuntime::graph_figures() const {
  std::lock_guard lk(tracked_mu_);
  std::vector<PublishedGraph> out(finished_.begin(), finished_.end());
  for (const Tracked& t : tracked_) out.push_back(published(*t.account, t.graph, t.priority));
  return out;
}

DeviceStats DeviceRuntime::stats() const {
  DeviceStats s;
  s.name = backend_->name();
  s.backend = backend_->kind();
  s.wall_ns = steady_now_ns() - start_ns_;
  s.busy_ns = backend_->busy_ns();
  s.held_ns = pool_.held_ns();
  s.lease_time_ns = pool_.lease_time();
  s.streams = pool_.size();
  s.leases_in_use = pool_.in_use();
  s.max_leases_in_use = pool_.max_in_use();
  s.lease_waiters = pool_.waiters();
  s.leases = pool_.leases();
  s.lease_ns = pool_.lease_ns();
  s.device_bytes_in_use = device_bytes_.used();
  s.device_bytes_cap = device_bytes_.cap();
  s.pinned_bytes_in_use = pinned_bytes_.used();
  s.pinned_bytes_cap = pinned_bytes_.cap();
  s.injected = faults_.counts();
  return s;
}

// ---- FaultInjector -----------------------------------------------------------------------------

bool FaultInjector::draw(double p) noexcept {
  if (p <= 0) return false;
  std::lock_guard lk(mu_);
  return rng_.uniform() < p;
}

void FaultInjector::on_alloc(std::size_t bytes, const std::string& stage, std::uint64_t item) {
  if (!draw(f_.alloc_failure)) return;
  alloc_.fetch_add(1, std::memory_order_relaxed);
  throw Error(fmt::format("splitflow: injected device fault (DeviceConfig::faults.alloc_failure): "
                          "stage '{}', item {}: the allocation of {} bytes failed",
                          stage, item, bytes));
}

void FaultInjector::on_burst_end(Burst& b) {
  DeviceBackend& backend = b.device().backend();
  if (draw(f_.slow_kernel)) {
    slow_.fetch_add(1, std::memory_order_relaxed);
    backend.timed_kernel(b.stream(), f_.slow_by, b.exec_sink());
  }
  if (draw(f_.stall)) {
    stall_.fetch_add(1, std::memory_order_relaxed);
    backend.timed_kernel(b.stream(), f_.stall_for, nullptr);  // the stream waits; no work runs
  }
  if (!b.device_error() && draw(f_.burst_failure)) {
    burst_.fetch_add(1, std::memory_order_relaxed);
    b.set_device_error(std::make_exception_ptr(Error(fmt::format(
        "splitflow: injected device fault (DeviceConfig::faults.burst_failure): stage '{}', "
        "item {}: the burst's device work failed", b.stage(), b.item()))));
  }
}

DeviceStats::Injected FaultInjector::counts() const noexcept {
  DeviceStats::Injected c;
  c.alloc_failures = alloc_.load(std::memory_order_relaxed);
  c.burst_failures = burst_.load(std::memory_order_relaxed);
  c.slow_kernels = slow_.load(std::memory_order_relaxed);
  c.stalls = stall_.load(std::memory_order_relaxed);
  return c;
}

// ---- GpuAccount --------------------------------------------------------------------------------

void GpuAccount::lease_begin(std::int64_t t) noexcept {
  std::lock_guard lk(mu_);
  if (leases_++ == 0) held_since_ = t;
}
void GpuAccount::lease_end(std::int64_t t) noexcept {
  std::lock_guard lk(mu_);
  if (--leases_ == 0) s_.held_ns += t - held_since_;
}
void GpuAccount::exec_begin(std::int64_t t) noexcept {
  std::lock_guard lk(mu_);
  if (execs_++ == 0) exec_since_ = t;
}
void GpuAccount::exec_end(std::int64_t t) noexcept {
  std::lock_guard lk(mu_);
  if (--execs_ == 0) {
    s_.busy_ns += t - exec_since_;
    watermark_ = std::max(watermark_, t);
  }
}
void GpuAccount::exec_interval(std::int64_t t0, std::int64_t t1) noexcept {
  std::lock_guard lk(mu_);
  if (t1 <= watermark_) return;
  s_.busy_ns += t1 - std::max(t0, watermark_);
  watermark_ = t1;
}
void GpuAccount::copied(bool h2d, std::size_t bytes, std::int64_t ns) noexcept {
  std::lock_guard lk(mu_);
  (h2d ? s_.h2d_bytes : s_.d2h_bytes) += bytes;
  (h2d ? s_.h2d_ns : s_.d2h_ns) += ns;
}
void GpuAccount::waited(std::int64_t ns) noexcept {
  std::lock_guard lk(mu_);
  s_.lease_wait_ns += ns;
  s_.max_lease_wait_ns = std::max(s_.max_lease_wait_ns, ns);
}
void GpuAccount::staged() noexcept {
  std::lock_guard lk(mu_);
  ++s_.staging_copies;
}
void GpuAccount::burst() noexcept {
  std::lock_guard lk(mu_);
  ++s_.bursts;
}
void GpuAccount::reset() noexcept {
  std::lock_guard lk(mu_);
  leases_ = execs_ = 0;
  held_since_ = exec_since_ = watermark_ = 0;
  s_ = GpuStats{};
}
GpuStats GpuAccount::snapshot(std::int64_t now) const {
  std::lock_guard lk(mu_);
  GpuStats s = s_;
  if (leases_ > 0) s.held_ns += now - held_since_;
  if (execs_ > 0) s.busy_ns += now - exec_since_;
  return s;
}

// ---- Burst -----------------------------------------------------------------------------------

class Burst::Sink final : public ExecutionSink {
 public:
  explicit Sink(Burst& b) : b_(b) {}
  void exec_begin(std::int64_t t) override {
    if (b_.account_) b_.account_->exec_begin(t);
  }
  void exec_end(std::int64_t t) override {
    if (b_.account_) b_.account_->exec_end(t);
  }
  void exec_interval(std::int64_t t0, std::int64_t t1) override {
    if (b_.account_) b_.account_->exec_interval(t0, t1);
  }
  void copied(bool h2d, std::size_t bytes, std::int64_t ns) override {
    if (b_.account_) b_.account_->copied(h2d, bytes, ns);
  }
  void op_done(int kind, std::size_t bytes, std::int64_t t0, std::int64_t t1) override {
    if (!b_.observers_.any()) return;
    const DeviceOpEvent e{b_.observers_.graph, b_.stage_, b_.item_, b_.lease_->index,
                          static_cast<DeviceOpEvent::Kind>(kind), bytes, t0, t1};
    b_.observers_.each([&](Observer& o) { o.on_device_op(e); });
  }

 private:
  Burst& b_;
};

Burst::Burst(DeviceRuntime& dev, Lease* lease, GpuAccount* account, BurstObservers observers,
             const std::string& stage, std::uint64_t item)
    : dev_(&dev),
      lease_(lease),
      account_(account),
      observers_(observers),
      stage_(&stage),
      item_(item),
      sink_(std::make_unique<Sink>(*this)) {
  lease_->account = account;
  // Held from when the body starts enqueuing (now), not from when the pool granted the
  // stream: the hand-over to an arena thread in between is the runtime's, not the graph's.
  const std::int64_t now = steady_now_ns();
  if (account_) {
    account_->lease_begin(now);
    account_->burst();
  }
  if (observers_.any()) {
    const LeaseEvent e{observers_.graph, stage_, item_, lease_->index, now};
    observers_.each([&](Observer& o) { o.on_lease_acquire(e); });
  }
}

Burst::~Burst() = default;

Stream* Burst::stream() const noexcept { return lease_->stream; }
ExecutionSink* Burst::exec_sink() const noexcept { return sink_.get(); }

void Burst::begin() { timer_ = dev_->backend().burst_begin(lease_->stream); }

void Burst::end(std::function<void()> done, bool body_failed) {
  // Faults go only into bursts whose body ran (an item fails once: the counts are the faults
  // that took effect).
  if (!body_failed && dev_->faults().active()) dev_->faults().on_burst_end(*this);
  dev_->backend().burst_end(lease_->stream, timer_, [this, done = std::move(done)] {
    const std::int64_t now = steady_now_ns();
    if (account_) account_->lease_end(now);
    if (observers_.any()) {
      const LeaseEvent e{observers_.graph, stage_, item_, lease_->index, now};
      observers_.each([&](Observer& o) { o.on_lease_release(e); });
    }
    dev_->pool().release(lease_);
    done();  // may free this burst: nothing of it is touched after
  });
}

void Burst::settle() noexcept {
  dev_->backend().settle(timer_, sink_.get());
  timer_ = nullptr;
  std::vector<std::shared_ptr<void>> keep;
  {
    std::lock_guard lk(mu_);
    keep.swap(keep_);
  }
  keep.clear();  // sources of async copies: the work is done
  dev_->drain_deferred();
}

std::exception_ptr Burst::device_error() const {
  std::lock_guard lk(mu_);
  return device_error_;
}
void Burst::set_device_error(std::exception_ptr e) {
  std::lock_guard lk(mu_);
  if (!device_error_) device_error_ = std::move(e);
}
void Burst::keep_alive(std::shared_ptr<void> keep) {
  std::lock_guard lk(mu_);
  keep_.push_back(std::move(keep));
}

// ---- PinnedRing ------------------------------------------------------------------------------

struct PinnedRing::Block {
  std::size_t offset;
  std::size_t size;      // bytes the block occupies
  bool counted = false;  // in counted_ (pushed, or freed before it was pushed)
  bool freed = false;
};

namespace {
// The owner of a ring tensor: returns its block when the last tensor goes, and keeps the ring
// alive until then.
struct RingRef {
  RingRef(std::shared_ptr<PinnedRing> r, PinnedRing::Block* b) : ring(std::move(r)), block(b) {}
  RingRef(const RingRef&) = delete;
  RingRef& operator=(const RingRef&) = delete;
  ~RingRef() { ring->free_block(block); }
  std::shared_ptr<PinnedRing> ring;
  PinnedRing::Block* block;
};
constexpr std::size_t kRingAlign = 256;
std::size_t round_up(std::size_t n) { return (n + kRingAlign - 1) / kRingAlign * kRingAlign; }
}  // namespace

PinnedRing::PinnedRing(std::shared_ptr<DeviceRuntime> dev, std::string owner, std::size_t bytes,
                       std::size_t item_bytes, Side side)
    : dev_(std::move(dev)),
      owner_(std::move(owner)),
      side_(side),
      capacity_(round_up(bytes)),
      item_bytes_(round_up(item_bytes)) {
  if (item_bytes_ == 0 || capacity_ < 2 * item_bytes_)
    throw GraphError(fmt::format(
        "splitflow: stage '{}': its pinned {}ring needs at least twice its item size ({} ring, {} "
        "per item{})",
        owner_, side_ == Side::output ? "output " : "", mib(capacity_), mib(item_bytes_),
        side_ == Side::output ? ": GpuStageOptions::out_ring_bytes and out_ring_item_bytes" : ""));
  dev_->pinned_bytes().take(capacity_, owner_, 0);
  try {
    base_ = static_cast<unsigned char*>(dev_->backend().pinned_alloc(capacity_));
  } catch (...) {
    dev_->pinned_bytes().give(capacity_);
    throw;
  }
  created_ns_ = used_since_ = steady_now_ns();
}

void PinnedRing::used_changed_locked() noexcept {
  const std::int64_t now = steady_now_ns();
  used_area_ += static_cast<double>(used_) * static_cast<double>(now - used_since_);
  used_since_ = now;
}

PinnedRing::Figures PinnedRing::figures() const {
  std::lock_guard lk(mu_);
  const std::int64_t now = steady_now_ns();
  const double area = used_area_ + static_cast<double>(used_) * static_cast<double>(now - used_since_);
  return {max_used_, now > created_ns_ ? area / static_cast<double>(now - created_ns_) : 0.0,
          refusals_, wait_ns_ + (waiting_ ? now - waiting_since_ : 0), max_committed_};
}

void PinnedRing::reset_figures() {
  std::lock_guard lk(mu_);
  const std::int64_t now = steady_now_ns();
  created_ns_ = used_since_ = now;
  used_area_ = 0;
  max_used_ = used_;
  max_committed_ = counted_ + budget_items_ * item_bytes_;
  refusals_ = 0;
  wait_ns_ = 0;
  wraps_ = 0;
  if (waiting_) waiting_since_ = now;
}

void PinnedRing::committed_changed_locked() noexcept {
  max_committed_ = std::max(max_committed_, counted_ + budget_items_ * item_bytes_);
}

PinnedRing::~PinnedRing() {
  for (Block* b : blocks_) delete b;  // only wrap wastes can be left: tensors keep us alive
  dev_->free(base_, capacity_, /*pinned=*/true);
}

void PinnedRing::set_notifier(std::shared_ptr<SpaceNotifier> n) {
  std::lock_guard lk(mu_);
  notifier_ = std::move(n);
}

void PinnedRing::notify_if_waiting_locked(std::shared_ptr<SpaceNotifier>& out) {
  if (!waiting_) return;
  waiting_ = false;
  wait_ns_ += steady_now_ns() - waiting_since_;
  out = notifier_;
}

std::size_t PinnedRing::try_reserve(std::size_t want) {
  std::lock_guard lk(mu_);
  const std::size_t limit = capacity_ - item_bytes_;
  const std::size_t committed = counted_ + budget_items_ * item_bytes_;
  const std::size_t room = committed < limit ? (limit - committed) / item_bytes_ : 0;
  const std::size_t got = std::min(want, room);
  budget_items_ += got;
  committed_changed_locked();
  if (got == 0) {
    ++refusals_;
    if (!waiting_) waiting_since_ = steady_now_ns();
    waiting_ = true;
  }
  return got;
}

void PinnedRing::release(std::size_t n) {
  if (n == 0) return;
  std::shared_ptr<SpaceNotifier> notify;
  {
    std::lock_guard lk(mu_);
    budget_items_ -= n;
    notify_if_waiting_locked(notify);
  }
  if (notify) notify->notify();
}

std::size_t PinnedRing::alloc_offset_locked(std::size_t size) {
  // The live region is [tail, head), or [tail, capacity) + [0, head) once wrapped. head is
  // kept below capacity: a block ending exactly at the end moves it back to 0.
  used_changed_locked();
  const auto take = [&](std::size_t at) {
    head_ = at + size;
    if (head_ == capacity_) {  // ends exactly at the end: the head wraps with no waste
      head_ = 0;
      ++wraps_;
    }
    used_ += size;
    max_used_ = std::max(max_used_, used_);
    return at;
  };
  const bool wrapped = used_ > 0 && head_ <= tail_;
  if (!wrapped) {
    if (capacity_ - head_ >= size) return take(head_);
    if (tail_ >= size) {  // wrap: the end of the buffer is wasted until the tail passes it
      const std::size_t waste = capacity_ - head_;
      blocks_.push_back(new Block{head_, waste, false, true});
      used_ += waste;
      ++wraps_;
      return take(0);
    }
  } else if (tail_ - head_ >= size) {
    return take(head_);
  }
  throw Error(fmt::format(
      "splitflow: internal error: the pinned ring of '{}' has no contiguous room for {} bytes "
      "(head {}, tail {}, used {})",
      owner_, size, head_, tail_, used_));
}

namespace {
// "the pinned ring into 'gs'" or "the pinned output ring of 'gs'".
std::string ring_words(PinnedRing::Side side, const std::string& owner) {
  return side == PinnedRing::Side::output ? fmt::format("the pinned output ring of '{}'", owner)
                                          : fmt::format("the pinned ring into '{}'", owner);
}

[[noreturn]] void throw_over_item_size(const std::string& stage, std::uint64_t item, std::size_t n,
                                       DType dtype, const std::string& owner, std::size_t item_bytes,
                                       PinnedRing::Side side) {
  throw Error(fmt::format(
      "splitflow: stage '{}' item {}: its output ({} of {}) exceeds the item size of {} ({}); "
      "raise GpuStageOptions::{}",
      stage, item, mib(n), to_string(dtype), ring_words(side, owner), mib(item_bytes),
      side == PinnedRing::Side::output ? "out_ring_item_bytes" : "ring_item_bytes"));
}
}  // namespace

void PinnedRing::check_item(const HostTensor& t, const std::string& stage, std::uint64_t item) const {
  if (!t.contiguous())
    throw Error(fmt::format(
        "splitflow: stage '{}' item {}: a non-contiguous host tensor cannot go through {}",
        stage, item, ring_words(side_, owner_)));
  if (t.nbytes() > item_bytes_)
    throw_over_item_size(stage, item, t.nbytes(), t.dtype(), owner_, item_bytes_, side_);
}

HostTensor PinnedRing::allocate(DType dtype, std::vector<std::int64_t> shape,
                                const std::string& stage, std::uint64_t item) {
  const std::size_t n = bytes_of(dtype, shape);
  if (n > item_bytes_) throw_over_item_size(stage, item, n, dtype, owner_, item_bytes_, side_);
  Block* b;
  {
    std::lock_guard lk(mu_);
    const std::size_t size = round_up(std::max<std::size_t>(n, 1));
    const std::size_t at = alloc_offset_locked(size);
    b = new Block{at, size};
    blocks_.push_back(b);
    unpushed_[base_ + at] = b;
  }
  auto ref = std::make_shared<RingRef>(shared_from_this(), b);
  return HostTensor::wrap(base_ + b->offset, dtype, std::move(shape), std::move(ref),
                          Memory::pinned);
}

HostTensor PinnedRing::push(HostTensor t, bool& staged, const std::string& stage,
                            std::uint64_t item) {
  {
    std::lock_guard lk(mu_);
    auto it = unpushed_.find(t.raw());
    staged = it == unpushed_.end();
    if (!staged) {
      Block* b = it->second;
      unpushed_.erase(it);
      b->counted = true;
      counted_ += b->size;
      budget_items_ -= 1;
      return t;
    }
  }
  check_item(t, stage, item);
  HostTensor copy = allocate(t.dtype(), t.shape(), stage, item);
  std::memcpy(copy.raw(), t.raw(), t.nbytes());
  bool again = false;
  return push(std::move(copy), again, stage, item);
}

void PinnedRing::free_block(Block* b) noexcept {
  std::shared_ptr<SpaceNotifier> notify;
  {
    std::lock_guard lk(mu_);
    b->freed = true;
    if (!b->counted) {  // freed before it was pushed: it occupies space until reclaimed
      unpushed_.erase(base_ + b->offset);
      b->counted = true;
      counted_ += b->size;
      committed_changed_locked();
    }
    // Reclaim freed blocks (and the wrap waste) from the tail, in allocation order.
    used_changed_locked();
    while (!blocks_.empty() && blocks_.front()->freed) {
      Block* f = blocks_.front();
      blocks_.pop_front();
      used_ -= f->size;
      if (f->counted) counted_ -= f->size;
      tail_ = (f->offset + f->size) % capacity_;
      delete f;
    }
    notify_if_waiting_locked(notify);
  }
  if (notify) notify->notify();
}

std::size_t PinnedRing::bytes_in_use() const {
  std::lock_guard lk(mu_);
  return used_;
}
std::size_t PinnedRing::budgets() const {
  std::lock_guard lk(mu_);
  return budget_items_;
}
std::uint64_t PinnedRing::wraps() const {
  std::lock_guard lk(mu_);
  return wraps_;
}

}  // namespace splitflow::detail
