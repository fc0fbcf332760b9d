// Tracer: an Observer that records a run as a Chrome trace (trace event format). Internal.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "splitflow/telemetry/telemetry.hpp"

namespace splitflow::detail {

class Tracer final : public Observer {
 public:
  /// `stages`: the graph's stage names, in order (one track each).
  Tracer(std::string graph, std::vector<std::string> stages, std::size_t max_events,
         std::int64_t origin_ns);

  void on_stage_begin(const InvocationEvent& e) override;
  void on_stage_end(const InvocationEvent& e) override;
  void on_lease_acquire(const LeaseEvent& e) override;
  void on_lease_release(const LeaseEvent& e) override;
  void on_device_op(const DeviceOpEvent& e) override;
  /// An instant event "tune" on the stage's track (the graph's first track for a graph-level
  /// decision), at most kMaxTunes of them (the rest are counted).
  void on_tune(const TuningEvent& e) override;

  /// The trace so far, as JSON (loads in chrome://tracing and ui.perfetto.dev).
  std::string json() const;

 private:
  enum class Track : std::uint8_t { stage, lease, device, queue_counter, ring_counter };
  struct Event {
    Track track;
    int tid;
    std::int64_t ts_ns, dur_ns;
    std::uint64_t a, b;   // stage: first item, items; device: item, bytes; counters: value
    std::uint8_t kind;    // device: kernel / h2d / d2h
  };
  void add_locked(const Event& e);
  int stage_index(const std::string& name) const;

  std::string graph_;
  std::vector<std::string> stages_;
  std::unordered_map<std::string, int> index_;
  std::size_t max_events_;
  std::int64_t origin_ns_;
  mutable std::mutex mu_;
  std::vector<Event> events_;
  std::uint64_t stride_ = 1, dropped_ = 0;
  std::uint64_t seen_[5] = {0, 0, 0, 0, 0};  // per track kind: sampling must not alias
  std::unordered_map<int, std::int64_t> lease_open_;  // stream -> acquire time
  struct Tune {
    int tid;
    std::int64_t ts_ns;
    std::string knob, reason, text;
    std::size_t from, to;
  };
  static constexpr std::size_t kMaxTunes = 1024;
  std::vector<Tune> tunes_;  // not sampled: a few per second at most
  std::uint64_t tunes_dropped_ = 0;
};

}  // namespace splitflow::detail
