#include "splitflow/core/config.hpp"

namespace splitflow {

const char* to_string(BackendKind k) noexcept {
  switch (k) {
    case BackendKind::automatic: return "automatic";
    case BackendKind::cuda: return "cuda";
    case BackendKind::host: return "host";
  }
  return "?";
}

}  // namespace splitflow
