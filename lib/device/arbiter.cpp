#include "arbiter.hpp"

#include <fcntl.h>
#include <grp.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstring>
#include <ctime>
#include <dirent.h>
#include <fstream>
#include <optional>
#include <sstream>

#include <fmt/format.h>

#include "backend.hpp"
#include "splitflow/core/detail/text.hpp"
#include "splitflow/core/error.hpp"
#include "splitflow/device/arbiter.hpp"

namespace splitflow::detail {

// ---- the shared layout ---------------------------------------------------------------------------

namespace {
constexpr std::uint64_t kMagic = 0x3142524146505331ull;  // "1SPFARB1", little-endian
constexpr std::uint32_t kVersion = 3;
constexpr int kMaxGraphs = 8;  // published per process
constexpr int kMaxProcs = 64;
constexpr int kMaxTickets = 1024;
constexpr std::size_t kMaxCapacity = 64;
constexpr const char* kPrefix = "splitflow-arb-";

enum SlotState : std::uint32_t { kFree = 0, kLive = 1, kExited = 2, kReclaimed = 3 };
enum TicketState : std::uint32_t { kNone = 0, kWaiting = 1, kGranted = 2 };
enum TicketKind : std::uint32_t { kLease = 0, kCompute = 1 };

}  // namespace

struct SlotGraph {
  char name[40];
  std::int32_t priority;
  std::uint32_t pad;
  std::uint64_t bursts;
  std::int64_t held_ns, busy_ns, wait_ns;
};

struct ProcSlot {
  std::uint32_t state;
  std::int32_t pid;
  std::uint64_t start_time;  // /proc/PID/stat field 22: tells a reused pid apart
  std::uint32_t doorbell;    // futex word: bumped when a ticket of this process is granted
  std::uint32_t cap;
  std::uint32_t collected;   // tokens it holds and knows of (written by itself only)
  std::uint32_t granted;     // derived: its tickets in state granted
  std::uint32_t waiting;     // derived: its tickets in state waiting
  std::int32_t priority;
  std::uint64_t leases;
  std::int64_t held_ns, held_since, busy_ns, wait_ns, ended_ns;
  // Compute slots (the host backend's modelled device, shared): as above, per slot.
  std::uint32_t c_collected, c_granted, c_waiting, pad;
  char label[48];
  std::uint32_t ngraphs, pad2;
  SlotGraph graphs[kMaxGraphs];  // written by the process itself (publish)
  std::uint32_t tokens() const noexcept { return collected + granted; }
};

struct ArbiterTicket {
  std::uint32_t state;
  std::int32_t proc;
  std::int32_t priority;
  std::uint32_t kind;  // kLease or kCompute
  std::uint64_t seq;
  std::int64_t since;
};

struct ArbiterSegment {
  std::uint64_t magic;  // written last by the creator (release), read first (acquire)
  std::uint32_t version, size;
  std::uint32_t max_procs, max_tickets, capacity, pad;
  pthread_mutex_t mu;  // robust, process-shared
  std::uint64_t next_seq;
  std::uint32_t in_use, waiting;  // derived
  std::uint32_t max_in_use, pad2;
  std::uint64_t leases, reclaimed_procs, reclaimed_leases;
  std::int64_t created_ns, held_ns, held_since;
  // Compute slots: kernels at once on the modelled device, across processes (host backend).
  std::uint32_t c_capacity, c_in_use, c_waiting, c_max_in_use;
  // The union of the kernels' execution intervals, as they report them when they end: busy_ns
  // adds the part of each that lies past busy_until.
  std::int64_t busy_ns, busy_until;
  ProcSlot procs[kMaxProcs];
  ArbiterTicket tickets[kMaxTickets];
};

namespace {

std::string shm_name(const std::string& name) {
  std::string s("/");
  s.append(kPrefix).append(name);
  return s;
}
std::string shm_path(const std::string& name) {
  std::string s("/dev/shm/");
  s.append(kPrefix).append(name);
  return s;
}

long futex(std::uint32_t* word, int op, std::uint32_t val, const timespec* timeout) {
  return syscall(SYS_futex, word, op, val, timeout, nullptr, 0);
}
void ring(std::uint32_t* word) {
  __atomic_fetch_add(word, 1, __ATOMIC_SEQ_CST);
  futex(word, FUTEX_WAKE, INT_MAX, nullptr);
}

/// State (field 3) and start time (field 22) of /proc/PID/stat; false when unreadable.
bool proc_stat(int pid, char& state, std::uint64_t& start) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!f || !std::getline(f, line)) return false;
  const auto close = line.rfind(')');
  if (close == std::string::npos) return false;
  std::istringstream rest(line.substr(close + 1));
  std::string field;
  rest >> state;  // field 3
  for (int i = 4; i <= 22; ++i) {
    if (!(rest >> field)) return false;
  }
  start = std::strtoull(field.c_str(), nullptr, 10);
  return true;
}

bool alive(int pid, std::uint64_t start) {
  if (pid <= 0) return false;
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  char state = '?';
  std::uint64_t s = 0;
  if (!proc_stat(pid, state, s)) return ::kill(pid, 0) == 0 || errno == EPERM;
  return state != 'Z' && state != 'X' && s == start;
}

std::string program_name() {
  std::ifstream f("/proc/self/comm");
  std::string s;
  std::getline(f, s);
  return s.empty() ? "splitflow" : s;
}

void held_change(std::int64_t& held_ns, std::int64_t& since, std::uint32_t before,
                 std::uint32_t after, std::int64_t now) {
  if (before == 0 && after > 0) since = now;
  if (before > 0 && after == 0) held_ns += now - since;
}

/// Slot p's tokens went from `before` to p.tokens(): its held-time bookkeeping.
void tokens_changed(ProcSlot& p, std::uint32_t before, std::int64_t now) {
  held_change(p.held_ns, p.held_since, before, p.tokens(), now);
}

/// The segment's derived counts, recomputed from the slots' and tickets' own fields (after a
/// holder of the lock died, or to check them).
void repair(ArbiterSegment& s) {
  for (auto& p : s.procs) p.granted = p.waiting = p.c_granted = p.c_waiting = 0;
  std::uint32_t waiting = 0, c_waiting = 0;
  for (auto& t : s.tickets) {
    if (t.state == kNone) continue;
    if (t.proc < 0 || t.proc >= kMaxProcs || s.procs[t.proc].state != kLive ||
        (t.state != kGranted && t.state != kWaiting) || (t.kind != kLease && t.kind != kCompute)) {
      t.state = kNone;  // a ticket of a slot that is gone, or garbage
      continue;
    }
    ProcSlot& p = s.procs[t.proc];
    if (t.kind == kLease) {
      if (t.state == kGranted) ++p.granted;
      else ++p.waiting, ++waiting;
    } else {
      if (t.state == kGranted) ++p.c_granted;
      else ++p.c_waiting, ++c_waiting;
    }
  }
  std::uint32_t in_use = 0, c_in_use = 0;
  for (auto& p : s.procs)
    if (p.state == kLive) in_use += p.tokens(), c_in_use += p.c_collected + p.c_granted;
  const std::int64_t now = steady_now_ns();
  held_change(s.held_ns, s.held_since, s.in_use, in_use, now);
  s.in_use = in_use;
  s.waiting = waiting;
  s.c_in_use = c_in_use;
  s.c_waiting = c_waiting;
}

/// The segment's lock. A holder that died leaves EOWNERDEAD to the next: the derived counts are
/// recomputed, then the mutex is marked consistent.
class SegLock {
 public:
  explicit SegLock(ArbiterSegment& s) : s_(s) {
    int r = pthread_mutex_lock(&s_.mu);
    if (r == EOWNERDEAD) {
      repair(s_);
      pthread_mutex_consistent(&s_.mu);
    } else if (r != 0) {
      throw Error(fmt::format("splitflow: the arbiter segment's lock cannot be taken ({}); "
                              "remove the segment once no process uses it",
                              std::strerror(r)));
    }
  }
  ~SegLock() { pthread_mutex_unlock(&s_.mu); }
  SegLock(const SegLock&) = delete;
  SegLock& operator=(const SegLock&) = delete;

 private:
  ArbiterSegment& s_;
};

/// A mapped, validated segment.
struct Mapped {
  ArbiterSegment* seg = nullptr;
  bool writable = false;
  bool created = false;
};

[[noreturn]] void refuse(const std::string& name, const std::string& why) {
  throw Error(fmt::format("splitflow: arbiter '{}' ({}): {}", name, shm_path(name), why));
}

void validate(const std::string& name, const ArbiterSegment& s) {
  const std::uint64_t magic = __atomic_load_n(&s.magic, __ATOMIC_ACQUIRE);
  if (magic != kMagic)
    refuse(name, "not a splitflow arbiter segment (bad magic); remove it once no process uses it, "
                 "or choose another ArbiterConfig::name");
  if (s.version != kVersion || s.size != sizeof(ArbiterSegment) || s.max_procs != kMaxProcs ||
      s.max_tickets != kMaxTickets)
    refuse(name, fmt::format("made by another splitflow version (layout version {}, {} bytes; "
                             "this one reads version {}, {} bytes); let its processes finish and "
                             "remove it, or choose another ArbiterConfig::name",
                             s.version, s.size, kVersion, sizeof(ArbiterSegment)));
  if (s.capacity < 1 || s.capacity > kMaxCapacity || s.in_use > s.capacity ||
      s.c_capacity < 1 || s.c_capacity > kMaxCapacity || s.c_in_use > s.c_capacity)
    refuse(name, fmt::format("corrupt (capacity {}, {} in use; compute slots {}, {} in use); "
                             "remove it once no process uses it",
                             s.capacity, s.in_use, s.c_capacity, s.c_in_use));
}

/// Opens (or, when `create`, creates) the segment.
Mapped open_segment(const std::string& name, const ArbiterConfig* create, std::size_t capacity,
                    std::size_t compute_slots) {
  check_arbiter_name(name);
  const std::string sname = shm_name(name);
  const bool shared = create && !create->group.empty();
  gid_t gid = 0;
  if (shared) {
    struct group* gr = ::getgrnam(create->group.c_str());
    if (!gr) refuse(name, fmt::format("ArbiterConfig::group '{}' is not a group on this machine",
                                      create->group));
    gid = gr->gr_gid;
  }
  const mode_t mode = shared ? 0660 : 0600;
  Mapped m;
  int fd = -1;
  if (create) {
    fd = ::shm_open(sname.c_str(), O_RDWR | O_CREAT | O_EXCL, mode);
    if (fd >= 0) {
      m.created = true;
    } else if (errno != EEXIST) {
      refuse(name, fmt::format("cannot create it: {}", std::strerror(errno)));
    }
  }
  if (fd < 0) {
    fd = ::shm_open(sname.c_str(), O_RDWR, 0);
    m.writable = fd >= 0;
    if (fd < 0 && errno == EACCES && !create) fd = ::shm_open(sname.c_str(), O_RDONLY, 0);
    if (fd < 0) {
      if (errno == ENOENT) refuse(name, "there is no such arbiter");
      if (errno == EACCES)
        refuse(name, "permission denied: the segment is private to the user who created it "
                     "(mode 0600) unless its creator set ArbiterConfig::group to a group of "
                     "this user");
      refuse(name, fmt::format("cannot open it: {}", std::strerror(errno)));
    }
  } else {
    m.writable = true;
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  const std::size_t bytes = sizeof(ArbiterSegment);
  if (m.created) {
    if (shared && ::fchown(fd, static_cast<uid_t>(-1), gid) != 0) {
      const int e = errno;
      ::shm_unlink(sname.c_str());
      refuse(name, fmt::format("cannot give it to group '{}': {} (this user must be a member)",
                               create->group, std::strerror(e)));
    }
    if (::fchmod(fd, mode) != 0 || ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      const int e = errno;
      ::shm_unlink(sname.c_str());
      refuse(name, fmt::format("cannot size it: {}", std::strerror(e)));
    }
  } else {
    struct stat st {};
    // The creator sizes it right after creating it; a moment of size 0 is one being made.
    for (int i = 0; i < 2000; ++i) {
      if (::fstat(fd, &st) != 0) refuse(name, std::strerror(errno));
      if (st.st_size != 0) break;
      ::usleep(1000);
    }
    if (create && st.st_uid != ::geteuid()) {
      const bool group_ok = (st.st_mode & 0060) == 0060 && !create->group.empty() && st.st_gid == gid;
      if (!group_ok)
        refuse(name, fmt::format("it belongs to uid {}, not to this user (uid {}): an arbiter is "
                                 "private to its creator's user unless it was created with "
                                 "ArbiterConfig::group (and this process names the same group)",
                                 st.st_uid, ::geteuid()));
    }
    if (static_cast<std::size_t>(st.st_size) != bytes)
      refuse(name, fmt::format("not an arbiter segment of this version ({} bytes, expected {}); "
                               "remove it once no process uses it, or choose another name",
                               st.st_size, bytes));
  }
  void* p = ::mmap(nullptr, bytes, m.writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED,
                   fd, 0);
  if (p == MAP_FAILED) {
    const int e = errno;
    if (m.created) ::shm_unlink(sname.c_str());  // never leave a segment without its magic
    refuse(name, fmt::format("cannot map it: {}", std::strerror(e)));
  }
  m.seg = static_cast<ArbiterSegment*>(p);
  ArbiterSegment& s = *m.seg;
  if (m.created) {
    std::memset(&s, 0, bytes);  // (ftruncate zeroed it; explicit for the reader)
    s.version = kVersion;
    s.size = bytes;
    s.max_procs = kMaxProcs;
    s.max_tickets = kMaxTickets;
    s.capacity = static_cast<std::uint32_t>(capacity);
    s.c_capacity = static_cast<std::uint32_t>(compute_slots);
    s.created_ns = steady_now_ns();
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&s.mu, &a);
    pthread_mutexattr_destroy(&a);
    __atomic_store_n(&s.magic, kMagic, __ATOMIC_RELEASE);
  } else {
    // A segment being made: its magic comes last.
    for (int i = 0; i < 2000 && __atomic_load_n(&s.magic, __ATOMIC_ACQUIRE) == 0; ++i) ::usleep(1000);
    try {
      validate(name, s);
    } catch (...) {
      ::munmap(p, bytes);
      throw;
    }
  }
  return m;
}

}  // namespace

void check_arbiter_name(const std::string& name) {
  const bool ok = !name.empty() && name.size() <= 64 &&
                  std::all_of(name.begin(), name.end(), [](char c) {
                    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' ||
                           c == '.';
                  }) &&
                  name != "." && name != "..";
  if (!ok)
    throw Error(fmt::format("splitflow: ArbiterConfig::name '{}' is not a valid arbiter name: use "
                            "1 to 64 letters, digits, '_', '-' or '.'",
                            name));
}

// ---- Arbiter ---------------------------------------------------------------------------------------

Arbiter::Arbiter(const ArbiterConfig& config, std::size_t local_streams,
                 std::size_t compute_slots,
                 std::function<void(const std::vector<std::uint64_t>&)> on_granted,
                 std::function<std::int64_t()> busy_ns,
                 std::function<std::vector<PublishedGraph>()> graphs)
    : config_(config), path_(shm_path(config.name)), bytes_(sizeof(ArbiterSegment)),
      on_granted_(std::move(on_granted)), busy_ns_(std::move(busy_ns)), graphs_(std::move(graphs)) {
  if (!(config.share > 0 && config.share <= 1))
    throw Error(fmt::format("splitflow: ArbiterConfig::share is {}; it must be in (0, 1]",
                            config.share));
  if (config.liveness.count() <= 0)
    throw Error("splitflow: ArbiterConfig::liveness must be positive");
  const std::size_t want = config.capacity ? config.capacity : local_streams;
  if (want < 1 || want > kMaxCapacity)
    throw Error(fmt::format("splitflow: ArbiterConfig::capacity is {}; it must be 1 to {}", want,
                            kMaxCapacity));
  if (compute_slots < 1 || compute_slots > kMaxCapacity)
    throw Error(fmt::format("splitflow: the arbiter's compute slots (DeviceConfig::"
                            "host_compute_slots) are {}; they must be 1 to {}",
                            compute_slots, kMaxCapacity));
  Mapped m = open_segment(config.name, &config_, want, compute_slots);
  seg_ = m.seg;
  ArbiterSegment& s = *seg_;
  try {
    SegLock lk(s);
    capacity_ = s.capacity;
    const std::int64_t now = steady_now_ns();
    reclaim_dead_locked(now);
    if (config.capacity != 0 && config.capacity != capacity_) {
      // A segment no process uses any more (left by earlier runs) keeps its capacity until it
      // is removed: say how.
      const bool unused = std::none_of(std::begin(s.procs), std::end(s.procs),
                                       [](const ProcSlot& p) { return p.state == kLive; });
      refuse(config.name,
             fmt::format("its capacity is {} bursts; this runtime asks for {} "
                         "(ArbiterConfig::capacity: 0 joins whatever it is){}",
                         capacity_, config.capacity,
                         unused ? fmt::format("; no process uses it now (left by an earlier run): "
                                              "`splitflow-top --remove {}` removes it, and the "
                                              "next runtime makes it with its own capacity",
                                              config.name)
                                : std::string()));
    }
    cap_ = static_cast<std::size_t>(std::floor(config.share * static_cast<double>(capacity_)));
    cap_ = std::clamp<std::size_t>(cap_, 1, std::min(capacity_, local_streams));
    // A free slot, else the one that ended longest ago.
    int best = -1;
    for (int i = 0; i < kMaxProcs; ++i) {
      const ProcSlot& p = s.procs[i];
      if (p.state == kLive) continue;
      const bool better = best < 0 || (s.procs[best].state != kFree &&
                                       (p.state == kFree || p.ended_ns < s.procs[best].ended_ns));
      if (better) best = i;
    }
    if (best < 0)
      refuse(config.name, fmt::format("it has {} live processes already (its most)", kMaxProcs));
    ProcSlot& me = s.procs[best];
    std::memset(&me, 0, sizeof me);
    me.pid = ::getpid();
    char st;
    proc_stat(me.pid, st, me.start_time);
    me.cap = static_cast<std::uint32_t>(cap_);
    const std::string label = config.label.empty() ? program_name() : config.label;
    std::snprintf(me.label, sizeof me.label, "%s", label.c_str());
    me.state = kLive;
    slot_ = best;
    Mine none;
    hand_out_locked(none, now);  // the reclaimed tokens, to others' tickets
  } catch (...) {
    ::munmap(seg_, bytes_);
    throw;
  }
  pump_ = std::thread([this] { pump(); });
}

void Arbiter::stop() {
  if (stop_.exchange(true)) return;
  ring(&seg_->procs[slot_].doorbell);
  if (pump_.joinable()) pump_.join();
}

Arbiter::~Arbiter() {
  stop();
  try {
    publish();  // its last figures stay readable after it has left
    SegLock lk(*seg_);
    ArbiterSegment& s = *seg_;
    ProcSlot& me = s.procs[slot_];
    const std::int64_t now = steady_now_ns();
    for (auto& t : s.tickets)
      if (t.state != kNone && t.proc == slot_) t.state = kNone;
    const std::uint32_t before = me.tokens();
    me.collected = 0;
    me.c_collected = 0;
    repair(s);  // my tickets and tokens are gone
    tokens_changed(me, before, now);
    me.state = kExited;
    me.ended_ns = now;
    Mine none;
    hand_out_locked(none, now);
  } catch (...) {
  }
  ::munmap(seg_, bytes_);
}

int Arbiter::reclaim_dead_locked(std::int64_t now) {
  ArbiterSegment& s = *seg_;
  int reclaimed = 0;
  for (int i = 0; i < kMaxProcs; ++i) {
    ProcSlot& p = s.procs[i];
    if (i == slot_ || p.state != kLive || alive(p.pid, p.start_time)) continue;
    const std::uint32_t before = p.tokens();
    for (auto& t : s.tickets)
      if (t.state != kNone && t.proc == i) t.state = kNone;
    s.reclaimed_leases += before;
    ++s.reclaimed_procs;
    if (before > 0) p.held_ns += now - p.held_since;
    p.collected = p.c_collected = 0;
    p.state = kReclaimed;
    p.ended_ns = now;
    ++reclaimed;
  }
  if (reclaimed) repair(s);  // its tokens, compute slots and tickets leave the counts
  return reclaimed;
}

void Arbiter::hand_out_locked(Mine& mine, std::int64_t now) {
  ArbiterSegment& s = *seg_;
  // Leases: to the best eligible ticket (highest priority, then oldest; its process under cap).
  while (s.waiting > 0 && s.in_use < s.capacity) {
    ArbiterTicket* best = nullptr;
    for (auto& t : s.tickets) {
      if (t.state != kWaiting || t.kind != kLease) continue;
      const ProcSlot& p = s.procs[t.proc];
      if (p.tokens() >= p.cap) continue;
      if (!best || t.priority > best->priority ||
          (t.priority == best->priority && t.seq < best->seq))
        best = &t;
    }
    if (!best) break;
    ProcSlot& p = s.procs[best->proc];
    const std::uint32_t before = p.tokens();
    --p.waiting;
    --s.waiting;
    ++p.leases;
    ++s.leases;
    p.wait_ns += now - best->since;
    if (best->proc == slot_) {
      best->state = kNone;
      ++p.collected;
      mine.leases.push_back(best->seq);
    } else {
      best->state = kGranted;  // one store: the ticket's process now holds the token
      ++p.granted;
      ring(&p.doorbell);
    }
    held_change(s.held_ns, s.held_since, s.in_use, s.in_use + 1, now);
    ++s.in_use;
    s.max_in_use = std::max(s.max_in_use, s.in_use);
    tokens_changed(p, before, now);
  }
  // Compute slots: the same order, no per-process cap.
  while (s.c_waiting > 0 && s.c_in_use < s.c_capacity) {
    ArbiterTicket* best = nullptr;
    for (auto& t : s.tickets) {
      if (t.state != kWaiting || t.kind != kCompute) continue;
      if (!best || t.priority > best->priority ||
          (t.priority == best->priority && t.seq < best->seq))
        best = &t;
    }
    if (!best) break;
    ProcSlot& p = s.procs[best->proc];
    --p.c_waiting;
    --s.c_waiting;
    // The thread waiting in enter() (this process's or another's) waits on the ticket's state
    // word itself: one wake-up from here to the kernel, not the process's pump and then it.
    __atomic_store_n(&best->state, kGranted, __ATOMIC_RELEASE);
    ++p.c_granted;
    futex(&best->state, FUTEX_WAKE, INT_MAX, nullptr);
    ++s.c_in_use;
    s.c_max_in_use = std::max(s.c_max_in_use, s.c_in_use);
  }
}

void Arbiter::deliver(Mine& mine) {
  if (!mine.leases.empty() && on_granted_) on_granted_(mine.leases);
}

ArbiterTicket* Arbiter::queue_locked(std::uint32_t kind, int priority, std::int64_t now) {
  ArbiterSegment& s = *seg_;
  for (auto& t : s.tickets) {
    if (t.state != kNone) continue;
    t.proc = slot_;
    t.priority = priority;
    t.kind = kind;
    t.seq = ++s.next_seq;
    t.since = now;
    t.state = kWaiting;
    return &t;
  }
  return nullptr;
}

Arbiter::Take Arbiter::acquire(int priority, std::uint64_t& ticket) {
  ArbiterSegment& s = *seg_;
  SegLock lk(s);
  ProcSlot& me = s.procs[slot_];
  const std::int64_t now = steady_now_ns();
  me.priority = priority;
  // When a token is free, no eligible ticket waits (hand_out_locked runs after every change).
  if (s.in_use < s.capacity && me.tokens() < me.cap) {
    const std::uint32_t before = me.tokens();
    ++me.collected;
    ++me.leases;
    ++s.leases;
    held_change(s.held_ns, s.held_since, s.in_use, s.in_use + 1, now);
    ++s.in_use;
    s.max_in_use = std::max(s.max_in_use, s.in_use);
    tokens_changed(me, before, now);
    return Take::granted;
  }
  ArbiterTicket* t = queue_locked(kLease, priority, now);
  if (!t) return Take::full;
  ++me.waiting;
  ++s.waiting;
  ticket = t->seq;
  return Take::queued;
}

std::vector<std::uint64_t> Arbiter::release() {
  ArbiterSegment& s = *seg_;
  Mine mine;
  {
    SegLock lk(s);
    ProcSlot& me = s.procs[slot_];
    if (me.collected == 0) return {};  // nothing of ours to give back (never another's)
    const std::int64_t now = steady_now_ns();
    const std::uint32_t before = me.tokens();
    --me.collected;
    held_change(s.held_ns, s.held_since, s.in_use, s.in_use - 1, now);
    --s.in_use;
    tokens_changed(me, before, now);
    hand_out_locked(mine, now);
  }
  std::vector<std::uint64_t> leases = std::move(mine.leases);
  mine.leases.clear();
  deliver(mine);  // (compute slots are not handed out by a lease's release; kept general)
  return leases;
}

void Arbiter::enter(int priority) {
  ArbiterSegment& s = *seg_;
  ArbiterTicket* ticket = nullptr;
  for (;;) {
    {
      std::optional<SegLock> lk;
      try {
        lk.emplace(s);
      } catch (...) {
        return;  // an unusable segment: the kernel runs without its place (leave() sees none)
      }
      ProcSlot& me = s.procs[slot_];
      const std::int64_t now = steady_now_ns();
      if (s.c_in_use < s.c_capacity) {
        ++me.c_collected;
        ++s.c_in_use;
        s.c_max_in_use = std::max(s.c_max_in_use, s.c_in_use);
        return;
      }
      if ((ticket = queue_locked(kCompute, priority, now)) != nullptr) {
        ++me.c_waiting;
        ++s.c_waiting;
        break;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));  // the ticket table is full
  }
  // Until hand_out_locked grants it: the ticket stays this thread's (no one else reuses a
  // waiting ticket), so its state word is the one to wait on. A wake that comes between the
  // load and the wait makes the wait return at once (the word is no longer kWaiting).
  for (;;) {
    if (__atomic_load_n(&ticket->state, __ATOMIC_ACQUIRE) != kWaiting) {
      std::optional<SegLock> lk;
      try {
        lk.emplace(s);
      } catch (...) {
        return;
      }
      if (ticket->state == kGranted) {
        ProcSlot& me = s.procs[slot_];
        ticket->state = kNone;
        --me.c_granted;
        ++me.c_collected;
      }
      return;  // kNone: the ticket was dropped (the segment repaired): run without a place
    }
    const timespec ts{0, 100'000'000};  // a re-check, in case the segment was repaired
    futex(&ticket->state, FUTEX_WAIT, kWaiting, &ts);
  }
}

void Arbiter::leave(std::int64_t t0, std::int64_t t1) noexcept {
  ArbiterSegment& s = *seg_;
  Mine mine;
  try {
    SegLock lk(s);
    ProcSlot& me = s.procs[slot_];
    if (me.c_collected == 0) return;
    const std::int64_t now = steady_now_ns();
    --me.c_collected;
    --s.c_in_use;
    if (t1 > t0) {  // the kernel's execution, into the device's busy time
      const std::int64_t from = std::max(t0, s.busy_until);
      if (t1 > from) s.busy_ns += t1 - from;
      s.busy_until = std::max(s.busy_until, t1);
    }
    hand_out_locked(mine, now);
  } catch (...) {
    return;
  }
  deliver(mine);
}

bool Arbiter::cancel(std::uint64_t ticket) {
  ArbiterSegment& s = *seg_;
  SegLock lk(s);
  ProcSlot& me = s.procs[slot_];
  for (auto& t : s.tickets) {
    if (t.state == kNone || t.seq != ticket || t.proc != slot_ || t.kind != kLease) continue;
    if (t.state == kWaiting) {
      t.state = kNone;
      --me.waiting;
      --s.waiting;
      return true;
    }
    t.state = kNone;  // granted meanwhile: the caller holds it now
    --me.granted;
    ++me.collected;
    return false;
  }
  return true;  // collected already: its delivery finds no waiter and gives it back
}

Arbiter::Mine Arbiter::collect_locked() {
  ArbiterSegment& s = *seg_;
  ProcSlot& me = s.procs[slot_];
  Mine mine;
  for (auto& t : s.tickets) {
    // A compute ticket is collected by the thread waiting for it (enter()).
    if (t.state != kGranted || t.proc != slot_ || t.kind != kLease) continue;
    t.state = kNone;
    --me.granted;
    ++me.collected;
    mine.leases.push_back(t.seq);
  }
  return mine;
}

int Arbiter::check_liveness() {
  ArbiterSegment& s = *seg_;
  Mine mine;
  int reclaimed = 0;
  {
    SegLock lk(s);
    const std::int64_t now = steady_now_ns();
    reclaimed = reclaim_dead_locked(now);
    if (reclaimed) hand_out_locked(mine, now);
  }
  deliver(mine);
  return reclaimed;
}

void Arbiter::hold_lock_for_test() { pthread_mutex_lock(&seg_->mu); }

void Arbiter::publish() {
  const std::int64_t busy = busy_ns_ ? busy_ns_() : 0;
  std::vector<PublishedGraph> graphs = graphs_ ? graphs_() : std::vector<PublishedGraph>{};
  // The graphs that held the device longest, if there are more than a slot keeps.
  std::stable_sort(graphs.begin(), graphs.end(),
                   [](const auto& a, const auto& b) { return a.held_ns > b.held_ns; });
  if (graphs.size() > kMaxGraphs) graphs.resize(kMaxGraphs);
  SegLock lk(*seg_);
  ProcSlot& me = seg_->procs[slot_];
  me.busy_ns = busy;
  me.ngraphs = static_cast<std::uint32_t>(graphs.size());
  for (std::size_t i = 0; i < graphs.size(); ++i) {
    SlotGraph& g = me.graphs[i];
    std::snprintf(g.name, sizeof g.name, "%s", graphs[i].name.c_str());
    g.priority = graphs[i].priority;
    g.bursts = graphs[i].bursts;
    g.held_ns = graphs[i].held_ns;
    g.busy_ns = graphs[i].busy_ns;
    g.wait_ns = graphs[i].wait_ns;
  }
}

void Arbiter::pump() {
  std::uint32_t* bell = &seg_->procs[slot_].doorbell;
  const std::int64_t period = std::chrono::nanoseconds(config_.liveness).count();
  std::int64_t next_check = steady_now_ns() + period;
  while (!stop_.load()) {
    const std::uint32_t seen = __atomic_load_n(bell, __ATOMIC_SEQ_CST);
    try {
      Mine mine;
      {
        SegLock lk(*seg_);
        mine = collect_locked();
      }
      deliver(mine);
      if (on_granted_) on_granted_({});  // lets the pool retry waiters kept while the table was full
      const std::int64_t now = steady_now_ns();
      if (now >= next_check) {
        check_liveness();
        publish();
        next_check = now + period;
      }
    } catch (...) {
      // A lock that cannot be taken is reported by the next request; keep pumping.
    }
    if (stop_.load()) break;
    const std::int64_t wait = std::max<std::int64_t>(next_check - steady_now_ns(), 0);
    timespec ts{static_cast<time_t>(wait / 1000000000), static_cast<long>(wait % 1000000000)};
    futex(bell, FUTEX_WAIT, seen, &ts);
  }
}

}  // namespace splitflow::detail

// ---- reading segments (the meter) -------------------------------------------------------------------

namespace splitflow {

std::vector<std::string> list_arbiters() {
  std::vector<std::string> names;
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n.rfind(detail::kPrefix, 0) == 0) names.push_back(n.substr(std::strlen(detail::kPrefix)));
    }
    ::closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

ArbiterView read_arbiter(const std::string& name) {
  using namespace detail;
  Mapped m = open_segment(name, nullptr, 0, 0);
  struct Unmap {
    void* p;
    ~Unmap() { ::munmap(p, sizeof(ArbiterSegment)); }
  } unmap{m.seg};
  ArbiterSegment& s = *m.seg;
  ArbiterView v;
  auto read = [&] {
    const std::int64_t now = steady_now_ns();
    v.name = name;
    v.path = shm_path(name);
    v.capacity = s.capacity;
    v.in_use = s.in_use;
    v.max_in_use = s.max_in_use;
    v.waiting = s.waiting;
    v.leases = s.leases;
    v.age_ns = now - s.created_ns;
    v.held_ns = s.held_ns + (s.in_use > 0 ? now - s.held_since : 0);
    v.compute_slots = s.c_capacity;
    v.compute_in_use = s.c_in_use;
    v.max_compute_in_use = s.c_max_in_use;
    v.compute_waiting = s.c_waiting;
    v.device_busy_ns = s.busy_ns;
    v.reclaimed_processes = s.reclaimed_procs;
    v.reclaimed_leases = s.reclaimed_leases;
    for (const ProcSlot& p : s.procs) {
      if (p.state == kFree) continue;
      ArbiterProcess a;
      a.pid = p.pid;
      a.label = std::string(p.label, strnlen(p.label, sizeof p.label));
      // A process that died is "dead" until a member reclaims its leases (its pump, or the
      // next process to join): a reader does not write, and would show it live otherwise.
      const bool dead = p.state == kLive && !alive(p.pid, p.start_time);
      a.state = dead ? "dead" : p.state == kLive ? "live" : p.state == kExited ? "exited" : "reclaimed";
      a.cap = p.cap;
      a.held = p.state == kLive ? p.tokens() : 0;
      a.waiting = p.state == kLive ? p.waiting : 0;
      a.priority = p.priority;
      a.leases = p.leases;
      a.held_ns = p.held_ns + (p.state == kLive && p.tokens() > 0 ? now - p.held_since : 0);
      a.busy_ns = p.busy_ns;
      a.wait_ns = p.wait_ns;
      for (std::uint32_t i = 0; i < std::min<std::uint32_t>(p.ngraphs, kMaxGraphs); ++i) {
        const SlotGraph& sg = p.graphs[i];
        ArbiterGraph g;
        g.name = std::string(sg.name, strnlen(sg.name, sizeof sg.name));
        g.priority = sg.priority;
        g.bursts = sg.bursts;
        g.held_ns = sg.held_ns;
        g.busy_ns = sg.busy_ns;
        g.wait_ns = sg.wait_ns;
        a.graphs.push_back(std::move(g));
      }
      v.processes.push_back(std::move(a));
    }
  };
  if (m.writable) {
    SegLock lk(s);
    read();
  } else {
    read();  // a reader without write access cannot take the lock: a possibly torn snapshot
  }
  return v;
}

bool remove_arbiter(const std::string& name, bool force) {
  detail::check_arbiter_name(name);
  if (!force && ::access(detail::shm_path(name).c_str(), F_OK) == 0) {
    // Processes still using it would go on in a segment no newcomer sees: a newcomer would
    // make a new one, and the two sets of processes would share the device without a bound.
    std::string live;
    try {
      for (const ArbiterProcess& p : read_arbiter(name).processes)
        if (p.state == "live") live += fmt::format("{}{} ({})", live.empty() ? "" : ", ", p.pid, p.label);
    } catch (const Error& e) {
      throw Error(fmt::format("splitflow: arbiter '{}' was not removed: it cannot be read ({}); "
                              "remove it anyway with force (splitflow-top --remove {} --force)",
                              name, e.what(), name));
    }
    if (!live.empty())
      throw Error(fmt::format("splitflow: arbiter '{}' was not removed: processes use it: {}; "
                              "removing it would let newcomers share the device past its "
                              "capacity with them (stop them first, or force it: "
                              "splitflow-top --remove {} --force)",
                              name, live, name));
  }
  return ::shm_unlink(detail::shm_name(name).c_str()) == 0;
}

namespace {
std::string json_string(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\', o += c;
    else if (static_cast<unsigned char>(c) < 0x20) o += fmt::format("\\u{:04x}", c);
    else o += c;
  }
  return o + "\"";
}
}  // namespace

std::string arbiters_json(const std::vector<ArbiterView>& views) {
  std::string o = "{\"arbiters\": [";
  for (std::size_t i = 0; i < views.size(); ++i) {
    const ArbiterView& v = views[i];
    o += fmt::format(
        "{}{{\"name\": {}, \"path\": {}, \"capacity\": {}, \"in_use\": {}, \"max_in_use\": {}, \"waiting\": {}, "
        "\"leases\": {}, \"age_ns\": {}, \"held_ns\": {}, \"busy_ns\": {}, "
        "\"compute_slots\": {}, \"max_compute_in_use\": {}, \"device_busy_ns\": {}, "
        "\"reclaimed_processes\": {}, \"reclaimed_leases\": {}, \"processes\": [",
        i ? ", " : "", json_string(v.name), json_string(v.path), v.capacity, v.in_use, v.max_in_use, v.waiting,
        v.leases, v.age_ns, v.held_ns, v.busy_ns(), v.compute_slots, v.max_compute_in_use,
        v.device_busy_ns, v.reclaimed_processes, v.reclaimed_leases);
    for (std::size_t k = 0; k < v.processes.size(); ++k) {
      const ArbiterProcess& p = v.processes[k];
      o += fmt::format(
          "{}{{\"pid\": {}, \"label\": {}, \"state\": {}, \"cap\": {}, \"held\": {}, "
          "\"waiting\": {}, \"priority\": {}, \"leases\": {}, \"held_ns\": {}, \"busy_ns\": {}, "
          "\"waste_ns\": {}, \"wait_ns\": {}, \"graphs\": [",
          k ? ", " : "", p.pid, json_string(p.label), json_string(p.state), p.cap, p.held,
          p.waiting, p.priority, p.leases, p.held_ns, p.busy_ns, p.waste_ns(), p.wait_ns);
      for (std::size_t j = 0; j < p.graphs.size(); ++j) {
        const ArbiterGraph& g = p.graphs[j];
        o += fmt::format("{}{{\"name\": {}, \"priority\": {}, \"bursts\": {}, \"held_ns\": {}, "
                         "\"busy_ns\": {}, \"waste_ns\": {}, \"wait_ns\": {}}}",
                         j ? ", " : "", json_string(g.name), g.priority, g.bursts, g.held_ns,
                         g.busy_ns, g.waste_ns(), g.wait_ns);
      }
      o += "]}";
    }
    o += "]}";
  }
  return o + "]}\n";
}

namespace {
// A Prometheus metric family of one value per process (or per graph of a process).
template <class Of>
struct Family {
  const char* metric;
  const char* type;
  const char* help;
  double (*value)(const Of&);
};
}  // namespace

std::string arbiters_prometheus(const std::vector<ArbiterView>& views) {
  std::string o;
  auto help = [&](const char* metric, const char* type, const char* text) {
    o += fmt::format("# HELP {} {}\n# TYPE {} {}\n", metric, text, metric, type);
  };
  auto label = [](const std::string& s) { return detail::prometheus_label(s); };
  help("splitflow_arbiter_capacity", "gauge", "Bursts the device runs at once across processes.");
  for (const auto& v : views)
    o += fmt::format("splitflow_arbiter_capacity{{arbiter=\"{}\"}} {}\n", label(v.name), v.capacity);
  help("splitflow_arbiter_in_use", "gauge", "Leases out now.");
  for (const auto& v : views)
    o += fmt::format("splitflow_arbiter_in_use{{arbiter=\"{}\"}} {}\n", label(v.name), v.in_use);
  help("splitflow_arbiter_waiting", "gauge", "Requests queued now.");
  for (const auto& v : views)
    o += fmt::format("splitflow_arbiter_waiting{{arbiter=\"{}\"}} {}\n", label(v.name), v.waiting);
  help("splitflow_arbiter_held_seconds_total", "counter", "Time with at least one lease out.");
  for (const auto& v : views)
    o += fmt::format("splitflow_arbiter_held_seconds_total{{arbiter=\"{}\"}} {:.6f}\n",
                     label(v.name), static_cast<double>(v.held_ns) * 1e-9);
  help("splitflow_arbiter_device_busy_seconds_total", "counter",
       "Time at least one kernel ran on the shared device (host backend's compute slots).");
  for (const auto& v : views)
    o += fmt::format("splitflow_arbiter_device_busy_seconds_total{{arbiter=\"{}\"}} {:.6f}\n",
                     label(v.name), static_cast<double>(v.device_busy_ns) * 1e-9);
  help("splitflow_arbiter_reclaimed_leases_total", "counter", "Leases taken back from dead processes.");
  for (const auto& v : views)
    o += fmt::format("splitflow_arbiter_reclaimed_leases_total{{arbiter=\"{}\"}} {}\n",
                     label(v.name), v.reclaimed_leases);
  const Family<ArbiterProcess> per[] = {
      {"splitflow_process_held_seconds_total", "counter", "Time with at least one lease of the process out.",
       [](const ArbiterProcess& p) { return static_cast<double>(p.held_ns) * 1e-9; }},
      {"splitflow_process_busy_seconds_total", "counter", "The process's device busy time.",
       [](const ArbiterProcess& p) { return static_cast<double>(p.busy_ns) * 1e-9; }},
      {"splitflow_process_waste_seconds_total", "counter", "Held minus busy.",
       [](const ArbiterProcess& p) { return static_cast<double>(p.waste_ns()) * 1e-9; }},
      {"splitflow_process_wait_seconds_total", "counter", "Summed queueing time of its requests.",
       [](const ArbiterProcess& p) { return static_cast<double>(p.wait_ns) * 1e-9; }},
      {"splitflow_process_leases_total", "counter", "Leases granted to the process.",
       [](const ArbiterProcess& p) { return static_cast<double>(p.leases); }},
      {"splitflow_process_held", "gauge", "Leases the process holds now.",
       [](const ArbiterProcess& p) { return static_cast<double>(p.held); }},
      {"splitflow_process_waiting", "gauge", "Requests of the process queued now.",
       [](const ArbiterProcess& p) { return static_cast<double>(p.waiting); }},
      {"splitflow_process_priority", "gauge", "Priority of its latest request.",
       [](const ArbiterProcess& p) { return static_cast<double>(p.priority); }},
  };
  for (const auto& m : per) {
    help(m.metric, m.type, m.help);
    for (const auto& v : views)
      for (const auto& p : v.processes)
        o += fmt::format("{}{{arbiter=\"{}\",pid=\"{}\",label=\"{}\",state=\"{}\"}} {}\n", m.metric,
                         label(v.name), p.pid, label(p.label), p.state, m.value(p));
  }
  const Family<ArbiterGraph> per_graph[] = {
      {"splitflow_graph_held_seconds_total", "counter", "Time with at least one lease of the graph out (its current or last run).",
       [](const ArbiterGraph& g) { return static_cast<double>(g.held_ns) * 1e-9; }},
      {"splitflow_graph_busy_seconds_total", "counter", "The graph's kernels and copies executing (its current or last run).",
       [](const ArbiterGraph& g) { return static_cast<double>(g.busy_ns) * 1e-9; }},
      {"splitflow_graph_bursts_total", "counter", "The graph's bursts (one lease each; its current or last run).",
       [](const ArbiterGraph& g) { return static_cast<double>(g.bursts); }},
  };
  for (const auto& m : per_graph) {
    help(m.metric, m.type, m.help);
    for (const auto& v : views)
      for (const auto& p : v.processes)
        for (const auto& g : p.graphs)
          o += fmt::format("{}{{arbiter=\"{}\",pid=\"{}\",label=\"{}\",graph=\"{}\",priority=\"{}\"}} {}\n",
                           m.metric, label(v.name), p.pid, label(p.label), label(g.name),
                           g.priority, m.value(g));
  }
  return o;
}

}  // namespace splitflow
