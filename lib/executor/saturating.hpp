// Saturating size arithmetic for the tuner and the runtime's use of it: a sum or product that
// would pass autotune::kUnlimited is kUnlimited (an unlimited capacity stays unlimited).
#pragma once

#include <cstddef>

#include "splitflow/executor/autotune.hpp"

namespace splitflow::autotune {

inline std::size_t sat_add(std::size_t a, std::size_t b) noexcept {
  return a > kUnlimited - b ? kUnlimited : a + b;
}

inline std::size_t sat_mul(std::size_t a, std::size_t b) noexcept {
  return (b != 0 && a > kUnlimited / b) ? kUnlimited : a * b;
}

}  // namespace splitflow::autotune
