#include "tracer.hpp"

#include <fmt/format.h>

namespace splitflow::detail {

namespace {
std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) {
      out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
      continue;
    }
    out += c;
  }
  return out + "\"";
}
double us(std::int64_t ns) { return static_cast<double>(ns) / 1000.0; }
const char* kDeviceKind[] = {"kernel", "copy H2D", "copy D2H"};
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

std::string Tracer::json() const {
  std::lock_guard lk(mu_);
  std::string out;
  out.reserve(events_.size() * 120 + 4096);
  out += "{\"displayTimeUnit\":\"ms\",\"metadata\":{";
  out += fmt::format("\"graph\":{},\"sample_every\":{},\"dropped_events\":{},\"events\":{}",
                     quoted(graph_), stride_, dropped_, events_.size());
  out += "},\"traceEvents\":[\n";
  // Track names: pid 1 the graph's stages, pid 2 stream leases, pid 3 device work.
  out += fmt::format(R"({{"ph":"M","pid":1,"name":"process_name","args":{{"name":{}}}}})",
                     quoted("graph " + graph_));
  out += ",\n{\"ph\":\"M\",\"pid\":2,\"name\":\"process_name\",\"args\":{\"name\":\"stream leases\"}}";
  out += ",\n{\"ph\":\"M\",\"pid\":3,\"name\":\"process_name\",\"args\":{\"name\":\"device work\"}}";
  for (std::size_t i = 0; i < stages_.size(); ++i)
    out += fmt::format(",\n{{\"ph\":\"M\",\"pid\":1,\"tid\":{},\"name\":\"thread_name\",\"args\":{{\"name\":{}}}}}",
                       i, quoted(stages_[i]));
  for (const Event& e : events_) {
    const double ts = us(e.ts_ns - origin_ns_);
    switch (e.track) {
      case Track::stage:
        out += fmt::format(
            ",\n{{\"ph\":\"X\",\"pid\":1,\"tid\":{},\"name\":{},\"ts\":{:.3f},\"dur\":{:.3f},"
            "\"args\":{{\"first_item\":{},\"items\":{}}}}}",
            e.tid, quoted(e.tid >= 0 ? stages_[e.tid] : "?"), ts, us(e.dur_ns), e.a, e.b);
        break;
      case Track::lease:
        out += fmt::format(
            ",\n{{\"ph\":\"X\",\"pid\":2,\"tid\":{},\"name\":{},\"ts\":{:.3f},\"dur\":{:.3f},"
            "\"args\":{{\"item\":{}}}}}",
            e.tid, quoted(e.b < stages_.size() ? "lease: " + stages_[e.b] : "lease"), ts,
            us(e.dur_ns), e.a);
        break;
      case Track::device:
        out += fmt::format(
            ",\n{{\"ph\":\"X\",\"pid\":3,\"tid\":{},\"name\":\"{}\",\"ts\":{:.3f},\"dur\":{:.3f},"
            "\"args\":{{\"item\":{},\"bytes\":{}}}}}",
            e.tid, kDeviceKind[e.kind], ts, us(e.dur_ns), e.a, e.b);
        break;
      case Track::queue_counter:
        out += fmt::format(
            ",\n{{\"ph\":\"C\",\"pid\":1,\"name\":{},\"ts\":{:.3f},\"args\":{{\"items\":{}}}}}",
            quoted("queue " + (e.tid >= 0 ? stages_[e.tid] : std::string("?"))), ts, e.a);
        break;
      case Track::ring_counter:
        out += fmt::format(
            ",\n{{\"ph\":\"C\",\"pid\":1,\"name\":{},\"ts\":{:.3f},\"args\":{{\"bytes\":{}}}}}",
            quoted("ring " + (e.tid >= 0 ? stages_[e.tid] : std::string("?"))), ts, e.a);
        break;
    }
  }
  out += "\n]}\n";
  return out;
}

}  // namespace splitflow::detail
