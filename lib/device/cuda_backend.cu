// CUDA backend: pooled non-blocking streams, a stream-ordered memory pool, pinned memory,
// completion by cudaLaunchHostFunc, burst timing by events. Every runtime call is checked; an
// error names the call, the device and (inside a GPU stage) the stage.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "backend.hpp"
#include "cuda_check.hpp"
#include "splitflow/core/error.hpp"

namespace splitflow::detail {

namespace {

// Occupies the device for `ns` nanoseconds: every block spins on the global timer, and the grid
// fills every SM, like one full-size kernel.
__global__ void spin_kernel(unsigned long long ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

}  // namespace

// A pooled stream. A CUDA stream's priority is fixed when it is created, so a pooled stream is a
// set of native streams, one per priority level it has been leased at (created on first use);
// `stream` is the one the current lease enqueues on (DeviceBackend::set_priority).
struct Stream {
  static constexpr int kMaxLevels = 8;
  cudaStream_t stream = nullptr;             // the current lease's
  cudaStream_t by_level[kMaxLevels] = {};    // [0]: the device's least priority (the default)
  int level = 0;                 // of `stream`
  std::atomic<int> want{0};      // the lease's level (set_priority), taken at its burst's start
  cudaEvent_t order = nullptr;  // a switch of level waits on it for the work enqueued before
};

namespace {

struct BurstEvents {
  cudaEvent_t start = nullptr;
  cudaEvent_t end = nullptr;
};

class CudaBackend final : public DeviceBackend {
 public:
  explicit CudaBackend(int ordinal) : ordinal_(ordinal) {
    int count = 0;
    SF_CUDA(cudaGetDeviceCount(&count), ordinal_);
    if (ordinal_ < 0 || ordinal_ >= count)
      throw Error(fmt::format("splitflow: CUDA device {} requested, {} present", ordinal_, count));
    SF_CUDA(cudaSetDevice(ordinal_), ordinal_);
    cudaDeviceProp prop{};
    SF_CUDA(cudaGetDeviceProperties(&prop, ordinal_), ordinal_);
    name_ = fmt::format("{} (sm_{}{}, {} SMs, device {})", prop.name, prop.major, prop.minor,
                        prop.multiProcessorCount, ordinal_);
    sms_ = prop.multiProcessorCount;
    int least = 0, greatest = 0;
    SF_CUDA(cudaDeviceGetStreamPriorityRange(&least, &greatest), ordinal_);
    least_ = least;
    levels_ = std::clamp(least - greatest + 1, 1, Stream::kMaxLevels);
    threads_per_sm_ = prop.maxThreadsPerMultiProcessor;
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = ordinal_;
    SF_CUDA(cudaMemPoolCreate(&pool_, &props), ordinal_);
    std::uint64_t keep = ~std::uint64_t{0};  // keep freed memory in the pool for reuse
    SF_CUDA(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep), ordinal_);
    SF_CUDA(cudaStreamCreateWithFlags(&free_stream_, cudaStreamNonBlocking), ordinal_);
    // Device time is measured against this event, recorded at a known host time.
    SF_CUDA(cudaEventCreate(&origin_), ordinal_);
    SF_CUDA(cudaEventRecord(origin_, free_stream_), ordinal_);
    SF_CUDA(cudaEventSynchronize(origin_), ordinal_);
    origin_ns_ = steady_now_ns();
  }

  ~CudaBackend() override {
    cudaSetDevice(ordinal_);
    for (BurstEvents* ev : spare_events_) destroy(ev);
    cudaStreamSynchronize(free_stream_);
    cudaStreamDestroy(free_stream_);
    cudaEventDestroy(origin_);
    cudaMemPoolDestroy(pool_);
  }

  BackendKind kind() const noexcept override { return BackendKind::cuda; }
  std::string name() const override { return name_; }
  int ordinal() const noexcept override { return ordinal_; }

  Stream* create_stream() override {
    SF_CUDA(cudaSetDevice(ordinal_), ordinal_);
    auto s = std::make_unique<Stream>();
    SF_CUDA(cudaStreamCreateWithPriority(&s->by_level[0], cudaStreamNonBlocking, least_), ordinal_);
    s->stream = s->by_level[0];
    if (cudaError_t e = cudaEventCreateWithFlags(&s->order, cudaEventDisableTiming); e != cudaSuccess) {
      cudaStreamDestroy(s->stream);
      throw_cuda_error(e, "cudaEventCreateWithFlags(&s->order, cudaEventDisableTiming)", ordinal_);
    }
    return s.release();
  }
  void destroy_stream(Stream* s) noexcept override {
    for (cudaStream_t st : s->by_level) {
      if (!st) continue;
      cudaStreamSynchronize(st);
      cudaStreamDestroy(st);
    }
    cudaEventDestroy(s->order);
    delete s;
  }
  /// A lease of a graph of priority `priority` (GraphOptions::priority: 0 the default, higher
  /// first) enqueues on a stream of the device's priority `least - min(priority, levels - 1)`
  /// (CUDA: a lower number is a higher priority; an H100/H200 has 6 levels, 0 to -5), so its
  /// kernels' blocks are scheduled before those of lower-priority streams that wait for SMs.
  /// Priorities at or below 0 share the least. Called under the pool's lock, possibly inside a
  /// device callback (a lease handed on as the last one completes), where the CUDA runtime must
  /// not be called: the level is only noted here and taken at the burst's start (use_level).
  void set_priority(Stream* s, int priority) noexcept override {
    s->want.store(std::clamp(priority, 0, levels_ - 1), std::memory_order_relaxed);
  }
  void* native(Stream* s) const noexcept override { return s->stream; }

  void copy(Stream* s, void* dst, const void* src, std::size_t bytes, bool h2d,
            ExecutionSink* sink) override {
    SF_CUDA(cudaMemcpyAsync(dst, src, bytes,
                            h2d ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, s->stream),
            ordinal_);
    if (sink) sink->copied(h2d, bytes, 0);  // time is part of the burst's event interval
  }
  void host_kernel(Stream*, std::function<void()>, ExecutionSink*) override {
    throw Error(
        "splitflow: DeviceContext::host_kernel() runs on the host backend only; on CUDA launch "
        "kernels on DeviceContext::native_stream()");
  }
  void timed_kernel(Stream* s, std::chrono::nanoseconds d, ExecutionSink*) override {
    const int block = threads_per_sm_ >= 1024 ? 1024 : threads_per_sm_;
    const int grid = sms_ * (threads_per_sm_ / block);
    spin_kernel<<<grid, block, 0, s->stream>>>(static_cast<unsigned long long>(d.count()));
    SF_CUDA(cudaGetLastError(), ordinal_);
  }
  void callback(Stream* s, std::function<void()> fn) override {
    auto* heap = new std::function<void()>(std::move(fn));
    SF_CUDA(cudaLaunchHostFunc(
                s->stream,
                [](void* p) {
                  std::unique_ptr<std::function<void()>> f(static_cast<std::function<void()>*>(p));
                  DeviceCallbackScope scope;  // no CUDA calls from here: frees are deferred
                  (*f)();
                },
                heap),
            ordinal_);
  }
  void* burst_begin(Stream* s) override {
    use_level(s);
    BurstEvents* ev = nullptr;
    {
      std::lock_guard lk(events_mu_);  // reused: two creates and two destroys less per burst
      if (!spare_events_.empty()) {
        ev = spare_events_.back();
        spare_events_.pop_back();
      }
    }
    if (!ev) {
      auto fresh = std::make_unique<BurstEvents>();
      SF_CUDA(cudaEventCreate(&fresh->start), ordinal_);
      note_cuda_call();
      if (cudaError_t e = cudaEventCreate(&fresh->end); e != cudaSuccess) {
        cudaEventDestroy(fresh->start);
        throw_cuda_error(e, "cudaEventCreate(&fresh->end)", ordinal_);
      }
      ev = fresh.release();
    }
    note_cuda_call();
    if (cudaError_t e = cudaEventRecord(ev->start, s->stream); e != cudaSuccess) {
      recycle(ev);
      throw_cuda_error(e, "cudaEventRecord(ev->start, s->stream)", ordinal_);
    }
    return ev;
  }
  void burst_end(Stream* s, void* timer, std::function<void()> done) override {
    if (auto* ev = static_cast<BurstEvents*>(timer)) SF_CUDA(cudaEventRecord(ev->end, s->stream), ordinal_);
    callback(s, std::move(done));  // host functions may not call CUDA: settle() reads the events
  }
  void settle(void* timer, ExecutionSink* sink) noexcept override {
    auto* ev = static_cast<BurstEvents*>(timer);
    if (!ev) return;
    float a = 0, b = 0;
    note_cuda_call();
    if (cudaEventElapsedTime(&a, origin_, ev->start) == cudaSuccess &&
        cudaEventElapsedTime(&b, origin_, ev->end) == cudaSuccess) {
      const std::int64_t t0 = origin_ns_ + static_cast<std::int64_t>(static_cast<double>(a) * 1e6);
      const std::int64_t t1 = origin_ns_ + static_cast<std::int64_t>(static_cast<double>(b) * 1e6);
      if (sink) {
        sink->exec_interval(t0, t1);
        sink->op_done(0, 0, t0, t1);
      }
      record_busy(t0, t1);
    }
    recycle(ev);
  }

  void* device_alloc(std::size_t bytes, Stream* s) override {
    void* p = nullptr;
    SF_CUDA(cudaMallocFromPoolAsync(&p, bytes, pool_, s->stream), ordinal_);
    return p;
  }
  void device_free(void* p, std::size_t, const std::vector<void*>& users) noexcept override {
    note_cuda_call();
    if (users.size() == 1) {
      // Freed in the order of the one other stream that used it (after its work so far), like
      // torch's record_stream; that stream's later work is not held up.
      if (cudaFreeAsync(p, static_cast<cudaStream_t>(users.front())) == cudaSuccess) return;
      cudaGetLastError();  // e.g. a stream already destroyed: fall back to a full device sync
      cudaDeviceSynchronize();
    } else {
      // Several users (rare): our free stream waits for each one's work so far. Later frees
      // queue behind it too, which only delays reuse.
      for (void* u : users) {
        cudaEvent_t ev = nullptr;
        if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) {
          cudaGetLastError();
          cudaDeviceSynchronize();
          break;
        }
        if (cudaEventRecord(ev, static_cast<cudaStream_t>(u)) == cudaSuccess)
          cudaStreamWaitEvent(free_stream_, ev, 0);
        else
          cudaDeviceSynchronize();
        cudaGetLastError();
        cudaEventDestroy(ev);
      }
    }
    cudaFreeAsync(p, free_stream_);
  }
  void* pinned_alloc(std::size_t bytes) override {
    void* p = nullptr;
    SF_CUDA(cudaHostAlloc(&p, bytes, cudaHostAllocPortable), ordinal_);
    return p;
  }
  void pinned_free(void* p) noexcept override { cudaFreeHost(p); }

  std::int64_t busy_ns() const override {
    std::lock_guard lk(mu_);
    return busy_;
  }

 private:
  // Moves the stream to the level its lease asked for (set_priority), on the thread that starts
  // the burst: work enqueued at the previous level runs first (an event orders the switch). If a
  // stream of the level cannot be created, the burst stays where it is: priority is a
  // preference, never an error.
  void use_level(Stream* s) noexcept {
    const int level = s->want.load(std::memory_order_relaxed);
    if (level == s->level) return;
    cudaStream_t& next = s->by_level[level];
    note_cuda_call();
    if (!next && (cudaSetDevice(ordinal_) != cudaSuccess ||
                  cudaStreamCreateWithPriority(&next, cudaStreamNonBlocking, least_ - level) !=
                      cudaSuccess)) {
      cudaGetLastError();
      next = nullptr;
      return;
    }
    if (cudaEventRecord(s->order, s->stream) != cudaSuccess ||
        cudaStreamWaitEvent(next, s->order, 0) != cudaSuccess) {
      cudaGetLastError();
      cudaStreamSynchronize(s->stream);  // (not expected) the order holds all the same
    }
    s->stream = next;
    s->level = level;
  }

  static void destroy(BurstEvents* ev) noexcept {
    cudaEventDestroy(ev->start);
    cudaEventDestroy(ev->end);
    delete ev;
  }
  // Keeps up to kSpareEvents pairs for later bursts (about the bursts in flight at once).
  void recycle(BurstEvents* ev) noexcept {
    {
      std::lock_guard lk(events_mu_);
      if (spare_events_.size() < kSpareEvents) {
        try {
          spare_events_.push_back(ev);
          return;
        } catch (...) {
        }
      }
    }
    destroy(ev);
  }
  static constexpr std::size_t kSpareEvents = 256;

  // Union of burst intervals, arriving roughly in start order (exact when they do).
  void record_busy(std::int64_t t0, std::int64_t t1) {
    std::lock_guard lk(mu_);
    if (t1 <= watermark_) return;
    busy_ += t1 - std::max(t0, watermark_);
    watermark_ = t1;
  }

  int ordinal_;
  std::string name_;
  int sms_ = 1;
  int threads_per_sm_ = 1024;
  int least_ = 0;   // the device's least stream priority (cudaDeviceGetStreamPriorityRange)
  int levels_ = 1;  // priority levels it has (least - greatest + 1)
  cudaMemPool_t pool_ = nullptr;
  cudaStream_t free_stream_ = nullptr;
  cudaEvent_t origin_ = nullptr;
  std::int64_t origin_ns_ = 0;
  std::mutex events_mu_;
  std::vector<BurstEvents*> spare_events_;
  mutable std::mutex mu_;
  std::int64_t watermark_ = 0;
  std::int64_t busy_ = 0;
};

}  // namespace

std::unique_ptr<DeviceBackend> make_cuda_backend(int ordinal) {
  return std::make_unique<CudaBackend>(ordinal);
}

int cuda_device_count() noexcept {
  int count = 0;
  note_cuda_call();
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device / no driver" error
    return 0;
  }
  return count;
}

namespace {
const CudaBackendEntry kCudaBackend{&make_cuda_backend, &cuda_device_count};
// Registers the backend as the program starts (the umbrella target links this file whole).
[[maybe_unused]] const bool kRegistered = register_cuda_backend(&kCudaBackend);
}  // namespace

}  // namespace splitflow::detail

namespace splitflow::detail {

void throw_cuda_error(cudaError_t err, const char* call, int device) {
  cudaGetLastError();  // clear a non-sticky error so the device stays usable for other graphs
  const std::string& stage = current_stage();
  throw Error(fmt::format("splitflow: CUDA error {} ({}) in {} on device {}{}", static_cast<int>(err),
                          cudaGetErrorString(err), call, device,
                          stage.empty() ? std::string() : fmt::format(" (stage '{}')", stage)));
}

}  // namespace splitflow::detail
