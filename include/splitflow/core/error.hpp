// Exceptions thrown by splitflow. Messages name the graph, the stage and the item.
#pragma once

#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>

namespace splitflow {

/// Base of everything splitflow throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The graph is malformed or used wrongly (bad edge, cycle, run while running, ...).
class GraphError : public Error {
 public:
  using Error::Error;
};

/// A stage body (or a source's generator) threw. Thrown by `Run::wait()` and by pull sinks.
/// The original exception is nested: `std::rethrow_if_nested(e)` rethrows it.
class StageError : public Error {
 public:
  StageError(std::string graph, std::string stage, std::uint64_t item, std::string message);

  const std::string& graph() const noexcept { return graph_; }
  const std::string& stage() const noexcept { return stage_; }
  /// Sequence number of the failing item: its index at the source that produced it
  /// (for a zip, the index of the pair).
  std::uint64_t item() const noexcept { return item_; }
  /// The original exception's message.
  const std::string& message() const noexcept { return message_; }

 private:
  std::string graph_;
  std::string stage_;
  std::uint64_t item_;
  std::string message_;
};

/// Thrown by a body to end its run whatever its stage's `on_error` says: a request to stop, not
/// an error of its item, so a skip or a substitute policy does not absorb it (nor counts it).
/// The run fails with a StageError naming the stage and the item, this nested. The Python module
/// throws one for a `KeyboardInterrupt` or `SystemExit` raised in a body, which reaches the
/// caller as itself.
///
///     g.stage<int>("check", [](int x) {
///       if (shutdown_requested()) throw splitflow::StopRequest("shutting down");
///       return x;
///     }, {.on_error = splitflow::OnError::skip});
class StopRequest : public Error {
 public:
  using Error::Error;
};

/// Whether `error` is a StopRequest (or a type derived from it).
bool is_stop_request(const std::exception_ptr& error) noexcept;

/// The run was cancelled before a pull sink's stream ended, by something other than that
/// sink's reader (`Run::cancel()` from another thread, another pull sink's reader closing the
/// run, the runtime's end): thrown by the sink's next() once it has given what it holds, so
/// that a loop over it cannot take a cut stream for a whole one. A reader that stops early
/// itself (close(), leaving its loop) is not told: it knows.
class CancelledError : public Error {
 public:
  using Error::Error;
};

/// A service's admission is full (ServiceOptions::max_pending requests pending) and its
/// admission is Admission::fail_fast: Service::submit() throws it.
class OverloadedError : public Error {
 public:
  using Error::Error;
};

/// A request's deadline passed before a GPU stage (or a dynamic batch) took it; it was dropped
/// unprocessed. Its future holds this error.
class DeadlineError : public Error {
 public:
  using Error::Error;
};
/// The name DeadlineError had before the errors shared one naming scheme.
using DeadlineExceeded = DeadlineError;

}  // namespace splitflow
