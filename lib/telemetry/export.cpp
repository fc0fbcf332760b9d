// JSON summary and Prometheus text. Keys and metric names are documented in docs/telemetry.md.
#include <fmt/format.h>

#include "splitflow/telemetry/export.hpp"
#include "splitflow/telemetry/stats.hpp"
#include "splitflow/telemetry/telemetry.hpp"

namespace splitflow {

namespace {

std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string strings(const std::vector<std::string>& v) {
  std::string out = "[";
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i) out += ',';
    out += quoted(v[i]);
  }
  out += ']';
  return out;
}

std::string latency_json(const LatencyHistogram& h) {
  return fmt::format(R"({{"count":{},"mean":{:.1f},"p50":{},"p95":{},"p99":{},"max":{}}})",
                     h.count(), h.mean(), h.percentile(50), h.percentile(95), h.percentile(99),
                     h.max());
}

std::string concurrency(std::size_t c) {
  return c == Concurrency::unlimited ? "null" : std::to_string(c);
}

// Prometheus label values escape backslash, quote and newline.
std::string label(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

}  // namespace

std::string to_json(const RunStats& st, const std::optional<DeviceStats>& device) {
  std::string out = "{";
  out += fmt::format(
      R"("schema_version":{},"graph":{},"status":"{}","wall_ns":{},"items_delivered":{},"throughput":{:.3f},)",
      kJsonSchemaVersion, quoted(st.graph), to_string(st.status), st.wall_ns, st.items_delivered(),
      st.throughput());
  out += "\"stages\":[";
  for (std::size_t i = 0; i < st.stages.size(); ++i) {
    const StageStats& s = st.stages[i];
    out += i ? ",\n" : "\n";
    out += fmt::format(
        R"({{"name":{},"kind":"{}","concurrency_limit":{},"capacity":{},"items_in":{},"items_out":{},)"
        R"("invocations":{},"busy_ns":{},"starved_ns":{},"blocked_ns":{},"work_ns":{},)"
        R"("mean_concurrency":{:.3f},"max_concurrency":{},"max_queue":{},"mean_queue":{:.3f},)"
        R"("latency_ns":{},"consumers":{})",
        quoted(s.name), to_string(s.kind), concurrency(s.concurrency_limit), s.capacity, s.items_in,
        s.items_out, s.invocations, s.busy_ns, s.starved_ns, s.blocked_ns, s.work_ns,
        s.mean_concurrency(), s.max_concurrency, s.max_queue, s.mean_queue, latency_json(s.latency),
        strings(s.consumers));
    if (s.ring_capacity > 0)
      out += fmt::format(
          R"(,"ring":{{"capacity":{},"in_use":{},"max_in_use":{},"mean_in_use":{:.1f},"budgets":{},"wraps":{},"refusals":{},"wait_ns":{}}})",
          s.ring_capacity, s.ring_in_use, s.ring_max_in_use, s.ring_mean_in_use, s.ring_budgets,
          s.ring_wraps, s.ring_refusals, s.ring_wait_ns);
    if (s.items_skipped + s.items_substituted > 0) {
      out += fmt::format(R"(,"skipped":{},"substituted":{},"errors":[)", s.items_skipped,
                         s.items_substituted);
      for (std::size_t e = 0; e < s.errors.size(); ++e)
        out += fmt::format(R"({}{{"item":{},"message":{}}})", e ? "," : "", s.errors[e].item,
                           quoted(s.errors[e].message));
      out += "]";
    }
    out += "}";
  }
  out += "\n],";
  const GpuStats& g = st.gpu;
  out += fmt::format(
      R"("gpu":{{"held_ns":{},"busy_ns":{},"held_over_busy":{:.4f},"bursts":{},"lease_wait_ns":{},)"
      R"("max_lease_wait_ns":{},"h2d_bytes":{},"h2d_ns":{},"d2h_bytes":{},"d2h_ns":{},"staging_copies":{},)"
      R"("device_wall_ns":{},"device_busy_ns":{},"device_mean_leases":{:.3f},"device_max_leases":{},)"
      R"("device_streams":{}}},)",
      g.held_ns, g.busy_ns, g.held_over_busy(), g.bursts, g.lease_wait_ns, g.max_lease_wait_ns,
      g.h2d_bytes, g.h2d_ns, g.d2h_bytes, g.d2h_ns, g.staging_copies, g.device_wall_ns,
      g.device_busy_ns, g.device_mean_leases, g.device_max_leases, g.device_streams);
  if (device) {
    std::string lease_time = "[";
    for (std::size_t k = 0; k < device->lease_time_ns.size(); ++k) {
      if (k) lease_time += ',';
      lease_time += std::to_string(device->lease_time_ns[k]);
    }
    lease_time += ']';
    out += fmt::format(
        R"("device":{{"name":{},"backend":"{}","wall_ns":{},"busy_ns":{},"busy_fraction":{:.4f},"held_ns":{},)"
        R"("held_over_busy":{:.4f},"streams":{},"leases_in_use":{},"max_leases_in_use":{},"mean_leases":{:.3f},)"
        R"("lease_time_ns":{},"leases":{},"lease_waiters":{},"device_bytes_in_use":{},"device_bytes_cap":{},)"
        R"("pinned_bytes_in_use":{},"pinned_bytes_cap":{}}},)",
        quoted(device->name), to_string(device->backend), device->wall_ns, device->busy_ns,
        device->busy_fraction(), device->held_ns, device->held_over_busy(), device->streams,
        device->leases_in_use, device->max_leases_in_use, device->mean_leases(), lease_time,
        device->leases, device->lease_waiters, device->device_bytes_in_use,
        device->device_bytes_cap, device->pinned_bytes_in_use, device->pinned_bytes_cap);
  } else {
    out += "\"device\":null,";
  }
  const Diagnosis d = diagnose(st, device);
  out += fmt::format(R"("diagnosis":{{"bottleneck":{},"findings":{},"suggestions":{}}}}})",
                     quoted(d.bottleneck), strings(d.findings), strings(d.suggestions));
  out += "\n";
  return out;
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
  std::string out = fmt::format(
      R"({{"schema_version":{},"graph":{},"service":{},"submitted":{},"answered":{},"failed":{},"expired":{},)"
      R"("rejected":{},"pending":{},"latency_ns":{{)",
      kJsonSchemaVersion, quoted(s.graph), quoted(s.service), s.submitted, s.answered, s.failed, s.expired, s.rejected,
      s.pending);
  const auto parts = latency_parts(s);
  for (std::size_t i = 0; i < parts.size(); ++i)
    out +=
        fmt::format(R"({}"{}":{})", i ? "," : "", parts[i].first, latency_json(*parts[i].second));
  return out + "}}";
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
