// Graph: a job as typed stages connected by bounded queues.
//
//     splitflow::Runtime rt;
//     splitflow::Graph g(rt, "squares");
//     auto numbers = g.source("numbers", std::views::iota(0, 100));
//     auto square  = g.stage("square", [](int x) { return long(x) * x; }, {.concurrency = 4});
//     auto out     = g.pull_sink<long>("out");
//     numbers >> square >> out;          // edge types are checked at compile time
//     auto run = g.run();
//     for (long v : out) use(v);         // in order: square is in_order by default
//     run.wait();
//
// Stages may skip or replace items whose body throws (StageOptions::on_error); Graph::batch
// gathers items into vectors.
#pragma once

#include <chrono>
#include <concepts>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <ranges>
#include <string>
#include <type_traits>
#include <utility>

#include "splitflow/core/config.hpp"
#include "splitflow/executor/detail/async_node.hpp"
#include "splitflow/executor/detail/graph_core.hpp"
#include "splitflow/executor/detail/gpu_node.hpp"
#include "splitflow/executor/detail/nodes.hpp"
#include "splitflow/device/device.hpp"
#include "splitflow/core/error.hpp"
#include "splitflow/executor/run.hpp"
#include "splitflow/executor/runtime.hpp"

namespace splitflow {

template <class In, class Out>
class Service;
template <class T>
struct Batch;
struct DynamicBatchOptions;

/// The item whose stage body runs on this thread: its number in the run, the one its errors
/// name (a source numbers its items 0, 1, ... in its order each run; a batch, a zip's pair get
/// their own); nullopt outside a stage's body (`g.stage`, a blocking stage's too, an async
/// stage's call). For an op
/// that needs an item's identity when the item carries none: the Python module's
/// `random_resized_crop` on a plain array draws its box from it.
/// \code
///   auto tag = g.stage("tag", [](long x) { return std::pair(*splitflow::current_item(), x); });
/// \endcode
std::optional<std::uint64_t> current_item() noexcept;

/// The typed input end of an edge (a stage's input, a zip's first or second input).
template <class T>
struct InPort {
  using input_type = T;
  using output_type = void;
  detail::Receiver<T>* receiver;
  detail::Receiver<T>& in_port() const noexcept { return *receiver; }
};

/// A handle to a node taking In (void for a source) and producing Out (void for a sink).
/// Handles are cheap to copy; the graph owns the node.
template <class In, class Out>
class Node {
 public:
  using input_type = In;
  using output_type = Out;

  Node(detail::NodeBase& node, detail::Receiver<In>* in, detail::Emitter<Out>* out)
      : node_(&node), in_(in), out_(out) {}

  const std::string& name() const noexcept { return node_->name(); }
  /// OnError::substitute: an item whose body throws becomes a copy of `value` (and is counted
  /// in StageStats::items_substituted, with its error's message). It puts the stage under
  /// OnError::substitute whatever its StageOptions::on_error said. Stages only (not a source,
  /// not a sink: neither has an item to replace).
  template <class U = Out>
    requires(!std::is_void_v<Out> && !std::is_void_v<In> && std::is_convertible_v<U, Out>)
  const Node& substitute_on_error(U value) const {
    out_->set_substitute(std::move(value));
    return *this;
  }
  /// A source whose items another system produces (workers of a remote pass, a queue that a
  /// service fills): `what` names it ("the remote pass 'remote' on Dask workers"). When the
  /// source is the graph's bottleneck the diagnosis then points at it, instead of advising
  /// that the source's work move into a stage after it (StageStats::fed_by). Sources only.
  ///
  ///     g.source("remote", pass).fed_by("the remote pass 'remote' on Dask workers");
  template <class U = In>
    requires(std::is_void_v<U>)
  const Node& fed_by(std::string what) const {
    node_->graph().check_mutable();  // (not while it runs: its figures read it)
    node_->set_fed_by(std::move(what));
    return *this;
  }
  detail::Receiver<In>& in_port() const noexcept
    requires(!std::is_void_v<In>)
  {
    return *in_;
  }
  detail::Emitter<Out>& out_port() const noexcept
    requires(!std::is_void_v<Out>)
  {
    return *out_;
  }

 protected:
  detail::NodeBase* node_;
  detail::Receiver<In>* in_;
  detail::Emitter<Out>* out_;
};

template <class T>
using Source = Node<void, T>;
template <class In, class Out>
using Stage = Node<In, Out>;
template <class T>
using Sink = Node<T, void>;

/// A sink read by the caller's thread, the way a training loop reads a data loader:
///     for (auto& batch : sink) train(batch);
/// next() blocks until an item arrives or the run ends (nullopt), and rethrows the run's
/// StageError if it failed. A run cancelled by anything but this sink's reader (Run::cancel()
/// from another thread, another pull sink's reader closing it, the runtime's end) ends the
/// stream with CancelledError instead, so that a loop cannot take a cut stream for a whole one:
///     std::jthread watchdog([&] { ...; run.cancel(); });
///     try { for (auto& batch : sink) train(batch); } catch (const CancelledError&) { ... }
/// Iteration reads the current run; items left when a new run starts are dropped.
/// A handle may outlive its graph: destroying the graph ends a reader waiting in next() (with
/// CancelledError) and waits for it to leave; a read after that throws CancelledError.
template <class T>
class PullSink : public Node<T, void> {
  using Readers = typename detail::PullSinkNode<T>::Readers;

 public:
  PullSink(detail::PullSinkNode<T>& n)
      : Node<T, void>(n, &n.input(), nullptr), sink_(&n), readers_(n.readers()) {}
  // Copied, never moved from: a moved-from handle would have no readers' gate to pass.
  PullSink(const PullSink&) = default;
  PullSink& operator=(const PullSink&) = default;

  std::optional<T> next() const { return take(sink_, *readers_, nullptr, nullptr); }
  /// The reader is done: cancels the run if it is still going (does nothing after its end, or
  /// once the graph is gone). Leaving a range-for over the sink early does the same. Its own
  /// next() then ends with nullopt; the readers of the graph's other pull sinks get
  /// CancelledError.
  void close() const { close(sink_, *readers_); }
  /// Like next(), but returns nullopt with `timed_out` set after `timeout` without an item.
  /// `item` (if given): the number in its run of the item returned (its source item's
  /// position, as errors name it; items a stage skipped leave gaps).
  std::optional<T> next_for(std::chrono::nanoseconds timeout, bool& timed_out,
                            std::uint64_t* item = nullptr) const {
    return take(sink_, *readers_, &timeout, &timed_out, item);
  }

  /// Leaving a loop over the sink early (the iterator is destroyed before the end of the
  /// stream: a `break`, a `return`, an exception) cancels the run, as close() does, so that
  /// `run.wait()` returns instead of waiting for producers that nobody reads. Move-only.
  class iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = T;
    using difference_type = std::ptrdiff_t;
    iterator() = default;
    iterator(detail::PullSinkNode<T>* s, std::shared_ptr<Readers> r) : sink_(s), readers_(std::move(r)) {
      ++*this;
    }
    iterator(iterator&& o) noexcept
        : sink_(std::exchange(o.sink_, nullptr)), readers_(std::move(o.readers_)), item_(std::move(o.item_)) {
      o.item_.reset();
    }
    iterator& operator=(iterator&& o) noexcept {
      if (this != &o) {
        leave();
        sink_ = std::exchange(o.sink_, nullptr);
        readers_ = std::move(o.readers_);
        item_ = std::move(o.item_);
        o.item_.reset();
      }
      return *this;
    }
    iterator(const iterator&) = delete;
    iterator& operator=(const iterator&) = delete;
    ~iterator() { leave(); }
    T& operator*() const { return *const_cast<std::optional<T>&>(item_); }
    iterator& operator++() {
      item_.reset();  // (if next() throws, the loop ended with the run's error: nothing to cancel)
      item_ = take(sink_, *readers_, nullptr, nullptr);
      return *this;
    }
    void operator++(int) { ++*this; }
    bool operator==(std::default_sentinel_t) const noexcept { return !item_.has_value(); }

   private:
    void leave() noexcept {
      if (sink_ && item_) close(sink_, *readers_);  // left before the end of the stream
    }
    detail::PullSinkNode<T>* sink_ = nullptr;
    std::shared_ptr<Readers> readers_;
    std::optional<T> item_;
  };
  iterator begin() const { return iterator(sink_, readers_); }
  std::default_sentinel_t end() const noexcept { return {}; }

 private:
  // Through the readers' gate: the sink is touched only while its graph lives.
  static std::optional<T> take(detail::PullSinkNode<T>* sink, Readers& r,
                               const std::chrono::nanoseconds* timeout, bool* timed_out,
                               std::uint64_t* item = nullptr) {
    detail::GateScope in(r.gate);
    if (!in)
      throw CancelledError("splitflow: " + r.what + " was read after its graph was destroyed; "
                           "keep the Graph alive while its sinks are read");
    return timeout ? sink->next_for(*timeout, *timed_out, item) : sink->next();
  }
  static void close(detail::PullSinkNode<T>* sink, Readers& r) noexcept {
    if (detail::GateScope in(r.gate); in) sink->close();
  }
  detail::PullSinkNode<T>* sink_;
  std::shared_ptr<Readers> readers_;
};

/// Pairs the items of `first()` and `second()` that came from the same upstream item (the
/// same source item, or the i-th item of each of two sources), whatever order they arrive in.
/// When a branch drops an item (a stage skipped it, its deadline passed) the zip drops its
/// partner, counted in its items_skipped. run() refuses inputs whose items cannot be told apart
/// (an input merging two sources, or reached along two paths, or a batch on an input that is
/// not upstream of both).
template <class A, class B>
class Zip {
 public:
  using input_type = void;
  using output_type = std::pair<A, B>;

  explicit Zip(detail::ZipNode<A, B>& n) : node_(&n) {}
  InPort<A> first() const noexcept { return {&node_->first()}; }
  InPort<B> second() const noexcept { return {&node_->second()}; }
  detail::Emitter<std::pair<A, B>>& out_port() const noexcept { return *node_; }
  const std::string& name() const noexcept { return node_->name(); }

 private:
  detail::ZipNode<A, B>* node_;
};

/// A GPU stage: `Out(In, DeviceContext&)`. When In is DeviceTensor it also accepts HostTensor
/// producers: connect() puts a pinned ring between them (see GpuStageOptions).
template <class In, class Out>
class GpuStage : public Node<In, Out> {
 public:
  GpuStage(detail::NodeBase& n, detail::Receiver<In>* in, detail::Emitter<Out>* out,
           detail::Receiver<HostTensor>* host_in)
      : Node<In, Out>(n, in, out), host_in_(host_in) {}
  detail::Receiver<HostTensor>& host_in_port() const noexcept { return *host_in_; }

 private:
  detail::Receiver<HostTensor>* host_in_;
};

namespace detail {

/// Throws GraphError: a member of a Graph that was moved from was called.
[[noreturn]] void moved_from_graph();

struct Deduce {};

/// A body with one call operator (not generic, not overloaded), whose parameters tell its input.
template <class F>
concept one_call_operator = requires { &F::operator(); };
template <class F>
struct call_signature {
  static_assert(one_call_operator<F>,
                "splitflow: the body's input type cannot be deduced: it is generic (an auto "
                "parameter) or overloaded; give it: g.stage<In>(name, body), g.sink<In>(...)");
  using args = std::tuple<void*>;  // (after the error above: no second one from here)
};
template <class F>
  requires one_call_operator<F>
struct call_signature<F> : call_signature<decltype(&F::operator())> {};
template <class R, class... A>
struct call_signature<R (*)(A...)> {
  using args = std::tuple<A...>;
};
template <class R, class... A>
struct call_signature<R(A...)> : call_signature<R (*)(A...)> {};
template <class C, class R, class... A>
struct call_signature<R (C::*)(A...)> : call_signature<R (*)(A...)> {};
template <class C, class R, class... A>
struct call_signature<R (C::*)(A...) const> : call_signature<R (*)(A...)> {};
template <class C, class R, class... A>
struct call_signature<R (C::*)(A...) noexcept> : call_signature<R (*)(A...)> {};
template <class C, class R, class... A>
struct call_signature<R (C::*)(A...) const noexcept> : call_signature<R (*)(A...)> {};

/// The input type of a stage body: given explicitly, or the decayed type of its one parameter.
template <class In, class F>
struct input_type {
  using type = In;
};
template <class F>
struct input_type<Deduce, F> {
  using args = typename call_signature<std::decay_t<F>>::args;
  static_assert(std::tuple_size_v<args> == 1 || std::tuple_size_v<args> == 2,
                "splitflow: a stage body takes its input item (and, for a GPU stage, a "
                "DeviceContext&, or for a producer of host tensors, a HostAllocator&)");
  using type = std::decay_t<std::tuple_element_t<0, args>>;
};

/// Output of a CPU stage body `Out(In)` or `Out(In, HostAllocator&)`.
template <class F, class I>
struct stage_output {
  using type = std::decay_t<std::invoke_result_t<F&, I&&>>;
};
template <class F, class I>
  requires std::is_invocable_v<F&, I&&, HostAllocator&>
struct stage_output<F, I> {
  using type = std::decay_t<std::invoke_result_t<F&, I&&, HostAllocator&>>;
};

template <class C>
concept HasHostPort = requires(const C& c) { c.host_in_port(); };

/// The edge from -> to, once the types are known to match.
template <class T>
void link(Emitter<T>& from, Receiver<T>& to) {
  if (&from.graph() != &to.node().graph())
    throw GraphError("splitflow::connect: '" + from.name() + "' and '" + to.node().name() +
                     "' belong to different graphs");
  from.graph().check_mutable();
  if (from.feeds(to))
    throw GraphError("splitflow::connect: '" + from.name() + "' is already connected to '" +
                     to.node().name() + "' in graph '" + from.graph().name() +
                     "'; connect them once (the same edge twice would deliver each item "
                     "twice)");
  if constexpr (!detail::copyable_v<T>) {
    if (from.fan_out() > 0)
      throw GraphError("splitflow::connect: '" + from.name() +
                       "' already has a consumer and its item type is move-only; fan-out "
                       "copies items, so it needs a copyable type (e.g. std::shared_ptr<T>)");
  }
  from.add_target(to);
}

/// A generator over [it, last): yields copies of the elements.
template <class It, class S, class Keep = std::nullptr_t>
auto iterate(It it, S last, Keep keep = nullptr) {
  using T = std::iter_value_t<It>;
  return [keep = std::move(keep), it, last]() mutable -> std::optional<T> {
    (void)keep;  // held, not used: it owns what [it, last) points into
    if (it == last) return std::nullopt;
    std::optional<T> v(*it);
    ++it;
    return v;
  };
}

template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};

template <class H>
concept Handle = requires { typename H::input_type; typename H::output_type; };

}  // namespace detail

/// Connects producer -> consumer. Edge types are checked at compile time. Connecting several
/// producers to one consumer merges them; connecting one producer to several consumers fans
/// out (each consumer gets every item, which needs a copyable item type).
template <detail::Handle P, detail::Handle C>
void connect(const P& producer, const C& consumer) {
  using T = typename P::output_type;
  using U = typename C::input_type;
  static_assert(!std::is_void_v<T>, "splitflow::connect: the producer is a sink; it has no output");
  static_assert(!std::is_void_v<U>,
                "splitflow::connect: the consumer is a source or a zip; it has no single input "
                "(connect to zip.first() / zip.second())");
  constexpr bool ring_edge = std::is_same_v<T, HostTensor> && std::is_same_v<U, DeviceTensor> &&
                             detail::HasHostPort<C>;
  static_assert(std::is_void_v<T> || std::is_void_v<U> || std::is_same_v<T, U> || ring_edge,
                "splitflow::connect: edge type mismatch: the producer's output type is not the "
                "consumer's input type (edge types are checked at compile time)");
  if constexpr (ring_edge) {
    detail::link(producer.out_port(), consumer.host_in_port());  // through the GPU stage's ring
  } else if constexpr (!std::is_void_v<T> && std::is_same_v<T, U>) {
    detail::link(producer.out_port(), consumer.in_port());
  }
}

/// Fan-out: every consumer gets every item (copies for all but the last consumer).
template <detail::Handle P, detail::Handle... C>
void fan_out(const P& producer, const C&... consumers) {
  static_assert(detail::copyable_v<typename P::output_type>,
                "splitflow::fan_out: fan-out copies items, so the item type must be copyable "
                "(wrap large or move-only items in std::shared_ptr)");
  (connect(producer, consumers), ...);
}

/// `a >> b >> c` connects a chain and returns its last handle.
template <detail::Handle P, detail::Handle C>
const C& operator>>(const P& producer, const C& consumer) {
  connect(producer, consumer);
  return consumer;
}

/// A job: typed stages joined by bounded queues, run on a Runtime. One run at a time; a graph
/// can run again after a run finished, failed or was cancelled. Destroying a graph cancels and
/// waits for its active run. Build a graph from one thread; run and read it from any.
class Graph {
 public:
  explicit Graph(Runtime& runtime, std::string name = "graph", GraphOptions options = {});
  ~Graph();
  Graph(Graph&&) noexcept;
  Graph& operator=(Graph&&) noexcept;

  /// The graph's name. Every member but running(), the destructor and assignment throws
  /// GraphError on a graph moved from (use the Graph it was moved into).
  const std::string& name() const { return core().name(); }

  /// A source from a generator: `std::optional<T>()` is called serially until it returns
  /// nullopt. A copyable generator is copied for each run, so every run starts afresh.
  template <class Gen>
    requires std::invocable<Gen&>
  auto source(std::string name, Gen gen) {
    using R = std::invoke_result_t<Gen&>;
    static_assert(detail::is_optional<R>::value,
                  "splitflow::Graph::source: a generator returns std::optional<T> (nullopt ends "
                  "the stream)");
    using T = typename R::value_type;
    auto& n = add<detail::SourceNode<T, Gen>>(std::move(name), std::move(gen));
    return Source<T>(n, nullptr, &n);
  }

  /// A source from an iterator range (copies each element; use std::make_move_iterator for
  /// move-only items). The range must outlive the graph's runs.
  template <std::input_iterator It, std::sentinel_for<It> S>
  auto source(std::string name, It first, S last) {
    return source(std::move(name), detail::iterate(first, last));
  }

  /// A source from a range: an lvalue range is read in place (it must outlive the graph), an
  /// rvalue range (a container, a view) is kept by the graph.
  template <std::ranges::input_range R>
    requires(!std::invocable<R&>)
  auto source(std::string name, R&& range) {
    if constexpr (std::is_lvalue_reference_v<R>) {
      return source(std::move(name), std::ranges::begin(range), std::ranges::end(range));
    } else {
      // The generator keeps the range; every copy of it (one per run) shares it.
      auto kept = std::make_shared<std::remove_cvref_t<R>>(std::move(range));
      return source(std::move(name),
                    detail::iterate(std::ranges::begin(*kept), std::ranges::end(*kept), kept));
    }
  }

  /// A stage `Out(In)`. In is deduced from a non-generic body, or given: `stage<int>(...)`.
  template <class In = detail::Deduce, class F>
  auto stage(std::string name, F body, StageOptions options = {}) {
    using I = typename detail::input_type<In, F>::type;
    static_assert(std::is_invocable_v<F&, I&&> || std::is_invocable_v<F&, I&&, HostAllocator&>,
                  "splitflow::Graph::stage: the body cannot be called with one item of the "
                  "input type: it takes one item (or one item and a HostAllocator&), which "
                  "arrives as an rvalue: by value, as const In& or In&&, not In&");
    using Out = typename detail::stage_output<F, I>::type;
    static_assert(!std::is_void_v<Out>,
                  "splitflow::Graph::stage: the body returns nothing; use sink() for a body "
                  "without output");
    // An automatic stage whose bodies the last run of a graph of this name found waiting runs
    // on the blocking threads (autotune::body_placement; each run's end decides again).
    bool placed = false;
    if constexpr (std::is_invocable_v<F&, I&&>)
      if (!options.blocking && options.concurrency == Concurrency::automatic &&
          detail::placed_on_blocking_threads(core(), name))
        options.blocking = placed = true;
    if (options.blocking) {
      if constexpr (std::is_invocable_v<F&, I&&>) {
        // An async stage whose answers come from the runtime's blocking threads: the body runs
        // there, its thread CPU time charged to the stage (call_ns), and the time it waited
        // (its wall time less its CPU demand: time on a CPU or runnable waiting for one, so
        // that a busy machine does not make a computing body look as if it waited; wait_ns).
        auto kept = std::make_shared<F>(std::move(body));
        detail::GraphCore* core = &this->core();
        auto submit = [kept, core](I item, Completion<Out> c) {
          core->post_blocking(detail::BlockingTask(
              [kept, item = std::move(item), c = std::move(c),
               seq = current_item()]() mutable {
                if (c.withdrawn()) return;  // its run stopped while it waited for a thread
                // splitflow::current_item() in the body.
                detail::CurrentItem current(seq.value_or(detail::CurrentItem::kNone));
                const auto wall0 = std::chrono::steady_clock::now();
                const detail::ThreadCpu at0 = detail::thread_cpu();
                auto charge = [&] {
                  const detail::ThreadCpu at1 = detail::thread_cpu();
                  const std::int64_t wall = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                std::chrono::steady_clock::now() - wall0).count();
                  c.charge_cpu(std::chrono::nanoseconds(at1.cpu_ns - at0.cpu_ns));
                  c.charge_wait(std::chrono::nanoseconds(detail::waited_ns(at0, at1, wall)));
                };
                try {
                  Out out = std::invoke(*kept, std::move(item));
                  charge();
                  c.done(std::move(out));
                } catch (...) {
                  charge();
                  c.fail(std::current_exception());
                }
              }));
        };
        auto& n = add<detail::AsyncStageNode<I, Out, decltype(submit)>>(std::move(name),
                                                                        std::move(submit), options);
        if (placed) n.placed_automatically();
        return Stage<I, Out>(n, &n.input(), &n);
      } else {
        throw GraphError("splitflow::Graph::stage('" + name + "'): a blocking stage's body takes "
                         "its item alone (Out(In)), not a HostAllocator");
      }
    }
    auto& n = add<detail::StageNode<I, Out, F>>(std::move(name), std::move(body), options);
    return Stage<I, Out>(n, &n.input(), &n);
  }

  /// A GPU stage `Out(In, DeviceContext&)`: each invocation leases a stream from the runtime's
  /// pool for its kernel burst only; its output is emitted when the stream's work completed.
  /// Give In explicitly for a generic body: `gpu_stage<DeviceTensor>(...)`.
  template <class In = detail::Deduce, class F>
  auto gpu_stage(std::string name, F body, GpuStageOptions options = {}) {
    using I = typename detail::input_type<In, F>::type;
    static_assert(std::is_invocable_v<F&, I&&, DeviceContext&>,
                  "splitflow::Graph::gpu_stage: the body must be callable as Out(In, "
                  "DeviceContext&)");
    using Out = std::decay_t<std::invoke_result_t<F&, I&&, DeviceContext&>>;
    static_assert(!std::is_void_v<Out>, "splitflow::Graph::gpu_stage: the body returns nothing");
    auto& n = add<detail::GpuStageNode<I, Out, F>>(std::move(name), std::move(body), options);
    return GpuStage<I, Out>(n, &n.input(), &n, &n.host_input());
  }

  /// An asynchronous stage: `void(In, Completion<Out>)` hands each item on (to worker
  /// processes, a remote service, an I/O engine) and returns its thread at once; whoever holds
  /// the Completion answers it later, from any thread, with done(out) or fail(error). Like a
  /// stage otherwise: `concurrency` bounds the items out at once (each counts until answered),
  /// outputs leave in order when `order` is in_order, and on_error applies to a failed answer.
  /// The external completion of oneTBB's async_node; no arena thread waits for an answer.
  /// A cancel (or a failure) withdraws the items out: the run ends without waiting for their
  /// answers (an answer then does nothing; Completion::withdrawn() tells the work it may stop),
  /// so a run started after it may have more out at once, the old ones' included. A blocking
  /// stage (StageOptions::blocking) differs: its bodies run on the runtime's threads, and the
  /// run's end waits for those executing, and for its bodies still queued for a blocking thread
  /// to reach one (they are then skipped): behind other graphs' bodies holding every blocking
  /// thread (RuntimeConfig::blocking_threads, shared by the runtime's graphs), a cancel waits
  /// for one of those to return.
  ///
  ///     auto s = g.async_stage<int, int>("remote", [&](int x, Completion<int> c) {
  ///       workers.post([x, c = std::move(c)]() mutable { c.done(x * 2); });
  ///     }, {.concurrency = 8});
  template <class In, class Out, class F>
  Stage<In, Out> async_stage(std::string name, F body, StageOptions options = {}) {
    static_assert(std::is_invocable_v<F&, In&&, Completion<Out>&&>,
                  "splitflow::Graph::async_stage: the body must be callable as void(In, "
                  "Completion<Out>)");
    if (options.blocking)
      throw GraphError("splitflow::Graph::async_stage('" + name + "'): StageOptions::blocking is "
                       "for Graph::stage (an async stage's body returns at once already)");
    auto& n = add<detail::AsyncStageNode<In, Out, F>>(std::move(name), std::move(body), options);
    return Stage<In, Out>(n, &n.input(), &n);
  }

  /// Gathers `size` items of T into one std::vector<T>, in arrival order. At the end of the
  /// input the last, shorter batch is emitted (or dropped: BatchOptions::drop_last). Like a
  /// serial in-order stage otherwise; its queue holds at least one batch.
  template <class T>
  Stage<T, std::vector<T>> batch(std::string name, std::size_t size, BatchOptions options = {}) {
    auto& n = add<detail::BatchNode<T>>(std::move(name), size, options);
    return Stage<T, std::vector<T>>(n, &n.input(), &n);
  }

  /// A service: the graph answers requests that any thread submits, one future each (see
  /// splitflow/serving/service.hpp, which defines it). At most one per graph, and no other source.
  template <class In, class Out>
  Service<In, Out> service(std::string name, ServiceOptions options = {});

  /// Dynamic batching (splitflow/serving/batching.hpp defines these): batches of at most max_batch
  /// items, each gone once full or once its oldest item waited max_delay; and back to items.
  template <class T>
  Stage<T, Batch<T>> dynamic_batch(std::string name, DynamicBatchOptions options);
  template <class T>
  Stage<Batch<T>, T> unbatch(std::string name, std::size_t max_batch);

  /// A callback sink `void(In)`.
  template <class In = detail::Deduce, class F>
  auto sink(std::string name, F body, StageOptions options = {}) {
    using I = typename detail::input_type<In, F>::type;
    static_assert(std::is_invocable_v<F&, I&&>,
                  "splitflow::Graph::sink: the body cannot be called with one item of the "
                  "input type: it takes one item, which arrives as an rvalue: by value, as "
                  "const In& or In&&, not In&");
    if (options.blocking)
      throw GraphError("splitflow::Graph::sink('" + name + "'): StageOptions::blocking is for "
                       "Graph::stage; a sink that waits can be a blocking stage into a sink");
    auto& n = add<detail::SinkNode<I, F>>(std::move(name), std::move(body), options);
    return Sink<I>(n, &n.input(), nullptr);
  }

  /// A sink read by the caller's thread (see PullSink). capacity 0 = the graph's default.
  template <class T>
  PullSink<T> pull_sink(std::string name, std::size_t capacity = 0) {
    return PullSink<T>(add<detail::PullSinkNode<T>>(std::move(name), capacity));
  }

  /// Pairs the items of two branches that came from the same upstream item (see Zip).
  /// capacity applies to each input.
  template <class A, class B>
  Zip<A, B> zip(std::string name, std::size_t capacity = 0) {
    return Zip<A, B>(add<detail::ZipNode<A, B>>(std::move(name), capacity));
  }

  /// Starts a run. Throws GraphError if the graph is malformed (an unconnected port, a cycle)
  /// or already running, or if its runtime was destroyed.
  Run run();

  /// True while a run is active: from run() until that run has ended (finished, failed or
  /// cancelled and drained). A graph that is not running can be changed or run again.
  /// \code
  ///   splitflow::Run r = g.run();
  ///   r.wait();
  ///   assert(!g.running());
  /// \endcode
  bool running() const;

 private:
  template <class N, class... A>
  N& add(A&&... args) {
    auto node = std::make_unique<N>(core(), std::forward<A>(args)...);
    N& ref = *node;
    core_->adopt(std::move(node));
    return ref;
  }
  /// The graph's core; GraphError on a graph moved from.
  detail::GraphCore& core() const {
    if (!core_) detail::moved_from_graph();
    return *core_;
  }

  std::unique_ptr<detail::GraphCore> core_;
};

}  // namespace splitflow
