// JSON summary and Prometheus text. Keys and metric names are documented in docs/telemetry.md.
#include <cmath>
#include <cstdint>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "splitflow/core/detail/text.hpp"
#include "splitflow/telemetry/export.hpp"
#include "splitflow/telemetry/stats.hpp"
#include "splitflow/telemetry/telemetry.hpp"

namespace splitflow {

namespace {

// JSON goes through nlohmann-json (a private dependency: no public header includes it);
// ordered_json keeps the keys in the order they are set, which is the documented order.
using Json = nlohmann::ordered_json;

// Compact, UTF-8 kept as is; bytes that are not valid UTF-8 (a name or an error message can
// hold any bytes) become U+FFFD rather than an exception.
std::string dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

// A figure with `decimals` places, as the summary has always written it (NaN and infinities
// come out as null).
double fixed(double x, int decimals) {
  if (!(std::abs(x) < 1e15)) return x;
  const double scale = std::pow(10.0, decimals);
  return std::round(x * scale) / scale;
}

Json latency_json(const LatencyHistogram& h) {
  Json j;
  j["count"] = std::uint64_t{h.count()};
  j["mean"] = fixed(h.mean(), 1);
  j["p50"] = std::uint64_t{h.percentile(50)};
  j["p95"] = std::uint64_t{h.percentile(95)};
  j["p99"] = std::uint64_t{h.percentile(99)};
  j["max"] = std::uint64_t{h.max()};
  return j;
}

Json concurrency(std::size_t c) {
  return c == Concurrency::unlimited ? Json(nullptr) : Json(std::uint64_t{c});
}

Json stage_json(const StageStats& s) {
  Json j;
  j["name"] = s.name;
  j["kind"] = to_string(s.kind);
  j["concurrency_limit"] = concurrency(s.concurrency_limit);
  j["concurrency_automatic"] = s.concurrency_automatic;
  j["capacity"] = std::uint64_t{s.capacity};
  j["items_in"] = std::uint64_t{s.items_in};
  j["items_out"] = std::uint64_t{s.items_out};
  j["invocations"] = std::uint64_t{s.invocations};
  j["busy_ns"] = std::int64_t{s.busy_ns};
  j["starved_ns"] = std::int64_t{s.starved_ns};
  j["blocked_ns"] = std::int64_t{s.blocked_ns};
  j["work_ns"] = std::int64_t{s.work_ns};
  if (s.call_ns >= 0) j["call_ns"] = std::int64_t{s.call_ns};  // async stages only
  j["serial_ns"] = std::int64_t{s.serial_ns};  // (0 but for bodies that take the GIL)
  j["serial_wait_ns"] = std::int64_t{s.serial_wait_ns};
  if (s.wait_ns >= 0) j["wait_ns"] = std::int64_t{s.wait_ns};  // blocking stages only
  j["mean_concurrency"] = fixed(s.mean_concurrency(), 3);
  j["max_concurrency"] = std::uint64_t{s.max_concurrency};
  j["max_queue"] = std::uint64_t{s.max_queue};
  j["mean_queue"] = fixed(s.mean_queue, 3);
  if (s.item_bytes_samples > 0) {  // (sampled with telemetry on)
    j["item_bytes"] = std::uint64_t{s.item_bytes};
    j["max_item_bytes"] = std::uint64_t{s.max_item_bytes};
  }
  j["latency_ns"] = latency_json(s.latency);
  j["consumers"] = s.consumers;
  if (!s.fed_by.empty()) j["fed_by"] = s.fed_by;  // sources fed by another system only
  if (s.ring_capacity > 0) {
    Json& r = j["ring"];
    r["capacity"] = std::uint64_t{s.ring_capacity};
    r["automatic"] = s.ring_automatic;
    r["in_use"] = std::uint64_t{s.ring_in_use};
    r["max_in_use"] = std::uint64_t{s.ring_max_in_use};
    r["mean_in_use"] = fixed(s.ring_mean_in_use, 1);
    r["budgets"] = std::uint64_t{s.ring_budgets};
    r["wraps"] = std::uint64_t{s.ring_wraps};
    r["refusals"] = std::uint64_t{s.ring_refusals};
    r["wait_ns"] = std::int64_t{s.ring_wait_ns};
  }
  if (s.items_skipped + s.items_substituted > 0) {
    j["skipped"] = std::uint64_t{s.items_skipped};
    j["substituted"] = std::uint64_t{s.items_substituted};
    Json errors = Json::array();
    for (const ItemError& e : s.errors) {
      Json err;
      err["item"] = std::uint64_t{e.item};
      err["message"] = e.message;
      errors.push_back(std::move(err));
    }
    j["errors"] = std::move(errors);
  }
  return j;
}

Json gpu_json(const GpuStats& g) {
  Json j;
  j["held_ns"] = std::int64_t{g.held_ns};
  j["busy_ns"] = std::int64_t{g.busy_ns};
  j["held_over_busy"] = fixed(g.held_over_busy(), 4);
  j["bursts"] = std::uint64_t{g.bursts};
  j["lease_wait_ns"] = std::int64_t{g.lease_wait_ns};
  j["max_lease_wait_ns"] = std::int64_t{g.max_lease_wait_ns};
  j["h2d_bytes"] = std::uint64_t{g.h2d_bytes};
  j["h2d_ns"] = std::int64_t{g.h2d_ns};
  j["d2h_bytes"] = std::uint64_t{g.d2h_bytes};
  j["d2h_ns"] = std::int64_t{g.d2h_ns};
  j["staging_copies"] = std::uint64_t{g.staging_copies};
  j["device_wall_ns"] = std::int64_t{g.device_wall_ns};
  j["device_busy_ns"] = std::int64_t{g.device_busy_ns};
  j["device_mean_leases"] = fixed(g.device_mean_leases, 3);
  j["device_max_leases"] = std::uint64_t{g.device_max_leases};
  j["device_streams"] = std::uint64_t{g.device_streams};
  return j;
}

Json device_json(const DeviceStats& d) {
  Json j;
  j["name"] = d.name;
  j["backend"] = to_string(d.backend);
  j["wall_ns"] = std::int64_t{d.wall_ns};
  j["busy_ns"] = std::int64_t{d.busy_ns};
  j["busy_fraction"] = fixed(d.busy_fraction(), 4);
  j["held_ns"] = std::int64_t{d.held_ns};
  j["held_over_busy"] = fixed(d.held_over_busy(), 4);
  j["streams"] = std::uint64_t{d.streams};
  j["leases_in_use"] = std::uint64_t{d.leases_in_use};
  j["max_leases_in_use"] = std::uint64_t{d.max_leases_in_use};
  j["mean_leases"] = fixed(d.mean_leases(), 3);
  j["lease_time_ns"] = d.lease_time_ns;
  j["leases"] = std::uint64_t{d.leases};
  j["lease_waiters"] = std::uint64_t{d.lease_waiters};
  j["device_bytes_in_use"] = std::uint64_t{d.device_bytes_in_use};
  j["device_bytes_cap"] = std::uint64_t{d.device_bytes_cap};
  j["pinned_bytes_in_use"] = std::uint64_t{d.pinned_bytes_in_use};
  j["pinned_bytes_cap"] = std::uint64_t{d.pinned_bytes_cap};
  j["injected_faults"] = Json{{"alloc_failures", d.injected.alloc_failures},
                              {"burst_failures", d.injected.burst_failures},
                              {"slow_kernels", d.injected.slow_kernels},
                              {"stalls", d.injected.stalls}};
  return j;
}

// Prometheus label values: UTF-8 (a name may hold any bytes: a graph named with bytes that are
// not UTF-8 made the whole text unreadable, a new user's trial), backslash, quote and newline
// escaped.
std::string label(const std::string& s) { return detail::prometheus_label(s); }

}  // namespace

std::string to_json(const RunStats& st, const std::optional<DeviceStats>& device) {
  Json j;
  j["schema_version"] = kJsonSchemaVersion;
  j["graph"] = st.graph;
  j["status"] = to_string(st.status);
  j["wall_ns"] = std::int64_t{st.wall_ns};
  j["items_delivered"] = std::uint64_t{st.items_delivered()};
  j["throughput"] = fixed(st.throughput(), 3);
  j["max_in_flight"] = std::uint64_t{st.max_in_flight};
  j["threads"] = std::uint64_t{st.threads};
  Json stages = Json::array();
  for (const StageStats& s : st.stages) stages.push_back(stage_json(s));
  j["stages"] = std::move(stages);
  j["gpu"] = gpu_json(st.gpu);
  j["device"] = device ? device_json(*device) : Json(nullptr);
  const Diagnosis d = diagnose(st, device);
  Json& diagnosis = j["diagnosis"];
  diagnosis["bottleneck"] = d.bottleneck;
  diagnosis["findings"] = d.findings;
  diagnosis["suggestions"] = d.suggestions;
  j["autotune"] = st.autotune;  // the tuner's decisions (empty without automatic stages)
  return dump(j) + "\n";
}

namespace {

// A metric's HELP and TYPE lines.
void head(std::string& out, const char* name, const char* type, const char* help) {
  out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

// A histogram as a Prometheus summary: p50/p95/p99, _count and _sum, in seconds. `labels`:
// the series' labels, without braces.
void summary(std::string& out, const char* name, const std::string& labels,
             const LatencyHistogram& h) {
  for (double q : {0.5, 0.95, 0.99})
    out += fmt::format("{}{{{},quantile=\"{}\"}} {:.9f}\n", name, labels, q,
                       h.percentile(q * 100) / 1e9);
  out += fmt::format("{}_count{{{}}} {}\n", name, labels, h.count());
  out += fmt::format("{}_sum{{{}}} {:.9f}\n", name, labels,
                     h.mean() * static_cast<double>(h.count()) / 1e9);
}

}  // namespace

std::string prometheus_text(const RunStats& st, const std::optional<DeviceStats>& device) {
  std::string out;
  const std::string g = label(st.graph);
  head(out, "splitflow_stage_items_total", "counter", "Items into (in) or out of (out) a stage.");
  for (const auto& s : st.stages) {
    out += fmt::format(
        "splitflow_stage_items_total{{graph=\"{}\",stage=\"{}\",direction=\"in\"}} {}\n", g,
        label(s.name), s.items_in);
    out += fmt::format(
        "splitflow_stage_items_total{{graph=\"{}\",stage=\"{}\",direction=\"out\"}} {}\n", g,
        label(s.name), s.items_out);
  }
  head(out, "splitflow_stage_seconds_total", "counter",
       "Wall time a stage spent busy, starved or blocked.");
  for (const auto& s : st.stages)
    for (auto [state, ns] : {std::pair{"busy", s.busy_ns}, std::pair{"starved", s.starved_ns},
                             std::pair{"blocked", s.blocked_ns}})
      out += fmt::format(
          "splitflow_stage_seconds_total{{graph=\"{}\",stage=\"{}\",state=\"{}\"}} {:.9f}\n", g,
          label(s.name), state, ns / 1e9);
  head(out, "splitflow_stage_latency_seconds", "summary", "Time an item spent in a stage.");
  for (const auto& s : st.stages)
    summary(out, "splitflow_stage_latency_seconds",
            fmt::format("graph=\"{}\",stage=\"{}\"", g, label(s.name)), s.latency);
  head(out, "splitflow_stage_queue_items", "gauge",
       "Items queued at a stage's input, mean over the run.");
  for (const auto& s : st.stages)
    out += fmt::format("splitflow_stage_queue_items{{graph=\"{}\",stage=\"{}\"}} {:.3f}\n", g,
                       label(s.name), s.mean_queue);
  head(out, "splitflow_gpu_seconds_total", "counter",
       "GPU time a graph held (leased) and used (busy).");
  out += fmt::format("splitflow_gpu_seconds_total{{graph=\"{}\",kind=\"held\"}} {:.9f}\n", g,
                     st.gpu.held_ns / 1e9);
  out += fmt::format("splitflow_gpu_seconds_total{{graph=\"{}\",kind=\"busy\"}} {:.9f}\n", g,
                     st.gpu.busy_ns / 1e9);
  head(out, "splitflow_gpu_copy_bytes_total", "counter", "Bytes copied between host and device.");
  out += fmt::format("splitflow_gpu_copy_bytes_total{{graph=\"{}\",direction=\"h2d\"}} {}\n", g,
                     st.gpu.h2d_bytes);
  out += fmt::format("splitflow_gpu_copy_bytes_total{{graph=\"{}\",direction=\"d2h\"}} {}\n", g,
                     st.gpu.d2h_bytes);
  if (device) {
    const std::string dev = label(device->name);
    head(out, "splitflow_device_busy_ratio", "gauge",
         "Fraction of wall time the device executed work.");
    out += fmt::format("splitflow_device_busy_ratio{{device=\"{}\"}} {:.6f}\n", dev,
                       device->busy_fraction());
    head(out, "splitflow_device_leases", "gauge", "Streams leased now.");
    out += fmt::format("splitflow_device_leases{{device=\"{}\"}} {}\n", dev, device->leases_in_use);
    head(out, "splitflow_device_bytes", "gauge", "Bytes in use in the device and pinned pools.");
    out += fmt::format("splitflow_device_bytes{{device=\"{}\",pool=\"device\"}} {}\n", dev,
                       device->device_bytes_in_use);
    out += fmt::format("splitflow_device_bytes{{device=\"{}\",pool=\"pinned\"}} {}\n", dev,
                       device->pinned_bytes_in_use);
  }
  return out;
}

namespace {

// A service's latency split, in the order its parts add up (the total last).
std::vector<std::pair<const char*, const LatencyHistogram*>> latency_parts(const ServiceStats& s) {
  return {{"queueing", &s.queueing},
          {"batching", &s.batching},
          {"gpu", &s.gpu},
          {"other", &s.other},
          {"total", &s.latency}};
}

}  // namespace

std::string to_json(const ServiceStats& s) {
  Json j;
  j["schema_version"] = kJsonSchemaVersion;
  j["graph"] = s.graph;
  j["service"] = s.service;
  j["submitted"] = std::uint64_t{s.submitted};
  j["answered"] = std::uint64_t{s.answered};
  j["failed"] = std::uint64_t{s.failed};
  j["expired"] = std::uint64_t{s.expired};
  j["rejected"] = std::uint64_t{s.rejected};
  j["pending"] = std::uint64_t{s.pending};
  Json& latency = j["latency_ns"];
  for (auto [part, h] : latency_parts(s)) latency[part] = latency_json(*h);
  return dump(j);
}

std::string prometheus_text(const ServiceStats& s) {
  std::string out;
  const std::string labels =
      fmt::format("graph=\"{}\",service=\"{}\"", label(s.graph), label(s.service));
  head(out, "splitflow_service_requests_total", "counter", "Requests by outcome.");
  for (auto [outcome, n] : {std::pair{"submitted", s.submitted}, std::pair{"answered", s.answered},
                            std::pair{"failed", s.failed}, std::pair{"expired", s.expired},
                            std::pair{"rejected", s.rejected}})
    out += fmt::format("splitflow_service_requests_total{{{},outcome=\"{}\"}} {}\n", labels,
                       outcome, n);
  head(out, "splitflow_service_pending_requests", "gauge",
       "Requests admitted and not yet answered.");
  out += fmt::format("splitflow_service_pending_requests{{{}}} {}\n", labels, s.pending);
  head(out, "splitflow_service_latency_seconds", "summary", "Where answered requests' time went.");
  for (auto [part, h] : latency_parts(s))
    summary(out, "splitflow_service_latency_seconds", fmt::format("{},part=\"{}\"", labels, part),
            *h);
  return out;
}

}  // namespace splitflow
