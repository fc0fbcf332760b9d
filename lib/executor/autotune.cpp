// Autotune's policy: the cost model, the bound, the integer solver, buffer sizing, budget
// sharing and the online hill climb (include/splitflow/executor/autotune.hpp).
#include "splitflow/executor/autotune.hpp"

#include "saturating.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <utility>

namespace splitflow::autotune {

namespace {

constexpr double kEps = 1e-9;
// The gain a trial past the GIL's bound on the model must show to be kept.
constexpr double kPastSerialGain = 0.15;
// The share of the cores a stage's slots past them must demand (CPU a slot, summed) to be tried
// at half as many ("threads past the cores", Autotuner::propose).
constexpr double kPastCoresDemand = 0.8;
// The least share of the shared lock's time the modelled stages are given (the others' holds
// are measured as their CPU demand with it taken, which counts what they computed without it).
constexpr double kMinSerialShare = 0.05;
constexpr double kInf = std::numeric_limits<double>::infinity();

bool tunable(const StageModel& m) noexcept { return !m.fixed_concurrency.has_value(); }

std::size_t ceiling_of(const StageModel& m) noexcept {
  return m.fixed_concurrency ? *m.fixed_concurrency : std::max<std::size_t>(1, m.max_concurrency);
}

// Devices' rates: 1 / (summed visits x device seconds of the stages on each).
std::map<int, double> device_rates(const std::vector<StageModel>& models) {
  std::map<int, double> load;
  for (const StageModel& m : models)
    if (m.resource == Resource::gpu) load[m.device] += m.visits * m.gpu_s;
  std::map<int, double> rates;
  for (auto [d, l] : load) rates[d] = l > 0 ? 1.0 / l : kInf;
  return rates;
}

// CPU seconds per item delivered, summed over the stages: the fluid bound's measure.
double cpu_per_item(const std::vector<StageModel>& models) noexcept {
  double cpu = 0;
  for (const StageModel& m : models) cpu += m.visits * m.cpu_s;
  return cpu;
}

// Seconds per item delivered that the stages' bodies hold the lock they share (a Python
// body's GIL: StageModel::serial_s): one body at a time, so its inverse bounds the rate.
double serial_per_item(const std::vector<StageModel>& models) noexcept {
  double s = 0;
  for (const StageModel& m : models) s += m.visits * m.serial_s;
  return s;
}

// The share of the shared lock's time left to the modelled stages (StageModel::serial_share:
// the same in each model; bodies outside them hold the rest).
double share_of(const StageModel& m) noexcept { return std::clamp(m.serial_share, kMinSerialShare, 1.0); }
double serial_share(const std::vector<StageModel>& models) noexcept {
  return models.empty() ? 1.0 : share_of(models.front());
}

// The rate the shared lock allows the modelled stages (kInf: none of them takes it).
double serial_rate(const std::vector<StageModel>& models) noexcept {
  const double serial = serial_per_item(models);
  return serial > 0 ? serial_share(models) / serial : kInf;
}

// Whether the shared lock binds at `rate`: its holds per item fill the time left to them.
bool gil_binds(const std::vector<StageModel>& models, double rate) noexcept {
  const double r = serial_rate(models);
  return std::isfinite(r) && rate >= r * (1 - 1e-6);
}

// The stage that holds the shared lock longest per item delivered (models.size(): none).
std::size_t serial_holder(const std::vector<StageModel>& models) noexcept {
  std::size_t at = models.size();
  for (std::size_t i = 0; i < models.size(); ++i)
    if (models[i].serial_s > 0 &&
        (at == models.size() || models[i].visits * models[i].serial_s > models[at].visits * models[at].serial_s))
      at = i;
  return at;
}

// Slots the producers of stage i reserve in its queue: one per invocation in flight.
std::size_t reserve_of(const std::vector<StageModel>& models, const std::vector<std::size_t>& k,
                       std::size_t i) {
  std::size_t r = 0;
  for (std::size_t p : models[i].producers)
    if (p < k.size()) r = sat_add(r, k[p]);
  return r;
}

// The most host bytes items can hold: queued ones (at most the capacity, less the slots that
// producers' invocations reserve) and invocations in flight (each holds its input; its output
// goes into a reserved slot). An upper bound: sum of capacity x item bytes, plus, for each
// invocation in flight, what its input holds beyond its outputs' slots.
std::size_t bytes_with(const std::vector<StageModel>& models, const std::vector<std::size_t>& k,
                       const std::vector<std::size_t>& cap) {
  const std::size_t n = models.size();
  std::vector<std::size_t> out_bytes(n, 0);
  for (std::size_t c = 0; c < n; ++c)
    for (std::size_t p : models[c].producers)
      if (p < n) out_bytes[p] = sat_add(out_bytes[p], models[c].item_bytes);
  std::size_t total = 0;
  for (std::size_t i = 0; i < n; ++i) {
    total = sat_add(total, sat_mul(cap[i], models[i].item_bytes));
    if (models[i].item_bytes > out_bytes[i])
      total = sat_add(total, sat_mul(k[i], models[i].item_bytes - out_bytes[i]));
  }
  return total;
}

// The smallest capacities that let every producer invocation run: its reserve and one more.
std::vector<std::size_t> min_capacities(const std::vector<StageModel>& models,
                                        const std::vector<std::size_t>& k) {
  std::vector<std::size_t> cap(models.size());
  for (std::size_t i = 0; i < models.size(); ++i)
    cap[i] = models[i].fixed_capacity ? *models[i].fixed_capacity
                                      : sat_add(reserve_of(models, k, i), 1);
  return cap;
}

// What the items can hold with every stage at its least (concurrency 1 or its user's, the
// least queues): no allocation holds less, so a memory budget below it bounds nothing below
// it (the graph's admission limit bounds its items then: admission_limit).
std::size_t least_bytes(const std::vector<StageModel>& models) {
  std::vector<std::size_t> k(models.size());
  for (std::size_t i = 0; i < models.size(); ++i)
    k[i] = models[i].fixed_concurrency ? *models[i].fixed_concurrency : 1;
  return bytes_with(models, k, min_capacities(models, k));
}

// Why a rate is out of reach, or Limit::none when it is feasible; k gets the concurrency it needs.
Limit check(const std::vector<StageModel>& models, const Budget& budget, double r,
            std::vector<std::size_t>& k, std::size_t& at) {
  k.assign(models.size(), 1);
  for (auto [d, rate] : device_rates(models))
    if (r > rate * (1 + kEps)) {
      for (std::size_t i = 0; i < models.size(); ++i)
        if (models[i].resource == Resource::gpu && models[i].device == d) at = i;
      return Limit::gpu;
    }
  // One body at a time holds the lock the stages' bodies share (a Python body's GIL).
  if (r > serial_rate(models) * (1 + kEps)) {
    at = serial_holder(models);
    return Limit::stage;
  }
  double cores = 0;
  for (std::size_t i = 0; i < models.size(); ++i) {
    const StageModel& m = models[i];
    k[i] = m.fixed_concurrency ? *m.fixed_concurrency : std::min(slots_for(m, r), ceiling_of(m));
    if (stage_rate(m, k[i]) < r * (1 - kEps)) {
      at = i;
      return Limit::stage;
    }
    cores += cores_of(m, k[i]);
    // A pool runs at most its cores of one stage's bodies at once.
    if (budget.pool && cores_of(m, k[i]) > budget.cores + kEps) {
      at = i;
      return Limit::cores;
    }
  }
  const bool fits_cpu = r * cpu_per_item(models) <= budget.cores * (1 + kEps);
  if (budget.pool) {
    // The pool's threads take the invocations in turn: what must fit is the CPU the rate needs.
    if (!fits_cpu) return Limit::cores;
  } else if (cores > budget.cores + kEps) {
    // A share smaller than one slot per stage still runs each stage once (no fewer is
    // possible): the floor is allowed while the rate's CPU fits the share.
    bool at_floor = true;
    for (std::size_t i = 0; i < models.size(); ++i) {
      const StageModel& m = models[i];
      at_floor &= k[i] <= (m.fixed_concurrency ? *m.fixed_concurrency : slots_for(m, 0.0));
    }
    if (!at_floor || !fits_cpu) return Limit::cores;
  }
  const std::size_t bytes = bytes_with(models, k, min_capacities(models, k));
  if (bytes > budget.memory_bytes && bytes > least_bytes(models)) return Limit::memory;
  return Limit::none;
}

std::string seconds(double s) {
  if (s >= 1) return fmt::format("{:.3g} s", s);
  if (s >= 1e-3) return fmt::format("{:.3g} ms", s * 1e3);
  return fmt::format("{:.3g} us", s * 1e6);
}

std::string percent(double f) { return fmt::format("{:.0f}%", 100 * f); }

// "the GIL its Python bodies share: held 2.06 ms per item ('parse' 1.5 ms, 'augment' 0.56 ms)"
std::string serial_text(const std::vector<StageModel>& models) {
  std::string who;
  int holders = 0;
  for (const StageModel& m : models)
    if (m.serial_s > 0) {
      who += fmt::format("{}'{}' {}", holders++ ? ", " : "", m.name, seconds(m.visits * m.serial_s));
    }
  const double share = serial_share(models);
  return fmt::format("the GIL its Python bodies share: held {} per item ({}), one body at a time{}",
                     seconds(serial_per_item(models)), who,
                     share < 0.995 ? fmt::format(", {} of it left by the Python bodies outside the model",
                                             percent(share))
                               : std::string());
}

// A stage's cost is per item it takes; the rates are in items the graph delivers. After a
// Graph::batch the two differ (a decode takes 64 samples per batch delivered): " x64" says so.
// (Measured: a skip downstream, the queues filling, move it a little from 1; a batch, an
// unbatch or a fan-out move it by half or more.)
std::string visits_text(const StageModel& m) {
  return m.visits >= 1.5 || (m.visits > 0 && m.visits <= 0.67) ? fmt::format(" x{:.3g}", m.visits)
                                                                 : std::string();
}
// Why a converged rate is well under the bound, from the window's waits: what the model leaves
// out (the graph's consumer, a pull sink's reader: a training loop; its source; a stage the
// tuner does not set) gives the pace, not the tuned stages. A trial's reader-bound run said only
// "0.09 of the bound". Empty when no wait shows it.
std::string short_of_bound_text(const Sample& s) {
  const double win = static_cast<double>(s.window_ns);
  if (win <= 0) return {};
  double blocked = 0, starved = 0;
  const StageSample* at_end = nullptr;
  const StageSample* at_start = nullptr;
  for (const StageSample& st : s.stages) {
    const double b = static_cast<double>(st.blocked_ns) / win;
    const double w = static_cast<double>(st.starved_ns) / win;
    if (!st.feeds.empty() && b > blocked) blocked = b, at_end = &st;
    // (A wait with items queued is for a thread, not for input: not the source's.)
    if (!st.fed_by.empty() && st.mean_queue < 1.0 && w > starved) starved = w, at_start = &st;
  }
  if (at_end && blocked >= 0.3 && blocked >= starved)
    return fmt::format("; under it because {} takes fewer: '{}' waited {} of the last {} for room "
                       "in it{}",
                       at_end->feeds, at_end->name, percent(blocked), seconds(win * 1e-9),
                       at_end->feeds.find("(its reader)") != std::string::npos
                           ? " (the loop reading it sets the pace: make it faster, or the graph's "
                             "cores can go to other work)"
                           : "");
  if (at_start && starved >= 0.3)
    return fmt::format("; under it because {} gives fewer: '{}' waited {} of the last {} for its "
                       "input",
                       at_start->fed_by, at_start->name, percent(starved), seconds(win * 1e-9));
  return {};
}

bool any_visits(const std::vector<StageModel>& models) {
  return std::any_of(models.begin(), models.end(),
                     [](const StageModel& m) { return !visits_text(m).empty(); });
}

std::string byte_text(double b) {
  if (b >= double(1 << 30)) return fmt::format("{:.3g} GiB", b / double(1 << 30));
  if (b >= double(1 << 20)) return fmt::format("{:.3g} MiB", b / double(1 << 20));
  if (b >= 1024) return fmt::format("{:.3g} KiB", b / 1024);
  return fmt::format("{:.0f} B", b);
}

std::string memory_text(std::size_t bytes) {
  return bytes == kUnlimited ? std::string("unlimited") : byte_text(static_cast<double>(bytes));
}

// "19 of 32 cores"; on a pool, whose threads take invocations in turn, the slots' worth.
// A graph has a slot a stage at least, which may be more than its budget (two stages on a
// share of one core): said so, not "2 of 1 cores" (a new C++ user's trial).
std::string cores_text(const Allocation& a, const Budget& b) {
  const char* over = a.cores > b.cores + 1e-9 ? ": one slot a stage at least, more than the "
                                               : "";
  return b.pool ? fmt::format("slots for {:.4g} cores on a pool of {:g}{}{}", a.cores, b.cores,
                              over, *over ? "pool" : "")
                : fmt::format("{:.4g} of {:g} cores{}{}", a.cores, b.cores, over,
                              *over ? "budget" : "");
}

}  // namespace

// Ring depths and max_in_flight follow from concurrency and capacities.
static void finish_settings(const std::vector<StageModel>& models, Allocation& a) {
  a.max_in_flight = 0;
  for (std::size_t i = 0; i < models.size(); ++i) {
    StageSetting& s = a.stages[i];
    // A GPU stage's ring holds its queued items and those its bursts are copying.
    s.ring_items = models[i].resource == Resource::gpu ? sat_add(s.capacity, s.concurrency) : 0;
    // Items in the graph: queued (reserved slots included) and in the last stages' bodies.
    a.max_in_flight = sat_add(a.max_in_flight, s.capacity);
    bool feeds = false;
    for (const StageModel& c : models)
      feeds |= std::find(c.producers.begin(), c.producers.end(), i) != c.producers.end();
    if (!feeds) a.max_in_flight = sat_add(a.max_in_flight, s.concurrency);
  }
  account(models, a);
}

const char* to_string(Resource r) noexcept {
  switch (r) {
    case Resource::cpu: return "cpu";
    case Resource::io: return "io";
    case Resource::gpu: return "gpu";
  }
  return "?";
}

const char* to_string(Limit l) noexcept {
  switch (l) {
    case Limit::none: return "none";
    case Limit::cores: return "cores";
    case Limit::stage: return "stage";
    case Limit::gpu: return "gpu";
    case Limit::memory: return "memory";
  }
  return "?";
}

const char* to_string(Action a) noexcept {
  switch (a) {
    case Action::initial: return "initial";
    case Action::retune: return "retune";
    case Action::probe: return "probe";
    case Action::keep: return "keep";
    case Action::revert: return "revert";
    case Action::release: return "release";
    case Action::converged: return "converged";
  }
  return "?";
}

double cores_of(const StageModel& m, std::size_t k) noexcept {
  return static_cast<double>(k) * m.cores_per_slot();
}

double stage_rate(const StageModel& m, std::size_t k) noexcept {
  const double per_slot = m.visits * m.wall_s;
  double r = per_slot > 0 ? static_cast<double>(k) / per_slot : kInf;
  if (m.resource == Resource::gpu && m.gpu_s > 0) r = std::min(r, 1.0 / (m.visits * m.gpu_s));
  if (m.serial_s > 0) r = std::min(r, share_of(m) / (m.visits * m.serial_s));
  return r;
}

// Whether raising stage m from `from` to `to` bodies passes the GIL's bound on the model (its
// own holds cap it) and gains less than a clear gain there: the time a body holds it is its
// CPU demand with it taken, which counts what it computes with the GIL released too, so only
// a measured gain of kPastSerialGain or more shows that it releases it.
bool past_gil_bound(const StageModel& m, std::size_t from, std::size_t to) noexcept {
  return m.serial_s > 0 &&
         share_of(m) / (m.visits * m.serial_s) <= stage_rate(m, to) * (1 + kEps) &&
         stage_rate(m, to) < stage_rate(m, from) * (1 + kPastSerialGain);
}

std::size_t slots_for(const StageModel& m, double rate) noexcept {
  const double x = rate * m.visits * m.wall_s;
  if (!(x < 1e15)) return kUnlimited;
  auto k = static_cast<std::size_t>(std::ceil(x - 1e-9));
  if (m.resource == Resource::gpu) k = std::max<std::size_t>(2, k + 1);  // one enqueues, one runs
  return std::max<std::size_t>(1, k);
}

double predicted_rate(const std::vector<StageModel>& models, const Allocation& a) {
  double r = kInf;
  for (std::size_t i = 0; i < models.size() && i < a.stages.size(); ++i)
    r = std::min(r, stage_rate(models[i], a.stages[i].concurrency));
  for (auto [d, rate] : device_rates(models)) r = std::min(r, rate);
  return r;
}

void account(const std::vector<StageModel>& models, Allocation& a) {
  a.cores = 0;
  std::vector<std::size_t> k(models.size()), cap(models.size());
  for (std::size_t i = 0; i < models.size(); ++i) {
    k[i] = a.stages[i].concurrency;
    cap[i] = a.stages[i].capacity;
    a.cores += cores_of(models[i], k[i]);
  }
  a.bytes = bytes_with(models, k, cap);
  a.rate = predicted_rate(models, a);
}

Bound rate_bound(const std::vector<StageModel>& models, const Budget& budget) {
  Bound b;
  if (models.empty()) return b;
  // The fluid bound: cores over the summed CPU cost, each stage's ceiling, each device.
  const double cpu = cpu_per_item(models);
  b.fluid_rate = cpu > 0 ? budget.cores / cpu : kInf;
  std::string why = fmt::format("cores: {:g} / {} of core time per item", budget.cores, seconds(cpu));
  Limit fluid_limit = Limit::cores;
  std::size_t fluid_at = 0;
  // (Before the stages' ceilings: a stage's rate is capped by the lock too, and the lock is
  // what binds when the two are equal.)
  if (const double serial = serial_rate(models); serial < b.fluid_rate) {
    b.fluid_rate = serial;
    fluid_limit = Limit::stage;
    fluid_at = serial_holder(models);
    why = serial_text(models);
  }
  for (std::size_t i = 0; i < models.size(); ++i) {
    const StageModel& m = models[i];
    const std::size_t c = ceiling_of(m);
    // (An automatic GPU stage's ceiling is the device's streams, which its device time bounds;
    // a user's number of bursts, each its lease to its completion, can bound less.)
    if (c == kUnlimited || (m.resource == Resource::gpu && !m.fixed_concurrency)) continue;
    const double r = stage_rate(m, c);
    if (r < b.fluid_rate) {
      b.fluid_rate = r;
      fluid_limit = Limit::stage;
      fluid_at = i;
      why = fmt::format("'{}' at concurrency {} ({} per item{})", m.name, c, seconds(m.wall_s),
                        visits_text(m));
    }
  }
  for (auto [d, rate] : device_rates(models)) {
    if (rate < b.fluid_rate) {
      b.fluid_rate = rate;
      fluid_limit = Limit::gpu;
      for (std::size_t i = 0; i < models.size(); ++i)
        if (models[i].resource == Resource::gpu && models[i].device == d) fluid_at = i;
      why = fmt::format("GPU {} ('{}': {} of device time per item)", d, models[fluid_at].name,
                        seconds(1.0 / rate));
    }
  }
  // The integer bound: the largest rate whose concurrencies fit (feasibility is monotone).
  std::vector<std::size_t> k;
  std::size_t at = 0;
  double hi = std::isfinite(b.fluid_rate) ? b.fluid_rate : 1e12;
  Limit why_not = check(models, budget, hi, k, at);
  double lo = 0;
  if (why_not == Limit::none) {
    lo = hi;
  } else {
    for (int it = 0; it < 200 && hi - lo > 1e-12 * hi; ++it) {
      const double mid = 0.5 * (lo + hi);
      std::size_t a2 = 0;
      if (check(models, budget, mid, k, a2) == Limit::none) lo = mid;
      else {
        hi = mid;
        why_not = check(models, budget, mid, k, at);
      }
    }
  }
  std::size_t a2 = 0;
  check(models, budget, lo, k, a2);
  Allocation a;
  a.stages.resize(models.size());
  for (std::size_t i = 0; i < models.size(); ++i) a.stages[i].concurrency = k[i];
  b.rate = lo > 0 ? std::max(lo, std::min(predicted_rate(models, a), b.fluid_rate)) : 0.0;
  if (lo >= b.fluid_rate * (1 - 1e-9) && fluid_limit != Limit::cores) {
    b.limit = fluid_limit;
    b.stage = fluid_at;
    b.why = why;
  } else {
    b.limit = why_not == Limit::none ? fluid_limit : why_not;
    b.stage = why_not == Limit::none ? fluid_at : at;
    if (b.limit == Limit::cores)
      b.why = fmt::format("cores: {:g} / {} of core time per item", budget.cores, seconds(cpu));
    else if (b.limit == Limit::memory)
      b.why = budget.memory_bytes < least_bytes(models)
                  ? fmt::format("memory left to the tuned queues: {}, less than the least "
                                "they hold ({})",
                                byte_text(static_cast<double>(budget.memory_bytes)),
                                byte_text(static_cast<double>(least_bytes(models))))
                  : fmt::format("memory left to the tuned queues: {}",
                                byte_text(static_cast<double>(budget.memory_bytes)));
    else if (b.limit == Limit::stage)
      b.why = gil_binds(models, lo)
                  ? serial_text(models)
                  : fmt::format("'{}' at concurrency {}", models[b.stage].name, ceiling_of(models[b.stage]));
    else
      b.why = why;
  }
  return b;
}

void size_buffers(const std::vector<StageModel>& models, Allocation& a, const Budget& budget,
                  const PolicyOptions& options) {
  const std::size_t n = models.size();
  std::vector<std::size_t> k(n), reserve(n), buffer(n);
  for (std::size_t i = 0; i < n; ++i) k[i] = a.stages[i].concurrency;
  for (std::size_t i = 0; i < n; ++i) {
    // A producer's invocation reserves its output's slot before its body runs, so the queue
    // holds every producer invocation in flight plus a buffer for this stage's own.
    reserve[i] = reserve_of(models, k, i);
    buffer[i] = std::max(options.min_capacity, (std::min<std::size_t>(k[i], 1u << 30) + 1) / 2);
    a.stages[i].capacity = models[i].fixed_capacity ? *models[i].fixed_capacity
                                                    : sat_add(reserve[i], buffer[i]);
  }
  // Halve the buffer of the queue holding the most bytes until the allocation fits.
  account(models, a);
  while (a.bytes > budget.memory_bytes) {
    std::size_t worst = n;
    std::size_t worst_bytes = 0;
    for (std::size_t i = 0; i < n; ++i) {
      if (models[i].fixed_capacity || buffer[i] <= 1) continue;
      const std::size_t b = sat_mul(buffer[i], models[i].item_bytes);
      if (b > worst_bytes) worst_bytes = b, worst = i;
    }
    if (worst == n) break;
    buffer[worst] = std::max<std::size_t>(1, buffer[worst] / 2);
    a.stages[worst].capacity = sat_add(reserve[worst], buffer[worst]);
    account(models, a);
  }
  finish_settings(models, a);
}

Allocation allocate(const std::vector<StageModel>& models, const Budget& budget,
                    const PolicyOptions& options) {
  const Bound b = rate_bound(models, budget);
  double target = b.rate;
  if (b.limit == Limit::gpu && options.gpu_busy_target < 1) {
    // The fewest cores that keep the device gpu_busy_target busy (a point above it, for the
    // losses of queueing that the model does not see).
    const double device = device_rates(models).at(models[b.stage].device);
    target = std::min(target, device * std::min(1.0, options.gpu_busy_target + 0.01));
  } else if (b.limit == Limit::stage && gil_binds(models, b.rate)) {
    // The GIL binds: the fewest threads that keep it as busy as a GPU is kept (a thread more
    // for the 3% a body spends outside it would only wait for it).
    target = std::min(target, std::min(1.0, options.gpu_busy_target + 0.01) * serial_rate(models));
  }
  Allocation a;
  a.stages.resize(models.size());
  std::vector<std::size_t> k;
  std::size_t at = 0;
  check(models, budget, target, k, at);
  for (std::size_t i = 0; i < models.size(); ++i) {
    // A stage at the GIL's bound: not a thread that gains it less than a clear gain on the
    // model (its time outside its holds is mostly the interpreter's handing the GIL over, to
    // the graph's reader too: a pure-Python body of 295 us, 267 of them holding it, ran 6%
    // slower on 2 threads than on 1; the climb's trial of one more measures it).
    const StageModel& m = models[i];
    while (!m.fixed_concurrency && k[i] > 1 && past_gil_bound(m, k[i] - 1, k[i])) --k[i];
    a.stages[i].concurrency = k[i];
  }
  if (b.limit == Limit::cores || b.limit == Limit::memory) {
    // Spend the cores left after rounding, slowest stage first: they cost nothing here and
    // absorb the variance of the costs.
    account(models, a);
    for (bool more = true; more;) {
      more = false;
      std::vector<std::size_t> order(models.size());
      std::iota(order.begin(), order.end(), std::size_t{0});
      std::stable_sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) {
        return stage_rate(models[x], a.stages[x].concurrency) <
               stage_rate(models[y], a.stages[y].concurrency);
      });
      for (std::size_t i : order) {
        const StageModel& m = models[i];
        if (!tunable(m) || m.resource == Resource::gpu || a.stages[i].concurrency >= ceiling_of(m))
          continue;
        if (a.cores + m.cores_per_slot() > budget.cores + kEps) continue;
        std::vector<std::size_t> kk(models.size());
        for (std::size_t j = 0; j < models.size(); ++j) kk[j] = a.stages[j].concurrency + (j == i);
        if (const std::size_t bytes = bytes_with(models, kk, min_capacities(models, kk));
            bytes > budget.memory_bytes && bytes > least_bytes(models))
          continue;
        ++a.stages[i].concurrency;
        a.cores += m.cores_per_slot();
        more = true;
        break;
      }
    }
  }
  size_buffers(models, a, budget, options);
  return a;
}

namespace {
// The items admission_limit's memory holds, and the least the graph goes on with.
std::pair<std::size_t, std::size_t> admission_fit(const AdmissionInput& in) noexcept {
  const std::size_t held = sat_add(in.fixed_bytes, in.sink_bytes);
  const std::size_t left = in.memory > held ? in.memory - held : 0;
  const std::size_t floor = std::min(std::max<std::size_t>(in.floor, 1), std::max<std::size_t>(in.ceiling, 1));
  return {in.unit_bytes ? left / in.unit_bytes : kUnlimited, floor};
}
}  // namespace

bool over_budget(const AdmissionInput& in) noexcept {
  if (in.memory == kUnlimited || in.unit_bytes == 0) return false;
  const auto [fits, floor] = admission_fit(in);
  return fits < floor;
}

std::optional<TuneEvent> admission_limit(const AdmissionInput& in, std::int64_t at_ns) {
  if (in.memory == kUnlimited || in.unit_bytes == 0) return std::nullopt;
  const auto [fits, floor] = admission_fit(in);
  const std::size_t want = std::clamp(fits, floor, std::max(in.ceiling, floor));
  if (want > in.current) {
    // A raise by an eighth of the limit at least, and only where items an eighth larger than
    // measured would still fit more than now: sizes vary from window to window (a trial's
    // service under a budget went 7 -> 8 -> 7 every window as its batches' sizes varied).
    AdmissionInput larger = in;
    larger.unit_bytes = sat_add(in.unit_bytes, in.unit_bytes / 8);
    if (want - in.current < std::max<std::size_t>(1, in.current / 8) || admission_fit(larger).first <= in.current)
      return std::nullopt;
  }
  // A budget that holds fewer items than the graph needs is said once, even where the limit
  // is at its floor already (a run under a budget starts there: the text was never shown).
  if (want == in.current && !(fits < floor && !in.told_over)) return std::nullopt;
  std::string why = fmt::format("items of up to {} (at '{}')", byte_text(double(in.unit_bytes)), in.widest);
  const std::string share =
      fmt::format("the graph's {} of the memory budget{}", byte_text(double(in.memory)),
                  std::string(in.fixed_bytes ? fmt::format(", less {} of pinned rings", byte_text(double(in.fixed_bytes))) : std::string()) +
                  (in.sink_bytes ? fmt::format(", less {} its pull sink's queue may hold", byte_text(double(in.sink_bytes))) : std::string()));
  if (fits < floor && floor == 1)
    why += fmt::format(": {} holds none of them; one at a time at the least, over the budget (a "
                       "larger RuntimeConfig::host_memory_budget or smaller items fit it)",
                       share);
  else if (fits < floor)
    why += fmt::format(": {} holds {} of them, but its batches hold {} while they fill, so {} at the "
                       "least, over the budget (a smaller batch or a larger "
                       "RuntimeConfig::host_memory_budget fits it)",
                       share, fits, floor - 1, floor);
  else if (want == in.ceiling && fits > in.ceiling)
    why += fmt::format(": {} of them (GraphOptions::max_in_flight) hold {}, within {}", want,
                       byte_text(double(sat_mul(want, in.unit_bytes))), share);
  else
    why += fmt::format(": {} of them hold {}, within {}", want, byte_text(double(sat_mul(want, in.unit_bytes))), share);
  return TuneEvent{at_ns, Action::retune, "", "max_in_flight", in.current, want, std::move(why)};
}

std::optional<TuneEvent> pull_sink_capacity(const SinkQueueInput& in, const std::string& sink,
                                            std::int64_t at_ns) {
  if (in.memory == kUnlimited || in.item_bytes == 0) return std::nullopt;
  const std::size_t ceiling = std::max<std::size_t>(in.ceiling, 1);
  const auto fit = [&](std::size_t bytes) {
    const std::size_t ready = in.memory / 4 / bytes;
    const std::size_t claimed = std::min(sat_add(in.claims, 1), in.memory / 2 / bytes);
    return std::clamp<std::size_t>(std::max(ready, claimed), 1, ceiling);
  };
  std::size_t want = fit(in.item_bytes);
  if (want > in.current) want = std::max(in.current, fit(sat_add(in.item_bytes, in.item_bytes / 8)));
  if (want == in.current) return std::nullopt;
  const std::size_t ready = in.memory / 4 / in.item_bytes;
  std::string why = fmt::format("items of {}: {} of them hold {}", byte_text(double(in.item_bytes)), want,
                                byte_text(double(sat_mul(want, in.item_bytes))));
  if (ready == 0)  // (one item is more than the quarter: it said "within a quarter", a trial)
    why += fmt::format(", more than a quarter of the graph's {} of the memory budget: the least "
                       "it can hold",
                       byte_text(double(in.memory)));
  else if (want > std::max<std::size_t>(ready, 1))
    why += fmt::format(", a slot for each of its producers' {} claims and one more, within half of "
                       "the graph's {} of the memory budget", in.claims, byte_text(double(in.memory)));
  else
    why += fmt::format(", within a quarter of the graph's {} of the memory budget",
                       byte_text(double(in.memory)));
  why += " (what its reader has ready; a pull sink's items are outside max_in_flight)";
  if (want == ceiling && ready > ceiling) why += fmt::format("; {} at most, its capacity as sized", ceiling);
  return TuneEvent{at_ns, Action::retune, sink, "capacity", in.current, want, std::move(why)};
}

std::vector<Budget> split_budget(const std::vector<GraphDemand>& demands, const Budget& total) {
  const std::size_t n = demands.size();
  std::vector<Budget> out(n);
  if (n == 0) return out;
  std::vector<double> w(n);
  for (std::size_t i = 0; i < n; ++i) {
    const int p = demands[i].priority;
    w[i] = p >= 0 ? 1.0 + p : 1.0 / (1.0 - p);
  }
  // Water-filling: a graph asking less than its weighted share gets what it asks; the others
  // share what is left by weight.
  auto fill = [&](auto want, double amount, std::vector<double>& got) {
    got.assign(n, 0);
    std::vector<bool> done(n, false);
    double left = amount;
    for (bool again = true; again;) {
      again = false;
      double wsum = 0;
      for (std::size_t i = 0; i < n; ++i)
        if (!done[i]) wsum += w[i];
      if (wsum == 0) break;
      for (std::size_t i = 0; i < n; ++i) {
        if (done[i]) continue;
        const double share = left * w[i] / wsum;
        if (want(i) <= share) {
          got[i] = want(i);
          left -= got[i];
          done[i] = true;
          again = true;
          break;
        }
      }
      if (!again) {
        for (std::size_t i = 0; i < n; ++i)
          if (!done[i]) got[i] = left * w[i] / wsum;
        left = 0;
      }
    }
    // Every demand met: what is left goes to all by weight (a graph that cannot use it
    // releases it again).
    if (left > 0) {
      double wsum = 0;
      for (std::size_t i = 0; i < n; ++i) wsum += w[i];
      const double share_left = left;
      for (std::size_t i = 0; i < n; ++i) got[i] += share_left * w[i] / wsum;
    }
  };
  std::vector<double> cores, bytes;
  fill([&](std::size_t i) { return std::ceil(demands[i].cores - 1e-9); }, total.cores, cores);
  fill([&](std::size_t i) { return static_cast<double>(demands[i].memory_bytes); },
       static_cast<double>(total.memory_bytes), bytes);
  // Whole cores: floors, then the remainder to the largest fractions (at least one each where
  // there are enough).
  double given = 0;
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), std::size_t{0});
  for (std::size_t i = 0; i < n; ++i) {
    out[i].cores = std::floor(cores[i] + 1e-9);
    given += out[i].cores;
  }
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return cores[a] - out[a].cores > cores[b] - out[b].cores;
  });
  for (std::size_t i : order)
    if (given + 1 <= std::floor(total.cores + 1e-9) && cores[i] - out[i].cores > 1e-9) {
      out[i].cores += 1;
      given += 1;
    }
  for (std::size_t i = 0; i < n; ++i) {
    // (A core at least for each graph that asks for any: one that asks for none, its reader
    // stalled, leaves it to the others.)
    if (out[i].cores < 1 && demands[i].cores > 0 && total.cores >= static_cast<double>(n)) {
      auto richest = std::max_element(out.begin(), out.end(),
                                      [](const Budget& a, const Budget& b) { return a.cores < b.cores; });
      richest->cores -= 1;
      out[i].cores = 1;
    }
    // A share of an unlimited budget (SIZE_MAX, 2^64 as a double) stays unlimited: converting
    // 2^64 to size_t is undefined (clang's UBSan stopped the tuner's tests there).
    out[i].memory_bytes = bytes[i] < 0x1p64 ? static_cast<std::size_t>(std::floor(bytes[i]))
                                            : std::numeric_limits<std::size_t>::max();
  }
  return out;
}

std::optional<TuneEvent> ring_depth(const RingInput& in, std::int64_t at_ns) {
  if (in.item_bytes == 0 || in.capacity == 0 || in.max_committed == 0) return std::nullopt;
  constexpr std::size_t kMiB = std::size_t{1} << 20;
  const std::size_t floor = sat_mul(2, in.item_bytes);
  const std::size_t ceiling = std::max(floor, in.ceiling);
  const double wall = static_cast<double>(std::max<std::int64_t>(in.wall_ns, 1));
  const double waited = static_cast<double>(std::max<std::int64_t>(in.wait_ns, 0)) / wall;
  const double starved = static_cast<double>(std::max<std::int64_t>(in.starved_ns, 0)) / wall;
  const std::string items = fmt::format("items of up to {}", byte_text(double(in.item_bytes)));
  std::size_t want = in.capacity;
  std::string why;
  if (in.refusals > 0 && waited >= 0.02 && starved >= 0.05) {
    want = std::clamp(sat_mul(2, in.capacity), floor, ceiling);
    why = fmt::format("producers waited {} of the last run for room in it ({} reservations refused, "
                      "{}) while '{}' waited {} of it for input",
                      percent(std::min(waited, 1.0)), in.refusals, items, in.stage, percent(std::min(starved, 1.0)));
    if (want <= in.capacity) return std::nullopt;  // at its ceiling already
    if (want == ceiling) why += fmt::format("; {} at most", byte_text(double(ceiling)));
  } else {
    const std::size_t need = sat_add(sat_add(in.max_committed, in.max_committed / 4), in.item_bytes);
    const std::size_t rounded = need > kUnlimited - kMiB ? need : (need + kMiB - 1) / kMiB * kMiB;
    want = std::clamp(rounded, floor, ceiling);
    if (!(want <= in.capacity / 4 * 3 || (in.capacity > ceiling && want < in.capacity))) return std::nullopt;
    why = fmt::format("the last run committed at most {} of it ({}); ", byte_text(double(in.max_committed)), items);
    why += in.refusals == 0 ? std::string("no producer waited for room")
                            : fmt::format("producers waited {} of the run for room, '{}' {} for input",
                                          percent(std::min(waited, 1.0)), in.stage, percent(std::min(starved, 1.0)));
    if (in.capacity > ceiling && want == ceiling) why += fmt::format("; {} at most", byte_text(double(ceiling)));
  }
  return TuneEvent{at_ns, Action::retune, in.stage, "ring_bytes", in.capacity, want, std::move(why)};
}

std::optional<TuneEvent> body_placement(const PlacementInput& in, std::int64_t at_ns) {
  if (in.samples < kMinPlacementSamples) return std::nullopt;
  const std::int64_t cpu = std::max<std::int64_t>(in.cpu_ns, 0);
  const std::int64_t wait = std::max<std::int64_t>(in.wait_ns, 0);
  const std::int64_t wall = std::max<std::int64_t>({in.wall_ns, cpu + wait, 1});
  const double waited = static_cast<double>(wait) / static_cast<double>(wall);
  const std::string measured =
      fmt::format("{} {} measured: {} CPU, {} waiting", in.samples, in.blocking ? "items" : "claims",
                  seconds(static_cast<double>(cpu) * 1e-9), seconds(static_cast<double>(wait) * 1e-9));
  if (!in.blocking && wait >= 2 * cpu && 2 * wait >= wall)
    return TuneEvent{at_ns, Action::retune, in.stage, "blocking", 0, 1,
                     fmt::format("its bodies waited {} of their time without a CPU ({}), holding "
                                 "the arena's threads; the next graph '{}' built runs them on the "
                                 "runtime's blocking threads, where its concurrency may go past "
                                 "the cores (StageOptions::blocking sets it for good)",
                                 percent(waited), measured, in.graph)};
  if (in.blocking && wait < cpu)
    return TuneEvent{at_ns, Action::retune, in.stage, "blocking", 1, 0,
                     fmt::format("its bodies computed more than they waited ({}); the next graph "
                                 "'{}' built runs them on the arena's threads again, within the "
                                 "cores",
                                 measured, in.graph)};
  return std::nullopt;
}

std::string TuneEvent::text() const {
  std::string head;
  if (!stage.empty() && knob == "blocking") {
    head = stage + (to ? " to the blocking threads" : " back to the arena's threads");
    return reason.empty() ? head : head + ": " + reason;
  }
  if (!stage.empty() && !knob.empty()) {
    auto number = [](std::size_t x) { return x == kUnlimited ? std::string("unlimited") : std::to_string(x); };
    const bool bytes = knob.size() > 6 && knob.compare(knob.size() - 6, 6, "_bytes") == 0;
    head = knob == "concurrency" ? fmt::format("{} {} -> {}", stage, number(from), number(to))
           : bytes ? fmt::format("{} {} {} -> {}", stage, knob, memory_text(from), memory_text(to))
                   : fmt::format("{} {} {} -> {}", stage, knob, number(from), number(to));
    return reason.empty() ? head : head + ": " + reason;
  }
  if (stage.empty() && !knob.empty())  // the graph's own knob: "max_in_flight 1 -> 12: ..."
    return (from == to ? fmt::format("{} stays {}", knob, to) : fmt::format("{} {} -> {}", knob, from, to)) +
           (reason.empty() ? "" : ": " + reason);
  return reason;
}

// ---- CostEstimator ---------------------------------------------------------------------------

namespace {
constexpr std::size_t kHistory = 30;  // windows an estimate averages at most
}

std::vector<std::size_t> CostEstimator::add(const Sample& s) {
  bool same = shape_.size() == s.stages.size();
  for (std::size_t i = 0; same && i < s.stages.size(); ++i)
    same = shape_[i].name == s.stages[i].name && shape_[i].gpu == s.stages[i].gpu;
  if (!same) {
    history_.clear();
    drifting_.assign(s.stages.size(), 0);
  }
  shape_ = s.stages;
  Window w;
  w.delivered = static_cast<double>(s.delivered);
  const double window = static_cast<double>(std::max<std::int64_t>(s.window_ns, 1));
  w.length = window;
  // (The others' holds: at most the window less the least share left to the stages. Read at
  // the window's ends, theirs and the stages' may each count a body the other counts in the
  // next window: a negative figure stands, the sum over the windows is what counts.)
  w.serial_others = std::min(static_cast<double>(s.serial_others_ns), (1 - kMinSerialShare) * window);
  // One body at a time holds the shared lock (a Python body's GIL): the stages' holds add up to
  // what the others left of the window at most. More (bodies that released it to compute, as
  // numpy and torch do, count that time too) is scaled down to it: then it was held
  // throughout, at most.
  double held = 0;
  for (const StageSample& st : s.stages) held += static_cast<double>(std::max<std::int64_t>(st.serial_ns, 0));
  const double left = window - std::max(w.serial_others, 0.0);
  const double scale = held > left ? left / held : 1.0;
  for (const StageSample& st : s.stages) {
    // (A body's wait to take the lock is contention, not its cost: a second thread of a stage
    // that holds it throughout doubles its time per item. The waits a body measures are those
    // to take it; those in its midst, when the interpreter hands the lock to another thread,
    // are not: its time per item comes from windows at concurrency 1 where there are some.)
    Raw r{static_cast<double>(st.items),
          static_cast<double>(std::max<std::int64_t>(st.work_ns - std::max<std::int64_t>(st.serial_wait_ns, 0), 0)),
          st.cpu_ns < 0 ? -1.0 : static_cast<double>(st.cpu_ns), static_cast<double>(st.gpu_busy_ns),
          static_cast<double>(std::max<std::int64_t>(st.serial_ns, 0)) * scale};
    if (st.concurrency <= 1) r.solo_work = r.work, r.solo_items = r.items;
    r.saturated = scale < 1 ? 1 : 0;
    r.released = static_cast<double>(st.serial_ns) > 1.1 * window ? 1 : 0;
    w.stages.push_back(r);
  }
  history_.push_back(std::move(w));
  if (history_.size() > kHistory) history_.erase(history_.begin());

  // Drift: the last two windows' cost per item both off the older windows' by more than
  // `drift`, in the same direction.
  std::vector<std::size_t> drifted;
  drifts_.clear();
  if (history_.size() < 3) return drifted;
  // (A stage holding the shared lock: its holds per item, which contention does not lengthen.)
  auto cost = [&](const Raw& r, bool gpu, bool serial) {
    return (gpu ? r.gpu : serial ? r.serial : r.work) / r.items;
  };
  for (std::size_t i = 0; i < s.stages.size(); ++i) {
    const bool gpu = s.stages[i].gpu;
    Raw ref;
    for (std::size_t w2 = 0; w2 + 2 < history_.size(); ++w2) ref += history_[w2].stages[i];
    const Raw& a = history_[history_.size() - 2].stages[i];
    const Raw& b = history_.back().stages[i];
    if (ref.items < 4 || a.items < 4 || b.items < 4) continue;
    // (A stage that holds the lock most of its time drifts by its holds; one that waits with
    // it released, a read, by its time per item; one whose bodies release it, the same.)
    const bool serial = !gpu && ref.serial > 0 && a.serial > 0 && b.serial > 0 &&
                        ref.serial >= 0.5 * ref.work && ref.released + a.released + b.released == 0;
    // (Holds scaled down to a window are the window over its items: they move with the rate,
    // not with the cost. A stage's cost that moves while the lock is saturated shows as a fall
    // of the rate, which climbs again.)
    if (serial && (a.saturated > 0 || b.saturated > 0)) continue;
    // A stage that worked under 5% of the window changes no decision by its cost: a reader
    // behind a slow loop "drifted" 54 -> 100 us as its bursts came cold, ten retunes in a
    // trial's run, none of them useful.
    const double window = static_cast<double>(std::max<std::int64_t>(s.window_ns, 1));
    if ((gpu ? b.gpu : b.work) < 0.05 * window && (gpu ? a.gpu : a.work) < 0.05 * window) continue;
    const double r0 = cost(ref, gpu, serial);
    if (!(r0 > 0)) continue;
    const double ra = cost(a, gpu, serial) / r0 - 1, rb = cost(b, gpu, serial) / r0 - 1;
    if (std::abs(ra) > drift_ && std::abs(rb) > drift_ && (ra > 0) == (rb > 0)) {
      drifted.push_back(i);
      Raw last = a;  // (the two windows together: the new cost)
      last += b;
      drifts_.push_back({i, r0 * 1e-9, cost(last, gpu, serial) * 1e-9, gpu, serial});
    }
  }
  return drifted;
}

CostEstimator::Raw& CostEstimator::Raw::operator+=(const Raw& o) noexcept {
  items += o.items;
  work += o.work;
  cpu = cpu < 0 || o.cpu < 0 ? -1.0 : cpu + o.cpu;
  gpu += o.gpu;
  serial += o.serial;
  solo_work += o.solo_work;
  solo_items += o.solo_items;
  saturated += o.saturated;
  released += o.released;
  return *this;
}

bool CostEstimator::ready() const noexcept {
  if (history_.empty()) return false;
  double delivered = 0;
  std::vector<double> items(shape_.size(), 0);
  for (const Window& w : history_) {
    delivered += w.delivered;
    for (std::size_t i = 0; i < items.size(); ++i) items[i] += w.stages[i].items;
  }
  if (delivered <= 0) return false;
  for (double x : items)
    if (x <= 0) return false;
  return true;
}

std::uint64_t CostEstimator::min_items() const noexcept {
  double fewest = kInf;
  for (std::size_t i = 0; i < shape_.size(); ++i) {
    double items = 0;
    for (const Window& w : history_) items += w.stages[i].items;
    fewest = std::min(fewest, items);
  }
  return std::isfinite(fewest) ? static_cast<std::uint64_t>(fewest) : 0;
}

std::vector<StageModel> CostEstimator::models() const {
  std::vector<StageModel> out;
  double delivered = 0, length = 0, others = 0;
  for (const Window& w : history_) {
    delivered += w.delivered;
    length += w.length;
    others += w.serial_others;
  }
  // The lock's time the bodies outside the model left to the stages in it.
  const double share = length > 0 ? std::clamp(1 - others / length, kMinSerialShare, 1.0) : 1.0;
  for (std::size_t i = 0; i < shape_.size(); ++i) {
    const StageSample& st = shape_[i];
    Raw sum;
    for (const Window& w : history_) sum += w.stages[i];
    const bool cpu_known = sum.cpu >= 0;
    StageModel m;
    m.name = st.name;
    m.device = st.device;
    m.item_bytes = st.item_bytes;
    m.max_concurrency = st.max_concurrency;
    m.fixed_concurrency = st.fixed_concurrency;
    m.fixed_capacity = st.fixed_capacity;
    m.producers = st.producers;
    m.serial_share = share;
    m.visits = st.visits > 0 ? st.visits : delivered > 0 && sum.items > 0 ? sum.items / delivered : 1.0;
    const double items = std::max(sum.items, 1.0);
    // A stage whose bodies held the lock at once releases it (numpy, torch): the lock bounds
    // it not (its holds counted what it computed without it). One that holds it most of its
    // time: its time per item at concurrency 1 where measured (without the waits for the
    // others' holds in the midst of its bodies).
    const bool held = sum.serial > 0 && sum.released == 0;
    const double work = held && sum.serial >= 0.5 * sum.work && sum.solo_items >= 4
                            ? sum.solo_work / sum.solo_items * 1e-9
                            : sum.work / items * 1e-9;
    const double cpu = cpu_known ? std::min(sum.cpu / items * 1e-9, work) : work;
    if (st.gpu) {
      m.resource = Resource::gpu;
      m.cpu_s = cpu;
      m.gpu_s = sum.gpu / items * 1e-9;
      m.wall_s = m.cpu_s + m.gpu_s;
      // A user's concurrency: k bursts at once, each as long as its lease to its completion
      // (a burst that serialises host work allows less than the device's rate; one waiting
      // for a busy device, the device's rate again).
      if (m.fixed_concurrency) m.wall_s = std::max(m.wall_s, work);
    } else {
      m.resource = cpu < 0.5 * work ? Resource::io : Resource::cpu;
      m.cpu_s = cpu;
      m.wall_s = work;
      m.serial_s = held ? std::min(sum.serial / items * 1e-9, work) : 0.0;
    }
    out.push_back(std::move(m));
  }
  return out;
}

void CostEstimator::restart() {
  while (history_.size() > 2) history_.erase(history_.begin());
}

// ---- Autotuner -------------------------------------------------------------------------------

Autotuner::Autotuner(PolicyOptions options, Budget budget)
    : opt_(options), budget_(budget), est_(options.drift) {}

namespace {
// Whether a budget's cores changed from `was` (by half a core or more, or pool against share).
bool cores_moved(const Budget& was, const Budget& now) noexcept {
  return std::abs(now.cores - was.cores) >= 0.5 || now.pool != was.pool;
}
}  // namespace

void Autotuner::set_budget(const Budget& budget) {
  if (cores_moved(budget_, budget) || budget.memory_bytes != budget_.memory_bytes) {
    if (!budget_changed_) old_budget_ = budget_;
    budget_changed_ = true;
  }
  // (Before the first allocation the memory a run is given is where it starts: said as it is,
  // not as a change (a trial's run said "budget 2 -> 2 cores, memory for the tuned queues
  // unlimited -> 44 MiB" after decisions that had spoken of the 44 MiB). The re-model stays:
  // without it the climb took a trial per slot a service's stage gained at once, 21% fewer
  // requests a second in a verification trial.)
  if (phase_ == Phase::warmup) old_budget_.memory_bytes = budget.memory_bytes;
  budget_ = budget;
}

double Autotuner::noise() const { return std::max(opt_.min_gain, 3 * noise_ewma_); }

double Autotuner::gpu_busy(const Sample& s) const {
  // The busy fraction of the device that bounds the rate (the least busy device, if none does).
  std::map<int, double> busy;
  for (const StageSample& st : s.stages)
    if (st.gpu) busy[st.device] += static_cast<double>(st.gpu_busy_ns);
  if (busy.empty() || s.window_ns <= 0) return 0;
  if (bound_.limit == Limit::gpu && bound_.stage < models_.size())
    return busy[models_[bound_.stage].device] / static_cast<double>(s.window_ns);
  double least = kInf;
  for (auto [d, b] : busy) least = std::min(least, b / static_cast<double>(s.window_ns));
  return least;
}

void Autotuner::emit(Decision& d, TuneEvent e) {
  d.events.push_back(e);
  events_.push_back(std::move(e));
}

GraphDemand Autotuner::demand(int priority) const {
  GraphDemand g;
  g.priority = priority;
  if (models_.empty()) {
    g.cores = budget_.cores;
    g.memory_bytes = budget_.memory_bytes;
    return g;
  }
  Budget unlimited{1e9, budget_.memory_bytes};
  const Bound b = rate_bound(models_, unlimited);
  if (b.limit == Limit::cores) {
    g.cores = static_cast<double>(kUnlimited);
  } else {
    const Allocation a = allocate(models_, unlimited, opt_);
    // What it holds (the climb may have added to the model's), and a core more when the
    // climb wanted one that the budget did not have.
    g.cores = std::max(a.cores, alloc_.cores) + (short_of_cores_ ? 1.0 : 0.0);
  }
  // (Its consumer sets the pace: more cores would wait for it. A trial's graph whose reader
  // slept kept half of a 2-core runtime, and the graph beside it ran at 60% of its rate.)
  if (paced_cores_ >= 0) g.cores = std::min(g.cores, paced_cores_);
  g.memory_bytes = std::max(alloc_.bytes, std::size_t{1});
  return g;
}

void Autotuner::retune(const Sample& s, Action action, std::string reason, Decision& d) {
  if (trial_) {
    // A move on trial when a re-tune comes (a drift, a budget, firm estimates) is not judged:
    // said, and undone before the model's moves, which start from what was kept (a trial's
    // probe was silently kept in some runs and reverted in others).
    for (const TuneEvent& c : trial_->changes)
      emit(d, {s.end_ns, Action::revert, c.stage, c.knob, c.to, c.from,
               fmt::format("not judged: re-tuned first ({})", reason.empty() ? "a new model" : reason)});
    alloc_ = base_;
    trial_.reset();
  }
  models_ = est_.models();
  refined_ = est_.min_items() >= opt_.min_items;
  bound_ = rate_bound(models_, budget_);
  Allocation next = allocate(models_, budget_, opt_);
  std::string costs;
  for (const StageModel& m : models_) {
    if (!costs.empty()) costs += ", ";
    costs += fmt::format("{} {}{}{}", m.name,
                         m.resource == Resource::gpu ? seconds(m.gpu_s) + " GPU"
                                                     : seconds(m.wall_s) + " " + to_string(m.resource),
                         m.serial_s > 0 ? " (" + seconds(m.serial_s) + " holding the GIL)" : "",
                         visits_text(m));
  }
  emit(d, {s.end_ns, action, "", "",
           0, 0,
           fmt::format("{}model per item: {}{}; bound {:.4g} items/s ({}); {}",
                       reason.empty() ? "" : reason + "; ", costs,
                       any_visits(models_)
                           ? " (each per item the stage takes; xN: N of them per item delivered, "
                             "as a batch's samples; rates are in items delivered)"
                           : "",
                       bound_.rate, bound_.why, cores_text(next, budget_))});
  for (std::size_t i = 0; i < models_.size(); ++i) {
    const std::size_t k0 = alloc_.stages.empty() ? s.stages[i].concurrency : alloc_.stages[i].concurrency;
    const std::size_t c0 = alloc_.stages.empty() ? s.stages[i].capacity : alloc_.stages[i].capacity;
    const StageModel& m = models_[i];
    const StageSetting& n = next.stages[i];
    if (n.concurrency != k0)
      emit(d, {s.end_ns, action, m.name, "concurrency", k0, n.concurrency,
               fmt::format("{} per item{}{}, {:.4g} items/s at {}", seconds(m.resource == Resource::gpu ? m.gpu_s : m.wall_s),
                           visits_text(m).empty()
                               ? std::string()
                               : fmt::format(" it takes,{} per item delivered", visits_text(m)),
                           m.resource == Resource::io ? fmt::format(" ({} CPU)", seconds(m.cpu_s)) : "",
                           stage_rate(m, n.concurrency), n.concurrency)});
    if (n.capacity != c0)
      emit(d, {s.end_ns, action, m.name, "capacity", c0, n.capacity,
               (m.producers.empty() || m.producers[0] >= next.stages.size()
                    ? fmt::format("fed by no tuned stage (a source, a batch): a buffer for concurrency {} here",
                                  n.concurrency)
                    : fmt::format("{} invocations of '{}' reserve a slot each, and a buffer for "
                                  "concurrency {} here",
                                  next.stages[m.producers[0]].concurrency,
                                  models_[m.producers[0]].name, n.concurrency)) +
                         (budget_.memory_bytes != kUnlimited && m.item_bytes > 0
                              ? fmt::format("; items of {}, the tuned queues' {}{} the memory budget leaves them{}",
                                            byte_text(static_cast<double>(m.item_bytes)),
                                            byte_text(static_cast<double>(next.bytes)),
                                            next.bytes <= budget_.memory_bytes
                                                ? " within the " + byte_text(static_cast<double>(budget_.memory_bytes))
                                                : " at their least, over the " +
                                                      byte_text(static_cast<double>(budget_.memory_bytes)),
                                            next.bytes <= budget_.memory_bytes
                                                ? ""
                                                : ": the graph's admission limit (max_in_flight) bounds its "
                                                  "items instead")
                              : std::string()) +
                         // (Its items are not the graph's: a batch of them, a branch's share.)
                         (m.visits > 0 && m.visits <= 0.67
                              ? fmt::format("; a slot holds one of its items, each{} per item delivered",
                                            visits_text(m))
                              : std::string())});
  }
  if ((bound_.limit == Limit::gpu || bound_.limit == Limit::stage) && next.cores + 1 <= budget_.cores)
    emit(d, {s.end_ns, Action::release, "", "", 0, 0,
             fmt::format("{} bounds the rate: {}; the rest released", bound_.why,
                         cores_text(next, budget_))});
  d.changed = true;
  alloc_ = next;
  base_ = next;
  trial_.reset();
  tabu_.clear();
  phase_ = Phase::baseline;
  settle_left_ = opt_.settle_windows;
  prev_rate_ = -1;
  noise_ewma_ = 0;
  low_windows_ = 0;
  d.allocation = alloc_;
}

static Allocation with_changes(const std::vector<StageModel>& models, Allocation a,
                               const std::vector<TuneEvent>& changes) {
  for (const TuneEvent& e : changes)
    for (std::size_t i = 0; i < models.size(); ++i)
      if (models[i].name == e.stage) {
        if (e.knob == "concurrency") a.stages[i].concurrency = e.to;
        else if (e.knob == "capacity") a.stages[i].capacity = e.to;
      }
  finish_settings(models, a);
  return a;
}

void Autotuner::apply(const Move& m) { alloc_ = with_changes(models_, alloc_, m.changes); }

std::optional<Autotuner::Move> Autotuner::propose(const Sample& s) {
  const std::size_t n = models_.size();
  const double win = static_cast<double>(s.window_ns);
  const double win_s = win * 1e-9;
  const double rate = win_s > 0 ? static_cast<double>(s.delivered) / win_s : 0;
  auto util = [&](std::size_t i) {
    const StageSample& st = s.stages[i];
    if (models_[i].resource == Resource::gpu)  // its device's time
      return win > 0 ? static_cast<double>(st.gpu_busy_ns) / win : 0.0;
    const double k = static_cast<double>(std::max<std::size_t>(1, alloc_.stages[i].concurrency));
    return win > 0 ? static_cast<double>(st.work_ns) / (win * k) : 0.0;
  };
  auto frac = [&](std::int64_t ns) { return win > 0 ? static_cast<double>(ns) / win : 0.0; };
  auto is_tabu = [&](const std::string& key) {
    return std::find(tabu_.begin(), tabu_.end(), key) != tabu_.end();
  };
  auto consumer_of = [&](std::size_t i) -> std::size_t {
    for (std::size_t j = 0; j < n; ++j)
      if (std::find(models_[j].producers.begin(), models_[j].producers.end(), i) != models_[j].producers.end())
        return j;
    return n;
  };
  const double busy = gpu_busy(s);
  short_of_cores_ = false;
  const bool gpu_limited = bound_.limit == Limit::gpu;
  const bool non_core_limit = gpu_limited || bound_.limit == Limit::stage;
  const bool fed = gpu_limited ? busy >= opt_.gpu_busy_target
                               : rate >= bound_.rate * (1 - noise());

  // 1. Release: a non-core limit binds and the graph keeps up with it: give back a core from
  //    the stage with the most slack, measured (its busy fraction with one invocation fewer
  //    stays below 95%).
  if (non_core_limit && (gpu_limited ? busy >= opt_.gpu_busy_target + 0.01 : fed)) {
    std::size_t best = n;
    double best_util = 0.95;
    for (std::size_t i = 0; i < n; ++i) {
      const StageModel& m = models_[i];
      const std::size_t k = alloc_.stages[i].concurrency;
      if (!tunable(m) || m.resource == Resource::gpu || k <= 1 || is_tabu("release:" + m.name))
        continue;
      const double projected = util(i) * static_cast<double>(k) / static_cast<double>(k - 1);
      if (projected < best_util) best_util = projected, best = i;
    }
    if (best < n) {
      const StageModel& m = models_[best];
      const std::size_t k = alloc_.stages[best].concurrency;
      Move mv;
      mv.key = "release:" + m.name;
      mv.release = true;
      mv.changes.push_back(
          {s.end_ns, Action::probe, m.name, "concurrency", k, k - 1,
           gpu_limited ? fmt::format("GPU busy {} (target {}); {} busy {}: trying one core fewer",
                                     percent(busy), percent(opt_.gpu_busy_target), m.name, percent(util(best)))
                       : fmt::format("{} bounds the rate; {} busy {}: trying one core fewer",
                                     bound_.why, m.name, percent(util(best)))});
      return mv;
    }
  }

  // 1b. Threads past the cores: where the cores bind, a stage running more at once than there
  //     are cores (one that waits, on the blocking threads) whose slots together demand most of
  //     the cores' CPU is tried at half as many, kept if the rate holds (whether or not the
  //     graph keeps up with its bound: the contention may be what holds it below, and a
  //     verification trial's runs converged at 0.58-0.92 of it without trying). Its waits may
  //     be for the cores or the GIL among its own threads, not I/O: a new user's trial saw a
  //     numpy stage, placed there by a run whose bodies slept, run 21 bodies at once on 2 cores
  //     (each item 70 ms instead of 5; its model "78.8 ms io", 27 slots of 0.075 cores: 2.0)
  //     for three epochs. A stage that waits for I/O demands little
  //     CPU a slot (a 3 ms read of 34 us: 28 slots, 0.3 cores) and is not tried.
  if (bound_.limit == Limit::cores) {
    const auto cores = static_cast<std::size_t>(std::max(1.0, std::ceil(budget_.cores - kEps)));
    for (std::size_t i = 0; i < n; ++i) {
      const StageModel& m = models_[i];
      const std::size_t k = alloc_.stages[i].concurrency;
      if (!tunable(m) || m.resource == Resource::gpu || k <= cores || is_tabu("past:" + m.name)) continue;
      const double demand = static_cast<double>(k) * m.cores_per_slot();
      if (demand < kPastCoresDemand * budget_.cores) continue;
      const std::size_t to = std::max(cores, k / 2);
      Move mv;
      mv.key = "past:" + m.name;
      mv.release = true;
      mv.changes.push_back(
          {s.end_ns, Action::probe, m.name, "concurrency", k, to,
           fmt::format("{:.4g} items/s, {:.2f} of the bound ({}); {} runs {} at once past the {} "
                       "cores, their CPU {:.2g} cores: trying {} (its waits may be for the cores or "
                       "the GIL, not I/O)",
                       rate, bound_.rate > 0 ? rate / bound_.rate : 0.0, bound_.why, m.name, k, cores,
                       demand, to)});
      return mv;
    }
  }

  // 2. Raise the bottleneck: the stage with the lowest rate at its concurrency, measured busy
  //    ones first, taking a core from the stage with the most slack when the budget is spent.
  if (!(gpu_limited && fed)) {
    std::vector<std::size_t> order;
    for (std::size_t i = 0; i < n; ++i) {
      const StageModel& m = models_[i];
      if (!tunable(m) || alloc_.stages[i].concurrency >= ceiling_of(m)) continue;
      // A stage blocked a third of the window has output waiting for room: another invocation
      // adds nothing (a trial's reader, busy 1% and blocked 75% behind a slow loop, was raised
      // because the decode after it waited for input).
      if (frac(s.stages[i].blocked_ns) >= 0.3) continue;
      // Nor does one to a stage that waited a third of it for input itself: its input ran
      // dry (a trial's reader, busy 0% as its source ran out at an epoch's end, was raised
      // because the crop after it waited, each epoch, and the next began from it).
      if (frac(s.stages[i].starved_ns) >= 0.3) continue;
      order.push_back(i);
    }
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      const bool ba = util(a) >= 0.8, bb = util(b) >= 0.8;
      if (ba != bb) return ba;
      return stage_rate(models_[a], alloc_.stages[a].concurrency) <
             stage_rate(models_[b], alloc_.stages[b].concurrency);
    });
    for (std::size_t b : order) {
      const StageModel& m = models_[b];
      if (is_tabu("raise:" + m.name)) continue;
      const std::size_t k = alloc_.stages[b].concurrency;
      std::size_t step = m.resource == Resource::io ? std::max<std::size_t>(1, k / 4) : 1;
      step = std::min(step, ceiling_of(m) - k);
      const std::size_t c = consumer_of(b);
      const std::string why =
          c < n && frac(s.stages[c].starved_ns) >= 0.01
              ? fmt::format("'{}' waited {} of the last {} for input; {} busy {}", models_[c].name,
                            percent(frac(s.stages[c].starved_ns)), seconds(win_s), m.name,
                            percent(util(b)))
              : fmt::format("{:.4g} items/s, {:.2f} of the bound; {} busy {}, {:.4g} items/s at {} "
                            "on the model",
                            rate, bound_.rate > 0 ? rate / bound_.rate : 0.0, m.name,
                            percent(util(b)), stage_rate(m, k), k);
      Move mv;
      mv.key = "raise:" + m.name;
      // (Past the GIL's bound on the model: the trial measures whether its bodies release it.)
      const bool past_serial = past_gil_bound(m, k, k + step);
      // (The model expects nothing of it: kept for a clear gain only, not one window's noise: a
      // pure-Python body's second thread measured +11% in one 250 ms window and was kept.)
      if (past_serial) mv.min_gain = kPastSerialGain;
      mv.changes.push_back(
          {s.end_ns, Action::probe, m.name, "concurrency", k, k + step,
           past_serial ? why + fmt::format("; the GIL bounds it on the model ({} held per item): "
                                           "trying whether its bodies release it (kept for a "
                                           "gain of {:.0f}% or more)",
                                           seconds(m.serial_s), 100 * kPastSerialGain)
                       : why});
      // Its consumers' queues grow by the slots the new invocations reserve.
      for (std::size_t c2 = 0; c2 < n; ++c2) {
        const auto& pr = models_[c2].producers;
        if (models_[c2].fixed_capacity || std::find(pr.begin(), pr.end(), b) == pr.end()) continue;
        const std::size_t cap = alloc_.stages[c2].capacity;
        mv.changes.push_back({s.end_ns, Action::probe, models_[c2].name, "capacity", cap,
                              sat_add(cap, step),
                              fmt::format("a slot for each invocation of '{}'", m.name)});
      }
      if (with_changes(models_, alloc_, mv.changes).bytes > budget_.memory_bytes) continue;
      const double extra = cores_of(m, k + step) - cores_of(m, k);
      // In a pool a slot more costs no core until it runs: the measured rate judges it.
      if (budget_.pool ? cores_of(m, k + step) <= budget_.cores + kEps
                       : alloc_.cores + extra <= budget_.cores + kEps)
        return mv;
      // A donor: the least busy stage (measured) that keeps up with the measured rate, on
      // the model, with one invocation fewer.
      std::size_t donor = n;
      double donor_rate = 0;
      for (std::size_t j = 0; j < n; ++j) {
        const StageModel& dm = models_[j];
        const std::size_t kd = alloc_.stages[j].concurrency;
        if (j == b || !tunable(dm) || kd <= 1 || dm.resource == Resource::gpu) continue;
        if (dm.cores_per_slot() + kEps < extra) continue;
        const double r = stage_rate(dm, kd - 1);
        if (r < rate * (1 + noise()) || util(j) >= util(b)) continue;
        if (donor == n || util(j) < util(donor)) donor_rate = r, donor = j;
      }
      if (donor == n) {
        short_of_cores_ = true;
        continue;
      }
      const StageModel& dm = models_[donor];
      const std::size_t kd = alloc_.stages[donor].concurrency;
      mv.changes.push_back({s.end_ns, Action::probe, dm.name, "concurrency", kd, kd - 1,
                            fmt::format("its core to {}: {} busy {}, {:.4g} items/s at {}", m.name,
                                        dm.name, percent(util(donor)), donor_rate, kd - 1)});
      return mv;
    }
  }

  // Twice the buffer beyond the producers' reserved slots.
  auto deeper = [&](std::size_t i) {
    std::vector<std::size_t> k(n);
    for (std::size_t j = 0; j < n; ++j) k[j] = alloc_.stages[j].concurrency;
    const std::size_t cap = alloc_.stages[i].capacity, reserve = reserve_of(models_, k, i);
    return sat_add(cap, std::max<std::size_t>(1, cap > reserve ? cap - reserve : 1));
  };

  // 3. Deeper queues: a stage waited for input while a producer was blocked on its full queue
  //    (the costs vary more than the queue absorbs).
  std::size_t best = n;
  double worst_wait = 0.05;
  for (std::size_t i = 0; i < n; ++i) {
    const StageModel& m = models_[i];
    if (m.fixed_capacity || is_tabu("capacity:" + m.name)) continue;
    const double wait = frac(s.stages[i].starved_ns);
    bool producer_blocked = false;
    for (std::size_t p : m.producers)
      if (p < n && frac(s.stages[p].blocked_ns) >= 0.05) producer_blocked = true;
    if (!producer_blocked || wait < worst_wait) continue;
    const std::size_t cap = alloc_.stages[i].capacity;
    if (with_changes(models_, alloc_, {{0, Action::probe, m.name, "capacity", cap, deeper(i), ""}})
            .bytes > budget_.memory_bytes)
      continue;
    worst_wait = wait;
    best = i;
  }
  if (best < n) {
    const StageModel& m = models_[best];
    const std::size_t cap = alloc_.stages[best].capacity;
    std::size_t p = m.producers.front();
    for (std::size_t q : m.producers)
      if (q < n && s.stages[q].blocked_ns > s.stages[p].blocked_ns) p = q;
    Move mv;
    mv.key = "capacity:" + m.name;
    mv.changes.push_back({s.end_ns, Action::probe, m.name, "capacity", cap, deeper(best),
                          fmt::format("'{}' waited {} of the last {} for input while '{}' was "
                                      "blocked {} on its full queue",
                                      m.name, percent(frac(s.stages[best].starved_ns)),
                                      seconds(win_s), models_[p].name,
                                      percent(frac(s.stages[p].blocked_ns)))});
    return mv;
  }
  return std::nullopt;
}

Decision Autotuner::observe(const Sample& s) {
  Decision d;
  // The consumer's pace (demand): a pull sink's reader, a sink (a stage between tuned ones
  // that the tuner does not set, a batch, is the graph's own limit, not its consumer), over two
  // windows, or one of half a second or more (a stalled graph's windows are joined, up to 8),
  // so that one pause of the reader does not give the graph's share away.
  double paced = -1;
  if (!models_.empty() && s.window_ns > 0) {
    const double win = static_cast<double>(s.window_ns);
    const bool held = std::any_of(s.stages.begin(), s.stages.end(), [&](const StageSample& st) {
      return st.feeds_consumer && static_cast<double>(st.blocked_ns) >= 0.5 * win;
    });
    if (held) paced = 1.25 * static_cast<double>(s.delivered) / (win * 1e-9) * cpu_per_item(models_);
  }
  paced_cores_ = paced < 0                     ? -1.0
                 : paced_last_ >= 0           ? std::max(paced, paced_last_)
                 : s.window_ns >= 500'000'000 ? paced
                                              : -1.0;
  paced_last_ = paced;
  const std::vector<std::size_t> drifted = est_.add(s);
  if (!est_.ready()) {
    d.allocation = alloc_;
    return d;
  }
  if (phase_ == Phase::warmup || alloc_.stages.size() != s.stages.size()) {
    retune(s, Action::initial, "", d);
    return d;
  }
  d.allocation = alloc_;
  if (!drifted.empty()) {
    // (The figures the drift was found by: the older windows' cost per item against the last
    // two windows'. The models before and after it are of other windows: a trial's texts read
    // "'crop' cost 1.46 ms -> 1.44 ms per item".)
    std::string why;
    for (const CostEstimator::Drift& x : est_.drifts()) {
      if (!why.empty()) why += "; ";
      why += fmt::format("'{}' cost {} -> {} per item{}", s.stages[x.stage].name, seconds(x.from_s),
                         seconds(x.to_s), x.gpu ? " of device time" : x.serial ? " holding the GIL" : "");
    }
    est_.restart();
    retune(s, Action::retune, why, d);
    return d;
  }
  if (budget_changed_) {
    budget_changed_ = false;
    const bool moved = cores_moved(old_budget_, budget_);
    retune(s, Action::retune,
           fmt::format("budget {}{}{}", moved ? fmt::format("{:g} -> {:g} cores", old_budget_.cores, budget_.cores)
                                                    : fmt::format("{:g} cores", budget_.cores),
                       budget_.pool == old_budget_.pool ? ""
                       : budget_.pool                   ? " (a pool of its own)"
                                                        : " (a share of a pool)",
                       budget_.memory_bytes != old_budget_.memory_bytes
                           ? fmt::format(", memory for the tuned queues {} -> {}",
                                         memory_text(old_budget_.memory_bytes),
                                         memory_text(budget_.memory_bytes))
                       : budget_.memory_bytes != kUnlimited && !moved
                           ? fmt::format(", memory for the tuned queues {}", memory_text(budget_.memory_bytes))
                           : std::string()),
           d);
    return d;
  }
  if (!refined_ && est_.min_items() >= opt_.min_items) {
    retune(s, Action::retune,
           fmt::format("estimates firm: {} items or more per stage", est_.min_items()), d);
    return d;
  }
  if (settle_left_ > 0) {
    --settle_left_;
    prev_rate_ = -1;
    return d;
  }
  const double win_s = static_cast<double>(s.window_ns) * 1e-9;
  const double rate = win_s > 0 ? static_cast<double>(s.delivered) / win_s : 0;
  const double busy = gpu_busy(s);

  if (trial_) {
    const Move mv = *trial_;
    trial_.reset();
    const double gain = base_rate_ > 0 ? rate / base_rate_ - 1 : 0;
    bool ok;
    if (mv.release)
      ok = gain >= -noise() && (bound_.limit != Limit::gpu || busy >= opt_.gpu_busy_target);
    else
      ok = gain > std::max(noise(), mv.min_gain) ||
           (bound_.limit == Limit::gpu && base_busy_ < opt_.gpu_busy_target &&
            busy >= opt_.gpu_busy_target && gain > 0);
    const std::string figures =
        fmt::format("rate {:.4g} -> {:.4g} items/s ({:+.1f}%, noise {:.1f}%){}", base_rate_, rate,
                    100 * gain, 100 * noise(),
                    bound_.limit == Limit::gpu
                        ? fmt::format(", GPU busy {} -> {}", percent(base_busy_), percent(busy))
                        : std::string());
    if (ok) {
      for (const TuneEvent& c : mv.changes)
        emit(d, {s.end_ns, mv.release ? Action::release : Action::keep, c.stage, c.knob, c.from,
                 c.to, figures});
      if (!mv.release) tabu_.clear();
      base_ = alloc_;
      // This window measured the kept allocation: it is the next move's baseline.
    } else {
      // (The rule it missed: a gain under it read as a gain, "+10.6%, noise 1.0%", a trial's.)
      const std::string rule =
          mv.release ? fmt::format("; released only at a loss within the noise{}",
                                   bound_.limit == Limit::gpu ? " and the GPU kept busy" : "")
                     : fmt::format("; kept only for a gain over {:.1f}%{}", 100 * std::max(noise(), mv.min_gain),
                                   bound_.limit == Limit::gpu ? " or the GPU brought to its busy target" : "");
      for (const TuneEvent& c : mv.changes)
        emit(d, {s.end_ns, Action::revert, c.stage, c.knob, c.to, c.from, figures + rule});
      tabu_.push_back(mv.key);
      alloc_ = base_;
      d.changed = true;
      d.allocation = alloc_;
      settle_left_ = opt_.settle_windows;
      phase_ = Phase::baseline;
      prev_rate_ = -1;
      return d;
    }
  } else if (prev_rate_ > 0 && rate > 0) {
    // Two windows of one allocation: how much the rate moves by itself.
    // (A jump beyond 10% is an event, a drift or a neighbour, not noise.)
    const double rel = std::min(0.1, std::abs(rate - prev_rate_) / std::max(rate, prev_rate_));
    noise_ewma_ = noise_ewma_ == 0 ? rel : 0.7 * noise_ewma_ + 0.3 * rel;
  }
  prev_rate_ = rate;

  if (phase_ == Phase::converged) {
    // Watch for a fall the costs do not explain (a drift re-tunes by itself).
    if (rate < converged_rate_ * (1 - 3 * noise())) ++low_windows_;
    else low_windows_ = 0;
    if (low_windows_ < 2) return d;
    low_windows_ = 0;
    tabu_.clear();
    emit(d, {s.end_ns, Action::probe, "", "", 0, 0,
             fmt::format("rate fell from {:.4g} to {:.4g} items/s: climbing again", converged_rate_,
                         rate)});
  }
  base_ = alloc_;
  base_rate_ = rate;
  base_busy_ = busy;
  if (std::optional<Move> mv = propose(s)) {
    for (const TuneEvent& c : mv->changes) emit(d, c);
    apply(*mv);
    trial_ = std::move(mv);
    phase_ = Phase::trial;
    settle_left_ = opt_.settle_windows;
    d.changed = true;
    d.allocation = alloc_;
    prev_rate_ = -1;
    return d;
  }
  if (phase_ != Phase::converged) {
    phase_ = Phase::converged;
    converged_rate_ = rate;
    emit(d, {s.end_ns, Action::converged, "", "", 0, 0,
             fmt::format("converged at {:.4g} items/s, {:.2f} of the bound {:.4g} ({}){}; {}{}",
                         rate, bound_.rate > 0 ? rate / bound_.rate : 0.0, bound_.rate, bound_.why,
                         bound_.rate > 0 && rate > 1.05 * bound_.rate
                             ? (bound_.limit == Limit::stage && gil_binds(models_, bound_.rate)
                                    ? " (above it: its bodies release the GIL for some of the time "
                                      "the model counts as held (numpy and torch do, to compute); "
                                      "a window in which a stage's bodies held it more than the "
                                      "window's length takes the GIL's bound off that stage at the "
                                      "next model)"
                                    : " (above it: the bound is of the budget's cores and the costs "
                                      "measured; cores the runtime's other graphs left idle, or costs "
                                      "that fell since, give more)")
                         : bound_.rate > 0 && rate < 0.8 * bound_.rate ? short_of_bound_text(s)
                                                                       : std::string(),
                         cores_text(alloc_, budget_),
                         bound_.limit == Limit::gpu ? fmt::format(", GPU busy {}", percent(busy))
                                                    : std::string())});
  }
  return d;
}

}  // namespace splitflow::autotune
