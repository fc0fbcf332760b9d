#include "run_tuner.hpp"

#include <algorithm>
#include <cmath>
#include <optional>
#include <unordered_map>

#include "runtime_core.hpp"
#include "saturating.hpp"
#include "splitflow/core/detail/clock.hpp"
#include "splitflow/executor/detail/graph_core.hpp"
#include "splitflow/executor/detail/node.hpp"

namespace splitflow::detail {

namespace {
// A window is measured once the graph delivered this many items in it, or it is this many
// windows long.
constexpr std::uint64_t kMinDelivered = 4;
constexpr std::size_t kMaxJoined = 8;
}  // namespace

namespace {

// Items through n per item delivered, where the graph's shape says it: a chain to the graph's
// one sink (1; before a Graph::batch of 64, 64; a skip after n is not counted). 0 (measured
// instead) past a fan-out, a merge, a zip, or a dynamic batch or unbatch (their batches vary).
// Measured, a run's first windows read x2.27 for a plain chain's stage whose queues were
// filling.
double shape_visits(const NodeBase& n) {
  double v = 1;
  const NodeBase* at = &n;
  for (;;) {
    const auto& succ = at->successors();
    if (succ.empty()) return v;
    if (succ.size() != 1) return 0;
    const NodeBase* next = succ[0].node;
    // (A GPU stage's two ports are one input: a producer on each is a merge.)
    if (next->kind() == StageKind::zip || next->predecessors(0) + next->predecessors(1) != 1 ||
        next->forms_batches_of() != 0 || next->splits_batches_of() != 0)
      return 0;
    v *= next->items_per_output();
    at = next;
  }
}

}  // namespace

RunTuner::RunTuner(GraphCore& graph, std::vector<NodeBase*> nodes, std::chrono::milliseconds window,
                   double cores, bool pool, TuningBoard* board, int priority)
    : graph_(graph),
      nodes_(std::move(nodes)),
      window_(std::max(window, std::chrono::milliseconds(1))),
      cores_(cores),
      pool_(pool),
      board_(board),
      priority_(priority),
      // A queue's buffer beyond its producers' reserved slots: at least 8 items here (the
      // policy's 2 is for the simulator's items of one claim each): a producer's claim takes a
      // run of slots, and its consumer's pops wake it only once the queue drained to half.
      tuner_(autotune::PolicyOptions{.min_capacity = 8},
             autotune::Budget{.cores = cores, .pool = pool}),
      admit_limit_(graph.admit_limit()) {
  for (NodeBase* n : nodes_) {
    tuned_.push_back(n->auto_concurrency());
    max_capacity_.push_back(n->auto_capacity() ? n->max_capacity() : 0);
  }
  // Items delivered count every sink's: with one sink, a fan-out before a stage re-merges on
  // its way (the walk sees the merge); with two, a stage feeding one of them visits a share.
  std::size_t sinks = 0;
  for (NodeBase* n : nodes_) sinks += n->kind() == StageKind::sink || n->kind() == StageKind::pull_sink;
  for (NodeBase* n : nodes_) shape_visits_.push_back(sinks == 1 ? shape_visits(*n) : 0.0);
}

void RunTuner::start() {
  if (board_) {
    board_->join(this, priority_);
    joined_ = true;
    warm_start();
  }
  thread_ = std::thread([this] { loop(); });
}

void RunTuner::warm_start() {
  // The latest tuned run of a graph of this name ended its automatic stages at these
  // concurrencies: start there (within the cores), not at 1; the tuner goes on from there.
  {
    // The stages the graph built on the blocking threads from the last run's placement.
    std::lock_guard lk(mu_);
    for (std::size_t i = 0; i < nodes_.size(); ++i)
      if (tuned_[i] && nodes_[i]->auto_placed() && events_.size() < kKeptFirst)
        events_.push_back(nodes_[i]->name() + " on the blocking threads: the last run of graph '" +
                          graph_.name() + "' found its bodies waiting (warm start)");
  }
  const auto last = board_->recall(graph_.name());
  if (last.empty()) return;
  const auto whole_cores = static_cast<std::size_t>(std::max(1.0, cores_));
  std::vector<Change> changes;
  std::vector<std::string> texts;
  for (std::size_t i = 0; i < nodes_.size(); ++i) {
    NodeBase* n = nodes_[i];
    if (!tuned_[i]) continue;
    const auto it = std::find_if(last.begin(), last.end(),
                                 [&](const auto& e) { return e.first == n->name(); });
    if (it == last.end()) continue;
    std::size_t from;
    {
      std::lock_guard lk(n->mutex());
      from = n->concurrency();
    }
    // (GPU stages' bursts and async stages' items out hold no thread while they wait.)
    const std::size_t to = n->kind() == StageKind::gpu_stage || n->asynchronous()
                               ? it->second
                               : std::min(it->second, whole_cores);
    if (to <= from) continue;
    changes.push_back({n, to});
    texts.push_back(n->name() + " " + std::to_string(from) + " -> " + std::to_string(to) +
                    ": where the last run of graph '" + graph_.name() + "' ended (warm start)");
  }
  if (changes.empty()) return;
  post(std::move(changes));
  std::lock_guard lk(mu_);
  for (std::string& t : texts)
    if (events_.size() < kKeptFirst) events_.push_back(std::move(t));  // among the first kept
}

void RunTuner::post(std::vector<Change> changes) {
  graph_.post_if_running([changes = std::move(changes)](WorkList& w) {
    for (const Change& c : changes) {
      if (c.capacity) c.node->set_capacity(c.capacity, w);
      if (c.concurrency) c.node->set_concurrency(c.concurrency, w);
    }
  });
}

RunTuner::~RunTuner() { stop(); }

void RunTuner::stop() noexcept {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (joined_) {
    board_->leave(this);
    joined_ = false;
    // What the next run of a graph of this name starts from (warm_start): the automatic
    // stages' concurrencies as the run ends (the tuner's thread has stopped changing them).
    try {
      std::vector<std::pair<std::string, std::size_t>> ended;
      for (std::size_t i = 0; i < nodes_.size(); ++i) {
        if (!tuned_[i]) continue;
        std::lock_guard lk(nodes_[i]->mutex());
        ended.emplace_back(nodes_[i]->name(), nodes_[i]->concurrency());
      }
      board_->remember(graph_.name(), std::move(ended));
    } catch (...) {  // no memory to remember it: the next run starts at 1
    }
  }
}

std::vector<std::string> RunTuner::events() const {
  std::lock_guard lk(mu_);
  std::vector<std::string> out = events_;
  if (omitted_ > 0)
    out.insert(out.begin() + kKeptFirst,
               "(" + std::to_string(omitted_) + " later decisions not kept: the first " +
                   std::to_string(kKeptFirst) + " and the last " +
                   std::to_string(kMaxEvents - kKeptFirst) + " are)");
  return out;
}

std::size_t RunTuner::window_item_bytes(const StageStats& a, const StageStats& b) noexcept {
  // What one of its input items holds: the mean of those sampled in the window.
  const std::uint64_t samples = b.item_bytes_samples - std::min(a.item_bytes_samples, b.item_bytes_samples);
  return samples > 0 && b.item_bytes_samples >= a.item_bytes_samples
             ? static_cast<std::size_t>(std::llround(
                   std::max(0.0, static_cast<double>(b.item_bytes) * static_cast<double>(b.item_bytes_samples) -
                                     static_cast<double>(a.item_bytes) * static_cast<double>(a.item_bytes_samples)) /
                   static_cast<double>(samples)))
             : b.item_bytes;
}

autotune::Sample RunTuner::sample_of(const RunStats& before, const RunStats& now,
                                     const std::vector<bool>& tuned, double cores,
                                     std::vector<std::size_t>* modelled, double* fixed_cores,
                                     const std::vector<std::size_t>* tuned_capacity,
                                     std::size_t* fixed_bytes, std::size_t blocking_threads) {
  const auto ceiling = [&](std::size_t i) -> std::size_t {
    return tuned_capacity && i < tuned_capacity->size() ? (*tuned_capacity)[i] : 0;
  };
  autotune::Sample s;
  s.end_ns = now.wall_ns;
  s.window_ns = now.wall_ns - before.wall_ns;
  s.delivered = now.items_delivered() - before.items_delivered();
  // The modelled stages: everything with a body of ours (sources pace themselves; a pull
  // sink's consumer is the caller's thread).
  std::unordered_map<std::string, std::size_t> index;
  std::vector<std::size_t> picked;
  const double window = static_cast<double>(std::max<std::int64_t>(s.window_ns, 1));
  const auto whole_cores = static_cast<std::size_t>(std::max(1.0, cores));
  double fixed = 0;
  std::size_t held = 0;
  using autotune::sat_add;
  using autotune::sat_mul;
  for (std::size_t i = 0; i < now.stages.size(); ++i) {
    const StageStats& st = now.stages[i];
    const StageKind k = st.kind;
    held = sat_add(held, st.ring_capacity);  // (pinned rings: fixed for the run)
    if (k == StageKind::source) continue;
    // A GPU stage whose concurrency its user set is modelled at that number (the tuner works
    // around it): its bursts hold no cores, but the rate it allows is the graph's bound when it
    // is the limit, and the cores the others need to keep it fed are what the graph asks for.
    const bool modelled_fixed = !tuned[i] && k == StageKind::gpu_stage;
    if (k == StageKind::pull_sink || (!tuned[i] && !modelled_fixed)) {
      // What the stages the tuner does not model can hold: their queue, and an item in each
      // body they can run at once (an unlimited one: at most the cores').
      const std::size_t bodies =
          k == StageKind::pull_sink ? 0
          : st.concurrency_limit == Concurrency::unlimited ? whole_cores
                                                             : st.concurrency_limit;
      held = sat_add(held, sat_mul(sat_add(st.capacity, bodies), st.item_bytes));
    }
    if (k == StageKind::pull_sink) continue;
    if (!tuned[i] && !modelled_fixed) {
      // A CPU stage whose concurrency its user set is not modelled: the cores it used in the
      // window are taken off the budget of the automatic ones (the tuner works around it).
      fixed += static_cast<double>(now.stages[i].work_ns - before.stages[i].work_ns) / window;
      continue;
    }
    index[now.stages[i].name] = picked.size();
    picked.push_back(i);
  }
  if (fixed_cores) *fixed_cores = fixed;
  if (fixed_bytes) *fixed_bytes = held;
  // The graph's device time (GpuStats::busy_ns) is per graph: with several GPU stages each
  // automatic one is given the share of its bursts' host work among all of them.
  std::int64_t gpu_work = 0;
  for (std::size_t i = 0; i < now.stages.size(); ++i)
    if (now.stages[i].kind == StageKind::gpu_stage)
      gpu_work += now.stages[i].work_ns - before.stages[i].work_ns;
  const std::int64_t gpu_busy = now.gpu.busy_ns - before.gpu.busy_ns;
  for (std::size_t i : picked) {
    const StageStats& a = before.stages[i];
    const StageStats& b = now.stages[i];
    autotune::StageSample x;
    x.name = b.name;
    x.gpu = b.kind == StageKind::gpu_stage;
    x.items = b.items_out - a.items_out;
    x.work_ns = b.work_ns - a.work_ns;
    x.serial_ns = b.serial_ns - a.serial_ns;
    x.serial_wait_ns = b.serial_wait_ns - a.serial_wait_ns;
    x.busy_ns = b.busy_ns - a.busy_ns;
    x.starved_ns = b.starved_ns - a.starved_ns;
    x.blocked_ns = b.blocked_ns - a.blocked_ns;
    x.mean_queue = std::max(0.0, (b.mean_queue * static_cast<double>(now.wall_ns) -
                                  a.mean_queue * static_cast<double>(before.wall_ns)) /
                                     window);
    x.capacity = std::max<std::size_t>(b.capacity, 1);
    x.item_bytes = window_item_bytes(a, b);
    // A queue the tuner sizes is not fixed; the others (a user's number, after a batch) are.
    if (ceiling(i) == 0) x.fixed_capacity = x.capacity;
    // A stage left unlimited by its user holds at most the cores' worth of threads.
    const std::size_t limit =
        b.concurrency_limit == Concurrency::unlimited ? whole_cores : b.concurrency_limit;
    x.concurrency = std::max<std::size_t>(limit, 1);
    if (!tuned[i]) x.fixed_concurrency = x.concurrency;  // (a user's GPU stage: above)
    if (x.gpu) {
      // A GPU stage's work time is its bursts' (lease to completion: device time and the waits
      // for it), not CPU; the host's enqueue inside it is not measured apart, and counted as
      // none, so that the device's time is not charged to the cores.
      x.cpu_ns = 0;
      // Bursts in flight, each holding a stream while it runs: at most the device's streams.
      if (now.gpu.device_streams > 0) {
        x.max_concurrency = now.gpu.device_streams;
        // (A user's unlimited GPU stage has as many bursts at once as the device has streams.)
        if (!tuned[i] && b.concurrency_limit == Concurrency::unlimited)
          x.fixed_concurrency = x.concurrency = now.gpu.device_streams;
      }
      x.gpu_busy_ns = gpu_work > 0 ? static_cast<std::int64_t>(static_cast<double>(gpu_busy) *
                                                               static_cast<double>(x.work_ns) /
                                                               static_cast<double>(gpu_work))
                                   : gpu_busy;
    } else if (b.call_ns >= 0) {
      // An async stage (Graph::async_stage, or a blocking stage, whose bodies run on the
      // runtime's blocking threads and charge their CPU time to call_ns): its bodies hand each
      // item on and return; the answer comes later, from elsewhere. The calls are its CPU, the rest of its time per item
      // is a wait that holds no thread (an I/O stage to the model when the calls are under half
      // of it), so its concurrency may go past the cores: up to the slots its consumers' queues
      // have, each item out holding one of them until it is emitted.
      x.cpu_ns = b.call_ns - a.call_ns;
      std::size_t slots = autotune::kUnlimited;
      // (A consumer's queue the tuner sizes may grow to its ceiling.)
      for (const std::string& c : b.consumers)
        for (std::size_t j = 0; j < now.stages.size(); ++j)
          if (now.stages[j].name == c)
            slots = std::min(slots, std::max<std::size_t>(
                                        ceiling(j) ? ceiling(j) : now.stages[j].capacity, 1));
      x.max_concurrency = slots == autotune::kUnlimited ? whole_cores : slots;
      // A blocking stage's bodies run on the runtime's blocking threads: past them a body only
      // queues for one, holding its item, and the queueing reads as a slower item (a trial with
      // 4 blocking threads saw 158 bodies at once, each "costing" ever more).
      if (b.wait_ns >= 0)
        x.max_concurrency = std::min(x.max_concurrency, blocking_threads);
      // A CPU stage after all: its calls and the CPU its answerers charged are most of its
      // time, or (a blocking stage, which says how long its bodies waited) its bodies did not
      // wait clearly longer than they computed (twice: a busy machine, a VM's stolen time, a
      // first window of few items make a computing body seem to wait a little): no more than
      // the cores, as any CPU stage.
      const std::int64_t waited = b.wait_ns >= 0 ? b.wait_ns - std::max<std::int64_t>(a.wait_ns, 0) : -1;
      if (x.items > 0 && (x.cpu_ns * 2 >= x.work_ns || (waited >= 0 && waited < 2 * x.cpu_ns)))
        x.max_concurrency = std::min(x.max_concurrency, whole_cores);
    } else {
      x.max_concurrency = whole_cores;
    }
    s.stages.push_back(std::move(x));
  }
  // Producers: the modelled stages that feed each one (through the consumers lists; a stage
  // fed through an unmodelled one counts as fed by the source).
  for (std::size_t i : picked)
    for (const std::string& c : now.stages[i].consumers) {
      auto it = index.find(c);
      if (it != index.end()) s.stages[it->second].producers.push_back(index[now.stages[i].name]);
    }
  // For the texts: what outside the model feeds each modelled stage and what it feeds.
  const auto outside = [&](std::size_t j) {
    const StageStats& o = now.stages[j];
    switch (o.kind) {
      case StageKind::source:
        return "source '" + o.name + "'" + (o.fed_by.empty() ? "" : " (fed by " + o.fed_by + ")");
      case StageKind::pull_sink: return "pull sink '" + o.name + "' (its reader)";
      case StageKind::sink: return "sink '" + o.name + "'";
      default: return "'" + o.name + "' (not tuned)";
    }
  };
  for (std::size_t m = 0; m < picked.size(); ++m) {
    const StageStats& st = now.stages[picked[m]];
    for (std::size_t j = 0; j < now.stages.size(); ++j) {
      if (index.count(now.stages[j].name)) continue;
      const auto& cs = now.stages[j].consumers;
      if (s.stages[m].fed_by.empty() && std::find(cs.begin(), cs.end(), st.name) != cs.end())
        s.stages[m].fed_by = outside(j);
      if (s.stages[m].feeds.empty() &&
          std::find(st.consumers.begin(), st.consumers.end(), now.stages[j].name) != st.consumers.end()) {
        s.stages[m].feeds = outside(j);
        s.stages[m].feeds_consumer =
            now.stages[j].kind == StageKind::sink || now.stages[j].kind == StageKind::pull_sink;
      }
    }
  }
  if (modelled) *modelled = std::move(picked);
  return s;
}

autotune::GraphDemand RunTuner::demand_of(double fixed) const {
  // (With the cores of the stages it does not model, which come off its share: a demand sized
  // to the rate, its consumer's pace, lost them.)
  autotune::GraphDemand demand = tuner_.demand(priority_);
  if (demand.cores < static_cast<double>(autotune::kUnlimited)) demand.cores += fixed;
  return demand;
}

void RunTuner::loop() {
  RunStats before = graph_.snapshot();
  std::int64_t serial_before = detail::process_serial_ns();
  std::size_t joined = 0;  // windows joined to the next one
  std::unique_lock lk(mu_);
  while (!cv_.wait_for(lk, window_, [&] { return stop_; })) {
    lk.unlock();
    RunStats now = graph_.snapshot();
    // A window in which the graph delivered too few items to measure its rate is joined to the
    // next (kMaxJoined windows at most: a run that stalls that long is measured so): a new
    // user's trial at 20 ms windows read "converged at 0 items/s, 0.00 of the bound 1474" and
    // "rate fell from 943.5 to 0 items/s", the run in order behind one 8-megapixel photo.
    if (now.items_delivered() - before.items_delivered() < kMinDelivered && ++joined < kMaxJoined) {
      lk.lock();
      continue;
    }
    joined = 0;
    const std::int64_t serial_now = detail::process_serial_ns();
    std::vector<std::size_t> modelled;
    double fixed = 0;
    std::size_t fixed_bytes = 0;
    autotune::Sample s =
        sample_of(before, now, tuned_, cores_, &modelled, &fixed, &max_capacity_, &fixed_bytes,
                  graph_.runtime_core()->config().blocking_threads);
    for (std::size_t m = 0; m < modelled.size() && m < s.stages.size(); ++m)
      if (shape_visits_[modelled[m]] > 0) s.stages[m].visits = shape_visits_[modelled[m]];
    // The GIL the process's other Python bodies held in the window (other graphs', the stages
    // of this one that are not tuned, its sources' and sinks'): not the modelled stages' to have.
    s.serial_others_ns = serial_now - serial_before;
    for (const autotune::StageSample& x : s.stages) s.serial_others_ns -= x.serial_ns;
    serial_before = serial_now;
    // The graph's share of the runtime's threads (and memory budget) among the tuned runs now
    // (all of them while it is alone), within its own budget; a share is not a pool (the others
    // run on the rest).
    double cores = cores_;
    std::size_t memory = autotune::kUnlimited;
    bool alone = true;
    if (board_) {
      const autotune::Budget share = board_->share(this, demand_of(fixed), &alone);
      cores = std::min(cores, share.cores);
      memory = share.memory_bytes;
    }
    const bool pool = pool_ && alone;
    // Whole cores, so that noise in the fixed stages' use does not re-tune every window.
    const double left = std::max(1.0, std::round(cores - fixed));
    // The memory the modelled stages may hold: the share less what the others can hold, in
    // steps of a sixteenth of the share, lowered at once and raised only by more than a step
    // (a new item size, a graph's start or end), so that the sampling's noise does not re-tune
    // every window and the budget is never over-posted.
    if (memory != autotune::kUnlimited) {
      const std::size_t step = std::max<std::size_t>(memory / 16, 1);
      const std::size_t want = (memory > fixed_bytes ? memory - fixed_bytes : 0) / step * step;
      if (memory_left_ == autotune::kUnlimited || want < memory_left_ || want > memory_left_ + step)
        memory_left_ = want;
    } else {
      memory_left_ = autotune::kUnlimited;
    }
    if (left != tuner_.budget().cores || pool != tuner_.budget().pool ||
        memory_left_ != tuner_.budget().memory_bytes)
      tuner_.set_budget({.cores = left, .memory_bytes = memory_left_, .pool = pool});
    const autotune::Decision d = tuner_.observe(s);
    // (The demand this window showed, posted now for the others' next windows, not at this
    // graph's next: a stalled graph's windows are joined up to 2 s long.)
    if (board_) board_->share(this, demand_of(fixed));
    std::vector<autotune::TuneEvent> events = d.events;
    // A pull sink's items are outside the admission limit (consumed as they arrive; its reader
    // may hold them past the run): under a budget, what its queue may hold is sized here (if
    // its user did not size it: a quarter of the share) and taken off the admission's memory.
    std::size_t sink_bytes = 0, unmeasured_slots = 0;  // (a sink whose items were not measured yet)
    if (memory != autotune::kUnlimited) {
      std::vector<Change> sized;
      // (An unlimited producer's claims at once: the runtime's threads, the tuner's cores.)
      const auto unlimited_claims = static_cast<std::size_t>(std::max(1.0, cores_));
      for (std::size_t i = 0; i < now.stages.size() && i < before.stages.size() && i < nodes_.size(); ++i) {
        const StageStats& b = now.stages[i];
        if (b.kind != StageKind::pull_sink) continue;
        const std::size_t bytes = window_item_bytes(before.stages[i], b);
        std::size_t capacity = b.capacity;
        if (max_capacity_[i]) {
          // Its producers' claims at once: each reserves a slot in it while its bodies run.
          std::size_t claims = 0;
          for (const StageStats& p : now.stages)
            if (std::find(p.consumers.begin(), p.consumers.end(), b.name) != p.consumers.end())
              claims = autotune::sat_add(claims, p.concurrency_limit == Concurrency::unlimited
                                                      ? unlimited_claims : std::max<std::size_t>(p.concurrency_limit, 1));
          const autotune::SinkQueueInput q{.current = capacity, .memory = memory, .item_bytes = bytes,
                                           .claims = claims, .ceiling = max_capacity_[i]};
          if (std::optional<autotune::TuneEvent> e = autotune::pull_sink_capacity(q, b.name, s.end_ns)) {
            capacity = e->to;
            sized.push_back(Change{nodes_[i], 0, capacity});
            events.push_back(std::move(*e));
          }
        }
        sink_bytes = autotune::sat_add(sink_bytes, autotune::sat_mul(capacity, bytes));
        if (bytes == 0) unmeasured_slots = autotune::sat_add(unmeasured_slots, capacity);
      }
      if (!sized.empty()) post(std::move(sized));
    }
    // The items the graph lets in at once, within its share of the memory budget: each item
    // alive counts against the limit, so this bounds what a user's capacities can hold too.
    if (memory != autotune::kUnlimited && graph_.admit_limit_tunable()) {
      autotune::AdmissionInput in{.current = admit_limit_,
                                  .memory = memory,
                                  .sink_bytes = sink_bytes,
                                  .floor = graph_.admit_floor(),
                                  .ceiling = graph_.options().max_in_flight};
      for (std::size_t i = 0; i < now.stages.size() && i < before.stages.size(); ++i) {
        const StageStats& b = now.stages[i];
        in.fixed_bytes = autotune::sat_add(in.fixed_bytes, b.ring_capacity);
        if (b.kind == StageKind::source) continue;
        const std::size_t bytes = window_item_bytes(before.stages[i], b);
        if (bytes > in.unit_bytes) {
          in.unit_bytes = bytes;
          in.widest = b.name;
        }
      }
      // A sink not measured yet holds items of the widest size measured, at most.
      in.sink_bytes = autotune::sat_add(in.sink_bytes, autotune::sat_mul(unmeasured_slots, in.unit_bytes));
      // A shortfall said once, and again only after two windows within the budget (sizes that
      // hover at the edge would say it every other window).
      const bool over = autotune::over_budget(in);
      within_budget_windows_ = over ? 0 : within_budget_windows_ + 1;
      if (within_budget_windows_ >= 2) told_over_budget_ = false;
      in.told_over = told_over_budget_;
      if (std::optional<autotune::TuneEvent> e = autotune::admission_limit(in, s.end_ns)) {
        told_over_budget_ = told_over_budget_ || over;
        admit_limit_ = e->to;
        graph_.post_if_running([g = &graph_, n = e->to](WorkList& w) { g->set_admit_limit(n, w); });
        events.push_back(std::move(*e));
      }
    }
    before = std::move(now);
    std::vector<Change> changes;
    if (d.changed)
      for (std::size_t k = 0; k < modelled.size() && k < d.allocation.stages.size(); ++k) {
        NodeBase* n = nodes_[modelled[k]];
        const autotune::StageSetting& a = d.allocation.stages[k];
        Change c{n};
        if (n->auto_concurrency()) c.concurrency = std::max<std::size_t>(a.concurrency, 1);
        // (set_capacity holds it within [1, the queue's ceiling].)
        if (max_capacity_[modelled[k]] && a.capacity != s.stages[k].capacity)
          c.capacity = std::max<std::size_t>(a.capacity, 1);
        if (c.concurrency || c.capacity) changes.push_back(c);
      }
    if (!changes.empty()) post(std::move(changes));
    std::vector<std::string> texts;
    for (const autotune::TuneEvent& e : events) texts.push_back(e.text());
    if (graph_.observed() && !events.empty()) {
      const std::int64_t t_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                    std::chrono::steady_clock::now().time_since_epoch())
                                    .count();
      for (std::size_t i = 0; i < events.size(); ++i) {
        const autotune::TuneEvent& e = events[i];
        const TuningEvent te{&graph_.name(), &e.stage, &e.knob, e.from, e.to, &e.reason,
                             &texts[i], t_ns};
        graph_.for_each_observer([&](Observer& o) { o.on_tune(te); });
      }
    }
    lk.lock();
    for (std::string& t : texts) {
      // Bounded whatever the run's length: the first decisions (the model's allocation) and
      // the latest; those between are counted.
      if (events_.size() == kMaxEvents) {
        events_.erase(events_.begin() + kKeptFirst);
        ++omitted_;
      }
      events_.push_back(std::move(t));
    }
  }
}

}  // namespace splitflow::detail
