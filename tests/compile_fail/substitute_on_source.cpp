// A source has no body whose error an item could replace: substitute_on_error does not compile.
#include <optional>
#include <splitflow/splitflow.hpp>

void f(splitflow::Graph& g) {
  auto src = g.source("n", []() -> std::optional<int> { return std::nullopt; });
  src.substitute_on_error(0);
}
