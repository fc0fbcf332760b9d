// DeviceContext and HostAllocator (the API GPU-stage and producer bodies see), and the entry
// points GPU-stage nodes use.
#include <fmt/format.h>

#include "device_runtime.hpp"
#include "splitflow/device/device.hpp"
#include "splitflow/core/error.hpp"

namespace splitflow {

namespace detail {

namespace {
thread_local const std::string* t_stage = nullptr;
const std::string kNoStage;
}  // namespace

void set_current_stage(const std::string* stage) noexcept { t_stage = stage; }
Burst& burst_of(const DeviceContext& ctx) noexcept { return *ctx.burst_; }
HostAllocator host_allocator(PinnedRing* ring, const std::string* stage, std::uint64_t item) noexcept {
  HostAllocator a;
  a.ring_ = ring;
  a.stage_ = stage;
  a.item_ = item;
  return a;
}
void check_ring_item(const PinnedRing& ring, const HostTensor& t, const std::string& stage,
                     std::uint64_t item) {
  ring.check_item(t, stage, item);
}
const std::string& current_stage() noexcept { return t_stage ? *t_stage : kNoStage; }

Lease* lease_or_wait(DeviceRuntime& dev, LeaseWaiter& w) { return dev.pool().acquire_or_wait(w); }
void withdraw_waiters(DeviceRuntime& dev, const void* owner) { dev.pool().withdraw(owner); }
BackendKind backend_of(const DeviceRuntime& dev) noexcept {
  return const_cast<DeviceRuntime&>(dev).backend().kind();
}
void account_waited(GpuAccount* a, std::int64_t ns) noexcept {
  if (a) a->waited(ns);
}
void account_staged(GpuAccount* a) noexcept {
  if (a) a->staged();
}

}  // namespace detail

namespace {
void check_same_size(const Tensor& dst, const Tensor& src, const detail::Burst& b) {
  if (dst.nbytes() != src.nbytes() || !dst.contiguous() || !src.contiguous())
    throw Error(fmt::format("splitflow: stage '{}' item {}: copy from {} to {} (copies need "
                            "contiguous tensors of the same byte size)",
                            b.stage(), b.item(), src.describe(), dst.describe()));
}
}  // namespace

BackendKind DeviceContext::backend() const noexcept { return detail::backend_of(burst_->device()); }
int DeviceContext::device() const noexcept { return burst_->device().backend().ordinal(); }
void* DeviceContext::native_stream() const noexcept {
  return burst_->device().backend().native(burst_->stream());
}
const std::string& DeviceContext::stage() const noexcept { return burst_->stage(); }
std::uint64_t DeviceContext::item() const noexcept { return burst_->item(); }

DeviceTensor DeviceContext::alloc(DType dtype, std::vector<std::int64_t> shape) {
  return burst_->device().alloc(dtype, std::move(shape), burst_->stream(), burst_->stage(),
                                burst_->item());
}

void DeviceContext::copy(DeviceTensor& dst, const HostTensor& src) {
  check_same_size(dst, src, *burst_);
  auto& dev = burst_->device();
  dev.backend().copy(burst_->stream(), dst.raw(), src.raw(), src.nbytes(), true,
                     burst_->exec_sink());
  // The source must live until the copy ran. The host backend drops it right after the copy (a
  // ring block returns then). On CUDA that would take a host function per copy, and CUDA runs
  // host functions one at a time on one thread: on an H200, small ring hand-offs were bound by
  // them (docs/benchmarks.md), so the burst keeps the source until it completes.
  if (dev.backend().kind() == BackendKind::cuda)
    burst_->keep_alive(src.owner());
  else
    dev.backend().callback(burst_->stream(), [keep = src] {});
  burst_->keep_alive(dst.owner());
}

void DeviceContext::copy(HostTensor& dst, const DeviceTensor& src) {
  check_same_size(dst, src, *burst_);
  burst_->device().backend().copy(burst_->stream(), dst.raw(), src.raw(), src.nbytes(), false,
                                  burst_->exec_sink());
  burst_->keep_alive(src.owner());
  burst_->keep_alive(dst.owner());
}

DeviceTensor DeviceContext::to_device(const HostTensor& src) {
  DeviceTensor d = alloc(src.dtype(), src.shape());
  copy(d, src);
  return d;
}

HostTensor DeviceContext::to_host(const DeviceTensor& src) {
  HostTensor h;
  if (detail::PinnedRing* ring = burst_->take_output_ring()) {
    h = ring->allocate(src.dtype(), src.shape(), burst_->stage(), burst_->item());
  } else {
    h = burst_->device().alloc_pinned(src.dtype(), src.shape(), burst_->stage(), burst_->item());
  }
  copy(h, src);
  return h;
}

void DeviceContext::host_kernel(std::function<void()> kernel) {
  detail::Burst* b = burst_;
  b->device().backend().host_kernel(
      b->stream(),
      [b, k = std::move(kernel)] {
        try {
          k();
        } catch (...) {
          b->set_device_error(std::current_exception());
        }
      },
      b->exec_sink());
}

HostTensor HostAllocator::empty(DType dtype, std::vector<std::int64_t> shape) {
  if (!ring_) return HostTensor::empty(dtype, std::move(shape));
  detail::PinnedRing* ring = std::exchange(ring_, nullptr);  // one ring tensor per item
  return ring->allocate(dtype, std::move(shape), *stage_, item_);
}

}  // namespace splitflow
