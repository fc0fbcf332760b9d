// Host backend: a device modelled on host threads. Streams are FIFOs of work; the head of each
// stream runs on an engine (compute slots, one H2D and one D2H copy engine), each engine served
// by its own threads taking ready work first come first served. Work of one stream runs in
// order, work of different streams overlaps as far as the engines allow, as on a GPU, and an
// engine with queued work goes from one op to the next without a thread hand-over (what keeps
// a copy engine saturated). Copies are real memcpys; a timed kernel holds its compute slot by
// waiting on a timer (no CPU burnt). Callbacks run in stream order on the thread that finished
// the op before them and hold the stream until they return, like cudaLaunchHostFunc. (A separate
// callback thread, as CUDA has, measured slower here: one more wake-up per callback on 2 cores.)
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "backend.hpp"
#include "splitflow/core/error.hpp"

namespace splitflow::detail {

namespace {

enum class OpKind { kernel, timed, copy, callback };

struct Op {
  OpKind kind;
  std::function<void()> fn;  // kernel body or callback
  std::chrono::nanoseconds duration{0};
  void* dst = nullptr;
  const void* src = nullptr;
  std::size_t bytes = 0;
  bool h2d = true;
  ExecutionSink* sink = nullptr;
  Stream* stream = nullptr;
  int priority = 0;  // its stream's when it became ready
};

}  // namespace

struct Stream {
  std::deque<Op> ops;    // under HostBackend::mu_
  bool running = false;  // someone owns the head: an engine runs it, or a thread its callbacks
  std::atomic<int> priority{0};  // of the burst that leased it (set_priority)
};

namespace {

class Engine {
 public:
  void push(Op* op) {
    {
      std::lock_guard lk(mu_);
      ready_.push_back(op);
    }
    cv_.notify_one();
  }
  /// The ready op of the highest priority, the oldest among equals (a kernel of a priority
  /// graph goes before kernels that became ready earlier, as on a high-priority CUDA stream).
  Op* pop() {
    std::unique_lock lk(mu_);
    cv_.wait(lk, [&] { return stop_ || !ready_.empty(); });
    if (ready_.empty()) return nullptr;
    auto best = ready_.begin();
    for (auto it = ready_.begin(); it != ready_.end(); ++it)
      if ((*it)->priority > (*best)->priority) best = it;
    Op* op = *best;
    ready_.erase(best);
    return op;
  }
  void stop() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op*> ready_;
  bool stop_ = false;
};

class HostBackend final : public DeviceBackend {
 public:
  HostBackend(int compute_slots, std::size_t cache_bytes)
      : slots_(compute_slots), cache_limit_(cache_bytes) {
    if (compute_slots < 1)
      throw Error("splitflow: host backend: host_compute_slots must be at least 1");
    for (int i = 0; i < compute_slots; ++i) threads_.emplace_back([this] { serve(compute_); });
    threads_.emplace_back([this] { serve(h2d_); });
    threads_.emplace_back([this] { serve(d2h_); });
  }

  ~HostBackend() override {
    compute_.stop();
    h2d_.stop();
    d2h_.stop();
    for (auto& t : threads_) t.join();
    for (auto& [size, blocks] : cache_)
      for (void* p : blocks) std::free(p);
  }

  BackendKind kind() const noexcept override { return BackendKind::host; }
  std::string name() const override {
    return fmt::format("host backend ({} compute slot{}, 2 copy engines)", slots_,
                       slots_ == 1 ? "" : "s");
  }
  int ordinal() const noexcept override { return 0; }

  Stream* create_stream() override { return new Stream(); }
  // Waits until no engine thread is still advancing the stream: the last callback (a burst's
  // completion) may let its owner destroy the runtime before the thread that ran it has
  // finished its bookkeeping.
  void destroy_stream(Stream* s) noexcept override {
    {
      std::unique_lock lk(mu_);
      idle_.wait(lk, [&] { return !s->running; });
    }
    delete s;
  }
  void* native(Stream*) const noexcept override { return nullptr; }
  void set_priority(Stream* s, int priority) noexcept override {
    s->priority.store(priority, std::memory_order_relaxed);
  }
  void set_compute_gate(ComputeGate* gate) noexcept override {
    gate_.store(gate, std::memory_order_release);
  }

  void copy(Stream* s, void* dst, const void* src, std::size_t bytes, bool h2d,
            ExecutionSink* sink) override {
    Op op{OpKind::copy, {}, {}, dst, src, bytes, h2d, sink, s};
    enqueue(s, std::move(op));
  }
  void host_kernel(Stream* s, std::function<void()> fn, ExecutionSink* sink) override {
    enqueue(s, Op{OpKind::kernel, std::move(fn), {}, nullptr, nullptr, 0, true, sink, s});
  }
  void timed_kernel(Stream* s, std::chrono::nanoseconds d, ExecutionSink* sink) override {
    enqueue(s, Op{OpKind::timed, {}, d, nullptr, nullptr, 0, true, sink, s});
  }
  void callback(Stream* s, std::function<void()> fn) override {
    enqueue(s, Op{OpKind::callback, std::move(fn), {}, nullptr, nullptr, 0, true, nullptr, s});
  }
  void* burst_begin(Stream*) override { return nullptr; }  // executions are reported per op
  void burst_end(Stream* s, void*, std::function<void()> done) override {
    callback(s, std::move(done));
  }
  void settle(void*, ExecutionSink*) noexcept override {}

  // Size classes of powers of two, freed blocks kept for reuse: like a stream-ordered device
  // pool, allocation in steady state costs no system call and no page faults.
  void* device_alloc(std::size_t bytes, Stream*) override {
    const std::size_t size = size_class(bytes);
    {
      std::lock_guard lk(cache_mu_);
      auto it = cache_.find(size);
      if (it != cache_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        cached_ -= size;
        return p;
      }
    }
    return aligned(64, size);
  }
  // `users`: no other library runs work on host-backend memory in another order.
  void device_free(void* p, std::size_t bytes, const std::vector<void*>&) noexcept override {
    const std::size_t size = size_class(bytes);
    {
      std::lock_guard lk(cache_mu_);
      if (cached_ + size <= cache_limit_) {
        try {
          cache_[size].push_back(p);
          cached_ += size;
          return;
        } catch (...) {  // no room to remember it: free it
        }
      }
    }
    std::free(p);
  }
  void* pinned_alloc(std::size_t bytes) override { return aligned(4096, bytes); }
  void pinned_free(void* p) noexcept override { std::free(p); }

  std::int64_t busy_ns() const override {
    std::lock_guard lk(busy_mu_);
    return busy_ + (active_ > 0 ? steady_now_ns() - busy_since_ : 0);
  }

 private:
  static std::size_t size_class(std::size_t bytes) {
    std::size_t size = 256;
    while (size < bytes) size <<= 1;
    return size;
  }

  static void* aligned(std::size_t alignment, std::size_t bytes) {
    const std::size_t size = (std::max<std::size_t>(bytes, 1) + alignment - 1) / alignment * alignment;
    void* p = std::aligned_alloc(alignment, size);
    if (!p) throw std::bad_alloc();
    return p;
  }

  void enqueue(Stream* s, Op&& op) {
    {
      std::lock_guard lk(mu_);
      s->ops.push_back(std::move(op));
      if (s->running) return;  // the stream's current owner will get to it
      s->running = true;
    }
    advance(s);
  }


  // Called by the owner of the stream's head (running == true) with no lock held: runs the
  // callbacks at the head in order, then hands the next op to its engine.
  void advance(Stream* s) {
    for (;;) {
      std::function<void()> callback;
      {
        std::lock_guard lk(mu_);
        if (s->ops.empty()) {
          s->running = false;
          idle_.notify_all();
          return;
        }
        Op& head = s->ops.front();  // deque: stable while it stays at the front
        if (head.kind != OpKind::callback) {
          Engine& e = head.kind == OpKind::copy ? (head.h2d ? h2d_ : d2h_) : compute_;
          head.priority = s->priority.load(std::memory_order_relaxed);
          e.push(&head);
          return;
        }
        callback = std::move(head.fn);
        s->ops.pop_front();
      }
      callback();
    }
  }

  void serve(Engine& engine) {
    while (Op* op = engine.pop()) {
      Stream* s = op->stream;
      // On a device shared with other processes, a kernel first takes its place on it.
      ComputeGate* gate = op->kind == OpKind::copy ? nullptr : gate_.load(std::memory_order_acquire);
      if (gate) gate->enter(op->priority);
      std::int64_t t0 = 0, t1 = 0;
      {
        t0 = steady_now_ns();
        active_begin(t0);
        if (op->sink) op->sink->exec_begin(t0);
        switch (op->kind) {
          case OpKind::kernel:
            op->fn();  // wrapped by DeviceContext: errors go to the burst
            break;
          case OpKind::timed:
            std::this_thread::sleep_until(std::chrono::steady_clock::now() + op->duration);
            break;
          case OpKind::copy:
            std::memcpy(op->dst, op->src, op->bytes);
            break;
          case OpKind::callback:
            break;
        }
        t1 = steady_now_ns();
        if (op->sink) {
          if (op->kind == OpKind::copy) op->sink->copied(op->h2d, op->bytes, t1 - t0);
          op->sink->op_done(op->kind == OpKind::copy ? (op->h2d ? 1 : 2) : 0, op->bytes, t0, t1);
          op->sink->exec_end(t1);
        }
        active_end(t1);
      }
      if (gate) gate->leave(t0, t1);
      {
        std::lock_guard lk(mu_);
        s->ops.pop_front();  // `op` is gone from here on
      }
      advance(s);
    }
  }

  void active_begin(std::int64_t t) {
    std::lock_guard lk(busy_mu_);
    if (active_++ == 0) busy_since_ = t;
  }
  void active_end(std::int64_t t) {
    std::lock_guard lk(busy_mu_);
    if (--active_ == 0) busy_ += t - busy_since_;
  }

  const int slots_;
  const std::size_t cache_limit_;
  std::mutex cache_mu_;
  std::map<std::size_t, std::vector<void*>> cache_;
  std::size_t cached_ = 0;
  std::mutex mu_;  // every stream's ops
  std::condition_variable idle_;  // a stream stopped running
  Engine compute_, h2d_, d2h_;
  std::vector<std::thread> threads_;
  std::atomic<ComputeGate*> gate_{nullptr};
  mutable std::mutex busy_mu_;
  int active_ = 0;
  std::int64_t busy_since_ = 0;
  std::int64_t busy_ = 0;
};

}  // namespace

std::unique_ptr<DeviceBackend> make_host_backend(int compute_slots, std::size_t cache_bytes) {
  return std::make_unique<HostBackend>(compute_slots, cache_bytes);
}

}  // namespace splitflow::detail
