#include "splitflow/core/error.hpp"

#include <fmt/format.h>

namespace splitflow {

StageError::StageError(std::string graph, std::string stage, std::uint64_t item,
                       std::string message)
    : Error(fmt::format("splitflow: graph '{}': stage '{}' failed on item {}: {}", graph, stage,
                        item, message)),
      graph_(std::move(graph)),
      stage_(std::move(stage)),
      item_(item),
      message_(std::move(message)) {}

bool is_stop_request(const std::exception_ptr& error) noexcept {
  if (!error) return false;
  try {
    std::rethrow_exception(error);
  } catch (const StopRequest&) {
    return true;
  } catch (...) {
  }
  return false;
}

}  // namespace splitflow
