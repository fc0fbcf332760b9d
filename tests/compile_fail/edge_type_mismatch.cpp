// Must not compile: a stage producing std::string connected to a sink taking int.
#include <splitflow/splitflow.hpp>

#include <string>

void build(splitflow::Runtime& rt) {
  splitflow::Graph g(rt, "bad");
  auto src = g.source("n", []() -> std::optional<int> { return std::nullopt; });
  auto text = g.stage("text", [](int x) { return std::to_string(x); });
  auto sum = g.sink("sum", [](int) {});
  src >> text;
  text >> sum;  // std::string -> int
}
