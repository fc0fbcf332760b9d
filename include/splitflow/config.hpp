// Policies for runtimes, graphs and stages, in one place (the DALI way: small enums, one Config).
#pragma once

#include <cstddef>
#include <limits>

namespace splitflow {

/// How many invocations of one stage may run at the same time.
struct Concurrency {
  static constexpr std::size_t serial = 1;
  static constexpr std::size_t unlimited = std::numeric_limits<std::size_t>::max();
};

/// Whether a stage's outputs leave it in the order its inputs arrived.
enum class Order {
  in_order,      ///< output order equals input order, even with concurrency > 1
  out_of_order,  ///< outputs leave as invocations finish (no reorder buffer)
};

/// Per-stage policy. `capacity` bounds the stage's input queue in items, counting items queued
/// and slots reserved by producers whose bodies are still running; 0 means the graph's default.
struct StageOptions {
  std::size_t concurrency = Concurrency::serial;
  Order order = Order::in_order;
  std::size_t capacity = 0;
};

/// Per-graph policy.
struct GraphOptions {
  /// Items admitted by the sources and not yet consumed by a sink (like oneTBB's
  /// max_number_of_live_tokens). A fan-out copy counts as one more item.
  std::size_t max_in_flight = 256;
  /// Input queue capacity of stages that do not set their own.
  std::size_t default_capacity = 32;
};

/// Per-runtime policy.
struct RuntimeConfig {
  /// Threads of the runtime's task arena; 0 means one per core.
  int threads = 0;
  /// Per-stage timing (busy / starved / blocked, work time). Item counters are always kept.
  bool telemetry = true;
};

}  // namespace splitflow
