// The cross-process lease arbiter (DeviceConfig::arbiter; docs/sharing.md), tested with real
// processes: tests/arbiter_member.cpp, started here with pipes on its stdin and stdout, either
// obeying commands (acquire, release, cancel; white-box, so each order is deterministic) or
// running a training-style graph on the host backend. Each test quotes the requirement it
// checks (issue 19, "Tests").
#include <gtest/gtest.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <splitflow/device/arbiter.hpp>
#include <splitflow/ops/ops.hpp>
#include <splitflow/splitflow.hpp>
#include <string>
#include <vector>

extern char** environ;

using namespace splitflow;
using namespace std::chrono_literals;

namespace {

/// A unique arbiter name per test, removed at the end.
struct Name {
  std::string value;
  Name() {
    static int n = 0;
    value = "test-" + std::to_string(::getpid()) + "-" + std::to_string(++n);
    remove_arbiter(value, /*force=*/true);
  }
  ~Name() { remove_arbiter(value, /*force=*/true); }
};

/// The member program: the build tree's, else the one beside this test (a staged copy).
std::string member_path() {
  if (::access(SPLITFLOW_ARBITER_MEMBER, X_OK) == 0) return SPLITFLOW_ARBITER_MEMBER;
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  std::string dir = n > 0 ? std::string(self, static_cast<std::size_t>(n)) : std::string(".");
  return dir.substr(0, dir.rfind('/')) + "/arbiter_member";
}

/// One arbiter_member process with its stdin and stdout.
class Member {
 public:
  /// `prefix`: a command that runs the member (e.g. setpriv, to run it as another user).
  explicit Member(std::vector<std::string> args, std::vector<std::string> prefix = {}) {
    int in[2], out[2];
    if (::pipe(in) != 0 || ::pipe(out) != 0) throw std::runtime_error("pipe");
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    posix_spawn_file_actions_addclose(&fa, in[1]);
    posix_spawn_file_actions_addclose(&fa, out[0]);
    args.insert(args.begin(), member_path());
    args.insert(args.begin(), prefix.begin(), prefix.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    if (posix_spawnp(&pid_, argv[0], &fa, nullptr, argv.data(), environ) != 0)
      throw std::runtime_error("spawn");
    posix_spawn_file_actions_destroy(&fa);
    ::close(in[0]);
    ::close(out[1]);
    to_ = in[1];
    from_ = out[0];
  }
  ~Member() {
    ::close(to_);
    ::close(from_);
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  void send(const std::string& line) {
    const std::string s = line + "\n";
    ASSERT_EQ(::write(to_, s.data(), s.size()), static_cast<ssize_t>(s.size()));
  }
  /// The next line (the deadline bounds a hang; it is not a synchronisation).
  std::string line(std::chrono::milliseconds deadline = 20s) {
    const auto end = std::chrono::steady_clock::now() + deadline;
    for (;;) {
      const auto nl = buf_.find('\n');
      if (nl != std::string::npos) {
        std::string l = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return l;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          end - std::chrono::steady_clock::now());
      if (left.count() <= 0) return "<timeout>";
      pollfd p{from_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char b[4096];
      const ssize_t n = ::read(from_, b, sizeof b);
      if (n <= 0) return "<eof>";
      buf_.append(b, static_cast<std::size_t>(n));
    }
  }
  /// True when no line arrives within `quiet` (used only to check that nothing was granted).
  bool silent_for(std::chrono::milliseconds quiet) {
    if (buf_.find('\n') != std::string::npos) return false;
    pollfd p{from_, POLLIN, 0};
    return ::poll(&p, 1, static_cast<int>(quiet.count())) == 0;
  }
  std::string ask(const std::string& cmd) {
    send(cmd);
    return line();
  }
  void kill9() {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  int wait_exit() {
    int st = 0;
    ::waitpid(pid_, &st, 0);
    pid_ = -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  }
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  int to_ = -1, from_ = -1;
  std::string buf_;
};

std::unique_ptr<Member> script(const std::string& name, int capacity, double share = 1.0,
                               int liveness_ms = 20, const std::string& group = "",
                               std::vector<std::string> prefix = {}) {
  return std::make_unique<Member>(
      std::vector<std::string>{"script", name, std::to_string(capacity), std::to_string(share),
                               std::to_string(liveness_ms), group},
      std::move(prefix));
}

/// Runs a member as user and group nobody/nogroup (65534): needs root and setpriv.
const std::vector<std::string> kAsNobody = {"setpriv", "--reuid=65534", "--regid=65534",
                                            "--clear-groups"};

std::uint64_t ticket_of(const std::string& queued) {
  EXPECT_EQ(queued.rfind("queued ", 0), 0u) << queued;
  return std::strtoull(queued.c_str() + 7, nullptr, 10);
}

/// Waits until `done()` (polling the segment; the deadline bounds a hang, it is not a
/// synchronisation): false when it never happened.
template <class F>
bool eventually(F done, std::chrono::seconds deadline = 20s) {
  const auto end = std::chrono::steady_clock::now() + deadline;
  while (!done()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::yield();
  }
  return true;
}

const ArbiterProcess* by_pid(const ArbiterView& v, int pid) {
  for (const auto& p : v.processes)
    if (p.pid == pid) return &p;
  return nullptr;
}

}  // namespace

// "every lease granted exactly once, FIFO order across processes within a priority": capacity
// 1; A holds the token, then B, C, D (four processes) queue in the order B1 C1 B2 D1; each
// release hands the token to the oldest waiting ticket, whichever process holds it.
TEST(Arbiter, FourProcessesAreServedInArrivalOrder) {
  Name n;
  auto a = script(n.value, 1), b = script(n.value, 1), c = script(n.value, 1), d = script(n.value, 1);
  for (auto* m : {a.get(), b.get(), c.get(), d.get()}) ASSERT_EQ(m->line().rfind("ready ", 0), 0u);
  ASSERT_EQ(a->ask("acquire 0"), "granted");
  const auto b1 = ticket_of(b->ask("acquire 0"));
  const auto c1 = ticket_of(c->ask("acquire 0"));
  const auto b2 = ticket_of(b->ask("acquire 0"));
  const auto d1 = ticket_of(d->ask("acquire 0"));
  EXPECT_TRUE(b->silent_for(50ms));  // nothing granted while A holds the only token
  ASSERT_EQ(a->ask("release"), "released");
  EXPECT_EQ(b->line(), "delivered " + std::to_string(b1));
  ASSERT_EQ(b->ask("release"), "released");
  EXPECT_EQ(c->line(), "delivered " + std::to_string(c1));
  ASSERT_EQ(c->ask("release"), "released");
  // B's second ticket is next: B's own release would have delivered it in-line; here C's does.
  EXPECT_EQ(b->line(), "delivered " + std::to_string(b2));
  ASSERT_EQ(b->ask("release"), "released");
  EXPECT_EQ(d->line(), "delivered " + std::to_string(d1));
  ASSERT_EQ(d->ask("release"), "released");
  const ArbiterView v = read_arbiter(n.value);
  EXPECT_EQ(v.leases, 5u);
  EXPECT_EQ(v.in_use, 0u);
  EXPECT_EQ(v.max_in_use, 1u);
  EXPECT_EQ(v.waiting, 0u);
  EXPECT_EQ(by_pid(v, b->pid())->leases, 2u);
  EXPECT_EQ(by_pid(v, d->pid())->leases, 1u);
}

// "a priority process served first": a priority-5 request queued after two priority-0 ones
// gets the next token; the priority-0 ones follow in their order.
TEST(Arbiter, AHigherPriorityRequestOvertakesAcrossProcesses) {
  Name n;
  auto a = script(n.value, 1), b = script(n.value, 1), c = script(n.value, 1);
  for (auto* m : {a.get(), b.get(), c.get()}) ASSERT_EQ(m->line().rfind("ready ", 0), 0u);
  ASSERT_EQ(a->ask("acquire 0"), "granted");
  const auto low1 = ticket_of(b->ask("acquire 0"));
  const auto low2 = ticket_of(b->ask("acquire 0"));
  const auto high = ticket_of(c->ask("acquire 5"));
  ASSERT_EQ(a->ask("release"), "released");
  EXPECT_EQ(c->line(), "delivered " + std::to_string(high));
  ASSERT_EQ(c->ask("release"), "released");
  EXPECT_EQ(b->line(), "delivered " + std::to_string(low1));
  ASSERT_EQ(b->ask("release"), "released");
  EXPECT_EQ(b->line(), "delivered " + std::to_string(low2));
}

// "a per-process cap (share of the device's concurrent bursts)": capacity 4, share 0.5: A holds
// at most 2 even with tokens free; B takes the others; A's queued request gets the first token
// A itself gives back.
TEST(Arbiter, AProcessNeverHoldsMoreThanItsShare) {
  Name n;
  auto a = script(n.value, 4, 0.5);
  EXPECT_EQ(a->line(), "ready 0 2 4");  // slot 0, cap 2 of capacity 4
  auto b = script(n.value, 4, 1.0);
  EXPECT_EQ(b->line(), "ready 1 4 4");
  ASSERT_EQ(a->ask("acquire 0"), "granted");
  ASSERT_EQ(a->ask("acquire 0"), "granted");
  const auto a3 = ticket_of(a->ask("acquire 9"));  // its cap, not the device, holds it back
  ASSERT_EQ(b->ask("acquire 0"), "granted");
  ASSERT_EQ(b->ask("acquire 0"), "granted");
  const auto b3 = ticket_of(b->ask("acquire 0"));
  EXPECT_EQ(read_arbiter(n.value).in_use, 4u);
  ASSERT_EQ(b->ask("release"), "released");
  // The free token cannot go to A (at its cap) though A's ticket is older and of higher priority.
  EXPECT_EQ(b->line(), "delivered " + std::to_string(b3));
  ASSERT_EQ(a->ask("release"), "released");
  EXPECT_EQ(a->line(), "delivered " + std::to_string(a3));
  EXPECT_EQ(read_arbiter(n.value).max_in_use, 4u);
}

// "A process can never release or alter another process's leases": a release with none held
// changes nothing, and a ticket number of another process cannot be cancelled.
TEST(Arbiter, AProcessCannotReleaseOrCancelAnothersLeases) {
  Name n;
  auto a = script(n.value, 1), b = script(n.value, 1);
  ASSERT_EQ(a->line().rfind("ready", 0), 0u);
  ASSERT_EQ(b->line().rfind("ready", 0), 0u);
  ASSERT_EQ(a->ask("acquire 0"), "granted");
  const auto bt = ticket_of(b->ask("acquire 0"));
  ASSERT_EQ(b->ask("release"), "released");  // B holds nothing: A's token stays A's
  EXPECT_EQ(read_arbiter(n.value).in_use, 1u);
  EXPECT_TRUE(b->silent_for(50ms));
  ASSERT_EQ(a->ask("cancel " + std::to_string(bt)), "cancelled 1");  // not A's: no effect
  EXPECT_EQ(read_arbiter(n.value).waiting, 1u);
  ASSERT_EQ(a->ask("release"), "released");
  EXPECT_EQ(b->line(), "delivered " + std::to_string(bt));
}

// A withdrawn request is never granted; the token goes to the next one.
TEST(Arbiter, ACancelledRequestIsSkipped) {
  Name n;
  auto a = script(n.value, 1), b = script(n.value, 1), c = script(n.value, 1);
  for (auto* m : {a.get(), b.get(), c.get()}) ASSERT_EQ(m->line().rfind("ready", 0), 0u);
  ASSERT_EQ(a->ask("acquire 0"), "granted");
  const auto bt = ticket_of(b->ask("acquire 0"));
  const auto ct = ticket_of(c->ask("acquire 0"));
  ASSERT_EQ(b->ask("cancel " + std::to_string(bt)), "cancelled 1");
  ASSERT_EQ(a->ask("release"), "released");
  EXPECT_EQ(c->line(), "delivered " + std::to_string(ct));
  EXPECT_TRUE(b->silent_for(50ms));
  EXPECT_EQ(read_arbiter(n.value).leases, 2u);
}

// "SIGKILL of a process holding leases: the others continue within the stated bound"
// (ArbiterConfig::liveness, 20 ms here; the test allows 2 s for a loaded machine). The dead
// process's tokens and tickets are reclaimed and counted.
TEST(Arbiter, TheLeasesOfAKilledProcessAreReclaimed) {
  Name n;
  auto a = script(n.value, 2), b = script(n.value, 2);
  ASSERT_EQ(a->line().rfind("ready", 0), 0u);
  ASSERT_EQ(b->line().rfind("ready", 0), 0u);
  ASSERT_EQ(a->ask("acquire 0"), "granted");
  ASSERT_EQ(a->ask("acquire 0"), "granted");
  ticket_of(a->ask("acquire 0"));  // a queued ticket dies with it too
  a->send("enter 0");                // and the compute slot it holds
  ASSERT_EQ(a->line(), "entered 0");
  const auto bt = ticket_of(b->ask("acquire 0"));
  b->send("enter 0");
  ASSERT_TRUE(eventually([&] { return read_arbiter(n.value).compute_waiting == 1; }));
  const auto t0 = std::chrono::steady_clock::now();
  a->kill9();
  std::vector<std::string> got = {b->line(2s), b->line(2s)};  // in either order
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, (std::vector<std::string>{"delivered " + std::to_string(bt), "entered 0"}));
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  RecordProperty("reclaim_ms", std::to_string(waited * 1e3));
  const ArbiterView v = read_arbiter(n.value);
  EXPECT_EQ(v.reclaimed_processes, 1u);
  EXPECT_EQ(v.reclaimed_leases, 2u);
  EXPECT_EQ(v.in_use, 1u);
  EXPECT_EQ(v.waiting, 0u);
  EXPECT_EQ(v.compute_in_use, 1u);  // B's, after A's was reclaimed
  EXPECT_EQ(v.compute_waiting, 0u);
  ASSERT_EQ(b->ask("acquire 0"), "granted");  // the second token is free again
  EXPECT_EQ(by_pid(v, b->pid())->state, "live");
}

// "splitflow-top --remove removes a segment no process uses any more": while a process uses
// it, removal is refused, naming the process (removed, a newcomer made a new segment and
// shared the device with it past the capacity: two bursts at once on a capacity of 1, a new
// user's trial); once it left, or with force, the segment goes.
TEST(Arbiter, ASegmentInUseIsNotRemovedUnlessForced) {
  Name n;
  auto a = script(n.value, 1);
  ASSERT_EQ(a->line().rfind("ready", 0), 0u);
  ASSERT_EQ(a->ask("acquire 0"), "granted");
  try {
    remove_arbiter(n.value);
    ADD_FAILURE() << "removed under a live process";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("arbiter '" + n.value + "' was not removed: processes use "
                                         "it: " + std::to_string(a->pid()) + " ("),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(read_arbiter(n.value).in_use, 1u) << "the segment is still there, its lease out";
  // A second process joins the same segment and waits for the token: one capacity between them.
  auto b = script(n.value, 1);
  ASSERT_EQ(b->line().rfind("ready", 0), 0u);
  ticket_of(b->ask("acquire 0"));
  a->send("quit");
  EXPECT_EQ(a->wait_exit(), 0);
  EXPECT_EQ(b->line().rfind("delivered ", 0), 0u);
  EXPECT_THROW(remove_arbiter(n.value), Error);  // b still uses it
  EXPECT_TRUE(remove_arbiter(n.value, /*force=*/true));
  EXPECT_FALSE(remove_arbiter(n.value)) << "there is none left";
}

// The meter reads, it does not reclaim: a process killed while no other member looks (no pump
// of another process, no newcomer) shows as "dead", not "live" with its leases growing
// (a new user's trial); the next process to join reclaims it.
TEST(Arbiter, TheMeterShowsAKilledProcessAsDeadUntilItIsReclaimed) {
  Name n;
  auto a = script(n.value, 2);
  ASSERT_EQ(a->line().rfind("ready", 0), 0u);
  ASSERT_EQ(a->ask("acquire 0"), "granted");
  ASSERT_EQ(a->ask("acquire 0"), "granted");
  const int pid = a->pid();
  a->kill9();
  ArbiterView v = read_arbiter(n.value);
  ASSERT_NE(by_pid(v, pid), nullptr);
  EXPECT_EQ(by_pid(v, pid)->state, "dead");
  EXPECT_EQ(by_pid(v, pid)->held, 2u);  // not yet taken back
  EXPECT_TRUE(remove_arbiter(n.value)) << "no live process uses it: removed without force";
  auto b = script(n.value, 2);  // a new segment
  ASSERT_EQ(b->line().rfind("ready", 0), 0u);
  v = read_arbiter(n.value);
  EXPECT_EQ(by_pid(v, pid), nullptr);
  EXPECT_EQ(by_pid(v, b->pid())->state, "live");
}

// A process killed while it holds the segment's lock (robust mutex): the next locker repairs
// the state and goes on; the dead one's token is reclaimed.
TEST(Arbiter, AProcessKilledHoldingTheLockDoesNotWedgeTheOthers) {
  Name n;
  auto a = script(n.value, 1), b = script(n.value, 1);
  ASSERT_EQ(a->line().rfind("ready", 0), 0u);
  ASSERT_EQ(b->line().rfind("ready", 0), 0u);
  ASSERT_EQ(a->ask("acquire 0"), "granted");
  ASSERT_EQ(a->ask("holdlock"), "locked");
  a->kill9();
  const auto bt = b->ask("acquire 0");  // takes the lock: EOWNERDEAD, repaired
  if (bt != "granted") {
    // Queued behind the dead holder, then granted when its token is reclaimed: the pump
    // thread's "delivered T" may come before the main thread's "queued T" (it did under TSan).
    const std::string next = b->line(2s);
    const bool queued_first = bt.rfind("queued ", 0) == 0;
    EXPECT_EQ(queued_first ? next : bt, "delivered " + std::to_string(ticket_of(queued_first ? bt : next)));
  }
  const ArbiterView v = read_arbiter(n.value);
  EXPECT_EQ(v.in_use, 1u);
  EXPECT_EQ(v.reclaimed_processes, 1u);
}

// "A corrupted or foreign segment (bad magic, version, sizes) is refused with a clear error".
TEST(Arbiter, ACorruptOrForeignSegmentIsRefusedWithAClearError) {
  Name n;
  const std::string path = "/dev/shm/splitflow-arb-" + n.value;
  auto expect_refused = [&](const std::string& want) {
    RuntimeConfig rc;
    rc.device.backend = BackendKind::host;
    rc.device.arbiter.name = n.value;
    Runtime rt(rc);
    Graph g(rt, "g");
    auto src = g.source("n", [i = 0]() mutable -> std::optional<long> {
      return i < 1 ? std::optional<long>(i++) : std::nullopt;
    });
    auto up = g.stage("up", [](long) { return HostTensor::empty(DType::u8, {4}); });
    auto k = g.gpu_stage("k", [](DeviceTensor t, DeviceContext& ctx) { return ctx.to_host(t); });
    auto sink = g.sink("s", [](HostTensor) {});
    src >> up >> k >> sink;
    try {
      g.run().wait();
      ADD_FAILURE() << "the segment was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    }
    EXPECT_THROW(read_arbiter(n.value), Error);
  };
  {  // right size, garbage magic
    std::ofstream f(path, std::ios::binary);
    std::vector<char> junk(4096, 'x');
    f.write(junk.data(), static_cast<std::streamsize>(junk.size()));
  }
  ::chmod(path.c_str(), 0600);
  expect_refused("not an arbiter segment of this version");
  {
    // The right size, wrong magic: written by something else.
    Name other;
    auto m = script(other.value, 1);
    ASSERT_EQ(m->line().rfind("ready", 0), 0u);
    ASSERT_EQ(m->ask("quit"), "bye");
    std::ifstream in("/dev/shm/splitflow-arb-" + other.value, std::ios::binary);
    std::vector<char> seg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ASSERT_GT(seg.size(), 64u);
    auto write_with = [&](std::size_t at, char value) {
      std::vector<char> copy = seg;
      copy[at] = value;
      std::ofstream f(path, std::ios::binary | std::ios::trunc);
      f.write(copy.data(), static_cast<std::streamsize>(copy.size()));
    };
    write_with(0, 'Z');  // magic
    expect_refused("bad magic");
    write_with(8, 7);  // version
    expect_refused("another splitflow version");
  }
}

// "The segment is private to the user by default (mode 0600)"; a bad name, a share out of
// range and a capacity that disagrees with the segment's are refused, naming the option.
TEST(Arbiter, TheSegmentIsPrivateAndOptionsAreChecked) {
  Name n;
  auto a = script(n.value, 3);
  ASSERT_EQ(a->line(), "ready 0 3 3");
  struct stat st {};
  ASSERT_EQ(::stat(("/dev/shm/splitflow-arb-" + n.value).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(st.st_uid, ::geteuid());
  auto b = script(n.value, 2);
  const std::string e = b->line();
  EXPECT_NE(e.find("its capacity is 3 bursts; this runtime asks for 2"), std::string::npos) << e;
  EXPECT_EQ(e.find("no process uses it now"), std::string::npos) << e;  // a uses it
  auto c = script(n.value, 3, 1.5);
  EXPECT_NE(c->line().find("ArbiterConfig::share is 1.5"), std::string::npos);
  auto d = script("no/slash", 1);
  EXPECT_NE(d->line().find("is not a valid arbiter name"), std::string::npos);
  // A segment left by earlier runs (every process gone) keeps its capacity: the refusal says
  // how to remove it (it did not: a new user's trial).
  ASSERT_EQ(a->ask("quit"), "bye");
  EXPECT_EQ(a->wait_exit(), 0);
  auto f = script(n.value, 4);
  const std::string stale = f->line();
  EXPECT_NE(stale.find("its capacity is 3 bursts; this runtime asks for 4 (ArbiterConfig::capacity: "
                       "0 joins whatever it is); no process uses it now (left by an earlier run): "
                       "`splitflow-top --remove " + n.value + "` removes it"),
            std::string::npos)
      << stale;
}

// "the meter's figures equal the sum of what each process reports": two training-style jobs as
// separate processes on one modelled device; each prints its own figures; the segment's
// per-process leases and busy time, and its graph's bursts, held and busy time, equal them, and
// the device's leases their sum.
TEST(Arbiter, TheMeterEqualsWhatTheProcessesReport) {
  Name n;
  std::vector<std::unique_ptr<Member>> jobs;
  for (int k = 0; k < 2; ++k)
    jobs.push_back(std::make_unique<Member>(std::vector<std::string>{
        "run", n.value, "1", "1.0", "0", "200", "300", "100", "job" + std::to_string(k)}));
  std::vector<std::string> reports;
  std::vector<int> pids;
  for (auto& j : jobs) {
    pids.push_back(j->pid());
    reports.push_back(j->line(120s));
    EXPECT_EQ(j->wait_exit(), 0) << reports.back();
  }
  const ArbiterView v = read_arbiter(n.value);
  unsigned long long total = 0;
  for (std::size_t k = 0; k < jobs.size(); ++k) {
    const std::string& r = reports[k];
    ASSERT_NE(r.find("\"status\": \"succeeded\""), std::string::npos) << r;
    EXPECT_NE(r.find("\"items\": 200, \"sum\": 19900"), std::string::npos) << r;
    const ArbiterProcess* p = by_pid(v, pids[k]);
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(p->state, "exited");
    EXPECT_EQ(p->label, "job" + std::to_string(k));
    EXPECT_NE(r.find("\"leases\": " + std::to_string(p->leases) + ","), std::string::npos) << r;
    EXPECT_NE(r.find("\"busy_ns\": " + std::to_string(p->busy_ns) + ","), std::string::npos) << r;
    EXPECT_EQ(p->leases, 200u);
    total += p->leases;
    // Its graph, as the process published it when it left: its run's own figures.
    ASSERT_EQ(p->graphs.size(), 1u);
    const ArbiterGraph& g = p->graphs.front();
    EXPECT_EQ(g.name, "job");
    EXPECT_EQ(g.bursts, 200u);
    EXPECT_NE(r.find("\"graph_bursts\": 200, \"graph_held_ns\": " + std::to_string(g.held_ns) +
                     ", \"graph_busy_ns\": " + std::to_string(g.busy_ns) + "}"),
              std::string::npos)
        << r;
    EXPECT_GE(g.held_ns, g.busy_ns);
  }
  EXPECT_EQ(v.leases, total);
  EXPECT_EQ(v.max_in_use, 1u);  // capacity 1: one burst on the device at a time
  EXPECT_EQ(v.in_use, 0u);
  // The modelled device (one compute slot, shared): one kernel at a time across the processes,
  // so its busy time is at least the kernels' summed durations (400 x 300 us), and at most what
  // the processes count (their copies too).
  EXPECT_EQ(v.compute_slots, 1u);
  EXPECT_EQ(v.max_compute_in_use, 1u);
  EXPECT_GE(v.device_busy_ns, 400 * 300'000LL);
  EXPECT_LE(v.device_busy_ns, v.busy_ns());
  // The meter's outputs carry the same figures.
  const std::string json = arbiters_json({v});
  EXPECT_NE(json.find("\"leases\": " + std::to_string(total)), std::string::npos);
  const std::string prom = arbiters_prometheus({v});
  EXPECT_NE(prom.find("splitflow_process_leases_total{arbiter=\"" + n.value + "\",pid=\"" +
                      std::to_string(pids[0]) + "\",label=\"job0\",state=\"exited\"} 200"),
            std::string::npos)
      << prom;
  EXPECT_NE(prom.find("splitflow_graph_bursts_total{arbiter=\"" + n.value + "\",pid=\"" +
                      std::to_string(pids[1]) + "\",label=\"job1\",graph=\"job\",priority=\"0\"} 200"),
            std::string::npos)
      << prom;
}

// "a second user's process refused without the sharing option": a member run as user nobody
// cannot join root's private segment; with ArbiterConfig::group (here nogroup, nobody's group)
// the segment is 0660 in that group and nobody's process joins and is served.
TEST(Arbiter, AnotherUsersProcessJoinsOnlyThroughTheSharingGroup) {
  if (::geteuid() != 0 || ::access("/usr/bin/setpriv", X_OK) != 0)
    GTEST_SKIP() << "needs root and setpriv to run a member as another user (the mode bits are "
                    "checked by TheSegmentIsPrivateAndOptionsAreChecked)";
  Name priv, shared;
  auto owner = script(priv.value, 1);
  ASSERT_EQ(owner->line().rfind("ready", 0), 0u);
  auto stranger = script(priv.value, 1, 1.0, 20, "", kAsNobody);
  const std::string e = stranger->line();
  if (e == "<eof>")  // (e.g. a staged copy in a folder user nobody cannot enter)
    GTEST_SKIP() << "user nobody cannot run " << member_path();
  EXPECT_EQ(e.rfind("error", 0), 0u) << e;
  EXPECT_NE(e.find("permission denied"), std::string::npos) << e;
  EXPECT_NE(e.find("ArbiterConfig::group"), std::string::npos) << e;

  auto host = script(shared.value, 1, 1.0, 20, "nogroup");
  ASSERT_EQ(host->line().rfind("ready", 0), 0u);
  struct stat st {};
  ASSERT_EQ(::stat(("/dev/shm/splitflow-arb-" + shared.value).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  EXPECT_EQ(st.st_gid, 65534u);
  auto guest = script(shared.value, 1, 1.0, 20, "nogroup", kAsNobody);
  ASSERT_EQ(guest->line().rfind("ready", 0), 0u);
  ASSERT_EQ(host->ask("acquire 0"), "granted");
  const auto t = ticket_of(guest->ask("acquire 0"));
  ASSERT_EQ(host->ask("release"), "released");
  EXPECT_EQ(guest->line(), "delivered " + std::to_string(t));
  // Without naming the group, the same user is refused by a segment of another owner.
  auto unnamed = script(shared.value, 1, 1.0, 20, "", kAsNobody);
  const std::string e2 = unnamed->line();
  EXPECT_NE(e2.find("belongs to uid 0"), std::string::npos) << e2;
}

namespace {
/// A graph of `items` items through a GPU stage of `kernel` on `rt`; its sum goes to `sum`.
std::unique_ptr<Graph> kernel_graph(Runtime& rt, const std::string& name, long items,
                                    std::chrono::microseconds kernel, std::atomic<long>& sum,
                                    int priority = 0) {
  GraphOptions go;
  go.priority = priority;
  auto g = std::make_unique<Graph>(rt, name, go);
  auto src = g->source("n", [i = 0L, items]() mutable -> std::optional<long> {
    return i < items ? std::optional<long>(i++) : std::nullopt;
  });
  auto up = g->stage("up", [](long i) {
    HostTensor t = HostTensor::empty(DType::i64, {1});
    *t.data<std::int64_t>() = i;
    return t;
  });
  GpuStageOptions o;
  o.concurrency = 4;
  auto k = g->gpu_stage("k", [kernel](DeviceTensor t, DeviceContext& ctx) {
    ops::busy_kernel(ctx, kernel);
    return ctx.to_host(t);
  }, o);
  auto sink = g->sink("s", [&sum](HostTensor h) { sum += *h.data<std::int64_t>(); });
  src >> up >> k >> sink;
  return g;
}

RuntimeConfig arbitrated(const std::string& name, std::size_t capacity, double share = 1.0) {
  RuntimeConfig rc;
  rc.threads = 2;
  rc.device.backend = BackendKind::host;
  rc.device.streams = 4;
  rc.device.host_compute_slots = 2;
  rc.device.arbiter.name = name;
  rc.device.arbiter.capacity = capacity;
  rc.device.arbiter.share = share;
  rc.device.arbiter.liveness = 20ms;
  return rc;
}
}  // namespace

// Two runtimes in one process join the same arbiter as two members (the StreamPool's side of
// it, under the sanitizers): every item is done once, the device never has more bursts than
// the capacity, and each runtime's leases are the arbiter's figure for it.
TEST(Arbiter, TwoRuntimesShareOneCapacityAndFinishEveryItem) {
  Name n;
  Runtime r1(arbitrated(n.value, 2)), r2(arbitrated(n.value, 2));
  std::atomic<long> s1{0}, s2{0};
  auto g1 = kernel_graph(r1, "g1", 150, 200us, s1);
  auto g2 = kernel_graph(r2, "g2", 150, 200us, s2);
  auto run1 = g1->run();
  auto run2 = g2->run();
  EXPECT_EQ(run1.wait(), RunStatus::succeeded);
  EXPECT_EQ(run2.wait(), RunStatus::succeeded);
  EXPECT_EQ(s1.load(), 149L * 150 / 2);
  EXPECT_EQ(s2.load(), 149L * 150 / 2);
  const ArbiterView v = read_arbiter(n.value);
  EXPECT_LE(v.max_in_use, 2u);
  EXPECT_EQ(v.in_use, 0u);
  EXPECT_EQ(v.leases, 300u);
  EXPECT_EQ(r1.device_stats()->leases + r2.device_stats()->leases, 300u);
  EXPECT_LE(r1.device_stats()->max_leases_in_use, 2u);
}

// Cancelling a run whose bursts wait in the arbiter withdraws its tickets (none is granted to
// a gone waiter, no token is lost): the other runtime's graph still finishes, and the segment
// ends with nothing out or queued.
TEST(Arbiter, ACancelledRunWithdrawsItsQueuedRequests) {
  Name n;
  Runtime r1(arbitrated(n.value, 1)), r2(arbitrated(n.value, 1));
  std::atomic<long> s1{0}, s2{0};
  auto slow = kernel_graph(r1, "slow", 1000000, 2ms, s1);
  auto other = kernel_graph(r2, "other", 100, 100us, s2);
  auto run1 = slow->run();
  auto run2 = other->run();
  // Once some of its bursts ran, with the other graph's requests queued behind them:
  ASSERT_TRUE(eventually([&] { return r1.device_stats()->leases >= 5; }));
  run1.cancel();
  EXPECT_EQ(run1.wait(), RunStatus::cancelled);
  EXPECT_EQ(run2.wait(), RunStatus::succeeded);
  EXPECT_EQ(s2.load(), 99L * 100 / 2);
  const ArbiterView v = read_arbiter(n.value);
  EXPECT_EQ(v.in_use, 0u);
  EXPECT_EQ(v.waiting, 0u);
  EXPECT_EQ(v.max_in_use, 1u);
  // Every lease the pools took came from the arbiter; a grant that met a withdrawn waiter went
  // back unused (counted by the arbiter, not by a pool).
  EXPECT_GE(v.leases, r1.device_stats()->leases + r2.device_stats()->leases);
}

// "the same order on the host backend's compute slots ... across processes": compute slots of
// the shared modelled device go first come first served within a priority, a priority-5
// kernel before priority-0 ones queued earlier.
TEST(Arbiter, ComputeSlotsAreGrantedByPriorityThenArrivalAcrossProcesses) {
  Name n;
  auto a = script(n.value, 1), b = script(n.value, 1), c = script(n.value, 1);
  for (auto* m : {a.get(), b.get(), c.get()}) ASSERT_EQ(m->line().rfind("ready", 0), 0u);
  a->send("enter 0");
  ASSERT_EQ(a->line(), "entered 0");
  // B's request, then C's, each queued (the segment says so) before the next is made:
  b->send("enter 0");
  ASSERT_TRUE(eventually([&] { return read_arbiter(n.value).compute_waiting == 1; }));
  c->send("enter 0");
  ASSERT_TRUE(eventually([&] { return read_arbiter(n.value).compute_waiting == 2; }));
  b->send("enter 5");  // a second kernel of B, at priority 5
  ASSERT_TRUE(eventually([&] { return read_arbiter(n.value).compute_waiting == 3; }));
  EXPECT_TRUE(b->silent_for(20ms));
  EXPECT_TRUE(c->silent_for(20ms));
  ASSERT_EQ(a->ask("leave"), "left");
  EXPECT_EQ(b->line(), "entered 5");
  b->send("leave");  // B's first request is next, queued before C's (its lines in either order)
  std::vector<std::string> two = {b->line(), b->line()};
  std::sort(two.begin(), two.end());
  EXPECT_EQ(two, (std::vector<std::string>{"entered 0", "left"}));
  ASSERT_EQ(b->ask("leave"), "left");
  EXPECT_EQ(c->line(), "entered 0");
  const ArbiterView v = read_arbiter(n.value);
  EXPECT_EQ(v.max_compute_in_use, 1u);
}

// "Give priority graphs ... the same order on the host backend's compute slots (within a
// process)": with the one compute slot busy, kernels of a priority-0 graph and then of a
// priority-5 graph become ready; the priority-5 kernel runs first when the slot frees.
TEST(KernelPriority, AReadyKernelOfAHigherPriorityGraphRunsFirst) {
  RuntimeConfig rc;
  rc.threads = 2;
  rc.device.backend = BackendKind::host;
  rc.device.streams = 8;
  rc.device.host_compute_slots = 1;
  Runtime rt(rc);
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  std::vector<std::string> order;
  std::atomic<int> enqueued{0};
  std::atomic<bool> blocking{false};
  auto graph = [&](const std::string& name, int priority, long items, bool blocker) {
    GraphOptions go;
    go.priority = priority;
    auto g = std::make_unique<Graph>(rt, name, go);
    auto src = g->source("n", [i = 0L, items]() mutable -> std::optional<long> {
      return i < items ? std::optional<long>(i++) : std::nullopt;
    });
    GpuStageOptions o;
    o.concurrency = 2;
    // The input is a plain number (no copy to the device first): the kernel is its stream's
    // first op, ready for the compute slot once host_kernel returns.
    auto k = g->gpu_stage("k", [&, name, blocker](long i, DeviceContext& ctx) {
      ctx.host_kernel([&, name, blocker] {
        if (blocker) {
          blocking = true;  // on the slot now (ready is not enough: the slot may not have taken it)
          std::unique_lock lk(mu);
          cv.wait(lk, [&] { return open; });
        }
        std::lock_guard lk(mu);
        order.push_back(name);
      });
      ++enqueued;
      return i;
    }, o);
    auto sink = g->sink("s", [](long) {});
    src >> k >> sink;
    return g;
  };
  auto blocker = graph("blocker", 0, 1, true);
  auto low = graph("low", 0, 2, false);
  auto high = graph("high", 5, 1, false);
  auto r0 = blocker->run();
  ASSERT_TRUE(eventually([&] { return blocking.load(); }));  // the slot is taken
  auto r1 = low->run();
  ASSERT_TRUE(eventually([&] { return enqueued.load() == 3; }));  // low's two kernels are ready
  auto r2 = high->run();
  ASSERT_TRUE(eventually([&] { return enqueued.load() == 4; }));  // and high's
  {
    std::lock_guard lk(mu);
    open = true;
  }
  cv.notify_all();
  EXPECT_EQ(r0.wait(), RunStatus::succeeded);
  EXPECT_EQ(r1.wait(), RunStatus::succeeded);
  EXPECT_EQ(r2.wait(), RunStatus::succeeded);
  EXPECT_EQ(order, (std::vector<std::string>{"blocker", "high", "low", "low"}));
}
