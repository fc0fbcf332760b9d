#include "splitflow/telemetry/stats.hpp"

#include <fmt/format.h>

#include "splitflow/core/config.hpp"

namespace splitflow {

const char* to_string(RunStatus s) noexcept {
  switch (s) {
    case RunStatus::running: return "running";
    case RunStatus::succeeded: return "succeeded";
    case RunStatus::failed: return "failed";
    case RunStatus::cancelled: return "cancelled";
  }
  return "?";
}

const char* to_string(StageKind k) noexcept {
  switch (k) {
    case StageKind::source: return "source";
    case StageKind::stage: return "stage";
    case StageKind::sink: return "sink";
    case StageKind::pull_sink: return "pull_sink";
    case StageKind::zip: return "zip";
    case StageKind::gpu_stage: return "gpu_stage";
  }
  return "?";
}

const StageStats* RunStats::find(std::string_view name) const& noexcept {
  for (const auto& s : stages)
    if (s.name == name) return &s;
  return nullptr;
}

std::optional<StageStats> RunStats::find(std::string_view name) && {
  for (StageStats& s : stages)
    if (s.name == name) return std::move(s);
  return std::nullopt;
}

std::optional<StageStats> RunStats::find(std::string_view name) const&& {
  if (const StageStats* s = static_cast<const RunStats&>(*this).find(name)) return *s;
  return std::nullopt;
}

namespace {
std::string pct(std::int64_t part, std::int64_t whole) {
  return whole > 0 ? fmt::format("{:.1f}%", 100.0 * static_cast<double>(part) / whole) : "-";
}
std::string conc(std::size_t c) {
  return c == Concurrency::unlimited ? std::string("inf") : fmt::format("{}", c);
}
}  // namespace

std::string format_table(const RunStats& st) {
  std::string out = fmt::format("graph '{}' {}  wall {:.3f} ms\n", st.graph, to_string(st.status),
                                static_cast<double>(st.wall_ns) / 1e6);
  out += fmt::format("{:<18} {:<9} {:>5} {:>10} {:>10} {:>9} {:>7} {:>8} {:>8} {:>9} {:>6} {:>7}\n",
                     "stage", "kind", "conc", "in", "out", "items/inv", "busy", "starved",
                     "blocked", "work ms", "max c", "max q");
  for (const auto& s : st.stages) {
    out += fmt::format(
        "{:<18} {:<9} {:>5} {:>10} {:>10} {:>9} {:>7} {:>8} {:>8} {:>9.2f} {:>6} {:>7}\n", s.name,
        to_string(s.kind), conc(s.concurrency_limit), s.items_in, s.items_out,
        s.invocations ? fmt::format("{:.1f}", static_cast<double>(s.items_out) / s.invocations)
                      : std::string("-"),
        pct(s.busy_ns, st.wall_ns), pct(s.starved_ns, st.wall_ns), pct(s.blocked_ns, st.wall_ns),
        static_cast<double>(s.work_ns) / 1e6, s.max_concurrency, s.max_queue);
  }
  return out;
}

}  // namespace splitflow
