#include "tracer.hpp"

#include <algorithm>
#include <initializer_list>

#include <nlohmann/json.hpp>

namespace splitflow::detail {

namespace {
// JSON goes through nlohmann-json (private to lib/); ordered_json keeps the keys in the order
// they are set ("ph" first, as chrome://tracing's own files have it).
using Json = nlohmann::ordered_json;
// Compact, UTF-8 kept as is; bytes that are not valid UTF-8 become U+FFFD, not an exception.
std::string dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }
double us(std::int64_t ns) { return static_cast<double>(ns) / 1000.0; }
const char* kDeviceKind[] = {"kernel", "copy H2D", "copy D2H"};
// A metadata event naming a process (pid) or, with tid >= 0, a thread (track).
Json name_event(int pid, int tid, const std::string& name) {
  Json j;
  j["ph"] = "M";
  j["pid"] = pid;
  if (tid >= 0) j["tid"] = tid;
  j["name"] = tid >= 0 ? "thread_name" : "process_name";
  j["args"]["name"] = name;
  return j;
}
// An event of each kind with every key in place, in order; json() sets their values per event
// (no allocation for most of them) and dumps it.
Json event_template(const char* ph, int pid, bool has_tid, bool has_dur,
                    std::initializer_list<const char*> args) {
  Json j;
  j["ph"] = ph;
  j["pid"] = pid;
  if (has_tid) j["tid"] = 0;
  j["name"] = "";
  j["ts"] = 0.0;
  if (has_dur) j["dur"] = 0.0;
  Json& a = j["args"];
  for (const char* key : args) a[key] = std::uint64_t{0};
  return j;
}
}  // namespace

Tracer::Tracer(std::string graph, std::vector<std::string> stages, std::size_t max_events,
               std::int64_t origin_ns)
    : graph_(std::move(graph)),
      stages_(std::move(stages)),
      max_events_(std::max<std::size_t>(max_events, 16)),
      origin_ns_(origin_ns) {
  for (std::size_t i = 0; i < stages_.size(); ++i) index_[stages_[i]] = static_cast<int>(i);
  events_.reserve(std::min<std::size_t>(max_events_, 4096));
}

int Tracer::stage_index(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? -1 : it->second;
}

// Bounded memory: once full, every other event is dropped and from then on one event in
// `stride_` of each kind is kept (the trace states the rate). Counting per kind keeps the
// sampling from aliasing with the begin/end alternation of a stage's events.
void Tracer::add_locked(const Event& e) {
  if (seen_[static_cast<int>(e.track)]++ % stride_ != 0) {
    ++dropped_;
    return;
  }
  if (events_.size() >= max_events_) {
    // Keep every other event of each kind (alternating per kind, not per position).
    bool take[5] = {true, true, true, true, true};
    std::size_t keep = 0;
    for (std::size_t i = 0; i < events_.size(); ++i) {
      bool& t = take[static_cast<int>(events_[i].track)];
      if (t) events_[keep++] = events_[i];
      t = !t;
    }
    dropped_ += events_.size() - keep;
    events_.resize(keep);
    stride_ *= 2;
  }
  events_.push_back(e);
}

void Tracer::on_stage_begin(const InvocationEvent& e) {
  const int tid = stage_index(*e.stage);
  std::lock_guard lk(mu_);
  add_locked({Track::queue_counter, tid, e.begin_ns, 0, e.queued, 0, 0});
  if (e.ring_bytes >= 0)
    add_locked({Track::ring_counter, tid, e.begin_ns, 0, static_cast<std::uint64_t>(e.ring_bytes), 0, 0});
}

void Tracer::on_stage_end(const InvocationEvent& e) {
  const int tid = stage_index(*e.stage);
  std::lock_guard lk(mu_);
  add_locked({Track::stage, tid, e.begin_ns, e.end_ns - e.begin_ns, e.first_item, e.items, 0});
}

void Tracer::on_lease_acquire(const LeaseEvent& e) {
  std::lock_guard lk(mu_);
  lease_open_[e.stream] = e.t_ns;
}

void Tracer::on_lease_release(const LeaseEvent& e) {
  std::lock_guard lk(mu_);
  auto it = lease_open_.find(e.stream);
  if (it == lease_open_.end()) return;
  add_locked({Track::lease, e.stream, it->second, e.t_ns - it->second, e.item,
              static_cast<std::uint64_t>(stage_index(*e.stage)), 0});
  lease_open_.erase(it);
}

void Tracer::on_device_op(const DeviceOpEvent& e) {
  std::lock_guard lk(mu_);
  add_locked({Track::device, e.stream, e.begin_ns, e.end_ns - e.begin_ns, e.item, e.bytes,
              static_cast<std::uint8_t>(e.kind)});
}

void Tracer::on_tune(const TuningEvent& e) {
  const int tid = e.stage->empty() ? 0 : stage_index(*e.stage);
  std::lock_guard lk(mu_);
  if (tunes_.size() >= kMaxTunes) {
    ++tunes_dropped_;
    return;
  }
  try {
    tunes_.push_back({tid, e.t_ns, *e.knob, *e.reason, *e.text, e.from, e.to});
  } catch (...) {  // out of memory: the decision is missing from the trace only
    ++tunes_dropped_;
  }
}

std::string Tracer::json() const {
  // Written from a copy taken under the lock: the observers (on the arena's threads) wait for
  // the copy only. graph_ and stages_ do not change after construction.
  std::vector<Event> events;
  std::vector<Tune> tunes;
  std::uint64_t stride, dropped, tunes_dropped;
  {
    std::lock_guard lk(mu_);
    events = events_;
    tunes = tunes_;
    stride = stride_;
    dropped = dropped_;
    tunes_dropped = tunes_dropped_;
  }
  // Each event is its own JSON value, dumped and appended with one per line: the buffer holds
  // up to trace_max_events (2^18 by default) events, and a JSON tree of all of them would cost
  // several times the buffer. Only the fixed frame around them is written here.
  std::string out;
  out.reserve(events.size() * 120 + 4096);
  Json metadata;
  metadata["graph"] = graph_;
  metadata["sample_every"] = stride;
  metadata["dropped_events"] = dropped;
  metadata["events"] = std::uint64_t{events.size()};
  metadata["tune_events"] = std::uint64_t{tunes.size()};
  metadata["dropped_tune_events"] = tunes_dropped;
  out += R"({"displayTimeUnit":"ms","metadata":)";
  out += dump(metadata);
  out += R"(,"traceEvents":[)";
  out += '\n';
  // Track names: pid 1 the graph's stages, pid 2 stream leases, pid 3 device work.
  out += dump(name_event(1, -1, "graph " + graph_));
  auto add = [&out](const Json& event) {
    out += ",\n";
    out += dump(event);
  };
  add(name_event(2, -1, "stream leases"));
  add(name_event(3, -1, "device work"));
  for (std::size_t i = 0; i < stages_.size(); ++i)
    add(name_event(1, static_cast<int>(i), stages_[i]));

  // Stage invocations (pid 1), leases (pid 2), device work (pid 3), queue and ring counters.
  Json stage_x = event_template("X", 1, true, true, {"first_item", "items"});
  Json lease_x = event_template("X", 2, true, true, {"item"});
  Json device_x = event_template("X", 3, true, true, {"item", "bytes"});
  Json queue_c = event_template("C", 1, false, false, {"items"});
  Json ring_c = event_template("C", 1, false, false, {"bytes"});
  auto set_name = [](Json& event, const std::string& a, const std::string& b = {}) {
    std::string& name = event["name"].get_ref<std::string&>();
    name.assign(a).append(b);
  };
  // Stage and counter events' tid is the stage's index (-1: not a stage of this graph); lease
  // and device events' is the stream's.
  const std::string unknown = "?";
  auto stage = [&](int tid) -> const std::string& {
    return tid >= 0 ? stages_[static_cast<std::size_t>(tid)] : unknown;
  };
  for (const Event& e : events) {
    const double ts = us(e.ts_ns - origin_ns_);
    switch (e.track) {
      case Track::stage:
        stage_x["tid"] = e.tid;
        set_name(stage_x, stage(e.tid));
        stage_x["ts"] = ts;
        stage_x["dur"] = us(e.dur_ns);
        stage_x["args"]["first_item"] = e.a;
        stage_x["args"]["items"] = e.b;
        add(stage_x);
        break;
      case Track::lease:
        lease_x["tid"] = e.tid;
        if (e.b < stages_.size())
          set_name(lease_x, "lease: ", stages_[e.b]);
        else
          set_name(lease_x, "lease");
        lease_x["ts"] = ts;
        lease_x["dur"] = us(e.dur_ns);
        lease_x["args"]["item"] = e.a;
        add(lease_x);
        break;
      case Track::device:
        device_x["tid"] = e.tid;
        set_name(device_x, kDeviceKind[e.kind]);
        device_x["ts"] = ts;
        device_x["dur"] = us(e.dur_ns);
        device_x["args"]["item"] = e.a;
        device_x["args"]["bytes"] = e.b;
        add(device_x);
        break;
      case Track::queue_counter:
        set_name(queue_c, "queue ", stage(e.tid));
        queue_c["ts"] = ts;
        queue_c["args"]["items"] = e.a;
        add(queue_c);
        break;
      case Track::ring_counter:
        set_name(ring_c, "ring ", stage(e.tid));
        ring_c["ts"] = ts;
        ring_c["args"]["bytes"] = e.a;
        add(ring_c);
        break;
    }
  }
  // The tuner's decisions: instant events on their stage's track.
  Json tune_i = event_template("i", 1, true, false, {});
  tune_i["s"] = "t";
  tune_i["name"] = "tune";
  for (const Tune& t : tunes) {
    tune_i["tid"] = t.tid;
    tune_i["ts"] = us(t.ts_ns - origin_ns_);
    Json& a = tune_i["args"];
    a["decision"] = t.text;
    a["knob"] = t.knob;
    a["from"] = t.from;
    a["to"] = t.to;
    a["reason"] = t.reason;
    add(tune_i);
  }
  out += "\n]}\n";
  return out;
}

}  // namespace splitflow::detail
