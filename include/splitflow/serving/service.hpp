// Services: graphs that answer requests. Any thread submits an item and gets a future for that
// item's result at the graph's end; admission is bounded; a request may carry a deadline.
//
//     splitflow::Graph g(rt, "classifier");
//     auto svc = g.service<Image, Label>("requests", {.max_pending = 256,
//                                                     .admission = Admission::fail_fast});
//     auto prep  = g.stage("prep", preprocess, {.concurrency = 4, .on_error = OnError::skip});
//     auto model = g.gpu_stage("model", infer);
//     svc.source() >> prep >> model >> svc.sink();
//     auto run = g.run();
//     std::future<Label> f = svc.submit(img, std::chrono::steady_clock::now() + 50ms);
//     ...
//     svc.close();  // no more requests: the run ends once every admitted one is answered
//     run.wait();
//
// Every future completes exactly once: with the result; with a StageError naming the graph,
// the stage and the request when a stage failed on its item (OnError::skip: the other requests
// go on; the body's own exception nested: std::rethrow_if_nested); with DeadlineError when its
// deadline passed before a GPU stage took it; or with an Error when the run ends first (cancel,
// a failing stage, the graph destroyed). Every one is a splitflow::Error.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include "splitflow/core/error.hpp"
#include "splitflow/executor/graph.hpp"
#include "splitflow/telemetry/export.hpp"  // to_json(ServiceStats), for users of services
#include "splitflow/telemetry/stats.hpp"

namespace splitflow {


namespace detail {

/// The requests in flight, by sequence number (the items' ids inside the graph).
template <class Out>
class RequestBook final : public ItemTracker {
 public:
  using Clock = std::chrono::steady_clock;

  /// `runtime`: the graph's (GraphCore::runtime_core()), to tell its threads.
  RequestBook(std::string graph, std::string name, ServiceOptions opts,
              const RuntimeCore* runtime = nullptr)
      : graph_(std::move(graph)), name_(std::move(name)), opts_(opts), runtime_(runtime) {
    if (opts_.max_pending == 0)
      throw GraphError("splitflow: service '" + name_ + "': max_pending must be at least 1");
  }

  /// Completes a request instead of its future (Service::submit with a callback): called once,
  /// on the thread that answers or fails it, with the result or the error (the other null).
  using Callback = std::function<void(Out* result, std::exception_ptr error)>;

  /// Admits a request: its id and future. Waits or throws OverloadedError when full.
  std::pair<std::uint64_t, std::future<Out>> admit(std::optional<Clock::time_point> deadline) {
    std::unique_lock lk(mu_);
    Pending& p = admit_locked(lk, deadline);
    return {p.id, p.promise.get_future()};
  }
  /// Admits a request completed through `done` instead of a future.
  std::uint64_t admit(std::optional<Clock::time_point> deadline, Callback done) {
    std::unique_lock lk(mu_);
    Pending& p = admit_locked(lk, deadline);
    p.done = std::move(done);
    return p.id;
  }

 private:
  struct Pending;
  Pending& admit_locked(std::unique_lock<std::mutex>& lk,
                        std::optional<Clock::time_point> deadline) {
    if (pending_.size() >= opts_.max_pending) {
      if (opts_.admission == Admission::fail_fast) {
        ++stats_.rejected;
        throw OverloadedError("splitflow: service '" + name_ + "' of graph '" + graph_ +
                              "' is overloaded: " + std::to_string(opts_.max_pending) +
                              " requests pending (ServiceOptions::max_pending; Python: "
                              "g.service(max_pending=))");
      }
      // A thread of the graph's runtime (a completion callback submitting the next request,
      // a stage body) would wait for room that only the runtime's threads make: once every
      // thread waits so, nothing is answered (a new C++ user's trial hung so).
      if (runtime_ && GraphCore::in_task_of(runtime_)) {
        ++stats_.rejected;
        throw OverloadedError(
            "splitflow: service '" + name_ + "' of graph '" + graph_ + "' is full (" +
            std::to_string(opts_.max_pending) + " requests pending, ServiceOptions::max_pending; Python: "
            "g.service(max_pending=)) and submit() was called from a thread of the graph's runtime (a completion "
            "callback, a stage body): waiting there for room would hold a thread that answers "
            "the pending requests, and once every thread waits so nothing is answered; submit "
            "from a thread of your own (hand the next request to it from the callback), or "
            "retry later");
      }
      const auto room = [&] { return pending_.size() < opts_.max_pending; };
      // A request with a deadline waits for room until its deadline, then is refused: its
      // submitter asked for an answer by then, and waiting longer could only fail it later.
      if (deadline && *deadline != Clock::time_point::max()) {
        if (!cv_.wait_until(lk, *deadline, room)) {
          ++stats_.rejected;
          throw DeadlineError("splitflow: service '" + name_ + "' of graph '" + graph_ +
                              "': the request's deadline passed while it waited for admission (" +
                              std::to_string(opts_.max_pending) +
                              " requests pending, ServiceOptions::max_pending; Python: "
                              "g.service(max_pending=)); it was not admitted");
        }
      } else {
        cv_.wait(lk, room);
      }
    }
    const std::uint64_t id = next_++;
    Pending& p = pending_[id];
    p.id = id;
    p.deadline = deadline;
    p.submitted = Clock::now();
    ++stats_.submitted;
    return p;
  }
  // Without mu_. A callback's exception is not the run's: it is dropped.
  static void complete(Pending& p, Out* value, std::exception_ptr error) noexcept {
    if (p.done) {
      try {
        p.done(value, std::move(error));
      } catch (...) {
      }
    } else if (value) {
      try {
        p.promise.set_value(std::move(*value));
      } catch (...) {  // (a copy of Out that throws: the future gets that error)
        p.promise.set_exception(std::current_exception());
      }
    } else {
      p.promise.set_exception(std::move(error));
    }
  }

 public:

  /// Takes back an admitted request that never entered the graph (its graph was not running
  /// or its service closed), without completing it: its submitter gets the error by an
  /// exception instead, and it counts as rejected, not submitted (nothing was admitted).
  /// False when the request was completed already (the run ended between its admission and
  /// its push, and fail_all failed it): its future or callback has its error, and nothing
  /// is to be thrown.
  /// `reuse_id`: the request never reached the graph (its push was refused), so its id is
  /// taken back when no later one was given (a request's id is its item number in the graph's
  /// errors: a refused submit made the next request's off by one). Not after a push that
  /// threw: it may have queued the item.
  bool withdraw(std::uint64_t id, bool reuse_id = false) noexcept {
    std::lock_guard lk(mu_);
    if (!pending_.erase(id)) return false;
    if (reuse_id && id + 1 == next_) --next_;
    --stats_.submitted;
    ++stats_.rejected;
    cv_.notify_one();
    return true;
  }

  void answer(std::uint64_t id, Out&& value) {
    std::unique_lock lk(mu_);
    auto it = pending_.find(id);
    if (it == pending_.end()) return;  // answered already (e.g. a copy through a fan-out)
    Pending p = std::move(it->second);
    pending_.erase(it);
    ++stats_.answered;
    record_split(p);
    cv_.notify_one();
    lk.unlock();
    complete(p, &value, nullptr);
  }

  void fail(std::uint64_t id, std::exception_ptr error, bool expired = false) noexcept {
    std::unique_lock lk(mu_);
    batches_.erase(id);  // a batch failing whole fails its first request last
    auto it = pending_.find(id);
    if (it == pending_.end()) return;
    Pending p = std::move(it->second);
    pending_.erase(it);
    ++(expired ? stats_.expired : stats_.failed);
    cv_.notify_one();
    lk.unlock();
    complete(p, nullptr, std::move(error));
  }

  /// The run ended: every request still pending fails.
  void fail_all(bool stopped) noexcept {
    std::unordered_map<std::uint64_t, Pending> left;
    {
      std::lock_guard lk(mu_);
      left.swap(pending_);
      batches_.clear();
      stats_.failed += left.size();
      cv_.notify_all();
    }
    for (auto& [id, p] : left)
      complete(p, nullptr, std::make_exception_ptr(
          Error("splitflow: service '" + name_ + "' of graph '" + graph_ + "': the run " +
                (stopped ? "was cancelled or failed" : "ended") + " before request " +
                std::to_string(id) + " was answered")));
  }

  ServiceStats stats() const {
    std::lock_guard lk(mu_);
    ServiceStats s = stats_;
    s.graph = graph_;
    s.service = name_;
    s.pending = pending_.size();
    return s;
  }

  // ItemTracker
  void item_failed(std::uint64_t seq, const std::string& stage,
                   std::exception_ptr error) noexcept override {
    fail(seq, request_error(seq, stage, std::move(error)));
  }
  void waited(std::uint64_t seq, std::int64_t ns) noexcept override {
    add(seq, &Pending::queue_ns, ns);
  }
  void on_device(std::uint64_t seq, std::int64_t ns) noexcept override {
    add(seq, &Pending::gpu_ns, ns);
  }
  void batched(std::uint64_t seq, const std::vector<std::uint64_t>& ids,
               const std::vector<std::int64_t>& waits) noexcept override {
    std::lock_guard lk(mu_);
    for (std::size_t i = 0; i < ids.size() && i < waits.size(); ++i)
      if (auto it = pending_.find(ids[i]); it != pending_.end()) it->second.batch_ns += waits[i];
    try {
      batches_[seq] = ids;
    } catch (...) {  // out of memory: the batch's later times go to its first request only
    }
  }
  void unbatched(std::uint64_t seq) noexcept override {
    std::lock_guard lk(mu_);
    batches_.erase(seq);
  }
  bool expired(std::uint64_t seq) noexcept override {
    std::lock_guard lk(mu_);
    // A formed batch goes on whole: its requests' deadlines were checked as it formed, and
    // its number is its first request's, whose deadline is not the batch's.
    if (batches_.count(seq)) return false;
    auto it = pending_.find(seq);
    return it != pending_.end() && it->second.deadline && Clock::now() > *it->second.deadline;
  }
  void item_expired(std::uint64_t seq, const std::string& stage) noexcept override {
    fail(seq,
         std::make_exception_ptr(DeadlineError("splitflow: service '" + name_ + "' of graph '" +
                                                  graph_ + "': request " + std::to_string(seq) +
                                                  " exceeded its deadline before stage '" + stage +
                                                  "' (dropped unprocessed)")),
         true);
  }

 private:
  struct Pending {
    std::uint64_t id = 0;
    std::promise<Out> promise;
    Callback done;  // set: completes the request instead of the promise
    std::optional<Clock::time_point> deadline;
    Clock::time_point submitted;
    std::int64_t queue_ns = 0, batch_ns = 0, gpu_ns = 0;
  };

  // A request's error is a StageError naming the graph, the stage and the request, with the
  // body's own exception nested (it was the body's exception itself, which a client catching
  // splitflow::Error, as the examples do, let through: a new C++ user's trial); splitflow's
  // own StageError and DeadlineError stay as they are.
  std::exception_ptr request_error(std::uint64_t seq, const std::string& stage,
                                   std::exception_ptr error) const noexcept {
    try {
      try {
        std::rethrow_exception(error);
      } catch (const StageError&) {
        return error;
      } catch (const DeadlineError&) {
        return error;
      } catch (const std::exception& e) {
        std::throw_with_nested(StageError(graph_, stage, seq, e.what()));
      } catch (...) {
        std::throw_with_nested(StageError(graph_, stage, seq, "unknown exception"));
      }
    } catch (const StageError&) {
      return std::current_exception();
    } catch (...) {  // no memory for it: the error as it was
    }
    return error;
  }

  // Adds ns to item seq's request, or to each request of the batch seq.
  void add(std::uint64_t seq, std::int64_t Pending::*field, std::int64_t ns) noexcept {
    std::lock_guard lk(mu_);
    if (auto b = batches_.find(seq); b != batches_.end()) {
      for (std::uint64_t id : b->second)
        if (auto it = pending_.find(id); it != pending_.end()) it->second.*field += ns;
    } else if (auto it = pending_.find(seq); it != pending_.end()) {
      it->second.*field += ns;
    }
  }

  // Under mu_. The parts come from two clocks (ticks, steady_clock): `other` absorbs the
  // rounding, never below zero.
  void record_split(const Pending& p) noexcept {
    const auto clamp = [](std::int64_t v) { return static_cast<std::uint64_t>(v > 0 ? v : 0); };
    const std::int64_t total =
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - p.submitted).count();
    stats_.latency.record(clamp(total));
    stats_.queueing.record(clamp(p.queue_ns));
    stats_.batching.record(clamp(p.batch_ns));
    stats_.gpu.record(clamp(p.gpu_ns));
    stats_.other.record(clamp(total - p.queue_ns - p.batch_ns - p.gpu_ns));
  }
  std::string graph_, name_;
  ServiceOptions opts_;
  const RuntimeCore* runtime_ = nullptr;  // only compared (in_task_of): may be gone
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<std::uint64_t, Pending> pending_;
  // Dynamic batches in flight: their item number -> their requests (batched .. unbatched).
  std::unordered_map<std::uint64_t, std::vector<std::uint64_t>> batches_;
  std::uint64_t next_ = 0;
  ServiceStats stats_;
};

template <class In>
class PushSourceNode;

/// A Service's hold on its source node, which its Graph owns: a Service (a copy kept by a
/// client thread) may outlive the Graph; the node clears `node` as it is destroyed, under
/// `mu`, which submit() holds shared while it pushes.
template <class In>
struct SourceLink {
  std::shared_mutex mu;
  // Set before the node takes `mu` to go: submits that come after do not take it shared (with
  // a reader-preferring lock, clients retrying in a loop could keep the node from going).
  std::atomic<bool> going{false};
  PushSourceNode<In>* node = nullptr;  // null once the graph is destroyed
  std::string graph, name;             // for errors naming them after that
};

/// The service's source: requests pushed by submit(), emitted in arrival order. It keeps the
/// run open until close() (or a cancel).
template <class In>
class PushSourceNode final : public Emitter<In> {
 public:
  PushSourceNode(GraphCore& g, std::string name)
      : Emitter<In>(g, std::move(name), StageKind::source, StageOptions{}, 0),
        link_(std::make_shared<SourceLink<In>>()) {
    link_->node = this;
    link_->graph = g.name();
    link_->name = this->name();
  }
  ~PushSourceNode() override {
    link_->going.store(true);
    std::unique_lock lk(link_->mu);  // waits for submits pushing now
    link_->node = nullptr;
  }

  const std::shared_ptr<SourceLink<In>>& link() const { return link_; }

  void set_on_end(std::function<void(bool)> f) { on_end_ = std::move(f); }

  /// False when the run is not accepting requests (not started, closed, stopping).
  bool push(In value, std::uint64_t id) {
    WorkList w;
    const Ticks now = now_ticks();
    {
      std::lock_guard lk(this->mu_);
      if (!accepting_ || this->graph().stopping()) return false;
      // A request its GPU stage's pinned ring cannot take (over ring_item_bytes, not
      // contiguous) is refused to its submitter here, with the reason: inside the run it would
      // fail the run, whatever the stages' OnError (a source's item), and every other client's
      // requests with it. (Under the lock, accepting: the ring is this run's, replaced only
      // between runs.)
      if constexpr (std::is_same_v<In, HostTensor>)
        if (PinnedRing* ring = this->output_ring()) check_ring_item(*ring, value, this->name(), id);
      queue_.push_back(Queued{Envelope<In>{std::move(value), id}, now});
      this->collect_claims_locked(w);
      this->refresh_state_locked();
    }
    this->graph().dispatch_external(w);
    return true;
  }

  void close() {
    WorkList w;
    bool release = false;
    {
      std::lock_guard lk(this->mu_);
      // Before the graph's first run, or as a run starts (its units not counted yet): that
      // run starts closed (a close() lost here left the run open until a cancel; one released
      // the source's unit before the run had counted it, and the run never ended). After a
      // run ended it closes nothing: that run is over, and the next one is open (a close()
      // meant for a run that a failure or a cancel ended first must not end its restart).
      if (phase_ == Phase::starting || (phase_ == Phase::idle && !ran_)) {
        closed_early_ = true;
        return;
      }
      if (phase_ == Phase::idle) return;
      accepting_ = false;
      release = std::exchange(holds_unit_, false);
      this->maybe_close_locked(w);
    }
    if (release) {
      this->graph().dispatch_external(w);
      this->graph().release_unit();
    }
  }

  /// Why push() takes no request now, for the submitter's error. (A submitter that waited for
  /// room until a cancel ended the run was told "call run() first": a new C++ user's trial.)
  std::string refusal() {
    std::lock_guard lk(this->mu_);
    if (!ran_) return "its graph is not running (call run() first) or the service was closed";
    if (phase_ == Phase::starting)
      return "its graph's run is starting (submit once run() has returned)";
    if (phase_ == Phase::running && !accepting_ && !this->graph().stopping())
      return "the service was closed (its run ends once every request taken is answered; run() "
             "the graph again to serve again)";
    // (After its Runtime's destruction it said "run() the graph again", which then threw: a
    // new C++ user's trial.)
    if (this->graph().ended_by_runtime())
      return "its graph's Runtime was destroyed, which ended the run; the graph cannot run again "
             "(a new Runtime and graph can serve)";
    return "its graph's run ended (it finished, was cancelled or failed) or is ending; run() the "
           "graph again to serve again";
  }

  void reset(Ticks start, bool telemetry, std::size_t parallelism) override {
    Emitter<In>::reset(start, telemetry, parallelism);
    std::lock_guard lk(this->mu_);
    queue_.clear();
    accepting_ = false;  // until begin_run(): the run's units are counted then
    holds_unit_ = true;
    phase_ = Phase::starting;
    ran_ = true;
  }

  void begin_run() override {
    std::lock_guard lk(this->mu_);
    phase_ = Phase::running;
    accepting_ = !std::exchange(closed_early_, false);  // closed: poke() ends it
  }

  /// The run's first task: a run that starts closed releases its unit here and ends once
  /// nothing is left (no request was admitted).
  void poke(WorkList& w) override {
    bool release = false;
    {
      std::lock_guard lk(this->mu_);
      if (phase_ == Phase::running && !accepting_ && holds_unit_) {
        release = std::exchange(holds_unit_, false);
        this->maybe_close_locked(w);
      }
    }
    Emitter<In>::poke(w);
    if (release) this->graph().release_unit();  // (the calling task holds a unit of its own)
  }

  /// Takes up to k pushed requests, in arrival order.
  void run_claim(WorkList& w, std::size_t k) override {
    Scratch<Envelope<In>> out;
    Scratch<Arrivals> arrivals;
    this->claim(
        w, k,
        [&](Ticks) {
          const std::size_t n = std::min(k, queue_.size());
          for (std::size_t i = 0; i < n; ++i) {
            out->push_back(std::move(queue_.front().item));
            arrivals->push_back({1, queue_.front().pushed});
            queue_.pop_front();
          }
          return Taken{.items = n, .tickets = 0, .announced = n,
                       .first = n ? out->front().seq : 0};
        },
        [&](const ClaimInfo&, Ticks t0) {
          report_waits(this->graph(), *out, *arrivals, t0);  // admitted, not yet taken
          const std::size_t n = out->size();
          if (n < k) this->graph().retire_items(k - n, w);  // admitted, not taken (a cancel)
          return ClaimResult{.emitted = this->emit(0, n, *out, w), .items = n};
        });
  }

  /// The run is stopping (cancelled, or failed): every request still pending fails now, not
  /// when the run's last body returns (a new user's trial: requests queued behind a body of
  /// 10 s failed 10 s after Run::cancel()). Results that come later find no request; a
  /// request whose own error failed the run had it first (absorb_error).
  void drop_queued(WorkList& w) override {
    Emitter<In>::drop_queued(w);
    bool release = false;
    {
      std::lock_guard lk(this->mu_);
      accepting_ = false;
      queue_.clear();
      release = std::exchange(holds_unit_, false);
    }
    if (on_end_) on_end_(true);
    if (release) this->graph().release_unit();
  }

  void end_of_stream() override {
    {
      std::lock_guard lk(this->mu_);
      accepting_ = false;
      queue_.clear();
      phase_ = Phase::idle;
    }
    if (on_end_) on_end_(this->graph().stopping());
  }

 protected:
  std::size_t ready_locked() const override { return queue_.size(); }
  std::size_t admit_locked(std::size_t want) override {
    return this->graph().try_admit(*this, want);
  }
  void unadmit_locked(std::size_t n, WorkList& w) override { this->graph().retire_items(n, w); }
  // (Never paced: a graph with a service has no other source. Were it, this counts its items.)
  void admitted_locked(std::size_t n, WorkList& w) override { this->graph().admitted(*this, n, w); }
  bool inputs_done_locked() const override { return !accepting_ && queue_.empty(); }

 private:
  struct Queued {
    Envelope<In> item;
    Ticks pushed;
  };
  std::deque<Queued> queue_;  // under mu_; bounded by the book's max_pending
  enum class Phase { idle, starting, running };
  bool accepting_ = false;
  bool holds_unit_ = false;
  Phase phase_ = Phase::idle;  // under mu_
  bool closed_early_ = false;  // under mu_: close() before the first run or as one starts
  bool ran_ = false;           // under mu_: a run has started (reset)
  std::function<void(bool)> on_end_;
  std::shared_ptr<SourceLink<In>> link_;
};

/// The service's sink: answers each item's request.
template <class Out>
class AnswerSinkNode final : public OneInputNode<AnswerSinkNode<Out>, NodeBase, Out> {
 public:
  AnswerSinkNode(GraphCore& g, std::string name, std::shared_ptr<RequestBook<Out>> book)
      : AnswerSinkNode::OneInputNode(g, std::move(name), StageKind::sink,
                                     StageOptions{Concurrency::unlimited, Order::out_of_order, 0},
                                     1),
        book_(std::move(book)) {}

  bool answers_requests() const noexcept override { return true; }

  ClaimResult process(std::vector<Envelope<Out>>& in, const ClaimInfo&, WorkList& w) {
    for (auto& item : in) book_->answer(item.seq, std::move(item.value));
    this->graph().retire_items(in.size(), w);
    return {in.size(), 0};
  }

 private:
  std::shared_ptr<RequestBook<Out>> book_;
};

}  // namespace detail

/// A graph's request entry and exit (Graph::service).
template <class In, class Out>
class Service {
 public:
  using Clock = std::chrono::steady_clock;

  Service(detail::PushSourceNode<In>& src, detail::AnswerSinkNode<Out>& sink,
          std::shared_ptr<detail::RequestBook<Out>> book)
      : link_(src.link()), sink_(&sink), book_(std::move(book)) {}

  /// Connect the graph's first stage to this: `svc.source() >> first`.
  Source<In> source() const {
    detail::PushSourceNode<In>& src = node("source()");
    return Source<In>(src, nullptr, &src);
  }
  /// Connect the graph's last stage to this: `last >> svc.sink()`.
  Sink<Out> sink() const {
    node("sink()");  // the sink lives and dies with the source, in the same graph
    return Sink<Out>(*sink_, &sink_->input(), nullptr);
  }

  /// Submits a request from any thread; its result arrives through the future. Waits or
  /// throws OverloadedError when max_pending requests are pending (ServiceOptions); from a
  /// thread of the graph's runtime (a completion callback, a stage body) it never waits: it
  /// throws OverloadedError, since the room it waited for is made by those threads. Throws
  /// GraphError when the graph is not running (or destroyed) or the service was closed; a
  /// request admitted as the run ends is not refused but failed by the run's end: the future
  /// returned has that error. A HostTensor request fed straight into a GPU stage's pinned ring
  /// that the ring cannot take (over its ring_item_bytes, not contiguous) throws Error with the
  /// reason, and is not admitted (the run and the other requests go on).
  std::future<Out> submit(In value) { return submit(std::move(value), std::nullopt); }
  /// With a deadline: if it passes before a GPU stage takes the request, the request is
  /// dropped unprocessed and its future gets DeadlineError. Under Admission::wait it waits
  /// for room until its deadline at most, then throws DeadlineError (not admitted).
  std::future<Out> submit(In value, std::optional<Clock::time_point> deadline) {
    auto [id, future] = book_->admit(deadline);
    if (!push_or_withdraw(std::move(value), id) && book_->withdraw(id, true)) throw not_accepting();
    return std::move(future);  // (not withdrawn: the run's end failed it, the future says so)
  }
  /// With a completion callback instead of a future (for event loops: asyncio, an RPC
  /// server's completion queue): `done(result, nullptr)` or `done(nullptr, error)` is called
  /// exactly once, on the thread that answers or fails the request (keep it short, and do not
  /// wait there for the run to end): a oneTBB worker, a device completion, a process stage's
  /// reader, or, when the run stops, the thread that cancels it (Run::cancel(), ~Graph, the
  /// runtime's end, a pull sink's close()) or the one whose stage failed it. Throws as submit() does, and then never calls `done`: a request is either
  /// refused by an exception or completed through `done` (a run ending as the request is
  /// admitted fails it through `done`, without an exception).
  void submit(In value, std::optional<Clock::time_point> deadline,
              typename detail::RequestBook<Out>::Callback done) {
    const std::uint64_t id = book_->admit(deadline, std::move(done));
    if (!push_or_withdraw(std::move(value), id) && book_->withdraw(id, true)) throw not_accepting();
  }

  /// No more requests this run: the run ends once every admitted request is answered.
  /// Called before the graph's first run, or as a run starts (from another thread), it closes
  /// that run: it ends as soon as it starts, taking no request. Called after a run ended, it
  /// does nothing (the next run is open). (Nothing to do once the graph is destroyed.)
  void close() {
    if (link_->going.load()) return;
    std::shared_lock lk(link_->mu);
    if (link_->node) link_->node->close();
  }

  ServiceStats stats() const { return book_->stats(); }

 private:
  // False when the request was not taken: the graph is not running, the service was closed,
  // or the graph was destroyed.
  bool push(In&& value, std::uint64_t id) {
    if (link_->going.load()) return false;
    std::shared_lock lk(link_->mu);
    return link_->node && link_->node->push(std::move(value), id);
  }
  // push(), and a request the graph refused (too large for its GPU stage's ring) withdrawn
  // before its error reaches the submitter: it was never admitted. (Not withdrawn: the run's
  // end completed it in between, through its future or callback; nothing is thrown then.)
  bool push_or_withdraw(In&& value, std::uint64_t id) {
    try {
      return push(std::move(value), id);
    } catch (...) {
      if (book_->withdraw(id)) throw;
      return true;
    }
  }
  detail::PushSourceNode<In>& node(const char* what) const {
    std::shared_lock lk(link_->mu);
    if (!link_->node)
      throw GraphError("splitflow: service '" + link_->name + "' of graph '" + link_->graph +
                       "': " + what + " after its graph was destroyed");
    return *link_->node;
  }
  GraphError not_accepting() const {
    std::string why;
    if (!link_->going.load()) {
      std::shared_lock lk(link_->mu);
      if (link_->node) why = link_->node->refusal();
    }
    if (why.empty())
      why = "its graph was destroyed (a Service may outlive its Graph, but takes no request after it)";
    return GraphError("splitflow: service '" + link_->name + "' of graph '" + link_->graph +
                      "' is not accepting requests: " + why);
  }

  std::shared_ptr<detail::SourceLink<In>> link_;
  detail::AnswerSinkNode<Out>* sink_;
  std::shared_ptr<detail::RequestBook<Out>> book_;
};

template <class In, class Out>
Service<In, Out> Graph::service(std::string name, ServiceOptions options) {
  if (core().tracker())
    throw GraphError("splitflow::Graph '" + this->name() +
                     "': it already has a service (one per graph)");
  auto book = std::make_shared<detail::RequestBook<Out>>(this->name(), name, options,
                                                         core().runtime_core());
  auto& src = add<detail::PushSourceNode<In>>(name);
  auto& sink = add<detail::AnswerSinkNode<Out>>(name + ".answer", book);
  src.set_on_end([b = book.get()](bool stopped) { b->fail_all(stopped); });
  core().set_tracker(book.get());
  return Service<In, Out>(src, sink, std::move(book));
}

}  // namespace splitflow
