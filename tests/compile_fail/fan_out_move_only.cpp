// Must not compile: fan-out copies items, and std::unique_ptr cannot be copied.
#include <splitflow/splitflow.hpp>

#include <memory>

void build(splitflow::Runtime& rt) {
  splitflow::Graph g(rt, "bad");
  auto src = g.source("n", []() -> std::optional<std::unique_ptr<int>> { return std::nullopt; });
  auto a = g.sink("a", [](std::unique_ptr<int>) {});
  auto b = g.sink("b", [](std::unique_ptr<int>) {});
  splitflow::fan_out(src, a, b);
}
