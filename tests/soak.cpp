// The soak (docs/reliability.md, "Soak"): four graphs share one runtime for a set time, in
// rounds, with stages that throw at random under fail / skip / substitute and device faults
// injected on the host backend (DeviceConfig::faults: allocation failures, failing bursts, slow
// kernels, stalled streams):
//   train    an input pipeline, epoch after epoch: decode (skip), augment (substitute), make a
//            tensor into the pinned ring, a GPU stage (skip, takes the device faults), read by
//            the caller through a pull sink;
//   serve    an inference service under open-loop load (a request every 2 ms, a 20 ms
//            deadline, fail_fast admission), answered through callbacks;
//   restart  an endless graph cancelled after a random 0.2-1.5 s, and started again;
//   fail     a graph whose stage fails its run at random (on_error = fail), run again.
// It checks as it goes, and exits 1 at the first violation, naming it:
//   - per run: delivered + skipped = produced (substituted items are delivered, marked), each
//     item at most once and in order, a failed run's error names the graph, stage and item, a
//     cancelled run ends cancelled;
//   - per request: exactly one completion, answered + failed + expired = submitted;
//   - between rounds (every graph stopped): no lease out, no lease waiter, device pool bytes 0,
//     pinned bytes = the rings' capacity, no ring byte or budget held;
//   - RSS, threads and open file descriptors, sampled after each round: their growth over the
//     samples after the warm-up (least-squares slope times that window) within the bounds.
// Usage: soak [--seconds S | --minutes M] [--round-seconds R] [--json FILE] [--seed N]
#include <dirent.h>
#include <unistd.h>

#include "sanitizers.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <random>
#include <splitflow/ops/ops.hpp>
#include <splitflow/serving/service.hpp>
#include <splitflow/splitflow.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using namespace splitflow;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

[[noreturn]] void violated(const std::string& what) {
  std::fprintf(stderr, "soak: VIOLATION: %s\n", what.c_str());
  std::fflush(stderr);
  std::_Exit(1);
}
#define SOAK_CHECK(cond, msg)                                                    \
  do {                                                                           \
    if (!(cond)) {                                                               \
      std::ostringstream soak_os;                                                \
      soak_os << msg << "  [" #cond "]";                                         \
      violated(soak_os.str());                                                   \
    }                                                                            \
  } while (0)

void spin_us(int us) {
  const auto end = Clock::now() + std::chrono::microseconds(us);
  while (Clock::now() < end) {
  }
}

/// A thread-safe draw in [0, 1) per (stream, item): the faults a stage throws depend on the
/// item, not on thread timing.
double unit(std::uint64_t seed, std::uint64_t stream, std::uint64_t item) {
  std::uint64_t z = seed ^ (stream * 0x9e3779b97f4a7c15ULL) ^ (item * 0xbf58476d1ce4e5b9ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

struct Options {
  double seconds = 120;
  double round_seconds = 10;
  std::string json;
  std::uint64_t seed = 1;
};

// ---- process figures ------------------------------------------------------------------------

struct Sample {
  double t_s;
  double rss_mib;
  long threads;
  long fds;
};

double rss_mib() {
  std::ifstream f("/proc/self/statm");
  long size = 0, resident = 0;
  f >> size >> resident;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / (1 << 20);
}
long threads_now() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("Threads:", 0) == 0) return std::stol(line.substr(8));
  return -1;
}
long fds_now() {
  long n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (dirent* e = readdir(d))
      if (e->d_name[0] != '.') ++n;
    closedir(d);
  }
  return n - 1;  // the directory stream's own
}

/// Least-squares slope of y over t (per second).
double slope(const std::vector<double>& t, const std::vector<double>& y) {
  const double n = static_cast<double>(t.size());
  double st = 0, sy = 0, stt = 0, sty = 0;
  for (std::size_t i = 0; i < t.size(); ++i) {
    st += t[i];
    sy += y[i];
    stt += t[i] * t[i];
    sty += t[i] * y[i];
  }
  const double d = n * stt - st * st;
  return d > 0 ? (n * sty - st * sy) / d : 0.0;
}

// ---- the graphs -----------------------------------------------------------------------------

struct Totals {
  std::uint64_t rounds = 0;
  std::uint64_t train_epochs = 0, train_items = 0, train_delivered = 0, train_skipped = 0,
                train_substituted = 0;
  std::uint64_t requests = 0, answered = 0, failed_requests = 0, expired = 0, rejected = 0;
  std::uint64_t restarts = 0, restart_items = 0;
  std::uint64_t fail_runs = 0, fail_failed = 0, fail_items = 0;
};

constexpr double kDecodeSkip = 0.002;       // train: decode throws, skipped
constexpr double kAugmentSubstitute = 0.002;  // train: augment throws, substituted by -1
constexpr double kServeSkip = 0.002;        // serve: prep throws (the request fails)
constexpr double kFailRun = 0.0004;         // fail: a throw fails the run

HostTensor id_tensor(long i, HostAllocator& a) {
  HostTensor t = a.empty(DType::i64, {8});
  std::fill_n(t.data<std::int64_t>(), 8, i);
  return t;
}

GpuStageOptions gpu_options(OnError on_error) {
  GpuStageOptions o;
  o.concurrency = 2;
  o.on_error = on_error;
  o.ring_bytes = 256 * 1024;
  o.ring_item_bytes = 4096;
  return o;
}

// The model: a device allocation (an injected allocation failure throws here), a kernel
// (slow kernels and stalls are added to its burst, failures set on it), a copy back.
HostTensor model(DeviceTensor t, DeviceContext& ctx) {
  DeviceTensor scratch = ctx.alloc(DType::f32, {256});
  ops::busy_kernel(ctx, 30us);
  (void)scratch;
  return ctx.to_host(t);
}

class Train {
 public:
  Train(Runtime& rt, std::uint64_t seed, long items) : g_(rt, "train"), items_(items) {
    auto src = g_.source("read", [n = items, i = 0L]() mutable -> std::optional<long> {
      if (i == n) return std::nullopt;
      return i++;
    });
    auto decode = g_.stage("decode", [s = seed](long i) {
      spin_us(15);
      if (unit(s, 1, static_cast<std::uint64_t>(i)) < kDecodeSkip)
        throw std::runtime_error("corrupt image " + std::to_string(i));
      return i;
    }, {.concurrency = 2, .on_error = OnError::skip});
    auto augment = g_.stage("augment", [s = seed](long i) {
      if (unit(s, 2, static_cast<std::uint64_t>(i)) < kAugmentSubstitute)
        throw std::runtime_error("augment failed on " + std::to_string(i));
      return i;
    }, {.concurrency = 2, .on_error = OnError::substitute});
    augment.substitute_on_error(-1L);
    auto make = g_.stage("make", [](long i, HostAllocator& a) { return id_tensor(i, a); });
    auto gpu = g_.gpu_stage("model", model, gpu_options(OnError::skip));
    out_.emplace(g_.pull_sink<HostTensor>("out", 8));
    src >> decode >> augment >> make >> gpu >> *out_;
  }

  /// Epochs until `until`; checks each.
  void run_until(Clock::time_point until, Totals& tot, std::vector<RunStats>& last) {
    do {
      Run run = g_.run();
      std::vector<long> got;
      got.reserve(static_cast<std::size_t>(items_));
      for (const HostTensor& t : *out_) {
        const auto* p = t.data<std::int64_t>();
        SOAK_CHECK(std::all_of(p, p + 8, [&](std::int64_t v) { return v == p[0]; }),
                   "train: an item's tensor was torn");
        got.push_back(static_cast<long>(p[0]));
      }
      SOAK_CHECK(run.wait() == RunStatus::succeeded, "train: an epoch did not succeed");
      const RunStats st = run.stats();
      const std::uint64_t produced = st.find("read")->items_out;
      const std::uint64_t skipped = st.find("decode")->items_skipped + st.find("model")->items_skipped;
      const std::uint64_t substituted = st.find("augment")->items_substituted;
      SOAK_CHECK(produced == static_cast<std::uint64_t>(items_), "train: the source produced "
                 << produced << " of " << items_);
      SOAK_CHECK(got.size() + skipped == produced, "train: delivered " << got.size() << " + skipped "
                 << skipped << " != produced " << produced << " (lost or duplicated)");
      // Exactly the expected items: all but those decode or the model skipped, in order, the
      // ones augment failed on delivered as -1 (unless the model skipped them after). The
      // stages' error lists name the items (each list is complete: fewer than its cap).
      auto items_of = [&](const char* stage) {
        const StageStats* ss = st.find(stage);
        SOAK_CHECK(ss->errors.size() == ss->items_skipped + ss->items_substituted,
                   "train: " << stage << " kept " << ss->errors.size() << " errors of "
                   << ss->items_skipped + ss->items_substituted << " (raise the cap or lower the rate)");
        std::vector<bool> in(static_cast<std::size_t>(items_));
        for (const auto& e : ss->errors) in.at(e.item) = true;
        return in;
      };
      const auto dropped_decode = items_of("decode"), substituted_at = items_of("augment"),
                 dropped_model = items_of("model");
      std::vector<long> want;
      for (long i = 0; i < items_; ++i) {
        const auto k = static_cast<std::size_t>(i);
        if (dropped_decode[k] || dropped_model[k]) continue;
        want.push_back(substituted_at[k] ? -1 : i);
      }
      SOAK_CHECK(got == want, "train: the delivered items differ from the expected ones ("
                 << got.size() << " delivered, " << want.size() << " expected): lost, "
                 "duplicated or out of order");
      for (const auto& s : st.stages)
        SOAK_CHECK(s.ring_in_use == 0 && s.ring_budgets == 0, "train: stage " << s.name
                   << " holds ring bytes after its run");
      ++tot.train_epochs;
      tot.train_items += produced;
      tot.train_delivered += got.size();
      tot.train_skipped += skipped;
      tot.train_substituted += substituted;
      last[0] = st;
    } while (Clock::now() < until);
  }

 private:
  Graph g_;
  long items_;
  std::optional<PullSink<HostTensor>> out_;
};

class Serve {
 public:
  Serve(Runtime& rt, std::uint64_t seed) : g_(rt, "serve") {
    svc_.emplace(g_.service<long, HostTensor>(
        "requests", ServiceOptions{.max_pending = 32, .admission = Admission::fail_fast}));
    auto prep = g_.stage("prep", [s = seed](long i, HostAllocator& a) {
      spin_us(20);
      if (unit(s, 3, static_cast<std::uint64_t>(i)) < kServeSkip)
        throw std::runtime_error("bad request " + std::to_string(i));
      return id_tensor(i, a);
    }, {.concurrency = 2, .on_error = OnError::skip});
    auto gpu = g_.gpu_stage("infer", model, gpu_options(OnError::skip));
    svc_->source() >> prep >> gpu >> svc_->sink();
  }

  /// Open-loop load until `until`, then close and check every request completed once.
  void run_until(Clock::time_point until, Totals& tot, std::vector<RunStats>& last) {
    Run run = g_.run();
    const ServiceStats before = svc_->stats();
    struct Book {
      std::mutex mu;
      std::condition_variable cv;
      std::vector<std::uint8_t> done;  // completions per request
      std::uint64_t completions = 0, answered = 0, failed = 0, expired = 0;
    } book;
    std::uint64_t submitted = 0, rejected = 0;
    auto next = Clock::now();
    for (long id = 0; Clock::now() < until; ++id) {
      std::this_thread::sleep_until(next);  // the load's pace, not a synchronisation
      next += 2ms;
      {
        std::lock_guard lk(book.mu);
        book.done.push_back(0);
      }
      try {
        svc_->submit(id, Clock::now() + 20ms, [&book, id](HostTensor* r, std::exception_ptr e) {
          std::lock_guard lk(book.mu);
          const auto k = static_cast<std::size_t>(id);
          SOAK_CHECK(book.done[k] == 0, "serve: request " << id << " completed twice");
          book.done[k] = 1;
          ++book.completions;
          if (r) {
            SOAK_CHECK(r->data<std::int64_t>()[0] == id, "serve: request " << id
                       << " got the answer of " << r->data<std::int64_t>()[0]);
            ++book.answered;
          } else {
            try {
              std::rethrow_exception(e);
            } catch (const DeadlineError&) {
              ++book.expired;
            } catch (...) {
              ++book.failed;
            }
          }
          book.cv.notify_all();
        });
        ++submitted;
      } catch (const OverloadedError&) {
        ++rejected;
        std::lock_guard lk(book.mu);
        book.done.back() = 2;  // never admitted
      }
    }
    svc_->close();
    SOAK_CHECK(run.wait() == RunStatus::succeeded, "serve: the run did not succeed");
    {
      std::unique_lock lk(book.mu);
      SOAK_CHECK(book.cv.wait_for(lk, 30s, [&] { return book.completions == submitted; }),
                 "serve: " << book.completions << " of " << submitted << " requests completed");
      SOAK_CHECK(book.answered + book.failed + book.expired == submitted,
                 "serve: answered + failed + expired != submitted");
    }
    const ServiceStats s = svc_->stats();
    SOAK_CHECK(s.submitted - before.submitted == submitted && s.pending == 0,
               "serve: the service counted " << s.submitted - before.submitted << " submitted, "
               << s.pending << " pending; the load " << submitted);
    SOAK_CHECK(s.answered - before.answered == book.answered &&
                   s.expired - before.expired == book.expired &&
                   s.failed - before.failed == book.failed,
               "serve: the service's counts differ from the callbacks'");
    tot.requests += submitted;
    tot.answered += book.answered;
    tot.failed_requests += book.failed;
    tot.expired += book.expired;
    tot.rejected += rejected;
    last[1] = run.stats();
  }

 private:
  Graph g_;
  std::optional<Service<long, HostTensor>> svc_;
};

class Restart {
 public:
  explicit Restart(Runtime& rt) : g_(rt, "restart") {
    auto src = g_.source("forever", [i = 0L]() mutable -> std::optional<long> { return i++; });
    auto work = g_.stage("work", [](long i, HostAllocator& a) {
      spin_us(10);
      return id_tensor(i, a);
    }, {.concurrency = 2});
    auto gpu = g_.gpu_stage("model", model, gpu_options(OnError::skip));
    auto sink = g_.sink("count", [this](HostTensor) { seen_.fetch_add(1, std::memory_order_relaxed); });
    src >> work >> gpu >> sink;
  }

  void run_until(Clock::time_point until, std::mt19937_64& rng, Totals& tot,
                 std::vector<RunStats>& last) {
    std::uniform_int_distribution<int> ms(200, 1500);
    while (Clock::now() < until) {
      Run run = g_.run();
      // Let it run a while (a pace, not a synchronisation: the checks hold whenever it stops).
      std::this_thread::sleep_for(std::chrono::milliseconds(ms(rng)));
      run.cancel();
      SOAK_CHECK(run.wait_for(30s), "restart: a cancelled run did not end within 30 s");
      SOAK_CHECK(run.status() == RunStatus::cancelled, "restart: status "
                 << to_string(run.status()) << " after cancel");
      const RunStats st = run.stats();
      for (const auto& s : st.stages)
        SOAK_CHECK(s.ring_in_use == 0 && s.ring_budgets == 0, "restart: stage " << s.name
                   << " holds ring bytes after a cancel");
      ++tot.restarts;
      tot.restart_items += st.find("count")->items_out;
      last[2] = st;
    }
  }

 private:
  Graph g_;
  std::atomic<long> seen_{0};
};

class Fail {
 public:
  Fail(Runtime& rt, std::uint64_t seed) : g_(rt, "fail") {
    auto src = g_.source("n", [this]() -> std::optional<long> {
      if (next_ == 2000) return std::nullopt;
      return next_++;
    });
    auto step = g_.stage("step", [this](long i) {
      spin_us(5);
      if (unit(seed_ + static_cast<std::uint64_t>(round_), 4, static_cast<std::uint64_t>(i)) < kFailRun) {
        long none = -1;
        thrown_.compare_exchange_strong(none, i);
        throw std::runtime_error("step failed on " + std::to_string(i));
      }
      return i;
    }, {.concurrency = 2});
    auto sink = g_.sink("s", [this](long i) {
      // (Once seen under ASan in a clean-clone make test, 2026-12-06, not reproduced since:
      // "item 11 delivered, 9 expected". What the run had done by then, for the next time.)
      SOAK_CHECK(i == expect_, "fail: item " << i << " delivered, " << expect_ << " expected (round "
                 << round_ << "; the step threw first on item " << thrown_.load()
                 << " this run, -1: none; the source made " << next_ << " items; current item "
                 << (splitflow::current_item() ? static_cast<long>(*splitflow::current_item()) : -1L)
                 << ")");
      ++expect_;
    });
    src >> step >> sink;
    seed_ = seed;
  }

  void run_until(Clock::time_point until, Totals& tot) {
    while (Clock::now() < until) {
      next_ = 0;
      expect_ = 0;
      thrown_ = -1;
      ++round_;
      Run run = g_.run();
      try {
        SOAK_CHECK(run.wait() == RunStatus::succeeded, "fail: a run neither succeeded nor threw");
        SOAK_CHECK(expect_ == 2000, "fail: a successful run delivered " << expect_ << " of 2000");
      } catch (const StageError& e) {
        const std::string want = "step failed on " + std::to_string(e.item());
        SOAK_CHECK(e.graph() == "fail" && e.stage() == "step" && e.message() == want,
                   "fail: the error names '" << e.graph() << "', '" << e.stage() << "', "
                   << e.item() << ": " << e.message());
        SOAK_CHECK(static_cast<std::uint64_t>(expect_) <= e.item(),
                   "fail: items after the failed one were delivered");
        ++tot.fail_failed;
      }
      ++tot.fail_runs;
      tot.fail_items += static_cast<std::uint64_t>(expect_);
    }
  }

 private:
  Graph g_;
  std::uint64_t seed_ = 0;
  long next_ = 0, expect_ = 0, round_ = 0;
  std::atomic<long> thrown_{-1};  // the first item the step threw on this run
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "soak: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--seconds") o.seconds = std::stod(value());
    else if (a == "--minutes") o.seconds = 60 * std::stod(value());
    else if (a == "--round-seconds") o.round_seconds = std::stod(value());
    else if (a == "--json") o.json = value();
    else if (a == "--seed") o.seed = std::stoull(value());
    else {
      std::fprintf(stderr,
                   "usage: soak [--seconds S | --minutes M] [--round-seconds R] [--json FILE] "
                   "[--seed N]\n");
      std::exit(2);
    }
  }
  if (!(o.seconds > 0) || !(o.round_seconds > 0)) {
    std::fprintf(stderr, "soak: the duration and the round must be positive\n");
    std::exit(2);
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  RuntimeConfig c{.threads = 4};
  c.device.backend = BackendKind::host;
  c.device.streams = 4;
  c.device.host_compute_slots = 2;
  c.device.faults = {.alloc_failure = 0.002, .burst_failure = 0.003, .slow_kernel = 0.01,
                     .slow_by = 2ms, .stall = 0.001, .stall_for = 50ms, .seed = opt.seed};
  Runtime rt(c);
  Train train(rt, opt.seed, 3000);
  Serve serve(rt, opt.seed);
  Restart restart(rt);
  Fail fail(rt, opt.seed);

  Totals tot;
  std::vector<Sample> samples;
  std::vector<RunStats> last(3);
  std::mt19937_64 rng(opt.seed);
  const auto start = Clock::now();
  const auto end = start + std::chrono::duration_cast<Clock::duration>(
                               std::chrono::duration<double>(opt.seconds));
  auto seconds_since = [&](Clock::time_point t) {
    return std::chrono::duration<double>(t - start).count();
  };
  std::printf("soak: %.0f s in rounds of %.0f s; graphs train, serve, restart, fail on one "
              "runtime (host backend, injected device faults)\n",
              opt.seconds, opt.round_seconds);
  while (Clock::now() < end) {
    const auto until = std::min(end, Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                         std::chrono::duration<double>(opt.round_seconds)));
    std::thread a([&] { train.run_until(until, tot, last); });
    std::thread b([&] { serve.run_until(until, tot, last); });
    std::thread d([&] { fail.run_until(until, tot); });
    restart.run_until(until, rng, tot, last);
    a.join();
    b.join();
    d.join();
    ++tot.rounds;
    // Every graph stopped: everything of the device is back.
    const DeviceStats dev = *rt.device_stats();
    std::size_t rings = 0;
    for (const RunStats& st : last)
      for (const auto& s : st.stages) rings += s.ring_capacity;
    SOAK_CHECK(dev.leases_in_use == 0 && dev.lease_waiters == 0,
               "round " << tot.rounds << ": " << dev.leases_in_use << " leases out, "
               << dev.lease_waiters << " waiters with every graph stopped");
    SOAK_CHECK(dev.device_bytes_in_use == 0,
               "round " << tot.rounds << ": " << dev.device_bytes_in_use << " device pool bytes held");
    SOAK_CHECK(dev.pinned_bytes_in_use == rings, "round " << tot.rounds << ": pinned bytes "
               << dev.pinned_bytes_in_use << " != the rings' " << rings);
    samples.push_back({seconds_since(Clock::now()), rss_mib(), threads_now(), fds_now()});
    const Sample& s = samples.back();
    std::printf("round %3llu  t %6.0f s  epochs %llu  requests %llu  restarts %llu  failed runs "
                "%llu  faults %llu  RSS %.1f MiB  threads %ld  fds %ld\n",
                static_cast<unsigned long long>(tot.rounds), s.t_s,
                static_cast<unsigned long long>(tot.train_epochs),
                static_cast<unsigned long long>(tot.requests),
                static_cast<unsigned long long>(tot.restarts),
                static_cast<unsigned long long>(tot.fail_failed),
                static_cast<unsigned long long>(dev.injected.total()), s.rss_mib, s.threads, s.fds);
    std::fflush(stdout);
  }

  // Growth after the warm-up (the first quarter of the samples, at least one).
  const std::size_t warm = std::max<std::size_t>(1, samples.size() / 4);
  std::vector<double> t, rss, thr, fd;
  for (std::size_t i = warm; i < samples.size(); ++i) {
    t.push_back(samples[i].t_s);
    rss.push_back(samples[i].rss_mib);
    thr.push_back(static_cast<double>(samples[i].threads));
    fd.push_back(static_cast<double>(samples[i].fds));
  }
  const double window_s = t.size() > 1 ? t.back() - t.front() : 0;
  const double rss_slope = slope(t, rss) * 3600, thr_slope = slope(t, thr) * 3600,
               fd_slope = slope(t, fd) * 3600;
  // Bounds: over the window, RSS may drift by 8 MiB (allocator noise), threads and fds by less
  // than one; per hour that is 8 MiB / window.
  const double rss_growth = rss_slope * window_s / 3600, thr_growth = thr_slope * window_s / 3600,
               fd_growth = fd_slope * window_s / 3600;
  const DeviceStats dev = *rt.device_stats();
  std::printf(
      "soak: %.0f s, %llu rounds: train %llu epochs, %llu items (%llu delivered, %llu skipped, "
      "%llu substituted); serve %llu requests (%llu answered, %llu failed, %llu expired), %llu "
      "rejected at admission; restart %llu cancels; fail %llu runs (%llu failed); injected "
      "faults: %llu allocation failures, %llu failed bursts, %llu slow kernels, %llu stalls\n"
      "soak: lost 0, duplicated 0, leaked 0 (checked per run and per round)\n"
      "soak: after the warm-up (%zu samples over %.0f s): RSS %+.1f MiB/h (%+.2f MiB in the "
      "window), threads %+.2f/h, fds %+.2f/h\n",
      seconds_since(Clock::now()), static_cast<unsigned long long>(tot.rounds),
      static_cast<unsigned long long>(tot.train_epochs),
      static_cast<unsigned long long>(tot.train_items),
      static_cast<unsigned long long>(tot.train_delivered),
      static_cast<unsigned long long>(tot.train_skipped),
      static_cast<unsigned long long>(tot.train_substituted),
      static_cast<unsigned long long>(tot.requests), static_cast<unsigned long long>(tot.answered),
      static_cast<unsigned long long>(tot.failed_requests),
      static_cast<unsigned long long>(tot.expired), static_cast<unsigned long long>(tot.rejected),
      static_cast<unsigned long long>(tot.restarts), static_cast<unsigned long long>(tot.fail_runs),
      static_cast<unsigned long long>(tot.fail_failed),
      static_cast<unsigned long long>(dev.injected.alloc_failures),
      static_cast<unsigned long long>(dev.injected.burst_failures),
      static_cast<unsigned long long>(dev.injected.slow_kernels),
      static_cast<unsigned long long>(dev.injected.stalls), t.size(), window_s, rss_slope,
      rss_growth, thr_slope, fd_slope);
  if (!opt.json.empty()) {
    std::ofstream j(opt.json);
    j << "{\"seconds\": " << seconds_since(Clock::now()) << ", \"rounds\": " << tot.rounds
      << ", \"train_epochs\": " << tot.train_epochs << ", \"train_items\": " << tot.train_items
      << ", \"train_delivered\": " << tot.train_delivered << ", \"train_skipped\": "
      << tot.train_skipped << ", \"train_substituted\": " << tot.train_substituted
      << ", \"requests\": " << tot.requests << ", \"answered\": " << tot.answered
      << ", \"failed_requests\": " << tot.failed_requests << ", \"expired\": " << tot.expired
      << ", \"rejected\": " << tot.rejected << ", \"restarts\": " << tot.restarts
      << ", \"fail_runs\": " << tot.fail_runs << ", \"fail_failed\": " << tot.fail_failed
      << ", \"injected\": {\"alloc_failures\": " << dev.injected.alloc_failures
      << ", \"burst_failures\": " << dev.injected.burst_failures << ", \"slow_kernels\": "
      << dev.injected.slow_kernels << ", \"stalls\": " << dev.injected.stalls << "}"
      << ", \"rss_mib_per_hour\": " << rss_slope << ", \"threads_per_hour\": " << thr_slope
      << ", \"fds_per_hour\": " << fd_slope << ", \"samples\": [";
    for (std::size_t i = 0; i < samples.size(); ++i)
      j << (i ? ", " : "") << "[" << samples[i].t_s << ", " << samples[i].rss_mib << ", "
        << samples[i].threads << ", " << samples[i].fds << "]";
    j << "]}\n";
  }
#if defined(SPLITFLOW_TEST_ASAN) || defined(SPLITFLOW_TEST_TSAN)
  // Under a sanitizer the process's own memory grows by design (ASan's quarantine, TSan's
  // history): RSS is reported, not bounded.
  constexpr bool kBoundRss = false;
#else
  constexpr bool kBoundRss = true;
#endif
  if (t.size() >= 2) {
    SOAK_CHECK(!kBoundRss || rss_growth < 8.0, "RSS grew " << rss_growth << " MiB over the " << window_s
               << " s after the warm-up (" << rss_slope << " MiB/h; bound 8 MiB in the window)");
    SOAK_CHECK(thr_growth < 1.0, "threads grew " << thr_growth << " over the window");
    SOAK_CHECK(fd_growth < 1.0, "open file descriptors grew " << fd_growth << " over the window");
  }
  SOAK_CHECK(dev.injected.total() > 0 && tot.train_skipped > 0,
             "no fault was injected or no item skipped: the soak tested nothing");
  std::printf("soak: passed\n");
  return 0;
}
