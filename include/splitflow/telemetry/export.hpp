// Telemetry exporters: a text report with a diagnosis, JSON, Prometheus text.
//
//     auto run = g.run();
//     run.wait();
//     std::puts(splitflow::report(run.stats(), rt.device_stats()).c_str());  // with a diagnosis
//     std::ofstream("run.json") << splitflow::to_json(run.stats(), rt.device_stats());
//     std::ofstream("trace.json") << run.trace_json();   // GraphOptions::trace = true
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "splitflow/telemetry/stats.hpp"

namespace splitflow {

/// What the figures say: where the GPU waited, who blocks whom, and what to change.
struct Diagnosis {
  /// The stage that limits the run's throughput ("" if none stands out).
  std::string bottleneck;
  /// Plain sentences: findings first, then suggestions computed from the figures.
  std::vector<std::string> findings;
  std::vector<std::string> suggestions;
};

Diagnosis diagnose(const RunStats& stats, const std::optional<DeviceStats>& device = {});

/// A text report: the run, its stages (with latency percentiles), its GPU figures, the device,
/// and the diagnosis.
std::string report(const RunStats& stats, const std::optional<DeviceStats>& device = {});

/// The version of the JSON summaries' layout ("schema_version" in to_json's output): raised
/// when a key changes meaning or goes; new keys may appear within a version.
inline constexpr int kJsonSchemaVersion = 1;

/// The same figures as JSON (keys documented in docs/telemetry.md; stable across versions).
std::string to_json(const RunStats& stats, const std::optional<DeviceStats>& device = {});

/// The counters in Prometheus text exposition format (serving it is the caller's choice).
std::string prometheus_text(const RunStats& stats, const std::optional<DeviceStats>& device = {});

/// A service's figures as JSON, each histogram as {count, mean, p50, p95, p99, max} in
/// nanoseconds (docs/telemetry.md).
std::string to_json(const ServiceStats& stats);
/// A service's figures in Prometheus text: request counters and the latency split as
/// summaries, labelled with the graph and the service.
std::string prometheus_text(const ServiceStats& stats);

}  // namespace splitflow
