// Must not compile: a source of a 1 MiB struct by value (items travel through claims on the
// worker threads' stacks, a few copies at once: it overflowed one at -O1, a new user's trial).
#include <splitflow/splitflow.hpp>

#include <array>

struct Frame {
  std::array<char, 1 << 20> pixels;
};

void build(splitflow::Runtime& rt) {
  splitflow::Graph g(rt, "bad");
  auto src = g.source("frames", []() -> std::optional<Frame> { return std::nullopt; });
  auto sink = g.sink("sink", [](const Frame&) {});
  src >> sink;
}
