#include "splitflow/executor/detail/graph_core.hpp"

#include "splitflow/executor/autotune.hpp"

#include <algorithm>
#include <limits>
#include <cmath>
#include <optional>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "device/device_runtime.hpp"
#include "executor/run_state.hpp"
#include "executor/run_tuner.hpp"
#include "executor/runtime_core.hpp"
#include "telemetry/tracer.hpp"
#include "splitflow/core/error.hpp"
#include "splitflow/executor/graph.hpp"

namespace splitflow {
namespace detail {

GraphCore::GraphCore(std::shared_ptr<RuntimeCore> runtime, std::string name, GraphOptions opts)
    : runtime_(std::move(runtime)), name_(std::move(name)), opts_(opts) {
  if (opts_.max_in_flight == 0 || opts_.default_capacity == 0)
    throw GraphError("splitflow::Graph '" + name_ +
                     "': max_in_flight and default_capacity must be at least 1");
  // (A window of 0 or less was taken as 1 ms, a negative or NaN core budget as the runtime's
  // threads: silently, where the user meant something else.)
  if (opts_.autotune_window.count() < 1 || opts_.autotune_window > kMaxAutotuneWindow)
    throw GraphError("splitflow::Graph '" + name_ + "': GraphOptions::autotune_window is " +
                     std::to_string(opts_.autotune_window.count()) +
                     " ms; it must be from 1 ms to 1 hour (the tuner measures and decides once "
                     "a window)");
  if (!(opts_.autotune_cores >= 0) || !std::isfinite(opts_.autotune_cores))
    throw GraphError("splitflow::Graph '" + name_ + "': GraphOptions::autotune_cores is " +
                     std::to_string(opts_.autotune_cores) +
                     "; it must be a finite number of cores, 0 or more (0: the runtime's threads)");
}

GraphCore::~GraphCore() {
  std::shared_ptr<RunState> run;
  {
    std::lock_guard lk(mu_);
    run = current_;
  }
  if (run) {
    run->cancel(CancelCause::graph_destroyed);
    try {
      run->wait();
    } catch (...) {  // the run's failure belongs to whoever holds its Run handle
    }
  }
  for (auto& n : nodes_) n->close_readers();  // a reader woken by the run's end leaves first
  if (gpu_)
    if (auto d = runtime_->device_if_created()) d->untrack(gpu_.get());  // its last figures stay
}

std::shared_ptr<DeviceRuntime> GraphCore::device() { return runtime_->device(); }

GpuAccount* GraphCore::gpu_account() {
  if (!gpu_) {
    gpu_ = std::make_unique<GpuAccount>();  // before the run starts (prepare)
    // Its figures, for the arbiter's meter (a process sharing the device publishes them).
    if (auto d = runtime_->device_if_created()) d->track(gpu_.get(), name_, opts_.priority);
  }
  return gpu_.get();
}

void GraphCore::post_blocking(BlockingTask t) {
  // The body keeps the run open until it returned (or its task was dropped unrun), even once a
  // cancel withdrew its item: the run's end (wait(), the Graph's and the Runtime's destructors)
  // waits for bodies executing, on these threads as on the arena's. It returned while they
  // ran: the next run went past the stage's concurrency, and state a body used could be
  // destroyed under it (a new user's trial, a heap-use-after-free under ASan). The caller's
  // claim holds a unit, so the run is live here.
  struct Hold {
    GraphCore* g;
    explicit Hold(GraphCore* core) noexcept : g(core) { g->add_unit(); }
    Hold(Hold&& o) noexcept : g(std::exchange(o.g, nullptr)) {}
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;
    Hold& operator=(Hold&&) = delete;
    ~Hold() {
      if (g) g->release_unit();
    }
  };
  runtime_->blocking_pool().post(BlockingTask([hold = Hold(this), t = std::move(t)]() mutable {
    Hold done = std::move(hold);  // released last: the item and its Completion go first
    BlockingTask body = std::move(t);
    body();
  }));
}

bool GraphCore::post_if_running(std::function<void(WorkList&)> fn) {
  if (!try_acquire_unit()) return false;
  // The unit acquired here goes with the task, which releases it: never this thread. (It was
  // released here, after post() took its own: when the task and the rest of the run had ended
  // first, this thread completed the run, and a tuner's thread then joined itself in
  // complete() -> RunTuner::stop: "Resource deadlock avoided", std::terminate. Seen under TSan
  // in BlockingStage.AnAutomaticStageWhoseBodiesWaitRunsOnTheBlockingThreadsInTheNextGraphOfItsName.)
  runtime_->spawn_urgent([this, fn = std::move(fn)] {
    try {
      WorkList w;
      fn(w);
      execute(w);
    } catch (...) {
      fail(*nodes_.front(), 0, std::current_exception());
    }
    release_unit();
  });
  return true;
}

void GraphCore::post(std::function<void(WorkList&)> fn) {
  // The caller holds a unit: the count is not zero, so post_if_running always takes the
  // task's unit and posts.
  post_if_running(std::move(fn));
}

NodeBase& GraphCore::adopt(std::unique_ptr<NodeBase> node) {
  check_mutable();
  if (node->name().empty())
    throw GraphError("splitflow::Graph '" + name_ + "': a stage's name is empty (errors, the "
                     "report and the tuner name stages: give it one, unique within the graph)");
  for (const auto& n : nodes_)
    if (n->name() == node->name())
      throw GraphError("splitflow::Graph '" + name_ + "': a stage named '" + node->name() +
                       "' already exists (stage names are unique within a graph)");
  if (node->kind() == StageKind::source) sources_.push_back(node.get());
  nodes_.push_back(std::move(node));
  return *nodes_.back();
}

bool GraphCore::admit_limit_tunable() const noexcept {
  if (sources_.size() == 1) return true;
  std::size_t pull_sinks = 0;
  for (const auto& n : nodes_) {
    if (n->kind() == StageKind::zip) return false;
    pull_sinks += n->kind() == StageKind::pull_sink ? 1 : 0;
  }
  return pull_sinks <= 1;
}

void GraphCore::check_mutable() const {
  std::lock_guard lk(mu_);
  if (active_)
    throw GraphError("splitflow::Graph '" + name_ + "': cannot change the graph while it runs");
}

bool GraphCore::running() const {
  std::lock_guard lk(mu_);
  return active_;
}

void GraphCore::validate() {
  if (sources_.empty()) throw GraphError("splitflow::Graph '" + name_ + "': it has no source");
  if (tracker_ && sources_.size() > 1)
    throw GraphError("splitflow::Graph '" + name_ +
                     "': a graph with a service has no other source (its items are requests)");
  for (const auto& n : nodes_) n->validate();
  // Kahn's algorithm: the per-node lock order relies on the graph being acyclic.
  std::unordered_map<const NodeBase*, std::size_t> indegree;
  for (const auto& n : nodes_)
    for (const Edge& e : n->successors()) ++indegree[e.node];
  std::vector<NodeBase*> ready, order;
  for (const auto& n : nodes_)
    if (indegree[n.get()] == 0) ready.push_back(n.get());
  while (!ready.empty()) {
    NodeBase* n = ready.back();
    ready.pop_back();
    order.push_back(n);
    for (const Edge& e : n->successors())
      if (--indegree[e.node] == 0) ready.push_back(e.node);
  }
  if (order.size() != nodes_.size()) {
    // Kahn's leftovers are the cycles and what lies downstream of them: walk back along
    // predecessors inside the leftovers until a node repeats, which closes a cycle.
    std::unordered_map<const NodeBase*, const NodeBase*> pred;
    for (const auto& n : nodes_)
      if (indegree[n.get()] > 0)
        for (const Edge& e : n->successors())
          if (indegree[e.node] > 0) pred.emplace(e.node, n.get());
    const NodeBase* at = nullptr;
    for (const auto& n : nodes_)
      if (indegree[n.get()] > 0) at = n.get();
    std::vector<const NodeBase*> walk;
    std::unordered_map<const NodeBase*, std::size_t> seen;
    while (seen.emplace(at, walk.size()).second) {
      walk.push_back(at);
      at = pred.at(at);
    }
    // walk[seen[at]..] is the cycle, backwards: name it forwards, from its earliest-added node.
    std::vector<const NodeBase*> cycle(walk.rbegin(), walk.rend() - static_cast<std::ptrdiff_t>(seen[at]));
    std::unordered_map<const NodeBase*, std::size_t> added;
    for (std::size_t i = 0; i < nodes_.size(); ++i) added[nodes_[i].get()] = i;
    std::rotate(cycle.begin(),
                std::min_element(cycle.begin(), cycle.end(),
                                 [&](auto* x, auto* y) { return added[x] < added[y]; }),
                cycle.end());
    std::string names;
    for (const NodeBase* n : cycle) names += "'" + n->name() + "' -> ";
    names += "'" + cycle.front()->name() + "'";
    throw GraphError("splitflow::Graph '" + name_ + "': it has a cycle: " + names +
                     " (graphs must be acyclic)");
  }
  size_queues(order);
  for (const NodeBase* n : order) n->validate_sized();
  check_batching(order);
  check_zips(order);
  topo_ = std::move(order);
}

void GraphCore::size_queues(const std::vector<NodeBase*>& order) {
  // In topological order: what an item on each node's input stands for in source items (a
  // batch's consumers see n of them per item), and the claims its producers can have out.
  const std::size_t threads = static_cast<std::size_t>(std::max(runtime_->threads(), 1));
  std::unordered_map<const NodeBase*, double> items;
  std::unordered_map<const NodeBase*, std::size_t> floor, room;
  std::unordered_map<const NodeBase*, bool> fixed;
  for (NodeBase* n : order) {
    const double in = items.count(n) ? items[n] : 1.0;
    n->size_default_queue(in, std::max<std::size_t>(floor[n], 2), room[n]);
    const double out = in * n->items_per_output();
    // A claim of n's holds a slot of its consumers' queues until it emits: they keep room for
    // as many claims as n can run (at most the runtime's threads; an automatic stage may be
    // raised to them).
    const std::size_t claims = n->auto_concurrency() ? threads : std::min(n->concurrency(), threads);
    for (const Edge& e : n->successors()) {
      items[e.node] = std::max(items.count(e.node) ? items[e.node] : 0.0, out);
      floor[e.node] += claims;
      // An automatic async stage's items out wait without a thread, each holding a slot here
      // until it is emitted: the tuner may raise it past the cores (an I/O stage), up to this
      // queue's slots, so the queue has room for the items the graph lets in at once
      // (max_in_flight: the bound on its memory already). The tuner keeps that room: answered
      // in any order, an item out holds its slot until those before it are emitted, longer
      // than the policy's reserved slots plus a buffer allow for.
      if (n->auto_concurrency() && n->asynchronous()) {
        room[e.node] = opts_.max_in_flight;
        fixed[e.node] = true;
      }
      // A producer that reserves several slots at once, all or none (an unbatch: a cut below
      // its batch would never grant them), or a GPU stage (its rings), keeps its consumer's
      // queue as sized, as does an automatic async stage (above). A batch reserves one slot a
      // claim, as a 1:1 stage does: the queue after it is tuned, in batches.
      if (n->kind() == StageKind::gpu_stage || n->splits_batches_of() != 0) fixed[e.node] = true;
      // An unbatch's claim reserves a whole batch's slots: its consumer's queue, if its user
      // did not size it, holds a batch at least (a service's answers after batches of 64: the
      // default 32 could never take one, and the service has no capacity to raise).
      if (const std::size_t b = n->splits_batches_of()) room[e.node] = std::max(room[e.node], b);
    }
  }
  // The tuner sizes the input queues of automatic CPU stages whose capacity the user did not
  // set, fed by producers that reserve a slot an output (1:1 stages, batches): from 1 up to the larger of the sized capacity and the items
  // the graph lets in at once (max_in_flight source items, which bounds their memory already:
  // a queue of 64-image batches, 256 / 64 = 4 of them).
  // Under a memory budget (RuntimeConfig::host_memory_budget) such a queue starts with room
  // for its producers' claims and one more item: the tuner raises it within the budget once it
  // has measured what the items hold (not from a default sized for small ones).
  const bool budget = runtime_->config().host_memory_budget > 0;
  // Under a budget, a tuned graph's pull sinks whose capacity their user did not set are
  // sized by the tuner too (autotune::pull_sink_capacity): their items are outside the
  // admission limit (they count as consumed when they arrive), so their queues are bounded by
  // bytes here. They start with room for two items, then what fits once items are measured.
  const bool tuned = std::any_of(order.begin(), order.end(), [](const NodeBase* n) { return n->auto_concurrency(); });
  const auto pull_sinks = std::count_if(order.begin(), order.end(), [](const NodeBase* n) { return n->kind() == StageKind::pull_sink; });
  for (NodeBase* n : order) {
    if (n->kind() == StageKind::pull_sink) {
      // (Not one fed by an unbatch, whose claims reserve a batch all or none, or by a GPU
      // stage: kept as sized, as other queues; its bytes still count against the admission.
      // Nor one of two: a reader taking from one while the other is full would wait for items
      // that the full one holds back, as the admission limit is kept for them.)
      const bool on = budget && tuned && pull_sinks == 1 && n->default_capacity() && !fixed[n];
      n->tune_capacity(on, n->capacity(), on ? 2 : 0);
      continue;
    }
    const double in = items.count(n) ? std::max(items[n], 1.0) : 1.0;
    n->tune_capacity(opts_.autotune_queues && n->auto_concurrency() && n->default_capacity() &&
                         n->kind() == StageKind::stage && !fixed[n],
                     static_cast<std::size_t>(std::ceil(static_cast<double>(opts_.max_in_flight) / in)),
                     budget ? std::max<std::size_t>(floor[n] + 1, 2) : 0);
  }
}

void GraphCore::check_batching(const std::vector<NodeBase*>& order) {
  // Batches wait to fill while holding items, each of which counts against max_in_flight
  // (fan-out copies too). If every batch can hold size - 1 items at once and that reaches
  // max_in_flight, no source can admit the item that would fill one: the run would hang.
  std::size_t held = 0, batches = 0;
  std::string names;
  for (const auto& n : nodes_)
    if (const std::size_t h = n->holds_while_filling()) {
      held += h;
      ++batches;
      names += (names.empty() ? "'" : ", '") + n->name() + "' (" + std::to_string(h + 1) + ")";
    }
  admit_floor_ = held + 1;
  if (batches > 1 && held + 1 > opts_.max_in_flight)
    throw GraphError("splitflow::Graph '" + name_ + "': its batches " + names + " can hold " +
                     std::to_string(held) + " items between them while they fill, and every "
                     "item counts against max_in_flight (" + std::to_string(opts_.max_in_flight) +
                     "), so the run could stall with each batch short; raise "
                     "GraphOptions::max_in_flight (Python: max_in_flight= of splitflow.Graph or "
                     "GraphDataset) to at least " + std::to_string(held + 1));
  // A batch formed by a dynamic batch must fit every unbatch it reaches.
  for (NodeBase* d : order) {
    const std::size_t limit = d->forms_batches_of();
    if (limit == 0) continue;
    std::vector<const NodeBase*> stack{d};
    std::unordered_set<const NodeBase*> seen{d};
    while (!stack.empty()) {
      const NodeBase* n = stack.back();
      stack.pop_back();
      for (const Edge& e : n->successors()) {
        if (!seen.insert(e.node).second || e.node->forms_batches_of() != 0) continue;
        if (const std::size_t u = e.node->splits_batches_of()) {
          if (u < limit)
            throw GraphError("splitflow::Graph '" + name_ + "': unbatch '" + e.node->name() +
                             "' takes batches of at most " + std::to_string(u) +
                             " items, but dynamic batch '" + d->name() + "' forms batches of up to " +
                             std::to_string(limit) + "; give the unbatch a max_batch of at least " +
                             std::to_string(limit));
          continue;
        }
        stack.push_back(e.node);
      }
    }
  }
}

void GraphCore::check_zips(const std::vector<NodeBase*>& order) {
  for (const auto& n : nodes_) n->clear_drop_listeners();
  paced_.clear();
  pace_lead_ = 0;
  const auto paced = [&](NodeBase* s) -> std::size_t {
    for (std::size_t i = 0; i < paced_.size(); ++i)
      if (paced_[i]->source == s) return i;
    paced_.push_back(std::make_unique<Paced>());
    paced_.back()->source = s;
    return paced_.size() - 1;
  };
  std::unordered_map<const NodeBase*, std::vector<std::pair<NodeBase*, int>>> preds;
  for (NodeBase* n : order)
    for (const Edge& e : n->successors()) preds[e.node].push_back({n, e.port});
  // Each zip's nodes upstream of both its inputs (zips come in topological order: an inner
  // one's before the zips after it).
  std::unordered_map<const NodeBase*, std::unordered_set<const NodeBase*>> common;
  std::size_t pairing_zips = 0;  // zips whose inputs two sources number
  for (NodeBase* z : order) {
    DropListener* listener = z->drop_listener();
    if (!listener) continue;
    const std::string who = "splitflow::Graph '" + name_ + "': zip '" + z->name() + "'";
    // The nodes upstream of input `p`, each once, into `into`: `enter(n)` says whether n
    // counts (and is walked past), `follow(n, port)` whether n's producers on `port` are.
    const auto upstream = [&](int p, std::unordered_set<const NodeBase*>& into, auto&& enter,
                              auto&& follow) {
      std::vector<const NodeBase*> stack;
      for (const auto& [q, port] : preds[z])
        if (port == p) stack.push_back(q);
      while (!stack.empty()) {
        const NodeBase* n = stack.back();
        stack.pop_back();
        if (into.count(n) || !enter(n)) continue;
        into.insert(n);
        for (const auto& [q, port] : preds[n])
          if (follow(n, port)) stack.push_back(q);
      }
    };
    const auto any = [](const NodeBase*) { return true; };
    std::unordered_set<const NodeBase*> anc[2];
    NodeBase* numbered_by[2] = {nullptr, nullptr};
    for (int p = 0; p < 2; ++p) {
      const char* input = p == 0 ? "first" : "second";
      // Every node upstream of this input (anc), and those that number its items (num): past
      // another zip only its first input's side, as a pair carries its halves' one number.
      upstream(p, anc[p], any, [](const NodeBase*, int) { return true; });
      std::unordered_set<const NodeBase*> num;
      upstream(p, num, any, [](const NodeBase* n, int port) {
        return n->kind() != StageKind::zip || port == 0;
      });
      // Paths from each numbering node to this input (capped at 2), consumers before producers.
      std::unordered_map<const NodeBase*, int> paths;
      std::vector<NodeBase*> sources;
      for (auto it = order.rbegin(); it != order.rend(); ++it) {
        if (!num.count(*it)) continue;
        int c = 0;
        for (const Edge& e : (*it)->successors()) {
          if (e.node == z) {
            c += e.port == p ? 1 : 0;
          } else if (num.count(e.node) && (e.node->kind() != StageKind::zip || e.port == 0)) {
            c += paths[e.node];
          }
        }
        paths[*it] = std::min(c, 2);
        if (preds[*it].empty()) sources.push_back(const_cast<NodeBase*>(*it));
      }
      // Pairs are matched by item number, which only names one item on one path.
      if (sources.size() != 1) {
        std::string names;
        for (const NodeBase* s : sources) names += (names.empty() ? "'" : ", '") + s->name() + "'";
        throw GraphError(who + ": its " + input + " input merges items of " +
                         std::to_string(sources.size()) + " sources (" + names +
                         "), so it cannot tell which items belong together; zip branches that "
                         "each come from one source");
      }
      if (paths[sources[0]] > 1)
        throw GraphError(who + ": its " + input + " input gets each item of '" +
                         sources[0]->name() +
                         "' along more than one path (a fan-out merged again), so an item would "
                         "pair twice; give each zip input one path");
      numbered_by[p] = sources[0];
    }
    // Two sources paired by position: paced against each other (try_admit), and each tells
    // the zip when it ended (source_ended).
    if (numbered_by[0] != numbered_by[1] && numbered_by[0]->kind() == StageKind::source &&
        numbered_by[1]->kind() == StageKind::source) {
      const std::size_t i = paced(numbered_by[0]), j = paced(numbered_by[1]);
      for (auto [x, y] : {std::pair{i, j}, std::pair{j, i}})
        if (std::find(paced_[x]->partners.begin(), paced_[x]->partners.end(), y) == paced_[x]->partners.end())
          paced_[x]->partners.push_back(y);
      paced_[i]->numbers.push_back({listener, 0});
      paced_[j]->numbers.push_back({listener, 1});
      ++pairing_zips;
    }
    for (int p = 0; p < 2; ++p) {
      for (const NodeBase* c : anc[p]) {
        if (anc[1 - p].count(c)) continue;  // upstream of both inputs: drops reach both
        if (c->holds_while_filling() || c->forms_batches_of() || c->splits_batches_of())
          throw GraphError(who + ": '" + c->name() + "' batches or unbatches items on its " +
                           (p == 0 ? "first" : "second") +
                           " input (not upstream of both), so the two inputs number their items "
                           "differently (a batch numbers its batches itself, even with one of the "
                           "same size on the other input); batch before the fan-out or after the zip");
      }
      // The nodes of this branch alone tell the zip of the items they drop. Past another zip,
      // that one passes on the drops of the nodes upstream of one of its inputs (it drops
      // their partners, or they were both dropped); those upstream of both of its inputs drop
      // both halves, so that it never hears of them: they tell this zip themselves.
      // (A walk: past an inner zip, through its one-input nodes without them, to its common
      // ones; each node once.)
      std::unordered_set<const NodeBase*> near;
      std::set<std::pair<const NodeBase*, const NodeBase*>> passed;
      std::vector<std::pair<const NodeBase*, const NodeBase*>> stack;  // (node, inner zip)
      for (const auto& [q, port] : preds[z])
        if (port == p) stack.push_back({q, nullptr});
      while (!stack.empty()) {
        const auto [n, inner] = stack.back();
        stack.pop_back();
        if (anc[1 - p].count(n)) continue;  // upstream of both inputs: drops reach both
        if (inner && !common[inner].count(n)) {  // the inner zip passes its drops on
          if (passed.insert({n, inner}).second)
            for (const auto& [q, port] : preds[n]) stack.push_back({q, inner});
          continue;
        }
        if (!near.insert(n).second) continue;
        for (const auto& [q, port] : preds[n])
          stack.push_back({q, n->kind() == StageKind::zip ? n : nullptr});
      }
      for (const NodeBase* n : near) const_cast<NodeBase*>(n)->add_drop_listener(*listener, p);
    }
    for (const NodeBase* n : anc[0])
      if (anc[1].count(n)) common[z].insert(n);
    listener->set_upstream(anc[0], anc[1]);
  }
  // Items of one source waiting at a zip for another's must leave room, with the batches'
  // held items, for the behind source to be admitted. Each zip pairing two sources holds at
  // most the lead of one over the other, per source the pair's items wait for besides (a chain
  // of nested zips: the leads add up along it): at most lead x zips x (sources - 1) items wait
  // at the zips, which the lead keeps to half the room. With a lead of 1, one more must fit.
  if (!paced_.empty()) {
    const std::size_t held = admit_floor_ - 1;
    const std::size_t room = opts_.max_in_flight > held ? opts_.max_in_flight - held : 0;
    const std::size_t waiting = pairing_zips * (paced_.size() - 1);
    if (room <= waiting) {
      std::string names;
      for (const auto& p : paced_) names += (names.empty() ? "'" : ", '") + p->source->name() + "'";
      throw GraphError("splitflow::Graph '" + name_ + "': " +
                       (pairing_zips == 1 ? std::string("a zip pairs") : std::to_string(pairing_zips) + " zips pair") +
                       " the items of the sources " + names +
                       ", whose items wait at the zips for each other's (up to " + std::to_string(waiting) +
                       " at once), but max_in_flight (" + std::to_string(opts_.max_in_flight) + ")" +
                       (held ? " less what its batches hold (" + std::to_string(held) + ")" : std::string()) +
                       " leaves room for " + std::to_string(room) +
                       "; raise GraphOptions::max_in_flight (Python: max_in_flight= of splitflow.Graph or "
                       "GraphDataset) to at least " + std::to_string(held + waiting + 1));
    }
    pace_lead_ = std::max<std::size_t>(1, room / (2 * waiting));
  }
}

void GraphCore::nudge_runtime() noexcept { runtime_->nudge(); }

std::uint64_t GraphCore::runtime_nudges() const noexcept { return runtime_->nudges(); }

bool GraphCore::in_task_of(const RuntimeCore* runtime) noexcept {
  return RuntimeCore::arena_slot(runtime) >= 0;
}

std::shared_ptr<RunState> GraphCore::start() {
  // A task of this runtime (a stage body running an inner graph, as a Taskflow subflow would)
  // that waited for the run would hold one of the threads the run needs: once every thread
  // waits so, nothing runs, and not even cancel() ends it (a new user's trial). Refused here,
  // before anything exists that its graph's destructor would have to wait for on that thread.
  if (RuntimeCore::arena_slot(runtime_.get()) >= 0)
    throw GraphError("splitflow: Graph::run() for graph '" + name_ + "' was called from a task of "
                     "the same Runtime (a stage body, a source or a sink of one of its graphs): "
                     "waiting for it there would hold one of the runtime's " +
                     std::to_string(runtime_->threads()) + " threads while the graph needs them, "
                     "and once every thread waits so, nothing runs; give the stage "
                     "StageOptions::blocking = true (Python: blocking=True), whose bodies run on "
                     "the runtime's blocking threads and may wait, or run the graph on another "
                     "Runtime");
  std::shared_ptr<RunState> run;
  {
    std::lock_guard lk(mu_);
    if (active_)
      throw GraphError("splitflow::Graph '" + name_ +
                       "': it is already running: read that run's pull sinks (PullSink::next; "
                       "Python: for x in sink) and wait for it (Run::wait), or cancel it, before "
                       "another run (Python's g.iterate(sink) starts one of its own)");
    validate();
    for (auto& n : nodes_) n->prepare();  // may throw: nothing is registered yet
    run = std::make_shared<RunState>(this);
    telemetry_ = runtime_->config().telemetry;
    start_ = now_ticks();
    for (auto& n : nodes_) n->reset(start_, telemetry_, runtime_->threads());
    for (std::size_t i = 0; i < nodes_.size(); ++i)
      if (auto late = nodes_[i]->late_takes()) run->track_late_takes(i, std::move(late));
    if (gpu_) {
      gpu_->reset();
      run_device_ = device();
      device_at_start_ = std::make_unique<DeviceStats>(run_device_->stats());
    }
    observers_.clear();
    if (opts_.observer) observers_.push_back(opts_.observer.get());
    if (opts_.trace) {
      std::vector<std::string> names;
      for (const auto& n : nodes_) names.push_back(n->name());
      auto tracer = std::make_shared<Tracer>(name_, std::move(names), opts_.trace_max_events,
                                             steady_ns_of(start_));
      observers_.push_back(tracer.get());
      run->set_tracer(std::move(tracer));
    }
    stop_.store(false, std::memory_order_relaxed);
    stop_reason_.store(StopReason::none, std::memory_order_relaxed);
    closed_by_.store(nullptr, std::memory_order_relaxed);
    cancel_cause_.store(CancelCause::call, std::memory_order_relaxed);
    {
      std::lock_guard tl(token_mu_);
      token_waiters_.clear();
      token_waiting_.store(false);
    }
    for (const auto& p : paced_) {
      p->admitted.store(0, std::memory_order_relaxed);
      p->ended.store(false, std::memory_order_relaxed);
      p->waiting.store(false, std::memory_order_relaxed);
    }
    // The admit limit: max_in_flight; a tuned graph under a memory budget starts at the least
    // it can go on with, and its tuner raises it once its items were measured (RunTuner), so
    // that the first window does not hold max_in_flight items of a size not yet known.
    const bool tuned = std::any_of(nodes_.begin(), nodes_.end(), [](const auto& n) { return n->auto_concurrency(); });
    const std::size_t limit = tuned && admit_limit_tunable() && runtime_->config().host_memory_budget > 0
                                  ? std::min(admit_floor_, opts_.max_in_flight)
                                  : opts_.max_in_flight;
    admit_limit_.store(limit, std::memory_order_relaxed);
    wake_room_.store(wake_room_for(limit), std::memory_order_relaxed);
    // Registered once nothing before it can throw (a source's reset copies the user's body, the
    // device's figures, the tracer): a state registered by a start() that then threw was never
    // published, and the runtime's shutdown cancelled and waited for it through a graph that
    // may be gone (a read-only review).
    runtime_->register_run(run);
    // One unit per source (released when it is exhausted) and one for the starting task.
    pending_.store(sources_.size() + 1, std::memory_order_release);
    current_ = run;
    active_ = true;
    for (auto& n : nodes_) n->begin_run();
  }
  tuner_.reset();  // the last run's (stopped)
  if (std::any_of(nodes_.begin(), nodes_.end(), [](const auto& n) { return n->auto_concurrency(); })) {
    std::vector<NodeBase*> nodes;
    for (auto& n : nodes_) nodes.push_back(n.get());
    const double cores = opts_.autotune_cores > 0 ? opts_.autotune_cores : runtime_->threads();
    // The runtime's threads are a pool that enforces itself; a smaller budget is a share of it.
    const bool pool = cores >= static_cast<double>(runtime_->threads());
    tuner_ = std::make_unique<RunTuner>(*this, std::move(nodes), opts_.autotune_window, cores, pool,
                                        &runtime_->tuning_board(), opts_.priority);
    tuner_->start();
  }
  runtime_->spawn([this] { run_task({nullptr, 0}); }, /*fair=*/true);
  return run;
}

void GraphCore::run_task(Claim first) noexcept {
  try {
    WorkList w;
    if (first.node) {
      first.node->run_claim(w, first.items);
    } else {
      for (NodeBase* s : sources_) s->poke(w);
    }
    execute(w);
  } catch (...) {
    // Only the runtime's own failures get here (bodies are guarded): fail the run.
    fail(first.node ? *first.node : *nodes_.front(), 0, std::current_exception());
  }
  release_unit();
}

void GraphCore::execute(WorkList& w) {
  for (;;) {
    while (!w.pokes.empty()) w.pokes.pop_back()->poke(w);
    if (w.claims.empty()) return;
    // Continue with the first claim (the items just produced, downstream: cache-warm) and
    // hand the rest to other threads.
    runtime_->run_urgent();  // device completions first: they unblock the GPU
    if (runtime_->slice_expired()) {  // this thread's turn is over: the rest waits in line
      for (std::size_t i = 0; i < w.claims.size(); ++i) spawn(w.claims[i]);
      w.claims.clear();
      return;
    }
    const Claim next = w.claims[0];
    for (std::size_t i = 1; i < w.claims.size(); ++i) spawn(w.claims[i]);
    w.claims.clear();
    next.node->run_claim(w, next.items);
  }
}

void GraphCore::spawn(Claim c) {
  pending_.fetch_add(1, std::memory_order_relaxed);
  runtime_->spawn([this, c] { run_task(c); }, /*fair=*/false);
}

void GraphCore::dispatch_external(WorkList& w) {
  if (w.pokes.empty() && w.claims.empty()) return;
  // A claim is spawned only under a unit of its run. From outside a task nothing else holds one:
  // a pull sink's reader taking an item after the run ended (the queue's late items) woke the
  // producer, whose claim was spawned with the run's count at zero; the task's release then
  // ended the finished run a second time, or, once the next run had started (and stored its own
  // count over that unit), left the next run one unit short or over: a rerun after a break hung
  // (docs/reliability.md). With the run over there is nothing to wake: the next start resets the
  // nodes.
  if (!try_acquire_unit()) {
    w.pokes.clear();
    w.claims.clear();
    return;
  }
  while (!w.pokes.empty()) w.pokes.pop_back()->poke(w);
  if (dispatch_hook_ && !w.claims.empty()) dispatch_hook_(w.claims.size());
  for (std::size_t i = 0; i < w.claims.size(); ++i) spawn(w.claims[i]);
  w.claims.clear();
  release_unit();
}

std::size_t GraphCore::wake_room_for(std::size_t limit) const noexcept {
  // Sources waiting for the admit limit wake when this much room is free (retire_items): at
  // most half the limit, and never more than what batches holding items cannot take. Paced
  // sources (a zip pairing them) wake at every free slot: the ahead source's items wait at
  // the zip until the other is admitted, so retires may stop short of more room.
  if (!paced_.empty()) return 1;
  const std::size_t held = admit_floor_ - 1;
  return std::max<std::size_t>(1, std::min(limit / 2, limit > held ? limit - held : std::size_t{0}));
}

void GraphCore::set_admit_limit(std::size_t n, WorkList& w) noexcept {
  n = std::clamp(n, std::min(admit_floor_, opts_.max_in_flight), opts_.max_in_flight);
  // Both before the check below, which wakes the waiters if the new limit has room for them
  // (a retire that saw one of the two new values and not the other is covered by it).
  wake_room_.store(wake_room_for(n), std::memory_order_seq_cst);
  admit_limit_.store(n, std::memory_order_seq_cst);
  retire_items(0, w);
}

void GraphCore::retire_items(std::uint64_t n, WorkList& w) noexcept {
  const std::uint64_t items =
      (pending_.fetch_sub(n << kItemShift, std::memory_order_seq_cst) >> kItemShift) - n;
  // Dekker with try_admit(): either we see the waiter's flag or it sees our decrement. Waiting
  // sources wake once wake_room_ items of room are free, not at every retire: with W sources
  // waiting, waking them all for each item cost O(W) per item. (A source that registered with
  // less room than that took what it saw itself; wake_room_ <= max_in_flight - what batches
  // can hold, so retires always reach it.)
  if (token_waiting_.load(std::memory_order_seq_cst) &&
      items + wake_room_.load(std::memory_order_seq_cst) <= admit_limit_.load(std::memory_order_seq_cst)) {
    std::lock_guard lk(token_mu_);
    for (NodeBase* s : token_waiters_) w.pokes.push_back(s);
    token_waiters_.clear();
    token_waiting_.store(false, std::memory_order_relaxed);
  }
}

GraphCore::Paced* GraphCore::paced_of(const NodeBase& source) const noexcept {
  for (const auto& p : paced_)
    if (p->source == &source) return p.get();
  return nullptr;
}

std::size_t GraphCore::pace_room(const Paced& p) const noexcept {
  // Within pace_lead_ of every partner that has not ended (seq_cst: Dekker with poke_paced's
  // callers, as for the admit limit).
  const std::uint64_t mine = p.admitted.load(std::memory_order_seq_cst);
  std::uint64_t room = std::numeric_limits<std::uint64_t>::max();
  for (std::size_t i : p.partners) {
    const Paced& q = *paced_[i];
    if (q.ended.load(std::memory_order_seq_cst)) continue;
    const std::uint64_t upto = q.admitted.load(std::memory_order_seq_cst) + pace_lead_;
    room = std::min<std::uint64_t>(room, upto > mine ? upto - mine : 0);
  }
  return static_cast<std::size_t>(std::min<std::uint64_t>(room, std::numeric_limits<std::size_t>::max()));
}

void GraphCore::poke_paced(const Paced& p, WorkList& w) noexcept {
  for (std::size_t i : p.partners) {
    Paced& q = *paced_[i];
    if (q.waiting.load(std::memory_order_seq_cst) && q.waiting.exchange(false, std::memory_order_seq_cst))
      w.pokes.push_back(q.source);
  }
}

void GraphCore::admitted(NodeBase& source, std::size_t n, WorkList& w) noexcept {
  if (Paced* p = paced_of(source)) {
    p->admitted.fetch_add(n, std::memory_order_seq_cst);
    poke_paced(*p, w);
  }
}

void GraphCore::source_ended(NodeBase& source, std::uint64_t items, WorkList& w) noexcept {
  Paced* p = paced_of(source);
  if (!p) return;
  p->ended.store(true, std::memory_order_seq_cst);
  poke_paced(*p, w);
  for (const auto& [zip, port] : p->numbers) zip->numbering_source_ended(port, items, source, w);
}

std::size_t GraphCore::try_admit(NodeBase& source, std::size_t want) {
  // A source a zip pairs with another is held within pace_lead_ items of it (of the items
  // each started: admitted()); waiting for it, it is poked when the partner's items start or
  // it ends.
  Paced* paced = paced_of(source);
  if (paced) {
    std::size_t room = pace_room(*paced);
    if (room == 0) {
      paced->waiting.store(true, std::memory_order_seq_cst);
      room = pace_room(*paced);
      if (room == 0) return 0;
      paced->waiting.store(false, std::memory_order_relaxed);
    }
    want = std::min(want, room);
  }
  return admit_within_limit(source, want);  // counted for the pace once they start (admitted)
}

std::size_t GraphCore::admit_within_limit(NodeBase& source, std::size_t want) {
  // Admitted items are counted at once (one atomic step), so that sources admitted at the same
  // time cannot each see the whole room; a source gives back what it did not produce.
  const auto take = [&]() -> std::size_t {
    std::uint64_t v = pending_.load(std::memory_order_seq_cst);
    const std::size_t limit = admit_limit_.load(std::memory_order_seq_cst);
    for (;;) {
      const std::uint64_t items = v >> kItemShift;
      if (items >= limit) return 0;
      const std::uint64_t n = std::min<std::uint64_t>(want, limit - items);
      if (pending_.compare_exchange_weak(v, v + (n << kItemShift), std::memory_order_seq_cst))
        return static_cast<std::size_t>(n);
    }
  };
  if (const std::size_t n = take()) return n;
  {
    std::lock_guard lk(token_mu_);
    if (std::find(token_waiters_.begin(), token_waiters_.end(), &source) == token_waiters_.end())
      token_waiters_.push_back(&source);
    token_waiting_.store(true, std::memory_order_seq_cst);
  }
  return take();
}

bool GraphCore::try_acquire_unit() noexcept {
  std::uint64_t v = pending_.load(std::memory_order_acquire);
  while (v != 0)
    if (pending_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) return true;
  return false;
}

void GraphCore::release_unit() noexcept {
  if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) complete();
}

void GraphCore::cancel() noexcept { cancel_by(nullptr); }

void GraphCore::close_from(const NodeBase& sink) noexcept { cancel_by(&sink); }

void GraphCore::cancel_by(const NodeBase* sink) noexcept {
  if (!try_acquire_unit()) return;
  const NodeBase* none = nullptr;
  if (sink != nullptr && stop_reason_.load() == StopReason::none)
    closed_by_.compare_exchange_strong(none, sink);
  cancel_holding_unit();
  release_unit();
}

void GraphCore::cancel_holding_unit(CancelCause why) noexcept {
  // The cause of the cancel that stops the run (of two at once, the one whose stop is first),
  // stored before stop() publishes the stop (its release store of stop_), which readers see.
  StopReason expected = StopReason::none;
  if (stop_reason_.compare_exchange_strong(expected, StopReason::cancelled)) cancel_cause_.store(why);
  stop(StopReason::cancelled);
}

std::string GraphCore::cancel_note(const NodeBase& reader, std::uint64_t given) const {
  if (stop_reason_.load() != StopReason::cancelled) return {};
  const NodeBase* by = closed_by_.load();
  if (by == &reader) return {};
  // (The graph's destruction was said as "Run::cancel() ... or the runtime's end": a new user's
  // trial.)
  const CancelCause cause = cancel_cause_.load();
  const std::string who =
      by ? "the reader of pull sink '" + by->name() + "' closed it (close(), or leaving its loop early)"
      : cause == CancelCause::graph_destroyed
          ? std::string("its Graph was destroyed while the sink was read (keep the Graph alive "
                        "until its readers are done)")
      : cause == CancelCause::runtime_end
          ? std::string("its Runtime was destroyed (a Runtime ends the runs of its graphs)")
          : std::string("Run::cancel() stopped it (from another thread; from Python also Ctrl-C "
                        "or the interpreter's exit)");
  return "splitflow: graph '" + name_ + "': the run was cancelled before pull sink '" +
         reader.name() + "' reached the end of its stream: " + who + ", so the " +
         std::to_string(given) +
         " items it gave are not the whole stream (a reader that stops early itself calls "
         "close() or leaves its loop, and is not told)";
}

void GraphCore::fail(const NodeBase& node, std::uint64_t seq, std::exception_ptr error) noexcept {
  StopReason expected = StopReason::none;
  if (!stop_reason_.compare_exchange_strong(expected, StopReason::failed)) return;
  std::shared_ptr<RunState> run;
  {
    std::lock_guard lk(mu_);
    run = current_;
  }
  run->record_error(name_, node.name(), seq, std::move(error));
  stop(StopReason::failed);
}

void GraphCore::stop(StopReason why) noexcept {
  StopReason expected = StopReason::none;
  stop_reason_.compare_exchange_strong(expected, why);
  stop_.store(true, std::memory_order_release);
  WorkList w;
  for (auto& n : nodes_) n->drop_queued(w);
  // Pokes would grant nothing now that the run is stopping.
}

void GraphCore::rethrow_if_failed() const {
  std::shared_ptr<RunState> run;
  {
    std::lock_guard lk(mu_);
    run = current_;
  }
  if (run) run->rethrow_if_failed();
}

RunStats GraphCore::collect_stats(bool final) const {
  // Hold every node's lock, taken in topological order (the global lock order), so that all
  // stages are read at the same instant and each one's states add up to the wall time.
  // The device over the run (read first: no node lock is held while the device is asked).
  std::optional<DeviceStats> window;
  if (run_device_ && device_at_start_) window = run_device_->stats().since(*device_at_start_);
  std::vector<std::unique_lock<SpinLock>> locks;
  locks.reserve(topo_.size());
  for (NodeBase* n : topo_) locks.emplace_back(n->mutex());
  const Ticks now = now_ticks();
  RunStats st;
  st.graph = name_;
  st.status = RunStatus::running;
  st.wall_ns = ticks_to_ns(now - start_);
  st.stages.reserve(nodes_.size());
  for (const auto& n : nodes_) {
    if (final) n->finalize_locked(now);
    st.stages.push_back(n->snapshot_locked(now));
  }
  if (gpu_) st.gpu = gpu_->snapshot(steady_now_ns());
  if (tuner_) st.autotune = tuner_->events();
  st.max_in_flight = admit_limit();
  st.threads = static_cast<std::size_t>(std::max(runtime_->threads(), 0));
  if (window) {
    st.gpu.device_wall_ns = window->wall_ns;
    st.gpu.device_busy_ns = window->busy_ns;
    st.gpu.device_mean_leases = window->mean_leases();
    st.gpu.device_streams = window->streams;
    for (std::size_t k = window->lease_time_ns.size(); k-- > 0;)
      if (window->lease_time_ns[k] > 0) {
        st.gpu.device_max_leases = k;
        break;
      }
  }
  return st;
}

RunStats GraphCore::snapshot() const { return collect_stats(false); }

void GraphCore::retune_at_end(RunStats& st) noexcept {
  // What nodes size for the next run from this one's figures (automatic pinned rings): their
  // decisions join the run's, in its stats and to its observers.
  try {
    std::vector<autotune::TuneEvent> events;
    for (std::size_t i = 0; i < nodes_.size() && i < st.stages.size(); ++i)
      nodes_[i]->retune_at_end(st.stages[i], st.wall_ns, events);
    std::vector<std::string> texts;
    for (const autotune::TuneEvent& e : events) texts.push_back(e.text());
    for (std::size_t i = 0; i < events.size() && observed(); ++i) {
      const autotune::TuneEvent& e = events[i];
      const TuningEvent te{&name_, &e.stage, &e.knob, e.from, e.to, &e.reason, &texts[i], e.at_ns};
      for_each_observer([&](Observer& o) { o.on_tune(te); });
    }
    for (std::string& t : texts) st.autotune.push_back(std::move(t));
  } catch (...) {  // no memory for the decision: the next run keeps this one's sizes
  }
}

void GraphCore::complete() noexcept {
  if (tuner_) tuner_->stop();  // before the final figures (its decisions are among them)
  std::shared_ptr<RunState> run;
  {
    std::lock_guard lk(mu_);
    run = current_;
  }
  RunStats st = collect_stats(true);
  retune_at_end(st);
  // Before the run is published: once wait() returns, what only this run used is released.
  for (auto& n : nodes_) n->end_run();
  const StopReason why = stop_reason_.load();
  const RunStatus status = why == StopReason::failed      ? RunStatus::failed
                           : why == StopReason::cancelled ? RunStatus::cancelled
                                                          : RunStatus::succeeded;
  runtime_->unregister_run(run.get());
  {
    // Together, so that a new run cannot start between them and have its pull sinks ended.
    std::lock_guard lk(mu_);
    for (auto& n : nodes_) n->end_of_stream();
    active_ = false;
  }
  run->publish(status, std::move(st));
}

namespace {
thread_local std::uint64_t t_current_item = CurrentItem::kNone;
}  // namespace

std::uint64_t CurrentItem::exchange(std::uint64_t seq) noexcept {
  return std::exchange(t_current_item, seq);
}

}  // namespace detail

std::optional<std::uint64_t> current_item() noexcept {
  const std::uint64_t seq = detail::t_current_item;
  if (seq == detail::CurrentItem::kNone) return std::nullopt;
  return seq;
}

void detail::moved_from_graph() {
  throw GraphError("splitflow::Graph: this graph was moved from; use the Graph it was moved "
                   "into");
}

Graph::Graph(Runtime& runtime, std::string name, GraphOptions options)
    : core_(std::make_unique<detail::GraphCore>(runtime.core(), std::move(name), options)) {}
Graph::~Graph() = default;
Graph::Graph(Graph&&) noexcept = default;
Graph& Graph::operator=(Graph&&) noexcept = default;

Run Graph::run() { return Run(core().start()); }

bool Graph::running() const { return core_ && core_->running(); }

}  // namespace splitflow
