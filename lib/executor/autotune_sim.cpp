// The discrete-event simulator of include/splitflow/executor/autotune_sim.hpp. Items are counts
// (a chain needs no identities): each stage has a queue, slots reserved in it by producers whose
// bodies run, and invocations in flight; a job (one item at one stage) goes core -> I/O wait ->
// device -> done. A producer starts an item only when it can reserve a slot downstream, as
// splitflow's stages do, so a full queue blocks it before its body runs.
#include "splitflow/executor/autotune_sim.hpp"

#include <algorithm>
#include <cmath>
#include <deque>
#include <queue>
#include <random>

namespace splitflow::autotune {

namespace {

constexpr std::size_t kQueueGuard = std::size_t{1} << 20;  // a starting "unlimited" queue

struct Job {
  std::uint32_t p = 0, i = 0;
  double cpu = 0, io = 0, gpu = 0;
};

enum class EvType : std::uint8_t { cpu_done, io_done, gpu_done };

struct Ev {
  double t;
  std::uint64_t seq;
  EvType type;
  std::uint32_t job;
  bool operator>(const Ev& o) const noexcept { return t != o.t ? t > o.t : seq > o.seq; }
};

struct StageState {
  SimStage spec;
  double factor = 1;
  std::size_t k = 1, cap = 1;
  std::size_t queue = 0, reserved = 0, in_progress = 0, waiting_core = 0;
  // This window's figures.
  std::uint64_t items = 0;
  double work = 0, cpu = 0, gpu = 0, busy = 0, starved = 0, blocked = 0, queue_time = 0;
};

struct PipeState {
  std::vector<StageState> st{};
  std::size_t max_in_flight = kUnlimited;
  std::size_t in_flight = 0;
  std::uint64_t delivered = 0;
  double cores_in_use = 0, cores_max = 0;
  std::size_t bytes_max = 0;
  std::vector<double> device_busy{};
  Autotuner tuner;
  Allocation running{};// the settings of the window in progress
};

class Sim {
 public:
  Sim(const std::vector<SimPipeline>& pipes, const SimOptions& o) : o_(o), rng_(o.seed) {
    free_cores_ = static_cast<std::size_t>(std::floor(o.cores + 1e-9));
    int devices = 0;
    for (const SimPipeline& p : pipes)
      for (const SimStage& s : p.stages) devices = std::max(devices, s.device + 1);
    devices_.resize(static_cast<std::size_t>(devices));
    std::vector<GraphDemand> unknown;
    for (const SimPipeline& p : pipes)
      unknown.push_back({1e18, kUnlimited, p.priority});
    const std::vector<Budget> shares = split_budget(unknown, {o.cores, o.memory_bytes});
    for (std::size_t pi = 0; pi < pipes.size(); ++pi) {
      const SimPipeline& p = pipes[pi];
      Budget share = shares[pi];
      share.pool = pipes.size() == 1;  // alone on the simulated cores, which enforce themselves
      PipeState ps{.tuner = Autotuner(o.policy, share)};
      ps.max_in_flight = p.max_in_flight;
      for (const SimStage& s : p.stages) {
        StageState ss;
        ss.spec = s;
        ss.k = s.fixed_concurrency.value_or(s.concurrency);
        ss.cap = s.fixed_capacity.value_or(s.capacity);
        ps.st.push_back(ss);
      }
      ps.device_busy.assign(devices_.size(), 0);
      ps.running = settings(ps);
      pipes_.push_back(std::move(ps));
      priority_.push_back(p.priority);
    }
  }

  SimResult run() {
    SimResult r;
    r.windows.resize(pipes_.size());
    const auto windows = static_cast<std::size_t>(std::floor(o_.duration_s / o_.window_s + 1e-9));
    std::vector<bool> applied(o_.changes.size(), false);
    for (std::size_t p = 0; p < pipes_.size(); ++p) pump(static_cast<std::uint32_t>(p));
    for (std::size_t w = 1; w <= windows; ++w) {
      const double end = static_cast<double>(w) * o_.window_s;
      while (!events_.empty() && events_.top().t <= end) {
        const Ev ev = events_.top();
        events_.pop();
        advance(ev.t);
        handle(ev);
        ++r.events_simulated;
      }
      advance(end);
      // Close the window: measure, share the budget, let each tuner decide, apply.
      std::vector<Sample> samples;
      for (std::size_t p = 0; p < pipes_.size(); ++p) {
        samples.push_back(sample(pipes_[p], end));
        SimWindow sw;
        sw.end_s = end;
        sw.rate = static_cast<double>(pipes_[p].delivered) / o_.window_s;
        sw.allocation = pipes_[p].running;
        sw.cores_in_use_max = pipes_[p].cores_max;
        sw.bytes_max = pipes_[p].bytes_max;
        sw.device_busy = pipes_[p].device_busy;
        for (double& b : sw.device_busy) b /= o_.window_s;
        sw.sample = samples.back();
        r.windows[p].push_back(std::move(sw));
      }
      if (o_.tune) {
        if (pipes_.size() > 1) {
          std::vector<GraphDemand> demands;
          for (std::size_t p = 0; p < pipes_.size(); ++p)
            demands.push_back(pipes_[p].tuner.demand(priority_[p]));
          const std::vector<Budget> shares = split_budget(demands, {o_.cores, o_.memory_bytes});
          for (std::size_t p = 0; p < pipes_.size(); ++p) pipes_[p].tuner.set_budget(shares[p]);
        }
        for (std::size_t p = 0; p < pipes_.size(); ++p) {
          const Decision d = pipes_[p].tuner.observe(samples[p]);
          if (d.changed) apply(pipes_[p], d.allocation);
        }
      }
      for (std::size_t c = 0; c < o_.changes.size(); ++c) {
        const CostChange& ch = o_.changes[c];
        if (!applied[c] && ch.at_s <= end + 1e-9 && ch.pipeline < pipes_.size() &&
            ch.stage < pipes_[ch.pipeline].st.size()) {
          pipes_[ch.pipeline].st[ch.stage].factor *= ch.factor;
          applied[c] = true;
        }
      }
      for (PipeState& ps : pipes_) reset_window(ps);
      for (std::size_t p = 0; p < pipes_.size(); ++p) pump(static_cast<std::uint32_t>(p));
    }
    for (PipeState& ps : pipes_) {
      r.events.push_back(ps.tuner.events());
      r.final_allocation.push_back(ps.tuner.allocation().stages.empty() ? ps.running
                                                                         : ps.tuner.allocation());
      r.final_bound.push_back(ps.tuner.bound());
      r.final_budget.push_back(ps.tuner.budget());
    }
    r.cores_in_use_max = cores_max_;
    return r;
  }

 private:
  static Allocation settings(const PipeState& ps) {
    Allocation a;
    for (const StageState& s : ps.st) a.stages.push_back({s.k, s.cap, 0});
    a.max_in_flight = ps.max_in_flight;
    return a;
  }

  void apply(PipeState& ps, const Allocation& a) {
    for (std::size_t i = 0; i < ps.st.size() && i < a.stages.size(); ++i) {
      ps.st[i].k = std::max<std::size_t>(1, a.stages[i].concurrency);
      ps.st[i].cap = std::max<std::size_t>(1, a.stages[i].capacity);
    }
    ps.max_in_flight = std::max<std::size_t>(1, a.max_in_flight);
    ps.running = a;
  }

  double draw(double cost) {
    if (cost <= 0) return 0;
    const double u = static_cast<double>(rng_() >> 11) * 0x1p-53;
    return cost * (1 + o_.jitter * (2 * u - 1));
  }

  bool full(const PipeState& ps, std::size_t i) const {
    if (i >= ps.st.size()) return false;  // the sink takes everything
    const StageState& s = ps.st[i];
    return s.queue + s.reserved >= std::min(s.cap, kQueueGuard);
  }

  void pump(std::uint32_t p) {
    PipeState& ps = pipes_[p];
    const std::size_t n = ps.st.size();
    for (bool changed = true; changed;) {
      changed = false;
      for (std::size_t i = n; i-- > 0;) {
        StageState& s = ps.st[i];
        while (s.queue > 0 && s.in_progress < s.k && !full(ps, i + 1)) {
          --s.queue;
          ++s.in_progress;
          if (i + 1 < n) ++ps.st[i + 1].reserved;
          start(p, static_cast<std::uint32_t>(i));
          changed = true;
        }
      }
      while (ps.in_flight < ps.max_in_flight && n > 0 && !full(ps, 0)) {
        ++ps.st[0].queue;
        ++ps.in_flight;
        changed = true;
      }
    }
  }

  std::uint32_t new_job(const Job& j) {
    if (!free_jobs_.empty()) {
      const std::uint32_t id = free_jobs_.back();
      free_jobs_.pop_back();
      jobs_[id] = j;
      return id;
    }
    jobs_.push_back(j);
    return static_cast<std::uint32_t>(jobs_.size() - 1);
  }

  void schedule(double t, EvType type, std::uint32_t job) { events_.push({t, seq_++, type, job}); }

  void start(std::uint32_t p, std::uint32_t i) {
    const StageState& s = pipes_[p].st[i];
    Job j{p, i, draw(s.spec.cpu_s * s.factor), draw(s.spec.io_s * s.factor),
          s.spec.device >= 0 ? draw(s.spec.gpu_s * s.factor) : 0.0};
    const std::uint32_t id = new_job(j);
    if (j.cpu > 0) {
      if (free_cores_ > 0) run_on_core(id);
      else {
        ++pipes_[p].st[i].waiting_core;
        core_queue_.push_back(id);
      }
    } else {
      after_cpu(id);
    }
  }

  void run_on_core(std::uint32_t id) {
    --free_cores_;
    pipes_[jobs_[id].p].cores_in_use += 1;
    schedule(now_ + jobs_[id].cpu, EvType::cpu_done, id);
  }

  void after_cpu(std::uint32_t id) {
    if (jobs_[id].io > 0) schedule(now_ + jobs_[id].io, EvType::io_done, id);
    else after_io(id);
  }

  void after_io(std::uint32_t id) {
    const Job& j = jobs_[id];
    const int d = pipes_[j.p].st[j.i].spec.device;
    if (d >= 0 && j.gpu > 0) {
      Device& dev = devices_[static_cast<std::size_t>(d)];
      if (!dev.busy) {
        dev.busy = true;
        schedule(now_ + j.gpu, EvType::gpu_done, id);
      } else {
        dev.queue.push_back(id);
      }
    } else {
      finish(id);
    }
  }

  void finish(std::uint32_t id) {
    const Job j = jobs_[id];
    free_jobs_.push_back(id);
    PipeState& ps = pipes_[j.p];
    StageState& s = ps.st[j.i];
    --s.in_progress;
    ++s.items;
    s.cpu += j.cpu;
    s.work += s.spec.device >= 0 ? j.cpu : j.cpu + j.io;
    if (s.spec.device >= 0) {
      s.gpu += j.gpu;
      ps.device_busy[static_cast<std::size_t>(s.spec.device)] += j.gpu;
    }
    if (j.i + 1 < ps.st.size()) {
      --ps.st[j.i + 1].reserved;
      ++ps.st[j.i + 1].queue;
    } else {
      ++ps.delivered;
      --ps.in_flight;
    }
    pump(j.p);
  }

  void handle(const Ev& ev) {
    const std::uint32_t id = ev.job;
    switch (ev.type) {
      case EvType::cpu_done: {
        ++free_cores_;
        pipes_[jobs_[id].p].cores_in_use -= 1;
        if (!core_queue_.empty()) {
          const std::uint32_t next = core_queue_.front();
          core_queue_.pop_front();
          --pipes_[jobs_[next].p].st[jobs_[next].i].waiting_core;
          run_on_core(next);
        }
        after_cpu(id);
        break;
      }
      case EvType::io_done: after_io(id); break;
      case EvType::gpu_done: {
        const Job& j = jobs_[id];
        Device& dev = devices_[static_cast<std::size_t>(pipes_[j.p].st[j.i].spec.device)];
        if (!dev.queue.empty()) {
          const std::uint32_t next = dev.queue.front();
          dev.queue.pop_front();
          schedule(now_ + jobs_[next].gpu, EvType::gpu_done, next);
        } else {
          dev.busy = false;
        }
        finish(id);
        break;
      }
    }
  }

  // Time passes from now_ to t in the state left by the last event.
  void advance(double t) {
    const double dt = t - now_;
    double cores = 0;
    for (PipeState& ps : pipes_) {
      std::size_t bytes = 0;
      for (std::size_t i = 0; i < ps.st.size(); ++i) {
        StageState& s = ps.st[i];
        if (s.in_progress > s.waiting_core) s.busy += dt;
        else if (s.queue > 0 && s.in_progress < s.k && full(ps, i + 1)) s.blocked += dt;
        else s.starved += dt;
        s.queue_time += static_cast<double>(s.queue) * dt;
        bytes += (s.queue + s.in_progress) * s.spec.item_bytes;
      }
      ps.bytes_max = std::max(ps.bytes_max, bytes);
      ps.cores_max = std::max(ps.cores_max, ps.cores_in_use);
      cores += ps.cores_in_use;
    }
    cores_max_ = std::max(cores_max_, cores);
    now_ = t;
  }

  Sample sample(const PipeState& ps, double end) const {
    auto ns = [](double s) { return static_cast<std::int64_t>(std::llround(s * 1e9)); };
    Sample s;
    s.end_ns = ns(end);
    s.window_ns = ns(o_.window_s);
    s.delivered = ps.delivered;
    for (std::size_t i = 0; i < ps.st.size(); ++i) {
      const StageState& st = ps.st[i];
      StageSample x;
      x.name = st.spec.name;
      x.gpu = st.spec.device >= 0;
      x.device = std::max(0, st.spec.device);
      if (i > 0) x.producers = {i - 1};
      x.visits = 1;  // a chain: every item through every stage
      x.items = st.items;
      x.work_ns = ns(st.work);
      x.cpu_ns = o_.report_cpu_time ? ns(st.cpu) : -1;
      x.gpu_busy_ns = ns(st.gpu);
      x.busy_ns = ns(st.busy);
      x.starved_ns = ns(st.starved);
      x.blocked_ns = ns(st.blocked);
      x.mean_queue = st.queue_time / o_.window_s;
      x.item_bytes = st.spec.item_bytes;
      x.concurrency = st.k;
      x.capacity = st.cap;
      x.fixed_concurrency = st.spec.fixed_concurrency;
      x.fixed_capacity = st.spec.fixed_capacity;
      x.max_concurrency = st.spec.max_concurrency;
      s.stages.push_back(std::move(x));
    }
    return s;
  }

  void reset_window(PipeState& ps) {
    for (StageState& s : ps.st) {
      s.items = 0;
      s.work = s.cpu = s.gpu = s.busy = s.starved = s.blocked = s.queue_time = 0;
    }
    ps.delivered = 0;
    ps.cores_max = ps.cores_in_use;
    std::size_t bytes = 0;
    for (const StageState& s : ps.st) bytes += (s.queue + s.in_progress) * s.spec.item_bytes;
    ps.bytes_max = bytes;
    std::fill(ps.device_busy.begin(), ps.device_busy.end(), 0.0);
  }

  struct Device {
    bool busy = false;
    std::deque<std::uint32_t> queue;
  };

  SimOptions o_;
  std::mt19937_64 rng_;
  double now_ = 0;
  std::uint64_t seq_ = 0;
  std::size_t free_cores_ = 0;
  double cores_max_ = 0;
  std::vector<PipeState> pipes_;
  std::vector<int> priority_;
  std::vector<Device> devices_;
  std::vector<Job> jobs_;
  std::vector<std::uint32_t> free_jobs_;
  std::deque<std::uint32_t> core_queue_;
  std::priority_queue<Ev, std::vector<Ev>, std::greater<Ev>> events_;
};

}  // namespace

double SimResult::steady_rate(std::size_t p, std::size_t n) const {
  const auto& w = windows.at(p);
  n = std::min(n, w.size());
  if (n == 0) return 0;
  double sum = 0;
  for (std::size_t i = w.size() - n; i < w.size(); ++i) sum += w[i].rate;
  return sum / static_cast<double>(n);
}

double SimResult::steady_busy(int d, std::size_t n) const {
  double total = 0;
  for (const auto& w : windows) {
    const std::size_t m = std::min(n, w.size());
    if (m == 0) continue;
    double sum = 0;
    for (std::size_t i = w.size() - m; i < w.size(); ++i)
      if (static_cast<std::size_t>(d) < w[i].device_busy.size())
        sum += w[i].device_busy[static_cast<std::size_t>(d)];
    total += sum / static_cast<double>(m);
  }
  return total;
}

SimResult simulate(const std::vector<SimPipeline>& pipelines, const SimOptions& options) {
  return Sim(pipelines, options).run();
}

}  // namespace splitflow::autotune
